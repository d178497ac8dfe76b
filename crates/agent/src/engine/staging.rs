//! Writing each byte once. The contents of a large plan's `file` changes are written once,
//! where they will live, before the plan is accepted; the journal references them instead
//! of holding them, and the step is a rename.
//!
//! The protocol, for a plan with at least `journal::bodies::THRESHOLD` bytes of file
//! content, per `file` change that is not `append` and whose target differs:
//! 1. `Staging { run, paths, dirs }` is journaled and synced: the files about to be staged
//!    and the directories that do not exist yet.
//! 2. Each content is written as `.<name>.inplace-r<run>` beside its target with its final
//!    mode and owner, its writeback started at once; then each file is synced, then each
//!    directory once.
//! 3. `PlanAccepted` references each staged file (`staged`: index, sha256, length, mode,
//!    directories created); the other contents go to the bodies blob as before. Synced.
//! 4. The step announces its pre-images (`StepStarted`, synced) and renames the staged file
//!    onto the target (directory synced): the rename is the mutation.
//! 5. Before `PlanFinished`, what was not renamed is removed, with the directories staging
//!    created when they are empty. A run that did not succeed first stores all its contents
//!    as one blob (`BodiesKept`), so it can still be retried from the journal.
//!
//! A content whose target already holds it (its step writes nothing) is not written at all
//! when nothing else of the plan can change that file before its step ([`may_hold`]):
//! `PlanAccepted.held` names the file, length and sha256 instead, and a resumed run reads
//! it back from there, verified.
//!
//! Why a crash anywhere is safe: before 3 is durable the plan was not accepted (the caller
//! got no answer), and the next start removes what 1 announced. After 3 every staged file is
//! durable (2 precedes 3). A resumed run reads each staged content back, verified against
//! its sha256; a rename that happened before the crash is found as the target already
//! holding that content (the step is then done). Content that is gone (removed by hand
//! while the agent was stopped, or a held file changed) makes that change fail and the run
//! roll back: it is never replaced by anything else.

use std::collections::BTreeSet;

use sha2::{Digest, Sha256};

use super::table::Bodies;
use crate::host::Host;
use crate::journal::backup::BackupStore;
use crate::journal::{HeldBody, StagedBody};
use crate::steps::{self, Mutation};
use inplace_base::FileMeta;
use inplace_plan::{Change, NodePath, Plan};

/// The file contents of kept plans, read back from the backup store and the node.
pub(super) struct NodeBodies<'a> {
    pub backups: &'a BackupStore,
    pub host: &'a Host,
}

fn matches(content: &[u8], len: u64, sha256: &str) -> bool {
    content.len() as u64 == len && hex::encode(Sha256::digest(content)) == sha256
}

/// The content of the file at `path` when it is `len` bytes with this sha256.
fn read_if(host: &Host, path: &NodePath, len: u64, sha256: &str) -> Option<Vec<u8>> {
    let (file, _, size) = host.root.open_file(path).ok()??;
    if size != len {
        return None;
    }
    let content = crate::host::fs::read_sized(&file, size).ok()?;
    matches(&content, len, sha256).then_some(content)
}

impl Bodies for NodeBodies<'_> {
    fn blob(&self, sha: &str) -> Result<Vec<u8>, String> {
        self.backups.get(sha).map_err(|e| e.to_string())
    }

    fn staged(&self, run: u64, body: &StagedBody) -> Option<Vec<u8>> {
        if let Ok(Some((content, _))) = self.host.root.read_staged(&body.path, run)
            && matches(&content, body.len, &body.sha256)
        {
            return Some(content);
        }
        // Renamed into place before the agent stopped: the target holds it.
        read_if(self.host, &body.path, body.len, &body.sha256)
    }

    fn held(&self, body: &HeldBody) -> Option<Vec<u8>> {
        read_if(self.host, &body.path, body.len, &body.sha256)
    }
}

/// Where the contents of a large plan's `file` changes go before it is accepted.
#[derive(Debug, Default)]
pub(super) struct Candidates {
    /// Staged beside their targets: plain `file` changes (not `append`) whose target differs
    /// from what they write, with the mode and owner they write.
    pub stage: Vec<(u32, FileMeta)>,
    /// Held by their targets: plain `file` changes whose target already holds exactly what
    /// they write (content, mode and owner), in a plan nothing else of which can change
    /// those files before their steps (see [`may_hold`]).
    pub held: Vec<u32>,
}

/// The changes of `plan` whose content is staged or held by its target, in a plan large
/// enough to keep its contents out of the journal (otherwise none). A change whose diff
/// fails is neither (its step reports the failure).
pub(super) fn candidates(host: &Host, plan: &Plan, prepared: &steps::Prepared) -> Candidates {
    let mut found = Candidates::default();
    if crate::journal::bodies::total(plan) < crate::journal::bodies::THRESHOLD {
        return found;
    }
    let hold = may_hold(plan);
    // Nothing changes the node during this pass: each directory is resolved once.
    let node = steps::HostNode::for_pass(host);
    for (i, change) in plan.changes.iter().enumerate() {
        let Change::File(f) = change else { continue };
        if f.append {
            continue;
        }
        let Ok(diff) = steps::diff_on(&node, change, prepared.ctx(i)) else {
            continue;
        };
        match diff.mutations.as_slice() {
            [Mutation::Write { path, meta, .. }] if *path == f.path => {
                found.stage.push((i as u32, *meta))
            }
            [] if hold => found.held.push(i as u32),
            _ => {}
        }
    }
    found
}

/// True when a content its target holds may be left there: every change of `plan` is a
/// `file` change that restarts no unit or an `absent` change. Each of those touches its own
/// path alone, and no two changes share a path (validation), so until its step nothing of
/// the plan can change a file that held its content; a package, a command, a unit restart or
/// a kubelet change might. (Whoever else changes it while the agent is stopped finds the
/// change failing and the run rolling back, as for a staged content that is gone.)
fn may_hold(plan: &Plan) -> bool {
    plan.changes.iter().all(|c| match c {
        Change::File(f) => f.restart_units.is_empty(),
        Change::Absent(_) => true,
        _ => false,
    })
}

/// The paths and the missing directories (from the top, each once) of `picks`.
pub(super) fn intent(
    host: &Host,
    plan: &Plan,
    picks: &[(u32, FileMeta)],
) -> (Vec<NodePath>, Vec<NodePath>) {
    let mut paths = Vec::with_capacity(picks.len());
    let mut dirs: Vec<NodePath> = Vec::new();
    for (i, _) in picks {
        let Some(Change::File(f)) = plan.changes.get(*i as usize) else {
            continue;
        };
        for d in host.root.missing_dirs(&f.path).unwrap_or_default() {
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
        paths.push(f.path.clone());
    }
    (paths, dirs)
}

/// Stages the contents of `picks` for `run` and makes their directories durable; the
/// bodies' sha256 are left for the caller (it has them from the plan's digest). On error
/// nothing staged is left behind.
pub(super) fn stage(
    host: &Host,
    run: u64,
    plan: &Plan,
    picks: &[(u32, FileMeta)],
) -> Result<Vec<StagedBody>, String> {
    let mut staged: Vec<StagedBody> = Vec::with_capacity(picks.len());
    match write_staged(host, run, plan, picks, &mut staged) {
        Ok(()) => Ok(staged),
        Err(e) => {
            for problem in unstage(host, run, staged.iter()) {
                tracing::warn!(
                    run,
                    problem,
                    "removing a staged file after a failed staging"
                );
            }
            Err(e)
        }
    }
}

/// Writes the staged files of `picks` (into `staged`, without their sha256), then syncs
/// them and their directories.
fn write_staged(
    host: &Host,
    run: u64,
    plan: &Plan,
    picks: &[(u32, FileMeta)],
    staged: &mut Vec<StagedBody>,
) -> Result<(), String> {
    for (i, meta) in picks {
        let Some(Change::File(f)) = plan.changes.get(*i as usize) else {
            continue;
        };
        let missing = host.root.missing_dirs(&f.path).unwrap_or_default();
        let created_dirs = host
            .root
            .stage(&f.path, run, &f.content, *meta)
            .map_err(|e| {
                // What this file's staging created before it failed.
                for dir in missing.iter().rev() {
                    let _ = host.root.remove_empty_dir(dir);
                }
                problem(*i, &f.path, &e)
            })?;
        staged.push(StagedBody {
            index: *i,
            path: f.path.clone(),
            sha256: String::new(),
            len: f.content.len() as u64,
            meta: *meta,
            created_dirs,
        });
    }
    // Each file's writeback started as it was written; now wait for them all.
    for body in staged.iter() {
        host.root
            .sync_staged(&body.path, run)
            .map_err(|e| problem(body.index, &body.path, &e))?;
    }
    let mut synced: BTreeSet<String> = BTreeSet::new();
    for body in staged.iter() {
        let dir = body
            .path
            .parent()
            .map(|d| d.to_string())
            .unwrap_or_default();
        if synced.insert(dir) {
            host.root
                .sync_parent(&body.path)
                .map_err(|e| problem(body.index, &body.path, &e))?;
        }
    }
    Ok(())
}

/// What went wrong staging change `index`, and that nothing changed; what to do when the
/// filesystem is full.
fn problem(index: u32, path: &NodePath, e: &crate::host::fs::FsError) -> String {
    let hint = match e.raw_os_error() {
        Some(28 | 122) => format!(
            "; free space on the filesystem of {} (the plan needs room for each new file's \
             content beside the old one) and submit it again",
            path.parent().map(|p| p.to_string()).unwrap_or_default()
        ),
        _ => String::new(),
    };
    format!("changes[{index}] file {path}: {e} (nothing on the node was changed){hint}")
}

/// Removes what `run` staged and did not rename into place, and the directories staging
/// created when they are empty; returns what could not be removed.
pub(super) fn unstage<'a>(
    host: &Host,
    run: u64,
    staged: impl Iterator<Item = &'a StagedBody>,
) -> Vec<String> {
    let staged: Vec<&StagedBody> = staged.collect();
    let mut problems = Vec::new();
    for body in &staged {
        if let Err(e) = host.root.unstage(&body.path, run) {
            problems.push(e.to_string());
        }
    }
    // Then the directories, deepest and latest first: a directory the first file's staging
    // created also holds the files staged after it.
    for dir in staged
        .iter()
        .rev()
        .flat_map(|b| b.created_dirs.iter().rev())
    {
        if let Err(e) = host.root.remove_empty_dir(dir) {
            problems.push(e.to_string());
        }
    }
    problems
}

/// Removes the staged files, and the directories announced, of staging whose plan was never
/// accepted (the agent stopped in between).
pub(super) fn sweep_abandoned(host: &Host, run: u64, paths: &[NodePath], dirs: &[NodePath]) {
    for p in paths {
        if let Err(e) = host.root.unstage(p, run) {
            tracing::warn!(run, path = %p, error = %e, "cannot remove a staged file of a plan that was not accepted");
        }
    }
    for d in dirs.iter().rev() {
        let _ = host.root.remove_empty_dir(d);
    }
}
