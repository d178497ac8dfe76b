//! A dead agent never hangs a Machine silently (crates/updater/src/unreachable.rs): with
//! the agent killed, `UpdateMachine` keeps answering "in progress" but keeps when the wait
//! began on the Machine (an annotation, so a restarted updater counts from the same moment),
//! creates a Warning Event `AgentUnreachable` at the first miss (one, however often Cluster
//! API asks), counts the Machine in `inplace_updater_unreachable_machines`, and after
//! `settings.unreachableTimeoutSeconds` answers Failure naming the node, address, port and
//! last error, with what to do. The agent back, the wait ends and the annotation goes.
//! The real updater binary, a real agent, the stand-in Kubernetes API.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::patience::deadline;
use crate::support::updater::*;
use inplace_updater::emulate::CapiClient;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::object_path;
use inplace_updater::unreachable::SINCE_ANNOTATION;

/// The request Cluster API sends now: the live Machine with its annotations (CAPI's
/// cleanupMachine keeps name, namespace, labels, annotations and spec).
fn request(w: &World, path: &str, config: &Value, settings: &Value) -> Vec<u8> {
    let live = w.api.get(path).unwrap();
    let mut sent = live.clone();
    sent["metadata"] = json!({});
    for k in ["name", "namespace", "labels", "annotations"] {
        sent["metadata"][k] = live["metadata"][k].clone();
    }
    update_request(&sent, Some(config), settings.clone())
}

async fn call(capi: &mut CapiClient, body: &[u8]) -> Value {
    let r = capi.call(Hook::UpdateMachine, body).await.unwrap();
    assert_eq!(r.status, 200);
    r.json()
}

async fn metric(capi: &mut CapiClient, name: &str) -> f64 {
    let text = String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

fn since(w: &World, path: &str) -> Option<String> {
    w.api.get(path).unwrap()["metadata"]["annotations"][SINCE_ANNOTATION]
        .as_str()
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_agent_is_reported_and_fails_the_machine_after_the_deadline() {
    let mut w = World::new(62).await;
    w.add_agent("node-d", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    let (machine, config) = w.put_machine(
        "dead-0",
        0,
        "v1.35.2",
        bootstrap_spec(json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "d\n"}])),
    );
    let path = object_path(&machine).unwrap();
    let settings = json!({"agentPort": w.agent_port.to_string(), "unreachableTimeoutSeconds": "3", "updateWaitSeconds": "0"});
    w.agents[0].proc.kill9();
    let address = format!("{}:{}", w.agents[0].ip, w.agent_port);

    // The first miss: in progress, the wait's start kept on the Machine, one Event.
    let r = call(&mut capi, &request(&w, &path, &config, &settings)).await;
    assert_eq!(r["status"], "Success", "{r}");
    assert_ne!(r["retryAfterSeconds"], 0, "{r}");
    let began = since(&w, &path).unwrap_or_else(|| panic!("no annotation\n{}", w.updater_log()));
    // Asked again (with the annotation in the request, as CAPI would): the same start.
    let r = call(&mut capi, &request(&w, &path, &config, &settings)).await;
    assert_eq!(r["status"], "Success", "{r}");
    assert_eq!(since(&w, &path).as_deref(), Some(began.as_str()));
    assert_eq!(
        metric(&mut capi, "inplace_updater_unreachable_machines").await,
        1.0
    );
    assert_eq!(
        metric(
            &mut capi,
            "inplace_updater_machines{cluster=\"default/capi-quickstart\",phase=\"unreachable\"}"
        )
        .await,
        1.0
    );
    assert!(metric(&mut capi, "inplace_updater_unreachable_oldest_seconds").await >= 0.0);
    let deadline_at = deadline();
    let events = loop {
        let events = w.api.events();
        if !events.is_empty() || Instant::now() > deadline_at {
            break events;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0]["reason"], "AgentUnreachable");
    assert_eq!(events[0]["type"], "Warning");
    assert_eq!(events[0]["involvedObject"]["name"], "dead-0");
    assert!(
        events[0]["message"].as_str().unwrap().contains("node-d"),
        "{}",
        events[0]
    );
    assert!(
        w.updater_log_shows("agent unreachable; waiting"),
        "{}",
        w.updater_log()
    );

    // A restarted updater counts from the annotation: past the deadline it answers Failure.
    drop(w.updater.take());
    w.start_updater();
    let mut capi = w.client();
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let r = call(&mut capi, &request(&w, &path, &config, &settings)).await;
    assert_eq!(r["status"], "Failure", "{r}");
    let message = r["message"].as_str().unwrap();
    for words in [
        "Machine default/dead-0",
        "node node-d",
        address.as_str(),
        "refused",
        "settings.unreachableTimeoutSeconds",
        "check the agent's pod",
        "delete the Machine",
    ] {
        assert!(message.contains(words), "{words:?} not in {message}");
    }
    assert!(
        !message.contains("Connection refused: Connection refused"),
        "{message}"
    );
    let text = String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    assert!(
        text.contains("inplace_updater_plan_failures_total{kind=\"unreachable_timeout\"} 1"),
        "{text}"
    );

    // The agent back: the wait ends, the annotation is removed, the Machine is updated.
    w.restart_agent(0, &["--no-chroot"], &[("INPLACE_AGENT_SERVICES", "off")]);
    let deadline_at = deadline();
    loop {
        let r = call(&mut capi, &request(&w, &path, &config, &settings)).await;
        if r["status"] == "Success" && r["retryAfterSeconds"] == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline_at,
            "never done: {r}\n{}",
            w.updater_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline_at = deadline();
    while since(&w, &path).is_some() {
        assert!(Instant::now() < deadline_at, "annotation stays");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        metric(&mut capi, "inplace_updater_unreachable_machines").await,
        0.0
    );
}

/// `CanUpdateMachineSet` asks the agents of the current MachineSet's Machines (listed by
/// its selector): all reachable and able → covered as before; one that cannot move the
/// version (no package manager) → the version is not covered, and the message names it;
/// one unreachable → nothing covered, naming its Machine and node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn can_update_machine_set_asks_the_agents_of_the_current_machines() {
    let mut w = World::new(63).await;
    w.add_agent("ms-node-a", "v1.35.1");
    w.add_agent("ms-node-b", "v1.35.1");
    w.start_updater();
    let mut capi = w.client();
    let mut body: Value = serde_json::from_slice(
        &std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/updater/can-update-machineset-request.json"),
        )
        .unwrap(),
    )
    .unwrap();
    body["settings"]["agentPort"] = json!(w.agent_port.to_string());
    let mut set = body["current"]["machineSet"].clone();
    let set_name = set["metadata"]["name"].as_str().unwrap().to_owned();
    // The MachineSet as the API server has it (the updater reads it live): its uid is the
    // one its Machines' owner references carry.
    set["metadata"]["uid"] = json!("5e1d0a2c-0000-4000-8000-000000000001");
    w.api.put(set.clone());
    for (i, name) in ["ms-0", "ms-1"].into_iter().enumerate() {
        let (mut machine, _) = w.put_machine(name, i, "v1.35.1", bootstrap_spec(json!([])));
        machine["metadata"]["labels"] = set["spec"]["selector"]["matchLabels"].clone();
        machine["metadata"]["ownerReferences"] = json!([{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet", "name": set_name,
            "uid": "5e1d0a2c-0000-4000-8000-000000000001", "controller": true,
        }]);
        w.api.put(machine);
    }
    // A Machine of another MachineSet, with no agent at all: not asked.
    let mut stranger = machine("other-0", "v1.35.1", "gone", "127.0.63.99", false);
    stranger["metadata"]["labels"] = json!({"cluster.x-k8s.io/deployment-name": "other"});
    w.api.put(stranger);

    let mut files_only = body.clone();
    files_only["desired"]["machineSet"]["spec"]["template"]["spec"]["version"] =
        body["current"]["machineSet"]["spec"]["template"]["spec"]["version"].clone();
    files_only["desired"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"]["joinConfiguration"] =
        body["current"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"]["joinConfiguration"]
            .clone();
    // One agent dead: nothing is covered, and the message names its Machine and node.
    // (Asked first: a node's GetNodeInfo answer is reused for 30 s.)
    w.agents[1].proc.kill9();
    let r = capi
        .call(Hook::CanUpdateMachineSet, &go_json(&files_only))
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Success", "{r}");
    assert!(r.get("bootstrapConfigTemplatePatch").is_none(), "{r}");
    assert!(r.get("machineSetPatch").is_none(), "{r}");
    let message = r["message"].as_str().unwrap();
    for words in [
        "Machine default/ms-1",
        "node ms-node-b",
        "a rollout replaces the Machines",
    ] {
        assert!(message.contains(words), "{words:?} not in {r}");
    }
    assert!(!message.contains("ms-0"), "{r}");

    // The agent back: files only are covered, as a current agent could.
    w.restart_agent(1, &["--no-chroot"], &[("INPLACE_AGENT_SERVICES", "off")]);
    let r = capi
        .call(Hook::CanUpdateMachineSet, &go_json(&files_only))
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Success", "{r}");
    assert!(
        r["bootstrapConfigTemplatePatch"]["patch"].is_string(),
        "{r}"
    );
    assert_eq!(r["affectsAvailability"], json!(false), "{r}");
    let listed = w.api.requests();
    assert!(
        listed
            .iter()
            .any(|(m, p)| m == "GET" && p.contains("/machines?") && p.contains("labelSelector")),
        "{listed:?}"
    );

    // A version bump: these agents have no package manager, so the version is not covered
    // (Cluster API rolls out), and the message says which node cannot.
    let r = capi
        .call(Hook::CanUpdateMachineSet, &go_json(&body))
        .await
        .unwrap()
        .json();
    assert!(r.get("machineSetPatch").is_none(), "{r}");
    let message = r["message"].as_str().unwrap();
    assert!(
        message
            .contains("node ms-node-a (Machine default/ms-0) cannot move the Kubernetes version"),
        "{r}"
    );
}
