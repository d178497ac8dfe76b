//! Desired Machine + KubeadmConfig → an inplace-agent plan (pure).
//!
//! What becomes what (docs/updater.md has the table for people):
//! - `files[]` → one `file` change each, in order (inline content or the resolved
//!   `contentFrom.secret`, every CAPI encoding, owner, permissions, append); the plan's
//!   `prune: {set: kubeadmconfig-files}` makes the agent remove a file an earlier plan of
//!   the set wrote and this one no longer lists; a user file the Machine's bootstrap data
//!   wrote (no plan did) and no `file` change names becomes an `absent` change
//!   ([`translate_removing`], [`super::bootstrap_data`]);
//! - `joinConfiguration.nodeRegistration.kubeletExtraArgs` (v1beta2 `[{name, value}]`) →
//!   `kubeletFlags.set`;
//! - `Machine.spec.version` → the optional repository switch file, then the upstream kubeadm
//!   order: `kubeadm` at `<version>-*` (held), `kubeadmUpgradeNode`, `kubelet` and `kubectl`
//!   at `<version>-*` (held); the agent resolves the pattern to the exact package version
//!   when it prepares the plan and journals that. On a node without a package manager the
//!   version is only verified (`kubeletVersion` gate);
//! - gates: `kubeletVersion` for the version; after a kubelet restart (flags or packages)
//!   `unitActive kubelet.service` and the kubelet healthz, when the agent manages services;
//!   on a control-plane Machine ([`MachineRole`], read from the live Machine) whose plan
//!   restarts a control-plane component (`kubeadmUpgradeNode`, a change under
//!   `/etc/kubernetes/manifests`), `controlPlane` last: the API server ready, the static pods
//!   on their new manifests, the local etcd member and the quorum (decision 0019).
//!
//! Nothing here does I/O: Secrets come in through [`SecretSource`], the node's abilities as
//! [`NodeFacts`], the paths the bootstrap data wrote as a list. The plan id is
//! `<namespace>/<machine>@<12 hex of sha256 over the desired specs>` ([`plan_id`]; and the
//! bootstrap data's removals, when there are any), so every replica, before and after a
//! restart, names the same work the same way.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::settings::{FILES_SET, Settings};
use inplace_plan::{AllowList, Limits, Plan, validate_value};

/// What the updater knows about the node's agent (from `GetNodeInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    /// The node name the agent serves.
    pub node_name: String,
    /// Change kinds the agent applies on this node (plan-file keys).
    pub change_kinds: Vec<String>,
    /// Check kinds it runs.
    pub check_kinds: Vec<String>,
    /// Plan features beyond the kinds (`prune`, `packageVersionPattern`).
    pub features: Vec<String>,
    /// The agent starts and restarts units (systemd); false with `--services off`.
    pub services_managed: bool,
    /// `apt`, `dnf` or empty.
    pub package_manager: String,
    /// The installed kubelet's version (`v1.35.2`), empty when unknown (the drain's
    /// "changes the Kubernetes version").
    pub kubelet_version: String,
}

impl NodeFacts {
    /// What a current agent on a kubeadm node with systemd and a package manager reports;
    /// used where no node can be asked (`CanUpdateMachineSet`, `translate`).
    pub fn assumed(node_name: &str) -> NodeFacts {
        let s = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect();
        NodeFacts {
            node_name: node_name.to_owned(),
            change_kinds: s(&[
                "file",
                "absent",
                "kubeletConfig",
                "kubeletFlags",
                "sysctl",
                "package",
                "artifact",
                "unit",
                "kubeadmUpgradeNode",
                "apiServerCertificate",
                "reboot",
            ]),
            check_kinds: s(&["unitActive", "httpGet", "kubeletVersion", "controlPlane"]),
            features: s(&[FEATURE_PRUNE, FEATURE_VERSION_PATTERN]),
            services_managed: true,
            package_manager: "apt".into(),
            kubelet_version: String::new(),
        }
    }

    /// The agent applies changes of `kind`.
    pub(crate) fn kind(&self, kind: &str) -> bool {
        self.change_kinds.iter().any(|k| k == kind)
    }

    /// The agent runs checks of `kind`.
    pub(crate) fn check(&self, kind: &str) -> bool {
        self.check_kinds.iter().any(|k| k == kind)
    }

    fn feature(&self, feature: &str) -> bool {
        self.features.iter().any(|k| k == feature)
    }

    /// What of a KubeadmConfig / Machine the updater can translate for this node, as a
    /// worker's ([`NodeFacts::capabilities_for`] for a control-plane Machine).
    pub fn capabilities(&self) -> Capabilities {
        self.capabilities_for(MachineRole::Worker)
    }

    /// What of a KubeadmConfig / Machine the updater can translate for this node when it is
    /// a Machine of `role` (read from the live Machine, [`MachineRole::of`]): only on a
    /// control-plane Machine is the cluster configuration node work.
    pub fn capabilities_for(&self, role: MachineRole) -> Capabilities {
        Capabilities {
            files: self.kind("file"),
            prune: self.feature(FEATURE_PRUNE),
            // A flag takes effect only when the agent can restart the kubelet.
            kubelet_flags: self.kind("kubeletFlags") && self.services_managed,
            version: self.kind("package")
                && self.kind("kubeadmUpgradeNode")
                && self.feature(FEATURE_VERSION_PATTERN),
            role,
            control_plane_config: self.kind("file")
                && self.kind("kubeadmUpgradeNode")
                && self.check("controlPlane"),
            api_server_certificate: self.kind(API_SERVER_CERTIFICATE),
        }
    }
}

/// The change kind that reissues the API server's serving certificate with new names
/// (`{certSANs, previous, certificatesDir}`), restored on rollback.
pub const API_SERVER_CERTIFICATE: &str = "apiServerCertificate";

/// `GetNodeInfo.plan_features` value: the agent honours `options.prune`.
pub const FEATURE_PRUNE: &str = "prune";
/// `GetNodeInfo.plan_features` value: package versions may be `<prefix>*` patterns.
pub const FEATURE_VERSION_PATTERN: &str = "packageVersionPattern";

/// What can be done in place on a node (drives the CanUpdate* coverage).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// `files[]` can be written.
    pub files: bool,
    /// A file dropped from `files[]` is removed from the node.
    pub prune: bool,
    /// kubelet flags can be set.
    pub kubelet_flags: bool,
    /// The Kubernetes version can be moved (packages, kubeadm upgrade node, patterns).
    pub version: bool,
    /// The Machine's role: the cluster configuration is node work on a control-plane
    /// Machine only.
    pub role: MachineRole,
    /// The node regenerates its static pod manifests from the cluster configuration and
    /// proves them healthy (`file`, `kubeadmUpgradeNode`, the `controlPlane` gate).
    pub control_plane_config: bool,
    /// The node reissues the API server's serving certificate (`apiServerCertificate`).
    pub api_server_certificate: bool,
}

/// Where `files[].contentFrom.secret` is read from (the Machine's namespace).
pub trait SecretSource {
    /// The bytes of `key` in Secret `name`, or an error for people (`secret default/x has
    /// no key y`).
    fn secret(&self, name: &str, key: &str) -> Result<Vec<u8>, String>;
}

/// No Secrets available (`translate` without a cluster).
pub struct NoSecrets;

impl SecretSource for NoSecrets {
    fn secret(&self, name: &str, _key: &str) -> Result<Vec<u8>, String> {
        Err(format!(
            "secret {name} cannot be read here (no cluster access); inline the content"
        ))
    }
}

/// The desired objects of one Machine.
#[derive(Debug, Clone, Copy)]
pub struct Desired<'a> {
    /// The Machine (metadata and spec are read).
    pub machine: &'a Value,
    /// The InfraMachine, if sent (only its spec enters the plan id).
    pub infrastructure: Option<&'a Value>,
    /// The KubeadmConfig, if the Machine has one.
    pub bootstrap: Option<&'a Value>,
}

/// A desired state that cannot be turned into a plan; `field` names the object field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct TranslateError {
    /// e.g. `bootstrapConfig.spec.files[2].contentFormat`.
    pub field: String,
    /// Why, and what to do.
    pub message: String,
}

fn terr(field: impl Into<String>, message: impl Into<String>) -> TranslateError {
    TranslateError {
        field: field.into(),
        message: message.into(),
    }
}

/// The outcome of a translation.
#[derive(Debug, Clone)]
pub struct Translation {
    /// The plan id.
    pub id: String,
    /// The plan document (plan-file shape), as `translate` prints it.
    pub document: Value,
    /// The validated plan (what goes on the wire, through `rpc::convert::plan_to_pb`).
    pub plan: Plan,
    /// The plan restarts a component of a control-plane node (so it carries the
    /// `controlPlane` gate, and affects availability: `CanUpdateMachine` says so).
    pub restarts_control_plane: bool,
}

/// Which kind of Machine a plan is for: a control-plane Machine gets the `controlPlane` gate
/// on plans that restart one of its components.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MachineRole {
    /// Owned by a KubeadmControlPlane, or labelled `cluster.x-k8s.io/control-plane`.
    ControlPlane,
    /// Anything else.
    Worker,
}

/// The label Cluster API puts on every control-plane Machine (`MachineControlPlaneLabel`,
/// cluster-api `api/core/v1beta2/machine_types.go`).
pub const CONTROL_PLANE_LABEL: &str = "cluster.x-k8s.io/control-plane";

/// The static pod manifests of a kubeadm node: a change under it restarts a component.
pub const MANIFESTS_DIR: &str = "/etc/kubernetes/manifests/";

impl MachineRole {
    /// The role of `machine` (a Machine object as read): the control-plane label, or an
    /// owner reference to a KubeadmControlPlane. Handlers pass the **live** Machine, never
    /// the request's (decision 0015).
    pub fn of(machine: &Value) -> MachineRole {
        let labelled = machine
            .pointer("/metadata/labels")
            .and_then(Value::as_object)
            .is_some_and(|l| l.contains_key(CONTROL_PLANE_LABEL));
        let owned = machine
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
            .is_some_and(|refs| {
                refs.iter()
                    .any(|r| r.get("kind").and_then(Value::as_str) == Some("KubeadmControlPlane"))
            });
        if labelled || owned {
            MachineRole::ControlPlane
        } else {
            MachineRole::Worker
        }
    }
}

/// Whether `plan` restarts a control-plane component on a kubeadm node: it runs `kubeadm
/// upgrade node` (which rewrites the static pod manifests) or writes or removes a path under
/// `/etc/kubernetes/manifests/` (the kubelet restarts the static pod) — pure. A reissued
/// serving certificate (`apiServerCertificate`) is not one: the API server reloads it, and
/// the change checks the new certificate against the CA before it writes it.
pub fn restarts_control_plane(plan: &Plan) -> bool {
    plan.changes.iter().any(restarts_a_component)
}

/// Whether `change` restarts a control-plane component when it changes the node: `kubeadm
/// upgrade node`, or a write or removal under `/etc/kubernetes/manifests/`.
pub fn restarts_a_component(change: &inplace_plan::Change) -> bool {
    matches!(change, inplace_plan::Change::KubeadmUpgradeNode(_))
        || change
            .spec()
            .writes()
            .iter()
            .any(|w| w.path.to_string().starts_with(MANIFESTS_DIR))
}

/// The etcd topology of a KubeadmConfig spec: `external` when
/// `clusterConfiguration.etcd.external` is set, else `stacked` (kubeadm's local etcd).
fn etcd_topology(bootstrap: Option<&Value>) -> &'static str {
    let external = bootstrap
        .and_then(|b| b.pointer("/spec/clusterConfiguration/etcd/external"))
        .is_some_and(|e| !e.is_null());
    if external { "external" } else { "stacked" }
}

/// The least time the `controlPlane` gate gets: an API server and etcd restarted by
/// `kubeadm upgrade node` take tens of seconds to be ready again.
pub const CONTROL_PLANE_GATE_MIN_SECONDS: u32 = 300;

/// `<namespace>/<machine>@<first 12 hex of sha256 over the desired specs>`: the specs of the
/// Machine, InfraMachine and BootstrapConfig, each in canonical JSON (keys sorted), so the
/// key order CAPI happened to marshal does not matter.
pub fn plan_id(desired: &Desired<'_>) -> String {
    plan_id_removing(desired, &[], None)
}

/// [`plan_id`] of a plan that also removes `removed` (files the bootstrap data wrote); the
/// same as [`plan_id`] when there are none, so plans from before such removals keep their id.
///
/// The settings that shape the plan enter it too when they are not the defaults (so the id
/// of a plan under default settings stays what it was): the same specs under other
/// settings are another plan, never a variant of the same id.
fn plan_id_removing(
    desired: &Desired<'_>,
    removed: &[String],
    settings: Option<&Settings>,
) -> String {
    let spec = |v: Option<&Value>| {
        v.and_then(|v| v.get("spec"))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let mut specs = json!({
        "machine": spec(Some(desired.machine)),
        "infrastructureMachine": spec(desired.infrastructure),
        "bootstrapConfig": spec(desired.bootstrap),
    });
    if !removed.is_empty() {
        specs["bootstrapRemovals"] = json!(removed);
    }
    if let Some(shaping) = settings
        .map(plan_shaping)
        .filter(|s| *s != plan_shaping(&Settings::defaults(&Default::default())))
    {
        specs["settings"] = shaping;
    }
    let mut canonical = String::new();
    write_canonical(&specs, &mut canonical);
    let hash = hex::encode(Sha256::digest(canonical.as_bytes()));
    let meta = |k: &str| {
        desired
            .machine
            .get("metadata")
            .and_then(|m| m.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    format!("{}/{}@{}", meta("namespace"), meta("name"), &hash[..12])
}

/// The settings that shape a plan's document (not the port or the drain, which are the
/// updater's own business), as JSON.
fn plan_shaping(s: &Settings) -> Value {
    json!({
        "kubernetesPackages": s.kubernetes_packages,
        "packageRepository": s.repository,
        "kubeletHealthzURL": s.kubelet_healthz_url,
        "gateTimeoutSeconds": s.gate_timeout_seconds,
        "planTimeoutSeconds": s.plan_timeout_seconds,
    })
}

/// JSON with object keys sorted at every level, no whitespace.
pub fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&m[k], out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, item) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `v1.35.2` → `1.35.2`; only plain `MAJOR.MINOR.PATCH` versions map onto package versions.
pub fn package_version(version: &str) -> Option<String> {
    let v = version.strip_prefix('v').unwrap_or(version);
    let parts: Vec<&str> = v.split('.').collect();
    (parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit())))
    .then(|| v.to_owned())
}

/// The KubeadmConfig spec fields whose changes need no node work (they only matter to a
/// `kubeadm init`/`join` that never runs again on this node).
pub const NO_NODE_WORK: &[&[&str]] = &[
    &["verbosity"],
    &["initConfiguration"],
    &["joinConfiguration", "discovery"],
    &["joinConfiguration", "timeouts"],
    &["joinConfiguration", "nodeRegistration", "imagePullPolicy"],
    &[
        "joinConfiguration",
        "nodeRegistration",
        "ignorePreflightErrors",
    ],
];

/// Where the kubelet flags are in a KubeadmConfig spec.
pub const KUBELET_ARGS: &[&str] = &["joinConfiguration", "nodeRegistration", "kubeletExtraArgs"];

/// Where KCP's feature gates are.
pub const FEATURE_GATES: &[&str] = &["clusterConfiguration", "featureGates"];

/// The cluster configuration fields a control-plane node applies in place: the flags,
/// volumes and environment of its static pods and its local etcd's image tag. `kubeadm
/// upgrade node` regenerates the static pod manifests from them (the cluster's
/// `kubeadm-config`, which KubeadmControlPlane moves before it touches any Machine).
pub const CONTROL_PLANE_CONFIG: &[&[&str]] = &[
    &["clusterConfiguration", "apiServer", "extraArgs"],
    &["clusterConfiguration", "apiServer", "extraVolumes"],
    &["clusterConfiguration", "apiServer", "extraEnvs"],
    &["clusterConfiguration", "controllerManager", "extraArgs"],
    &["clusterConfiguration", "controllerManager", "extraVolumes"],
    &["clusterConfiguration", "controllerManager", "extraEnvs"],
    &["clusterConfiguration", "scheduler", "extraArgs"],
    &["clusterConfiguration", "scheduler", "extraVolumes"],
    &["clusterConfiguration", "scheduler", "extraEnvs"],
    &["clusterConfiguration", "etcd", "local", "imageTag"],
    &["clusterConfiguration", "etcd", "local", "extraArgs"],
    &["clusterConfiguration", "etcd", "local", "extraEnvs"],
];

/// Where the local etcd's image tag is.
pub const ETCD_IMAGE_TAG: &[&str] = &["clusterConfiguration", "etcd", "local", "imageTag"];

/// Where the API server's extra certificate names are.
pub const API_SERVER_CERT_SANS: &[&str] = &["clusterConfiguration", "apiServer", "certSANs"];

/// Where kubeadm keeps the cluster's certificates when `certificatesDir` is not set.
pub const CERTIFICATES_DIR_DEFAULT: &str = "/etc/kubernetes/pki";

/// Whether a value counts as set: Cluster API drops empty lists before it compares
/// (`PrepareKubeadmConfigsForDiff`), so an empty list, object or string is unset.
pub fn is_set(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// The record of the covered control-plane configuration of a KubeadmConfig spec (pure):
/// the set fields of [`CONTROL_PLANE_CONFIG`], nested as in the spec's
/// `clusterConfiguration`; `None` when none is set. The plans of control-plane Machines
/// write it, in canonical JSON, to [`inplace_plan::CLUSTER_CONFIGURATION_RECORD`].
pub fn cluster_configuration_record(spec: &Value) -> Option<Value> {
    let mut record = Value::Object(Map::new());
    let mut any = false;
    for path in CONTROL_PLANE_CONFIG {
        let v = lookup(spec, path);
        if let (true, Some(v)) = (is_set(v), v) {
            let (last, parents) = path[1..].split_last().unwrap_or((&"", &[]));
            let mut at = &mut record;
            for key in parents {
                at = &mut at[*key];
            }
            at[*last] = v.clone();
            any = true;
        }
    }
    any.then_some(record)
}

/// A plan change and the spec field it is made from.
pub type Sourced = (Value, String);

/// The changes of a control-plane Machine's plan that move its static pods to the cluster
/// configuration of `spec` (its KubeadmConfig spec), for a node that can do them (pure):
/// the record ([`cluster_configuration_record`]) as a `file` change, and `kubeadmUpgradeNode`
/// unless the plan already runs it (`has_kubeadm`); `certificate` is the `apiServerCertificate`
/// change for the desired `certSANs`, for a node whose agent has that kind. Each comes with
/// the spec field it is made from.
///
/// `previous` is left empty: only the desired KubeadmConfig reaches `UpdateMachine`, so the
/// updater never knows the names the certificate had; the coverage therefore takes a
/// `certSANs` change in place only when it adds names ([`super::patch`]).
pub fn control_plane_changes(
    spec: &Value,
    caps: Capabilities,
    has_kubeadm: bool,
) -> (Vec<Sourced>, Option<Sourced>) {
    let mut out = Vec::new();
    if caps.role != MachineRole::ControlPlane {
        return (out, None);
    }
    if caps.control_plane_config
        && let Some(record) = cluster_configuration_record(spec)
    {
        let mut content = String::new();
        write_canonical(&record, &mut content);
        content.push('\n');
        out.push((
            json!({"file": {
                "path": inplace_plan::CLUSTER_CONFIGURATION_RECORD,
                "content": content,
                "mode": "0600",
            }}),
            "bootstrapConfig.spec.clusterConfiguration".to_owned(),
        ));
        if !has_kubeadm {
            out.push((
                json!({"kubeadmUpgradeNode": {}}),
                "bootstrapConfig.spec.clusterConfiguration".to_owned(),
            ));
        }
    }
    let sans = lookup(spec, API_SERVER_CERT_SANS).filter(|v| is_set(Some(v)));
    let certificate = match sans {
        Some(sans) if caps.api_server_certificate => {
            let mut body = Map::new();
            body.insert("certSANs".into(), sans.clone());
            body.insert("previous".into(), json!([]));
            if let Some(dir) = spec
                .pointer("/clusterConfiguration/certificatesDir")
                .and_then(Value::as_str)
                .filter(|d| !d.is_empty() && *d != CERTIFICATES_DIR_DEFAULT)
            {
                body.insert("certificatesDir".into(), json!(dir));
            }
            Some((
                json!({ API_SERVER_CERTIFICATE: body }),
                "bootstrapConfig.spec.clusterConfiguration.apiServer.certSANs".to_owned(),
            ))
        }
        _ => None,
    };
    (out, certificate)
}

/// Translates the desired state for `node` into a plan.
pub fn translate(
    desired: &Desired<'_>,
    settings: &Settings,
    node: &NodeFacts,
    secrets: &dyn SecretSource,
) -> Result<Translation, TranslateError> {
    translate_removing(desired, settings, node, secrets, &[])
}

/// [`translate`], and remove what the Machine's bootstrap data wrote that the plan no longer
/// writes: `bootstrap_written` holds the paths of the user files it wrote
/// ([`super::bootstrap_data`]); each one no `file` change of the plan names becomes an
/// `absent` change after the `files[]` changes (a no-op once the file is gone; rolled back
/// with the rest). They enter the plan id, so the id stays a function of the inputs.
pub fn translate_removing(
    desired: &Desired<'_>,
    settings: &Settings,
    node: &NodeFacts,
    secrets: &dyn SecretSource,
    bootstrap_written: &[String],
) -> Result<Translation, TranslateError> {
    let role = MachineRole::of(desired.machine);
    translate_for(desired, role, settings, node, secrets, bootstrap_written)
}

/// [`translate_removing`] for a Machine of `role`, as read from the live Machine
/// ([`MachineRole::of`]): on a control-plane Machine, a plan that restarts a control-plane
/// component ([`restarts_control_plane`]) ends with the `controlPlane` gate; an agent that
/// cannot run it is refused (an older agent would call the node done unproven).
pub fn translate_for(
    desired: &Desired<'_>,
    role: MachineRole,
    settings: &Settings,
    node: &NodeFacts,
    secrets: &dyn SecretSource,
    bootstrap_written: &[String],
) -> Result<Translation, TranslateError> {
    let machine_spec = desired.machine.get("spec").unwrap_or(&Value::Null);
    let mut changes: Vec<Value> = Vec::new();
    let mut sources: Vec<String> = Vec::new();
    let mut restarts_kubelet = false;
    let mut files_end = 0;

    if let Some(bootstrap) = desired.bootstrap {
        let kind = bootstrap.get("kind").and_then(Value::as_str).unwrap_or("");
        if kind != "KubeadmConfig" {
            return Err(terr(
                "bootstrapConfig.kind",
                format!("{kind:?} is not supported: this updater translates KubeadmConfig only"),
            ));
        }
        let spec = bootstrap.get("spec").unwrap_or(&Value::Null);
        for (i, file) in spec
            .get("files")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let field = format!("bootstrapConfig.spec.files[{i}]");
            changes.push(json!({"file": file_change(file, &field, secrets)?}));
            sources.push(field);
        }
        files_end = changes.len();
        if let Some(args) = lookup(spec, KUBELET_ARGS) {
            let field = "bootstrapConfig.spec.joinConfiguration.nodeRegistration.kubeletExtraArgs";
            let set = kubelet_args(args, field)?;
            if !set.is_empty() {
                changes.push(json!({"kubeletFlags": {"set": set}}));
                sources.push(field.to_owned());
                restarts_kubelet = true;
            }
        }
    }

    // A control-plane Machine: the record of its cluster configuration, before the version's
    // packages so that one `kubeadm upgrade node` applies both.
    let caps = node.capabilities_for(role);
    let bootstrap_spec = desired
        .bootstrap
        .and_then(|b| b.get("spec"))
        .unwrap_or(&Value::Null);
    let (control_plane, certificate) = control_plane_changes(bootstrap_spec, caps, true);
    let record_changes = !control_plane.is_empty();
    for (change, source) in control_plane {
        changes.push(change);
        sources.push(source);
    }

    let mut verify: Vec<Value> = Vec::new();
    if let Some(version) = machine_spec.get("version").and_then(Value::as_str) {
        let field = "machine.spec.version";
        let plain = package_version(version).ok_or_else(|| {
            terr(
                field,
                format!("{version:?} is not a MAJOR.MINOR.PATCH Kubernetes version"),
            )
        })?;
        let pattern = format!("{plain}-*");
        let packages = node.kind("package") && !settings.kubernetes_packages.is_empty();
        if packages {
            if !node.feature(FEATURE_VERSION_PATTERN) {
                return Err(terr(
                    field,
                    format!(
                        "the agent on node {} is too old to resolve package versions by \
                         pattern; upgrade inplace-agent on the node",
                        node.node_name
                    ),
                ));
            }
            if let Some((path, template)) = &settings.repository {
                let minor = plain.rsplit_once('.').map_or(plain.as_str(), |(m, _)| m);
                let content = template
                    .replace("{minor}", &format!("v{minor}"))
                    .replace("{version}", &plain);
                changes.push(json!({"file": {"path": path, "content": ensure_newline(content)}}));
                sources.push("settings.packageRepositoryTemplate".into());
            }
            for (i, name) in settings.kubernetes_packages.iter().enumerate() {
                changes.push(json!({"package": {"name": name, "version": pattern, "hold": true}}));
                sources.push(field.into());
                if i == 0 && name == "kubeadm" && node.kind("kubeadmUpgradeNode") {
                    changes.push(json!({"kubeadmUpgradeNode": {}}));
                    sources.push(field.into());
                }
            }
            restarts_kubelet = true;
        }
        if node.check("kubeletVersion") {
            verify.push(json!({"kubeletVersion": {
                "version": format!("v{plain}"),
                "timeoutSeconds": settings.gate_timeout_seconds,
            }}));
        }
    }
    if restarts_kubelet && node.services_managed {
        if node.check("unitActive") {
            verify.insert(
                0,
                json!({"unitActive": {"name": "kubelet.service", "timeoutSeconds": settings.gate_timeout_seconds}}),
            );
        }
        if let (Some(url), true) = (&settings.kubelet_healthz_url, node.check("httpGet")) {
            let at = usize::from(!verify.is_empty() && verify[0].get("unitActive").is_some());
            verify.insert(
                at,
                json!({"httpGet": {"url": url, "expectStatus": 200, "timeoutSeconds": settings.gate_timeout_seconds}}),
            );
        }
    }

    if record_changes
        && !changes
            .iter()
            .any(|c| c.get("kubeadmUpgradeNode").is_some())
    {
        changes.push(json!({"kubeadmUpgradeNode": {}}));
        sources.push("bootstrapConfig.spec.clusterConfiguration".into());
    }
    if let Some((change, source)) = certificate {
        changes.push(change);
        sources.push(source);
    }

    let removed = if desired.bootstrap.is_some() && node.kind("absent") {
        bootstrap_removals(&changes, bootstrap_written)
    } else {
        Vec::new()
    };
    let absent = removed.iter().map(|p| json!({"absent": {"path": p}}));
    changes.splice(files_end..files_end, absent);
    sources.splice(
        files_end..files_end,
        removed
            .iter()
            .map(|_| "machine.spec.bootstrap.dataSecretName".to_owned()),
    );
    let id = plan_id_removing(desired, &removed, Some(settings));

    let mut options = Map::new();
    options.insert("rollbackOnFailure".into(), json!(true));
    if settings.plan_timeout_seconds > 0 {
        options.insert(
            "timeoutSeconds".into(),
            json!(settings.plan_timeout_seconds),
        );
    }
    if node.feature(FEATURE_PRUNE) && desired.bootstrap.is_some() {
        options.insert("prune".into(), json!({"set": FILES_SET}));
    }
    let mut document = json!({
        "apiVersion": inplace_plan::API_VERSION,
        "kind": "Plan",
        "id": id,
        "nodeName": node.node_name,
        "options": options,
        "changes": changes,
        "verify": verify,
    });
    let limits = Limits {
        allow: AllowList::everything(),
        ..Limits::default()
    };
    let validate = |document: &Value| {
        validate_value(document, "updater", &limits).map_err(|invalid| {
            let first = invalid.errors.first();
            let (field, message) = match first {
                Some(e) => {
                    let source = e
                        .field
                        .strip_prefix("changes[")
                        .and_then(|r| r.split_once(']'))
                        .and_then(|(n, _)| n.parse::<usize>().ok())
                        .and_then(|n| sources.get(n))
                        .cloned()
                        .unwrap_or_else(|| "plan".to_owned());
                    (source, format!("the plan would be invalid: {e}"))
                }
                None => ("plan".to_owned(), invalid.to_string()),
            };
            terr(field, message)
        })
    };
    let mut plan = validate(&document)?;
    let restarts = role == MachineRole::ControlPlane && restarts_control_plane(&plan);
    if restarts {
        if !node.check("controlPlane") {
            return Err(terr(
                "machine.spec",
                format!(
                    "the agent on node {} cannot prove a control-plane node healthy (no \
                     controlPlane gate), so this control-plane change would be called done \
                     while its API server or etcd may still be restarting; upgrade \
                     inplace-agent on the node",
                    node.node_name
                ),
            ));
        }
        let gate = json!({"controlPlane": {
            "nodeName": node.node_name,
            "etcd": etcd_topology(desired.bootstrap),
            "timeoutSeconds": settings.gate_timeout_seconds.max(CONTROL_PLANE_GATE_MIN_SECONDS),
        }});
        if let Some(v) = document.get_mut("verify").and_then(Value::as_array_mut) {
            v.push(gate);
        }
        plan = validate(&document)?;
    }
    Ok(Translation {
        id,
        document,
        plan,
        restarts_control_plane: restarts,
    })
}

/// The paths of `written` that no `file` change of `changes` writes, in order, once each.
fn bootstrap_removals(changes: &[Value], written: &[String]) -> Vec<String> {
    let kept: std::collections::BTreeSet<&str> = changes
        .iter()
        .filter_map(|c| lookup(c, &["file", "path"]).and_then(Value::as_str))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    written
        .iter()
        .filter(|p| !kept.contains(p.as_str()) && seen.insert(p.as_str()))
        .cloned()
        .collect()
}

fn ensure_newline(mut s: String) -> String {
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// One `files[]` entry → the body of a `file` change.
fn file_change(
    file: &Value,
    field: &str,
    secrets: &dyn SecretSource,
) -> Result<Value, TranslateError> {
    let f = file
        .as_object()
        .ok_or_else(|| terr(field, "is not an object"))?;
    let s = |key: &str| f.get(key).and_then(Value::as_str);
    let path = s("path")
        .filter(|p| p.starts_with('/'))
        .ok_or_else(|| terr(format!("{field}.path"), "missing or not an absolute path"))?;
    if let Some(format) = s("contentFormat").filter(|v| !v.is_empty()) {
        return Err(terr(
            format!("{field}.contentFormat"),
            format!(
                "{format:?} files are rendered by CABPK at bootstrap; they cannot be updated in \
                 place (a rollout replaces the Machine)"
            ),
        ));
    }
    let bytes: Vec<u8> = match (s("content"), f.get("contentFrom")) {
        (_, Some(from)) if !from.is_null() => {
            let secret = from.get("secret");
            let name = secret.and_then(|v| v.get("name")).and_then(Value::as_str);
            let key = secret.and_then(|v| v.get("key")).and_then(Value::as_str);
            let (Some(name), Some(key)) = (name, key) else {
                return Err(terr(
                    format!("{field}.contentFrom.secret"),
                    "needs name and key",
                ));
            };
            secrets
                .secret(name, key)
                .map_err(|e| terr(format!("{field}.contentFrom.secret"), e))?
        }
        (Some(content), _) => content.as_bytes().to_vec(),
        (None, _) => Vec::new(),
    };
    let from_secret = f.get("contentFrom").is_some_and(|v| !v.is_null());
    // The plan carries text: bytes that are not the text of an encoding travel as base64.
    let (content, encoding) = match s("encoding").unwrap_or("") {
        "" => (BASE64.encode(&bytes), "base64"),
        "base64" => (text(bytes, field)?, "base64"),
        "gzip" => (BASE64.encode(&bytes), "gzip+base64"),
        "gzip+base64" => (text(bytes, field)?, "gzip+base64"),
        other => {
            return Err(terr(
                format!("{field}.encoding"),
                format!("{other:?} is not one of base64, gzip, gzip+base64"),
            ));
        }
    };
    // A Secret's bytes said to be base64 are checked here, so that no later error (the plan's
    // validation, the agent's check) describes them: which byte, at which offset.
    if from_secret
        && encoding.ends_with("base64")
        && inplace_plan::parse::decode_content(&content, inplace_plan::Encoding::Base64, 0).is_err()
    {
        return Err(terr(
            format!("{field}.contentFrom.secret"),
            "the Secret's value is not base64 text, as the file's encoding says (its content is \
             not shown)",
        ));
    }
    let mut out = Map::new();
    out.insert("path".into(), json!(path));
    out.insert("content".into(), json!(content));
    out.insert("encoding".into(), json!(encoding));
    if let Some(owner) = s("owner").filter(|v| !v.is_empty()) {
        out.insert("owner".into(), json!(owner));
    }
    if let Some(mode) = s("permissions").filter(|v| !v.is_empty()) {
        let mode = if mode.len() < 3 {
            format!("{mode:0>3}")
        } else {
            mode.to_owned()
        };
        out.insert("mode".into(), json!(mode));
    }
    if f.get("append").and_then(Value::as_bool) == Some(true) {
        out.insert("append".into(), json!(true));
    }
    Ok(Value::Object(out))
}

fn text(bytes: Vec<u8>, field: &str) -> Result<String, TranslateError> {
    String::from_utf8(bytes).map_err(|_| {
        terr(
            format!("{field}.content"),
            "is not the base64 text its encoding says (its content is not shown)",
        )
    })
}

/// v1beta2 `kubeletExtraArgs: [{name, value}]` → flag name → value. Repeated names cannot be
/// expressed as flags the agent sets (one value per flag) and are refused.
pub fn kubelet_args(args: &Value, field: &str) -> Result<Map<String, Value>, TranslateError> {
    let list = args.as_array().ok_or_else(|| {
        terr(
            field,
            "is not a list of {name, value} (KubeadmConfig v1beta2); the v1beta1 map form is not \
             supported",
        )
    })?;
    let mut set = Map::new();
    for (i, arg) in list.iter().enumerate() {
        let name = arg.get("name").and_then(Value::as_str).unwrap_or("");
        let value = arg.get("value").and_then(Value::as_str).unwrap_or("");
        let name = name.trim_start_matches('-');
        if name.is_empty() {
            return Err(terr(format!("{field}[{i}].name"), "missing"));
        }
        if set.insert(name.to_owned(), json!(value)).is_some() {
            return Err(terr(
                format!("{field}[{i}].name"),
                format!("{name:?} is repeated; the agent sets one value per kubelet flag"),
            ));
        }
    }
    Ok(set)
}

/// The value at `path` in `v`.
pub fn lookup<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(*k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Defaults;

    fn settings() -> Settings {
        Settings::defaults(&Defaults::default())
    }

    #[test]
    fn the_plan_id_ignores_key_order_and_changes_with_the_spec() {
        let a = json!({"metadata": {"name": "m", "namespace": "ns"}, "spec": {"version": "v1.35.2", "clusterName": "c"}});
        let b = json!({"spec": {"clusterName": "c", "version": "v1.35.2"}, "metadata": {"namespace": "ns", "name": "m"}});
        let c = json!({"metadata": {"name": "m", "namespace": "ns"}, "spec": {"version": "v1.35.3", "clusterName": "c"}});
        let id = |m: &Value| {
            plan_id(&Desired {
                machine: m,
                infrastructure: None,
                bootstrap: None,
            })
        };
        assert_eq!(id(&a), id(&b));
        assert_ne!(id(&a), id(&c));
        assert!(id(&a).starts_with("ns/m@"));
        assert_eq!(id(&a).len(), "ns/m@".len() + 12);
    }

    #[test]
    fn versions_map_onto_package_patterns() {
        assert_eq!(package_version("v1.35.2").as_deref(), Some("1.35.2"));
        assert_eq!(package_version("1.35.2").as_deref(), Some("1.35.2"));
        assert_eq!(package_version("v1.36.0-rc.1"), None);
        assert_eq!(package_version("v1.35"), None);
    }

    #[test]
    fn every_capi_encoding_becomes_the_same_bytes() {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"hello\n").unwrap();
        let gz = gz.finish().unwrap();
        struct S(Vec<u8>);
        impl SecretSource for S {
            fn secret(&self, _: &str, _: &str) -> Result<Vec<u8>, String> {
                Ok(self.0.clone())
            }
        }
        let machine = json!({"metadata": {"name": "m", "namespace": "ns"}, "spec": {}});
        let cases: Vec<(Value, Vec<u8>)> = vec![
            (json!({"path": "/etc/a", "content": "hello\n"}), vec![]),
            (
                json!({"path": "/etc/a", "content": BASE64.encode("hello\n"), "encoding": "base64"}),
                vec![],
            ),
            (
                json!({"path": "/etc/a", "content": BASE64.encode(&gz), "encoding": "gzip+base64"}),
                vec![],
            ),
            (
                json!({"path": "/etc/a", "contentFrom": {"secret": {"name": "s", "key": "k"}}}),
                b"hello\n".to_vec(),
            ),
            (
                json!({"path": "/etc/a", "contentFrom": {"secret": {"name": "s", "key": "k"}}, "encoding": "gzip"}),
                gz.clone(),
            ),
            (
                json!({"path": "/etc/a", "contentFrom": {"secret": {"name": "s", "key": "k"}}, "encoding": "base64"}),
                BASE64.encode("hello\n").into_bytes(),
            ),
        ];
        for (file, secret) in cases {
            let bootstrap = json!({"kind": "KubeadmConfig", "spec": {"files": [file.clone()]}});
            let t = translate(
                &Desired {
                    machine: &machine,
                    infrastructure: None,
                    bootstrap: Some(&bootstrap),
                },
                &settings(),
                &NodeFacts::assumed("n1"),
                &S(secret),
            )
            .unwrap_or_else(|e| panic!("{file}: {e}"));
            match &t.plan.changes[0] {
                inplace_plan::Change::File(f) => assert_eq!(&f.content[..], b"hello\n", "{file}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn files_the_bootstrap_data_wrote_and_the_plan_no_longer_writes_are_removed() {
        let machine =
            json!({"metadata": {"name": "m", "namespace": "ns"}, "spec": {"version": "v1.35.2"}});
        let bootstrap = json!({"kind": "KubeadmConfig", "spec": {"files": [
            {"path": "/etc/kubernetes/a", "content": "a"},
            {"path": "/etc/kubernetes/c", "content": "c"},
        ]}});
        let desired = Desired {
            machine: &machine,
            infrastructure: None,
            bootstrap: Some(&bootstrap),
        };
        let mut settings = settings();
        settings.repository = Some((
            "/etc/apt/sources.list.d/kubernetes.list".into(),
            "deb x\n".into(),
        ));
        let written: Vec<String> = [
            "/etc/kubernetes/a",
            "/etc/kubernetes/b",
            "/etc/apt/sources.list.d/kubernetes.list",
            "/etc/kubernetes/b",
        ]
        .map(str::to_owned)
        .into();
        let node = NodeFacts::assumed("n1");
        let t = translate_removing(&desired, &settings, &node, &NoSecrets, &written).unwrap();
        let kinds: Vec<String> = t
            .plan
            .changes
            .iter()
            .map(|c| format!("{} {}", c.kind(), c.target()))
            .collect();
        assert_eq!(
            kinds[..4],
            [
                "file /etc/kubernetes/a",
                "file /etc/kubernetes/c",
                "absent /etc/kubernetes/b",
                "file /etc/apt/sources.list.d/kubernetes.list"
            ],
            "{kinds:?}"
        );
        assert_eq!(kinds.iter().filter(|k| k.starts_with("absent")).count(), 1);
        // The id is the plain one without removals, and another with them.
        let plain = translate(&desired, &settings, &node, &NoSecrets).unwrap();
        assert_ne!(
            plain.id,
            plan_id(&desired),
            "settings that shape the plan are in its id"
        );
        assert_ne!(t.id, plain.id);
        let none: Vec<String> = vec!["/etc/kubernetes/a".into()];
        let kept = translate_removing(&desired, &settings, &node, &NoSecrets, &none).unwrap();
        assert_eq!(kept.id, plain.id, "nothing removed: the id of before");
        // An agent without the absent kind gets no removals.
        let mut old = NodeFacts::assumed("n1");
        old.change_kinds.retain(|k| k != "absent");
        let t = translate_removing(&desired, &settings, &old, &NoSecrets, &written).unwrap();
        assert!(
            t.plan
                .changes
                .iter()
                .all(|c| c.kind().to_string() != "absent")
        );
    }

    #[test]
    fn a_control_plane_configuration_becomes_its_record_then_kubeadm_then_the_gate() {
        let machine = json!({"metadata": {"name": "cp", "namespace": "ns"}, "spec": {}});
        let bootstrap = json!({"kind": "KubeadmConfig", "spec": {"clusterConfiguration": {
            "apiServer": {"extraArgs": [{"name": "audit-log-maxage", "value": "30"}], "extraVolumes": [], "certSANs": ["cp.example"]},
            "etcd": {"local": {"imageTag": "3.6.5-0", "dataDir": "/var/lib/etcd"}},
            "networking": {"podSubnet": "10.244.0.0/16"},
        }}});
        let desired = Desired {
            machine: &machine,
            infrastructure: None,
            bootstrap: Some(&bootstrap),
        };
        let node = NodeFacts::assumed("cp-0");
        let t = translate_for(
            &desired,
            MachineRole::ControlPlane,
            &settings(),
            &node,
            &NoSecrets,
            &[],
        )
        .unwrap();
        let kinds: Vec<String> = t
            .plan
            .changes
            .iter()
            .map(|c| format!("{} {}", c.kind(), c.target()))
            .collect();
        assert_eq!(
            kinds,
            [
                format!("file {}", inplace_plan::CLUSTER_CONFIGURATION_RECORD),
                "kubeadmUpgradeNode kubeadm upgrade node".to_string(),
                "apiServerCertificate /etc/kubernetes/pki/apiserver.crt".to_string()
            ]
        );
        let inplace_plan::Change::File(f) = &t.plan.changes[0] else {
            panic!("{:?}", t.plan.changes[0]);
        };
        // Canonical JSON of the covered fields only (no certSANs, dataDir, networking, no
        // empty list).
        assert_eq!(
            String::from_utf8_lossy(&f.content),
            "{\"apiServer\":{\"extraArgs\":[{\"name\":\"audit-log-maxage\",\"value\":\"30\"}]},\
             \"etcd\":{\"local\":{\"imageTag\":\"3.6.5-0\"}}}\n"
        );
        assert!(t.restarts_control_plane);
        assert_eq!(
            t.plan.verify.last().map(|c| c.probe.key()),
            Some("controlPlane")
        );
        // A worker's plan is what it was: nothing of the cluster configuration.
        let w = translate_for(
            &desired,
            MachineRole::Worker,
            &settings(),
            &node,
            &NoSecrets,
            &[],
        )
        .unwrap();
        assert!(w.plan.changes.is_empty(), "{:?}", w.plan.changes);
        // An agent without the gate: no record, no kubeadm (the coverage leaves it
        // uncovered); the certificate's names need no gate (nothing restarts).
        let mut old = node.clone();
        old.check_kinds.retain(|k| k != "controlPlane");
        let o = translate_for(
            &desired,
            MachineRole::ControlPlane,
            &settings(),
            &old,
            &NoSecrets,
            &[],
        )
        .unwrap();
        assert!(
            o.plan
                .changes
                .iter()
                .all(|c| matches!(c, inplace_plan::Change::ApiServerCertificate(_))),
            "{:?}",
            o.plan.changes
        );

        // certSANs, for an agent with the apiServerCertificate kind: after kubeadm.
        let mut caps = node.capabilities_for(MachineRole::ControlPlane);
        caps.api_server_certificate = true;
        let mut spec = bootstrap["spec"].clone();
        spec["clusterConfiguration"]["certificatesDir"] = json!("/etc/k8s/pki");
        let (changes, certificate) = control_plane_changes(&spec, caps, false);
        assert_eq!(changes.len(), 2);
        assert_eq!(changes[1].0, json!({"kubeadmUpgradeNode": {}}));
        assert_eq!(
            certificate.map(|c| c.0),
            Some(json!({"apiServerCertificate": {
                "certSANs": ["cp.example"], "previous": [], "certificatesDir": "/etc/k8s/pki"
            }}))
        );
        caps.role = MachineRole::Worker;
        assert_eq!(
            control_plane_changes(&spec, caps, false),
            (Vec::new(), None)
        );
    }

    #[test]
    fn unsupported_fields_are_named() {
        let machine = json!({"metadata": {"name": "m", "namespace": "ns"}, "spec": {}});
        let bootstrap = json!({"kind": "KubeadmConfig", "spec": {"files": [{"path": "/etc/a", "content": "x", "contentFormat": "Template"}]}});
        let e = translate(
            &Desired {
                machine: &machine,
                infrastructure: None,
                bootstrap: Some(&bootstrap),
            },
            &settings(),
            &NodeFacts::assumed("n1"),
            &NoSecrets,
        )
        .unwrap_err();
        assert_eq!(e.field, "bootstrapConfig.spec.files[0].contentFormat");
        let bootstrap = json!({"kind": "KubeadmConfig", "spec": {"files": [{"path": "/etc/a", "permissions": "0999", "content": "x"}]}});
        let e = translate(
            &Desired {
                machine: &machine,
                infrastructure: None,
                bootstrap: Some(&bootstrap),
            },
            &settings(),
            &NodeFacts::assumed("n1"),
            &NoSecrets,
        )
        .unwrap_err();
        assert_eq!(e.field, "bootstrapConfig.spec.files[0]", "{e}");
        assert!(e.message.contains("mode"), "{e}");
    }
}
