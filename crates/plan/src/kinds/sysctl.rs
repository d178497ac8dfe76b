//! `sysctl`: persisted as `/etc/sysctl.d/90-inplace-agent-<key>.conf` and applied live
//! through `<root>/proc/sys` when the root has one (a sandbox root has not: then the value
//! is persisted only, and the step says so).

use serde_json::{Map, Value, json};

use super::{Diff, Mutation, Node, Note, StepCtx};
use super::{Kind, Written};
use crate::parse::{Cx, check_sysctl_key, join};
use crate::{Disruption, NodePath, Owner, sysctl_segments};
use inplace_base::StepError;
use inplace_base::{ErrorKind, Existing, FileMeta};

/// `sysctl`: a kernel parameter, persisted and applied live.
#[derive(Debug, Clone, PartialEq)]
pub struct SysctlChange {
    /// Dotted key (`net.ipv4.ip_forward`), or slash-separated when a segment has dots.
    pub key: String,
    /// The value, as `sysctl` would write it.
    pub value: String,
}

/// The file that persists a `sysctl` change (`net.ipv4.ip_forward` →
/// `/etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf`).
pub fn sysctl_conf_path(key: &str) -> Result<NodePath, String> {
    let name = key.replace('/', ".");
    NodePath::parse(&format!("/etc/sysctl.d/90-inplace-agent-{name}.conf"))
        .map_err(|e| e.to_string())
}

/// The live file for a key.
pub fn proc_path(key: &str) -> Result<NodePath, String> {
    let segs = sysctl_segments(key)?;
    NodePath::parse(&format!("/proc/sys/{}", segs.join("/"))).map_err(|e| e.to_string())
}

/// The persisted file's content (pure).
pub fn conf_content(change: &SysctlChange) -> String {
    format!(
        "# Managed by inplace-agent; the next plan that sets this key overwrites it.\n{} = {}\n",
        change.key, change.value
    )
}

/// True when a live value already equals the desired one; the kernel prints multi-field
/// values separated by tabs (pure).
pub fn same_value(live: &str, desired: &str) -> bool {
    live.split_whitespace().eq(desired.split_whitespace())
}

fn has_proc_sys(node: &dyn Node) -> bool {
    node.dir_exists(&NodePath::parse("/proc/sys").expect("constant path"))
}

impl Kind for SysctlChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["key", "value"]);
        let key = cx.string(path, m, "key", true).map(str::to_string);
        if let Some(k) = &key {
            if let Err(e) = check_sysctl_key(k) {
                cx.err(join(path, "key"), e);
            } else {
                cx.claim(&join(path, "key"), format!("sysctl:{k}"), k, index);
                // The file that persists it, which another change must not write.
                if let Ok(conf) = sysctl_conf_path(k) {
                    cx.claim(
                        &join(path, "key"),
                        format!("path:{conf}"),
                        conf.as_str(),
                        index,
                    );
                }
            }
        }
        let value = match m.get("value") {
            None | Some(Value::Null) => {
                cx.err(join(path, "value"), "is required");
                None
            }
            Some(v) => cx.scalar(&join(path, "value"), v),
        };
        if let Some(v) = &value
            && (v.trim().is_empty() || v.contains('\n') || v.len() > 4096)
        {
            cx.err(
                join(path, "value"),
                "must be a non-empty single line of at most 4096 bytes",
            );
        }
        let key = key.filter(|k| check_sysctl_key(k).is_ok())?;
        Some(SysctlChange { key, value: value? })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        json!({"key": self.key, "value": self.value})
    }

    fn target(&self) -> String {
        self.key.clone()
    }

    fn restart_units(&self) -> Vec<String> {
        Vec::new()
    }

    fn restart_field(&self) -> Option<&'static str> {
        None
    }

    fn fed_units(&self) -> Vec<String> {
        Vec::new()
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
        sysctl_conf_path(&self.key)
            .into_iter()
            .map(|p| Written::replaces("key", p))
            .collect()
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        Disruption::None
    }

    fn needs_services(&self) -> bool {
        false
    }

    fn batchable(&self) -> bool {
        false
    }

    fn owner(&self) -> Option<&Owner> {
        None
    }

    fn preflight(&self, node: &dyn Node) -> Vec<(&'static str, String)> {
        if !has_proc_sys(node) {
            return Vec::new();
        }
        let path = match proc_path(&self.key) {
            Ok(p) => p,
            Err(e) => return vec![("key", e)],
        };
        match node.read_special(&path) {
            Ok(Some(_)) => Vec::new(),
            Ok(None) => vec![(
                "key",
                format!(
                    "the node's kernel has no sysctl {} ({path} does not exist)",
                    self.key
                ),
            )],
            Err(e) => vec![("key", e.detail)],
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

    fn diff(&self, node: &dyn Node, ctx: StepCtx) -> Result<Diff, StepError> {
        let invalid = |e: String| StepError::new(ErrorKind::Precondition, e);
        let conf = sysctl_conf_path(&self.key).map_err(invalid)?;
        let content = conf_content(self).into_bytes();
        let meta = FileMeta {
            mode: 0o644,
            uid: ctx.root_ids.0,
            gid: ctx.root_ids.1,
        };
        let mut mutations = Vec::new();
        let current_ok = matches!(node.read(&conf)?, Existing::File { content: c, meta: m } if c == content && m == meta);
        if !current_ok {
            mutations.push(Mutation::Write {
                path: conf,
                content: content.into(),
                meta,
            });
        }
        let note = if has_proc_sys(node) {
            let path = proc_path(&self.key).map_err(invalid)?;
            let live = node.read_special(&path)?.unwrap_or_default();
            if !same_value(&live, &self.value) {
                mutations.push(Mutation::SysctlLive {
                    path,
                    value: self.value.clone(),
                });
            }
            None
        } else {
            Some(format!(
                "persisted only: {} has no /proc/sys, so the value takes effect at the next boot",
                node.root_display()
            ))
        };
        Ok(Diff { mutations, note })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_values() {
        assert_eq!(
            sysctl_conf_path("net.ipv4.ip_forward").unwrap().as_str(),
            "/etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf"
        );
        assert_eq!(
            proc_path("net.ipv4.ip_forward").unwrap().as_str(),
            "/proc/sys/net/ipv4/ip_forward"
        );
        assert_eq!(
            proc_path("net/ipv4/conf/eth0.1/rp_filter")
                .unwrap()
                .as_str(),
            "/proc/sys/net/ipv4/conf/eth0.1/rp_filter"
        );
        assert!(same_value("32768\t60999\n", "32768 60999"));
        assert!(!same_value("1\n", "0"));
    }
}
