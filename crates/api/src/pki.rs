//! `pki init`: a throwaway CA and certificates for trying the agent out.
//!
//! **Not for production.** The CA key sits next to the certificates it signs, nothing is
//! rotated and nothing is revoked. In production certificates come from cert-manager (see
//! docs/pki.md). What this writes into the directory:
//!
//! | file | what |
//! |---|---|
//! | `ca.crt`, `ca.key` | a self-signed CA (path length 0) |
//! | `server.crt`, `server.key` | the agent: SANs node name, `localhost`, `127.0.0.1` (and the cluster's URI SAN when given); serverAuth |
//! | `updater.crt`, `updater.key` | the updater: URI SAN (default `spiffe://inplace-agent/updater`); clientAuth |
//! | `reader.crt`, `reader.key` | a read-only client: URI SAN (default `spiffe://inplace-agent/reader`); clientAuth |
//!
//! Keys are ECDSA P-256, written with mode 0600; certificates 0644. Existing files are
//! never overwritten unless asked.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// Default identity of the updater's certificate (the admin).
pub const DEFAULT_UPDATER_IDENTITY: &str = "spiffe://inplace-agent/updater";

/// Default identity of the read-only client certificate.
pub const DEFAULT_READER_IDENTITY: &str = "spiffe://inplace-agent/reader";

/// What the URI SAN that binds an agent's serving certificate to its workload cluster
/// starts with ([`cluster_identity`]).
pub const CLUSTER_IDENTITY_PREFIX: &str = "spiffe://inplace-agent/cluster/";

/// Whether `s` can be a namespace or a Cluster's name (a DNS-1123 subdomain: at most 253
/// lowercase letters, digits, `-` and `.`, starting and ending with a letter or digit), so
/// it can stand in a [`cluster_identity`] as it is.
pub fn is_object_name(s: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    s.len() <= 253
        && edge(s.chars().next())
        && edge(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// The URI SAN that binds an agent's serving certificate to the workload cluster
/// `namespace/name` (the Cluster of the agent's Machine: the Machine's namespace and
/// `spec.clusterName`): `spiffe://inplace-agent/cluster/<namespace>/<name>`. With
/// `agentCA: File` the updater requires it (docs/pki.md, "An agent bound to its cluster").
pub fn cluster_identity(namespace: &str, name: &str) -> String {
    format!("{CLUSTER_IDENTITY_PREFIX}{namespace}/{name}")
}

/// What `pki init` creates.
#[derive(Debug, Clone)]
pub struct PkiInitOptions {
    /// Directory to write into; created with mode 0700 if missing (an existing directory
    /// keeps its mode).
    pub dir: PathBuf,
    /// The node's name, put into the server certificate's SANs.
    pub node_name: String,
    /// URI SAN of the updater (admin) certificate.
    pub updater_identity: String,
    /// URI SAN of the reader certificate.
    pub reader_identity: String,
    /// Validity of every certificate, from now.
    pub validity: Duration,
    /// Replace existing files instead of refusing.
    pub overwrite: bool,
    /// The workload cluster (`namespace`, `name`) the node belongs to: its
    /// [`cluster_identity`] is added to the server certificate as a URI SAN, which an updater
    /// with `agentCA: File` requires.
    pub cluster: Option<(String, String)>,
}

impl PkiInitOptions {
    /// Options with the default identities, one year of validity and no overwriting.
    pub fn new(dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        Self {
            dir: dir.into(),
            node_name: node_name.into(),
            updater_identity: DEFAULT_UPDATER_IDENTITY.to_owned(),
            reader_identity: DEFAULT_READER_IDENTITY.to_owned(),
            validity: Duration::from_secs(365 * 24 * 3600),
            overwrite: false,
            cluster: None,
        }
    }
}

/// The files `pki init` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PkiFiles {
    /// CA certificate (the agent's client CA and the clients' server CA).
    pub ca_cert: PathBuf,
    /// CA private key.
    pub ca_key: PathBuf,
    /// Agent certificate.
    pub server_cert: PathBuf,
    /// Agent private key.
    pub server_key: PathBuf,
    /// Updater (admin) certificate.
    pub updater_cert: PathBuf,
    /// Updater private key.
    pub updater_key: PathBuf,
    /// Reader certificate.
    pub reader_cert: PathBuf,
    /// Reader private key.
    pub reader_key: PathBuf,
}

impl PkiFiles {
    fn in_dir(dir: &Path) -> Self {
        Self {
            ca_cert: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            updater_cert: dir.join("updater.crt"),
            updater_key: dir.join("updater.key"),
            reader_cert: dir.join("reader.crt"),
            reader_key: dir.join("reader.key"),
        }
    }

    fn all(&self) -> [&Path; 8] {
        [
            &self.ca_cert,
            &self.ca_key,
            &self.server_cert,
            &self.server_key,
            &self.updater_cert,
            &self.updater_key,
            &self.reader_cert,
            &self.reader_key,
        ]
    }
}

/// `pki init` failed.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A file exists and overwriting was not requested.
    #[error("{} already exists (pass overwrite to replace it)", .0.display())]
    Exists(PathBuf),
    /// An option is unusable.
    #[error("invalid {field}: {detail}")]
    Invalid {
        /// The option.
        field: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// Generating a key or certificate failed.
    #[error("generate {what}: {source}")]
    Generate {
        /// The certificate being generated.
        what: &'static str,
        /// The underlying error.
        source: rcgen::Error,
    },
    /// Writing a file failed.
    #[error("write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Creates a CA and server, updater and reader certificates in `options.dir`.
pub fn init(options: &PkiInitOptions) -> Result<PkiFiles, PkiError> {
    let files = PkiFiles::in_dir(&options.dir);
    if !options.overwrite {
        if let Some(existing) = files.all().into_iter().find(|p| p.exists()) {
            return Err(PkiError::Exists(existing.to_owned()));
        }
    }
    if options.node_name.is_empty() {
        return Err(PkiError::Invalid {
            field: "node name",
            detail: "empty".into(),
        });
    }

    let not_before = time::OffsetDateTime::now_utc() - time::Duration::minutes(5);
    let validity = time::Duration::try_from(options.validity).map_err(|e| PkiError::Invalid {
        field: "validity",
        detail: e.to_string(),
    })?;
    let not_after = not_before + validity;

    // CA
    let ca_key = generate_key("ca key")?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = name("inplace-agent test CA (not for production)");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca_params.not_before = not_before;
    ca_params.not_after = not_after;
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(|source| PkiError::Generate { what: "ca", source })?;
    let issuer = Issuer::new(ca_params, ca_key);

    // Server: the node name plus loopback, serverAuth only (it cannot act as a client).
    let mut sans = vec![options.node_name.clone()];
    for extra in ["localhost", "127.0.0.1"] {
        if !sans.iter().any(|s| s == extra) {
            sans.push(extra.to_owned());
        }
    }
    let mut server = CertificateParams::new(sans).map_err(|source| PkiError::Generate {
        what: "server certificate",
        source,
    })?;
    server.distinguished_name = name(&options.node_name);
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    if let Some((namespace, cluster)) = &options.cluster {
        let invalid = |detail: String| PkiError::Invalid {
            field: "cluster",
            detail,
        };
        for (what, part) in [("namespace", namespace), ("name", cluster)] {
            if !is_object_name(part) {
                return Err(invalid(format!(
                    "the {what} {part:?} is not a Kubernetes object name (lowercase letters, \
                     digits, '-' and '.')"
                )));
            }
        }
        let uri = cluster_identity(namespace, cluster)
            .try_into()
            .map_err(|e: rcgen::Error| invalid(e.to_string()))?;
        server.subject_alt_names.push(SanType::URI(uri));
    }
    let server = leaf(server, not_before, not_after, &issuer, "server certificate")?;

    let updater = client_leaf(
        &options.updater_identity,
        "updater",
        "updater identity",
        not_before,
        not_after,
        &issuer,
    )?;
    let reader = client_leaf(
        &options.reader_identity,
        "reader",
        "reader identity",
        not_before,
        not_after,
        &issuer,
    )?;

    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&options.dir)
        .map_err(|source| PkiError::Write {
            path: options.dir.clone(),
            source,
        })?;
    write(
        &files.ca_cert,
        ca_cert.pem().as_bytes(),
        0o644,
        options.overwrite,
    )?;
    write(
        &files.ca_key,
        issuer.key().serialize_pem().as_bytes(),
        0o600,
        options.overwrite,
    )?;
    for ((cert, key), (cert_path, key_path)) in [server, updater, reader].iter().zip([
        (&files.server_cert, &files.server_key),
        (&files.updater_cert, &files.updater_key),
        (&files.reader_cert, &files.reader_key),
    ]) {
        write(cert_path, cert.as_bytes(), 0o644, options.overwrite)?;
        write(key_path, key.as_bytes(), 0o600, options.overwrite)?;
    }
    Ok(files)
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

fn generate_key(what: &'static str) -> Result<KeyPair, PkiError> {
    KeyPair::generate().map_err(|source| PkiError::Generate { what, source })
}

/// Signs `params` with a fresh key; returns (certificate PEM, key PEM).
fn leaf(
    mut params: CertificateParams,
    not_before: time::OffsetDateTime,
    not_after: time::OffsetDateTime,
    issuer: &Issuer<'_, KeyPair>,
    what: &'static str,
) -> Result<(String, String), PkiError> {
    let key = generate_key(what)?;
    params.not_before = not_before;
    params.not_after = not_after;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    let cert = params
        .signed_by(&key, issuer)
        .map_err(|source| PkiError::Generate { what, source })?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn client_leaf(
    identity: &str,
    common_name: &str,
    field: &'static str,
    not_before: time::OffsetDateTime,
    not_after: time::OffsetDateTime,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<(String, String), PkiError> {
    let invalid = |detail: String| PkiError::Invalid { field, detail };
    if !identity.contains(':') || identity.chars().any(|c| c.is_whitespace()) {
        return Err(invalid(format!("{identity:?} is not a uri")));
    }
    let uri = identity
        .try_into()
        .map_err(|e: rcgen::Error| invalid(e.to_string()))?;
    let mut params = CertificateParams::default();
    params.distinguished_name = name(common_name);
    params.subject_alt_names = vec![SanType::URI(uri)];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    leaf(params, not_before, not_after, issuer, field)
}

/// Writes a file with `mode` from the start (no window with wider permissions).
fn write(path: &Path, contents: &[u8], mode: u32, overwrite: bool) -> Result<(), PkiError> {
    let err = |source| PkiError::Write {
        path: path.to_owned(),
        source,
    };
    if overwrite {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(err)?;
    file.write_all(contents).map_err(err)?;
    file.sync_all().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authz::{IdentitySource, identity_from_certificate};
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use std::os::unix::fs::PermissionsExt;

    fn der(path: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(path).unwrap()
    }

    #[test]
    fn init_writes_usable_material() {
        let dir = tempfile::tempdir().unwrap();
        let files = init(&PkiInitOptions::new(dir.path().join("pki"), "worker-1")).unwrap();

        let dir_mode = std::fs::metadata(dir.path().join("pki"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o700);
        for key in [
            &files.ca_key,
            &files.server_key,
            &files.updater_key,
            &files.reader_key,
        ] {
            let mode = std::fs::metadata(key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }

        let server = der(&files.server_cert);
        let (_, parsed) = x509_parser::parse_x509_certificate(&server).unwrap();
        let eku = parsed.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.server_auth && !eku.client_auth);
        use x509_parser::extensions::GeneralName;
        let sans = &parsed
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names;
        assert!(
            matches!(
                sans.as_slice(),
                [
                    GeneralName::DNSName("worker-1"),
                    GeneralName::DNSName("localhost"),
                    GeneralName::IPAddress([127, 0, 0, 1]),
                ]
            ),
            "{sans:?}"
        );

        let updater = identity_from_certificate(&der(&files.updater_cert)).unwrap();
        assert_eq!(updater.source, IdentitySource::UriSan);
        assert_eq!(updater.value, DEFAULT_UPDATER_IDENTITY);
        let reader = identity_from_certificate(&der(&files.reader_cert)).unwrap();
        assert_eq!(reader.value, DEFAULT_READER_IDENTITY);

        // The material makes valid server and client TLS configurations.
        let server_paths = crate::tls::ServerTlsPaths::in_dir(&dir.path().join("pki"));
        crate::tls::server_config(&server_paths).unwrap();
        crate::tls::client_config(&crate::tls::ClientTlsPaths {
            ca: files.ca_cert.clone(),
            cert: files.updater_cert.clone(),
            key: files.updater_key.clone(),
        })
        .unwrap();
    }

    #[test]
    fn init_refuses_to_overwrite_unless_asked() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = PkiInitOptions::new(dir.path(), "worker-1");
        let first = init(&options).unwrap();
        let before = std::fs::read(&first.ca_cert).unwrap();
        let err = init(&options).unwrap_err();
        assert!(matches!(err, PkiError::Exists(_)), "{err}");
        assert_eq!(std::fs::read(&first.ca_cert).unwrap(), before);
        options.overwrite = true;
        init(&options).unwrap();
        assert_ne!(std::fs::read(&first.ca_cert).unwrap(), before);
    }

    #[test]
    fn init_binds_the_server_certificate_to_its_cluster_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let options = PkiInitOptions {
            cluster: Some(("team-a".into(), "prod".into())),
            ..PkiInitOptions::new(dir.path(), "worker-1")
        };
        let files = init(&options).unwrap();
        let server = der(&files.server_cert);
        let (_, parsed) = x509_parser::parse_x509_certificate(&server).unwrap();
        use x509_parser::extensions::GeneralName;
        let uris: Vec<_> = parsed
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::URI(u) => Some(*u),
                _ => None,
            })
            .collect();
        assert_eq!(uris, ["spiffe://inplace-agent/cluster/team-a/prod"]);

        let bad = PkiInitOptions {
            cluster: Some(("team-a".into(), "x/../y".into())),
            overwrite: true,
            ..PkiInitOptions::new(dir.path(), "worker-1")
        };
        let e = init(&bad).unwrap_err().to_string();
        assert!(e.contains("not a Kubernetes object name"), "{e}");
    }

    #[test]
    fn init_rejects_bad_identities() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = PkiInitOptions::new(dir.path(), "worker-1");
        options.updater_identity = "not a uri".into();
        let err = init(&options).unwrap_err().to_string();
        assert!(err.starts_with("invalid updater identity"), "{err}");
        assert!(!dir.path().join("ca.crt").exists());
    }
}
