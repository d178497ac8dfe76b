//! The agents' gRPC API, as a client: one mutual-TLS channel per (address, node, trust),
//! reused by every call made under the same trust (HTTP/2 multiplexes them), verified for
//! the node's name so a recycled address cannot receive a plan meant for another node;
//! `GetNodeInfo` answers kept for a short while (they decide which change kinds and gates a
//! plan may use, and change only when the agent is upgraded or reconfigured).
//!
//! Every call takes a [`Peer`], which only the edge builds from the live Machine and the
//! effective settings ([`crate::edge::agent_ca`]): where the agent is, the node it must be,
//! and how its certificate is verified — the `--agent-ca` file plus the URI SAN of the
//! Machine's cluster, or the cluster's own proven CA. The trust is part of the channel's
//! key (the CA's fingerprint and the required identity), so no call changes what another
//! call trusts: two calls for the same address under different trust use two channels.
//! Channels not used for [`CHANNEL_IDLE`] are dropped, and the pool holds at most
//! [`MAX_CHANNELS`] (the least recently used go first), so channels made under a CA that
//! is no longer used do not pile up.
//!
//! The client certificate files are re-read when they change (cert-manager rotates the
//! Secret they come from); channels made with the old certificate are dropped then.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::ClientConfig;
use tonic::transport::Channel;

use super::edge::agent_ca::{Peer, Trust};
use super::translate::NodeFacts;
use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::tls::{
    ClientTlsPaths, client_config, client_config_requiring, client_config_trusting_der, connect,
    load_certificates, load_private_key,
};

/// What a channel's certificate verification was made under, beyond the node's name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum TrustKey {
    /// The `--agent-ca` file, requiring this URI SAN.
    File {
        /// The cluster's URI SAN.
        required_uri: String,
    },
    /// A cluster's CA, by its fingerprint (SHA-256 of the certificate).
    Cluster {
        /// The fingerprint.
        fingerprint: [u8; 32],
    },
}

impl TrustKey {
    fn of(trust: &Trust) -> TrustKey {
        match trust {
            Trust::File(cluster) => TrustKey::File {
                required_uri: cluster.uri(),
            },
            Trust::Cluster(ca) => TrustKey::Cluster {
                fingerprint: ca.fingerprint(),
            },
        }
    }
}

/// The key of a pooled channel: (address, node name, trust).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ChannelKey {
    target: String,
    node: String,
    trust: TrustKey,
}

impl ChannelKey {
    fn of(peer: &Peer) -> ChannelKey {
        ChannelKey {
            target: peer.target().to_owned(),
            node: peer.node().to_owned(),
            trust: TrustKey::of(peer.trust()),
        }
    }
}

/// Channels unused this long are dropped.
pub const CHANNEL_IDLE: Duration = Duration::from_secs(600);

/// The most channels kept (one per agent and trust; a fleet of thousands of nodes).
pub const MAX_CHANNELS: usize = 8192;

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
    /// Configurations by trust, with when each was last used.
    by_trust: HashMap<TrustKey, (Arc<ClientConfig>, Instant)>,
    stamp: Vec<Option<(SystemTime, u64)>>,
    checked: Instant,
}

#[derive(Clone)]
struct Entry {
    client: NodeAgentClient<Channel>,
    facts: Option<(NodeFacts, Instant)>,
    used: Instant,
}

/// The files the updater's agent client is made of: its certificate and key (the `admin`
/// role on the agents), and the `--agent-ca` file when it was given. That file is the CA of
/// `agentCA: File` only; under `agentCA: ClusterSecret` each cluster's CA Secret verifies
/// its agents, so an updater whose settings all say `ClusterSecret` needs no file.
#[derive(Debug, Clone)]
pub struct ClientFiles {
    /// `--agent-ca`: the fleet CA of `agentCA: File`, if given.
    pub ca: Option<PathBuf>,
    /// `--agent-cert`: the client certificate chain, leaf first.
    pub cert: PathBuf,
    /// `--agent-key`: its private key.
    pub key: PathBuf,
}

impl From<ClientTlsPaths> for ClientFiles {
    fn from(p: ClientTlsPaths) -> ClientFiles {
        ClientFiles {
            ca: Some(p.ca),
            cert: p.cert,
            key: p.key,
        }
    }
}

/// What `agentCA: File` answers when the updater was started without `--agent-ca` (the
/// settings refuse it first, [`crate::settings::Defaults::agent_ca_file`]; this is the
/// client's own guard).
pub const NO_AGENT_CA: &str = "settings.agentCA is File (the default), which verifies the agents \
     against the --agent-ca file, and this updater was started without --agent-ca: start it \
     with --agent-ca FILE, or set agentCA: ClusterSecret in the ExtensionConfig's settings \
     (docs/pki.md, \"Which CA verifies the agents\")";

/// Loads the client certificate and key (and the `--agent-ca` file when given): what
/// [`Agents::new`] refuses to start without, and what a reload must pass.
fn check(files: &ClientFiles) -> Result<(), inplace_api::tls::TlsError> {
    match &files.ca {
        Some(ca) => client_config(&ClientTlsPaths {
            ca: ca.clone(),
            cert: files.cert.clone(),
            key: files.key.clone(),
        })
        .map(drop),
        None => {
            let chain = load_certificates(&files.cert)?;
            let key = load_private_key(&files.key)?;
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .and_then(|b| {
                    b.with_root_certificates(rustls::RootCertStore::empty())
                        .with_client_auth_cert(chain, key)
                })
                .map(drop)
                .map_err(|source| inplace_api::tls::TlsError::Rustls {
                    context: "client certificate and key",
                    source,
                })
        }
    }
}

/// The pool of agent connections.
pub struct Agents {
    files: ClientFiles,
    tls: Mutex<Tls>,
    pool: Mutex<HashMap<ChannelKey, Entry>>,
    /// Calls that found the agent unreachable (for the metrics).
    pub unreachable: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Agents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agents")
            .field("files", &self.files)
            .finish()
    }
}

fn stamp(files: &ClientFiles) -> Vec<Option<(SystemTime, u64)>> {
    [files.ca.as_ref(), Some(&files.cert), Some(&files.key)]
        .iter()
        .flatten()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

impl Agents {
    /// A pool presenting the client certificate of `files`, trusting the `--agent-ca` file
    /// (when given) for agents under `agentCA: File`.
    pub fn new(files: impl Into<ClientFiles>) -> Result<Agents, inplace_api::tls::TlsError> {
        let files = files.into();
        check(&files)?;
        Ok(Agents {
            tls: Mutex::new(Tls {
                by_trust: HashMap::new(),
                stamp: stamp(&files),
                checked: Instant::now(),
            }),
            files,
            pool: Mutex::new(HashMap::new()),
            unreachable: Default::default(),
        })
    }

    fn lock_pool(&self) -> std::sync::MutexGuard<'_, HashMap<ChannelKey, Entry>> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_tls(&self) -> std::sync::MutexGuard<'_, Tls> {
        self.tls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Re-reads the client certificate files when they changed; the configurations and
    /// channels made with the old ones are dropped then.
    fn reload(&self) {
        let mut tls = self.lock_tls();
        if tls.checked.elapsed() < RELOAD_CHECK {
            return;
        }
        tls.checked = Instant::now();
        let now = stamp(&self.files);
        if now == tls.stamp {
            return;
        }
        match check(&self.files) {
            Ok(()) => {
                tracing::info!("agent client certificate reloaded");
                tls.by_trust.clear();
                tls.stamp = now;
                self.lock_pool().clear();
            }
            Err(e) => {
                tracing::warn!(error = %e, "agent client certificate not reloaded; keeping the old one");
            }
        }
    }

    /// The client configuration for `trust` (built once per trust: per cluster identity
    /// under the `--agent-ca` file, per CA fingerprint of a cluster's CA).
    fn config_for(&self, trust: &Trust) -> Result<Arc<ClientConfig>, String> {
        self.reload();
        let key = TrustKey::of(trust);
        let mut tls = self.lock_tls();
        if let Some((config, used)) = tls.by_trust.get_mut(&key) {
            *used = Instant::now();
            return Ok(config.clone());
        }
        let config = match trust {
            Trust::File(cluster) => {
                let ca = self.files.ca.clone().ok_or(NO_AGENT_CA)?;
                let paths = ClientTlsPaths {
                    ca,
                    cert: self.files.cert.clone(),
                    key: self.files.key.clone(),
                };
                client_config_requiring(&paths, Some(&cluster.uri()))
                    .map_err(|e| format!("the --agent-ca file for cluster {cluster}: {e}"))?
            }
            Trust::Cluster(ca) => {
                let origin = format!("Secret {} key tls.crt", ca.secret());
                client_config_trusting_der(
                    ca.der(),
                    &origin,
                    &self.files.cert,
                    &self.files.key,
                    None,
                )
                .map_err(|e| format!("the CA of cluster {}: {e}", ca.cluster()))?
            }
        };
        let config = Arc::new(config);
        let now = Instant::now();
        tls.by_trust
            .retain(|_, (_, used)| now.duration_since(*used) < CHANNEL_IDLE);
        if tls.by_trust.len() >= MAX_CHANNELS
            && let Some(oldest) = tls
                .by_trust
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
        {
            tls.by_trust.remove(&oldest);
        }
        tls.by_trust.insert(key, (config.clone(), now));
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

    async fn entry(&self, peer: &Peer) -> Result<Entry, AgentError> {
        let (target, node) = (peer.target(), peer.node());
        let key = ChannelKey::of(peer);
        let config = self
            .config_for(peer.trust())
            .map_err(|e| self.unreachable(node, target, e))?;
        if let Some(entry) = self.lock_pool().get_mut(&key) {
            entry.used = Instant::now();
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
                        peer.trust().describe(self.files.ca.as_deref())
                    ));
                }
                self.unreachable(node, target, detail)
            })?;
        let now = Instant::now();
        let entry = Entry {
            client: NodeAgentClient::new(channel),
            facts: None,
            used: now,
        };
        let mut pool = self.lock_pool();
        if !pool.contains_key(&key) {
            // Channels of a CA or an agent no longer in use do not pile up.
            pool.retain(|_, e| now.duration_since(e.used) < CHANNEL_IDLE);
            if pool.len() >= MAX_CHANNELS
                && let Some(oldest) = pool
                    .iter()
                    .min_by_key(|(_, e)| e.used)
                    .map(|(k, _)| k.clone())
            {
                pool.remove(&oldest);
            }
        }
        Ok(pool.entry(key).or_insert(entry).clone())
    }

    fn forget(&self, peer: &Peer) {
        self.lock_pool().remove(&ChannelKey::of(peer));
    }

    fn status_error(&self, peer: &Peer, method: &'static str, status: tonic::Status) -> AgentError {
        let (target, node) = (peer.target(), peer.node());
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
                if !status.message().contains("shutting down") =>
            {
                self.forget(peer);
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
    pub async fn facts(&self, peer: &Peer) -> Result<NodeFacts, AgentError> {
        let entry = self.entry(peer).await?;
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
            .map_err(|s| self.status_error(peer, "GetNodeInfo", s))?
            .into_inner();
        let node = peer.node();
        if !info.node_name.is_empty() && info.node_name != node {
            self.forget(peer);
            return Err(self.unreachable(
                node,
                peer.target(),
                format!("the agent there serves node {:?}", info.node_name),
            ));
        }
        let facts = facts_from(&info, node);
        if let Some(e) = self.lock_pool().get_mut(&ChannelKey::of(peer)) {
            e.facts = Some((facts.clone(), Instant::now()));
        }
        Ok(facts)
    }

    /// `CheckPlan`.
    pub async fn check(
        &self,
        peer: &Peer,
        plan: pb::Plan,
    ) -> Result<pb::CheckPlanResponse, AgentError> {
        let mut client = self.entry(peer).await?.client;
        let mut request = tonic::Request::new(pb::CheckPlanRequest { plan: Some(plan) });
        request.set_timeout(CALL_TIMEOUT);
        client
            .check_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(peer, "CheckPlan", s))
    }

    /// `GetPlanStatus`; `None` when the agent does not know the id.
    pub async fn status(
        &self,
        peer: &Peer,
        id: &str,
    ) -> Result<Option<pb::PlanStatus>, AgentError> {
        let mut client = self.entry(peer).await?.client;
        let mut request = tonic::Request::new(pb::GetPlanStatusRequest { id: id.to_owned() });
        request.set_timeout(CALL_TIMEOUT);
        match client.get_plan_status(request).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(self.status_error(peer, "GetPlanStatus", s)),
        }
    }

    /// `WatchPlan`: the plan's snapshots as the agent sends them; `None` when the agent does
    /// not know the id. Only opening the stream has a deadline; it stays open until the
    /// terminal snapshot or until it breaks.
    pub async fn watch(
        &self,
        peer: &Peer,
        id: &str,
    ) -> Result<Option<tonic::Streaming<pb::PlanStatus>>, AgentError> {
        let mut client = self.entry(peer).await?.client;
        let request = tonic::Request::new(pb::WatchPlanRequest { id: id.to_owned() });
        match tokio::time::timeout(CALL_TIMEOUT, client.watch_plan(request)).await {
            Err(_) => {
                self.forget(peer);
                Err(self.unreachable(peer.node(), peer.target(), "WatchPlan: timed out"))
            }
            Ok(Ok(r)) => Ok(Some(r.into_inner())),
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => Ok(None),
            Ok(Err(s)) => Err(self.status_error(peer, "WatchPlan", s)),
        }
    }

    /// `ApplyPlan`.
    pub async fn apply(
        &self,
        peer: &Peer,
        plan: pb::Plan,
    ) -> Result<pb::ApplyPlanResponse, AgentError> {
        let mut client = self.entry(peer).await?.client;
        let mut request = tonic::Request::new(pb::ApplyPlanRequest {
            plan: Some(plan),
            retry: false,
        });
        request.set_timeout(CALL_TIMEOUT);
        client
            .apply_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(peer, "ApplyPlan", s))
    }

    /// `RetryPlan` of the attempt `from_attempt` that was seen to fail: a new attempt
    /// starts only while that is still the latest one, so the same request sent twice (by
    /// two replicas, or again after a restart) starts one attempt.
    pub async fn retry(
        &self,
        peer: &Peer,
        id: &str,
        from_attempt: u32,
    ) -> Result<pb::PlanStatus, AgentError> {
        let mut client = self.entry(peer).await?.client;
        let mut request = tonic::Request::new(pb::RetryPlanRequest {
            id: id.to_owned(),
            from_attempt,
        });
        request.set_timeout(CALL_TIMEOUT);
        client
            .retry_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(peer, "RetryPlan", s))
    }

    /// `GetDrift`: whether the node still matches the last plan that succeeded on it;
    /// `None` from an agent that predates the call.
    pub async fn drift(&self, peer: &Peer) -> Result<Option<pb::DriftStatus>, AgentError> {
        let mut client = self.entry(peer).await?.client;
        let mut request = tonic::Request::new(pb::GetDriftRequest {});
        request.set_timeout(CALL_TIMEOUT);
        match client.get_drift(request).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(s) if s.code() == tonic::Code::Unimplemented => Ok(None),
            Err(s) => Err(self.status_error(peer, "GetDrift", s)),
        }
    }

    /// `RepairPlan`: a new attempt of the last succeeded plan, which must be `id`.
    pub async fn repair(&self, peer: &Peer, id: &str) -> Result<pb::PlanStatus, AgentError> {
        let mut client = self.entry(peer).await?.client;
        let mut request = tonic::Request::new(pb::RepairPlanRequest { id: id.to_owned() });
        request.set_timeout(CALL_TIMEOUT);
        client
            .repair_plan(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(peer, "RepairPlan", s))
    }

    /// Where the client certificate comes from.
    pub fn files(&self) -> &ClientFiles {
        &self.files
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
            .facts(&Peer::for_tests(&target, "node-a"))
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
    fn a_configuration_is_made_per_trust_and_kept_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::emulate::Pki::new(dir.path()).unwrap();
        let client = pki.updater_client().unwrap();
        let agents = Agents::new(paths(pki.ca(), client.cert, client.key)).unwrap();
        let red = Peer::for_tests_in("t", "n", "team-a", "red");
        let blue = Peer::for_tests_in("t", "n", "team-b", "blue");
        let one = agents.config_for(red.trust()).unwrap();
        assert!(Arc::ptr_eq(&one, &agents.config_for(red.trust()).unwrap()));
        // Another cluster's identity at the same address and node: another configuration,
        // and the first one is still the one for red.
        let other = agents.config_for(blue.trust()).unwrap();
        assert!(!Arc::ptr_eq(&one, &other));
        assert!(Arc::ptr_eq(&one, &agents.config_for(red.trust()).unwrap()));
        assert_ne!(ChannelKey::of(&red), ChannelKey::of(&blue));
        assert_eq!(
            ChannelKey::of(&red),
            ChannelKey::of(&Peer::for_tests_in("t", "n", "team-a", "red"))
        );
    }
}
