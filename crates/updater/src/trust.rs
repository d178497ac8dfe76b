//! Which CA verifies a Machine's agent (`settings.agentCA`, docs/pki.md): the `--agent-ca`
//! file (`File`, one fleet CA) or the CA of the Machine's workload cluster
//! (`ClusterSecret`): the `<spec.clusterName>-ca` Secret, key `tls.crt`, in the Machine's
//! namespace, where Cluster API keeps it (cluster-api util/secret: `Name(cluster, "ca")`
//! is `<cluster>-ca`, `TLSCrtDataName` is `tls.crt`). A kubelet serving certificate is
//! signed by that CA, so one updater trusts every cluster's agents without a bundle.
//!
//! The Secret is read by `get` at most once per [`RECHECK`] per cluster; the CA is taken
//! again only when its resourceVersion changed, so the channels made under it are kept
//! until the CA does change (docs/decisions/0012-fleet-trust-and-dead-agents.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::agent::{ClusterCa, Trust};
use super::cluster::Cluster;
use super::settings::AgentCa;
use super::translate::lookup;

/// How long a cluster's CA is used before its Secret is read again.
pub const RECHECK: Duration = Duration::from_secs(30);

/// The Secret key holding the CA certificate.
pub const CA_KEY: &str = "tls.crt";

/// The workload clusters' CAs read so far, by Secret (`namespace/name`).
#[derive(Debug)]
pub struct ClusterCas {
    cache: Mutex<HashMap<String, (Instant, Arc<ClusterCa>)>>,
    recheck: Duration,
}

impl Default for ClusterCas {
    fn default() -> Self {
        ClusterCas {
            cache: Mutex::default(),
            recheck: RECHECK,
        }
    }
}

/// The name of a cluster's CA Secret.
pub fn secret_name(cluster: &str) -> String {
    format!("{cluster}-ca")
}

impl ClusterCas {
    /// The CA that verifies the agent of the live Machine `key` (`namespace/name`) under
    /// `source`; errors say which Secret and what to do.
    pub async fn trust_for(
        &self,
        cluster: &Cluster,
        source: AgentCa,
        live: &Value,
        key: &str,
    ) -> Result<Trust, String> {
        if source == AgentCa::File {
            return Ok(Trust::File);
        }
        let namespace = lookup(live, &["metadata", "namespace"])
            .and_then(Value::as_str)
            .or_else(|| key.split_once('/').map(|(ns, _)| ns))
            .unwrap_or_default();
        let name = lookup(live, &["spec", "clusterName"])
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                format!(
                    "Machine {key} has no spec.clusterName, so the CA that verifies its agent \
                     (settings.agentCA: ClusterSecret) is not known"
                )
            })?;
        self.get(cluster, namespace, name).await.map(Trust::Cluster)
    }

    /// The CA of cluster `namespace/name`, read again after [`RECHECK`].
    pub async fn get(
        &self,
        cluster: &Cluster,
        namespace: &str,
        name: &str,
    ) -> Result<Arc<ClusterCa>, String> {
        let secret = format!("{namespace}/{}", secret_name(name));
        let cached = self.lock().get(&secret).cloned();
        if let Some((at, ca)) = &cached
            && at.elapsed() < self.recheck
        {
            return Ok(ca.clone());
        }
        let read = cluster
            .secret_versioned(namespace, &secret_name(name))
            .await;
        let what = format!(
            "cluster {namespace}/{name}'s CA (settings.agentCA: ClusterSecret): Secret {secret}"
        );
        let (version, data) = match read {
            Ok(Some(found)) => found,
            Ok(None) => {
                return Err(format!(
                    "{what} does not exist; Cluster API creates it with the cluster, or set \
                     settings.agentCA to File for agents whose certificates come from the \
                     --agent-ca CA"
                ));
            }
            Err(e) => {
                // The API server did not answer: the CA known so far stays in use.
                if let Some((_, ca)) = cached {
                    tracing::warn!(%secret, error = %e, "cluster CA not read again; keeping the one known");
                    return Ok(ca);
                }
                return Err(format!("{what}: {e}"));
            }
        };
        let ca = match cached {
            Some((_, ca)) if ca.version == version => ca,
            _ => {
                let pem = data
                    .get(CA_KEY)
                    .filter(|v| !v.is_empty())
                    .cloned()
                    .ok_or_else(|| format!("{what} has no key {CA_KEY}"))?;
                tracing::info!(%secret, %version, "cluster CA read");
                Arc::new(ClusterCa {
                    cluster: format!("{namespace}/{name}"),
                    secret: secret.clone(),
                    version,
                    pem,
                })
            }
        };
        self.lock().insert(secret, (Instant::now(), ca.clone()));
        Ok(ca)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, Arc<ClusterCa>)>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::standin::{ApiStandin, secret};

    #[tokio::test]
    async fn a_clusters_ca_is_read_once_per_recheck_and_taken_again_on_a_new_version() {
        let api = ApiStandin::start().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let cluster = Cluster::connect(Some(&kubeconfig)).await.unwrap();
        let with_version = |pem: &[u8], version: &str| {
            let mut s = secret("ns", "red-ca", &[(CA_KEY, pem)]);
            s["metadata"]["resourceVersion"] = serde_json::json!(version);
            s
        };
        api.put(with_version(b"PEM 1", "7"));
        let gets = |api: &ApiStandin| {
            api.requests()
                .iter()
                .filter(|(_, p)| p.ends_with("/secrets/red-ca"))
                .count()
        };

        // Within the recheck: one read.
        let cas = ClusterCas::default();
        let one = cas.get(&cluster, "ns", "red").await.unwrap();
        assert_eq!(
            (one.version.as_str(), one.pem.as_slice()),
            ("7", &b"PEM 1"[..])
        );
        assert_eq!(one.secret, "ns/red-ca");
        assert!(Arc::ptr_eq(
            &one,
            &cas.get(&cluster, "ns", "red").await.unwrap()
        ));
        assert_eq!(gets(&api), 1);

        // Read again after it: the same version is the same CA (its channels are kept); a
        // new version is taken.
        let cas = ClusterCas {
            recheck: Duration::ZERO,
            ..ClusterCas::default()
        };
        let first = cas.get(&cluster, "ns", "red").await.unwrap();
        let again = cas.get(&cluster, "ns", "red").await.unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        api.put(with_version(b"PEM 2", "8"));
        let rotated = cas.get(&cluster, "ns", "red").await.unwrap();
        assert_eq!(
            (rotated.version.as_str(), rotated.pem.as_slice()),
            ("8", &b"PEM 2"[..])
        );
        assert_ne!(Trust::Cluster(first), Trust::Cluster(rotated));

        // No Secret, or no tls.crt: named, with what to do.
        let e = cas.get(&cluster, "ns", "green").await.unwrap_err();
        assert!(
            e.contains("Secret ns/green-ca does not exist")
                && e.contains("settings.agentCA to File"),
            "{e}"
        );
        api.put(secret("ns", "blue-ca", &[("ca.crt", b"x")]));
        let e = cas.get(&cluster, "ns", "blue").await.unwrap_err();
        assert!(e.contains("has no key tls.crt"), "{e}");
    }
}
