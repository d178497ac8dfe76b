//! The records of the journal: the on-disk contract, apart from the engine's state. Field
//! names and spellings are part of the format (version [`super::FORMAT_VERSION`]): only add
//! fields, with a default, so journals of earlier versions still read. The engine converts
//! its state to and from these types (`engine::journaled`); a renamed engine field changes
//! that conversion, never the file. The values embedded here are the journal's own or small
//! shared value types whose serde form is itself fixed (`base`: errors, file metadata, unit
//! jobs and states; `plan`: change kinds, disruption, node paths).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use inplace_base::units::{UnitBefore, UnitFileOp, UnitJob};
use inplace_base::{ErrorInfo, FileMeta};
use inplace_plan::{ChangeKind, Disruption, NodePath};

/// A plan document kept as JSON text: replaying a journal does not parse the plans of runs
/// that finished; only an unfinished run's plan is read back into a `Plan`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PlanDoc(Box<RawValue>);

impl PlanDoc {
    /// Wraps a plan document.
    pub fn from_value(v: &serde_json::Value) -> PlanDoc {
        let text = serde_json::to_string(v).unwrap_or_else(|_| "null".into());
        PlanDoc(
            RawValue::from_string(text)
                .unwrap_or_else(|_| RawValue::from_string("null".into()).expect("null is JSON")),
        )
    }

    /// Parses the document.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::from_str(self.0.get()).unwrap_or(serde_json::Value::Null)
    }

    /// The JSON text.
    pub fn text(&self) -> &str {
        self.0.get()
    }
}

impl PartialEq for PlanDoc {
    fn eq(&self, other: &PlanDoc) -> bool {
        self.0.get() == other.0.get()
    }
}

/// What status needs of one change without reading the plan: kind, target, disruption.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeSummary {
    /// Kind.
    pub kind: ChangeKind,
    /// What it is about.
    pub target: String,
    /// Disruption when it changes something.
    pub disruption: Disruption,
}

/// What status needs of one gate without reading the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckSummary {
    /// Kind (`httpGet`).
    pub kind: String,
    /// What it checks.
    pub target: String,
}

/// A `file` change whose content was staged next to its target before the plan was
/// accepted (`.<name>.inplace-r<run>`, durable): the step renames it into place, and the
/// journal keeps a reference instead of the content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StagedBody {
    /// The change's index in the plan.
    pub index: u32,
    /// The file it stages.
    pub path: NodePath,
    /// sha256 hex of the staged content.
    pub sha256: String,
    /// Its length in bytes.
    pub len: u64,
    /// Mode and owner the staged file was given.
    pub meta: FileMeta,
    /// Directories staging created for it (removed again, when empty, if the run does
    /// not keep the file).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub created_dirs: Vec<NodePath>,
}

/// A `file` change whose target already held exactly its content, mode and owner when the
/// plan was accepted: its step has nothing to write, so the content is not stored again;
/// the journal keeps where it is and what it must be (`engine::staging`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldBody {
    /// The change's index in the plan.
    pub index: u32,
    /// The file that holds it.
    pub path: NodePath,
    /// sha256 hex of the content.
    pub sha256: String,
    /// Its length in bytes.
    pub len: u64,
}

/// One journal record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Record {
    /// First record of a compacted journal: links it to the chain it replaced.
    #[serde(rename_all = "camelCase")]
    Compacted {
        /// Hash of the last record of the replaced journal.
        previous_hash: String,
        /// Sequence number of that record.
        previous_seq: u64,
    },
    /// Contents of a plan about to be accepted are being staged next to their targets
    /// (written before the first staged file, synced): if `PlanAccepted` of `run` never
    /// follows, the next start removes those files and the directories listed.
    #[serde(rename_all = "camelCase")]
    Staging {
        /// The run number the plan will get.
        run: u64,
        /// The files staged (each as `.<name>.inplace-r<run>` beside it).
        paths: Vec<NodePath>,
        /// Directories that did not exist and staging may create, from the top.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        dirs: Vec<NodePath>,
    },
    /// A plan attempt was accepted; carries the full canonical plan so it can resume.
    #[serde(rename_all = "camelCase")]
    PlanAccepted {
        /// Run number, unique on this node.
        run: u64,
        /// Plan id.
        id: String,
        /// Plan digest.
        digest: String,
        /// Attempt number.
        attempt: u32,
        /// `cli` or `grpc`.
        source: String,
        /// The canonical plan document.
        plan: PlanDoc,
        /// Kind, target and disruption of each change (so a replay need not read `plan`).
        #[serde(default)]
        changes: Vec<ChangeSummary>,
        /// Kind and target of each gate.
        #[serde(default)]
        checks: Vec<CheckSummary>,
        /// sha256 of the blob in the backup store that holds the plan's file contents, when
        /// they were kept out of `plan` (whose file contents are then empty; see
        /// `journal::bodies`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bodies: Option<String>,
        /// The `file` contents staged beside their targets instead (their content is empty in
        /// `plan` and absent from `bodies`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        staged: Vec<StagedBody>,
        /// The `file` contents their targets already held (their content is empty in `plan`
        /// and absent from `bodies`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        held: Vec<HeldBody>,
        /// The managed set of the plan (`options.prune.set`), so the set's members are known
        /// without reading `plan`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prune: Option<String>,
    },
    /// A package version pattern (`1.31.2-*`) was resolved to the exact version this run
    /// installs (written before the change's first mutation; the run uses it from then on,
    /// also after a restart).
    VersionResolved {
        /// Run number.
        run: u64,
        /// The package change.
        index: u32,
        /// The exact version.
        version: String,
    },
    /// The paths of the plan's managed set that earlier plans wrote and this one does not
    /// list: the run removes them, as `absent` changes appended after the plan's own
    /// (written when the run prepares, before any change).
    PruneResolved {
        /// Run number.
        run: u64,
        /// The paths, in order.
        paths: Vec<String>,
    },
    /// The members of a managed set (written by compaction, which drops the plans they
    /// came from).
    SetMembers {
        /// The set.
        set: String,
        /// Its paths.
        paths: Vec<String>,
    },
    /// The run entered a phase.
    Phase {
        /// Run number.
        run: u64,
        /// The new phase (never a terminal one: a run ends with `PlanFinished`).
        phase: RunPhase,
        /// Why, when the phase is entered because something failed (`RollingBack`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<ErrorInfo>,
    },
    /// A change is about to mutate the node; its pre-images are durable in the backup
    /// store. Written (and fdatasynced) before the first mutation of the step.
    #[serde(rename_all = "camelCase")]
    StepStarted {
        /// Run number.
        run: u64,
        /// Change index.
        index: u32,
        /// What the node looked like before, in mutation order.
        preimages: Vec<Preimage>,
        /// What the change is about to do ("write /etc/x (12 bytes, 0644 0:0)"), so that a
        /// change finished after a restart still says what it wrote. Absent in journals of
        /// earlier versions.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        planned: Vec<String>,
    },
    /// A change is in its desired state.
    StepDone {
        /// Run number.
        run: u64,
        /// Change index.
        index: u32,
        /// Whether it had to change anything.
        changed: bool,
        /// What was done.
        message: String,
    },
    /// What the commands of a change printed (package manager, `kubeadm upgrade node`),
    /// bounded; written before its `StepDone`.
    StepOutput {
        /// Run number.
        run: u64,
        /// Change index.
        index: u32,
        /// Each command line with its exit status and the tail of its output.
        output: String,
    },
    /// A change failed.
    StepFailed {
        /// Run number.
        run: u64,
        /// Change index.
        index: u32,
        /// Why.
        error: ErrorInfo,
    },
    /// A change was announced by `StepStarted` but an earlier change of its batch failed
    /// before it was touched: nothing of it changed.
    StepAbandoned {
        /// Run number.
        run: u64,
        /// Change index.
        index: u32,
    },
    /// A changed change was restored from its pre-images.
    StepRolledBack {
        /// Run number.
        run: u64,
        /// Change index.
        index: u32,
    },
    /// Rollback could not restore a changed change (after retries); rollback goes on with
    /// the changes before it.
    StepRollbackFailed {
        /// Run number.
        run: u64,
        /// Change index.
        index: u32,
        /// Why.
        error: ErrorInfo,
    },
    /// systemd was asked to reload unit files.
    DaemonReloaded {
        /// Run number.
        run: u64,
        /// True when this happened during rollback.
        rollback: bool,
    },
    /// A unit was restarted because something it depends on changed (or, with `skipped`,
    /// would have been, had service management been on).
    UnitRestarted {
        /// Run number.
        run: u64,
        /// The unit.
        unit: String,
        /// True when this happened during rollback.
        rollback: bool,
        /// True when service management is off and the restart was not done.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        skipped: bool,
        /// What systemd said.
        message: String,
    },
    /// A unit job is about to be queued (write-ahead, fdatasynced): a start, stop or restart
    /// in the Restarting phase or during rollback, with the unit's state before it.
    #[serde(rename_all = "camelCase")]
    UnitJobStarted {
        /// Run number.
        run: u64,
        /// The unit.
        unit: String,
        /// The job.
        job: UnitJob,
        /// True during rollback.
        rollback: bool,
        /// The unit before the job; after a crash or a lost connection it tells whether a
        /// restart already happened.
        before: UnitBefore,
    },
    /// A unit job finished (or was not needed, or failed).
    #[serde(rename_all = "camelCase")]
    UnitJobDone {
        /// Run number.
        run: u64,
        /// The unit.
        unit: String,
        /// The job.
        job: UnitJob,
        /// True during rollback.
        rollback: bool,
        /// How it ended.
        outcome: UnitJobOutcome,
        /// What systemd said (the unit's state, result and status text).
        message: String,
    },
    /// The connection to systemd was lost during a call; the agent reconnects and retries.
    SystemdUnreachable {
        /// Run number.
        run: u64,
        /// What failed and when the next attempt is.
        message: String,
    },
    /// How this agent manages units for the run (`systemd on unix:path=...` or `off`),
    /// written when the run starts or resumes.
    ServiceManager {
        /// Run number.
        run: u64,
        /// The choice, for people.
        description: String,
    },
    /// A reboot was requested from this boot.
    #[serde(rename_all = "camelCase")]
    RebootRequested {
        /// Run number.
        run: u64,
        /// The reboot change.
        index: u32,
        /// The boot id before the reboot.
        boot_id: String,
    },
    /// A health gate finished.
    CheckDone {
        /// Run number.
        run: u64,
        /// Index in `verify[]`.
        index: u32,
        /// Whether it passed.
        passed: bool,
        /// What it saw.
        message: String,
    },
    /// Somebody asked to cancel the run; honoured at the next step boundary, also after a
    /// restart.
    CancelRequested {
        /// Run number.
        run: u64,
        /// Why, as the caller said (`cancel --reason`); absent in journals of earlier
        /// versions and when none was given.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
        /// Who asked (the caller's identity; `cli` for a local caller), when known.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        by: String,
    },
    /// The run ended.
    PlanFinished {
        /// Run number.
        run: u64,
        /// Terminal phase.
        phase: RunPhase,
        /// Why, when it did not succeed.
        error: Option<ErrorInfo>,
    },
    /// The file contents of a run that did not succeed were stored as one blob (its staged
    /// files are removed when it finishes, and the files that held contents may change), so
    /// it can be retried from the journal.
    #[serde(rename_all = "camelCase")]
    BodiesKept {
        /// Run number.
        run: u64,
        /// sha256 of the blob: every `file` content of the plan, as `PlanAccepted.bodies`.
        bodies: String,
    },
    /// A finished plan carried over by compaction.
    Summary {
        /// Its final status (per-change results may be trimmed for old plans).
        status: Box<SummaryStatus>,
        /// The canonical plan, kept for recent unsuccessful plans so they can be retried.
        plan: Option<PlanDoc>,
        /// The blob holding `plan`'s file contents, as in `PlanAccepted`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bodies: Option<String>,
        /// The contents of `plan` that were staged (not in `bodies`), as in `PlanAccepted`:
        /// without them a document whose contents were emptied would read back as a plan of
        /// empty files.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        staged: Vec<StagedBody>,
        /// The contents of `plan` its targets held, as in `PlanAccepted`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        held: Vec<HeldBody>,
        /// For the last succeeded plan (kept as the drift baseline): the exact versions its
        /// run resolved, by change index, as `VersionResolved` said.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        versions: BTreeMap<u32, String>,
        /// For the last succeeded plan: the managed-set paths its run removed, as
        /// `PruneResolved` said.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pruned: Vec<String>,
    },
    /// The node stopped matching the last succeeded plan (`run`), or what differs changed:
    /// the drifted changes as found now. Not a record of the run: nothing of it changed.
    #[serde(rename_all = "camelCase")]
    DriftFound {
        /// The run of the last succeeded plan (the baseline).
        run: u64,
        /// Each drifted change, with when it was first seen drifted.
        changes: Vec<DriftNote>,
    },
    /// The node matches the last succeeded plan (`run`) again.
    #[serde(rename_all = "camelCase")]
    DriftCleared {
        /// The run of the baseline.
        run: u64,
    },
}

/// One drifted change, as journaled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DriftNote {
    /// Index in the plan's `changes[]`.
    pub index: u32,
    /// Kind.
    pub kind: ChangeKind,
    /// What it is about.
    pub target: String,
    /// What differs, in words (expected and found).
    pub detail: String,
    /// When it was first seen drifted (Unix ms).
    pub first_seen_ms: u64,
}

impl Record {
    /// The run this record belongs to, if any.
    pub fn run(&self) -> Option<u64> {
        match self {
            // Not a run yet: the plan is still being accepted.
            Record::Compacted { .. } | Record::SetMembers { .. } | Record::Staging { .. } => None,
            // About the node, not a run's progress.
            Record::DriftFound { .. } | Record::DriftCleared { .. } => None,
            Record::Summary { status, .. } => Some(status.run),
            Record::VersionResolved { run, .. } | Record::PruneResolved { run, .. } => Some(*run),
            Record::PlanAccepted { run, .. }
            | Record::Phase { run, .. }
            | Record::StepStarted { run, .. }
            | Record::StepDone { run, .. }
            | Record::StepOutput { run, .. }
            | Record::StepFailed { run, .. }
            | Record::StepAbandoned { run, .. }
            | Record::StepRolledBack { run, .. }
            | Record::StepRollbackFailed { run, .. }
            | Record::DaemonReloaded { run, .. }
            | Record::UnitRestarted { run, .. }
            | Record::UnitJobStarted { run, .. }
            | Record::UnitJobDone { run, .. }
            | Record::SystemdUnreachable { run, .. }
            | Record::ServiceManager { run, .. }
            | Record::RebootRequested { run, .. }
            | Record::CheckDone { run, .. }
            | Record::CancelRequested { run, .. }
            | Record::BodiesKept { run, .. }
            | Record::PlanFinished { run, .. } => Some(*run),
        }
    }

    /// Short name for tables (`stepDone`).
    pub fn name(&self) -> &'static str {
        match self {
            Record::Compacted { .. } => "compacted",
            Record::Staging { .. } => "staging",
            Record::PlanAccepted { .. } => "planAccepted",
            Record::VersionResolved { .. } => "versionResolved",
            Record::PruneResolved { .. } => "pruneResolved",
            Record::SetMembers { .. } => "setMembers",
            Record::Phase { .. } => "phase",
            Record::StepStarted { .. } => "stepStarted",
            Record::StepDone { .. } => "stepDone",
            Record::StepOutput { .. } => "stepOutput",
            Record::StepFailed { .. } => "stepFailed",
            Record::StepAbandoned { .. } => "stepAbandoned",
            Record::StepRolledBack { .. } => "stepRolledBack",
            Record::StepRollbackFailed { .. } => "stepRollbackFailed",
            Record::DaemonReloaded { .. } => "daemonReloaded",
            Record::UnitRestarted { .. } => "unitRestarted",
            Record::UnitJobStarted { .. } => "unitJobStarted",
            Record::UnitJobDone { .. } => "unitJobDone",
            Record::SystemdUnreachable { .. } => "systemdUnreachable",
            Record::ServiceManager { .. } => "serviceManager",
            Record::RebootRequested { .. } => "rebootRequested",
            Record::CheckDone { .. } => "checkDone",
            Record::CancelRequested { .. } => "cancelRequested",
            Record::BodiesKept { .. } => "bodiesKept",
            Record::PlanFinished { .. } => "planFinished",
            Record::Summary { .. } => "summary",
            Record::DriftFound { .. } => "driftFound",
            Record::DriftCleared { .. } => "driftCleared",
        }
    }

    /// True for records that announce a mutation of the node (the write-ahead ones).
    pub fn is_mutation(&self) -> bool {
        matches!(
            self,
            Record::StepStarted { .. }
                | Record::RebootRequested { .. }
                | Record::UnitJobStarted { .. }
        )
    }

    /// A line for watchers about unit jobs, restarts, reboots and lost connections; `None`
    /// for records that carry no such news.
    pub fn note(&self) -> Option<String> {
        let rb = |rollback: bool| if rollback { " (rollback)" } else { "" };
        match self {
            Record::UnitRestarted { message, .. } => Some(message.clone()),
            Record::CancelRequested { reason, by, .. } => Some(format!(
                "cancel requested{}{}; the run stops at the next step boundary",
                if by.is_empty() {
                    String::new()
                } else {
                    format!(" by {by}")
                },
                if reason.is_empty() {
                    String::new()
                } else {
                    format!(": {reason}")
                }
            )),
            Record::UnitJobStarted {
                unit,
                job,
                rollback,
                before,
                ..
            } => Some(format!(
                "{} {unit}{} (it was {}/{}{})",
                match job {
                    UnitJob::Start => "starting",
                    UnitJob::Stop => "stopping",
                    UnitJob::Restart => "restarting",
                },
                if *rollback { " to roll back" } else { "" },
                before.active_state,
                before.sub_state,
                before
                    .invocation_id
                    .as_deref()
                    .map(|id| format!(", InvocationID {}", &id[..id.len().min(12)]))
                    .unwrap_or_default()
            )),
            Record::UnitJobDone {
                rollback, message, ..
            } => Some(format!("{message}{}", rb(*rollback))),
            Record::SystemdUnreachable { message, .. } => Some(message.clone()),
            Record::DaemonReloaded { rollback, .. } => {
                Some(format!("systemd reloaded unit files{}", rb(*rollback)))
            }
            Record::RebootRequested { index, boot_id, .. } => Some(format!(
                "changes[{index}]: reboot requested from boot {boot_id}; waiting for the node \
                 to come back"
            )),
            // Phases, steps and gates are in the status itself (phase, per-change and
            // per-gate results); the rest is bookkeeping.
            Record::Compacted { .. }
            | Record::PlanAccepted { .. }
            | Record::VersionResolved { .. }
            | Record::PruneResolved { .. }
            | Record::SetMembers { .. }
            | Record::Phase { .. }
            | Record::StepStarted { .. }
            | Record::StepDone { .. }
            | Record::StepOutput { .. }
            | Record::StepFailed { .. }
            | Record::StepAbandoned { .. }
            | Record::StepRolledBack { .. }
            | Record::StepRollbackFailed { .. }
            | Record::ServiceManager { .. }
            | Record::CheckDone { .. }
            | Record::PlanFinished { .. }
            | Record::Staging { .. }
            | Record::BodiesKept { .. }
            | Record::DriftFound { .. }
            | Record::DriftCleared { .. }
            | Record::Summary { .. } => None,
        }
    }
}

/// How a unit job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum UnitJobOutcome {
    /// systemd finished the job and the unit is where it was asked to be.
    Done,
    /// Nothing was queued (service management off, or a unit that is not running and that
    /// the plan does not ask to run).
    Skipped,
    /// The job failed or left the unit failed; the message says how.
    Failed,
}

/// What one mutation target looked like before the step, enough to put it back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Preimage {
    /// A file.
    #[serde(rename_all = "camelCase")]
    File {
        /// Node path.
        path: NodePath,
        /// Its previous state.
        before: FileBefore,
        /// Directories the step creates above it (removed again on rollback when empty).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        created_dirs: Vec<NodePath>,
    },
    /// A live kernel parameter.
    Sysctl {
        /// The `/proc/sys` path.
        path: NodePath,
        /// Its value before.
        before: String,
    },
    /// A unit file's enablement or mask before the change enabled, disabled, masked or
    /// unmasked it; rollback applies the inverse operation.
    #[serde(rename_all = "camelCase")]
    UnitFile {
        /// The unit.
        unit: String,
        /// What the change did.
        op: UnitFileOp,
        /// `GetUnitFileState` before (`enabled`, `disabled`, `masked`...; `absent` for no
        /// unit file).
        before: String,
    },
    /// A unit's run state before a change asked for it to be running or stopped. The start
    /// or stop happens in the Restarting phase and is journaled there; rollback undoes that
    /// job, so this pre-image itself restores nothing.
    #[serde(rename_all = "camelCase")]
    UnitActive {
        /// The unit.
        unit: String,
        /// Its state then.
        before: UnitBefore,
    },
    /// Host-specific state recorded by later step kinds (units, packages), opaque here.
    Other {
        /// Which step kind owns it.
        kind: String,
        /// Its data.
        data: serde_json::Value,
    },
}

/// A file's previous state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FileBefore {
    /// It did not exist.
    Absent,
    /// It existed with this content (in the backup store) and metadata.
    Present {
        /// sha256 of the content, the backup store key.
        sha256: String,
        /// Mode and owner.
        meta: FileMeta,
    },
}

/// A run's phase as the journal spells it (`"Applying"`). The engine's `Phase` converts to
/// and from it; which moves between phases are legal is the engine's business
/// (`Phase::can_become`), not the format's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RunPhase {
    /// Accepted, not started.
    Pending,
    /// Re-validating against the node, downloading and checking artifacts.
    Preparing,
    /// Changing the node.
    Applying,
    /// Reloading systemd and restarting units.
    Restarting,
    /// Running the health gates.
    Verifying,
    /// Every change applied and every gate passed.
    Succeeded,
    /// Ended failed, not rolled back.
    Failed,
    /// Restoring what the run changed.
    RollingBack,
    /// Ended failed, every change restored.
    RolledBack,
    /// A newer plan took over.
    Superseded,
    /// Cancelled on request.
    Cancelled,
}

impl RunPhase {
    /// The name as written (`Applying`).
    pub fn as_str(self) -> &'static str {
        match self {
            RunPhase::Pending => "Pending",
            RunPhase::Preparing => "Preparing",
            RunPhase::Applying => "Applying",
            RunPhase::Restarting => "Restarting",
            RunPhase::Verifying => "Verifying",
            RunPhase::Succeeded => "Succeeded",
            RunPhase::Failed => "Failed",
            RunPhase::RollingBack => "RollingBack",
            RunPhase::RolledBack => "RolledBack",
            RunPhase::Superseded => "Superseded",
            RunPhase::Cancelled => "Cancelled",
        }
    }
}

impl fmt::Display for RunPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The final status of a run, as a `Summary` record carries it after compaction dropped the
/// run's own records. The shape is the one `Summary` records have always had.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SummaryStatus {
    /// Plan id.
    pub id: String,
    /// Plan digest (`v2:sha256:...`; `sha256:...` for a plan journaled before digests v2).
    pub digest: String,
    /// Attempt number.
    pub attempt: u32,
    /// Run number.
    pub run: u64,
    /// Where the plan came from (`cli`, `grpc`).
    pub source: String,
    /// The phase the run ended in.
    pub phase: RunPhase,
    /// Step i of n when it ended.
    pub progress: SummaryProgress,
    /// Per change (empty for old plans: only the newest keep them).
    #[serde(default)]
    pub changes: Vec<SummaryChange>,
    /// Per gate.
    #[serde(default)]
    pub checks: Vec<SummaryCheck>,
    /// Why it did not succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
    /// A reboot was pending.
    #[serde(default)]
    pub rebooting: bool,
    /// How units were managed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub services: String,
    /// Accepted (Unix ms).
    pub accepted_at_ms: u64,
    /// Started (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// Ended (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// Changes by result.
    pub counts: SummaryCounts,
    /// The run's newest events.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<SummaryEvent>,
}

/// Step i of n in a [`SummaryStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SummaryProgress {
    /// 1-based step.
    pub current: u32,
    /// Changes plus gates.
    pub total: u32,
    /// The last message.
    pub message: String,
}

/// One change's result in a [`SummaryStatus`] (not [`ChangeSummary`], which is a change's
/// kind and target in `PlanAccepted`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SummaryChange {
    /// Position in `changes[]`.
    pub index: u32,
    /// Kind.
    pub kind: ChangeKind,
    /// Path, package or unit.
    pub target: String,
    /// How it ended.
    pub state: SummaryChangeState,
    /// The last thing said about it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Disruption when it changes something.
    pub disruption: Disruption,
    /// How long it took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

/// How a change ended, as a [`SummaryChange`] spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SummaryChangeState {
    /// Not reached.
    Pending,
    /// Being applied.
    Running,
    /// Already in the desired state.
    Unchanged,
    /// Changed.
    Changed,
    /// Failed.
    Failed,
    /// Changed, then restored.
    RolledBack,
    /// Changed, and rollback could not restore it.
    RollbackFailed,
    /// Not applied because the run ended first.
    Skipped,
}

/// One gate's result in a [`SummaryStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SummaryCheck {
    /// Position in `verify[]`.
    pub index: u32,
    /// Check kind (`httpGet`).
    pub kind: String,
    /// What it checks.
    pub target: String,
    /// How it ended.
    pub state: SummaryCheckState,
    /// What it saw last.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// How a gate ended, as a [`SummaryCheck`] spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SummaryCheckState {
    /// Not run.
    Pending,
    /// Being polled.
    Running,
    /// Passed.
    Passed,
    /// Failed.
    Failed,
    /// Not run because the run ended first.
    Skipped,
}

/// Changes by result in a [`SummaryStatus`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SummaryCounts {
    /// Changes in the plan.
    pub total: u32,
    /// Changed.
    pub changed: u32,
    /// Already in the desired state.
    pub unchanged: u32,
    /// Restored by rollback.
    pub rolled_back: u32,
}

/// One event of a run in a [`SummaryStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SummaryEvent {
    /// The sequence number of the record it came from.
    pub seq: u64,
    /// When (Unix ms).
    pub at_ms: u64,
    /// What happened.
    pub message: String,
}
