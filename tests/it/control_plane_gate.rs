//! The `controlPlane` gate (decision 0019) run by the real agent binary on a sandbox
//! control-plane node, against stand-ins served here: an HTTPS API server with its own CA
//! (`/readyz`, and the mirror pods at `GET /api/v1/namespaces/kube-system/pods/<name>` in the
//! wire shape the kubelet leaves them, requiring a client certificate), and an etcd metrics
//! listener (`/health`, `/health?serializable=true`). The mirror pods' `config.hash` follows
//! the manifest file in the sandbox, as the kubelet's does, unless the stand-in is told to
//! keep the old one.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use base64::Engine as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::support::{Node, text};

pub(crate) const NODE: &str = "cp-0";
const COMPONENTS: [&str; 4] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];

/// How the stand-ins answer; changed by the tests.
struct Behaviour {
    readyz: AtomicU16,
    /// The mirror pods keep the hash they had when the stand-in started.
    frozen: AtomicBool,
    etcd_leader: AtomicBool,
    /// The hash each mirror pod had at the start.
    initial: Mutex<Vec<(String, String)>>,
    /// Pod reads that came without a client certificate.
    anonymous_pod_reads: AtomicU16,
}

/// A sandbox control-plane node with its PKI and stand-ins (also used by
/// `updater_cluster_config`, whose agent serves this node).
pub(crate) struct ControlPlane {
    pub(crate) node: Node,
    behaviour: Arc<Behaviour>,
    pub(crate) api_port: u16,
    etcd_port: u16,
}

fn hash_of(root: &Path, component: &str) -> String {
    let bytes = std::fs::read(manifest(root, component)).unwrap_or_default();
    hex::encode(&Sha256::digest(&bytes)[..16])
}

fn manifest(root: &Path, component: &str) -> PathBuf {
    root.join(format!("etc/kubernetes/manifests/{component}.yaml"))
}

fn manifest_text(component: &str, image: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {component}\n  namespace: kube-system\n\
         spec:\n  containers:\n  - name: {component}\n    image: registry.k8s.io/{component}:{image}\n"
    )
}

impl ControlPlane {
    pub(crate) fn new() -> ControlPlane {
        let node = Node::new();
        let root = node.root().to_path_buf();
        std::fs::create_dir_all(root.join("etc/kubernetes/manifests")).unwrap();
        std::fs::create_dir_all(root.join("etc/kubernetes/pki")).unwrap();
        for c in COMPONENTS {
            std::fs::write(manifest(&root, c), manifest_text(c, "v1.35.2")).unwrap();
        }
        // The cluster CA, the API server's certificate (named `kubernetes`, as kubeadm
        // names it), the kubelet's client certificate.
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "kubernetes");
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let server_key = rcgen::KeyPair::generate().unwrap();
        let server = rcgen::CertificateParams::new(vec![
            "kubernetes".to_string(),
            "kubernetes.default".to_string(),
            NODE.to_string(),
        ])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
        let client_key = rcgen::KeyPair::generate().unwrap();
        let mut client_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        client_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("system:node:{NODE}"));
        let client = client_params.signed_by(&client_key, &issuer).unwrap();
        std::fs::write(root.join("etc/kubernetes/pki/ca.crt"), ca.pem()).unwrap();
        let b64 = |s: String| base64::engine::general_purpose::STANDARD.encode(s);
        // kubeadm's kubelet.conf names files; this one holds the credential inline, the other
        // form CAPI's bootstrap writes.
        std::fs::write(
            root.join("etc/kubernetes/kubelet.conf"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: default-cluster\n  cluster:\n    \
                 certificate-authority-data: {}\n    server: https://10.0.0.1:6443\n\
                 contexts:\n- name: default-context\n  context:\n    cluster: default-cluster\n    \
                 namespace: default\n    user: default-auth\ncurrent-context: default-context\n\
                 users:\n- name: default-auth\n  user:\n    client-certificate-data: {}\n    \
                 client-key-data: {}\n",
                b64(ca.pem()),
                b64(client.pem()),
                b64(client_key.serialize_pem()),
            ),
        )
        .unwrap();

        let behaviour = Arc::new(Behaviour {
            readyz: AtomicU16::new(200),
            frozen: AtomicBool::new(false),
            etcd_leader: AtomicBool::new(true),
            initial: Mutex::new(
                COMPONENTS
                    .iter()
                    .map(|c| (c.to_string(), hash_of(&root, c)))
                    .collect(),
            ),
            anonymous_pod_reads: AtomicU16::new(0),
        });

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .allow_unauthenticated()
        .build()
        .unwrap();
        let config = Arc::new(
            rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_client_cert_verifier(verifier)
                .with_single_cert(
                    vec![server.der().clone()],
                    PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der())),
                )
                .unwrap(),
        );
        let api = TcpListener::bind("127.0.0.1:0").unwrap();
        let api_port = api.local_addr().unwrap().port();
        {
            let behaviour = behaviour.clone();
            let root = root.clone();
            thread::spawn(move || {
                for stream in api.incoming().flatten() {
                    let (config, behaviour, root) =
                        (config.clone(), behaviour.clone(), root.clone());
                    thread::spawn(move || serve_api(stream, config, &behaviour, &root));
                }
            });
        }
        let etcd = TcpListener::bind("127.0.0.1:0").unwrap();
        let etcd_port = etcd.local_addr().unwrap().port();
        {
            let behaviour = behaviour.clone();
            thread::spawn(move || {
                for stream in etcd.incoming().flatten() {
                    serve_etcd(stream, &behaviour);
                }
            });
        }
        ControlPlane {
            node,
            behaviour,
            api_port,
            etcd_port,
        }
    }

    /// A plan that changes kube-apiserver's manifest (as `kubeadm upgrade node` does), gated.
    fn plan(&self, id: &str) -> PathBuf {
        let content = manifest_text("kube-apiserver", "v1.35.3");
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n  - file: {{path: \
             /etc/kubernetes/manifests/kube-apiserver.yaml, content: {content:?}, mode: \"0600\"}}\n\
             verify:\n  - controlPlane: {{nodeName: {NODE}, etcd: stacked, apiServer: \
             \"127.0.0.1:{}\", etcdMetrics: \"127.0.0.1:{}\", timeoutSeconds: 3, periodSeconds: 1}}\n",
            self.api_port, self.etcd_port
        );
        self.node
            .plan_file(&format!("{}.yaml", id.replace('/', "_")), &text)
    }

    fn apply(&self, id: &str) -> (Value, String) {
        let plan = self.plan(id);
        let out = self.node.agent(&[
            "apply",
            "--no-chroot",
            "--output",
            "json",
            plan.to_str().unwrap(),
        ]);
        let status: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("no status: {}", text(&out)));
        (status, text(&out))
    }

    fn apiserver_manifest(&self) -> String {
        std::fs::read_to_string(manifest(self.node.root(), "kube-apiserver")).unwrap()
    }
}

fn read_head(stream: &mut impl Read) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => buf.push(byte[0]),
            _ => return None,
        }
        if buf.len() > 16 * 1024 {
            return None;
        }
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    Some(head.split_whitespace().nth(1).unwrap_or("").to_string())
}

/// The API server stand-in: `/readyz`, and mirror pods for client-certificate holders. Pods
/// are sent chunked, as a Go server sends a body of unknown length.
fn serve_api(tcp: TcpStream, config: Arc<rustls::ServerConfig>, b: &Behaviour, root: &Path) {
    let conn = rustls::ServerConnection::new(config).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let Some(path) = read_head(&mut tls) else {
        return;
    };
    let has_cert = tls
        .conn
        .peer_certificates()
        .is_some_and(|c: &[CertificateDer<'_>]| !c.is_empty());
    let (status, body, chunked) = if path == "/readyz" {
        match b.readyz.load(Ordering::SeqCst) {
            200 => (200, "ok".to_string(), false),
            s => (
                s,
                "[+]ping ok\n[+]log ok\n[-]etcd failed: reason withheld\nreadyz check failed\n"
                    .to_string(),
                false,
            ),
        }
    } else if let Some(name) = path.strip_prefix("/api/v1/namespaces/kube-system/pods/") {
        if !has_cert {
            b.anonymous_pod_reads.fetch_add(1, Ordering::SeqCst);
            (403, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": format!("pods \"{name}\" is forbidden: User \"system:anonymous\" cannot get resource \"pods\""), "reason": "Forbidden", "code": 403}).to_string(), false)
        } else {
            match name.strip_suffix(&format!("-{NODE}")).filter(|c| COMPONENTS.contains(c)) {
                Some(c) => {
                    let hash = if b.frozen.load(Ordering::SeqCst) {
                        b.initial.lock().unwrap().iter().find(|(n, _)| n == c).unwrap().1.clone()
                    } else {
                        hash_of(root, c)
                    };
                    (200, mirror_pod(c, &hash).to_string(), true)
                }
                None => (404, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": format!("pods \"{name}\" not found"), "reason": "NotFound", "code": 404}).to_string(), false),
            }
        }
    } else {
        (404, "404 page not found\n".to_string(), false)
    };
    let reason = match status {
        200 => "OK",
        403 => "Forbidden",
        404 => "Not Found",
        _ => "Service Unavailable",
    };
    let head = if chunked {
        format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
    } else {
        format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
    };
    let _ = tls.write_all(head.as_bytes());
    if chunked {
        for piece in body.as_bytes().chunks(700) {
            let _ = write!(tls, "{:x}\r\n", piece.len());
            let _ = tls.write_all(piece);
            let _ = tls.write_all(b"\r\n");
        }
        let _ = tls.write_all(b"0\r\n\r\n");
    } else {
        let _ = tls.write_all(body.as_bytes());
    }
    tls.conn.send_close_notify();
    let _ = tls.flush();
}

/// A mirror pod as the kubelet leaves it in the API (trimmed of fields the gate ignores).
fn mirror_pod(component: &str, hash: &str) -> Value {
    json!({
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": format!("{component}-{NODE}"),
            "namespace": "kube-system",
            "uid": "2a5c0f7e-55a4-4b0e-9f3e-6f1f2f3a4b5c",
            "resourceVersion": "4711",
            "creationTimestamp": "2026-12-07T08:00:00Z",
            "labels": {"component": component, "tier": "control-plane"},
            "annotations": {
                "kubernetes.io/config.hash": hash,
                "kubernetes.io/config.mirror": hash,
                "kubernetes.io/config.seen": "2026-12-07T08:00:00.123456789Z",
                "kubernetes.io/config.source": "file"
            },
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "0d4f6a8c-1b3d-4e5f-8a9b-0c1d2e3f4a5b", "controller": true}]
        },
        "spec": {
            "containers": [{"name": component, "image": format!("registry.k8s.io/{component}:v1.35.3")}],
            "nodeName": NODE,
            "hostNetwork": true,
            "priorityClassName": "system-node-critical"
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "PodReadyToStartContainers", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-07T08:00:01Z"},
                {"type": "Initialized", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-07T08:00:01Z"},
                {"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-07T08:00:05Z"},
                {"type": "ContainersReady", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-07T08:00:05Z"},
                {"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-07T08:00:01Z"}
            ],
            "hostIP": "10.0.0.10",
            "podIP": "10.0.0.10",
            "qosClass": "Burstable"
        }
    })
}

/// etcd's metrics listener: `/health?serializable=true` answers from the member itself; the
/// linearizable `/health` needs a leader (etcd's `{"health":"false","reason":"RAFT NO LEADER"}`).
fn serve_etcd(mut stream: TcpStream, b: &Behaviour) {
    let Some(path) = read_head(&mut stream) else {
        return;
    };
    let (status, body) = match path.as_str() {
        "/health?serializable=true" => (200, r#"{"health":"true","reason":""}"#),
        "/health" if b.etcd_leader.load(Ordering::SeqCst) => {
            (200, r#"{"health":"true","reason":""}"#)
        }
        "/health" => (503, r#"{"health":"false","reason":"RAFT NO LEADER"}"#),
        _ => (404, "404 page not found\n"),
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
}

fn detail(status: &Value) -> String {
    status["error"]["detail"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_healthy_control_plane_passes_the_gate() {
    let cp = ControlPlane::new();
    let (status, out) = cp.apply("kube-system/cp-0@healthy");
    assert_eq!(status["phase"], "Succeeded", "{out}");
    assert!(cp.apiserver_manifest().contains("v1.35.3"));
    assert_eq!(
        cp.behaviour.anonymous_pod_reads.load(Ordering::SeqCst),
        0,
        "the mirror pods are read with the kubelet's credential"
    );
}

#[test]
fn an_api_server_that_stays_unready_fails_the_gate_and_rolls_back() {
    let cp = ControlPlane::new();
    cp.behaviour.readyz.store(503, Ordering::SeqCst);
    let (status, out) = cp.apply("kube-system/cp-0@unready");
    assert_eq!(status["phase"], "RolledBack", "{out}");
    assert_eq!(status["error"]["kind"], "verification", "{out}");
    assert!(
        status["error"]["step"]
            .as_str()
            .unwrap_or("")
            .contains("controlPlane"),
        "{status}"
    );
    let d = detail(&status);
    assert!(d.starts_with("kube-apiserver: "), "{d}");
    assert!(
        d.contains(&format!(
            "https://127.0.0.1:{}/readyz answered 503",
            cp.api_port
        )),
        "{d}"
    );
    assert!(d.contains("[-]etcd failed"), "{d}");
    assert!(
        cp.apiserver_manifest().contains("v1.35.2"),
        "manifest restored"
    );
}

#[test]
fn a_mirror_pod_on_the_old_manifest_fails_the_gate_and_rolls_back() {
    let cp = ControlPlane::new();
    cp.behaviour.frozen.store(true, Ordering::SeqCst);
    let (status, out) = cp.apply("kube-system/cp-0@stale");
    assert_eq!(status["phase"], "RolledBack", "{out}");
    let d = detail(&status);
    assert!(d.starts_with("kube-apiserver: mirror pod kube-system/kube-apiserver-cp-0 still runs the manifest from before the plan"), "{d}");
    assert!(d.contains("kubernetes.io/config.hash"), "{d}");
    assert!(
        cp.apiserver_manifest().contains("v1.35.2"),
        "manifest restored"
    );
}

#[test]
fn etcd_without_a_leader_fails_the_gate_and_rolls_back() {
    let cp = ControlPlane::new();
    cp.behaviour.etcd_leader.store(false, Ordering::SeqCst);
    let (status, out) = cp.apply("kube-system/cp-0@noleader");
    assert_eq!(status["phase"], "RolledBack", "{out}");
    let d = detail(&status);
    assert!(d.starts_with("etcd: the cluster has no leader"), "{d}");
    assert!(
        d.contains(&format!(
            "http://127.0.0.1:{}/health answered 503",
            cp.etcd_port
        )),
        "{d}"
    );
    assert!(d.contains("RAFT NO LEADER"), "{d}");
    assert!(
        cp.apiserver_manifest().contains("v1.35.2"),
        "manifest restored"
    );
}
