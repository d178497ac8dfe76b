//! The engine's state as a fold of journal records: replay at start-up and live updates go
//! through the same [`Table::apply`], so a restarted agent knows and reports exactly what it
//! knew before.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::status::*;
use crate::journal::{ChangeSummary, CheckSummary, Entry, PlanDoc, Preimage, Record};
use crate::plan::{Check, Limits, Plan, PlanOptions, validate_value};
use crate::steps;

/// How many finished plans keep their per-change results.
pub const KEEP_FULL: usize = 16;

/// What a run needs to resume, beyond its status.
#[derive(Debug, Clone)]
pub struct RunState {
    /// The plan. While the journal is replayed this is an empty placeholder: plans are only
    /// read back (from [`Table`]'s documents) for runs still unfinished when replay ends.
    pub plan: Arc<Plan>,
    /// Pre-images of changes that started mutating, by change index.
    pub preimages: BTreeMap<u32, Vec<Preimage>>,
    /// Changes in their desired state.
    pub done: BTreeSet<u32>,
    /// Changes restored by rollback.
    pub rolled_back: BTreeSet<u32>,
    /// Gates that passed.
    pub checks_passed: BTreeSet<u32>,
    /// Units restarted (forward), and during rollback.
    pub restarted: BTreeSet<String>,
    /// Units restarted during rollback.
    pub restarted_rollback: BTreeSet<String>,
    /// daemon-reload done (forward, rollback).
    pub reloaded: (bool, bool),
    /// A reboot requested by change `index` from boot `boot_id`.
    pub reboot: Option<(u32, String)>,
    /// Somebody asked to cancel.
    pub cancel_requested: bool,
    /// Timestamp of the last record of this run (step durations).
    pub last_ts: u64,
}

impl RunState {
    /// True when some change of this run mutated the node.
    pub fn changed_anything(&self) -> bool {
        !self.preimages.is_empty()
    }
}

/// All plans the agent knows, newest last.
#[derive(Debug, Default)]
pub struct Table {
    plans: Vec<PlanStatus>,
    runs: BTreeMap<u64, RunState>,
    /// The plan documents of unfinished runs.
    docs: BTreeMap<u64, PlanDoc>,
    retained: BTreeMap<u64, PlanDoc>,
    next_run: u64,
    /// How many finished plans to remember at all.
    pub keep_plans: usize,
    /// False while the journal is replayed: per-step progress messages are only built for
    /// live records (a replay of a million records would format them all for nothing).
    live: bool,
}

fn step_name(index: u32, plan: &Plan) -> String {
    match plan.changes.get(index as usize) {
        Some(c) => format!("changes[{index}] {} {}", c.kind(), c.target()),
        None => format!("changes[{index}]"),
    }
}

fn phase_message(phase: Phase) -> String {
    match phase {
        Phase::Preparing => "checking the plan against the node".into(),
        Phase::Applying => "applying changes".into(),
        Phase::Restarting => "restarting units".into(),
        Phase::Verifying => "running health gates".into(),
        Phase::RollingBack => "rolling back".into(),
        other => other.to_string(),
    }
}

/// An empty plan standing in for one not read back yet (during replay).
fn placeholder() -> Arc<Plan> {
    static EMPTY: std::sync::OnceLock<Arc<Plan>> = std::sync::OnceLock::new();
    EMPTY
        .get_or_init(|| {
            Arc::new(Plan {
                id: String::new(),
                node_name: None,
                options: PlanOptions::default(),
                changes: Vec::new(),
                verify: Vec::new(),
            })
        })
        .clone()
}

/// Kind, target and disruption of each change, kind and target of each gate, for the
/// `PlanAccepted` record.
pub fn summaries(plan: &Plan) -> (Vec<ChangeSummary>, Vec<CheckSummary>) {
    let changes = plan
        .changes
        .iter()
        .map(|c| ChangeSummary {
            kind: c.kind(),
            target: c.target(),
            disruption: steps::disruption(c),
        })
        .collect();
    let checks = plan
        .verify
        .iter()
        .map(|c| CheckSummary {
            kind: c.probe.key().to_string(),
            target: c.probe.target(),
        })
        .collect();
    (changes, checks)
}

/// The name of a gate for messages: `verify[1] httpGet http://...`.
pub fn check_name(index: u32, check: &Check) -> String {
    format!(
        "verify[{index}] {} {}",
        check.probe.key(),
        check.probe.target()
    )
}

impl Table {
    /// An empty table keeping `keep_plans` finished plans.
    pub fn new(keep_plans: usize) -> Table {
        Table {
            keep_plans: keep_plans.max(1),
            next_run: 1,
            ..Table::default()
        }
    }

    /// The next free run number.
    pub fn next_run(&self) -> u64 {
        self.next_run
    }

    /// Applies one record. Unknown runs are ignored (their plan was compacted away).
    pub fn apply(&mut self, entry: Entry) {
        self.apply_with_plan(entry, None);
    }

    /// Applies one record; for a `PlanAccepted` written by this process, `plan` is the
    /// already validated plan, so it is not read back from the document.
    pub fn apply_with_plan(&mut self, entry: Entry, plan: Option<Arc<Plan>>) {
        let ts = entry.ts;
        match entry.record {
            Record::Compacted { .. } => {}
            Record::PlanAccepted {
                run,
                id,
                digest,
                attempt,
                source,
                plan: doc,
                changes,
                checks,
            } => {
                let status = PlanStatus {
                    id,
                    digest,
                    attempt,
                    run,
                    source,
                    phase: Phase::Pending,
                    progress: Progress::default(),
                    changes: Vec::new(),
                    checks: Vec::new(),
                    error: None,
                    rebooting: false,
                    accepted_at_ms: ts,
                    started_at_ms: None,
                    finished_at_ms: None,
                    counts: Counts::default(),
                };
                self.accept(status, doc, changes, checks, plan);
            }
            Record::Summary { status, plan } => {
                self.next_run = self.next_run.max(status.run + 1);
                if let Some(p) = plan {
                    self.retained.insert(status.run, p);
                }
                self.plans.push(*status);
            }
            rec => {
                let Some(run) = rec.run() else { return };
                self.apply_run(run, rec, ts);
            }
        }
    }

    /// Ends the replay: from now on records are live, and unfinished runs get the progress
    /// message their last record implies.
    pub fn finish_replay(&mut self) {
        self.live = true;
        let runs: Vec<u64> = self.runs.keys().copied().collect();
        for run in runs {
            let parsed = match self.docs.get(&run) {
                Some(doc) => validate_value(&doc.to_value(), "journal", &Limits::replay()),
                None => continue,
            };
            let plan = match parsed {
                Ok(p) => Arc::new(p),
                Err(e) => {
                    // Cannot happen for plans this agent wrote; keep the run visible and failed.
                    self.runs.remove(&run);
                    if let Some(status) = self.plans.iter_mut().rev().find(|p| p.run == run) {
                        status.phase = Phase::Failed;
                        status.error = Some(ErrorInfo {
                            kind: ErrorKind::Internal,
                            step: None,
                            detail: format!("journaled plan cannot be read back: {e}"),
                        });
                    }
                    continue;
                }
            };
            if let Some(rs) = self.runs.get_mut(&run) {
                rs.plan = plan.clone();
            }
            if let Some(status) = self.plans.iter_mut().rev().find(|p| p.run == run) {
                status.progress.message = match status.phase {
                    Phase::Applying if status.progress.current > 0 => {
                        step_name(status.progress.current - 1, &plan)
                    }
                    phase => phase_message(phase),
                };
            }
        }
    }

    fn accept(
        &mut self,
        mut status: PlanStatus,
        doc: PlanDoc,
        mut changes: Vec<ChangeSummary>,
        mut checks: Vec<CheckSummary>,
        plan: Option<Arc<Plan>>,
    ) {
        let run = status.run;
        self.next_run = self.next_run.max(run + 1);
        // Records written before summaries existed (or an empty plan): read the plan now.
        let mut plan = plan;
        if plan.is_none() && (self.live || (changes.is_empty() && checks.is_empty())) {
            match validate_value(&doc.to_value(), "journal", &Limits::replay()) {
                Ok(p) => plan = Some(Arc::new(p)),
                Err(e) => {
                    status.phase = Phase::Failed;
                    status.finished_at_ms = Some(status.accepted_at_ms);
                    status.error = Some(ErrorInfo {
                        kind: ErrorKind::Internal,
                        step: None,
                        detail: format!("journaled plan cannot be read back: {e}"),
                    });
                    self.plans.push(status);
                    return;
                }
            }
        }
        if let Some(p) = &plan
            && changes.is_empty()
            && checks.is_empty()
        {
            (changes, checks) = summaries(p);
        }
        status.changes = changes
            .into_iter()
            .enumerate()
            .map(|(i, c)| ChangeStatus {
                index: i as u32,
                kind: c.kind,
                target: c.target,
                state: ChangeState::Pending,
                message: String::new(),
                disruption: c.disruption,
                duration_ms: None,
            })
            .collect();
        status.checks = checks
            .into_iter()
            .enumerate()
            .map(|(i, c)| CheckStatus {
                index: i as u32,
                kind: c.kind,
                target: c.target,
                state: CheckState::Pending,
                message: String::new(),
            })
            .collect();
        status.counts.total = status.changes.len() as u32;
        status.progress = Progress {
            current: 0,
            total: (status.changes.len() + status.checks.len()) as u32,
            message: "accepted".into(),
        };
        let last_ts = status.accepted_at_ms;
        self.runs.insert(
            run,
            RunState {
                plan: plan.unwrap_or_else(placeholder),
                preimages: BTreeMap::new(),
                done: BTreeSet::new(),
                rolled_back: BTreeSet::new(),
                checks_passed: BTreeSet::new(),
                restarted: BTreeSet::new(),
                restarted_rollback: BTreeSet::new(),
                reloaded: (false, false),
                reboot: None,
                cancel_requested: false,
                last_ts,
            },
        );
        self.docs.insert(run, doc);
        self.plans.push(status);
    }

    fn apply_run(&mut self, run: u64, rec: Record, ts: u64) {
        let Some(pos) = self.plans.iter().rposition(|p| p.run == run) else {
            return;
        };
        let live = self.live;
        let status = &mut self.plans[pos];
        let state = self.runs.get_mut(&run);
        let mut finished = false;
        match (rec, state) {
            (Record::Phase { phase, error, .. }, Some(rs)) => {
                if status.phase == Phase::Pending && phase != Phase::Pending {
                    status.started_at_ms = Some(ts);
                }
                status.phase = phase;
                if error.is_some() {
                    status.error = error;
                }
                status.progress.message = phase_message(phase);
                rs.last_ts = ts;
            }
            (
                Record::StepStarted {
                    index, preimages, ..
                },
                Some(rs),
            ) => {
                let entry = rs.preimages.entry(index).or_default();
                for p in preimages {
                    if !entry.contains(&p) {
                        entry.push(p);
                    }
                }
                if let Some(c) = status.changes.get_mut(index as usize) {
                    c.state = ChangeState::Running;
                }
                status.progress.current = index + 1;
                if live {
                    status.progress.message = step_name(index, &rs.plan);
                }
            }
            (
                Record::StepDone {
                    index,
                    changed,
                    message,
                    ..
                },
                Some(rs),
            ) => {
                if rs.done.insert(index) {
                    if changed {
                        status.counts.changed += 1;
                    } else {
                        status.counts.unchanged += 1;
                    }
                }
                if let Some(c) = status.changes.get_mut(index as usize) {
                    c.state = if changed {
                        ChangeState::Changed
                    } else {
                        ChangeState::Unchanged
                    };
                    c.message = message;
                    c.duration_ms = Some(ts.saturating_sub(rs.last_ts));
                }
                status.progress.current = index + 1;
                if live {
                    status.progress.message = step_name(index, &rs.plan);
                }
                rs.last_ts = ts;
            }
            (Record::StepFailed { index, error, .. }, Some(rs)) => {
                if let Some(c) = status.changes.get_mut(index as usize) {
                    c.state = ChangeState::Failed;
                    c.message = error.detail.clone();
                    c.duration_ms = Some(ts.saturating_sub(rs.last_ts));
                }
                status.error = Some(error);
                rs.last_ts = ts;
            }
            (Record::StepAbandoned { index, .. }, Some(rs)) => {
                rs.preimages.remove(&index);
                if let Some(c) = status.changes.get_mut(index as usize) {
                    c.state = ChangeState::Pending;
                }
            }
            (Record::StepRolledBack { index, .. }, Some(rs)) => {
                if rs.rolled_back.insert(index) {
                    status.counts.rolled_back += 1;
                }
                if let Some(c) = status.changes.get_mut(index as usize) {
                    c.state = ChangeState::RolledBack;
                }
                if live {
                    status.progress.message = format!("rolled back {}", step_name(index, &rs.plan));
                }
                rs.last_ts = ts;
            }
            (Record::DaemonReloaded { rollback, .. }, Some(rs)) => {
                if rollback {
                    rs.reloaded.1 = true;
                } else {
                    rs.reloaded.0 = true;
                }
            }
            (
                Record::UnitRestarted {
                    unit,
                    rollback,
                    message,
                    ..
                },
                Some(rs),
            ) => {
                if rollback {
                    rs.restarted_rollback.insert(unit);
                } else {
                    rs.restarted.insert(unit);
                }
                status.progress.message = message;
            }
            (Record::RebootRequested { index, boot_id, .. }, Some(rs)) => {
                rs.reboot = Some((index, boot_id));
                status.rebooting = true;
            }
            (
                Record::CheckDone {
                    index,
                    passed,
                    message,
                    ..
                },
                Some(rs),
            ) => {
                if passed {
                    rs.checks_passed.insert(index);
                } else if let Some(check) = status.checks.get(index as usize) {
                    status.error = Some(ErrorInfo {
                        kind: ErrorKind::Verification,
                        step: Some(format!("verify[{index}] {} {}", check.kind, check.target)),
                        detail: message.clone(),
                    });
                }
                if let Some(c) = status.checks.get_mut(index as usize) {
                    c.state = if passed {
                        CheckState::Passed
                    } else {
                        CheckState::Failed
                    };
                    c.message = message;
                }
                status.progress.current = status.changes.len() as u32 + index + 1;
                status.progress.message = format!("verify[{index}]");
                rs.last_ts = ts;
            }
            (Record::CancelRequested { .. }, Some(rs)) => rs.cancel_requested = true,
            (Record::PlanFinished { phase, error, .. }, _) => {
                status.phase = phase;
                status.finished_at_ms = Some(ts);
                status.rebooting = false;
                if error.is_some() {
                    status.error = error;
                }
                status.progress.message = phase.to_string();
                for c in &mut status.changes {
                    if c.state == ChangeState::Pending || c.state == ChangeState::Running {
                        c.state = ChangeState::Skipped;
                    }
                }
                for c in &mut status.checks {
                    if c.state == CheckState::Pending || c.state == CheckState::Running {
                        c.state = CheckState::Skipped;
                    }
                }
                finished = true;
            }
            _ => {}
        }
        if finished {
            let phase = status.phase;
            self.runs.remove(&run);
            if let Some(doc) = self.docs.remove(&run)
                && phase != Phase::Succeeded
            {
                self.retained.insert(run, doc);
            }
            self.trim();
        }
    }

    /// Bounds memory: per-change results only for the newest finished plans, and at most
    /// `keep_plans` finished plans (plus retained plan documents for the newest failures).
    fn trim(&mut self) {
        let finished: Vec<u64> = self
            .plans
            .iter()
            .filter(|p| p.phase.is_terminal())
            .map(|p| p.run)
            .collect();
        if finished.len() > KEEP_FULL {
            let cut = finished[finished.len() - KEEP_FULL - 1];
            for p in &mut self.plans {
                if p.phase.is_terminal() && p.run <= cut && !p.changes.is_empty() {
                    p.changes = Vec::new();
                    p.checks = Vec::new();
                }
            }
        }
        if finished.len() > self.keep_plans {
            let drop_upto = finished[finished.len() - self.keep_plans - 1];
            self.plans
                .retain(|p| !(p.phase.is_terminal() && p.run <= drop_upto));
        }
        while self.retained.len() > KEEP_FULL {
            self.retained.pop_first();
        }
    }

    /// Sets a transient progress message (not journaled: "waiting for the dpkg lock").
    pub fn set_message(&mut self, run: u64, message: String) {
        if let Some(p) = self.plans.iter_mut().rev().find(|p| p.run == run) {
            p.progress.message = message;
        }
    }

    /// Marks a change as running (not journaled; a change with nothing to do never writes a
    /// `StepStarted`).
    pub fn set_running(&mut self, run: u64, index: u32) {
        if let Some(p) = self.plans.iter_mut().rev().find(|p| p.run == run) {
            if let Some(c) = p.changes.get_mut(index as usize)
                && c.state == ChangeState::Pending
            {
                c.state = ChangeState::Running;
            }
            p.progress.current = index + 1;
        }
    }

    /// The latest attempt of `id`.
    pub fn latest(&self, id: &str) -> Option<&PlanStatus> {
        self.plans.iter().rev().find(|p| p.id == id)
    }

    /// The latest attempt of `id` with this digest.
    pub fn find(&self, id: &str, digest: &str) -> Option<&PlanStatus> {
        self.plans
            .iter()
            .rev()
            .find(|p| p.id == id && p.digest == digest)
    }

    /// The status of a run.
    pub fn by_run(&self, run: u64) -> Option<&PlanStatus> {
        self.plans.iter().rev().find(|p| p.run == run)
    }

    /// Unfinished runs, oldest first.
    pub fn unfinished(&self) -> impl Iterator<Item = (&u64, &RunState)> {
        self.runs.iter()
    }

    /// The resume state of an unfinished run.
    pub fn run_state(&self, run: u64) -> Option<&RunState> {
        self.runs.get(&run)
    }

    /// The newest unfinished run accepted after `run`, if any (it supersedes `run`).
    pub fn newer_than(&self, run: u64) -> Option<&PlanStatus> {
        let newest = *self.runs.keys().next_back()?;
        (newest > run).then(|| self.by_run(newest)).flatten()
    }

    /// The canonical plan of a finished, unsuccessful run, kept for retries.
    pub fn retained_plan(&self, run: u64) -> Option<&PlanDoc> {
        self.retained.get(&run)
    }

    /// Every known plan, oldest first.
    pub fn plans(&self) -> &[PlanStatus] {
        &self.plans
    }

    /// The records that replace the journal when it is compacted (only valid when no run
    /// is unfinished).
    pub fn summary_records(&self) -> Vec<Record> {
        self.plans
            .iter()
            .filter(|p| p.phase.is_terminal())
            .map(|p| Record::Summary {
                status: Box::new(p.clone()),
                plan: self.retained.get(&p.run).cloned(),
            })
            .collect()
    }
}
