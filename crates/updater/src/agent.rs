//! The agents' gRPC API, as a client: one mutual-TLS channel per (address, node), reused by
//! every call (HTTP/2 multiplexes them), verified for the node's name so a recycled address
//! cannot receive a plan meant for another node; `GetNodeInfo` answers kept for a short
//! while (they decide which change kinds and gates a plan may use, and change only when the
//! agent is upgraded or reconfigured).
//!
//! The client certificate files are re-read when they change (cert-manager rotates the
//! Secret they come from); channels made with the old certificate are dropped then.
//!
//! Which CA an agent's certificate must chain to is set per (address, node) by
//! [`Agents::trust`] before the first call ([`Trust`]): the `--agent-ca` file, or the CA of
//! the Machine's workload cluster (its `<cluster>-ca` Secret, [`super::trust`]). A channel
//! made under another CA (or an older version of the Secret) is dropped when it changes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::ClientConfig;
use tonic::transport::Channel;

use super::translate::NodeFacts;
use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::tls::{ClientTlsPaths, client_config, client_config_trusting, connect};

/// Which CA verifies an agent's certificate.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Trust {
    /// The `--agent-ca` file (one fleet CA).
    #[default]
    File,
    /// The CA of the Machine's workload cluster.
    Cluster(Arc<ClusterCa>),
}

/// A workload cluster's CA as read from its Secret.
#[derive(Debug, PartialEq, Eq)]
pub struct ClusterCa {
    /// The Cluster, `namespace/name`.
    pub cluster: String,
    /// The Secret, `namespace/name`.
    pub secret: String,
    /// The Secret's resourceVersion when read.
    pub version: String,
    /// Its `tls.crt` (PEM).
    pub pem: Vec<u8>,
}

impl Trust {
    /// Which CA, in words for a message.
    pub fn describe(&self, file: &std::path::Path) -> String {
        match self {
            Trust::File => format!("the --agent-ca file {}", file.display()),
            Trust::Cluster(ca) => format!(
                "the CA of cluster {} (Secret {}, key tls.crt)",
                ca.cluster, ca.secret
            ),
        }
    }
}

/// How long a `GetNodeInfo` answer is reused.
const FACTS_TTL: Duration = Duration::from_secs(30);

/// Deadline of one call to an agent (the hook itself must answer within 10 s).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// How often the client certificate files are looked at.
const RELOAD_CHECK: Duration = Duration::from_secs(10);

/// A call to an agent failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The agent could not be reached (connect, TLS, timeout, the node name differs).
    #[error("inplace-agent on node {node} at {target} is unreachable: {detail}")]
    Unreachable {
        /// The node.
        node: String,
        /// `https://address:port`.
        target: String,
        /// Why.
        detail: String,
    },
    /// The agent answered with a gRPC error.
    #[error("inplace-agent on node {node} refused {method}: {code:?}: {message}")]
    Refused {
        /// The node.
        node: String,
        /// `ApplyPlan`, ...
        method: &'static str,
        /// gRPC status code.
        code: tonic::Code,
        /// The agent's message (field paths, never plan content).
        message: String,
    },
}

struct Tls {
    config: Arc<ClientConfig>,
    /// Configurations trusting a cluster's CA, by Secret, with its resourceVersion.
    by_cluster: HashMap<String, (String, Arc<ClientConfig>)>,
    stamp: Vec<Option<(SystemTime, u64)>>,
    checked: Instant,
}

#[derive(Clone)]
struct Entry {
    client: NodeAgentClient<Channel>,
    facts: Option<(NodeFacts, Instant)>,
}

/// The pool of agent connections.
pub struct Agents {
    paths: ClientTlsPaths,
    tls: Mutex<Tls>,
    pool: Mutex<HashMap<(String, String), Entry>>,
    trusts: Mutex<HashMap<(String, String), Trust>>,
    /// Calls that found the agent unreachable (for the metrics).
    pub unreachable: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Agents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agents")
            .field("paths", &self.paths)
            .finish()
    }
}

fn stamp(paths: &ClientTlsPaths) -> Vec<Option<(SystemTime, u64)>> {
    [&paths.ca, &paths.cert, &paths.key]
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

impl Agents {
    /// A pool presenting the client certificate at `paths` and trusting its CA for agents.
    pub fn new(paths: ClientTlsPaths) -> Result<Agents, inplace_api::tls::TlsError> {
        let config = Arc::new(client_config(&paths)?);
        Ok(Agents {
            tls: Mutex::new(Tls {
                config,
                by_cluster: HashMap::new(),
                stamp: stamp(&paths),
                checked: Instant::now(),
            }),
            paths,
            pool: Mutex::new(HashMap::new()),
            trusts: Mutex::new(HashMap::new()),
            unreachable: Default::default(),
        })
    }

    fn lock_pool(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Entry>> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The client configuration, re-read when its files changed.
    fn config(&self) -> Arc<ClientConfig> {
        let mut tls = self.tls.lock().unwrap_or_else(|e| e.into_inner());
        if tls.checked.elapsed() >= RELOAD_CHECK {
            tls.checked = Instant::now();
            let now = stamp(&self.paths);
            if now != tls.stamp {
                match client_config(&self.paths) {
                    Ok(config) => {
                        tracing::info!("agent client certificate reloaded");
                        tls.config = Arc::new(config);
                        tls.by_cluster.clear();
                        tls.stamp = now;
                        self.lock_pool().clear();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "agent client certificate not reloaded; keeping the old one");
                    }
                }
            }
        }
        tls.config.clone()
    }

    /// Sets which CA verifies the agent at `target` for `node`; a channel made under
    /// another one is dropped.
    pub fn trust(&self, target: &str, node: &str, trust: Trust) {
        let key = (target.to_owned(), node.to_owned());
        let mut trusts = self.trusts.lock().unwrap_or_else(|e| e.into_inner());
        if trusts.get(&key).unwrap_or(&Trust::File) != &trust {
            self.lock_pool().remove(&key);
        }
        if trust == Trust::File {
            trusts.remove(&key);
        } else {
            trusts.insert(key, trust);
        }
    }

    fn trust_of(&self, target: &str, node: &str) -> Trust {
        self.trusts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(target.to_owned(), node.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// The client configuration for `trust` (built once per version of a cluster's CA).
    fn config_for(&self, trust: &Trust) -> Result<Arc<ClientConfig>, String> {
        let file = self.config();
        let Trust::Cluster(ca) = trust else {
            return Ok(file);
        };
        let mut tls = self.tls.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((version, config)) = tls.by_cluster.get(&ca.secret)
            && *version == ca.version
        {
            return Ok(config.clone());
        }
        let origin = format!("Secret {} key tls.crt", ca.secret);
        let config = client_config_trusting(&ca.pem, &origin, &self.paths.cert, &self.paths.key)
            .map(Arc::new)
            .map_err(|e| format!("the CA of cluster {}: {e}", ca.cluster))?;
        tls.by_cluster
            .insert(ca.secret.clone(), (ca.version.clone(), config.clone()));
        Ok(config)
    }

    fn unreachable(&self, node: &str, target: &str, detail: impl Into<String>) -> AgentError {
        self.unreachable
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        AgentError::Unreachable {
            node: node.to_owned(),
            target: target.to_owned(),
            detail: detail.into(),
        }
    }

    async fn entry(&self, target: &str, node: &str) -> Result<Entry, AgentError> {
        let key = (target.to_owned(), node.to_owned());
        let trust = self.trust_of(target, node);
        let config = self
            .config_for(&trust)
            .map_err(|e| self.unreachable(node, target, e))?;
        if let Some(entry) = self.lock_pool().get(&key) {
            return Ok(entry.clone());
        }
        let channel = tokio::time::timeout(CALL_TIMEOUT, connect(target, Some(node), config))
            .await
            .map_err(|_| self.unreachable(node, target, "connect timed out"))?
            .map_err(|e| {
                // The error's display is its cause chain, each cause once.
                let mut detail = e.to_string();
                if e.problem().is_some_and(|p| p.is_certificate()) {
                    detail.push_str(&format!(
                        " (verified against {})",
                        trust.describe(&self.paths.ca)
                    ));
                }
                self.unreachable(node, target, detail)
            })?;
        let entry = Entry {
            client: NodeAgentClient::new(channel),
            facts: None,
        };
        self.lock_pool().entry(key).or_insert(entry.clone());
        Ok(entry)
    }

    fn forget(&self, target: &str, node: &str) {
        self.lock_pool()
            .remove(&(target.to_owned(), node.to_owned()));
    }

    fn status_error(
        &self,
        target: &str,
        node: &str,
        method: &'static str,
        status: tonic::Status,
    ) -> AgentError {
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
                if !status.message().contains("shutting down") =>
            {
                self.forget(target, node);
                self.unreachable(node, target, format!("{method}: {}", status.message()))
            }
            code => AgentError::Refused {
                node: node.to_owned(),
                method,
                code,
                message: status.message().to_owned(),
            },
        }
    }

    /// What the agent says about itself, checked to be the node we meant.
    pub async fn facts(&self, target: &str, node: &str) -> Result<NodeFacts, AgentError> {
        let entry = self.entry(target, node).await?;
        if let Some((facts, at)) = &entry.facts
            && at.elapsed() < FACTS_TTL
        {
            return Ok(facts.clone());
        }
        let mut client = entry.client.clone();
        let mut request = tonic::Request::new(pb::GetNodeInfoRequest {});
        request.set_timeout(CALL_TIMEOUT);
        let info = client
            .get_node_info(request)
            .await
            .map_err(|s| self.status_error(target, node, "GetNodeInfo", s))?
            .into_inner();
        if !info.node_name.is_empty() && info.node_name != node {
            self.forget(target, node);
            return Err(self.unreachable(
                node,
                target,
                format!("the agent there serves node {:?}", info.node_name),
            ));
        }
        let facts = facts_from(&info, node);
        if let Some(e) = self
            .lock_pool()
            .get_mut(&(target.to_owned(), node.to_owned()))
        {
            e.facts = Some((facts.clone(), Instant::now()));
        }
        Ok(facts)
    }

    /// `CheckPlan`.
    pub async fn check(
        &self,
        target: &str,
        node: &str,
        plan: pb::Plan,
    ) -> Result<pb::CheckPlanResponse, AgentError> {
        let mut client = self.entry(target, node).await?.client;
        let mut request = tonic::Request::new(pb::CheckPlanRequest { plan: Some(plan) });
        request.set_timeout(CALL_TIMEOUT);
        client
            .check_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(target, node, "CheckPlan", s))
    }

    /// `GetPlanStatus`; `None` when the agent does not know the id.
    pub async fn status(
        &self,
        target: &str,
        node: &str,
        id: &str,
    ) -> Result<Option<pb::PlanStatus>, AgentError> {
        let mut client = self.entry(target, node).await?.client;
        let mut request = tonic::Request::new(pb::GetPlanStatusRequest { id: id.to_owned() });
        request.set_timeout(CALL_TIMEOUT);
        match client.get_plan_status(request).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(self.status_error(target, node, "GetPlanStatus", s)),
        }
    }

    /// `WatchPlan`: the plan's snapshots as the agent sends them; `None` when the agent does
    /// not know the id. Only opening the stream has a deadline; it stays open until the
    /// terminal snapshot or until it breaks.
    pub async fn watch(
        &self,
        target: &str,
        node: &str,
        id: &str,
    ) -> Result<Option<tonic::Streaming<pb::PlanStatus>>, AgentError> {
        let mut client = self.entry(target, node).await?.client;
        let request = tonic::Request::new(pb::WatchPlanRequest { id: id.to_owned() });
        match tokio::time::timeout(CALL_TIMEOUT, client.watch_plan(request)).await {
            Err(_) => {
                self.forget(target, node);
                Err(self.unreachable(node, target, "WatchPlan: timed out"))
            }
            Ok(Ok(r)) => Ok(Some(r.into_inner())),
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => Ok(None),
            Ok(Err(s)) => Err(self.status_error(target, node, "WatchPlan", s)),
        }
    }

    /// `ApplyPlan`.
    pub async fn apply(
        &self,
        target: &str,
        node: &str,
        plan: pb::Plan,
    ) -> Result<pb::ApplyPlanResponse, AgentError> {
        let mut client = self.entry(target, node).await?.client;
        let mut request = tonic::Request::new(pb::ApplyPlanRequest {
            plan: Some(plan),
            retry: false,
        });
        request.set_timeout(CALL_TIMEOUT);
        client
            .apply_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(target, node, "ApplyPlan", s))
    }

    /// `RetryPlan` of the attempt `from_attempt` that was seen to fail: a new attempt
    /// starts only while that is still the latest one, so the same request sent twice (by
    /// two replicas, or again after a restart) starts one attempt.
    pub async fn retry(
        &self,
        target: &str,
        node: &str,
        id: &str,
        from_attempt: u32,
    ) -> Result<pb::PlanStatus, AgentError> {
        let mut client = self.entry(target, node).await?.client;
        let mut request = tonic::Request::new(pb::RetryPlanRequest {
            id: id.to_owned(),
            from_attempt,
        });
        request.set_timeout(CALL_TIMEOUT);
        client
            .retry_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(target, node, "RetryPlan", s))
    }

    /// `GetDrift`: whether the node still matches the last plan that succeeded on it;
    /// `None` from an agent that predates the call.
    pub async fn drift(
        &self,
        target: &str,
        node: &str,
    ) -> Result<Option<pb::DriftStatus>, AgentError> {
        let mut client = self.entry(target, node).await?.client;
        let mut request = tonic::Request::new(pb::GetDriftRequest {});
        request.set_timeout(CALL_TIMEOUT);
        match client.get_drift(request).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(s) if s.code() == tonic::Code::Unimplemented => Ok(None),
            Err(s) => Err(self.status_error(target, node, "GetDrift", s)),
        }
    }

    /// `RepairPlan`: a new attempt of the last succeeded plan, which must be `id`.
    pub async fn repair(
        &self,
        target: &str,
        node: &str,
        id: &str,
    ) -> Result<pb::PlanStatus, AgentError> {
        let mut client = self.entry(target, node).await?.client;
        let mut request = tonic::Request::new(pb::RepairPlanRequest { id: id.to_owned() });
        request.set_timeout(CALL_TIMEOUT);
        client
            .repair_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(target, node, "RepairPlan", s))
    }

    /// Where the client certificate comes from.
    pub fn paths(&self) -> &ClientTlsPaths {
        &self.paths
    }
}

/// `GetNodeInfo` → what translation needs. An agent that predates a field reports it empty,
/// which reads as "cannot": no `unitActive` gate, no prune, no version pattern.
pub fn facts_from(info: &pb::GetNodeInfoResponse, node: &str) -> NodeFacts {
    NodeFacts {
        node_name: node.to_owned(),
        change_kinds: info.supported_change_kinds.clone(),
        check_kinds: if info.supported_check_kinds.is_empty() {
            // Agents before the field ran these three without conditions.
            vec!["httpGet".into(), "kubeletVersion".into()]
        } else {
            info.supported_check_kinds.clone()
        },
        features: info.plan_features.clone(),
        services_managed: info.services_managed,
        package_manager: info.package_manager.clone(),
        kubelet_version: info.kubelet_version.clone(),
    }
}

/// The agent client certificate paths of the `serve` flags.
pub fn paths(ca: PathBuf, cert: PathBuf, key: PathBuf) -> ClientTlsPaths {
    ClientTlsPaths { ca, cert, key }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unreachable_agent_says_each_cause_once() {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::emulate::Pki::new(dir.path()).unwrap();
        let client = pki.updater_client().unwrap();
        let agents = Agents::new(paths(pki.ca(), client.cert, client.key)).unwrap();
        // A port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let target = format!("https://127.0.0.1:{port}");
        let e = agents
            .facts(&target, "node-a")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "inplace-agent on node node-a at {target} is unreachable: "
            )),
            "{e}"
        );
        assert_eq!(
            e.to_lowercase().matches("connection refused").count(),
            1,
            "{e}"
        );
    }

    #[test]
    fn a_changed_trust_drops_the_channel_made_under_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::emulate::Pki::new(dir.path()).unwrap();
        let client = pki.updater_client().unwrap();
        let agents = Agents::new(paths(pki.ca(), client.cert, client.key)).unwrap();
        let ca = |version: &str| {
            Trust::Cluster(Arc::new(ClusterCa {
                cluster: "ns/c".into(),
                secret: "ns/c-ca".into(),
                version: version.into(),
                pem: std::fs::read(pki.ca()).unwrap(),
            }))
        };
        agents.trust("t", "n", ca("1"));
        assert_eq!(agents.trust_of("t", "n"), ca("1"));
        let one = agents.config_for(&ca("1")).unwrap();
        assert!(Arc::ptr_eq(&one, &agents.config_for(&ca("1")).unwrap()));
        assert!(!Arc::ptr_eq(&one, &agents.config_for(&ca("2")).unwrap()));
        agents.trust("t", "n", Trust::File);
        assert_eq!(agents.trust_of("t", "n"), Trust::File);
        let bad = Trust::Cluster(Arc::new(ClusterCa {
            cluster: "ns/d".into(),
            secret: "ns/d-ca".into(),
            version: "1".into(),
            pem: b"REPLACE".to_vec(),
        }));
        let e = agents.config_for(&bad).unwrap_err();
        assert!(
            e.contains("the CA of cluster ns/d") && e.contains("Secret ns/d-ca key tls.crt"),
            "{e}"
        );
    }
}
