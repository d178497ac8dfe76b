//! The change kinds: **one file each, and one registration** (the [`kinds!`] list at the
//! bottom of this file).
//!
//! A kind is a type implementing [`Kind`]: how its body is read and validated, its canonical
//! form (digest, journal), what it is about, the paths it writes, the units it feeds, its
//! disruption class, what it checks on the node before a run, and its diff — what must
//! change on this node, as [`Mutation`]s — computed from what it observes through
//! [`Node`]. A kind never touches the node itself: the node is a trait here, implemented by
//! `steps` over `host`; mutations are carried out (journaled, backed up, undone) by `steps`
//! and the engine for every kind alike. So a kind is pure decisions over observations, and
//! `plan/` still does no I/O.
//!
//! The registration generates [`Change`] (the enum of all kinds), [`ChangeKind`] (their
//! names) and the exhaustive dispatch from one to the other; there is no `match` over kinds
//! anywhere else that a new kind could fall through. The checklist for a new kind is in
//! ARCHITECTURE.md.

use std::fmt;

use serde_json::{Map, Value};

use super::parse::Cx;
use super::{Disruption, NodePath, Owner};
use inplace_base::StepError;

mod absent;
mod api_server_certificate;
mod artifact;
mod certificate;
mod control_plane;
mod drift;
mod exec;
mod file;
mod kubeadm_upgrade_node;
mod kubelet_config;
mod kubelet_flags;
mod mutation;
mod node;
mod package;
mod reboot;
mod sysctl;
mod unit;

pub use absent::AbsentChange;
pub use api_server_certificate::{ApiServerCertificateChange, CERTIFICATES_DIR};
pub use artifact::ArtifactChange;
pub use certificate::{San, desired_sans};
pub use control_plane::{
    CONTROL_PLANE_COMPONENTS, ControlPlaneGate, ETCD_METRICS_DEFAULT, EtcdTopology, check_endpoint,
};
pub use drift::{Difference, differences};
pub use exec::ExecChange;
pub use file::FileChange;
pub use kubeadm_upgrade_node::{CLUSTER_CONFIGURATION_RECORD, KubeadmUpgradeNodeChange, REWRITES};
pub use kubelet_config::{KUBELET_CONFIG_PATH, KubeletConfigChange};
pub use kubelet_flags::{KUBEADM_FLAGS_PATH, KubeletFlagsChange};
pub use mutation::{
    Diff, KUBEADM_TARGET, Mutation, Note, PackageMutation, StepCtx, Touched, UpgradeNode,
};
pub use node::{Node, Packages};
pub use package::PackageChange;
pub use reboot::RebootChange;
pub use sysctl::{SysctlChange, sysctl_conf_path};
pub use unit::{DropIn, UnitChange, UnitState, is_running, is_stopped, is_unit_path, services_off};

/// The kubelet's systemd unit, which the kubelet's configuration, flags and package feed.
pub const KUBELET_UNIT: &str = "kubelet.service";

/// A node path a change writes or removes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The field of the change that names it (`path`, `key`, `dropIn`).
    pub field: &'static str,
    /// The path.
    pub path: NodePath,
    /// The change only appends to it (so other appends to it compose).
    pub append: bool,
    /// The change removes it rather than writing it.
    pub removes: bool,
}

impl Written {
    /// A path the change writes (replaces) through `field`.
    pub fn replaces(field: &'static str, path: NodePath) -> Written {
        Written {
            field,
            path,
            append: false,
            removes: false,
        }
    }
}

/// One change kind. Every method is required: a new kind states each of its facts, and the
/// compiler lists whatever it forgot.
pub trait Kind: fmt::Debug + Send + Sync {
    /// Reads and validates the kind's body `m` (at field path `path`, change `index`),
    /// reporting every problem through `cx`; `None` when there was one.
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self>
    where
        Self: Sized;

    /// The body of the canonical form (every default explicit; a valid body again). With
    /// `bodies` false, large file contents are left empty (the journal keeps them apart).
    fn canonical(&self, bodies: bool) -> Value;

    /// What the change is about, for people: a path, a package, a unit, a key.
    fn target(&self) -> String;

    /// The units restarted when this change changes something (`restartUnits`, the kubelet
    /// for its configuration); never the unit a `unit` change starts or stops itself.
    fn restart_units(&self) -> Vec<String>;

    /// The field that names [`Kind::restart_units`] (`restartUnits`), for messages about
    /// them; `None` when the kind itself implies the units (the kubelet for its config).
    fn restart_field(&self) -> Option<&'static str>;

    /// The units whose inputs this change is: restarted when it changed their files, as the
    /// Restarting phase decides (a `unit` change feeds its own unit).
    fn fed_units(&self) -> Vec<String>;

    /// The unit this change brings to a run state, and that state (`unit` with `state`).
    fn run_state(&self) -> Option<(&str, UnitState)>;

    /// A disruption that does not depend on what the change found (a reboot reboots; an
    /// `exec` change is as disruptive as it declares); `None`: it follows from what it
    /// touched and the units it feeds.
    fn declared_disruption(&self) -> Option<Disruption>;

    /// Whether `other`, earlier in the plan, is an input of this change: when it changed the
    /// node in this run, this change has work to do (`kubeadm upgrade node` after its
    /// package, binary, config or patches changed).
    fn fed_by(&self, other: &Change) -> bool;

    /// The node paths it writes or removes (admission checks them against the allow-list
    /// and against each other; a crash's temp files are swept from them).
    fn writes(&self) -> Vec<Written>;

    /// The packages it installs, removes or holds.
    fn packages(&self) -> Vec<&str>;

    /// How disruptive it is when it changes something, decided before looking at the node.
    fn disruption(&self) -> Disruption;

    /// It cannot be applied without a service manager (units, reboots).
    fn needs_services(&self) -> bool;

    /// Its mutations are only file writes and removals, which the engine announces in
    /// batches with one journal sync.
    fn batchable(&self) -> bool;

    /// The owner of what it writes, resolved against the node's accounts at admission.
    fn owner(&self) -> Option<&Owner>;

    /// What this node lacks for the change, as (field, problem), checked at admission and by
    /// the dry run before anything is recorded (besides what every kind gets: its paths
    /// against the allow-list and each other, its owner against the node's accounts).
    fn preflight(&self, node: &dyn Node) -> Vec<(&'static str, String)>;

    /// Work while the plan prepares, before anything on the node changes (downloads into
    /// the agent's cache); what happened, for people, when there was any.
    fn prepare(
        &self,
        node: &dyn Node,
        note: &mut dyn FnMut(Note),
    ) -> Result<Option<String>, StepError>;

    /// Why a dry run cannot tell whether this would change the node without doing what it
    /// must not do (downloading an archive to look at a member); `None` when it can.
    fn undecided(&self, node: &dyn Node) -> Option<String>;

    /// What must change on this node now, as mutations (none: already in the desired state).
    fn diff(&self, node: &dyn Node, ctx: StepCtx) -> Result<Diff, StepError>;

    /// A choice the plan leaves to the node and the engine journals once (a package version
    /// pattern: the highest matching version offered). `Ok(None)`: nothing to resolve;
    /// `Ok(Some(None))`: nothing offered matches. With `refresh`, lists may be refreshed.
    fn resolve(
        &self,
        node: &dyn Node,
        timeout: std::time::Duration,
        refresh: bool,
        note: &mut dyn FnMut(Note),
    ) -> Result<Option<Option<String>>, StepError>;

    /// This change with a journaled resolution applied (see [`Kind::resolve`]).
    fn resolved(&self, value: &str) -> Option<Change>;

    /// The paths a managed set (`options.prune`) keeps track of for this change: the files it
    /// defines whole.
    fn set_members(&self) -> Vec<NodePath>;
}

/// The registration: each kind, its variant of [`Change`] and [`ChangeKind`], and its key in
/// plan files. Everything that dispatches over kinds is generated from this one list.
macro_rules! kinds {
    ($( $(#[$doc:meta])* $variant:ident($ty:ident) = $key:literal ),+ $(,)?) => {
        /// One entry of `changes[]`.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Change {
            $( $(#[$doc])* $variant($ty), )+
        }

        /// The kind of a change, as named in plan files.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum ChangeKind {
            $( #[doc = concat!("`", $key, "`")] $variant, )+
        }

        impl ChangeKind {
            /// Every kind, in documentation order.
            pub const ALL: &'static [ChangeKind] = &[$(ChangeKind::$variant),+];

            /// The key used in plan files.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ChangeKind::$variant => $key,)+
                }
            }

            /// Reads a body of this kind (see [`Kind::parse`]).
            pub fn parse(
                self,
                cx: &mut Cx<'_>,
                index: usize,
                path: &str,
                m: &Map<String, Value>,
            ) -> Option<Change> {
                match self {
                    $(ChangeKind::$variant => $ty::parse(cx, index, path, m).map(Change::$variant),)+
                }
            }
        }

        impl Change {
            /// The kind of this change.
            pub fn kind(&self) -> ChangeKind {
                match self {
                    $(Change::$variant(_) => ChangeKind::$variant,)+
                }
            }

            /// The kind's facts and decisions for this change.
            pub fn spec(&self) -> &dyn Kind {
                match self {
                    $(Change::$variant(c) => c,)+
                }
            }
        }
    };
}

kinds! {
    /// A file with these bytes, mode and owner.
    File(FileChange) = "file",
    /// A path that must not exist.
    Absent(AbsentChange) = "absent",
    /// A JSON merge patch onto the kubelet configuration.
    KubeletConfig(KubeletConfigChange) = "kubeletConfig",
    /// Flags in `KUBELET_KUBEADM_ARGS`.
    KubeletFlags(KubeletFlagsChange) = "kubeletFlags",
    /// A kernel parameter.
    Sysctl(SysctlChange) = "sysctl",
    /// A package at an exact version.
    Package(PackageChange) = "package",
    /// A downloaded binary.
    Artifact(ArtifactChange) = "artifact",
    /// A systemd unit file or drop-in and its state.
    Unit(UnitChange) = "unit",
    /// `kubeadm upgrade node`.
    KubeadmUpgradeNode(KubeadmUpgradeNodeChange) = "kubeadmUpgradeNode",
    /// A reboot, resumed after.
    Reboot(RebootChange) = "reboot",
    /// An escape hatch command (disabled unless the config allows it).
    Exec(ExecChange) = "exec",
    /// The API server's serving certificate carries these names (reissued from the CA).
    ApiServerCertificate(ApiServerCertificateChange) = "apiServerCertificate",
}

impl ChangeKind {
    /// Looks a kind up by its plan-file key.
    pub fn from_key(key: &str) -> Option<ChangeKind> {
        ChangeKind::ALL.iter().copied().find(|k| k.as_str() == key)
    }
}

impl fmt::Display for ChangeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Change {
    /// What the change is about, for people: a path, a package name, a unit, a key.
    pub fn target(&self) -> String {
        self.spec().target()
    }

    /// Units that must be restarted when this change actually changes something.
    pub fn restart_units(&self) -> Vec<String> {
        self.spec().restart_units()
    }
}

/// The earlier changes of `plan` that change `index` is fed by ([`Kind::fed_by`]), pure.
pub fn feeders(plan: &crate::Plan, index: usize) -> Vec<u32> {
    let Some(change) = plan.changes.get(index) else {
        return Vec::new();
    };
    let spec = change.spec();
    plan.changes[..index]
        .iter()
        .enumerate()
        .filter(|(_, c)| spec.fed_by(c))
        .map(|(j, _)| j as u32)
        .collect()
}

/// The first change before `index` that feeds it and for which `changed` says yes (pure).
pub fn inputs_changed(
    plan: &crate::Plan,
    index: usize,
    changed: impl Fn(u32) -> bool,
) -> Option<u32> {
    feeders(plan, index).into_iter().find(|j| changed(*j))
}

/// `{"<key>": <body>}`: a change in its canonical form.
pub fn canonical_change(c: &Change, bodies: bool) -> Value {
    let mut m = Map::new();
    m.insert(c.kind().as_str().into(), c.spec().canonical(bodies));
    Value::Object(m)
}

/// Inserts `key: v` when `v` is set (the canonical form leaves unset options out).
pub fn put_opt<T: serde::Serialize>(m: &mut Map<String, Value>, key: &str, v: &Option<T>) {
    if let Some(v) = v {
        m.insert(key.into(), serde_json::json!(v));
    }
}

/// The disruption of a change that writes `path` and restarts `restart_units`: a restart
/// when it feeds units, a daemon-reload when it is a unit file, otherwise none.
pub fn file_disruption(path: &NodePath, restart_units: &[String]) -> Disruption {
    if !restart_units.is_empty() {
        Disruption::Restart
    } else if is_unit_path(path) {
        Disruption::DaemonReload
    } else {
        Disruption::None
    }
}
