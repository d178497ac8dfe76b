//! A workload cluster's kubeconfig is data (issue 44, crates/updater/src/edge/kubeconfig.rs),
//! end to end: the real `inplace-updater serve` binary, a real agent, and the Kubernetes API
//! stand-in, with a tenant's `<cluster>-kubeconfig` Secret read on the first UpdateMachine
//! that needs a drain. An `exec` credential plugin never runs (its marker file never
//! appears, nothing of its output reaches the answer); a `tokenFile` is never read nor its
//! token sent, not even to a server the operator allowed on loopback (the attacker's TLS
//! listener never hears from the updater); a server on loopback is refused unless the
//! updater was started with `--allow-local-workload-servers`, and the answer says so.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::support::daemon::{Daemon, Ready};
use crate::support::updater::*;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::{node, secret};

const SECRET: &str = "Secret default/capi-quickstart-kubeconfig key value";

/// A world on `subnet` with one agent whose kubelet runs v1.35.1, and the updater started
/// (with the harness's `--allow-local-workload-servers` when `allow_local`).
async fn started(subnet: u8, allow_local: bool) -> World {
    let mut w = World::new(subnet).await;
    w.add_agent("node-k", "v1.35.1");
    if allow_local {
        w.start_updater();
    } else {
        start_updater_refusing_local_servers(&mut w);
    }
    w.api.put(node("node-k", "v1.35.1"));
    w
}

/// The updater as `World::start_updater` starts it, but without
/// `--allow-local-workload-servers` (production's default).
fn start_updater_refusing_local_servers(w: &mut World) {
    let serving = w
        .pki
        .server("serving", &[SERVICE_HOST, "127.0.0.1"])
        .unwrap();
    let kubeconfig = w.dir.path().join("kubeconfig");
    w.api.write_kubeconfig(&kubeconfig).unwrap();
    let mut cmd = Command::new(UPDATER);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&serving.cert)
        .arg("--tls-key")
        .arg(&serving.key)
        .arg("--agent-ca")
        .arg(w.pki.ca())
        .arg("--agent-cert")
        .arg(&w.client_cert.cert)
        .arg("--agent-key")
        .arg(&w.client_cert.key)
        .arg("--agent-port")
        .arg(w.agent_port.to_string())
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("INPLACE_UPDATER_LOG", "debug");
    let proc = Daemon::start(cmd, Ready::Log).unwrap_or_else(|e| panic!("updater: {e}"));
    w.updater_addr = Some(proc.addr.parse().unwrap());
    w.updater = Some(proc);
}

/// Puts the cluster's kubeconfig Secret holding `kubeconfig`.
fn put_kubeconfig(w: &World, kubeconfig: &str) {
    w.api.put(secret(
        "default",
        "capi-quickstart-kubeconfig",
        &[("value", kubeconfig.as_bytes())],
    ));
}

/// A kubeconfig for `server` whose CA is `ca_pem` and whose user is `user` (YAML lines at
/// the user's indentation).
fn kubeconfig(server: &str, ca_pem: &str, user: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: w\n  cluster:\n    server: {server}\n    \
         certificate-authority-data: {ca}\nusers:\n- name: u\n  user:\n{user}contexts:\n- name: w\n  \
         context:\n    cluster: w\n    user: u\ncurrent-context: w\n"
    )
}

/// Two UpdateMachine calls for a version bump (a plan that drains): the last answer.
async fn update_twice(w: &World) -> Value {
    let mut capi = w.client();
    let files = bootstrap_spec(json!([{"path": "/etc/kubernetes/k.conf", "content": "k=1\n"}]));
    let (machine, config) = w.put_machine("md-0", 0, "v1.35.2", files);
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "30"});
    let body = update_request(&machine, Some(&config), settings);
    let mut last = Value::Null;
    for _ in 0..2 {
        let r = capi.call(Hook::UpdateMachine, &body).await.unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        last = r.json();
    }
    last
}

fn message(v: &Value) -> &str {
    v["message"].as_str().unwrap_or("")
}

/// Whether the stand-in was asked anything of the workload cluster (its Node).
fn workload_touched(w: &World) -> bool {
    w.api
        .requests()
        .iter()
        .any(|(_, path)| path.starts_with("/api/v1/nodes"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_plugin_in_the_kubeconfig_never_runs() {
    let w = started(131, true).await;
    let marker = w.dir.path().join("pwned");
    let server = format!("https://{}", w.api.addr);
    let user = format!(
        "    exec:\n      apiVersion: client.authentication.k8s.io/v1beta1\n      command: /bin/sh\n      \
         args: [\"-c\", \"touch {}; id\"]\n",
        marker.display()
    );
    put_kubeconfig(&w, &kubeconfig(&server, w.api.ca_pem(), &user));

    let v = update_twice(&w).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!marker.exists(), "the exec plugin ran\n{}", w.updater_log());
    let m = message(&v);
    assert!(m.contains(SECRET), "{v}");
    assert!(m.contains("users[0].user.exec"), "{v}");
    assert!(!m.contains("uid="), "{v}");
    assert!(
        !m.contains("/bin/sh") && !m.contains("touch"),
        "no content echoed: {v}"
    );
    assert_eq!(
        v["status"], "Success",
        "waited out (the Secret may be fixed): {v}"
    );
    assert!(!workload_touched(&w), "no request to the workload cluster");
    assert!(!w.updater_log().contains("uid="), "{}", w.updater_log());
}

/// A TLS listener on 127.0.0.1 (a certificate for 127.0.0.1 from a CA of its own) that
/// keeps every byte it is sent and counts its connections.
struct Listener {
    addr: SocketAddr,
    ca_pem: String,
    heard: Arc<Mutex<(usize, Vec<u8>)>>,
}

async fn listener(dir: &Path) -> Listener {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let pki = inplace_updater::emulate::Pki::new(&dir.join("attacker")).unwrap();
    let files = pki.server("attacker", &["127.0.0.1"]).unwrap();
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&files.key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let heard = Arc::new(Mutex::new((0, Vec::new())));
    let keep = heard.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = tcp.accept().await {
            keep.lock().unwrap().0 += 1;
            let (acceptor, keep) = (acceptor.clone(), keep.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(conn).await else {
                    return;
                };
                let mut buf = [0u8; 4096];
                while let Ok(Ok(n @ 1..)) =
                    tokio::time::timeout(Duration::from_secs(2), tls.read(&mut buf)).await
                {
                    keep.lock().unwrap().1.extend_from_slice(&buf[..n]);
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":403,"reason":"Forbidden","message":"no"}"#;
                let _ = tls
                    .write_all(
                        format!(
                            "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    Listener {
        addr,
        ca_pem: std::fs::read_to_string(pki.ca()).unwrap(),
        heard,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_is_never_read_nor_sent_even_to_an_allowed_local_server() {
    let w = started(132, true).await;
    let sentinel = "sentinel-sa-token-5f0c2a";
    let token_file = w.dir.path().join("token");
    std::fs::write(&token_file, sentinel).unwrap();
    let attacker = listener(w.dir.path()).await;
    let user = format!("    tokenFile: {}\n", token_file.display());
    put_kubeconfig(
        &w,
        &kubeconfig(
            &format!("https://{}", attacker.addr),
            &attacker.ca_pem,
            &user,
        ),
    );

    let v = update_twice(&w).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (connections, bytes) = attacker.heard.lock().unwrap().clone();
    assert!(
        !String::from_utf8_lossy(&bytes).contains(sentinel),
        "the token was sent: {}",
        String::from_utf8_lossy(&bytes)
    );
    assert_eq!(
        connections, 0,
        "the updater connected to the kubeconfig's server"
    );
    let m = message(&v);
    assert!(
        m.contains(SECRET) && m.contains("users[0].user.tokenFile"),
        "{v}"
    );
    assert!(
        !m.contains(sentinel) && !m.contains(&*token_file.to_string_lossy()),
        "{v}"
    );
    assert!(!w.updater_log().contains(sentinel));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_on_loopback_is_refused_without_the_flag() {
    let w = started(133, false).await;
    // The stand-in's own kubeconfig: https, its CA, an inline token; on 127.0.0.1.
    w.api
        .put(w.api.workload_secret("default", "capi-quickstart"));

    let v = update_twice(&w).await;
    let m = message(&v);
    assert!(m.contains(SECRET), "{v}");
    assert!(
        m.contains("clusters[0].cluster.server: its host is a loopback address"),
        "{v}"
    );
    assert!(m.contains("--allow-local-workload-servers"), "{v}");
    assert!(
        !m.contains(&w.api.addr.port().to_string()),
        "no content echoed: {v}"
    );
    assert!(!workload_touched(&w), "no request to the workload cluster");

    // The same Secret with the flag (the harness's default): the drain goes on.
    let mut w = w;
    w.updater = None;
    w.start_updater();
    let v = update_twice(&w).await;
    assert!(!message(&v).contains(SECRET), "{v}\n{}", w.updater_log());
    assert!(workload_touched(&w), "{v}\n{}", w.updater_log());
    assert!(
        w.updater_log_shows("--allow-local-workload-servers"),
        "the flag is loud in the log"
    );
}
