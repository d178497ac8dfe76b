//! `kubeadmUpgradeNode`: runs `kubeadm upgrade node` in the node's root with the step timeout.
//!
//! It is an action, not a state, so "desired state" needs a definition. It **runs** when
//!
//! 1. an earlier change of the plan that feeds kubeadm changed the node in this run (or, in
//!    a dry run, would): a `package` named `kubeadm`, an `artifact` installed at a path whose
//!    file name is `kubeadm`, a `file`/`absent` at the `--config` file or under the
//!    `--patches` directory given in `extraArgs`, or a `file`/`absent` at the cluster
//!    configuration record [`CLUSTER_CONFIGURATION_RECORD`] ([`feeds`]); or
//! 2. the node shows a version bump that has not finished: the installed kubeadm
//!    (`kubeadm version -o short`) is newer than the kubelet (`kubelet --version`). In the
//!    upstream order (kubeadm, `kubeadm upgrade node`, then kubelet) that is exactly the state
//!    a failed or interrupted earlier attempt leaves behind, whose kubeadm package is
//!    already new and so does not change again.
//!
//! Otherwise it is **skipped** and reported unchanged. `kubeadm upgrade node` is idempotent,
//! so running it again after a crash in the middle is safe.
//!
//! It rewrites the kubelet configuration (workers) and the static pod manifests
//! (control-plane nodes); those files ([`REWRITES`]) are its pre-image, restored on
//! rollback. What else kubeadm does (certificate renewal, etcd upgrade on control-plane
//! nodes) is not undone.

use serde_json::{Map, Value, json};

use super::UpgradeNode;
use super::{Change, KUBELET_UNIT, Kind, Written};
use super::{Diff, Mutation, Node, Note, StepCtx};
use crate::parse::Cx;
use crate::{Disruption, NodePath, Owner};
use inplace_base::StepError;
use std::time::Duration;

/// `kubeadmUpgradeNode`: runs `kubeadm upgrade node`.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeadmUpgradeNodeChange {
    /// Extra arguments (for example `--patches DIR`).
    pub extra_args: Vec<String>,
}

/// Files `kubeadm upgrade node` may rewrite; backed up before it runs, restored on rollback.
pub const REWRITES: [&str; 7] = [
    "/var/lib/kubelet/config.yaml",
    "/var/lib/kubelet/kubeadm-flags.env",
    "/var/lib/kubelet/instance-config.yaml",
    "/etc/kubernetes/manifests/etcd.yaml",
    "/etc/kubernetes/manifests/kube-apiserver.yaml",
    "/etc/kubernetes/manifests/kube-controller-manager.yaml",
    "/etc/kubernetes/manifests/kube-scheduler.yaml",
];

/// The record of the control-plane configuration a node was last moved to: the covered part
/// of the cluster's `ClusterConfiguration` (API server, controller manager, scheduler and
/// local etcd flags, volumes, environment, etcd image tag) in canonical JSON, written by the
/// updater's plans for control-plane Machines before their `kubeadmUpgradeNode`.
///
/// kubeadm never reads it: `kubeadm upgrade node` reads the cluster's `kube-system/kubeadm-config`
/// ConfigMap, which KubeadmControlPlane moves before it touches any Machine. The record makes
/// that move a state of the node the agent can diff, journal, drift-check and roll back, and a
/// change of it is an input of `kubeadm upgrade node` ([`feeds`]): the static pod manifests are
/// regenerated exactly when the configuration they come from changed.
pub const CLUSTER_CONFIGURATION_RECORD: &str = "/etc/kubernetes/inplace/cluster-configuration.json";

/// The value of `--name` in `args` (`--name=v` or `--name v`).
pub fn arg_value<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Some(v);
        }
        if a == name {
            return it.next().map(String::as_str);
        }
    }
    None
}

/// Whether `change` is an input of `kubeadm upgrade node` as `k` runs it (pure): it installs
/// the kubeadm package, writes a binary named `kubeadm`, writes kubeadm's `--config` file or
/// a file under its `--patches` directory, or writes or removes the cluster configuration
/// record ([`CLUSTER_CONFIGURATION_RECORD`]) — whatever its kind.
pub fn feeds(change: &Change, k: &KubeadmUpgradeNodeChange) -> bool {
    let patches = arg_value(&k.extra_args, "--patches").and_then(|d| NodePath::parse(d).ok());
    let config = arg_value(&k.extra_args, "--config").and_then(|f| NodePath::parse(f).ok());
    let spec = change.spec();
    spec.packages().contains(&"kubeadm")
        || spec.writes().iter().any(|w| {
            let p = &w.path;
            (p.file_name() == "kubeadm" && !w.removes)
                || config.as_ref() == Some(p)
                || patches.as_ref().is_some_and(|d| p.starts_with(d) && p != d)
                || p.to_string() == CLUSTER_CONFIGURATION_RECORD
        })
}

/// `Kubernetes v1.31.2` → `v1.31.2` (pure).
pub fn parse_kubelet_version(out: &str) -> Option<String> {
    out.split_whitespace()
        .find(|w| w.starts_with('v') && w[1..].starts_with(|c: char| c.is_ascii_digit()))
        .map(str::to_string)
}

/// `v1.31.2`, `1.31.2-rc.0` → (1, 31, 2) (pure).
pub fn parse_kube_version(s: &str) -> Option<(u64, u64, u64)> {
    let s = s.trim();
    let s = s.strip_prefix('v').unwrap_or(s);
    let mut parts = s.splitn(3, '.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    let patch_text = parts.next()?;
    let digits: String = patch_text
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, minor, digits.parse().ok()?))
}

/// Whether a kubeadm at `kubeadm` next to a kubelet at `kubelet` is a version bump that has
/// not finished (kubeadm is newer) (pure).
pub fn upgrade_pending(kubeadm: &str, kubelet: &str) -> bool {
    match (parse_kube_version(kubeadm), parse_kube_version(kubelet)) {
        (Some(a), Some(b)) => a > b,
        _ => false,
    }
}

impl Kind for KubeadmUpgradeNodeChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["extraArgs"]);
        cx.claim(
            path,
            "kubeadm-upgrade-node".into(),
            "kubeadm upgrade node",
            index,
        );
        let extra_args = cx.string_list(path, m, "extraArgs")?;
        Some(KubeadmUpgradeNodeChange { extra_args })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        json!({"extraArgs": self.extra_args})
    }

    fn target(&self) -> String {
        "kubeadm upgrade node".to_string()
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
        feeds(other, self)
    }

    fn writes(&self) -> Vec<Written> {
        // What kubeadm rewrites is its own business (backed up, restored on rollback); the
        // plan's other changes may write those files too, so they are not claimed here.
        Vec::new()
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
        false
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
        let run = |reason: String| Diff {
            mutations: vec![Mutation::KubeadmUpgradeNode(UpgradeNode {
                args: self.extra_args.clone(),
                timeout: ctx.step_timeout,
                reason,
            })],
            note: None,
        };
        if let Some(j) = ctx.inputs_changed {
            return Ok(run(format!(
                "changes[{j}] changed an input of kubeadm in this run"
            )));
        }
        let budget = if ctx.step_timeout.is_zero() {
            Duration::from_secs(30)
        } else {
            ctx.step_timeout.min(Duration::from_secs(30))
        };
        let kubeadm = node.query_program(&["kubeadm", "version", "-o", "short"], budget);
        let kubelet = node
            .query_program(&["kubelet", "--version"], budget)
            .map(|out| parse_kubelet_version(&out).unwrap_or(out));
        if let (Ok(a), Ok(b)) = (&kubeadm, &kubelet)
            && upgrade_pending(a, b)
        {
            return Ok(run(format!(
                "kubeadm {a} is newer than the kubelet {b}: a version bump has not finished"
            )));
        }
        let seen = match (kubeadm, kubelet) {
            (Ok(a), Ok(b)) => format!("kubeadm {a}, kubelet {b}"),
            (Err(e), _) | (_, Err(e)) => e,
        };
        Ok(Diff {
            mutations: Vec::new(),
            note: Some(format!(
                "skipped: nothing kubeadm reads changed in this run and no version bump is \
                 pending ({seen})"
            )),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::inputs_changed;
    use crate::{Limits, Plan, parse_plan};

    fn plan(changes: &str) -> Plan {
        let text = format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: t\nchanges:\n{changes}");
        parse_plan(text.as_bytes(), "t", &Limits::default()).unwrap()
    }

    #[test]
    fn versions_are_compared_as_kubernetes_versions() {
        assert_eq!(parse_kube_version("v1.31.2"), Some((1, 31, 2)));
        assert_eq!(parse_kube_version("1.31.10-rc.0\n"), Some((1, 31, 10)));
        assert_eq!(parse_kube_version("Kubernetes v1.31.2"), None);
        assert!(upgrade_pending("v1.31.2", "v1.30.4"));
        assert!(upgrade_pending("v1.31.10", "v1.31.9"), "numeric, not text");
        assert!(!upgrade_pending("v1.31.2", "v1.31.2"));
        assert!(
            !upgrade_pending("v1.30.4", "v1.31.2"),
            "kubelet ahead: not ours"
        );
        assert!(!upgrade_pending("garbage", "v1.31.2"));
    }

    #[test]
    fn inputs_are_the_kubeadm_binary_its_config_and_patches() {
        let p = plan(
            "  - package: {name: kubeadm, version: 1.31.2-1.1}\n\
             \x20 - package: {name: kubectl, version: 1.31.2-1.1}\n\
             \x20 - artifact: {url: https://x/kubeadm, sha256: \"0000000000000000000000000000000000000000000000000000000000000000\", path: /usr/local/bin/kubeadm}\n\
             \x20 - file: {path: /etc/kubernetes/patches/kubeletconfiguration.yaml, content: x}\n\
             \x20 - file: {path: /etc/kubernetes/other.yaml, content: x}\n\
             \x20 - file: {path: /etc/kubernetes/upgrade.yaml, content: x}\n\
             \x20 - kubeadmUpgradeNode: {extraArgs: [--patches, /etc/kubernetes/patches, --config=/etc/kubernetes/upgrade.yaml]}\n\
             \x20 - package: {name: kubelet, version: 1.31.2-1.1}\n",
        );
        let Change::KubeadmUpgradeNode(k) = &p.changes[6] else {
            panic!()
        };
        let fed: Vec<bool> = p.changes.iter().map(|c| feeds(c, k)).collect();
        assert_eq!(fed, [true, false, true, true, false, true, false, false]);
        assert_eq!(inputs_changed(&p, 6, |_| true), Some(0));
        assert_eq!(inputs_changed(&p, 6, |j| j == 3 || j == 4), Some(3));
        assert_eq!(inputs_changed(&p, 6, |j| j == 1 || j == 4 || j == 7), None);
        assert_eq!(
            inputs_changed(&p, 0, |_| true),
            None,
            "not a kubeadm change"
        );

        let plain = KubeadmUpgradeNodeChange { extra_args: vec![] };
        assert!(
            !feeds(&p.changes[3], &plain),
            "no --patches: files are not inputs"
        );
    }

    #[test]
    fn the_cluster_configuration_record_feeds_kubeadm_and_a_file_beside_it_does_not() {
        let p = plan(&format!(
            "  - file: {{path: {CLUSTER_CONFIGURATION_RECORD}, content: \"{{}}\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/inplace/other.json, content: x}}\n\
             \x20 - kubeadmUpgradeNode: {{}}\n"
        ));
        let Change::KubeadmUpgradeNode(k) = &p.changes[2] else {
            panic!()
        };
        let fed: Vec<bool> = p.changes.iter().map(|c| feeds(c, k)).collect();
        assert_eq!(fed, [true, false, false]);
        assert_eq!(inputs_changed(&p, 2, |j| j == 0), Some(0));
        assert_eq!(inputs_changed(&p, 2, |j| j == 1), None);
        // Removing the record (an `absent` change) is a change of kubeadm's input too.
        let p = plan(&format!(
            "  - absent: {{path: {CLUSTER_CONFIGURATION_RECORD}}}\n\
             \x20 - kubeadmUpgradeNode: {{}}\n"
        ));
        let Change::KubeadmUpgradeNode(k) = &p.changes[1] else {
            panic!()
        };
        assert!(feeds(&p.changes[0], k));
    }
}
