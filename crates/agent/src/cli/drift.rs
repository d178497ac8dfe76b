//! `inplace-agent drift`: whether the node still matches the last plan that succeeded on it,
//! as the agent last checked: the local agent's status socket (its journal when no agent
//! answers), or a remote agent's `GetDrift` with `--addr`. Each drifted change is listed with
//! what differs. Exit 0 when the node matches, 1 when it has drifted or the agent cannot be
//! asked.
//!
//! `inplace-agent repair`: re-applies the last succeeded plan on an agent (`RepairPlan`, over
//! mutual TLS with an admin certificate), as a new attempt of it.

use clap::Args;

use super::Exit;
use super::remote::{self, AgentChoice, RemoteOutput, TlsArgs};
use inplace_api::pb;

/// Arguments of `drift`.
#[derive(Debug, Args, Clone)]
pub struct DriftArgs {
    #[command(flatten)]
    pub agent: AgentChoice,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = RemoteOutput::Text)]
    pub output: RemoteOutput,
}

/// Arguments of `repair`.
#[derive(Debug, Args, Clone)]
pub struct RepairArgs {
    /// The agent
    #[arg(long, env = "INPLACE_AGENT_ADDR", value_name = "HOST:PORT")]
    pub addr: String,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    /// Repair only if the last succeeded plan has this id
    #[arg(long, value_name = "ID")]
    pub id: Option<String>,
    /// Follow the repair until it ends
    #[arg(long)]
    pub wait: bool,
    /// Never draw a progress bar, print a line per step
    #[arg(long)]
    pub no_progress: bool,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = RemoteOutput::Text)]
    pub output: RemoteOutput,
}

/// Runs `drift`.
pub fn drift(args: &DriftArgs) -> Exit {
    match &args.agent.addr {
        None => local_drift(args),
        Some(addr) => remote_drift(args, addr),
    }
}

/// The drift section of the local agent's status (or of its journal when no agent answers).
fn local_drift(args: &DriftArgs) -> Exit {
    let status = match super::status::local_status(&args.agent) {
        Ok(s) => s,
        Err(exit) => return exit,
    };
    match args.output {
        RemoteOutput::Json => outln!(
            "{:#}",
            serde_json::to_value(&status.drift).unwrap_or_default()
        ),
        _ => match &status.drift {
            Some(d) => outln!("{}", super::status::render_drift(d).join("\n")),
            None => outln!("drift: no plan has succeeded on this node; nothing to drift from"),
        },
    }
    if status.drift.is_some_and(|d| d.drifted) {
        Exit::Failed
    } else {
        Exit::Ok
    }
}

fn remote_drift(args: &DriftArgs, addr: &str) -> Exit {
    let runtime = match remote::runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let mut client = match remote::connect_agent(addr, &args.agent.tls).await {
            Ok(c) => c,
            Err(e) => return super::fail(&e),
        };
        let d = match client.get_drift(remote::call(pb::GetDriftRequest {})).await {
            Ok(r) => r.into_inner(),
            Err(status) => return remote::refused("get drift", addr, &args.agent.tls, &status),
        };
        match args.output {
            RemoteOutput::Json => outln!("{:#}", drift_json(&d)),
            _ => outln!("{}", render(&d)),
        }
        if d.drifted { Exit::Failed } else { Exit::Ok }
    })
}

fn drift_json(d: &pb::DriftStatus) -> serde_json::Value {
    serde_json::json!({
        "drifted": d.drifted,
        "baseline": d.has_baseline.then(|| serde_json::json!({
            "id": d.baseline_id,
            "digest": d.baseline_digest,
            "attempt": d.baseline_attempt,
            "run": d.baseline_run,
        })),
        "checkedAtMs": (d.checked_at_unix_ms > 0).then_some(d.checked_at_unix_ms),
        "problem": (!d.problem.is_empty()).then_some(&d.problem),
        "changes": d.changes.iter().map(|c| serde_json::json!({
            "index": c.index,
            "kind": c.kind,
            "target": c.target,
            "detail": c.detail,
            "differences": c.differences.iter().map(|f| serde_json::json!({
                "field": f.field, "expected": f.expected, "found": f.found,
            })).collect::<Vec<_>>(),
            "firstSeenMs": c.first_seen_unix_ms,
        })).collect::<Vec<_>>(),
    })
}

/// A remote agent's drift for a person, as `status` shows a local one.
fn render(d: &pb::DriftStatus) -> String {
    if !d.has_baseline {
        return "drift: no plan has succeeded on this node; nothing to drift from".into();
    }
    let view = super::status::DriftView {
        drifted: d.drifted,
        baseline: Some((d.baseline_id.clone(), d.baseline_attempt, d.baseline_run)),
        checked_at_ms: (d.checked_at_unix_ms > 0).then_some(d.checked_at_unix_ms),
        problem: (!d.problem.is_empty()).then(|| d.problem.clone()),
        changes: d
            .changes
            .iter()
            .map(|c| super::status::DriftLine {
                index: c.index,
                kind: c.kind.clone(),
                target: c.target.clone(),
                detail: c.detail.clone(),
                differences: c
                    .differences
                    .iter()
                    .map(|f| (f.field.clone(), f.expected.clone(), f.found.clone()))
                    .collect(),
                first_seen_ms: c.first_seen_unix_ms,
            })
            .collect(),
    };
    view.lines().join("\n")
}

/// Runs `repair`.
pub fn repair(args: &RepairArgs) -> Exit {
    let runtime = match remote::runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let mut client = match remote::connect_agent(&args.addr, &args.tls).await {
            Ok(c) => c,
            Err(e) => return super::fail(&e),
        };
        let request = pb::RepairPlanRequest {
            id: args.id.clone().unwrap_or_default(),
        };
        let status = match client.repair_plan(remote::call(request)).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                return remote::refused("repair", &args.addr, &args.tls, &status);
            }
        };
        remote::conclude(
            &mut client,
            status,
            args.wait.then_some(remote::FOREVER),
            args.no_progress,
            args.output,
            false,
        )
        .await
    })
}
