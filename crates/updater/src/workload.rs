//! A workload cluster, through kube-rs, for the drain ([`super::drain`]): its client is
//! built from the kubeconfig Secret Cluster API keeps for every cluster
//! (`<cluster>-kubeconfig`, key `value`, the Machine's namespace), one per cluster, and
//! built again when the Secret's content changes (rotation). The Secret is a tenant's to
//! write, so kube-rs never reads it: [`crate::edge::kubeconfig`] turns it into
//! [`WorkloadCredentials`] (a server pinned to its address, a CA, inline credentials) and
//! the client's configuration is built from those alone; what a workload API server says
//! reaches a message only as its status code, reason and a bounded, cleaned message. What the updater does there:
//! `get` and merge `patch` of the Node (cordon, uncordon, its annotations), `list` of the
//! Node's Pods (`spec.nodeName` field selector), of Namespaces and of a namespace's
//! PodDisruptionBudgets, `get` of a DaemonSet (is a Pod's owner still there), and `create`
//! of `pods/eviction` (policy/v1). Nothing else; docs/updater.md says what the kubeconfig
//! must allow.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use super::cluster::Cluster;
use super::drain::{Selector, string_map};
use crate::edge::kubeconfig::{self, LocalServers, User, WorkloadCredentials};

/// A request to a workload cluster failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("workload cluster {cluster}: {op}: {detail}")]
pub struct WorkloadError {
    /// `<namespace>/<cluster name>`.
    pub cluster: String,
    /// What was done (`get Node worker-7`, `read Secret default/c-kubeconfig`).
    pub op: String,
    /// What the API server or the connection said, and what to do.
    pub detail: String,
    /// The kubeconfig Secret does not exist (the updater cannot have touched this cluster).
    pub no_secret: bool,
}

/// The workload clusters' clients, one per cluster, keyed by the kubeconfig's digest.
#[derive(Default)]
pub struct Workloads {
    clients: Mutex<HashMap<String, ([u8; 32], kube::Client)>>,
    local: LocalServers,
}

impl std::fmt::Debug for Workloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Workloads")
    }
}

/// The name of the kubeconfig Secret of `cluster`.
pub fn kubeconfig_secret(cluster: &str) -> String {
    format!("{cluster}-kubeconfig")
}

impl Workloads {
    /// No clients yet; servers on local addresses allowed or not
    /// (`--allow-local-workload-servers`).
    pub fn new(local: LocalServers) -> Workloads {
        Workloads {
            clients: Mutex::default(),
            local,
        }
    }

    /// The client of cluster `name` in `namespace`: the Secret is read each time (one `get`)
    /// and a new client built only when its content changed.
    pub async fn client(
        &self,
        management: &Cluster,
        namespace: &str,
        name: &str,
    ) -> Result<Workload, WorkloadError> {
        let id = format!("{namespace}/{name}");
        let secret = kubeconfig_secret(name);
        let err = |op: String, detail: String, no_secret: bool| WorkloadError {
            cluster: id.clone(),
            op,
            detail,
            no_secret,
        };
        let read = format!("read Secret {namespace}/{secret}");
        let data = management
            .secret(namespace, &secret)
            .await
            .map_err(|e| err(read.clone(), e.to_string(), false))?
            .ok_or_else(|| {
                err(
                    read.clone(),
                    "it does not exist (Cluster API writes it for every cluster; without it the \
                     updater cannot cordon or drain: set settings.drain to Never to update without draining)"
                        .into(),
                    true,
                )
            })?;
        let value = data
            .get("value")
            .ok_or_else(|| err(read.clone(), "it has no key \"value\"".into(), false))?;
        let digest: [u8; 32] =
            sha2::Digest::finalize(<sha2::Sha256 as sha2::Digest>::new_with_prefix(value)).into();
        let cached = self
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .filter(|(d, _)| *d == digest)
            .map(|(_, c)| c.clone());
        let client = match cached {
            Some(c) => c,
            None => {
                let secret_id = format!("{namespace}/{secret}");
                let credentials = kubeconfig::credentials(&secret_id, value, self.local)
                    .await
                    .map_err(|e| {
                        let what = if e.refusal.transient {
                            "; asked again on the next call"
                        } else {
                            "; fix the Secret (docs/updater.md, \"Workload cluster access\", \
                             says what it may hold)"
                        };
                        err(
                            format!("read the kubeconfig in Secret {secret_id} key value"),
                            format!("{}{what}", e.refusal),
                            false,
                        )
                    })?;
                if let Some(kind) = credentials.local() {
                    tracing::warn!(cluster = %id, address = %credentials.url(),
                        "workload cluster client built for a server on a {kind} address: allowed only \
                         by --allow-local-workload-servers, which is for test rigs");
                }
                let client = build(&credentials).map_err(|e| {
                    err(
                        format!(
                            "build a client from the kubeconfig in Secret {secret_id} key value"
                        ),
                        e.into(),
                        false,
                    )
                })?;
                tracing::info!(cluster = %id, "workload cluster client built from its kubeconfig Secret");
                self.clients
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id.clone(), (digest, client.clone()));
                client
            }
        };
        Ok(Workload {
            client,
            cluster: id,
        })
    }
}

/// A client for `credentials` and nothing else: the configuration is written here field by
/// field (no kubeconfig, no environment, no proxy, no file, no plugin).
fn build(credentials: &WorkloadCredentials) -> Result<kube::Client, &'static str> {
    let mut config = kube::Config::new(credentials.url().clone());
    config.root_cert = Some(credentials.ca_der().to_vec());
    config.accept_invalid_certs = false;
    config.proxy_url = None;
    config.tls_server_name = credentials.server_name().map(str::to_owned);
    config.headers = Vec::new();
    let auth = match credentials.user() {
        User::Certificate { cert_pem, key_pem } => {
            use base64::Engine as _;
            let b64 = base64::engine::general_purpose::STANDARD;
            json!({"client-certificate-data": b64.encode(cert_pem), "client-key-data": b64.encode(key_pem)})
        }
        User::Token(token) => json!({ "token": token }),
    };
    config.auth_info = serde_json::from_value(auth)
        .map_err(|_| "the inline credentials could not be given to the client")?;
    // Each drain step runs inside one hook call (CAPI's 10 s).
    config.connect_timeout = Some(Duration::from_secs(2));
    config.read_timeout = Some(Duration::from_secs(3));
    config.write_timeout = Some(Duration::from_secs(3));
    // kube-rs's TLS takes the process's crypto provider; ring is this binary's.
    let _ = rustls::crypto::ring::default_provider().install_default();
    kube::Client::try_from(config)
        .map_err(|_| "the client certificate, key or CA was not usable for TLS")
}

/// The most bytes of an API server's message a hook message carries.
const MAX_API_MESSAGE: usize = 200;

/// What a failed request to a workload cluster says in a message: the HTTP status, reason and
/// a bounded, cleaned message of the API server, or what the connection did; never the
/// kubeconfig or anything from the credentials.
fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => {
            let reason = clean(&s.reason, 64);
            let message = clean(&s.message, MAX_API_MESSAGE);
            match (reason.is_empty(), message.is_empty()) {
                (true, true) => format!("the API server answered {}", s.code),
                (false, true) => format!("the API server answered {} {reason}", s.code),
                (true, false) => format!("the API server answered {}: {message}", s.code),
                (false, false) => format!("the API server answered {} {reason}: {message}", s.code),
            }
        }
        kube::Error::SerdeError(_) => {
            "the API server's answer is not the object asked for (is the kubeconfig's server a \
             Kubernetes API server?)"
                .into()
        }
        kube::Error::HyperError(_) | kube::Error::Service(_) => connection(e),
        _ => "the request could not be made".into(),
    }
}

/// A connection failure in words: TLS, refused, timed out, or another I/O failure; what TLS
/// said is kept (rustls's words, bounded and cleaned), nothing else.
fn connection(e: &kube::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut timed_out = false;
    while let Some(s) = source {
        if let Some(tls) = s.downcast_ref::<rustls::Error>() {
            return format!(
                "TLS with the workload API server failed ({}): does certificate-authority-data \
                 hold the CA that signed the server's certificate, for the server's host?",
                clean(&tls.to_string(), MAX_API_MESSAGE)
            );
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => {
                    return "the workload API server refused the connection".into();
                }
                std::io::ErrorKind::TimedOut => timed_out = true,
                _ => {}
            }
        }
        if s.to_string().contains("elapsed") {
            timed_out = true;
        }
        source = s.source();
    }
    if timed_out {
        "the workload API server did not answer in time".into()
    } else {
        "the connection to the workload API server failed".into()
    }
}

/// `text` with control characters dropped, at most `max` bytes (on a character boundary).
fn clean(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars().filter(|c| !c.is_control()) {
        if out.len() + c.len_utf8() > max {
            out.push('…');
            break;
        }
        out.push(c);
    }
    out
}

/// What an eviction came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evicted {
    /// Accepted: the Pod is being deleted.
    Yes,
    /// The Pod is gone already.
    Gone,
    /// 429: a PodDisruptionBudget does not allow it now (the API server's message).
    Refused(String),
}

/// One workload cluster.
#[derive(Clone)]
pub struct Workload {
    client: kube::Client,
    /// `<namespace>/<cluster name>`, for errors and logs.
    pub cluster: String,
}

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

impl Workload {
    fn err(&self, op: String, e: kube::Error) -> WorkloadError {
        WorkloadError {
            cluster: self.cluster.clone(),
            op,
            detail: describe(&e),
            no_secret: false,
        }
    }

    /// The Node as JSON, or `None` when it does not exist.
    pub async fn node(&self, name: &str) -> Result<Option<Value>, WorkloadError> {
        let api: Api<Node> = Api::all(self.client.clone());
        api.get_opt(name)
            .await
            .map(|n| n.as_ref().map(to_value))
            .map_err(|e| self.err(format!("get Node {name}"), e))
    }

    /// A JSON merge patch of the Node (cordon, uncordon, annotations).
    pub async fn patch_node(&self, name: &str, patch: &Value) -> Result<(), WorkloadError> {
        let api: Api<Node> = Api::all(self.client.clone());
        api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map(drop)
            .map_err(|e| self.err(format!("patch Node {name}"), e))
    }

    /// The Pods bound to the Node, as JSON.
    pub async fn pods_on(&self, node: &str) -> Result<Vec<Value>, WorkloadError> {
        let api: Api<Pod> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.nodeName={node}"));
        api.list(&params)
            .await
            .map(|l| l.items.iter().map(to_value).collect())
            .map_err(|e| self.err(format!("list the Pods of Node {node}"), e))
    }

    /// Every Namespace's labels.
    pub async fn namespaces(
        &self,
    ) -> Result<HashMap<String, BTreeMap<String, String>>, WorkloadError> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(|e| self.err("list Namespaces".into(), e))?;
        Ok(list
            .items
            .iter()
            .map(|n| {
                let v = to_value(n);
                (
                    n.metadata.name.clone().unwrap_or_default(),
                    string_map(v.pointer("/metadata/labels")),
                )
            })
            .collect())
    }

    /// Whether the DaemonSet exists.
    pub async fn daemon_set_exists(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<bool, WorkloadError> {
        let api: Api<DaemonSet> = Api::namespaced(self.client.clone(), namespace);
        api.get_opt(name)
            .await
            .map(|d| d.is_some())
            .map_err(|e| self.err(format!("get DaemonSet {namespace}/{name}"), e))
    }

    /// Evicts the Pod (policy/v1 Eviction).
    pub async fn evict(&self, namespace: &str, name: &str) -> Result<Evicted, WorkloadError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match api.evict(name, &EvictParams::default()).await {
            Ok(_) => Ok(Evicted::Yes),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(Evicted::Gone),
            Err(kube::Error::Api(e)) if e.code == 429 => {
                Ok(Evicted::Refused(clean(&e.message, MAX_API_MESSAGE)))
            }
            Err(e) => Err(self.err(format!("evict Pod {namespace}/{name}"), e)),
        }
    }

    /// The PodDisruptionBudgets of `namespace` that select `labels`, as `namespace/name`.
    pub async fn budgets_of(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<Vec<String>, WorkloadError> {
        let api: Api<PodDisruptionBudget> = Api::namespaced(self.client.clone(), namespace);
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(|e| self.err(format!("list PodDisruptionBudgets in {namespace}"), e))?;
        Ok(list
            .items
            .iter()
            .filter_map(|b| {
                let v = to_value(b);
                // policy/v1: an empty selector selects every Pod of the namespace.
                let selector = Selector::from_json(v.pointer("/spec/selector"), "").ok()?;
                selector.matches(labels).then(|| {
                    format!(
                        "{namespace}/{}",
                        b.metadata.name.clone().unwrap_or_default()
                    )
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::standin::{ApiStandin, node};

    /// The management stand-in holds the Secret; two workload stand-ins: a rotation of the
    /// Secret to the second is followed, an unchanged Secret keeps the client.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_kubeconfig_secret_is_read_each_time_and_a_rotation_is_followed() {
        let management = ApiStandin::start().await.unwrap();
        let (one, two) = (
            ApiStandin::start().await.unwrap(),
            ApiStandin::start().await.unwrap(),
        );
        one.put(node("n", "v1.35.1"));
        two.put(node("n", "v1.35.2"));
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        management.write_kubeconfig(&kubeconfig).unwrap();
        let cluster = Cluster::connect(Some(&kubeconfig)).await.unwrap();
        // The stand-in is on loopback.
        let workloads = Workloads::new(LocalServers::Allow);
        let version = |n: Option<Value>| {
            n.and_then(|n| n.pointer("/status/nodeInfo/kubeletVersion").cloned())
        };

        let missing = workloads
            .client(&cluster, "default", "c")
            .await
            .err()
            .unwrap();
        assert!(missing.no_secret, "{missing}");
        assert!(
            missing.to_string().contains("Secret default/c-kubeconfig"),
            "{missing}"
        );

        // Refused by default: the same Secret, a strict updater.
        management.put(one.workload_secret("default", "c"));
        let strict = Workloads::default()
            .client(&cluster, "default", "c")
            .await
            .err()
            .unwrap();
        assert!(
            strict.to_string().contains(
                "read the kubeconfig in Secret default/c-kubeconfig key value: \
                 clusters[0].cluster.server: its host is a loopback address"
            ),
            "{strict}"
        );
        assert!(!strict.no_secret);

        management.put(one.workload_secret("default", "c"));
        let w = workloads.client(&cluster, "default", "c").await.unwrap();
        assert_eq!(version(w.node("n").await.unwrap()), Some("v1.35.1".into()));
        workloads.client(&cluster, "default", "c").await.unwrap();
        management.put(two.workload_secret("default", "c"));
        let w = workloads.client(&cluster, "default", "c").await.unwrap();
        assert_eq!(version(w.node("n").await.unwrap()), Some("v1.35.2".into()));
        let secret_gets = management
            .requests()
            .iter()
            .filter(|(m, p)| m == "GET" && p == "/api/v1/namespaces/default/secrets/c-kubeconfig")
            .count();
        assert_eq!(secret_gets, 5, "read on every use");
        assert_eq!(
            workloads.clients.lock().unwrap().len(),
            1,
            "one client per cluster"
        );
    }

    /// What an API server says is kept to its status, reason and 200 cleaned bytes.
    #[test]
    fn an_api_servers_words_are_bounded_and_cleaned() {
        let e = kube::Error::Api(kube::core::ErrorResponse {
            status: "Failure".into(),
            message: format!("no\u{1b}[31m\r\nway {}", "x".repeat(500)),
            reason: "Forbidden".into(),
            code: 403,
        });
        let d = describe(&e);
        assert!(
            d.starts_with("the API server answered 403 Forbidden: no[31mway xxx"),
            "{d}"
        );
        assert!(!d.chars().any(char::is_control), "{d}");
        assert!(
            d.len() <= "the API server answered 403 Forbidden: ".len() + 200 + 3,
            "{d}"
        );
        assert_eq!(clean("é".repeat(200).as_str(), 5), "éé…");
    }
}
