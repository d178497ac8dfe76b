//! Change kinds: for each, what must change on this node (a pure diff of desired against
//! observed) expressed as [`Mutation`]s, which the engine journals, executes and can undo.
//!
//! A step never writes directly: `diff` reads the node and returns mutations, `capture`
//! records the pre-image of a mutation's target in the backup store, `execute` performs it,
//! `restore` puts a pre-image back. This keeps every kind crash-safe and reversible in the
//! same way.

pub mod artifact;
pub mod file;
pub mod kubeadm;
pub mod kubelet;
pub mod package;
pub mod sysctl;
pub mod unit;
pub mod verify;

use crate::base::FileMeta;
use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use crate::base::ErrorKind;
use crate::host::fs::FsError;
use crate::host::systemd::{SystemdError, UnitBefore, UnitFileOp};
use crate::host::users::Accounts;
use crate::host::{Host, STEP_BUS_WINDOW, ServiceCall};
use crate::journal::backup::{BackupError, BackupStore};
use crate::journal::{FileBefore, Preimage};
use crate::plan::{Change, ChangeKind, Disruption, FieldError, NodePath, Plan};

/// One change to the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mutation {
    /// Replace or create a file atomically (creating missing directories).
    Write {
        /// Node path.
        path: NodePath,
        /// New content.
        content: Vec<u8>,
        /// New mode and owner.
        meta: FileMeta,
    },
    /// Remove a file.
    Remove {
        /// Node path.
        path: NodePath,
    },
    /// Write a value to a `/proc/sys` file.
    SysctlLive {
        /// The `/proc/sys/...` node path.
        path: NodePath,
        /// The value.
        value: String,
    },
    /// Enable, disable, mask or unmask a unit file through systemd.
    UnitFile {
        /// The unit.
        unit: String,
        /// What to do.
        op: UnitFileOp,
    },
    /// Bring a unit to a run state. Recorded with its change (which is then changed); the
    /// start or stop itself happens in the Restarting phase, after the daemon-reload.
    UnitRun {
        /// The unit.
        unit: String,
        /// Running or stopped.
        state: crate::plan::UnitState,
    },
    /// Replace or create a file atomically with content streamed from a verified file on the
    /// agent's side (an artifact in the download cache), so binaries are never held in
    /// memory. Backed up and restored like [`Mutation::Write`].
    WriteFrom {
        /// Node path.
        path: NodePath,
        /// The file to copy, on the agent's filesystem.
        source: PathBuf,
        /// The sha256 the copied content must have (checked while copying, before the rename).
        sha256: String,
        /// New mode and owner.
        meta: FileMeta,
    },
    /// Bring a package to a version and hold state.
    Package(package::PackageMutation),
    /// Run `kubeadm upgrade node`.
    KubeadmUpgradeNode(kubeadm::UpgradeNode),
}

impl Mutation {
    /// For people: "write /etc/x (12 bytes, 0644 0:0)".
    pub fn describe(&self) -> String {
        match self {
            Mutation::Write {
                path,
                content,
                meta,
            } => format!(
                "write {path} ({} bytes, {:04o} {}:{})",
                content.len(),
                meta.mode,
                meta.uid,
                meta.gid
            ),
            Mutation::Remove { path } => format!("remove {path}"),
            Mutation::SysctlLive { path, value } => format!("set {path} = {value}"),
            Mutation::UnitFile { unit, op } => format!("{op} {unit}"),
            Mutation::UnitRun { unit, state } => format!(
                "{} {unit} (after the daemon-reload)",
                match state {
                    crate::plan::UnitState::Running => "start",
                    crate::plan::UnitState::Stopped => "stop",
                }
            ),
            Mutation::WriteFrom {
                path, sha256, meta, ..
            } => format!(
                "write {path} from the artifact cache (sha256 {}, {:04o} {}:{})",
                &sha256[..sha256.len().min(12)],
                meta.mode,
                meta.uid,
                meta.gid
            ),
            Mutation::Package(p) => p.describe(),
            Mutation::KubeadmUpgradeNode(k) => k.describe(),
        }
    }

    /// What the mutation changes, as a key its pre-image shares (see [`preimage_target`]).
    pub fn target(&self) -> String {
        match self {
            Mutation::Write { path, .. }
            | Mutation::Remove { path }
            | Mutation::WriteFrom { path, .. }
            | Mutation::SysctlLive { path, .. } => path.to_string(),
            Mutation::Package(p) => p.target(),
            Mutation::KubeadmUpgradeNode(_) => kubeadm::TARGET.to_string(),
            Mutation::UnitFile { unit, op } => format!("unit-file:{unit}:{op}"),
            Mutation::UnitRun { unit, .. } => format!("unit-run:{unit}"),
        }
    }
}

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

/// What a step says while it works (waiting for a lock, downloading, retrying).
#[derive(Debug, Clone, Copy)]
pub enum Note<'a> {
    /// Where it is ("downloading ...: 12 of 90 MiB"): the plan's status message only.
    Status(&'a str),
    /// Something a person watching should see as it happens ("waiting for the dpkg lock,
    /// held by PID 4242"): the status message, and an event to watchers.
    Event(&'a str),
}

/// What a change needs on this node now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    /// Mutations in order; empty when the node is already in the desired state.
    pub mutations: Vec<Mutation>,
    /// Something worth saying about it ("persisted only: no /proc/sys").
    pub note: Option<String>,
}

/// A step failure with a bounded kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct StepError {
    /// Classification.
    pub kind: ErrorKind,
    /// What failed on what.
    pub detail: String,
}

impl StepError {
    /// A new error.
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> StepError {
        StepError {
            kind,
            detail: detail.into(),
        }
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
    /// The kinds implemented by this build.
    pub kinds: Vec<ChangeKind>,
}

impl Capabilities {
    /// The kinds this build implements.
    pub fn implemented() -> Vec<ChangeKind> {
        vec![
            ChangeKind::File,
            ChangeKind::Absent,
            ChangeKind::KubeletConfig,
            ChangeKind::KubeletFlags,
            ChangeKind::Sysctl,
            ChangeKind::Unit,
            ChangeKind::Reboot,
            ChangeKind::Package,
            ChangeKind::Artifact,
            ChangeKind::KubeadmUpgradeNode,
        ]
    }

    /// Why this node cannot apply `change`, or `None` when it can.
    pub fn unsupported(&self, change: &Change) -> Option<String> {
        let kind = change.kind();
        if kind == ChangeKind::Exec && !self.exec_allowed {
            return Some(
                "exec changes are disabled on this node (set exec.allow = true in the agent \
                 configuration)"
                    .into(),
            );
        }
        if !self.kinds.contains(&kind) {
            return Some(format!(
                "{kind} changes are not supported by this agent yet"
            ));
        }
        None
    }

    /// Why this node cannot run a gate, or `None` when it can.
    pub fn unsupported_check(&self, probe: &crate::plan::Probe) -> Option<String> {
        verify::unsupported(probe)
    }
}

/// True for changes that cannot be applied without a service manager (units, reboots).
pub fn needs_services(change: &Change) -> bool {
    matches!(change, Change::Unit(_) | Change::Reboot(_))
}

/// Why `change` cannot be applied on a node whose agent has service management off, or
/// `None` when it can (restarts are then journaled as skipped, not refused).
pub fn unsupported_without_services(change: &Change) -> Option<String> {
    needs_services(change).then(|| {
        format!(
            "{} changes need service management, which is off on this agent (--services off)",
            change.kind()
        )
    })
}

/// True for kinds whose mutations are only file writes and removals, which the engine may
/// announce in batches with one journal sync.
pub fn batchable(change: &Change) -> bool {
    matches!(
        change,
        Change::File(_)
            | Change::Absent(_)
            | Change::KubeletConfig(_)
            | Change::KubeletFlags(_)
            | Change::Artifact(_)
    )
}

/// Disruption of a change when it changes something (before looking at the node): a reboot
/// reboots; a unit change that sets content, a drop-in or a run state restarts (or starts or
/// stops) its unit, one that only enables or masks reloads systemd; a change that feeds units
/// restarts them; a file under a unit directory reloads systemd.
pub fn disruption(change: &Change) -> Disruption {
    match change {
        Change::Reboot(_) => Disruption::Reboot,
        Change::Exec(e) => e.disruption,
        Change::Unit(u) => {
            if u.content.is_some() || u.drop_in.is_some() || u.state.is_some() {
                Disruption::Restart
            } else {
                Disruption::DaemonReload
            }
        }
        c if !c.restart_units().is_empty() => Disruption::Restart,
        Change::File(f) if unit::is_unit_path(&f.path) => Disruption::DaemonReload,
        Change::Absent(a) if unit::is_unit_path(&a.path) => Disruption::DaemonReload,
        _ => Disruption::None,
    }
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

/// What a step needs to know about the node besides its own change.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepCtx {
    /// The change's resolved owner, for changes with one.
    pub ids: Option<(u32, u32)>,
    /// The node's `root:root`, for files the agent creates on its own.
    pub root_ids: (u32, u32),
    /// The plan's time budget of one step (commands the step runs get it).
    pub step_timeout: Duration,
    /// For `kubeadmUpgradeNode`: the earlier change of the plan that feeds kubeadm and
    /// changed the node in this run (or would, in a dry run), if any. Set by the engine.
    pub inputs_changed: Option<u32>,
}

/// Checks a plan against this node (owners exist, paths do not escape through symlinks,
/// the kubelet files are usable) without changing anything. Errors name the field.
pub fn preflight(host: &Host, plan: &Plan) -> Result<Prepared, Vec<FieldError>> {
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
        let mut ids = None;
        // What is at the path when it is neither absent nor a regular file.
        let mut check_path = |field: &str, p: &NodePath, errors: &mut Vec<FieldError>| match host
            .root
            .check_path_in(p, &mut dirs)
        {
            Ok(kind) => kind,
            Err(e) => {
                errors.push(FieldError::new(format!("{base}.{field}"), e.to_string()));
                None
            }
        };
        match change {
            Change::File(f) => {
                let other = check_path("path", &f.path, &mut errors);
                match accounts.resolve(&f.owner) {
                    Ok(resolved) => ids = Some(resolved),
                    Err(e) => errors.push(FieldError::new(format!("{base}.owner"), e)),
                }
                if let Some(kind) = other {
                    errors.push(FieldError::new(
                        format!("{base}.path"),
                        format!("{} is a {kind} on the node, not a regular file", f.path),
                    ));
                }
            }
            Change::Absent(a) => {
                if let Some(kind) = check_path("path", &a.path, &mut errors) {
                    errors.push(FieldError::new(
                        format!("{base}.path"),
                        format!(
                            "{} is a {kind} on the node; absent removes files only",
                            a.path
                        ),
                    ));
                }
            }
            Change::KubeletConfig(_) => {
                let p = kubelet::config_path();
                check_path("mergePatch", &p, &mut errors);
                if let Err(e) = kubelet::read_config(host) {
                    errors.push(FieldError::new(format!("{base}.mergePatch"), e.detail));
                }
            }
            Change::KubeletFlags(_) => {
                check_path("set", &kubelet::flags_path(), &mut errors);
            }
            Change::Unit(u) => {
                if u.content.is_some()
                    && let Some(p) = unit::unit_file_path(&u.name)
                {
                    check_path("name", &p, &mut errors);
                }
                if let Some(p) = u
                    .drop_in
                    .as_ref()
                    .and_then(|d| unit::drop_in_path(&u.name, &d.name))
                {
                    check_path("dropIn", &p, &mut errors);
                }
            }
            Change::Sysctl(s) => {
                if let Err(e) = sysctl::preflight(host, s) {
                    errors.push(FieldError::new(format!("{base}.key"), e));
                }
                if let Ok(p) = sysctl::conf_path(&s.key) {
                    check_path("key", &p, &mut errors);
                }
            }
            Change::Package(p) => {
                for (field, e) in package::preflight(host, p) {
                    errors.push(FieldError::new(format!("{base}.{field}"), e));
                }
            }
            Change::Artifact(a) => {
                check_path("path", &a.path, &mut errors);
                // Opened, not read: the file there may be a large binary.
                if let Err(FsError::NotAFile { kind, .. }) = host.root.open_file(&a.path) {
                    errors.push(FieldError::new(
                        format!("{base}.path"),
                        format!("{} is a {kind} on the node, not a regular file", a.path),
                    ));
                }
            }
            _ => {}
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

/// The node paths a change writes or removes, with the field that names them and whether
/// it only appends.
pub fn written_paths(change: &Change) -> Vec<(&'static str, NodePath, bool)> {
    match change {
        Change::File(f) => vec![("path", f.path.clone(), f.append)],
        Change::Absent(a) => vec![("path", a.path.clone(), false)],
        Change::KubeletConfig(_) => vec![("mergePatch", kubelet::config_path(), false)],
        Change::KubeletFlags(_) => vec![("set", kubelet::flags_path(), false)],
        Change::Sysctl(s) => sysctl::conf_path(&s.key)
            .into_iter()
            .map(|p| ("key", p, false))
            .collect(),
        Change::Unit(u) => unit::paths(u)
            .into_iter()
            .map(|p| ("name", p, false))
            .collect(),
        Change::Artifact(a) => vec![("path", a.path.clone(), false)],
        _ => Vec::new(),
    }
}

/// Units the plan restarts, starts or gates on that this node does not have and no change
/// of the plan creates: applying would end in a failed restart, a failed gate and a rollback
/// that restarts a unit that does not exist. Asked of systemd only when it answers at once;
/// a plan with a package change is not checked (packages ship units).
fn missing_units(host: &Host, plan: &Plan) -> Vec<FieldError> {
    let Some(services) = host.services() else {
        return Vec::new();
    };
    if plan.changes.iter().any(|c| matches!(c, Change::Package(_))) {
        return Vec::new();
    }
    let created: std::collections::BTreeSet<&str> = plan
        .changes
        .iter()
        .flat_map(|c| match c {
            Change::Unit(u) if u.content.is_some() => vec![u.name.as_str()],
            Change::File(f) if unit::is_unit_path(&f.path) => vec![f.path.file_name()],
            _ => Vec::new(),
        })
        .collect();
    let mut referenced: Vec<(String, String)> = Vec::new();
    for (i, c) in plan.changes.iter().enumerate() {
        let field = match c {
            Change::File(_) | Change::Absent(_) | Change::Artifact(_) => "restartUnits",
            Change::Unit(_) => "name",
            _ => "",
        };
        let base = if field.is_empty() {
            format!("changes[{i}].{}", c.kind())
        } else {
            format!("changes[{i}].{}.{field}", c.kind())
        };
        for unit in c.restart_units() {
            referenced.push((base.clone(), unit));
        }
    }
    for (i, check) in plan.verify.iter().enumerate() {
        if let crate::plan::Probe::UnitActive { name } = &check.probe {
            referenced.push((format!("verify[{i}].unitActive.name"), name.clone()));
        }
    }
    referenced.retain(|(_, unit)| !created.contains(unit.as_str()));
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

/// What `change` needs on this node now.
pub fn diff(host: &Host, change: &Change, ctx: StepCtx) -> Result<Diff, StepError> {
    match change {
        Change::File(f) => file::diff_file(host, f, ctx.ids.unwrap_or(ctx.root_ids)),
        Change::Absent(a) => file::diff_absent(host, a),
        Change::KubeletConfig(k) => kubelet::diff_config(host, k),
        Change::KubeletFlags(k) => kubelet::diff_flags(host, k, ctx.root_ids),
        Change::Sysctl(s) => sysctl::diff(host, s, ctx.root_ids),
        Change::Unit(u) => unit::diff(host, u, ctx.root_ids),
        Change::Package(p) => package::diff(host, p, ctx),
        Change::Artifact(a) => artifact::diff(host, a, ctx),
        Change::KubeadmUpgradeNode(k) => kubeadm::diff(host, k, ctx),
        other => Err(StepError::new(
            ErrorKind::Unsupported,
            format!(
                "{} changes are not supported by this agent yet",
                other.kind()
            ),
        )),
    }
}

/// Why a dry run cannot tell whether `change` would change the node without doing work it
/// must not do (downloading an archive to look at a member); `None` when it can.
pub fn undecided(host: &Host, change: &Change) -> Option<String> {
    match change {
        Change::Artifact(a) => artifact::undecided(host, a),
        _ => None,
    }
}

/// Records what `m`'s target looks like now, storing file content in the backup store.
pub fn capture(host: &Host, backups: &BackupStore, m: &Mutation) -> Result<Preimage, StepError> {
    match m {
        Mutation::Write { path, .. }
        | Mutation::WriteFrom { path, .. }
        | Mutation::Remove { path } => {
            let before = capture_file(host, backups, path)?;
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
            let services = host.services().ok_or_else(unit::services_off)?;
            let mut call = ServiceCall::within(STEP_BUS_WINDOW);
            let before = services.unit_file_state(unit, &mut call)?;
            Ok(Preimage::UnitFile {
                unit: unit.clone(),
                op: *op,
                before: before.map_or_else(|| "absent".to_string(), |s| s.as_str().to_string()),
            })
        }
        Mutation::UnitRun { unit, .. } => {
            let services = host.services().ok_or_else(unit::services_off)?;
            let mut call = ServiceCall::within(STEP_BUS_WINDOW);
            let state = services.unit_state(unit, &mut call)?;
            Ok(Preimage::UnitActive {
                unit: unit.clone(),
                before: UnitBefore::of(&state),
            })
        }
        Mutation::Package(p) => package::capture(host, p),
        Mutation::KubeadmUpgradeNode(_) => kubeadm::capture(host, backups),
    }
}

/// Files up to this size are backed up from memory; larger ones (binaries) are streamed.
const STREAM_ABOVE: u64 = 1 << 20;

/// The state of the file at `path`, its content stored in the backup store.
pub(crate) fn capture_file(
    host: &Host,
    backups: &BackupStore,
    path: &NodePath,
) -> Result<FileBefore, StepError> {
    let Some((mut file, meta, size)) = host.root.open_file(path)? else {
        return Ok(FileBefore::Absent);
    };
    let sha256 = if size <= STREAM_ABOVE {
        let mut content = Vec::with_capacity(size as usize);
        file.read_to_end(&mut content)
            .map_err(|source| FsError::Io {
                op: "read",
                path: path.to_string(),
                source,
            })?;
        backups.put(&content)?
    } else {
        backups.put_reader(&mut file)?
    };
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
    }
    Ok(None)
}

/// Enables, disables, masks or unmasks a unit file; enabling a unit without an `[Install]`
/// section is an error (systemd would silently do nothing).
fn unit_file_op(host: &Host, unit: &str, op: UnitFileOp) -> Result<(), StepError> {
    let services = host.services().ok_or_else(unit::services_off)?;
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
    for (_, p, _) in written_paths(change) {
        host.root.sweep_temp(&p)?;
    }
    Ok(())
}
