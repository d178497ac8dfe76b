//! A STAND-IN for the Kubernetes API server: the few paths the updater uses (`get` of a
//! Machine with status, a KubeadmConfig, a Secret; `list` of Machines by label selector;
//! `create` of a `v1` Event, 409 AlreadyExists for a name taken; a JSON merge `patch` of a
//! Machine), serving the objects' real JSON shapes and the API server's `Status` object for
//! errors, over plain HTTP/1.1 on loopback. It is not a Kubernetes API server (no auth, no
//! watch, no list but of Machines by equality label selector, no validation,
//! resourceVersion only counted): no kube-apiserver can be installed on the machines this
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
    /// Created Events, in order.
    events: Vec<Value>,
    /// The last resourceVersion handed out.
    version: u64,
}

/// A running stand-in.
#[derive(Debug, Clone)]
pub struct ApiStandin {
    /// Where it listens (`http://` + this).
    pub addr: SocketAddr,
    store: Arc<Mutex<Store>>,
}

/// The API path of an object (`/apis/<group>/<version>/namespaces/<ns>/<plural>/<name>`).
pub fn object_path(object: &Value) -> Option<String> {
    let api_version = object.get("apiVersion")?.as_str()?;
    let kind = object.get("kind")?.as_str()?;
    let meta = object.get("metadata")?;
    let ns = meta.get("namespace")?.as_str()?;
    let name = meta.get("name")?.as_str()?;
    let plural = format!("{}s", kind.to_ascii_lowercase());
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
    /// Starts serving on 127.0.0.1 (a free port) on the current Tokio runtime.
    pub async fn start() -> std::io::Result<ApiStandin> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let store = Arc::new(Mutex::new(Store::default()));
        let shared = store.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let store = shared.clone();
                tokio::spawn(async move {
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
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        Ok(ApiStandin { addr, store })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
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

    /// The Events created so far, in order, as stored (with `metadata.uid`,
    /// `creationTimestamp` and `resourceVersion` set).
    pub fn events(&self) -> Vec<Value> {
        self.lock().events.clone()
    }

    /// Every request so far as (method, path with query).
    pub fn requests(&self) -> Vec<(String, String)> {
        self.lock().requests.clone()
    }

    /// A kubeconfig file pointing at the stand-in.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: http://{addr}\n\
             users:\n- name: updater\n  user:\n    token: standin-token\ncontexts:\n- name: standin\n  context:\n    \
             cluster: standin\n    user: updater\ncurrent-context: standin\n",
            addr = self.addr
        );
        std::fs::write(path, text)
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
    /// GET .../namespaces/<ns>/machines?labelSelector=k=v,...: the Machines of the namespace
    /// with all those labels, as a `MachineList` (equality selectors only; the only list
    /// the stand-in serves). `None` for any other request.
    fn list_machines(
        &self,
        segments: &[&str],
        ns_at: Option<usize>,
        query: Option<&str>,
    ) -> Option<Response<Full<Bytes>>> {
        let i = ns_at?;
        if segments.len() != i + 3 || segments[i + 2] != "machines" {
            return None;
        }
        let query = query.unwrap_or_default();
        if query.contains("watch") {
            return None;
        }
        let selector = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("labelSelector="))
            .map(query_decode)?;
        let wanted: Vec<(&str, &str)> = selector
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let prefix = format!("/{}/", segments.join("/"));
        let items: Vec<Value> = self
            .objects
            .iter()
            .filter(|(path, _)| path.starts_with(&prefix))
            .filter(|(_, o)| {
                wanted.iter().all(|(k, v)| {
                    o["metadata"]["labels"].get(*k).and_then(Value::as_str) == Some(*v)
                })
            })
            .map(|(_, o)| o.clone())
            .collect();
        Some(json_response(
            StatusCode::OK,
            &json!({
                "kind": "MachineList",
                "apiVersion": format!("{}/{}", segments[1], segments[2]),
                "metadata": {"resourceVersion": self.version.to_string()},
                "items": items,
            }),
        ))
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
        self.objects.insert(at, event.clone());
        self.events.push(event.clone());
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
    store.requests.push((method.to_string(), full));
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    // POST /api/v1/namespaces/<ns>/events
    if method == Method::POST
        && segments.len() == 5
        && segments[..3] == ["api", "v1", "namespaces"]
        && segments[4] == "events"
    {
        let ns = segments[3].to_owned();
        return store.create_event(&path, &ns, body);
    }
    if method == Method::PATCH && segments.get(1) == Some(&"cluster.x-k8s.io") {
        return store.patch(&path, content_type, body);
    }
    if method != Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!(
                "the stand-in serves only get, create of events and patch of machines; {method} {path} is not served"
            ),
        );
    }
    // .../namespaces/<ns>/<plural>/<name> : a get; anything shorter is a list or watch.
    let ns_at = segments.iter().position(|s| *s == "namespaces");
    if let Some(list) = store.list_machines(&segments, ns_at, uri.query()) {
        return list;
    }
    let named = ns_at.is_some_and(|i| segments.len() == i + 4);
    if !named || uri.query().is_some_and(|q| q.contains("watch")) {
        return status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!(
                "list (but of machines by labelSelector) and watch are forbidden here (the updater's RBAC allows get only): {path}"
            ),
        );
    }
    match store.objects.get(&path) {
        Some(object) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(object.to_string())))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))),
        None => {
            let plural = segments[segments.len() - 2];
            let name = segments[segments.len() - 1];
            status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("{plural} {name:?} not found"),
            )
        }
    }
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
