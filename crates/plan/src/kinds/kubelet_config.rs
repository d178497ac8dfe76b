//! `kubeletConfig`: an RFC 7386 merge patch onto the kubelet configuration kubeadm wrote
//! (`/var/lib/kubelet/config.yaml`), keeping the order of its keys.

use serde_json::{Map, Value, json};
use serde_yaml_ng::Value as Yaml;

use super::{Diff, Mutation, Node, Note, StepCtx};
use super::{KUBELET_UNIT, Kind, Written};
use crate::parse::{Cx, join, type_name};
use crate::{Disruption, NodePath, Owner};
use inplace_base::StepError;
use inplace_base::{ErrorKind, Existing, FileMeta};

/// Where kubeadm keeps the kubelet configuration.
pub const KUBELET_CONFIG_PATH: &str = "/var/lib/kubelet/config.yaml";

/// `kubeletConfig`: an RFC 7386 merge patch onto `/var/lib/kubelet/config.yaml`.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeletConfigChange {
    /// The patch; always a JSON object.
    pub merge_patch: Map<String, Value>,
}

/// `/var/lib/kubelet/config.yaml`.
pub fn config_path() -> NodePath {
    NodePath::parse(KUBELET_CONFIG_PATH).expect("constant path")
}

/// Reads and parses the kubelet configuration; it must exist and be a YAML mapping.
pub fn read_config(node: &dyn Node) -> Result<(Yaml, FileMeta), StepError> {
    let path = config_path();
    match node.read(&path)? {
        Existing::File { content, meta } => {
            let doc: Yaml = serde_yaml_ng::from_slice(&content).map_err(|e| {
                StepError::new(
                    ErrorKind::Precondition,
                    format!("{path} on the node is not valid YAML: {e}"),
                )
            })?;
            if !doc.is_mapping() {
                return Err(StepError::new(
                    ErrorKind::Precondition,
                    format!("{path} on the node is not a YAML mapping"),
                ));
            }
            Ok((doc, meta))
        }
        Existing::Absent => Err(StepError::new(
            ErrorKind::Precondition,
            format!("{path} does not exist on this node (is it a kubeadm node?)"),
        )),
        Existing::Other { kind } => Err(StepError::new(
            ErrorKind::Precondition,
            format!("{path} is a {kind} on the node, not a file"),
        )),
    }
}

impl Kind for KubeletConfigChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["mergePatch"]);
        let field = join(path, "mergePatch");
        cx.claim(
            &field,
            format!("path:{KUBELET_CONFIG_PATH}"),
            KUBELET_CONFIG_PATH,
            index,
        );
        match m.get("mergePatch") {
            None | Some(Value::Null) => {
                cx.err(field, "is required");
                None
            }
            Some(Value::Object(patch)) => {
                let mut ok = true;
                for key in ["apiVersion", "kind"] {
                    if patch.contains_key(key) {
                        cx.err(
                            format!("{field}.{key}"),
                            "cannot be changed by a merge patch",
                        );
                        ok = false;
                    }
                }
                ok.then(|| KubeletConfigChange {
                    merge_patch: patch.clone(),
                })
            }
            Some(other) => {
                cx.err(
                    field,
                    format!(
                        "must be an object (an RFC 7386 merge patch), got {}",
                        type_name(other)
                    ),
                );
                None
            }
        }
    }

    fn canonical(&self, _bodies: bool) -> Value {
        json!({"mergePatch": self.merge_patch})
    }

    fn target(&self) -> String {
        KUBELET_CONFIG_PATH.to_string()
    }

    fn restart_units(&self) -> Vec<String> {
        vec![KUBELET_UNIT.to_string()]
    }

    fn restart_field(&self) -> Option<&'static str> {
        None
    }

    fn fed_units(&self) -> Vec<String> {
        vec![KUBELET_UNIT.to_string()]
    }

    fn run_state(&self) -> Option<(&str, super::UnitState)> {
        None
    }

    fn declared_disruption(&self) -> Option<Disruption> {
        None
    }

    fn fed_by(&self, other: &super::Change) -> bool {
        let _ = other;
        false
    }

    fn writes(&self) -> Vec<Written> {
        vec![Written::replaces("mergePatch", config_path())]
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        Disruption::Restart
    }

    fn needs_services(&self) -> bool {
        false
    }

    fn batchable(&self) -> bool {
        true
    }

    fn owner(&self) -> Option<&Owner> {
        None
    }

    fn preflight(&self, node: &dyn Node) -> Vec<(&'static str, String)> {
        match read_config(node) {
            Ok(_) => Vec::new(),
            Err(e) => vec![("mergePatch", e.detail)],
        }
    }

    fn prepare(
        &self,
        _node: &dyn Node,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<String>, StepError> {
        Ok(None)
    }

    fn undecided(&self, _node: &dyn Node) -> Option<String> {
        None
    }

    fn diff(&self, node: &dyn Node, _ctx: StepCtx) -> Result<Diff, StepError> {
        let (doc, meta) = read_config(node)?;
        let text = patched_config(&doc, &self.merge_patch)
            .map_err(|e| StepError::new(ErrorKind::Internal, e))?;
        Ok(Diff {
            mutations: text
                .map(|t| Mutation::Write {
                    path: config_path(),
                    content: t.into_bytes().into(),
                    meta,
                })
                .into_iter()
                .collect(),
            note: None,
        })
    }

    fn resolve(
        &self,
        _node: &dyn Node,
        _timeout: std::time::Duration,
        _refresh: bool,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<Option<String>>, StepError> {
        Ok(None)
    }

    fn resolved(&self, _value: &str) -> Option<super::Change> {
        None
    }

    fn set_members(&self) -> Vec<NodePath> {
        Vec::new()
    }
}

pub fn json_to_yaml(v: &Value) -> Yaml {
    match v {
        Value::Null => Yaml::Null,
        Value::Bool(b) => Yaml::Bool(*b),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Yaml::Number(u.into())
            } else if let Some(i) = n.as_i64() {
                Yaml::Number(i.into())
            } else {
                Yaml::Number(n.as_f64().unwrap_or(0.0).into())
            }
        }
        Value::String(s) => Yaml::String(s.clone()),
        Value::Array(a) => Yaml::Sequence(a.iter().map(json_to_yaml).collect()),
        Value::Object(m) => {
            let mut out = serde_yaml_ng::Mapping::new();
            for (k, v) in m {
                out.insert(Yaml::String(k.clone()), json_to_yaml(v));
            }
            Yaml::Mapping(out)
        }
    }
}

/// RFC 7386 merge patch applied to a YAML document, keeping the order of existing keys
/// (pure). `null` removes a key; objects merge recursively; anything else replaces.
pub fn merge_patch(target: &mut Yaml, patch: &Map<String, Value>) {
    if !target.is_mapping() {
        *target = Yaml::Mapping(serde_yaml_ng::Mapping::new());
    }
    let Yaml::Mapping(map) = target else {
        return;
    };
    for (key, value) in patch {
        let k = Yaml::String(key.clone());
        match value {
            Value::Null => {
                map.shift_remove(&k);
            }
            Value::Object(sub) => {
                let entry = map.entry(k).or_insert(Yaml::Null);
                merge_patch(entry, sub);
            }
            other => {
                map.insert(k, json_to_yaml(other));
            }
        }
    }
}

/// The new configuration text, or `None` when the patch changes nothing (pure).
pub fn patched_config(doc: &Yaml, patch: &Map<String, Value>) -> Result<Option<String>, String> {
    let mut merged = doc.clone();
    merge_patch(&mut merged, patch);
    if merged == *doc {
        return Ok(None);
    }
    serde_yaml_ng::to_string(&merged)
        .map(Some)
        .map_err(|e| format!("render kubelet configuration: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc7386_and_keeps_key_order() {
        let doc: Yaml = serde_yaml_ng::from_str(
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: 110\n\
             evictionHard:\n  memory.available: 100Mi\n  nodefs.available: 10%\nserializeImagePulls: true\n",
        )
        .unwrap();
        let patch = json!({"maxPods": 150, "evictionHard": {"nodefs.available": null, "imagefs.available": "15%"}, "serializeImagePulls": null});
        let out = patched_config(&doc, patch.as_object().unwrap())
            .unwrap()
            .unwrap();
        assert_eq!(
            out,
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: 150\n\
             evictionHard:\n  memory.available: 100Mi\n  imagefs.available: 15%\n"
        );
        let reparsed: Yaml = serde_yaml_ng::from_str(&out).unwrap();
        assert_eq!(
            patched_config(&reparsed, patch.as_object().unwrap()).unwrap(),
            None
        );
    }
}
