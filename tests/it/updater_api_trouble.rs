//! A read of the management cluster that fails for a moment decides nothing (decision
//! 0023): the stand-in API server answers `503 ServiceUnavailable` to chosen reads, as a
//! real one does while its etcd has no leader. `CanUpdateMachine` then answers Failure —
//! Cluster API decides nothing and asks again — where a Success without patches would have
//! had the Machine replaced; `UpdateMachine` answers a wait where a Failure would have
//! marked the Machine's in-place update failed. The real `inplace-updater serve` and agent.

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::hooks::Hook;

const CONTROL_PLANE: &str = "cluster.x-k8s.io/control-plane";

fn nothing_decided(v: &Value, name: &str) -> bool {
    v["status"] == "Failure"
        && v["message"].as_str().is_some_and(|m| {
            m.contains(&format!("Machine default/{name}"))
                && m.contains(
                    "nothing decided: the management cluster's API server did not answer a read (",
                )
                && m.contains("ServiceUnavailable")
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn can_update_machine_decides_nothing_while_a_read_fails() {
    let mut w = World::new(203).await;
    w.add_agent("node-d", "v1.35.1");
    w.start_updater();
    let (req, live) = fixture_request_for_agent_0(&w);
    let name = live["metadata"]["name"].as_str().unwrap().to_owned();
    w.api.put(live);
    // The whole control plane already runs v1.35.2: the worker may follow.
    let mut cp = machine("cp-a", "v1.35.2", "cp-a", "10.0.0.9", false);
    cp["metadata"]["labels"][CONTROL_PLANE] = json!("");
    cp["status"]["nodeInfo"] = json!({"kubeletVersion": "v1.35.2"});
    w.api.put(cp);
    let mut capi = w.client();
    let mut ask = async || {
        capi.call(Hook::CanUpdateMachine, &go_json(&req))
            .await
            .unwrap()
            .json()
    };

    // The live Machine cannot be read.
    w.api.unavailable_for(&format!("/machines/{name}"), 1);
    let v = ask().await;
    assert!(nothing_decided(&v, &name), "{v}\n{}", w.updater_log());
    assert!(v.get("machinePatch").is_none(), "{v}");

    // The control plane's Machines (the version skew rules) cannot be listed.
    w.api.unavailable_for("labelSelector", 1);
    let v = ask().await;
    assert!(nothing_decided(&v, &name), "{v}\n{}", w.updater_log());

    // The API server answers again: the answer is the node's (the sandbox node has no
    // package manager, so the version is left to a rollout — a decision, said as one).
    let v = ask().await;
    assert_eq!(v["status"], "Success", "{v}\n{}", w.updater_log());
    assert!(
        w.updater_log_shows("failed transiently"),
        "the log says why nothing was decided: {}",
        w.updater_log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_machine_waits_while_a_read_fails() {
    let mut w = World::new(204).await;
    w.add_agent("node-0", "v1.35.2");
    w.start_updater();
    let settings = json!({"agentPort": w.agent_port.to_string(), "drain": "Never"});
    let (machine, config) = w.put_machine(
        "md-0-0",
        0,
        "v1.35.2",
        bootstrap_spec(json!([
            {"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=v2\n"}])),
    );
    let body = update_request(&machine, Some(&config), settings);
    let mut capi = w.client();
    for read in ["/machines/md-0-0", "/kubeadmconfigs/md-0-0"] {
        w.api.unavailable_for(read, 1);
        let v = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
        assert_eq!(v["status"], "Success", "{read}: {v}\n{}", w.updater_log());
        assert_eq!(v["retryAfterSeconds"], 5, "{read}: {v}");
        let message = v["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with("waiting: Machine default/md-0-0: the management cluster's API server did not answer a read")
                && message.contains("did not answer a read (get ")
                && message.contains("ServiceUnavailable"),
            "{read}: {v}"
        );
        assert!(
            !w.agents[0]
                .root
                .join("etc/kubernetes/inplace-demo.conf")
                .exists(),
            "nothing was started on the node"
        );
    }
    // Then the update goes on as if nothing happened.
    let seen = poll_update(&mut capi, &body, 0.01).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Success", "{seen:?}\n{}", w.updater_log());
    assert_eq!(last["retryAfterSeconds"], 0, "{seen:?}");
    assert_eq!(
        std::fs::read_to_string(w.agents[0].root.join("etc/kubernetes/inplace-demo.conf")).unwrap(),
        "mode=v2\n"
    );
}
