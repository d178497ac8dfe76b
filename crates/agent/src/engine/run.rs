//! Driving one run through its phases. Every decision reads the run's state from the table
//! (the journal's fold), so the same code starts a fresh run and resumes one after a crash.
//! Unit jobs, daemon-reloads and reboots are in `run/services.rs`.

mod services;

use inplace_base::ErrorInfo;
use inplace_base::ErrorKind;
use inplace_base::time::now_ms;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use super::Shared;
use super::state::Phase;
use super::table::{RunState, check_name};
use crate::failpoint;
use crate::journal::backup::BlobBatch;
use crate::journal::{JournalError, Record};
use crate::steps::{self, StepError};
use inplace_plan::{Change, Plan};

/// Most changes announced with one journal sync.
const BATCH: usize = 64;

/// One change of a batch between its diff and its execution.
struct Work {
    index: u32,
    diff: steps::Diff,
    preimages: Vec<crate::journal::Preimage>,
    resumed: bool,
    /// What the change said it would do when it was announced before a restart.
    planned: Vec<String>,
    announced: bool,
    /// Its content was staged beside the target (the write is a rename).
    staged: Option<crate::journal::StagedBody>,
}

impl Work {
    /// Its one mutation is the write its content was staged for (a rename).
    fn is_staged_write(&self) -> bool {
        matches!((&self.staged, self.diff.mutations.as_slice()),
            (Some(body), [steps::Mutation::Write { path, .. }]) if *path == body.path)
    }
}

/// Renames not yet durable and the records of changes done that must wait for them.
#[derive(Default)]
struct Unsynced {
    /// A path per rename (its directory is synced).
    dirs: Vec<inplace_plan::NodePath>,
    /// The `StepDone` records, by change index.
    done: Vec<(u32, Record)>,
}

/// How the run must stop at a step boundary.
enum Stop {
    Cancelled,
    Superseded(String),
    TimedOut(u64),
    /// The agent is shutting down: leave the run unfinished; it resumes at the next start.
    Shutdown,
}

/// Why the run left its happy path.
enum Abort {
    /// A step or gate failed: roll back (if the plan says so) and end Failed/RolledBack.
    Failed(ErrorInfo),
    /// Stop at the boundary.
    Stop(Stop),
    /// The journal failed: nothing more can be recorded, so nothing more is done.
    Journal(JournalError),
}

impl From<JournalError> for Abort {
    fn from(e: JournalError) -> Abort {
        Abort::Journal(e)
    }
}

pub(super) struct Runner {
    shared: Arc<Shared>,
    /// The plan checked against the node (owners resolved), once per run.
    prepared: std::cell::RefCell<Option<steps::Prepared>>,
    /// The plan's artifacts are verified in the download cache (Preparing did it, or a
    /// resumed Applying did it again).
    fetched: std::cell::Cell<bool>,
}

impl Runner {
    pub(super) fn new(shared: Arc<Shared>) -> Runner {
        Runner {
            shared,
            prepared: std::cell::RefCell::new(None),
            fetched: std::cell::Cell::new(false),
        }
    }

    /// Checks the plan against the node now (owners, paths, supported kinds).
    fn admit(&self, plan: &Plan) -> Result<steps::Prepared, Abort> {
        if let Some(p) = self.prepared.borrow().as_ref() {
            return Ok(p.clone());
        }
        let engine = super::Engine {
            shared: self.shared.clone(),
        };
        // Accepted already: a nodeName is not required again (a repair has none to give).
        let prepared = engine.admit_accepted(plan).map_err(|e| {
            Abort::Failed(ErrorInfo {
                kind: match e {
                    super::SubmitError::Unsupported { .. } => ErrorKind::Unsupported,
                    _ => ErrorKind::Precondition,
                },
                step: None,
                detail: e.to_string(),
            })
        })?;
        *self.prepared.borrow_mut() = Some(prepared.clone());
        Ok(prepared)
    }

    /// Runs the oldest unfinished run to its end; false when there was none.
    pub(super) fn step(&self) -> bool {
        let run = {
            let inner = self.shared.lock();
            inner.table.unfinished().map(|(r, _)| *r).next()
        };
        let Some(run) = run else { return false };
        // Every log line about the run carries its id and digest (and, below, the change).
        let (id, digest) = {
            let inner = self.shared.lock();
            inner
                .table
                .by_run(run)
                .map(|s| (s.id.clone(), s.digest.clone()))
                .unwrap_or_default()
        };
        let span = tracing::info_span!("plan", plan = %id, digest = %digest, run);
        let _in_plan = span.enter();
        if let Err(e) = self.drive(run) {
            // The journal cannot be written: stop here; a restart resumes from what it has.
            tracing::error!(run, error = %e, "journal write failed; the plan is left for resume");
            std::thread::sleep(Duration::from_secs(1));
            return false;
        }
        self.maybe_compact();
        true
    }

    fn state(&self, run: u64) -> Option<(Phase, RunState, Option<u64>)> {
        let inner = self.shared.lock();
        let rs = inner.table.run_state(run)?.clone();
        let status = inner.table.by_run(run)?;
        Some((status.phase, rs, status.started_at_ms))
    }

    fn record(&self, rec: Record, sync: bool) -> Result<(), JournalError> {
        self.shared.record(rec, sync)
    }

    /// Journals a move to `phase`. An illegal move is refused (the run ends Failed instead,
    /// see `Shared::record`): the next look at the run's state finds it ended.
    fn phase(&self, run: u64, phase: Phase, error: Option<ErrorInfo>) -> Result<(), JournalError> {
        let record = Record::Phase {
            run,
            phase: phase.into(),
            error,
        };
        self.record(record, false)?;
        let now = self.shared.lock().table.by_run(run).map(|s| s.phase);
        if now == Some(phase) {
            tracing::info!(%phase, "phase changed");
        }
        Ok(())
    }

    fn finish(&self, run: u64, phase: Phase, error: Option<ErrorInfo>) -> Result<(), JournalError> {
        if phase != Phase::Succeeded {
            self.keep_bodies(run);
        }
        let kind = error.as_ref().map(|e| e.kind.as_str());
        let record = Record::PlanFinished {
            run,
            phase: phase.into(),
            error,
        };
        self.record(record, true)?;
        let (result, kind, took) = {
            let inner = self.shared.lock();
            match inner.table.by_run(run) {
                Some(s) if s.phase == phase => (phase, kind, s.duration_ms(now_ms())),
                // Refused as illegal: the run ended Failed (internal) instead.
                Some(s) if s.phase.is_terminal() => {
                    let kind = s.error.as_ref().map(|e| e.kind.as_str());
                    (s.phase, kind, s.duration_ms(now_ms()))
                }
                _ => return Ok(()),
            }
        };
        match kind {
            None => tracing::info!(%result, duration_ms = took, "plan finished"),
            Some(kind) => {
                tracing::warn!(%result, error_kind = kind, duration_ms = took, "plan finished")
            }
        }
        Ok(())
    }

    /// A run whose contents were staged or held by their targets and that did not succeed:
    /// stores all its file contents as one blob and journals that (`BodiesKept`), so a retry
    /// from the journal still has them once the staged files are removed and whatever
    /// happens to the files that held them. Best effort: without it a retry asks for the
    /// plan again.
    fn keep_bodies(&self, run: u64) {
        let Some((_, rs, _)) = self.state(run) else {
            return;
        };
        if (rs.staged.is_empty() && rs.held.is_empty()) || !rs.gone.is_empty() {
            return;
        }
        let Some(blob) = crate::journal::bodies::pack(&rs.plan, &BTreeSet::new()) else {
            return;
        };
        match self.shared.backups.put(&blob) {
            Ok(bodies) => {
                if let Err(e) = self.record(Record::BodiesKept { run, bodies }, false) {
                    tracing::warn!(error = %e, "cannot journal the kept file contents");
                }
            }
            Err(e) => tracing::warn!(
                error = %e,
                "cannot keep the file contents of a run that did not succeed; a retry will \
                 need the plan again"
            ),
        }
    }

    fn drive(&self, run: u64) -> Result<(), JournalError> {
        let mut resumed = false;
        loop {
            let Some((phase, rs, _)) = self.state(run) else {
                return Ok(());
            };
            if !resumed {
                resumed = true;
                self.record(
                    Record::ServiceManager {
                        run,
                        description: self.shared.host.services_description(),
                    },
                    false,
                )?;
                if phase != Phase::Pending {
                    tracing::info!(%phase, "resuming unfinished plan");
                    self.sweep(&rs.plan);
                }
            }
            let outcome = match phase {
                Phase::Pending => self.boundary(run).map_or_else(
                    || self.phase(run, Phase::Preparing, None).map_err(Abort::from),
                    |stop| Err(Abort::Stop(stop)),
                ),
                Phase::Preparing => self.prepare(run, &rs.plan),
                Phase::Applying => self.apply(run),
                Phase::Restarting => self.restart(run),
                Phase::Verifying => self.verify(run),
                Phase::RollingBack => {
                    let error = self.error_of(run);
                    return self.rollback_and_finish(run, error, Phase::RolledBack);
                }
                _ => return Ok(()),
            };
            match outcome {
                Ok(()) => continue,
                Err(Abort::Journal(e)) => return Err(e),
                Err(Abort::Failed(error)) => return self.fail(run, error),
                Err(Abort::Stop(Stop::Shutdown)) => {
                    tracing::info!("shutting down: the plan resumes at the next start");
                    return Ok(());
                }
                Err(Abort::Stop(stop)) => return self.stop(run, stop),
            }
        }
    }

    fn error_of(&self, run: u64) -> Option<ErrorInfo> {
        let inner = self.shared.lock();
        inner.table.by_run(run).and_then(|s| s.error.clone())
    }

    /// Removes temp files a crash may have left for this plan's targets.
    fn sweep(&self, plan: &Plan) {
        for change in &plan.changes {
            if let Err(e) = steps::sweep(&self.shared.host, change) {
                tracing::warn!(error = %e, "could not remove a stale temp file");
            }
        }
    }

    /// Checks, between steps, whether the run must stop.
    fn boundary(&self, run: u64) -> Option<Stop> {
        if self
            .shared
            .shutdown
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Some(Stop::Shutdown);
        }
        let inner = self.shared.lock();
        let rs = inner.table.run_state(run)?;
        if rs.cancel_requested {
            return Some(Stop::Cancelled);
        }
        if let Some(newer) = inner.table.newer_than(run) {
            return Some(Stop::Superseded(format!(
                "superseded by plan {} ({})",
                newer.id,
                short(&newer.digest)
            )));
        }
        let status = inner.table.by_run(run)?;
        if let Some(start) = status.started_at_ms {
            let limit = rs.plan.options.timeout.as_millis() as u64;
            if now_ms().saturating_sub(start) > limit {
                return Some(Stop::TimedOut(limit / 1000));
            }
        }
        None
    }

    fn prepare(&self, run: u64, plan: &Plan) -> Result<(), Abort> {
        self.resolve(run, plan)?;
        let resolved = self.state(run).map(|s| s.1.plan.clone());
        let plan = resolved.as_deref().unwrap_or(plan);
        self.admit(plan)?;
        self.fetch_artifacts(run, plan)?;
        // The control-plane gates' "before" (steps::control_plane), now that nothing changed.
        crate::steps::control_plane::capture(&self.shared.host, run, plan);
        self.phase(run, Phase::Applying, None)?;
        Ok(())
    }

    /// Decides, once per run and before anything changes, what the plan's shorthand stands
    /// for on this node, and journals it: the paths its managed set removes (appended as
    /// `absent` changes), and the exact versions of its package patterns that the package
    /// lists offer now (a pattern nothing matches yet is resolved before its own step, after
    /// the changes before it, such as a repository switch).
    fn resolve(&self, run: u64, plan: &Plan) -> Result<(), Abort> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(());
        };
        if let (Some(set), None) = (&plan.options.prune, &rs.pruned) {
            let own: BTreeSet<String> = plan.file_paths().into_iter().collect();
            let members = self.shared.lock().table.set_members(set);
            let paths: Vec<String> = members.into_iter().filter(|p| !own.contains(p)).collect();
            if !paths.is_empty() {
                tracing::info!(set = %set, removed = paths.len(), "managed set: removing paths no longer listed");
            }
            self.record(Record::PruneResolved { run, paths }, false)?;
        }
        let node = steps::HostNode::new(&self.shared.host);
        for (i, change) in plan.changes.iter().enumerate() {
            if rs.versions.contains_key(&(i as u32)) {
                continue;
            }
            let step = format!("changes[{i}] {} {}", change.kind(), change.target());
            let found = change
                .spec()
                .resolve(&node, plan.options.step_timeout, false, &mut |n| {
                    self.note(run, &step, n)
                });
            if let Ok(Some(Some(version))) = found {
                self.record(
                    Record::VersionResolved {
                        run,
                        index: i as u32,
                        version,
                    },
                    false,
                )?;
            }
        }
        Ok(())
    }

    /// Resolves the version pattern of package change `index` right before its step
    /// (refreshing the package lists once when nothing matches); fails the step when the
    /// repositories offer no matching version.
    fn resolve_at_step(&self, run: u64, plan: &Plan, index: usize) -> Result<(), Abort> {
        let Some(change) = plan.changes.get(index) else {
            return Ok(());
        };
        let step = format!("changes[{index}] {} {}", change.kind(), change.target());
        let node = steps::HostNode::new(&self.shared.host);
        let found = change
            .spec()
            .resolve(&node, plan.options.step_timeout, true, &mut |n| {
                self.note(run, &step, n)
            });
        let error = match found {
            Ok(None) => return Ok(()),
            Ok(Some(Some(version))) => {
                self.record(
                    Record::VersionResolved {
                        run,
                        index: index as u32,
                        version,
                    },
                    false,
                )?;
                return Ok(());
            }
            Ok(Some(None)) => steps::StepError::new(
                ErrorKind::Package,
                format!(
                    "nothing offered by the configured repositories matches {} (after \
                     refreshing the package lists); check the repository the plan configures \
                     for this version",
                    change.target()
                ),
            ),
            Err(e) => e,
        };
        let error = ErrorInfo {
            kind: error.kind,
            step: Some(step),
            detail: error.detail,
        };
        self.record(
            Record::StepFailed {
                run,
                index: index as u32,
                error: error.clone(),
            },
            true,
        )?;
        Err(Abort::Failed(error))
    }

    /// Downloads and verifies every artifact of the plan not yet in its desired state into
    /// the cache, before anything on the node changes: a failure (a wrong sha256, a dead
    /// server) fails the plan with nothing changed.
    fn fetch_artifacts(&self, run: u64, plan: &Plan) -> Result<(), Abort> {
        if self.fetched.get() {
            return Ok(());
        }
        let done = self.state(run).map(|s| s.1.done).unwrap_or_default();
        let node = steps::HostNode::new(&self.shared.host);
        for (i, change) in plan.changes.iter().enumerate() {
            if done.contains(&(i as u32)) {
                continue;
            }
            let _in_change = tracing::info_span!("change", change = i).entered();
            if let Some(stop) = self.boundary(run) {
                return Err(Abort::Stop(stop));
            }
            let step = format!("changes[{i}] {} {}", change.kind(), change.target());
            let result = change
                .spec()
                .prepare(&node, &mut |n| self.note(run, &step, n));
            let result = match result {
                Ok(None) => continue,
                Ok(Some(message)) => Ok(message),
                Err(e) => Err(e),
            };
            match result {
                Ok(message) => self.note(run, &step, steps::Note::Status(&message)),
                Err(e) => {
                    let error = ErrorInfo {
                        kind: e.kind,
                        step: Some(step),
                        detail: e.detail,
                    };
                    self.record(
                        Record::StepFailed {
                            run,
                            index: i as u32,
                            error: error.clone(),
                        },
                        true,
                    )?;
                    return Err(Abort::Failed(error));
                }
            }
        }
        self.fetched.set(true);
        Ok(())
    }

    /// Shows what a step is doing in the run's status (and to watchers, for events).
    fn note(&self, run: u64, step: &str, note: steps::Note) {
        let (text, event) = match note {
            steps::Note::Status(t) => (t, false),
            steps::Note::Event(t) => (t, true),
        };
        self.shared.note(run, format!("{step}: {text}"), event);
    }

    fn apply(&self, run: u64) -> Result<(), Abort> {
        let Some((_, mut rs, _)) = self.state(run) else {
            return Ok(());
        };
        let mut plan = rs.plan.clone();
        let prepared = self.admit(&plan)?;
        // Resumed in Applying after a restart: make sure the artifacts are still cached.
        self.fetch_artifacts(run, &plan)?;
        let todo: Vec<usize> = (0..plan.changes.len())
            .filter(|i| !rs.done.contains(&(*i as u32)))
            .collect();
        let mut cursor = 0;
        while cursor < todo.len() {
            // A batch: consecutive file-like changes (announced with one journal sync), or a
            // single change of another kind, or a single change resumed after a crash.
            let mut batch = vec![todo[cursor]];
            let alone = |i: usize| {
                !plan.changes[i].spec().batchable() || rs.preimages.contains_key(&(i as u32))
            };
            if !alone(todo[cursor]) {
                while let Some(&next) = todo.get(cursor + batch.len()) {
                    if batch.len() >= BATCH || alone(next) {
                        break;
                    }
                    batch.push(next);
                }
            }
            cursor += batch.len();
            if !rs.preimages.contains_key(&(batch[0] as u32))
                && let Some(stop) = self.boundary(run)
            {
                return Err(Abort::Stop(stop));
            }
            if let Change::Reboot(_) = &plan.changes[batch[0]] {
                self.reboot_step(run, batch[0] as u32)?;
                continue;
            }
            if !rs.versions.contains_key(&(batch[0] as u32)) {
                self.resolve_at_step(run, &plan, batch[0])?;
                if let Some((_, now, _)) = self.state(run) {
                    rs = now;
                    plan = rs.plan.clone();
                }
            }
            self.apply_batch(run, &plan, &prepared, &batch, &rs)?;
        }
        let next = if self.unit_plan(run).is_empty() {
            Phase::Verifying
        } else {
            Phase::Restarting
        };
        self.phase(run, next, None)?;
        Ok(())
    }

    /// Applies a batch of changes: diff each and capture its pre-images, announce every
    /// change that will mutate (one fdatasync for the batch: the write-ahead rule), then
    /// mutate in order. A failure ends the batch where the change order puts it: changes
    /// before it are applied, the announced ones after it are abandoned untouched.
    fn apply_batch(
        &self,
        run: u64,
        plan: &Plan,
        prepared: &steps::Prepared,
        batch: &[usize],
        rs: &RunState,
    ) -> Result<(), Abort> {
        let mut work: Vec<Work> = Vec::with_capacity(batch.len());
        let mut failed: Option<(usize, StepError)> = None;
        // Every change of the batch is diffed before the first one changes the node: one pass.
        let node = steps::HostNode::for_pass(&self.shared.host);
        // The batch's backups are written as they are captured and made durable together,
        // before the first `StepStarted` names one (see journal/backup.rs).
        let mut blobs = BlobBatch::new(&self.shared.backups);
        // Each change's pre-images, parallel to `work`: files' are captured after the loop.
        let mut captures: Vec<Vec<Capture>> = Vec::with_capacity(batch.len());
        for &i in batch {
            let index = i as u32;
            let _in_change = tracing::info_span!("change", change = index).entered();
            self.shared.lock().table.set_running(run, index);
            let in_flight = rs.preimages.get(&index);
            let mut ctx = prepared.ctx(i);
            let feeders = inplace_plan::kinds::feeders(plan, i);
            if !feeders.is_empty() {
                // What changed in this run so far (not the batch's snapshot of it).
                let changed = self.state(run).map(|s| s.1.preimages).unwrap_or_default();
                ctx.inputs_changed = feeders.into_iter().find(|j| changed.contains_key(j));
            }
            if rs.gone.contains(&index) {
                let held = rs.held.contains(&index);
                failed = Some((i, content_gone(&plan.changes[i], run, held)));
                break;
            }
            match self.prepare_one(&node, &blobs, &plan.changes[i], ctx, in_flight) {
                Ok((diff, pending)) => {
                    captures.push(pending);
                    work.push(Work {
                        index,
                        diff,
                        preimages: Vec::new(),
                        resumed: in_flight.is_some(),
                        planned: rs.planned.get(&index).cloned().unwrap_or_default(),
                        announced: false,
                        staged: rs.staged.get(&index).cloned(),
                    })
                }
                Err(e) => {
                    failed = Some((i, e));
                    break;
                }
            }
        }
        if let Some((k, e)) = capture_files(&self.shared.host, &blobs, &work, &mut captures) {
            // Changes before it keep their pre-images; it fails; none after it is performed.
            failed = Some((work[k].index as usize, e));
            work.truncate(k);
        }
        for (w, pending) in work.iter_mut().zip(captures) {
            w.preimages = pending.into_iter().filter_map(Capture::done).collect();
        }
        if let Err(e) = blobs.sync() {
            // No backup of the batch is known durable: nothing from the first change that
            // needs one on is announced or performed.
            if let Some(k) = work.iter().position(|w| !w.preimages.is_empty()) {
                let e = StepError::from(e);
                let detail = format!(
                    "making the backups of changes[{}..] durable: {}",
                    work[k].index, e.detail
                );
                failed = Some((work[k].index as usize, StepError::new(e.kind, detail)));
                work.truncate(k);
            }
        }
        drop(blobs);
        let mut announced = false;
        for w in work.iter_mut().filter(|w| !w.preimages.is_empty()) {
            failpoint::hit("step.before_started");
            let preimages = std::mem::take(&mut w.preimages);
            self.record(
                Record::StepStarted {
                    run,
                    index: w.index,
                    preimages,
                    planned: w.diff.mutations.iter().map(|m| m.describe()).collect(),
                },
                false,
            )?;
            w.announced = true;
            announced = true;
        }
        if announced {
            self.shared.lock().journal.sync()?;
        }
        // Renames of staged contents are made durable together: each directory is synced once,
        // then the changes are journaled done (never before their renames are durable).
        let mut unsynced = Unsynced::default();
        for (k, w) in work.iter().enumerate() {
            let _in_change = tracing::info_span!("change", change = w.index).entered();
            let outcome = if w.is_staged_write() {
                Ok(())
            } else {
                self.settle(&mut unsynced)
            }
            .and_then(|()| self.execute_one(run, plan, w, &mut unsynced))
            .and_then(|()| {
                if unsynced.dirs.is_empty() {
                    self.settle(&mut unsynced)
                } else {
                    Ok(())
                }
            });
            let outcome = match (outcome, k + 1 == work.len()) {
                (Ok(()), true) => self.settle(&mut unsynced),
                (other, _) => other,
            };
            if let Err((index, e)) = outcome {
                // What was renamed before the failure is made durable and journaled done.
                if let Err((_, settle)) = self.settle(&mut unsynced) {
                    tracing::warn!(error = %settle.detail, "cannot sync renamed files");
                }
                for later in work[k + 1..].iter().filter(|l| l.announced) {
                    self.record(
                        Record::StepAbandoned {
                            run,
                            index: later.index,
                        },
                        false,
                    )?;
                }
                failed = Some((index as usize, e));
                break;
            }
        }
        if let Some((i, e)) = failed {
            let _in_change = tracing::info_span!("change", change = i).entered();
            tracing::warn!(error_kind = e.kind.as_str(), "change failed");
            let change = &plan.changes[i];
            let error = ErrorInfo {
                kind: e.kind,
                step: Some(format!(
                    "changes[{i}] {} {}",
                    change.kind(),
                    change.target()
                )),
                detail: e.detail,
            };
            self.record(
                Record::StepFailed {
                    run,
                    index: i as u32,
                    error: error.clone(),
                },
                true,
            )?;
            return Err(Abort::Failed(error));
        }
        Ok(())
    }

    /// Diffs one change and captures the pre-images its mutations need, except files'
    /// (`Capture::File`: [`capture_files`] captures them with the batch's other files). On
    /// resume the journaled pre-images describe the node before the change; only targets
    /// not captured then are captured now.
    fn prepare_one(
        &self,
        node: &steps::HostNode<'_>,
        blobs: &BlobBatch<'_>,
        change: &Change,
        ctx: steps::StepCtx,
        in_flight: Option<&Vec<crate::journal::Preimage>>,
    ) -> Result<(steps::Diff, Vec<Capture>), StepError> {
        let host = &self.shared.host;
        let diff = steps::diff_on(node, change, ctx)?;
        let mut targets: BTreeSet<String> = in_flight
            .into_iter()
            .flatten()
            .map(preimage_target)
            .collect();
        let mut captures = Vec::new();
        for (k, m) in diff.mutations.iter().enumerate() {
            if !targets.insert(mutation_target(m)) {
                continue;
            }
            captures.push(if steps::captures_a_file(m) {
                Capture::File(k)
            } else {
                Capture::Done(steps::capture(host, blobs, m)?)
            });
        }
        Ok((diff, captures))
    }

    /// Syncs the directories of the renames made so far, then journals their changes done.
    /// When a directory cannot be synced, those changes are not journaled done (the first is
    /// reported failed; rollback restores them all from their pre-images).
    fn settle(&self, unsynced: &mut Unsynced) -> Result<(), (u32, StepError)> {
        let first = unsynced.done.first().map(|d| d.0).unwrap_or_default();
        let done = std::mem::take(&mut unsynced.done);
        let mut synced: Vec<String> = Vec::new();
        for path in std::mem::take(&mut unsynced.dirs) {
            let dir = path.parent().map(|d| d.to_string()).unwrap_or_default();
            if !synced.contains(&dir) {
                self.shared
                    .host
                    .root
                    .sync_parent(&path)
                    .map_err(|e| (first, StepError::from(e)))?;
                synced.push(dir);
            }
        }
        for (index, record) in done {
            self.record(record, false)
                .map_err(|e| (index, StepError::new(ErrorKind::Io, e.to_string())))?;
        }
        Ok(())
    }

    /// Performs one change's mutations and queues the record that it is done in `unsynced`
    /// (with the renames whose directories must be synced first).
    fn execute_one(
        &self,
        run: u64,
        plan: &Plan,
        w: &Work,
        unsynced: &mut Unsynced,
    ) -> Result<(), (u32, StepError)> {
        self.execute_mutations(run, plan, w, unsynced)
            .map(|done| unsynced.done.push((w.index, done)))
            .map_err(|e| (w.index, e))
    }

    /// Performs one change's mutations; the record that it is done.
    fn execute_mutations(
        &self,
        run: u64,
        plan: &Plan,
        w: &Work,
        unsynced: &mut Unsynced,
    ) -> Result<Record, StepError> {
        let journal_err = |e: JournalError| StepError::new(ErrorKind::Io, e.to_string());
        if w.diff.mutations.is_empty() {
            let message = if w.resumed {
                completed_after_restart(&w.planned)
            } else {
                w.diff
                    .note
                    .clone()
                    .unwrap_or_else(|| "already in the desired state".into())
            };
            return Ok(Record::StepDone {
                run,
                index: w.index,
                changed: w.resumed,
                message,
            });
        }
        let step = plan
            .changes
            .get(w.index as usize)
            .map(|c| format!("changes[{}] {} {}", w.index, c.kind(), c.target()))
            .unwrap_or_default();
        let mut output = Vec::new();
        for m in &w.diff.mutations {
            failpoint::hit("step.before_mutation");
            if self.install_staged(run, w, m)? {
                if let steps::Mutation::Write { path, .. } = m {
                    unsynced.dirs.push(path.clone());
                }
            } else {
                let said = steps::execute(&self.shared.host, m, &mut |n| self.note(run, &step, n))?;
                output.extend(said);
            }
            failpoint::hit("step.after_mutation");
        }
        if !output.is_empty() {
            self.record(
                Record::StepOutput {
                    run,
                    index: w.index,
                    output: output.join("\n"),
                },
                false,
            )
            .map_err(journal_err)?;
        }
        let mut message: Vec<String> = w.diff.mutations.iter().map(|m| m.describe()).collect();
        if let Some(note) = &w.diff.note {
            message.push(note.clone());
        }
        Ok(Record::StepDone {
            run,
            index: w.index,
            changed: true,
            message: message.join("; "),
        })
    }

    /// Carries out `m` by renaming the content staged for it into place, when `m` is the
    /// write its change's content was staged for (same file, same mode and owner: the
    /// content is the change's by construction); false when it is not, or when nothing is
    /// staged any more (then `m` is carried out as it is).
    fn install_staged(&self, run: u64, w: &Work, m: &steps::Mutation) -> Result<bool, StepError> {
        let Some(body) = &w.staged else {
            return Ok(false);
        };
        match m {
            steps::Mutation::Write {
                path,
                meta,
                content,
            } if *path == body.path && *meta == body.meta && content.len() as u64 == body.len => {
                Ok(self.shared.host.root.install_staged(path, run)?)
            }
            _ => Ok(false),
        }
    }

    fn verify(&self, run: u64) -> Result<(), Abort> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(());
        };
        let plan = rs.plan.clone();
        for (i, check) in plan.verify.iter().enumerate() {
            let index = i as u32;
            if rs.checks_passed.contains(&index) {
                continue;
            }
            if let Some(stop) = self.boundary(run) {
                return Err(Abort::Stop(stop));
            }
            let name = check_name(index, check);
            self.shared.lock().table.set_check_running(run, index);
            // A gate being polled is not cut short by a shutdown (it would read as failed).
            let stop = || {
                self.boundary(run)
                    .is_some_and(|s| !matches!(s, Stop::Shutdown))
            };
            let mut progress = |msg: &str| {
                let mut inner = self.shared.lock();
                inner.table.set_message(run, format!("{name}: {msg}"));
            };
            let baseline = crate::steps::control_plane::recall(run, index);
            let outcome = crate::steps::check::run_check(
                &self.shared.host,
                check,
                baseline.as_ref(),
                &stop,
                &mut progress,
            );
            let message = self.with_unit_failures(run, outcome.message.clone(), outcome.passed);
            self.record(
                Record::CheckDone {
                    run,
                    index,
                    passed: outcome.passed,
                    message: outcome.message.clone(),
                },
                !outcome.passed,
            )?;
            if !outcome.passed {
                match self.boundary(run).filter(|s| !matches!(s, Stop::Shutdown)) {
                    // The plan's timeout cut this gate: the error names the gate and what it
                    // last saw, not only the timeout (a gate waiting on a component that never
                    // came back is the usual reason a plan runs out of time).
                    Some(Stop::TimedOut(secs)) => {
                        return Err(Abort::Failed(ErrorInfo {
                            kind: ErrorKind::Timeout,
                            step: Some(name),
                            detail: format!(
                                "the plan's timeout ({secs}s) ended this gate; last: {message}"
                            ),
                        }));
                    }
                    Some(stop) => return Err(Abort::Stop(stop)),
                    None => {}
                }
                return Err(Abort::Failed(ErrorInfo {
                    kind: ErrorKind::Verification,
                    step: Some(name),
                    detail: message,
                }));
            }
        }
        self.recheck_failed_units(run)?;
        self.finish(run, Phase::Succeeded, None)?;
        Ok(())
    }

    fn fail(&self, run: u64, error: ErrorInfo) -> Result<(), JournalError> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(());
        };
        tracing::warn!(error_kind = error.kind.as_str(), step = error.step.as_deref().unwrap_or(""), error = %error.detail, "plan failed");
        if rs.plan.options.rollback_on_failure && rs.changed_anything() {
            self.phase(run, Phase::RollingBack, Some(error.clone()))?;
            self.rollback_and_finish(run, Some(error), Phase::RolledBack)
        } else {
            self.finish(run, Phase::Failed, Some(error))
        }
    }

    fn stop(&self, run: u64, stop: Stop) -> Result<(), JournalError> {
        match stop {
            Stop::Shutdown => Ok(()),
            Stop::Superseded(why) => self.finish(
                run,
                Phase::Superseded,
                Some(ErrorInfo {
                    kind: ErrorKind::Superseded,
                    step: None,
                    detail: why,
                }),
            ),
            Stop::TimedOut(secs) => self.fail(
                run,
                ErrorInfo {
                    kind: ErrorKind::Timeout,
                    step: None,
                    detail: format!("the plan ran longer than its timeout of {secs}s"),
                },
            ),
            Stop::Cancelled => {
                let Some((_, rs, _)) = self.state(run) else {
                    return Ok(());
                };
                let error = ErrorInfo {
                    kind: ErrorKind::Cancelled,
                    step: None,
                    detail: format!("cancelled on request{}", rs.cancel_reason),
                };
                if rs.plan.options.rollback_on_failure && rs.changed_anything() {
                    self.phase(run, Phase::RollingBack, Some(error.clone()))?;
                    self.rollback_and_finish(run, Some(error), Phase::Cancelled)
                } else {
                    self.finish(run, Phase::Cancelled, Some(error))
                }
            }
        }
    }

    /// Restores every changed change in reverse order, restarts what the restore touched,
    /// and ends the run in `end` — or Failed with `RollbackFailed` when a restore fails.
    fn rollback_and_finish(
        &self,
        run: u64,
        error: Option<ErrorInfo>,
        end: Phase,
    ) -> Result<(), JournalError> {
        let Some((_, rs, _)) = self.state(run) else {
            return Ok(());
        };
        let end = if rs.cancel_requested
            && end == Phase::RolledBack
            && error
                .as_ref()
                .is_some_and(|e| e.kind == ErrorKind::Cancelled)
        {
            Phase::Cancelled
        } else {
            end
        };
        let host = &self.shared.host;
        let mut not_restored = Vec::new();
        for (index, preimages) in rs.preimages.iter().rev() {
            if rs.rolled_back.contains(index) {
                continue;
            }
            let _in_change = tracing::info_span!("change", change = index).entered();
            let mut last_err = None;
            for attempt in 0..3 {
                if attempt > 0 {
                    std::thread::sleep(Duration::from_millis(200 * attempt));
                }
                let step = rs
                    .plan
                    .changes
                    .get(*index as usize)
                    .map(|c| format!("rolling back changes[{index}] {} {}", c.kind(), c.target()))
                    .unwrap_or_default();
                let result = preimages.iter().rev().try_for_each(|p| {
                    steps::restore(host, &self.shared.backups, p, &mut |n| {
                        self.note(run, &step, n)
                    })
                });
                match result {
                    Ok(()) => {
                        last_err = None;
                        break;
                    }
                    Err(e) => last_err = Some(e),
                }
            }
            if let Some(e) = last_err {
                // Go on: every earlier change is still undone, and each outcome recorded,
                // so the node is left changed at exactly the changes that say so.
                tracing::error!(error = %e, "change could not be rolled back");
                self.record(
                    Record::StepRollbackFailed {
                        run,
                        index: *index,
                        error: ErrorInfo {
                            kind: e.kind,
                            step: rs
                                .plan
                                .changes
                                .get(*index as usize)
                                .map(|c| format!("changes[{index}] {} {}", c.kind(), c.target())),
                            detail: e.detail.clone(),
                        },
                    },
                    true,
                )?;
                not_restored.push(*index);
                continue;
            }
            failpoint::hit("rollback.before_record");
            self.record(Record::StepRolledBack { run, index: *index }, false)?;
            tracing::info!("change rolled back");
        }
        if let Some(failure) = self.rollback_failure(run, &not_restored, &error) {
            // The unit half still runs: what was restored must be live again.
            let units = self.rollback_units(run, &error)?;
            let failure = match units {
                Err(units) => ErrorInfo {
                    detail: format!("{}; also: {}", failure.detail, units.detail),
                    ..failure
                },
                Ok(()) => failure,
            };
            return self.finish(run, Phase::Failed, Some(failure));
        }
        // Reload and undo the unit jobs, so the old configuration is live again.
        if let Err(failure) = self.rollback_units(run, &error)? {
            return self.finish(run, Phase::Failed, Some(failure));
        }
        // Everything was put back: the error says what, and what a rollback cannot undo.
        let error = match (end, error) {
            (Phase::RolledBack, Some(mut e)) => {
                if let Some(note) = restored_note(&rs.plan, rs.preimages.keys().copied()) {
                    e.detail = format!("{}; {note}", e.detail);
                }
                Some(e)
            }
            (_, error) => error,
        };
        self.finish(run, end, error)
    }

    /// The error of a rollback that left changes unrestored: which, and why each, from the
    /// journal's fold (so a rollback resumed after a crash reports the same).
    fn rollback_failure(
        &self,
        run: u64,
        not_restored: &[u32],
        error: &Option<ErrorInfo>,
    ) -> Option<ErrorInfo> {
        if not_restored.is_empty() {
            return None;
        }
        let (_, rs, _) = self.state(run)?;
        let status = {
            let inner = self.shared.lock();
            inner.table.by_run(run).cloned()
        }?;
        let total = rs.preimages.len();
        let name = |i: u32| {
            rs.plan
                .changes
                .get(i as usize)
                .map(|c| format!("changes[{i}] {} {}", c.kind(), c.target()))
                .unwrap_or_else(|| format!("changes[{i}]"))
        };
        let why = |i: u32| {
            status
                .changes
                .get(i as usize)
                .map(|c| c.message.clone())
                .unwrap_or_default()
        };
        let after = error
            .as_ref()
            .map(|e| format!(" (rolling back after: {e})"))
            .unwrap_or_default();
        let restored = total - not_restored.len();
        let others = match restored {
            0 => String::new(),
            1 => "; the other changed change was restored".to_string(),
            n => format!("; the other {n} changed changes were restored"),
        };
        // The step names the first change left changed (rollback goes in reverse order).
        let first = not_restored.iter().max().copied().unwrap_or_default();
        let detail = if let [only] = not_restored {
            format!(
                "rollback could not restore this change: {}{others}; the node needs attention{after}",
                why(*only)
            )
        } else {
            let reasons: Vec<String> = not_restored
                .iter()
                .map(|i| format!("{}: {}", name(*i), why(*i)))
                .collect();
            format!(
                "rollback could not restore {} changes: {}{others}; the node needs attention{after}",
                not_restored.len(),
                reasons.join("; ")
            )
        };
        Some(ErrorInfo {
            kind: ErrorKind::RollbackFailed,
            step: Some(name(first)),
            detail,
        })
    }

    fn maybe_compact(&self) {
        let mut inner = self.shared.lock();
        // Due once the journal is over `compact_bytes` and has grown since the last
        // compaction by what that compaction left, or by `compact_bytes` when that is less.
        // What a compaction keeps (the remembered plans' summaries) can itself be over
        // `compact_bytes`: without the second condition every run would rewrite and sync
        // all of it again.
        let (size, head) = (inner.journal.size(), inner.journal.compacted_len());
        let limit = self.shared.config.compact_bytes;
        let due = size >= limit && size.saturating_sub(head) >= head.min(limit);
        if inner.table.unfinished().next().is_some()
            || (!due && inner.bodies_bytes < super::COMPACT_BODIES_BYTES)
        {
            return;
        }
        let records = inner.table.summary_records();
        let before = inner.journal.size();
        match inner.journal.compact(now_ms(), records) {
            Ok(()) => {
                let after = inner.journal.size();
                inner.bodies_bytes = 0;
                // Under the lock: a plan being accepted stores its bodies blob again under
                // this lock if it finds it removed (`Shared::record_with_plan`).
                let keep = inner.table.retained_bodies();
                let removed = self.shared.backups.retain(&keep).unwrap_or_default();
                drop(inner);
                tracing::info!(
                    before,
                    after,
                    backups_removed = removed,
                    "journal compacted"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "journal compaction failed; the old journal is kept")
            }
        }
    }
}

/// What a rollback that restored every change of `restored` (indexes into `plan.changes`)
/// put back, for the run's error and so for Cluster API's message (a hook message holds 512
/// bytes: the count of each kind, the packages by name), and what it cannot undo: `kubeadm
/// upgrade node`'s pre-image is the files it rewrites ([`inplace_plan::kinds::REWRITES`]),
/// not what else it did. `None` when nothing was restored.
fn restored_note(plan: &Plan, restored: impl Iterator<Item = u32>) -> Option<String> {
    let mut packages = Vec::new();
    let mut kubeadm = false;
    // Other kinds, in the order first seen, and how many of each.
    let mut others: Vec<(&'static str, usize)> = Vec::new();
    for index in restored {
        match plan.changes.get(index as usize) {
            Some(Change::Package(p)) => packages.push(p.name.clone()),
            Some(Change::KubeadmUpgradeNode(_)) => kubeadm = true,
            Some(c) => {
                let kind = c.kind().as_str();
                match others.iter_mut().find(|(k, _)| *k == kind) {
                    Some(entry) => entry.1 += 1,
                    None => others.push((kind, 1)),
                }
            }
            None => {}
        }
    }
    let mut put_back: Vec<String> = others
        .into_iter()
        .map(|(kind, n)| format!("{n} {kind}"))
        .collect();
    if !packages.is_empty() {
        put_back.push(format!("packages {}", packages.join(", ")));
    }
    if kubeadm {
        put_back.push("static pod manifests, kubelet configuration".to_string());
    }
    if put_back.is_empty() {
        return None;
    }
    let mut note = format!("rolled back: {}", put_back.join(", "));
    if kubeadm {
        note.push_str(
            "; not undone: kubeadm's other work (renewed certificates, etcd's newer data)",
        );
    }
    Some(note)
}

/// Why a staged or held change cannot be applied: its content was gone when the journal
/// was read back (nothing else may be written in its place).
fn content_gone(change: &Change, run: u64, held: bool) -> StepError {
    let path = change.target();
    let detail = if held {
        format!(
            "the content of this change was not stored when the plan was accepted, because \
             {path} already held it, and it no longer does (changed while the agent was \
             stopped?)"
        )
    } else {
        let name = crate::host::fs::staged_name(path.rsplit('/').next().unwrap_or_default(), run);
        format!(
            "the content of this change was staged beside {path} as {name} before the agent \
             stopped, and neither that file nor {path} holds it any more (removed while the \
             agent was stopped?)"
        )
    };
    StepError::new(
        ErrorKind::Precondition,
        format!(
            "{detail}; nothing else is written in its place: the run rolls back — submit the \
             plan again"
        ),
    )
}

fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

/// What a change that was done before a restart says: what it wrote, as it said when it was
/// announced (journals of earlier versions did not record that).
fn completed_after_restart(planned: &[String]) -> String {
    if planned.is_empty() {
        "completed after a restart".to_string()
    } else {
        format!("{} (completed after a restart)", planned.join("; "))
    }
}

/// A pre-image of a change being prepared.
enum Capture {
    /// Captured.
    Done(crate::journal::Preimage),
    /// The pre-image of the file the change's mutation at this index writes or removes,
    /// captured with the batch's other files ([`capture_files`]).
    File(usize),
}

impl Capture {
    fn done(self) -> Option<crate::journal::Preimage> {
        match self {
            Capture::Done(p) => Some(p),
            Capture::File(_) => None,
        }
    }
}

/// Captures the file pre-images of a batch (`Capture::File` in `captures`, parallel to
/// `work`) into `blobs`, two at a time on a machine with two cores or more: reading and
/// hashing the files being replaced is most of a large batch's time before its first write,
/// and nothing changes the node before the batch's first mutation, so the order of the
/// captures does not matter. On failure returns the position in `work` of the first change
/// (in change order) whose capture failed, and why.
fn capture_files(
    host: &crate::host::Host,
    blobs: &BlobBatch<'_>,
    work: &[Work],
    captures: &mut [Vec<Capture>],
) -> Option<(usize, StepError)> {
    let jobs: Vec<(usize, usize, &steps::Mutation)> = captures
        .iter()
        .enumerate()
        .flat_map(|(w, pending)| {
            pending
                .iter()
                .enumerate()
                .filter_map(move |(slot, c)| match c {
                    Capture::File(m) => Some((w, slot, &work[w].diff.mutations[*m])),
                    Capture::Done(_) => None,
                })
        })
        .collect();
    let capture = |job: &(usize, usize, &steps::Mutation)| steps::capture(host, blobs, job.2);
    let two = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    let results: Vec<Result<crate::journal::Preimage, StepError>> = if jobs.len() < 2 || !two {
        jobs.iter().map(capture).collect()
    } else {
        std::thread::scope(|s| {
            let odd = s.spawn(|| jobs.iter().skip(1).step_by(2).map(capture).collect());
            let even: Vec<_> = jobs.iter().step_by(2).map(capture).collect();
            let odd: Vec<_> = odd.join().expect("capturing does not panic");
            let mut odd = odd.into_iter();
            even.into_iter()
                .flat_map(|e| std::iter::once(e).chain(odd.next()))
                .collect()
        })
    };
    let mut first: Option<(usize, StepError)> = None;
    for (&(w, slot, _), result) in jobs.iter().zip(results) {
        match result {
            Ok(p) => captures[w][slot] = Capture::Done(p),
            Err(e) if first.as_ref().is_none_or(|(f, _)| w < *f) => first = Some((w, e)),
            Err(_) => {}
        }
    }
    first
}

fn mutation_target(m: &steps::Mutation) -> String {
    m.target()
}

fn preimage_target(p: &crate::journal::Preimage) -> String {
    steps::preimage_target(p)
}

#[cfg(test)]
mod restored_note_tests {
    use super::*;

    fn plan(changes: &str) -> Plan {
        let yaml = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: default/cp-0@a\n\
             nodeName: cp-0\nchanges:\n{changes}"
        );
        inplace_plan::parse_plan(yaml.as_bytes(), "test", &inplace_plan::Limits::default())
            .expect("a valid plan")
    }

    #[test]
    fn a_version_bump_says_what_came_back_and_what_kubeadm_leaves() {
        let p = plan(
            "- file: {path: /etc/kubernetes/a, content: a}\n\
             - file: {path: /etc/kubernetes/b, content: b}\n\
             - kubeletFlags: {set: {max-pods: \"150\"}}\n\
             - package: {name: kubeadm, version: 1.31.2-1.1, hold: true}\n\
             - kubeadmUpgradeNode: {}\n\
             - package: {name: kubelet, version: 1.31.2-1.1, hold: true}\n",
        );
        assert_eq!(
            restored_note(&p, [0, 1, 2, 3, 4, 5].into_iter()).unwrap(),
            "rolled back: 2 file, 1 kubeletFlags, packages kubeadm, kubelet, static pod \
             manifests, kubelet configuration; not undone: kubeadm's other work (renewed \
             certificates, etcd's newer data)"
        );
        // Only what was restored is named; nothing restored, nothing said.
        assert_eq!(
            restored_note(&p, [1].into_iter()).unwrap(),
            "rolled back: 1 file"
        );
        assert_eq!(restored_note(&p, std::iter::empty()), None);
    }
}
