//! The documents of the status socket, versioned like plans (`apiVersion: inplace.agent/v1`,
//! a `kind`). Fields are only ever added. `docs/status-api.schema.json` is their JSON Schema,
//! generated from these types ([`schema`]); a test fails when it drifts. The documents are
//! types of their own, converted from the engine's state (the plan's change kinds and
//! disruption, and `base::ErrorInfo`, are shared value types whose JSON is fixed as well).

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::engine::state as engine;
use crate::engine::table::Table;
use crate::journal::{Entry, JournalError, Reader, Record};
use inplace_base::ErrorInfo;
use inplace_plan::{ChangeKind, Disruption};

/// `kind` of the agent's status.
pub const KIND_AGENT_STATUS: &str = "AgentStatus";
/// `kind` of one plan's status.
pub const KIND_PLAN_STATUS: &str = "PlanStatus";
/// `kind` of a page of journal records.
pub const KIND_JOURNAL_RECORDS: &str = "JournalRecords";
/// `kind` of an error answer.
pub const KIND_ERROR: &str = "Error";

/// How many finished plans `AgentStatus.recent` lists.
pub const RECENT_PLANS: usize = 10;

/// Where a status came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    /// The running agent answered on its status socket.
    Agent,
    /// No agent answered; the journal was read directly (read-only, without its lock).
    Journal,
}

/// `GET /v1/status`: what the agent is doing and what it did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    /// `inplace.agent/v1`.
    pub api_version: String,
    /// `AgentStatus`.
    pub kind: String,
    /// Whether the running agent said this or the journal was read without it.
    pub source: Source,
    /// When this was put together (Unix ms).
    pub generated_at_ms: u64,
    /// The node.
    pub node: NodeInfo,
    /// The agent process; absent when read from the journal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentInfo>,
    /// How the agent manages units (`systemd on unix:path=...`, or `off`).
    pub services: String,
    /// The plan running (or accepted and waiting), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<CurrentPlan>,
    /// The most recent finished plans, newest first (at most 10).
    pub recent: Vec<PlanSummary>,
    /// The newest plan that did not succeed, however old, with the step that failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<PlanSummary>,
    /// The journal.
    pub journal: JournalSummary,
    /// Whether the node still matches the last succeeded plan; absent before any plan
    /// succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<DriftStatus>,
}

/// Whether the node still matches the last plan that succeeded on it (docs/observability.md,
/// Drift).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriftStatus {
    /// True when some change of the baseline does not match the node.
    pub drifted: bool,
    /// The last succeeded plan (absent when it is known only from the journal's drift
    /// records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<DriftBaseline>,
    /// When the running agent last checked (Unix ms); absent when read from the journal
    /// (what the last check journaled) or before the first check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked_at_ms: Option<u64>,
    /// Why the last check could not be made, if it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The drifted changes.
    pub changes: Vec<DriftedChange>,
}

/// The plan drift is measured against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriftBaseline {
    /// Plan id.
    pub id: String,
    /// Plan digest.
    pub digest: String,
    /// Its attempt that succeeded.
    pub attempt: u32,
    /// Its run.
    pub run: u64,
}

/// One change of the baseline that the node no longer matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriftedChange {
    /// Index in the plan's `changes[]`.
    pub index: u32,
    /// Kind.
    pub kind: ChangeKind,
    /// What it is about.
    pub target: String,
    /// What differs, in words.
    pub detail: String,
    /// What differs, field by field (expected and found); empty when read from the journal.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub differences: Vec<inplace_plan::kinds::Difference>,
    /// When it was first seen drifted (Unix ms).
    pub first_seen_ms: u64,
}

impl DriftStatus {
    /// The running agent's view.
    pub fn of(state: &crate::engine::drift::DriftState) -> Option<DriftStatus> {
        let baseline = state.baseline.as_ref()?;
        Some(DriftStatus {
            drifted: state.drifted(),
            baseline: Some(DriftBaseline {
                id: baseline.id.clone(),
                digest: baseline.digest.clone(),
                attempt: baseline.attempt,
                run: baseline.run,
            }),
            checked_at_ms: state.checked_at_ms,
            problem: state.problem.clone(),
            changes: state
                .changes
                .iter()
                .map(|c| DriftedChange {
                    index: c.index,
                    kind: c.kind,
                    target: c.target.clone(),
                    detail: c.detail.clone(),
                    differences: c.differences.clone(),
                    first_seen_ms: c.first_seen_ms,
                })
                .collect(),
        })
    }

    /// What the journal last recorded (no agent answering, or before its first check).
    pub fn journaled(table: &Table) -> Option<DriftStatus> {
        let run = table.baseline().map(|b| b.kept.run)?;
        let baseline = table.by_run(run).map(|s| DriftBaseline {
            id: s.id.clone(),
            digest: s.digest.clone(),
            attempt: s.attempt,
            run,
        });
        let changes: Vec<DriftedChange> = table
            .journaled_drift()
            .filter(|d| d.run == run)
            .map(|d| {
                d.changes
                    .iter()
                    .map(|n| DriftedChange {
                        index: n.index,
                        kind: n.kind,
                        target: n.target.clone(),
                        detail: n.detail.clone(),
                        differences: Vec::new(),
                        first_seen_ms: n.first_seen_ms,
                    })
                    .collect()
            })
            .unwrap_or_default();
        Some(DriftStatus {
            drifted: !changes.is_empty(),
            baseline,
            checked_at_ms: None,
            problem: None,
            changes,
        })
    }
}

/// The node the agent manages.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeInfo {
    /// The node's Kubernetes name (empty when unknown).
    pub name: String,
    /// The node's root directory as the agent sees it (`/`, or `/host` in the DaemonSet).
    pub root: String,
    /// os-release `ID` (`debian`).
    #[serde(default)]
    pub os_id: String,
    /// os-release `VERSION_ID` (`12`).
    #[serde(default)]
    pub os_version_id: String,
    /// os-release `PRETTY_NAME`.
    #[serde(default)]
    pub os_pretty_name: String,
    /// Kernel release.
    #[serde(default)]
    pub kernel_release: String,
    /// Machine architecture.
    #[serde(default)]
    pub architecture: String,
    /// `kubelet --version` (`v1.31.2`), refreshed after every plan; empty when unknown.
    #[serde(default)]
    pub kubelet_version: String,
}

/// The agent process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentInfo {
    /// Version of the agent.
    pub version: String,
    /// Git commit it was built from: 12 hex digits, `+modified` when its sources differed
    /// from that commit, `unknown` when it was built without git metadata.
    pub commit: String,
    /// Process id.
    pub pid: u32,
    /// When it started (Unix ms).
    pub started_at_ms: u64,
    /// Seconds since then.
    pub uptime_seconds: u64,
    /// The gRPC listener.
    pub grpc_listen: String,
    /// This socket.
    pub status_socket: String,
    /// The TCP metrics listener, when configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
}

/// The plan being run: where it is and what it is doing now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CurrentPlan {
    /// Plan id.
    pub id: String,
    /// Plan digest (`v2:sha256:...`; `sha256:...` for a plan journaled before digests v2).
    pub digest: String,
    /// Attempt number.
    pub attempt: u32,
    /// Journal run number.
    pub run: u64,
    /// Where it came from (`cli`, `grpc`).
    pub source: String,
    /// Phase.
    pub phase: Phase,
    /// Step i of `steps`: the change or gate running now (1-based), else the last one run
    /// (0 before the first); the same number as the hook response's "step i/n".
    pub step: u32,
    /// Changes plus gates.
    pub steps: u32,
    /// What is happening, for people.
    pub message: String,
    /// The change being applied (Preparing, Applying), if one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_change: Option<ChangeStatus>,
    /// The health gate being polled (Verifying), if one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_check: Option<CheckStatus>,
    /// When it was accepted (Unix ms).
    pub accepted_at_ms: u64,
    /// When it started running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// How long it has been running; absent when read from the journal (no agent runs it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_ms: Option<u64>,
    /// Read from the journal (no agent runs it): where the run goes on when the agent starts
    /// again (`changes[1] kubeletConfig /var/lib/kubelet/config.yaml`, the Restarting phase,
    /// a gate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumes_at: Option<String>,
    /// Changes so far.
    pub counts: Counts,
    /// Why it is rolling back, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
    /// A reboot was requested and the node has not come back yet.
    pub rebooting: bool,
    /// The `UpdateMachine` hook response for it right now.
    pub hook_response: HookResponse,
    /// Its newest events (at most 5; `/v1/plans/{id}` has up to 32): unit jobs, reloads,
    /// reboots, the agent restarting.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<RunEvent>,
}

/// How many events `CurrentPlan` carries.
pub const CURRENT_EVENTS: usize = 5;

/// A plan attempt in one line: its result and how long it took.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlanSummary {
    /// Plan id.
    pub id: String,
    /// Plan digest.
    pub digest: String,
    /// Attempt number.
    pub attempt: u32,
    /// Journal run number.
    pub run: u64,
    /// Where it came from.
    pub source: String,
    /// Phase: the result once it is terminal.
    pub phase: Phase,
    /// When it was accepted (Unix ms).
    pub accepted_at_ms: u64,
    /// When it started running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// From start to end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Changes by result.
    pub counts: Counts,
    /// Why it did not succeed, with the step that failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
}

/// The journal file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JournalSummary {
    /// Its path.
    pub path: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Records in it.
    pub records: u64,
    /// Sequence number of the last record (0 when empty); `GET /v1/journal?since=` it.
    pub last_seq: u64,
}

/// `GET /v1/plans/{id}` (and `inplace-agent status ID -o json`): the latest attempt of a
/// plan with every change and gate, and its hook response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlanStatusDocument {
    /// `inplace.agent/v1`.
    pub api_version: String,
    /// `PlanStatus`.
    pub kind: String,
    /// The status.
    #[serde(flatten)]
    pub status: PlanStatus,
    /// The `UpdateMachine` hook response for it.
    pub hook_response: HookResponse,
}

impl PlanStatusDocument {
    /// The document for a status.
    pub fn new(status: engine::PlanStatus) -> PlanStatusDocument {
        PlanStatusDocument {
            api_version: inplace_plan::API_VERSION.to_string(),
            kind: KIND_PLAN_STATUS.to_string(),
            hook_response: (&status.hook_response()).into(),
            status: (&status).into(),
        }
    }
}

/// `GET /v1/journal?since=SEQ&limit=N`: records after `since`, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JournalRecords {
    /// `inplace.agent/v1`.
    pub api_version: String,
    /// `JournalRecords`.
    pub kind: String,
    /// The `since` asked for.
    pub since: u64,
    /// The records, as `inplace-agent journal -o json` prints them.
    pub records: Vec<JournalItem>,
    /// True when more records follow the last one here (ask again with its `seq`).
    pub more: bool,
}

/// One journal record (the items of `inplace-agent journal -o json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JournalItem {
    /// Sequence number.
    pub seq: u64,
    /// When it was written (RFC 3339, UTC).
    pub time: String,
    /// Its chain hash (hex).
    pub hash: String,
    /// The run it belongs to.
    pub run: Option<u64>,
    /// Record type (`planAccepted`, `stepDone`, ...).
    #[serde(rename = "type")]
    pub record_type: String,
    /// The record as the journal stores it (`{"stepDone": {...}}`; see docs/observability.md).
    pub record: serde_json::Value,
    /// Fields left out (set to null) because they carry plan content: `plan` of
    /// `planAccepted` and `summary` records. Only on the status socket; `inplace-agent journal`
    /// (root) shows everything.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub redacted: Vec<String>,
}

impl JournalItem {
    /// The item for a journal entry; with `redact`, plan documents are left out.
    pub fn new(entry: &Entry, redact: bool) -> JournalItem {
        let mut record = serde_json::to_value(&entry.record).unwrap_or_default();
        let mut redacted = Vec::new();
        if redact
            && matches!(
                entry.record,
                Record::PlanAccepted { .. } | Record::Summary { .. }
            )
            && let Some(fields) = record
                .get_mut(entry.record.name())
                .and_then(|v| v.as_object_mut())
            && let Some(plan) = fields.get_mut("plan")
            && !plan.is_null()
        {
            *plan = serde_json::Value::Null;
            redacted.push("plan".to_string());
        }
        JournalItem {
            seq: entry.seq,
            time: inplace_base::time::rfc3339(entry.ts),
            hash: entry.hash_hex(),
            run: entry.record.run(),
            record_type: entry.record.name().to_string(),
            record,
            redacted,
        }
    }
}

/// An error answer of the socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ErrorDocument {
    /// `inplace.agent/v1`.
    pub api_version: String,
    /// `Error`.
    pub kind: String,
    /// The HTTP status code.
    pub code: u16,
    /// What went wrong.
    pub message: String,
}

impl ErrorDocument {
    /// An error answer.
    pub fn new(code: u16, message: impl Into<String>) -> ErrorDocument {
        ErrorDocument {
            api_version: inplace_plan::API_VERSION.to_string(),
            kind: KIND_ERROR.to_string(),
            code,
            message: message.into(),
        }
    }
}

// === The plan status as the documents carry it ===
//
// The engine's state converted (bootc's way with its API types): the same names and shapes
// the documents have always had, separate from `engine::state`, so a change there changes
// the conversions below (the compiler points at them) and not the JSON, and the schema in
// docs/ keeps guarding what clients see.

/// Phases of a plan run: Pending → Preparing → Applying → Restarting → Verifying →
/// Succeeded, or Failed / RollingBack → RolledBack, Superseded, Cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    /// Accepted, not started.
    Pending,
    /// Re-validating against the node, downloading and checking artifacts.
    Preparing,
    /// Changing the node, one change at a time.
    Applying,
    /// Reloading systemd and restarting the units whose inputs changed.
    Restarting,
    /// Running the health gates.
    Verifying,
    /// Every change applied and every gate passed.
    Succeeded,
    /// A step or gate failed and nothing was rolled back.
    Failed,
    /// Restoring what the plan changed.
    RollingBack,
    /// A step or gate failed and every change was restored.
    RolledBack,
    /// A newer plan took over at a step boundary.
    Superseded,
    /// Cancelled on request at a step boundary.
    Cancelled,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// State of one change within a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ChangeState {
    /// Not reached yet.
    Pending,
    /// Being applied.
    Running,
    /// Already in the desired state; nothing written.
    Unchanged,
    /// Changed to the desired state.
    Changed,
    /// Failed.
    Failed,
    /// Changed, then restored by rollback.
    RolledBack,
    /// Changed, and rollback could not restore it (the message says why): the node needs
    /// attention at exactly this change.
    RollbackFailed,
    /// Not applied because the run ended first.
    Skipped,
}

/// State of one health gate within a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CheckState {
    /// Not run yet.
    Pending,
    /// Being polled.
    Running,
    /// Passed.
    Passed,
    /// Failed (after retries until its timeout).
    Failed,
    /// Not run because the run ended first.
    Skipped,
}

/// Result of one change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChangeStatus {
    /// Position in `changes[]`.
    pub index: u32,
    /// Change kind.
    pub kind: ChangeKind,
    /// What it is about (path, package, unit).
    pub target: String,
    /// State.
    pub state: ChangeState,
    /// The last thing said about it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Disruption when it changes something.
    pub disruption: Disruption,
    /// How long it took, once done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

/// Result of one health gate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckStatus {
    /// Position in `verify[]`.
    pub index: u32,
    /// Check kind (`httpGet`).
    pub kind: String,
    /// What it checks.
    pub target: String,
    /// State.
    pub state: CheckState,
    /// What it saw last.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// Progress through a run: step `current` of `total`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct Progress {
    /// 1-based number of the step running (the change being applied, the gate being
    /// polled), else of the last one run (0 before the first). While units restart it stays
    /// at the last change.
    pub current: u32,
    /// Changes plus gates.
    pub total: u32,
    /// What is happening, for people.
    pub message: String,
}

/// The CAPI `UpdateMachine` response status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum HookStatus {
    /// In progress (retryAfterSeconds > 0) or done (0).
    Success,
    /// The update failed.
    Failure,
}

/// Exactly what an updater returns to CAPI for this plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HookResponse {
    /// Success or Failure.
    pub status: HookStatus,
    /// Shown in the Machine's `Updating` condition.
    pub message: String,
    /// Ask CAPI to call again after this many seconds; 0 means done.
    pub retry_after_seconds: u32,
}

/// The status of one plan attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlanStatus {
    /// Plan id.
    pub id: String,
    /// Plan digest (`v2:sha256:...`; `sha256:...` for a plan journaled before digests v2).
    pub digest: String,
    /// Attempt number, 1 for the first run, +1 per explicit retry.
    pub attempt: u32,
    /// Journal run number (unique per attempt on this node).
    pub run: u64,
    /// Where it came from (`cli`, `grpc`).
    pub source: String,
    /// Phase.
    pub phase: Phase,
    /// Step i of n.
    pub progress: Progress,
    /// Per change.
    #[serde(default)]
    pub changes: Vec<ChangeStatus>,
    /// Per gate.
    #[serde(default)]
    pub checks: Vec<CheckStatus>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
    /// A reboot was requested and the node has not come back yet.
    #[serde(default)]
    pub rebooting: bool,
    /// How the agent manages units for this run (`systemd on unix:path=...`, or `off` when
    /// restarts are only journaled), as it said when the run started or resumed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub services: String,
    /// When it was accepted (Unix ms).
    pub accepted_at_ms: u64,
    /// When it started running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// Counts, kept when the per-change list is trimmed from old plans.
    pub counts: Counts,
    /// What happened to the node's units and the node itself as the run went, oldest first
    /// (the newest 32): unit jobs queued and done (with the unit's InvocationID),
    /// daemon-reloads, reboots, a lost systemd connection, the agent restarting, a cancel.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<RunEvent>,
}

/// One thing that happened in a run, from its journal record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunEvent {
    /// The journal record's sequence number (increasing: a watcher shows each once).
    pub seq: u64,
    /// When it was journaled (Unix ms).
    pub at_ms: u64,
    /// What happened, for people ("restarted kubelet.service in 230 ms: unit is
    /// active/running, InvocationID 9f8e...").
    pub message: String,
}

/// How many changes ended in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// Changes in the plan.
    pub total: u32,
    /// Changed.
    pub changed: u32,
    /// Already in the desired state.
    pub unchanged: u32,
    /// Restored by rollback.
    pub rolled_back: u32,
}

// === Engine state → documents, and back for the client ===
//
// Every match is exhaustive: a phase or state the engine adds is a decision here. The way
// back (document → engine state) is for `inplace-agent status`, which renders a document it
// read from the socket with the same code as a local status.

impl From<engine::Phase> for Phase {
    fn from(phase: engine::Phase) -> Phase {
        match phase {
            engine::Phase::Pending => Phase::Pending,
            engine::Phase::Preparing => Phase::Preparing,
            engine::Phase::Applying => Phase::Applying,
            engine::Phase::Restarting => Phase::Restarting,
            engine::Phase::Verifying => Phase::Verifying,
            engine::Phase::Succeeded => Phase::Succeeded,
            engine::Phase::Failed => Phase::Failed,
            engine::Phase::RollingBack => Phase::RollingBack,
            engine::Phase::RolledBack => Phase::RolledBack,
            engine::Phase::Superseded => Phase::Superseded,
            engine::Phase::Cancelled => Phase::Cancelled,
        }
    }
}

impl From<Phase> for engine::Phase {
    fn from(phase: Phase) -> engine::Phase {
        match phase {
            Phase::Pending => engine::Phase::Pending,
            Phase::Preparing => engine::Phase::Preparing,
            Phase::Applying => engine::Phase::Applying,
            Phase::Restarting => engine::Phase::Restarting,
            Phase::Verifying => engine::Phase::Verifying,
            Phase::Succeeded => engine::Phase::Succeeded,
            Phase::Failed => engine::Phase::Failed,
            Phase::RollingBack => engine::Phase::RollingBack,
            Phase::RolledBack => engine::Phase::RolledBack,
            Phase::Superseded => engine::Phase::Superseded,
            Phase::Cancelled => engine::Phase::Cancelled,
        }
    }
}

impl From<engine::ChangeState> for ChangeState {
    fn from(state: engine::ChangeState) -> ChangeState {
        match state {
            engine::ChangeState::Pending => ChangeState::Pending,
            engine::ChangeState::Running => ChangeState::Running,
            engine::ChangeState::Unchanged => ChangeState::Unchanged,
            engine::ChangeState::Changed => ChangeState::Changed,
            engine::ChangeState::Failed => ChangeState::Failed,
            engine::ChangeState::RolledBack => ChangeState::RolledBack,
            engine::ChangeState::RollbackFailed => ChangeState::RollbackFailed,
            engine::ChangeState::Skipped => ChangeState::Skipped,
        }
    }
}

impl From<ChangeState> for engine::ChangeState {
    fn from(state: ChangeState) -> engine::ChangeState {
        match state {
            ChangeState::Pending => engine::ChangeState::Pending,
            ChangeState::Running => engine::ChangeState::Running,
            ChangeState::Unchanged => engine::ChangeState::Unchanged,
            ChangeState::Changed => engine::ChangeState::Changed,
            ChangeState::Failed => engine::ChangeState::Failed,
            ChangeState::RolledBack => engine::ChangeState::RolledBack,
            ChangeState::RollbackFailed => engine::ChangeState::RollbackFailed,
            ChangeState::Skipped => engine::ChangeState::Skipped,
        }
    }
}

impl From<engine::CheckState> for CheckState {
    fn from(state: engine::CheckState) -> CheckState {
        match state {
            engine::CheckState::Pending => CheckState::Pending,
            engine::CheckState::Running => CheckState::Running,
            engine::CheckState::Passed => CheckState::Passed,
            engine::CheckState::Failed => CheckState::Failed,
            engine::CheckState::Skipped => CheckState::Skipped,
        }
    }
}

impl From<CheckState> for engine::CheckState {
    fn from(state: CheckState) -> engine::CheckState {
        match state {
            CheckState::Pending => engine::CheckState::Pending,
            CheckState::Running => engine::CheckState::Running,
            CheckState::Passed => engine::CheckState::Passed,
            CheckState::Failed => engine::CheckState::Failed,
            CheckState::Skipped => engine::CheckState::Skipped,
        }
    }
}

impl From<&engine::ChangeStatus> for ChangeStatus {
    fn from(c: &engine::ChangeStatus) -> ChangeStatus {
        ChangeStatus {
            index: c.index,
            kind: c.kind,
            target: c.target.clone(),
            state: c.state.into(),
            message: c.message.clone(),
            disruption: c.disruption,
            duration_ms: c.duration_ms,
        }
    }
}

impl From<ChangeStatus> for engine::ChangeStatus {
    fn from(c: ChangeStatus) -> engine::ChangeStatus {
        engine::ChangeStatus {
            index: c.index,
            kind: c.kind,
            target: c.target,
            state: c.state.into(),
            message: c.message,
            disruption: c.disruption,
            duration_ms: c.duration_ms,
        }
    }
}

impl From<&engine::CheckStatus> for CheckStatus {
    fn from(c: &engine::CheckStatus) -> CheckStatus {
        CheckStatus {
            index: c.index,
            kind: c.kind.clone(),
            target: c.target.clone(),
            state: c.state.into(),
            message: c.message.clone(),
        }
    }
}

impl From<CheckStatus> for engine::CheckStatus {
    fn from(c: CheckStatus) -> engine::CheckStatus {
        engine::CheckStatus {
            index: c.index,
            kind: c.kind,
            target: c.target,
            state: c.state.into(),
            message: c.message,
        }
    }
}

impl From<engine::Counts> for Counts {
    fn from(c: engine::Counts) -> Counts {
        Counts {
            total: c.total,
            changed: c.changed,
            unchanged: c.unchanged,
            rolled_back: c.rolled_back,
        }
    }
}

impl From<Counts> for engine::Counts {
    fn from(c: Counts) -> engine::Counts {
        engine::Counts {
            total: c.total,
            changed: c.changed,
            unchanged: c.unchanged,
            rolled_back: c.rolled_back,
        }
    }
}

impl From<&engine::RunEvent> for RunEvent {
    fn from(e: &engine::RunEvent) -> RunEvent {
        RunEvent {
            seq: e.seq,
            at_ms: e.at_ms,
            message: e.message.clone(),
        }
    }
}

impl From<RunEvent> for engine::RunEvent {
    fn from(e: RunEvent) -> engine::RunEvent {
        engine::RunEvent {
            seq: e.seq,
            at_ms: e.at_ms,
            message: e.message,
        }
    }
}

impl From<&engine::HookResponse> for HookResponse {
    fn from(h: &engine::HookResponse) -> HookResponse {
        HookResponse {
            status: match h.status {
                engine::HookStatus::Success => HookStatus::Success,
                engine::HookStatus::Failure => HookStatus::Failure,
            },
            message: h.message.clone(),
            retry_after_seconds: h.retry_after_seconds,
        }
    }
}

impl From<HookResponse> for engine::HookResponse {
    fn from(h: HookResponse) -> engine::HookResponse {
        engine::HookResponse {
            status: match h.status {
                HookStatus::Success => engine::HookStatus::Success,
                HookStatus::Failure => engine::HookStatus::Failure,
            },
            message: h.message,
            retry_after_seconds: h.retry_after_seconds,
        }
    }
}

impl From<&engine::PlanStatus> for PlanStatus {
    fn from(s: &engine::PlanStatus) -> PlanStatus {
        PlanStatus {
            id: s.id.clone(),
            digest: s.digest.clone(),
            attempt: s.attempt,
            run: s.run,
            source: s.source.clone(),
            phase: s.phase.into(),
            progress: Progress {
                current: s.progress.current,
                total: s.progress.total,
                message: s.progress.message.clone(),
            },
            changes: s.changes.iter().map(ChangeStatus::from).collect(),
            checks: s.checks.iter().map(CheckStatus::from).collect(),
            error: s.error.clone(),
            rebooting: s.rebooting,
            services: s.services.clone(),
            accepted_at_ms: s.accepted_at_ms,
            started_at_ms: s.started_at_ms,
            finished_at_ms: s.finished_at_ms,
            counts: s.counts.into(),
            events: s.events.iter().map(RunEvent::from).collect(),
        }
    }
}

impl From<PlanStatus> for engine::PlanStatus {
    fn from(s: PlanStatus) -> engine::PlanStatus {
        engine::PlanStatus {
            id: s.id,
            digest: s.digest,
            attempt: s.attempt,
            run: s.run,
            source: s.source,
            phase: s.phase.into(),
            progress: engine::Progress {
                current: s.progress.current,
                total: s.progress.total,
                message: s.progress.message,
            },
            changes: s.changes.into_iter().map(Into::into).collect(),
            checks: s.checks.into_iter().map(Into::into).collect(),
            error: s.error,
            rebooting: s.rebooting,
            services: s.services,
            accepted_at_ms: s.accepted_at_ms,
            started_at_ms: s.started_at_ms,
            finished_at_ms: s.finished_at_ms,
            counts: s.counts.into(),
            events: s.events.into_iter().map(Into::into).collect(),
        }
    }
}

// === Building the documents ===

/// What the status needs beside the table.
#[derive(Debug, Clone)]
pub struct Context {
    /// Where the answer comes from.
    pub source: Source,
    /// The node.
    pub node: NodeInfo,
    /// The agent process, when it answers.
    pub agent: Option<AgentInfo>,
    /// How units are managed (empty: the last run's choice is used).
    pub services: String,
    /// The journal.
    pub journal: JournalSummary,
    /// The running agent's last drift check (`None`: what the journal recorded is used).
    pub drift: Option<DriftStatus>,
}

/// The agent's status from the engine's table (read under its lock: nothing here copies a
/// per-change list).
pub fn agent_status(table: &Table, ctx: Context, now_ms: u64) -> AgentStatus {
    let plans = table.plans();
    let current = table
        .unfinished()
        .next()
        .and_then(|(run, _)| table.by_run(*run))
        .map(|s| {
            let mut c = current_plan(s, now_ms);
            if ctx.source == Source::Journal {
                c.elapsed_ms = None;
                c.resumes_at = Some(resume_point(s));
            }
            c
        });
    let recent: Vec<PlanSummary> = plans
        .iter()
        .rev()
        .filter(|p| p.phase.is_terminal())
        .take(RECENT_PLANS)
        .map(plan_summary)
        .collect();
    let last_failure = plans
        .iter()
        .rev()
        .find(|p| p.phase.is_terminal() && p.phase.is_failure())
        .map(plan_summary);
    let services = if ctx.services.is_empty() {
        plans
            .iter()
            .rev()
            .find(|p| !p.services.is_empty())
            .map(|p| p.services.clone())
            .unwrap_or_default()
    } else {
        ctx.services
    };
    AgentStatus {
        api_version: inplace_plan::API_VERSION.to_string(),
        kind: KIND_AGENT_STATUS.to_string(),
        source: ctx.source,
        generated_at_ms: now_ms,
        node: ctx.node,
        agent: ctx.agent,
        services,
        current,
        recent,
        last_failure,
        journal: ctx.journal,
        drift: ctx.drift.or_else(|| DriftStatus::journaled(table)),
    }
}

/// Where a running plan is: phase, step i of n, the change or gate running now.
pub fn current_plan(s: &engine::PlanStatus, now_ms: u64) -> CurrentPlan {
    use engine::{ChangeState, CheckState, Phase};
    let running_change = match s.phase {
        Phase::Preparing | Phase::Applying => s
            .changes
            .iter()
            .find(|c| c.state == ChangeState::Running)
            .map(ChangeStatus::from),
        _ => None,
    };
    let running_check = match s.phase {
        Phase::Verifying => s
            .checks
            .iter()
            .find(|c| c.state == CheckState::Running)
            .or_else(|| s.checks.iter().find(|c| c.state == CheckState::Pending))
            .map(CheckStatus::from),
        _ => None,
    };
    // One numbering everywhere: the engine's step i of n, which the hook response, the
    // remote status, sd_notify and the metric show too.
    let step = s.progress.current;
    CurrentPlan {
        id: s.id.clone(),
        digest: s.digest.clone(),
        attempt: s.attempt,
        run: s.run,
        source: s.source.clone(),
        phase: s.phase.into(),
        step,
        steps: s.progress.total,
        message: s.progress.message.clone(),
        running_change,
        running_check,
        accepted_at_ms: s.accepted_at_ms,
        started_at_ms: s.started_at_ms,
        elapsed_ms: s.duration_ms(now_ms),
        resumes_at: None,
        counts: s.counts.into(),
        error: s.error.clone(),
        rebooting: s.rebooting,
        hook_response: (&s.hook_response()).into(),
        events: s.events[s.events.len().saturating_sub(CURRENT_EVENTS)..]
            .iter()
            .map(RunEvent::from)
            .collect(),
    }
}

/// Where an unfinished run goes on when the agent starts again: what the runner does first
/// when it resumes from the journal.
pub fn resume_point(s: &engine::PlanStatus) -> String {
    use engine::{ChangeState, CheckState, Phase};
    let n = s.changes.len();
    let total = s.progress.total;
    match s.phase {
        Phase::Pending | Phase::Preparing => {
            "the start: the plan is checked against the node again (Preparing)".to_string()
        }
        Phase::Applying => match s
            .changes
            .iter()
            .find(|c| !matches!(c.state, ChangeState::Changed | ChangeState::Unchanged))
        {
            Some(c) if s.rebooting => format!(
                "changes[{}] {} {} (step {}/{total}): the boot id tells whether the node rebooted",
                c.index,
                c.kind,
                c.target,
                c.index + 1
            ),
            Some(c) => format!(
                "changes[{}] {} {} (step {}/{total})",
                c.index,
                c.kind,
                c.target,
                c.index + 1
            ),
            None => "the restarts and gates after the last change".to_string(),
        },
        Phase::Restarting => {
            "the Restarting phase: unit jobs already done are not repeated".to_string()
        }
        Phase::Verifying => match s.checks.iter().find(|c| c.state != CheckState::Passed) {
            Some(c) => format!(
                "verify[{}] {} {} (step {}/{total})",
                c.index,
                c.kind,
                c.target,
                n as u32 + c.index + 1
            ),
            None => "the end of the gates".to_string(),
        },
        Phase::RollingBack => "rolling back: changes already restored stay restored".to_string(),
        other => other.to_string(),
    }
}

/// A plan attempt in one line.
pub fn plan_summary(s: &engine::PlanStatus) -> PlanSummary {
    PlanSummary {
        id: s.id.clone(),
        digest: s.digest.clone(),
        attempt: s.attempt,
        run: s.run,
        source: s.source.clone(),
        phase: s.phase.into(),
        accepted_at_ms: s.accepted_at_ms,
        started_at_ms: s.started_at_ms,
        finished_at_ms: s.finished_at_ms,
        duration_ms: s.finished_at_ms.and_then(|_| s.duration_ms(0)),
        counts: s.counts.into(),
        error: s.error.clone(),
    }
}

/// Most bytes of records one journal page carries (a page always has at least one record).
pub const MAX_JOURNAL_PAGE_BYTES: usize = 8 << 20;

/// Records after `since` from the journal file at `path`, at most `limit` (and about
/// [`MAX_JOURNAL_PAGE_BYTES`]), and whether more follow. Reads the file as it is, without
/// the journal's lock: a record being appended is simply not there yet.
pub fn journal_page(
    path: &Path,
    since: u64,
    limit: usize,
    redact: bool,
) -> Result<JournalRecords, JournalError> {
    let mut records = Vec::new();
    let mut more = false;
    let mut bytes = 0usize;
    if let Some(reader) = Reader::open(path)? {
        for entry in reader {
            let entry = entry?;
            if entry.seq <= since {
                continue;
            }
            if records.len() >= limit || bytes >= MAX_JOURNAL_PAGE_BYTES {
                more = true;
                break;
            }
            let item = JournalItem::new(&entry, redact);
            bytes += item.record.to_string().len();
            records.push(item);
        }
    }
    Ok(JournalRecords {
        api_version: inplace_plan::API_VERSION.to_string(),
        kind: KIND_JOURNAL_RECORDS.to_string(),
        since,
        records,
        more,
    })
}

/// The engine's table folded from the journal of `state_dir` read directly (read-only,
/// without the journal's lock: `inplace-agent status` when no agent runs), and the file's
/// summary. Large plan bodies are read from the state directory's backup store.
pub fn read_journal(
    state_dir: &Path,
    keep_plans: usize,
) -> Result<(Table, JournalSummary), JournalError> {
    let path = &crate::journal::file_path(state_dir);
    let mut table = Table::new(keep_plans);
    let mut summary = JournalSummary {
        path: path.display().to_string(),
        ..JournalSummary::default()
    };
    if let Some(mut reader) = Reader::open(path)? {
        for entry in reader.by_ref() {
            let entry = entry?;
            summary.records += 1;
            summary.last_seq = entry.seq;
            table.apply(entry);
        }
        summary.bytes = reader.valid_len();
    }
    let backups = crate::journal::backup::BackupStore::at(state_dir);
    table.finish_replay(&crate::engine::table::blobs_only(|sha| {
        backups.get(sha).map_err(|e| e.to_string())
    }));
    Ok((table, summary))
}

/// The JSON Schema of every document the socket serves, as kept in
/// `docs/status-api.schema.json` (the schema-drift test writes and compares it).
#[cfg(test)]
pub fn schema() -> serde_json::Value {
    let mut generator = schemars::SchemaGenerator::default();
    let mut documents = serde_json::Map::new();
    for (name, schema) in [
        (KIND_AGENT_STATUS, generator.subschema_for::<AgentStatus>()),
        (
            KIND_PLAN_STATUS,
            generator.subschema_for::<PlanStatusDocument>(),
        ),
        (
            KIND_JOURNAL_RECORDS,
            generator.subschema_for::<JournalRecords>(),
        ),
        (KIND_ERROR, generator.subschema_for::<ErrorDocument>()),
    ] {
        documents.insert(name.to_string(), schema.to_value());
    }
    let definitions: serde_json::Map<String, serde_json::Value> =
        generator.take_definitions(true).into_iter().collect();
    serde_json::json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://inplace-agent.dev/schemas/status-api/v1",
        "title": "inplace-agent status socket documents (apiVersion inplace.agent/v1)",
        "description": "Generated from the Rust types (crates/agent/src/status/api.rs) by the test status::api::tests::the_schema_in_docs_is_current; regenerate with INPLACE_AGENT_BLESS=1 cargo test -p inplace-agent --lib the_schema_in_docs_is_current",
        "oneOf": [
            {"$ref": "#/$defs/AgentStatus"},
            {"$ref": "#/$defs/PlanStatusDocument"},
            {"$ref": "#/$defs/JournalRecords"},
            {"$ref": "#/$defs/ErrorDocument"}
        ],
        "$defs": definitions,
        "x-documents": documents,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use inplace_base::ErrorKind;

    const SCHEMA_FILE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/status-api.schema.json"
    );

    fn sample() -> engine::PlanStatus {
        engine::PlanStatus {
            id: "default/md-0@abc".into(),
            digest: "sha256:ab".into(),
            attempt: 2,
            run: 7,
            source: "grpc".into(),
            phase: engine::Phase::RolledBack,
            progress: engine::Progress {
                current: 2,
                total: 2,
                message: "RolledBack".into(),
            },
            changes: vec![engine::ChangeStatus {
                index: 0,
                kind: ChangeKind::KubeletConfig,
                target: "/var/lib/kubelet/config.yaml".into(),
                state: engine::ChangeState::RolledBack,
                message: "maxPods 110 → 0".into(),
                disruption: Disruption::Restart,
                duration_ms: Some(1234),
            }],
            checks: vec![engine::CheckStatus {
                index: 0,
                kind: "httpGet".into(),
                target: "http://127.0.0.1:10248/healthz".into(),
                state: engine::CheckState::Failed,
                message: "answered 500".into(),
            }],
            error: Some(ErrorInfo {
                kind: ErrorKind::Verification,
                step: Some("verify[0] httpGet http://127.0.0.1:10248/healthz".into()),
                detail: "answered 500".into(),
            }),
            rebooting: false,
            services: "off".into(),
            accepted_at_ms: 1000,
            started_at_ms: Some(1001),
            finished_at_ms: Some(1009),
            counts: engine::Counts {
                total: 1,
                changed: 1,
                unchanged: 0,
                rolled_back: 1,
            },
            events: vec![engine::RunEvent {
                seq: 12,
                at_ms: 1005,
                message: "restarted kubelet.service".into(),
            }],
        }
    }

    /// The document of a plan status, field by field and spelled as clients read it: the
    /// engine's state is converted, so renaming an engine field cannot change this.
    #[test]
    fn a_plan_status_document_is_spelled_as_clients_read_it() {
        let doc = serde_json::to_value(PlanStatusDocument::new(sample())).unwrap();
        let want = serde_json::json!({
            "apiVersion": "inplace.agent/v1",
            "kind": "PlanStatus",
            "id": "default/md-0@abc",
            "digest": "sha256:ab",
            "attempt": 2,
            "run": 7,
            "source": "grpc",
            "phase": "RolledBack",
            "progress": {"current": 2, "total": 2, "message": "RolledBack"},
            "changes": [{
                "index": 0,
                "kind": "kubeletConfig",
                "target": "/var/lib/kubelet/config.yaml",
                "state": "RolledBack",
                "message": "maxPods 110 → 0",
                "disruption": "Restart",
                "durationMs": 1234
            }],
            "checks": [{
                "index": 0,
                "kind": "httpGet",
                "target": "http://127.0.0.1:10248/healthz",
                "state": "Failed",
                "message": "answered 500"
            }],
            "error": {
                "kind": "verification",
                "step": "verify[0] httpGet http://127.0.0.1:10248/healthz",
                "detail": "answered 500"
            },
            "rebooting": false,
            "services": "off",
            "acceptedAtMs": 1000,
            "startedAtMs": 1001,
            "finishedAtMs": 1009,
            "counts": {"total": 1, "changed": 1, "unchanged": 0, "rolledBack": 1},
            "events": [{"seq": 12, "atMs": 1005, "message": "restarted kubelet.service"}],
            "hookResponse": {
                "status": "Failure",
                "message": "plan default/md-0@abc failed and was rolled back: verify[0] httpGet http://127.0.0.1:10248/healthz: answered 500",
                "retryAfterSeconds": 0
            }
        });
        assert_eq!(doc, want);
    }

    /// A client reads a document back into the engine's state and renders it like a local
    /// status: nothing is lost either way.
    #[test]
    fn documents_read_back_into_the_same_engine_state() {
        let status = sample();
        let text = serde_json::to_string(&PlanStatusDocument::new(status.clone())).unwrap();
        let doc: PlanStatusDocument = serde_json::from_str(&text).unwrap();
        assert_eq!(engine::PlanStatus::from(doc.status), status);
        assert_eq!(
            engine::HookResponse::from(doc.hook_response),
            status.hook_response()
        );
        let current = current_plan(&status, 2000);
        assert_eq!(current.phase, Phase::RolledBack);
        assert_eq!(engine::Phase::from(current.phase), status.phase);
    }

    /// The schema kept in docs/ is the one the types generate. To regenerate after changing
    /// a type: `INPLACE_AGENT_BLESS=1 cargo test -p inplace-agent --lib the_schema_in_docs_is_current`.
    #[test]
    fn the_schema_in_docs_is_current() {
        let generated = format!("{:#}\n", schema());
        if std::env::var_os("INPLACE_AGENT_BLESS").is_some() {
            std::fs::write(SCHEMA_FILE, &generated).unwrap();
        }
        let kept = std::fs::read_to_string(SCHEMA_FILE).unwrap_or_default();
        assert!(
            kept == generated,
            "docs/status-api.schema.json is not what the types in crates/agent/src/status/api.rs generate; \
             if the change is intended (fields are only ever added), regenerate it with \
             `INPLACE_AGENT_BLESS=1 cargo test -p inplace-agent --lib the_schema_in_docs_is_current` and commit it"
        );
    }

    #[test]
    fn the_schema_describes_what_the_types_serialize() {
        let schema = schema();
        let defs = &schema["$defs"];
        let agent = &defs["AgentStatus"];
        for field in ["apiVersion", "kind", "node", "recent", "journal", "current"] {
            assert!(
                agent["properties"].get(field).is_some(),
                "{field}: {agent:#}"
            );
        }
        // The flattened PlanStatus fields are in the document's properties.
        let plan = &defs["PlanStatusDocument"]["properties"];
        for field in [
            "id",
            "digest",
            "phase",
            "progress",
            "changes",
            "hookResponse",
        ] {
            assert!(plan.get(field).is_some(), "{field}: {plan:#}");
        }
        let kinds = &defs["ChangeKind"]["enum"];
        assert!(
            kinds
                .as_array()
                .unwrap()
                .contains(&"kubeadmUpgradeNode".into())
        );
    }
}
