//! Whole clusters updated in place, as Cluster API drives it, against the stand-ins: real
//! `inplace-agent serve` processes on sandbox trees, the Kubernetes API stand-in
//! (`inplace_updater::standin`) in this process as the management cluster and every workload
//! cluster, the release `inplace-updater serve`, and this program calling the hooks over
//! HTTPS in Cluster API's order and shapes (`inplace_updater::emulate::CapiClient`).
//!
//! ```text
//! cluster upgrade [--workers N] [--max-unavailable M] [--restart-seconds S] [--drain MODE] [--json FILE]
//! cluster fleet [--clusters C] [--machines M] [--at-once P] [--max-unavailable U] [--drain MODE] [--json FILE]
//! ```
//!
//! **`upgrade`**: one workload cluster, 3 control-plane Machines and N workers (10), moved
//! from v1.35.2 to v1.36.0 in place, in Cluster API's order
//! (kubernetes-sigs/cluster-api `docs/proposals/20240807-in-place-updates-implementation-notes.md`):
//! KubeadmControlPlane one control-plane Machine at a time, `CanUpdateMachine`, then the
//! Machine and its KubeadmConfig set to the desired state and marked in place, then
//! `UpdateMachine` polled (again `retryAfterSeconds` after an in-progress answer) until done;
//! then the workers as the MachineDeployment's in-place flow: `CanUpdateMachineSet` once, then
//! M Machines at a time (`maxUnavailable`, 1) moved to the new MachineSet and updated the same
//! way. What stands in for the node work: each plan writes the kubelet stand-in's version file
//! (for the package upgrade), and on a control-plane node the four static pod manifests at the
//! new image (for `kubeadm upgrade node`); the control-plane node's API server and mirror pods
//! are `tests/support/restarting_control_plane.rs`, which stands in for the static pods' restart by
//! answering unready for S seconds (5) after a manifest is written. The plan's `controlPlane`
//! gate must pass before done. Figures: per node, from its first hook call to the done answer;
//! the whole cluster; per control-plane node the time it did not serve: from the write of its
//! kube-apiserver manifest (its modification time: the stand-in's restart begins there) to
//! the end of the plan (the agent's `finishedAtMs`, after the gate passed).
//!
//! **`fleet`**: C workload clusters (100) of M Machines (20: 3 control-plane, 17 workers)
//! each, the same upgrade, every cluster its own CA (`agentCA: ClusterSecret`: its
//! `<cluster>-ca` Secret with the CA's key), drain on (`drain: Always`: every node cordoned,
//! its Pod evicted, uncordoned), one updater. Every Machine has a real agent presenting a
//! certificate of its cluster's CA for its node name; to keep the processes on this machine
//! bounded, clusters are updated P at a time (5): a cluster's agents are started, it is
//! upgraded, its agents stopped. Figures: each hook's latency p50/p99/max over every call;
//! the updater's RSS (`VmRSS` sampled every 200 ms: peak and `VmHWM`; steady: 10 s after the
//! last Machine); the API stand-in's requests per Machine, by verb and resource.

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use inplace_api::pki::DEFAULT_UPDATER_IDENTITY;
use inplace_updater::emulate::{CapiClient, Pki};
use inplace_updater::hooks::{
    HOOKS_API_VERSION, Hook, PENDING_HOOKS_ANNOTATION, UPDATE_IN_PROGRESS_ANNOTATION,
};
use inplace_updater::standin::{ApiStandin, extension_config, node as node_object, pod, secret};
use serde_json::{Value, json};

use support::daemon::{Daemon, Ready, Starting, raise_nofile, serve_command};
use support::memory::Memory;
use support::restarting_control_plane::{self as control_plane, ControlPlaneNode};

type Error = Box<dyn std::error::Error + Send + Sync>;

const HOST: &str = "inplace-updater.inplace-system.svc";
const FROM: &str = "v1.35.2";
const TO: &str = "v1.36.0";
const KUBELET_VERSION_FILE: &str = "/usr/local/bin/kubelet.version";

fn bin(var: &str, built: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(built))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

/// p50, p99 and max of `v`, printed with `unit` and as JSON.
fn summary(name: &str, mut v: Vec<f64>, unit: &str) -> Value {
    v.sort_by(f64::total_cmp);
    let (p50, p99, max) = (
        percentile(&v, 0.5),
        percentile(&v, 0.99),
        v.last().copied().unwrap_or(0.0),
    );
    println!(
        "{name}: n={}, p50 {p50:.2} {unit}, p99 {p99:.2} {unit}, max {max:.2} {unit}",
        v.len()
    );
    json!({"n": v.len(), "p50": p50, "p99": p99, "max": max, "unit": unit})
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

// === the pieces ===

/// Starts agent `node` on a fresh kubeadm-like tree under `dir` whose kubelet (the
/// stand-in) reports [`FROM`], with a server certificate from `signer` (its cluster's CA)
/// for its node name and `ip`, listening on `ip:port`. `prepare` runs on the tree first.
fn spawn_agent(
    dir: &Path,
    signer: &Pki,
    client_ca: &Path,
    (node, ip, port): (&str, &str, u16),
    prepare: impl FnOnce(&Path) -> Result<(), Error>,
) -> Result<Starting, Error> {
    let home = dir.join(node);
    let root = home.join("root");
    inplace_demo_node::build_kubeadm_worker(&root)?;
    let bin_dir = root.join("usr/local/bin");
    std::fs::create_dir_all(&bin_dir)?;
    std::fs::copy(support::updater::KUBELET_STANDIN, bin_dir.join("kubelet"))?;
    std::fs::write(bin_dir.join("kubelet.version"), format!("{FROM}\n"))?;
    prepare(&root)?;
    let cert = signer.server_with_uris(node, &[node, ip], &[])?;
    let mut cmd = serve_command(
        &bin("INPLACE_AGENT_BIN", support::programs::AGENT),
        &root,
        node,
        &cert.cert,
        &cert.key,
        client_ca,
    );
    cmd.args(["--no-chroot", "--services", "off"])
        .args(["--reader", DEFAULT_UPDATER_IDENTITY])
        .arg("--listen")
        .arg(format!("{ip}:{port}"))
        .arg("--state-dir")
        .arg(home.join("state"))
        .env("INPLACE_AGENT_LOG", "warn");
    Ok(Daemon::spawn(cmd, Ready::Notify(home.join("notify.sock")))?)
}

/// Starts the release updater against `api`, its agent client certificate from `pki`.
fn start_updater(dir: &Path, pki: &Pki, api: &ApiStandin) -> Result<(Daemon, SocketAddr), Error> {
    let client = pki.updater_client()?;
    let serving = pki.server("serving", &[HOST, "127.0.0.1"])?;
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let mut cmd = support::updater::updater_serve_command(
        Path::new(&bin("INPLACE_UPDATER_BIN", support::programs::UPDATER)),
        &serving,
        &client,
        &pki.ca(),
        &kubeconfig,
    );
    cmd.arg("--allow-local-workload-servers") // the stand-in's workload clusters are on loopback
        .env("INPLACE_UPDATER_LOG", "warn,inplace_updater::cli=info");
    let updater =
        tokio::task::block_in_place(|| Daemon::start(cmd, Ready::LogFile(dir.join("updater.log"))))
            .map_err(|e| format!("the updater did not start: {e}"))?;
    let addr: SocketAddr = updater.addr.parse()?;
    Ok((updater, addr))
}

/// A workload cluster's objects in the management cluster: its CA Secret with the key that
/// proves it, its kubeconfig Secret (pointing back at the stand-in, which is then the
/// workload cluster too).
fn put_cluster(api: &ApiStandin, namespace: &str, cluster: &str, ca: &Pki) -> Result<(), Error> {
    let pem = std::fs::read(ca.ca())?;
    api.put(secret(
        namespace,
        &format!("{cluster}-ca"),
        &[("tls.crt", &pem), ("tls.key", ca.ca_key_pem().as_bytes())],
    ));
    api.put(api.workload_secret(namespace, cluster));
    api.put(
        json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": cluster, "namespace": namespace}, "spec": {}}),
    );
    Ok(())
}

/// The node in the workload cluster, with one Pod of a ReplicaSet to evict.
fn put_node(api: &ApiStandin, node: &str) {
    api.put(node_object(node, FROM));
    api.put(pod(
        "default",
        &format!("web-{node}"),
        node,
        Some(("ReplicaSet", "web-7d9")),
        json!({"app": "web"}),
    ));
}

/// Where a Machine sits.
struct Place<'a> {
    namespace: &'a str,
    cluster: &'a str,
    name: &'a str,
    node: &'a str,
    ip: &'a str,
}

/// A live Machine at `version`: a control-plane Machine (labelled, owned by the
/// KubeadmControlPlane) or a worker owned by MachineSet `set`.
fn machine(p: &Place<'_>, version: &str, set: Option<&str>) -> Value {
    let mut labels = json!({"cluster.x-k8s.io/cluster-name": p.cluster});
    let owner = match set {
        None => {
            labels["cluster.x-k8s.io/control-plane"] = json!("");
            labels["cluster.x-k8s.io/control-plane-name"] =
                json!(format!("{}-control-plane", p.cluster));
            json!({"apiVersion": "controlplane.cluster.x-k8s.io/v1beta2", "kind": "KubeadmControlPlane",
                   "name": format!("{}-control-plane", p.cluster), "uid": "kcp-uid", "controller": true})
        }
        Some(set) => {
            labels["cluster.x-k8s.io/deployment-name"] = json!(format!("{}-md-0", p.cluster));
            labels["machine-template-hash"] = json!(set);
            json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet", "name": set,
                   "uid": format!("uid-{set}"), "controller": true})
        }
    };
    json!({
        "kind": "Machine", "apiVersion": "cluster.x-k8s.io/v1beta2",
        "metadata": {"name": p.name, "namespace": p.namespace, "labels": labels,
                     "ownerReferences": [owner], "annotations": {}},
        "spec": {
            "clusterName": p.cluster,
            "bootstrap": {"configRef": {"kind": "KubeadmConfig", "name": p.name, "apiGroup": "bootstrap.cluster.x-k8s.io"},
                          "dataSecretName": p.name},
            "infrastructureRef": {"kind": "DevMachine", "name": p.name, "apiGroup": "infrastructure.cluster.x-k8s.io"},
            "version": version,
            "providerID": format!("dev:////{}", p.name),
        },
        "status": {
            "nodeRef": {"name": p.node},
            "nodeInfo": {"kubeletVersion": version},
            "addresses": [{"type": "Hostname", "address": p.node}, {"type": "InternalIP", "address": p.ip}],
            "phase": "Running",
        },
    })
}

fn kubeadm_config(namespace: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2", "kind": "KubeadmConfig",
           "metadata": {"name": name, "namespace": namespace}, "spec": spec})
}

fn infra(namespace: &str, name: &str) -> Value {
    json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta2", "kind": "DevMachine",
           "metadata": {"name": name, "namespace": namespace}, "spec": {}})
}

fn strip_status(o: &Value) -> Value {
    let mut o = o.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("status");
    }
    o
}

/// A worker's KubeadmConfig spec at `version`'s node files, and a control-plane node's,
/// whose files also hold the static pod manifests (`api`: its API server stand-in).
fn bootstrap_spec(version: &str, control_plane: Option<(&str, bool)>) -> Value {
    let mut files = vec![json!({"path": KUBELET_VERSION_FILE, "owner": "root:root",
                                "permissions": "0644", "content": format!("{version}\n")})];
    let mut spec =
        json!({"joinConfiguration": {"nodeRegistration": {"imagePullPolicy": "IfNotPresent"}}});
    if let Some((api, stacked)) = control_plane {
        for c in control_plane::COMPONENTS {
            files.push(json!({"path": format!("/etc/kubernetes/manifests/{c}.yaml"), "owner": "root:root",
                              "permissions": "0600", "content": control_plane::manifest_text(c, version, api)}));
        }
        spec["joinConfiguration"]["controlPlane"] = json!({});
        spec["clusterConfiguration"] = if stacked {
            json!({"etcd": {"local": {}}})
        } else {
            json!({"etcd": {"external": {"endpoints": ["https://10.0.0.5:2379"]}}})
        };
    }
    spec["files"] = json!(files);
    spec
}

fn can_update_machine_body(
    settings: &Value,
    current: (&Value, &Value),
    desired: (&Value, &Value),
) -> Vec<u8> {
    let ns = current.0["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default();
    let name = current.0["metadata"]["name"].as_str().unwrap_or_default();
    serde_json::to_vec(&json!({
        "kind": "CanUpdateMachineRequest", "apiVersion": HOOKS_API_VERSION, "settings": settings,
        "current": {"machine": strip_status(current.0), "infrastructureMachine": infra(ns, name), "bootstrapConfig": current.1},
        "desired": {"machine": strip_status(desired.0), "infrastructureMachine": infra(ns, name), "bootstrapConfig": desired.1},
    }))
    .unwrap_or_default()
}

fn update_machine_body(settings: &Value, machine: &Value, config: &Value) -> Vec<u8> {
    let ns = machine["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default();
    let name = machine["metadata"]["name"].as_str().unwrap_or_default();
    serde_json::to_vec(&json!({
        "kind": "UpdateMachineRequest", "apiVersion": HOOKS_API_VERSION, "settings": settings,
        "desired": {"machine": strip_status(machine), "infrastructureMachine": infra(ns, name), "bootstrapConfig": config},
    }))
    .unwrap_or_default()
}

/// The MachineSet `name` of a cluster's MachineDeployment at `version`.
fn machine_set(
    namespace: &str,
    cluster: &str,
    name: &str,
    version: &str,
    replicas: usize,
) -> Value {
    let labels = json!({"cluster.x-k8s.io/cluster-name": cluster,
                        "cluster.x-k8s.io/deployment-name": format!("{cluster}-md-0"),
                        "machine-template-hash": name});
    json!({
        "kind": "MachineSet", "apiVersion": "cluster.x-k8s.io/v1beta2",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"), "labels": labels},
        "spec": {"clusterName": cluster, "replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "clusterName": cluster,
                     "bootstrap": {"configRef": {"kind": "KubeadmConfigTemplate", "name": name, "apiGroup": "bootstrap.cluster.x-k8s.io"}},
                     "infrastructureRef": {"kind": "DevMachineTemplate", "name": name, "apiGroup": "infrastructure.cluster.x-k8s.io"},
                     "version": version}}},
    })
}

fn can_update_machine_set_body(settings: &Value, current: &Value, desired: &Value) -> Vec<u8> {
    let ns = current["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default();
    let template = |set: &Value, version: &str| {
        json!({"apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2", "kind": "KubeadmConfigTemplate",
               "metadata": {"name": set["metadata"]["name"], "namespace": ns},
               "spec": {"template": {"spec": bootstrap_spec(version, None)}}})
    };
    let infra = |set: &Value| {
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta2", "kind": "DevMachineTemplate",
               "metadata": {"name": set["metadata"]["name"], "namespace": ns}, "spec": {"template": {"spec": {}}}})
    };
    let version = |set: &Value| {
        set["spec"]["template"]["spec"]["version"]
            .as_str()
            .unwrap_or(FROM)
            .to_owned()
    };
    serde_json::to_vec(&json!({
        "kind": "CanUpdateMachineSetRequest", "apiVersion": HOOKS_API_VERSION, "settings": settings,
        "current": {"machineSet": current, "infrastructureMachineTemplate": infra(current),
                    "bootstrapConfigTemplate": template(current, &version(current))},
        "desired": {"machineSet": desired, "infrastructureMachineTemplate": infra(desired),
                    "bootstrapConfigTemplate": template(desired, &version(desired))},
    }))
    .unwrap_or_default()
}

/// What one Machine's in-place update took.
#[derive(Default)]
struct MachineRun {
    /// `CanUpdateMachine`'s latency (KubeadmControlPlane's Machines only).
    can_update_ms: Option<f64>,
    update_ms: Vec<f64>,
    /// Each in-progress answer's `retryAfterSeconds`.
    retries: Vec<u64>,
    /// From the `CanUpdateMachine` call to the done answer.
    took: Duration,
}

/// How Cluster API starts a Machine's in-place update.
#[derive(Clone)]
enum Via {
    /// KubeadmControlPlane: `CanUpdateMachine` for this Machine first
    /// (`controlplane/kubeadm/internal/controllers/inplace*.go`).
    ControlPlane,
    /// A MachineDeployment whose `CanUpdateMachineSet` said yes: the Machine is moved to the
    /// new MachineSet and updated, no per-Machine question (the implementation notes'
    /// workflows #1–#4).
    MachineSet(String),
}

/// Hook calls that failed on the connection (a refused or dropped handshake) and were
/// made again, as Cluster API's next reconcile would.
static TRANSPORT_RETRIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `UpdateMachine` answers of status Failure, called again as Cluster API would.
static HOOK_FAILURES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `CanUpdateMachine` / `CanUpdateMachineSet` answers of status Failure (nothing decided:
/// the updater could not read the management cluster), called again as Cluster API would.
static UNDECIDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A `CanUpdate*` `hook` with `body` until it decides: Cluster API takes a Failure as a
/// reconcile error and asks again after a backoff (kubernetes-sigs/cluster-api
/// `controlplane/kubeadm/internal/controllers/inplace_canupdatemachine.go`); so does the
/// bench, 1 s apart, up to 5 times, and counts it.
async fn call_until_decided(
    client: &mut CapiClient,
    hook: Hook,
    body: &[u8],
) -> anyhow::Result<inplace_updater::emulate::HttpResponse> {
    let mut failures = 0;
    loop {
        let r = call(client, hook, body).await?;
        if r.json()["status"] != "Failure" || failures == 5 {
            return Ok(r);
        }
        failures += 1;
        UNDECIDED.fetch_add(1, Ordering::SeqCst);
        println!(
            "{hook:?} decided nothing, asking again in 1 s: {}",
            r.json()["message"]
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// `hook` with `body`, made again up to 3 times (1 s apart) when the connection fails.
async fn call(
    client: &mut CapiClient,
    hook: Hook,
    body: &[u8],
) -> anyhow::Result<inplace_updater::emulate::HttpResponse> {
    let mut tries = 0;
    loop {
        match client.call(hook, body).await {
            Ok(r) => return Ok(r),
            Err(e) if tries < 3 => {
                tries += 1;
                TRANSPORT_RETRIES.fetch_add(1, Ordering::SeqCst);
                println!("{hook:?}: {e}; calling again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One Machine as Cluster API moves it in place: (KubeadmControlPlane only)
/// `CanUpdateMachine`, which must cover it; the live Machine and KubeadmConfig set to the
/// desired state and marked in place; `UpdateMachine` until done (again `retryAfterSeconds`
/// after an in-progress answer); the marks cleared and the node's new version recorded.
async fn update_machine(
    client: &mut CapiClient,
    api: &ApiStandin,
    settings: &Value,
    live: Value,
    desired_spec: Value,
    via: Via,
) -> Result<MachineRun, String> {
    let ns = live["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let name = live["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let desired_config = kubeadm_config(&ns, &name, desired_spec);
    let mut desired = live.clone();
    desired["spec"]["version"] = json!(TO);
    let started = Instant::now();
    let mut run = MachineRun::default();
    match &via {
        Via::ControlPlane => {
            let current_config = api
                .get(&format!(
                    "/apis/bootstrap.cluster.x-k8s.io/v1beta2/namespaces/{ns}/kubeadmconfigs/{name}"
                ))
                .ok_or_else(|| format!("no KubeadmConfig {ns}/{name}"))?;
            let body = can_update_machine_body(
                settings,
                (&live, &current_config),
                (&desired, &desired_config),
            );
            let t = Instant::now();
            let r = call_until_decided(client, Hook::CanUpdateMachine, &body)
                .await
                .map_err(|e| format!("CanUpdateMachine {ns}/{name}: {e}"))?;
            run.can_update_ms = Some(t.elapsed().as_secs_f64() * 1e3);
            let v = r.json();
            if v["status"] != "Success"
                || (v.get("machinePatch").is_none() && v.get("bootstrapConfigPatch").is_none())
            {
                return Err(format!(
                    "CanUpdateMachine {ns}/{name} does not cover it: {v}"
                ));
            }
        }
        Via::MachineSet(set) => {
            desired["metadata"]["ownerReferences"] = json!([{"apiVersion": "cluster.x-k8s.io/v1beta2",
                "kind": "MachineSet", "name": set, "uid": format!("uid-{set}"), "controller": true}]);
            desired["metadata"]["labels"]["machine-template-hash"] = json!(set);
        }
    }
    // What Cluster API does next: the Machine and its KubeadmConfig take the desired specs,
    // the Machine is marked as updating in place with UpdateMachine pending.
    desired["metadata"]["annotations"][UPDATE_IN_PROGRESS_ANNOTATION] = json!("");
    desired["metadata"]["annotations"][PENDING_HOOKS_ANNOTATION] = json!("UpdateMachine");
    api.put(desired.clone());
    api.put(desired_config.clone());
    let body = update_machine_body(settings, &desired, &desired_config);
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut failures = 0;
    loop {
        let t = Instant::now();
        let r = call(client, Hook::UpdateMachine, &body)
            .await
            .map_err(|e| format!("UpdateMachine {ns}/{name}: {e}"))?;
        run.update_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let v = r.json();
        if v["status"] != "Success" {
            // Cluster API's Machine controller takes a Failure as a reconcile error and calls
            // again after a backoff; so does the bench, a few times, and counts it.
            failures += 1;
            HOOK_FAILURES.fetch_add(1, Ordering::SeqCst);
            if failures > 5 {
                return Err(format!("UpdateMachine {ns}/{name}: {v}"));
            }
            println!(
                "UpdateMachine {ns}/{name} failed, calling again in 1 s: {}",
                v["message"]
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        let retry = v["retryAfterSeconds"].as_u64().unwrap_or(0);
        if retry == 0 {
            break;
        }
        run.retries.push(retry);
        if Instant::now() > deadline {
            return Err(format!("UpdateMachine {ns}/{name}: not done in 600 s: {v}"));
        }
        tokio::time::sleep(Duration::from_secs(retry)).await;
    }
    run.took = started.elapsed();
    // Done: the Machine controller clears the marks; the node reports the new kubelet.
    let mut done = desired;
    if let Some(a) = done["metadata"]["annotations"].as_object_mut() {
        a.remove(UPDATE_IN_PROGRESS_ANNOTATION);
        a.remove(PENDING_HOOKS_ANNOTATION);
    }
    done["status"]["nodeInfo"]["kubeletVersion"] = json!(TO);
    api.put(done);
    Ok(run)
}

/// The plan's end as the agent journaled it (`finishedAtMs` of its latest plan).
fn finished_at_ms(root: &Path) -> Result<u64, String> {
    let socket = root.join("run/inplace-agent/status.sock");
    let status = inplace_agent::status::client::get(&socket, "/v1/status", Duration::from_secs(30))
        .map_err(|e| format!("the agent's status at {}: {e}", socket.display()))?;
    let status: Value = serde_json::from_slice(&status.body).map_err(|e| e.to_string())?;
    status["recent"][0]["finishedAtMs"]
        .as_u64()
        .ok_or_else(|| format!("no finishedAtMs in {status}"))
}

fn modified_ms(path: &Path) -> Result<u64, String> {
    let t = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64))
}

/// Samples the updater's `VmRSS` every 200 ms until stopped; the highest seen (KiB).
fn sample_rss(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut peak = 0;
        while !stop.load(Ordering::SeqCst) {
            peak = peak.max(Memory::of(pid).rss);
            std::thread::sleep(Duration::from_millis(200));
        }
        peak
    })
}

// === options ===

#[derive(Clone)]
struct Options {
    mode: String,
    planes: usize,
    workers: usize,
    max_unavailable: Option<usize>,
    restart_seconds: Option<f64>,
    clusters: usize,
    machines: usize,
    at_once: usize,
    /// `settings.drain` (`Always`; `Never` to see what the drain costs).
    drain: String,
    json: Option<PathBuf>,
}

fn options() -> Result<Options, Error> {
    let mut o = Options {
        mode: String::new(),
        planes: 3,
        workers: 10,
        max_unavailable: None,
        restart_seconds: None,
        clusters: 100,
        machines: 20,
        at_once: 5,
        drain: "Always".to_owned(),
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--bench" => {}
            "upgrade" | "fleet" => o.mode = a.clone(),
            "--workers" => o.workers = value()?.parse()?,
            "--max-unavailable" => o.max_unavailable = Some(value()?.parse()?),
            "--restart-seconds" => o.restart_seconds = Some(value()?.parse()?),
            "--clusters" => o.clusters = value()?.parse()?,
            "--machines" => o.machines = value()?.parse()?,
            "--at-once" => o.at_once = value()?.parse()?,
            "--drain" => o.drain = value()?,
            "--json" => o.json = Some(value()?.into()),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    if o.mode.is_empty() {
        return Err("say upgrade or fleet".into());
    }
    if o.machines < o.planes || o.clusters > 250 {
        return Err(format!(
            "--machines must be at least {} and --clusters at most 250",
            o.planes
        )
        .into());
    }
    Ok(o)
}

fn main() -> Result<(), Error> {
    let o = options()?;
    raise_nofile();
    // The API stand-in serves on this runtime too: enough threads that a lane blocked on its
    // agents' start does not starve it.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let figures = runtime.block_on(async {
        if o.mode == "upgrade" {
            upgrade(&o).await
        } else {
            fleet(&o).await
        }
    })?;
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_vec_pretty(&figures)?)?;
    }
    Ok(())
}

// === one workload cluster, in Cluster API's order ===

/// What every cluster of a run shares.
struct Run {
    dir: PathBuf,
    api: ApiStandin,
    settings: Value,
    mgmt: Arc<Pki>,
    /// The agents' port (each agent on its own loopback address).
    port: u16,
    /// The updater's address.
    addr: SocketAddr,
    restart: Duration,
    /// Whether etcd is stacked (the shared stand-in on 127.0.0.1:2381 is up).
    stacked: bool,
}

fn ip(c: usize, i: usize) -> String {
    format!("127.80.{c}.{}", i + 2)
}

/// Machine and node name of Machine `i` of cluster `cluster` (the first `planes` are
/// control-plane Machines).
fn names(cluster: &str, i: usize, planes: usize) -> (String, String) {
    if i < planes {
        (
            format!("{cluster}-control-plane-{i}"),
            format!("{cluster}-cp-{i}"),
        )
    } else {
        (
            format!("{cluster}-md-0-{:02}", i - planes),
            format!("{cluster}-w-{:02}", i - planes),
        )
    }
}

fn cluster_names(c: usize) -> (String, String) {
    (format!("fleet-{c:03}"), format!("wc-{c:03}"))
}

/// Cluster `c` in the management cluster: its CA and kubeconfig Secrets, `planes`
/// control-plane Machines and `workers` Machines of the old MachineSet at [`FROM`], their
/// KubeadmConfigs, both MachineSets, the nodes and their Pods in the workload cluster.
fn put_cluster_objects(
    run: &Run,
    ca: &Pki,
    c: usize,
    planes: usize,
    workers: usize,
) -> Result<(), Error> {
    let (ns, cluster) = cluster_names(c);
    put_cluster(&run.api, &ns, &cluster, ca)?;
    let (set_old, set_new) = (format!("{cluster}-md-0-old"), format!("{cluster}-md-0-new"));
    for i in 0..planes + workers {
        let (name, node) = names(&cluster, i, planes);
        let ip = ip(c, i);
        let place = Place {
            namespace: &ns,
            cluster: &cluster,
            name: &name,
            node: &node,
            ip: &ip,
        };
        let plane = i < planes;
        run.api
            .put(machine(&place, FROM, (!plane).then_some(set_old.as_str())));
        // A control-plane node's manifests name its API server stand-in, known once it runs
        // (`upgrade_cluster` writes the KubeadmConfig again then).
        let spec = bootstrap_spec(FROM, plane.then_some(("127.0.0.1:6443", run.stacked)));
        run.api.put(kubeadm_config(&ns, &name, spec));
        put_node(&run.api, &node);
    }
    run.api
        .put(machine_set(&ns, &cluster, &set_old, FROM, workers));
    run.api
        .put(machine_set(&ns, &cluster, &set_new, TO, workers));
    Ok(())
}

/// What one cluster's upgrade measured.
#[derive(Default)]
struct ClusterRun {
    /// One row per node.
    rows: Vec<Value>,
    control_plane_s: Vec<f64>,
    worker_s: Vec<f64>,
    not_serving_s: Vec<f64>,
    set_ms: Vec<f64>,
    can_ms: Vec<f64>,
    update_ms: Vec<f64>,
    control_plane_took: Duration,
    workers_took: Duration,
    took: Duration,
}

impl ClusterRun {
    fn extend(&mut self, o: ClusterRun) {
        self.rows.extend(o.rows);
        self.control_plane_s.extend(o.control_plane_s);
        self.worker_s.extend(o.worker_s);
        self.not_serving_s.extend(o.not_serving_s);
        self.set_ms.extend(o.set_ms);
        self.can_ms.extend(o.can_ms);
        self.update_ms.extend(o.update_ms);
    }
}

/// Cluster `c` from [`FROM`] to [`TO`] in place: its agents (and control-plane stand-ins)
/// started; KubeadmControlPlane's Machines one at a time; `CanUpdateMachineSet`; the
/// workers `unavailable` at a time; every node checked at the new version; its agents stopped.
async fn upgrade_cluster(
    run: &Run,
    ca: &Pki,
    c: usize,
    (planes, workers, unavailable): (usize, usize, usize),
) -> Result<ClusterRun, String> {
    let (ns, cluster) = cluster_names(c);
    let err = |e: Error| e.to_string();
    let mut starting = Vec::new();
    let mut stand_ins = Vec::new();
    for i in 0..planes + workers {
        let (_, node) = names(&cluster, i, planes);
        let mut plane = None;
        starting.push(
            spawn_agent(
                &run.dir,
                ca,
                &run.mgmt.ca(),
                (&node, &ip(c, i), run.port),
                |root| {
                    if i < planes {
                        plane = Some(ControlPlaneNode::start(root, &node, FROM, run.restart)?);
                    }
                    Ok(())
                },
            )
            .map_err(err)?,
        );
        stand_ins.extend(plane);
    }
    let mut agents = Vec::new();
    for s in starting {
        agents.push(tokio::task::block_in_place(|| s.wait())?);
    }
    for (i, plane) in stand_ins.iter().enumerate() {
        let (name, _) = names(&cluster, i, planes);
        run.api.put(kubeadm_config(
            &ns,
            &name,
            bootstrap_spec(FROM, Some((&plane.api, run.stacked))),
        ));
    }
    let root = |node: &str| run.dir.join(node).join("root");
    let get = |path: String| {
        run.api
            .get(&path)
            .ok_or_else(|| format!("{path} does not exist"))
    };
    let mut out = ClusterRun::default();
    let began = Instant::now();
    let mut client = CapiClient::new(run.addr, HOST, &run.mgmt.ca()).map_err(|e| e.to_string())?;

    // KubeadmControlPlane: one control-plane Machine at a time.
    for (i, plane) in stand_ins.iter().enumerate() {
        let (name, node) = names(&cluster, i, planes);
        let live = get(format!(
            "/apis/cluster.x-k8s.io/v1beta2/namespaces/{ns}/machines/{name}"
        ))?;
        let spec = bootstrap_spec(TO, Some((&plane.api, run.stacked)));
        let m = update_machine(
            &mut client,
            &run.api,
            &run.settings,
            live,
            spec,
            Via::ControlPlane,
        )
        .await?;
        let r = root(&node);
        let finished = tokio::task::block_in_place(|| finished_at_ms(&r))?;
        let manifest = control_plane::manifest(&r, "kube-apiserver");
        let down = finished.saturating_sub(modified_ms(&manifest)?) as f64 / 1000.0;
        let text = std::fs::read_to_string(&manifest).map_err(|e| e.to_string())?;
        if !text.contains(TO) || !plane.settled() {
            return Err(format!(
                "{node}: the API server is not on the {TO} manifest after done"
            ));
        }
        if c == 0 {
            println!(
                "{node}: done {:.2} s after CanUpdateMachine ({} UpdateMachine calls); not serving {down:.2} s ({} unready /readyz answers)",
                m.took.as_secs_f64(),
                m.update_ms.len(),
                plane.unready_answers.load(Ordering::SeqCst)
            );
        }
        out.rows.push(json!({"node": node, "role": "control-plane", "seconds": m.took.as_secs_f64(),
                             "update_calls": m.update_ms.len(), "not_serving_seconds": down,
                             "update_call_ms": m.update_ms.clone(), "retry_after_seconds": m.retries.clone(),
                             "can_update_ms": m.can_update_ms}));
        out.control_plane_s.push(m.took.as_secs_f64());
        out.not_serving_s.push(down);
        out.can_ms.extend(m.can_update_ms);
        out.update_ms.extend(m.update_ms);
    }
    out.control_plane_took = began.elapsed();

    // The MachineDeployment: CanUpdateMachineSet once, then its Machines moved to the new
    // MachineSet and updated, maxUnavailable at a time.
    let (set_old, set_new) = (format!("{cluster}-md-0-old"), format!("{cluster}-md-0-new"));
    let workers_began = Instant::now();
    if workers > 0 {
        let current = get(format!(
            "/apis/cluster.x-k8s.io/v1beta2/namespaces/{ns}/machinesets/{set_old}"
        ))?;
        let desired = machine_set(&ns, &cluster, &set_new, TO, workers);
        let t = Instant::now();
        let body = can_update_machine_set_body(&run.settings, &current, &desired);
        let r = call_until_decided(&mut client, Hook::CanUpdateMachineSet, &body)
            .await
            .map_err(|e| format!("CanUpdateMachineSet {ns}/{set_old}: {e}"))?;
        out.set_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let v = r.json();
        if v["status"] != "Success"
            || (v.get("bootstrapConfigTemplatePatch").is_none()
                && v.get("machineSetPatch").is_none())
        {
            return Err(format!(
                "CanUpdateMachineSet {ns}/{set_old} does not cover it: {v}"
            ));
        }
    }
    let indices: Vec<usize> = (planes..planes + workers).collect();
    for chunk in indices.chunks(unavailable.max(1)) {
        let mut tasks = Vec::new();
        for &i in chunk {
            let (name, node) = names(&cluster, i, planes);
            let live = get(format!(
                "/apis/cluster.x-k8s.io/v1beta2/namespaces/{ns}/machines/{name}"
            ))?;
            let (api, settings, set) = (run.api.clone(), run.settings.clone(), set_new.clone());
            let mut client =
                CapiClient::new(run.addr, HOST, &run.mgmt.ca()).map_err(|e| e.to_string())?;
            tasks.push((
                node,
                tokio::spawn(async move {
                    update_machine(
                        &mut client,
                        &api,
                        &settings,
                        live,
                        bootstrap_spec(TO, None),
                        Via::MachineSet(set),
                    )
                    .await
                }),
            ));
        }
        for (node, t) in tasks {
            let m = t.await.map_err(|e| e.to_string())??;
            if c == 0 {
                println!(
                    "{node}: done {:.2} s after the Machine was moved ({} UpdateMachine calls)",
                    m.took.as_secs_f64(),
                    m.update_ms.len()
                );
            }
            out.rows.push(json!({"node": node, "role": "worker", "seconds": m.took.as_secs_f64(), "update_calls": m.update_ms.len(),
                             "update_call_ms": m.update_ms.clone(), "retry_after_seconds": m.retries.clone()}));
            out.worker_s.push(m.took.as_secs_f64());
            out.update_ms.extend(m.update_ms);
        }
    }
    out.workers_took = workers_began.elapsed();
    out.took = began.elapsed();
    for i in 0..planes + workers {
        let (_, node) = names(&cluster, i, planes);
        let kubelet =
            std::fs::read_to_string(root(&node).join(KUBELET_VERSION_FILE.trim_start_matches('/')))
                .map_err(|e| format!("{node}: {e}"))?;
        if kubelet.trim() != TO {
            return Err(format!(
                "{node}: the kubelet stand-in says {kubelet:?} after done"
            ));
        }
    }
    drop(agents);
    drop(stand_ins);
    for i in 0..planes + workers {
        let _ = std::fs::remove_dir_all(run.dir.join(names(&cluster, i, planes).1));
    }
    Ok(out)
}

/// The API stand-in, the updater and the shared pieces of a run of `clusters` clusters.
async fn prepare(
    dir: &Path,
    o: &Options,
    restart: Duration,
) -> Result<(Run, Vec<Arc<Pki>>, Daemon, Option<Arc<AtomicBool>>), Error> {
    let mgmt = Arc::new(Pki::new(&dir.join("pki"))?);
    let etcd = control_plane::start_etcd();
    let stacked = etcd.is_some();
    if !stacked {
        println!(
            "{} is taken: etcd is external (the gate checks no etcd member)",
            control_plane::ETCD_METRICS
        );
    }
    let api = ApiStandin::start().await?;
    let port = support::updater::free_port();
    let settings = json!({"agentPort": port.to_string(), "agentCA": "ClusterSecret", "drain": o.drain,
                          "gateTimeoutSeconds": "600"});
    api.put(extension_config(
        "inplace-updater",
        settings.clone(),
        Value::Null,
    ));
    let mut run = Run {
        dir: dir.to_path_buf(),
        api,
        settings,
        mgmt,
        port,
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        restart,
        stacked,
    };
    let mut cas = Vec::new();
    for c in 0..o.clusters {
        let ca = Pki::new(&dir.join(format!("pki-{c:03}")))?;
        put_cluster_objects(&run, &ca, c, o.planes, o.machines - o.planes)?;
        cas.push(Arc::new(ca));
    }
    let (updater, addr) = start_updater(dir, &run.mgmt, &run.api)?;
    run.addr = addr;
    Ok((run, cas, updater, etcd))
}

// === upgrade: one cluster, 3 + N ===

async fn upgrade(o: &Options) -> Result<Value, Error> {
    let work = tempfile::Builder::new()
        .prefix("inplace-bench-cluster-")
        .tempdir()?;
    let load_start = loadavg();
    println!("load average at start: {load_start}");
    let restart = Duration::from_secs_f64(o.restart_seconds.unwrap_or(5.0));
    let o = Options {
        clusters: 1,
        machines: o.planes + o.workers,
        ..o.clone()
    };
    let (run, cas, updater, etcd) = prepare(work.path(), &o, restart).await?;
    let pid = updater.pid();
    let unavailable = o.max_unavailable.unwrap_or(1);
    let got = upgrade_cluster(&run, &cas[0], 0, (o.planes, o.workers, unavailable)).await?;
    let mem = Memory::of(pid);
    println!(
        "whole cluster: {:.2} s (control plane {:.2} s, workers {:.2} s, {unavailable} at a time); updater RSS {:.1} MiB (peak {:.1})",
        got.took.as_secs_f64(),
        got.control_plane_took.as_secs_f64(),
        got.workers_took.as_secs_f64(),
        mem.rss as f64 / 1024.0,
        mem.hwm as f64 / 1024.0
    );
    let figures = json!({
        "mode": "upgrade", "from": FROM, "to": TO, "control_planes": o.planes, "workers": o.workers,
        "max_unavailable": unavailable, "drain": o.drain, "stand_in_restart_seconds": restart.as_secs_f64(),
        "etcd": if run.stacked {"stacked"} else {"external"},
        "nodes": got.rows,
        "control_plane_node_seconds": summary("control-plane node, CanUpdateMachine → done", got.control_plane_s, "s"),
        "worker_node_seconds": summary("worker node, moved → done", got.worker_s, "s"),
        "not_serving_seconds": summary("control-plane node not serving (manifest written → gate passed, plan done)", got.not_serving_s, "s"),
        "can_update_machine_set_ms": got.set_ms.first(),
        "control_plane_seconds": got.control_plane_took.as_secs_f64(),
        "workers_seconds": got.workers_took.as_secs_f64(),
        "total_seconds": got.took.as_secs_f64(),
        "updater_rss_kib": mem.rss, "updater_peak_rss_kib": mem.hwm,
        "hook_calls_made_again_after_a_connection_error": TRANSPORT_RETRIES.load(Ordering::SeqCst),
        "loadavg_start": load_start, "loadavg_end": loadavg(),
    });
    drop(updater);
    if let Some(stop) = etcd {
        stop.store(true, Ordering::SeqCst);
    }
    Ok(figures)
}

// === fleet: C clusters × M Machines ===

async fn fleet(o: &Options) -> Result<Value, Error> {
    let work = tempfile::Builder::new()
        .prefix("inplace-bench-fleet-")
        .tempdir()?;
    let load_start = loadavg();
    println!("load average at start: {load_start}");
    let restart = Duration::from_secs_f64(o.restart_seconds.unwrap_or(1.0));
    let (run, cas, updater, etcd) = prepare(work.path(), o, restart).await?;
    let run = Arc::new(run);
    let pid = updater.pid();
    let n = o.clusters * o.machines;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = Memory::of(pid);
    println!(
        "updater idle RSS, {n} Machines of {} clusters in the management cluster: {:.1} MiB",
        o.clusters,
        idle.rss as f64 / 1024.0
    );
    let requests_before = run.api.requests().len();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_rss(pid, stop.clone());
    let began = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let shape = (
        o.planes,
        o.machines - o.planes,
        o.max_unavailable.unwrap_or(5),
    );
    let mut lanes = Vec::new();
    for lane in 0..o.at_once.max(1) {
        let (next, run, cas, clusters) = (next.clone(), run.clone(), cas.clone(), o.clusters);
        lanes.push(tokio::spawn(async move {
            // Lanes start 2 s apart, so their clusters' agents do not all start in one instant.
            tokio::time::sleep(Duration::from_secs(2 * lane as u64)).await;
            let mut all = ClusterRun::default();
            loop {
                let c = next.fetch_add(1, Ordering::SeqCst);
                if c >= clusters {
                    return Ok::<_, String>(all);
                }
                let got = upgrade_cluster(&run, &cas[c], c, shape)
                    .await
                    .map_err(|e| format!("cluster wc-{c:03}: {e}"))?;
                all.extend(got);
            }
        }));
    }
    let mut all = ClusterRun::default();
    for l in lanes {
        match l.await? {
            Ok(got) => all.extend(got),
            Err(e) => {
                let log =
                    std::fs::read_to_string(work.path().join("updater.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                println!("the updater's log, last lines:");
                for l in tail.iter().rev() {
                    println!("  {l}");
                }
                return Err(e.into());
            }
        }
    }
    let took = began.elapsed();
    let requests: Vec<(String, String)> = run.api.requests().split_off(requests_before);
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.store(true, Ordering::SeqCst);
    let sampled_peak = tokio::task::block_in_place(|| sampler.join()).unwrap_or(0);
    let steady = Memory::of(pid);
    println!(
        "{} clusters × {} Machines in place in {:.1} s ({} clusters at a time); updater RSS peak {:.1} MiB (VmHWM {:.1}), steady {:.1} MiB 10 s after",
        o.clusters,
        o.machines,
        took.as_secs_f64(),
        o.at_once,
        sampled_peak as f64 / 1024.0,
        steady.hwm as f64 / 1024.0,
        steady.rss as f64 / 1024.0
    );
    // Requests to the API stand-in by verb and resource (the path's last known collection).
    let known = [
        "machines",
        "machinesets",
        "kubeadmconfigs",
        "secrets",
        "nodes",
        "pods",
        "eviction",
        "events",
        "poddisruptionbudgets",
        "extensionconfigs",
        "clusters",
        "machinedrainrules",
        "namespaces",
        "daemonsets",
        "configmaps",
    ];
    let mut by: std::collections::BTreeMap<String, usize> = Default::default();
    for (method, path) in &requests {
        let path = path.split('?').next().unwrap_or_default();
        let resource = path
            .rsplit('/')
            .find(|p| known.contains(p))
            .unwrap_or("other");
        *by.entry(format!("{method} {resource}")).or_default() += 1;
    }
    let per = |v: usize| v as f64 / n as f64;
    println!(
        "API requests per Machine: {:.2} ({} in all)",
        per(requests.len()),
        requests.len()
    );
    for (k, v) in &by {
        println!("  {k}: {:.2} per Machine", per(*v));
    }
    let by: serde_json::Map<String, Value> = by
        .iter()
        .map(|(k, v)| (k.clone(), json!(per(*v))))
        .collect();
    let figures = json!({
        "mode": "fleet", "clusters": o.clusters, "machines_per_cluster": o.machines, "machines": n,
        "control_planes_per_cluster": o.planes, "clusters_at_once": o.at_once, "max_unavailable": shape.2, "drain": o.drain,
        "stand_in_restart_seconds": restart.as_secs_f64(), "etcd": if run.stacked {"stacked"} else {"external"},
        "from": FROM, "to": TO, "seconds": took.as_secs_f64(),
        "can_update_machine_set_ms": summary("CanUpdateMachineSet", all.set_ms, "ms"),
        "can_update_machine_ms": summary("CanUpdateMachine", all.can_ms, "ms"),
        "update_machine_ms": summary("UpdateMachine (every call)", all.update_ms, "ms"),
        "control_plane_node_seconds": summary("control-plane Machine, CanUpdateMachine → done", all.control_plane_s, "s"),
        "worker_node_seconds": summary("worker Machine, moved → done", all.worker_s, "s"),
        "not_serving_seconds": summary("control-plane node not serving", all.not_serving_s, "s"),
        "updater_idle_rss_kib": idle.rss, "updater_peak_rss_kib": sampled_peak, "updater_hwm_kib": steady.hwm,
        "updater_steady_rss_kib": steady.rss, "updater_steady_anon_kib": steady.anon,
        "hook_calls_made_again_after_a_connection_error": TRANSPORT_RETRIES.load(Ordering::SeqCst),
        "update_machine_failures_called_again": HOOK_FAILURES.load(Ordering::SeqCst),
        "can_update_failures_called_again": UNDECIDED.load(Ordering::SeqCst),
        "api_requests": requests.len(), "api_requests_per_machine": per(requests.len()),
        "api_requests_per_machine_by_kind": by,
        "loadavg_start": load_start, "loadavg_end": loadavg(),
    });
    drop(updater);
    if let Some(stop) = etcd {
        stop.store(true, Ordering::SeqCst);
    }
    Ok(figures)
}
