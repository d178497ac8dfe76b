//! The updater's side of the `controlPlane` gate (decision 0019): which plans carry it (a
//! control-plane Machine's plan that restarts a control-plane component, the role read from
//! the live Machine), what it says, and `CanUpdateMachine`'s `affectsAvailability` for them.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_plan::{EtcdTopology, Probe};
use inplace_updater::hooks::Hook;
use inplace_updater::settings::{Defaults, Settings};
use inplace_updater::translate::{
    Desired, MachineRole, NoSecrets, NodeFacts, restarts_control_plane, translate_for,
};

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/updater")
        .join(name);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn settings() -> Settings {
    Settings::defaults(&Defaults::default())
}

/// The desired control-plane Machine and KubeadmConfig of KCP's request fixture (a version
/// bump, v1.35.1 → v1.35.2).
fn control_plane_objects() -> (Value, Value) {
    let req = fixture("can-update-machine-request.json");
    (
        req["desired"]["machine"].clone(),
        req["desired"]["bootstrapConfig"].clone(),
    )
}

fn gates(verify: &[inplace_plan::Check]) -> Vec<&'static str> {
    verify.iter().map(|c| c.probe.key()).collect()
}

#[test]
fn a_control_plane_version_bump_ends_with_the_control_plane_gate_and_a_worker_does_not() {
    let (machine, bootstrap) = control_plane_objects();
    let desired = Desired {
        machine: &machine,
        infrastructure: None,
        bootstrap: Some(&bootstrap),
    };
    let node = NodeFacts::assumed("cp-0");
    let s = settings();
    let t = translate_for(
        &desired,
        MachineRole::ControlPlane,
        &s,
        &node,
        &NoSecrets,
        &[],
    )
    .unwrap();
    assert!(t.restarts_control_plane);
    assert!(restarts_control_plane(&t.plan));
    assert_eq!(
        gates(&t.plan.verify),
        ["unitActive", "httpGet", "kubeletVersion", "controlPlane"]
    );
    let Probe::ControlPlane(g) = &t.plan.verify[3].probe else {
        panic!("{:?}", t.plan.verify[3]);
    };
    assert_eq!(g.node_name, "cp-0");
    assert_eq!(g.etcd, EtcdTopology::Stacked);
    assert_eq!(
        g.components,
        [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler"
        ]
    );
    assert!(t.plan.verify[3].timeout.as_secs() >= 300);

    // The same desired state for a Machine the live objects call a worker: no gate.
    let w = translate_for(&desired, MachineRole::Worker, &s, &node, &NoSecrets, &[]).unwrap();
    assert!(!w.restarts_control_plane);
    assert_eq!(
        gates(&w.plan.verify),
        ["unitActive", "httpGet", "kubeletVersion"]
    );

    // External etcd: no etcd member or pod to check on the node.
    let mut external = bootstrap.clone();
    external["spec"]["clusterConfiguration"]["etcd"] =
        json!({"external": {"endpoints": ["https://10.0.0.5:2379"]}});
    let desired = Desired {
        bootstrap: Some(&external),
        ..desired
    };
    let t = translate_for(
        &desired,
        MachineRole::ControlPlane,
        &s,
        &node,
        &NoSecrets,
        &[],
    )
    .unwrap();
    let Some(Probe::ControlPlane(g)) = t.plan.verify.last().map(|c| &c.probe) else {
        panic!("{:?}", t.plan.verify);
    };
    assert_eq!(g.etcd, EtcdTopology::External);
    assert!(!g.components.iter().any(|c| c == "etcd"), "{g:?}");
}

#[test]
fn a_file_only_control_plane_plan_has_no_gate_but_a_manifest_file_does() {
    let (mut machine, mut bootstrap) = control_plane_objects();
    // No version bump (the node's kubelet already runs it): files only.
    machine["spec"].as_object_mut().unwrap().remove("version");
    bootstrap["spec"]["joinConfiguration"]["nodeRegistration"]
        .as_object_mut()
        .unwrap()
        .remove("kubeletExtraArgs");
    let node = NodeFacts::assumed("cp-0");
    let s = settings();
    let desired = Desired {
        machine: &machine,
        infrastructure: None,
        bootstrap: Some(&bootstrap),
    };
    let t = translate_for(
        &desired,
        MachineRole::ControlPlane,
        &s,
        &node,
        &NoSecrets,
        &[],
    )
    .unwrap();
    assert!(!t.restarts_control_plane);
    assert!(gates(&t.plan.verify).is_empty(), "{:?}", t.plan.verify);

    // A file that is a static pod manifest restarts a component: gated.
    let mut with_manifest = bootstrap.clone();
    with_manifest["spec"]["files"]
        .as_array_mut()
        .unwrap()
        .push(json!({"path": "/etc/kubernetes/manifests/kube-vip.yaml", "content": "apiVersion: v1\nkind: Pod\n"}));
    let desired = Desired {
        bootstrap: Some(&with_manifest),
        ..desired
    };
    let t = translate_for(
        &desired,
        MachineRole::ControlPlane,
        &s,
        &node,
        &NoSecrets,
        &[],
    )
    .unwrap();
    assert!(t.restarts_control_plane);
    assert_eq!(gates(&t.plan.verify), ["controlPlane"]);
}

#[test]
fn an_agent_without_the_gate_is_refused_for_a_control_plane_restart() {
    let (machine, bootstrap) = control_plane_objects();
    let desired = Desired {
        machine: &machine,
        infrastructure: None,
        bootstrap: Some(&bootstrap),
    };
    let mut node = NodeFacts::assumed("cp-0");
    node.check_kinds.retain(|k| k != "controlPlane");
    let e = translate_for(
        &desired,
        MachineRole::ControlPlane,
        &settings(),
        &node,
        &NoSecrets,
        &[],
    )
    .unwrap_err();
    assert!(
        e.message
            .contains("the agent on node cp-0 cannot prove a control-plane node healthy"),
        "{e}"
    );
    // A worker's plan does not need it.
    translate_for(
        &desired,
        MachineRole::Worker,
        &settings(),
        &node,
        &NoSecrets,
        &[],
    )
    .unwrap();
}

#[test]
fn the_role_is_the_label_or_a_kubeadm_control_plane_owner() {
    let (machine, _) = control_plane_objects();
    assert_eq!(MachineRole::of(&machine), MachineRole::ControlPlane);
    let worker = machine_fixture_worker();
    assert_eq!(MachineRole::of(&worker), MachineRole::Worker);
    let mut owned = worker.clone();
    owned["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "controlplane.cluster.x-k8s.io/v1beta2", "kind": "KubeadmControlPlane",
        "name": "capi-quickstart-control-plane", "uid": "u", "controller": true
    }]);
    assert_eq!(MachineRole::of(&owned), MachineRole::ControlPlane);
}

fn machine_fixture_worker() -> Value {
    fixture("update-machine-request.json")["desired"]["machine"].clone()
}

/// `affectsAvailability` follows the live Machine: the same request (KCP's, whose Machine is
/// labelled control-plane) answers `true` without a drain when the live Machine is a
/// control-plane Machine, and leaves it unset (as for any kubelet restart without a drain)
/// when the live Machine is a worker: the request's labels decide nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn can_update_machine_says_a_control_plane_restart_affects_availability() {
    let mut w = World::new(219).await;
    let a = w.add_agent("node-d", "v1.35.1");
    // KCP's certSANs are on the node's serving certificate, as kubeadm left them.
    crate::support::pki::control_plane_serving_certificate(
        &w.agents[a].root,
        &["localhost", "127.0.0.1"],
    );
    w.start_updater();
    let mut capi = w.client();
    let mut req: Value = can_update_machine_request();
    req["settings"]["agentPort"] = json!(w.agent_port.to_string());
    req["settings"]["drain"] = json!("Never");
    // The sandbox node has no package manager (the version is not covered): the plan's
    // control-plane restart is a static pod manifest among the files.
    for side in ["current", "desired"] {
        req[side]["bootstrapConfig"]["spec"]["files"][0]["path"] =
            json!("/etc/kubernetes/manifests/kube-vip.yaml");
    }
    let name = req["desired"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = machine(&name, "v1.35.2", "node-d", &w.agents[0].ip, true);
    live["spec"] = req["desired"]["machine"]["spec"].clone();
    live["metadata"]["labels"]["cluster.x-k8s.io/control-plane"] = json!("");
    w.api.put(live.clone());
    let v = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}\n{}", w.updater_log());
    assert_eq!(v["affectsAvailability"], true, "{v}");

    live["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("cluster.x-k8s.io/control-plane");
    w.api.put(live.clone());
    let v = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    assert!(v.get("affectsAvailability").is_none(), "{v}");

    // A control-plane Machine whose manifest is already what the plan writes: the plan
    // carries the file (every file of the KubeadmConfig), but nothing under the manifests
    // would change, so nothing restarts and KCP need not surge.
    live["metadata"]["labels"]["cluster.x-k8s.io/control-plane"] = json!("");
    w.api.put(live);
    let content = req["desired"]["bootstrapConfig"]["spec"]["files"][0]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let manifest = w.agents[a]
        .root
        .join("etc/kubernetes/manifests/kube-vip.yaml");
    std::fs::create_dir_all(manifest.parent().unwrap()).unwrap();
    std::fs::write(&manifest, content).unwrap();
    std::fs::set_permissions(&manifest, std::fs::Permissions::from_mode(0o644)).unwrap();
    let v = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    assert_ne!(
        v.get("affectsAvailability"),
        Some(&json!(true)),
        "the manifest is in place already: {v}\n{}",
        w.updater_log()
    );
}
