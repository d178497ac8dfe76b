//! The start-up self-check of `serve` (and `config check`): before anything is opened, the
//! TLS files are there, readable and of the right kind, the server certificate names the
//! node, the CA bundle parses, and somebody may call the agent's admin methods. Each problem
//! says which setting, which file, and how to fix it; `serve` exits 2 on any of them (the
//! unit's `RestartPreventExitStatus=2`: a restart would not fix a configuration).

use std::path::{Path, PathBuf};

use crate::config::DaemonSettings;
use inplace_api::tls::{self, ServerTlsPaths};

/// One thing that keeps the agent from serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// What is wrong, naming the setting and the file.
    pub what: String,
    /// How to fix it, naming a key of the configuration file and a flag.
    pub fix: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}\n  fix: {}", self.what, self.fix)
    }
}

/// What the check found: problems stop the agent, warnings are logged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    /// Each keeps the agent from serving.
    pub problems: Vec<Problem>,
    /// Worth saying, not worth refusing to start over (an expired certificate may be
    /// renewed in place: the agent re-reads it).
    pub warnings: Vec<String>,
}

/// Where a setting comes from, for the fixes: `tls.cert in /etc/inplace-agent/config.toml
/// (or --tls-cert)`.
fn setting(key: &str, flag: &str, config: Option<&Path>) -> String {
    match config {
        Some(file) => format!("{key} in {} (or {flag})", file.display()),
        None => format!("{flag} (or {key} in a configuration file)"),
    }
}

/// The TLS files of the configuration that do not exist: an agent without them is not
/// configured yet (the unit's `ExecCondition=` waits for them quietly).
pub fn missing_tls_files(paths: &ServerTlsPaths) -> Vec<PathBuf> {
    [&paths.cert, &paths.key, &paths.client_ca]
        .into_iter()
        .filter(|p| !p.exists())
        .cloned()
        .collect()
}

/// Checks what `serve` needs before it opens anything; `config` is the file the settings came
/// from (for the fixes).
pub fn check(settings: &DaemonSettings, config: Option<&Path>) -> Findings {
    let mut found = Findings::default();
    let paths = &settings.tls;
    let node = &settings.node_name;
    let pki_init = format!(
        "for a first try, `inplace-agent pki init {} --node-name {node}` makes throwaway ones \
         (docs/pki.md)",
        paths
            .cert
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| ".".into())
    );
    let files = [
        (
            "tls.cert",
            "--tls-cert",
            &paths.cert,
            "the agent's server certificate",
        ),
        ("tls.key", "--tls-key", &paths.key, "its private key"),
        (
            "tls.client_ca",
            "--client-ca",
            &paths.client_ca,
            "the CA bundle the updater's client certificate chains to",
        ),
    ];
    let mut readable = true;
    for (key, flag, path, what) in files {
        if let Err(e) = std::fs::read(path) {
            // The first missing file says how to make throwaway ones, once.
            let first = if readable {
                format!("; {pki_init}")
            } else {
                String::new()
            };
            readable = false;
            found.problems.push(Problem {
                what: format!("{key} {}: {}", path.display(), io_words(&e)),
                fix: format!(
                    "put {what} there, or point {} at it{first}",
                    setting(key, flag, config)
                ),
            });
        }
    }
    if readable {
        check_material(paths, node, config, &mut found);
    }
    if settings.rules.admin().is_empty() {
        let readers = if settings.rules.reader().is_empty() {
            "no identity may call the agent at all"
        } else {
            "only readers may call the agent"
        };
        found.problems.push(Problem {
            what: format!(
                "authorization.admin is empty: {readers}, so no updater can apply, cancel or \
                 retry a plan"
            ),
            fix: format!(
                "list the updater's identity (its client certificate's URI SAN, else DNS SAN, \
                 else CN) in {}, e.g. admin = [\"spiffe://inplace-agent/updater\"] under \
                 [authorization]",
                setting("authorization.admin", "--admin", config)
            ),
        });
    }
    found
}

fn io_words(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => e.to_string(),
    }
}

/// The files are readable: are they what they must be?
fn check_material(paths: &ServerTlsPaths, node: &str, config: Option<&Path>, found: &mut Findings) {
    let mut parsed = true;
    match tls::load_certificates(&paths.cert) {
        Ok(chain) => check_leaf(&chain[0], paths, node, config, found),
        Err(e) => {
            parsed = false;
            found.problems.push(Problem {
                what: format!("tls.cert: {e}"),
                fix: format!(
                    "tls.cert must be the server certificate chain in PEM, leaf first ({})",
                    setting("tls.cert", "--tls-cert", config)
                ),
            });
        }
    }
    if let Err(e) = tls::load_private_key(&paths.key) {
        parsed = false;
        found.problems.push(Problem {
            what: format!("tls.key: {e}"),
            fix: format!(
                "tls.key must be the certificate's private key in PEM (PKCS#8, PKCS#1 or SEC1) \
                 ({})",
                setting("tls.key", "--tls-key", config)
            ),
        });
    }
    let ca = tls::load_certificates(&paths.client_ca).and_then(|certs| {
        let mut roots = rustls::RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            Err(tls::TlsError::NoTrustAnchor {
                path: paths.client_ca.clone(),
                detail: "no certificate in it is usable as a CA".into(),
            })
        } else {
            Ok(())
        }
    });
    if let Err(e) = ca {
        parsed = false;
        found.problems.push(Problem {
            what: format!("tls.client_ca: {e}"),
            fix: format!(
                "tls.client_ca must hold the CA certificates (PEM) that issue the updater's \
                 client certificates ({})",
                setting("tls.client_ca", "--client-ca", config)
            ),
        });
    }
    if parsed && let Err(e) = tls::server_config(paths) {
        found.problems.push(Problem {
            what: format!("tls: {e}"),
            fix: format!(
                "tls.key must be the private key of the certificate in tls.cert ({} and {})",
                setting("tls.cert", "--tls-cert", config),
                setting("tls.key", "--tls-key", config)
            ),
        });
    }
}

/// The leaf must name the node (the updater verifies the node name); its validity is only
/// warned about (it may be renewed in place).
fn check_leaf(
    der: &rustls::pki_types::CertificateDer<'_>,
    paths: &ServerTlsPaths,
    node: &str,
    config: Option<&Path>,
    found: &mut Findings,
) {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        found.problems.push(Problem {
            what: format!(
                "tls.cert {}: the first certificate cannot be parsed",
                paths.cert.display()
            ),
            fix: "tls.cert must be a PEM X.509 certificate chain, leaf first".to_string(),
        });
        return;
    };
    let names = dns_names(&cert);
    if !names.iter().any(|n| name_matches(n, node)) {
        let has = if names.is_empty() {
            "no DNS names".to_string()
        } else {
            format!("only {}", names.join(", "))
        };
        found.problems.push(Problem {
            what: format!(
                "tls.cert {} does not name this node {node:?} (it has {has}): the updater \
                 verifies the agent's certificate for the node name",
                paths.cert.display()
            ),
            fix: format!(
                "issue the agent's certificate with the DNS name {node} (docs/pki.md; `inplace-agent \
                 pki init DIR --node-name {node}` for a first try), or, if {node:?} is not the \
                 node's Kubernetes name, set {}",
                setting("node.name", "--node-name", config)
            ),
        });
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let validity = cert.validity();
    let at =
        |t: i64| inplace_base::time::rfc3339(u64::try_from(t).unwrap_or(0).saturating_mul(1000));
    if validity.not_after.timestamp() < now {
        found.warnings.push(format!(
            "tls.cert {} expired at {}: clients refuse it until it is renewed (the agent \
             re-reads it when it changes)",
            paths.cert.display(),
            at(validity.not_after.timestamp())
        ));
    } else if validity.not_before.timestamp() > now {
        found.warnings.push(format!(
            "tls.cert {} is valid only from {}: is a clock wrong?",
            paths.cert.display(),
            at(validity.not_before.timestamp())
        ));
    }
}

fn dns_names(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    let Ok(Some(sans)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    sans.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .collect()
}

/// Whether a certificate's DNS name covers `node`: the same name (ASCII case does not
/// matter), or a wildcard `*.suffix` for a node name with one more label.
pub fn name_matches(pattern: &str, node: &str) -> bool {
    let (pattern, node) = (pattern.to_ascii_lowercase(), node.to_ascii_lowercase());
    match pattern.strip_prefix("*.") {
        Some(suffix) => node
            .split_once('.')
            .is_some_and(|(first, rest)| !first.is_empty() && rest == suffix),
        None => pattern == node,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_cover_one_label() {
        assert!(name_matches("worker-1", "worker-1"));
        assert!(name_matches("Worker-1", "worker-1"));
        assert!(name_matches("*.nodes.example", "worker-1.nodes.example"));
        assert!(!name_matches("*.nodes.example", "worker-1"));
        assert!(!name_matches("*.example", "worker-1.nodes.example"));
        assert!(!name_matches("worker-10", "worker-1"));
    }
}
