//! A STAND-IN for the Kubernetes API server: the few paths the updater uses (`get` of any
//! object it holds — a Machine with status, a KubeadmConfig, a Secret, a MachineSet, a
//! MachineDeployment, a KubeadmControlPlane, a KubeadmConfigTemplate, an Event; `list` of
//! Machines and MachineSets by label selector, and of Events; `create` of a `v1` Event, 409
//! AlreadyExists for a name taken; a JSON merge `patch` of a Machine or an Event), serving the objects'
//! real JSON shapes and the API server's `Status` object for errors, over HTTP/1.1 on
//! loopback (plain, or HTTPS on the same port with a certificate from a CA of its own, as
//! a workload cluster's kubeconfig must be https; its certificate also names `kubernetes` and
//! `/readyz` answers ok, so the demo's control-plane node can use it as its local API server). For the drain it also serves a workload cluster's paths (one stand-in may be
//! both clusters): cluster-scoped Nodes (`get`, merge `patch`: cordon), `list` of Pods
//! (with the `spec.nodeName` field selector), Namespaces, PodDisruptionBudgets and
//! MachineDrainRules (and the management cluster's Machines, by equality label selector), `get` of DaemonSets, and the `pods/eviction` subresource with
//! policy/v1 semantics: 429 TooManyRequests (the API server's message and
//! `DisruptionBudget` cause) while a matching budget's `status.disruptionsAllowed` is 0, 500
//! when two budgets match; otherwise the budget's allowance drops by one and the Pod is
//! removed at once (there is no kubelet to wait for). It is not a Kubernetes API server (no
//! auth, no watch, lists only of those kinds, no validation, resourceVersion only counted): no kube-apiserver can be installed on the machines this
//! project is built and tested on, so the tests, the demo and the benchmark run the
//! updater's real kube-rs client against this. Every request is recorded, so tests can
//! assert the updater only ever `get`s by name (never lists or watches Secrets) and writes
//! only what it should.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// The stand-in's objects and request log.
#[derive(Debug, Default)]
pub struct Store {
    objects: BTreeMap<String, Value>,
    requests: Vec<(String, String)>,
    /// The paths of the Events created, in order.
    events: Vec<String>,
    /// The last resourceVersion handed out.
    version: u64,
    /// Reads answered `503 ServiceUnavailable`, as an API server does while it cannot
    /// serve (its etcd has no leader, it is shutting down): (part of the path, how many more).
    unavailable: Vec<(String, usize)>,
}

/// A running stand-in.
#[derive(Debug, Clone)]
pub struct ApiStandin {
    /// Where it listens (`http://` or `https://` + this).
    pub addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    ca_pem: Arc<String>,
}

/// Serves one connection (plain or TLS) until it closes.
async fn serve<I>(io: I, store: Arc<Mutex<Store>>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let store = store.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let content_type = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            Ok::<_, std::convert::Infallible>(handle(
                &store,
                &parts.method,
                &parts.uri,
                content_type,
                &body,
            ))
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(io, service)
        .await;
}

/// A CA of the stand-in's own (its PEM) and a rustls server configuration with a
/// certificate it signed for `127.0.0.1` and `localhost` (HTTP/1.1).
fn serving_tls() -> anyhow::Result<(String, rustls::ServerConfig)> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "api stand-in CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_pem = ca.self_signed(&ca_key)?.pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    // `kubernetes`: the name the agent's `controlPlane` gate verifies an API server under
    // (the demo's control-plane node uses this stand-in as its local API server).
    let mut leaf = CertificateParams::new(vec![
        "127.0.0.1".to_owned(),
        "localhost".to_owned(),
        "kubernetes".to_owned(),
    ])?;
    leaf.distinguished_name
        .push(DnType::CommonName, "api stand-in");
    leaf.is_ca = IsCa::ExplicitNoCa;
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.use_authority_key_identifier_extension = true;
    let cert = leaf.signed_by(&key, &issuer)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((ca_pem, config))
}

/// Kinds without a namespace (the stand-in serves the first three; the RBAC and cert-manager
/// ones are stored for the tests that install the kustomizations into it).
const CLUSTER_SCOPED: [&str; 6] = [
    "Node",
    "Namespace",
    "ExtensionConfig",
    "ClusterRole",
    "ClusterRoleBinding",
    "ClusterIssuer",
];

/// Their plurals.
const CLUSTER_SCOPED_PLURALS: [&str; 6] = [
    "nodes",
    "namespaces",
    "extensionconfigs",
    "clusterroles",
    "clusterrolebindings",
    "clusterissuers",
];

/// Plurals the stand-in lists (the drain's, Machines for `CanUpdateMachineSet`, MachineSets
/// for `explain`, Events as `kubectl describe` lists them; Secrets and everything else are
/// never listed).
const LISTED: [&str; 8] = [
    "machines",
    "machinesets",
    "events",
    "pods",
    "namespaces",
    "poddisruptionbudgets",
    "machinedrainrules",
    "nodes",
];

/// The API path of an object (`/apis/<group>/<version>/namespaces/<ns>/<plural>/<name>`).
pub fn object_path(object: &Value) -> Option<String> {
    let api_version = object.get("apiVersion")?.as_str()?;
    let kind = object.get("kind")?.as_str()?;
    let meta = object.get("metadata")?;
    let name = meta.get("name")?.as_str()?;
    let plural = format!("{}s", kind.to_ascii_lowercase());
    if CLUSTER_SCOPED.contains(&kind) {
        let api = if api_version.contains('/') {
            "apis"
        } else {
            "api"
        };
        return Some(format!("/{api}/{api_version}/{plural}/{name}"));
    }
    let ns = meta.get("namespace")?.as_str()?;
    Some(if api_version.contains('/') {
        format!("/apis/{api_version}/namespaces/{ns}/{plural}/{name}")
    } else {
        format!("/api/{api_version}/namespaces/{ns}/{plural}/{name}")
    })
}

fn status(code: StatusCode, reason: &str, message: String) -> Response<Full<Bytes>> {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

impl ApiStandin {
    /// Starts serving on 127.0.0.1 (a free port) on the current Tokio runtime: plain HTTP,
    /// and HTTPS on the same port (a connection whose first byte opens a TLS handshake) with
    /// a certificate for `127.0.0.1` and `localhost` from a CA of its own ([`Self::ca_pem`]).
    pub async fn start() -> std::io::Result<ApiStandin> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (ca_pem, tls) = serving_tls().map_err(std::io::Error::other)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let store = Arc::new(Mutex::new(Store::default()));
        let shared = store.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let store = shared.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let mut first = [0u8; 1];
                    // 0x16: a TLS record of type handshake (RFC 8446 §5.1).
                    if matches!(tcp.peek(&mut first).await, Ok(1)) && first[0] == 0x16 {
                        if let Ok(tls) = acceptor.accept(tcp).await {
                            serve(TokioIo::new(tls), store).await;
                        }
                    } else {
                        serve(TokioIo::new(tcp), store).await;
                    }
                });
            }
        });
        Ok(ApiStandin {
            addr,
            store,
            ca_pem: Arc::new(ca_pem),
        })
    }

    /// The PEM of the CA that signed the stand-in's HTTPS certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next `times` reads (get or list) whose path and query contain `part` are
    /// answered `503 ServiceUnavailable`, as a real API server answers while it cannot serve.
    pub fn unavailable_for(&self, part: &str, times: usize) {
        self.lock().unavailable.push((part.to_owned(), times));
    }

    /// Stores (or replaces) an object; Secrets are given with `stringData` or `data`. An
    /// object without `metadata.uid` gets one from its path, as the API server gives every
    /// object a uid (the same path, the same uid).
    pub fn put(&self, mut object: Value) {
        let Some(path) = object_path(&object) else {
            panic!("stand-in object without apiVersion/kind/metadata.namespace/name");
        };
        if object["metadata"].get("uid").is_none() {
            use sha2::Digest as _;
            let hash = hex::encode(sha2::Sha256::digest(path.as_bytes()));
            object["metadata"]["uid"] = json!(format!(
                "{}-{}-{}-{}-{}",
                &hash[..8],
                &hash[8..12],
                &hash[12..16],
                &hash[16..20],
                &hash[20..32]
            ));
        }
        self.lock().objects.insert(path, object);
    }

    /// Removes an object.
    pub fn delete(&self, object_path: &str) {
        self.lock().objects.remove(object_path);
    }

    /// An object as stored.
    pub fn get(&self, object_path: &str) -> Option<Value> {
        self.lock().objects.get(object_path).cloned()
    }

    /// Changes a stored object in place.
    pub fn edit(&self, object_path: &str, f: impl FnOnce(&mut Value)) {
        if let Some(o) = self.lock().objects.get_mut(object_path) {
            f(o);
        }
    }

    /// The Events created so far, in order, as stored now (with `metadata.uid`,
    /// `creationTimestamp` and `resourceVersion` set, and the patches since applied).
    pub fn events(&self) -> Vec<Value> {
        let store = self.lock();
        store
            .events
            .iter()
            .filter_map(|p| store.objects.get(p).cloned())
            .collect()
    }

    /// Every request so far as (method, path with query).
    pub fn requests(&self) -> Vec<(String, String)> {
        self.lock().requests.clone()
    }

    /// A kubeconfig file pointing at the stand-in.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig())
    }

    /// A kubeconfig pointing at the stand-in over plain HTTP (the text of the file; the
    /// management cluster's, given to the updater with `--kubeconfig`).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: http://{addr}\n\
             users:\n- name: updater\n  user:\n    token: standin-token\ncontexts:\n- name: standin\n  context:\n    \
             cluster: standin\n    user: updater\ncurrent-context: standin\n",
            addr = self.addr
        )
    }

    /// A kubeconfig as Cluster API writes one for a workload cluster, pointing at the
    /// stand-in over HTTPS: the server, its CA as `certificate-authority-data` and an inline
    /// token, nothing else (the only shape the updater accepts besides an inline client
    /// certificate; `crate::edge::kubeconfig`). The updater must be started with
    /// `--allow-local-workload-servers` to use it, as it is on loopback.
    pub fn workload_kubeconfig(&self) -> String {
        use base64::Engine as _;
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: workload\n  cluster:\n    server: https://{addr}\n    \
             certificate-authority-data: {ca}\nusers:\n- name: workload-admin\n  user:\n    token: standin-token\n\
             contexts:\n- name: workload-admin@workload\n  context:\n    cluster: workload\n    user: workload-admin\n\
             current-context: workload-admin@workload\n",
            addr = self.addr,
            ca = base64::engine::general_purpose::STANDARD.encode(self.ca_pem.as_bytes()),
        )
    }

    /// The `<cluster>-kubeconfig` Secret Cluster API keeps for a cluster, pointing at this
    /// stand-in over HTTPS ([`Self::workload_kubeconfig`]; the stand-in then serves as the
    /// workload cluster too).
    pub fn workload_secret(&self, namespace: &str, cluster: &str) -> Value {
        secret(
            namespace,
            &format!("{cluster}-kubeconfig"),
            &[("value", self.workload_kubeconfig().as_bytes())],
        )
    }
}

fn json_response(code: StatusCode, object: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(object.to_string())))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(fields) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(t) = target {
        for (k, v) in fields {
            if v.is_null() {
                t.remove(k);
            } else {
                merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// `%XX` and `+` of a query value, decoded.
fn query_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Store {
    /// GET of a collection: the objects under `prefix` (`api/v1`, `apis/<group>/<version>`)
    /// of `plural`, in `namespace` or all; `fieldSelector=spec.nodeName=<node>` for Pods,
    /// `labelSelector=k=v,k,...` (equality, and `k` for "has the label") for any kind.
    fn list(
        &self,
        prefix: &[&str],
        namespace: Option<&str>,
        plural: &str,
        query: Option<&str>,
    ) -> Response<Full<Bytes>> {
        let parameter = |name: &str| {
            query.and_then(|q| {
                q.split('&')
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                    .map(query_decode)
            })
        };
        let fields = parameter("fieldSelector").unwrap_or_default();
        let node = fields.strip_prefix("spec.nodeName=").map(str::to_owned);
        // `involvedObject.<key>=<value>`, as `kubectl describe` selects an object's Events.
        let involved: Vec<(String, String)> = fields
            .split(',')
            .filter_map(|kv| kv.strip_prefix("involvedObject.")?.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let labels = parameter("labelSelector").unwrap_or_default();
        // `k=v` wants that value; a bare `k` wants the label with any value.
        let wanted: Vec<(&str, Option<&str>)> = labels
            .split(',')
            .filter(|kv| !kv.is_empty())
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (kv, None),
            })
            .collect();
        let base = format!("/{}/", prefix.join("/"));
        let items: Vec<Value> = self
            .objects
            .iter()
            .filter(|(path, _)| {
                let Some(rest) = path.strip_prefix(&base) else {
                    return false;
                };
                let parts: Vec<&str> = rest.split('/').collect();
                match (namespace, parts.as_slice()) {
                    (None, [p, _]) => *p == plural,
                    (None, ["namespaces", _, p, _]) => *p == plural,
                    (Some(ns), ["namespaces", n, p, _]) => *n == ns && *p == plural,
                    _ => false,
                }
            })
            .map(|(_, o)| o)
            .filter(|o| {
                node.as_deref()
                    .is_none_or(|n| o.pointer("/spec/nodeName").and_then(Value::as_str) == Some(n))
            })
            .filter(|o| {
                involved.iter().all(|(k, v)| {
                    o.get("involvedObject")
                        .and_then(|i| i.get(k))
                        .and_then(Value::as_str)
                        == Some(v.as_str())
                })
            })
            .filter(|o| {
                wanted.iter().all(|(k, v)| {
                    let label = o
                        .pointer("/metadata/labels")
                        .and_then(|l| l.get(*k))
                        .and_then(Value::as_str);
                    match v {
                        Some(v) => label == Some(*v),
                        None => label.is_some(),
                    }
                })
            })
            .cloned()
            .collect();
        // `limit`: the first that many, and a `continue` token when more match (the API
        // server's chunking; the stand-in serves no second chunk).
        let mut items = items;
        let mut more = None;
        if let Some(limit) = parameter("limit").and_then(|l| l.parse::<usize>().ok())
            && limit > 0
            && items.len() > limit
        {
            items.truncate(limit);
            more = Some("stand-in-continue");
        }
        let kind = items
            .first()
            .and_then(|o| o.get("kind"))
            .and_then(Value::as_str)
            .map_or_else(|| "List".to_owned(), |k| format!("{k}List"));
        json_response(
            StatusCode::OK,
            &json!({
                "kind": kind,
                "apiVersion": prefix[1..].join("/"),
                "metadata": match more {
                    Some(token) => json!({"resourceVersion": self.version.to_string(), "continue": token}),
                    None => json!({"resourceVersion": self.version.to_string()}),
                },
                "items": items,
            }),
        )
    }

    /// POST of `pods/<name>/eviction`: policy/v1 semantics with the budgets stored under
    /// `/apis/policy/v1/namespaces/<ns>/poddisruptionbudgets/`.
    fn evict(&mut self, ns: &str, name: &str) -> Response<Full<Bytes>> {
        let pod_path = format!("/api/v1/namespaces/{ns}/pods/{name}");
        let Some(pod) = self.objects.get(&pod_path) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("pods \"{name}\" not found"),
            );
        };
        let labels = super::drain::string_map(pod.pointer("/metadata/labels"));
        let prefix = format!("/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/");
        let budgets: Vec<String> = self
            .objects
            .iter()
            .filter(|(p, _)| p.starts_with(&prefix))
            .filter(|(_, b)| {
                super::drain::Selector::from_json(b.pointer("/spec/selector"), "")
                    .is_ok_and(|s| s.matches(&labels))
            })
            .map(|(p, _)| p.clone())
            .collect();
        if budgets.len() > 1 {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
                    .into(),
            );
        }
        if let Some(path) = budgets.first() {
            let budget = &self.objects[path];
            let allowed = budget
                .pointer("/status/disruptionsAllowed")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if allowed <= 0 {
                let pdb = budget
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let healthy = budget
                    .pointer("/status/currentHealthy")
                    .and_then(Value::as_i64)
                    .unwrap_or(0);
                let desired = budget
                    .pointer("/status/desiredHealthy")
                    .and_then(Value::as_i64)
                    .unwrap_or(0);
                let body = json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "Cannot evict pod as it would violate the pod's disruption budget.",
                    "reason": "TooManyRequests",
                    "details": {"causes": [{"reason": "DisruptionBudget",
                        "message": format!("The disruption budget {pdb} needs {desired} healthy pods and has {healthy} currently")}]},
                    "code": 429,
                });
                return json_response(StatusCode::TOO_MANY_REQUESTS, &body);
            }
            let version = self.next_version();
            if let Some(b) = self.objects.get_mut(path) {
                b["status"]["disruptionsAllowed"] = json!(allowed - 1);
                b["metadata"]["resourceVersion"] = json!(version);
            }
        }
        self.objects.remove(&pod_path);
        json_response(
            StatusCode::CREATED,
            &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
        )
    }

    fn next_version(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }

    /// POST .../namespaces/<ns>/events: stored under its name, 409 when taken.
    fn create_event(&mut self, path: &str, ns: &str, body: &[u8]) -> Response<Full<Bytes>> {
        let mut event: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => {
                return status(StatusCode::BAD_REQUEST, "BadRequest", format!("{e}"));
            }
        };
        let name = event["metadata"]["name"].as_str().unwrap_or("").to_owned();
        if name.is_empty() || event["metadata"]["namespace"].as_str().unwrap_or(ns) != ns {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name: required, metadata.namespace: must be the path's".into(),
            );
        }
        let at = format!("{path}/{name}");
        if self.objects.contains_key(&at) {
            let mut r = status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("events \"{name}\" already exists"),
            );
            let body = json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("events \"{name}\" already exists"), "reason": "AlreadyExists",
                "details": {"name": name, "kind": "events"}, "code": 409,
            });
            *r.body_mut() = Full::new(Bytes::from(body.to_string()));
            return r;
        }
        let version = self.next_version();
        let meta = &mut event["metadata"];
        meta["namespace"] = json!(ns);
        meta["uid"] = json!(format!("standin-event-{version}"));
        meta["resourceVersion"] = json!(version);
        meta["creationTimestamp"] = json!("2025-01-01T00:00:00Z");
        self.objects.insert(at.clone(), event.clone());
        self.events.push(at);
        json_response(StatusCode::CREATED, &event)
    }

    /// PATCH of a stored object with a JSON merge patch.
    fn patch(&mut self, path: &str, content_type: &str, body: &[u8]) -> Response<Full<Bytes>> {
        if content_type != "application/merge-patch+json" {
            return status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                format!("the stand-in takes only JSON merge patches, not {content_type:?}"),
            );
        }
        let patch: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", format!("{e}")),
        };
        let version = self.next_version();
        let Some(object) = self.objects.get_mut(path) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("{path} not found"),
            );
        };
        merge(object, &patch);
        object["metadata"]["resourceVersion"] = json!(version);
        json_response(StatusCode::OK, object)
    }
}

fn handle(
    store: &Mutex<Store>,
    method: &Method,
    uri: &http::Uri,
    content_type: &str,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let path = uri.path().to_owned();
    let full = uri.path_and_query().map_or(path.clone(), |p| p.to_string());
    let mut store = store.lock().unwrap_or_else(|e| e.into_inner());
    store.requests.push((method.to_string(), full.clone()));
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    // GET /readyz: always ready (the demo's control-plane gate reads it).
    if method == Method::GET && path == "/readyz" {
        return Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from_static(b"ok")))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())));
    }
    // POST /api/v1/namespaces/<ns>/events
    if method == Method::POST
        && segments.len() == 5
        && segments[..3] == ["api", "v1", "namespaces"]
        && segments[4] == "events"
    {
        let ns = segments[3].to_owned();
        return store.create_event(&path, &ns, body);
    }
    // POST /api/v1/namespaces/<ns>/pods/<name>/eviction
    if method == Method::POST
        && segments.len() == 7
        && segments[..3] == ["api", "v1", "namespaces"]
        && segments[4] == "pods"
        && segments[6] == "eviction"
    {
        let (ns, name) = (segments[3].to_owned(), segments[5].to_owned());
        return store.evict(&ns, &name);
    }
    // PATCH of a Machine (annotations), a Node (cordon) or an Event (its count, as
    // client-go's event correlator bumps it).
    if method == Method::PATCH
        && (segments.get(1) == Some(&"cluster.x-k8s.io")
            || (segments.len() == 4 && segments[..3] == ["api", "v1", "nodes"])
            || (segments.len() == 6
                && segments[..3] == ["api", "v1", "namespaces"]
                && segments[4] == "events"))
    {
        return store.patch(&path, content_type, body);
    }
    if method == Method::GET
        && let Some(fault) = store
            .unavailable
            .iter_mut()
            .find(|(part, left)| *left > 0 && full.contains(part.as_str()))
    {
        fault.1 -= 1;
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the stand-in was told to be unavailable for this read".to_owned(),
        );
    }
    if method != Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!(
                "the stand-in serves only get, create of events and evictions, patch of machines, nodes and events; {method} {path} is not served"
            ),
        );
    }
    if uri.query().is_some_and(|q| q.contains("watch")) {
        return status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("watch is forbidden here: {path}"),
        );
    }
    if let Some(object) = store.objects.get(&path) {
        return json_response(StatusCode::OK, object);
    }
    // A list: /api/v1/<plural>, /api(s)/<gv>/<plural>, or .../namespaces/<ns>/<plural>.
    let version_at = if segments.first() == Some(&"api") {
        2
    } else {
        3
    };
    let rest = segments.get(version_at..).unwrap_or_default();
    let (list_ns, plural) = match rest {
        [plural] => (None, *plural),
        ["namespaces", ns, plural] => (Some(*ns), *plural),
        _ => (None, ""),
    };
    if LISTED.contains(&plural) {
        return store.list(&segments[..version_at], list_ns, plural, uri.query());
    }
    // .../namespaces/<ns>/<plural>/<name> : a get; anything shorter is a list.
    let ns_at = segments.iter().position(|s| *s == "namespaces");
    let named = ns_at.is_some_and(|i| segments.len() == i + 4)
        || (segments.len() == version_at + 2
            && CLUSTER_SCOPED_PLURALS.contains(&segments[version_at]));
    if !named {
        return status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!(
                "this list is forbidden here (the updater's RBAC allows get, and list only of the drain's kinds and of Machines by selector): {path}"
            ),
        );
    }
    let plural = segments[segments.len() - 2];
    let name = segments[segments.len() - 1];
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{plural} {name:?} not found"),
    )
}

/// A Secret object for the stand-in.
pub fn secret(namespace: &str, name: &str, data: &[(&str, &[u8])]) -> Value {
    use base64::Engine as _;
    let data: serde_json::Map<String, Value> = data
        .iter()
        .map(|(k, v)| {
            (
                (*k).to_owned(),
                json!(base64::engine::general_purpose::STANDARD.encode(v)),
            )
        })
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "type": "Opaque",
        "data": data,
    })
}

/// A workload cluster's Node for the stand-in, schedulable, whose kubelet reports
/// `kubelet_version`.
pub fn node(name: &str, kubelet_version: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {},
        "status": {"nodeInfo": {"kubeletVersion": kubelet_version}},
    })
}

/// A running Pod bound to `node`; `owner` is its controller (kind, name), if any.
pub fn pod(
    namespace: &str,
    name: &str,
    node: &str,
    owner: Option<(&str, &str)>,
    labels: Value,
) -> Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]},
        "status": {"phase": "Running"},
    });
    if let Some((kind, owner)) = owner {
        let api_version = if kind == "DaemonSet" || kind == "ReplicaSet" || kind == "StatefulSet" {
            "apps/v1"
        } else {
            "batch/v1"
        };
        pod["metadata"]["ownerReferences"] = json!([{"apiVersion": api_version, "kind": kind,
            "name": owner, "uid": format!("uid-{owner}"), "controller": true, "blockOwnerDeletion": true}]);
    }
    pod
}

/// A policy/v1 PodDisruptionBudget selecting `match_labels`, with `allowed` disruptions
/// left (`status.disruptionsAllowed`, which the stand-in's evictions spend).
pub fn pdb(namespace: &str, name: &str, match_labels: Value, allowed: i64) -> Value {
    json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": match_labels}},
        "status": {"disruptionsAllowed": allowed, "currentHealthy": 1, "desiredHealthy": 1,
                   "expectedPods": 1, "observedGeneration": 1},
    })
}

/// A Namespace with labels.
pub fn namespace(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// An ExtensionConfig of the updater (cluster-scoped) with these `settings` (strings) and
/// `spec.namespaceSelector` (`null`: every namespace), as an administrator registers it.
pub fn extension_config(name: &str, settings: Value, namespace_selector: Value) -> Value {
    let mut spec = serde_json::json!({
        "clientConfig": {"service": {"name": "inplace-updater", "namespace": "inplace-system", "port": 443}},
        "settings": settings,
    });
    if !namespace_selector.is_null() {
        spec["namespaceSelector"] = namespace_selector;
    }
    serde_json::json!({
        "apiVersion": "runtime.cluster.x-k8s.io/v1beta2",
        "kind": "ExtensionConfig",
        "metadata": {"name": name},
        "spec": spec,
    })
}
