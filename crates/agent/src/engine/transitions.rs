//! The phases' state machine, enforced where phases change: every `Phase` and `PlanFinished`
//! record the engine journals, and every one the table folds, goes through
//! [`Phase::can_become`]. The writer refuses an illegal move and ends the run Failed
//! (`internal`) instead; the fold reports one it finds in a journal (a warning naming the
//! record, a note in the run's events, a counter) instead of folding it silently.
//!
//! Which records move a run between phases, and what is legal for each:
//! - `PlanAccepted` starts a run in Pending (a new run; a retry is a new run too, never a
//!   move of the old one out of its terminal phase);
//! - `Phase` moves an unfinished run to a phase that is not terminal (`can_become`);
//! - `PlanFinished` moves it to a terminal phase (`can_become`): this is how a run ends;
//! - `Summary` (compaction) brings back a run that ended, in its terminal phase: not a move;
//! - a resumed run journals no phase again: the runner reads the phase from the table and
//!   goes on from there (its `ServiceManager` record marks the resume), so a phase never
//!   follows itself.

use super::state::Phase;
use crate::journal::Record;
use inplace_base::{ErrorInfo, ErrorKind};

/// A phase change the state machine does not allow, found in a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IllegalTransition {
    /// The run.
    pub run: u64,
    /// Its phase before the record (`None`: the record brings the run in, as a `Summary`).
    pub from: Option<Phase>,
    /// The phase the record names.
    pub to: Phase,
    /// The record (`phase`, `planFinished`, `summary`).
    pub record: &'static str,
}

impl std::fmt::Display for IllegalTransition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (run, record, to) = (self.run, self.record, self.to);
        match self.from {
            Some(from) => write!(
                f,
                "a {record} record moves run {run} from {from} to {to}, which the phases' \
                 state machine does not allow"
            ),
            None => write!(
                f,
                "a {record} record brings back run {run} in {to}, which is not a phase a \
                 run ends in"
            ),
        }
    }
}

impl IllegalTransition {
    /// What the engine journals instead of the refused record: the run ends Failed with an
    /// internal error, right where it is. Failed is legal from every unfinished phase, and
    /// stopping is what is safest for the node: the runner's idea of the run disagrees with
    /// its journal, so neither going on nor rolling back can be trusted to do the right
    /// thing; every pre-image stays in the backup store for a person (or a retry). `None`
    /// when the run has already ended: nothing more is journaled for it.
    pub fn instead(&self) -> Option<Record> {
        let from = self.from.filter(|p| !p.is_terminal())?;
        Some(Record::PlanFinished {
            run: self.run,
            phase: Phase::Failed.into(),
            error: Some(ErrorInfo {
                kind: ErrorKind::Internal,
                step: None,
                detail: format!(
                    "internal error: the agent tried to move the run from {from} to {}, \
                     which its phases' state machine does not allow; the run was stopped \
                     where it was, without rolling back (its pre-images are kept): this is a \
                     bug of inplace-agent, please report it",
                    self.to
                ),
            }),
        })
    }
}

/// The phase `record` moves its run to, with the rule it must follow; `None` for records
/// that change no phase.
fn target(record: &Record) -> Option<(u64, Phase, Rule)> {
    match record {
        Record::Phase { run, phase, .. } => Some((*run, (*phase).into(), Rule::Unfinished)),
        Record::PlanFinished { run, phase, .. } => Some((*run, (*phase).into(), Rule::Terminal)),
        Record::Summary { status, .. } => Some((status.run, status.phase.into(), Rule::Ended)),
        // A new run in Pending: nothing to move from.
        Record::PlanAccepted { .. } => None,
        // Steps, gates, unit jobs, reboots, resolutions, a cancel request, bookkeeping: they
        // happen within a phase.
        Record::Compacted { .. }
        | Record::DriftFound { .. }
        | Record::DriftCleared { .. }
        | Record::VersionResolved { .. }
        | Record::PruneResolved { .. }
        | Record::SetMembers { .. }
        | Record::StepStarted { .. }
        | Record::StepDone { .. }
        | Record::StepOutput { .. }
        | Record::StepFailed { .. }
        | Record::StepAbandoned { .. }
        | Record::StepRolledBack { .. }
        | Record::StepRollbackFailed { .. }
        | Record::DaemonReloaded { .. }
        | Record::UnitRestarted { .. }
        | Record::UnitJobStarted { .. }
        | Record::UnitJobDone { .. }
        | Record::SystemdUnreachable { .. }
        | Record::ServiceManager { .. }
        | Record::RebootRequested { .. }
        | Record::CheckDone { .. }
        | Record::Staging { .. }
        | Record::BodiesKept { .. }
        | Record::CancelRequested { .. } => None,
    }
}

/// What the phase a record names must be.
#[derive(Clone, Copy)]
enum Rule {
    /// `Phase`: a legal move to a phase that is not terminal (a run ends by `PlanFinished`).
    Unfinished,
    /// `PlanFinished`: a legal move to a terminal phase.
    Terminal,
    /// `Summary`: a terminal phase (the run comes back as it ended; there is no move).
    Ended,
}

/// Checks the phase change `record` makes to a run that is in `current` now (`None` when
/// the run is unknown). Records that change no phase pass.
pub fn check(
    record: &Record,
    current: impl FnOnce(u64) -> Option<Phase>,
) -> Result<(), IllegalTransition> {
    let Some((run, to, rule)) = target(record) else {
        return Ok(());
    };
    let illegal = |from| IllegalTransition {
        run,
        from,
        to,
        record: record.name(),
    };
    match rule {
        Rule::Ended => {
            if to.is_terminal() {
                Ok(())
            } else {
                Err(illegal(None))
            }
        }
        Rule::Unfinished | Rule::Terminal => {
            // An unknown run is one compaction dropped: the fold ignores its records.
            let Some(from) = current(run) else {
                return Ok(());
            };
            let kind_fits = match rule {
                Rule::Terminal => to.is_terminal(),
                _ => !to.is_terminal(),
            };
            if kind_fits && from.can_become(to) {
                Ok(())
            } else {
                Err(illegal(Some(from)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::engine::table::{Table, summaries};
    use crate::journal::{Entry, PlanDoc, Reader, RunPhase};
    use Phase::*;
    use inplace_plan::{Limits, Plan, parse_plan};

    fn plan(id: &str) -> Plan {
        parse_plan(
            format!(
                "apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n  - file: {{path: /etc/kubernetes/{id}.conf, content: x}}\n"
            )
            .as_bytes(),
            "test",
            &Limits::default(),
        )
        .expect("plan")
    }

    fn accepted(run: u64, attempt: u32, plan: &Plan) -> Record {
        let (changes, checks) = summaries(plan);
        Record::PlanAccepted {
            run,
            id: plan.id.clone(),
            digest: plan.digest(),
            attempt,
            source: "cli".into(),
            plan: PlanDoc::from_value(&plan.canonical_json()),
            changes,
            checks,
            bodies: None,
            staged: Vec::new(),
            held: Vec::new(),
            prune: None,
        }
    }

    fn to(run: u64, phase: Phase) -> Record {
        let error = (phase == RollingBack).then(|| ErrorInfo {
            kind: ErrorKind::Verification,
            step: None,
            detail: "a gate failed".into(),
        });
        if phase.is_terminal() {
            Record::PlanFinished {
                run,
                phase: phase.into(),
                error,
            }
        } else {
            Record::Phase {
                run,
                phase: phase.into(),
                error,
            }
        }
    }

    /// A table folding a journal, as replay and live updates do.
    struct Walk {
        table: Table,
        seq: u64,
    }

    impl Walk {
        fn new() -> Walk {
            Walk {
                table: Table::new(100),
                seq: 0,
            }
        }

        fn fold(&mut self, record: Record) -> &mut Walk {
            self.seq += 1;
            self.table.apply(Entry {
                seq: self.seq,
                ts: 1000 + self.seq,
                record,
                offset: 0,
                hash: [0; 32],
            });
            self
        }

        /// Accepts a plan as `run` and moves it through `phases`, one record each.
        fn run(&mut self, run: u64, attempt: u32, phases: &[Phase]) -> &mut Walk {
            self.fold(accepted(run, attempt, &plan("p")));
            for p in phases {
                self.fold(to(run, *p));
            }
            self
        }

        fn phase(&self, run: u64) -> Phase {
            self.table.by_run(run).expect("run").phase
        }

        fn events(&self, run: u64) -> Vec<String> {
            let status = self.table.by_run(run).expect("run");
            status.events.iter().map(|e| e.message.clone()).collect()
        }

        /// Every path below is one the runner takes: nothing may be reported.
        fn legal(&self) -> &Walk {
            assert_eq!(
                self.table.illegal_transitions(),
                0,
                "{:?}",
                self.table.plans()
            );
            self
        }
    }

    #[test]
    fn the_happy_path_with_and_without_restarts() {
        let mut w = Walk::new();
        w.run(
            1,
            1,
            &[Preparing, Applying, Restarting, Verifying, Succeeded],
        );
        w.run(2, 1, &[Preparing, Applying, Verifying, Succeeded]);
        w.legal();
        assert_eq!((w.phase(1), w.phase(2)), (Succeeded, Succeeded));
        assert!(
            w.table.run_state(1).is_none(),
            "an ended run is not resumed"
        );
    }

    #[test]
    fn failure_with_and_without_rollback() {
        let mut w = Walk::new();
        // A gate fails and everything is restored; a restore fails; nothing to restore.
        w.run(
            1,
            1,
            &[
                Preparing,
                Applying,
                Restarting,
                Verifying,
                RollingBack,
                RolledBack,
            ],
        );
        w.run(2, 1, &[Preparing, Applying, RollingBack, Failed]);
        w.run(3, 1, &[Preparing, Failed]);
        w.run(
            4,
            1,
            &[Preparing, Applying, Restarting, RollingBack, RolledBack],
        );
        w.legal();
        assert_eq!(
            [w.phase(1), w.phase(2), w.phase(3), w.phase(4)],
            [RolledBack, Failed, Failed, RolledBack]
        );
    }

    #[test]
    fn cancel_at_every_boundary() {
        let mut w = Walk::new();
        w.run(1, 1, &[Cancelled]);
        w.run(2, 1, &[Preparing, Cancelled]);
        w.run(3, 1, &[Preparing, Applying, RollingBack, Cancelled]);
        w.run(
            4,
            1,
            &[Preparing, Applying, Restarting, Verifying, Cancelled],
        );
        w.legal();
        assert!((1..=4).all(|run| w.phase(run) == Cancelled));
    }

    #[test]
    fn a_newer_plan_supersedes_at_a_boundary() {
        let mut w = Walk::new();
        w.run(1, 1, &[Superseded]);
        w.run(2, 1, &[Preparing, Applying, Superseded]);
        w.run(3, 1, &[Preparing, Applying, Verifying, Superseded]);
        w.legal();
        assert!((1..=3).all(|run| w.phase(run) == Superseded));
    }

    /// A crash in the middle: the next agent journals its `ServiceManager` record and goes
    /// on from the phase the table has, journaling no phase twice.
    #[test]
    fn resume_after_a_crash_journals_no_phase_again() {
        let mut w = Walk::new();
        let drive = |run| Record::ServiceManager {
            run,
            description: "off".into(),
        };
        w.fold(accepted(1, 1, &plan("p")));
        w.fold(drive(1));
        w.fold(to(1, Preparing)).fold(to(1, Applying));
        w.fold(drive(1)); // the agent restarted
        w.fold(to(1, Restarting)).fold(to(1, Verifying));
        w.fold(to(1, RollingBack));
        w.fold(drive(1)); // and again, while rolling back
        w.fold(to(1, RolledBack));
        w.legal();
        assert_eq!(w.phase(1), RolledBack);
        // A phase journaled again would be a bug: reported.
        let mut again = Walk::new();
        again.run(1, 1, &[Preparing, Applying, Applying]);
        assert_eq!(again.table.illegal_transitions(), 1);
    }

    /// A retry is a new run (attempt 2) that starts in Pending; the run it retries stays
    /// where it ended.
    #[test]
    fn a_retry_is_a_new_run_not_a_move_out_of_the_end() {
        let mut w = Walk::new();
        w.run(1, 1, &[Preparing, Applying, RollingBack, RolledBack]);
        w.run(2, 2, &[Preparing, Applying, Verifying, Succeeded]);
        w.legal();
        assert_eq!((w.phase(1), w.phase(2)), (RolledBack, Succeeded));
        // Moving the ended run itself: reported and not folded.
        w.fold(to(1, Preparing));
        assert_eq!(w.table.illegal_transitions(), 1);
        assert_eq!(w.phase(1), RolledBack, "the end of a run is final");
        assert!(w.table.run_state(1).is_none());
    }

    /// Compaction's summaries bring ended runs back in their terminal phase.
    #[test]
    fn summaries_bring_back_ended_runs() {
        let mut w = Walk::new();
        w.run(1, 1, &[Preparing, Applying, Verifying, Succeeded]);
        w.run(2, 1, &[Preparing, Failed]);
        let mut compacted = Walk::new();
        for r in w.table.summary_records() {
            compacted.fold(r);
        }
        compacted.legal();
        assert_eq!(
            (compacted.phase(1), compacted.phase(2)),
            (Succeeded, Failed)
        );
        // A summary of a run that had not ended cannot come from compaction.
        let Record::Summary { mut status, .. } = w.table.summary_records().remove(0) else {
            panic!("a summary");
        };
        status.run = 9;
        status.phase = RunPhase::Applying;
        compacted.fold(Record::Summary {
            status,
            plan: None,
            bodies: None,
            staged: Vec::new(),
            held: Vec::new(),
            versions: Default::default(),
            pruned: Vec::new(),
        });
        assert_eq!(compacted.table.illegal_transitions(), 1);
    }

    /// What the fold finds in a journal that breaks the state machine: a warning, a note in
    /// the run's events naming the record and the phases, and the counter; the record is
    /// folded as written, unless the run had ended.
    #[test]
    fn illegal_moves_in_a_journal_are_reported_not_folded_silently() {
        let mut w = Walk::new();
        w.run(1, 1, &[Verifying]); // seq 2: Pending → Verifying
        assert_eq!(w.table.illegal_transitions(), 1);
        assert_eq!(w.phase(1), Verifying, "folded as written");
        let events = w.events(1);
        assert_eq!(
            events,
            [
                "journal record 2: a phase record moves run 1 from Pending to Verifying, which \
              the phases' state machine does not allow; folded as written (a bug of the agent \
              that wrote it)"
            ]
        );
        // A run ends only by planFinished, and planFinished names a terminal phase.
        w.fold(to(1, Succeeded)); // Verifying → Succeeded: legal
        assert_eq!(w.table.illegal_transitions(), 1);
        let mut w = Walk::new();
        w.run(1, 1, &[Preparing]);
        w.fold(Record::Phase {
            run: 1,
            phase: RunPhase::Failed,
            error: None,
        });
        w.fold(Record::PlanFinished {
            run: 1,
            phase: RunPhase::Applying,
            error: None,
        });
        assert_eq!(w.table.illegal_transitions(), 2);
        // Ended twice: the first end stays.
        let mut w = Walk::new();
        w.run(1, 1, &[Preparing, Applying, Verifying, Succeeded, Failed]);
        assert_eq!(w.table.illegal_transitions(), 1);
        assert_eq!(w.phase(1), Succeeded);
        assert!(w.events(1)[0].contains("from Succeeded to Failed"));
        assert!(
            w.events(1)[0]
                .ends_with("ignored: the run had ended (a bug of the agent that wrote it)")
        );
    }

    /// The journal the previous release wrote (the golden fixture) holds only legal moves.
    #[test]
    fn the_golden_journal_has_no_illegal_transition() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/golden-journal/state/journal/journal.log"
        );
        let mut table = Table::new(1000);
        let mut moves = 0;
        for entry in Reader::open(std::path::Path::new(path))
            .unwrap()
            .expect("fixture")
        {
            let entry = entry.unwrap();
            if matches!(
                entry.record,
                Record::Phase { .. } | Record::PlanFinished { .. } | Record::Summary { .. }
            ) {
                moves += 1;
            }
            table.apply(entry);
        }
        assert!(moves > 20, "only {moves} phase changes in the fixture");
        assert_eq!(table.illegal_transitions(), 0);
    }

    /// Failed, the refusal's end, is legal from every phase a run can be in unfinished.
    #[test]
    fn a_refused_move_can_always_end_the_run_failed() {
        for from in [
            Pending,
            Preparing,
            Applying,
            Restarting,
            Verifying,
            RollingBack,
        ] {
            assert!(from.can_become(Failed), "{from}");
            let illegal = IllegalTransition {
                run: 3,
                from: Some(from),
                to: Succeeded,
                record: "planFinished",
            };
            let Some(Record::PlanFinished {
                run: 3,
                phase: RunPhase::Failed,
                error: Some(error),
            }) = illegal.instead()
            else {
                panic!("{from}: {:?}", illegal.instead());
            };
            assert_eq!(error.kind, ErrorKind::Internal);
            assert!(
                error.detail.contains(&format!("from {from} to Succeeded")),
                "{}",
                error.detail
            );
        }
        let ended = IllegalTransition {
            run: 3,
            from: Some(RolledBack),
            to: Preparing,
            record: "phase",
        };
        assert_eq!(
            ended.instead(),
            None,
            "nothing more is journaled for an ended run"
        );
    }

    /// Log lines of the calling thread, for assertions.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The engine refuses to journal an illegal move: it logs an internal error naming the
    /// phases, journals the run's end as Failed (`internal`) instead, and nothing runs.
    #[test]
    fn the_engine_refuses_to_journal_an_illegal_move() {
        use crate::config::SettingsInput;
        use crate::engine::{Engine, Submission};
        use crate::host::Host;

        let dir = tempfile::tempdir().unwrap();
        inplace_demo_node::build_kubeadm_worker(dir.path()).unwrap();
        let settings = SettingsInput {
            root: Some(dir.path().to_path_buf()),
            no_chroot: true,
            services_off: true,
            ..SettingsInput::default()
        }
        .resolve()
        .unwrap();
        let host = Arc::new(Host::open(settings.host.clone()).unwrap());
        let (engine, _) = Engine::open(settings.engine.clone(), host.clone()).unwrap();
        let p = plan("refused");
        let Submission::Accepted(status) = engine.submit(p, "test", false).unwrap() else {
            panic!("accepted");
        };
        let run = status.run;

        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            // Pending → Applying skips Preparing (where the plan is checked against the
            // node and its artifacts are fetched).
            engine.shared.record(to(run, Applying), false).unwrap();
        });
        let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        assert!(logs.contains("ERROR"), "{logs}");
        assert!(
            logs.contains("refusing to journal an illegal phase change")
                && logs.contains("from Pending to Applying"),
            "{logs}"
        );

        let status = engine.status_of_run(run).unwrap();
        assert_eq!(status.phase, Failed);
        let error = status.error.unwrap();
        assert_eq!(error.kind, ErrorKind::Internal);
        assert!(
            error.detail.contains("from Pending to Applying"),
            "{}",
            error.detail
        );
        engine.run_until_idle();
        assert!(
            !dir.path().join("etc/kubernetes/refused.conf").exists(),
            "nothing ran"
        );
        // The journal has the end, not the refused move, and replays to the same.
        let mut names = Vec::new();
        let path = crate::journal::file_path(&settings.engine.state_dir);
        for e in Reader::open(&path).unwrap().unwrap() {
            names.push(e.unwrap().record.name());
        }
        assert_eq!(names, ["planAccepted", "planFinished"]);
        drop(engine);
        let (reopened, _) = Engine::open(settings.engine, host).unwrap();
        assert_eq!(reopened.status_of_run(run).unwrap().phase, Failed);
        assert_eq!(reopened.read(|t| t.illegal_transitions()), 0);
    }
}
