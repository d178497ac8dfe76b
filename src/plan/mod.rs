//! The plan: declarative desired state for one node, validated once into these types.
//!
//! A plan file (YAML or JSON, camelCase keys, DESIGN §2) is parsed by [`parse`] into a
//! [`Plan`]; every type here is already valid (absolute normalised paths, decoded content,
//! parsed modes), so the engine never re-checks input. [`Plan::digest`] is a sha256 over a
//! canonical serialisation of this model, independent of the input format.
//!
//! Architecture invariant: nothing in this module does I/O.

mod digest;
mod error;
mod parse;
mod path;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

pub use error::{FieldError, InvalidPlan};
pub use parse::{
    API_VERSION, Limits, check_unit_name, decode_content, is_dns_subdomain, normalize_kube_version,
    parse_mode, parse_owner, parse_plan, sysctl_segments, validate_value,
};
pub use path::{AllowList, NodePath, PathError};

/// One validated plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Updater-chosen identifier (`<namespace>/<machine>@<hash>`); id + digest identify the work.
    pub id: String,
    /// The node this plan is for; `serve` refuses plans for other nodes.
    pub node_name: Option<String>,
    /// Run options.
    pub options: PlanOptions,
    /// Desired state, in order.
    pub changes: Vec<Change>,
    /// Health gates run after the changes.
    pub verify: Vec<Check>,
}

/// Options of a plan run.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// Restore what the plan changed when a step or gate fails (default true).
    pub rollback_on_failure: bool,
    /// Overall time budget of one attempt (default 900 s).
    pub timeout: Duration,
    /// Time budget of one step (default 300 s).
    pub step_timeout: Duration,
    /// The managed set this plan's `file` paths belong to (`prune: {set: NAME}`): paths an
    /// earlier plan of the set wrote and this one does not list are removed.
    pub prune: Option<String>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            rollback_on_failure: true,
            timeout: Duration::from_secs(900),
            step_timeout: Duration::from_secs(300),
            prune: None,
        }
    }
}

/// One entry of `changes[]`.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A file with these bytes, mode and owner.
    File(FileChange),
    /// A path that must not exist.
    Absent(AbsentChange),
    /// A JSON merge patch onto the kubelet configuration.
    KubeletConfig(KubeletConfigChange),
    /// Flags in `KUBELET_KUBEADM_ARGS`.
    KubeletFlags(KubeletFlagsChange),
    /// A kernel parameter.
    Sysctl(SysctlChange),
    /// A package at an exact version.
    Package(PackageChange),
    /// A downloaded binary.
    Artifact(ArtifactChange),
    /// A systemd unit file or drop-in and its state.
    Unit(UnitChange),
    /// `kubeadm upgrade node`.
    KubeadmUpgradeNode(KubeadmUpgradeNodeChange),
    /// A reboot, resumed after.
    Reboot(RebootChange),
    /// An escape hatch command (disabled unless the config allows it).
    Exec(ExecChange),
}

/// The kind of a change, as named in plan files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChangeKind {
    /// `file`
    File,
    /// `absent`
    Absent,
    /// `kubeletConfig`
    KubeletConfig,
    /// `kubeletFlags`
    KubeletFlags,
    /// `sysctl`
    Sysctl,
    /// `package`
    Package,
    /// `artifact`
    Artifact,
    /// `unit`
    Unit,
    /// `kubeadmUpgradeNode`
    KubeadmUpgradeNode,
    /// `reboot`
    Reboot,
    /// `exec`
    Exec,
}

impl ChangeKind {
    /// Every kind, in documentation order.
    pub const ALL: [ChangeKind; 11] = [
        ChangeKind::File,
        ChangeKind::Absent,
        ChangeKind::KubeletConfig,
        ChangeKind::KubeletFlags,
        ChangeKind::Sysctl,
        ChangeKind::Package,
        ChangeKind::Artifact,
        ChangeKind::Unit,
        ChangeKind::KubeadmUpgradeNode,
        ChangeKind::Reboot,
        ChangeKind::Exec,
    ];

    /// The key used in plan files.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::File => "file",
            ChangeKind::Absent => "absent",
            ChangeKind::KubeletConfig => "kubeletConfig",
            ChangeKind::KubeletFlags => "kubeletFlags",
            ChangeKind::Sysctl => "sysctl",
            ChangeKind::Package => "package",
            ChangeKind::Artifact => "artifact",
            ChangeKind::Unit => "unit",
            ChangeKind::KubeadmUpgradeNode => "kubeadmUpgradeNode",
            ChangeKind::Reboot => "reboot",
            ChangeKind::Exec => "exec",
        }
    }

    /// Looks a kind up by its plan-file key.
    pub fn from_key(key: &str) -> Option<ChangeKind> {
        ChangeKind::ALL.into_iter().find(|k| k.as_str() == key)
    }
}

impl fmt::Display for ChangeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Change {
    /// The kind of this change.
    pub fn kind(&self) -> ChangeKind {
        match self {
            Change::File(_) => ChangeKind::File,
            Change::Absent(_) => ChangeKind::Absent,
            Change::KubeletConfig(_) => ChangeKind::KubeletConfig,
            Change::KubeletFlags(_) => ChangeKind::KubeletFlags,
            Change::Sysctl(_) => ChangeKind::Sysctl,
            Change::Package(_) => ChangeKind::Package,
            Change::Artifact(_) => ChangeKind::Artifact,
            Change::Unit(_) => ChangeKind::Unit,
            Change::KubeadmUpgradeNode(_) => ChangeKind::KubeadmUpgradeNode,
            Change::Reboot(_) => ChangeKind::Reboot,
            Change::Exec(_) => ChangeKind::Exec,
        }
    }

    /// What the change is about, for people: a path, a package name, a unit, a key.
    pub fn target(&self) -> String {
        match self {
            Change::File(c) => c.path.to_string(),
            Change::Absent(c) => c.path.to_string(),
            Change::KubeletConfig(_) => KUBELET_CONFIG_PATH.to_string(),
            Change::KubeletFlags(_) => KUBEADM_FLAGS_PATH.to_string(),
            Change::Sysctl(c) => c.key.clone(),
            Change::Package(c) => format!("{}={}", c.name, c.version),
            Change::Artifact(c) => c.path.to_string(),
            Change::Unit(c) => match &c.drop_in {
                Some(d) => format!("{}.d/{}", c.name, d.name),
                None => c.name.clone(),
            },
            Change::KubeadmUpgradeNode(_) => "kubeadm upgrade node".to_string(),
            Change::Reboot(c) => c.reason.clone(),
            Change::Exec(c) => c.argv.join(" "),
        }
    }

    /// Units that must be restarted when this change actually changes something.
    pub fn restart_units(&self) -> Vec<String> {
        match self {
            Change::File(c) => c.restart_units.clone(),
            Change::Absent(c) => c.restart_units.clone(),
            Change::Artifact(c) => c.restart_units.clone(),
            Change::KubeletConfig(_) | Change::KubeletFlags(_) => {
                vec![KUBELET_UNIT.to_string()]
            }
            Change::KubeadmUpgradeNode(_) => vec![KUBELET_UNIT.to_string()],
            Change::Package(c) if c.name == "kubelet" => vec![KUBELET_UNIT.to_string()],
            Change::Unit(c) if c.state != Some(UnitState::Stopped) => vec![c.name.clone()],
            _ => Vec::new(),
        }
    }
}

/// Where kubeadm keeps the kubelet configuration.
pub const KUBELET_CONFIG_PATH: &str = "/var/lib/kubelet/config.yaml";
/// Where kubeadm keeps the kubelet's command-line flags.
pub const KUBEADM_FLAGS_PATH: &str = "/var/lib/kubelet/kubeadm-flags.env";
/// The kubelet's systemd unit.
pub const KUBELET_UNIT: &str = "kubelet.service";

/// The file that persists a `sysctl` change (`net.ipv4.ip_forward` →
/// `/etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf`).
pub fn sysctl_conf_path(key: &str) -> Result<NodePath, String> {
    let name = key.replace('/', ".");
    NodePath::parse(&format!("/etc/sysctl.d/90-inplace-agent-{name}.conf"))
        .map_err(|e| e.to_string())
}

/// How inline content is encoded in the plan file (CAPI `files[].encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// The content is the text itself.
    Plain,
    /// Base64 of the bytes.
    Base64,
    /// Gzip of the bytes (only usable from JSON/YAML as a binary-safe string; rare).
    Gzip,
    /// Base64 of the gzip of the bytes.
    GzipBase64,
}

/// A user/group pair resolved later against the node's /etc/passwd and /etc/group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// User name or numeric uid.
    pub user: IdRef,
    /// Group name or numeric gid; `None` means the user's primary group.
    pub group: Option<IdRef>,
}

impl Default for Owner {
    /// `root:root`, resolved against the node's accounts like any other name.
    fn default() -> Self {
        Owner {
            user: IdRef::Name("root".into()),
            group: Some(IdRef::Name("root".into())),
        }
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.group {
            Some(g) => write!(f, "{}:{}", self.user, g),
            None => write!(f, "{}", self.user),
        }
    }
}

/// A user or group, by name or number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdRef {
    /// A numeric id.
    Id(u32),
    /// A name to look up.
    Name(String),
}

impl fmt::Display for IdRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdRef::Id(n) => write!(f, "{n}"),
            IdRef::Name(s) => f.write_str(s),
        }
    }
}

/// A permission mode (the low 12 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode(pub u32);

impl Mode {
    /// The default mode of files the agent writes.
    pub const FILE_DEFAULT: Mode = Mode(0o644);
    /// The default mode of executables the agent installs.
    pub const EXEC_DEFAULT: Mode = Mode(0o755);
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

/// `file`: a file with these bytes, mode and owner.
#[derive(Debug, Clone, PartialEq)]
pub struct FileChange {
    /// Absolute path on the node.
    pub path: NodePath,
    /// The decoded bytes (the encoding is undone at validation).
    pub content: Vec<u8>,
    /// Permission bits (default 0644).
    pub mode: Mode,
    /// Owner (default root:root).
    pub owner: Owner,
    /// Append `content` unless the file already contains it, instead of replacing the file.
    pub append: bool,
    /// Units restarted when this file changes.
    pub restart_units: Vec<String>,
}

/// `absent`: a path that must not exist.
#[derive(Debug, Clone, PartialEq)]
pub struct AbsentChange {
    /// Absolute path on the node.
    pub path: NodePath,
    /// Units restarted when the file is removed.
    pub restart_units: Vec<String>,
}

/// `kubeletConfig`: an RFC 7386 merge patch onto `/var/lib/kubelet/config.yaml`.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeletConfigChange {
    /// The patch; always a JSON object.
    pub merge_patch: serde_json::Map<String, serde_json::Value>,
}

/// `kubeletFlags`: flags set or removed in `KUBELET_KUBEADM_ARGS`.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeletFlagsChange {
    /// Flag name (without dashes) → value.
    pub set: BTreeMap<String, String>,
    /// Flag names (without dashes) to remove.
    pub remove: Vec<String>,
}

/// `sysctl`: a kernel parameter, persisted and applied live.
#[derive(Debug, Clone, PartialEq)]
pub struct SysctlChange {
    /// Dotted key (`net.ipv4.ip_forward`), or slash-separated when a segment has dots.
    pub key: String,
    /// The value, as `sysctl` would write it.
    pub value: String,
}

/// `package`: a package at an exact version.
#[derive(Debug, Clone, PartialEq)]
pub struct PackageChange {
    /// Package name.
    pub name: String,
    /// Exact version (`1.31.2-1.1`), or a pattern ending in `*` (`1.31.2-*`) that the
    /// engine resolves to the highest available match when the plan prepares.
    pub version: String,
    /// `apt` or `dnf`; detected from the node when absent.
    pub manager: Option<String>,
    /// Hold the package at that version.
    pub hold: bool,
}

/// `artifact`: a binary from a URL, checked against its sha256.
#[derive(Debug, Clone, PartialEq)]
pub struct ArtifactChange {
    /// Where to download from.
    pub url: String,
    /// Expected sha256 of the download (lowercase hex).
    pub sha256: String,
    /// Install path on the node.
    pub path: NodePath,
    /// Permission bits (default 0755).
    pub mode: Mode,
    /// Member of a `.tar.gz` to install instead of the download itself.
    pub extract: Option<String>,
    /// Units restarted when the binary changes.
    pub restart_units: Vec<String>,
}

/// `unit`: a systemd unit file or drop-in and its desired state.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitChange {
    /// Unit name (`containerd.service`).
    pub name: String,
    /// Full unit file content, written to `/etc/systemd/system/<name>`.
    pub content: Option<String>,
    /// A drop-in written to `/etc/systemd/system/<name>.d/<dropIn.name>`.
    pub drop_in: Option<DropIn>,
    /// Enable or disable the unit file; `None` leaves it.
    pub enabled: Option<bool>,
    /// Running or stopped; `None` leaves it.
    pub state: Option<UnitState>,
    /// Mask or unmask; `None` leaves it.
    pub masked: Option<bool>,
}

/// A systemd drop-in file.
#[derive(Debug, Clone, PartialEq)]
pub struct DropIn {
    /// File name, ending in `.conf`.
    pub name: String,
    /// Content.
    pub content: String,
}

/// Desired run state of a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitState {
    /// Active.
    Running,
    /// Inactive.
    Stopped,
}

/// `kubeadmUpgradeNode`: runs `kubeadm upgrade node`.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeadmUpgradeNodeChange {
    /// Extra arguments (for example `--patches DIR`).
    pub extra_args: Vec<String>,
}

/// `reboot`: reboot the node and resume after it.
#[derive(Debug, Clone, PartialEq)]
pub struct RebootChange {
    /// Why, for people and the journal.
    pub reason: String,
}

/// `exec`: run a command (escape hatch; disabled by default).
#[derive(Debug, Clone, PartialEq)]
pub struct ExecChange {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Run only when this command exits non-zero (makes the command idempotent).
    pub unless: Option<Vec<String>>,
    /// Declared disruption of running it.
    pub disruption: Disruption,
}

/// How disruptive a change is to the node's workloads, from least to most.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
pub enum Disruption {
    /// Nothing restarts.
    #[default]
    None,
    /// systemd re-reads unit files.
    DaemonReload,
    /// A unit reloads its configuration.
    Reload,
    /// A unit restarts.
    Restart,
    /// The node reboots.
    Reboot,
}

impl fmt::Display for Disruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Disruption::None => "None",
            Disruption::DaemonReload => "DaemonReload",
            Disruption::Reload => "Reload",
            Disruption::Restart => "Restart",
            Disruption::Reboot => "Reboot",
        })
    }
}

/// One entry of `verify[]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// What to check.
    pub probe: Probe,
    /// Give up after this long (default 60 s).
    pub timeout: Duration,
    /// Try again this often until the timeout (default 2 s).
    pub period: Duration,
}

/// The kinds of health gate.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    /// A systemd unit is active.
    UnitActive {
        /// Unit name.
        name: String,
    },
    /// An HTTP GET answers with the expected status.
    HttpGet {
        /// `http://` or `https://` URL.
        url: String,
        /// Expected status code (default 200).
        expect_status: u16,
    },
    /// `kubelet --version` reports this version.
    KubeletVersion {
        /// `v1.31.2`.
        version: String,
    },
    /// A command exits 0.
    Command {
        /// Program and arguments.
        argv: Vec<String>,
    },
}

impl Probe {
    /// The key used in plan files.
    pub fn key(&self) -> &'static str {
        match self {
            Probe::UnitActive { .. } => "unitActive",
            Probe::HttpGet { .. } => "httpGet",
            Probe::KubeletVersion { .. } => "kubeletVersion",
            Probe::Command { .. } => "command",
        }
    }

    /// What is checked, for people.
    pub fn target(&self) -> String {
        match self {
            Probe::UnitActive { name } => name.clone(),
            Probe::HttpGet { url, .. } => url.clone(),
            Probe::KubeletVersion { version } => version.clone(),
            Probe::Command { argv } => argv.join(" "),
        }
    }
}

impl PackageChange {
    /// The part before the `*` when `version` is a pattern (`1.31.2-*` → `1.31.2-`).
    pub fn version_prefix(&self) -> Option<&str> {
        self.version.strip_suffix('*')
    }
}

/// A managed set name: 1 to 63 of `[a-z0-9-]`, starting and ending alphanumeric.
pub fn is_set_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

impl Plan {
    /// The paths of the plan's `file` changes (the members of its managed set).
    pub fn file_paths(&self) -> Vec<String> {
        self.changes
            .iter()
            .filter_map(|c| match c {
                Change::File(f) => Some(f.path.to_string()),
                _ => None,
            })
            .collect()
    }

    /// sha256 over the canonical serialisation of the validated model, `sha256:<hex>`.
    /// The id is not part of it: the same desired state under two ids has one digest.
    pub fn digest(&self) -> String {
        digest::digest(self)
    }

    /// The canonical plan document: plan-file shape, every default explicit, content as
    /// base64. The journal stores it and [`validate_value`] reads it back into the same plan.
    pub fn canonical_json(&self) -> serde_json::Value {
        digest::canonical_value(self, true)
    }

    /// [`Plan::canonical_json`] with every `file` content empty, as the journal stores a
    /// plan whose bodies it keeps in a blob (`journal::bodies::strip` of the full form).
    pub fn canonical_json_without_bodies(&self) -> serde_json::Value {
        digest::canonical_value(self, false)
    }

    /// Every unit named anywhere in the plan, for restart computation.
    pub fn restart_units(&self) -> Vec<String> {
        let mut units: Vec<String> = self
            .changes
            .iter()
            .flat_map(Change::restart_units)
            .collect();
        units.sort();
        units.dedup();
        units
    }
}

impl serde::Serialize for ChangeKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl schemars::JsonSchema for ChangeKind {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ChangeKind".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let keys: Vec<&str> = ChangeKind::ALL.iter().map(|k| k.as_str()).collect();
        schemars::json_schema!({
            "description": "The kind of a change, as named in plan files.",
            "type": "string",
            "enum": keys,
        })
    }
}

impl<'de> serde::Deserialize<'de> for ChangeKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ChangeKind::from_key(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown change kind {s:?}")))
    }
}

#[cfg(test)]
mod examples {
    use super::*;

    /// Every plan under `examples/plans` validates with the default limits.
    #[test]
    fn every_example_plan_validates() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/plans");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if !matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml" | "json")
            ) {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let name = path.display().to_string();
            if let Err(e) = parse_plan(&bytes, &name, &Limits::default()) {
                panic!("{e}");
            }
            seen += 1;
        }
        assert!(seen >= 4, "found {seen} example plans in {}", dir.display());
    }

    /// The version-bump examples follow the upstream kubeadm order and compute the restart.
    #[test]
    fn upgrade_examples_follow_the_kubeadm_order() {
        for file in ["upgrade-1.30-to-1.31.yaml", "upgrade-1.30-to-1.31-dnf.yaml"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("examples/plans")
                .join(file);
            let plan =
                parse_plan(&std::fs::read(&path).unwrap(), file, &Limits::default()).unwrap();
            let order: Vec<String> = plan
                .changes
                .iter()
                .map(|c| match c {
                    Change::Package(p) => {
                        assert!(p.hold, "{file}: {} is held", p.name);
                        p.name.clone()
                    }
                    other => other.kind().to_string(),
                })
                .collect();
            assert_eq!(
                order,
                ["kubeadm", "kubeadmUpgradeNode", "kubelet", "kubectl"],
                "{file}"
            );
            assert_eq!(plan.restart_units(), [KUBELET_UNIT], "{file}");
            let gates: Vec<&str> = plan.verify.iter().map(|c| c.probe.key()).collect();
            assert_eq!(gates, ["unitActive", "httpGet", "kubeletVersion"], "{file}");
        }
    }
}
