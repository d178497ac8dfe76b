//! A whole cluster's minor version bump (v1.35.4 → v1.36.1) in place, with the hooks called
//! in KubeadmControlPlane's order and with its request shapes, then the workers the
//! MachineDeployment way (issue 45).
//!
//! What KubeadmControlPlane (KCP) does, read from kubernetes-sigs/cluster-api
//! (`controlplane/kubeadm/internal/controllers/`):
//! - `update.go`: the cluster's `kubeadm-config` moves first, then one Machine at a time;
//! - `inplace.go`: per Machine, the preflight checks, then `CanUpdateMachine`, then the
//!   trigger; the next Machine only once this one's update is over;
//! - `inplace_canupdatemachine.go`: the request carries the Machine (name, namespace,
//!   labels, annotations, spec), the KubeadmConfig after `PrepareKubeadmConfigsForDiff`
//!   (`joinConfiguration.discovery` emptied, the init configuration of the first Machine
//!   turned into a join configuration) and the InfraMachine;
//! - `inplace_trigger.go`: the `in-place-updates.internal.cluster.x-k8s.io/update-in-progress`
//!   annotation, the desired InfraMachine, KubeadmConfig and Machine written, then
//!   `UpdateMachine` marked pending; the Machine controller then calls `UpdateMachine` with
//!   the live objects until it says done, and clears the annotations.
//!
//! Real here: `inplace-updater serve`, one `inplace-agent serve` per node on its sandbox
//! tree, the updater's hook calls over TLS, the plans, the gates, the rollback.
//!
//! Stand-ins (say so when reading a result):
//! - the management cluster is the API stand-in (`inplace_updater::standin`); this test plays
//!   KCP, the MachineSet controller and the Machine controller against it, including what
//!   the Machine controller copies from the Node (`status.nodeInfo.kubeletVersion`);
//! - the nodes have no package manager, so a version is verified, not installed
//!   (translate.rs): the `kubeletVersion` gate waits until the kubelet stand-in reports the
//!   new version, which the test writes (`usr/local/bin/kubelet.version`) after the first
//!   `UpdateMachine` call, as the package install would. For the same reason `CanUpdateMachine`
//!   leaves the version uncovered on these nodes (a real KCP would replace the Machine); the
//!   emulated KCP goes on as it would for a node with a package manager
//!   (`updater_kcp_packages.rs` runs a control-plane node's bump with real packages: apt on a
//!   sandboxed systemd node, the version covered, the rollback of packages and manifests);
//! - what restarts a control-plane component here is a static pod manifest among the
//!   KubeadmConfig's files (kube-vip's, whose image moves with the release), so each
//!   control-plane plan ends with the `controlPlane` gate; each control-plane node's API
//!   server, mirror pods and CA are `tests/support/control_plane.rs`'s stand-ins; etcd is
//!   external in this cluster (the updater's plans use kubeadm's fixed etcd metrics address,
//!   127.0.0.1:2381, which a test cannot own; `control_plane_gate.rs` covers the etcd checks);
//! - the gate's least timeout is 300 s; the failing node's plan is cut by the plan timeout
//!   (`planTimeoutSeconds`), which rolls it back the same way a failed gate does.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::control_plane::Standins;
use crate::support::kcp::{self, CERT_SANS, for_request, with_discovery};
use crate::support::snapshot;
use crate::support::updater::*;
use inplace_updater::hooks::{Hook, PENDING_HOOKS_ANNOTATION, UPDATE_IN_PROGRESS_ANNOTATION};

const OLD: &str = "v1.35.4";
const NEW: &str = "v1.36.1";
const KUBE_VIP: &str = "/etc/kubernetes/manifests/kube-vip.yaml";
const DEMO_CONF: &str = "/etc/kubernetes/inplace-demo.conf";
/// Time scale of the Machine controller's waits (`retryAfterSeconds`).
const SCALE: f64 = 0.2;

fn kube_vip(tag: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: kube-vip\n  namespace: kube-system\nspec:\n  \
         containers:\n  - name: kube-vip\n    image: ghcr.io/kube-vip/kube-vip:{tag}\n  hostNetwork: true\n"
    )
}

/// KCP's `kubeadmConfigSpec` at a release: kube-vip's manifest moves with it.
fn control_plane_spec(tag: &str) -> Value {
    kcp::control_plane_spec(json!([
        {"path": KUBE_VIP, "owner": "root:root", "permissions": "0600", "content": kube_vip(tag)},
        {"path": DEMO_CONF, "owner": "root:root", "permissions": "0644", "content": format!("release={tag}\n")},
    ]))
}

/// The MachineDeployment's KubeadmConfigTemplate spec at a release.
fn worker_spec(tag: &str) -> Value {
    json!({
        "joinConfiguration": {
            "nodeRegistration": {"kubeletExtraArgs": [{"name": "max-pods", "value": "150"}]},
        },
        "files": [
            {"path": DEMO_CONF, "owner": "root:root", "permissions": "0644", "content": format!("release={tag}\n")},
        ],
    })
}

/// One Machine of the flow and its node.
struct Member {
    name: String,
    agent: usize,
    control_plane: bool,
}

fn settings(w: &World) -> Value {
    json!({
        "agentPort": w.agent_port.to_string(),
        "drain": "Never",
        "kubeletHealthzURL": "",
        "planTimeoutSeconds": "25",
    })
}

/// The live Machine of `m` at `version`, its node running `running`; a control-plane
/// Machine is labelled and owned as KCP makes them, a worker as a MachineSet makes them.
fn live_machine(w: &World, m: &Member, version: &str, running: &str, in_place: bool) -> Value {
    let a = &w.agents[m.agent];
    let mut v = machine(&m.name, version, &a.node, &a.ip, in_place);
    if m.control_plane {
        return kcp::owned_by_kcp(v, running);
    }
    for (k, val) in md_labels() {
        v["metadata"]["labels"][k] = json!(val);
    }
    v["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet",
        "name": "capi-quickstart-md-0-old", "uid": "ms-uid", "controller": true}]);
    v["status"]["nodeInfo"] = json!({"kubeletVersion": running});
    v
}

fn md_labels() -> [(&'static str, &'static str); 3] {
    [
        ("cluster.x-k8s.io/cluster-name", "capi-quickstart"),
        ("cluster.x-k8s.io/deployment-name", "capi-quickstart-md-0"),
        ("machine-template-hash", "old"),
    ]
}

fn infra(name: &str) -> Value {
    json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta2", "kind": "DevMachine",
           "metadata": {"name": name, "namespace": "default"}, "spec": {}})
}

/// KCP's `CanUpdateMachine` request for `m`, from `OLD` to `NEW`.
fn can_update_machine(w: &World, m: &Member) -> Vec<u8> {
    let current = live_machine(w, m, OLD, OLD, false);
    let mut desired = current.clone();
    desired["spec"]["version"] = json!(NEW);
    let config = |tag: &str| {
        let mut c = kubeadm_config(&m.name, control_plane_spec(tag));
        c["metadata"]["labels"] = current["metadata"]["labels"].clone();
        for_request(&c)
    };
    go_json(&json!({
        "kind": "CanUpdateMachineRequest",
        "apiVersion": inplace_updater::hooks::HOOKS_API_VERSION,
        "settings": settings(w),
        "current": {"machine": for_request(&current), "infrastructureMachine": infra(&m.name),
                    "bootstrapConfig": config(OLD)},
        "desired": {"machine": for_request(&desired), "infrastructureMachine": infra(&m.name),
                    "bootstrapConfig": config(NEW)},
    }))
}

/// The MachineDeployment controller's `CanUpdateMachineSet` request (the fixture's shape),
/// from the MachineSet at `OLD` to one at `NEW`.
fn can_update_machine_set(w: &World) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/updater/can-update-machineset-request.json");
    let mut req: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    req["settings"] = settings(w);
    let current = &mut req["current"]["machineSet"];
    current["metadata"]["name"] = json!("capi-quickstart-md-0-old");
    for (k, v) in md_labels() {
        current["spec"]["selector"]["matchLabels"][k] = json!(v);
        current["spec"]["template"]["metadata"]["labels"][k] = json!(v);
    }
    current["spec"]["template"]["spec"]["version"] = json!(OLD);
    req["current"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"] = worker_spec(OLD);
    req["desired"]["machineSet"]["spec"]["template"]["spec"]["version"] = json!(NEW);
    req["desired"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"] = worker_spec(NEW);
    go_json(&req)
}

/// A file of agent `i`'s node.
fn read(w: &World, i: usize, path: &str) -> Option<String> {
    std::fs::read_to_string(w.agents[i].root.join(path.trim_start_matches('/'))).ok()
}

fn set_kubelet(w: &World, i: usize, version: &str) {
    std::fs::write(
        w.agents[i].root.join("usr/local/bin/kubelet.version"),
        format!("{version}\n"),
    )
    .unwrap();
}

/// The node's agent's latest plan, from its status socket (`/v1/status`'s `recent[0]`, then
/// `/v1/plans/<id>` for its gates); null when the node never got one.
fn last_run(w: &World, i: usize) -> Value {
    kcp::last_run(&w.agents[i].root).unwrap_or(Value::Null)
}

/// The `controlPlane` gate of a plan document.
fn control_plane_gate(run: &Value) -> Value {
    kcp::gate(run, "controlPlane")
}

/// The bootstrap's files on a node at the old release (what cloud-init wrote).
fn bootstrap_files(w: &World, i: usize, control_plane: bool) {
    let root = &w.agents[i].root;
    let spec = if control_plane {
        control_plane_spec(OLD)
    } else {
        worker_spec(OLD)
    };
    for f in spec["files"].as_array().unwrap() {
        let path = root.join(f["path"].as_str().unwrap().trim_start_matches('/'));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, f["content"].as_str().unwrap()).unwrap();
    }
}

/// KCP's trigger (`inplace_trigger.go`), then the Machine controller's `UpdateMachine` calls
/// until done or failed; the package install (the kubelet's new version) lands after the
/// first call. The answers, and the body sent.
async fn trigger_and_update(
    w: &World,
    capi: &mut inplace_updater::emulate::CapiClient,
    m: &Member,
    move_kubelet: bool,
) -> (Vec<Value>, Vec<u8>) {
    let live = live_machine(w, m, NEW, OLD, true);
    let spec = if m.control_plane {
        control_plane_spec(NEW)
    } else {
        worker_spec(NEW)
    };
    let mut config = kubeadm_config(&m.name, with_discovery(spec));
    config["metadata"]["annotations"] = json!({UPDATE_IN_PROGRESS_ANNOTATION: ""});
    w.api.put(config.clone());
    w.api.put(live.clone());
    let body = update_request(&live, Some(&config), settings(w));
    let first = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
    if move_kubelet {
        set_kubelet(w, m.agent, NEW);
    }
    let mut seen = vec![first.clone()];
    if first["status"] == "Success" && first["retryAfterSeconds"].as_i64().unwrap_or(0) > 0 {
        tokio::time::sleep(Duration::from_secs_f64(
            first["retryAfterSeconds"].as_f64().unwrap_or(1.0) * SCALE,
        ))
        .await;
        seen.extend(poll_update(capi, &body, SCALE).await);
    }
    (seen, body)
}

/// The Machine controller once `UpdateMachine` said done: the annotations cleared, the
/// Node's kubelet version copied into the Machine's status.
fn finished(w: &World, m: &Member) {
    let mut live = live_machine(w, m, NEW, NEW, false);
    let annotations = live["metadata"]["annotations"].as_object_mut().unwrap();
    annotations.remove(UPDATE_IN_PROGRESS_ANNOTATION);
    annotations.remove(PENDING_HOOKS_ANNOTATION);
    w.api.put(live);
}

fn done(seen: &[Value]) -> bool {
    seen.last()
        .is_some_and(|v| v["status"] == "Success" && v["retryAfterSeconds"].as_i64() == Some(0))
}

fn refused_for_skew(v: &Value, words: &str) -> bool {
    v["status"] == "Success"
        && v.get("machineSetPatch").is_none()
        && v.get("machinePatch").is_none()
        && v["message"].as_str().is_some_and(|m| m.contains(words))
}

/// Three control-plane Machines and two workers, every node at `OLD`, live in the stand-in.
async fn cluster(subnet: u8) -> (World, Vec<Member>, Vec<Standins>) {
    let mut w = World::new(subnet).await;
    let mut members = Vec::new();
    let mut standins = Vec::new();
    for i in 0..5 {
        let control_plane = i < 3;
        let node = if control_plane {
            format!("cp-{i}")
        } else {
            format!("worker-{}", i - 3)
        };
        let a = w.add_agent(&node, OLD);
        bootstrap_files(&w, a, control_plane);
        if control_plane {
            let root = w.agents[a].root.clone();
            standins.push(Standins::install(&root, &node, &w.agents[a].ip, OLD));
            // The serving certificate kubeadm left, with KCP's certSANs (the plans carry
            // `apiServerCertificate`, which finds them there).
            crate::support::pki::control_plane_serving_certificate(&root, &CERT_SANS);
        }
        let m = Member {
            name: format!("capi-quickstart-{node}"),
            agent: a,
            control_plane,
        };
        w.api.put(live_machine(&w, &m, OLD, OLD, false));
        let spec = if control_plane {
            control_plane_spec(OLD)
        } else {
            worker_spec(OLD)
        };
        w.api
            .put(kubeadm_config(&m.name, with_discovery(spec.clone())));
        members.push(m);
    }
    // The MachineDeployment's current MachineSet, as the updater reads it live.
    let ms: Value = serde_json::from_slice(&can_update_machine_set(&w)).unwrap();
    w.api.put(ms["current"]["machineSet"].clone());
    w.start_updater();
    (w, members, standins)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minor_upgrade_moves_the_control_plane_then_the_workers_in_place() {
    let (w, members, standins) = cluster(245).await;
    let mut capi = w.client();
    let log = |w: &World| w.updater_log();

    // The control plane, one Machine at a time (KCP: CanUpdateMachine, trigger, UpdateMachine
    // until done, only then the next).
    for (i, m) in members.iter().take(3).enumerate() {
        let v = capi
            .call(Hook::CanUpdateMachine, &can_update_machine(&w, m))
            .await
            .unwrap()
            .json();
        assert_eq!(v["status"], "Success", "{}: {v}\n{}", m.name, log(&w));
        let message = v["message"].as_str().unwrap_or_default();
        for rule in [
            "newer than the control plane",
            "minor version apart",
            "skips v",
        ] {
            assert!(!message.contains(rule), "not refused for skew: {v}");
        }
        assert_eq!(
            v["affectsAvailability"], true,
            "a control-plane restart: {v}"
        );

        let (seen, _) = trigger_and_update(&w, &mut capi, m, true).await;
        assert!(done(&seen), "{}: {seen:?}\n{}", m.name, log(&w));
        let run = last_run(&w, m.agent);
        assert_eq!(run["phase"], "Succeeded", "{run:#}");
        assert_eq!(
            control_plane_gate(&run)["state"],
            "Passed",
            "the node was proved healthy before done: {run:#}"
        );
        assert!(standins[i].behaviour.readyz_reads.load(Ordering::SeqCst) > 0);
        assert_eq!(read(&w, m.agent, KUBE_VIP), Some(kube_vip(NEW)));
        finished(&w, m);

        // Between the control-plane steps: a worker may not move ahead of any control-plane
        // node (the MachineDeployment controller's question), nor be updated without asking.
        if i < 2 {
            let v = capi
                .call(Hook::CanUpdateMachineSet, &can_update_machine_set(&w))
                .await
                .unwrap()
                .json();
            // The first of those still on OLD, by name, is named.
            let behind = &members[i + 1].name;
            assert!(
                refused_for_skew(
                    &v,
                    &format!("newer than the control plane (Machine {behind} runs {OLD})")
                ),
                "after {}: {v}\n{}",
                m.name,
                log(&w)
            );
        }
    }

    // Every control-plane node runs NEW: the workers may follow (the answer is about what
    // the nodes can do, no longer about skew).
    let v = capi
        .call(Hook::CanUpdateMachineSet, &can_update_machine_set(&w))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    assert!(
        !v["message"]
            .as_str()
            .unwrap_or_default()
            .contains("control plane"),
        "{v}\n{}",
        log(&w)
    );
    for m in &members[3..] {
        let (seen, _) = trigger_and_update(&w, &mut capi, m, true).await;
        assert!(done(&seen), "{}: {seen:?}\n{}", m.name, log(&w));
        assert_eq!(
            read(&w, m.agent, DEMO_CONF),
            Some(format!("release={NEW}\n"))
        );
        assert_eq!(last_run(&w, m.agent)["phase"], "Succeeded");
        finished(&w, m);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_failure_on_the_second_control_plane_node_rolls_back_that_node_only() {
    let (w, members, standins) = cluster(246).await;
    let mut capi = w.client();
    let third = snapshot(&w.agents[members[2].agent].root, &[]);

    // The first moves and is proved healthy.
    let first = &members[0];
    let v = capi
        .call(Hook::CanUpdateMachine, &can_update_machine(&w, first))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    let (seen, first_body) = trigger_and_update(&w, &mut capi, first, true).await;
    assert!(done(&seen), "{seen:?}\n{}", w.updater_log());
    finished(&w, first);

    // The second: its API server does not come back ready after the change.
    let second = &members[1];
    let v = capi
        .call(Hook::CanUpdateMachine, &can_update_machine(&w, second))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    standins[1].behaviour.readyz.store(503, Ordering::SeqCst);
    let (seen, _) = trigger_and_update(&w, &mut capi, second, true).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Failure", "{seen:?}\n{}", w.updater_log());
    let run = last_run(&w, second.agent);
    assert_eq!(run["phase"], "RolledBack", "{run:#}");
    let gate = control_plane_gate(&run);
    assert_eq!(gate["state"], "Failed", "{run:#}");
    assert!(
        gate["message"]
            .as_str()
            .unwrap_or("")
            .contains("/readyz answered 503"),
        "{gate:#}"
    );
    // Its files and manifest are the old release's again.
    assert_eq!(read(&w, second.agent, KUBE_VIP), Some(kube_vip(OLD)));
    assert_eq!(
        read(&w, second.agent, DEMO_CONF),
        Some(format!("release={OLD}\n"))
    );

    // The first stays upgraded, and its update is still done (its node still matches).
    assert_eq!(read(&w, first.agent, KUBE_VIP), Some(kube_vip(NEW)));
    assert_eq!(last_run(&w, first.agent)["phase"], "Succeeded");
    let mut live = live_machine(&w, first, NEW, NEW, true);
    live["status"]["nodeInfo"]["kubeletVersion"] = json!(NEW);
    w.api.put(live);
    let again = poll_update(&mut capi, &first_body, SCALE).await;
    assert!(done(&again), "{again:?}");
    finished(&w, first);

    // KCP's preflight checks now fail on the second node: the third is never asked about, and
    // its node is as it was.
    assert_eq!(snapshot(&w.agents[members[2].agent].root, &[]), third);
    assert!(
        !w.updater_log().contains(&members[2].name),
        "the third Machine was not touched"
    );
}

/// The skew rules are checked again when the update starts (decision 0020): an
/// `UpdateMachine` that no `CanUpdate*` preceded, or whose control plane moved back since,
/// is refused before any node work. Failed on the code before this check: the worker's plan
/// was submitted and its files written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_machine_checks_the_skew_rules_before_any_node_work() {
    let (w, members, _standins) = cluster(247).await;
    let mut capi = w.client();
    // One control-plane node moved, two still run OLD.
    let cp = &members[0];
    set_kubelet(&w, cp.agent, NEW);
    finished(&w, cp);

    // A worker straight to NEW, without CanUpdateMachineSet.
    let worker = &members[3];
    let before = snapshot(&w.agents[worker.agent].root, &[]);
    let (seen, _) = trigger_and_update(&w, &mut capi, worker, false).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Failure", "{seen:?}\n{}", w.updater_log());
    let message = last["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "newer than the control plane (Machine {} runs {OLD})",
            members[1].name
        )) && message.contains("nothing was started"),
        "{message}"
    );
    assert_eq!(snapshot(&w.agents[worker.agent].root, &[]), before);
    assert!(
        last_run(&w, worker.agent).is_null(),
        "no plan reached the node"
    );

    // A control-plane node two minors ahead of the others (the control plane moved back,
    // or a version typed wrong): refused by the same rules.
    let skip = &members[1];
    let mut live = live_machine(&w, skip, "v1.37.0", OLD, true);
    live["spec"]["version"] = json!("v1.37.0");
    let config = kubeadm_config(&skip.name, with_discovery(control_plane_spec(NEW)));
    w.api.put(config.clone());
    w.api.put(live.clone());
    let v = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&live, Some(&config), settings(&w)),
        )
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Failure", "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap_or_default()
            .contains("skips v1.36"),
        "{v}"
    );
    assert!(
        last_run(&w, skip.agent).is_null(),
        "no plan reached the node"
    );
}
