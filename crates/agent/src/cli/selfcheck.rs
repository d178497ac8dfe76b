//! The start-up self-check of `serve` (and `config check`): before anything is opened, the
//! settings validate (the node name among them), the TLS files are there, readable and of
//! the right kind, the server certificate names the node, the CA bundle parses, somebody may
//! call the agent's admin methods, and the state directory can be written. Every problem is
//! found in one go, not only the first: each says which setting, which file, and how to fix
//! it; `serve` exits 2 on any of them (the unit's `RestartPreventExitStatus=2`: a restart
//! would not fix a configuration).

use std::path::{Path, PathBuf};

use crate::config::{DaemonSettings, Unresolved};
use inplace_api::authz::AuthzRules;
use inplace_api::tls::{self, ServerTlsPaths};

/// One thing that keeps the agent from serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// What is wrong, naming the setting and the file.
    pub what: String,
    /// How to fix it, naming a key of the configuration file and a flag.
    pub fix: String,
    /// A TLS file that does not exist: the agent is not configured yet (`--check-configured`).
    pub missing_file: bool,
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

/// What the check looks at: the validated settings, or what is known of settings that did
/// not validate (their problems are then the check's first).
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// The TLS files.
    pub tls: &'a ServerTlsPaths,
    /// The roles.
    pub rules: &'a AuthzRules,
    /// The node's name, when it is known and valid.
    pub node_name: Option<&'a str>,
    /// The state directory.
    pub state_dir: &'a Path,
    /// The settings' own problems (`None`: they validated).
    pub unresolved: Option<&'a Unresolved>,
}

impl<'a> Subject<'a> {
    /// The validated settings.
    pub fn of(settings: &'a DaemonSettings) -> Subject<'a> {
        Subject {
            tls: &settings.tls,
            rules: &settings.rules,
            node_name: Some(&settings.node_name),
            state_dir: &settings.settings.engine.state_dir,
            unresolved: None,
        }
    }

    /// Settings that did not validate: their problems, and the rest checked as far as known.
    pub fn of_unresolved(unresolved: &'a Unresolved) -> Subject<'a> {
        Subject {
            tls: &unresolved.tls,
            rules: &unresolved.rules,
            node_name: unresolved.node_name.as_deref(),
            state_dir: &unresolved.state_dir,
            unresolved: Some(unresolved),
        }
    }

    /// Whichever of the two a resolution gave.
    pub fn of_result(resolved: &'a Result<DaemonSettings, Box<Unresolved>>) -> Subject<'a> {
        match resolved {
            Ok(settings) => Subject::of(settings),
            Err(unresolved) => Subject::of_unresolved(unresolved),
        }
    }
}

/// Checks what `serve` needs before it opens anything; `config` is the file the settings came
/// from (for the fixes). Every problem is named, not only the first.
pub fn check(subject: Subject<'_>, config: Option<&Path>) -> Findings {
    let mut found = Findings::default();
    if let Some(unresolved) = subject.unresolved {
        for p in &unresolved.problems {
            found.problems.push(Problem {
                what: p.what.clone(),
                fix: p.fix.clone().unwrap_or_else(|| {
                    format!(
                        "correct that setting in {} (docs/configuration.md names each key and \
                         its flag)",
                        config
                            .map(|f| f.display().to_string())
                            .unwrap_or_else(|| "the flags".into())
                    )
                }),
                missing_file: false,
            });
        }
    }
    let paths = subject.tls;
    let node = subject.node_name.unwrap_or("NODE");
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
                missing_file: e.kind() == std::io::ErrorKind::NotFound,
            });
        }
    }
    if readable {
        check_material(paths, subject.node_name, config, &mut found);
    }
    let rules = subject.rules;
    if rules.admin().is_empty() {
        let readers = if rules.reader().is_empty() {
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
            missing_file: false,
        });
    }
    check_state_dir(subject.state_dir, config, &mut found);
    found
}

/// The state directory (journal, backups) must be a directory the agent can write, or one
/// it can create: checked without creating anything.
fn check_state_dir(dir: &Path, config: Option<&Path>, found: &mut Findings) {
    use rustix::fs::{Access, access};
    let elsewhere = setting("node.state_dir", "--state-dir", config);
    // The directory, or the nearest ancestor that exists (where it would be created).
    let mut at = dir;
    while !at.exists() {
        match at.parent() {
            Some(parent) => at = parent,
            None => return,
        }
    }
    let what = if at == dir {
        format!("node.state_dir {}", dir.display())
    } else {
        format!(
            "node.state_dir {} cannot be created: {}",
            dir.display(),
            at.display()
        )
    };
    if !at.is_dir() {
        found.problems.push(Problem {
            what: format!("{what}: not a directory"),
            fix: format!("remove what is there, or point {elsewhere} at a directory"),
            missing_file: false,
        });
    } else if let Err(e) = access(at, Access::WRITE_OK | Access::EXEC_OK) {
        let why = match e {
            rustix::io::Errno::ROFS => "on a read-only filesystem".to_string(),
            rustix::io::Errno::ACCESS | rustix::io::Errno::PERM => {
                "not writable by this process".to_string()
            }
            other => std::io::Error::from(other).to_string(),
        };
        let root = super::not_root_hint_for_node()
            .map(|_| "run the agent as root, or ")
            .unwrap_or_default();
        found.problems.push(Problem {
            what: format!("{what}: {why}"),
            fix: format!("{root}point {elsewhere} at a writable directory"),
            missing_file: false,
        });
    }
}

fn io_words(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => e.to_string(),
    }
}

/// The files are readable: are they what they must be?
fn check_material(
    paths: &ServerTlsPaths,
    node: Option<&str>,
    config: Option<&Path>,
    found: &mut Findings,
) {
    let mut parsed = true;
    match tls::load_certificates(&paths.cert) {
        Ok(chain) => {
            if let Some(leaf) = chain.first() {
                check_leaf(leaf, paths, node, config, found)
            }
        }
        Err(e) => {
            parsed = false;
            found.problems.push(Problem {
                what: format!("tls.cert: {e}"),
                fix: format!(
                    "tls.cert must be the server certificate chain in PEM, leaf first ({})",
                    setting("tls.cert", "--tls-cert", config)
                ),
                missing_file: false,
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
            missing_file: false,
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
            missing_file: false,
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
            missing_file: false,
        });
    }
}

/// The leaf must name the node (the updater verifies the node name); its validity is only
/// warned about (it may be renewed in place).
fn check_leaf(
    der: &rustls::pki_types::CertificateDer<'_>,
    paths: &ServerTlsPaths,
    node: Option<&str>,
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
            missing_file: false,
        });
        return;
    };
    let names = dns_names(&cert);
    // Without a node name (itself a problem) there is nothing to compare the names with.
    if let Some(node) = node
        && !names.iter().any(|n| name_matches(n, node))
    {
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
            missing_file: false,
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
