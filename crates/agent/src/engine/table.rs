//! The engine's state as a fold of journal records: replay at start-up and live updates go
//! through the same [`Table::apply`], so a restarted agent knows and reports exactly what it
//! knew before.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::journaled;
use super::state::*;
use super::transitions::{self, IllegalTransition};
use crate::journal::{
    ChangeSummary, CheckSummary, Entry, HeldBody, PlanDoc, Preimage, Record, StagedBody,
    UnitJobOutcome,
};
use inplace_base::units::{UnitBefore, UnitJob};
use inplace_base::{ErrorInfo, ErrorKind};
use inplace_plan::{Check, Limits, NodePath, Plan, PlanOptions, validate_document, validate_value};

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
    /// What those changes said they would do when they were announced, by change index.
    pub planned: BTreeMap<u32, Vec<String>>,
    /// Changes in their desired state.
    pub done: BTreeSet<u32>,
    /// Changes restored by rollback.
    pub rolled_back: BTreeSet<u32>,
    /// Changes rollback could not restore.
    pub rollback_failed: BTreeSet<u32>,
    /// Gates that passed.
    pub checks_passed: BTreeSet<u32>,
    /// Unit jobs (restarts, starts, stops; forward and rollback), in journal order.
    pub unit_jobs: Vec<super::units::JobRecord>,
    /// daemon-reload done (forward, rollback).
    pub reloaded: (bool, bool),
    /// The last reboot requested, not yet seen to have happened.
    pub reboot: Option<RebootRequest>,
    /// The last reboot change after which the node did reboot: changes before it are live.
    pub rebooted_at: Option<u32>,
    /// Somebody asked to cancel.
    pub cancel_requested: bool,
    /// Who asked to cancel and why ("by spiffe://x/updater: wrong plan"), as journaled.
    pub cancel_reason: String,
    /// How many times an agent started driving the run (its `ServiceManager` records).
    pub drives: u32,
    /// Timestamp of the last record of this run (step durations).
    pub last_ts: u64,
    /// The plan's managed set (`options.prune.set`).
    pub prune_set: Option<String>,
    /// The paths of the plan's own `file` changes (the set's members after it).
    pub members: Vec<String>,
    /// Package version patterns resolved for this run, by change index.
    pub versions: BTreeMap<u32, String>,
    /// The managed-set paths this run removes (`Some` once decided; appended to the plan
    /// as `absent` changes).
    pub pruned: Option<Vec<String>>,
    /// The contents staged beside their targets, by change index.
    pub staged: BTreeMap<u32, StagedBody>,
    /// The changes whose content their target held when the plan was accepted.
    pub held: BTreeSet<u32>,
    /// Staged or held changes whose content was gone when the journal was read back: they
    /// cannot be applied (the run fails at the first of them and rolls back).
    pub gone: BTreeSet<u32>,
}

/// A reboot a run asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebootRequest {
    /// The reboot change.
    pub index: u32,
    /// The boot id when it was first requested.
    pub boot_id: String,
    /// When it was first requested (Unix ms).
    pub requested_at_ms: u64,
}

impl RunState {
    /// True when some change of this run mutated the node.
    pub fn changed_anything(&self) -> bool {
        !self.preimages.is_empty()
    }

    /// The forward (not rollback) job record of `unit`, if any.
    pub fn forward_job(&self, unit: &str) -> Option<&super::units::JobRecord> {
        self.unit_jobs
            .iter()
            .rev()
            .find(|j| !j.rollback && j.unit == unit)
    }

    /// The rollback job record of `unit`, if any.
    pub fn rollback_job(&self, unit: &str) -> Option<&super::units::JobRecord> {
        self.unit_jobs
            .iter()
            .rev()
            .find(|j| j.rollback && j.unit == unit)
    }
}

/// A journaled plan document: the canonical plan, and the backup-store blob holding its
/// file contents when they were kept out of the document (`journal::bodies`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeptPlan {
    /// The run.
    pub run: u64,
    /// The canonical plan document (file contents empty when `bodies` is set).
    pub doc: PlanDoc,
    /// sha256 of the bodies blob.
    pub bodies: Option<String>,
    /// The contents staged beside their targets (not in `bodies`).
    pub staged: Vec<StagedBody>,
    /// The contents their targets held (not in `bodies`).
    pub held: Vec<HeldBody>,
}

/// Where a kept plan's file contents are read back from.
pub trait Bodies {
    /// A bodies blob, by sha256.
    fn blob(&self, sha: &str) -> Result<Vec<u8>, String>;
    /// The content `body` staged for `run`, verified against its sha256; `None` when it
    /// is gone.
    fn staged(&self, run: u64, body: &StagedBody) -> Option<Vec<u8>>;
    /// The content `body`'s target held, verified against its sha256; `None` when it no
    /// longer holds it.
    fn held(&self, body: &HeldBody) -> Option<Vec<u8>>;
}

/// Blobs read by a function, and no staged content (a reader without the node's files).
pub struct BlobsOnly<F>(F);

/// Contents read back from bodies blobs only, by `load`; staged contents count as gone.
pub fn blobs_only<F: Fn(&str) -> Result<Vec<u8>, String>>(load: F) -> BlobsOnly<F> {
    BlobsOnly(load)
}

impl<F: Fn(&str) -> Result<Vec<u8>, String>> Bodies for BlobsOnly<F> {
    fn blob(&self, sha: &str) -> Result<Vec<u8>, String> {
        (self.0)(sha)
    }

    fn staged(&self, _run: u64, _body: &StagedBody) -> Option<Vec<u8>> {
        None
    }

    fn held(&self, _body: &HeldBody) -> Option<Vec<u8>> {
        None
    }
}

impl KeptPlan {
    /// The complete plan document, and the changes whose staged or held content is gone
    /// (their content is empty in the document: they must not be applied).
    pub fn to_value(
        &self,
        bodies: &dyn Bodies,
    ) -> Result<(serde_json::Value, BTreeSet<u32>), String> {
        let mut value = self.doc.to_value();
        let apart: BTreeSet<u32> = self
            .staged
            .iter()
            .map(|s| s.index)
            .chain(self.held.iter().map(|h| h.index))
            .collect();
        if let Some(sha) = &self.bodies {
            let blob = bodies
                .blob(sha)
                .map_err(|e| format!("plan bodies {sha}: {e}"))?;
            crate::journal::bodies::fill(&mut value, &blob, &apart)?;
        }
        let mut gone = BTreeSet::new();
        let found = self
            .staged
            .iter()
            .map(|body| (body.index, bodies.staged(self.run, body)))
            .chain(self.held.iter().map(|body| (body.index, bodies.held(body))));
        for (index, content) in found {
            match content {
                Some(content) => crate::journal::bodies::put(&mut value, index, &content),
                None => {
                    gone.insert(index);
                }
            }
        }
        Ok((value, gone))
    }
}

/// All plans the agent knows, newest last.
#[derive(Debug, Default)]
pub struct Table {
    plans: Vec<PlanStatus>,
    runs: BTreeMap<u64, RunState>,
    /// The plan documents of unfinished runs.
    docs: BTreeMap<u64, KeptPlan>,
    retained: BTreeMap<u64, KeptPlan>,
    next_run: u64,
    /// How many finished plans to remember at all.
    pub keep_plans: usize,
    /// False while the journal is replayed: per-step progress messages are only built for
    /// live records (a replay of a million records would format them all for nothing).
    live: bool,
    /// The members of each managed set: what plans of the set wrote and did not remove.
    sets: BTreeMap<String, BTreeSet<String>>,
    /// Illegal phase changes found in the journal (see [`Table::illegal_transitions`]).
    illegal_transitions: u64,
    /// Staging not followed by its `PlanAccepted` (yet): run → (files, directories).
    staging: BTreeMap<u64, (Vec<NodePath>, Vec<NodePath>)>,
    /// The last succeeded plan, what drift is measured against.
    baseline: Option<Baseline>,
    /// The drift last journaled (`DriftFound`), until a `DriftCleared`.
    drift: Option<JournaledDrift>,
}

/// The last succeeded plan: its document and what its run resolved, so that the plan it
/// applied can be read back exactly (see [`Table::baseline`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Baseline {
    /// The plan document and where its contents are.
    pub kept: KeptPlan,
    /// Exact versions its run resolved, by change index.
    pub versions: BTreeMap<u32, String>,
    /// Managed-set paths its run removed.
    pub pruned: Vec<String>,
}

/// The drift the journal last recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournaledDrift {
    /// The baseline run it is measured against.
    pub run: u64,
    /// The drifted changes.
    pub changes: Vec<crate::journal::DriftNote>,
}

/// `plan` with a run's resolutions applied: exact package versions, and an `absent` change
/// for each path its managed set removes.
pub fn resolved_plan(plan: &Plan, versions: &BTreeMap<u32, String>, pruned: &[String]) -> Plan {
    let mut plan = plan.clone();
    for (index, version) in versions {
        if let Some(change) = plan.changes.get_mut(*index as usize)
            && let Some(resolved) = change.spec().resolved(version)
        {
            *change = resolved;
        }
    }
    for path in pruned {
        if let Ok(path) = inplace_plan::NodePath::parse(path) {
            plan.changes
                .push(inplace_plan::Change::Absent(inplace_plan::AbsentChange {
                    path,
                    restart_units: Vec::new(),
                }));
        }
    }
    plan
}

fn step_name(index: u32, plan: &Plan) -> String {
    match plan.changes.get(index as usize) {
        Some(c) => format!("changes[{index}] {} {}", c.kind(), c.target()),
        None => format!("changes[{index}]"),
    }
}

fn phase_message(phase: Phase) -> String {
    match phase {
        Phase::Pending => "accepted".into(),
        Phase::Preparing => "checking the plan against the node".into(),
        Phase::Applying => "applying changes".into(),
        Phase::Restarting => "restarting units".into(),
        Phase::Verifying => "running health gates".into(),
        Phase::RollingBack => "rolling back".into(),
        other => other.to_string(),
    }
}

/// Points "step i of n" at the change being applied now — the first one running, since a
/// batch announces several before it applies them one by one — else at `finished` (the
/// 1-based step that just ended). Every view (status, hook response, remote status,
/// sd_notify, the metric) reads this one number; with `live`, the message names that step.
fn point_at_step(status: &mut PlanStatus, live: bool, finished: Option<u32>) {
    let running = status
        .changes
        .iter()
        .find(|c| c.state == ChangeState::Running)
        .map(|c| c.index);
    let Some(index) = running.or(finished.and_then(|f| f.checked_sub(1))) else {
        return;
    };
    status.progress.current = index + 1;
    if live && let Some(c) = status.changes.get(index as usize) {
        status.progress.message = format!("changes[{index}] {} {}", c.kind, c.target);
    }
}

/// Appends an event to a run's news, keeping the newest [`MAX_RUN_EVENTS`].
fn push_event(status: &mut PlanStatus, seq: u64, at_ms: u64, message: String) {
    if status.events.len() >= MAX_RUN_EVENTS {
        status.events.remove(0);
    }
    status.events.push(RunEvent {
        seq,
        at_ms,
        message,
    });
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
            disruption: c.spec().disruption(),
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
    ///
    /// One arm per record kind, each folded by its own function; a record that changes a
    /// run's phase is checked against the phases' state machine first
    /// ([`transitions::check`]).
    pub fn apply_with_plan(&mut self, entry: Entry, plan: Option<Arc<Plan>>) {
        let Entry {
            seq, ts, record, ..
        } = entry;
        if let Err(illegal) = self.check_transition(&record)
            && !self.report_illegal(seq, ts, &illegal)
        {
            return;
        }
        let at = At { seq, ts };
        let note = record.note();
        match record {
            // The first record of a compacted journal: what it replaced is gone, and the
            // records after it say everything that was kept.
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
                bodies,
                staged,
                held,
                prune,
            } => {
                self.staging.remove(&run);
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
                    services: String::new(),
                    accepted_at_ms: ts,
                    started_at_ms: None,
                    finished_at_ms: None,
                    counts: Counts::default(),
                    events: Vec::new(),
                };
                self.accept(
                    status,
                    KeptPlan {
                        run,
                        doc,
                        bodies,
                        staged,
                        held,
                    },
                    changes,
                    checks,
                    plan,
                    prune,
                );
            }
            Record::Staging { run, paths, dirs } => {
                self.staging.insert(run, (paths, dirs));
            }
            Record::BodiesKept { run, bodies } => {
                if let Some(kept) = self.docs.get_mut(&run) {
                    kept.bodies = Some(bodies);
                    kept.staged.clear();
                    kept.held.clear();
                }
            }
            Record::SetMembers { set, paths } => {
                self.sets.insert(set, paths.into_iter().collect());
            }
            Record::Summary {
                status,
                plan,
                bodies,
                staged,
                held,
                versions,
                pruned,
            } => {
                let status = journaled::status_of(*status);
                self.next_run = self.next_run.max(status.run + 1);
                if let Some(doc) = plan {
                    let run = status.run;
                    let kept = KeptPlan {
                        run,
                        doc,
                        bodies,
                        staged,
                        held,
                    };
                    if status.phase == Phase::Succeeded {
                        self.baseline = Some(Baseline {
                            kept,
                            versions,
                            pruned,
                        });
                    } else {
                        self.retained.insert(run, kept);
                    }
                }
                self.plans.push(status);
            }
            Record::DriftFound { run, changes } => {
                self.drift = Some(JournaledDrift { run, changes });
            }
            Record::DriftCleared { .. } => self.drift = None,
            Record::Phase { run, phase, error } => {
                self.in_run(run, at, note, |f| f.phase(phase.into(), error));
            }
            Record::PlanFinished { run, phase, error } => {
                self.finished(run, at, phase.into(), error);
            }
            Record::VersionResolved {
                run,
                index,
                version,
            } => self.in_run(run, at, note, |f| f.version_resolved(index, version)),
            Record::PruneResolved { run, paths } => {
                self.in_run(run, at, note, |f| f.prune_resolved(paths));
            }
            Record::StepStarted {
                run,
                index,
                preimages,
                planned,
            } => self.in_run(run, at, note, |f| f.step_started(index, preimages, planned)),
            Record::StepDone {
                run,
                index,
                changed,
                message,
            } => self.in_run(run, at, note, |f| f.step_done(index, changed, message)),
            // What a change's commands printed is for readers of the journal (`inplace-agent
            // journal`, `/v1/journal`); the status says what the change did in its
            // `StepDone` or `StepFailed` message.
            Record::StepOutput { .. } => {}
            Record::StepFailed { run, index, error } => {
                self.in_run(run, at, note, |f| f.step_failed(index, error));
            }
            Record::StepAbandoned { run, index } => {
                self.in_run(run, at, note, |f| f.step_abandoned(index));
            }
            Record::StepRolledBack { run, index } => {
                self.in_run(run, at, note, |f| f.step_rolled_back(index));
            }
            Record::StepRollbackFailed { run, index, error } => {
                self.in_run(run, at, note, |f| f.step_rollback_failed(index, error));
            }
            Record::DaemonReloaded { run, rollback } => {
                self.in_run(run, at, note, |f| f.daemon_reloaded(rollback));
            }
            Record::UnitRestarted {
                run,
                unit,
                rollback,
                skipped,
                message,
            } => self.in_run(run, at, note, |f| {
                f.unit_restarted(unit, rollback, skipped, message)
            }),
            Record::UnitJobStarted {
                run,
                unit,
                job,
                rollback,
                before,
            } => self.in_run(run, at, note, |f| {
                f.unit_job_started(unit, job, rollback, before)
            }),
            Record::UnitJobDone {
                run,
                unit,
                job,
                rollback,
                outcome,
                message,
            } => self.in_run(run, at, note, |f| {
                f.unit_job_done(unit, job, rollback, outcome, message)
            }),
            Record::SystemdUnreachable { run, message } => {
                self.in_run(run, at, note, |f| f.status.progress.message = message);
            }
            Record::ServiceManager { run, description } => {
                self.in_run(run, at, note, |f| f.service_manager(description));
            }
            Record::RebootRequested {
                run,
                index,
                boot_id,
            } => self.in_run(run, at, note, |f| f.reboot_requested(index, boot_id)),
            Record::CheckDone {
                run,
                index,
                passed,
                message,
            } => self.in_run(run, at, note, |f| f.check_done(index, passed, message)),
            Record::CancelRequested { run, reason, by } => {
                self.in_run(run, at, note, |f| f.cancel_requested(&reason, &by));
            }
        }
    }

    /// Reports an illegal phase change found in the journal: a warning naming the record,
    /// a note in the run's events (so `status` shows it), and [`Table::illegal_transitions`].
    /// Returns whether to fold the record anyway. A move out of a terminal phase is not
    /// folded: the run's end is final, and folding it would have the runner resume a run
    /// that ended. Any other is folded as written: the agent that wrote it went on from
    /// there, and the records after it say so.
    fn report_illegal(&mut self, seq: u64, ts: u64, illegal: &IllegalTransition) -> bool {
        let fold = !illegal.from.is_some_and(Phase::is_terminal);
        let what = if fold {
            "folded as written"
        } else {
            "ignored: the run had ended"
        };
        tracing::warn!(
            seq,
            run = illegal.run,
            from = illegal.from.map(|p| p.to_string()).unwrap_or_default(),
            to = %illegal.to,
            "journal record {seq}: {illegal}; {what}"
        );
        self.illegal_transitions += 1;
        if let Some(status) = self.plans.iter_mut().rev().find(|p| p.run == illegal.run) {
            push_event(
                status,
                seq,
                ts,
                format!(
                    "journal record {seq}: {illegal}; {what} (a bug of the agent that wrote it)"
                ),
            );
        }
        fold
    }

    /// Checks the phase change `record` would make against the phases' state machine
    /// ([`transitions::check`]), from the phase its run is in now.
    pub fn check_transition(&self, record: &Record) -> Result<(), IllegalTransition> {
        transitions::check(record, |run| self.by_run(run).map(|s| s.phase))
    }

    /// How many illegal phase changes the journal had (each reported as it was folded).
    pub fn illegal_transitions(&self) -> u64 {
        self.illegal_transitions
    }

    /// Folds a record of an unfinished run: the run's news goes to its events, then `fold`
    /// updates its status and resume state. A record of a run compaction dropped changes
    /// nothing; nor does one of a run that ended (its end is final: a cancel that arrived
    /// as the run ended, say).
    fn in_run(&mut self, run: u64, at: At, note: Option<String>, fold: impl FnOnce(&mut RunFold)) {
        let live = self.live;
        let Some(status) = self.plans.iter_mut().rev().find(|p| p.run == run) else {
            return;
        };
        if let Some(message) = note {
            push_event(status, at.seq, at.ts, message);
        }
        let Some(rs) = self.runs.get_mut(&run) else {
            return;
        };
        fold(&mut RunFold {
            status,
            rs,
            at,
            live,
        });
    }

    /// `PlanFinished`: the run ends. Its managed set learns what it holds now, what never
    /// ran is Skipped, and the run's resume state goes (its plan is kept for a retry when it
    /// did not succeed).
    fn finished(&mut self, run: u64, at: At, phase: Phase, error: Option<ErrorInfo>) {
        let Some(pos) = self.plans.iter().rposition(|p| p.run == run) else {
            return;
        };
        if let Some(rs) = self.runs.get(&run)
            && let Some(set) = &rs.prune_set
        {
            let members = self.sets.entry(set.clone()).or_default();
            match phase {
                // The node holds exactly this plan's files of the set.
                Phase::Succeeded => {
                    *members = rs.members.iter().cloned().collect();
                }
                // Everything this run did was undone.
                Phase::RolledBack => {}
                // Partly applied: the set may hold both plans' files.
                _ => members.extend(rs.members.iter().cloned()),
            }
        }
        let status = &mut self.plans[pos];
        status.phase = phase;
        status.finished_at_ms = Some(at.ts);
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
        let rs = self.runs.remove(&run);
        if let Some(doc) = self.docs.remove(&run) {
            if phase == Phase::Succeeded {
                // The node now is what this plan says: drift is measured against it (the
                // next check journals that drift from an older plan is over).
                let (versions, pruned) = rs
                    .map(|rs| (rs.versions, rs.pruned.unwrap_or_default()))
                    .unwrap_or_default();
                self.baseline = Some(Baseline {
                    kept: doc,
                    versions,
                    pruned,
                });
            } else {
                self.retained.insert(run, doc);
            }
        }
        self.trim();
    }

    /// Ends the replay: from now on records are live, and unfinished runs get their plan
    /// (read back from its document; `load` reads a bodies blob by sha256) and the progress
    /// message their last record implies.
    pub fn finish_replay(&mut self, bodies: &dyn Bodies) {
        self.live = true;
        let runs: Vec<u64> = self.runs.keys().copied().collect();
        for run in runs {
            let parsed = match self.docs.get(&run) {
                Some(kept) => kept.to_value(bodies).and_then(|(v, gone)| {
                    validate_document(v, "journal", &Limits::replay())
                        .map(|p| (p, gone))
                        .map_err(|e| e.to_string())
                }),
                None => continue,
            };
            let plan = match parsed {
                Ok((p, gone)) => {
                    if let Some(rs) = self.runs.get_mut(&run) {
                        rs.gone = gone;
                    }
                    Arc::new(p)
                }
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
            let mut plan = plan;
            if let Some(rs) = self.runs.get_mut(&run) {
                if !rs.versions.is_empty() || rs.pruned.as_ref().is_some_and(|p| !p.is_empty()) {
                    plan = Arc::new(resolved_plan(
                        &plan,
                        &rs.versions,
                        rs.pruned.as_deref().unwrap_or_default(),
                    ));
                }
                rs.plan = plan.clone();
            }
            if let Some(status) = self.plans.iter_mut().rev().find(|p| p.run == run) {
                status.progress.message = match status.phase {
                    Phase::Applying if status.rebooting => reboot_message(status),
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
        kept: KeptPlan,
        mut changes: Vec<ChangeSummary>,
        mut checks: Vec<CheckSummary>,
        plan: Option<Arc<Plan>>,
        prune: Option<String>,
    ) {
        let run = status.run;
        self.next_run = self.next_run.max(run + 1);
        // Records written before summaries existed (or an empty plan): read the plan now.
        let mut plan = plan;
        // (A plan whose bodies are in a blob always has summaries; it is read at the end of
        // the replay if it is unfinished.)
        if plan.is_none()
            && kept.bodies.is_none()
            && kept.staged.is_empty()
            && kept.held.is_empty()
            && (self.live || (changes.is_empty() && checks.is_empty()))
        {
            match validate_value(&kept.doc.to_value(), "journal", &Limits::replay()) {
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
        let members: Vec<String> = if prune.is_some() {
            changes
                .iter()
                .filter(|c| c.kind == inplace_plan::ChangeKind::File)
                .map(|c| c.target.clone())
                .collect()
        } else {
            Vec::new()
        };
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
                planned: BTreeMap::new(),
                done: BTreeSet::new(),
                rolled_back: BTreeSet::new(),
                rollback_failed: BTreeSet::new(),
                checks_passed: BTreeSet::new(),
                unit_jobs: Vec::new(),
                reloaded: (false, false),
                reboot: None,
                rebooted_at: None,
                cancel_requested: false,
                cancel_reason: String::new(),
                drives: 0,
                last_ts,
                prune_set: prune,
                members,
                versions: BTreeMap::new(),
                pruned: None,
                staged: kept.staged.iter().map(|s| (s.index, s.clone())).collect(),
                held: kept.held.iter().map(|h| h.index).collect(),
                gone: BTreeSet::new(),
            },
        );
        self.docs.insert(run, kept);
        self.plans.push(status);
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
                    p.events = Vec::new();
                }
            }
        }
        if finished.len() > self.keep_plans {
            let drop_upto = finished[finished.len() - self.keep_plans - 1];
            // The baseline's status stays: compaction carries its plan in its summary.
            let baseline = self.baseline.as_ref().map(|b| b.kept.run);
            self.plans.retain(|p| {
                !(p.phase.is_terminal() && p.run <= drop_upto) || Some(p.run) == baseline
            });
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
        let live = self.live;
        if let Some(p) = self.plans.iter_mut().rev().find(|p| p.run == run) {
            if let Some(c) = p.changes.get_mut(index as usize)
                && c.state == ChangeState::Pending
            {
                c.state = ChangeState::Running;
            }
            point_at_step(p, live, Some(index + 1));
        }
    }

    /// Marks a health gate as being polled (not journaled: its `CheckDone` says how it
    /// ended), so step i of n points at it.
    pub fn set_check_running(&mut self, run: u64, index: u32) {
        if let Some(p) = self.plans.iter_mut().rev().find(|p| p.run == run) {
            if let Some(c) = p.checks.get_mut(index as usize)
                && c.state == CheckState::Pending
            {
                c.state = CheckState::Running;
                p.progress.message = format!("verify[{index}] {} {}", c.kind, c.target);
            }
            p.progress.current = p.changes.len() as u32 + index + 1;
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

    /// The digests of the runs of `id`, newest first (with repeats).
    pub fn digests_of<'a>(&'a self, id: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.plans
            .iter()
            .rev()
            .filter(move |p| p.id == id)
            .map(|p| p.digest.as_str())
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

    /// Staging whose `PlanAccepted` never came (the agent stopped while accepting a plan):
    /// run → (files, directories) to remove.
    pub fn abandoned_staging(&self) -> &BTreeMap<u64, (Vec<NodePath>, Vec<NodePath>)> {
        &self.staging
    }

    /// The canonical plan of a finished, unsuccessful run, kept for retries.
    pub fn retained_plan(&self, run: u64) -> Option<&KeptPlan> {
        self.retained.get(&run)
    }

    /// The bodies blobs the plans kept for retries need (what compaction must not remove).
    pub fn retained_bodies(&self) -> std::collections::HashSet<String> {
        self.retained
            .values()
            .chain(self.baseline.as_ref().map(|b| &b.kept))
            .filter_map(|k| k.bodies.clone())
            .collect()
    }

    /// The last succeeded plan, if the journal still has it.
    pub fn baseline(&self) -> Option<&Baseline> {
        self.baseline.as_ref()
    }

    /// The drift last journaled against the baseline, if any.
    pub fn journaled_drift(&self) -> Option<&JournaledDrift> {
        self.drift.as_ref()
    }

    /// Every known plan, oldest first.
    pub fn plans(&self) -> &[PlanStatus] {
        &self.plans
    }

    /// The records that replace the journal when it is compacted (only valid when no run
    /// is unfinished).
    pub fn summary_records(&self) -> Vec<Record> {
        let sets = self.sets.iter().map(|(set, paths)| Record::SetMembers {
            set: set.clone(),
            paths: paths.iter().cloned().collect(),
        });
        // Staging whose plan was never accepted: its files are still to be removed.
        let staging = self
            .staging
            .iter()
            .map(|(run, (paths, dirs))| Record::Staging {
                run: *run,
                paths: paths.clone(),
                dirs: dirs.clone(),
            });
        sets.chain(staging)
            .chain(
                self.plans
                    .iter()
                    .filter(|p| p.phase.is_terminal())
                    .map(|p| {
                        let baseline = self.baseline.as_ref().filter(|b| b.kept.run == p.run);
                        let kept = self.retained.get(&p.run).or(baseline.map(|b| &b.kept));
                        Record::Summary {
                            status: Box::new(journaled::summary_of(p)),
                            plan: kept.map(|k| k.doc.clone()),
                            bodies: kept.and_then(|k| k.bodies.clone()),
                            staged: kept.map(|k| k.staged.clone()).unwrap_or_default(),
                            held: kept.map(|k| k.held.clone()).unwrap_or_default(),
                            versions: baseline.map(|b| b.versions.clone()).unwrap_or_default(),
                            pruned: baseline.map(|b| b.pruned.clone()).unwrap_or_default(),
                        }
                    }),
            )
            .chain(self.drift.as_ref().map(|d| Record::DriftFound {
                run: d.run,
                changes: d.changes.clone(),
            }))
            .collect()
    }

    /// The members of managed set `set` (empty when unknown).
    pub fn set_members(&self, set: &str) -> Vec<String> {
        self.sets
            .get(set)
            .map(|m| m.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// Where a record sits in the journal.
#[derive(Debug, Clone, Copy)]
struct At {
    seq: u64,
    ts: u64,
}

/// The fold of one record of an unfinished run: its status and its resume state. One
/// function per record kind.
struct RunFold<'a> {
    status: &'a mut PlanStatus,
    rs: &'a mut RunState,
    at: At,
    /// False while the journal is replayed (see [`Table`]'s `live`).
    live: bool,
}

impl RunFold<'_> {
    /// `Phase` (already checked against the state machine).
    fn phase(&mut self, phase: Phase, error: Option<ErrorInfo>) {
        let status = &mut *self.status;
        if status.phase == Phase::Pending && phase != Phase::Pending {
            status.started_at_ms = Some(self.at.ts);
        }
        status.phase = phase;
        if error.is_some() {
            status.error = error;
        }
        status.progress.message = phase_message(phase);
        self.rs.last_ts = self.at.ts;
    }

    /// `VersionResolved`: the change's target and the run's plan name the exact version.
    fn version_resolved(&mut self, index: u32, version: String) {
        if let Some(c) = self.status.changes.get_mut(index as usize)
            && let Some((name, _)) = c.target.split_once('=')
        {
            c.target = format!("{name}={version}");
        }
        let rs = &mut *self.rs;
        if self.live {
            let mut versions = BTreeMap::new();
            versions.insert(index, version.clone());
            rs.plan = Arc::new(resolved_plan(&rs.plan, &versions, &[]));
        }
        rs.versions.insert(index, version);
        rs.last_ts = self.at.ts;
    }

    /// `PruneResolved`: the paths the managed set removes become `absent` changes after
    /// the plan's own (once: the first decision stands).
    fn prune_resolved(&mut self, paths: Vec<String>) {
        let (status, rs) = (&mut *self.status, &mut *self.rs);
        if rs.pruned.is_none() {
            let first = status.changes.len() as u32;
            for (i, path) in paths.iter().enumerate() {
                status.changes.push(ChangeStatus {
                    index: first + i as u32,
                    kind: inplace_plan::ChangeKind::Absent,
                    target: path.clone(),
                    state: ChangeState::Pending,
                    message: String::new(),
                    disruption: inplace_plan::Disruption::None,
                    duration_ms: None,
                });
            }
            status.counts.total = status.changes.len() as u32;
            status.progress.total += paths.len() as u32;
            if self.live {
                rs.plan = Arc::new(resolved_plan(&rs.plan, &BTreeMap::new(), &paths));
            }
            rs.pruned = Some(paths);
        }
        rs.last_ts = self.at.ts;
    }

    /// `StepStarted`: the change is running; its pre-images (deduplicated: a resumed change
    /// announces only what it had not captured) are what rollback restores.
    fn step_started(&mut self, index: u32, preimages: Vec<Preimage>, planned: Vec<String>) {
        let rs = &mut *self.rs;
        if !planned.is_empty() {
            rs.planned.insert(index, planned);
        }
        let entry = rs.preimages.entry(index).or_default();
        for p in preimages {
            if !entry.contains(&p) {
                entry.push(p);
            }
        }
        if let Some(c) = self.status.changes.get_mut(index as usize) {
            c.state = ChangeState::Running;
        }
        point_at_step(self.status, self.live, Some(index + 1));
    }

    /// `StepDone`: the change is in its desired state (counted once, also when a resumed
    /// run says it again); a reboot change done means the node came back.
    fn step_done(&mut self, index: u32, changed: bool, message: String) {
        let (status, rs, at) = (&mut *self.status, &mut *self.rs, self.at);
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
            c.duration_ms = Some(at.ts.saturating_sub(rs.last_ts));
        }
        point_at_step(status, self.live, Some(index + 1));
        rs.last_ts = at.ts;
        let is_reboot = status
            .changes
            .get(index as usize)
            .is_some_and(|c| c.kind == inplace_plan::ChangeKind::Reboot);
        if is_reboot {
            status.rebooting = false;
            rs.reboot = None;
            if changed {
                rs.rebooted_at = Some(index);
                let said = status
                    .changes
                    .get(index as usize)
                    .map(|c| format!("changes[{index}]: {}", c.message))
                    .unwrap_or_default();
                push_event(status, at.seq, at.ts, said);
            }
        }
    }

    /// `StepFailed`: the change failed; its error is the run's.
    fn step_failed(&mut self, index: u32, error: ErrorInfo) {
        let (status, rs) = (&mut *self.status, &mut *self.rs);
        if let Some(c) = status.changes.get_mut(index as usize) {
            c.state = ChangeState::Failed;
            c.message = error.detail.clone();
            c.duration_ms = Some(self.at.ts.saturating_sub(rs.last_ts));
        }
        status.progress.current = index + 1;
        status.error = Some(error);
        rs.last_ts = self.at.ts;
    }

    /// `StepAbandoned`: announced, never touched; it is pending again, with nothing to
    /// restore.
    fn step_abandoned(&mut self, index: u32) {
        self.rs.preimages.remove(&index);
        self.rs.planned.remove(&index);
        if let Some(c) = self.status.changes.get_mut(index as usize) {
            c.state = ChangeState::Pending;
        }
        point_at_step(self.status, self.live, None);
    }

    /// `StepRolledBack`: restored from its pre-images.
    fn step_rolled_back(&mut self, index: u32) {
        let (status, rs) = (&mut *self.status, &mut *self.rs);
        if rs.rolled_back.insert(index) {
            status.counts.rolled_back += 1;
        }
        rs.rollback_failed.remove(&index);
        if let Some(c) = status.changes.get_mut(index as usize) {
            c.state = ChangeState::RolledBack;
        }
        if self.live {
            status.progress.message = format!("rolled back {}", step_name(index, &rs.plan));
        }
        rs.last_ts = self.at.ts;
    }

    /// `StepRollbackFailed`: rollback could not restore the change.
    fn step_rollback_failed(&mut self, index: u32, error: ErrorInfo) {
        let (status, rs) = (&mut *self.status, &mut *self.rs);
        rs.rollback_failed.insert(index);
        if let Some(c) = status.changes.get_mut(index as usize) {
            c.state = ChangeState::RollbackFailed;
            c.message = error.detail;
        }
        if self.live {
            status.progress.message = format!("could not roll back {}", step_name(index, &rs.plan));
        }
        rs.last_ts = self.at.ts;
    }

    /// `DaemonReloaded`, forward or during rollback (each is done once per run).
    fn daemon_reloaded(&mut self, rollback: bool) {
        self.status.progress.message = format!(
            "systemd reloaded unit files{}",
            if rollback { " (rollback)" } else { "" }
        );
        if rollback {
            self.rs.reloaded.1 = true;
        } else {
            self.rs.reloaded.0 = true;
        }
    }

    /// `UnitRestarted`, written by earlier versions: a restart, done or skipped.
    fn unit_restarted(&mut self, unit: String, rollback: bool, skipped: bool, message: String) {
        self.rs.unit_jobs.push(super::units::JobRecord {
            unit,
            job: inplace_base::units::UnitJob::Restart,
            rollback,
            before: Default::default(),
            outcome: Some(if skipped {
                UnitJobOutcome::Skipped
            } else {
                UnitJobOutcome::Done
            }),
            message: message.clone(),
            queued: !skipped,
        });
        self.status.progress.message = message;
    }

    /// `UnitJobStarted`: a job is about to be queued (with the unit's state before it).
    fn unit_job_started(&mut self, unit: String, job: UnitJob, rollback: bool, before: UnitBefore) {
        self.status.progress.message = format!(
            "{} {unit}{}",
            match job {
                UnitJob::Start => "starting",
                UnitJob::Stop => "stopping",
                UnitJob::Restart => "restarting",
            },
            if rollback { " (rollback)" } else { "" }
        );
        self.rs.unit_jobs.push(super::units::JobRecord {
            unit,
            job,
            rollback,
            before,
            outcome: None,
            message: String::new(),
            queued: true,
        });
    }

    /// `UnitJobDone`: ends the open job of the unit, or records one that was never queued
    /// (skipped).
    fn unit_job_done(
        &mut self,
        unit: String,
        job: UnitJob,
        rollback: bool,
        outcome: UnitJobOutcome,
        message: String,
    ) {
        let open = self
            .rs
            .unit_jobs
            .iter_mut()
            .rev()
            .find(|j| j.unit == unit && j.rollback == rollback && j.outcome.is_none());
        self.status.progress.message = message.clone();
        match open {
            Some(j) => {
                j.outcome = Some(outcome);
                j.message = message;
            }
            None => self.rs.unit_jobs.push(super::units::JobRecord {
                unit,
                job,
                rollback,
                before: Default::default(),
                outcome: Some(outcome),
                message,
                queued: false,
            }),
        }
    }

    /// `ServiceManager`: journaled each time an agent (re)starts driving the run; a second
    /// one means it restarted in the middle and resumed.
    fn service_manager(&mut self, description: String) {
        let status = &mut *self.status;
        self.rs.drives += 1;
        if self.rs.drives > 1 {
            let message = format!(
                "the agent restarted; the run resumes in {} at step {}/{}",
                status.phase, status.progress.current, status.progress.total
            );
            push_event(status, self.at.seq, self.at.ts, message);
        }
        status.services = description;
    }

    /// `RebootRequested`: the run waits for the node to come back. Asked again from the
    /// same boot (after a restart of the agent), the first request time stays, so the step
    /// timeout is not extended.
    fn reboot_requested(&mut self, index: u32, boot_id: String) {
        let (status, rs) = (&mut *self.status, &mut *self.rs);
        let same = rs
            .reboot
            .as_ref()
            .is_some_and(|r| r.index == index && r.boot_id == boot_id);
        if !same {
            rs.reboot = Some(RebootRequest {
                index,
                boot_id,
                requested_at_ms: self.at.ts,
            });
        }
        status.rebooting = true;
        if let Some(c) = status.changes.get_mut(index as usize) {
            c.state = ChangeState::Running;
        }
        point_at_step(status, false, Some(index + 1));
        status.progress.message = reboot_message(status);
    }

    /// `CheckDone`: a gate passed, or failed (its failure is the run's error).
    fn check_done(&mut self, index: u32, passed: bool, message: String) {
        let (status, rs) = (&mut *self.status, &mut *self.rs);
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
        rs.last_ts = self.at.ts;
    }

    /// `CancelRequested`: honoured by the runner at the next step boundary.
    fn cancel_requested(&mut self, reason: &str, by: &str) {
        self.rs.cancel_requested = true;
        self.rs.cancel_reason = match (by.is_empty(), reason.is_empty()) {
            (true, true) => String::new(),
            (false, true) => format!(" by {by}"),
            (true, false) => format!(": {reason}"),
            (false, false) => format!(" by {by}: {reason}"),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::state::{HookStatus, RETRY_IN_PROGRESS, RETRY_REBOOTING};
    use inplace_plan::parse_plan;

    fn entry(seq: u64, ts: u64, record: Record) -> Entry {
        Entry {
            seq,
            ts,
            record,
            offset: 0,
            hash: [0; 32],
        }
    }

    fn accepted(plan: &Plan) -> Record {
        let (changes, checks) = summaries(plan);
        Record::PlanAccepted {
            run: 1,
            id: plan.id.clone(),
            digest: plan.digest(),
            attempt: 1,
            source: "cli".into(),
            plan: PlanDoc::from_value(&plan.canonical_json()),
            changes,
            checks,
            bodies: None,
            staged: Vec::new(),
            held: Vec::new(),
            prune: plan.options.prune.clone(),
        }
    }

    #[test]
    fn managed_set_members_follow_finished_plans_and_survive_compaction() {
        let plan = parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: p\noptions: {prune: {set: s}}\nchanges:\n  - file: {path: /etc/kubernetes/a, content: x}\n  - file: {path: /etc/kubernetes/b, content: y}\n",
            "test",
            &Limits::default(),
        )
        .expect("plan");
        let mut table = Table::new(10);
        table.apply(entry(1, 1, accepted(&plan)));
        assert!(table.set_members("s").is_empty());
        table.apply(entry(
            2,
            2,
            Record::PruneResolved {
                run: 1,
                paths: vec!["/etc/kubernetes/old".into()],
            },
        ));
        let status = table.by_run(1).unwrap();
        assert_eq!(status.changes.len(), 3, "the removal is the third change");
        assert_eq!(status.changes[2].kind, inplace_plan::ChangeKind::Absent);
        table.apply(entry(
            3,
            3,
            Record::PlanFinished {
                run: 1,
                phase: Phase::Succeeded.into(),
                error: None,
            },
        ));
        assert_eq!(
            table.set_members("s"),
            ["/etc/kubernetes/a", "/etc/kubernetes/b"]
        );
        // Compaction writes the members; a table built from its records knows them.
        let records = table.summary_records();
        assert!(matches!(&records[0], Record::SetMembers { set, .. } if set == "s"));
        let mut compacted = Table::new(10);
        for (i, r) in records.into_iter().enumerate() {
            compacted.apply(entry(i as u64 + 1, 10, r));
        }
        assert_eq!(compacted.set_members("s"), table.set_members("s"));
    }

    #[test]
    fn a_reboot_asks_capi_to_come_back_later_until_the_node_is_back() {
        let plan = parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nchanges:\n  - file: {path: /etc/kubernetes/a, content: x}\n  - reboot: {reason: kernel}\n",
            "test",
            &Limits::default(),
        )
        .expect("plan");
        let mut table = Table::new(10);
        let records = [
            accepted(&plan),
            Record::Phase {
                run: 1,
                phase: Phase::Applying.into(),
                error: None,
            },
            Record::RebootRequested {
                run: 1,
                index: 1,
                boot_id: "b1".into(),
            },
        ];
        for (i, r) in records.into_iter().enumerate() {
            table.apply(entry(i as u64 + 1, 1000 + i as u64, r));
        }
        let status = table.by_run(1).unwrap();
        assert!(status.rebooting);
        let hook = status.hook_response();
        assert_eq!(hook.status, HookStatus::Success);
        assert_eq!(hook.retry_after_seconds, RETRY_REBOOTING);
        assert_eq!(
            hook.message,
            "plan p: Applying step 2/2: waiting for the node to reboot (changes[1] reboot kernel)"
        );
        assert_eq!(
            status.progress.message,
            "waiting for the node to reboot (changes[1] reboot kernel)"
        );
        assert_eq!(crate::status::api::current_plan(status, 0).step, 2);
        // A restarted agent (the journal replayed) says the same, not the change before.
        let mut replayed = Table::new(10);
        let records = [
            accepted(&plan),
            Record::Phase {
                run: 1,
                phase: Phase::Applying.into(),
                error: None,
            },
            Record::StepDone {
                run: 1,
                index: 0,
                changed: true,
                message: "write".into(),
            },
            Record::RebootRequested {
                run: 1,
                index: 1,
                boot_id: "b1".into(),
            },
        ];
        for (i, r) in records.into_iter().enumerate() {
            replayed.apply(entry(i as u64 + 1, 1000 + i as u64, r));
        }
        replayed.finish_replay(&blobs_only(|_| Err("no bodies in this test".into())));
        assert_eq!(
            replayed.by_run(1).unwrap().hook_response().message,
            "plan p: Applying step 2/2: waiting for the node to reboot (changes[1] reboot kernel)"
        );
        let request = table.run_state(1).unwrap().reboot.clone().unwrap();
        assert_eq!((request.index, request.requested_at_ms), (1, 1002));
        // Asked again from the same boot (after a restart of the agent): the first request
        // time stays, so the step timeout is not extended.
        table.apply(entry(
            4,
            5000,
            Record::RebootRequested {
                run: 1,
                index: 1,
                boot_id: "b1".into(),
            },
        ));
        assert_eq!(
            table
                .run_state(1)
                .unwrap()
                .reboot
                .as_ref()
                .unwrap()
                .requested_at_ms,
            1002
        );
        table.apply(entry(
            5,
            9000,
            Record::StepDone {
                run: 1,
                index: 1,
                changed: true,
                message: "the node rebooted".into(),
            },
        ));
        let status = table.by_run(1).unwrap();
        assert!(!status.rebooting);
        assert_eq!(
            status.hook_response().retry_after_seconds,
            RETRY_IN_PROGRESS
        );
        let rs = table.run_state(1).unwrap();
        assert_eq!(rs.rebooted_at, Some(1));
        assert!(rs.reboot.is_none());
    }

    /// One step numbering (issue 15): while a batch of announced changes is applied, step
    /// i of n is the change being applied, and the hook message, the status socket's
    /// `current.step` and `progress` (the remote status, sd_notify, the metric) agree.
    #[test]
    fn step_i_of_n_is_the_change_being_applied_everywhere() {
        let plan = parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nchanges:\n  - file: {path: /etc/kubernetes/a, content: x}\n  - file: {path: /etc/kubernetes/b, content: x}\n  - file: {path: /etc/kubernetes/c, content: x}\nverify:\n  - command: {argv: [\"true\"]}\n",
            "test",
            &Limits::default(),
        )
        .expect("plan");
        let mut table = Table::new(10);
        table.finish_replay(&blobs_only(|_| Err("no bodies".into())));
        let mut seq = 0;
        let mut apply = |table: &mut Table, r: Record| {
            seq += 1;
            table.apply(entry(seq, 1000 + seq, r));
        };
        apply(&mut table, accepted(&plan));
        for phase in [Phase::Preparing, Phase::Applying] {
            apply(
                &mut table,
                Record::Phase {
                    run: 1,
                    phase: phase.into(),
                    error: None,
                },
            );
        }
        for index in 0..3 {
            table.set_running(1, index);
            apply(
                &mut table,
                Record::StepStarted {
                    run: 1,
                    index,
                    preimages: Vec::new(),
                    planned: Vec::new(),
                },
            );
        }
        let agree = |table: &Table, step: u32, what: &str| {
            let s = table.by_run(1).unwrap();
            assert_eq!(s.progress.current, step, "{s:#?}");
            assert_eq!(s.progress.total, 4);
            assert_eq!(crate::status::api::current_plan(s, 0).step, step);
            let hook = s.hook_response().message;
            assert!(hook.contains(&format!("step {step}/4: {what}")), "{hook}");
        };
        agree(&table, 1, "changes[0] file /etc/kubernetes/a");
        for index in 0..3 {
            apply(
                &mut table,
                Record::StepDone {
                    run: 1,
                    index,
                    changed: true,
                    message: "write".into(),
                },
            );
            let next = (index + 1).min(2);
            agree(
                &table,
                next + 1,
                &format!(
                    "changes[{next}] file /etc/kubernetes/{}",
                    ["a", "b", "c"][next as usize]
                ),
            );
        }
        apply(
            &mut table,
            Record::Phase {
                run: 1,
                phase: Phase::Verifying.into(),
                error: None,
            },
        );
        table.set_check_running(1, 0);
        agree(&table, 4, "verify[0] command true");
        let s = table.by_run(1).unwrap();
        assert_eq!(
            crate::status::api::current_plan(s, 0)
                .running_check
                .map(|c| c.index),
            Some(0)
        );
    }

    /// Unit jobs, reloads and an agent restart are a run's events, in journal order, with
    /// the unit's InvocationID (issue 15: restarts were in the root-only journal only).
    #[test]
    fn restarts_reloads_and_resumes_are_events_of_the_run() {
        let plan = parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nchanges:\n  - file: {path: /etc/kubernetes/a, content: x, restartUnits: [kubelet.service]}\n",
            "test",
            &Limits::default(),
        )
        .expect("plan");
        let mut table = Table::new(10);
        let service = |description: &str| Record::ServiceManager {
            run: 1,
            description: description.into(),
        };
        let phase = |phase: Phase| Record::Phase {
            run: 1,
            phase: phase.into(),
            error: None,
        };
        let records = [
            accepted(&plan),
            service("systemd"),
            phase(Phase::Preparing),
            phase(Phase::Applying),
            phase(Phase::Restarting),
            service("systemd"),
            Record::DaemonReloaded {
                run: 1,
                rollback: false,
            },
            Record::UnitJobStarted {
                run: 1,
                unit: "kubelet.service".into(),
                job: inplace_base::units::UnitJob::Restart,
                rollback: false,
                before: inplace_base::units::UnitBefore {
                    active_state: "active".into(),
                    sub_state: "running".into(),
                    invocation_id: Some("0123456789abcdef0123456789abcdef".into()),
                },
            },
            Record::UnitJobDone {
                run: 1,
                unit: "kubelet.service".into(),
                job: inplace_base::units::UnitJob::Restart,
                rollback: false,
                outcome: crate::journal::UnitJobOutcome::Done,
                message: "restarted kubelet.service in 20 ms: unit is active/running, InvocationID fedcba987654".into(),
            },
        ];
        for (i, r) in records.into_iter().enumerate() {
            table.apply(entry(i as u64 + 1, 1000 + i as u64, r));
        }
        let events: Vec<(u64, &str)> = table
            .by_run(1)
            .unwrap()
            .events
            .iter()
            .map(|e| (e.seq, e.message.as_str()))
            .collect();
        assert_eq!(
            events,
            [
                (
                    6,
                    "the agent restarted; the run resumes in Restarting at step 0/1"
                ),
                (7, "systemd reloaded unit files"),
                (
                    8,
                    "restarting kubelet.service (it was active/running, InvocationID 0123456789ab)"
                ),
                (
                    9,
                    "restarted kubelet.service in 20 ms: unit is active/running, InvocationID fedcba987654"
                ),
            ]
        );
        assert!(
            table
                .by_run(1)
                .unwrap()
                .hook_response()
                .message
                .contains("restarted kubelet.service in 20 ms"),
            "the hook message says it too"
        );
    }

    /// Records of earlier versions, without the fields added since, still read.
    #[test]
    fn records_written_before_the_cancel_reason_and_the_planned_writes_still_read() {
        let old: Record = serde_json::from_str(r#"{"cancelRequested":{"run":3}}"#).unwrap();
        assert_eq!(
            old,
            Record::CancelRequested {
                run: 3,
                reason: String::new(),
                by: String::new()
            }
        );
        let old: Record =
            serde_json::from_str(r#"{"stepStarted":{"run":3,"index":0,"preimages":[]}}"#).unwrap();
        assert!(matches!(old, Record::StepStarted { planned, .. } if planned.is_empty()));
    }

    #[test]
    fn replay_reads_back_only_the_plans_of_unfinished_runs() {
        let plan = parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nchanges:\n  - file: {path: /etc/kubernetes/a, content: x}\n",
            "test",
            &Limits::default(),
        )
        .expect("plan");
        let mut table = Table::new(10);
        table.apply(entry(1, 1, accepted(&plan)));
        assert!(
            table.run_state(1).unwrap().plan.changes.is_empty(),
            "placeholder while replaying"
        );
        assert_eq!(
            table.by_run(1).unwrap().changes[0].target,
            "/etc/kubernetes/a"
        );
        table.finish_replay(&blobs_only(|_| Err("no bodies in this test".into())));
        assert_eq!(*table.run_state(1).unwrap().plan, plan);
    }
}
