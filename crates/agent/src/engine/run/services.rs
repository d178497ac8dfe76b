//! The runner's dealings with the service manager: the Restarting phase (one daemon-reload,
//! then one job per unit, each journaled before it is queued), the unit half of rollback,
//! the re-check of units whose start or restart failed, and the reboot step.
//!
//! What to do is decided by the pure functions of `engine::units`; this file does it,
//! journals it, and reports a lost bus connection (`SystemdUnreachable` records) while the
//! service manager reconnects.

use inplace_base::ErrorInfo;
use inplace_base::ErrorKind;
use inplace_base::time::now_ms;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::{Abort, Runner, Stop};
use crate::engine::state::Phase;
use crate::engine::table::RunState;
use crate::engine::units::{self, Decision, Effect, UnitPlan, Want};
use crate::failpoint;
use crate::host::systemd::{SystemdError, UnitBefore, UnitJob};
use crate::host::{ServiceCall, ServiceManager};
use crate::journal::{JournalError, Record, UnitJobOutcome};

/// How often the reboot step looks at the boot id while it waits to be taken down.
const REBOOT_POLL: Duration = Duration::from_millis(500);

/// The effect of every change of the run that mutated the node, by index.
fn effects(rs: &RunState) -> BTreeMap<usize, Effect> {
    rs.preimages
        .iter()
        .map(|(i, p)| (*i as usize, units::effect_of_preimages(p)))
        .collect()
}

/// `detail` without a leading `<op>: ` (systemd errors start with their operation).
fn without_op(detail: &str, op: &str) -> String {
    detail
        .strip_prefix(op)
        .and_then(|d| d.strip_prefix(": "))
        .unwrap_or(detail)
        .to_string()
}

fn systemd_failure(op: &str, e: &SystemdError) -> Abort {
    Abort::Failed(ErrorInfo {
        kind: ErrorKind::Systemd,
        step: Some(op.to_string()),
        detail: without_op(&e.to_string(), op),
    })
}

impl Runner {
    /// What the Restarting phase of `run` does, from what its changes did so far.
    pub(super) fn unit_plan(&self, run: u64) -> UnitPlan {
        let Some((_, rs, _)) = self.state(run) else {
            return UnitPlan::default();
        };
        units::plan_units(&rs.plan, &effects(&rs), rs.rebooted_at.map(|i| i as usize))
    }

    /// Runs `f` with a call that keeps reconnecting until `deadline` and journals every
    /// lost connection (`SystemdUnreachable`), so watchers and the journal see it.
    fn with_call<T>(
        &self,
        run: u64,
        deadline: Instant,
        f: impl FnOnce(&mut ServiceCall<'_>) -> T,
    ) -> T {
        let mut report = |message: &str| {
            let record = Record::SystemdUnreachable {
                run,
                message: message.to_string(),
            };
            if let Err(e) = self.record(record, false) {
                tracing::warn!(run, error = %e, "could not journal a lost systemd connection");
            }
        };
        let mut call = ServiceCall::until(deadline, &mut report);
        f(&mut call)
    }

    fn step_deadline(rs: &RunState) -> Instant {
        Instant::now() + rs.plan.options.step_timeout
    }

    /// The Restarting phase: one daemon-reload when unit files changed, then for each unit
    /// (stops first, then in plan order) the job its state calls for, each journaled before
    /// it is queued and done at most once, also across crashes and lost connections.
    /// A failed start or restart does not end the phase: the gates run, and the unit must be
    /// running by the end of them ([`Runner::recheck_failed_units`]). A failed stop, or a
    /// bus that stays unreachable, fails the run.
    pub(super) fn restart(&self, run: u64) -> Result<(), Abort> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(());
        };
        let up = self.unit_plan(run);
        match self.shared.host.services() {
            None => {
                let how = self.shared.host.services_description();
                for u in &up.units {
                    if !matches!(u.want, Want::Restart { .. })
                        || rs.forward_job(&u.unit).is_some_and(|j| j.outcome.is_some())
                    {
                        continue;
                    }
                    self.record(
                        Record::UnitJobDone {
                            run,
                            unit: u.unit.clone(),
                            job: UnitJob::Restart,
                            rollback: false,
                            outcome: UnitJobOutcome::Skipped,
                            message: format!(
                                "{} not restarted: this agent's service management is {how}",
                                u.unit
                            ),
                        },
                        false,
                    )?;
                }
            }
            Some(services) => {
                if up.reload && !rs.reloaded.0 {
                    self.with_call(run, Self::step_deadline(&rs), |c| services.daemon_reload(c))
                        .map_err(|e| systemd_failure("daemon-reload", &e))?;
                    self.record(
                        Record::DaemonReloaded {
                            run,
                            rollback: false,
                        },
                        true,
                    )?;
                }
                for u in &up.units {
                    let Some((_, rs, _)) = self.state(run) else {
                        return Ok(());
                    };
                    let earlier = rs.forward_job(&u.unit);
                    if earlier.is_some_and(|j| j.outcome.is_some()) {
                        continue;
                    }
                    if let Some(stop) = self
                        .boundary(run)
                        .filter(|s| matches!(s, Stop::TimedOut(_) | Stop::Shutdown))
                    {
                        return Err(Abort::Stop(stop));
                    }
                    let deadline = Self::step_deadline(&rs);
                    let job = match earlier {
                        // Journaled and maybe queued before a crash: finish that job.
                        Some(j) if j.queued => j.job,
                        _ => {
                            let now = self
                                .with_call(run, deadline, |c| services.unit_state(&u.unit, c))
                                .map_err(|e| systemd_failure(&format!("show {}", u.unit), &e))?;
                            match units::decide(&u.unit, &u.want, &now) {
                                Decision::Nothing => continue,
                                Decision::Skip(message) => {
                                    self.record(
                                        Record::UnitJobDone {
                                            run,
                                            unit: u.unit.clone(),
                                            job: UnitJob::Restart,
                                            rollback: false,
                                            outcome: UnitJobOutcome::Skipped,
                                            message,
                                        },
                                        false,
                                    )?;
                                    continue;
                                }
                                Decision::Queue(job) => job,
                            }
                        }
                    };
                    if let Err(e) = self.unit_job(run, services, &u.unit, job, false, deadline)? {
                        if job == UnitJob::Stop || e.is_connection_lost() {
                            return Err(systemd_failure(&format!("{job} {}", u.unit), &e));
                        }
                        tracing::warn!(run, unit = %u.unit, error = %e, "unit job failed; the gates decide");
                    }
                }
            }
        }
        self.phase(run, Phase::Verifying, None)?;
        Ok(())
    }

    /// One unit job, journaled first (`UnitJobStarted` with the unit's state, fdatasynced)
    /// and after (`UnitJobDone`). A job that was journaled but not finished before a crash
    /// is resumed with its journaled `before`, so a restart that already happened is not
    /// done again. The inner error is the job's failure (also journaled).
    fn unit_job(
        &self,
        run: u64,
        services: &dyn ServiceManager,
        unit: &str,
        job: UnitJob,
        rollback: bool,
        deadline: Instant,
    ) -> Result<Result<String, SystemdError>, JournalError> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(Ok(String::new()));
        };
        let open = if rollback {
            rs.rollback_job(unit)
        } else {
            rs.forward_job(unit)
        }
        .filter(|j| j.queued && j.outcome.is_none() && j.job == job);
        let done = |outcome: UnitJobOutcome, message: String| Record::UnitJobDone {
            run,
            unit: unit.to_string(),
            job,
            rollback,
            outcome,
            message,
        };
        let (before, maybe_queued) = match open {
            Some(j) => (j.before.clone(), true),
            None => {
                let now = match self.with_call(run, deadline, |c| services.unit_state(unit, c)) {
                    Ok(now) => now,
                    Err(e) => {
                        self.record(done(UnitJobOutcome::Failed, e.to_string()), true)?;
                        return Ok(Err(e));
                    }
                };
                let before = UnitBefore::of(&now);
                self.record(
                    Record::UnitJobStarted {
                        run,
                        unit: unit.to_string(),
                        job,
                        rollback,
                        before: before.clone(),
                    },
                    true,
                )?;
                (before, false)
            }
        };
        failpoint::hit("unit.before_job");
        let result = self.with_call(run, deadline, |c| {
            services.job(job, unit, &before, maybe_queued, c)
        });
        failpoint::hit("unit.after_job");
        match result {
            Ok(outcome) => {
                let took = outcome.elapsed;
                let took = if took < Duration::from_secs(1) {
                    format!("{} ms", took.as_millis())
                } else {
                    format!("{:.1}s", took.as_secs_f64())
                };
                let invocation = outcome
                    .state
                    .invocation_id
                    .as_ref()
                    .map(|id| format!(", InvocationID {}", &id.to_string()[..12]))
                    .unwrap_or_default();
                let message = format!(
                    "{} {unit} in {took}: {}{invocation}",
                    job.past(),
                    outcome.state
                );
                self.record(done(UnitJobOutcome::Done, message.clone()), true)?;
                Ok(Ok(message))
            }
            Err(e) => {
                self.record(done(UnitJobOutcome::Failed, e.to_string()), true)?;
                Ok(Err(e))
            }
        }
    }

    /// A failed gate's message, followed by what the failed starts and restarts of the run
    /// said (they are often why the gate failed).
    pub(super) fn with_unit_failures(&self, run: u64, message: String, passed: bool) -> String {
        if passed {
            return message;
        }
        let Some((_, rs, _)) = self.state(run) else {
            return message;
        };
        let failures: Vec<&str> = rs
            .unit_jobs
            .iter()
            .filter(|j| !j.rollback && j.outcome == Some(UnitJobOutcome::Failed))
            .map(|j| j.message.as_str())
            .collect();
        if failures.is_empty() {
            message
        } else {
            format!("{message}; earlier: {}", failures.join("; "))
        }
    }

    /// After the gates passed: every unit whose start or restart failed in this run must be
    /// running by now (a unit with `Restart=` may have recovered on its own); otherwise the
    /// run fails with what its job said and what the unit is now.
    pub(super) fn recheck_failed_units(&self, run: u64) -> Result<(), Abort> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(());
        };
        let Some(services) = self.shared.host.services() else {
            return Ok(());
        };
        let failed: Vec<_> = rs
            .unit_jobs
            .iter()
            .filter(|j| !j.rollback && j.outcome == Some(UnitJobOutcome::Failed))
            .collect();
        for j in failed {
            let op = format!("{} {}", j.job, j.unit);
            let now = self
                .with_call(run, Self::step_deadline(&rs), |c| {
                    services.unit_state(&j.unit, c)
                })
                .map_err(|e| systemd_failure(&format!("show {}", j.unit), &e))?;
            if !now.is_active() {
                return Err(Abort::Failed(ErrorInfo {
                    kind: ErrorKind::Systemd,
                    step: Some(op.clone()),
                    detail: format!(
                        "{}; {} is still not running: {now}",
                        without_op(&j.message, &op),
                        j.unit
                    ),
                }));
            }
            tracing::info!(run, unit = %j.unit, "a unit whose {} failed is running now", j.job);
        }
        Ok(())
    }

    /// The unit half of rollback, after the files were restored: a daemon-reload when the
    /// run reloaded, then the jobs that undo its unit jobs (`units::undo_jobs`), each
    /// journaled and done at most once. After a reboot in the run, units fed by the restored
    /// changes from before the reboot are restarted too (when running), so the restored files
    /// are live again. The inner error is the rollback failure to report.
    pub(super) fn rollback_units(
        &self,
        run: u64,
        error: &Option<ErrorInfo>,
    ) -> Result<Result<(), ErrorInfo>, JournalError> {
        let Some(services) = self.shared.host.services() else {
            return Ok(Ok(()));
        };
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(Ok(()));
        };
        let after = error
            .as_ref()
            .map(|e| format!(" (rolling back after: {e})"))
            .unwrap_or_default();
        let failure = |what: String, e: &SystemdError| ErrorInfo {
            kind: ErrorKind::RollbackFailed,
            step: Some(what.clone()),
            detail: format!(
                "files were restored but {what} failed: {}; the node needs attention{after}",
                without_op(&e.to_string(), &what)
            ),
        };
        if rs.reloaded.0 && !rs.reloaded.1 {
            let reloaded =
                self.with_call(run, Self::step_deadline(&rs), |c| services.daemon_reload(c));
            if let Err(e) = reloaded {
                return Ok(Err(failure("daemon-reload".into(), &e)));
            }
            self.record(
                Record::DaemonReloaded {
                    run,
                    rollback: true,
                },
                true,
            )?;
        }
        let mut undo = units::undo_jobs(&rs.unit_jobs);
        let mut only_if_running = BTreeSet::new();
        if rs.rebooted_at.is_some() {
            for u in units::plan_units(&rs.plan, &effects(&rs), None).units {
                if matches!(u.want, Want::Restart { .. }) && !undo.iter().any(|d| d.unit == u.unit)
                {
                    only_if_running.insert(u.unit.clone());
                    undo.push(units::Undo {
                        unit: u.unit,
                        job: UnitJob::Restart,
                        reset_failed: false,
                    });
                }
            }
        }
        for d in undo {
            let Some((_, rs, _)) = self.state(run) else {
                return Ok(Ok(()));
            };
            if rs
                .rollback_job(&d.unit)
                .is_some_and(|j| j.outcome.is_some())
            {
                continue;
            }
            let deadline = Self::step_deadline(&rs);
            let what = format!("{} {}", d.job, d.unit);
            if only_if_running.contains(&d.unit) && rs.rollback_job(&d.unit).is_none() {
                let now = self.with_call(run, deadline, |c| services.unit_state(&d.unit, c));
                match now {
                    Ok(now) if now.active_state == crate::host::systemd::ActiveState::Inactive => {
                        continue;
                    }
                    Ok(_) => {}
                    Err(e) => return Ok(Err(failure(what, &e))),
                }
            }
            if let Err(e) = self.unit_job(run, services, &d.unit, d.job, true, deadline)? {
                return Ok(Err(failure(what, &e)));
            }
            if d.reset_failed {
                let reset = self.with_call(run, deadline, |c| services.reset_failed(&d.unit, c));
                if let Err(e) = reset {
                    tracing::debug!(run, unit = %d.unit, error = %e, "reset-failed after rollback");
                }
            }
        }
        Ok(Ok(()))
    }

    /// The reboot change at `index`: when a change before it changed something,
    /// journal the request with the current boot id (fdatasynced), ask systemd to reboot and
    /// wait to be taken down. At the next start the run resumes here: a different boot id
    /// means the node rebooted and the run goes on with the next change; the same boot id
    /// means the reboot did not happen (yet): it is asked for again, and when the step
    /// timeout has passed since the first request the step fails.
    pub(super) fn reboot_step(&self, run: u64, index: u32) -> Result<(), Abort> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(());
        };
        let plan = rs.plan.clone();
        let i = index as usize;
        let step = format!("changes[{index}] reboot {}", plan.changes[i].target());
        let fail = |kind: ErrorKind, detail: String| {
            Abort::Failed(ErrorInfo {
                kind,
                step: Some(step.clone()),
                detail,
            })
        };
        let host = &self.shared.host;
        let boot_path = host.boot_id_path();
        let rebooted = |from: &str, to: &str| Record::StepDone {
            run,
            index,
            changed: true,
            message: format!("the node rebooted (boot id {from} → {to})"),
        };
        let request = match rs.reboot.clone().filter(|r| r.index == index) {
            Some(r) => match host.boot_id() {
                Some(now) if now != r.boot_id => {
                    self.record(rebooted(&r.boot_id, &now), true)?;
                    return Ok(());
                }
                Some(_) => {
                    tracing::warn!(
                        run,
                        boot_id = %r.boot_id,
                        "started again in the boot that asked for the reboot: it did not happen (yet)"
                    );
                    r
                }
                None => {
                    return Err(fail(
                        ErrorKind::Precondition,
                        format!(
                            "cannot read the boot id from {}: the reboot requested from boot {} \
                             cannot be confirmed",
                            boot_path.display(),
                            r.boot_id
                        ),
                    ));
                }
            },
            None => {
                let changed: BTreeSet<usize> = rs.preimages.keys().map(|k| *k as usize).collect();
                if !units::reboot_needed(&plan, i, &changed) {
                    self.record(
                        Record::StepDone {
                            run,
                            index,
                            changed: false,
                            message: "not needed: no change before it changed anything".into(),
                        },
                        false,
                    )?;
                    return Ok(());
                }
                let Some(boot_id) = host.boot_id() else {
                    return Err(fail(
                        ErrorKind::Precondition,
                        format!(
                            "cannot read the boot id from {}: a reboot could not be told apart \
                             from a restart of the agent",
                            boot_path.display()
                        ),
                    ));
                };
                self.record(
                    Record::RebootRequested {
                        run,
                        index,
                        boot_id,
                    },
                    true,
                )?;
                failpoint::hit("reboot.before_request");
                match self.state(run).and_then(|(_, rs, _)| rs.reboot) {
                    Some(r) => r,
                    None => return Ok(()),
                }
            }
        };
        let Some(services) = host.services() else {
            return Err(fail(
                ErrorKind::Unsupported,
                "reboot changes need service management, which is off on this agent".into(),
            ));
        };
        let limit_ms = rs.plan.options.step_timeout.as_millis() as u64;
        let deadline_ms = request.requested_at_ms.saturating_add(limit_ms);
        let left = || Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
        if !left().is_zero() {
            self.with_call(run, Instant::now() + left(), |c| services.reboot(c))
                .map_err(|e| fail(ErrorKind::Systemd, e.to_string()))?;
            tracing::info!(run, boot_id = %request.boot_id, "reboot requested; waiting to be taken down");
        }
        // A reboot ends this process; until then (or until the step timeout), wait.
        loop {
            if let Some(now) = host.boot_id().filter(|b| *b != request.boot_id) {
                self.record(rebooted(&request.boot_id, &now), true)?;
                return Ok(());
            }
            if left().is_zero() {
                return Err(fail(
                    ErrorKind::Timeout,
                    format!(
                        "the node did not reboot: the boot id is still {} {}s after the reboot \
                         was requested",
                        request.boot_id,
                        now_ms().saturating_sub(request.requested_at_ms) / 1000
                    ),
                ));
            }
            if self
                .shared
                .shutdown
                .load(std::sync::atomic::Ordering::SeqCst)
            {
                return Err(Abort::Stop(Stop::Shutdown));
            }
            let mut inner = self.shared.lock();
            let waiting = inner
                .table
                .by_run(run)
                .map(crate::engine::state::reboot_message)
                .unwrap_or_default();
            inner.table.set_message(
                run,
                format!(
                    "{waiting}, {}s since the request",
                    now_ms().saturating_sub(request.requested_at_ms) / 1000
                ),
            );
            drop(inner);
            std::thread::sleep(REBOOT_POLL.min(left()));
        }
    }
}
