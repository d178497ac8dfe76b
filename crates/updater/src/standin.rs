//! A STAND-IN for the Kubernetes API server: the few paths the updater reads (`get` of a
//! Machine with status, a KubeadmConfig, a Secret), serving the objects' real JSON shapes
//! and the API server's `Status` object for errors, over plain HTTP/1.1 on loopback. It is
//! not a Kubernetes API server (no auth, no watch, no list, no resourceVersion semantics):
//! no kube-apiserver can be installed on the machines this project is built and tested on,
//! so the tests, the demo and the benchmark run the updater's real kube-rs client against
//! this. Every request is recorded, so tests can assert the updater only ever `get`s by
//! name (never lists or watches Secrets).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// The stand-in's objects and request log.
#[derive(Debug, Default)]
pub struct Store {
    objects: BTreeMap<String, Value>,
    requests: Vec<(String, String)>,
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
                        async move { Ok::<_, std::convert::Infallible>(handle(&store, &req)) }
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

    /// Stores (or replaces) an object; Secrets are given with `stringData` or `data`.
    pub fn put(&self, object: Value) {
        let Some(path) = object_path(&object) else {
            panic!("stand-in object without apiVersion/kind/metadata.namespace/name");
        };
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

fn handle(store: &Mutex<Store>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let full = req
        .uri()
        .path_and_query()
        .map_or(path.clone(), |p| p.to_string());
    let mut store = store.lock().unwrap_or_else(|e| e.into_inner());
    store.requests.push((req.method().to_string(), full));
    if req.method() != Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!(
                "the stand-in serves only get; {} {path} is not served",
                req.method()
            ),
        );
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    // .../namespaces/<ns>/<plural>/<name> : a get; anything shorter is a list or watch.
    let ns_at = segments.iter().position(|s| *s == "namespaces");
    let named = ns_at.is_some_and(|i| segments.len() == i + 4);
    if !named || req.uri().query().is_some_and(|q| q.contains("watch")) {
        return status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!(
                "list and watch are forbidden here (the updater's RBAC allows get only): {path}"
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
