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
//! Why a crash anywhere is safe: before 3 is durable the plan was not accepted (the caller
//! got no answer), and the next start removes what 1 announced. After 3 every staged file is
//! durable (2 precedes 3). A resumed run reads each staged content back, verified against
//! its sha256; a rename that happened before the crash is found as the target already
//! holding that content (the step is then done). Content that is gone (removed by hand
//! while the agent was stopped) makes that change fail and the run roll back: it is never
//! replaced by anything else.

use std::collections::BTreeSet;

use sha2::{Digest, Sha256};

use super::table::Bodies;
use crate::base::FileMeta;
use crate::host::Host;
use crate::journal::StagedBody;
use crate::journal::backup::BackupStore;
use crate::plan::{Change, NodePath, Plan};
use crate::steps::{self, Mutation};

/// The file contents of kept plans, read back from the backup store and the node.
pub(super) struct NodeBodies<'a> {
    pub backups: &'a BackupStore,
    pub host: &'a Host,
}

fn matches(content: &[u8], body: &StagedBody) -> bool {
    content.len() as u64 == body.len && hex::encode(Sha256::digest(content)) == body.sha256
}

impl Bodies for NodeBodies<'_> {
    fn blob(&self, sha: &str) -> Result<Vec<u8>, String> {
        self.backups.get(sha).map_err(|e| e.to_string())
    }

    fn staged(&self, run: u64, body: &StagedBody) -> Option<Vec<u8>> {
        if let Ok(Some((content, _))) = self.host.root.read_staged(&body.path, run)
            && matches(&content, body)
        {
            return Some(content);
        }
        // Renamed into place before the agent stopped: the target holds it.
        let (file, _, size) = self.host.root.open_file(&body.path).ok()??;
        if size != body.len {
            return None;
        }
        let content = crate::host::fs::read_sized(&file, size).ok()?;
        matches(&content, body).then_some(content)
    }
}

/// The changes of `plan` whose content is staged: plain `file` changes (not `append`) whose
/// target differs from what they write, with the mode and owner they write, in a plan large
/// enough to keep its contents out of the journal. A change whose diff fails is not staged
/// (its step reports the failure).
pub(super) fn candidates(
    host: &Host,
    plan: &Plan,
    prepared: &steps::Prepared,
) -> Vec<(u32, FileMeta)> {
    if crate::journal::bodies::total(plan) < crate::journal::bodies::THRESHOLD {
        return Vec::new();
    }
    let mut picks = Vec::new();
    // Nothing changes the node during this pass: each directory is resolved once.
    let node = steps::HostNode::for_pass(host);
    for (i, change) in plan.changes.iter().enumerate() {
        let Change::File(f) = change else { continue };
        if f.append {
            continue;
        }
        if let Ok(diff) = steps::diff_on(&node, change, prepared.ctx(i))
            && let [Mutation::Write { path, meta, .. }] = diff.mutations.as_slice()
            && *path == f.path
        {
            picks.push((i as u32, *meta));
        }
    }
    picks
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
