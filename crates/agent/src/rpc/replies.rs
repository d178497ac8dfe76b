//! The engine's answers on the wire and back: [`PlanStatus`] ↔ `pb::PlanStatus` (every
//! field of the proto), [`DryRunReport`] → `pb::CheckPlanResponse`, and the hook response.
//!
//! The reverse direction ([`status_from_pb`]) is for the client commands (`submit`,
//! `status`), so a remote status renders and serializes exactly like a local one. Values a
//! newer agent may add (an error kind, a change kind) are mapped leniently where the proto
//! says how (an unknown error kind reads as `internal`) and refused otherwise, naming the
//! value.

use inplace_base::ErrorInfo;
use inplace_base::ErrorKind;
use std::time::Duration;

use crate::engine::dry_run::{ChangeVerdict, DryRunReport};
use crate::engine::state::{
    ChangeState, ChangeStatus, CheckState, CheckStatus, Counts, HookResponse, HookStatus, Phase,
    PlanStatus, Progress, RunEvent,
};
use inplace_api::convert::disruption_to_pb;
use inplace_api::pb;
use inplace_plan::{ChangeKind, Disruption};

pub use inplace_api::bounded::{MAX_DETAIL, MAX_HOOK_MESSAGE, MAX_STEP_MESSAGE, bounded};

// === Enums ===

/// The wire value of a phase.
pub fn phase_to_pb(phase: Phase) -> pb::Phase {
    match phase {
        Phase::Pending => pb::Phase::Pending,
        Phase::Preparing => pb::Phase::Preparing,
        Phase::Applying => pb::Phase::Applying,
        Phase::Restarting => pb::Phase::Restarting,
        Phase::Verifying => pb::Phase::Verifying,
        Phase::Succeeded => pb::Phase::Succeeded,
        Phase::Failed => pb::Phase::Failed,
        Phase::RollingBack => pb::Phase::RollingBack,
        Phase::RolledBack => pb::Phase::RolledBack,
        Phase::Superseded => pb::Phase::Superseded,
        Phase::Cancelled => pb::Phase::Cancelled,
    }
}

/// The phase of a wire value; `None` for UNSPECIFIED and values this build does not know.
pub fn phase_from_pb(value: i32) -> Option<Phase> {
    Some(match pb::Phase::try_from(value).ok()? {
        pb::Phase::Unspecified => return None,
        pb::Phase::Pending => Phase::Pending,
        pb::Phase::Preparing => Phase::Preparing,
        pb::Phase::Applying => Phase::Applying,
        pb::Phase::Restarting => Phase::Restarting,
        pb::Phase::Verifying => Phase::Verifying,
        pb::Phase::Succeeded => Phase::Succeeded,
        pb::Phase::Failed => Phase::Failed,
        pb::Phase::RollingBack => Phase::RollingBack,
        pb::Phase::RolledBack => Phase::RolledBack,
        pb::Phase::Superseded => Phase::Superseded,
        pb::Phase::Cancelled => Phase::Cancelled,
    })
}

fn change_state_to_pb(state: ChangeState) -> pb::ChangeState {
    match state {
        ChangeState::Pending => pb::ChangeState::Pending,
        ChangeState::Running => pb::ChangeState::Running,
        ChangeState::Unchanged => pb::ChangeState::Unchanged,
        ChangeState::Changed => pb::ChangeState::Changed,
        ChangeState::Failed => pb::ChangeState::Failed,
        ChangeState::RolledBack => pb::ChangeState::RolledBack,
        ChangeState::Skipped => pb::ChangeState::Skipped,
        ChangeState::RollbackFailed => pb::ChangeState::RollbackFailed,
    }
}

fn change_state_from_pb(value: i32) -> Option<ChangeState> {
    Some(match pb::ChangeState::try_from(value).ok()? {
        pb::ChangeState::Unspecified => return None,
        pb::ChangeState::Pending => ChangeState::Pending,
        pb::ChangeState::Running => ChangeState::Running,
        pb::ChangeState::Unchanged => ChangeState::Unchanged,
        pb::ChangeState::Changed => ChangeState::Changed,
        pb::ChangeState::Failed => ChangeState::Failed,
        pb::ChangeState::RolledBack => ChangeState::RolledBack,
        pb::ChangeState::Skipped => ChangeState::Skipped,
        pb::ChangeState::RollbackFailed => ChangeState::RollbackFailed,
    })
}

fn check_state_to_pb(state: CheckState) -> pb::CheckState {
    match state {
        CheckState::Pending => pb::CheckState::Pending,
        CheckState::Running => pb::CheckState::Running,
        CheckState::Passed => pb::CheckState::Passed,
        CheckState::Failed => pb::CheckState::Failed,
        CheckState::Skipped => pb::CheckState::Skipped,
    }
}

fn check_state_from_pb(value: i32) -> Option<CheckState> {
    Some(match pb::CheckState::try_from(value).ok()? {
        pb::CheckState::Unspecified => return None,
        pb::CheckState::Pending => CheckState::Pending,
        pb::CheckState::Running => CheckState::Running,
        pb::CheckState::Passed => CheckState::Passed,
        pb::CheckState::Failed => CheckState::Failed,
        pb::CheckState::Skipped => CheckState::Skipped,
    })
}

fn disruption_from_pb(value: i32) -> Disruption {
    match pb::Disruption::try_from(value) {
        Ok(pb::Disruption::None) => Disruption::None,
        Ok(pb::Disruption::DaemonReload) => Disruption::DaemonReload,
        Ok(pb::Disruption::Reload) => Disruption::Reload,
        Ok(pb::Disruption::Restart) => Disruption::Restart,
        // The proto: unknown is to be treated as a reboot.
        Ok(pb::Disruption::Reboot | pb::Disruption::Unspecified) | Err(_) => Disruption::Reboot,
    }
}

fn error_kind_from_str(kind: &str) -> ErrorKind {
    // The proto: treat unknown kinds like "internal".
    serde_json::from_value(serde_json::Value::String(kind.to_owned()))
        .unwrap_or(ErrorKind::Internal)
}

// === Times ===

fn timestamp(ms: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        nanos: i32::try_from(ms % 1000).unwrap_or(0) * 1_000_000,
    }
}

fn timestamp_ms(t: &prost_types::Timestamp) -> u64 {
    let secs = u64::try_from(t.seconds).unwrap_or(0);
    let millis = u64::try_from(t.nanos / 1_000_000).unwrap_or(0);
    secs.saturating_mul(1000).saturating_add(millis)
}

fn duration(ms: u64) -> prost_types::Duration {
    prost_types::Duration::try_from(Duration::from_millis(ms)).unwrap_or_default()
}

fn duration_ms(d: &prost_types::Duration) -> u64 {
    Duration::try_from(*d)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

// === Plan status ===

/// The hook response on the wire (message bounded as the proto says).
pub fn hook_response_to_pb(hook: &HookResponse) -> pb::HookResponse {
    pb::HookResponse {
        status: match hook.status {
            HookStatus::Success => pb::HookStatus::Success,
            HookStatus::Failure => pb::HookStatus::Failure,
        } as i32,
        message: bounded(&hook.message, MAX_HOOK_MESSAGE),
        retry_after_seconds: i32::try_from(hook.retry_after_seconds).unwrap_or(i32::MAX),
    }
}

/// A plan status on the wire, with its hook response.
pub fn status_to_pb(status: &PlanStatus) -> pb::PlanStatus {
    pb::PlanStatus {
        id: status.id.clone(),
        digest: status.digest.clone(),
        attempt: status.attempt,
        phase: phase_to_pb(status.phase) as i32,
        step: Some(pb::Step {
            index: status.progress.current,
            total: status.progress.total,
            message: bounded(&status.progress.message, MAX_STEP_MESSAGE),
        }),
        changes: status
            .changes
            .iter()
            .map(|c| pb::ChangeResult {
                index: c.index,
                kind: c.kind.as_str().to_owned(),
                target: c.target.clone(),
                state: change_state_to_pb(c.state) as i32,
                message: bounded(&c.message, MAX_DETAIL),
                disruption: disruption_to_pb(c.disruption) as i32,
                duration: c.duration_ms.map(duration),
            })
            .collect(),
        checks: status
            .checks
            .iter()
            .map(|c| pb::CheckResult {
                index: c.index,
                kind: c.kind.clone(),
                target: c.target.clone(),
                state: check_state_to_pb(c.state) as i32,
                message: bounded(&c.message, MAX_DETAIL),
            })
            .collect(),
        error: status.error.as_ref().map(|e| pb::PlanError {
            kind: e.kind.as_str().to_owned(),
            step: e.step.clone().unwrap_or_default(),
            detail: bounded(&e.detail, MAX_DETAIL),
        }),
        accepted_at: Some(timestamp(status.accepted_at_ms)),
        started_at: status.started_at_ms.map(timestamp),
        finished_at: status.finished_at_ms.map(timestamp),
        hook_response: Some(hook_response_to_pb(&status.hook_response())),
        rebooting: status.rebooting,
        services: status.services.clone(),
        counts: Some(pb::ChangeCounts {
            total: status.counts.total,
            changed: status.counts.changed,
            unchanged: status.counts.unchanged,
            rolled_back: status.counts.rolled_back,
        }),
        source: status.source.clone(),
        run: status.run,
        events: status
            .events
            .iter()
            .map(|e| pb::RunEvent {
                seq: e.seq,
                at: Some(timestamp(e.at_ms)),
                message: bounded(&e.message, MAX_DETAIL),
            })
            .collect(),
    }
}

/// A wire status back into the engine's type (for client commands). Fails on a phase,
/// change kind or state this build does not know, naming it.
pub fn status_from_pb(status: &pb::PlanStatus) -> Result<PlanStatus, String> {
    let phase = phase_from_pb(status.phase)
        .ok_or_else(|| format!("plan {}: unknown phase {}", status.id, status.phase))?;
    let step = status.step.clone().unwrap_or_default();
    let changes = status
        .changes
        .iter()
        .map(|c| {
            Ok(ChangeStatus {
                index: c.index,
                kind: ChangeKind::from_key(&c.kind).ok_or_else(|| {
                    format!("changes[{}]: unknown change kind {:?}", c.index, c.kind)
                })?,
                target: c.target.clone(),
                state: change_state_from_pb(c.state)
                    .ok_or_else(|| format!("changes[{}]: unknown state {}", c.index, c.state))?,
                message: c.message.clone(),
                disruption: disruption_from_pb(c.disruption),
                duration_ms: c.duration.as_ref().map(duration_ms),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let checks = status
        .checks
        .iter()
        .map(|c| {
            Ok(CheckStatus {
                index: c.index,
                kind: c.kind.clone(),
                target: c.target.clone(),
                state: check_state_from_pb(c.state)
                    .ok_or_else(|| format!("verify[{}]: unknown state {}", c.index, c.state))?,
                message: c.message.clone(),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let counts = status.counts.unwrap_or_default();
    Ok(PlanStatus {
        id: status.id.clone(),
        digest: status.digest.clone(),
        attempt: status.attempt,
        run: status.run,
        source: status.source.clone(),
        phase,
        progress: Progress {
            current: step.index,
            total: step.total,
            message: step.message,
        },
        changes,
        checks,
        error: status.error.as_ref().map(|e| ErrorInfo {
            kind: error_kind_from_str(&e.kind),
            step: (!e.step.is_empty()).then(|| e.step.clone()),
            detail: e.detail.clone(),
        }),
        rebooting: status.rebooting,
        services: status.services.clone(),
        accepted_at_ms: status.accepted_at.as_ref().map_or(0, timestamp_ms),
        started_at_ms: status.started_at.as_ref().map(timestamp_ms),
        finished_at_ms: status.finished_at.as_ref().map(timestamp_ms),
        counts: Counts {
            total: counts.total,
            changed: counts.changed,
            unchanged: counts.unchanged,
            rolled_back: counts.rolled_back,
        },
        events: status
            .events
            .iter()
            .map(|e| RunEvent {
                seq: e.seq,
                at_ms: e.at.as_ref().map_or(0, timestamp_ms),
                message: e.message.clone(),
            })
            .collect(),
    })
}

// === Check report ===

/// A dry-run report on the wire; `existing` is the status of the same id and digest, when
/// the agent knows it.
pub fn check_report_to_pb(
    report: &DryRunReport,
    existing: Option<&PlanStatus>,
) -> pb::CheckPlanResponse {
    let changes: Vec<pb::ChangeCheck> = report
        .changes
        .iter()
        .map(|c| pb::ChangeCheck {
            index: c.index,
            kind: c.kind.clone(),
            target: c.target.clone(),
            verdict: match c.result {
                ChangeVerdict::WouldChange => pb::ChangeVerdict::WouldChange,
                ChangeVerdict::Unchanged => pb::ChangeVerdict::Unchanged,
                ChangeVerdict::Unsupported => pb::ChangeVerdict::Unsupported,
                ChangeVerdict::Invalid => pb::ChangeVerdict::Invalid,
            } as i32,
            reason: bounded(&c.detail, MAX_DETAIL),
            disruption: if c.result == ChangeVerdict::WouldChange {
                disruption_to_pb(c.disruption)
            } else {
                pb::Disruption::None
            } as i32,
        })
        .collect();
    pb::CheckPlanResponse {
        digest: report.digest.clone(),
        would_change: report
            .changes
            .iter()
            .any(|c| c.result == ChangeVerdict::WouldChange),
        changes,
        disruption: disruption_to_pb(report.disruption) as i32,
        applicable: report.applicable,
        restart_units: report.restart_units.clone(),
        existing: existing.map(status_to_pb),
        checks: report
            .checks
            .iter()
            .map(|g| pb::VerifyCheck {
                index: g.index,
                kind: g.kind.clone(),
                target: g.target.clone(),
                supported: g.supported,
                reason: bounded(&g.detail, MAX_DETAIL),
            })
            .collect(),
        errors: report
            .errors
            .iter()
            .map(|e| pb::FieldError {
                field: e.field.clone(),
                message: e.message.clone(),
            })
            .collect(),
    }
}

/// The engine's drift state on the wire.
pub fn drift_to_pb(state: &crate::engine::drift::DriftState) -> pb::DriftStatus {
    let baseline = state.baseline.as_ref();
    pb::DriftStatus {
        drifted: state.drifted(),
        has_baseline: baseline.is_some(),
        baseline_id: baseline.map(|b| b.id.clone()).unwrap_or_default(),
        baseline_digest: baseline.map(|b| b.digest.clone()).unwrap_or_default(),
        baseline_attempt: baseline.map(|b| b.attempt).unwrap_or_default(),
        baseline_run: baseline.map(|b| b.run).unwrap_or_default(),
        checked_at_unix_ms: state.checked_at_ms.unwrap_or_default(),
        problem: state.problem.clone().unwrap_or_default(),
        changes: state
            .changes
            .iter()
            .map(|c| pb::DriftedChange {
                index: c.index,
                kind: c.kind.to_string(),
                target: c.target.clone(),
                detail: c.detail.clone(),
                differences: c
                    .differences
                    .iter()
                    .map(|d| pb::DriftDifference {
                        field: d.field.clone(),
                        expected: d.expected.clone(),
                        found: d.found.clone(),
                    })
                    .collect(),
                first_seen_unix_ms: c.first_seen_ms,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(phase: Phase) -> PlanStatus {
        PlanStatus {
            id: "default/md-0@abc".into(),
            digest: format!("sha256:{}", "a".repeat(64)),
            attempt: 2,
            run: 7,
            source: "grpc".into(),
            phase,
            progress: Progress {
                current: 2,
                total: 3,
                message: "verify[0]".into(),
            },
            changes: vec![ChangeStatus {
                index: 0,
                kind: ChangeKind::KubeletConfig,
                target: "/var/lib/kubelet/config.yaml".into(),
                state: ChangeState::RolledBack,
                message: "maxPods 110 → 0".into(),
                disruption: Disruption::Restart,
                duration_ms: Some(1234),
            }],
            checks: vec![CheckStatus {
                index: 0,
                kind: "httpGet".into(),
                target: "http://127.0.0.1:10248/healthz".into(),
                state: CheckState::Failed,
                message: "answered 500".into(),
            }],
            error: Some(ErrorInfo {
                kind: ErrorKind::Verification,
                step: Some("verify[0] httpGet http://127.0.0.1:10248/healthz".into()),
                detail: "answered 500".into(),
            }),
            rebooting: false,
            services: String::new(),
            accepted_at_ms: 1_796_049_346_123,
            started_at_ms: Some(1_796_049_346_200),
            finished_at_ms: Some(1_796_049_350_001),
            counts: Counts {
                total: 1,
                changed: 1,
                unchanged: 0,
                rolled_back: 1,
            },
            events: vec![RunEvent {
                seq: 12,
                at_ms: 1_796_049_348_000,
                message: "restarted kubelet.service in 230 ms: unit is active/running".into(),
            }],
        }
    }

    #[test]
    fn status_round_trips_through_the_wire() {
        for phase in [Phase::RolledBack, Phase::Applying, Phase::Succeeded] {
            let status = sample(phase);
            let wire = status_to_pb(&status);
            assert_eq!(status_from_pb(&wire).unwrap(), status);
            let hook = wire.hook_response.unwrap();
            let expected = status.hook_response();
            assert_eq!(hook.message, expected.message);
            assert_eq!(
                hook.retry_after_seconds as u32,
                expected.retry_after_seconds
            );
        }
        let wire = status_to_pb(&sample(Phase::RolledBack));
        assert_eq!(wire.phase, pb::Phase::RolledBack as i32);
        assert_eq!(
            wire.hook_response.unwrap().status,
            pb::HookStatus::Failure as i32
        );
        assert_eq!(wire.accepted_at.unwrap().nanos, 123_000_000);
        assert_eq!(
            wire.changes[0].duration,
            Some(prost_types::Duration {
                seconds: 1,
                nanos: 234_000_000
            })
        );
    }

    #[test]
    fn unknown_values_are_named_or_mapped_as_the_proto_says() {
        let mut wire = status_to_pb(&sample(Phase::Failed));
        wire.error.as_mut().unwrap().kind = "quota".into();
        assert_eq!(
            status_from_pb(&wire).unwrap().error.unwrap().kind,
            ErrorKind::Internal
        );
        wire.changes[0].kind = "teleport".into();
        let err = status_from_pb(&wire).unwrap_err();
        assert!(err.contains("\"teleport\""), "{err}");
        wire.phase = 99;
        assert!(
            status_from_pb(&wire)
                .unwrap_err()
                .contains("unknown phase 99")
        );
    }

    #[test]
    fn messages_are_bounded_at_char_boundaries() {
        let long = "é".repeat(300);
        let mut status = sample(Phase::Applying);
        status.progress.message = long;
        status.error = None;
        let wire = status_to_pb(&status);
        assert!(wire.step.unwrap().message.len() <= MAX_STEP_MESSAGE);
        assert!(wire.hook_response.unwrap().message.len() <= MAX_HOOK_MESSAGE);
    }
}
