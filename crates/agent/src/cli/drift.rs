//! `inplace-agent drift`: whether the node still matches the last plan that succeeded on it.
//! The answer comes from a check of the node, never from memory alone (decision 0016):
//!
//! - the local agent serving on its status socket: its last check;
//! - no agent serving there: a check made here, now — the daemon's own check
//!   (`engine::drift::look`, what its check process runs), read-only: nothing is journaled;
//! - `--addr`: a remote agent's `GetDrift`.
//!
//! Exit 0 the node matches (or no plan has succeeded: nothing to drift from), 1 it has
//! drifted, 2 the flags or configuration are invalid, 3 unknown: no check could be made
//! (the output says why and what to do). Each drifted change is listed with what differs.
//!
//! `inplace-agent repair`: re-applies the last succeeded plan as a new attempt of it: on
//! this node, as `apply` does (the node flags, the journal), or on a remote agent
//! (`RepairPlan`, over mutual TLS with an admin certificate) with `--addr`.

use std::path::Path;

use clap::Args;

use super::remote::{self, AgentChoice, RemoteOutput, TlsArgs};
use super::status::{DriftView, Local};
use super::{Exit, NodeArgs, Services};
use crate::engine::drift::{DriftedChange, look};
use crate::host::Host;
use crate::journal::backup::BackupStore;
use crate::status::api;
use inplace_api::pb;
use inplace_base::time::now_ms;

/// Arguments of `drift`.
#[derive(Debug, Args, Clone)]
pub struct DriftArgs {
    #[command(flatten)]
    pub agent: AgentChoice,
    /// How the node's units are managed, for a check made here (no agent serving): `off`
    /// for a plain directory tree [default: node.services of the agent's configuration,
    /// else systemd]
    #[arg(long, env = "INPLACE_AGENT_SERVICES", value_enum)]
    pub services: Option<Services>,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = RemoteOutput::Text)]
    pub output: RemoteOutput,
}

/// Arguments of `repair`.
#[derive(Debug, Args, Clone)]
pub struct RepairArgs {
    /// A remote agent to repair (over mutual TLS, admin certificate); without it, this
    /// node is repaired here, as `apply` does
    #[arg(long, env = "INPLACE_AGENT_ADDR", value_name = "HOST:PORT")]
    pub addr: Option<String>,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    #[command(flatten)]
    pub node: NodeArgs,
    /// Repair only if the last succeeded plan has this id
    #[arg(long, value_name = "ID")]
    pub id: Option<String>,
    /// With --addr: follow the repair until it ends (progress as `submit --wait`; exit by
    /// its outcome). A repair here always runs to its end
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

/// What `drift` answers: the drift section and how the command ends.
struct Answer {
    drift: Option<api::DriftStatus>,
    exit: Exit,
    /// What to do, for an unknown answer (printed after it).
    todo: Option<String>,
}

impl Answer {
    /// An answer from a check (or from an agent's last check).
    fn of(drift: api::DriftStatus) -> Answer {
        let exit = if drift.drifted {
            Exit::Failed
        } else if drift.problem.is_some() || drift.checked_at_ms.is_none() {
            Exit::Unknown
        } else {
            Exit::Ok
        };
        Answer {
            drift: Some(drift),
            exit,
            todo: None,
        }
    }

    /// No check could be made, for `why`; `baseline` when known.
    fn unknown(baseline: Option<api::DriftBaseline>, why: String, todo: &str) -> Answer {
        Answer {
            drift: Some(api::DriftStatus {
                drifted: false,
                baseline,
                checked_at_ms: None,
                problem: Some(why),
                changes: Vec::new(),
            }),
            exit: Exit::Unknown,
            todo: Some(todo.to_string()),
        }
    }

    fn print(&self, output: RemoteOutput) -> Exit {
        match output {
            RemoteOutput::Json => outln!(
                "{:#}",
                serde_json::to_value(&self.drift).unwrap_or_default()
            ),
            _ => match &self.drift {
                Some(d) => {
                    outln!("{}", super::status::render_drift(d).join("\n"));
                    if let Some(todo) = &self.todo {
                        outln!("  what to do: {todo}");
                    }
                }
                None => outln!("drift: no plan has succeeded on this node; nothing to drift from"),
            },
        }
        if let (Exit::Unknown, RemoteOutput::Json) = (self.exit, output)
            && let Some(todo) = &self.todo
        {
            errln!("drift unknown; what to do: {todo}");
        }
        self.exit
    }
}

/// The local agent's last check when it serves on its socket, else a check made here.
fn local_drift(args: &DriftArgs) -> Exit {
    let local = match Local::resolve(&args.agent) {
        Ok(l) => l,
        Err(e) => return super::fail(&e.into()),
    };
    let answer = match super::status::ask_agent(&local) {
        Ok(Some(status)) => from_agent(&local, status),
        Ok(None) => {
            errln!(
                "no agent is serving on {}; checking the node here (read-only)",
                local.socket.display()
            );
            match check_here(&local, args.services) {
                Ok(answer) => answer,
                Err(exit) => return exit,
            }
        }
        // The agent did not answer as it should: whether the node drifted is not known.
        Err(_) => Answer::unknown(
            None,
            format!(
                "the agent serving on {} did not answer its status",
                local.socket.display()
            ),
            "see its log (journalctl -u inplace-agent) and run this again",
        ),
    };
    answer.print(args.output)
}

/// What the agent serving on the socket last found.
fn from_agent(local: &Local, status: api::AgentStatus) -> Answer {
    let Some(drift) = status.drift else {
        return Answer {
            drift: None,
            exit: Exit::Ok,
            todo: None,
        };
    };
    let mut answer = Answer::of(drift);
    if answer.exit == Exit::Unknown {
        answer.todo = Some(
            match answer.drift.as_ref().and_then(|d| d.problem.as_ref()) {
                Some(_) => "fix what the check names; the agent checks again after a write, on \
                        its interval and after each plan"
                    .to_string(),
                None => format!(
                    "the agent on {} has not checked since it started (its first check is still \
                 running, or drift.enabled = false): run this again in a few seconds, or turn \
                 the checks on",
                    local.socket.display()
                ),
            },
        );
    }
    answer
}

/// The check the daemon makes (`engine::drift::look`), made here on the node `local`
/// names, against the last succeeded plan in its journal (read without its lock). Never
/// writes. `Err` is the exit code of flags or a configuration that cannot be used.
fn check_here(local: &Local, services: Option<Services>) -> Result<Answer, Exit> {
    let mut input = local.settings.clone();
    if let Some(services) = services {
        input.services_off = services == Services::Off;
    }
    // As the daemon: without a name configured, the root's /etc/hostname.
    if input.node_name.is_none() {
        input.node_name = crate::host::node::hostname(&local.root);
    }
    let settings = input.resolve().map_err(|e| {
        errln!("error: {e}");
        Exit::Invalid
    })?;
    let journal = crate::journal::file_path(&local.state_dir);
    if !journal.exists() {
        errln!(
            "no journal at {}: no plan has been applied with this state directory",
            journal.display()
        );
        return Ok(Answer {
            drift: None,
            exit: Exit::Ok,
            todo: None,
        });
    }
    let root_hint = super::not_root_hint_for_node()
        .map(|h| format!("; {h}"))
        .unwrap_or_default();
    let (table, _) = match api::read_journal(&local.state_dir, usize::MAX) {
        Ok(read) => read,
        Err(e) => {
            return Ok(Answer::unknown(
                None,
                format!("the journal {} cannot be read: {e}", journal.display()),
                &format!(
                    "make the journal readable (inplace-agent journal reads it too){root_hint}"
                ),
            ));
        }
    };
    let Some(baseline) = table.baseline().cloned() else {
        return Ok(Answer {
            drift: None,
            exit: Exit::Ok,
            todo: None,
        });
    };
    let run = baseline.kept.run;
    let reference = table.by_run(run).map(|s| api::DriftBaseline {
        id: s.id.clone(),
        digest: s.digest.clone(),
        attempt: s.attempt,
        run,
    });
    let id = reference.as_ref().map(|r| r.id.clone()).unwrap_or_default();
    // A plan between its start and its end: the node is expected to differ from the last
    // succeeded one, and is not measured against it (the daemon does not check then either).
    if let Some((unfinished, _)) = table.unfinished().next() {
        let what = table
            .by_run(*unfinished)
            .map(|s| {
                format!(
                    "plan {} attempt {} (run {unfinished}, {})",
                    s.id, s.attempt, s.phase
                )
            })
            .unwrap_or_else(|| format!("run {unfinished}"));
        return Ok(Answer::unknown(
            reference,
            format!(
                "{what} has not finished: the node is between plans, and drift is measured \
                 only once no plan is running"
            ),
            "let it finish: start the agent (systemctl start inplace-agent), which resumes \
             it, or wait for the inplace-agent apply that runs it; then run this again",
        ));
    }
    let host = match Host::open(settings.host.clone()) {
        Ok(host) => host,
        Err(e) => {
            return Ok(Answer::unknown(
                reference,
                format!("cannot open the node's root {}: {e}", local.root.display()),
                &format!("pass the node's root with --root{root_hint}"),
            ));
        }
    };
    let backups = BackupStore::at(&local.state_dir);
    let found = look(&settings.engine, &host, &backups, &baseline, &id);
    let now = now_ms();
    match found.found {
        Ok(changes) => {
            let journaled = table
                .journaled_drift()
                .filter(|d| d.run == run)
                .map(|d| d.changes.clone())
                .unwrap_or_default();
            let changes = changes
                .into_iter()
                .map(|c| {
                    let first_seen = journaled
                        .iter()
                        .find(|n| n.index == c.index)
                        .map_or(now, |n| n.first_seen_ms);
                    wire_change(c, first_seen)
                })
                .collect::<Vec<_>>();
            Ok(Answer::of(api::DriftStatus {
                drifted: !changes.is_empty(),
                baseline: reference,
                checked_at_ms: Some(now),
                problem: None,
                changes,
            }))
        }
        Err(why) => Ok(Answer::unknown(
            reference,
            why,
            &format!(
                "fix what it names (the node name: --node-name or node.name; systemd: \
                 --services){root_hint}, and run this again; a running agent checks on its own \
                 (inplace-agent status shows its last check)"
            ),
        )),
    }
}

/// A drifted change as the status document shows it.
fn wire_change(c: DriftedChange, first_seen_ms: u64) -> api::DriftedChange {
    api::DriftedChange {
        index: c.index,
        kind: c.kind,
        target: c.target,
        detail: c.detail,
        differences: c.differences,
        first_seen_ms,
    }
}

fn remote_drift(args: &DriftArgs, addr: &str) -> Exit {
    let runtime = match remote::runtime() {
        Ok(r) => r,
        Err(_) => return Exit::Unknown,
    };
    runtime.block_on(async {
        let mut client = match remote::connect_agent(addr, &args.agent.tls).await {
            Ok(c) => c,
            Err(e) => return unknown_unless_invalid(super::fail(&e)),
        };
        let d = match client.get_drift(remote::call(pb::GetDriftRequest {})).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                return unknown_unless_invalid(remote::refused(
                    "get drift",
                    addr,
                    &args.agent.tls,
                    &status,
                ));
            }
        };
        match args.output {
            RemoteOutput::Json => outln!("{:#}", drift_json(&d)),
            _ => outln!("{}", render(&d)),
        }
        if d.drifted {
            Exit::Failed
        } else if !d.has_baseline {
            Exit::Ok
        } else if !d.problem.is_empty() || d.checked_at_unix_ms == 0 {
            Exit::Unknown
        } else {
            Exit::Ok
        }
    })
}

/// `drift` could not ask: unknown (3), not "drifted" (1); invalid input stays 2.
fn unknown_unless_invalid(exit: Exit) -> Exit {
    match exit {
        Exit::Invalid => Exit::Invalid,
        _ => Exit::Unknown,
    }
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
    let view = DriftView {
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

/// Runs `repair`: on the agent at `--addr`, else here.
pub fn repair(args: &RepairArgs) -> Exit {
    let Some(addr) = &args.addr else {
        return repair_here(args);
    };
    // Both a remote agent and a local tree named: which one is meant is not for us to guess.
    if args.node.root != Path::new("/") || args.node.state_dir.is_some() {
        errln!(
            "error: repair: --addr {addr} repairs the node of the agent there, and --root {} \
             (or --state-dir) repairs the tree here: give one of them (--addr may come from \
             INPLACE_AGENT_ADDR, --root from INPLACE_AGENT_ROOT: unset the one you do not mean)",
            args.node.root.display()
        );
        return Exit::Invalid;
    }
    let runtime = match remote::runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let mut client = match remote::connect_agent(addr, &args.tls).await {
            Ok(c) => c,
            Err(e) => return super::fail(&e),
        };
        let request = pb::RepairPlanRequest {
            id: args.id.clone().unwrap_or_default(),
        };
        let status = match client.repair_plan(remote::call(request)).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                return remote::refused("repair", addr, &args.tls, &status);
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

/// `repair` without `--addr`: the last succeeded plan of this node's journal, re-applied
/// here as `apply` applies a plan.
fn repair_here(args: &RepairArgs) -> Exit {
    let output = match args.output {
        RemoteOutput::Text => super::Output::Text,
        RemoteOutput::Json => super::Output::Json,
        RemoteOutput::HookResponse => {
            errln!(
                "error: --output hook-response is the answer of a remote agent: use it with \
                 --addr, or text or json here"
            );
            return Exit::Invalid;
        }
    };
    super::apply::repair(&args.node, args.id.as_deref(), output, args.no_progress)
}
