//! `kubeletConfig` (RFC 7386 merge patch onto `/var/lib/kubelet/config.yaml`) and
//! `kubeletFlags` (`KUBELET_KUBEADM_ARGS` in `/var/lib/kubelet/kubeadm-flags.env`).

use crate::base::FileMeta;
use std::collections::BTreeMap;

use serde_json::{Map, Value};
use serde_yaml_ng::Value as Yaml;

use super::{Diff, Mutation, StepError};
use crate::base::ErrorKind;
use crate::host::Host;
use crate::host::fs::Existing;
use crate::plan::{
    KUBEADM_FLAGS_PATH, KUBELET_CONFIG_PATH, KubeletConfigChange, KubeletFlagsChange, NodePath,
};

/// `/var/lib/kubelet/config.yaml`.
pub fn config_path() -> NodePath {
    NodePath::parse(KUBELET_CONFIG_PATH).expect("constant path")
}

/// `/var/lib/kubelet/kubeadm-flags.env`.
pub fn flags_path() -> NodePath {
    NodePath::parse(KUBEADM_FLAGS_PATH).expect("constant path")
}

/// Reads and parses the kubelet configuration; it must exist and be a YAML mapping.
pub fn read_config(host: &Host) -> Result<(Yaml, FileMeta), StepError> {
    let path = config_path();
    match host.root.read(&path)? {
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

fn json_to_yaml(v: &Value) -> Yaml {
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

/// Reads the node and diffs a `kubeletConfig` change.
pub fn diff_config(host: &Host, change: &KubeletConfigChange) -> Result<Diff, StepError> {
    let (doc, meta) = read_config(host)?;
    let text = patched_config(&doc, &change.merge_patch)
        .map_err(|e| StepError::new(ErrorKind::Internal, e))?;
    Ok(Diff {
        mutations: text
            .map(|t| Mutation::Write {
                path: config_path(),
                content: t.into_bytes(),
                meta,
            })
            .into_iter()
            .collect(),
        note: None,
    })
}

const ARGS_VAR: &str = "KUBELET_KUBEADM_ARGS";

/// One flag (or stray token) of `KUBELET_KUBEADM_ARGS`, kept as written unless changed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Token {
    /// Flag name without dashes; `None` for a token that is not a flag.
    name: Option<String>,
    /// The original words (`--a=b`, or `--a b`).
    words: Vec<String>,
}

fn tokenize(args: &str) -> Vec<Token> {
    let words: Vec<&str> = args.split_whitespace().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = words[i];
        if let Some(flag) = w.strip_prefix("--").or_else(|| w.strip_prefix('-')) {
            let (name, has_value) = match flag.split_once('=') {
                Some((n, _)) => (n, true),
                None => (flag, false),
            };
            let mut tok = vec![w.to_string()];
            if !has_value && words.get(i + 1).is_some_and(|n| !n.starts_with('-')) {
                tok.push(words[i + 1].to_string());
                i += 1;
            }
            out.push(Token {
                name: Some(name.to_string()),
                words: tok,
            });
        } else {
            out.push(Token {
                name: None,
                words: vec![w.to_string()],
            });
        }
        i += 1;
    }
    out
}

/// Sets and removes flags in the text of `kubeadm-flags.env`, keeping every other line, the
/// flags the change does not mention, and their order; new flags go at the end in name
/// order. `None` when nothing changes (pure).
pub fn edit_flags_env(
    text: Option<&str>,
    set: &BTreeMap<String, String>,
    remove: &[String],
) -> Option<String> {
    let text = text.unwrap_or("");
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let found = lines.iter().position(|l| {
        l.trim_start()
            .strip_prefix(ARGS_VAR)
            .is_some_and(|r| r.trim_start().starts_with('='))
    });
    let current = found
        .map(|i| {
            let l = &lines[i];
            let value = l.split_once('=').map(|(_, v)| v.trim()).unwrap_or("");
            value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .unwrap_or(value)
                .to_string()
        })
        .unwrap_or_default();
    let mut seen = std::collections::BTreeSet::new();
    let mut out: Vec<Token> = Vec::new();
    for tok in tokenize(&current) {
        match &tok.name {
            Some(name) if remove.contains(name) => {}
            Some(name) if set.contains_key(name) => {
                if seen.insert(name.clone()) {
                    out.push(Token {
                        name: Some(name.clone()),
                        words: vec![format!("--{name}={}", set[name])],
                    });
                }
            }
            _ => out.push(tok),
        }
    }
    for (name, value) in set {
        if !seen.contains(name) {
            out.push(Token {
                name: Some(name.clone()),
                words: vec![format!("--{name}={value}")],
            });
        }
    }
    let joined: Vec<String> = out.into_iter().flat_map(|t| t.words).collect();
    let line = format!("{ARGS_VAR}=\"{}\"", joined.join(" "));
    match found {
        Some(i) => {
            if lines[i] == line {
                return None;
            }
            if tokenize(&current)
                .into_iter()
                .flat_map(|t| t.words)
                .collect::<Vec<_>>()
                == joined
            {
                return None;
            }
            lines[i] = line;
        }
        None => {
            if set.is_empty() {
                return None;
            }
            lines.push(line);
        }
    }
    let mut result = lines.join("\n");
    result.push('\n');
    Some(result)
}

/// Reads the node and diffs a `kubeletFlags` change.
pub fn diff_flags(
    host: &Host,
    change: &KubeletFlagsChange,
    root_ids: (u32, u32),
) -> Result<Diff, StepError> {
    let path = flags_path();
    let (text, meta) = match host.root.read(&path)? {
        Existing::File { content, meta } => {
            (Some(String::from_utf8_lossy(&content).into_owned()), meta)
        }
        Existing::Absent => (
            None,
            FileMeta {
                mode: 0o644,
                uid: root_ids.0,
                gid: root_ids.1,
            },
        ),
        Existing::Other { kind } => {
            return Err(StepError::new(
                ErrorKind::Precondition,
                format!("{path} is a {kind} on the node, not a file"),
            ));
        }
    };
    let new = edit_flags_env(text.as_deref(), &change.set, &change.remove);
    Ok(Diff {
        mutations: new
            .map(|t| Mutation::Write {
                path,
                content: t.into_bytes(),
                meta,
            })
            .into_iter()
            .collect(),
        note: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KUBEADM_ENV: &str = "KUBELET_KUBEADM_ARGS=\"--container-runtime-endpoint=unix:///var/run/containerd/containerd.sock --pod-infra-container-image=registry.k8s.io/pause:3.9 --node-ip=10.0.0.5\"\n";

    fn set(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn flags_keep_order_and_unmentioned_flags() {
        let out = edit_flags_env(
            Some(KUBEADM_ENV),
            &set(&[("node-labels", "tier=web"), ("node-ip", "10.0.0.6")]),
            &["pod-infra-container-image".to_string()],
        )
        .unwrap();
        assert_eq!(
            out,
            "KUBELET_KUBEADM_ARGS=\"--container-runtime-endpoint=unix:///var/run/containerd/containerd.sock --node-ip=10.0.0.6 --node-labels=tier=web\"\n"
        );
        // Applying the same edit again changes nothing.
        assert_eq!(
            edit_flags_env(
                Some(&out),
                &set(&[("node-labels", "tier=web"), ("node-ip", "10.0.0.6")]),
                &["pod-infra-container-image".to_string()],
            ),
            None
        );
    }

    #[test]
    fn flags_file_missing_or_without_the_variable() {
        assert_eq!(
            edit_flags_env(None, &set(&[("v", "2")]), &[]).unwrap(),
            "KUBELET_KUBEADM_ARGS=\"--v=2\"\n"
        );
        assert_eq!(
            edit_flags_env(Some("# comment\nOTHER=1\n"), &set(&[("v", "2")]), &[]).unwrap(),
            "# comment\nOTHER=1\nKUBELET_KUBEADM_ARGS=\"--v=2\"\n"
        );
        assert_eq!(edit_flags_env(None, &set(&[]), &["v".into()]), None);
    }

    #[test]
    fn space_separated_values_are_understood() {
        let out = edit_flags_env(
            Some("KUBELET_KUBEADM_ARGS=\"--node-ip 10.0.0.5 --v=1\"\n"),
            &set(&[("v", "3")]),
            &["node-ip".into()],
        )
        .unwrap();
        assert_eq!(out, "KUBELET_KUBEADM_ARGS=\"--v=3\"\n");
    }

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
