//! Control-plane configuration in place (issue 45, decision 0022), through the real
//! `inplace-updater serve` and `inplace-agent serve` binaries and the Kubernetes API stand-in:
//! an API server flag change on a control-plane Machine is covered by `CanUpdateMachine` and
//! applied by `UpdateMachine` as the node's cluster configuration record, `kubeadm upgrade
//! node` (the STAND-IN `kubeadm-standin`, which regenerates the static pod manifests from
//! the ClusterConfiguration the test moves as KubeadmControlPlane moves the cluster's
//! `kubeadm-config`) and the `controlPlane` gate (the API server and mirror pod stand-ins of
//! `control_plane_gate`); an etcd image tag lowered and a networking change stay uncovered
//! with their reasons; a failed kubeadm rolls the manifests and the record back.

use std::path::Path;

use serde_json::{Value, json};

use crate::control_plane_gate::{ControlPlane, NODE};
use crate::support::updater::*;
use inplace_updater::hooks::Hook;

/// The kubeadm stand-in (tests/kubeadm-standin/standin.rs).
const KUBEADM_STANDIN: &str = env!("CARGO_BIN_EXE_kubeadm-standin");
/// Where the stand-in reads the cluster's ClusterConfiguration (its ConfigMap, moved by KCP).
const KUBEADM_CONFIG: &str = "etc/kubernetes/kubeadm-standin/kubeadm-config.json";
const RECORD: &str = "etc/kubernetes/inplace/cluster-configuration.json";
const COMPONENTS: [&str; 3] = [
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];
/// The Machine of the fixtures' KubeadmControlPlane request.
const MACHINE: &str = "capi-quickstart-control-plane-8xq2w";

fn manifest(root: &Path, component: &str) -> String {
    std::fs::read_to_string(root.join(format!("etc/kubernetes/manifests/{component}.yaml")))
        .unwrap_or_default()
}

/// A KubeadmConfig spec of a control-plane Machine with `cluster` as its
/// clusterConfiguration (external etcd: the gate checks the API server and the pods).
fn spec(cluster: Value) -> Value {
    json!({
        "clusterConfiguration": cluster,
        "joinConfiguration": {"controlPlane": {}, "nodeRegistration": {"imagePullPolicy": "IfNotPresent"}},
    })
}

fn cluster(audit_max_age: &str) -> Value {
    json!({
        "apiServer": {"extraArgs": [{"name": "audit-log-maxage", "value": audit_max_age}]},
        "controllerManager": {"extraArgs": [{"name": "bind-address", "value": "0.0.0.0"}]},
        "etcd": {"external": {"endpoints": ["https://10.0.0.5:2379"]}},
    })
}

/// What KubeadmControlPlane moves before it touches a Machine: the cluster's
/// `kubeadm-config` (here the stand-in's file), from the KubeadmConfig's clusterConfiguration.
fn move_kubeadm_config(root: &Path, cluster: &Value) {
    let mut c = cluster.clone();
    c["kubernetesVersion"] = json!("v1.35.2");
    let path = root.join(KUBEADM_CONFIG);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
}

/// A sandbox control-plane node whose manifests the kubeadm stand-in wrote from `initial`
/// (as `kubeadm init`/`join` left them), served by a real agent; and the updater.
struct Setup {
    cp: ControlPlane,
    world: World,
    settings: Value,
}

async fn setup(subnet: u8, initial: &Value) -> Setup {
    let cp = ControlPlane::new();
    let root = cp.node.root().to_path_buf();
    let bin = root.join("usr/local/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(KUBELET_STANDIN, bin.join("kubelet")).unwrap();
    std::fs::write(bin.join("kubelet.version"), "v1.35.2\n").unwrap();
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    std::fs::copy(KUBEADM_STANDIN, root.join("usr/bin/kubeadm")).unwrap();
    // The API server's advertise endpoint, as kubeadm writes it: the gate's stand-in.
    std::fs::write(
        root.join("etc/kubernetes/manifests/kube-apiserver.yaml"),
        format!(
            "metadata:\n  annotations:\n    \
             kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint: 127.0.0.1:{}\n",
            cp.api_port
        ),
    )
    .unwrap();
    move_kubeadm_config(&root, initial);
    let out = std::process::Command::new(KUBEADM_STANDIN)
        .args(["upgrade", "node"])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let mut world = World::new(subnet).await;
    world.start_agent(
        NODE,
        &root,
        &["--no-chroot"],
        &[("INPLACE_AGENT_SERVICES", "off")],
    );
    world.start_updater();
    let settings = json!({
        "agentPort": world.agent_port.to_string(),
        "drain": "Never",
        "kubeletHealthzURL": "",
        "gateTimeoutSeconds": "30",
    });
    Setup {
        cp,
        world,
        settings,
    }
}

impl Setup {
    fn root(&self) -> &Path {
        self.cp.node.root()
    }

    /// The live control-plane Machine and its KubeadmConfig (`desired`, as CAPI patched it).
    fn put_live(&self, desired: &Value) -> (Value, Value) {
        let (mut machine, config) = self
            .world
            .put_machine(MACHINE, 0, "v1.35.2", desired.clone());
        machine["metadata"]["labels"]["cluster.x-k8s.io/control-plane"] = json!("");
        self.world.api.put(machine.clone());
        (machine, config)
    }

    /// KubeadmControlPlane's `CanUpdateMachine` for moving the Machine from `current` to
    /// `desired` (KubeadmConfig specs; the version stays).
    async fn can_update(&self, current: &Value, desired: &Value) -> Value {
        let mut req = can_update_machine_request();
        req["settings"] = self.settings.clone();
        for (side, spec) in [("current", current), ("desired", desired)] {
            req[side]["machine"]["spec"]["version"] = json!("v1.35.2");
            req[side]["bootstrapConfig"]["spec"] = spec.clone();
        }
        self.put_live(desired);
        let mut capi = self.world.client();
        capi.call(Hook::CanUpdateMachine, &go_json(&req))
            .await
            .unwrap()
            .json()
    }

    /// `UpdateMachine` as the Machine controller calls it, until done; the last answer.
    async fn update(&self, desired: &Value) -> Value {
        let (machine, config) = self.put_live(desired);
        let body = update_request(&machine, Some(&config), self.settings.clone());
        let mut capi = self.world.client();
        let seen = poll_update(&mut capi, &body, 0.1).await;
        seen.last().cloned().unwrap()
    }

    fn journal(&self) -> String {
        let state = self.world.dir.path().join(format!("state-{NODE}"));
        let out = std::process::Command::new(AGENT)
            .arg("journal")
            .arg("--root")
            .arg(self.root())
            .arg("--state-dir")
            .arg(&state)
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_flag_change_goes_in_place_and_what_cannot_is_named() {
    let s = setup(245, &cluster("7")).await;
    let before: Vec<String> = COMPONENTS.iter().map(|c| manifest(s.root(), c)).collect();
    assert!(before[0].contains("--audit-log-maxage=7"), "{}", before[0]);
    let (current, desired) = (spec(cluster("7")), spec(cluster("30")));

    // CanUpdateMachine: covered, nothing named uncovered, a control-plane restart.
    let v = s.can_update(&current, &desired).await;
    assert_eq!(v["status"], "Success", "{v}\n{}", s.world.updater_log());
    assert_eq!(
        v.get("message").and_then(Value::as_str).unwrap_or(""),
        "",
        "{v}"
    );
    assert!(v["bootstrapConfigPatch"].is_object(), "{v}");
    assert_eq!(v["affectsAvailability"], true, "{v}");

    // KubeadmControlPlane moves the cluster's kubeadm-config, then the Machine is updated.
    move_kubeadm_config(s.root(), &cluster("30"));
    let last = s.update(&desired).await;
    assert_eq!(
        last["status"],
        "Success",
        "{last}\n{}",
        s.world.updater_log()
    );
    assert_eq!(last["retryAfterSeconds"].as_i64().unwrap_or(0), 0, "{last}");
    let after: Vec<String> = COMPONENTS.iter().map(|c| manifest(s.root(), c)).collect();
    assert!(after[0].contains("--audit-log-maxage=30"), "{}", after[0]);
    assert!(!after[0].contains("--audit-log-maxage=7"), "{}", after[0]);
    assert_eq!(after[1..], before[1..], "the other manifests are unchanged");
    let record = std::fs::read_to_string(s.root().join(RECORD)).unwrap();
    assert!(
        record.contains(r#"{"name":"audit-log-maxage","value":"30"}"#),
        "{record}"
    );
    let journal = s.journal();
    assert!(journal.contains("kubeadm upgrade node"), "{journal}");
    let log = std::fs::read_to_string(s.root().join("var/log/kubeadm-standin.log")).unwrap();
    assert!(
        log.lines()
            .last()
            .unwrap_or("")
            .contains("rewrote [kube-apiserver], equal [kube-controller-manager kube-scheduler]"),
        "{log}"
    );

    // An etcd image tag lowered: refused, naming the field and both tags.
    let tag = |t: &str| {
        let mut c = cluster("30");
        c["etcd"] = json!({"local": {"imageTag": t}});
        spec(c)
    };
    let v = s.can_update(&tag("3.6.5-0"), &tag("3.5.21-0")).await;
    assert_eq!(v["status"], "Success", "{v}");
    let message = v["message"].as_str().unwrap_or("");
    assert!(
        message.contains(
            "clusterConfiguration.etcd.local.imageTag (moves etcd backwards, from 3.6.5-0 to \
             3.5.21-0: an etcd that moved its data forward cannot be downgraded"
        ),
        "{message}"
    );
    assert!(
        v.get("bootstrapConfigPatch")
            .is_none_or(|p| !p.to_string().contains("3.5.21-0")),
        "{v}"
    );
    assert!(
        s.world.updater_log_shows("reason_class=\"downgrade\""),
        "{}",
        s.world.updater_log()
    );

    // A networking change still rolls out, with its reason.
    let net = |subnet: &str| {
        let mut c = cluster("30");
        c["networking"] = json!({"podSubnet": subnet});
        spec(c)
    };
    let v = s
        .can_update(&net("10.244.0.0/16"), &net("10.245.0.0/16"))
        .await;
    let message = v["message"].as_str().unwrap_or("");
    assert!(
        message.contains(
            "clusterConfiguration.networking.podSubnet (changes the cluster's networking"
        ),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_kubeadm_restores_the_manifest_and_the_record() {
    let s = setup(246, &cluster("7")).await;
    let before = manifest(s.root(), "kube-apiserver");
    std::fs::write(s.root().join("etc/kubernetes/kubeadm-standin-fail"), "").unwrap();
    move_kubeadm_config(s.root(), &cluster("30"));
    let last = s.update(&spec(cluster("30"))).await;
    assert_eq!(
        last["status"],
        "Failure",
        "{last}\n{}",
        s.world.updater_log()
    );
    let log = std::fs::read_to_string(s.root().join("var/log/kubeadm-standin.log")).unwrap();
    assert!(
        log.lines()
            .last()
            .unwrap_or("")
            .contains("rewrote [kube-apiserver]"),
        "{log}"
    );
    assert_eq!(
        manifest(s.root(), "kube-apiserver"),
        before,
        "manifest restored"
    );
    assert!(
        !s.root().join(RECORD).exists(),
        "the record the plan wrote is removed again (there was none)"
    );
    let journal = s.journal();
    assert!(journal.contains("kubeadm upgrade node"), "{journal}");
}
