//! When Cluster API should ask again about a plan that is running: `retryAfterSeconds`
//! follows what the plan still has to do.
//!
//! Cluster API caches an in-progress `UpdateMachine` answer and does not call again before
//! its `retryAfterSeconds` (`internal/controllers/machine/machine_controller_inplace_update.go`
//! of Cluster API), so a fixed 10 s made a Machine whose node finished in under a second wait
//! 10 s. The answer now asks CAPI back after about the time the rest of the plan is expected
//! to take: the changes from the current step on, by kind (a file write is milliseconds, a
//! package install or a reboot is not), then the restarts and the health gates. Never sooner
//! than 1 s, never later than the agent itself asks (10 s running, 60 s while the node
//! reboots), so a plan that runs longer than expected is looked at as often as before.
//!
//! Pure: the plan's expected step times are computed once when it is translated
//! ([`costs`]), and each answer from the agent's phase and step ([`retry_after`]).

use inplace_api::pb;

/// What a plan's remaining work is expected to take after its last change: restarting what
/// the changes fed and the health gates, in milliseconds.
const AFTER_CHANGES_MS: u32 = 2_000;

/// The shortest `retryAfterSeconds` of a plan in progress (0 means done to Cluster API).
pub const MIN_RETRY_SECONDS: i32 = 1;

/// The expected time of one change on a node, by its kind, in milliseconds: estimates for
/// pacing the calls, not limits (the agent's step timeout is the limit).
fn expected_ms(change: &pb::Change) -> u32 {
    use pb::change::Kind;
    match &change.kind {
        Some(Kind::File(_) | Kind::Absent(_) | Kind::Sysctl(_)) => 20,
        Some(Kind::KubeletConfig(_) | Kind::KubeletFlags(_) | Kind::Unit(_)) => 50,
        Some(Kind::Exec(_)) => 5_000,
        Some(Kind::Artifact(_)) => 10_000,
        Some(Kind::Package(_)) => 15_000,
        Some(Kind::KubeadmUpgradeNode(_)) => 20_000,
        Some(Kind::Reboot(_)) => 45_000,
        None => 20,
    }
}

/// The expected time of each change of `plan`, in plan order (milliseconds).
pub fn costs(plan: &pb::Plan) -> Vec<u32> {
    plan.changes.iter().map(expected_ms).collect()
}

/// Where a plan is, as the agent reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// `pb::Phase` as sent (`Unspecified` before the agent answered).
    pub phase: i32,
    /// The step in progress (1-based) and how many there are, when the agent said.
    pub step: Option<(u32, u32)>,
    /// The node is rebooting for the plan.
    pub rebooting: bool,
}

/// Milliseconds the rest of the plan is expected to take from `at`.
pub fn remaining_ms(costs: &[u32], at: Position) -> u64 {
    use pb::Phase;
    let all: u64 = costs.iter().map(|c| u64::from(*c)).sum();
    let after = u64::from(AFTER_CHANGES_MS);
    if at.rebooting {
        return u64::from(expected_ms(&pb::Change {
            kind: Some(pb::change::Kind::Reboot(Default::default())),
        })) + after;
    }
    match Phase::try_from(at.phase).unwrap_or(Phase::Unspecified) {
        Phase::Applying => {
            // Steps are 1-based; the one in progress still counts whole.
            let from = at
                .step
                .map_or(0, |(index, _)| index.saturating_sub(1) as usize);
            costs
                .get(from.min(costs.len())..)
                .unwrap_or_default()
                .iter()
                .map(|c| u64::from(*c))
                .sum::<u64>()
                + after
        }
        Phase::Restarting | Phase::Verifying | Phase::RollingBack => after,
        _ => all + after,
    }
}

/// `retryAfterSeconds` for a plan in progress at `at`: about what is left, at least
/// [`MIN_RETRY_SECONDS`], at most what the agent asked (`agent_retry`; what the answer was
/// before pacing).
pub fn retry_after(costs: &[u32], at: Position, agent_retry: i32) -> i32 {
    if agent_retry <= 0 {
        return agent_retry;
    }
    let seconds = remaining_ms(costs, at).div_ceil(1000);
    let seconds = i32::try_from(seconds).unwrap_or(i32::MAX);
    seconds.clamp(MIN_RETRY_SECONDS, agent_retry.max(MIN_RETRY_SECONDS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::change::Kind;

    fn plan(kinds: &[Kind]) -> pb::Plan {
        pb::Plan {
            changes: kinds
                .iter()
                .map(|k| pb::Change {
                    kind: Some(k.clone()),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn at(phase: pb::Phase, step: Option<(u32, u32)>) -> Position {
        Position {
            phase: phase as i32,
            step,
            rebooting: false,
        }
    }

    #[test]
    fn a_plan_of_files_is_asked_about_again_within_seconds() {
        let costs = costs(&plan(&[
            Kind::File(Default::default()),
            Kind::File(Default::default()),
            Kind::KubeletFlags(Default::default()),
        ]));
        // 90 ms of changes and 2 s of restarts and gates.
        for position in [
            at(pb::Phase::Unspecified, None),
            at(pb::Phase::Pending, None),
            at(pb::Phase::Applying, Some((2, 3))),
        ] {
            assert_eq!(retry_after(&costs, position, 10), 3, "{position:?}");
        }
        for position in [
            at(pb::Phase::Restarting, None),
            at(pb::Phase::Verifying, None),
        ] {
            assert_eq!(retry_after(&costs, position, 10), 2, "{position:?}");
        }
    }

    #[test]
    fn a_package_install_is_not_a_file_write_and_what_is_done_no_longer_counts() {
        let costs = costs(&plan(&[
            Kind::Package(Default::default()),
            Kind::KubeadmUpgradeNode(Default::default()),
            Kind::Package(Default::default()),
        ]));
        // Before it starts: capped at what the agent asks (10 s).
        assert_eq!(retry_after(&costs, at(pb::Phase::Pending, None), 10), 10);
        // At the last package: 15 s + 2 s left, still capped.
        assert_eq!(
            retry_after(&costs, at(pb::Phase::Applying, Some((3, 3))), 10),
            10
        );
        // With a longer cap (the agent asked for 60): the estimate itself.
        assert_eq!(
            retry_after(&costs, at(pb::Phase::Applying, Some((3, 3))), 60),
            17
        );
        assert_eq!(
            retry_after(&costs, at(pb::Phase::Applying, Some((1, 3))), 60),
            52
        );
    }

    #[test]
    fn never_below_a_second_never_above_the_agents_ask_and_done_stays_done() {
        let costs = costs(&plan(&[]));
        assert_eq!(retry_after(&costs, at(pb::Phase::Verifying, None), 10), 2);
        assert_eq!(
            retry_after(&[0], at(pb::Phase::Applying, Some((1, 1))), 1),
            1
        );
        assert_eq!(
            retry_after(&[0], at(pb::Phase::Applying, Some((1, 1))), 0),
            0
        );
        let rebooting = Position {
            rebooting: true,
            ..at(pb::Phase::Applying, Some((1, 1)))
        };
        assert_eq!(retry_after(&[45_000], rebooting, 60), 47);
        // A step index past the end (a newer agent counting differently) is not a panic.
        assert_eq!(
            retry_after(&[20], at(pb::Phase::Applying, Some((9, 1))), 10),
            2
        );
    }
}
