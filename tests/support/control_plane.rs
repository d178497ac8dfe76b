//! Stand-ins for what the `controlPlane` gate (decision 0019) reads on a kubeadm
//! control-plane node, served in this process, shared by the gate's own tests
//! (`tests/it/control_plane_gate.rs`) and the emulated KubeadmControlPlane flow
//! (`tests/it/updater_kcp_flow.rs`):
//!
//! - the node's files, laid out as kubeadm leaves them in a sandbox root: the cluster CA
//!   (`/etc/kubernetes/pki/ca.crt`), the kubelet's kubeconfig with its client certificate
//!   inline (`/etc/kubernetes/kubelet.conf`), and the four static pod manifests, the
//!   kube-apiserver's carrying kubeadm's advertise-endpoint annotation (this stand-in's
//!   address);
//! - an HTTPS API server with that CA, its certificate named `kubernetes`: `/readyz`, and the
//!   mirror pods at `GET /api/v1/namespaces/kube-system/pods/<component>-<node>` in the wire
//!   shape the kubelet leaves them, for client-certificate holders only. A mirror pod's
//!   `kubernetes.io/config.hash` follows its manifest file in the root, as the kubelet's
//!   does, unless [`Behaviour::frozen`] keeps the one it had at the start;
//! - an etcd metrics listener (`/health`, `/health?serializable=true`).
//!
//! Nothing here is Kubernetes: no container runs, no kubelet watches the manifests.

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

/// The static pods of a stacked-etcd kubeadm control-plane node.
pub const COMPONENTS: [&str; 4] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];

/// The annotation kubeadm writes the API server's advertise endpoint into.
pub const ADVERTISE: &str = "kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint";

/// How the stand-ins answer; changed by the tests.
pub struct Behaviour {
    /// The status `/readyz` answers (200: ready).
    pub readyz: AtomicU16,
    /// The mirror pods keep the hash they had when the stand-in started.
    pub frozen: AtomicBool,
    /// etcd has a leader (the linearizable `/health` answers healthy).
    pub etcd_leader: AtomicBool,
    /// The hash each mirror pod had at the start.
    initial: Mutex<Vec<(String, String)>>,
    /// Pod reads that came without a client certificate.
    pub anonymous_pod_reads: AtomicU16,
    /// `/readyz` requests answered.
    pub readyz_reads: AtomicU16,
}

/// One control-plane node's stand-ins, serving until the process ends.
pub struct Standins {
    /// How they answer.
    pub behaviour: Arc<Behaviour>,
    /// The API server's port (on the address given to [`Standins::install`]).
    pub api_port: u16,
    /// The etcd metrics listener's port, on 127.0.0.1.
    pub etcd_port: u16,
}

/// The kubelet's stand-in hash of `component`'s manifest in `root` (16 bytes of sha256).
pub fn hash_of(root: &Path, component: &str) -> String {
    let bytes = std::fs::read(manifest(root, component)).unwrap_or_default();
    hex::encode(&Sha256::digest(&bytes)[..16])
}

/// Where `component`'s static pod manifest is in `root`.
pub fn manifest(root: &Path, component: &str) -> PathBuf {
    root.join(format!("etc/kubernetes/manifests/{component}.yaml"))
}

/// A static pod manifest of `component` at image tag `image`.
pub fn manifest_text(component: &str, image: &str) -> String {
    manifest_with(component, image, None)
}

/// [`manifest_text`], the kube-apiserver's carrying kubeadm's advertise endpoint `advertise`.
pub fn manifest_with(component: &str, image: &str, advertise: Option<&str>) -> String {
    let annotations = advertise
        .map(|a| format!("  annotations:\n    {ADVERTISE}: \"{a}\"\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {component}\n  namespace: kube-system\n\
         {annotations}spec:\n  containers:\n  - name: {component}\n    image: registry.k8s.io/{component}:{image}\n"
    )
}

impl Standins {
    /// Lays out a kubeadm control-plane node `node` in `root` (PKI, kubelet.conf, the
    /// static pod manifests at image tag `image`) and starts its API server on `ip` (the
    /// kube-apiserver manifest advertises it) and its etcd metrics listener on 127.0.0.1.
    pub fn install(root: &Path, node: &str, ip: &str, image: &str) -> Standins {
        std::fs::create_dir_all(root.join("etc/kubernetes/manifests")).unwrap();
        std::fs::create_dir_all(root.join("etc/kubernetes/pki")).unwrap();
        let api = TcpListener::bind(format!("{ip}:0")).unwrap();
        let api_port = api.local_addr().unwrap().port();
        let etcd = TcpListener::bind("127.0.0.1:0").unwrap();
        let etcd_port = etcd.local_addr().unwrap().port();
        for c in COMPONENTS {
            let advertise = (c == "kube-apiserver").then(|| format!("{ip}:{api_port}"));
            std::fs::write(
                manifest(root, c),
                manifest_with(c, image, advertise.as_deref()),
            )
            .unwrap();
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
            node.to_string(),
        ])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
        let client_key = rcgen::KeyPair::generate().unwrap();
        let mut client_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        client_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("system:node:{node}"));
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
                    .map(|c| (c.to_string(), hash_of(root, c)))
                    .collect(),
            ),
            anonymous_pod_reads: AtomicU16::new(0),
            readyz_reads: AtomicU16::new(0),
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
        {
            let behaviour = behaviour.clone();
            let root = root.to_path_buf();
            let node = node.to_owned();
            thread::spawn(move || {
                for stream in api.incoming().flatten() {
                    let (config, behaviour, root, node) = (
                        config.clone(),
                        behaviour.clone(),
                        root.clone(),
                        node.clone(),
                    );
                    thread::spawn(move || serve_api(stream, config, &behaviour, &root, &node));
                }
            });
        }
        {
            let behaviour = behaviour.clone();
            thread::spawn(move || {
                for stream in etcd.incoming().flatten() {
                    serve_etcd(stream, &behaviour);
                }
            });
        }
        Standins {
            behaviour,
            api_port,
            etcd_port,
        }
    }
}

/// The request target of an HTTP/1 request head read from `stream` (at most 16 KiB).
pub fn read_head(stream: &mut impl Read) -> Option<String> {
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
fn serve_api(
    tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
    b: &Behaviour,
    root: &Path,
    node: &str,
) {
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
        b.readyz_reads.fetch_add(1, Ordering::SeqCst);
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
            match name.strip_suffix(&format!("-{node}")).filter(|c| COMPONENTS.contains(c)) {
                Some(c) => {
                    let hash = if b.frozen.load(Ordering::SeqCst) {
                        b.initial.lock().unwrap().iter().find(|(n, _)| n == c).unwrap().1.clone()
                    } else {
                        hash_of(root, c)
                    };
                    (200, mirror_pod(c, node, &hash).to_string(), true)
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
fn mirror_pod(component: &str, node: &str, hash: &str) -> Value {
    json!({
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": format!("{component}-{node}"),
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
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": "0d4f6a8c-1b3d-4e5f-8a9b-0c1d2e3f4a5b", "controller": true}]
        },
        "spec": {
            "containers": [{"name": component, "image": format!("registry.k8s.io/{component}:v1.35.3")}],
            "nodeName": node,
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
