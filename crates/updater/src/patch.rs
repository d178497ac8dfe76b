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
//! Never covered: diskSetup, mounts, format, ignition, users, ntp, boot/pre/post kubeadm
//! commands, the node name, `contentFormat: Template` files, InfraMachine changes.

use serde_json::{Map, Value, json};

use super::translate::{
    Capabilities, FEATURE_GATES, KUBELET_ARGS, NO_NODE_WORK, kubelet_args, lookup,
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
    /// A covered change restarts the kubelet (version, flags): it affects availability.
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
    };

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
