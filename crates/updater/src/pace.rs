//! When Cluster API should ask again about a plan that is running, and when a call waits for
//! the plan's end instead: a Machine is reported done within about a second of its node
//! finishing, whatever the plan's length, with at most about one call a second.
//!
//! Cluster API calls `UpdateMachine` again `retryAfterSeconds` after an in-progress answer
//! (`RequeueAfter` in `internal/controllers/machine/machine_controller_inplace_update.go` of
//! Cluster API) and gives a call 10 s (`DefaultHandlersTimeoutSeconds`; the discovery
//! response's `timeoutSeconds`). A plan that ends between two calls is reported done at the
//! next one, so the wait after the end is at most the retry. Estimates cannot space the
//! calls: they are wrong both ways (a package or `kubeadm upgrade node` step may have
//! nothing to do; issue 45 measured a Machine done after 13.8 s whose plan ran 3.09 s,
//! answered "10 s" by the estimate), so an estimate-paced retry costs up to the whole retry
//! whenever the node is faster than its estimate. So
//! (docs/decisions/0018-done-when-the-node-is-done.md):
//!
//! - a call about a running plan [`Next::Hold`]s: it waits up to the hold window
//!   (`updateWaitSeconds`, 3 s) for the plan's terminal status, which the `WatchPlan` stream
//!   delivers the moment the agent journals it, and answers done then;
//! - a call that was not ended by the window answers in progress with
//!   [`MIN_RETRY_SECONDS`] (1 s): the Machine is always either held or at most a second from
//!   its next call (about one call every 4 s);
//! - while the node reboots (the stream is down: nothing to hold on) the retry follows the
//!   estimate of the reboot ([`estimate`]: the change's expected time, scaled by what this
//!   node's finished changes took against theirs), then every [`REBOOT_POLL_SECONDS`].
//!
//! Holding ties up one of Cluster API's Machine workers for the window, so at most
//! [`super::progress::MAX_HOLDS`] calls hold at once; the others answer a 1 s retry.
//!
//! Pure: the plan's expected change times are computed once when it is translated
//! ([`costs`]), and each decision from the agent's phase and step and what the updater saw
//! of the plan so far ([`next`]).

use std::time::Duration;

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
        Some(
            Kind::KubeletConfig(_)
            | Kind::KubeletFlags(_)
            | Kind::Unit(_)
            | Kind::ApiServerCertificate(_),
        ) => 50,
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

/// The shortest `retryAfterSeconds` while the node reboots past its estimate: an agent away
/// costs each call a dial that fails, so it is not asked every second.
pub const REBOOT_POLL_SECONDS: i32 = 5;

/// Below this much expected time of finished changes the observed rate is not used (too
/// little to go by).
const RATE_BASIS_MS: u64 = 1_000;

/// Bounds of the observed rate, so that one odd change does not swing the estimate wildly.
const RATE_BOUNDS: (f64, f64) = (0.05, 20.0);

/// What the updater saw of a running attempt, besides where it is.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Seen {
    /// Milliseconds the agent took for the changes of this attempt it has finished.
    pub spent_ms: u64,
    /// What those same changes were expected to take ([`costs`]), in milliseconds.
    pub expected_ms: u64,
    /// How long the plan has been where it is (phase, step, rebooting), from when the
    /// updater first saw it there.
    pub here: Duration,
}

impl Seen {
    /// How much slower (above 1) or faster (below 1) this node runs than the estimates,
    /// from the changes it finished; 1 until there is enough to go by.
    pub fn rate(&self) -> f64 {
        if self.expected_ms < RATE_BASIS_MS {
            return 1.0;
        }
        (self.spent_ms as f64 / self.expected_ms as f64).clamp(RATE_BOUNDS.0, RATE_BOUNDS.1)
    }
}

/// How long the rest of a plan is expected to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// Milliseconds until the plan is expected to end (a lower bound when `past`).
    pub left_ms: u64,
    /// The plan has been where it is longer than expected: when that part ends is unknown.
    pub past: bool,
}

/// What is left of a plan at `at`, after what the updater `seen` of it.
pub fn estimate(costs: &[u32], at: Position, seen: Seen) -> Estimate {
    use pb::Phase;
    let rate = seen.rate();
    let scaled = |ms: u64| (ms as f64 * rate).round() as u64;
    let sum = |from: usize| -> u64 {
        costs
            .get(from.min(costs.len())..)
            .unwrap_or_default()
            .iter()
            .map(|c| u64::from(*c))
            .sum()
    };
    let after = u64::from(AFTER_CHANGES_MS);
    let here = u64::try_from(seen.here.as_millis()).unwrap_or(u64::MAX);
    // `part` is the expected time of where the plan is now, `then` what follows it.
    let (part, then) = if at.rebooting {
        let reboot = u64::from(expected_ms(&pb::Change {
            kind: Some(pb::change::Kind::Reboot(Default::default())),
        }));
        (reboot, after)
    } else {
        match Phase::try_from(at.phase).unwrap_or(Phase::Unspecified) {
            Phase::Applying => {
                // Steps are 1-based; the one in progress is `part`.
                let current = at
                    .step
                    .map_or(0, |(index, _)| index.saturating_sub(1) as usize);
                let part = costs.get(current).map_or(0, |c| scaled(u64::from(*c)));
                (part, scaled(sum(current + 1)) + after)
            }
            Phase::Restarting | Phase::Verifying | Phase::RollingBack => (after, 0),
            // Not started yet (pending, being submitted, preparing): all of it.
            _ => {
                return Estimate {
                    left_ms: scaled(sum(0)) + after,
                    past: false,
                };
            }
        }
    };
    Estimate {
        left_ms: part.saturating_sub(here) + then,
        past: here > part,
    }
}

/// What a call about a plan in progress does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Wait (within the call's hold window) for the plan's end: it is expected by then.
    Hold,
    /// Answer in progress with this `retryAfterSeconds`.
    Retry(i32),
}

/// What a call about a plan in progress at `at` does, with `hold` left of its hold window
/// and `agent_retry` the agent's own `retryAfterSeconds` (60 s while the node reboots):
/// hold while there is a window; without one, ask CAPI back in [`MIN_RETRY_SECONDS`]; while
/// the node reboots, when the reboot is expected to be over (at most `agent_retry`), past
/// that every [`REBOOT_POLL_SECONDS`].
pub fn next(costs: &[u32], at: Position, seen: Seen, hold: Duration, agent_retry: i32) -> Next {
    let cap = agent_retry.max(MIN_RETRY_SECONDS);
    if at.rebooting {
        // The stream is down while the node is away: nothing to hold on.
        let left = estimate(costs, at, seen);
        return Next::Retry(if left.past {
            REBOOT_POLL_SECONDS.min(cap)
        } else {
            i32::try_from(left.left_ms.div_ceil(1000))
                .unwrap_or(i32::MAX)
                .clamp(MIN_RETRY_SECONDS, cap)
        });
    }
    if hold.is_zero() {
        return Next::Retry(MIN_RETRY_SECONDS);
    }
    Next::Hold
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::change::Kind;

    const HOLD: Duration = Duration::from_secs(3);

    fn costs_of(kinds: &[Kind]) -> Vec<u32> {
        costs(&pb::Plan {
            changes: kinds
                .iter()
                .map(|k| pb::Change {
                    kind: Some(k.clone()),
                })
                .collect(),
            ..Default::default()
        })
    }

    fn at(phase: pb::Phase, step: Option<(u32, u32)>) -> Position {
        Position {
            phase: phase as i32,
            step,
            rebooting: false,
        }
    }

    fn here(seconds: f64) -> Seen {
        Seen {
            here: Duration::from_secs_f64(seconds),
            ..Default::default()
        }
    }

    #[test]
    fn a_running_plan_is_held_whatever_its_estimate_and_asked_back_in_a_second_after() {
        // A kubeadm upgrade estimated at 20 s may have nothing to do: the call holds rather
        // than answer "20 s" (the 13.8 s Machine of a 3.09 s plan).
        let costs = costs_of(&[
            Kind::Package(Default::default()),
            Kind::KubeadmUpgradeNode(Default::default()),
            Kind::Package(Default::default()),
        ]);
        for position in [
            at(pb::Phase::Unspecified, None),
            at(pb::Phase::Pending, None),
            at(pb::Phase::Applying, Some((2, 3))),
            at(pb::Phase::Restarting, None),
            at(pb::Phase::Verifying, None),
        ] {
            assert_eq!(
                next(&costs, position, here(0.0), HOLD, 10),
                Next::Hold,
                "{position:?}"
            );
            // The window is over: asked back in a second, never later.
            assert_eq!(
                next(&costs, position, here(40.0), Duration::ZERO, 10),
                Next::Retry(MIN_RETRY_SECONDS),
                "{position:?}"
            );
        }
    }

    #[test]
    fn what_is_left_follows_the_step_and_the_observed_rate() {
        let costs = costs_of(&[
            Kind::Package(Default::default()),
            Kind::KubeadmUpgradeNode(Default::default()),
            Kind::Package(Default::default()),
        ]);
        assert_eq!(
            estimate(&costs, at(pb::Phase::Pending, None), here(9.0)),
            Estimate {
                left_ms: 52_000,
                past: false
            }
        );
        let last = at(pb::Phase::Applying, Some((3, 3)));
        assert_eq!(estimate(&costs, last, here(12.0)).left_ms, 5_000);
        let past = estimate(&costs, last, here(20.0));
        assert!(past.past);
        assert_eq!(past.left_ms, 2_000);
        // The first package took 3 s of its 15: the rest at that rate.
        let fast = Seen {
            spent_ms: 3_000,
            expected_ms: 15_000,
            here: Duration::ZERO,
        };
        assert_eq!(
            estimate(&costs, at(pb::Phase::Applying, Some((2, 3))), fast).left_ms,
            4_000 + 3_000 + 2_000
        );
        // Too little finished to go by: the estimates as they are.
        let little = Seen {
            spent_ms: 5_000,
            expected_ms: 40,
            here: Duration::ZERO,
        };
        assert_eq!(little.rate(), 1.0);
        assert_eq!(
            Seen {
                spent_ms: 600_000,
                expected_ms: 15_000,
                here: Duration::ZERO
            }
            .rate(),
            RATE_BOUNDS.1
        );
        // A step index past the end (a newer agent counting differently) is not a panic.
        assert_eq!(
            estimate(&[20], at(pb::Phase::Applying, Some((9, 1))), here(0.0)).left_ms,
            2_000
        );
    }

    #[test]
    fn a_rebooting_node_is_asked_back_when_it_should_be_up_not_held() {
        let costs = costs_of(&[Kind::Reboot(Default::default())]);
        let rebooting = Position {
            rebooting: true,
            ..at(pb::Phase::Applying, Some((1, 1)))
        };
        assert_eq!(
            next(&costs, rebooting, here(0.0), HOLD, 60),
            Next::Retry(47)
        );
        assert_eq!(
            next(&costs, rebooting, here(44.5), HOLD, 60),
            Next::Retry(3)
        );
        assert_eq!(
            next(&costs, rebooting, here(90.0), HOLD, 60),
            Next::Retry(REBOOT_POLL_SECONDS)
        );
        // Never more than the agent asks, never below a second.
        assert_eq!(
            next(&costs, rebooting, here(0.0), HOLD, 10),
            Next::Retry(10)
        );
        assert_eq!(next(&costs, rebooting, here(90.0), HOLD, 0), Next::Retry(1));
    }
}
