//! Drift: whether the node still matches the last plan that succeeded on it. A drift check
//! is the dry run of that plan ([`dry_run::check_plan`], the code of `CheckPlan`), read-only:
//! a change is drifted when its diff is not empty. The agent's own writes never count: a
//! check is not made while a run is waiting or running, a check that a run overtook is
//! thrown away, and the baseline is the end state of the newest succeeded plan.
//!
//! Drift appearing, changing and clearing is journaled (`DriftFound`, `DriftCleared`), so a
//! restarted agent keeps when each change was first seen drifted.

use std::collections::BTreeMap;

use super::dry_run::{self, ChangeVerdict};
use super::staging::NodeBodies;
use super::table::{Baseline, resolved_plan};
use super::{Engine, EngineConfig, Submission, SubmitError};
use crate::host::Host;
use crate::journal::{DriftNote, Record};
use crate::steps;
use inplace_base::time::now_ms;
use inplace_plan::kinds::Difference;
use inplace_plan::{Change, ChangeKind, Limits, Plan, validate_document};

/// One change of the baseline that the node no longer matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriftedChange {
    /// Index in the plan's `changes[]`.
    pub index: u32,
    /// Kind.
    pub kind: ChangeKind,
    /// What it is about.
    pub target: String,
    /// What differs, in words: what the dry run would do, or why the change no longer fits.
    pub detail: String,
    /// What differs, field by field (expected and found).
    pub differences: Vec<Difference>,
    /// When it was first seen drifted (Unix ms).
    pub first_seen_ms: u64,
}

/// The plan drift is measured against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaselineRef {
    /// Plan id.
    pub id: String,
    /// Plan digest.
    pub digest: String,
    /// Its attempt that succeeded.
    pub attempt: u32,
    /// Its run.
    pub run: u64,
}

/// What the agent knows about drift.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriftState {
    /// The last succeeded plan; `None` before any plan succeeded.
    pub baseline: Option<BaselineRef>,
    /// When the last check was made (Unix ms); `None` before the first.
    pub checked_at_ms: Option<u64>,
    /// The drifted changes, by index (empty: the node matches the baseline).
    pub changes: Vec<DriftedChange>,
    /// Why the last check could not be made, if it could not.
    pub problem: Option<String>,
    /// Times drift appeared (a change newly drifted) since the agent started.
    pub events: u64,
}

impl DriftState {
    /// True when some change of the baseline does not match the node.
    pub fn drifted(&self) -> bool {
        !self.changes.is_empty()
    }

    /// The drifted changes of each kind.
    pub fn by_kind(&self) -> BTreeMap<ChangeKind, u64> {
        let mut out = BTreeMap::new();
        for c in &self.changes {
            *out.entry(c.kind).or_default() += 1;
        }
        out
    }
}

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckOutcome {
    /// The check was made: the state now.
    Checked,
    /// No check: a run is waiting or running (or started during the check).
    Suspended,
    /// No plan has succeeded on this node: nothing to drift from.
    NoBaseline,
}

/// The changes of `plan` (the baseline) whose dry-run verdict says the node differs, with
/// what differs; `gone` are the changes whose content is no longer kept (sha256 and
/// length of what they wrote): their target no longer holds it. `Err` when the check
/// cannot be made at all (the plan-level errors of the dry run: systemd unreachable, node
/// name). A change this agent does not support, a reboot, and an `exec` change without
/// `unless` (the command's effect cannot be observed) are not judged.
pub fn drifted_changes(
    config: &EngineConfig,
    host: &Host,
    plan: &Plan,
    gone: &BTreeMap<u32, (String, u64)>,
) -> Result<Vec<DriftedChange>, String> {
    let report = dry_run::check_plan_explained(config, host, plan);
    if !report.errors.is_empty() {
        return Err(report
            .errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "));
    }
    let mut out = Vec::new();
    for verdict in &report.changes {
        let i = verdict.index;
        let Some(change) = plan.changes.get(i as usize) else {
            continue;
        };
        let judged = match change {
            Change::Reboot(_) => false,
            Change::Exec(e) => e.unless.is_some(),
            _ => true,
        };
        if !judged || verdict.result == ChangeVerdict::Unsupported {
            continue;
        }
        let drifted = |detail: String, differences: Vec<Difference>| DriftedChange {
            index: i,
            kind: change.kind(),
            target: change.target(),
            detail,
            differences,
            first_seen_ms: 0,
        };
        if let Some((sha, len)) = gone.get(&i) {
            let found = match steps::file_size(host, &change_path(change)) {
                Ok(Some(size)) => format!("{size} bytes of other content"),
                Ok(None) => "absent".to_string(),
                Err(e) => format!("unreadable ({e})"),
            };
            let expected = format!("{len} bytes, sha256 {}", &sha[..sha.len().min(12)]);
            out.push(drifted(
                format!(
                    "{} no longer holds the content the plan wrote",
                    change.target()
                ),
                vec![Difference {
                    field: format!("{} content", change.target()),
                    expected,
                    found,
                }],
            ));
            continue;
        }
        match verdict.result {
            ChangeVerdict::Unchanged | ChangeVerdict::Unsupported => {}
            ChangeVerdict::Invalid => out.push(drifted(verdict.detail.clone(), Vec::new())),
            ChangeVerdict::WouldChange => {
                out.push(drifted(verdict.detail.clone(), verdict.differences.clone()));
            }
        }
    }
    Ok(out)
}

/// The path a `file` change writes (its target), for a change whose content is gone.
fn change_path(change: &Change) -> inplace_plan::NodePath {
    match change {
        Change::File(f) => f.path.clone(),
        other => inplace_plan::NodePath::parse(&other.target())
            .unwrap_or_else(|_| inplace_plan::NodePath::parse("/").expect("root")),
    }
}

/// The baseline plan read back from the journal, as submitted and as its run applied it
/// (resolved versions, pruned paths), and the changes whose content is gone.
type ReadBack = (Plan, Plan, BTreeMap<u32, (String, u64)>);

fn read_baseline(engine: &Engine, baseline: &Baseline, id: &str) -> Result<ReadBack, String> {
    let bodies = NodeBodies {
        backups: &engine.shared.backups,
        host: &engine.shared.host,
    };
    let kept = &baseline.kept;
    let (value, gone) = kept.to_value(&bodies)?;
    let plan = validate_document(value, id, &Limits::replay()).map_err(|e| e.to_string())?;
    let applied = resolved_plan(&plan, &baseline.versions, &baseline.pruned);
    let sums = kept
        .staged
        .iter()
        .map(|s| (s.index, (s.sha256.clone(), s.len)))
        .chain(kept.held.iter().map(|h| (h.index, (h.sha256.clone(), h.len))));
    let gone = sums.filter(|(i, _)| gone.contains(i)).collect();
    Ok((plan, applied, gone))
}

impl Engine {
    /// What the agent knows about drift (the last check's result).
    pub fn drift(&self) -> DriftState {
        self.shared
            .drift
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Checks the node against the last succeeded plan now, unless a run is waiting or
    /// running; journals drift appearing, changing or clearing, and logs it. Reads the node
    /// without the engine lock.
    pub fn check_drift(&self) -> CheckOutcome {
        let (baseline, status, generation) = {
            let inner = self.shared.lock();
            if inner.table.unfinished().next().is_some() {
                return CheckOutcome::Suspended;
            }
            let Some(baseline) = inner.table.baseline().cloned() else {
                return CheckOutcome::NoBaseline;
            };
            let status = inner.table.by_run(baseline.kept.run).cloned();
            (baseline, status, inner.table.next_run())
        };
        let reference = BaselineRef {
            id: status.as_ref().map(|s| s.id.clone()).unwrap_or_default(),
            digest: status.as_ref().map(|s| s.digest.clone()).unwrap_or_default(),
            attempt: status.as_ref().map(|s| s.attempt).unwrap_or_default(),
            run: baseline.kept.run,
        };
        let found = read_baseline(self, &baseline, &reference.id)
            .map_err(|e| format!("the plan of run {} cannot be read back: {e}", reference.run))
            .and_then(|(_, applied, gone)| {
                drifted_changes(&self.shared.config, &self.shared.host, &applied, &gone)
            });
        let now = now_ms();
        let inner = self.shared.lock();
        // A run accepted while the node was read: what was read may be its writes.
        if inner.table.next_run() != generation || inner.table.unfinished().next().is_some() {
            return CheckOutcome::Suspended;
        }
        let mut state = self.shared.drift.lock().unwrap_or_else(|p| p.into_inner());
        state.checked_at_ms = Some(now);
        let mut changes = match found {
            Ok(changes) => {
                state.problem = None;
                changes
            }
            Err(problem) => {
                if state.problem.as_ref() != Some(&problem) {
                    tracing::warn!(run = reference.run, "cannot check drift: {problem}");
                }
                state.problem = Some(problem);
                state.baseline = Some(reference);
                return CheckOutcome::Checked;
            }
        };
        // First seen: kept from this process's last check or, after a restart, from the
        // journal, for a change drifted then and now.
        let journaled = inner
            .table
            .journaled_drift()
            .filter(|d| d.run == reference.run)
            .map(|d| d.changes.clone())
            .unwrap_or_default();
        let same_baseline = state.baseline.as_ref().is_some_and(|b| b.run == reference.run);
        let mut newly = false;
        for c in &mut changes {
            let before = state
                .changes
                .iter()
                .filter(|_| same_baseline)
                .find(|p| p.index == c.index)
                .map(|p| p.first_seen_ms)
                .or_else(|| {
                    journaled
                        .iter()
                        .find(|n| n.index == c.index)
                        .map(|n| n.first_seen_ms)
                });
            match before {
                Some(at) => c.first_seen_ms = at,
                None => {
                    c.first_seen_ms = now;
                    newly = true;
                }
            }
        }
        let notes: Vec<DriftNote> = changes
            .iter()
            .map(|c| DriftNote {
                index: c.index,
                kind: c.kind,
                target: c.target.clone(),
                detail: summary(c),
                first_seen_ms: c.first_seen_ms,
            })
            .collect();
        let record = match (journaled.is_empty(), notes.is_empty()) {
            (_, false) if notes != journaled => Some(Record::DriftFound {
                run: reference.run,
                changes: notes,
            }),
            (false, true) => Some(Record::DriftCleared {
                run: reference.run,
            }),
            _ => None,
        };
        if newly {
            state.events += 1;
        }
        for c in changes.iter().filter(|c| c.first_seen_ms == now) {
            tracing::warn!(
                plan = %reference.id,
                run = reference.run,
                index = c.index,
                kind = %c.kind,
                target = %c.target,
                "drift: the node no longer matches changes[{}] of plan {}: {}",
                c.index,
                reference.id,
                summary(c)
            );
        }
        if changes.is_empty() && !state.changes.is_empty() && same_baseline {
            tracing::info!(plan = %reference.id, run = reference.run, "drift cleared: the node matches plan {} again", reference.id);
        }
        state.changes = changes;
        state.baseline = Some(reference);
        drop(state);
        drop(inner);
        if let Some(record) = record
            && let Err(e) = self.shared.record(record, true)
        {
            tracing::warn!(error = %e, "cannot journal drift");
        }
        CheckOutcome::Checked
    }

    /// Re-applies the last succeeded plan as a new attempt of it (`source` says it is a
    /// repair, and of which run), with the same admission, rollback and gates as any run.
    pub fn repair(&self, by: &str) -> Result<Submission, SubmitError> {
        let _submitting = self.submission_lock();
        let (baseline, status) = {
            let inner = self.shared.lock();
            if let Some((run, _)) = inner.table.unfinished().next() {
                return Err(SubmitError::Conflict(format!(
                    "run {run} is in progress; repair once it has finished"
                )));
            }
            let baseline = inner.table.baseline().cloned().ok_or_else(|| {
                SubmitError::NotFound(
                    "no plan has succeeded on this node: there is nothing to repair to".into(),
                )
            })?;
            let status = inner
                .table
                .by_run(baseline.kept.run)
                .cloned()
                .ok_or_else(|| {
                    SubmitError::NotFound(format!(
                        "the status of run {} is no longer kept",
                        baseline.kept.run
                    ))
                })?;
            // The newest attempt of the plan, so the repair gets the next attempt number.
            let latest = inner.table.latest(&status.id).cloned().unwrap_or(status);
            (baseline, latest)
        };
        // As submitted: a version pattern is resolved again, as for any attempt.
        let (plan, _, gone) =
            read_baseline(self, &baseline, &status.id).map_err(SubmitError::Conflict)?;
        if !gone.is_empty() {
            let which: Vec<String> = gone.keys().map(|i| format!("changes[{i}]")).collect();
            return Err(SubmitError::Conflict(format!(
                "plan {} cannot be repaired from the journal: the content of {} was kept only \
                 by its target, which no longer holds it; submit the plan again",
                status.id,
                which.join(", ")
            )));
        }
        let prepared = self.admit(&plan)?;
        let source = format!("repair of run {} by {by}", baseline.kept.run);
        self.accept_attempt(plan, &status, &source, &prepared)
    }
}

/// A drifted change in one line: its differences, else its detail.
pub fn summary(c: &DriftedChange) -> String {
    if c.differences.is_empty() {
        c.detail.clone()
    } else {
        c.differences
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}
