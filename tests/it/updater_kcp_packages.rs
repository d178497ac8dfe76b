//! A control-plane node's minor version bump (v1.30.4 → v1.31.2) in place with REAL package
//! installs, end to end (issue 45): the real `inplace-updater serve`, a real `inplace-agent
//! serve` beside a sandboxed real systemd (`--bus`, the node's root), apt installing the
//! stand-in Kubernetes packages from a repository built in the node, and the hooks called in
//! KubeadmControlPlane's order with its request shapes (`tests/it/updater_kcp_flow.rs` says
//! which cluster-api files those are): `CanUpdateMachine`, the trigger, then `UpdateMachine`
//! polled until done.
//!
//! Stand-ins (say so when reading a result):
//! - the packages are `inplace_agent::sandbox::packages::kube_packages`: the kubeadm stand-in's
//!   `upgrade node` moves the image tag of the kube-apiserver, kube-controller-manager and
//!   kube-scheduler manifests to its own version, as the real one regenerates them;
//! - the node's API server, mirror pods and CA are `tests/support/control_plane.rs`'s, its
//!   API server on 127.0.0.1 (the agent runs on the host network); a mirror pod's hash
//!   follows its manifest in the node's root, as the kubelet's does;
//! - etcd is external in this cluster (the gate's stacked-etcd checks use kubeadm's fixed
//!   metrics address, 127.0.0.1:2381, which a test cannot own; `control_plane_gate.rs`
//!   covers them);
//! - the management cluster is the API stand-in; this test plays KCP and the Machine
//!   controller against it.
//!
//! Tests that need root, systemd and apt run for real with `CI=true` and skip loudly
//! otherwise.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde_json::{Value, json};

use crate::support::control_plane::{self, COMPONENTS, Standins};
use crate::support::kcp::{self, CERT_SANS, for_request, gate, with_discovery};
use crate::support::sandbox::{self, Systemd};
use crate::support::updater::*;
use crate::support::{overlay, pki};
use inplace_agent::host::packages::ManagerKind;
use inplace_agent::sandbox::packages::{self as pkgs, KUBE_PACKAGES, KUBEADM_LOG};
use inplace_updater::hooks::{Hook, UPDATE_IN_PROGRESS_ANNOTATION};

const OLD: &str = "v1.30.4";
const NEW: &str = "v1.31.2";
const NODE: &str = "cp-sys";
const MACHINE: &str = "capi-quickstart-control-plane-sys";
const DEMO_CONF: &str = "/etc/kubernetes/inplace-demo.conf";
const KUBELET_CONFIG: &str = "/var/lib/kubelet/config.yaml";
const KUBEADM_FLAGS: &str = "/var/lib/kubelet/kubeadm-flags.env";
/// Time scale of the Machine controller's waits (`retryAfterSeconds`).
const SCALE: f64 = 0.05;
/// The failing test's plan timeout: long enough for the packages, kubeadm and the first
/// gates, short enough to cut the `controlPlane` gate soon after.
const PLAN_TIMEOUT: u32 = 20;

/// KCP's `kubeadmConfigSpec` at a release (without kube-vip: here `kubeadm upgrade node` is
/// what restarts the control plane).
fn control_plane_spec(release: &str) -> Value {
    kcp::control_plane_spec(json!([
        {"path": DEMO_CONF, "owner": "root:root", "permissions": "0644", "content": format!("release={release}\n")},
    ]))
}

/// The live control-plane Machine at `version`, its node running `running`, labelled and
/// owned as KCP makes them.
fn live_machine(w: &World, version: &str, running: &str, in_place: bool) -> Value {
    let a = &w.agents[0];
    kcp::owned_by_kcp(machine(MACHINE, version, &a.node, &a.ip, in_place), running)
}

fn infra() -> Value {
    json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta2", "kind": "DevMachine",
           "metadata": {"name": MACHINE, "namespace": "default"}, "spec": {}})
}

/// The settings: no drain (one node), no kubelet healthz (it is in the node's network
/// namespace, out of the agent's reach here), and the plan's timeout.
fn settings(w: &World, plan_timeout: u32) -> Value {
    json!({
        "agentPort": w.agent_port.to_string(),
        "drain": "Never",
        "kubeletHealthzURL": "",
        "gateTimeoutSeconds": "60",
        "planTimeoutSeconds": plan_timeout.to_string(),
    })
}

/// KCP's `CanUpdateMachine` request, from `OLD` to `NEW`.
fn can_update_machine(w: &World, plan_timeout: u32) -> Vec<u8> {
    let current = live_machine(w, OLD, OLD, false);
    let mut desired = current.clone();
    desired["spec"]["version"] = json!(NEW);
    let config = |release: &str| {
        let mut c = kubeadm_config(MACHINE, control_plane_spec(release));
        c["metadata"]["labels"] = current["metadata"]["labels"].clone();
        for_request(&c)
    };
    go_json(&json!({
        "kind": "CanUpdateMachineRequest",
        "apiVersion": inplace_updater::hooks::HOOKS_API_VERSION,
        "settings": settings(w, plan_timeout),
        "current": {"machine": for_request(&current), "infrastructureMachine": infra(),
                    "bootstrapConfig": config(OLD)},
        "desired": {"machine": for_request(&desired), "infrastructureMachine": infra(),
                    "bootstrapConfig": config(NEW)},
    }))
}

/// KCP's trigger (`inplace_trigger.go`: the desired KubeadmConfig and Machine written, the
/// Machine marked), then the Machine controller's `UpdateMachine` calls until done or failed.
async fn trigger_and_update(
    w: &World,
    capi: &mut inplace_updater::emulate::CapiClient,
    plan_timeout: u32,
) -> Vec<Value> {
    let live = live_machine(w, NEW, OLD, true);
    let mut config = kubeadm_config(MACHINE, with_discovery(control_plane_spec(NEW)));
    config["metadata"]["annotations"] = json!({UPDATE_IN_PROGRESS_ANNOTATION: ""});
    w.api.put(config.clone());
    w.api.put(live.clone());
    let body = update_request(&live, Some(&config), settings(w, plan_timeout));
    poll_update(capi, &body, SCALE).await
}

/// The node's agent's latest plan document (`/v1/status`'s `recent[0]`, then
/// `/v1/plans/<id>`), from its status socket in the node's root.
fn last_run(w: &World) -> Value {
    kcp::last_run(&w.agents[0].root).unwrap_or_else(|| panic!("no plan on node {NODE}"))
}

/// A kubeadm control-plane node at `OLD` on a sandboxed real systemd, its packages installed
/// from apt and held, its agent beside it, and the updater; `None` when the machine cannot
/// run it outside CI (a loud SKIP was printed).
struct ControlPlaneNode {
    w: World,
    standins: Standins,
    systemd: Systemd,
    root: PathBuf,
    // Last: the node outlives nothing that reads through its root.
    node: sandbox::SandboxNode,
}

async fn control_plane_node(subnet: u8) -> Option<ControlPlaneNode> {
    let node = sandbox::SandboxNode::boot()?;
    if let Some(why) = pkgs::missing_tools(&node.path("/"), ManagerKind::Apt) {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("cannot build an apt repository with CI=true: {why}");
        }
        eprintln!("\n**** SKIP: control-plane version bump with apt not run: {why} ****\n");
        return None;
    }
    let systemd = node
        .install_kube_packages(
            ManagerKind::Apt,
            sandbox::Standin::Binary(&overlay::standin_for_packages()),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let root = node.root();
    // What kubeadm and the bootstrap left on a control-plane node at OLD.
    let standins = Standins::install(&root, NODE, "127.0.0.1", OLD);
    pki::control_plane_serving_certificate(&root, &CERT_SANS);
    node.write_file(DEMO_CONF, format!("release={OLD}\n"), 0o644);

    let mut w = World::new(subnet).await;
    w.start_agent(NODE, &root, &["--bus", &node.bus_address()], &[]);
    w.api.put(live_machine(&w, OLD, OLD, false));
    w.api.put(kubeadm_config(
        MACHINE,
        with_discovery(control_plane_spec(OLD)),
    ));
    w.start_updater();
    Some(ControlPlaneNode {
        w,
        standins,
        systemd,
        root,
        node,
    })
}

impl ControlPlaneNode {
    /// Every static pod manifest's bytes.
    fn manifests(&self) -> Vec<(String, Vec<u8>)> {
        COMPONENTS
            .iter()
            .map(|c| {
                (
                    c.to_string(),
                    std::fs::read(control_plane::manifest(&self.root, c)).unwrap(),
                )
            })
            .collect()
    }

    fn package(&self, name: &str) -> (String, bool) {
        pkgs::installed(&self.root, ManagerKind::Apt, name)
            .unwrap_or_else(|| panic!("{name} is not installed"))
    }

    fn logs(&self) -> String {
        format!(
            "--- updater\n{}\n--- agent\n{}",
            self.w.updater_log(),
            self.w.agents[0].proc.log()
        )
    }

    /// KCP's `CanUpdateMachine`: everything covered, the version included, and the change
    /// affects availability (it restarts the control plane).
    async fn can_update(&self, capi: &mut inplace_updater::emulate::CapiClient, timeout: u32) {
        let v = capi
            .call(
                Hook::CanUpdateMachine,
                &can_update_machine(&self.w, timeout),
            )
            .await
            .unwrap()
            .json();
        assert_eq!(v["status"], "Success", "{v}\n{}", self.logs());
        let message = v["message"].as_str().unwrap_or_default();
        assert!(
            !message.contains("not in place") && !message.contains("version"),
            "nothing rolls out, the version least of all: {v}"
        );
        assert!(
            v["machinePatch"]["patch"].is_string(),
            "the version is covered: {v}"
        );
        assert!(v["bootstrapConfigPatch"]["patch"].is_string(), "{v}");
        assert_eq!(
            v["affectsAvailability"], true,
            "a control-plane restart: {v}"
        );
    }
}

/// KCP moves a control-plane Machine from v1.30.4 to v1.31.2 and the node does what kubeadm's
/// upgrade does there, with real packages: kubeadm first, `kubeadm upgrade node` by the new
/// kubeadm (the static pod manifests regenerated), kubelet and kubectl, all held, the kubelet
/// restarted by systemd, and the node proved healthy by the `controlPlane` gate before done.
/// Failed on the old kubeadm stand-in: the manifests kept the v1.30.4 images.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_node_moves_a_minor_version_with_real_packages() {
    let Some(n) = control_plane_node(201).await else {
        return;
    };
    let started = Instant::now();
    let mut capi = n.w.client();
    let (old, new) = pkgs::versions(ManagerKind::Apt);
    let before = n.manifests();
    let readyz_before = n.standins.behaviour.readyz_reads.load(Ordering::SeqCst);

    n.can_update(&mut capi, 80).await;
    let seen = trigger_and_update(&n.w, &mut capi, 80).await;
    let last = seen.last().unwrap();
    assert!(
        last["status"] == "Success" && last["retryAfterSeconds"] == 0,
        "{seen:?}\n{}",
        n.logs()
    );

    let run = last_run(&n.w);
    assert_eq!(run["phase"], "Succeeded", "{run:#}");
    // The order of the upgrade on the node, from the plan: kubeadm, `kubeadm upgrade node`,
    // then kubelet and kubectl.
    let changes: Vec<String> = run["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| {
            let target = c["target"].as_str().unwrap_or_default();
            (c["kind"] == "package" || c["kind"] == "kubeadmUpgradeNode")
                .then(|| format!("{} {target}", c["kind"].as_str().unwrap_or_default()))
        })
        .collect();
    assert_eq!(
        changes,
        [
            format!("package kubeadm={new}"),
            "kubeadmUpgradeNode kubeadm upgrade node".to_string(),
            format!("package kubelet={new}"),
            format!("package kubectl={new}"),
        ],
        "{run:#}"
    );
    // `kubeadm upgrade node` ran once, by the NEW kubeadm while the kubelet was still old.
    assert_eq!(
        n.node.read_file(KUBEADM_LOG),
        format!("kubeadm {NEW} upgrade node (kubelet {OLD})\n")
    );
    // ... and regenerated the manifests of kubeadm's Kubernetes components (etcd's is
    // kubeadm's own table's business: the stand-in leaves it).
    for (c, old_bytes) in &before {
        let now = std::fs::read_to_string(control_plane::manifest(&n.root, c)).unwrap();
        let old_text = String::from_utf8_lossy(old_bytes);
        if c == "etcd" {
            assert_eq!(now, old_text, "{c}");
        } else {
            assert_eq!(
                now,
                old_text.replace(&format!("{c}:{OLD}"), &format!("{c}:{NEW}")),
                "{c}'s manifest regenerated for {NEW}"
            );
        }
    }
    assert!(
        n.node
            .read_file(KUBELET_CONFIG)
            .contains(&format!("# written by kubeadm {NEW}")),
        "kubeadm wrote the kubelet configuration"
    );
    for pkg in KUBE_PACKAGES {
        let (v, held) = n.package(pkg);
        assert_eq!(v, new, "{pkg} (was {old})");
        assert!(held, "{pkg} is held");
    }
    assert!(n.node.read_file(KUBEADM_FLAGS).contains("--max-pods=150"));
    assert_eq!(n.node.read_file(DEMO_CONF), format!("release={NEW}\n"));
    let kubelet = n.systemd.unit_state("kubelet.service").expect("kubelet");
    assert!(kubelet.is_active(), "{kubelet:?}");
    let journal = std::fs::read_to_string(inplace_agent::journal::file_path(
        &n.w.dir.path().join(format!("state-{NODE}")),
    ))
    .unwrap();
    assert!(journal.contains("kubelet.service"), "the kubelet restarted");

    // Proved healthy before done: /readyz read, every mirror pod on its manifest's hash.
    for kind in ["unitActive", "kubeletVersion", "controlPlane"] {
        assert_eq!(gate(&run, kind)["state"], "Passed", "{kind}: {run:#}");
    }
    assert!(n.standins.behaviour.readyz_reads.load(Ordering::SeqCst) > readyz_before);
    let cp = gate(&run, "controlPlane");
    let message = cp["message"].as_str().unwrap_or_default();
    for c in [
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        assert!(message.contains(c), "{c} named: {cp:#}");
    }
    let checks: Vec<&str> = run["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["kind"].as_str())
        .collect();
    assert_eq!(checks.last(), Some(&"controlPlane"), "the gate is last");

    // Asked again (the Machine controller's next call): done at once.
    let again = trigger_and_update(&n.w, &mut capi, 80).await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(n.node.read_file(KUBEADM_LOG).lines().count(), 1);
    eprintln!("control-plane version bump: {:?}", started.elapsed());
}

/// The same bump, but the node's API server does not come back ready: the `controlPlane` gate
/// fails (cut by the plan's timeout: the gate's least timeout is 300 s) and the node rolls
/// back what the plan changed — the static pod manifests byte for byte, the kubelet
/// configuration and flags, the files, and the packages (the agent reinstalls the previous
/// versions, which the repository still offers, and holds them again) — and restarts the
/// kubelet on the old ones. `UpdateMachine` answers Failure naming the gate and the rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_control_plane_gate_rolls_the_packages_and_manifests_back() {
    let Some(n) = control_plane_node(202).await else {
        return;
    };
    let started = Instant::now();
    let mut capi = n.w.client();
    let (old, _) = pkgs::versions(ManagerKind::Apt);
    let manifests = n.manifests();
    let kubelet_config = std::fs::read(n.node.path(KUBELET_CONFIG)).unwrap();
    let flags = std::fs::read(n.node.path(KUBEADM_FLAGS)).unwrap();
    n.standins.behaviour.readyz.store(500, Ordering::SeqCst);

    n.can_update(&mut capi, PLAN_TIMEOUT).await;
    let seen = trigger_and_update(&n.w, &mut capi, PLAN_TIMEOUT).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Failure", "{seen:?}\n{}", n.logs());
    let message = last["message"].as_str().unwrap_or_default().to_owned();
    eprintln!("UpdateMachine ({} bytes): {message}", message.len());

    let run = last_run(&n.w);
    assert_eq!(run["phase"], "RolledBack", "{run:#}\n{}", n.logs());
    let cp = gate(&run, "controlPlane");
    assert_eq!(cp["state"], "Failed", "{run:#}");
    assert!(
        cp["message"]
            .as_str()
            .unwrap_or_default()
            .contains("/readyz answered 500"),
        "{cp:#}"
    );
    // kubeadm did run (the new one) and moved the manifests before the gate failed.
    assert_eq!(
        n.node.read_file(KUBEADM_LOG),
        format!("kubeadm {NEW} upgrade node (kubelet {OLD})\n")
    );
    // Everything it changed is back, byte for byte.
    assert_eq!(
        n.manifests(),
        manifests,
        "the static pod manifests restored"
    );
    assert_eq!(
        std::fs::read(n.node.path(KUBELET_CONFIG)).unwrap(),
        kubelet_config,
        "the kubelet configuration restored"
    );
    assert_eq!(
        std::fs::read(n.node.path(KUBEADM_FLAGS)).unwrap(),
        flags,
        "the kubelet flags restored"
    );
    assert_eq!(n.node.read_file(DEMO_CONF), format!("release={OLD}\n"));
    // The packages: the previous versions reinstalled and held again.
    for pkg in KUBE_PACKAGES {
        assert_eq!(n.package(pkg), (old.to_string(), true), "{pkg}");
    }
    let kubelet = n.systemd.unit_state("kubelet.service").expect("kubelet");
    assert!(kubelet.is_active(), "{kubelet:?}");
    let changes = run["changes"].as_array().unwrap();
    assert!(
        changes
            .iter()
            .filter(|c| c["state"] != "Unchanged")
            .all(|c| c["state"] == "RolledBack"),
        "every change it made was rolled back: {run:#}"
    );

    // The answer names the node, the gate and what it last saw (not only the timeout that
    // cut it), what was rolled back and what a rollback cannot undo. Failed before the
    // agent said so: "plan ... failed and was rolled back: the plan ran longer than its
    // timeout of 20s".
    for want in [
        "failed and was rolled back: verify[2] controlPlane node cp-sys: kube-apiserver, \
         kube-controller-manager, kube-scheduler (etcd external): the plan's timeout (20s) \
         ended this gate; last: kube-apiserver: https://127.0.0.1:",
        "rolled back: 1 file, 1 kubeletFlags, packages kubeadm, kubelet, kubectl, static pod \
         manifests, kubelet configuration; not undone: kubeadm's other work (renewed \
         certificates, etcd's newer data)",
    ] {
        assert!(message.contains(want), "{want:?} in {message}");
    }
    // The run's error has all of it: what the gate last saw included.
    let detail = run["error"]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("/readyz answered 500"), "{detail}");
    assert!(
        detail.ends_with(&message[message.len() - 100..]),
        "{detail}"
    );
    // CAPI retries with backoff: every later call is the same Failure.
    let again = trigger_and_update(&n.w, &mut capi, PLAN_TIMEOUT).await;
    assert_eq!(again.len(), 1);
    assert_eq!(&again[0], last);
    eprintln!(
        "control-plane gate failure and rollback: {:?}",
        started.elapsed()
    );
}
