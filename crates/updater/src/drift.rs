//! Drift seen from the updater (docs/updater.md, "Drift"): a node whose agent says it no
//! longer matches the plan that succeeded on it is not up to date, whatever the Machine
//! says. `UpdateMachine` for that plan repairs the node (the agent's `RepairPlan`: a new
//! attempt of the plan, with its rollback and gates) instead of answering done, and
//! `CanUpdateMachine` says so in its message.

use super::agent::Agents;
use super::edge::agent_ca::Peer;
use super::progress::PlanRef;
use inplace_api::pb;

/// What the agent says about drift from `plan`: the drifted changes in a few words, when
/// its last succeeded plan is `plan` and the node no longer matches it.
fn drifted_from(d: &pb::DriftStatus, id: &str) -> Option<String> {
    if !d.drifted || d.baseline_id != id {
        return None;
    }
    let changes: Vec<String> = d
        .changes
        .iter()
        .take(3)
        .map(|c| match c.differences.first() {
            Some(f) => format!(
                "changes[{}] {} ({}: expected {}, found {})",
                c.index, c.kind, f.field, f.expected, f.found
            ),
            None => format!("changes[{}] {} {}", c.index, c.kind, c.target),
        })
        .collect();
    let more = d.changes.len().saturating_sub(3);
    Some(format!(
        "{} change(s) drifted: {}{}",
        d.changes.len(),
        changes.join("; "),
        if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        }
    ))
}

/// What a node's agent said about drift when asked (`Ok(None)`: an agent before the call;
/// `Err`: it could not be asked, why). Asked once per `UpdateMachine` call, for the drain's
/// decision and for the repair alike.
pub type Said = Result<Option<pb::DriftStatus>, String>;

/// Asks `plan`'s node about drift (`GetDrift`).
pub async fn ask(agents: &Agents, plan: &PlanRef) -> Said {
    agents.drift(&plan.peer).await.map_err(|e| e.to_string())
}

/// `status` of `plan` as the agent gave it; when the plan succeeded and the node has
/// drifted from it since, the status of the repair started instead. What the agent said
/// about drift earlier in the same call is `said` (asked now when `None`). An agent that
/// cannot say (older, unreachable) or refuses the repair leaves the status as it is (logged).
pub async fn repair_if_drifted(
    agents: &Agents,
    machine: &str,
    plan: &PlanRef,
    status: pb::PlanStatus,
    said: Option<Said>,
) -> pb::PlanStatus {
    if status.phase != pb::Phase::Succeeded as i32 || !plan.has_digest(&status.digest) {
        return status;
    }
    let said = match said {
        Some(said) => said,
        None => ask(agents, plan).await,
    };
    let drift = match said {
        Ok(Some(d)) => d,
        Ok(None) => return status,
        Err(e) => {
            tracing::warn!(%machine, node = %plan.peer.node(), plan = %plan.id, error = %e, "cannot ask for drift");
            return status;
        }
    };
    let Some(what) = drifted_from(&drift, &plan.id) else {
        return status;
    };
    match agents.repair(&plan.peer, &plan.id).await {
        Ok(next) if next.hook_response.is_some() => {
            tracing::warn!(%machine, node = %plan.peer.node(), plan = %plan.id, attempt = next.attempt, "node drifted from its plan ({what}): repairing");
            next
        }
        Ok(_) => status,
        Err(e) => {
            tracing::warn!(%machine, node = %plan.peer.node(), plan = %plan.id, error = %e, "node drifted from its plan ({what}) and cannot be repaired");
            status
        }
    }
}

/// Whether the agent `said` that `plan` is the last plan that succeeded on its node and the
/// node has drifted from it since (an agent that cannot say: no).
pub fn has_drifted_from(said: &Said, plan: &PlanRef) -> bool {
    matches!(said, Ok(Some(d)) if drifted_from(d, &plan.id).is_some())
}

/// `message` of `CanUpdateMachine`, with what the node's agent says about drift from the
/// last plan that succeeded on it, when the node has drifted.
pub async fn with_drift(agents: &Agents, peer: &Peer, message: String) -> String {
    let node = peer.node();
    let Ok(Some(d)) = agents.drift(peer).await else {
        return message;
    };
    let Some(what) = drifted_from(&d, &d.baseline_id) else {
        return message;
    };
    let note = format!(
        "node {node} has drifted from plan {} ({what}); an update repairs it",
        d.baseline_id
    );
    if message.is_empty() {
        note
    } else {
        format!("{message}; {note}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drift(id: &str, drifted: bool) -> pb::DriftStatus {
        pb::DriftStatus {
            drifted,
            has_baseline: true,
            baseline_id: id.into(),
            changes: vec![pb::DriftedChange {
                index: 1,
                kind: "kubeletConfig".into(),
                target: "/var/lib/kubelet/config.yaml".into(),
                detail: String::new(),
                differences: vec![pb::DriftDifference {
                    field: "maxPods".into(),
                    expected: "90".into(),
                    found: "250".into(),
                }],
                first_seen_unix_ms: 1,
            }]
            .into_iter()
            .filter(|_| drifted)
            .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_drift_from_this_plan_counts() {
        assert_eq!(
            drifted_from(&drift("p", true), "p").as_deref(),
            Some("1 change(s) drifted: changes[1] kubeletConfig (maxPods: expected 90, found 250)")
        );
        assert_eq!(drifted_from(&drift("p", true), "other"), None);
        assert_eq!(drifted_from(&drift("p", false), "p"), None);
    }
}
