//! The vocabulary between the kinds and the rest: what a kind's diff asks to change
//! ([`Mutation`]), what it says meanwhile ([`Note`]), and what it knows of the run
//! ([`StepCtx`]). Mutations are carried out, backed up and undone by `steps` for every kind
//! alike (a kind never writes).

use std::path::PathBuf;
use std::time::Duration;

use crate::NodePath;
use inplace_base::FileMeta;
use inplace_base::packages::ManagerKind;
use inplace_base::units::UnitFileOp;

/// The key the mutation and the pre-image of `kubeadm upgrade node` share.
pub const KUBEADM_TARGET: &str = "kubeadm:upgrade-node";

/// One change to the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mutation {
    /// Replace or create a file atomically (creating missing directories).
    Write {
        /// Node path.
        path: NodePath,
        /// New content (shared with the plan, not a copy).
        content: bytes::Bytes,
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
        state: crate::UnitState,
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
    Package(PackageMutation),
    /// Run `kubeadm upgrade node`.
    KubeadmUpgradeNode(UpgradeNode),
    /// Run an `exec` change's command (which cannot be undone).
    Run {
        /// Program and arguments.
        argv: Vec<String>,
        /// Kill it after this long (the plan's step timeout).
        timeout: Duration,
    },
}

/// What a mutation (or the pre-image captured for it) touches, as far as units care: the
/// one input of the engine's rule for reloads and restarts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Touched {
    /// A file at this path (a unit file when it is under a unit directory).
    File(NodePath),
    /// A unit file's enablement or mask.
    UnitFile,
    /// A unit's run state (started or stopped in the Restarting phase).
    UnitRun,
    /// A package (which may ship unit files).
    Package,
    /// A live kernel parameter.
    Sysctl,
    /// What a command did (`kubeadm upgrade node`, an `exec` change).
    Command,
}

impl Mutation {
    /// What it touches.
    pub fn touched(&self) -> Touched {
        match self {
            Mutation::Write { path, .. }
            | Mutation::Remove { path }
            | Mutation::WriteFrom { path, .. } => Touched::File(path.clone()),
            Mutation::UnitFile { .. } => Touched::UnitFile,
            Mutation::UnitRun { .. } => Touched::UnitRun,
            Mutation::Package(_) => Touched::Package,
            Mutation::SysctlLive { .. } => Touched::Sysctl,
            Mutation::KubeadmUpgradeNode(_) | Mutation::Run { .. } => Touched::Command,
        }
    }

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
                    crate::UnitState::Running => "start",
                    crate::UnitState::Stopped => "stop",
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
            Mutation::Run { argv, .. } => format!("run {}", argv.join(" ")),
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
            Mutation::KubeadmUpgradeNode(_) => KUBEADM_TARGET.to_string(),
            Mutation::UnitFile { unit, op } => format!("unit-file:{unit}:{op}"),
            Mutation::UnitRun { unit, .. } => format!("unit-run:{unit}"),
            Mutation::Run { argv, .. } => format!("exec:{}", argv.join(" ")),
        }
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

/// What a package change does to the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageMutation {
    /// The manager doing it.
    pub manager: ManagerKind,
    /// Package name.
    pub name: String,
    /// Install exactly this version; `None` leaves the version alone.
    pub version: Option<String>,
    /// The version installed now, for messages.
    pub from: Option<String>,
    /// Held afterwards or not.
    pub hold: bool,
    /// Time budget of each command and of each lock wait (the plan's step timeout).
    pub timeout: Duration,
}

impl PackageMutation {
    /// "install kubelet 1.31.2-1.1 (was 1.30.4-1.1) and hold it".
    pub fn describe(&self) -> String {
        let hold = if self.hold {
            "hold"
        } else {
            "release the hold"
        };
        match (&self.version, &self.from) {
            (Some(v), Some(from)) => format!("install {} {v} (was {from}), {hold}", self.name),
            (Some(v), None) => format!("install {} {v} (not installed before), {hold}", self.name),
            (None, at) => {
                let at = at
                    .as_ref()
                    .map(|v| format!(" (at {v})"))
                    .unwrap_or_default();
                if self.hold {
                    format!("hold {}{at}", self.name)
                } else {
                    format!("release the hold of {}{at}", self.name)
                }
            }
        }
    }

    /// `package:<name>`, the key its pre-image shares.
    pub fn target(&self) -> String {
        format!("package:{}", self.name)
    }
}

/// Running `kubeadm upgrade node`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeNode {
    /// Arguments after `kubeadm upgrade node`.
    pub args: Vec<String>,
    /// Kill it after this long (the plan's step timeout).
    pub timeout: Duration,
    /// Why it runs, for people.
    pub reason: String,
}

impl UpgradeNode {
    /// The command line.
    pub fn argv(&self) -> Vec<String> {
        let mut argv: Vec<String> = ["kubeadm", "upgrade", "node"].map(String::from).to_vec();
        argv.extend(self.args.iter().cloned());
        argv
    }

    /// `run kubeadm upgrade node (changes[0] changed an input of kubeadm in this run)`.
    pub fn describe(&self) -> String {
        format!("run {} ({})", self.argv().join(" "), self.reason)
    }
}
