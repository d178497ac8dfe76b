//! The `controlPlane` gate: a kubeadm control-plane node is proved healthy before its plan is
//! called done (docs/decisions/0019-control-plane-gates.md).
//!
//! One attempt checks, in this order, and fails on the first that does not hold, naming the
//! component, the endpoint, what it answered and what to do:
//!
//! 1. **kube-apiserver**: `GET https://<apiServer>/readyz` answers 200. The server is
//!    verified against the node's cluster CA (`/etc/kubernetes/pki/ca.crt`) under the name
//!    `kubernetes`, which kubeadm puts in every API server certificate (an address such as
//!    127.0.0.1 is not always one of its names). The endpoint is the gate's `apiServer`, else
//!    the advertise endpoint kubeadm wrote into the kube-apiserver manifest
//!    (`kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint`), else
//!    127.0.0.1:6443.
//! 2. **etcd** (stacked only): the local member's `http://<etcdMetrics>/health?serializable=true`
//!    (answered from the member's own state) and the linearizable `/health`, which etcd
//!    answers healthy only when the cluster has a leader, i.e. quorum.
//! 3. **the static pods**: each component's mirror pod
//!    (`GET /api/v1/namespaces/kube-system/pods/<component>-<node>`, read through the local
//!    API server with the kubelet's own credential from `/etc/kubernetes/kubelet.conf`) is
//!    Ready and is the mirror of the pod the kubelet runs now (`kubernetes.io/config.mirror`
//!    equals `kubernetes.io/config.hash`); and when the component's manifest changed since
//!    the plan started, its `kubernetes.io/config.hash` changed too: the kubelet runs the
//!    new manifest, not the old pod.
//!
//! The "before" is a [`Baseline`] taken while the plan prepares, before anything changes
//! ([`capture`]): the sha256 of each manifest and its mirror pod's hash. It is kept in
//! memory for the run; an agent that restarted in the middle of a plan has none, and then
//! the gate proves Ready mirror pods of the current pods and says that it could not prove a
//! hash change.
//!
//! Every file is read through the agent's root (`Host::root`), bounded; every request has a
//! deadline and a bounded answer.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::host::{Host, http, https};
use inplace_plan::{ControlPlaneGate, EtcdTopology, NodePath, Plan, Probe};

/// The kubeadm static pod manifests.
pub const MANIFESTS_DIR: &str = "/etc/kubernetes/manifests";
/// The cluster CA the API server's serving certificate chains to.
pub const CLUSTER_CA: &str = "/etc/kubernetes/pki/ca.crt";
/// The kubelet's kubeconfig (its client certificate reads the node's own mirror pods).
pub const KUBELET_CONF: &str = "/etc/kubernetes/kubelet.conf";
/// The name the API server's certificate is verified under.
pub const API_SERVER_NAME: &str = "kubernetes";
/// Where the API server listens when nothing says otherwise.
pub const API_SERVER_DEFAULT: &str = "127.0.0.1:6443";
/// The annotation kubeadm writes the API server's advertise endpoint into.
pub const ADVERTISE_ANNOTATION: &str =
    "kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint";
/// The kubelet's hash of the static pod a mirror pod stands for.
pub const CONFIG_HASH: &str = "kubernetes.io/config.hash";
/// The kubelet's mark of a mirror pod (the hash of the static pod it mirrors).
pub const CONFIG_MIRROR: &str = "kubernetes.io/config.mirror";

/// Most bytes read of a manifest, a kubeconfig, a certificate or a key.
const MAX_FILE: u64 = 1024 * 1024;
/// Most bytes of a pod read from the API server.
const MAX_POD: usize = 1024 * 1024;
/// Most bytes of a `/readyz` answer kept.
const MAX_READYZ: usize = 64 * 1024;
/// How long the baseline may take per request (the plan has not started yet).
const BASELINE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the node looked like before the plan changed anything, per component.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Baseline {
    /// Component → (sha256 of its manifest, the kubelet's hash of its pod), each `None` when
    /// it could not be read.
    pub components: BTreeMap<String, (Option<String>, Option<String>)>,
}

/// Baselines of the runs in flight, by (run, gate index); the last few only.
static BASELINES: Mutex<Vec<((u64, u32), Baseline)>> = Mutex::new(Vec::new());
const KEEP_BASELINES: usize = 16;

/// Takes and keeps the baseline of every `controlPlane` gate of `plan` for `run`, before the
/// plan changes anything. Never fails: what cannot be read is left unknown.
pub fn capture(host: &Host, run: u64, plan: &Plan) {
    for (i, check) in plan.verify.iter().enumerate() {
        if let Probe::ControlPlane(gate) = &check.probe {
            let b = baseline(host, gate);
            tracing::info!(run, gate = i, baseline = ?b, "control-plane baseline taken");
            let mut all = BASELINES.lock().unwrap_or_else(|p| p.into_inner());
            all.retain(|(k, _)| *k != (run, i as u32));
            all.push(((run, i as u32), b));
            let excess = all.len().saturating_sub(KEEP_BASELINES);
            all.drain(..excess);
        }
    }
}

/// The baseline taken for gate `index` of `run`, if this process took one.
pub fn recall(run: u64, index: u32) -> Option<Baseline> {
    let all = BASELINES.lock().unwrap_or_else(|p| p.into_inner());
    all.iter()
        .find(|(k, _)| *k == (run, index))
        .map(|(_, b)| b.clone())
}

/// The baseline of one gate, now.
pub fn baseline(host: &Host, gate: &ControlPlaneGate) -> Baseline {
    let api = Api::open(host, gate, BASELINE_TIMEOUT).ok();
    let mut components = BTreeMap::new();
    for c in &gate.components {
        let manifest = read_manifest(host, c).ok().flatten().map(|b| sha256(&b));
        let hash = api
            .as_ref()
            .and_then(|api| api.mirror_pod(&gate.node_name, c, BASELINE_TIMEOUT).ok())
            .and_then(|p| p.hash);
        components.insert(c.clone(), (manifest, hash));
    }
    Baseline { components }
}

/// One attempt of the gate: `Ok(observation)` when the node is healthy, `Err(why)` when not.
pub fn probe(
    host: &Host,
    gate: &ControlPlaneGate,
    before: Option<&Baseline>,
    budget: Duration,
) -> Result<String, String> {
    let deadline = Instant::now() + budget;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(200))
    };
    let rewritten = |c: &str| -> Option<bool> {
        let (was, _) = before?.components.get(c)?;
        let was = was.as_ref()?;
        let now = read_manifest(host, c).ok().flatten().map(|b| sha256(&b));
        Some(now.as_ref() != Some(was))
    };
    let api = Api::open(host, gate, left())?;
    // 1. The API server.
    let readyz = format!("https://{}/readyz", api.addr);
    match api.get("/readyz", left(), MAX_READYZ) {
        Ok(r) if r.status == 200 => {}
        Ok(r) => {
            return Err(format!(
                "kube-apiserver: {readyz} answered {}{}: the API server on this node is not \
                 ready; see the failed checks ([-] lines) and the kube-apiserver container's log \
                 (crictl logs)",
                r.status,
                failed_checks(&r.body)
            ));
        }
        Err(e) => {
            return Err(format!(
                "kube-apiserver: {e}: the API server on this node does not answer; see the \
                 kubelet's log (journalctl -u kubelet) and the kube-apiserver container's"
            ));
        }
    }
    let mut seen = vec![format!("kube-apiserver {readyz} answered 200")];
    // 2. etcd, where it runs on this node.
    if gate.etcd == EtcdTopology::Stacked {
        let member = format!("http://{}/health?serializable=true", gate.etcd_metrics);
        etcd_health(&member, left()).map_err(|e| {
            format!(
                "etcd: the local member is not healthy: {e}; see the etcd container's log \
                 (crictl logs) and `etcdctl endpoint health`{}",
                etcd_forward_note(rewritten("etcd"))
            )
        })?;
        let quorum = format!("http://{}/health", gate.etcd_metrics);
        etcd_health(&quorum, left()).map_err(|e| {
            format!(
                "etcd: the cluster has no leader (quorum lost or an election in progress): {e}; \
                 do not take another control-plane node down; check `etcdctl endpoint status \
                 --cluster`{}",
                etcd_forward_note(rewritten("etcd"))
            )
        })?;
        seen.push(format!("etcd {member} and {quorum} healthy"));
    }
    // 3. The static pods.
    let mut unproven = Vec::new();
    for c in &gate.components {
        let name = format!("kube-system/{c}-{}", gate.node_name);
        let pod = api.mirror_pod(&gate.node_name, c, left()).map_err(|e| {
            format!(
                "{c}: mirror pod {name}: {e}: the kubelet has not (re)created it; see the \
                 kubelet's log (journalctl -u kubelet){}",
                if c == "etcd" {
                    etcd_forward_note(rewritten(c))
                } else {
                    String::new()
                }
            )
        })?;
        let Some(hash) = pod.hash.clone() else {
            return Err(format!(
                "{c}: pod {name} has no {CONFIG_HASH} annotation: it is not a static pod's \
                 mirror; see what created it"
            ));
        };
        if pod.mirror.as_deref() != Some(hash.as_str()) {
            return Err(format!(
                "{c}: mirror pod {name} stands for another pod than the one the kubelet \
                 runs ({CONFIG_MIRROR} {:?}, {CONFIG_HASH} {hash:?}); wait for the kubelet to \
                 replace it",
                pod.mirror.as_deref().unwrap_or("")
            ));
        }
        let before_hash = before
            .and_then(|b| b.components.get(c))
            .and_then(|(_, h)| h.clone());
        match (rewritten(c), before_hash) {
            (Some(true), Some(old)) if old == hash => {
                return Err(format!(
                    "{c}: mirror pod {name} still runs the manifest from before the plan \
                     ({CONFIG_HASH} {hash}): the kubelet has not started the new \
                     {MANIFESTS_DIR}/{c}.yaml; see the kubelet's log (journalctl -u kubelet){}",
                    if c == "etcd" {
                        etcd_forward_note(Some(true))
                    } else {
                        String::new()
                    }
                ));
            }
            (Some(true), None) | (None, _) => unproven.push(c.clone()),
            _ => {}
        }
        if !pod.ready {
            return Err(format!(
                "{c}: mirror pod {name} ({CONFIG_HASH} {hash}) is not Ready{}: see the {c} \
                 container's log (crictl logs){}",
                pod.why_not_ready
                    .as_deref()
                    .map(|w| format!(" ({w})"))
                    .unwrap_or_default(),
                if c == "etcd" {
                    etcd_forward_note(rewritten(c))
                } else {
                    String::new()
                }
            ));
        }
    }
    seen.push(format!(
        "mirror pods of {} Ready on their current manifests",
        gate.components.join(", ")
    ));
    if !unproven.is_empty() {
        seen.push(format!(
            "no baseline from before the plan for {} (the agent restarted during it): a \
             hash change could not be proven",
            unproven.join(", ")
        ));
    }
    Ok(seen.join("; "))
}

/// What the status says about etcd's data when a gate fails after etcd's manifest changed:
/// the rollback puts the previous manifest back, never etcd's data.
fn etcd_forward_note(rewritten: Option<bool>) -> String {
    if rewritten == Some(true) {
        "; not rolled back: etcd's data. The previous etcd manifest is restored, but a member \
         that already ran the new etcd keeps what it wrote (etcd does not downgrade its data \
         by restarting an older binary): check the member with `etcdctl endpoint status` \
         before retrying"
            .to_string()
    } else {
        String::new()
    }
}

/// `GET <url>` of etcd's health endpoint: `Ok` on 200 with `"health":"true"`.
fn etcd_health(url: &str, budget: Duration) -> Result<(), String> {
    match http::get(url, budget) {
        Ok(r) => {
            let v: Option<Value> = serde_json::from_str(&r.body).ok();
            let healthy = v
                .as_ref()
                .and_then(|v| v.get("health"))
                .and_then(Value::as_str)
                == Some("true");
            if r.status == 200 && healthy {
                Ok(())
            } else {
                let reason = v
                    .as_ref()
                    .and_then(|v| v.get("reason"))
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(|s| format!(" (reason {:?})", truncate(s, 200)))
                    .unwrap_or_default();
                Err(format!(
                    "{url} answered {} {}{reason}",
                    r.status,
                    truncate(r.body.trim(), 200)
                ))
            }
        }
        Err(e) => Err(format!("{url}: {e}")),
    }
}

/// The `[-]` lines of a verbose `/readyz` answer, or its first line.
fn failed_checks(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let failed: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("[-]"))
        .take(8)
        .collect();
    let said = if failed.is_empty() {
        text.lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("")
            .to_string()
    } else {
        failed.join(", ")
    };
    if said.is_empty() {
        String::new()
    } else {
        format!(": {}", truncate(&said, 400))
    }
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

fn sha256(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A regular file of the node, read through the root, at most [`MAX_FILE`] bytes; `None`
/// when absent.
fn read_file(host: &Host, path: &str) -> Result<Option<Vec<u8>>, String> {
    let p = NodePath::parse(path).map_err(|e| format!("{path}: {e}"))?;
    match host.root.meta(&p) {
        Ok(Some((_, size))) if size > MAX_FILE => {
            return Err(format!(
                "{path}: {size} bytes, more than the {MAX_FILE} read"
            ));
        }
        Ok(_) => {}
        Err(e) => return Err(e.to_string()),
    }
    match host.root.read(&p) {
        Ok(inplace_base::Existing::File { content, .. }) => Ok(Some(content)),
        Ok(inplace_base::Existing::Absent) => Ok(None),
        Ok(_) => Err(format!("{path}: not a regular file")),
        Err(e) => Err(e.to_string()),
    }
}

fn read_manifest(host: &Host, component: &str) -> Result<Option<Vec<u8>>, String> {
    read_file(host, &format!("{MANIFESTS_DIR}/{component}.yaml"))
}

/// The advertise endpoint kubeadm wrote into the kube-apiserver manifest, if any.
fn advertise_endpoint(host: &Host) -> Option<String> {
    let bytes = read_manifest(host, "kube-apiserver").ok().flatten()?;
    let v: Value = serde_yaml_ng::from_slice(&bytes).ok()?;
    let e = v
        .get("metadata")?
        .get("annotations")?
        .get(ADVERTISE_ANNOTATION)?
        .as_str()?;
    inplace_plan::kinds::check_endpoint(e)
        .ok()
        .map(|()| e.to_string())
}

/// The node's kubelet credential, from its kubeconfig: the current context's user's client
/// certificate and key, inline (`*-data`) or as files on the node. Nothing of its content
/// ever enters a message.
fn kubelet_identity(host: &Host) -> Result<https::ClientIdentity, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bytes =
        read_file(host, KUBELET_CONF)?.ok_or_else(|| format!("{KUBELET_CONF} is missing"))?;
    let conf: Value = serde_yaml_ng::from_slice(&bytes)
        .map_err(|_| format!("{KUBELET_CONF} is not a YAML kubeconfig"))?;
    let named = |list: &str, name: &str| -> Option<Value> {
        conf.get(list)?
            .as_array()?
            .iter()
            .find(|e| e.get("name").and_then(Value::as_str) == Some(name))
            .cloned()
    };
    let user_name = conf
        .get("current-context")
        .and_then(Value::as_str)
        .and_then(|ctx| named("contexts", ctx))
        .and_then(|c| c.get("context")?.get("user")?.as_str().map(str::to_owned))
        .or_else(|| {
            // One user and no usable context: that user.
            let users = conf.get("users")?.as_array()?;
            (users.len() == 1)
                .then(|| users[0].get("name")?.as_str().map(str::to_owned))
                .flatten()
        })
        .ok_or_else(|| format!("{KUBELET_CONF}: no current context naming a user"))?;
    let user = named("users", &user_name)
        .and_then(|u| u.get("user").cloned())
        .ok_or_else(|| format!("{KUBELET_CONF}: user {user_name:?} is not defined"))?;
    let material = |data: &str, file: &str| -> Result<Vec<u8>, String> {
        if let Some(d) = user.get(data).and_then(Value::as_str) {
            return base64::engine::general_purpose::STANDARD
                .decode(d.trim())
                .map_err(|_| format!("{KUBELET_CONF}: users[{user_name}].{data} is not base64"));
        }
        if let Some(path) = user.get(file).and_then(Value::as_str) {
            if !path.starts_with('/') {
                return Err(format!(
                    "{KUBELET_CONF}: users[{user_name}].{file} {path:?} is not an absolute path"
                ));
            }
            return read_file(host, path)?.ok_or_else(|| {
                format!("{KUBELET_CONF}: users[{user_name}].{file} {path} is missing")
            });
        }
        Err(format!(
            "{KUBELET_CONF}: users[{user_name}] has neither {data} nor {file}"
        ))
    };
    let cert = material("client-certificate-data", "client-certificate")?;
    let key = material("client-key-data", "client-key")?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{KUBELET_CONF}: the client certificate is not PEM"))?;
    if chain.is_empty() {
        return Err(format!("{KUBELET_CONF}: no client certificate"));
    }
    let key = PrivateKeyDer::from_pem_slice(&key)
        .map_err(|_| format!("{KUBELET_CONF}: the client key is not a PEM private key"))?;
    Ok(https::ClientIdentity { chain, key })
}

/// The local API server, as the gate reaches it.
struct Api {
    addr: String,
    /// With the kubelet's identity when it could be read, else anonymous.
    config: Arc<rustls::ClientConfig>,
    /// Why the kubelet's identity could not be used, when it could not.
    no_identity: Option<String>,
}

/// What the gate reads of a mirror pod.
struct MirrorPod {
    hash: Option<String>,
    mirror: Option<String>,
    ready: bool,
    why_not_ready: Option<String>,
}

impl Api {
    fn open(host: &Host, gate: &ControlPlaneGate, _budget: Duration) -> Result<Api, String> {
        let addr = gate
            .api_server
            .clone()
            .or_else(|| advertise_endpoint(host))
            .unwrap_or_else(|| API_SERVER_DEFAULT.to_string());
        let ca = read_file(host, CLUSTER_CA)
            .map_err(|e| format!("kube-apiserver: cluster CA: {e}"))?
            .ok_or_else(|| {
                format!(
                    "kube-apiserver: {CLUSTER_CA} is missing: the gate verifies the API server \
                     against it; is this a kubeadm control-plane node?"
                )
            })?;
        let (identity, no_identity) = match kubelet_identity(host) {
            Ok(id) => (Some(id), None),
            Err(e) => (None, Some(e)),
        };
        let config =
            https::client(&ca, CLUSTER_CA, identity).map_err(|e| format!("kube-apiserver: {e}"))?;
        Ok(Api {
            addr,
            config,
            no_identity,
        })
    }

    fn get(&self, path: &str, budget: Duration, max: usize) -> Result<https::HttpsReply, String> {
        https::get(&self.config, &self.addr, API_SERVER_NAME, path, budget, max)
    }

    fn mirror_pod(
        &self,
        node: &str,
        component: &str,
        budget: Duration,
    ) -> Result<MirrorPod, String> {
        if let Some(why) = &self.no_identity {
            return Err(format!(
                "cannot read it without the kubelet's credential: {why}"
            ));
        }
        let path = format!("/api/v1/namespaces/kube-system/pods/{component}-{node}");
        let url = format!("https://{}{path}", self.addr);
        let r = self.get(&path, budget, MAX_POD)?;
        if r.status == 404 {
            return Err(format!("{url} answered 404 (no such pod)"));
        }
        if r.status != 200 {
            return Err(format!(
                "{url} answered {}: {}",
                r.status,
                truncate(String::from_utf8_lossy(&r.body).trim(), 200)
            ));
        }
        let v: Value = serde_json::from_slice(&r.body)
            .map_err(|e| format!("{url}: the answer is not a pod: {e}"))?;
        let annotation = |k: &str| {
            v.pointer("/metadata/annotations")
                .and_then(|a| a.get(k))
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let ready_cond = v
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .and_then(|cs| {
                cs.iter()
                    .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
            });
        let ready = ready_cond
            .and_then(|c| c.get("status"))
            .and_then(Value::as_str)
            == Some("True");
        let why_not_ready = if ready {
            None
        } else {
            let phase = v
                .pointer("/status/phase")
                .and_then(Value::as_str)
                .unwrap_or("");
            let reason = ready_cond
                .and_then(|c| c.get("reason").or_else(|| c.get("message")))
                .and_then(Value::as_str)
                .unwrap_or("");
            let said: Vec<String> = [("phase", phase), ("reason", reason)]
                .iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| format!("{k} {}", truncate(v, 100)))
                .collect();
            (!said.is_empty()).then(|| said.join(", "))
        };
        Ok(MirrorPod {
            hash: annotation(CONFIG_HASH),
            mirror: annotation(CONFIG_MIRROR),
            ready,
            why_not_ready,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_readyz_checks_are_named() {
        let body = b"[+]ping ok\n[-]etcd failed: reason withheld\n[+]log ok\nreadyz check failed\n";
        assert_eq!(failed_checks(body), ": [-]etcd failed: reason withheld");
        assert_eq!(failed_checks(b"not ready\n"), ": not ready");
        assert_eq!(failed_checks(b""), "");
    }

    #[test]
    fn the_etcd_note_is_said_only_when_etcd_moved() {
        assert!(etcd_forward_note(Some(true)).contains("not rolled back"));
        assert!(etcd_forward_note(Some(false)).is_empty());
        assert!(etcd_forward_note(None).is_empty());
    }
}
