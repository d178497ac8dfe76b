//! Throwaway PKIs: a node's (`inplace-agent pki init`'s code: a CA, the server certificate, the
//! updater's and a reader's client certificates) and a plain HTTPS server's (a CA and a
//! certificate for 127.0.0.1 and localhost, for the download tests and bench).

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tonic::transport::Channel;

use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::pki::{PkiFiles, PkiInitOptions};
use inplace_api::tls::{ClientTlsPaths, client_config, connect};

/// A node's PKI in a temp dir, removed on drop.
pub struct NodePki {
    _dir: tempfile::TempDir,
    /// The node name the server certificate is for.
    pub node: String,
    pub files: PkiFiles,
}

/// Which client certificate a client presents.
#[derive(Clone, Copy, Debug)]
pub enum As {
    /// The updater's identity: the admin role.
    Updater,
    /// The reader's identity: read-only calls.
    Reader,
}

impl NodePki {
    /// A fresh PKI for `node`.
    pub fn new(node: &str) -> Result<NodePki, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("pki temp dir: {e}"))?;
        let files = inplace_api::pki::init(&PkiInitOptions::new(dir.path().join("pki"), node))
            .map_err(|e| format!("pki init for {node}: {e}"))?;
        Ok(NodePki {
            _dir: dir,
            node: node.to_owned(),
            files,
        })
    }

    /// The CA, certificate and key files of a client.
    pub fn client_paths(&self, who: As) -> ClientTlsPaths {
        let f = &self.files;
        let (cert, key) = match who {
            As::Updater => (&f.updater_cert, &f.updater_key),
            As::Reader => (&f.reader_cert, &f.reader_key),
        };
        ClientTlsPaths {
            ca: f.ca_cert.clone(),
            cert: cert.clone(),
            key: key.clone(),
        }
    }

    /// The `--ca --cert --key --server-name` flags of the client commands.
    pub fn client_flags(&self, who: As) -> Vec<String> {
        let p = self.client_paths(who);
        vec![
            "--ca".into(),
            p.ca.display().to_string(),
            "--cert".into(),
            p.cert.display().to_string(),
            "--key".into(),
            p.key.display().to_string(),
            "--server-name".into(),
            self.node.clone(),
        ]
    }

    /// A gRPC client of the agent at `addr`; panics when it cannot connect.
    pub async fn client(&self, addr: &str, who: As) -> NodeAgentClient<Channel> {
        let config = client_config(&self.client_paths(who)).unwrap();
        let channel = connect(addr, Some(&self.node), Arc::new(config))
            .await
            .unwrap_or_else(|e| panic!("connect to {addr} as {who:?}: {e}"));
        NodeAgentClient::new(channel)
    }
}

/// A test CA (PEM) and an HTTPS server configuration for 127.0.0.1 and localhost signed by it.
pub struct HttpsPki {
    pub ca_pem: String,
    pub server: Arc<rustls::ServerConfig>,
}

/// A fresh [`HttpsPki`].
pub fn https_pki() -> HttpsPki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "inplace-agent test CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf_params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
    let certs: Vec<CertificateDer<'static>> = vec![leaf.der().clone()];
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    HttpsPki {
        ca_pem: ca_cert.pem(),
        server: Arc::new(server),
    }
}

/// The serving certificate a kubeadm control-plane node has, as the `apiServerCertificate`
/// change finds it: `<root>/etc/kubernetes/pki/apiserver.crt` and `.key` carrying `sans`,
/// signed by a fresh cluster CA written beside them as `ca.crt` and `ca.key` — unless the
/// tree has a `ca.crt` already (a stand-in's), which is then left as it is: the change reads
/// the CA only when it must reissue, and these certificates already carry the names.
pub fn control_plane_serving_certificate(root: &std::path::Path, sans: &[&str]) {
    let pki = root.join("etc/kubernetes/pki");
    std::fs::create_dir_all(&pki).unwrap();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kubernetes");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let mut leaf_params =
        rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
    leaf_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kube-apiserver");
    let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();
    std::fs::write(pki.join("apiserver.crt"), leaf.pem()).unwrap();
    std::fs::write(pki.join("apiserver.key"), leaf_key.serialize_pem()).unwrap();
    if !pki.join("ca.crt").exists() {
        std::fs::write(pki.join("ca.crt"), ca_cert.pem()).unwrap();
        std::fs::write(pki.join("ca.key"), ca_key.serialize_pem()).unwrap();
    }
}
