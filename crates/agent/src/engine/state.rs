//! What the agent reports about a plan: phase, progress, per-change results, the error, and
//! the CAPI hook response derived from them. Everything here is a fold of journal records,
//! so a restarted agent reports exactly what it reported before.
//!
//! These are the engine's state, not a format: nothing here is serialized. The journal
//! (`journal::SummaryStatus`, `RunPhase`), the status socket's documents (`status::api`) and
//! the gRPC messages (`rpc::replies`) have their own types, converted from these.

use inplace_base::ErrorInfo;
use std::fmt;

use inplace_plan::{ChangeKind, Disruption};

/// Phases of a plan run: Pending → Preparing → Applying → Restarting → Verifying →
/// Succeeded, or Failed / RollingBack → RolledBack, Superseded, Cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

impl Phase {
    /// True for phases a run never leaves.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Phase::Succeeded
                | Phase::Failed
                | Phase::RolledBack
                | Phase::Superseded
                | Phase::Cancelled
        )
    }

    /// True when the run ended without reaching its desired state.
    pub fn is_failure(self) -> bool {
        matches!(
            self,
            Phase::Failed | Phase::RolledBack | Phase::Cancelled | Phase::Superseded
        )
    }

    /// Whether a run may move from `self` to `next`: the phases' state machine. Every
    /// `Phase` and `PlanFinished` record goes through it (`engine::transitions`): the engine
    /// refuses to journal an illegal move, the table reports one it finds in a journal.
    pub fn can_become(self, next: Phase) -> bool {
        use Phase::*;
        match (self, next) {
            // A run never leaves its end (a retry is a new run), and a resumed run goes on
            // in the phase it was in without journaling it again.
            (a, b) if a.is_terminal() || a == b => false,
            // The happy path; Restarting is skipped when no unit needs a job.
            (Pending, Preparing) => true,
            (Preparing, Applying) => true,
            (Applying, Restarting | Verifying) => true,
            (Restarting, Verifying) => true,
            (Verifying, Succeeded) => true,
            // A step or gate failed (or the plan timed out, or a cancel came) after changes:
            // rollback, when the plan asks for it.
            (Pending | Preparing | Applying | Restarting | Verifying, RollingBack) => true,
            // A failure with nothing to roll back, or no rollback wanted; from Pending also
            // the end of a move the engine refused.
            (Pending | Preparing | Applying | Restarting | Verifying, Failed) => true,
            // A cancel or a newer plan, honoured at a step boundary.
            (Pending | Preparing | Applying | Restarting | Verifying, Superseded | Cancelled) => {
                true
            }
            // Rollback ends restored, cancelled (the cancel that started it), or failed (a
            // change it could not restore, or a refused move).
            (RollingBack, RolledBack | Failed | Cancelled) => true,
            _ => false,
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// State of one change within a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
    pub message: String,
    /// Disruption when it changes something.
    pub disruption: Disruption,
    /// How long it took, once done.
    pub duration_ms: Option<u64>,
}

/// Result of one health gate.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    pub message: String,
}

/// Progress through a run: step `current` of `total`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookStatus {
    /// In progress (retryAfterSeconds > 0) or done (0).
    Success,
    /// The update failed.
    Failure,
}

/// Exactly what an updater returns to CAPI for this plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookResponse {
    /// Success or Failure.
    pub status: HookStatus,
    /// Shown in the Machine's `Updating` condition.
    pub message: String,
    /// Ask CAPI to call again after this many seconds; 0 means done.
    pub retry_after_seconds: u32,
}

/// Retry interval while a plan is in progress.
pub const RETRY_IN_PROGRESS: u32 = 10;
/// Retry interval while the node reboots.
pub const RETRY_REBOOTING: u32 = 60;

/// The status of one plan attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    pub changes: Vec<ChangeStatus>,
    /// Per gate.
    pub checks: Vec<CheckStatus>,
    /// Why it failed.
    pub error: Option<ErrorInfo>,
    /// A reboot was requested and the node has not come back yet.
    pub rebooting: bool,
    /// How the agent manages units for this run (`systemd on unix:path=...`, or `off` when
    /// restarts are only journaled), as it said when the run started or resumed.
    pub services: String,
    /// When it was accepted (Unix ms).
    pub accepted_at_ms: u64,
    /// When it started running.
    pub started_at_ms: Option<u64>,
    /// When it ended.
    pub finished_at_ms: Option<u64>,
    /// Counts, kept when the per-change list is trimmed from old plans.
    pub counts: Counts,
    /// What happened to the node's units and the node itself as the run went, oldest first
    /// (the newest 32): unit jobs queued and done (with the unit's InvocationID),
    /// daemon-reloads, reboots, a lost systemd connection, the agent restarting, a cancel.
    pub events: Vec<RunEvent>,
}

/// One thing that happened in a run, from its journal record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunEvent {
    /// The journal record's sequence number (increasing: a watcher shows each once).
    pub seq: u64,
    /// When it was journaled (Unix ms).
    pub at_ms: u64,
    /// What happened, for people ("restarted kubelet.service in 230 ms: unit is
    /// active/running, InvocationID 9f8e...").
    pub message: String,
}

/// How many events a run keeps (the newest).
pub const MAX_RUN_EVENTS: usize = 32;

/// How many changes ended in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

impl PlanStatus {
    /// The `UpdateMachine` hook response for this status: a pure function of the journaled
    /// state, so every call for the same plan answers the same way, before and after a
    /// restart of the agent.
    pub fn hook_response(&self) -> HookResponse {
        let (status, retry) = match self.phase {
            Phase::Succeeded => (HookStatus::Success, 0),
            p if p.is_terminal() => (HookStatus::Failure, 0),
            _ if self.rebooting => (HookStatus::Success, RETRY_REBOOTING),
            _ => (HookStatus::Success, RETRY_IN_PROGRESS),
        };
        HookResponse {
            status,
            message: self.hook_message(),
            retry_after_seconds: retry,
        }
    }

    /// [`PlanStatus::summary`] within the proto's limit on a hook message
    /// ([`inplace_api::bounded::MAX_HOOK_MESSAGE`]). When a finished plan's summary is longer,
    /// its error's detail is what gets cut, in its middle: the plan, how it ended and the
    /// failed step stay whole, the detail keeps its start (the cause) and its end (what a
    /// rollback restored). Cutting the whole summary would lose the step first.
    fn hook_message(&self) -> String {
        use inplace_api::bounded::{MAX_HOOK_MESSAGE, bounded};
        let whole = self.summary();
        if whole.len() <= MAX_HOOK_MESSAGE {
            return whole;
        }
        let (Some(what), Some(e)) = (self.ended(), &self.error) else {
            return whole;
        };
        let head = match &e.step {
            Some(step) => format!("plan {} {what}: {step}: ", self.id),
            None => format!("plan {} {what}: ", self.id),
        };
        // Room for a useful part of the detail, or the whole summary is cut as it was.
        match MAX_HOOK_MESSAGE.checked_sub(head.len()) {
            Some(room) if room >= 128 => format!("{head}{}", bounded(&e.detail, room)),
            _ => whole,
        }
    }

    /// How a finished plan ended, in words; `None` while it runs.
    fn ended(&self) -> Option<&'static str> {
        match self.phase {
            Phase::Failed => Some("failed"),
            Phase::RolledBack => Some("failed and was rolled back"),
            Phase::Cancelled => Some("was cancelled"),
            Phase::Superseded => Some("was superseded"),
            _ => None,
        }
    }

    /// One line for people and for CAPI's condition message. No timings in it, so it is
    /// identical on every call for a finished plan.
    pub fn summary(&self) -> String {
        let c = &self.counts;
        match self.phase {
            Phase::Succeeded => format!(
                "plan {} succeeded: {} changed, {} unchanged",
                self.id, c.changed, c.unchanged
            ),
            Phase::Failed | Phase::RolledBack | Phase::Cancelled | Phase::Superseded => {
                let what = self.ended().unwrap_or("ended");
                match &self.error {
                    Some(e) => format!("plan {} {what}: {e}", self.id),
                    None => format!("plan {} {what}", self.id),
                }
            }
            Phase::RollingBack => match &self.error {
                Some(e) => format!("plan {} is rolling back after: {e}", self.id),
                None => format!("plan {} is rolling back", self.id),
            },
            phase if self.rebooting => format!(
                "plan {}: {phase} step {}/{}: {}",
                self.id,
                self.progress.current,
                self.progress.total,
                reboot_message(self)
            ),
            phase => {
                let p = &self.progress;
                if p.message.is_empty() {
                    format!("plan {}: {phase}", self.id)
                } else {
                    format!(
                        "plan {}: {phase} step {}/{}: {}",
                        self.id, p.current, p.total, p.message
                    )
                }
            }
        }
    }

    /// Wall time from start to end (or to now, while running).
    pub fn duration_ms(&self, now_ms: u64) -> Option<u64> {
        let start = self.started_at_ms?;
        Some(self.finished_at_ms.unwrap_or(now_ms).saturating_sub(start))
    }
}

/// What a run waiting for its reboot says, everywhere: the status, the hook response,
/// sd_notify (step i of n is the reboot change).
pub fn reboot_message(status: &PlanStatus) -> String {
    let index = status.progress.current.saturating_sub(1);
    match status.changes.get(index as usize) {
        Some(c) => format!(
            "waiting for the node to reboot (changes[{index}] {} {})",
            c.kind, c.target
        ),
        None => "waiting for the node to reboot".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_transitions_follow_the_design() {
        use Phase::*;
        let happy = [
            Pending, Preparing, Applying, Restarting, Verifying, Succeeded,
        ];
        for w in happy.windows(2) {
            assert!(w[0].can_become(w[1]), "{:?} -> {:?}", w[0], w[1]);
        }
        assert!(Applying.can_become(Verifying), "no restarts needed");
        assert!(Verifying.can_become(RollingBack));
        assert!(RollingBack.can_become(RolledBack));
        assert!(Applying.can_become(Superseded));
        assert!(!Succeeded.can_become(Applying), "terminal");
        assert!(
            !RolledBack.can_become(Pending),
            "retry is a new attempt, not a transition"
        );
        assert!(!Pending.can_become(Verifying));
        assert!(!RollingBack.can_become(Succeeded));
    }

    use inplace_base::ErrorKind;

    fn ended(phase: Phase, step: &str, detail: String) -> PlanStatus {
        PlanStatus {
            id: "default/cp-0@abc".into(),
            digest: "v2:sha256:0".into(),
            attempt: 1,
            run: 1,
            source: "grpc".into(),
            phase,
            progress: Progress::default(),
            changes: Vec::new(),
            checks: Vec::new(),
            error: Some(ErrorInfo {
                kind: ErrorKind::Timeout,
                step: Some(step.into()),
                detail,
            }),
            rebooting: false,
            services: "off".into(),
            accepted_at_ms: 0,
            started_at_ms: None,
            finished_at_ms: None,
            counts: Counts::default(),
            events: Vec::new(),
        }
    }

    /// A hook message over the proto's 512 bytes keeps the failed step whole and the ends of
    /// the detail (the cause, what rollback restored); a short one is the summary.
    #[test]
    fn a_long_hook_message_cuts_the_detail_not_the_step() {
        use inplace_api::bounded::MAX_HOOK_MESSAGE;
        let step = "verify[2] controlPlane node cp-0: kube-apiserver, kube-controller-manager, \
                    kube-scheduler (etcd external)";
        let detail = format!(
            "the cause first; last: {}; rolled back: packages kubeadm, kubelet, kubectl",
            "x".repeat(600)
        );
        let s = ended(Phase::RolledBack, step, detail);
        let message = s.hook_response().message;
        assert!(message.len() <= MAX_HOOK_MESSAGE, "{}", message.len());
        assert!(
            message.starts_with(&format!(
                "plan default/cp-0@abc failed and was rolled back: {step}: the cause first"
            )),
            "{message}"
        );
        assert!(
            message.ends_with("; rolled back: packages kubeadm, kubelet, kubectl"),
            "{message}"
        );
        assert!(
            s.summary().len() > MAX_HOOK_MESSAGE,
            "the summary stays whole"
        );

        let short = ended(Phase::Failed, "changes[0] file /a", "no space left".into());
        assert_eq!(
            short.hook_response().message,
            "plan default/cp-0@abc failed: changes[0] file /a: no space left"
        );
    }
}
