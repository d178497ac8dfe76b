//! Drift seen from the updater (crates/updater/src/drift.rs): `UpdateMachine` for a desired
//! state whose plan already succeeded on a node that has drifted from it since repairs the
//! node (a new attempt of the plan) instead of answering done. The real `inplace-updater
//! serve` binary, a real agent, the stand-in Kubernetes API.

use std::time::Duration;

use serde_json::json;

use crate::support::patience::eventually;
use crate::support::updater::*;
use inplace_updater::hooks::Hook;

const FILE: &str = "/etc/kubernetes/inplace-demo.conf";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_machine_repairs_a_node_that_drifted_from_the_plan_that_succeeded() {
    let mut w = World::new(37).await;
    let i = w.add_agent("node-d", "v1.35.3");
    w.start_updater();
    let mut capi = w.client();
    let (machine, config) = w.put_machine(
        "drift-0",
        i,
        "v1.35.3",
        bootstrap_spec(json!([{"path": FILE, "content": "desired\n"}])),
    );
    let settings = json!({"agentPort": w.agent_port.to_string(), "updateWaitSeconds": "0"});
    let body = update_request(&machine, Some(&config), settings);
    let seen = poll_update(&mut capi, &body, 0.05).await;
    let done = seen.last().unwrap();
    assert_eq!(
        (done["status"].as_str(), done["retryAfterSeconds"].as_i64()),
        (Some("Success"), Some(0)),
        "{seen:?}"
    );
    let path = w.agents[i].root.join(FILE.trim_start_matches('/'));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "desired\n");

    // Edited by hand: the agent reports drift (its journal says so).
    std::fs::write(&path, "edited by hand\n").unwrap();
    let journal = inplace_agent::journal::file_path(&w.dir.path().join("state-node-d"));
    eventually("the agent journals the drift", || {
        std::fs::read_to_string(&journal)
            .ok()?
            .contains("\"driftFound\"")
            .then_some(())
    });

    // CanUpdateMachine says so in its message.
    let mut req = can_update_machine_request();
    req["settings"]["agentPort"] = json!(w.agent_port.to_string());
    req["desired"]["machine"]["metadata"]["name"] = json!("drift-0");
    let r = capi
        .call(
            inplace_updater::hooks::Hook::CanUpdateMachine,
            &go_json(&req),
        )
        .await
        .unwrap();
    let v = r.json();
    assert_eq!(v["status"], "Success", "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("node node-d has drifted from plan default/drift-0@"),
        "{v}"
    );

    // The same desired state again, to an updater without the remembered answer (another
    // replica, a restart): not "done" but a repair, followed to its end.
    drop(w.updater.take());
    w.start_updater();
    let mut capi = w.client();
    let seen = poll_update(&mut capi, &body, 0.05).await;
    // Answered with the repair: still running, or (a small plan on a fast machine) already
    // succeeded as attempt 2 within the call; never the first attempt's "done".
    let first = &seen[0];
    assert!(
        first["retryAfterSeconds"] != 0 || w.agents[i].proc.log().contains("repair accepted"),
        "answered done without a repair: {seen:?}\n{}",
        w.agents[i].proc.log()
    );
    let done = seen.last().unwrap();
    assert_eq!(
        (done["status"].as_str(), done["retryAfterSeconds"].as_i64()),
        (Some("Success"), Some(0)),
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "desired\n");
    let text = std::fs::read_to_string(&journal).unwrap();
    assert!(text.contains("repair of run 1 by grpc"), "{text}");
    assert!(
        w.updater_log_shows("node drifted from its plan"),
        "{}",
        w.updater_log()
    );
    // Cleared on the node once the repair succeeded.
    eventually("the drift clears", || {
        std::fs::read_to_string(&journal)
            .ok()?
            .contains("\"driftCleared\"")
            .then_some(())
            .or_else(|| {
                std::thread::sleep(Duration::from_millis(50));
                None
            })
    });
}

/// The repair of a drifted node is a new attempt of its plan and drains first, as a new plan
/// would (here `drain: Always`): the node is cordoned and its Pod evicted before the repair
/// touches anything (a PodDisruptionBudget that allows nothing holds the repair back), and
/// the node is uncordoned after the repair succeeded, although the plan's first attempt had
/// already been answered and uncordoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_repair_of_a_drifted_node_drains_it_first() {
    use inplace_updater::standin::{node, pdb, pod};

    let mut w = World::new(38).await;
    let i = w.add_agent("node-r", "v1.35.3");
    w.api
        .put(w.api.workload_secret("default", "capi-quickstart"));
    w.api.put(node("node-r", "v1.35.3"));
    w.start_updater();
    let mut capi = w.client();
    let (machine, config) = w.put_machine(
        "drift-1",
        i,
        "v1.35.3",
        bootstrap_spec(json!([{"path": FILE, "content": "desired\n"}])),
    );
    let settings =
        json!({"agentPort": w.agent_port.to_string(), "updateWaitSeconds": "0", "drain": "Always"});
    let body = update_request(&machine, Some(&config), settings);
    let seen = poll_update(&mut capi, &body, 0.05).await;
    assert_eq!(seen.last().unwrap()["retryAfterSeconds"], 0, "{seen:?}");
    let node_path = "/api/v1/nodes/node-r";
    let cordoned =
        |w: &World| w.api.get(node_path).unwrap()["spec"]["unschedulable"].as_bool() == Some(true);
    assert!(!cordoned(&w), "uncordoned after the plan");

    // A workload arrives, under a budget that allows no disruption; the file is edited.
    let rs = Some(("ReplicaSet", "web-7d9"));
    w.api
        .put(pod("default", "web-0", "node-r", rs, json!({"app": "web"})));
    w.api.put(pdb("default", "web", json!({"app": "web"}), 0));
    let path = w.agents[i].root.join(FILE.trim_start_matches('/'));
    std::fs::write(&path, "edited by hand\n").unwrap();
    let journal = inplace_agent::journal::file_path(&w.dir.path().join("state-node-r"));
    eventually("the agent journals the drift", || {
        std::fs::read_to_string(&journal)
            .ok()?
            .contains("\"driftFound\"")
            .then_some(())
    });

    // Another replica: the repair waits for the drain, which the budget holds.
    drop(w.updater.take());
    w.start_updater();
    let mut capi = w.client();
    for _ in 0..3 {
        let v = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
        assert_eq!(v["status"], "Success", "{v}");
        assert!(
            v["message"]
                .as_str()
                .unwrap()
                .contains("blocked by PodDisruptionBudget default/web"),
            "{v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(cordoned(&w), "cordoned before the repair");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "edited by hand\n",
        "repaired before the node was drained"
    );

    // The budget allows one: the Pod goes, the repair runs, the node is uncordoned.
    w.api.put(pdb("default", "web", json!({"app": "web"}), 1));
    let seen = poll_update(&mut capi, &body, 0.05).await;
    let done = seen.last().unwrap();
    assert_eq!(
        (done["status"].as_str(), done["retryAfterSeconds"].as_i64()),
        (Some("Success"), Some(0)),
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert!(
        w.api.get("/api/v1/namespaces/default/pods/web-0").is_none(),
        "evicted"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "desired\n");
    assert!(
        std::fs::read_to_string(&journal)
            .unwrap()
            .contains("repair of run 1 by grpc")
    );
    assert!(
        !cordoned(&w),
        "uncordoned after the repair\n{}",
        w.updater_log()
    );
}
