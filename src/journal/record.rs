//! The records of the journal. Field names are part of the on-disk format: only add.

use crate::base::ErrorInfo;
use serde::{Deserialize, Serialize};

use serde_json::value::RawValue;

use crate::base::FileMeta;
use crate::engine::status::{Phase, PlanStatus};
use crate::host::systemd::{UnitBefore, UnitFileOp, UnitJob};
use crate::plan::{ChangeKind, Disruption, NodePath};

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
        /// The new phase.
        phase: Phase,
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
        phase: Phase,
        /// Why, when it did not succeed.
        error: Option<ErrorInfo>,
    },
    /// A finished plan carried over by compaction.
    Summary {
        /// Its final status (per-change results may be trimmed for old plans).
        status: Box<PlanStatus>,
        /// The canonical plan, kept for recent unsuccessful plans so they can be retried.
        plan: Option<PlanDoc>,
        /// The blob holding `plan`'s file contents, as in `PlanAccepted`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bodies: Option<String>,
    },
}

impl Record {
    /// The run this record belongs to, if any.
    pub fn run(&self) -> Option<u64> {
        match self {
            Record::Compacted { .. } | Record::SetMembers { .. } => None,
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
            | Record::PlanFinished { run, .. } => Some(*run),
        }
    }

    /// Short name for tables (`stepDone`).
    pub fn name(&self) -> &'static str {
        match self {
            Record::Compacted { .. } => "compacted",
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
            Record::PlanFinished { .. } => "planFinished",
            Record::Summary { .. } => "summary",
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
                    crate::host::systemd::UnitJob::Start => "starting",
                    crate::host::systemd::UnitJob::Stop => "stopping",
                    crate::host::systemd::UnitJob::Restart => "restarting",
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
            _ => None,
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
