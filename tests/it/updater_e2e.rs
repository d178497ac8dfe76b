//! The updater end to end: the real `inplace-updater serve` binary, real `inplace-agent
//! serve` agents on sandbox nodes (one on a sandboxed real systemd, as root), the
//! Kubernetes API stand-in, and Cluster API emulated as its controllers call: discovery →
//! CanUpdateMachineSet → UpdateMachine polled every `retryAfterSeconds` (time-scaled) until
//! 0; the same desired state again changes nothing; a dropped file is removed; a failing
//! gate answers Failure on every later call; a Machine not being updated starts nothing.

use crate::support::{overlay, sandbox};

use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::hooks::{Hook, PENDING_HOOKS_ANNOTATION};
use inplace_updater::standin::{object_path, secret};

/// How much of `retryAfterSeconds` the emulated CAPI waits (10 s → 100 ms).
const SCALE: f64 = 0.01;

fn files(content: &str) -> Value {
    json!([
        {"path": "/etc/kubernetes/inplace-demo.conf", "owner": "root:root", "permissions": "0644", "content": content},
        {"path": "/etc/kubernetes/registry-auth", "permissions": "0600",
         "contentFrom": {"secret": {"name": "registry", "key": "password"}}},
        {"path": "/etc/kubernetes/extra.conf", "content": base64::engine::general_purpose::STANDARD.encode("extra=1\n"), "encoding": "base64"},
    ])
}

fn read(agent: &Agent, path: &str) -> Option<String> {
    std::fs::read_to_string(agent.root.join(path.trim_start_matches('/'))).ok()
}

fn count_accepted(state: &Path) -> usize {
    std::fs::read_to_string(inplace_agent::journal::file_path(state))
        .unwrap_or_default()
        .matches("planAccepted")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capi_sequences_update_a_fleet_in_place_and_a_second_sequence_changes_nothing() {
    let mut w = World::new(20).await;
    for i in 0..3 {
        w.add_agent(&format!("node-{i}"), "v1.35.2");
    }
    w.start_updater();
    w.api.put(secret(
        "default",
        "registry",
        &[("password", SECRET_CONTENT.as_bytes())],
    ));
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string(), "drain": "Disruptive"});

    // Discovery, as the ExtensionConfig controller calls it.
    let r = capi
        .call(Hook::Discovery, br#"{"kind":"DiscoveryRequest","apiVersion":"hooks.runtime.cluster.x-k8s.io/v1alpha1"}"#)
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let handlers: Vec<String> = r.json()["handlers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            format!(
                "{}:{}",
                h["name"].as_str().unwrap(),
                h["failurePolicy"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        handlers,
        [
            "can-update-machine:Fail",
            "can-update-machineset:Fail",
            "update-machine:Fail"
        ]
    );

    // The MachineDeployment controller asks about the MachineSet (the fixture).
    let ms = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/updater/can-update-machineset-request.json"),
    )
    .unwrap();
    // The current MachineSet exists (the updater reads it live).
    w.api
        .put(serde_json::from_slice::<Value>(&ms).unwrap()["current"]["machineSet"].clone());
    let r = capi.call(Hook::CanUpdateMachineSet, &ms).await.unwrap();
    assert_eq!(r.json()["status"], "Success", "{}", r.json());
    assert!(r.json()["machineSetPatch"]["patch"].is_string());

    // Each Machine moves to the new MachineSet and CAPI calls UpdateMachine until done.
    let mut bodies = Vec::new();
    for i in 0..3 {
        let name = format!("md-0-{i}");
        let (machine, config) =
            w.put_machine(&name, i, "v1.35.2", bootstrap_spec(files("mode=v2\n")));
        bodies.push(update_request(&machine, Some(&config), settings.clone()));
    }
    for (i, body) in bodies.iter().enumerate() {
        let seen = poll_update(&mut capi, body, SCALE).await;
        let last = seen.last().unwrap();
        assert_eq!(
            last["status"],
            "Success",
            "node-{i}: {seen:?}\n{}",
            w.updater_log()
        );
        assert_eq!(last["retryAfterSeconds"], 0);
        assert_eq!(last["kind"], "UpdateMachineResponse");
        let a = &w.agents[i];
        assert_eq!(
            read(a, "/etc/kubernetes/inplace-demo.conf").as_deref(),
            Some("mode=v2\n")
        );
        assert_eq!(
            read(a, "/etc/kubernetes/registry-auth").as_deref(),
            Some(SECRET_CONTENT)
        );
        assert_eq!(
            read(a, "/etc/kubernetes/extra.conf").as_deref(),
            Some("extra=1\n")
        );
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(a.root.join("etc/kubernetes/registry-auth"))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        let flags = read(a, "/var/lib/kubelet/kubeadm-flags.env").unwrap();
        assert!(flags.contains("--max-pods=150"), "{flags}");
        assert!(
            flags.contains("--eviction-hard=nodefs.available<0%"),
            "{flags}"
        );
    }

    // A second sequence with the same desired state: the same answers, no new plan, no change.
    let states: Vec<_> = (0..3)
        .map(|i| w.dir.path().join(format!("state-node-{i}")))
        .collect();
    let before: Vec<usize> = states.iter().map(|s| count_accepted(s)).collect();
    assert_eq!(before, [1, 1, 1]);
    let trees: Vec<_> = w.agents.iter().map(|a| snapshot(&a.root)).collect();
    for body in &bodies {
        let seen = poll_update(&mut capi, body, SCALE).await;
        assert_eq!(seen.len(), 1, "done at once: {seen:?}");
        assert_eq!(seen[0]["retryAfterSeconds"], 0);
    }
    let after: Vec<usize> = states.iter().map(|s| count_accepted(s)).collect();
    assert_eq!(after, before, "no plan submitted twice");
    for (a, t) in w.agents.iter().zip(&trees) {
        assert_eq!(&snapshot(&a.root), t, "node {} changed", a.node);
    }

    // A file dropped from files[]: the next desired state removes it from the node.
    let mut fewer = bootstrap_spec(files("mode=v3\n"));
    fewer["files"].as_array_mut().unwrap().remove(2);
    let (machine, config) = w.put_machine("md-0-0", 0, "v1.35.2", fewer);
    let body = update_request(&machine, Some(&config), settings.clone());
    let seen = poll_update(&mut capi, &body, SCALE).await;
    assert_eq!(seen.last().unwrap()["retryAfterSeconds"], 0, "{seen:?}");
    assert_eq!(
        read(&w.agents[0], "/etc/kubernetes/inplace-demo.conf").as_deref(),
        Some("mode=v3\n")
    );
    assert_eq!(
        read(&w.agents[0], "/etc/kubernetes/extra.conf"),
        None,
        "pruned"
    );
    let journal = std::fs::read_to_string(inplace_agent::journal::file_path(&states[0])).unwrap();
    assert!(journal.contains("pruneResolved") && journal.contains("/etc/kubernetes/extra.conf"));

    // The updater only ever got objects by name (its ExtensionConfig, cluster-scoped,
    // included), and listed the Machines of the MachineSet by its selector
    // (CanUpdateMachineSet); never a watch, never a write.
    for (method, path) in w.api.requests() {
        assert_eq!(method, "GET", "{path}");
        assert!(!path.contains("watch"), "{path}");
        let list = path.contains("/machines?labelSelector=");
        let extension_config =
            path == "/apis/runtime.cluster.x-k8s.io/v1beta2/extensionconfigs/inplace-updater";
        assert!(
            list || extension_config || path.split('/').count() >= 7,
            "a get by name: {path}"
        );
    }
    // Bodies hold the bootstrap token and secret contents: neither is ever logged.
    let logs = format!(
        "{}\n{}",
        w.updater_log(),
        w.agents
            .iter()
            .map(|a| a.proc.log())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        !logs.contains(BOOTSTRAP_TOKEN),
        "the bootstrap token was logged"
    );
    assert!(!logs.contains(SECRET_CONTENT), "a secret was logged");
    assert!(w.updater_log_shows("body_sha256"), "{}", w.updater_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_gate_answers_failure_on_every_later_call_and_the_node_is_restored() {
    let mut w = World::new(21).await;
    // The kubelet reports v1.35.2; the Machine wants v1.35.3: the version gate cannot pass.
    w.add_agent("node-a", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    // The version differs: without "drain": "Never" the node would be drained first
    // (tests/it/updater_drain.rs).
    let settings =
        json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "2", "drain": "Never"});
    let (machine, config) = w.put_machine(
        "cp-0",
        0,
        "v1.35.3",
        bootstrap_spec(json!([
        {"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=v9\n"}])),
    );
    let body = update_request(&machine, Some(&config), settings);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    let failure = seen.last().unwrap().clone();
    assert_eq!(failure["status"], "Failure", "{seen:?}");
    let message = failure["message"].as_str().unwrap().to_owned();
    assert!(message.contains("kubeletVersion"), "{message}");
    // Rolled back: the file is not there, the flags are as before.
    assert_eq!(
        read(&w.agents[0], "/etc/kubernetes/inplace-demo.conf"),
        None
    );
    assert!(
        !read(&w.agents[0], "/var/lib/kubelet/kubeadm-flags.env")
            .unwrap()
            .contains("max-pods")
    );
    // CAPI retries with backoff: every later call is the same Failure, nothing runs again.
    let state = w.dir.path().join("state-node-a");
    for _ in 0..3 {
        let r = capi.call(Hook::UpdateMachine, &body).await.unwrap();
        assert_eq!(r.json(), failure);
    }
    assert_eq!(count_accepted(&state), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_machines_being_updated_in_place_are_touched_and_unreachable_agents_are_waited_for() {
    let mut w = World::new(22).await;
    w.add_agent("node-b", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string()});
    let (mut machine, config) = w.put_machine("w-0", 0, "v1.35.2", bootstrap_spec(json!([])));

    // The live Machine is not being updated (CAPI did not mark it): Failure, nothing starts.
    let path = object_path(&machine).unwrap();
    w.api.edit(&path, |m| {
        m["metadata"]["annotations"]
            .as_object_mut()
            .unwrap()
            .remove(PENDING_HOOKS_ANNOTATION);
    });
    let r = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), settings.clone()),
        )
        .await
        .unwrap();
    assert_eq!(r.json()["status"], "Failure");
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("not being updated in place"),
        "{}",
        r.json()
    );
    assert_eq!(count_accepted(&w.dir.path().join("state-node-b")), 0);

    // A forged request whose desired KubeadmConfig differs from the live one: refused.
    w.api.put(machine.clone());
    let mut forged = config.clone();
    forged["spec"]["files"] = json!([{"path": "/etc/kubernetes/evil", "content": "x"}]);
    let r = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&forged), settings.clone()),
        )
        .await
        .unwrap();
    assert_eq!(r.json()["status"], "Failure");
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("differs from the live KubeadmConfig"),
        "{}",
        r.json()
    );
    assert_eq!(count_accepted(&w.dir.path().join("state-node-b")), 0);

    // A Machine that does not exist.
    let mut ghost = machine.clone();
    ghost["metadata"]["name"] = json!("ghost");
    let r = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&ghost, None, settings.clone()),
        )
        .await
        .unwrap();
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("does not exist"),
        "{}",
        r.json()
    );

    // The agent cannot be reached (its address is one nothing listens on): in progress,
    // saying what it waits for, asked again in 15 s.
    machine["status"]["addresses"] = json!([{"type": "InternalIP", "address": "127.0.22.250"}]);
    w.api.put(machine.clone());
    let r = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), settings.clone()),
        )
        .await
        .unwrap();
    let v = r.json();
    assert_eq!(v["status"], "Success", "{v}");
    assert_eq!(v["retryAfterSeconds"], 15);
    assert!(v["message"].as_str().unwrap().contains("node-b"), "{v}");

    // CanUpdateMachine for that Machine: nothing is covered (a rollout is safe, a half-known
    // node is not).
    let mut req = can_update_machine_request();
    req["desired"]["machine"]["metadata"]["name"] = json!("w-0");
    let r = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap();
    let v = r.json();
    assert_eq!(v["status"], "Success");
    assert!(
        v.get("machinePatch").is_none() && v.get("bootstrapConfigPatch").is_none(),
        "{v}"
    );
    assert!(
        v["message"].as_str().unwrap().contains("unreachable"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn can_update_machine_asks_the_nodes_agent() {
    let mut w = World::new(23).await;
    w.add_agent("cp-node", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    let mut req = can_update_machine_request();
    req["settings"]["agentPort"] = json!(w.agent_port.to_string());
    let name = req["desired"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = machine(&name, "v1.35.2", "cp-node", &w.agents[0].ip, true);
    live["spec"] = req["desired"]["machine"]["spec"].clone();
    w.api.put(live);
    let r = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap();
    let v = r.json();
    // This agent has no package manager: the version cannot move in place; files and
    // kubelet flags can, so the bootstrap config is covered and the Machine is not.
    assert_eq!(v["status"], "Success", "{v}");
    assert!(v.get("machinePatch").is_none(), "{v}");
    assert!(v["bootstrapConfigPatch"]["patch"].is_string(), "{v}");
    assert!(v["message"].as_str().unwrap().contains("version"), "{v}");
    assert_eq!(
        count_accepted(&w.dir.path().join("state-cp-node")),
        0,
        "CheckPlan records nothing"
    );
}

/// One agent on a sandboxed real systemd with the stand-in Kubernetes packages at 1.30
/// (apt): the updater moves it to v1.31.2 in place — the pattern `1.31.2-*` resolved to the
/// exact version by the agent and journaled, kubeadm upgrade node, the kubelet restarted by
/// systemd, the unitActive and kubeletVersion gates — and writes the files and flags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_real_systemd_moves_to_the_new_version_in_place() {
    use inplace_agent::host::packages::ManagerKind;
    let Some(node) = sandbox::SandboxNode::boot() else {
        return;
    };
    if let Some(why) =
        inplace_agent::sandbox::packages::missing_tools(&node.path("/"), ManagerKind::Apt)
    {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("cannot build an apt repository with CI=true: {why}");
        }
        eprintln!("\n**** SKIP: apt version bump not run: {why} ****\n");
        return;
    }
    let systemd = node
        .install_kube_packages(
            ManagerKind::Apt,
            sandbox::Standin::Binary(&overlay::standin_for_packages()),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let (old, new) = inplace_agent::sandbox::packages::versions(ManagerKind::Apt);
    let new_upstream = inplace_agent::sandbox::packages::upstream(new).to_owned();
    let mut w = World::new(24).await;
    // The agent runs beside the node (host network) and manages it through its bus.
    let root = node.root();
    w.start_agent("sys-node", &root, &["--bus", &node.bus_address()], &[]);
    w.start_updater();
    let mut capi = w.client();
    // The kubelet's healthz is in the node's network namespace, out of the agent's reach
    // here: no httpGet gate (unitActive and kubeletVersion remain).
    let settings = json!({"agentPort": w.agent_port.to_string(), "kubeletHealthzURL": "", "gateTimeoutSeconds": "60", "drain": "Never"});
    let version = format!("v{new_upstream}");
    let (machine, config) = w.put_machine(
        "sys-0",
        0,
        &version,
        bootstrap_spec(json!([
        {"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=systemd\n"}])),
    );
    let body = update_request(&machine, Some(&config), settings);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    let last = seen.last().unwrap();
    assert_eq!(
        last["status"],
        "Success",
        "{seen:?}\n{}\n{}",
        w.updater_log(),
        w.agents[0].proc.log()
    );
    assert_eq!(last["retryAfterSeconds"], 0);
    for pkg in ["kubeadm", "kubelet", "kubectl"] {
        let (v, held) =
            inplace_agent::sandbox::packages::installed(&root, ManagerKind::Apt, pkg).unwrap();
        assert_eq!(v, new, "{pkg} (was {old})");
        assert!(held, "{pkg} is held");
    }
    assert_eq!(
        node.read_file("/etc/kubernetes/inplace-demo.conf"),
        "mode=systemd\n"
    );
    assert!(
        node.read_file("/var/lib/kubelet/kubeadm-flags.env")
            .contains("--max-pods=150")
    );
    let state = w.dir.path().join("state-sys-node");
    let journal = std::fs::read_to_string(inplace_agent::journal::file_path(&state)).unwrap();
    assert!(
        journal.contains("versionResolved") && journal.contains(&format!("\"version\":\"{new}\"")),
        "the exact version is journaled"
    );
    assert!(
        journal.contains("kubelet.service"),
        "the kubelet was restarted"
    );
    let state = systemd
        .unit_state("kubelet.service")
        .expect("kubelet state");
    assert!(state.is_active(), "{state:?}");
    // Again: done at once.
    let seen = poll_update(&mut capi, &body, SCALE).await;
    assert_eq!(seen.len(), 1);
    let _ = Duration::ZERO;
}

/// Content hash of every regular file under `root` (the agent's own state excluded).
fn snapshot(root: &Path) -> Vec<(String, String)> {
    use sha2::Digest;
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            if rel.starts_with("var/lib/inplace-agent") || rel.starts_with("run") {
                continue;
            }
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_file() {
                let bytes = std::fs::read(&p).unwrap_or_default();
                out.push((rel, hex::encode(sha2::Sha256::digest(&bytes))));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_demo_drives_an_agent_through_emulated_capi_calls() {
    let out = std::process::Command::new(UPDATER)
        .args(["demo", "--agent", AGENT])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for want in [
        "update-machine for UpdateMachine (failurePolicy Fail, 10 s)",
        "replace /spec/template/spec/version",
        "retryAfterSeconds=0",
        "/etc/kubernetes/inplace-demo.conf: \"mode=v2\"",
        "/etc/kubernetes/registry-auth: (absent)",
        "default/web-1 blocked by PodDisruptionBudget default/web",
        "pods left on demo-node: kube-system/kube-proxy-demo, kube-system/etcd-demo-node",
        "cordoned after the plan succeeded: false",
        // The control-plane step: the worker refused ahead of its control plane, then the
        // control-plane node moved and proved healthy.
        "worker first: UpdateMachine → Failure",
        "is newer than the control plane (Machine demo-control-plane-4bz9k runs v1.35.3)",
        "ghcr.io/kube-vip/kube-vip:v1.1.0",
        "the controlPlane gate read, before done: GET /api/v1/namespaces/kube-system/pods/kube-apiserver-demo-cp",
        "GET /readyz",
        "UpdateMachine → Failure",
        // The not-in-place answer and its reason: the updater's log line, the Event.
        "reason_class=\"field-not-in-place\"",
        "Event on MachineDeployment default/demo-md-0: Normal NotUpdatedInPlace (count 1): not in place: preKubeadmCommands runs only when the node is bootstrapped",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    assert!(!text.contains("s3cr3t"), "{text}");
}
