//! The plan: declarative desired state for one node, validated once into these types.
//!
//! A plan file (YAML or JSON, camelCase keys, DESIGN §2) is parsed by [`parse`] into a
//! [`Plan`]; every type here is already valid (absolute normalised paths, decoded content,
//! parsed modes), so the engine never re-checks input. [`Plan::digest`] is a sha256 over a
//! canonical serialisation of this model, independent of the input format.
//!
//! Architecture invariant: nothing in this module does I/O.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod digest;
pub use digest::ContentSums;
pub use hasher::KnownSums;
mod error;
mod hasher;
mod json;
pub mod kinds;
pub mod parse;
mod path;

use std::fmt;
use std::time::Duration;

pub use error::{FieldError, InvalidPlan};
pub use kinds::{
    AbsentChange, ArtifactChange, CLUSTER_CONFIGURATION_RECORD, Change, ChangeKind,
    ControlPlaneGate, DropIn, EtcdTopology, ExecChange, FileChange, KUBEADM_FLAGS_PATH,
    KUBELET_CONFIG_PATH, KUBELET_UNIT, Kind, KubeadmUpgradeNodeChange, KubeletConfigChange,
    KubeletFlagsChange, PackageChange, RebootChange, SysctlChange, UnitChange, UnitState,
    sysctl_conf_path,
};
pub use parse::{
    API_VERSION, Limits, check_unit_name, decode_content, is_dns_subdomain, normalize_kube_version,
    parse_mode, parse_owner, parse_plan, read_plan, read_plan_hashed, sysctl_segments,
    validate_document, validate_document_with_bodies, validate_value,
};
pub use parse::{Cx, ReadPlanError};
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
    /// A kubeadm control-plane node is healthy: API server ready, static pods on the
    /// current manifests, the local etcd member and quorum (`controlPlane`).
    ControlPlane(ControlPlaneGate),
}

impl Probe {
    /// The key used in plan files.
    pub fn key(&self) -> &'static str {
        match self {
            Probe::UnitActive { .. } => "unitActive",
            Probe::HttpGet { .. } => "httpGet",
            Probe::KubeletVersion { .. } => "kubeletVersion",
            Probe::Command { .. } => "command",
            Probe::ControlPlane(_) => "controlPlane",
        }
    }

    /// What is checked, for people.
    pub fn target(&self) -> String {
        match self {
            Probe::UnitActive { name } => name.clone(),
            Probe::HttpGet { url, .. } => url.clone(),
            Probe::KubeletVersion { version } => version.clone(),
            Probe::Command { argv } => argv.join(" "),
            Probe::ControlPlane(g) => g.target(),
        }
    }
}

/// Whether `digest` is written by the first definition (`sha256:<hex>`), as agents before
/// digests v2 journaled and reported it.
pub fn is_v1_digest(digest: &str) -> bool {
    digest.starts_with(digest::V1_PREFIX)
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
            .flat_map(|c| c.spec().set_members())
            .map(|p| p.to_string())
            .collect()
    }

    /// The plan's identity beside its id: sha256 over the canonical serialisation of the
    /// validated model, each file content by its sha256, `v2:sha256:<hex>`. The id is not
    /// part of it: the same desired state under two ids has one digest.
    pub fn digest(&self) -> String {
        digest::digest_v2(self, &ContentSums::of(self))
    }

    /// [`Plan::digest`] from the sums of this plan's contents (`ContentSums::of(self)`).
    pub fn digest_with(&self, sums: &ContentSums) -> String {
        digest::digest_v2(self, sums)
    }

    /// The digest by its first definition, `sha256:<hex>`, over the contents themselves
    /// (as base64): what agents before the second one journaled and report.
    pub fn digest_v1(&self) -> String {
        digest::digest_v1(self)
    }

    /// Whether `digest`, of either definition, is this plan's.
    pub fn has_digest(&self, digest: &str) -> bool {
        if digest.starts_with(digest::V2_PREFIX) {
            digest == self.digest()
        } else {
            digest == self.digest_v1()
        }
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
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/plans");
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
                .join("../../examples/plans")
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
