//! Why a Machine was not updated in place (issue 46; crates/updater/src/why.rs, events.rs,
//! explain.rs; docs/decisions/0017-why-not-in-place.md): when `CanUpdateMachineSet` or
//! `CanUpdateMachine` answers less than everything, the reason — which field, which nodes,
//! what they lack — is in the updater's log line with its class, in one Event on the
//! object an operator looks at (the MachineDeployment; the KubeadmControlPlane), bumped
//! rather than repeated while Cluster API keeps asking, and in
//! `inplace_updater_decisions_total`; and `inplace-updater explain` says the same before
//! the change is applied. The real updater binary, real agents (`--services off`), the
//! stand-in Kubernetes API.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::patience::deadline;
use crate::support::updater::*;
use inplace_updater::emulate::CapiClient;
use inplace_updater::hooks::Hook;

const MD: &str = "capi-quickstart-md-0";
const MD_UID: &str = "0d0d0d0d-0000-4000-8000-00000000000a";
const MS_UID: &str = "5e1d0a2c-0000-4000-8000-0000000000a1";
const KCP: &str = "capi-quickstart-control-plane";
const KCP_UID: &str = "c0c0c0c0-0000-4000-8000-00000000000b";

/// What the log and the Event say of a kubeletExtraArgs change on agents that run with
/// services off (the stand-in nodes of the world's agents).
const SERVICES_OFF: &str = "joinConfiguration.nodeRegistration.kubeletExtraArgs needs a kubelet \
     restart; the agents on ms-node-a (Machine default/ms-0), ms-node-b (Machine default/ms-1) \
     do not manage services (--services off)";

/// What they say of a preKubeadmCommands change.
const NEVER: &str = "preKubeadmCommands runs only when the node is bootstrapped: only a new \
     Machine applies it";

fn fixture(name: &str) -> Value {
    serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/updater")
                .join(name),
        )
        .unwrap(),
    )
    .unwrap()
}

async fn decisions(capi: &mut CapiClient, hook: &str, outcome: &str, reason: &str) -> f64 {
    let text = String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    let series = format!(
        "inplace_updater_decisions_total{{hook=\"{hook}\",outcome=\"{outcome}\",reason=\"{reason}\"}} "
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The Events about `kind`, waiting (bounded) until `count` is what `want` says.
async fn events_on(w: &World, kind: &str, want: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let until = deadline();
    loop {
        let events: Vec<Value> = w
            .api
            .events()
            .into_iter()
            .filter(|e| e["involvedObject"]["kind"] == kind)
            .collect();
        if want(&events) {
            return events;
        }
        assert!(
            Instant::now() < until,
            "events on {kind}: {events:#?}\n{}",
            w.updater_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `inplace-updater explain` against the stand-in, asking the world's agents.
fn explain(w: &World, target: &[&str], files: &[(&str, &Value)]) -> (i32, String, String) {
    let mut cmd = Command::new(UPDATER);
    cmd.arg("explain")
        .args(target)
        .arg("--kubeconfig")
        .arg(w.dir.path().join("kubeconfig"))
        .arg("--agent-cert")
        .arg(&w.client_cert.cert)
        .arg("--agent-key")
        .arg(&w.client_cert.key)
        .arg("--agent-ca")
        .arg(w.pki.ca());
    for (name, object) in files {
        let path = w.dir.path().join(name);
        std::fs::write(&path, serde_yaml_ng::to_string(object).unwrap()).unwrap();
        cmd.arg("-f").arg(path);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// (a) A kubeletExtraArgs change of a MachineDeployment whose nodes' agents run with
/// `--services off`: they cannot restart the kubelet, so Cluster API rolls out — and the
/// log, one Event on the MachineDeployment (its count bumped, not repeated), the metric and
/// `explain` all say why, naming the field, the nodes and what they lack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_flag_on_agents_without_services_says_why_in_the_log_an_event_the_metric_and_explain()
 {
    let mut w = World::new(174).await;
    w.add_agent("ms-node-a", "v1.35.1");
    w.add_agent("ms-node-b", "v1.35.1");
    w.start_updater();
    let mut capi = w.client();

    let mut body = fixture("can-update-machineset-request.json");
    body["settings"]["agentPort"] = json!(w.agent_port.to_string());
    // Only the kubelet flags change (no version bump, the same files).
    let current_t = body["current"]["bootstrapConfigTemplate"].clone();
    body["desired"]["machineSet"]["spec"]["template"]["spec"]["version"] =
        body["current"]["machineSet"]["spec"]["template"]["spec"]["version"].clone();
    body["desired"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"]["files"] =
        current_t["spec"]["template"]["spec"]["files"].clone();

    // The MachineDeployment, its current MachineSet (owned by it), that MachineSet's two
    // Machines and its KubeadmConfigTemplate, as the API server has them.
    let mut set = body["current"]["machineSet"].clone();
    let set_name = set["metadata"]["name"].as_str().unwrap().to_owned();
    set["metadata"]["uid"] = json!(MS_UID);
    set["metadata"]["ownerReferences"] = json!([{"apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineDeployment", "name": MD, "uid": MD_UID, "controller": true}]);
    w.api.put(set.clone());
    w.api.put(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": MD, "namespace": "default", "uid": MD_UID},
        "spec": {"clusterName": "capi-quickstart", "replicas": 2,
                 "selector": {"matchLabels": {"cluster.x-k8s.io/deployment-name": MD}},
                 "template": set["spec"]["template"].clone()},
    }));
    w.api.put(current_t.clone());
    for (i, name) in ["ms-0", "ms-1"].into_iter().enumerate() {
        let (mut machine, _) = w.put_machine(name, i, "v1.35.1", bootstrap_spec(json!([])));
        machine["metadata"]["labels"] = set["spec"]["selector"]["matchLabels"].clone();
        machine["metadata"]["ownerReferences"] = json!([{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet", "name": set_name,
            "uid": MS_UID, "controller": true,
        }]);
        w.api.put(machine);
    }

    // Cluster API asks three times in a row (every reconcile of the rollout).
    for _ in 0..3 {
        let r = capi
            .call(Hook::CanUpdateMachineSet, &go_json(&body))
            .await
            .unwrap()
            .json();
        assert_eq!(r["status"], "Success", "{r}");
        assert!(r.get("bootstrapConfigTemplatePatch").is_none(), "{r}");
    }
    let log = w.updater_log();
    let line = log
        .lines()
        .find(|l| l.contains("hook=CanUpdateMachineSet") && l.contains("reason_class="))
        .unwrap_or_else(|| panic!("no reason in the log:\n{log}"));
    assert!(
        line.contains("reason_class=\"agent-capability\"")
            || line.contains("reason_class=agent-capability"),
        "{line}"
    );
    assert!(line.contains(SERVICES_OFF), "{line}");

    // One Event, on the MachineDeployment (found through the MachineSet's owner).
    let events = events_on(&w, "MachineDeployment", |e| !e.is_empty()).await;
    assert_eq!(events.len(), 1, "{events:#?}");
    let e = &events[0];
    assert_eq!(e["involvedObject"]["name"], MD);
    assert_eq!(e["involvedObject"]["uid"], MD_UID);
    assert_eq!(e["reason"], "NotUpdatedInPlace");
    assert_eq!(e["type"], "Normal");
    assert_eq!(e["action"], "CanUpdateMachineSet");
    assert_eq!(e["message"], format!("not in place: {SERVICES_OFF}"));
    assert_eq!(e["count"], 1, "the repeats wait out the interval: {e}");
    assert!(
        w.api
            .events()
            .iter()
            .all(|e| e["involvedObject"]["kind"] == "MachineDeployment"),
        "{:#?}",
        w.api.events()
    );

    // After the interval, the next call bumps the same Event by every call since.
    tokio::time::sleep(Duration::from_millis(10_300)).await;
    capi.call(Hook::CanUpdateMachineSet, &go_json(&body))
        .await
        .unwrap();
    let events = events_on(&w, "MachineDeployment", |e| {
        e.first().is_some_and(|e| e["count"] == 4)
    })
    .await;
    assert_eq!(events.len(), 1, "{events:#?}");
    assert!(
        w.api
            .requests()
            .iter()
            .any(|(m, p)| m == "PATCH" && p.contains("/events/")),
        "the count is bumped by a patch"
    );
    assert_eq!(
        decisions(
            &mut capi,
            "CanUpdateMachineSet",
            "partial",
            "agent-capability"
        )
        .await,
        4.0
    );

    // explain: the same answer before anything is applied (the new template as a file).
    let template = body["desired"]["bootstrapConfigTemplate"].clone();
    let written = w.api.events();
    let (code, out, err) = explain(
        &w,
        &["--machine-deployment", &format!("default/{MD}")],
        &[("template.yaml", &template)],
    );
    assert_eq!(code, 3, "exit 3: not in place\n{out}\n{err}");
    assert!(out.contains(SERVICES_OFF), "{out}\n{err}");
    assert!(out.contains("agent-capability"), "{out}");
    assert!(
        out.starts_with(&format!("MachineDeployment default/{MD}: not in place")),
        "{out}"
    );
    assert_eq!(w.api.events(), written, "explain writes no Event");
    // docs/updater.md's example is this very output.
    assert_eq!(
        out,
        documented_explain_output(),
        "docs/updater.md, \"Why was my Machine replaced?\""
    );
}

/// The output lines of the example after `<!-- explain-example -->` in docs/updater.md (the
/// command's lines and `$ echo $?` left out).
fn documented_explain_output() -> String {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/updater.md"))
            .unwrap();
    let (_, after) = doc.split_once("<!-- explain-example -->\n```\n").unwrap();
    let (block, _) = after.split_once("```").unwrap();
    let mut out = String::new();
    let mut in_command = false;
    for line in block.lines() {
        if line.starts_with("$ echo") {
            break;
        }
        if line.starts_with("$ ") || in_command {
            in_command = line.ends_with('\\');
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// (b) A field that never goes in place (preKubeadmCommands) on a KubeadmControlPlane's
/// Machine: `CanUpdateMachine` says so in the log, in one Event on the KubeadmControlPlane
/// naming the Machine, in the metric, and `explain` of the KubeadmControlPlane says the
/// same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_that_never_goes_in_place_says_why_on_the_control_plane_and_in_explain() {
    let mut w = World::new(175).await;
    let a = w.add_agent("cp-node-0", "v1.35.1");
    // KCP's certSANs are on the node's serving certificate, as kubeadm left them.
    crate::support::pki::control_plane_serving_certificate(
        &w.agents[a].root,
        &["localhost", "127.0.0.1"],
    );
    w.start_updater();
    let mut capi = w.client();
    let port = w.agent_port.to_string();

    let fixture = fixture("can-update-machine-request.json");
    let mut config = fixture["current"]["bootstrapConfig"].clone();
    config["spec"]["preKubeadmCommands"] = json!(["echo a"]);
    let name = fixture["current"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    // The live Machine, owned by the KubeadmControlPlane; its KubeadmConfig; the
    // KubeadmControlPlane whose kubeadmConfigSpec it was made from.
    let mut live = machine(&name, "v1.35.1", "cp-node-0", &w.agents[0].ip, false);
    live["metadata"]["labels"] = fixture["current"]["machine"]["metadata"]["labels"].clone();
    live["metadata"]["ownerReferences"] = json!([{"apiVersion": "controlplane.cluster.x-k8s.io/v1beta2",
        "kind": "KubeadmControlPlane", "name": KCP, "uid": KCP_UID, "controller": true}]);
    live["spec"] = fixture["current"]["machine"]["spec"].clone();
    w.api.put(live.clone());
    w.api.put(config.clone());
    let kcp = json!({
        "apiVersion": "controlplane.cluster.x-k8s.io/v1beta2", "kind": "KubeadmControlPlane",
        "metadata": {"name": KCP, "namespace": "default", "uid": KCP_UID},
        "spec": {"replicas": 1, "version": live["spec"]["version"].clone(),
                 "kubeadmConfigSpec": config["spec"].clone()},
    });
    w.api.put(kcp.clone());

    // KubeadmControlPlane's request: only preKubeadmCommands changes.
    let strip = |v: &Value| {
        let mut v = v.clone();
        v.as_object_mut().unwrap().remove("status");
        v
    };
    let mut desired_config = config.clone();
    desired_config["spec"]["preKubeadmCommands"] = json!(["echo b"]);
    let request = json!({
        "kind": "CanUpdateMachineRequest",
        "apiVersion": "hooks.runtime.cluster.x-k8s.io/v1alpha1",
        "settings": {"agentPort": port},
        "current": {"machine": strip(&live), "bootstrapConfig": config.clone()},
        "desired": {"machine": strip(&live), "bootstrapConfig": desired_config},
    });
    for _ in 0..2 {
        let r = capi
            .call(Hook::CanUpdateMachine, &go_json(&request))
            .await
            .unwrap()
            .json();
        assert_eq!(r["status"], "Success", "{r}\n{}", w.updater_log());
        assert!(
            r["message"]
                .as_str()
                .unwrap()
                .contains("preKubeadmCommands"),
            "{r}"
        );
    }
    let log = w.updater_log();
    let line = log
        .lines()
        .find(|l| l.contains("hook=CanUpdateMachine ") && l.contains("reason_class="))
        .unwrap_or_else(|| panic!("no reason in the log:\n{log}"));
    assert!(line.contains("field-not-in-place"), "{line}");
    assert!(line.contains(NEVER), "{line}");

    let events = events_on(&w, "KubeadmControlPlane", |e| !e.is_empty()).await;
    assert_eq!(events.len(), 1, "{events:#?}");
    let e = &events[0];
    assert_eq!(e["involvedObject"]["name"], KCP);
    assert_eq!(e["involvedObject"]["uid"], KCP_UID);
    assert_eq!(e["action"], "CanUpdateMachine");
    assert_eq!(
        e["message"],
        format!("not in place: Machine default/{name}: {NEVER}")
    );
    assert_eq!(
        decisions(
            &mut capi,
            "CanUpdateMachine",
            "partial",
            "field-not-in-place"
        )
        .await,
        2.0
    );

    // explain of the KubeadmControlPlane with the change as it would be applied.
    let mut proposed = kcp.clone();
    proposed["spec"]["kubeadmConfigSpec"]["preKubeadmCommands"] = json!(["echo b"]);
    let (code, out, err) = explain(
        &w,
        &["--kubeadm-control-plane", &format!("default/{KCP}")],
        &[("kcp.yaml", &proposed)],
    );
    assert_eq!(code, 3, "{out}\n{err}");
    assert!(
        out.contains(&format!(
            "Machine default/{name} (partial, field-not-in-place): {NEVER}"
        )),
        "{out}\n{err}"
    );
    // The same change not made: everything in place, exit 0.
    let (code, out, err) = explain(
        &w,
        &["--kubeadm-control-plane", &format!("default/{KCP}")],
        &[("kcp.yaml", &kcp)],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("in place: Cluster API would update its Machines in place"),
        "{out}"
    );
}

/// `CanUpdateMachine` and `CanUpdateMachineSet` give one answer for the same node: a
/// kubeletExtraArgs change on an agent that does not manage services (`--services off`, as
/// the world's agents run) is not in place — the flag would be written and never read, as
/// nothing restarts the kubelet — and the reason says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn can_update_machine_leaves_a_kubelet_flag_to_a_rollout_where_services_are_off() {
    let mut w = World::new(176).await;
    w.add_agent("node-d", "v1.35.1");
    w.start_updater();
    let (mut req, live) = fixture_request_for_agent_0(&w);
    w.api.put(live);
    // Only the kubelet flags change (max-pods added): the same version, the same files.
    req["desired"]["machine"]["spec"]["version"] =
        req["current"]["machine"]["spec"]["version"].clone();
    req["desired"]["bootstrapConfig"]["spec"]["files"] =
        req["current"]["bootstrapConfig"]["spec"]["files"].clone();
    let v = w
        .client()
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}");
    assert!(v.get("bootstrapConfigPatch").is_none(), "not covered: {v}");
    let message = v["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("kubeletExtraArgs") && message.contains("--services off"),
        "{v}\n{}",
        w.updater_log()
    );
}
