//! `check` and `apply`.

use std::path::Path;
use std::sync::Arc;

use super::render::{Renderer, status_json, summary};
use super::{Exit, Invalid, NodeArgs, Output};
use crate::config::Settings;
use crate::engine::dry_run::{ChangeVerdict, check_plan};
use crate::engine::state::{Phase, PlanStatus};
use crate::engine::{Engine, Event, Submission, SubmitError};
use crate::host::Host;
use crate::host::systemd::SystemdError;
use inplace_plan::{
    InvalidPlan, KnownSums, Limits, Plan, ReadPlanError, read_plan, read_plan_hashed,
};

/// Reads and validates a plan file; prints the errors and returns the exit code on failure.
pub fn load_plan(path: &Path, settings: &Settings, output: Output) -> Result<Plan, Exit> {
    read_plan_path(path, &settings.limits, output)
}

/// Reads and validates the plan at `path` (`-`: standard input) within `limits`; prints what
/// is wrong with it.
pub(super) fn read_plan_path(path: &Path, limits: &Limits, output: Output) -> Result<Plan, Exit> {
    read_path(path, limits, output, false).map(|(plan, _)| plan)
}

/// [`read_plan_path`], with `hash` the long contents hashed while the plan is read
/// (`plan::read_plan_hashed`), for a plan about to be submitted.
fn read_path(
    path: &Path,
    limits: &Limits,
    output: Output,
    hash: bool,
) -> Result<(Plan, KnownSums), Exit> {
    let name = path.display().to_string();
    let read = |input: &mut dyn std::io::Read| {
        if hash {
            read_plan_hashed(input, &name, limits)
        } else {
            read_plan(input, &name, limits).map(|plan| (plan, KnownSums::default()))
        }
    };
    let result = if name == "-" {
        read(&mut std::io::stdin().lock())
    } else {
        match std::fs::File::open(path) {
            Ok(mut file) => read(&mut file),
            Err(e) => Err(ReadPlanError::Read(e)),
        }
    };
    report_read(result, &name, output)
}

/// Reads and validates the plan named `name` from `input` within `limits`; prints what is
/// wrong with it.
pub(super) fn read_plan_from(
    input: &mut dyn std::io::Read,
    name: &str,
    limits: &Limits,
    output: Output,
) -> Result<Plan, Exit> {
    report_read(read_plan(input, name, limits), name, output)
}

/// The plan read, or the exit code after printing why it could not be.
fn report_read<T>(result: Result<T, ReadPlanError>, name: &str, output: Output) -> Result<T, Exit> {
    result.map_err(|e| {
        match e {
            ReadPlanError::Read(e) => errln!("error: read plan {name}: {e}"),
            ReadPlanError::Invalid(invalid) => print_invalid(&invalid, output),
        }
        Exit::Invalid
    })
}

pub(super) fn print_invalid(invalid: &InvalidPlan, output: Output) {
    match output {
        Output::Json => outln!(
            "{:#}",
            serde_json::json!({
                "apiVersion": inplace_plan::API_VERSION,
                "kind": "InvalidPlan",
                "source": invalid.source,
                "errors": invalid.errors,
            })
        ),
        Output::Text => errln!("error: {invalid}"),
    }
}

fn settings(node: &NodeArgs) -> Result<Settings, Exit> {
    node.input()
        .resolve()
        .map_err(|e| super::fail(&Invalid::new(e).into()))
}

fn open_host(settings: &Settings) -> Result<Arc<Host>, Exit> {
    Host::open(settings.host.clone())
        .map(Arc::new)
        .map_err(|e| super::fail(&Invalid(e.into()).into()))
}

/// `inplace-agent check`.
pub fn check(plan_path: &Path, node: &NodeArgs, output: Output) -> Exit {
    let result = (|| {
        let settings = settings(node)?;
        let plan = load_plan(plan_path, &settings, output)?;
        let host = open_host(&settings)?;
        Ok::<_, Exit>(check_plan(&settings.engine, &host, &plan))
    })();
    let report = match result {
        Ok(r) => r,
        Err(code) => return code,
    };
    match output {
        Output::Json => outln!("{:#}", serde_json::to_value(&report).unwrap_or_default()),
        Output::Text => {
            outln!("plan {} ({})", report.id, report.digest);
            for e in &report.errors {
                outln!("  error: {e}");
            }
            let n = report.changes.len();
            let width = n.to_string().len();
            for c in &report.changes {
                let what = match c.result {
                    ChangeVerdict::WouldChange => format!("would change [{}]", c.disruption),
                    ChangeVerdict::Unchanged => "unchanged".to_string(),
                    ChangeVerdict::Unsupported => "NOT SUPPORTED".to_string(),
                    ChangeVerdict::Invalid => "INVALID".to_string(),
                };
                let detail = if c.detail.is_empty() {
                    String::new()
                } else {
                    format!(": {}", c.detail)
                };
                outln!(
                    "  [{:>width$}/{n}] changes[{}] {} {}: {what}{detail}",
                    c.index + 1,
                    c.index,
                    c.kind,
                    c.target
                );
            }
            for g in &report.checks {
                let what = if g.supported {
                    "supported".to_string()
                } else {
                    format!("NOT SUPPORTED: {}", g.detail)
                };
                outln!("  verify[{}] {} {}: {what}", g.index, g.kind, g.target);
            }
            let units = if report.restart_units.is_empty() {
                String::new()
            } else {
                format!(" (restarts {})", report.restart_units.join(", "))
            };
            let reload = if report.daemon_reload {
                " (one daemon-reload)"
            } else {
                ""
            };
            outln!("disruption: {}{units}{reload}", report.disruption);
            outln!("service management: {}", report.services);
            if !report.applicable {
                outln!("this node cannot apply the plan as it is");
            }
        }
    }
    if report.applicable {
        Exit::Ok
    } else if let Some(first) = report.environment.first() {
        // Not the plan: the node could not be read (a refused permission, an I/O error).
        errln!("error: the node could not be checked, the plan was not judged: {first}");
        if let Some(hint) = super::not_root_hint_for_node() {
            errln!("{hint}");
        }
        Exit::Failed
    } else {
        Exit::Invalid
    }
}

/// `inplace-agent apply`.
pub fn apply(plan_path: &Path, node: &NodeArgs, output: Output, retry: bool, plain: bool) -> Exit {
    let settings = match settings(node) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let (plan, known) = match read_path(plan_path, &settings.limits, output, true) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let host = match open_host(&settings) {
        Ok(h) => h,
        Err(code) => return code,
    };
    // Refuse a plan that does not fit the node before the journal is even opened: an
    // invalid plan leaves no trace, not even a state directory.
    if let Err(e) = crate::engine::admit(&settings.engine, &host, &plan) {
        match (&e, output) {
            (SubmitError::Invalid(invalid), _) => print_invalid(invalid, output),
            (_, Output::Json) => outln!(
                "{:#}",
                serde_json::json!({"apiVersion": inplace_plan::API_VERSION, "kind": "Refused", "error": e.to_string()})
            ),
            _ => errln!("error: {e}"),
        }
        return Exit::Invalid;
    }
    if let Err(e) = services_ready(&host, &plan) {
        return super::fail(&e.into());
    }
    let engine = match open_engine(&settings, host) {
        Ok(e) => e,
        Err(code) => return code,
    };
    match run_known(&engine, plan, known, retry, plain, false) {
        Ok(status) => {
            match output {
                Output::Json => outln!("{:#}", status_json(&status)),
                Output::Text => outln!("{}", summary(&status)),
            }
            Exit::of_phase(status.phase)
        }
        Err(code) => code,
    }
}

/// Opens the engine on the node's journal (taking its lock); warns about a torn record.
fn open_engine(settings: &Settings, host: Arc<Host>) -> Result<Engine, Exit> {
    let (engine, report) =
        Engine::open(settings.engine.clone(), host).map_err(|e| super::fail(&e.into()))?;
    if let Some(torn) = report.torn {
        errln!(
            "warning: the journal ended in a torn record ({} bytes at offset {}), left by a \
             crash; it was truncated and the agent continues from the last complete record",
            torn.bytes,
            torn.offset
        );
    }
    Ok(engine)
}

/// `inplace-agent repair` without `--addr`: the last plan that succeeded on this node (only
/// if its id is `id`, when given), re-applied here as a new attempt of it, journaled as
/// `repair of run N by cli`, with the same admission, rollback and gates as `apply`.
pub fn repair(node: &NodeArgs, id: Option<&str>, output: Output, plain: bool) -> Exit {
    let settings = match settings(node) {
        Ok(s) => s,
        Err(code) => return code,
    };
    // Nothing to repair to, and no trace left: the journal is not created for a refusal.
    let journal = crate::journal::file_path(&settings.engine.state_dir);
    if !journal.exists() {
        errln!(
            "error: no plan has succeeded on this node (no journal at {}): there is nothing \
             to repair to; apply a plan first (inplace-agent apply PLAN), or pass the node's \
             --root or --state-dir",
            journal.display()
        );
        return Exit::Failed;
    }
    let host = match open_host(&settings) {
        Ok(h) => h,
        Err(code) => return code,
    };
    let engine = match open_engine(&settings, host) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let events = engine.subscribe();
    let submission = match engine.repair_of(id, "cli") {
        Ok(s) => s,
        Err(e) => return super::fail(&e.into()),
    };
    let status = submission.status().clone();
    errln!(
        "repairing: plan {} attempt {} re-applies {}",
        status.id,
        status.attempt,
        status.source.trim_start_matches("repair of ")
    );
    match follow_run(&engine, status, events, plain, false) {
        Ok(status) => {
            match output {
                Output::Json => outln!("{:#}", status_json(&status)),
                Output::Text => outln!("{}", summary(&status)),
            }
            Exit::of_phase(status.phase)
        }
        Err(code) => code,
    }
}

/// Checks that systemd answers when the plan will need it (units, reboots, restarts,
/// `unitActive` gates), so that `apply` says so at once instead of retrying until the step
/// timeout. Nothing is journaled before this.
pub fn services_ready(host: &Host, plan: &Plan) -> Result<(), ServicesUnreachable> {
    let Some(services) = host.services() else {
        return Ok(());
    };
    let needs = plan
        .changes
        .iter()
        .any(|c| c.spec().needs_services() || !c.restart_units().is_empty())
        || plan
            .verify
            .iter()
            .any(|c| matches!(c.probe, inplace_plan::Probe::UnitActive { .. }));
    if !needs {
        return Ok(());
    }
    services
        .ping()
        .map(|_| ())
        .map_err(|source| ServicesUnreachable {
            plan: plan.id.clone(),
            source,
        })
}

/// A plan needs systemd and it does not answer (what to do is part of the message).
#[derive(Debug, thiserror::Error)]
#[error(
    "plan {plan} needs systemd (restarts, units, reboots or unitActive gates) but it is not \
     reachable: {source}; to apply it to a plain directory tree without managing units, pass \
     --services off"
)]
pub struct ServicesUnreachable {
    /// The plan's id.
    pub plan: String,
    /// Why systemd did not answer.
    pub source: SystemdError,
}

/// How long the progress thread lets events gather after one arrives. At the fastest step
/// rate measured (500 unchanged files in about 10 ms, two events each) that is a quarter of
/// the 4,096 events the broadcast holds for a slow receiver.
const RENDER_GATHER: std::time::Duration = std::time::Duration::from_millis(10);

/// Submits a plan to a local engine and runs it on this thread to its end, showing progress
/// from a second thread.
pub fn run_plan(
    engine: &Engine,
    plan: Plan,
    retry: bool,
    plain: bool,
    quiet_unchanged: bool,
) -> Result<PlanStatus, Exit> {
    run_known(
        engine,
        plan,
        KnownSums::default(),
        retry,
        plain,
        quiet_unchanged,
    )
}

/// [`run_plan`] of a plan some of whose contents were hashed while it was read.
fn run_known(
    engine: &Engine,
    plan: Plan,
    known: KnownSums,
    retry: bool,
    plain: bool,
    quiet_unchanged: bool,
) -> Result<PlanStatus, Exit> {
    let events = engine.subscribe();
    if let Some(current) = engine.current()
        && (current.id != plan.id || !plan.has_digest(&current.digest))
    {
        errln!(
            "note: plan {} (attempt {}) was left unfinished by an earlier run; it resumes \
             until this plan supersedes it at the next step boundary",
            current.id,
            current.attempt
        );
    }
    let submission = engine
        .submit_known(plan, known, "cli", retry)
        .map_err(|e| super::fail(&e.into()))?;
    let status = submission.status().clone();
    if let Submission::Existing(s) = &submission
        && s.phase.is_terminal()
    {
        let when = s
            .finished_at_ms
            .map(inplace_base::time::rfc3339)
            .unwrap_or_default();
        let _ = std::io::Write::flush(&mut std::io::stdout());
        errln!(
            "plan {} ({}) already ran on this node: attempt {} {} at {when}; nothing to do{}",
            s.id,
            s.digest,
            s.attempt,
            s.phase,
            if s.phase == Phase::Succeeded {
                ""
            } else {
                " (use --retry to run it again)"
            }
        );
        return Ok(s.clone());
    }
    follow_run(engine, status, events, plain, quiet_unchanged)
}

/// Runs the engine on this thread until the run of `status` (just accepted; `events`
/// subscribed before it was) has ended, showing its progress from a second thread.
fn follow_run(
    engine: &Engine,
    status: PlanStatus,
    mut events: tokio::sync::broadcast::Receiver<Event>,
    plain: bool,
    quiet_unchanged: bool,
) -> Result<PlanStatus, Exit> {
    let run = status.run;
    let mut renderer =
        Renderer::new(run, status.progress.total, plain).quiet_unchanged(quiet_unchanged);
    let shown = std::thread::spawn(move || {
        use tokio::sync::broadcast::error::{RecvError, TryRecvError};
        // Shows one event; false once the run has ended.
        let mut show = |event: &Event| renderer.event(event).is_none();
        loop {
            match events.blocking_recv() {
                Ok(event) if !show(&event) => return,
                Ok(_) | Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => return,
            }
            // Let the next moment's events gather and show them together: a plan of 500
            // quick steps then wakes this thread a few times, not once a step (each wake-up
            // is a futex call on the engine's thread). The engine's end wakes it at once.
            std::thread::park_timeout(RENDER_GATHER);
            loop {
                match events.try_recv() {
                    Ok(event) if !show(&event) => return,
                    Ok(_) | Err(TryRecvError::Lagged(_)) => {}
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Closed) => return,
                }
            }
        }
    });
    engine.run_until_idle();
    shown.thread().unpark();
    let finished = engine.status_of_run(run).unwrap_or(status);
    if !finished.phase.is_terminal() {
        errln!(
            "error: plan {} stopped in phase {} because its journal could not be written; it \
             resumes from the journal at the next start",
            finished.id,
            finished.phase
        );
        return Err(Exit::Failed);
    }
    let _ = shown.join();
    Ok(finished)
}
