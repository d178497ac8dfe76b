//! CanUpdate* answers (pure): copy into `current` exactly the desired fields the agent can
//! apply on the node, and express that copy as an RFC 6902 JSON Patch against the whole
//! `current` object (CAPI applies it to the object, then compares only `spec`, or
//! `spec.template.spec` for MachineSets and templates, with `desired`). Whatever is not
//! copied stays different, so CAPI falls back to a rollout for it.
//!
//! Covered: `Machine.spec.version`; KubeadmConfig `files[]` (when every entry can be
//! written and, if one is dropped, the agent removes it), `kubeletExtraArgs` (when no flag is
//! dropped: the updater only ever knows the desired flags, so it cannot tell which flags to
//! remove), `clusterConfiguration.featureGates` together with a version bump (KCP drops
//! `ControlPlaneKubeletLocalMode` on 1.35 → 1.36; `kubeadm upgrade node` applies the
//! cluster's configuration), and the fields that need no node work ([`NO_NODE_WORK`]).
//! On a control-plane Machine ([`Capabilities::role`]) also the cluster configuration its
//! static pods are made from ([`CONTROL_PLANE_CONFIG`]: the API server's, controller
//! manager's and scheduler's `extraArgs`, `extraVolumes`, `extraEnvs`, the local etcd's
//! `imageTag`, `extraArgs`, `extraEnvs`), which `kubeadm upgrade node` regenerates them from,
//! never an etcd image tag lower than the running one; and `apiServer.certSANs` when names
//! are only added (the serving certificate is reissued).
//! Never covered: diskSetup, mounts, format, ignition, users, ntp, boot/pre/post kubeadm
//! commands, the node name, `contentFormat: Template` files, InfraMachine changes.

use serde_json::{Map, Value, json};

use super::translate::{
    API_SERVER_CERT_SANS, CONTROL_PLANE_CONFIG, Capabilities, ETCD_IMAGE_TAG, FEATURE_GATES,
    KUBELET_ARGS, MachineRole, NO_NODE_WORK, is_set, kubelet_args, lookup,
};
use super::why::{Class, Gap, Need};

/// Machine spec fields CAPI clears before comparing (`CleanupMachineSpecForDiff`); they
/// never need covering.
pub const MACHINE_FIELDS_CAPI_IGNORES: &[&str] = &[
    "clusterName",
    "bootstrap",
    "infrastructureRef",
    "providerID",
    "minReadySeconds",
    "readinessGates",
    "deletion",
    "taints",
];

/// What the coverage of one pair of specs found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Coverage {
    /// `current`'s spec with the covered desired fields copied in.
    pub spec: Value,
    /// Fields copied (covered), e.g. `version`, `files`.
    pub covered: Vec<String>,
    /// Fields still different after the copy, with why ([`super::why`]: the response
    /// message, the log, the Event, the metric).
    pub uncovered: Vec<Gap>,
    /// A covered change restarts the kubelet (version, flags) or a control-plane component
    /// (the cluster configuration): it affects availability.
    pub disruptive: bool,
}

impl Coverage {
    /// True when nothing stays different.
    pub fn complete(&self) -> bool {
        self.uncovered.is_empty()
    }
}

/// Coverage of a Machine spec (or a MachineSet's `spec.template.spec`).
pub fn cover_machine(current: &Value, desired: &Value, caps: Capabilities) -> Coverage {
    let mut out = Coverage {
        spec: current.clone(),
        ..Coverage::default()
    };
    let (c, d) = (current.get("version"), desired.get("version"));
    if c != d {
        if caps.version {
            set(&mut out.spec, &["version"], d.cloned());
            out.covered.push("version".into());
            out.disruptive = true;
        } else {
            out.uncovered.push(Gap::needs(
                "version",
                Need::Version,
                "needs new packages and kubeadm upgrade node",
            ));
        }
    }
    for key in differing_keys(&out.spec, desired) {
        if !MACHINE_FIELDS_CAPI_IGNORES.contains(&key.as_str()) && key != "version" {
            out.uncovered.push(Gap::new(
                key,
                Class::FieldNotInPlace,
                "is not node work: only a new Machine changes it",
            ));
        }
    }
    out
}

/// Coverage of a KubeadmConfig spec (or a template's `spec.template.spec`);
/// `version_changes` tells whether the Machine's version moves in place too.
pub fn cover_kubeadm(
    current: &Value,
    desired: &Value,
    caps: Capabilities,
    version_changes: bool,
) -> Coverage {
    let mut out = Coverage {
        spec: current.clone(),
        ..Coverage::default()
    };
    // files[]
    let (cf, df) = (current.get("files"), desired.get("files"));
    if cf != df {
        match files_refusal(cf, df, caps) {
            None => {
                set(&mut out.spec, &["files"], df.cloned());
                out.covered.push("files".into());
            }
            Some(gap) => out.uncovered.push(gap),
        }
    }
    // kubeletExtraArgs
    let (ca, da) = (lookup(current, KUBELET_ARGS), lookup(desired, KUBELET_ARGS));
    if ca != da {
        match flags_refusal(ca, da, caps) {
            None => {
                set(&mut out.spec, KUBELET_ARGS, da.cloned());
                out.covered.push(KUBELET_ARGS.join("."));
                out.disruptive = true;
            }
            Some(gap) => out.uncovered.push(gap),
        }
    }
    // featureGates, with a version bump only
    let (cg, dg) = (
        lookup(current, FEATURE_GATES),
        lookup(desired, FEATURE_GATES),
    );
    if cg != dg {
        if version_changes && caps.version {
            set(&mut out.spec, FEATURE_GATES, dg.cloned());
            out.covered.push(FEATURE_GATES.join("."));
        } else {
            out.uncovered.push(Gap::new(
                FEATURE_GATES.join("."),
                Class::FieldNotInPlace,
                "changed without a version bump: no kubeadm upgrade would apply it",
            ));
        }
    }
    if caps.role == MachineRole::ControlPlane {
        cover_control_plane(current, desired, caps, &mut out);
    }
    for path in NO_NODE_WORK {
        let (c, d) = (lookup(&out.spec, path), lookup(desired, path));
        if c != d {
            set(&mut out.spec, path, d.cloned());
            out.covered.push(path.join("."));
        }
    }
    // Whatever still differs, named down to the level that differs (for the message).
    let mut rest = Vec::new();
    differing_paths(&out.spec, desired, "", 3, &mut rest);
    let reported: Vec<String> = out.uncovered.iter().map(|u| u.field.clone()).collect();
    rest.retain(|p| {
        !reported
            .iter()
            .any(|r| p.starts_with(r.as_str()) || r.starts_with(p.as_str()))
    });
    out.uncovered.extend(rest.into_iter().map(|p| {
        let why = never_in_place(&p);
        Gap::new(p, Class::FieldNotInPlace, why)
    }));
    out
}

/// The cluster configuration of a control-plane Machine: what `kubeadm upgrade node`
/// regenerates the static pods from ([`CONTROL_PLANE_CONFIG`]), and the API server's
/// certificate names.
fn cover_control_plane(current: &Value, desired: &Value, caps: Capabilities, out: &mut Coverage) {
    let set_before = CONTROL_PLANE_CONFIG
        .iter()
        .any(|p| is_set(lookup(current, p)));
    let set_after = CONTROL_PLANE_CONFIG
        .iter()
        .any(|p| is_set(lookup(desired, p)));
    let differing: Vec<&[&str]> = CONTROL_PLANE_CONFIG
        .iter()
        .copied()
        .filter(|p| lookup(current, p) != lookup(desired, p))
        .collect();
    if !differing.is_empty() && set_before && !set_after {
        // Nothing left to record: the plan would carry no record whose change runs kubeadm.
        out.uncovered.push(Gap::new(
            "clusterConfiguration",
            Class::FieldNotInPlace,
            "removes the last of the API server, controller manager, scheduler and etcd \
             settings (extraArgs, extraVolumes, extraEnvs, imageTag): with none left the \
             node's record of them cannot change, so kubeadm upgrade node would not run; only \
             a new Machine applies it",
        ));
        return;
    }
    for path in differing {
        let field = path.join(".");
        let (c, d) = (lookup(current, path), lookup(desired, path));
        if !caps.control_plane_config {
            out.uncovered.push(Gap::needs(
                field,
                Need::ControlPlaneConfig,
                "needs kubeadm upgrade node and the controlPlane gate on the node",
            ));
            continue;
        }
        if path == ETCD_IMAGE_TAG
            && let Some(gap) = etcd_backwards(c, d)
        {
            out.uncovered.push(gap);
            continue;
        }
        set(&mut out.spec, path, d.cloned());
        out.covered.push(field);
        out.disruptive = true;
    }
    let (c, d) = (
        lookup(current, API_SERVER_CERT_SANS),
        lookup(desired, API_SERVER_CERT_SANS),
    );
    if c != d {
        let field = API_SERVER_CERT_SANS.join(".");
        let names = |v: Option<&Value>| -> Vec<String> {
            v.and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .map(|n| n.as_str().map_or_else(|| n.to_string(), str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let kept = names(d);
        let dropped: Vec<String> = names(c).into_iter().filter(|n| !kept.contains(n)).collect();
        if !dropped.is_empty() {
            out.uncovered.push(Gap::new(
                field,
                Class::FieldNotInPlace,
                format!(
                    "drops {}: a name is not taken out of the API server's certificate in place \
                     (the updater sees only the desired names when it updates the node)",
                    dropped.join(", ")
                ),
            ));
        } else if !caps.api_server_certificate {
            out.uncovered.push(Gap::needs(
                field,
                Need::ApiServerCertificate,
                "needs the API server's serving certificate reissued with the new names",
            ));
        } else {
            set(&mut out.spec, API_SERVER_CERT_SANS, d.cloned());
            out.covered.push(field);
        }
    }
}

/// An etcd image tag as a comparable version: `3.6.5-0` → ([3, 6, 5], 0), `v3.5.21` →
/// ([3, 5, 21], 0); `None` when it is not of that form.
pub fn etcd_version(tag: &str) -> Option<(Vec<u64>, u64)> {
    let tag = tag.strip_prefix('v').unwrap_or(tag);
    let (version, revision) = match tag.split_once('-') {
        Some((v, r)) => (v, r.parse().ok()?),
        None => (tag, 0),
    };
    let parts: Option<Vec<u64>> = version.split('.').map(|p| p.parse().ok()).collect();
    parts.filter(|p| p.len() == 3).map(|p| (p, revision))
}

/// The refusal of an etcd image tag move that goes backwards, or that cannot be ordered
/// (both tags set): an etcd that moved its data forward cannot be downgraded. A tag set on
/// one side only moves from or to kubeadm's default for the version, which the updater does
/// not know; `kubeadm upgrade node` itself does not move etcd backwards.
fn etcd_backwards(current: Option<&Value>, desired: Option<&Value>) -> Option<Gap> {
    let field = ETCD_IMAGE_TAG.join(".");
    let (Some(c), Some(d)) = (
        current.and_then(Value::as_str).filter(|s| !s.is_empty()),
        desired.and_then(Value::as_str).filter(|s| !s.is_empty()),
    ) else {
        return None;
    };
    match (etcd_version(c), etcd_version(d)) {
        (Some(a), Some(b)) if b >= a => None,
        (Some(_), Some(_)) => Some(Gap::new(
            field,
            Class::Downgrade,
            format!(
                "moves etcd backwards, from {c} to {d}: an etcd that moved its data forward \
                 cannot be downgraded, in place or by a new Machine; keep {c} or a later tag"
            ),
        )),
        _ => Some(Gap::new(
            field,
            Class::Downgrade,
            format!(
                "cannot be ordered ({c} to {d}, not etcd versions such as 3.6.5-0): etcd never \
                 goes backwards, so a tag that cannot be proved newer is not moved in place"
            ),
        )),
    }
}

fn files_refusal(
    current: Option<&Value>,
    desired: Option<&Value>,
    caps: Capabilities,
) -> Option<Gap> {
    let never = |why: String| Some(Gap::new("files", Class::FieldNotInPlace, why));
    if !caps.files {
        return Some(Gap::needs(
            "files",
            Need::Files,
            "need an agent that writes files",
        ));
    }
    let paths = |v: Option<&Value>| -> Vec<String> {
        v.and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.get("path").and_then(Value::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    for (i, file) in desired
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        if let Some(f) = file
            .get("contentFormat")
            .and_then(Value::as_str)
            .filter(|f| !f.is_empty())
        {
            return never(format!(
                "hold files[{i}] with contentFormat {f}, rendered only at bootstrap"
            ));
        }
        match file.get("encoding").and_then(Value::as_str).unwrap_or("") {
            "" | "base64" | "gzip" | "gzip+base64" => {}
            other => {
                return never(format!(
                    "hold files[{i}] with the unknown encoding {other:?}"
                ));
            }
        }
        if !file
            .get("path")
            .and_then(Value::as_str)
            .is_some_and(|p| p.starts_with('/'))
        {
            return never(format!("hold files[{i}] without an absolute path"));
        }
    }
    let kept = paths(desired);
    let dropped: Vec<String> = paths(current)
        .into_iter()
        .filter(|p| !kept.contains(p))
        .collect();
    if !dropped.is_empty() && !caps.prune {
        return Some(Gap::needs(
            "files",
            Need::Prune,
            format!(
                "drop {}, which must be removed from the node",
                dropped.join(", ")
            ),
        ));
    }
    None
}

fn flags_refusal(
    current: Option<&Value>,
    desired: Option<&Value>,
    caps: Capabilities,
) -> Option<Gap> {
    let field = KUBELET_ARGS.join(".");
    if !caps.kubelet_flags {
        return Some(Gap::needs(
            field,
            Need::KubeletRestart,
            "needs a kubelet restart",
        ));
    }
    let names = |v: Option<&Value>| -> Result<Map<String, Value>, String> {
        match v {
            None | Some(Value::Null) => Ok(Map::new()),
            Some(v) => kubelet_args(v, "kubeletExtraArgs").map_err(|e| e.to_string()),
        }
    };
    let cur = match names(current) {
        Ok(m) => m,
        Err(e) => return Some(Gap::new(field, Class::FieldNotInPlace, e)),
    };
    let des = match names(desired) {
        Ok(m) => m,
        Err(e) => return Some(Gap::new(field, Class::FieldNotInPlace, e)),
    };
    let dropped: Vec<&String> = cur.keys().filter(|k| !des.contains_key(*k)).collect();
    if !dropped.is_empty() {
        let names: Vec<&str> = dropped.iter().map(|s| s.as_str()).collect();
        return Some(Gap::new(
            field,
            Class::FieldNotInPlace,
            format!(
                "drops {}: dropping a flag is not done in place (the updater only sees the \
                 desired flags)",
                names.join(", ")
            ),
        ));
    }
    None
}

/// Why a KubeadmConfig field outside what the updater covers stays different.
fn never_in_place(path: &str) -> &'static str {
    if let Some(rest) = path.strip_prefix("clusterConfiguration.") {
        return cluster_configuration_never(rest);
    }
    let top = path.split('.').next().unwrap_or(path);
    match top {
        "preKubeadmCommands" | "postKubeadmCommands" | "bootCommands" => {
            "runs only when the node is bootstrapped: only a new Machine applies it"
        }
        "diskSetup" | "mounts" | "format" | "ignition" | "users" | "ntp" => {
            "is set up only when the node is bootstrapped: only a new Machine applies it"
        }
        _ => "is not done in place: only a new Machine applies it",
    }
}

/// Why a `clusterConfiguration` field (`rest` is its path below it) stays different.
fn cluster_configuration_never(rest: &str) -> &'static str {
    let first = rest.split('.').next().unwrap_or(rest);
    match first {
        "networking" => {
            "changes the cluster's networking (pod and service subnets, DNS domain), which the \
             running cluster keeps: not done in place, only a new Machine applies it"
        }
        "controlPlaneEndpoint" => {
            "moves the control plane's endpoint, which every node's kubeconfig names: only a new \
             Machine applies it"
        }
        "imageRepository"
        | "kubernetesVersion"
        | "clusterName"
        | "certificatesDir"
        | "encryptionAlgorithm"
        | "dns"
        | "proxy" => {
            "is not one of the control-plane settings updated in place (the static pods' \
             extraArgs, extraVolumes, extraEnvs, etcd's imageTag, the API server's certSANs): \
             only a new Machine applies it"
        }
        "etcd" if rest.starts_with("etcd.external") => {
            "changes the external etcd the API server uses: only a new Machine applies it"
        }
        "etcd" if rest.contains("CertSANs") => {
            "needs etcd's certificates reissued, which is not done in place: only a new \
             Machine applies it"
        }
        "etcd" => {
            "is not one of etcd's settings updated in place (imageTag, extraArgs, extraEnvs): \
             only a new Machine applies it"
        }
        _ => {
            "is not one of the control-plane settings updated in place (the static pods' \
             extraArgs, extraVolumes, extraEnvs, etcd's imageTag, the API server's certSANs) \
             on a control-plane Machine: only a new Machine applies it"
        }
    }
}

/// Sets (`Some`) or removes (`None`) the value at `path`, creating objects on the way.
pub fn set(v: &mut Value, path: &[&str], value: Option<Value>) {
    let Some((last, parents)) = path.split_last() else {
        if let Some(value) = value {
            *v = value;
        }
        return;
    };
    let mut cur = v;
    for key in parents {
        if !cur.is_object() {
            if value.is_none() {
                return;
            }
            *cur = Value::Object(Map::new());
        }
        let Some(map) = cur.as_object_mut() else {
            return;
        };
        if value.is_none() && !map.contains_key(*key) {
            return;
        }
        cur = map
            .entry((*key).to_owned())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    if !cur.is_object() {
        if value.is_none() {
            return;
        }
        *cur = Value::Object(Map::new());
    }
    if let Some(map) = cur.as_object_mut() {
        match value {
            Some(value) => {
                map.insert((*last).to_owned(), value);
            }
            None => {
                map.remove(*last);
            }
        }
    }
}

fn differing_keys(a: &Value, b: &Value) -> Vec<String> {
    let empty = Map::new();
    let am = a.as_object().unwrap_or(&empty);
    let bm = b.as_object().unwrap_or(&empty);
    let mut keys: Vec<String> = am.keys().chain(bm.keys()).cloned().collect();
    keys.sort();
    keys.dedup();
    keys.retain(|k| am.get(k) != bm.get(k));
    keys
}

fn differing_paths(a: &Value, b: &Value, prefix: &str, depth: usize, out: &mut Vec<String>) {
    for key in differing_keys(a, b) {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match (a.get(&key), b.get(&key)) {
            (Some(x @ Value::Object(_)), Some(y @ Value::Object(_))) if depth > 1 => {
                differing_paths(x, y, &path, depth - 1, out);
            }
            _ => out.push(path),
        }
    }
}

/// RFC 6902 operations that turn `from` into `to` (paths under `base`, a JSON pointer).
/// Objects are compared key by key; arrays of equal length element by element; anything
/// else is replaced whole (so `add` only ever targets an existing parent).
pub fn diff(base: &str, from: &Value, to: &Value, ops: &mut Vec<Value>) {
    if from == to {
        return;
    }
    match (from, to) {
        (Value::Object(a), Value::Object(b)) => {
            for key in a.keys() {
                if !b.contains_key(key) {
                    ops.push(json!({"op": "remove", "path": format!("{base}/{}", escape(key))}));
                }
            }
            for (key, value) in b {
                let path = format!("{base}/{}", escape(key));
                match a.get(key) {
                    Some(old) => diff(&path, old, value, ops),
                    None => ops.push(json!({"op": "add", "path": path, "value": value})),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                diff(&format!("{base}/{i}"), x, y, ops);
            }
        }
        _ => ops.push(json!({"op": "replace", "path": base, "value": to})),
    }
}

/// A JSON pointer token (`~` → `~0`, `/` → `~1`).
pub fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The operations that replace `object`'s spec (at `spec_path`, e.g. `["spec"]` or
/// `["spec", "template", "spec"]`) with `covered`.
pub fn spec_patch(object: &Value, spec_path: &[&str], covered: &Value) -> Vec<Value> {
    let mut ops = Vec::new();
    let base: String = spec_path
        .iter()
        .map(|k| format!("/{}", escape(k)))
        .collect();
    match lookup(object, spec_path) {
        Some(current) => diff(&base, current, covered, &mut ops),
        None => {
            // Only reachable for a spec CAPI did not send: add it whole if the parent exists.
            ops.push(json!({"op": "add", "path": base, "value": covered}));
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Capabilities = Capabilities {
        files: true,
        prune: true,
        kubelet_flags: true,
        version: true,
        role: MachineRole::Worker,
        control_plane_config: true,
        api_server_certificate: true,
    };

    const CONTROL_PLANE: Capabilities = Capabilities {
        role: MachineRole::ControlPlane,
        ..ALL
    };

    fn cluster(config: Value) -> Value {
        json!({"clusterConfiguration": config})
    }

    #[test]
    fn control_plane_settings_go_in_place_on_a_control_plane_machine_only() {
        let cur = cluster(json!({
            "apiServer": {"extraArgs": [{"name": "audit-log-maxage", "value": "7"}], "certSANs": ["a.example"]},
            "etcd": {"local": {"imageTag": "3.6.4-0"}},
        }));
        let des = cluster(json!({
            "apiServer": {
                "extraArgs": [{"name": "audit-log-maxage", "value": "30"}],
                "extraVolumes": [{"name": "audit", "hostPath": "/var/log/audit", "mountPath": "/var/log/audit"}],
                "certSANs": ["a.example", "b.example"],
            },
            "controllerManager": {"extraArgs": [{"name": "v", "value": "2"}]},
            "scheduler": {"extraEnvs": [{"name": "GOGC", "value": "50"}]},
            "etcd": {"local": {"imageTag": "3.6.5-0", "extraArgs": [{"name": "quota-backend-bytes", "value": "8589934592"}]}},
        }));
        let c = cover_kubeadm(&cur, &des, CONTROL_PLANE, false);
        assert!(c.complete(), "{:?}", c.uncovered);
        assert_eq!(c.spec, des);
        assert!(c.disruptive);
        assert!(
            c.covered
                .contains(&"clusterConfiguration.apiServer.certSANs".to_string())
        );
        // A worker's KubeadmConfig: the same difference is not node work.
        let w = cover_kubeadm(&cur, &des, ALL, false);
        assert!(!w.complete());
        assert!(
            w.uncovered
                .iter()
                .all(|g| g.class == Class::FieldNotInPlace),
            "{:?}",
            w.uncovered
        );
        // A node whose agent cannot: named as what it lacks.
        let old = Capabilities {
            control_plane_config: false,
            api_server_certificate: false,
            ..CONTROL_PLANE
        };
        let o = cover_kubeadm(&cur, &des, old, false);
        assert_eq!(o.covered, Vec::<String>::new());
        assert!(
            o.uncovered
                .iter()
                .all(|g| g.class == Class::AgentCapability),
            "{:?}",
            o.uncovered
        );
        assert!(
            o.uncovered
                .iter()
                .any(|g| g.need == Some(Need::ApiServerCertificate))
        );
        assert!(
            o.uncovered
                .iter()
                .any(|g| g.need == Some(Need::ControlPlaneConfig))
        );
    }

    #[test]
    fn etcd_never_goes_backwards() {
        let tag = |t: &str| cluster(json!({"etcd": {"local": {"imageTag": t}}}));
        let c = cover_kubeadm(&tag("3.6.5-0"), &tag("3.5.21-0"), CONTROL_PLANE, false);
        assert_eq!(c.uncovered.len(), 1, "{:?}", c.uncovered);
        let gap = &c.uncovered[0];
        assert_eq!(gap.class, Class::Downgrade);
        assert_eq!(gap.field, "clusterConfiguration.etcd.local.imageTag");
        assert!(gap.why.contains("from 3.6.5-0 to 3.5.21-0"), "{gap}");
        assert!(gap.why.contains("cannot be downgraded"), "{gap}");
        assert_eq!(c.spec, tag("3.6.5-0"), "nothing copied");
        // Numeric order, the revision counts, and forward goes.
        assert!(cover_kubeadm(&tag("3.5.9-0"), &tag("3.5.21-0"), CONTROL_PLANE, false).complete());
        assert!(cover_kubeadm(&tag("3.6.5-0"), &tag("3.6.5-1"), CONTROL_PLANE, false).complete());
        assert!(!cover_kubeadm(&tag("3.6.5-1"), &tag("3.6.5-0"), CONTROL_PLANE, false).complete());
        let odd = cover_kubeadm(&tag("3.6.5-0"), &tag("latest"), CONTROL_PLANE, false);
        assert_eq!(
            odd.uncovered[0].class,
            Class::Downgrade,
            "{:?}",
            odd.uncovered
        );
        assert_eq!(etcd_version("v3.5.21"), Some((vec![3, 5, 21], 0)));
    }

    #[test]
    fn other_cluster_configuration_fields_roll_out_with_their_reason() {
        let cur = cluster(
            json!({"networking": {"podSubnet": "10.244.0.0/16"}, "apiServer": {"extraArgs": [{"name": "v", "value": "1"}], "certSANs": ["a", "b"]}}),
        );
        let des = cluster(
            json!({"networking": {"podSubnet": "10.245.0.0/16"}, "apiServer": {"extraArgs": [{"name": "v", "value": "1"}], "certSANs": ["a"]}, "imageRepository": "mirror.example"}),
        );
        let c = cover_kubeadm(&cur, &des, CONTROL_PLANE, false);
        let said: Vec<String> = c.uncovered.iter().map(ToString::to_string).collect();
        assert_eq!(said.len(), 3, "{said:?}");
        assert!(
            said.iter().any(|s| s.starts_with(
                "clusterConfiguration.networking.podSubnet (changes the cluster's networking"
            )),
            "{said:?}"
        );
        assert!(
            said.iter()
                .any(|s| s.starts_with("clusterConfiguration.apiServer.certSANs (drops b")),
            "{said:?}"
        );
        assert!(
            said.iter()
                .any(|s| s.starts_with("clusterConfiguration.imageRepository (is not one of")),
            "{said:?}"
        );
        // Removing the last covered setting: no record would change, so it rolls out.
        let cur = cluster(json!({"apiServer": {"extraArgs": [{"name": "v", "value": "1"}]}}));
        let c = cover_kubeadm(
            &cur,
            &cluster(json!({"apiServer": {}})),
            CONTROL_PLANE,
            false,
        );
        assert!(!c.complete());
        assert!(
            c.uncovered[0].why.contains("removes the last"),
            "{:?}",
            c.uncovered
        );
    }

    #[test]
    fn diff_escapes_and_never_adds_under_a_missing_parent() {
        let a = json!({"x": {"a/b": 1, "k": [1, 2]}, "gone": true});
        let b = json!({"x": {"a/b": 2, "k": [1, 2, 3], "new": {"deep": 1}}});
        let mut ops = Vec::new();
        diff("", &a, &b, &mut ops);
        assert!(ops.contains(&json!({"op": "replace", "path": "/x/a~1b", "value": 2})));
        assert!(ops.contains(&json!({"op": "replace", "path": "/x/k", "value": [1, 2, 3]})));
        assert!(ops.contains(&json!({"op": "add", "path": "/x/new", "value": {"deep": 1}})));
        assert!(ops.contains(&json!({"op": "remove", "path": "/gone"})));
    }

    #[test]
    fn dropped_files_need_prune_and_dropped_flags_roll_out() {
        let cur = json!({"files": [{"path": "/etc/a", "content": "1"}, {"path": "/etc/b", "content": "1"}]});
        let des = json!({"files": [{"path": "/etc/a", "content": "2"}]});
        assert!(cover_kubeadm(&cur, &des, ALL, false).complete());
        let no_prune = Capabilities {
            prune: false,
            ..ALL
        };
        let c = cover_kubeadm(&cur, &des, no_prune, false);
        assert!(!c.complete());
        assert!(
            c.uncovered[0].to_string().contains("/etc/b"),
            "{:?}",
            c.uncovered
        );

        let flags =
            |v: Value| json!({"joinConfiguration": {"nodeRegistration": {"kubeletExtraArgs": v}}});
        let cur = flags(json!([{"name": "max-pods", "value": "110"}, {"name": "v", "value": "2"}]));
        let des = flags(json!([{"name": "max-pods", "value": "150"}]));
        let c = cover_kubeadm(&cur, &des, ALL, false);
        assert!(!c.complete());
        assert!(
            c.uncovered[0].to_string().contains("drops v"),
            "{:?}",
            c.uncovered
        );
    }

    #[test]
    fn feature_gates_only_with_a_version_bump() {
        let cur = json!({"clusterConfiguration": {"featureGates": {"ControlPlaneKubeletLocalMode": true}}});
        let des = json!({"clusterConfiguration": {}});
        assert!(cover_kubeadm(&cur, &des, ALL, true).complete());
        assert!(!cover_kubeadm(&cur, &des, ALL, false).complete());
    }

    #[test]
    fn what_cannot_be_done_in_place_stays_different() {
        let cur = json!({"preKubeadmCommands": ["a"], "diskSetup": {}, "files": []});
        let des = json!({"preKubeadmCommands": ["b"], "diskSetup": {"partitions": []}, "files": [{"path": "/etc/x", "content": "", "contentFormat": "Template"}]});
        let c = cover_kubeadm(&cur, &des, ALL, false);
        assert_eq!(c.spec, cur);
        assert_eq!(c.uncovered.len(), 3, "{:?}", c.uncovered);
    }
}
