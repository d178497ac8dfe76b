//! Which agent a Machine may cause a call on, and how that agent is verified: the live
//! Machine (its node, address, namespace and cluster) and the effective `settings.agentCA`
//! become a [`Peer`], the only thing [`crate::agent::Agents`] calls. The rule it holds: a
//! Machine in namespace B can never cause any call on an agent of a cluster in namespace A
//! (docs/pki.md, "Which CA verifies the agents"; docs/security.md).
//!
//! The node name and address come from the Machine's `status`, which a tenant who can write
//! Machines writes; so what binds the agent to the Machine's own cluster is the trust:
//!
//! - `ClusterSecret`: the agent's certificate must chain to the CA of the Machine's cluster,
//!   the Secret `<spec.clusterName>-ca` in the Machine's namespace, where Cluster API keeps
//!   it (cluster-api util/secret/consts.go: `ClusterCA` is the suffix `ca`, `TLSCrtDataName`
//!   is `tls.crt`, `TLSKeyDataName` is `tls.key`; util/secret/certificates.go `AsSecret`
//!   writes both). The certificate is public: anyone who can create a Secret in namespace B
//!   can copy cluster A's CA certificate into it. So the CA is accepted only when the Secret
//!   also proves it is that cluster's CA: `tls.crt` holds exactly one certificate, a CA
//!   (basicConstraints CA:true), and `tls.key` holds the private key whose public key is the
//!   certificate's (a copier of the certificate does not have it). The key is read only to
//!   prove this; its bytes are zeroed after the check and never kept. A CA whose key Cluster
//!   API does not hold (its external CA mode: `tls.crt` only) is refused, saying what to do.
//! - `File` (one fleet CA, the `--agent-ca` file, signs every cluster's agents): the agent's
//!   certificate must also carry the URI SAN `spiffe://inplace-agent/cluster/<namespace>/<name>`
//!   of the Machine's cluster ([`inplace_api::pki::cluster_identity`]), checked by the
//!   client's certificate verifier after the chain and the node name.
//!
//! Not checked: that the Machine's node is the workload cluster's Node of the same
//! `spec.providerID`. That would be read through the cluster's kubeconfig Secret, which the
//! tenant of the namespace can write too, so the answer would not be trusted (a residual
//! risk docs/security.md records).
//!
//! A cluster's CA Secret is read by `get` at most once per [`RECHECK`]; it is proven again
//! only when its resourceVersion changed, so the channels made under it are kept until the
//! CA does change (docs/decisions/0012-fleet-trust-and-dead-agents.md).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::pem::{PemObject, SectionKind};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::Value;
use sha2::Digest as _;
use x509_parser::prelude::FromDer as _;
use x509_parser::x509::SubjectPublicKeyInfo;
use zeroize::Zeroizing;

use crate::cluster::Cluster;
use crate::edge::extension_config::Effective;
use crate::settings::{AgentCa, Settings};
use crate::translate::lookup;
use inplace_api::pki::{cluster_identity, is_object_name};

/// How long a cluster's CA is used before its Secret is read again.
pub const RECHECK: Duration = Duration::from_secs(30);

/// The Secret key holding the CA certificate (cluster-api util/secret `TLSCrtDataName`).
pub const CA_CERT_KEY: &str = "tls.crt";

/// The Secret key holding the CA's private key (cluster-api util/secret `TLSKeyDataName`).
pub const CA_PRIVATE_KEY: &str = "tls.key";

/// Largest `tls.crt` or `tls.key` read (a CA certificate or an RSA-4096 key is a few KiB).
const MAX_PEM: usize = 64 * 1024;

/// The name of a cluster's CA Secret (cluster-api util/secret `Name(cluster, ClusterCA)`).
pub fn secret_name(cluster: &str) -> String {
    format!("{cluster}-ca")
}

// === ClusterId ===

/// A workload cluster as a Machine names it: the Machine's namespace and `spec.clusterName`
/// (a Machine's Cluster is always in its own namespace).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClusterId {
    namespace: String,
    name: String,
}

impl ClusterId {
    /// The cluster of a live Machine `key` (`namespace/name`).
    fn of_machine(live: &Value, key: &str) -> Result<ClusterId, String> {
        let namespace = lookup(live, &["metadata", "namespace"])
            .and_then(Value::as_str)
            .or_else(|| key.split_once('/').map(|(ns, _)| ns))
            .unwrap_or_default();
        let name = lookup(live, &["spec", "clusterName"])
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                format!(
                    "Machine {key} has no spec.clusterName, so the cluster its agent must belong \
                     to is not known"
                )
            })?;
        if !is_object_name(namespace) || !is_object_name(name) {
            return Err(format!(
                "Machine {key}: spec.clusterName {name:?} is not a Kubernetes object name, so \
                 the cluster its agent must belong to is not known"
            ));
        }
        Ok(ClusterId {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The Cluster's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URI SAN that binds an agent's certificate to this cluster.
    pub fn uri(&self) -> String {
        cluster_identity(&self.namespace, &self.name)
    }
}

impl std::fmt::Display for ClusterId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

// === ClusterCa ===

/// A workload cluster's CA, proven by its Secret to be that cluster's (built only here).
#[derive(Debug, PartialEq, Eq)]
pub struct ClusterCa {
    cluster: ClusterId,
    secret: String,
    version: String,
    der: CertificateDer<'static>,
    fingerprint: [u8; 32],
}

impl ClusterCa {
    /// The cluster.
    pub fn cluster(&self) -> &ClusterId {
        &self.cluster
    }

    /// The Secret, `namespace/name`.
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// The Secret's resourceVersion when read.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The CA certificate (DER).
    pub fn der(&self) -> &CertificateDer<'static> {
        &self.der
    }

    /// SHA-256 of the CA certificate.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }
}

// === Trust ===

/// How an agent's certificate is verified, beyond the node's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// Chains to the `--agent-ca` file (one fleet CA) and carries the URI SAN of this
    /// cluster ([`ClusterId::uri`]).
    File(ClusterId),
    /// Chains to the cluster's own CA (which binds the cluster by itself).
    Cluster(Arc<ClusterCa>),
}

impl Trust {
    /// Which CA and identity, in words for a message.
    pub fn describe(&self, file: Option<&std::path::Path>) -> String {
        match self {
            Trust::File(cluster) => format!(
                "the --agent-ca file {} and the URI SAN {} of cluster {cluster}",
                file.map_or("(none given)".into(), |f| f.display().to_string()),
                cluster.uri()
            ),
            Trust::Cluster(ca) => format!(
                "the CA of cluster {} (Secret {}, key {CA_CERT_KEY})",
                ca.cluster, ca.secret
            ),
        }
    }

    /// The URI SAN the agent's certificate must carry, if any.
    pub fn required_uri(&self) -> Option<String> {
        match self {
            Trust::File(cluster) => Some(cluster.uri()),
            Trust::Cluster(_) => None,
        }
    }
}

// === Peer ===

/// The agent a live Machine may cause calls on: where it is, the node its certificate must
/// name and how it is verified. Built only by [`ClusterCas::peer`] from the live Machine and
/// the effective settings; every call on an agent takes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    target: String,
    node: String,
    trust: Trust,
}

impl Peer {
    /// `https://address:port` of the agent.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The node name its certificate must carry.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// How its certificate is verified.
    pub fn trust(&self) -> &Trust {
        &self.trust
    }

    /// A peer for unit tests of code that only carries one (cluster `ns/c`, `File`).
    #[cfg(test)]
    pub(crate) fn for_tests(target: &str, node: &str) -> Peer {
        Peer::for_tests_in(target, node, "ns", "c")
    }

    /// A peer for unit tests: cluster `namespace/name`, `agentCA: File`.
    #[cfg(test)]
    pub(crate) fn for_tests_in(target: &str, node: &str, namespace: &str, name: &str) -> Peer {
        Peer {
            target: target.to_owned(),
            node: node.to_owned(),
            trust: Trust::File(ClusterId {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            }),
        }
    }
}

/// The node name and the agent target of a live Machine `key`.
fn locate(live: &Value, settings: &Settings, key: &str) -> Result<(String, String), String> {
    let node = lookup(live, &["status", "nodeRef", "name"])
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("Machine {key} has no status.nodeRef.name yet"))?
        .to_owned();
    let addresses = lookup(live, &["status", "addresses"])
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let address = settings
        .address_types
        .iter()
        .find_map(|t| {
            addresses.iter().find_map(|a| {
                (a.get("type").and_then(Value::as_str) == Some(t.as_str()))
                    .then(|| a.get("address").and_then(Value::as_str))
                    .flatten()
                    .filter(|s| !s.is_empty())
            })
        })
        .ok_or_else(|| {
            format!(
                "Machine {key} has no status.addresses entry of type {} to reach node {node}'s agent",
                settings.address_types.join(" or ")
            )
        })?;
    let host = if address.contains(':') {
        format!("[{address}]")
    } else {
        address.to_owned()
    };
    Ok((node, format!("https://{host}:{}", settings.agent_port)))
}

// === The CA's proof ===

/// Why a `<cluster>-ca` Secret does not prove its CA (no word of the Secret's content).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaRefused {
    /// `tls.crt` is missing or empty.
    #[error("has no key {CA_CERT_KEY}")]
    NoCertificate,
    /// `tls.crt` does not hold exactly one PEM certificate and nothing else.
    #[error("key {CA_CERT_KEY} must hold exactly one PEM certificate; it holds {0}")]
    NotOneCertificate(String),
    /// The certificate does not parse.
    #[error("key {CA_CERT_KEY} holds a certificate that does not parse as X.509")]
    Unparsable,
    /// The certificate is not a CA.
    #[error("key {CA_CERT_KEY} holds a certificate that is not a CA (no basicConstraints CA:true)")]
    NotCa,
    /// `tls.key` is missing or empty: a CA Cluster API does not hold the key of.
    #[error(
        "has no key {CA_PRIVATE_KEY}, so it does not prove that {CA_CERT_KEY} is this cluster's \
         CA (a copy of another cluster's public CA certificate would look the same). For a \
         cluster whose CA is managed outside Cluster API, serve its namespace from an \
         ExtensionConfig with settings.agentCA: File and issue its agents' certificates with \
         the cluster's URI SAN (docs/pki.md, \"An externally managed CA\")"
    )]
    NoKey,
    /// `tls.key` is not a private key this updater reads.
    #[error(
        "key {CA_PRIVATE_KEY} does not hold a PEM private key this updater reads (RSA, ECDSA \
         P-256 or P-384, Ed25519; PKCS#1, SEC1 or PKCS#8)"
    )]
    UnreadableKey,
    /// `tls.key` is another key than the certificate's.
    #[error(
        "key {CA_PRIVATE_KEY} is not the private key of the certificate in {CA_CERT_KEY}, so it \
         does not prove that the certificate is this cluster's CA"
    )]
    KeyMismatch,
    /// Too large to be a CA certificate or key.
    #[error("key {0} is larger than {MAX_PEM} bytes")]
    TooLarge(&'static str),
}

/// What `tls.crt` must be: exactly one PEM certificate, a CA. Returns its DER.
fn one_ca_certificate(pem: &[u8]) -> Result<CertificateDer<'static>, CaRefused> {
    if pem.is_empty() {
        return Err(CaRefused::NoCertificate);
    }
    if pem.len() > MAX_PEM {
        return Err(CaRefused::TooLarge(CA_CERT_KEY));
    }
    let mut certs = Vec::new();
    let mut others = 0usize;
    for section in <(SectionKind, Vec<u8>)>::pem_slice_iter(pem) {
        match section {
            Ok((SectionKind::Certificate, der)) => certs.push(der),
            Ok((_, mut der)) => {
                // Not a certificate (a key pasted into tls.crt, say): not kept.
                zeroize::Zeroize::zeroize(&mut der);
                others += 1;
            }
            Err(_) => return Err(CaRefused::NotOneCertificate("text that is not PEM".into())),
        }
    }
    if certs.len() != 1 || others != 0 {
        let said = match (certs.len(), others) {
            (0, 0) => "no PEM section".to_string(),
            (n, 0) => format!("{n} certificates"),
            (n, o) => format!("{n} certificate(s) and {o} other PEM section(s)"),
        };
        return Err(CaRefused::NotOneCertificate(said));
    }
    let der = certs.remove(0);
    let (rest, cert) =
        x509_parser::parse_x509_certificate(&der).map_err(|_| CaRefused::Unparsable)?;
    if !rest.is_empty() {
        return Err(CaRefused::Unparsable);
    }
    match cert.basic_constraints() {
        Ok(Some(bc)) if bc.value.ca => {}
        Ok(_) => return Err(CaRefused::NotCa),
        Err(_) => return Err(CaRefused::Unparsable),
    }
    Ok(CertificateDer::from(der))
}

/// Proves that `key_pem` is the private key of the CA certificate in `cert_pem` (exactly one
/// certificate, a CA): the key's public key, which the key's parser derives from the private
/// parts (ring checks RSA's components for consistency and computes an EC or Ed25519 public
/// key from the private scalar), must be the certificate's SubjectPublicKeyInfo. Returns the
/// certificate's DER. The key is zeroed before this returns, whatever the outcome; nothing of
/// it is returned or said.
pub(in crate::edge) fn prove_ca(
    cert_pem: &[u8],
    key_pem: Option<Zeroizing<Vec<u8>>>,
) -> Result<CertificateDer<'static>, CaRefused> {
    let der = one_ca_certificate(cert_pem)?;
    let key_pem = key_pem.filter(|k| !k.is_empty()).ok_or(CaRefused::NoKey)?;
    if key_pem.len() > MAX_PEM {
        return Err(CaRefused::TooLarge(CA_PRIVATE_KEY));
    }
    let key = Zeroizing::new(
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| CaRefused::UnreadableKey)?,
    );
    drop(key_pem);
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|_| CaRefused::UnreadableKey)?;
    drop(key);
    let key_spki = signing.public_key().ok_or(CaRefused::UnreadableKey)?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).map_err(|_| CaRefused::Unparsable)?;
    let (_, from_key) =
        SubjectPublicKeyInfo::from_der(key_spki.as_ref()).map_err(|_| CaRefused::UnreadableKey)?;
    let in_cert = cert.public_key();
    // The named curve of an EC key (none for RSA and Ed25519).
    let curve = |spki: &SubjectPublicKeyInfo<'_>| -> Option<String> {
        spki.algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok())
            .map(|oid| oid.to_id_string())
    };
    let same = from_key.algorithm.algorithm == in_cert.algorithm.algorithm
        && from_key.subject_public_key.data == in_cert.subject_public_key.data
        && (curve(&from_key).is_none() || curve(&from_key) == curve(in_cert));
    if !same {
        return Err(CaRefused::KeyMismatch);
    }
    Ok(der)
}

// === ClusterCas ===

/// What a CA Secret's version proved.
type Proven = Result<Arc<ClusterCa>, String>;

/// The workload clusters' CAs read so far, by Secret (`namespace/name`): when read, its
/// resourceVersion, and what that version proved. The key is never kept.
#[derive(Debug)]
pub struct ClusterCas {
    cache: Mutex<HashMap<String, (Instant, String, Proven)>>,
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

impl ClusterCas {
    /// The agent of the live Machine `key` (`namespace/name`) under the effective
    /// `settings`: where it is, its node and how it is verified. Errors name the Machine,
    /// the node and the Secret, and say what to do.
    pub async fn peer(
        &self,
        cluster: &Cluster,
        settings: &Effective,
        live: &Value,
        key: &str,
    ) -> Result<Peer, String> {
        let (node, target) = locate(live, settings, key)?;
        let id = ClusterId::of_machine(live, key).map_err(|e| format!("{e} (node {node})"))?;
        let trust = match settings.agent_ca {
            AgentCa::File => Trust::File(id),
            AgentCa::ClusterSecret => Trust::Cluster(
                self.get(cluster, &id)
                    .await
                    .map_err(|e| format!("Machine {key} (node {node}): {e}"))?,
            ),
        };
        Ok(Peer {
            target,
            node,
            trust,
        })
    }

    /// The proven CA of cluster `id`, read again after [`RECHECK`].
    async fn get(&self, cluster: &Cluster, id: &ClusterId) -> Result<Arc<ClusterCa>, String> {
        let name = secret_name(&id.name);
        let secret = format!("{}/{name}", id.namespace);
        let cached = self.lock().get(&secret).cloned();
        if let Some((at, _, proven)) = &cached
            && at.elapsed() < self.recheck
        {
            return proven.clone();
        }
        let what = format!("cluster {id}'s CA (settings.agentCA: ClusterSecret): Secret {secret}");
        let (version, mut data) = match cluster.secret_versioned(&id.namespace, &name).await {
            Ok(Some(found)) => found,
            Ok(None) => {
                return Err(format!(
                    "{what} does not exist; Cluster API creates it with the cluster, or set \
                     settings.agentCA to File for agents whose certificates come from the \
                     --agent-ca CA"
                ));
            }
            Err(e) => {
                // The API server did not answer: what the version known so far proved stands.
                if let Some((_, _, proven)) = cached {
                    tracing::warn!(%secret, error = %e, "cluster CA not read again; keeping the one known");
                    return proven;
                }
                return Err(format!("{what}: {e}"));
            }
        };
        let key = data.remove(CA_PRIVATE_KEY).map(Zeroizing::new);
        let proven = match cached {
            Some((_, known, proven)) if known == version => proven,
            _ => {
                let cert = data.remove(CA_CERT_KEY).unwrap_or_default();
                match prove_ca(&cert, key) {
                    Ok(der) => {
                        let fingerprint: [u8; 32] = sha2::Sha256::digest(der.as_ref()).into();
                        tracing::info!(%secret, %version, "cluster CA read and proven by its key");
                        Ok(Arc::new(ClusterCa {
                            cluster: id.clone(),
                            secret: secret.clone(),
                            version: version.clone(),
                            der,
                            fingerprint,
                        }))
                    }
                    Err(refused) => {
                        tracing::warn!(%secret, %version, reason = %refused, "cluster CA refused");
                        Err(format!("{what} {refused}"))
                    }
                }
            }
        };
        // Every value of the Secret is dropped here; the key was zeroed by `prove_ca`.
        drop(data);
        self.lock()
            .insert(secret, (Instant::now(), version, proven.clone()));
        proven
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, String, Proven)>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::standin::{ApiStandin, secret};
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

    /// A CA certificate and its key (PEM), of `alg`.
    fn ca(alg: &'static rcgen::SignatureAlgorithm) -> (String, String) {
        let key = KeyPair::generate_for(alg).unwrap();
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn key(pem: &str) -> Option<Zeroizing<Vec<u8>>> {
        Some(Zeroizing::new(pem.as_bytes().to_vec()))
    }

    #[test]
    fn a_ca_is_proven_only_by_its_own_key() {
        // The key of the certificate, for each kind of key a CA may have.
        for alg in [
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rcgen::PKCS_ECDSA_P384_SHA384,
            &rcgen::PKCS_ED25519,
        ] {
            let (cert, own) = ca(alg);
            let der = prove_ca(cert.as_bytes(), key(&own)).unwrap();
            assert!(!der.is_empty());
        }
        let (cert, own) = ca(&rcgen::PKCS_ECDSA_P256_SHA256);
        // Another key (of the same kind, and of another kind).
        let (_, other) = ca(&rcgen::PKCS_ECDSA_P256_SHA256);
        assert_eq!(
            prove_ca(cert.as_bytes(), key(&other)),
            Err(CaRefused::KeyMismatch)
        );
        let (_, other) = ca(&rcgen::PKCS_ECDSA_P384_SHA384);
        assert_eq!(
            prove_ca(cert.as_bytes(), key(&other)),
            Err(CaRefused::KeyMismatch)
        );
        // No key: the external CA mode, with what to do.
        for none in [None, key("")] {
            let e = prove_ca(cert.as_bytes(), none).unwrap_err();
            assert_eq!(e, CaRefused::NoKey);
            let e = e.to_string();
            assert!(
                e.contains("settings.agentCA: File") && e.contains("docs/pki.md"),
                "{e}"
            );
        }
        // Two certificates (a bundle), even with the key of the first.
        let (second, _) = ca(&rcgen::PKCS_ECDSA_P256_SHA256);
        let e = prove_ca(format!("{cert}{second}").as_bytes(), key(&own)).unwrap_err();
        assert_eq!(e, CaRefused::NotOneCertificate("2 certificates".into()));
        // A certificate and its key in tls.crt: not one certificate either.
        let e = prove_ca(format!("{cert}{own}").as_bytes(), key(&own)).unwrap_err();
        assert!(matches!(e, CaRefused::NotOneCertificate(_)), "{e}");
        // A certificate that is not a CA, with its own key.
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["node-a".to_string()])
            .unwrap()
            .self_signed(&leaf_key)
            .unwrap();
        assert_eq!(
            prove_ca(leaf.pem().as_bytes(), key(&leaf_key.serialize_pem())),
            Err(CaRefused::NotCa)
        );
        // Garbage, in either key; nothing of it is said.
        let garbage = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWJ5dGVz\n-----END PRIVATE KEY-----\n";
        let e = prove_ca(cert.as_bytes(), key(garbage)).unwrap_err();
        assert_eq!(e, CaRefused::UnreadableKey);
        assert!(!e.to_string().contains("c2VjcmV0"), "{e}");
        let e = prove_ca(cert.as_bytes(), key("not pem at all")).unwrap_err();
        assert_eq!(e, CaRefused::UnreadableKey);
        assert_eq!(
            prove_ca(b"not pem at all", key(&own)),
            Err(CaRefused::NotOneCertificate("no PEM section".into()))
        );
        let bad_der = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert_eq!(
            prove_ca(bad_der.as_bytes(), key(&own)),
            Err(CaRefused::Unparsable)
        );
        assert_eq!(prove_ca(b"", key(&own)), Err(CaRefused::NoCertificate));
    }

    #[test]
    fn an_rsa_ca_as_cluster_api_makes_it_is_proven_by_its_pkcs1_key() {
        // Cluster API's CA key: RSA, PEM "RSA PRIVATE KEY" (PKCS#1; cluster-api util/certs
        // EncodePrivateKeyPEM). A fixture made once with openssl (test-only material).
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/updater/cluster-ca");
        let cert = std::fs::read(dir.join("tls.crt")).unwrap();
        let pkcs1 = std::fs::read(dir.join("tls.key")).unwrap();
        assert!(pkcs1.starts_with(b"-----BEGIN RSA PRIVATE KEY-----"));
        prove_ca(&cert, Some(Zeroizing::new(pkcs1))).unwrap();
        let other = std::fs::read(dir.join("other.key")).unwrap();
        assert_eq!(
            prove_ca(&cert, Some(Zeroizing::new(other))),
            Err(CaRefused::KeyMismatch)
        );
    }

    #[tokio::test]
    async fn a_clusters_ca_is_read_once_per_recheck_and_proven_again_on_a_new_version() {
        let api = ApiStandin::start().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let cluster = Cluster::connect(Some(&kubeconfig)).await.unwrap();
        let (one_cert, one_key) = ca(&rcgen::PKCS_ECDSA_P256_SHA256);
        let (two_cert, two_key) = ca(&rcgen::PKCS_ECDSA_P256_SHA256);
        let with_version = |cert: &str, key: &str, version: &str| {
            let mut s = secret(
                "ns",
                "red-ca",
                &[
                    (CA_CERT_KEY, cert.as_bytes()),
                    (CA_PRIVATE_KEY, key.as_bytes()),
                ],
            );
            s["metadata"]["resourceVersion"] = serde_json::json!(version);
            s
        };
        api.put(with_version(&one_cert, &one_key, "7"));
        let gets = |api: &ApiStandin| {
            api.requests()
                .iter()
                .filter(|(_, p)| p.ends_with("/secrets/red-ca"))
                .count()
        };
        let red = ClusterId {
            namespace: "ns".into(),
            name: "red".into(),
        };

        // Within the recheck: one read.
        let cas = ClusterCas::default();
        let one = cas.get(&cluster, &red).await.unwrap();
        assert_eq!(one.version(), "7");
        assert_eq!(one.secret(), "ns/red-ca");
        assert!(Arc::ptr_eq(&one, &cas.get(&cluster, &red).await.unwrap()));
        assert_eq!(gets(&api), 1);

        // Read again after it: the same version is the same CA (its channels are kept); a
        // new version is proven again.
        let cas = ClusterCas {
            recheck: Duration::ZERO,
            ..ClusterCas::default()
        };
        let first = cas.get(&cluster, &red).await.unwrap();
        let again = cas.get(&cluster, &red).await.unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        api.put(with_version(&two_cert, &two_key, "8"));
        let rotated = cas.get(&cluster, &red).await.unwrap();
        assert_eq!(rotated.version(), "8");
        assert_ne!(rotated.fingerprint(), first.fingerprint());
        assert_ne!(Trust::Cluster(first), Trust::Cluster(rotated));
        // A version whose key is another's: refused, naming the Secret, echoing nothing.
        api.put(with_version(&two_cert, &one_key, "9"));
        let e = cas.get(&cluster, &red).await.unwrap_err();
        assert!(
            e.contains("Secret ns/red-ca key tls.key is not the private key"),
            "{e}"
        );
        assert!(!e.contains("PRIVATE KEY-----"), "{e}");

        // No Secret, or no tls.crt: named, with what to do.
        let green = ClusterId {
            namespace: "ns".into(),
            name: "green".into(),
        };
        let e = cas.get(&cluster, &green).await.unwrap_err();
        assert!(
            e.contains("Secret ns/green-ca does not exist")
                && e.contains("settings.agentCA to File"),
            "{e}"
        );
        api.put(secret("ns", "blue-ca", &[("ca.crt", b"x")]));
        let blue = ClusterId {
            namespace: "ns".into(),
            name: "blue".into(),
        };
        let e = cas.get(&cluster, &blue).await.unwrap_err();
        assert!(e.contains("has no key tls.crt"), "{e}");
    }
}
