//! Shared harness of the updater's tests: a throwaway PKI, the Kubernetes API stand-in
//! (`inplace_updater::standin`, in this process), real `inplace-agent serve` agents on
//! sandbox node trees (each on its own loopback address, all on one port, as a fleet whose
//! agents share `agentPort`), the real `inplace-updater serve` binary, and a client that
//! calls it exactly as Cluster API does (`updater::emulate::CapiClient`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::daemon::{Daemon, Ready, serve_command};
use super::patience::deadline;
use inplace_updater::emulate::{CapiClient, CertFiles, Pki};
use inplace_updater::hooks::{
    HOOKS_API_VERSION, Hook, PENDING_HOOKS_ANNOTATION, UPDATE_IN_PROGRESS_ANNOTATION,
};
use inplace_updater::standin::ApiStandin;

pub use super::programs::{AGENT, UPDATER};
pub const KUBELET_STANDIN: &str = env!("CARGO_BIN_EXE_kubelet-standin");

/// The host name CAPI dials (the Service's DNS name); the serving certificate names it.
pub const SERVICE_HOST: &str = "inplace-updater.inplace-system.svc";

/// What never appears in a log: the bootstrap token of the fixtures and a secret file body.
pub const BOOTSTRAP_TOKEN: &str = "abcdef.0123456789abcdef";
pub const SECRET_CONTENT: &str = "s3cr3t-registry-password";

/// The namespace and cluster of the fixtures' Machines ([`machine`]); the world's agents'
/// certificates carry this cluster's URI SAN (`inplace_api::pki::cluster_identity`), which
/// the updater requires with `agentCA: File`.
pub const CLUSTER: (&str, &str) = ("default", "capi-quickstart");

/// An agent: a sandbox node tree (or a given root) and `inplace-agent serve` on it.
pub struct Agent {
    pub node: String,
    pub ip: String,
    pub root: PathBuf,
    _tree: Option<tempfile::TempDir>,
    pub proc: Daemon,
}

/// A free TCP port on 127.0.0.1 (the agents bind it on other loopback addresses).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The whole setup of one test.
pub struct World {
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    pub api: ApiStandin,
    pub agent_port: u16,
    pub agents: Vec<Agent>,
    pub updater: Option<Daemon>,
    pub updater_addr: Option<SocketAddr>,
    pub client_cert: CertFiles,
    /// The third octet of this test's loopback addresses (tests run in parallel).
    pub subnet: u8,
}

impl World {
    pub async fn new(subnet: u8) -> World {
        super::programs::check_fresh();
        let dir = tempfile::Builder::new()
            .prefix("inplace-updater-test-")
            .tempdir()
            .unwrap();
        let pki = Pki::new(&dir.path().join("pki")).unwrap();
        let client_cert = pki.updater_client().unwrap();
        let api = ApiStandin::start().await.unwrap();
        World {
            dir,
            pki,
            api,
            agent_port: free_port(),
            agents: Vec::new(),
            updater: None,
            updater_addr: None,
            client_cert,
            subnet,
        }
    }

    /// Starts an agent for `node` on a fresh kubeadm-like tree whose kubelet (the stand-in)
    /// reports `kubelet_version`. Service management is off (no systemd in a tree).
    pub fn add_agent(&mut self, node: &str, kubelet_version: &str) -> usize {
        self.add_agent_signed_by(node, kubelet_version, None)
    }

    /// [`World::add_agent`] with the agent's serving certificate signed by `signer` (another
    /// workload cluster's CA) instead of this world's CA; it still trusts this world's CA for
    /// the updater's client certificate (the management side's).
    pub fn add_agent_signed_by(
        &mut self,
        node: &str,
        kubelet_version: &str,
        signer: Option<&Pki>,
    ) -> usize {
        let bound = inplace_api::pki::cluster_identity(CLUSTER.0, CLUSTER.1);
        self.add_agent_bound(node, kubelet_version, signer, &[&bound])
    }

    /// [`World::add_agent_signed_by`] with the URI SANs `uris` in the agent's certificate
    /// instead of the fixtures' cluster's (none: an agent bound to no cluster).
    pub fn add_agent_bound(
        &mut self,
        node: &str,
        kubelet_version: &str,
        signer: Option<&Pki>,
        uris: &[&str],
    ) -> usize {
        let tree = tempfile::Builder::new()
            .prefix("inplace-updater-node-")
            .tempdir()
            .unwrap();
        inplace_demo_node::build_kubeadm_worker(tree.path()).unwrap();
        let bin = tree.path().join("usr/local/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::copy(KUBELET_STANDIN, bin.join("kubelet")).unwrap();
        std::fs::write(bin.join("kubelet.version"), format!("{kubelet_version}\n")).unwrap();
        let root = tree.path().to_path_buf();
        let ip = format!("127.0.{}.{}", self.subnet, self.agents.len() + 2);
        let proc = self.spawn_agent_signed_by(
            node,
            &ip,
            &root,
            &["--no-chroot"],
            &[("INPLACE_AGENT_SERVICES", "off")],
            (signer.unwrap_or(&self.pki), uris),
        );
        self.agents.push(Agent {
            node: node.to_owned(),
            ip,
            root: root.clone(),
            _tree: None,
            proc,
        });
        let i = self.agents.len() - 1;
        self.agents[i]._tree = Some(tree);
        i
    }

    /// Starts `inplace-agent serve` for `node` on `root` with extra flags and environment.
    pub fn start_agent(
        &mut self,
        node: &str,
        root: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> usize {
        let ip = format!("127.0.{}.{}", self.subnet, self.agents.len() + 2);
        let proc = self.spawn_agent(node, &ip, root, extra, env);
        self.agents.push(Agent {
            node: node.to_owned(),
            ip,
            root: root.to_path_buf(),
            _tree: None,
            proc,
        });
        self.agents.len() - 1
    }

    /// Kills agent `i` (SIGKILL, as a crash or a power cut would) and starts it again on
    /// the same address, tree and state directory.
    pub fn restart_agent(&mut self, i: usize, extra: &[&str], env: &[(&str, &str)]) {
        self.agents[i].proc.kill9();
        let (node, ip, root) = {
            let a = &self.agents[i];
            (a.node.clone(), a.ip.clone(), a.root.clone())
        };
        self.agents[i].proc = self.spawn_agent(&node, &ip, &root, extra, env);
    }

    fn spawn_agent(
        &self,
        node: &str,
        ip: &str,
        root: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let bound = inplace_api::pki::cluster_identity(CLUSTER.0, CLUSTER.1);
        self.spawn_agent_signed_by(node, ip, root, extra, env, (&self.pki, &[&bound]))
    }

    fn spawn_agent_signed_by(
        &self,
        node: &str,
        ip: &str,
        root: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
        (signer, uris): (&Pki, &[&str]),
    ) -> Daemon {
        let server = signer.server_with_uris(node, &[node, ip], uris).unwrap();
        let state = self.dir.path().join(format!("state-{node}"));
        let mut cmd = serve_command(
            Path::new(AGENT),
            root,
            node,
            &server.cert,
            &server.key,
            &self.pki.ca(),
        );
        cmd.arg("--state-dir")
            .arg(&state)
            .arg("--listen")
            .arg(format!("{ip}:{}", self.agent_port))
            .args(extra)
            .env("INPLACE_AGENT_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        Daemon::start(cmd, Ready::Log).unwrap_or_else(|e| panic!("agent {node}: {e}"))
    }

    /// Starts the updater binary against the stand-in.
    pub fn start_updater(&mut self) -> SocketAddr {
        self.start_updater_with(&[])
    }

    /// Starts the updater binary against the stand-in, with `extra` flags for `serve`.
    pub fn start_updater_with(&mut self, extra: &[&str]) -> SocketAddr {
        let serving = self
            .pki
            .server("serving", &[SERVICE_HOST, "localhost", "127.0.0.1"])
            .unwrap();
        let kubeconfig = self.dir.path().join("kubeconfig");
        self.api.write_kubeconfig(&kubeconfig).unwrap();
        let mut cmd = updater_serve_command(
            Path::new(UPDATER),
            &serving,
            &self.client_cert,
            &self.pki.ca(),
            &kubeconfig,
        );
        cmd.arg("--agent-port")
            .arg(self.agent_port.to_string())
            .arg("--allow-local-workload-servers") // the stand-in's workload clusters are on loopback
            .args(extra)
            .env("INPLACE_UPDATER_LOG", "debug");
        let proc = Daemon::start(cmd, Ready::Log).unwrap_or_else(|e| panic!("updater: {e}"));
        let addr: SocketAddr = proc
            .addr
            .parse()
            .unwrap_or_else(|e| panic!("updater address {:?}: {e}", proc.addr));
        self.updater = Some(proc);
        self.updater_addr = Some(addr);
        addr
    }

    /// A client as an unauthenticated caller is: it does not touch the ExtensionConfig, so
    /// the settings of its requests must be the registered ones or be refused.
    pub fn raw_client(&self) -> CapiClient {
        CapiClient::new(self.updater_addr.unwrap(), SERVICE_HOST, &self.pki.ca()).unwrap()
    }

    /// A client as Cluster API is: the ExtensionConfig carries each request's settings.
    pub fn client(&self) -> CapiClient {
        CapiClient::new(self.updater_addr.unwrap(), SERVICE_HOST, &self.pki.ca())
            .unwrap()
            .registering_in(&self.api)
    }

    pub fn updater_log(&self) -> String {
        self.updater.as_ref().map(Daemon::log).unwrap_or_default()
    }

    /// Whether the updater's log shows `text`, waiting for it up to the tests' patience:
    /// a line may reach the log file just after the answer it belongs to (seen under load).
    pub fn updater_log_shows(&self, text: &str) -> bool {
        super::patience::poll(|| self.updater_log().contains(text).then_some(())).is_some()
    }

    /// Puts the Machine `name` (for agent `i`) and its KubeadmConfig into the stand-in,
    /// marked as being updated in place.
    pub fn put_machine(
        &self,
        name: &str,
        agent: usize,
        version: &str,
        bootstrap_spec: Value,
    ) -> (Value, Value) {
        let a = &self.agents[agent];
        let machine = machine(name, version, &a.node, &a.ip, true);
        let config = kubeadm_config(name, bootstrap_spec);
        self.api.put(machine.clone());
        self.api.put(config.clone());
        (machine, config)
    }
}

/// A Machine as the API server serves it (typed order: kind first), being updated in place
/// when `in_place`.
pub fn machine(name: &str, version: &str, node: &str, ip: &str, in_place: bool) -> Value {
    let mut annotations = serde_json::Map::new();
    if in_place {
        annotations.insert(UPDATE_IN_PROGRESS_ANNOTATION.into(), json!(""));
        annotations.insert(PENDING_HOOKS_ANNOTATION.into(), json!("UpdateMachine"));
    }
    json!({
        "kind": "Machine",
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"cluster.x-k8s.io/cluster-name": "capi-quickstart"},
            "annotations": annotations,
        },
        "spec": {
            "clusterName": "capi-quickstart",
            "bootstrap": {
                "configRef": {"kind": "KubeadmConfig", "name": name, "apiGroup": "bootstrap.cluster.x-k8s.io"},
                "dataSecretName": name,
            },
            "infrastructureRef": {"kind": "DevMachine", "name": name, "apiGroup": "infrastructure.cluster.x-k8s.io"},
            "version": version,
            "providerID": format!("docker:////{name}"),
        },
        "status": {
            "nodeRef": {"name": node},
            "addresses": [
                {"type": "Hostname", "address": node},
                {"type": "InternalIP", "address": ip},
            ],
            "phase": "Running",
        },
    })
}

/// `inplace-updater serve` of `program` on a free loopback port: serving with `serving`,
/// calling the agents with `client` (trusting `agent_ca` under `agentCA: File`), the
/// management cluster through `kubeconfig` (the tests', the benches' updater).
pub fn updater_serve_command(
    program: &Path,
    serving: &CertFiles,
    client: &CertFiles,
    agent_ca: &Path,
    kubeconfig: &Path,
) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&serving.cert)
        .arg("--tls-key")
        .arg(&serving.key)
        .arg("--agent-ca")
        .arg(agent_ca)
        .arg("--agent-cert")
        .arg(&client.cert)
        .arg("--agent-key")
        .arg(&client.key)
        .arg("--kubeconfig")
        .arg(kubeconfig);
    cmd
}

/// A KubeadmConfig with `spec` (unstructured, as the API server serves it).
pub fn kubeadm_config(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2",
        "kind": "KubeadmConfig",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    })
}

/// The KubeadmConfig spec of the fixtures: one file, two kubelet flags, a bootstrap token.
pub fn bootstrap_spec(files: Value) -> Value {
    json!({
        "files": files,
        "joinConfiguration": {
            "discovery": {"bootstrapToken": {"apiServerEndpoint": "172.18.0.3:6443", "token": BOOTSTRAP_TOKEN}},
            "nodeRegistration": {"kubeletExtraArgs": [
                {"name": "eviction-hard", "value": "nodefs.available<0%,nodefs.inodesFree<0%,imagefs.available<0%"},
                {"name": "max-pods", "value": "150"},
            ]},
        },
    })
}

/// The `CanUpdateMachineRequest` of `tests/fixtures/updater/` (its settings name no agent
/// port: the caller sets the world's).
pub fn can_update_machine_request() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/updater/can-update-machine-request.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// KubeadmControlPlane's `CanUpdateMachine` of the fixture (v1.35.1 → v1.35.2, `drain:
/// Never`) for agent 0 of `w`, and the live Machine it is about as the stand-in should serve
/// it (not put: the caller may change it first), its node reporting v1.35.1.
pub fn fixture_request_for_agent_0(w: &World) -> (Value, Value) {
    let mut req: Value = can_update_machine_request();
    req["settings"]["agentPort"] = json!(w.agent_port.to_string());
    req["settings"]["drain"] = json!("Never");
    let name = req["desired"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let a = &w.agents[0];
    let mut live = machine(&name, "v1.35.1", &a.node, &a.ip, false);
    live["status"]["nodeInfo"] = json!({"kubeletVersion": "v1.35.1"});
    (req, live)
}

/// The UpdateMachine request CAPI's Machine controller sends for the live objects (as Go's
/// json.Marshal writes it: compact, `<` escaped, no status).
pub fn update_request(machine: &Value, config: Option<&Value>, settings: Value) -> Vec<u8> {
    let strip = |o: &Value| {
        let mut o = o.clone();
        if let Some(m) = o.as_object_mut() {
            m.remove("status");
        }
        o
    };
    let mut desired = serde_json::Map::new();
    desired.insert("machine".into(), strip(machine));
    desired.insert(
        "infrastructureMachine".into(),
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta2", "kind": "DevMachine",
               "metadata": {"name": machine["metadata"]["name"], "namespace": "default"}, "spec": {}}),
    );
    if let Some(c) = config {
        desired.insert("bootstrapConfig".into(), strip(c));
    }
    let mut req = serde_json::Map::new();
    req.insert("kind".into(), json!("UpdateMachineRequest"));
    req.insert("apiVersion".into(), json!(HOOKS_API_VERSION));
    if settings.as_object().is_some_and(|s| !s.is_empty()) {
        req.insert("settings".into(), settings);
    }
    req.insert("desired".into(), Value::Object(desired));
    go_json(&Value::Object(req))
}

/// Go's `json.Marshal` escaping of `<`, `>` and `&`.
pub fn go_json(v: &Value) -> Vec<u8> {
    serde_json::to_string(v)
        .unwrap()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .into_bytes()
}

/// Calls UpdateMachine as CAPI's Machine controller does until it says done or fails:
/// after each in-progress answer it waits `retryAfterSeconds` (scaled by `scale`, so a test
/// does not wait 10 s per round), like CAPI's hook cache. Returns every response.
pub async fn poll_update(client: &mut CapiClient, body: &[u8], scale: f64) -> Vec<Value> {
    let deadline = deadline();
    let mut seen = Vec::new();
    loop {
        let r = client.call(Hook::UpdateMachine, body).await.unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        seen.push(v.clone());
        let retry = v["retryAfterSeconds"].as_i64().unwrap_or(0);
        if v["status"] != "Success" || retry == 0 {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "UpdateMachine never finished: {seen:?}"
        );
        tokio::time::sleep(Duration::from_secs_f64(retry as f64 * scale)).await;
    }
}
