//! Kubernetes' version skew rules in the updater's in-place answers (issue 45): a worker
//! follows its control plane, a control-plane node moves at most one minor ahead of the
//! others, and no minor version is skipped. The versions are the live Machines' (the
//! control plane's from its cluster's live control-plane Machines), never the request's;
//! a refusal is said in the answer and the log with the reason class `skew`.

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::hooks::Hook;

const CONTROL_PLANE: &str = "cluster.x-k8s.io/control-plane";

/// A live control-plane Machine of the request's cluster whose node runs `version`.
fn control_plane_machine(name: &str, version: &str) -> Value {
    let mut m = machine(name, version, name, "10.0.0.9", false);
    m["metadata"]["labels"][CONTROL_PLANE] = json!("");
    m["status"]["nodeInfo"] = json!({"kubeletVersion": version});
    m
}

/// KubeadmControlPlane's request (v1.35.1 → `desired`) against a sandbox agent, with the
/// live Machine a worker or a control-plane Machine whose node runs v1.35.1.
async fn ask(w: &mut World, desired: &str, control_plane: bool) -> Value {
    let (mut req, mut live) = fixture_request_for_agent_0(w);
    req["desired"]["machine"]["spec"]["version"] = json!(desired);
    if control_plane {
        live["metadata"]["labels"][CONTROL_PLANE] = json!("");
    }
    w.api.put(live);
    let mut capi = w.client();
    capi.call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json()
}

fn refused_for_skew(v: &Value, words: &str) -> bool {
    v["status"] == "Success"
        && v.get("machinePatch").is_none()
        && v["message"].as_str().is_some_and(|m| m.contains(words))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_follows_its_control_plane_and_no_minor_is_skipped() {
    let mut w = World::new(231).await;
    w.add_agent("node-d", "v1.35.1");
    w.start_updater();
    w.api.put(control_plane_machine("cp-a", "v1.35.1"));
    w.api.put(control_plane_machine("cp-b", "v1.35.2"));

    // A worker to v1.35.2 while cp-a still runs v1.35.1: refused, naming cp-a.
    let v = ask(&mut w, "v1.35.2", false).await;
    assert!(
        refused_for_skew(
            &v,
            "newer than the control plane (Machine cp-a runs v1.35.1)"
        ),
        "{v}\n{}",
        w.updater_log()
    );
    assert!(
        w.updater_log_shows("skew"),
        "the log names the reason class: {}",
        w.updater_log()
    );

    // Once the whole control plane runs it, the worker may follow (the answer is then
    // about what the node can do, not about skew).
    w.api.put(control_plane_machine("cp-a", "v1.35.2"));
    let v = ask(&mut w, "v1.35.2", false).await;
    assert!(
        !v["message"]
            .as_str()
            .unwrap_or_default()
            .contains("control plane"),
        "{v}"
    );

    // Two minors at once: refused for any role, saying which minor to move to first.
    let v = ask(&mut w, "v1.37.0", true).await;
    assert!(
        refused_for_skew(
            &v,
            "skips v1.36; kubeadm upgrades one minor version at a time"
        ),
        "{v}"
    );
    // A minor downgrade: refused.
    let v = ask(&mut w, "v1.34.9", true).await;
    assert!(refused_for_skew(&v, "minor version downgrade"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_node_moves_at_most_one_minor_ahead_of_the_others() {
    let mut w = World::new(232).await;
    w.add_agent("node-d", "v1.35.1");
    w.start_updater();
    // The others: one already on v1.36, one still on v1.34 (a cluster mid-upgrade that
    // another tool left behind).
    w.api.put(control_plane_machine("cp-a", "v1.36.0"));
    w.api.put(control_plane_machine("cp-b", "v1.34.3"));
    let v = ask(&mut w, "v1.36.0", true).await;
    assert!(
        refused_for_skew(
            &v,
            "more than one minor version ahead of control-plane Machine cp-b (v1.34.3)"
        ),
        "{v}\n{}",
        w.updater_log()
    );
    // The request's own labels decide nothing: the same request about a live worker is
    // judged as a worker's (newer than cp-b, so refused with the worker's rule).
    let v = ask(&mut w, "v1.36.0", false).await;
    assert!(
        refused_for_skew(
            &v,
            "newer than the control plane (Machine cp-b runs v1.34.3)"
        ),
        "{v}"
    );
}
