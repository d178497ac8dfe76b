//! The `controlPlane` gate (decision 0019) run by the real agent binary on a sandbox
//! control-plane node, against the stand-ins of `tests/support/control_plane.rs` served in
//! this process: an HTTPS API server with its own CA (`/readyz`, and the mirror pods at
//! `GET /api/v1/namespaces/kube-system/pods/<name>` in the wire shape the kubelet leaves
//! them, requiring a client certificate), and an etcd metrics listener (`/health`,
//! `/health?serializable=true`). The mirror pods' `config.hash` follows the manifest file in
//! the sandbox, as the kubelet's does, unless the stand-in is told to keep the old one.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::Value;

use crate::support::control_plane::{Behaviour, Standins, manifest, manifest_text};
use crate::support::{Node, text};

pub(crate) const NODE: &str = "cp-0";

/// A sandbox control-plane node with its PKI and stand-ins (`tests/support/control_plane.rs`).
pub(crate) struct ControlPlane {
    pub(crate) node: Node,
    behaviour: Arc<Behaviour>,
    pub(crate) api_port: u16,
    etcd_port: u16,
}

impl ControlPlane {
    pub(crate) fn new() -> ControlPlane {
        let node = Node::new();
        let s = Standins::install(node.root(), NODE, "127.0.0.1", "v1.35.2");
        ControlPlane {
            node,
            behaviour: s.behaviour,
            api_port: s.api_port,
            etcd_port: s.etcd_port,
        }
    }

    /// A plan that changes kube-apiserver's manifest (as `kubeadm upgrade node` does), gated.
    fn plan(&self, id: &str) -> PathBuf {
        let content = manifest_text("kube-apiserver", "v1.35.3");
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n  - file: {{path: \
             /etc/kubernetes/manifests/kube-apiserver.yaml, content: {content:?}, mode: \"0600\"}}\n\
             verify:\n  - controlPlane: {{nodeName: {NODE}, etcd: stacked, apiServer: \
             \"127.0.0.1:{}\", etcdMetrics: \"127.0.0.1:{}\", timeoutSeconds: 3, periodSeconds: 1}}\n",
            self.api_port, self.etcd_port
        );
        self.node
            .plan_file(&format!("{}.yaml", id.replace('/', "_")), &text)
    }

    fn apply(&self, id: &str) -> (Value, String) {
        let plan = self.plan(id);
        let out = self.node.agent(&[
            "apply",
            "--no-chroot",
            "--output",
            "json",
            plan.to_str().unwrap(),
        ]);
        let status: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("no status: {}", text(&out)));
        (status, text(&out))
    }

    fn apiserver_manifest(&self) -> String {
        std::fs::read_to_string(manifest(self.node.root(), "kube-apiserver")).unwrap()
    }
}

fn detail(status: &Value) -> String {
    status["error"]["detail"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_healthy_control_plane_passes_the_gate() {
    let cp = ControlPlane::new();
    let (status, out) = cp.apply("kube-system/cp-0@healthy");
    assert_eq!(status["phase"], "Succeeded", "{out}");
    assert!(cp.apiserver_manifest().contains("v1.35.3"));
    assert_eq!(
        cp.behaviour.anonymous_pod_reads.load(Ordering::SeqCst),
        0,
        "the mirror pods are read with the kubelet's credential"
    );
}

#[test]
fn an_api_server_that_stays_unready_fails_the_gate_and_rolls_back() {
    let cp = ControlPlane::new();
    cp.behaviour.readyz.store(503, Ordering::SeqCst);
    let (status, out) = cp.apply("kube-system/cp-0@unready");
    assert_eq!(status["phase"], "RolledBack", "{out}");
    assert_eq!(status["error"]["kind"], "verification", "{out}");
    assert!(
        status["error"]["step"]
            .as_str()
            .unwrap_or("")
            .contains("controlPlane"),
        "{status}"
    );
    let d = detail(&status);
    assert!(d.starts_with("kube-apiserver: "), "{d}");
    assert!(
        d.contains(&format!(
            "https://127.0.0.1:{}/readyz answered 503",
            cp.api_port
        )),
        "{d}"
    );
    assert!(d.contains("[-]etcd failed"), "{d}");
    assert!(
        cp.apiserver_manifest().contains("v1.35.2"),
        "manifest restored"
    );
}

#[test]
fn a_mirror_pod_on_the_old_manifest_fails_the_gate_and_rolls_back() {
    let cp = ControlPlane::new();
    cp.behaviour.frozen.store(true, Ordering::SeqCst);
    let (status, out) = cp.apply("kube-system/cp-0@stale");
    assert_eq!(status["phase"], "RolledBack", "{out}");
    let d = detail(&status);
    assert!(d.starts_with("kube-apiserver: mirror pod kube-system/kube-apiserver-cp-0 still runs the manifest from before the plan"), "{d}");
    assert!(d.contains("kubernetes.io/config.hash"), "{d}");
    assert!(
        cp.apiserver_manifest().contains("v1.35.2"),
        "manifest restored"
    );
}

#[test]
fn etcd_without_a_leader_fails_the_gate_and_rolls_back() {
    let cp = ControlPlane::new();
    cp.behaviour.etcd_leader.store(false, Ordering::SeqCst);
    let (status, out) = cp.apply("kube-system/cp-0@noleader");
    assert_eq!(status["phase"], "RolledBack", "{out}");
    let d = detail(&status);
    assert!(d.starts_with("etcd: the cluster has no leader"), "{d}");
    assert!(
        d.contains(&format!(
            "http://127.0.0.1:{}/health answered 503",
            cp.etcd_port
        )),
        "{d}"
    );
    assert!(d.contains("RAFT NO LEADER"), "{d}");
    assert!(
        cp.apiserver_manifest().contains("v1.35.2"),
        "manifest restored"
    );
}
