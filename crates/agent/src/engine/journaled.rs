//! The engine's state ⇄ the journal's records. The journal has its own types (its on-disk
//! format, `journal::record`); the engine converts here, in one place, so renaming a field
//! of [`PlanStatus`] changes these functions (the compiler points at them) and never the
//! file. Every match is exhaustive both ways: a new phase or state is a decision here.

use super::state::{
    ChangeState, ChangeStatus, CheckState, CheckStatus, Counts, Phase, PlanStatus, Progress,
    RunEvent,
};
use crate::journal::{
    RunPhase, SummaryChange, SummaryChangeState, SummaryCheck, SummaryCheckState, SummaryCounts,
    SummaryEvent, SummaryProgress, SummaryStatus,
};

impl From<Phase> for RunPhase {
    fn from(phase: Phase) -> RunPhase {
        match phase {
            Phase::Pending => RunPhase::Pending,
            Phase::Preparing => RunPhase::Preparing,
            Phase::Applying => RunPhase::Applying,
            Phase::Restarting => RunPhase::Restarting,
            Phase::Verifying => RunPhase::Verifying,
            Phase::Succeeded => RunPhase::Succeeded,
            Phase::Failed => RunPhase::Failed,
            Phase::RollingBack => RunPhase::RollingBack,
            Phase::RolledBack => RunPhase::RolledBack,
            Phase::Superseded => RunPhase::Superseded,
            Phase::Cancelled => RunPhase::Cancelled,
        }
    }
}

impl From<RunPhase> for Phase {
    fn from(phase: RunPhase) -> Phase {
        match phase {
            RunPhase::Pending => Phase::Pending,
            RunPhase::Preparing => Phase::Preparing,
            RunPhase::Applying => Phase::Applying,
            RunPhase::Restarting => Phase::Restarting,
            RunPhase::Verifying => Phase::Verifying,
            RunPhase::Succeeded => Phase::Succeeded,
            RunPhase::Failed => Phase::Failed,
            RunPhase::RollingBack => Phase::RollingBack,
            RunPhase::RolledBack => Phase::RolledBack,
            RunPhase::Superseded => Phase::Superseded,
            RunPhase::Cancelled => Phase::Cancelled,
        }
    }
}

impl From<ChangeState> for SummaryChangeState {
    fn from(state: ChangeState) -> SummaryChangeState {
        match state {
            ChangeState::Pending => SummaryChangeState::Pending,
            ChangeState::Running => SummaryChangeState::Running,
            ChangeState::Unchanged => SummaryChangeState::Unchanged,
            ChangeState::Changed => SummaryChangeState::Changed,
            ChangeState::Failed => SummaryChangeState::Failed,
            ChangeState::RolledBack => SummaryChangeState::RolledBack,
            ChangeState::RollbackFailed => SummaryChangeState::RollbackFailed,
            ChangeState::Skipped => SummaryChangeState::Skipped,
        }
    }
}

impl From<SummaryChangeState> for ChangeState {
    fn from(state: SummaryChangeState) -> ChangeState {
        match state {
            SummaryChangeState::Pending => ChangeState::Pending,
            SummaryChangeState::Running => ChangeState::Running,
            SummaryChangeState::Unchanged => ChangeState::Unchanged,
            SummaryChangeState::Changed => ChangeState::Changed,
            SummaryChangeState::Failed => ChangeState::Failed,
            SummaryChangeState::RolledBack => ChangeState::RolledBack,
            SummaryChangeState::RollbackFailed => ChangeState::RollbackFailed,
            SummaryChangeState::Skipped => ChangeState::Skipped,
        }
    }
}

impl From<CheckState> for SummaryCheckState {
    fn from(state: CheckState) -> SummaryCheckState {
        match state {
            CheckState::Pending => SummaryCheckState::Pending,
            CheckState::Running => SummaryCheckState::Running,
            CheckState::Passed => SummaryCheckState::Passed,
            CheckState::Failed => SummaryCheckState::Failed,
            CheckState::Skipped => SummaryCheckState::Skipped,
        }
    }
}

impl From<SummaryCheckState> for CheckState {
    fn from(state: SummaryCheckState) -> CheckState {
        match state {
            SummaryCheckState::Pending => CheckState::Pending,
            SummaryCheckState::Running => CheckState::Running,
            SummaryCheckState::Passed => CheckState::Passed,
            SummaryCheckState::Failed => CheckState::Failed,
            SummaryCheckState::Skipped => CheckState::Skipped,
        }
    }
}

/// The `Summary` record's form of a finished run's status (compaction).
pub fn summary_of(s: &PlanStatus) -> SummaryStatus {
    SummaryStatus {
        id: s.id.clone(),
        digest: s.digest.clone(),
        attempt: s.attempt,
        run: s.run,
        source: s.source.clone(),
        phase: s.phase.into(),
        progress: SummaryProgress {
            current: s.progress.current,
            total: s.progress.total,
            message: s.progress.message.clone(),
        },
        changes: s
            .changes
            .iter()
            .map(|c| SummaryChange {
                index: c.index,
                kind: c.kind,
                target: c.target.clone(),
                state: c.state.into(),
                message: c.message.clone(),
                disruption: c.disruption,
                duration_ms: c.duration_ms,
            })
            .collect(),
        checks: s
            .checks
            .iter()
            .map(|c| SummaryCheck {
                index: c.index,
                kind: c.kind.clone(),
                target: c.target.clone(),
                state: c.state.into(),
                message: c.message.clone(),
            })
            .collect(),
        error: s.error.clone(),
        rebooting: s.rebooting,
        services: s.services.clone(),
        accepted_at_ms: s.accepted_at_ms,
        started_at_ms: s.started_at_ms,
        finished_at_ms: s.finished_at_ms,
        counts: SummaryCounts {
            total: s.counts.total,
            changed: s.counts.changed,
            unchanged: s.counts.unchanged,
            rolled_back: s.counts.rolled_back,
        },
        events: s
            .events
            .iter()
            .map(|e| SummaryEvent {
                seq: e.seq,
                at_ms: e.at_ms,
                message: e.message.clone(),
            })
            .collect(),
    }
}

/// A finished run's status from its `Summary` record (replay of a compacted journal).
pub fn status_of(s: SummaryStatus) -> PlanStatus {
    PlanStatus {
        id: s.id,
        digest: s.digest,
        attempt: s.attempt,
        run: s.run,
        source: s.source,
        phase: s.phase.into(),
        progress: Progress {
            current: s.progress.current,
            total: s.progress.total,
            message: s.progress.message,
        },
        changes: s
            .changes
            .into_iter()
            .map(|c| ChangeStatus {
                index: c.index,
                kind: c.kind,
                target: c.target,
                state: c.state.into(),
                message: c.message,
                disruption: c.disruption,
                duration_ms: c.duration_ms,
            })
            .collect(),
        checks: s
            .checks
            .into_iter()
            .map(|c| CheckStatus {
                index: c.index,
                kind: c.kind,
                target: c.target,
                state: c.state.into(),
                message: c.message,
            })
            .collect(),
        error: s.error,
        rebooting: s.rebooting,
        services: s.services,
        accepted_at_ms: s.accepted_at_ms,
        started_at_ms: s.started_at_ms,
        finished_at_ms: s.finished_at_ms,
        counts: Counts {
            total: s.counts.total,
            changed: s.counts.changed,
            unchanged: s.counts.unchanged,
            rolled_back: s.counts.rolled_back,
        },
        events: s
            .events
            .into_iter()
            .map(|e| RunEvent {
                seq: e.seq,
                at_ms: e.at_ms,
                message: e.message,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::{Reader, Record};

    const GOLDEN: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/golden-journal/state/journal/journal.log"
    );

    /// Every phase and state survives the round trip, under the name the journal has always
    /// used for it (the engine's `Debug` name: they were one type until the contracts split).
    #[test]
    fn phases_and_states_round_trip_under_their_journal_names() {
        use Phase::*;
        for p in [
            Pending,
            Preparing,
            Applying,
            Restarting,
            Verifying,
            Succeeded,
            Failed,
            RollingBack,
            RolledBack,
            Superseded,
            Cancelled,
        ] {
            let on_disk = RunPhase::from(p);
            assert_eq!(Phase::from(on_disk), p);
            assert_eq!(on_disk.as_str(), format!("{p:?}"));
            assert_eq!(
                serde_json::to_string(&on_disk).unwrap(),
                format!("\"{p:?}\"")
            );
        }
        use ChangeState as C;
        for c in [
            C::Pending,
            C::Running,
            C::Unchanged,
            C::Changed,
            C::Failed,
            C::RolledBack,
            C::RollbackFailed,
            C::Skipped,
        ] {
            let on_disk = SummaryChangeState::from(c);
            assert_eq!(ChangeState::from(on_disk), c);
            assert_eq!(
                serde_json::to_string(&on_disk).unwrap(),
                format!("\"{c:?}\"")
            );
        }
        use CheckState as K;
        for c in [K::Pending, K::Running, K::Passed, K::Failed, K::Skipped] {
            let on_disk = SummaryCheckState::from(c);
            assert_eq!(CheckState::from(on_disk), c);
            assert_eq!(
                serde_json::to_string(&on_disk).unwrap(),
                format!("\"{c:?}\"")
            );
        }
    }

    /// The summaries the release of the golden journal wrote read into engine state and come
    /// back byte for byte: the conversion loses nothing the format carries.
    #[test]
    fn golden_summaries_round_trip_through_engine_state() {
        let reader = Reader::open(std::path::Path::new(GOLDEN))
            .unwrap()
            .expect("the golden journal");
        let mut summaries = 0;
        for entry in reader {
            let Record::Summary { status, .. } = entry.unwrap().record else {
                continue;
            };
            let before = serde_json::to_string(&status).unwrap();
            let engine = status_of(*status);
            let after = serde_json::to_string(&summary_of(&engine)).unwrap();
            assert_eq!(after, before);
            summaries += 1;
        }
        assert!(summaries > 10, "only {summaries} summary records");
    }
}
