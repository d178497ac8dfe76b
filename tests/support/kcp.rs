//! What the emulated KubeadmControlPlane tests share (`tests/it/updater_kcp_flow.rs`,
//! `tests/it/updater_kcp_packages.rs`): KCP's request shapes and reading a node's last plan.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use super::updater::BOOTSTRAP_TOKEN;

/// KCP's `clusterConfiguration.apiServer.certSANs` (the quickstart's).
pub const CERT_SANS: [&str; 2] = ["localhost", "127.0.0.1"];

/// KCP's `kubeadmConfigSpec` with `files`: the quickstart's certSANs, an external etcd (the
/// stacked checks use kubeadm's fixed metrics port, which a test cannot own), a control-plane
/// join with one kubelet flag.
pub fn control_plane_spec(files: Value) -> Value {
    json!({
        "clusterConfiguration": {
            "apiServer": {"certSANs": CERT_SANS},
            "etcd": {"external": {"endpoints": ["https://10.0.0.5:2379"], "caFile": "/etc/kubernetes/pki/etcd/ca.crt", "certFile": "/etc/kubernetes/pki/apiserver-etcd-client.crt", "keyFile": "/etc/kubernetes/pki/apiserver-etcd-client.key"}},
        },
        "joinConfiguration": {
            "controlPlane": {},
            "nodeRegistration": {"kubeletExtraArgs": [{"name": "max-pods", "value": "150"}]},
        },
        "files": files,
    })
}

/// `machine` labelled and owned as KCP makes its Machines, its node reporting `running`.
pub fn owned_by_kcp(mut machine: Value, running: &str) -> Value {
    machine["metadata"]["labels"]["cluster.x-k8s.io/control-plane"] = json!("");
    machine["metadata"]["labels"]["cluster.x-k8s.io/control-plane-name"] =
        json!("capi-quickstart-control-plane");
    machine["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "controlplane.cluster.x-k8s.io/v1beta2", "kind": "KubeadmControlPlane",
        "name": "capi-quickstart-control-plane", "uid": "kcp-uid", "controller": true}]);
    machine["status"]["nodeInfo"] = json!({"kubeletVersion": running});
    machine
}

/// The bootstrap's join data as the live KubeadmConfig holds it; KCP's request drops it
/// (`PrepareKubeadmConfigsForDiff`).
pub fn with_discovery(mut spec: Value) -> Value {
    spec["joinConfiguration"]["discovery"] = json!({"bootstrapToken": {
        "apiServerEndpoint": "10.0.0.1:6443", "token": BOOTSTRAP_TOKEN}});
    spec
}

/// `cleanupMachine` of `inplace_canupdatemachine.go`: name, namespace, labels, annotations,
/// spec (Go's json.Marshal leaves empty ones out: omitempty).
pub fn for_request(o: &Value) -> Value {
    let mut metadata = serde_json::Map::new();
    for key in ["name", "namespace", "labels", "annotations"] {
        if let Some(v) = o["metadata"]
            .get(key)
            .filter(|v| !v.is_null() && v.as_object().is_none_or(|m| !m.is_empty()))
        {
            metadata.insert(key.into(), v.clone());
        }
    }
    json!({"kind": o["kind"], "apiVersion": o["apiVersion"], "metadata": metadata, "spec": o["spec"]})
}

/// The most recent plan of the agent whose root is `root`, as its status socket serves it;
/// `None` when the node has had none.
pub fn last_run(root: &Path) -> Option<Value> {
    let socket = root.join("run/inplace-agent/status.sock");
    let get = |path: &str| -> Value {
        let got = inplace_agent::status::client::get(&socket, path, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("the agent's status {path}: {e}"));
        serde_json::from_slice(&got.body).unwrap()
    };
    let status = get("/v1/status");
    let id = status["recent"][0]["id"].as_str()?;
    let encoded: String = id
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    Some(get(&format!("/v1/plans/{encoded}")))
}

/// The gate of `kind` (`controlPlane`, `kubeletVersion` …) of a plan document.
pub fn gate(run: &Value, kind: &str) -> Value {
    run["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["kind"] == kind))
        .cloned()
        .unwrap_or_else(|| panic!("no {kind} gate: {run:#}"))
}
