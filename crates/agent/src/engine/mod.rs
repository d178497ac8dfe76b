//! The engine: accepts plans, runs one at a time through its phases on a worker thread,
//! journals every step, and answers status questions from the journal's fold.
//!
//! Architecture invariants:
//! - every state change is a journal record first; the in-memory [`table::Table`] is only a
//!   fold of those records (the same code replays them at start-up);
//! - the lock around the journal and table is held for appends and reads only, never while
//!   the node is being changed or a gate polled;
//! - a plan (id + digest) that finished is never run again, except by an explicit retry,
//!   which is a new attempt.

pub mod drift;
pub mod dry_run;
mod journaled;
mod run;
mod staging;
pub mod state;
pub mod table;
pub(crate) mod transitions;
pub(crate) mod units;

use inplace_base::time::now_ms;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tokio::sync::broadcast;

use crate::failpoint;
use crate::host::Host;
use crate::journal::backup::BackupStore;
use crate::journal::{Journal, JournalError, OpenReport, Record};
use crate::steps::{self, Capabilities};
use inplace_plan::{
    ContentSums, FieldError, InvalidPlan, KnownSums, Limits, Plan, validate_document,
};
use state::{Phase, PlanStatus};
use table::Table;

/// Engine settings (validated: no `Option` where a value is required).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Where the journal and backups live.
    pub state_dir: PathBuf,
    /// What this node can apply.
    pub capabilities: Capabilities,
    /// This node's name; plans naming another node are refused.
    pub node_name: Option<String>,
    /// Refuse plans without `nodeName` (the daemon does; the local CLI does not).
    pub require_node_name: bool,
    /// Compact the journal once it is larger than this many bytes and has grown by as
    /// many (or by what the last compaction left, when that is less) since then.
    pub compact_bytes: u64,
    /// How many finished plans to remember.
    pub keep_plans: usize,
    /// Events the broadcast to watchers holds for a slow receiver (it also keeps the last
    /// this many alive, so it is memory held while idle).
    pub event_capacity: usize,
}

impl EngineConfig {
    /// Defaults for a state directory.
    pub fn new(state_dir: PathBuf) -> EngineConfig {
        EngineConfig {
            state_dir,
            capabilities: Capabilities {
                exec_allowed: false,
                kinds: Capabilities::implemented(),
            },
            node_name: None,
            require_node_name: false,
            compact_bytes: 1 << 20,
            keep_plans: 1000,
            event_capacity: 4096,
        }
    }
}

/// Why a submission was refused; nothing was journaled and nothing on the node changed.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The plan does not fit this node (field errors).
    #[error("{0}")]
    Invalid(InvalidPlan),
    /// The plan names another node.
    #[error("plan {id} is for node {plan_node:?}, this is node {node:?}")]
    WrongNode {
        /// Plan id.
        id: String,
        /// The node the plan names.
        plan_node: String,
        /// This node.
        node: String,
    },
    /// The plan has changes or gates this node cannot apply.
    #[error("plan {id} cannot be applied on this node:{}", .reasons.iter().map(|r| format!("\n  {r}")).collect::<String>())]
    Unsupported {
        /// Plan id.
        id: String,
        /// `changes[3] package: not supported ...`, one per problem.
        reasons: Vec<String>,
    },
    /// No such plan.
    #[error("no plan with id {0:?} is known to this agent")]
    NotFound(String),
    /// The request does not fit the plan's state (retry of a running plan, ...).
    #[error("{0}")]
    Conflict(String),
    /// The journal failed.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The plan's file contents could not be staged beside their targets (nothing on the
    /// node changed; what was staged is removed again).
    #[error("could not stage the plan's file contents: {0}")]
    Staging(String),
}

/// What `submit` did.
#[derive(Debug, Clone)]
pub enum Submission {
    /// A new attempt was accepted and will run.
    Accepted(PlanStatus),
    /// The same id + digest is already known; nothing new runs.
    Existing(PlanStatus),
}

impl Submission {
    /// The status either way.
    pub fn status(&self) -> &PlanStatus {
        match self {
            Submission::Accepted(s) | Submission::Existing(s) => s,
        }
    }
}

/// Something happened to a run.
#[derive(Debug, Clone)]
pub enum Event {
    /// The run's phase changed (or it was accepted): full status.
    Status(Arc<PlanStatus>),
    /// A step of the run progressed.
    Progress(Arc<ProgressEvent>),
}

/// One step of a run progressed.
#[derive(Debug, Clone)]
pub struct ProgressEvent {
    /// Run number.
    pub run: u64,
    /// Journal sequence number of the record (0 for a [`ProgressEvent::note`]).
    pub seq: u64,
    /// Step i of n.
    pub progress: state::Progress,
    /// The change the record was about, as it is now.
    pub change: Option<state::ChangeStatus>,
    /// The gate the record was about, as it is now.
    pub check: Option<state::CheckStatus>,
    /// News the record carries about unit jobs, restarts, daemon-reloads, reboots and lost
    /// systemd connections (`Record::note`).
    pub restart: Option<String>,
    /// Something a running step says that is not a journal record ("waiting for the dpkg
    /// lock, held by PID 4242", a download retry); `seq` is then 0 (no record).
    pub note: Option<String>,
}

pub(crate) struct Inner {
    journal: Journal,
    table: Table,
    phases: PhaseHistory,
    /// Bytes of plan bodies blobs stored since the journal was last compacted (compaction
    /// also removes the blobs no kept plan needs).
    bodies_bytes: u64,
}

/// Compact (when idle) once this many bytes of plan bodies blobs were stored since the last
/// compaction, even if the journal itself is still small.
pub(crate) const COMPACT_BODIES_BYTES: u64 = 64 << 20;

/// The sums of a plan's contents, when it is accepted: all of them, or those known before
/// (the rest are hashed beside staging).
enum Sums {
    All(ContentSums),
    Known(KnownSums),
}

/// How many runs keep their phase snapshots (see [`Engine::phase_history`]). A snapshot is
/// as large as its plan's change list, so this bounds what the history holds.
const PHASE_HISTORY_RUNS: usize = 4;

/// The `Event::Status` snapshots of the most recent runs, in the order they were sent, so a
/// watcher that fell behind the broadcast can still show every phase a run went through.
#[derive(Default)]
struct PhaseHistory {
    runs: std::collections::VecDeque<(u64, Vec<Arc<PlanStatus>>)>,
}

impl PhaseHistory {
    fn push(&mut self, status: Arc<PlanStatus>) {
        if let Some((_, snapshots)) = self.runs.iter_mut().find(|(run, _)| *run == status.run) {
            snapshots.push(status);
            return;
        }
        if self.runs.len() >= PHASE_HISTORY_RUNS {
            self.runs.pop_front();
        }
        self.runs.push_back((status.run, vec![status]));
    }

    fn of(&self, run: u64) -> Vec<Arc<PlanStatus>> {
        self.runs
            .iter()
            .find(|(r, _)| *r == run)
            .map(|(_, snapshots)| snapshots.clone())
            .unwrap_or_default()
    }
}

pub(crate) struct Shared {
    inner: Mutex<Inner>,
    /// Held from a submission's decision (new attempt or existing) until its acceptance is
    /// journaled, so concurrent submissions of the same plan accept it once and never share
    /// a run number.
    submissions: Mutex<()>,
    /// The ids whose submission is being decided (admitted, staged, accepted): a second
    /// submission of the same id waits for the first and then finds its result, instead of
    /// staging every content again beside it. A client whose call timed out while a slow
    /// node staged a large plan calls again; without this each call started the staging
    /// anew, and on a slow enough node none ever finished within a call.
    in_flight: Mutex<std::collections::HashSet<String>>,
    in_flight_done: Condvar,
    /// How many admissions ran (for tests of the above).
    #[cfg(test)]
    admissions: std::sync::atomic::AtomicUsize,
    work: Condvar,
    events: broadcast::Sender<Event>,
    config: EngineConfig,
    host: Arc<Host>,
    backups: BackupStore,
    shutdown: std::sync::atomic::AtomicBool,
    observer: std::sync::OnceLock<Arc<dyn RecordObserver>>,
    /// The last drift check's result (`drift.rs`); taken after `inner` when both are held.
    drift: Mutex<drift::DriftState>,
    /// The metadata of the baseline's files when the node last matched it (`drift.rs`).
    clean: Mutex<Option<drift::Clean>>,
}

/// Told about every record the engine journals, after the table folded it: how the metrics
/// count plans, change durations, unit jobs and failed gates without reading the journal.
/// Called with the engine lock held, on the thread that journaled: it must be quick and
/// must not call back into the engine.
pub trait RecordObserver: Send + Sync {
    /// `record` was journaled at `ts` (Unix ms); `status` is its run's status after it.
    fn journaled(&self, record: &Record, ts: u64, status: Option<&PlanStatus>);
}

/// The journal as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalInfo {
    /// The journal file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Records in it.
    pub records: u64,
    /// Sequence number of the last record (0 before the first).
    pub last_seq: u64,
}

/// A handle to the engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("state_dir", &self.shared.config.state_dir)
            .finish()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the table half-updated in a way the
        // journal does not reflect; keep going with the data.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Journals a record, folds it into the table and tells watchers.
    fn record(&self, record: Record, sync: bool) -> Result<(), JournalError> {
        self.record_with_plan(record, sync, None, None)
    }

    /// A backup store failure while journaling a plan's bodies, as a journal error.
    fn backup_error(&self, e: crate::journal::backup::BackupError) -> JournalError {
        JournalError::Io {
            path: self.config.state_dir.join("backups"),
            source: match e.raw_os_error() {
                Some(code) => std::io::Error::from_raw_os_error(code),
                None => std::io::Error::other(e.to_string()),
            },
        }
    }

    /// As `record`; for `PlanAccepted`, the validated plan it carries and the blob of its
    /// file bodies when they are kept apart, with its sha256 (stored again, under the lock,
    /// if compaction removed it since the caller stored it: compaction runs under the same
    /// lock).
    fn record_with_plan(
        &self,
        record: Record,
        sync: bool,
        plan: Option<Arc<Plan>>,
        bodies: Option<(&str, &[u8])>,
    ) -> Result<(), JournalError> {
        let mut inner = self.lock();
        // Every phase change goes through the state machine, under the lock that orders the
        // journal: an illegal one is a bug, refused here, and the run ends Failed instead.
        let (record, sync) = match inner
            .table
            .check_transition(&record)
            .map_err(|illegal| (illegal.instead(), illegal))
        {
            Ok(()) => (record, sync),
            Err((instead, illegal)) => {
                tracing::error!(
                    run = illegal.run,
                    from = illegal.from.map(|p| p.to_string()).unwrap_or_default(),
                    to = %illegal.to,
                    "internal error: refusing to journal an illegal phase change ({illegal}); \
                     the run ends Failed where it is"
                );
                match instead {
                    Some(instead) => (instead, true),
                    None => return Ok(()),
                }
            }
        };
        if let Some((sha, blob)) = bodies {
            self.backups
                .put_hashed(sha, blob)
                .map_err(|e| self.backup_error(e))?;
            inner.bodies_bytes += blob.len() as u64;
        }
        // Whatever ends a run removes what it staged and did not rename into place first
        // (`staging`): once the run is finished nothing refers to those files.
        if let Record::PlanFinished { run, .. } = &record
            && let Some(rs) = inner.table.run_state(*run)
            && !rs.staged.is_empty()
        {
            for problem in staging::unstage(&self.host, *run, rs.staged.values()) {
                tracing::warn!(
                    run,
                    problem,
                    "cannot remove a staged file of a finished run"
                );
            }
        }
        let run = record.run();
        let phase_change = matches!(
            record,
            Record::PlanAccepted { .. } | Record::Phase { .. } | Record::PlanFinished { .. }
        );
        let (change_index, check_index, restart) = match &record {
            Record::StepDone { index, .. }
            | Record::StepFailed { index, .. }
            | Record::StepRolledBack { index, .. }
            | Record::StepRollbackFailed { index, .. } => (Some(*index), None, None),
            Record::CheckDone { index, .. } => (None, Some(*index), None),
            other => (None, None, other.note()),
        };
        // The observer sees the record after the fold, which consumes it.
        let observed = self.observer.get().map(|o| (o.clone(), record.clone()));
        let entry = inner.journal.append(now_ms(), record, sync)?;
        let (seq, ts) = (entry.seq, entry.ts);
        inner.table.apply_with_plan(entry, plan);
        if let Some((observer, record)) = observed {
            observer.journaled(&record, ts, run.and_then(|r| inner.table.by_run(r)));
        }
        if let Some(run) = run
            && let Some(status) = inner.table.by_run(run)
        {
            let event = if phase_change {
                let status = Arc::new(status.clone());
                inner.phases.push(status.clone());
                Event::Status(status)
            } else {
                Event::Progress(Arc::new(ProgressEvent {
                    run,
                    seq,
                    progress: status.progress.clone(),
                    change: change_index.and_then(|i| status.changes.get(i as usize).cloned()),
                    check: check_index.and_then(|i| status.checks.get(i as usize).cloned()),
                    restart,
                    note: None,
                }))
            };
            let _ = self.events.send(event);
        }
        Ok(())
    }
}

impl Shared {
    /// Sets the status message of a running run (not journaled: it is about what is going
    /// on now, like a gate's attempts); with `event`, watchers are told as well.
    fn note(&self, run: u64, message: String, event: bool) {
        let mut inner = self.lock();
        inner.table.set_message(run, message.clone());
        if !event {
            return;
        }
        if let Some(status) = inner.table.by_run(run) {
            let _ = self.events.send(Event::Progress(Arc::new(ProgressEvent {
                run,
                seq: 0,
                progress: status.progress.clone(),
                change: None,
                check: None,
                restart: None,
                note: Some(message),
            })));
        }
    }
}

impl Engine {
    /// Opens the journal (replaying it; a torn tail is truncated and reported) and prepares
    /// to resume any unfinished plan. Does not start the worker. Units are managed through
    /// the host's service manager, as its settings chose ([`Host::services`]).
    pub fn open(
        config: EngineConfig,
        host: Arc<Host>,
    ) -> Result<(Engine, OpenReport), JournalError> {
        let mut table = Table::new(config.keep_plans);
        let (journal, report) = Journal::open(&config.state_dir, |e| table.apply(e))?;
        let backups = BackupStore::at(&config.state_dir);
        table.finish_replay(&staging::NodeBodies {
            backups: &backups,
            host: &host,
        });
        for (run, (paths, dirs)) in table.abandoned_staging() {
            staging::sweep_abandoned(&host, *run, paths, dirs);
        }
        let (events, _) = broadcast::channel(config.event_capacity.max(16));
        let engine = Engine {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    journal,
                    table,
                    phases: PhaseHistory::default(),
                    bodies_bytes: 0,
                }),
                submissions: Mutex::new(()),
                in_flight: Mutex::new(std::collections::HashSet::new()),
                in_flight_done: Condvar::new(),
                #[cfg(test)]
                admissions: std::sync::atomic::AtomicUsize::new(0),
                work: Condvar::new(),
                events,
                config,
                host,
                backups,
                shutdown: std::sync::atomic::AtomicBool::new(false),
                observer: std::sync::OnceLock::new(),
                drift: Mutex::new(drift::DriftState::default()),
                clean: Mutex::new(None),
            }),
        };
        Ok((engine, report))
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// The node.
    pub fn host(&self) -> &Arc<Host> {
        &self.shared.host
    }

    /// Sets the observer told about every record journaled from now on (once; false when
    /// one was set already).
    pub fn set_observer(&self, observer: Arc<dyn RecordObserver>) -> bool {
        self.shared.observer.set(observer).is_ok()
    }

    /// Reads the engine's state under its lock without copying it (status pages, metrics).
    /// `f` must be quick: the engine waits for it to journal its next record.
    pub fn read<R>(&self, f: impl FnOnce(&Table) -> R) -> R {
        f(&self.shared.lock().table)
    }

    /// Watches every run's progress.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.shared.events.subscribe()
    }

    /// Checks a validated plan against this node without journaling anything.
    pub fn admit(&self, plan: &Plan) -> Result<steps::Prepared, SubmitError> {
        #[cfg(test)]
        self.shared
            .admissions
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        admit(&self.shared.config, &self.shared.host, plan)
    }

    /// Submits a plan. The same id + digest returns the existing status (running or
    /// finished) and never runs again unless `retry` is set and the last attempt failed.
    pub fn submit(&self, plan: Plan, source: &str, retry: bool) -> Result<Submission, SubmitError> {
        self.submit_known(plan, KnownSums::default(), source, retry)
    }

    /// [`Engine::submit`] of a plan some of whose contents were hashed already, while it
    /// was read (`plan::read_plan_hashed`).
    pub fn submit_known(
        &self,
        plan: Plan,
        known: KnownSums,
        source: &str,
        retry: bool,
    ) -> Result<Submission, SubmitError> {
        let _one = self.one_submission_of(&plan.id);
        // An id this agent has never seen cannot be a repeat: its digest (a hash over all of
        // its content) is computed while its contents are staged, not before.
        let fresh = self.shared.lock().table.latest(&plan.id).is_none();
        if fresh {
            let prepared = self.admit(&plan)?;
            let _submitting = self.submission_lock();
            if self.shared.lock().table.latest(&plan.id).is_none() {
                return self.accept(plan, None, Sums::Known(known), 1, source, &prepared);
            }
        }
        let sums = ContentSums::of_known(&plan, known);
        let digest = self.identity(&plan, &sums);
        {
            let inner = self.shared.lock();
            if let Some(existing) = inner.table.find(&plan.id, &digest)
                && (!retry || !existing.phase.is_failure())
            {
                return Ok(Submission::Existing(existing.clone()));
            }
        }
        let prepared = self.admit(&plan)?;
        let _submitting = self.submission_lock();
        let inner = self.shared.lock();
        // Decide again: another caller may have submitted meanwhile.
        let attempt = match inner.table.find(&plan.id, &digest) {
            Some(existing) if !retry || !existing.phase.is_failure() => {
                return Ok(Submission::Existing(existing.clone()));
            }
            Some(existing) => existing.attempt + 1,
            None => 1,
        };
        drop(inner);
        self.accept(
            plan,
            Some(digest),
            Sums::All(sums),
            attempt,
            source,
            &prepared,
        )
    }

    /// The digest under which this agent knows `plan`, whose id it has seen: its v1 digest
    /// when a run of that id was journaled with it (by an agent before digests v2, so that
    /// resubmitting such a plan after an upgrade is still the same plan and never runs
    /// again), otherwise its digest.
    fn identity(&self, plan: &Plan, sums: &ContentSums) -> String {
        let digest = plan.digest_with(sums);
        let any_v1 = {
            let inner = self.shared.lock();
            if inner.table.find(&plan.id, &digest).is_some() {
                return digest;
            }
            inner
                .table
                .digests_of(&plan.id)
                .any(inplace_plan::is_v1_digest)
        };
        if any_v1 {
            let v1 = plan.digest_v1();
            if self.shared.lock().table.find(&plan.id, &v1).is_some() {
                return v1;
            }
        }
        digest
    }

    /// Journals a plan as accepted (the caller holds the submission lock). The contents of
    /// a large plan's files that must change are staged beside their targets first
    /// (`staging`); the rest go to one blob in the backup store (`journal::bodies`). Both
    /// are written and synced here, outside the engine lock, and beside the digest when
    /// `digest` is not known yet.
    fn accept(
        &self,
        plan: Plan,
        digest: Option<String>,
        sums: Sums,
        attempt: u32,
        source: &str,
        prepared: &steps::Prepared,
    ) -> Result<Submission, SubmitError> {
        let run = {
            let inner = self.shared.lock();
            inner.table.next_run()
        };
        let host = &self.shared.host;
        let (sums, stored) = std::thread::scope(|s| {
            // The sha256 of each content (the digest's and the staged files') is computed
            // beside deciding which files must change (every target read and compared) and
            // staging them.
            let hashing = match sums {
                Sums::All(sums) => Err(sums),
                Sums::Known(known) => {
                    let plan = &plan;
                    Ok(s.spawn(move || ContentSums::of_known(plan, known)))
                }
            };
            let picks = staging::candidates(host, &plan, prepared);
            let stored = self
                .store_contents(run, &plan, &picks)
                .map(|(staged, blob)| (staged, picks.held, blob));
            let sums = match hashing {
                Ok(h) => h.join().expect("hashing does not panic"),
                Err(sums) => sums,
            };
            (sums, stored)
        });
        let (mut staged, held, blob) = stored?;
        for body in &mut staged {
            body.sha256 = sums
                .hex(body.index as usize)
                .expect("a staged content is a file change's");
        }
        let held: Vec<_> = held
            .into_iter()
            .filter_map(|index| match plan.changes.get(index as usize) {
                Some(inplace_plan::Change::File(f)) => Some(crate::journal::HeldBody {
                    index,
                    path: f.path.clone(),
                    sha256: sums
                        .hex(index as usize)
                        .expect("a held content is a file change's"),
                    len: f.content.len() as u64,
                }),
                _ => None,
            })
            .collect();
        let digest = digest.unwrap_or_else(|| plan.digest_with(&sums));
        let (changes, checks) = table::summaries(&plan);
        let doc = if staged.is_empty() && held.is_empty() && blob.is_none() {
            plan.canonical_json()
        } else {
            plan.canonical_json_without_bodies()
        };
        let record = Record::PlanAccepted {
            run,
            id: plan.id.clone(),
            digest,
            attempt,
            source: source.to_string(),
            plan: crate::journal::PlanDoc::from_value(&doc),
            changes,
            checks,
            bodies: blob.as_ref().map(|(sha, _)| sha.clone()),
            staged,
            held,
            prune: plan.options.prune.clone(),
        };
        drop(doc);
        let staged: Vec<_> = match &record {
            Record::PlanAccepted { staged, .. } => staged.clone(),
            _ => Vec::new(),
        };
        if let Err(e) = self.shared.record_with_plan(
            record,
            true,
            Some(Arc::new(plan)),
            blob.as_ref().map(|(sha, b)| (sha.as_str(), b.as_slice())),
        ) {
            for problem in staging::unstage(host, run, staged.iter()) {
                tracing::warn!(run, problem, "removing a staged file after a failed submit");
            }
            return Err(e.into());
        }
        self.shared.work.notify_all();
        let inner = self.shared.lock();
        let status = inner
            .table
            .by_run(run)
            .cloned()
            .ok_or_else(|| SubmitError::Conflict(format!("run {run} vanished")))?;
        Ok(Submission::Accepted(status))
    }

    /// Stages the contents `picks` stages (announced first: `Record::Staging`) and stores
    /// the file contents of a large plan that are neither staged nor held by their targets
    /// as one blob: the staged bodies, and the blob's sha256 and bytes.
    #[allow(clippy::type_complexity)]
    fn store_contents(
        &self,
        run: u64,
        plan: &Plan,
        picks: &staging::Candidates,
    ) -> Result<(Vec<crate::journal::StagedBody>, Option<(String, Vec<u8>)>), SubmitError> {
        let host = &self.shared.host;
        let mut staged = Vec::new();
        if !picks.stage.is_empty() {
            let (paths, dirs) = staging::intent(host, plan, &picks.stage);
            self.shared
                .record(Record::Staging { run, paths, dirs }, true)?;
            staged = staging::stage(host, run, plan, &picks.stage).map_err(SubmitError::Staging)?;
            failpoint::hit("staging.before_accept");
        }
        let indices = staged
            .iter()
            .map(|s| s.index)
            .chain(picks.held.iter().copied())
            .collect();
        let blob = crate::journal::bodies::pack(plan, &indices);
        let blob = match blob {
            Some(b) => Some((
                self.shared.backups.put(&b).map_err(|e| {
                    for problem in staging::unstage(host, run, staged.iter()) {
                        tracing::warn!(
                            run,
                            problem,
                            "removing a staged file after a failed submit"
                        );
                    }
                    self.shared.backup_error(e)
                })?,
                b,
            )),
            None => None,
        };
        Ok((staged, blob))
    }

    /// Waits until no other submission of `id` is being decided, then marks this one; the
    /// mark is taken away when the guard is dropped (also on an error or a panic).
    fn one_submission_of(&self, id: &str) -> InFlight<'_> {
        let mut ids = self
            .shared
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        while ids.contains(id) {
            ids = self
                .shared
                .in_flight_done
                .wait(ids)
                .unwrap_or_else(|p| p.into_inner());
        }
        ids.insert(id.to_owned());
        InFlight {
            shared: &self.shared,
            id: id.to_owned(),
        }
    }

    fn submission_lock(&self) -> MutexGuard<'_, ()> {
        self.shared
            .submissions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the last attempt of `id` again, when it ended without succeeding.
    pub fn retry(&self, id: &str, source: &str) -> Result<Submission, SubmitError> {
        let _submitting = self.submission_lock();
        let (status, plan) = {
            let inner = self.shared.lock();
            let status = inner
                .table
                .latest(id)
                .cloned()
                .ok_or_else(|| SubmitError::NotFound(id.to_string()))?;
            if !status.phase.is_terminal() {
                return Err(SubmitError::Conflict(format!(
                    "plan {id} is still running ({}); retry applies to finished plans",
                    status.phase
                )));
            }
            if status.phase == Phase::Succeeded {
                return Ok(Submission::Existing(status));
            }
            let plan = inner
                .table
                .retained_plan(status.run)
                .cloned()
                .ok_or_else(|| {
                    SubmitError::Conflict(format!(
                        "the content of plan {id} is no longer kept; submit it again with retry"
                    ))
                })?;
            (status, plan)
        };
        let bodies = staging::NodeBodies {
            backups: &self.shared.backups,
            host: &self.shared.host,
        };
        let (value, gone) = plan.to_value(&bodies).map_err(|e| {
            SubmitError::Conflict(format!("the content of plan {id} cannot be read: {e}"))
        })?;
        if !gone.is_empty() {
            return Err(SubmitError::Conflict(format!(
                "the content of plan {id} is no longer kept; submit it again with retry"
            )));
        }
        let plan = validate_document(value, id, &Limits::replay()).map_err(SubmitError::Invalid)?;
        let prepared = self.admit(&plan)?;
        self.accept(
            plan,
            Some(status.digest.clone()),
            Sums::Known(KnownSums::default()),
            status.attempt + 1,
            source,
            &prepared,
        )
    }

    /// Accepts `plan` as the next attempt after `latest` (its digest kept), for a repair.
    fn accept_attempt(
        &self,
        plan: Plan,
        latest: &PlanStatus,
        source: &str,
        prepared: &steps::Prepared,
    ) -> Result<Submission, SubmitError> {
        self.accept(
            plan,
            Some(latest.digest.clone()),
            Sums::Known(KnownSums::default()),
            latest.attempt + 1,
            source,
            prepared,
        )
    }

    /// Asks the running attempt of `id` to stop at the next step boundary (rolling back
    /// what it changed when its plan says so).
    pub fn cancel(&self, id: &str) -> Result<PlanStatus, SubmitError> {
        self.cancel_because(id, "", "")
    }

    /// [`Engine::cancel`], journaling who asked (`by`, a caller identity) and why
    /// (`reason`): both end up in the run's events and in its error.
    pub fn cancel_because(
        &self,
        id: &str,
        by: &str,
        reason: &str,
    ) -> Result<PlanStatus, SubmitError> {
        let status = {
            let inner = self.shared.lock();
            inner
                .table
                .latest(id)
                .cloned()
                .ok_or_else(|| SubmitError::NotFound(id.to_string()))?
        };
        if status.phase.is_terminal() {
            return Ok(status);
        }
        self.shared.record(
            Record::CancelRequested {
                run: status.run,
                reason: reason.to_string(),
                by: by.to_string(),
            },
            true,
        )?;
        self.shared.work.notify_all();
        Ok(self.status_of_run(status.run).unwrap_or(status))
    }

    /// The latest attempt of a plan.
    pub fn status(&self, id: &str) -> Option<PlanStatus> {
        self.shared.lock().table.latest(id).cloned()
    }

    /// The latest attempt of a plan with this id and digest.
    pub fn find(&self, id: &str, digest: &str) -> Option<PlanStatus> {
        self.shared.lock().table.find(id, digest).cloned()
    }

    /// The status snapshots sent as [`Event::Status`] for `run` (one per phase it entered,
    /// oldest first), kept for the few most recent runs of this process; empty for older
    /// runs and for phases entered before a restart.
    pub fn phase_history(&self, run: u64) -> Vec<Arc<PlanStatus>> {
        self.shared.lock().phases.of(run)
    }

    /// The status of one run.
    pub fn status_of_run(&self, run: u64) -> Option<PlanStatus> {
        self.shared.lock().table.by_run(run).cloned()
    }

    /// The running (or next) plan, if any.
    pub fn current(&self) -> Option<PlanStatus> {
        let inner = self.shared.lock();
        let run = inner.table.unfinished().map(|(r, _)| *r).next()?;
        inner.table.by_run(run).cloned()
    }

    /// Every known plan, oldest first.
    pub fn plans(&self) -> Vec<PlanStatus> {
        self.shared.lock().table.plans().to_vec()
    }

    /// True when a plan is waiting or running.
    pub fn busy(&self) -> bool {
        self.shared.lock().table.unfinished().next().is_some()
    }

    /// Journal size in bytes and records.
    pub fn journal_stats(&self) -> (u64, u64) {
        let inner = self.shared.lock();
        (inner.journal.size(), inner.journal.records())
    }

    /// Where the journal is, how large, and its last sequence number.
    pub fn journal_info(&self) -> JournalInfo {
        let inner = self.shared.lock();
        JournalInfo {
            path: inner.journal.path().to_path_buf(),
            bytes: inner.journal.size(),
            records: inner.journal.records(),
            last_seq: inner.journal.last_seq(),
        }
    }

    /// Runs unfinished plans on the calling thread until none is left.
    pub fn run_until_idle(&self) {
        while run::Runner::new(self.shared.clone()).step() {}
    }

    /// Starts the worker thread that runs plans as they arrive.
    pub fn spawn_worker(&self) -> std::io::Result<JoinHandle<()>> {
        let shared = self.shared.clone();
        std::thread::Builder::new()
            .name("inplace-engine".into())
            .spawn(move || {
                let mut worked = false;
                loop {
                    if shared.shutdown.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    if run::Runner::new(shared.clone()).step() {
                        worked = true;
                        continue;
                    }
                    if std::mem::take(&mut worked) {
                        // Idle again: what the runs freed goes back to the kernel.
                        crate::host::memory::give_back();
                    }
                    let inner = shared.lock();
                    if inner.table.unfinished().next().is_none()
                        && !shared.shutdown.load(std::sync::atomic::Ordering::SeqCst)
                    {
                        let _unused = shared
                            .work
                            .wait_timeout(inner, std::time::Duration::from_secs(60));
                    }
                }
            })
    }

    /// Asks the worker to stop after the current step.
    pub fn shutdown(&self) {
        self.shared
            .shutdown
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.shared.work.notify_all();
    }
}

/// Checks a validated plan against a node without journaling anything: the node name,
/// the kinds this node supports, and the node-dependent facts (owners, symlinks, files).
pub fn admit(cfg: &EngineConfig, host: &Host, plan: &Plan) -> Result<steps::Prepared, SubmitError> {
    if let Some(node) = &cfg.node_name {
        match &plan.node_name {
            Some(n) if n != node => {
                return Err(SubmitError::WrongNode {
                    id: plan.id.clone(),
                    plan_node: n.clone(),
                    node: node.clone(),
                });
            }
            None if cfg.require_node_name => {
                return Err(SubmitError::Invalid(InvalidPlan {
                    source: plan.id.clone(),
                    errors: vec![FieldError::new(
                        "nodeName",
                        format!("is required by this agent (node {node})"),
                    )],
                }));
            }
            _ => {}
        }
    }
    let mut reasons = Vec::new();
    for (i, c) in plan.changes.iter().enumerate() {
        if let Some(why) = cfg.capabilities.unsupported(c) {
            reasons.push(format!("changes[{i}] {}: {why}", c.kind()));
        }
    }
    for (i, c) in plan.verify.iter().enumerate() {
        if let Some(why) = cfg.capabilities.unsupported_check(&c.probe) {
            reasons.push(format!("verify[{i}] {}: {why}", c.probe.key()));
        }
    }
    if host.services().is_none() {
        for (i, c) in plan.changes.iter().enumerate() {
            if let Some(why) = steps::unsupported_without_services(c) {
                reasons.push(format!("changes[{i}] {}: {why}", c.kind()));
            }
        }
        for (i, c) in plan.verify.iter().enumerate() {
            if let Some(why) = steps::check::unsupported_without_services(&c.probe) {
                reasons.push(format!("verify[{i}] {}: {why}", c.probe.key()));
            }
        }
    }
    if !reasons.is_empty() {
        return Err(SubmitError::Unsupported {
            id: plan.id.clone(),
            reasons,
        });
    }
    steps::preflight(host, plan).map_err(|errors| {
        SubmitError::Invalid(InvalidPlan {
            source: plan.id.clone(),
            errors,
        })
    })
}

/// A submission of one id being decided ([`Engine::one_submission_of`]).
struct InFlight<'a> {
    shared: &'a Shared,
    id: String,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.shared
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        self.shared.in_flight_done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SettingsInput;

    #[test]
    fn concurrent_submissions_of_a_new_plan_stage_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let (config, host) = sandbox(dir.path(), 1 << 20);
        let (engine, _) = Engine::open(config, host).unwrap();
        let (plan, _) = big_plan("once", "");
        let start = Arc::new(std::sync::Barrier::new(4));
        let answers: Vec<Submission> = std::thread::scope(|s| {
            let calls: Vec<_> = (0..4)
                .map(|_| {
                    let (engine, plan, start) = (&engine, plan.clone(), start.clone());
                    s.spawn(move || {
                        start.wait();
                        engine.submit(plan, "test", false).unwrap()
                    })
                })
                .collect();
            calls.into_iter().map(|c| c.join().unwrap()).collect()
        });
        let accepted = answers
            .iter()
            .filter(|a| matches!(a, Submission::Accepted(_)))
            .count();
        assert_eq!(accepted, 1, "{answers:?}");
        assert_eq!(
            engine
                .shared
                .admissions
                .load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one admission (staging) for four calls of the same new plan"
        );
    }

    fn plan(id: &str, content: &str) -> Plan {
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n  - file: {{path: /etc/kubernetes/{content}.conf, content: \"{content}\"}}\n"
        );
        inplace_plan::parse_plan(text.as_bytes(), "test", &Limits::default()).unwrap()
    }

    fn sandbox(dir: &std::path::Path, compact_bytes: u64) -> (EngineConfig, Arc<Host>) {
        inplace_demo_node::build_kubeadm_worker(dir).unwrap();
        let mut settings = SettingsInput {
            root: Some(dir.to_path_buf()),
            no_chroot: true,
            services_off: true,
            ..SettingsInput::default()
        }
        .resolve()
        .unwrap();
        settings.engine.compact_bytes = compact_bytes;
        let host = Arc::new(Host::open(settings.host.clone()).unwrap());
        (settings.engine, host)
    }

    /// A plan with more file content than `journal::bodies::THRESHOLD`, and a gate.
    fn big_plan(id: &str, gate: &str) -> (Plan, String) {
        let big = "0123456789abcdef".repeat(crate::journal::bodies::THRESHOLD / 16 + 1);
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n\
             \x20 - file: {{path: /etc/kubernetes/big.conf, content: \"{big}\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/small.conf, content: \"small\"}}\n{gate}"
        );
        let plan = inplace_plan::parse_plan(text.as_bytes(), "test", &Limits::default()).unwrap();
        (plan, big)
    }

    fn journal_text(config: &EngineConfig) -> String {
        std::fs::read_to_string(
            config
                .state_dir
                .join("journal")
                .join(crate::journal::JOURNAL_FILE),
        )
        .unwrap()
    }

    /// The staged files (`.<name>.inplace-r<run>`) under `dir`, recursively.
    fn staged_files(dir: &std::path::Path) -> Vec<String> {
        let mut found = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let path = e.path();
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    todo.push(path);
                } else if e.file_name().to_string_lossy().contains(".inplace-r") {
                    found.push(path.display().to_string());
                }
            }
        }
        found.sort();
        found
    }

    #[test]
    fn a_plan_whose_contents_are_staged_resumes_from_them() {
        let dir = tempfile::tempdir().unwrap();
        let (config, host) = sandbox(dir.path(), 1 << 20);
        let (plan, big) = big_plan("bodies", "");
        {
            let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
            let s = engine.submit(plan.clone(), "test", false).unwrap();
            assert!(matches!(s, Submission::Accepted(_)));
            // Not run: as if the agent stopped right after accepting it.
        }
        // Each content was written once, beside its target; the journal only refers to it.
        let journal = journal_text(&config);
        assert!(journal.contains("\"staged\":[") && !journal.contains(&big[..64]));
        assert!(
            !journal.contains("\"bodies\":\""),
            "nothing is left for a blob"
        );
        let staged = staged_files(dir.path());
        assert_eq!(staged.len(), 2, "{staged:?}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/.big.conf.inplace-r1"))
                .unwrap(),
            big
        );
        assert!(!dir.path().join("etc/kubernetes/big.conf").exists());
        let (engine, _) = Engine::open(config, host).unwrap();
        engine.run_until_idle();
        let status = engine.status("bodies").unwrap();
        assert_eq!(status.phase, Phase::Succeeded, "{status:?}");
        assert_eq!(staged_files(dir.path()), Vec::<String>::new());
        assert_eq!(status.digest, plan.digest());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/big.conf")).unwrap(),
            big
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/small.conf")).unwrap(),
            "small"
        );
    }

    /// Accepts plan `gone`, whose two contents are staged (small.conf first, so that the run
    /// has something to roll back, and a big file in a new directory), then removes the big
    /// one's staged file, as if by hand while the agent was stopped.
    fn accepted_with_staged_content_gone(
        dir: &std::path::Path,
        config: &EngineConfig,
        host: &Arc<Host>,
    ) {
        std::fs::write(dir.join("etc/kubernetes/small.conf"), "before").unwrap();
        let big = "x".repeat(crate::journal::bodies::THRESHOLD + 1);
        let plan = file_plan(
            "gone",
            &[
                ("/etc/kubernetes/small.conf", "small"),
                ("/etc/kubernetes/new/big.conf", &big),
            ],
            "",
        );
        {
            let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
            engine.submit(plan, "test", false).unwrap();
        }
        std::fs::remove_file(dir.join("etc/kubernetes/new/.big.conf.inplace-r1")).unwrap();
    }

    #[test]
    fn staged_content_that_is_gone_fails_its_change_and_the_run_rolls_back() {
        let dir = tempfile::tempdir().unwrap();
        let (config, host) = sandbox(dir.path(), 1 << 20);
        accepted_with_staged_content_gone(dir.path(), &config, &host);
        let (engine, _) = Engine::open(config, host).unwrap();
        let error = rolled_back_at(
            &engine,
            "gone",
            "changes[1] file /etc/kubernetes/new/big.conf",
        );
        assert!(
            error.detail.contains(".big.conf.inplace-r1"),
            "{}",
            error.detail
        );
        assert!(
            error.detail.contains("submit the plan again"),
            "{}",
            error.detail
        );
        // Nothing was written in its place; the rest is as it was, the staged directory gone.
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/small.conf")).unwrap(),
            "before"
        );
        assert!(!dir.path().join("etc/kubernetes/new").exists());
        assert_eq!(staged_files(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn a_run_whose_staged_content_is_gone_is_not_retried_with_empty_files_after_compaction() {
        let dir = tempfile::tempdir().unwrap();
        // Compaction after every plan.
        let (config, host) = sandbox(dir.path(), 0);
        // The run rolls back, and nothing holds its contents any more (every one was staged,
        // none is in a blob).
        accepted_with_staged_content_gone(dir.path(), &config, &host);
        {
            let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
            engine.run_until_idle();
            assert_eq!(engine.status("gone").unwrap().phase, Phase::RolledBack);
            // Another plan, so that the journal is compacted once the first has finished.
            engine
                .submit(
                    inplace_plan::parse_plan(
                        b"apiVersion: inplace.agent/v1\nkind: Plan\nid: later\nchanges:\n  - file: {path: /etc/kubernetes/later.conf, content: later}\n",
                        "test",
                        &Limits::default(),
                    )
                    .unwrap(),
                    "test",
                    false,
                )
                .unwrap();
            engine.run_until_idle();
        }
        assert!(
            last_compaction(&config.state_dir).is_some(),
            "the journal was compacted"
        );
        let (engine, _) = Engine::open(config, host).unwrap();
        match engine.retry("gone", "test") {
            Err(SubmitError::Conflict(message)) => {
                assert!(message.contains("no longer kept"), "{message}")
            }
            other => panic!("a retry without the contents must be refused: {other:?}"),
        }
        engine.run_until_idle();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/small.conf")).unwrap(),
            "before"
        );
        assert!(!dir.path().join("etc/kubernetes/new").exists());
    }

    #[test]
    fn staging_that_was_never_accepted_is_removed_at_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let (config, host) = sandbox(dir.path(), 1 << 20);
        let (plan, _) = big_plan("abandoned", "");
        // The agent stopped between staging and accepting: the intent is journaled, the
        // files are there, the plan is not.
        {
            let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
            let prepared = engine.admit(&plan).unwrap();
            let picks = staging::candidates(&host, &plan, &prepared).stage;
            assert_eq!(picks.len(), 2);
            let (paths, dirs) = staging::intent(&host, &plan, &picks);
            engine
                .shared
                .record(
                    Record::Staging {
                        run: 1,
                        paths,
                        dirs,
                    },
                    true,
                )
                .unwrap();
            staging::stage(&host, 1, &plan, &picks).unwrap();
        }
        assert_eq!(staged_files(dir.path()).len(), 2);
        let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
        assert_eq!(staged_files(dir.path()), Vec::<String>::new());
        assert!(engine.status("abandoned").is_none());
        // The run number is the next plan's; its acceptance settles the old intent.
        let s = engine.submit(plan, "test", false).unwrap();
        assert!(
            matches!(s, Submission::Accepted(ref st) if st.run == 1),
            "{s:?}"
        );
        engine.run_until_idle();
        assert_eq!(engine.status("abandoned").unwrap().phase, Phase::Succeeded);
        drop(engine);
        let (engine, _) = Engine::open(config, host).unwrap();
        assert!(engine.shared.lock().table.abandoned_staging().is_empty());
    }

    /// A health endpoint that does not answer until [`answer_health`], and a plan's gate on it.
    fn silent_health_gate() -> (std::net::TcpListener, String) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gate = format!(
            "verify:\n  - httpGet: {{url: \"http://{}/healthz\", timeoutSeconds: 1, periodSeconds: 1}}\n",
            listener.local_addr().unwrap()
        );
        (listener, gate)
    }

    /// Answers every request to `listener` with 200 from now on.
    fn answer_health(listener: std::net::TcpListener) {
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for mut stream in listener.incoming().flatten() {
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf);
                let _ = stream.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
            }
        });
    }

    /// Runs `engine` until idle and returns the error of plan `id`, which must have failed
    /// at `step` and been rolled back.
    fn rolled_back_at(engine: &Engine, id: &str, step: &str) -> inplace_base::ErrorInfo {
        engine.run_until_idle();
        let status = engine.status(id).unwrap();
        assert_eq!(status.phase, Phase::RolledBack, "{status:?}");
        let error = status.error.unwrap();
        assert_eq!(error.step.as_deref(), Some(step));
        error
    }

    /// Retries `id` and runs its second attempt to success.
    fn retry_succeeds(engine: &Engine, id: &str) {
        engine.retry(id, "test").unwrap();
        engine.run_until_idle();
        let status = engine.status(id).unwrap();
        assert_eq!(
            (status.attempt, status.phase),
            (2, Phase::Succeeded),
            "{status:?}"
        );
    }

    /// The last `planAccepted` record of the journal.
    fn last_accepted(config: &EngineConfig) -> String {
        journal_text(config)
            .lines()
            .rev()
            .find(|l| l.contains("planAccepted"))
            .unwrap()
            .to_string()
    }

    fn blobs(config: &EngineConfig) -> usize {
        std::fs::read_dir(config.state_dir.join("backups"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    fn file_plan(id: &str, files: &[(&str, &str)], gate: &str) -> Plan {
        let mut text = format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n");
        for (path, content) in files {
            text.push_str(&format!(
                "  - file: {{path: {path}, content: \"{content}\"}}\n"
            ));
        }
        text.push_str(gate);
        inplace_plan::parse_plan(text.as_bytes(), "test", &Limits::default()).unwrap()
    }

    /// A sandbox under `dir` whose engine has applied [`big_plan`] (`first`), and its big
    /// content.
    fn after_a_big_plan(
        dir: &std::path::Path,
        compact_bytes: u64,
    ) -> (EngineConfig, Arc<Host>, Engine, String) {
        let (config, host) = sandbox(dir, compact_bytes);
        let (plan, big) = big_plan("first", "");
        let engine = Engine::open(config.clone(), host.clone()).unwrap().0;
        engine.submit(plan, "test", false).unwrap();
        engine.run_until_idle();
        assert_eq!(engine.status("first").unwrap().phase, Phase::Succeeded);
        (config, host, engine, big)
    }

    #[test]
    fn a_file_already_in_place_is_held_by_its_target_and_not_stored_again() {
        let dir = tempfile::tempdir().unwrap();
        let (config, host, engine, big) = after_a_big_plan(dir.path(), 1 << 20);
        drop(engine);
        let stored = blobs(&config);
        // The same big file (in place now) and another small one, under a new id.
        let files = [
            ("/etc/kubernetes/big.conf", big.as_str()),
            ("/etc/kubernetes/small.conf", "other"),
        ];
        let second = file_plan("second", &files, "");
        {
            let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
            engine.submit(second.clone(), "test", false).unwrap();
            // Not run: as if the agent stopped right after accepting it.
        }
        let last = last_accepted(&config);
        assert!(
            last.contains("\"held\":[{\"index\":0,")
                && last.contains("\"staged\":[{\"index\":1,")
                && !last.contains("\"bodies\":\"")
                && !last.contains(&big[..64]),
            "{last}"
        );
        assert_eq!(
            blobs(&config),
            stored,
            "nothing stored for the held content"
        );
        assert_eq!(staged_files(dir.path()).len(), 1);
        // Resumed after the restart: the held content is read back from its target.
        let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
        engine.run_until_idle();
        let status = engine.status("second").unwrap();
        assert_eq!(status.phase, Phase::Succeeded, "{status:?}");
        assert_eq!(status.digest, second.digest());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/small.conf")).unwrap(),
            "other"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/big.conf")).unwrap(),
            big
        );
        assert_eq!(staged_files(dir.path()), Vec::<String>::new());
        // (small.conf's old content is backed up.)
        let stored = blobs(&config);
        // The same desired state under a new id: every content is held, nothing is written.
        let again = file_plan("again", &files, "");
        engine.submit(again, "test", false).unwrap();
        let last = last_accepted(&config);
        assert!(
            last.contains("\"held\":[{\"index\":0,")
                && last.contains("{\"index\":1,")
                && !last.contains("\"staged\":")
                && !last.contains("\"bodies\":\""),
            "{last}"
        );
        assert_eq!(blobs(&config), stored);
        engine.run_until_idle();
        let status = engine.status("again").unwrap();
        assert_eq!(
            (status.phase, status.counts.unchanged),
            (Phase::Succeeded, 2),
            "{status:?}"
        );
    }

    #[test]
    fn held_content_changed_while_the_agent_was_stopped_fails_its_change_and_is_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let (config, host, engine, big) = after_a_big_plan(dir.path(), 1 << 20);
        // small.conf first, so the run has something to roll back when big.conf fails.
        let plan = file_plan(
            "held",
            &[
                ("/etc/kubernetes/small.conf", "changed"),
                ("/etc/kubernetes/big.conf", &big),
            ],
            "",
        );
        engine.submit(plan, "test", false).unwrap();
        drop(engine);
        assert!(last_accepted(&config).contains("\"held\":[{\"index\":1,"));
        // Changed by someone else while the agent was stopped.
        let big_conf = dir.path().join("etc/kubernetes/big.conf");
        std::fs::write(&big_conf, "edited").unwrap();
        let (engine, _) = Engine::open(config, host).unwrap();
        let error = rolled_back_at(&engine, "held", "changes[1] file /etc/kubernetes/big.conf");
        assert!(
            error.detail.contains("already held it") && error.detail.contains("submit the plan"),
            "{}",
            error.detail
        );
        // Nothing was written in its place, and the rest was rolled back.
        assert_eq!(std::fs::read_to_string(&big_conf).unwrap(), "edited");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/small.conf")).unwrap(),
            "small"
        );
        match engine.retry("held", "test") {
            Err(SubmitError::Conflict(message)) => {
                assert!(message.contains("no longer kept"), "{message}")
            }
            other => panic!("a retry without the content must be refused: {other:?}"),
        }
        assert_eq!(staged_files(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn a_failed_run_keeps_its_held_contents_for_a_retry_after_compaction() {
        let dir = tempfile::tempdir().unwrap();
        // Compaction after every plan.
        let (config, host, engine, big) = after_a_big_plan(dir.path(), 0);
        // The same contents (both held) and a health endpoint that does not answer until
        // the retry.
        let (listener, gate) = silent_health_gate();
        let plan = file_plan(
            "fails",
            &[
                ("/etc/kubernetes/big.conf", &big),
                ("/etc/kubernetes/small.conf", "small"),
            ],
            &gate,
        );
        engine.submit(plan, "test", false).unwrap();
        assert!(last_accepted(&config).contains("\"held\":["));
        engine.run_until_idle();
        // Nothing changed, so there was nothing to roll back; its contents were kept.
        assert_eq!(engine.status("fails").unwrap().phase, Phase::Failed);
        drop(engine);
        assert_eq!(blobs(&config), 1);
        // Changed by hand since: the retry must write the plan's content, from the blob.
        let big_conf = dir.path().join("etc/kubernetes/big.conf");
        std::fs::write(&big_conf, "edited").unwrap();
        answer_health(listener);
        let (engine, _) = Engine::open(config, host).unwrap();
        retry_succeeds(&engine, "fails");
        assert_eq!(std::fs::read_to_string(&big_conf).unwrap(), big);
    }

    #[test]
    fn a_plan_that_restarts_a_unit_stores_the_contents_its_targets_hold() {
        let dir = tempfile::tempdir().unwrap();
        let (config, _host, engine, big) = after_a_big_plan(dir.path(), 1 << 20);
        // A restarted unit could rewrite big.conf before its step: its content is stored.
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: restarts\nchanges:\n\
             \x20 - file: {{path: /etc/kubernetes/small.conf, content: \"other\", restartUnits: [kubelet.service]}}\n\
             \x20 - file: {{path: /etc/kubernetes/big.conf, content: \"{big}\"}}\n"
        );
        let plan = inplace_plan::parse_plan(text.as_bytes(), "test", &Limits::default()).unwrap();
        engine.submit(plan, "test", false).unwrap();
        let last = last_accepted(&config);
        assert!(
            last.contains("\"bodies\":\"") && !last.contains("\"held\":"),
            "{last}"
        );
        engine.run_until_idle();
        assert_eq!(engine.status("restarts").unwrap().phase, Phase::Succeeded);
    }

    /// The `previousSeq` of the compaction the journal file starts with; `None` when it
    /// does not start with one.
    fn last_compaction(state_dir: &std::path::Path) -> Option<u64> {
        let text = std::fs::read_to_string(crate::journal::file_path(state_dir)).ok()?;
        let (_, json) = text.lines().next()?.split_once(' ')?;
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        v["rec"]["compacted"]["previousSeq"].as_u64()
    }

    #[test]
    fn a_journal_whose_summaries_outgrow_the_limit_is_not_compacted_after_every_plan() {
        let dir = tempfile::tempdir().unwrap();
        // Far less than what the remembered plans' summaries take.
        let limit = 4096;
        let (config, host) = sandbox(dir.path(), limit);
        let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
        let (mut compactions, mut last, mut peak) = (0, None, 0);
        let mut head = 0;
        for i in 0..60 {
            let before = std::fs::metadata(crate::journal::file_path(&config.state_dir))
                .map(|m| m.len())
                .unwrap_or(0);
            engine
                .submit(
                    plan(&format!("p{i}"), &format!("c{}", i % 3)),
                    "test",
                    false,
                )
                .unwrap();
            engine.run_until_idle();
            let size = std::fs::metadata(crate::journal::file_path(&config.state_dir))
                .unwrap()
                .len();
            peak = peak.max(before.max(size));
            let now = last_compaction(&config.state_dir);
            if now != last {
                compactions += 1;
                last = now;
                head = size;
            }
        }
        assert!(
            head > limit,
            "the summaries ({head} bytes) outgrew the limit"
        );
        assert!(
            (3..30).contains(&compactions),
            "{compactions} compactions in 60 plans"
        );
        // Bounded: at most what a compaction leaves, the limit's worth of growth, and a plan.
        assert!(peak < 2 * head + limit, "peak {peak}, head {head}");
        // The head (the compaction and its summaries) is found again when the journal is
        // opened anew.
        let written = engine.shared.lock().journal.compacted_len();
        assert!(written > limit);
        drop(engine);
        let (engine, _) = Engine::open(config, host).unwrap();
        assert_eq!(engine.shared.lock().journal.compacted_len(), written);
        assert_eq!(engine.status("p59").unwrap().phase, Phase::Succeeded);
    }

    /// A plan that an agent before digests v2 journaled (by its v1 digest) is the same plan
    /// when it is submitted again after the upgrade: it does not run again, and a retry is
    /// its next attempt under the same digest.
    #[test]
    fn a_plan_journaled_with_a_v1_digest_is_still_the_same_plan() {
        let dir = tempfile::tempdir().unwrap();
        let (config, host) = sandbox(dir.path(), 1 << 20);
        let refused = "verify:\n  - httpGet: {url: \"http://127.0.0.1:9/healthz\", \
                       timeoutSeconds: 1, periodSeconds: 1}\n";
        let (ok, _) = big_plan("old/ok", "");
        let (fails, _) = big_plan("old/fails", refused);
        {
            let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
            for plan in [&ok, &fails] {
                // What an agent before v2 journaled: the same record, the v1 digest.
                let prepared = engine.admit(plan).unwrap();
                let v1 = Some(plan.digest_v1());
                engine
                    .accept(
                        plan.clone(),
                        v1,
                        Sums::Known(KnownSums::default()),
                        1,
                        "old agent",
                        &prepared,
                    )
                    .unwrap();
                engine.run_until_idle();
            }
        }
        let (engine, _) = Engine::open(config, host).unwrap();
        let known = |s: &Submission, plan: &Plan, attempt: u32| {
            let st = s.status();
            assert_eq!(
                (st.digest.as_str(), st.attempt),
                (plan.digest_v1().as_str(), attempt),
                "{s:?}"
            );
        };
        let s = engine.submit(ok.clone(), "test", false).unwrap();
        assert!(matches!(s, Submission::Existing(_)), "{s:?}");
        known(&s, &ok, 1);
        let s = engine.submit(fails.clone(), "test", false).unwrap();
        assert!(matches!(s, Submission::Existing(_)), "{s:?}");
        known(&s, &fails, 1);
        assert!(s.status().phase.is_failure(), "{s:?}");
        let s = engine.submit(fails.clone(), "test", true).unwrap();
        assert!(matches!(s, Submission::Accepted(_)), "{s:?}");
        known(&s, &fails, 2);
        engine.run_until_idle();
        // Another plan under a known id is new work, under its v2 digest.
        let changed = plan("old/ok", "changed");
        let s = engine.submit(changed.clone(), "test", false).unwrap();
        assert!(matches!(s, Submission::Accepted(_)), "{s:?}");
        assert_eq!(
            (s.status().digest.clone(), s.status().attempt),
            (changed.digest(), 1)
        );
    }

    #[test]
    fn a_failed_plan_with_bodies_is_retried_after_compaction() {
        let dir = tempfile::tempdir().unwrap();
        // Compaction after every plan.
        let (config, host) = sandbox(dir.path(), 0);
        // A health endpoint that does not answer until the retry.
        let (listener, gate) = silent_health_gate();
        let (plan, big) = big_plan("fails", &gate);
        let (engine, _) = Engine::open(config.clone(), host.clone()).unwrap();
        engine.submit(plan, "test", false).unwrap();
        engine.run_until_idle();
        assert_eq!(engine.status("fails").unwrap().phase, Phase::RolledBack);
        assert!(!dir.path().join("etc/kubernetes/big.conf").exists());
        // A succeeding plan with other bodies: its blob is not kept by compaction.
        let (other, _) = big_plan("other", "");
        engine.submit(other, "test", false).unwrap();
        engine.run_until_idle();
        let blobs = std::fs::read_dir(config.state_dir.join("backups"))
            .unwrap()
            .count();
        assert_eq!(blobs, 1, "only the failed plan's bodies are kept");
        drop(engine);
        answer_health(listener);
        // The compacted journal kept the failed plan, its content in the blob, for a retry.
        let (engine, _) = Engine::open(config, host).unwrap();
        retry_succeeds(&engine, "fails");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/kubernetes/big.conf")).unwrap(),
            big
        );
    }

    #[test]
    fn concurrent_submissions_accept_once_and_never_share_a_run() {
        let dir = tempfile::tempdir().unwrap();
        inplace_demo_node::build_kubeadm_worker(dir.path()).unwrap();
        let settings = SettingsInput {
            root: Some(dir.path().to_path_buf()),
            no_chroot: true,
            ..SettingsInput::default()
        }
        .resolve()
        .unwrap();
        let host = Arc::new(Host::open(settings.host.clone()).unwrap());
        let (engine, _) = Engine::open(settings.engine.clone(), host.clone()).unwrap();
        let same = plan("same", "same");
        let threads: Vec<_> = (0..16)
            .map(|t| {
                let engine = engine.clone();
                let same = same.clone();
                std::thread::spawn(move || {
                    let mut accepted = 0;
                    for i in 0..25 {
                        let id = format!("t{t}-{i}");
                        let mine = engine.submit(plan(&id, &id), "test", false).unwrap();
                        assert!(matches!(mine, Submission::Accepted(_)));
                        if let Submission::Accepted(_) =
                            engine.submit(same.clone(), "test", false).unwrap()
                        {
                            accepted += 1;
                        }
                    }
                    accepted
                })
            })
            .collect();
        let accepted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(accepted, 1, "the same plan was accepted {accepted} times");
        let plans = engine.plans();
        assert_eq!(plans.len(), 16 * 25 + 1);
        let runs: std::collections::BTreeSet<u64> = plans.iter().map(|p| p.run).collect();
        assert_eq!(runs.len(), plans.len(), "run numbers are unique");
        drop(engine);
        let (reopened, _) = Engine::open(settings.engine, host).unwrap();
        assert_eq!(
            reopened.plans(),
            plans,
            "the journal replays to the same table"
        );
    }
}
