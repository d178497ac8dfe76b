//! Carrying out what the kinds decide. A kind (`plan::kinds`) never touches the node: it
//! observes it through [`HostNode`] (the kinds' `Node`, over `host`) and returns
//! [`Mutation`]s; here each mutation's pre-image is captured into the backup store
//! (`capture`), the mutation is performed (`execute`), and a pre-image is put back
//! (`restore`) — the same way for every kind, which is what keeps every kind crash-safe and
//! reversible. Admission (`preflight`) checks a plan against the node: what every kind gets
//! (paths against the allow-list, owners against the node's accounts, units that must exist)
//! and each kind's own checks.

pub mod artifact;
pub mod check;
pub mod control_plane;
pub mod kubeadm;
mod node;
pub mod package;

use std::time::Duration;

use crate::host::fs::FsError;
use crate::host::systemd::{SystemdError, UnitBefore, UnitFileOp};
use crate::host::users::Accounts;
use crate::host::{Host, STEP_BUS_WINDOW, ServiceCall};
use crate::journal::backup::{BackupError, BackupStore, BlobBatch};
use crate::journal::{FileBefore, Preimage};
use inplace_base::ErrorKind;
use inplace_plan::kinds::is_unit_path;
use inplace_plan::{Change, ChangeKind, FieldError, NodePath, Plan};

pub use inplace_base::StepError;
pub use inplace_plan::kinds::{Diff, Mutation, Note, StepCtx};
pub use node::HostNode;

/// What a pre-image describes, the same key as the [`Mutation::target`] it was captured for.
pub fn preimage_target(p: &Preimage) -> String {
    match p {
        Preimage::File { path, .. } | Preimage::Sysctl { path, .. } => path.to_string(),
        Preimage::UnitFile { unit, op, .. } => format!("unit-file:{unit}:{op}"),
        Preimage::UnitActive { unit, .. } => format!("unit-run:{unit}"),
        Preimage::Other { kind, data } => match data.get("target").and_then(|t| t.as_str()) {
            Some(target) => target.to_string(),
            None => format!("{kind}:{data}"),
        },
    }
}

/// What a journaled pre-image touched (see [`Mutation::touched`]).
pub fn preimage_touched(p: &Preimage) -> inplace_plan::kinds::Touched {
    use inplace_plan::kinds::Touched;
    match p {
        Preimage::File { path, .. } => Touched::File(path.clone()),
        Preimage::UnitFile { .. } => Touched::UnitFile,
        Preimage::UnitActive { .. } => Touched::UnitRun,
        Preimage::Sysctl { .. } => Touched::Sysctl,
        Preimage::Other { kind, .. } if kind == package::PREIMAGE_KIND => Touched::Package,
        // kubeadm upgrade node, exec, and kinds a newer agent journaled.
        Preimage::Other { .. } => Touched::Command,
    }
}

const ENOSPC: i32 = 28;
const EDQUOT: i32 = 122;

impl From<FsError> for StepError {
    fn from(e: FsError) -> StepError {
        let kind = match e.raw_os_error() {
            Some(ENOSPC | EDQUOT) => ErrorKind::DiskFull,
            _ => match e {
                FsError::Symlink { .. }
                | FsError::SymlinkBelow { .. }
                | FsError::Escapes { .. }
                | FsError::NotAllowed { .. }
                | FsError::NotADirectory { .. }
                | FsError::NotAFile { .. } => ErrorKind::Precondition,
                FsError::Io { .. } => ErrorKind::Io,
            },
        };
        StepError::new(kind, e.to_string())
    }
}

impl From<SystemdError> for StepError {
    fn from(e: SystemdError) -> StepError {
        StepError::new(ErrorKind::Systemd, e.to_string())
    }
}

impl From<BackupError> for StepError {
    fn from(e: BackupError) -> StepError {
        let kind = match e.raw_os_error() {
            Some(ENOSPC | EDQUOT) => ErrorKind::DiskFull,
            _ => ErrorKind::Io,
        };
        StepError::new(kind, e.to_string())
    }
}

/// What the agent can do on this node, from its configuration.
#[derive(Debug, Clone, Default)]
pub struct Capabilities {
    /// `exec` changes are allowed.
    pub exec_allowed: bool,
    /// The kinds this build implements (every kind of the plan model).
    pub kinds: Vec<ChangeKind>,
}

impl Capabilities {
    /// The kinds this build implements: all of them (a kind is its registration).
    pub fn implemented() -> Vec<ChangeKind> {
        ChangeKind::ALL.to_vec()
    }

    /// Why this node cannot apply `change`, or `None` when it can.
    pub fn unsupported(&self, change: &Change) -> Option<String> {
        if let Change::Exec(_) = change
            && !self.exec_allowed
        {
            return Some(
                "exec changes are disabled on this node (set exec.allow = true in the agent \
                 configuration)"
                    .into(),
            );
        }
        None
    }

    /// Why this node cannot run a gate, or `None` when it can.
    pub fn unsupported_check(&self, probe: &inplace_plan::Probe) -> Option<String> {
        check::unsupported(probe)
    }
}

/// Why `change` cannot be applied on a node whose agent has service management off, or
/// `None` when it can (restarts are then journaled as skipped, not refused).
pub fn unsupported_without_services(change: &Change) -> Option<String> {
    change.spec().needs_services().then(|| {
        format!(
            "{} changes need service management, which is off on this agent (--services off)",
            change.kind()
        )
    })
}

/// Per-change facts resolved against the node before a run (owners to ids).
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    /// Resolved (uid, gid) per change index, for changes with an owner.
    pub ids: Vec<Option<(u32, u32)>>,
    /// The node's `root:root`.
    pub root_ids: (u32, u32),
    /// The plan's time budget of one step.
    pub step_timeout: Duration,
}

impl Prepared {
    /// The context of change `index`.
    pub fn ctx(&self, index: usize) -> StepCtx {
        StepCtx {
            ids: self.ids.get(index).copied().flatten(),
            root_ids: self.root_ids,
            step_timeout: self.step_timeout,
            inputs_changed: None,
        }
    }
}

/// Checks a plan against this node without changing anything; errors name the field. Every
/// kind gets the same checks of what it writes (the allow-list, resolved the way the write
/// will resolve it; something other than a regular file in the way) and of its owner, then
/// its own ([`inplace_plan::Kind::preflight`]).
pub fn preflight(host: &Host, plan: &Plan) -> Result<Prepared, Vec<FieldError>> {
    let node = HostNode::new(host);
    let mut errors = Vec::new();
    let accounts = match Accounts::load(&host.root) {
        Ok(a) => a,
        Err(e) => {
            errors.push(FieldError::new(
                "",
                format!("read the node's accounts: {e}"),
            ));
            Accounts::default()
        }
    };
    let mut prepared = Prepared {
        root_ids: accounts.root_ids(),
        step_timeout: plan.options.step_timeout,
        ..Prepared::default()
    };
    // Directories shared by many paths (500 files in one directory) are resolved once.
    let mut dirs = crate::host::fs::DirCache::default();
    for (i, change) in plan.changes.iter().enumerate() {
        let base = format!("changes[{i}].{}", change.kind());
        let spec = change.spec();
        let mut in_the_way = Vec::new();
        for w in spec.writes() {
            match host.root.check_path_in(&w.path, &mut dirs) {
                Ok(Some(kind)) => in_the_way.push((w, kind)),
                Ok(None) => {}
                Err(e) => {
                    // The kind travels with it: a refused permission is the node's, not
                    // the plan's (the dry run says so and `check` exits accordingly).
                    let e = StepError::from(e);
                    errors.push(FieldError::caused(
                        format!("{base}.{}", w.field),
                        e.detail,
                        e.kind,
                    ));
                }
            }
        }
        let ids = spec
            .owner()
            .and_then(|owner| match accounts.resolve(owner) {
                Ok(resolved) => Some(resolved),
                Err(e) => {
                    errors.push(FieldError::new(format!("{base}.owner"), e));
                    None
                }
            });
        for (w, kind) in in_the_way {
            let problem = if w.removes {
                format!(
                    "{} is a {kind} on the node; absent removes files only",
                    w.path
                )
            } else {
                format!("{} is a {kind} on the node, not a regular file", w.path)
            };
            errors.push(FieldError::new(format!("{base}.{}", w.field), problem));
        }
        for (field, problem) in spec.preflight(&node) {
            errors.push(FieldError::new(format!("{base}.{field}"), problem));
        }
        prepared.ids.push(ids);
    }
    errors.extend(missing_units(host, plan));
    if errors.is_empty() {
        Ok(prepared)
    } else {
        Err(errors)
    }
}

/// The unit a path defines when it is a unit file (`/etc/systemd/system/x.service`), not a
/// drop-in below a unit's `.d` directory.
fn unit_defined_by(path: &NodePath) -> Option<&str> {
    let dir = path.parent()?;
    (is_unit_path(path) && !dir.as_str().ends_with(".d")).then(|| path.file_name())
}

/// Units the plan restarts, starts or gates on that this node does not have and no change
/// of the plan creates: applying would end in a failed restart, a failed gate and a rollback
/// that restarts a unit that does not exist. Asked of systemd only when it answers at once;
/// a plan that installs packages is not checked (packages ship units).
fn missing_units(host: &Host, plan: &Plan) -> Vec<FieldError> {
    let Some(services) = host.services() else {
        return Vec::new();
    };
    if plan.changes.iter().any(|c| !c.spec().packages().is_empty()) {
        return Vec::new();
    }
    let created: std::collections::BTreeSet<String> = plan
        .changes
        .iter()
        .flat_map(|c| c.spec().writes())
        .filter(|w| !w.removes)
        .filter_map(|w| unit_defined_by(&w.path).map(str::to_string))
        .collect();
    let mut referenced: Vec<(String, String)> = Vec::new();
    for (i, c) in plan.changes.iter().enumerate() {
        let spec = c.spec();
        let field = match spec.restart_field() {
            Some(field) => format!("changes[{i}].{}.{field}", c.kind()),
            None => format!("changes[{i}].{}", c.kind()),
        };
        for unit in spec.restart_units() {
            referenced.push((field.clone(), unit));
        }
    }
    for (i, check) in plan.verify.iter().enumerate() {
        if let inplace_plan::Probe::UnitActive { name } = &check.probe {
            referenced.push((format!("verify[{i}].unitActive.name"), name.clone()));
        }
    }
    referenced.retain(|(_, unit)| !created.contains(unit));
    if referenced.is_empty() || services.ping().is_err() {
        return Vec::new();
    }
    let mut missing: std::collections::BTreeMap<String, bool> = std::collections::BTreeMap::new();
    let mut errors = Vec::new();
    for (field, unit) in referenced {
        let absent = *missing.entry(unit.clone()).or_insert_with(|| {
            let mut call = ServiceCall::within(std::time::Duration::from_secs(2));
            match services.unit_state(&unit, &mut call) {
                Ok(state) => state.load_state == crate::host::systemd::LoadState::NotFound,
                Err(SystemdError::NoSuchUnit { .. }) => true,
                Err(_) => false,
            }
        });
        if absent {
            errors.push(FieldError::new(
                field,
                format!(
                    "{unit} does not exist on this node and no change of the plan creates it \
                     (check the name against `systemctl list-unit-files`)"
                ),
            ));
        }
    }
    errors
}

/// What `change` needs on this node now (the kind's diff over the node).
pub fn diff(host: &Host, change: &Change, ctx: StepCtx) -> Result<Diff, StepError> {
    diff_on(&HostNode::new(host), change, ctx)
}

/// [`diff`] over a given node (one [`HostNode::for_pass`] for a pass of diffs).
pub fn diff_on(node: &HostNode<'_>, change: &Change, ctx: StepCtx) -> Result<Diff, StepError> {
    change.spec().diff(node, ctx)
}

/// What differs between `change` and the node, field by field (a drift report's words),
/// given the non-empty diff its kind computed.
pub fn explain(host: &Host, change: &Change, diff: &Diff) -> Vec<inplace_plan::kinds::Difference> {
    inplace_plan::kinds::differences(change, &HostNode::new(host), diff)
}

/// The size of the regular file at `path` on the node (`None`: nothing there).
pub fn file_size(host: &Host, path: &inplace_plan::NodePath) -> Result<Option<u64>, String> {
    inplace_plan::kinds::Node::file_meta(&HostNode::new(host), path)
        .map(|m| m.map(|(_, size)| size))
        .map_err(|e| e.detail)
}

/// Why a dry run cannot tell whether `change` would change the node without doing work it
/// must not do (downloading an archive to look at a member); `None` when it can.
pub fn undecided(host: &Host, change: &Change) -> Option<String> {
    change.spec().undecided(&HostNode::new(host))
}

/// `Preimage::Other` kind of an exec change's pre-image (nothing to restore).
pub const RUN_PREIMAGE_KIND: &str = "exec";

/// Runs an exec change's command in the node's root; its bounded output is the result.
fn run(
    host: &Host,
    argv: &[String],
    timeout: Duration,
    note: &mut dyn FnMut(Note),
) -> Result<String, StepError> {
    let spec = host.command(argv.iter().cloned()).timeout(timeout);
    note(Note::Status(&format!("running {}", spec.display())));
    match crate::host::command::run(&spec) {
        Ok(out) if out.success() => Ok(package::transcript_text(
            &[crate::host::packages::CommandRecord {
                command: spec.display(),
                output: out,
            }],
            package::MAX_JOURNAL_OUTPUT,
        )),
        Ok(out) => Err(StepError::new(
            if out.timed_out {
                ErrorKind::Timeout
            } else {
                ErrorKind::Command
            },
            format!("{}: {}", spec.display(), out.summary()),
        )),
        Err(e) => Err(StepError::new(
            ErrorKind::Command,
            format!("{}: {e}", spec.display()),
        )),
    }
}

/// Records what `m`'s target looks like now, storing file content in the backup store
/// through `backups` (durable once the batch is synced, before the pre-image is journaled).
pub fn capture(host: &Host, backups: &BlobBatch<'_>, m: &Mutation) -> Result<Preimage, StepError> {
    match m {
        Mutation::Write { path, .. }
        | Mutation::WriteFrom { path, .. }
        | Mutation::Remove { path } => {
            // The step renames the new content over the file or removes it.
            let before = capture_file(host, backups, path, Keep::Link)?;
            let created_dirs = match m {
                Mutation::Write { .. } | Mutation::WriteFrom { .. } => {
                    host.root.missing_dirs(path)?
                }
                _ => Vec::new(),
            };
            Ok(Preimage::File {
                path: path.clone(),
                before,
                created_dirs,
            })
        }
        Mutation::SysctlLive { path, .. } => {
            let before = host.root.read_special(path)?.unwrap_or_default();
            Ok(Preimage::Sysctl {
                path: path.clone(),
                before: before.trim_end().to_string(),
            })
        }
        Mutation::UnitFile { unit, op } => {
            let services = host
                .services()
                .ok_or_else(inplace_plan::kinds::services_off)?;
            let mut call = ServiceCall::within(STEP_BUS_WINDOW);
            let before = services.unit_file_state(unit, &mut call)?;
            Ok(Preimage::UnitFile {
                unit: unit.clone(),
                op: *op,
                before: before.map_or_else(|| "absent".to_string(), |s| s.as_str().to_string()),
            })
        }
        Mutation::UnitRun { unit, .. } => {
            let services = host
                .services()
                .ok_or_else(inplace_plan::kinds::services_off)?;
            let mut call = ServiceCall::within(STEP_BUS_WINDOW);
            let state = services.unit_state(unit, &mut call)?;
            Ok(Preimage::UnitActive {
                unit: unit.clone(),
                before: UnitBefore::of(&state),
            })
        }
        Mutation::Package(p) => package::capture(host, p),
        Mutation::KubeadmUpgradeNode(_) => kubeadm::capture(host, backups),
        // A command cannot be undone; its pre-image says so, and rollback passes over it.
        Mutation::Run { .. } => Ok(Preimage::Other {
            kind: RUN_PREIMAGE_KIND.to_string(),
            data: serde_json::json!({"target": m.target()}),
        }),
    }
}

/// Whether `m`'s pre-image is a file's ([`capture_file`]: read, hashed and stored, with
/// nothing else asked of the node), so it may be captured beside other files'.
pub fn captures_a_file(m: &Mutation) -> bool {
    matches!(
        m,
        Mutation::Write { .. } | Mutation::WriteFrom { .. } | Mutation::Remove { .. }
    )
}

/// Files up to this size are backed up from memory; larger ones (binaries) are streamed.
const STREAM_ABOVE: u64 = 1 << 20;

/// How a file's pre-image goes into the backup store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// A copy of its bytes.
    Copy,
    /// The file itself, hard-linked into the store, when it can be ([`BlobBatch::link`]);
    /// a copy otherwise. Only for a file that the step replaces by a rename or removes and
    /// that nothing writes in place before then.
    Link,
}

/// The state of the file at `path`, its content stored in the backup store (durable once
/// `backups` is synced) as `keep` says.
pub(crate) fn capture_file(
    host: &Host,
    backups: &BlobBatch<'_>,
    path: &NodePath,
    keep: Keep,
) -> Result<FileBefore, StepError> {
    let Some((mut file, meta, size)) = host.root.open_file(path)? else {
        return Ok(FileBefore::Absent);
    };
    let read_err = |source| FsError::Io {
        op: "read",
        path: path.to_string(),
        source,
    };
    // Kept by a link only when it has no other name and no process has it open for
    // writing: once the step has replaced it, nothing but the store can reach it. Linked
    // before it is read: one that cannot be (another mount) is read once, to be copied.
    let linkable = match keep {
        Keep::Link => rustix::fs::fstat(&file)
            .ok()
            .filter(|st| st.st_nlink == 1)
            .filter(|_| inplace_base::open_for_writing(&file) == Some(false)),
        Keep::Copy => None,
    };
    let linked = match linkable {
        Some(seen) => backups.link(&file).map(|l| l.map(|l| (l, seen))),
        None => Ok(None),
    };
    let stored = match (linked, size <= STREAM_ABOVE) {
        (Err(e), _) => Err(e),
        (Ok(Some((linked, seen))), small) => {
            let (sha, content) = if small {
                let content = crate::host::fs::read_sized(&file, size).map_err(read_err)?;
                (
                    hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&content)),
                    Some(content),
                )
            } else {
                let (sha, _) = crate::host::download::hash_reader(&mut file).map_err(read_err)?;
                (sha, None)
            };
            match (backups.keep(linked, &file, &sha, &seen), content) {
                (true, _) => Ok(sha),
                (false, Some(content)) => backups.put_hashed(&content, sha),
                (false, None) => {
                    // Changed while it was read: copied as it is now.
                    use std::io::Seek;
                    file.rewind().map_err(read_err)?;
                    backups.put_reader(&mut file)
                }
            }
        }
        (Ok(None), true) => {
            let content = crate::host::fs::read_sized(&file, size).map_err(read_err)?;
            backups.put(&content)
        }
        (Ok(None), false) => backups.put_reader(&mut file),
    };
    // The step names the change; the detail says which file was being backed up.
    let sha256 = stored.map_err(|e| {
        let e = StepError::from(e);
        StepError::new(e.kind, format!("backing up {path}: {}", e.detail))
    })?;
    Ok(FileBefore::Present { sha256, meta })
}

/// Performs one mutation. `note` hears what a long one is doing (lock waits, commands);
/// the result is the bounded output of the commands it ran, for the journal.
pub fn execute(
    host: &Host,
    m: &Mutation,
    note: &mut dyn FnMut(Note),
) -> Result<Option<String>, StepError> {
    match m {
        Mutation::Write {
            path,
            content,
            meta,
        } => host.root.write_atomic(path, content, *meta)?,
        Mutation::Remove { path } => {
            host.root.remove(path)?;
        }
        Mutation::SysctlLive { path, value } => host
            .root
            .write_special(path, format!("{value}\n").as_bytes())?,
        Mutation::UnitFile { unit, op } => unit_file_op(host, unit, *op)?,
        // Carried out in the Restarting phase, after the daemon-reload.
        Mutation::UnitRun { .. } => {}
        Mutation::WriteFrom {
            path,
            source,
            sha256,
            meta,
        } => artifact::install(host, path, source, sha256, *meta)?,
        Mutation::Package(p) => return package::execute(host, p, note).map(Some),
        Mutation::KubeadmUpgradeNode(k) => return kubeadm::execute(host, k, note).map(Some),
        Mutation::Run { argv, timeout } => return run(host, argv, *timeout, note).map(Some),
    }
    Ok(None)
}

/// Enables, disables, masks or unmasks a unit file; enabling a unit without an `[Install]`
/// section is an error (systemd would silently do nothing).
fn unit_file_op(host: &Host, unit: &str, op: UnitFileOp) -> Result<(), StepError> {
    let services = host
        .services()
        .ok_or_else(inplace_plan::kinds::services_off)?;
    let mut call = ServiceCall::within(STEP_BUS_WINDOW);
    let changes = services.unit_file(op, unit, &mut call)?;
    if op == UnitFileOp::Enable
        && changes.carries_install_info == Some(false)
        && changes.changes.is_empty()
    {
        return Err(StepError::new(
            ErrorKind::Precondition,
            format!(
                "enable {unit}: its unit file has no [Install] section, so it cannot be enabled"
            ),
        ));
    }
    Ok(())
}

/// Puts a pre-image back (idempotent: restoring twice is the same as once).
pub fn restore(
    host: &Host,
    backups: &BackupStore,
    p: &Preimage,
    note: &mut dyn FnMut(Note),
) -> Result<(), StepError> {
    match p {
        Preimage::File {
            path,
            before,
            created_dirs,
        } => {
            host.root.sweep_temp(path)?;
            restore_file(host, backups, path, before)?;
            for dir in created_dirs.iter().rev() {
                host.root.remove_empty_dir(dir)?;
            }
            Ok(())
        }
        Preimage::Sysctl { path, before } => {
            if !before.is_empty() {
                host.root
                    .write_special(path, format!("{before}\n").as_bytes())?;
            }
            Ok(())
        }
        Preimage::UnitFile { unit, op, .. } => unit_file_op(host, unit, op.inverse()),
        // The engine undoes the start or stop itself (it journaled that job).
        Preimage::UnitActive { .. } => Ok(()),
        Preimage::Other { kind, data } if kind == package::PREIMAGE_KIND => {
            package::restore(host, data, note)
        }
        Preimage::Other { kind, data } if kind == kubeadm::PREIMAGE_KIND => {
            kubeadm::restore(host, backups, data)
        }
        Preimage::Other { kind, .. } if kind == RUN_PREIMAGE_KIND => {
            note(Note::Event(
                "an exec change cannot be undone; rollback goes on without it",
            ));
            Ok(())
        }
        Preimage::Other { kind, .. } => Err(StepError::new(
            ErrorKind::Internal,
            format!("cannot restore {kind} state: this agent does not know that step kind"),
        )),
    }
}

/// Puts one file back as `before` describes it, streaming the content from the backup store
/// (verified as it is read); nothing is written when the file already is that way.
pub(crate) fn restore_file(
    host: &Host,
    backups: &BackupStore,
    path: &NodePath,
    before: &FileBefore,
) -> Result<(), StepError> {
    match before {
        FileBefore::Absent => {
            host.root.remove(path)?;
        }
        FileBefore::Present { sha256, meta } => {
            let same = match host.root.open_file(path)? {
                Some((mut file, m, _)) if m == *meta => {
                    let (sha, _) =
                        crate::host::download::hash_reader(&mut file).map_err(|source| {
                            FsError::Io {
                                op: "read",
                                path: path.to_string(),
                                source,
                            }
                        })?;
                    sha == *sha256
                }
                _ => false,
            };
            if !same {
                let mut content = backups.open(sha256)?;
                host.root.write_atomic_from(path, &mut content, *meta)?;
            }
        }
    }
    Ok(())
}

/// Removes temp files a crash may have left for the targets of `change`.
pub fn sweep(host: &Host, change: &Change) -> Result<(), StepError> {
    for w in change.spec().writes() {
        host.root.sweep_temp(&w.path)?;
    }
    Ok(())
}
