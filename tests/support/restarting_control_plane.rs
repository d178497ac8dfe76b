//! Stand-ins for what the `controlPlane` gate (decision 0019) reads on a kubeadm
//! control-plane node, for the benches (`benches/cluster.rs`): an HTTPS API server with the
//! node's cluster CA (`/readyz`, and the node's mirror pods at
//! `GET /api/v1/namespaces/kube-system/pods/<component>-<node>` for a client-certificate
//! holder, in the wire shape the kubelet leaves them), and one etcd metrics listener
//! (`/health`, `/health?serializable=true`) shared by the nodes on this machine.
//!
//! The node's tree gets what kubeadm leaves there: the four static pod manifests (the
//! kube-apiserver's with kubeadm's advertise-endpoint annotation naming this stand-in, which
//! is where the gate looks when the plan names no `apiServer`), `pki/ca.crt` and a
//! `kubelet.conf` with the kubelet's client certificate inline.
//!
//! **A restart, stood in.** When a manifest's content changes, the stand-in behaves as the
//! kubelet and the new static pod would for `restart` after the file's modification time:
//! the mirror pod keeps the old `kubernetes.io/config.hash` and, for kube-apiserver,
//! `/readyz` answers 503; after that the mirror pod carries the new hash and `/readyz` 200.
//! `restart` is an input of the bench, not a measurement.
//!
//! The same wire shapes as `tests/it/control_plane_gate.rs`, which also changes what the
//! stand-in answers (unready, frozen hashes, no etcd leader) for its failure tests.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

pub use super::control_plane::{COMPONENTS, manifest};
use super::control_plane::{manifest_with, read_head};

/// kubeadm's etcd metrics listener, where the gate reads etcd's health by default.
pub const ETCD_METRICS: &str = "127.0.0.1:2381";

/// The manifest of `component` at `image` (a tag such as `v1.35.2`); kube-apiserver's
/// carries the advertise endpoint `api` (`host:port`).
pub fn manifest_text(component: &str, image: &str, api: &str) -> String {
    manifest_with(
        component,
        image,
        (component == "kube-apiserver").then_some(api),
    )
}

fn hash_of(bytes: &[u8]) -> String {
    hex::encode(&Sha256::digest(bytes)[..16])
}

/// What one component's mirror pod shows: the hash it serves, and a change being "restarted".
#[derive(Default)]
struct Pod {
    served: String,
    pending: Option<(String, SystemTime)>,
}

/// One control-plane node's API server stand-in.
pub struct ControlPlaneNode {
    /// The node's name (mirror pods are `<component>-<node>`).
    pub node: String,
    /// `127.0.0.1:<port>` of its API server stand-in.
    pub api: String,
    /// `/readyz` answers that were not 200 (during a stood-in restart).
    pub unready_answers: Arc<AtomicU64>,
    pods: Arc<Mutex<BTreeMap<String, Pod>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for ControlPlaneNode {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(&self.api);
    }
}

impl ControlPlaneNode {
    /// Writes what kubeadm leaves on control-plane node `node` under `root` (manifests at
    /// `image`, the cluster CA, the kubelet's kubeconfig) and starts its API server stand-in,
    /// whose stood-in restarts last `restart`.
    pub fn start(
        root: &Path,
        node: &str,
        image: &str,
        restart: Duration,
    ) -> Result<ControlPlaneNode, String> {
        let err =
            |what: &str, e: &dyn std::fmt::Display| format!("control plane {node}: {what}: {e}");
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| err("bind", &e))?;
        let api = listener
            .local_addr()
            .map(|a| a.to_string())
            .map_err(|e| err("address", &e))?;
        std::fs::create_dir_all(root.join("etc/kubernetes/manifests"))
            .map_err(|e| err("mkdir", &e))?;
        std::fs::create_dir_all(root.join("etc/kubernetes/pki")).map_err(|e| err("mkdir", &e))?;
        for c in COMPONENTS {
            std::fs::write(manifest(root, c), manifest_text(c, image, &api))
                .map_err(|e| err("write manifest", &e))?;
        }
        // The cluster CA, the API server's certificate (named `kubernetes`, as kubeadm names
        // it), the kubelet's client certificate.
        let rc = |e: rcgen::Error| err("certificate", &e);
        let ca_key = rcgen::KeyPair::generate().map_err(rc)?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(rc)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "kubernetes");
        let ca = ca_params.self_signed(&ca_key).map_err(rc)?;
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let server_key = rcgen::KeyPair::generate().map_err(rc)?;
        let server = rcgen::CertificateParams::new(vec![
            "kubernetes".to_string(),
            "kubernetes.default".to_string(),
            node.to_string(),
        ])
        .map_err(rc)?
        .signed_by(&server_key, &issuer)
        .map_err(rc)?;
        let client_key = rcgen::KeyPair::generate().map_err(rc)?;
        let mut client_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(rc)?;
        client_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("system:node:{node}"));
        let client = client_params.signed_by(&client_key, &issuer).map_err(rc)?;
        std::fs::write(root.join("etc/kubernetes/pki/ca.crt"), ca.pem())
            .map_err(|e| err("write ca", &e))?;
        let b64 = |s: String| base64::engine::general_purpose::STANDARD.encode(s);
        std::fs::write(
            root.join("etc/kubernetes/kubelet.conf"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: default-cluster\n  cluster:\n    \
                 certificate-authority-data: {}\n    server: https://{api}\n\
                 contexts:\n- name: default-context\n  context:\n    cluster: default-cluster\n    \
                 namespace: default\n    user: default-auth\ncurrent-context: default-context\n\
                 users:\n- name: default-auth\n  user:\n    client-certificate-data: {}\n    \
                 client-key-data: {}\n",
                b64(ca.pem()),
                b64(client.pem()),
                b64(client_key.serialize_pem()),
            ),
        )
        .map_err(|e| err("write kubelet.conf", &e))?;

        let mut pods = BTreeMap::new();
        for c in COMPONENTS {
            let bytes = std::fs::read(manifest(root, c)).unwrap_or_default();
            pods.insert(
                c.to_string(),
                Pod {
                    served: hash_of(&bytes),
                    pending: None,
                },
            );
        }
        let pods = Arc::new(Mutex::new(pods));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).map_err(|e| err("roots", &e))?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .allow_unauthenticated()
        .build()
        .map_err(|e| err("verifier", &e))?;
        let config = Arc::new(
            rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| err("tls", &e))?
                .with_client_cert_verifier(verifier)
                .with_single_cert(
                    vec![server.der().clone()],
                    PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der())),
                )
                .map_err(|e| err("tls", &e))?,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let unready_answers = Arc::new(AtomicU64::new(0));
        {
            let (pods, stop, unready) = (pods.clone(), stop.clone(), unready_answers.clone());
            let (root, node) = (root.to_path_buf(), node.to_string());
            thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let (config, pods, unready) = (config.clone(), pods.clone(), unready.clone());
                    let (root, node) = (root.clone(), node.clone());
                    thread::spawn(move || {
                        let state = State {
                            root: &root,
                            node: &node,
                            pods: &pods,
                            restart,
                        };
                        serve_api(stream, config, &state, &unready)
                    });
                }
            });
        }
        Ok(ControlPlaneNode {
            node: node.to_string(),
            api,
            unready_answers,
            pods,
            stop,
        })
    }

    /// Whether every component's mirror pod serves its manifest's current hash.
    pub fn settled(&self) -> bool {
        self.pods
            .lock()
            .map(|p| p.values().all(|p| p.pending.is_none()))
            .unwrap_or(false)
    }
}

struct State<'a> {
    root: &'a Path,
    node: &'a str,
    pods: &'a Mutex<BTreeMap<String, Pod>>,
    restart: Duration,
}

impl State<'_> {
    /// The hash `component`'s mirror pod shows now, and whether it is still restarting.
    fn look(&self, component: &str) -> (String, bool) {
        let path = manifest(self.root, component);
        let bytes = std::fs::read(&path).unwrap_or_default();
        let now_hash = hash_of(&bytes);
        let written = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .unwrap_or_else(|_| SystemTime::now());
        let Ok(mut pods) = self.pods.lock() else {
            return (now_hash, false);
        };
        let pod = pods.entry(component.to_string()).or_default();
        if pod.served != now_hash {
            match &pod.pending {
                Some((h, _)) if *h == now_hash => {}
                _ => pod.pending = Some((now_hash.clone(), written)),
            }
        } else {
            pod.pending = None;
        }
        if let Some((h, since)) = pod.pending.clone() {
            let elapsed = SystemTime::now().duration_since(since).unwrap_or_default();
            if elapsed >= self.restart {
                pod.served = h;
                pod.pending = None;
            }
        }
        (pod.served.clone(), pod.pending.is_some())
    }
}

fn serve_api(
    tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
    state: &State<'_>,
    unready: &AtomicU64,
) {
    let Ok(conn) = rustls::ServerConnection::new(config) else {
        return;
    };
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let Some(path) = read_head(&mut tls) else {
        return;
    };
    let has_cert = tls.conn.peer_certificates().is_some_and(|c| !c.is_empty());
    let (status, body) = if path == "/readyz" {
        if state.look("kube-apiserver").1 {
            unready.fetch_add(1, Ordering::SeqCst);
            (
                503,
                "[+]ping ok\n[-]etcd failed: reason withheld\nreadyz check failed\n".to_string(),
            )
        } else {
            (200, "ok".to_string())
        }
    } else if let Some(name) = path.strip_prefix("/api/v1/namespaces/kube-system/pods/") {
        let component = name
            .strip_suffix(&format!("-{}", state.node))
            .filter(|c| COMPONENTS.contains(c));
        match (has_cert, component) {
            (false, _) => (403, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403}).to_string()),
            (true, Some(c)) => {
                let (hash, restarting) = state.look(c);
                (200, mirror_pod(c, state.node, &hash, !restarting).to_string())
            }
            (true, None) => (404, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}).to_string()),
        }
    } else {
        (404, "404 page not found\n".to_string())
    };
    let reason = match status {
        200 => "OK",
        403 => "Forbidden",
        404 => "Not Found",
        _ => "Service Unavailable",
    };
    let _ = write!(
        tls,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tls.conn.send_close_notify();
    let _ = tls.flush();
}

/// A mirror pod as the kubelet leaves it in the API (trimmed of fields the gate ignores).
fn mirror_pod(component: &str, node: &str, hash: &str, ready: bool) -> Value {
    let ready = if ready { "True" } else { "False" };
    json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": format!("{component}-{node}"), "namespace": "kube-system",
            "labels": {"component": component, "tier": "control-plane"},
            "annotations": {
                "kubernetes.io/config.hash": hash,
                "kubernetes.io/config.mirror": hash,
                "kubernetes.io/config.source": "file"
            }
        },
        "spec": {"nodeName": node, "hostNetwork": true},
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "Ready", "status": ready},
                {"type": "ContainersReady", "status": ready}
            ]
        }
    })
}

/// etcd's metrics listener on [`ETCD_METRICS`], healthy and with a leader, shared by every
/// stand-in node of this process; `None` when the port is taken (the caller says so and
/// uses external etcd instead).
pub fn start_etcd() -> Option<Arc<AtomicBool>> {
    let listener = TcpListener::bind(ETCD_METRICS).ok()?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            if s.load(Ordering::SeqCst) {
                return;
            }
            let Some(path) = read_head(&mut stream) else {
                continue;
            };
            let (status, body) = match path.as_str() {
                "/health?serializable=true" | "/health" => {
                    (200, r#"{"health":"true","reason":""}"#)
                }
                _ => (404, "404 page not found\n"),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Some(stop)
}
