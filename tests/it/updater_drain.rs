//! The drain before a disruptive plan (crates/updater/src/drain.rs, handlers/draining.rs),
//! end to end: the real `inplace-updater serve` binary, a real agent on a sandbox node tree,
//! and the Kubernetes API stand-in serving both the management cluster and the workload
//! cluster (the `<cluster>-kubeconfig` Secret points back at it), so the updater's kube-rs
//! client cordons, lists Pods and evicts through the real wire shapes. A version bump
//! drains (DaemonSet, mirror and `drain: skip` Pods stay; a MachineDrainRule's higher order
//! waits; a PDB-blocked Pod holds the drain until its budget allows), then the plan runs and
//! the node is uncordoned; a files-only plan does not drain; a failing gate leaves the node
//! cordoned and says so; a person's cordon survives; the exclude annotation skips; the
//! timeout fails, then proceeds; a restarted updater continues a drain half done.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::drain::{CORDONED_BY_ANNOTATION, DRAIN_ANNOTATION, EXCLUDE_ANNOTATION};
use inplace_updater::emulate::CapiClient;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::{namespace, node, pdb, pod};

const SCALE: f64 = 0.01;
const NODE_PATH: &str = "/api/v1/nodes/";

fn pod_path(ns: &str, name: &str) -> String {
    format!("/api/v1/namespaces/{ns}/pods/{name}")
}

const WEB_PDB: &str = "/apis/policy/v1/namespaces/default/poddisruptionbudgets/web";

/// A workload cluster on the stand-in for agent 0's node, whose Node reports
/// `kubelet_version`, with the Pods of a small worker: two web replicas under a budget
/// allowing `allowed` disruptions, an unmanaged Pod, a database Pod a MachineDrainRule
/// drains last, a DaemonSet Pod, a mirror Pod, a Pod labelled `drain: skip`, and a Pod of
/// another node.
fn workload(w: &World, kubelet_version: &str, allowed: i64) -> String {
    let name = w.agents[0].node.clone();
    w.api
        .put(w.api.workload_secret("default", "capi-quickstart"));
    w.api.put(node(&name, kubelet_version));
    w.api.put(namespace("default", json!({})));
    w.api.put(namespace("kube-system", json!({})));
    w.api
        .put(json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "kube-proxy", "namespace": "kube-system"}, "spec": {}}));
    let rs = Some(("ReplicaSet", "web-7d9"));
    w.api
        .put(pod("default", "web-0", &name, rs, json!({"app": "web"})));
    w.api
        .put(pod("default", "web-1", &name, rs, json!({"app": "web"})));
    w.api
        .put(pod("default", "api-0", &name, None, json!({"app": "api"})));
    w.api.put(pod(
        "default",
        "db-0",
        &name,
        Some(("StatefulSet", "db")),
        json!({"tier": "db"}),
    ));
    w.api.put(pod(
        "kube-system",
        "kube-proxy-a",
        &name,
        Some(("DaemonSet", "kube-proxy")),
        json!({}),
    ));
    let mut mirror = pod(
        "kube-system",
        &format!("etcd-{name}"),
        &name,
        None,
        json!({}),
    );
    mirror["metadata"]["annotations"] = json!({"kubernetes.io/config.mirror": "abc"});
    w.api.put(mirror);
    w.api.put(pod(
        "default",
        "keep",
        &name,
        None,
        json!({"cluster.x-k8s.io/drain": "skip"}),
    ));
    w.api.put(pod(
        "default",
        "elsewhere",
        "node-x",
        rs,
        json!({"app": "web"}),
    ));
    w.api
        .put(pdb("default", "web", json!({"app": "web"}), allowed));
    w.api.put(json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDrainRule",
        "metadata": {"name": "db-last", "namespace": "default"},
        "spec": {"drain": {"behavior": "Drain", "order": 10},
                 "machines": [{"selector": {"matchLabels": {"cluster.x-k8s.io/cluster-name": "capi-quickstart"}}}],
                 "pods": [{"selector": {"matchLabels": {"tier": "db"}}}]}}));
    name
}

fn node_object(w: &World, name: &str) -> Value {
    w.api.get(&format!("{NODE_PATH}{name}")).unwrap()
}

fn cordoned(n: &Value) -> bool {
    n["spec"]["unschedulable"].as_bool().unwrap_or(false)
}

fn on_node(w: &World, name: &str) -> Vec<String> {
    let mut pods: Vec<String> = [
        ("default", "web-0"),
        ("default", "web-1"),
        ("default", "api-0"),
        ("default", "db-0"),
        ("kube-system", "kube-proxy-a"),
        ("kube-system", &format!("etcd-{name}")),
        ("default", "keep"),
        ("default", "elsewhere"),
    ]
    .iter()
    .filter(|(ns, n)| w.api.get(&pod_path(ns, n)).is_some())
    .map(|(ns, n)| format!("{ns}/{n}"))
    .collect();
    pods.sort();
    pods
}

/// The new kubelet, as a package upgrade would ship it (the sandbox has no package
/// manager): the plan's version gate then passes.
fn upgrade_kubelet(w: &World) {
    std::fs::write(
        w.agents[0].root.join("usr/local/bin/kubelet.version"),
        "v1.35.2\n",
    )
    .unwrap();
}

async fn call(capi: &mut CapiClient, body: &[u8]) -> Value {
    let r = capi.call(Hook::UpdateMachine, body).await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn message(v: &Value) -> &str {
    v["message"].as_str().unwrap_or("")
}

/// Calls until the answer is no longer the drain's (the plan was submitted, or failed).
async fn drain_through(capi: &mut CapiClient, body: &[u8]) -> Value {
    for _ in 0..200 {
        let v = call(capi, body).await;
        if !message(&v).starts_with("draining") {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the drain never ended");
}

/// A world on `subnet` with one agent (node `node-d`, its kubelet at `kubelet`) and the
/// updater started.
async fn started(subnet: u8, kubelet: &str) -> World {
    let mut w = World::new(subnet).await;
    w.add_agent("node-d", kubelet);
    w.start_updater();
    w
}

fn files(content: &str) -> Value {
    bootstrap_spec(json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": content}]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_bump_drains_the_node_by_capis_rules_then_runs_and_uncordons() {
    let w = started(50, "v1.35.1").await;
    let node = workload(&w, "v1.35.1", 1);
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "30"});
    let (machine, config) = w.put_machine("md-0", 0, "v1.35.2", files("drain=1\n"));
    let body = update_request(&machine, Some(&config), settings);

    // The first call cordons, evicts what the budget allows and answers in progress.
    let first = call(&mut capi, &body).await;
    assert_eq!(first["status"], "Success", "{first}");
    assert_eq!(
        first["retryAfterSeconds"],
        5,
        "{first}\n{}",
        w.updater_log()
    );
    assert_eq!(
        message(&first),
        "draining node node-d: 4 pods left; default/web-1 blocked by PodDisruptionBudget default/web; then default/db-0",
        "{}",
        w.updater_log()
    );
    let n = node_object(&w, &node);
    assert!(cordoned(&n), "{n}");
    let plan = n["metadata"]["annotations"][CORDONED_BY_ANNOTATION]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        n["metadata"]["annotations"][DRAIN_ANNOTATION]
            .as_str()
            .unwrap()
            .starts_with(&format!("{plan}@")),
        "{n}"
    );
    let mut left = [
        "default/db-0".to_owned(),
        "default/elsewhere".to_owned(),
        "default/keep".to_owned(),
        "default/web-1".to_owned(),
        format!("kube-system/etcd-{node}"),
        "kube-system/kube-proxy-a".to_owned(),
    ];
    left.sort();
    assert_eq!(on_node(&w, &node), left);

    // The budget holds: retried on every call, never bypassed; nothing submitted yet.
    for _ in 0..3 {
        let v = call(&mut capi, &body).await;
        assert!(
            message(&v).contains("default/web-1 blocked by PodDisruptionBudget default/web"),
            "{v}"
        );
    }
    let state = w.dir.path().join("state-node-d");
    assert!(
        !std::fs::read_to_string(inplace_agent::journal::file_path(&state))
            .unwrap_or_default()
            .contains("planAccepted")
    );

    // The budget allows one more: web-1 goes, then db-0 (order 10), then the plan — in one
    // call, as the stand-in's evicted Pods are gone at once and the call looks again.
    w.api
        .edit(WEB_PDB, |b| b["status"]["disruptionsAllowed"] = json!(1));
    let v = call(&mut capi, &body).await;
    assert!(
        !message(&v).starts_with("draining"),
        "drained and submitted in the call: {v}\n{}",
        w.updater_log()
    );
    let evicted: Vec<String> = w
        .api
        .requests()
        .into_iter()
        .filter(|(method, path)| method == "POST" && path.contains("/eviction"))
        .map(|(_, path)| path)
        .collect();
    let at = |pod: &str| {
        evicted
            .iter()
            .rposition(|p| p.contains(&format!("/pods/{pod}/")))
            .unwrap_or_else(|| panic!("{pod} was not evicted: {evicted:?}"))
    };
    assert!(
        at("web-1") < at("db-0"),
        "db-0 (order 10) last: {evicted:?}"
    );
    upgrade_kubelet(&w);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Success", "{seen:?}\n{}", w.updater_log());
    assert_eq!(last["retryAfterSeconds"], 0, "{seen:?}");
    let mut stayed = vec![
        "default/elsewhere".to_owned(),
        "default/keep".to_owned(),
        format!("kube-system/etcd-{node}"),
        "kube-system/kube-proxy-a".to_owned(),
    ];
    stayed.sort();
    assert_eq!(on_node(&w, &node), stayed);
    let n = node_object(&w, &node);
    assert!(!cordoned(&n), "uncordoned after Succeeded: {n}");
    assert!(
        n["metadata"]["annotations"]
            .get(CORDONED_BY_ANNOTATION)
            .is_none(),
        "{n}"
    );
    assert!(
        n["metadata"]["annotations"].get(DRAIN_ANNOTATION).is_none(),
        "{n}"
    );

    // Evictions only, never a delete; the Secret read by name, the rules listed.
    let requests = w.api.requests();
    assert!(requests.iter().all(|(m, _)| m != "DELETE"), "{requests:?}");
    let evictions: Vec<&str> = requests
        .iter()
        .filter(|(m, p)| m == "POST" && p.contains("/eviction"))
        .map(|(_, p)| p.as_str())
        .collect();
    assert!(evictions.iter().any(|p| p.contains("/pods/db-0/eviction")));
    assert!(
        !evictions
            .iter()
            .any(|p| p.contains("kube-proxy") || p.contains("etcd-") || p.contains("/keep/"))
    );
    assert!(
        requests.iter().any(|(m, p)| m == "GET"
            && p == "/api/v1/namespaces/default/secrets/capi-quickstart-kubeconfig")
    );
    assert!(
        !requests
            .iter()
            .any(|(_, p)| p.ends_with("/secrets") || p.contains("/secrets?"))
    );
    let metrics =
        String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    for (name, at_least) in [
        ("inplace_updater_drains_started_total", 1),
        ("inplace_updater_drains_finished_total", 1),
        ("inplace_updater_pods_evicted_total", 4),
        ("inplace_updater_evictions_refused_total", 4),
        ("inplace_updater_drain_duration_seconds_count", 1),
    ] {
        let value = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"));
        assert!(
            value.trim().parse::<f64>().unwrap() >= at_least as f64,
            "{name} {value}"
        );
    }
    let log = w.updater_log();
    assert!(
        log.contains("eviction refused by a PodDisruptionBudget") && log.contains("default/web"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_files_only_plan_does_not_drain() {
    let w = started(51, "v1.35.2").await;
    let node = workload(&w, "v1.35.2", 0);
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string()});
    let (machine, config) = w.put_machine("md-1", 0, "v1.35.2", files("files-only\n"));
    let body = update_request(&machine, Some(&config), settings);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    assert_eq!(seen.last().unwrap()["retryAfterSeconds"], 0, "{seen:?}");
    assert!(
        seen.iter().all(|v| !message(v).contains("draining")),
        "{seen:?}"
    );
    assert!(!cordoned(&node_object(&w, &node)));
    assert_eq!(on_node(&w, &node).len(), 8);
    assert!(
        !w.api
            .requests()
            .iter()
            .any(|(_, p)| p.starts_with(NODE_PATH) || p.contains("/pods")),
        "the workload cluster was not touched: {:?}",
        w.api.requests()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_gate_leaves_the_node_cordoned_and_says_so() {
    let w = started(52, "v1.35.1").await;
    let node = workload(&w, "v1.35.1", 5);
    let mut capi = w.client();
    // The kubelet never reports v1.35.2: the version gate fails after 2 s.
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "2"});
    let (machine, config) = w.put_machine("md-2", 0, "v1.35.2", files("gate\n"));
    let body = update_request(&machine, Some(&config), settings);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Failure", "{seen:?}");
    assert!(message(last).contains("kubeletVersion"), "{last}");
    assert!(
        message(last).contains("node node-d stays cordoned"),
        "{last}"
    );
    assert!(cordoned(&node_object(&w, &node)));
    // Every later call says it again.
    let again = call(&mut capi, &body).await;
    assert!(message(&again).contains("stays cordoned"), "{again}");
    assert!(cordoned(&node_object(&w, &node)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persons_cordon_survives_the_update() {
    let w = started(53, "v1.35.1").await;
    let node = workload(&w, "v1.35.1", 5);
    w.api.edit(&format!("{NODE_PATH}{node}"), |n| {
        n["spec"]["unschedulable"] = json!(true)
    });
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "30"});
    let (machine, config) = w.put_machine("md-3", 0, "v1.35.2", files("person\n"));
    let body = update_request(&machine, Some(&config), settings);
    let first = call(&mut capi, &body).await;
    assert!(
        w.api
            .requests()
            .iter()
            .any(|(method, path)| method == "POST" && path.contains("/eviction")),
        "the node was drained: {first}"
    );
    let n = node_object(&w, &node);
    assert!(
        n["metadata"]["annotations"]
            .get(CORDONED_BY_ANNOTATION)
            .is_none(),
        "{n}"
    );
    drain_through(&mut capi, &body).await;
    upgrade_kubelet(&w);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    assert_eq!(seen.last().unwrap()["retryAfterSeconds"], 0, "{seen:?}");
    let n = node_object(&w, &node);
    assert!(cordoned(&n), "the person's cordon stays: {n}");
    assert!(
        n["metadata"]["annotations"].get(DRAIN_ANNOTATION).is_none(),
        "{n}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exclude_node_draining_annotation_skips_the_drain() {
    let w = started(54, "v1.35.1").await;
    let node = workload(&w, "v1.35.1", 0);
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "30"});
    let (mut machine, config) = w.put_machine("md-4", 0, "v1.35.2", files("exclude\n"));
    machine["metadata"]["annotations"][EXCLUDE_ANNOTATION] = json!("");
    w.api.put(machine.clone());
    let body = update_request(&machine, Some(&config), settings);
    let first = call(&mut capi, &body).await;
    assert!(!message(&first).contains("draining"), "{first}");
    upgrade_kubelet(&w);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    assert_eq!(seen.last().unwrap()["retryAfterSeconds"], 0, "{seen:?}");
    assert!(!cordoned(&node_object(&w, &node)));
    assert_eq!(on_node(&w, &node).len(), 8, "nothing evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_timeout_fails_then_proceeds_when_told() {
    let w = started(55, "v1.35.1").await;
    let node = workload(&w, "v1.35.1", 0);
    let mut capi = w.client();
    let port = w.agent_port.to_string();
    let (machine, config) = w.put_machine("md-5", 0, "v1.35.2", files("timeout\n"));
    let fail = update_request(
        &machine,
        Some(&config),
        json!({"agentPort": port, "gateTimeoutSeconds": "30", "drainTimeoutSeconds": "1"}),
    );
    let first = call(&mut capi, &fail).await;
    assert!(
        message(&first).contains("blocked by PodDisruptionBudget default/web"),
        "{first}"
    );
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let failed = call(&mut capi, &fail).await;
    assert_eq!(failed["status"], "Failure", "{failed}");
    let m = message(&failed);
    assert!(
        m.contains("drain of node node-d timed out after 1 s (settings.drainTimeoutSeconds)"),
        "{m}"
    );
    assert!(
        m.contains("default/web-0") && m.contains("stays cordoned"),
        "{m}"
    );
    assert!(cordoned(&node_object(&w, &node)));

    // The Machine's own nodeDrainTimeoutSeconds wins over the setting.
    let mut long = machine.clone();
    long["spec"]["deletion"] = json!({"nodeDrainTimeoutSeconds": 3600});
    w.api.put(long.clone());
    let body = update_request(
        &long,
        Some(&config),
        json!({"agentPort": port, "gateTimeoutSeconds": "30", "drainTimeoutSeconds": "1"}),
    );
    let v = call(&mut capi, &body).await;
    assert_eq!(v["status"], "Success", "{v}");
    assert!(message(&v).starts_with("draining"), "{v}");
    w.api.put(machine.clone());

    let proceed = update_request(
        &machine,
        Some(&config),
        json!({"agentPort": port, "gateTimeoutSeconds": "30", "drainTimeoutSeconds": "1", "onDrainTimeout": "Proceed"}),
    );
    drain_through(&mut capi, &proceed).await;
    upgrade_kubelet(&w);
    let seen = poll_update(&mut capi, &proceed, SCALE).await;
    assert_eq!(
        seen.last().unwrap()["retryAfterSeconds"],
        0,
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert!(
        on_node(&w, &node).contains(&"default/web-0".to_owned()),
        "still there"
    );
    assert!(
        !cordoned(&node_object(&w, &node)),
        "uncordoned after Succeeded"
    );
    assert!(w.updater_log_shows("drain timed out; proceeding"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_updater_continues_a_drain_half_done() {
    let mut w = started(56, "v1.35.1").await;
    let node = workload(&w, "v1.35.1", 0);
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "30"});
    let (machine, config) = w.put_machine("md-6", 0, "v1.35.2", files("restart\n"));
    let body = update_request(&machine, Some(&config), settings);
    let first = call(&mut w.client(), &body).await;
    assert!(
        message(&first).contains("blocked by PodDisruptionBudget"),
        "{first}"
    );
    let mark = node_object(&w, &node)["metadata"]["annotations"][DRAIN_ANNOTATION].clone();

    // A new updater process: nothing in memory, the Node says where the drain is.
    let mut old = w.updater.take().unwrap();
    old.kill9();
    w.start_updater();
    let mut capi = w.client();
    let again = call(&mut capi, &body).await;
    assert_eq!(
        message(&again),
        "draining node node-d: 3 pods left; default/web-0 blocked by PodDisruptionBudget default/web; \
         default/web-1 blocked by PodDisruptionBudget default/web; then default/db-0"
    );
    assert_eq!(
        node_object(&w, &node)["metadata"]["annotations"][DRAIN_ANNOTATION],
        mark,
        "not begun again"
    );
    let metrics =
        String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    assert!(
        metrics.contains("inplace_updater_drains_started_total 0"),
        "{metrics}"
    );
    w.api
        .edit(WEB_PDB, |b| b["status"]["disruptionsAllowed"] = json!(5));
    drain_through(&mut capi, &body).await;
    upgrade_kubelet(&w);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    assert_eq!(
        seen.last().unwrap()["retryAfterSeconds"],
        0,
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert!(
        !cordoned(&node_object(&w, &node)),
        "the new process uncordons what the old cordoned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn can_update_machine_says_a_plan_that_drains_affects_availability() {
    let w = started(57, "v1.35.1").await;
    let mut capi = w.client();
    let mut req: Value = can_update_machine_request();
    req["settings"]["agentPort"] = json!(w.agent_port.to_string());
    let name = req["desired"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = machine(&name, "v1.35.2", "node-d", &w.agents[0].ip, true);
    live["spec"] = req["desired"]["machine"]["spec"].clone();
    w.api.put(live);
    // The kubelet runs v1.35.1 and the Machine wants v1.35.2: the plan drains.
    let v = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    assert_eq!(v["affectsAvailability"], true, "{v}");
    // Without the drain the kubelet restart still affects availability: the field is unset.
    req["settings"]["drain"] = json!("Never");
    let v = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    assert!(v.get("affectsAvailability").is_none(), "{v}");
}
