//! Drift: whether the node still matches the last plan that succeeded on it. A drift check
//! is the dry run of that plan ([`dry_run::check_plan`], the code of `CheckPlan`), read-only:
//! a change is drifted when its diff is not empty. The agent's own writes never count: a
//! check is not made while a run is waiting or running, a check that a run overtook is
//! thrown away, and the baseline is the end state of the newest succeeded plan.
//!
//! Drift appearing, changing and clearing is journaled (`DriftFound`, `DriftCleared`), so a
//! restarted agent keeps when each change was first seen drifted.

use std::collections::{BTreeMap, BTreeSet};

use super::dry_run::{self, ChangeVerdict};
use super::staging::NodeBodies;
use super::table::{Baseline, resolved_plan};
use super::{Engine, EngineConfig, Submission, SubmitError};
use crate::host::Host;
use crate::host::watch::Stamped;
use crate::journal::backup::BackupStore;
use crate::journal::{DriftNote, Record};
use crate::steps;
use inplace_base::time::now_ms;
use inplace_plan::kinds::Difference;
use inplace_plan::{Change, ChangeKind, Limits, NodePath, Plan, validate_document};

/// One change of the baseline that the node no longer matches.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
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
    /// The node directories whose writes may drift the baseline (where its changes write,
    /// the package database when it has packages), as of the last check.
    pub watch: BTreeSet<NodePath>,
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
/// cannot be made at all: the plan-level errors of the dry run (systemd unreachable, node
/// name), a node that could not be read (a refused permission, an I/O error: not drift,
/// and not "none" either), or a change this agent cannot check as it is configured now
/// (service management off for a plan with units, `exec` not allowed). A reboot and an
/// `exec` change without `unless` (the command's effect cannot be observed) are not judged.
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
    if !report.environment.is_empty() {
        return Err(format!(
            "the node could not be read: {}",
            report.environment.join("; ")
        ));
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
        if !judged {
            continue;
        }
        if verdict.result == ChangeVerdict::Unsupported {
            return Err(format!(
                "changes[{i}] {} {} cannot be checked by this agent as it is configured: {}",
                change.kind(),
                change.target(),
                verdict.detail
            ));
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

/// The metadata of a baseline's files when a check found the node matching it: the next
/// check compares metadata first and reads nothing when none changed.
#[derive(Debug, Clone)]
pub struct Clean {
    /// The baseline's run.
    run: u64,
    /// When the full check was made (Unix ms).
    at_ms: u64,
    /// The paths and their stamps, taken before the full check read them.
    stamped: Stamped,
}

/// How long metadata alone may vouch for the node before a check reads everything again.
pub const FULL_CHECK_EVERY_MS: u64 = 3_600_000;

/// The paths whose metadata is the whole state of `plan`: every change is a file, an
/// absence, or the kubelet's configuration or flags (plus the account files owners are
/// resolved from); `None` when a change's state is elsewhere (a package, a unit, a live
/// sysctl, a command's effect).
pub fn stamped_paths(plan: &Plan) -> Option<Vec<NodePath>> {
    let mut paths: Vec<NodePath> = ["/etc/passwd", "/etc/group"]
        .iter()
        .map(|p| NodePath::parse(p).expect("constant path"))
        .collect();
    for change in &plan.changes {
        match change {
            Change::File(_)
            | Change::Absent(_)
            | Change::KubeletConfig(_)
            | Change::KubeletFlags(_) => {}
            _ => return None,
        }
        paths.extend(change.spec().writes().into_iter().map(|w| w.path));
    }
    Some(paths)
}

/// The directories whose writes may drift `plan`: the parent of every path it writes, and
/// the package databases when it has package changes.
pub fn watch_dirs(plan: &Plan) -> BTreeSet<NodePath> {
    let mut dirs = BTreeSet::new();
    for change in &plan.changes {
        for w in change.spec().writes() {
            if let Some(parent) = w.path.parent() {
                dirs.insert(parent);
            }
        }
        if let Change::Package(_) = change {
            for db in PACKAGE_DATABASES {
                dirs.insert(NodePath::parse(db).expect("constant path"));
            }
        }
    }
    dirs
}

/// Where dpkg and rpm keep what is installed and held (renamed into place on each change).
const PACKAGE_DATABASES: [&str; 3] = ["/var/lib/dpkg", "/var/lib/rpm", "/etc/dnf/plugins"];

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

fn read_baseline(
    backups: &BackupStore,
    host: &Host,
    baseline: &Baseline,
    id: &str,
) -> Result<ReadBack, String> {
    let bodies = NodeBodies { backups, host };
    let kept = &baseline.kept;
    let (value, gone) = kept.to_value(&bodies)?;
    let plan = validate_document(value, id, &Limits::replay()).map_err(|e| e.to_string())?;
    let applied = resolved_plan(&plan, &baseline.versions, &baseline.pruned);
    let sums = kept
        .staged
        .iter()
        .map(|s| (s.index, (s.sha256.clone(), s.len)))
        .chain(
            kept.held
                .iter()
                .map(|h| (h.index, (h.sha256.clone(), h.len))),
        );
    let gone = sums.filter(|(i, _)| gone.contains(i)).collect();
    Ok((plan, applied, gone))
}

/// What one full look at the node against the baseline found: the drifted changes (or
/// why they could not be found), the directories to watch, and — when the node matched a
/// baseline whose whole state is files — their stamps, taken before they were read. What a
/// check process answers the daemon (`cli::drift_probe`), hence serializable.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Look {
    /// The baseline's run looked at.
    pub run: u64,
    /// The drifted changes, or why the check could not be made.
    pub found: Result<Vec<DriftedChange>, String>,
    /// See [`DriftState::watch`].
    pub watch: BTreeSet<NodePath>,
    /// The baseline's files and their stamps, when the node matched it and metadata can
    /// vouch for it next time.
    pub stamped: Option<Stamped>,
}

impl Look {
    /// A look that could not be made, for `why`.
    pub fn failed(run: u64, why: String) -> Look {
        Look {
            run,
            found: Err(why),
            watch: BTreeSet::new(),
            stamped: None,
        }
    }
}

/// Reads the node against `baseline` (plan id `id`): never writes.
pub fn look(
    config: &EngineConfig,
    host: &Host,
    backups: &BackupStore,
    baseline: &Baseline,
    id: &str,
) -> Look {
    let run = baseline.kept.run;
    let mut watch = BTreeSet::new();
    let mut stamped = None;
    let found = read_baseline(backups, host, baseline, id)
        .map_err(|e| format!("the plan of run {run} cannot be read back: {e}"))
        .and_then(|(_, applied, gone)| {
            watch = watch_dirs(&applied);
            // Stamped before the files are read: a write during the check changes them.
            stamped = stamped_paths(&applied)
                .filter(|_| gone.is_empty())
                .map(|paths| Stamped::take(host, &paths));
            drifted_changes(config, host, &applied, &gone)
        });
    if !found.as_ref().is_ok_and(Vec::is_empty) {
        stamped = None;
    }
    Look {
        run,
        found,
        watch,
        stamped,
    }
}

/// A check that needs a look at the node ([`Engine::begin_drift_check`]); what the look
/// finds goes to [`Engine::finish_drift_check`].
#[derive(Debug)]
pub struct Pending {
    /// The baseline to look at.
    pub baseline: Baseline,
    /// Which plan it is.
    pub reference: BaselineRef,
    /// The engine's next run when the check began: a run accepted since voids the check.
    generation: u64,
}

/// How a check began.
#[derive(Debug)]
pub enum Begun {
    /// It is over: no check could be made, or metadata vouched for the node.
    Done(CheckOutcome),
    /// The node must be read ([`Engine::look`], or a check process).
    Look(Box<Pending>),
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
    /// without the engine lock, in this process ([`Engine::look`]); the daemon makes the
    /// same check with the look in a check process of its own (`cli::drift_probe`).
    pub fn check_drift(&self) -> CheckOutcome {
        match self.begin_drift_check() {
            Begun::Done(outcome) => outcome,
            Begun::Look(pending) => {
                let look = self.look(&pending);
                self.finish_drift_check(&pending, look)
            }
        }
    }

    /// The first half of a check: whether one can be made, and when no file of the
    /// baseline changed since the node last matched it (metadata first, at most for an
    /// hour), the whole check. Otherwise the baseline to look at.
    pub fn begin_drift_check(&self) -> Begun {
        let (run, status, generation) = {
            let inner = self.shared.lock();
            if inner.table.unfinished().next().is_some() {
                return Begun::Done(CheckOutcome::Suspended);
            }
            let Some(run) = inner.table.baseline().map(|b| b.kept.run) else {
                return Begun::Done(CheckOutcome::NoBaseline);
            };
            (
                run,
                inner.table.by_run(run).cloned(),
                inner.table.next_run(),
            )
        };
        let reference = BaselineRef {
            id: status.as_ref().map(|s| s.id.clone()).unwrap_or_default(),
            digest: status
                .as_ref()
                .map(|s| s.digest.clone())
                .unwrap_or_default(),
            attempt: status.as_ref().map(|s| s.attempt).unwrap_or_default(),
            run,
        };
        let clean = self
            .shared
            .clean
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .filter(|c| {
                c.run == reference.run && now_ms().saturating_sub(c.at_ms) < FULL_CHECK_EVERY_MS
            });
        if let Some(clean) = clean
            && clean.stamped.unchanged(&self.shared.host)
        {
            let inner = self.shared.lock();
            if inner.table.next_run() != generation || inner.table.unfinished().next().is_some() {
                return Begun::Done(CheckOutcome::Suspended);
            }
            let mut state = self.shared.drift.lock().unwrap_or_else(|p| p.into_inner());
            state.checked_at_ms = Some(now_ms());
            state.problem = None;
            state.changes.clear();
            state.baseline = Some(reference);
            *self.shared.clean.lock().unwrap_or_else(|p| p.into_inner()) = Some(clean);
            return Begun::Done(CheckOutcome::Checked);
        }
        // The node must be read: the baseline (its whole plan document) is copied only now,
        // not for every check that metadata vouches for.
        let baseline = {
            let inner = self.shared.lock();
            match inner.table.baseline() {
                Some(b) if inner.table.next_run() == generation => b.clone(),
                _ => return Begun::Done(CheckOutcome::Suspended),
            }
        };
        Begun::Look(Box::new(Pending {
            baseline,
            reference,
            generation,
        }))
    }

    /// The middle of a check, in this process: the node read against the baseline.
    pub fn look(&self, pending: &Pending) -> Look {
        look(
            &self.shared.config,
            &self.shared.host,
            &self.shared.backups,
            &pending.baseline,
            &pending.reference.id,
        )
    }

    /// The end of a check: what the look found becomes the drift state (thrown away when
    /// a run was accepted meanwhile), journaled and logged when it changed.
    pub fn finish_drift_check(&self, pending: &Pending, look: Look) -> CheckOutcome {
        let (reference, generation) = (pending.reference.clone(), pending.generation);
        let Look {
            run,
            found,
            watch,
            stamped,
        } = look;
        let found = if run == reference.run {
            found
        } else {
            Err(format!(
                "the check looked at run {run}, not the baseline's run {}",
                reference.run
            ))
        };
        let now = now_ms();
        if let (Ok(changes), Some(stamped)) = (&found, stamped)
            && changes.is_empty()
        {
            *self.shared.clean.lock().unwrap_or_else(|p| p.into_inner()) = Some(Clean {
                run: reference.run,
                at_ms: now,
                stamped,
            });
        }
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
                // A look that failed knows nothing of where the plan writes: the directories
                // watched stay those of the last look that did not.
                state.watch = watch;
                changes
            }
            Err(problem) => {
                if state.problem.as_ref() != Some(&problem) {
                    tracing::warn!(plan = %reference.id, run = reference.run, "cannot check drift against plan {}: {problem}", reference.id);
                }
                state.problem = Some(problem);
                state.baseline = Some(reference);
                return CheckOutcome::Checked;
            }
        };
        // First seen: kept from this process's last check or, after a restart, from the
        // journal, for a change drifted then and now.
        let journaled_any = inner.table.journaled_drift().is_some();
        let journaled = inner
            .table
            .journaled_drift()
            .filter(|d| d.run == reference.run)
            .map(|d| d.changes.clone())
            .unwrap_or_default();
        let same_baseline = state
            .baseline
            .as_ref()
            .is_some_and(|b| b.run == reference.run);
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
        // Journaled when what is drifted changes, and when it clears (drift from an older
        // baseline included: a newer plan succeeded since).
        let record = if !notes.is_empty() && notes != journaled {
            Some(Record::DriftFound {
                run: reference.run,
                changes: notes,
            })
        } else if notes.is_empty() && journaled_any {
            Some(Record::DriftCleared { run: reference.run })
        } else {
            None
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
        self.repair_of(None, by)
    }

    /// [`Engine::repair`], only when the last succeeded plan has id `id` (when given).
    pub fn repair_of(&self, id: Option<&str>, by: &str) -> Result<Submission, SubmitError> {
        let _submitting = self.submission_lock();
        let (baseline, status) = {
            let inner = self.shared.lock();
            if let Some((run, _)) = inner.table.unfinished().next() {
                return Err(SubmitError::Conflict(format!(
                    "run {run} is in progress; repair once it has finished"
                )));
            }
            let baseline = inner.table.baseline().cloned().ok_or_else(|| {
                SubmitError::Conflict(
                    "no plan has succeeded on this node: there is nothing to repair to".into(),
                )
            })?;
            let status = inner
                .table
                .by_run(baseline.kept.run)
                .cloned()
                .ok_or_else(|| {
                    SubmitError::Conflict(format!(
                        "the status of run {} is no longer kept",
                        baseline.kept.run
                    ))
                })?;
            if let Some(id) = id
                && id != status.id
            {
                return Err(SubmitError::Conflict(format!(
                    "the last plan that succeeded on this node is {}, not {id}",
                    status.id
                )));
            }
            // The newest attempt of the plan, so the repair gets the next attempt number.
            let latest = inner.table.latest(&status.id).cloned().unwrap_or(status);
            (baseline, latest)
        };
        // As submitted: a version pattern is resolved again, as for any attempt.
        let (plan, _, gone) = read_baseline(
            &self.shared.backups,
            &self.shared.host,
            &baseline,
            &status.id,
        )
        .map_err(SubmitError::Conflict)?;
        if !gone.is_empty() {
            let which: Vec<String> = gone.keys().map(|i| format!("changes[{i}]")).collect();
            return Err(SubmitError::Conflict(format!(
                "plan {} cannot be repaired from the journal: the content of {} was kept only \
                 by its target, which no longer holds it; submit the plan again",
                status.id,
                which.join(", ")
            )));
        }
        // The plan succeeded on this very node (its journal says so): an agent that requires
        // a `nodeName` of what it is sent (the daemon) does not require one of a repair, whose
        // plan was not sent but read back from here. A plan naming another node is still
        // refused: the agent's node name changed since it succeeded.
        let prepared = self.admit_accepted(&plan).map_err(|e| match e {
            SubmitError::WrongNode {
                id,
                plan_node,
                node,
            } => SubmitError::Conflict(format!(
                "plan {id} cannot be repaired here: it names node {plan_node}, and this \
                     agent is now node {node} (node.name or --node-name changed since it \
                     succeeded); submit a plan for node {node}, or run the agent as node \
                     {plan_node}"
            )),
            other => other,
        })?;
        let source = format!("repair of run {} by {by}", baseline.kept.run);
        self.accept_attempt(plan, &status, &source, &prepared)
    }

    /// [`Engine::admit`] of a plan this node accepted already (a run starting, a repair
    /// read back from the journal, where it succeeded): a `nodeName` is required of what is
    /// sent, and was, or the plan is this node's own; it is not required again (decision
    /// 0016). A plan naming another node is still refused.
    pub(super) fn admit_accepted(&self, plan: &Plan) -> Result<steps::Prepared, SubmitError> {
        if plan.node_name.is_none() && self.shared.config.require_node_name {
            let mut config = self.shared.config.clone();
            config.require_node_name = false;
            return super::admit(&config, &self.shared.host, plan);
        }
        self.admit(plan)
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::config::SettingsInput;

    const PLAN: &str = "apiVersion: inplace.agent/v1\nkind: Plan\nid: drift\nchanges:\n\
        \x20 - file: {path: /etc/kubernetes/extra.conf, content: \"extra\\n\", mode: \"0640\"}\n\
        \x20 - kubeletConfig: {mergePatch: {maxPods: 90, evictionHard: {memory.available: 200Mi}}}\n\
        \x20 - kubeletFlags: {set: {node-labels: role=worker}}\n\
        \x20 - sysctl: {key: net.ipv4.ip_forward, value: \"1\"}\n";

    fn node(dir: &Path) -> (Engine, Arc<Host>) {
        inplace_demo_node::build_kubeadm_worker(dir).unwrap();
        node_again(dir)
    }

    fn applied(dir: &Path) -> Engine {
        applied_plan(dir, PLAN)
    }

    fn applied_plan(dir: &Path, text: &str) -> Engine {
        let (engine, _) = node(dir);
        let plan = inplace_plan::parse_plan(text.as_bytes(), "test", &Limits::default()).unwrap();
        engine.submit(plan, "test", false).unwrap();
        engine.run_until_idle();
        assert_eq!(
            engine.plans().last().unwrap().phase,
            super::super::state::Phase::Succeeded
        );
        engine
    }

    fn fields(engine: &Engine) -> Vec<(u32, String, String, String)> {
        assert_eq!(engine.check_drift(), CheckOutcome::Checked);
        let state = engine.drift();
        assert_eq!(state.problem, None);
        state
            .changes
            .iter()
            .flat_map(|c| {
                c.differences.iter().map(|d| {
                    (
                        c.index,
                        d.field.clone(),
                        d.expected.clone(),
                        d.found.clone(),
                    )
                })
            })
            .collect()
    }

    fn edit(dir: &Path, rel: &str, from: &str, to: &str) {
        let path = dir.join(rel);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{rel} has no {from:?}: {text}");
        std::fs::write(&path, text.replace(from, to)).unwrap();
    }

    #[test]
    fn before_any_plan_succeeded_there_is_nothing_to_drift_from() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, _) = node(dir.path());
        assert_eq!(engine.check_drift(), CheckOutcome::NoBaseline);
        assert!(!engine.drift().drifted());
    }

    #[test]
    fn a_look_that_failed_is_a_problem_not_drift_and_keeps_the_directories_watched() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        edit(dir.path(), "etc/kubernetes/extra.conf", "extra", "edited");
        assert_eq!(engine.check_drift(), CheckOutcome::Checked);
        let before = engine.drift();
        assert!(
            before
                .watch
                .contains(&NodePath::parse("/etc/kubernetes").unwrap())
        );
        let Begun::Look(pending) = engine.begin_drift_check() else {
            panic!("a plan with a sysctl is always read");
        };
        let why = "the check process was killed after 300s".to_string();
        let failed = Look::failed(pending.reference.run, why.clone());
        assert_eq!(
            engine.finish_drift_check(&pending, failed),
            CheckOutcome::Checked
        );
        let after = engine.drift();
        assert_eq!(after.problem, Some(why));
        assert_eq!(after.watch, before.watch);
        assert_eq!(after.changes, before.changes, "what was known stays known");
        // A look at another run than the baseline's is not taken for the baseline's.
        let Begun::Look(pending) = engine.begin_drift_check() else {
            panic!("read again");
        };
        let mut stray = engine.look(&pending);
        stray.run += 1;
        engine.finish_drift_check(&pending, stray);
        assert!(
            engine
                .drift()
                .problem
                .unwrap()
                .contains("not the baseline's run")
        );
    }

    #[test]
    fn a_node_as_the_plan_left_it_has_not_drifted() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        assert_eq!(fields(&engine), Vec::new());
        assert_eq!(engine.drift().baseline.unwrap().id, "drift");
    }

    #[test]
    fn file_content_mode_and_owner_are_each_named() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        let path = dir.path().join("etc/kubernetes/extra.conf");
        std::fs::write(&path, "edited by hand\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let found = fields(&engine);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].0, 0);
        assert_eq!(found[0].1, "/etc/kubernetes/extra.conf content");
        assert!(found[0].2.starts_with("6 bytes, sha256 "), "{found:?}");
        assert!(found[0].3.starts_with("15 bytes, sha256 "), "{found:?}");
        assert_eq!(
            found[1],
            (
                0,
                "/etc/kubernetes/extra.conf mode".into(),
                "0640".into(),
                "0600".into()
            )
        );
        // Owner: the sandbox's root is the caller; chown to another id when allowed.
        std::fs::write(&path, "extra\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
            let found = fields(&engine);
            assert_eq!(found.len(), 1, "{found:?}");
            assert_eq!(found[0].1, "/etc/kubernetes/extra.conf owner");
            assert_eq!(found[0].3, "65534:65534");
        }
    }

    #[test]
    fn after_a_clean_check_metadata_vouches_only_for_unchanged_files() {
        let plan = inplace_plan::parse_plan(PLAN.as_bytes(), "test", &Limits::default()).unwrap();
        // The sysctl's live value is not in a file's metadata: every check of it reads.
        assert_eq!(stamped_paths(&plan), None);
        let text = PLAN
            .lines()
            .filter(|l| !l.contains("sysctl"))
            .collect::<Vec<_>>()
            .join("\n");
        let files_only =
            inplace_plan::parse_plan(text.as_bytes(), "test", &Limits::default()).unwrap();
        assert_eq!(stamped_paths(&files_only).map(|p| p.len()), Some(5));
        let dir = tempfile::tempdir().unwrap();
        let engine = applied_plan(dir.path(), &text);
        // Clean (read), clean again (metadata only); then a same-sized edit is still found.
        assert_eq!(fields(&engine), Vec::new());
        assert_eq!(fields(&engine), Vec::new());
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 90",
            "maxPods: 91",
        );
        assert_eq!(
            fields(&engine),
            vec![(1, "maxPods".into(), "90".into(), "91".into())]
        );
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 91",
            "maxPods: 90",
        );
        assert_eq!(fields(&engine), Vec::new());
        assert_eq!(fields(&engine), Vec::new());
    }

    #[test]
    fn a_kubelet_config_field_is_named_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 90",
            "maxPods: 250",
        );
        assert_eq!(
            fields(&engine),
            vec![(1, "maxPods".into(), "90".into(), "250".into())]
        );
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 250",
            "maxPods: 90",
        );
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "memory.available: 200Mi",
            "",
        );
        let found = fields(&engine);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].1, "evictionHard.memory.available");
        assert_eq!(found[0].2, "\"200Mi\"");
    }

    #[test]
    fn a_kubelet_flag_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        edit(
            dir.path(),
            "var/lib/kubelet/kubeadm-flags.env",
            "--node-labels=role=worker",
            "--node-labels=role=infra",
        );
        assert_eq!(
            fields(&engine),
            vec![(
                2,
                "--node-labels".into(),
                "role=worker".into(),
                "role=infra".into()
            )]
        );
    }

    #[test]
    fn a_sysctl_reset_in_its_file_is_drift() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        let conf = "etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf";
        edit(dir.path(), conf, "= 1", "= 0");
        let found = fields(&engine);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, 3);
        assert_eq!(found[0].1, format!("/{conf} content"));
    }

    #[test]
    fn drift_is_journaled_when_it_appears_and_clears_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 90",
            "maxPods: 250",
        );
        engine.check_drift();
        let first = engine.drift().changes[0].first_seen_ms;
        assert_eq!(engine.drift().events, 1);
        // Checked again: nothing new is journaled, first seen stays.
        let records = engine.journal_info().records;
        engine.check_drift();
        assert_eq!(engine.journal_info().records, records);
        drop(engine);
        let (engine, _) = node_again(dir.path());
        assert_eq!(engine.check_drift(), CheckOutcome::Checked);
        assert_eq!(engine.drift().changes[0].first_seen_ms, first);
        assert_eq!(engine.journal_info().records, records);
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 250",
            "maxPods: 90",
        );
        engine.check_drift();
        assert!(!engine.drift().drifted());
        assert!(engine.read(|t| t.journaled_drift().is_none()));
        assert_eq!(engine.journal_info().records, records + 1);
    }

    /// The engine of a node built before (its tree is left as it is).
    fn node_again(dir: &Path) -> (Engine, Arc<Host>) {
        let settings = SettingsInput {
            root: Some(dir.to_path_buf()),
            no_chroot: true,
            services_off: true,
            ..SettingsInput::default()
        }
        .resolve()
        .unwrap();
        let host = Arc::new(Host::open(settings.host.clone()).unwrap());
        let (engine, _) = Engine::open(settings.engine, host.clone()).unwrap();
        (engine, host)
    }

    #[test]
    fn a_run_in_progress_suspends_checks() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        let next = PLAN
            .replace("id: drift", "id: next")
            .replace("maxPods: 90", "maxPods: 80");
        let plan = inplace_plan::parse_plan(next.as_bytes(), "test", &Limits::default()).unwrap();
        engine.submit(plan, "test", false).unwrap();
        // Accepted, not run yet: the node differs from the baseline, and that is not drift.
        assert_eq!(engine.check_drift(), CheckOutcome::Suspended);
        engine.run_until_idle();
        assert_eq!(fields(&engine), Vec::new());
        assert_eq!(engine.drift().baseline.unwrap().id, "next");
    }

    #[test]
    fn repair_reapplies_the_last_succeeded_plan_as_a_new_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 90",
            "maxPods: 250",
        );
        engine.check_drift();
        assert!(engine.drift().drifted());
        let s = engine.repair("test").unwrap();
        assert!(matches!(s, Submission::Accepted(_)));
        assert_eq!(s.status().attempt, 2);
        assert_eq!(s.status().source, "repair of run 1 by test");
        engine.run_until_idle();
        assert_eq!(fields(&engine), Vec::new());
        let baseline = engine.drift().baseline.unwrap();
        assert_eq!((baseline.id.as_str(), baseline.attempt), ("drift", 2));
    }

    #[test]
    fn the_baseline_and_the_drift_survive_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let engine = applied(dir.path());
        edit(
            dir.path(),
            "var/lib/kubelet/config.yaml",
            "maxPods: 90",
            "maxPods: 250",
        );
        engine.check_drift();
        let records = engine.read(|t| t.summary_records());
        let mut table = super::super::table::Table::new(1000);
        for (seq, record) in records.into_iter().enumerate() {
            table.apply(crate::journal::Entry {
                seq: seq as u64 + 1,
                ts: 0,
                record,
                offset: 0,
                hash: [0; 32],
            });
        }
        assert_eq!(
            table.baseline(),
            engine.read(|t| t.baseline().cloned()).as_ref()
        );
        assert_eq!(table.journaled_drift().map(|d| d.changes.len()), Some(1));
    }
}
