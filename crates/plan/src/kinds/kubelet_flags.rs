//! `kubeletFlags`: flags set or removed in `KUBELET_KUBEADM_ARGS` of
//! `/var/lib/kubelet/kubeadm-flags.env`, keeping every other flag and its order.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::{Diff, Mutation, Node, Note, StepCtx};
use super::{KUBELET_UNIT, Kind, Written};
use crate::parse::{Cx, check_flag_name, check_flag_value, join, type_name};
use crate::{Disruption, NodePath, Owner};
use inplace_base::StepError;
use inplace_base::{ErrorKind, Existing, FileMeta};

/// Where kubeadm keeps the kubelet's command-line flags.
pub const KUBEADM_FLAGS_PATH: &str = "/var/lib/kubelet/kubeadm-flags.env";

/// `kubeletFlags`: flags set or removed in `KUBELET_KUBEADM_ARGS`.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeletFlagsChange {
    /// Flag name (without dashes) → value.
    pub set: BTreeMap<String, String>,
    /// Flag names (without dashes) to remove.
    pub remove: Vec<String>,
}

/// `/var/lib/kubelet/kubeadm-flags.env`.
pub fn flags_path() -> NodePath {
    NodePath::parse(KUBEADM_FLAGS_PATH).expect("constant path")
}

impl Kind for KubeletFlagsChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["set", "remove"]);
        cx.claim(
            path,
            format!("path:{KUBEADM_FLAGS_PATH}"),
            KUBEADM_FLAGS_PATH,
            index,
        );
        let set_field = join(path, "set");
        let mut ok = true;
        let mut set = BTreeMap::new();
        match m.get("set") {
            None | Some(Value::Null) => {}
            Some(Value::Object(entries)) => {
                for (name, value) in entries {
                    let field = format!("{set_field}[{name:?}]");
                    if let Err(e) = check_flag_name(name) {
                        cx.err(&field, e);
                        ok = false;
                        continue;
                    }
                    match cx.scalar(&field, value) {
                        Some(v) => match check_flag_value(&v) {
                            Ok(()) => {
                                set.insert(name.clone(), v);
                            }
                            Err(e) => {
                                cx.err(&field, e);
                                ok = false;
                            }
                        },
                        None => ok = false,
                    }
                }
            }
            Some(other) => {
                cx.err(
                    set_field,
                    format!("must be an object of flag: value, got {}", type_name(other)),
                );
                ok = false;
            }
        }
        let remove = cx.string_list(path, m, "remove");
        if let Some(remove) = &remove {
            for (i, name) in remove.iter().enumerate() {
                let field = format!("{path}.remove[{i}]");
                if let Err(e) = check_flag_name(name) {
                    cx.err(field, e);
                    ok = false;
                } else if set.contains_key(name) {
                    cx.err(field, format!("flag {name:?} is both set and removed"));
                    ok = false;
                }
            }
        }
        let mut remove = remove?;
        remove.sort();
        remove.dedup();
        ok.then_some(KubeletFlagsChange { set, remove })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        json!({"set": self.set, "remove": self.remove})
    }

    fn target(&self) -> String {
        KUBEADM_FLAGS_PATH.to_string()
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
        vec![Written::replaces("set", flags_path())]
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

    fn preflight(&self, _node: &dyn Node) -> Vec<(&'static str, String)> {
        Vec::new()
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

    fn diff(&self, node: &dyn Node, ctx: StepCtx) -> Result<Diff, StepError> {
        let path = flags_path();
        let (text, meta) = match node.read(&path)? {
            Existing::File { content, meta } => {
                (Some(String::from_utf8_lossy(&content).into_owned()), meta)
            }
            Existing::Absent => (
                None,
                FileMeta {
                    mode: 0o644,
                    uid: ctx.root_ids.0,
                    gid: ctx.root_ids.1,
                },
            ),
            Existing::Other { kind } => {
                return Err(StepError::new(
                    ErrorKind::Precondition,
                    format!("{path} is a {kind} on the node, not a file"),
                ));
            }
        };
        let new = edit_flags_env(text.as_deref(), &self.set, &self.remove);
        Ok(Diff {
            mutations: new
                .map(|t| Mutation::Write {
                    path,
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

/// The flags of `KUBELET_KUBEADM_ARGS` in the text of `kubeadm-flags.env`, by name (a flag
/// without a value maps to `""`; the last of a repeated flag wins, as for the kubelet).
pub fn current_flags(text: &str) -> BTreeMap<String, String> {
    let Some(value) = text.lines().find_map(|l| {
        l.trim_start()
            .strip_prefix(ARGS_VAR)
            .and_then(|r| r.trim_start().strip_prefix('='))
    }) else {
        return BTreeMap::new();
    };
    let value = value.trim();
    let value = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
        .unwrap_or(value);
    tokenize(value)
        .into_iter()
        .filter_map(|t| {
            let name = t.name?;
            let first = &t.words[0];
            let v = match first.split_once('=') {
                Some((_, v)) => v.to_string(),
                None => t.words.get(1).cloned().unwrap_or_default(),
            };
            Some((name, v))
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
