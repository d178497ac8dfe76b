//! The files a Machine's bootstrap data wrote: where the `files[]` of a Machine's first
//! in-place update came from, so that a file dropped from that list is removed although no
//! plan ever wrote it (docs/decisions/0009-bootstrap-files.md).
//!
//! CABPK (Cluster API's kubeadm bootstrap provider) renders the KubeadmConfig once, when the
//! Machine is created, into the Secret `spec.bootstrap.dataSecretName` names: key `value`
//! holds the document, key `format` says which (`cloud-config`, the default when empty, or
//! `ignition`). Its file list is the user's `files[]` at that time plus what CABPK writes
//! for itself; [`user_files`] returns the paths of the first, never of the second.
//!
//! What CABPK writes for itself, read in kubernetes-sigs/cluster-api:
//! - `bootstrap/kubeadm/internal/cloudinit/node.go`, `controlplane_init.go`,
//!   `controlplane_join.go`: the kubeadm configuration (`/run/kubeadm/kubeadm.yaml`,
//!   `/run/kubeadm/kubeadm-join-config.yaml`; `/tmp/kubeadm.yaml`,
//!   `/tmp/kubeadm-join-config.yaml`, `/tmp/kubeadm-controlplane-join-config.yaml` in older
//!   releases), the placeholder `/run/cluster-api/placeholder`, and in recent trees more
//!   files under `/run/cluster-api/` (the cluster configuration, the kubeadm version);
//! - `bootstrap/kubeadm/internal/cloudinit/cloudinit.go`: the join retry script
//!   `/usr/local/bin/kubeadm-bootstrap-script` (`useExperimentalRetryJoin`);
//! - `util/secret/certificates.go` (`Certificates.AsFiles`, used by the control-plane
//!   templates): `ca`, `etcd/ca`, `front-proxy-ca` (`.crt`, `.key`) and `sa.pub`, `sa.key`
//!   under `clusterConfiguration.certificatesDir` (`/etc/kubernetes/pki`), or with an
//!   external etcd its `caFile`, `certFile` and `keyFile`;
//! - `bootstrap/kubeadm/internal/controllers/kubeadmconfig_controller.go`: the discovery
//!   kubeconfig at `joinConfiguration.discovery.file.kubeConfigPath` (appended to the user's
//!   files); `storeBootstrapData`: the Secret's keys, the document stored as rendered (no
//!   base64 or gzip of its own);
//! - `bootstrap/kubeadm/internal/ignition/ignition.go`, `ignition/clc/clc.go` (Ignition):
//!   `/etc/kubeadm.sh`, `/etc/kubeadm.yml`, `/etc/ntp.conf`, `/etc/ssh/sshd_config`,
//!   `/etc/sudoers.d/<user>`, and whatever `ignition.containerLinuxConfig.additionalConfig`
//!   adds (merged into `storage.files`).
//!
//! Also never returned: entries that append (the file was there before), and paths that
//! are not plain absolute paths (cloud-init renders Jinja in them: the real path is unknown).
//!
//! Pure but for [`written`], which reads the Secret. The Secret holds a bootstrap token:
//! only paths leave this module; no error or log line carries the document's text.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::cluster::{Cluster, ClusterError};
use super::edge::yaml::{self, Limits, ParseError};
use super::translate::lookup;

/// The bootstrap data cannot be used; says why without quoting it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// The Machine names no bootstrap data Secret.
    #[error("spec.bootstrap.dataSecretName is not set")]
    NoSecretName,
    /// The Secret does not exist.
    #[error("bootstrap data secret {0} does not exist")]
    Missing(String),
    /// The Secret could not be read.
    #[error("{0}")]
    Read(String),
    /// The Secret has no `value` key.
    #[error("bootstrap data secret {0} has no key \"value\"")]
    NoValue(String),
    /// A `format` this updater does not parse.
    #[error("bootstrap data format {0:?} is not cloud-config or ignition")]
    Format(String),
    /// The document does not parse as its format says.
    #[error("bootstrap data is not a valid {format} document: {why}")]
    Malformed {
        /// `cloud-config` or `ignition`.
        format: &'static str,
        /// Where or what, never the text.
        why: String,
    },
    /// The document, or the KubeadmConfig's `additionalConfig`, is over a parsing limit
    /// ([`Limits::BOOTSTRAP_YAML`], [`Limits::BOOTSTRAP_JSON`]): CABPK never renders one, so it is refused, not skipped.
    #[error("bootstrap data ({format}) is refused: {field}{why}")]
    OverLimit {
        /// `cloud-config` or `ignition`.
        format: &'static str,
        /// The field over the limit with a `: ` after it, or empty for the document itself.
        field: &'static str,
        /// Which limit, its value and where.
        why: ParseError,
    },
}

/// What the document's parse gave: the entries, or why not (where, never what).
enum Unparsed {
    Malformed(String),
    OverLimit(&'static str, ParseError),
}

impl Unparsed {
    fn syntax(field: &'static str, e: ParseError) -> Unparsed {
        match e.limit() {
            Some(_) => Unparsed::OverLimit(field, e),
            None if field.is_empty() => Unparsed::Malformed(e.to_string()),
            None => Unparsed::Malformed(format!("{field}{e}")),
        }
    }
}

impl From<String> for Unparsed {
    fn from(why: String) -> Unparsed {
        Unparsed::Malformed(why)
    }
}

impl From<&str> for Unparsed {
    fn from(why: &str) -> Unparsed {
        Unparsed::Malformed(why.to_owned())
    }
}

/// The bootstrap data formats CABPK writes (`KubeadmConfig.spec.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// cloud-init `#cloud-config` (`write_files`).
    CloudConfig,
    /// Ignition JSON (`storage.files`).
    Ignition,
}

impl Format {
    /// The Secret's `format` value; empty (or absent) is CABPK's default, cloud-config.
    pub fn parse(format: &str) -> Result<Format, Unreadable> {
        match format.trim() {
            "" | "cloud-config" => Ok(Format::CloudConfig),
            "ignition" => Ok(Format::Ignition),
            other => Err(Unreadable::Format(bounded(other))),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Format::CloudConfig => "cloud-config",
            Format::Ignition => "ignition",
        }
    }
}

/// A format value for a message: short, printable (it is not the document, but still
/// comes from outside).
fn bounded(s: &str) -> String {
    s.chars().filter(|c| !c.is_control()).take(40).collect()
}

/// The paths of the user's files that `document` (bootstrap data in `format`) wrote, in
/// its order, without repeats: CABPK's own entries for the KubeadmConfig `spec` it was
/// rendered from (the desired spec: the fields that place CABPK's files roll out when they
/// change), appending entries and non-plain paths left out.
pub fn user_files(
    format: Format,
    document: &[u8],
    spec: &Value,
) -> Result<Vec<String>, Unreadable> {
    let unreadable = |u: Unparsed| match u {
        Unparsed::Malformed(why) => Unreadable::Malformed {
            format: format.name(),
            why,
        },
        Unparsed::OverLimit(field, why) => Unreadable::OverLimit {
            format: format.name(),
            field,
            why,
        },
    };
    // Where the UTF-8 breaks is not said: an offset into a Secret tells of its bytes.
    let text = std::str::from_utf8(document).map_err(|_| unreadable("not UTF-8".into()))?;
    let entries = match format {
        Format::CloudConfig => cloud_config_files(text).map_err(unreadable)?,
        Format::Ignition => ignition_files(text).map_err(unreadable)?,
    };
    let own = CabpkFiles::of(spec, format).map_err(unreadable)?;
    let mut seen = BTreeSet::new();
    Ok(entries
        .into_iter()
        .filter(|e| !e.append && plain_path(&e.path) && !own.contains(&e.path))
        .filter_map(|e| seen.insert(e.path.clone()).then_some(e.path))
        .collect())
}

/// One file entry of the document.
#[derive(Debug)]
struct Entry {
    path: String,
    append: bool,
}

/// `#cloud-config` `write_files[]`. CABPK starts the document with `## template: jinja`
/// and `#cloud-config`.
fn cloud_config_files(text: &str) -> Result<Vec<Entry>, Unparsed> {
    let header = text
        .lines()
        .map(str::trim_end)
        .take_while(|l| l.is_empty() || l.starts_with('#'))
        .any(|l| l == "#cloud-config");
    if !header {
        return Err("no #cloud-config header".into());
    }
    let doc = yaml::yaml(text, &Limits::BOOTSTRAP_YAML).map_err(|e| Unparsed::syntax("", e))?;
    let files = match doc.value().get("write_files") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(files)) => files,
        Some(_) => return Err("write_files is not a list".into()),
    };
    files
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let path = f
                .get("path")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("write_files[{i}].path is missing or not a string"))?;
            let append = match f.get("append") {
                Some(Value::Bool(b)) => *b,
                Some(Value::String(s)) => s.eq_ignore_ascii_case("true"),
                _ => false,
            };
            Ok(Entry {
                path: path.to_owned(),
                append,
            })
        })
        .collect()
}

/// Ignition `storage.files[]` (CABPK renders spec 2.3 through the Container Linux Config
/// transpiler; `append` is a boolean there, a list in spec 3).
fn ignition_files(text: &str) -> Result<Vec<Entry>, Unparsed> {
    let doc = yaml::json(text.as_bytes(), &Limits::BOOTSTRAP_JSON)
        .map_err(|e| Unparsed::syntax("", e))?
        .into_value();
    if !doc.get("ignition").is_some_and(Value::is_object) {
        return Err("no ignition object".into());
    }
    let files = match lookup(&doc, &["storage", "files"]) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(files)) => files,
        Some(_) => return Err("storage.files is not a list".into()),
    };
    files
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let path = f
                .get("path")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("storage.files[{i}].path is missing or not a string"))?;
            let append = match f.get("append") {
                Some(Value::Bool(b)) => *b,
                Some(Value::Array(a)) => !a.is_empty(),
                _ => false,
            };
            Ok(Entry {
                path: path.to_owned(),
                append,
            })
        })
        .collect()
}

/// A path an `absent` change can name: absolute, normal (no `.`, `..`, empty components),
/// and no template markup (cloud-init renders Jinja: the path on the node is another).
fn plain_path(p: &str) -> bool {
    inplace_plan::NodePath::parse(p).is_ok() && !p.contains("{{") && !p.contains("{%")
}

/// What CABPK writes for itself (see the module documentation for where each comes from).
struct CabpkFiles {
    paths: BTreeSet<String>,
    dirs: Vec<&'static str>,
}

/// CABPK's own files whatever the spec says.
const CABPK_PATHS: &[&str] = &[
    "/run/kubeadm/kubeadm.yaml",
    "/run/kubeadm/kubeadm-join-config.yaml",
    "/run/cluster-api/placeholder",
    "/usr/local/bin/kubeadm-bootstrap-script",
    "/tmp/kubeadm.yaml",
    "/tmp/kubeadm-join-config.yaml",
    "/tmp/kubeadm-controlplane-join-config.yaml",
];

/// Directories whose every file is CABPK's (`/run/cluster-api/` holds its sentinel and, in
/// recent releases, what workers learn of the cluster).
const CABPK_DIRS: &[&str] = &["/run/cluster-api/", "/run/kubeadm/"];

/// The Ignition flavour's own files (`clc.go`).
const IGNITION_PATHS: &[&str] = &[
    "/etc/kubeadm.sh",
    "/etc/kubeadm.yml",
    "/etc/ntp.conf",
    "/etc/ssh/sshd_config",
];

/// The Ignition flavour writes `/etc/sudoers.d/<user>` for each user with `sudo`.
const IGNITION_DIRS: &[&str] = &["/etc/sudoers.d/"];

/// The certificate authorities and keys a control-plane Machine gets, relative to the
/// certificates directory (`Certificates.AsFiles`).
const CERTIFICATES: &[&str] = &[
    "ca.crt",
    "ca.key",
    "etcd/ca.crt",
    "etcd/ca.key",
    "front-proxy-ca.crt",
    "front-proxy-ca.key",
    "sa.pub",
    "sa.key",
];

/// kubeadm's and CABPK's default certificates directory.
const DEFAULT_CERTIFICATES_DIR: &str = "/etc/kubernetes/pki";

impl CabpkFiles {
    fn of(spec: &Value, format: Format) -> Result<CabpkFiles, Unparsed> {
        let s = |path: &[&str]| {
            lookup(spec, path)
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        let mut paths: BTreeSet<String> = CABPK_PATHS.iter().map(|p| (*p).to_owned()).collect();
        let mut dirs: Vec<&'static str> = CABPK_DIRS.to_vec();
        let mut cert_dirs = vec![DEFAULT_CERTIFICATES_DIR.to_owned()];
        cert_dirs.extend(s(&["clusterConfiguration", "certificatesDir"]));
        for dir in &cert_dirs {
            for name in CERTIFICATES {
                paths.insert(format!("{}/{name}", dir.trim_end_matches('/')));
            }
        }
        for key in ["caFile", "certFile", "keyFile"] {
            paths.extend(s(&["clusterConfiguration", "etcd", "external", key]));
        }
        paths.extend(s(&["joinConfiguration", "caCertPath"]));
        paths.extend(s(&[
            "joinConfiguration",
            "discovery",
            "file",
            "kubeConfigPath",
        ]));
        if format == Format::Ignition {
            paths.extend(IGNITION_PATHS.iter().map(|p| (*p).to_owned()));
            dirs.extend(IGNITION_DIRS);
            if let Some(extra) = s(&["ignition", "containerLinuxConfig", "additionalConfig"]) {
                paths.extend(additional_config_files(&extra)?);
            }
        }
        Ok(CabpkFiles { paths, dirs })
    }

    fn contains(&self, path: &str) -> bool {
        self.paths.contains(path) || self.dirs.iter().any(|d| path.starts_with(d))
    }
}

/// `storage.files[].path` of a Container Linux Config (YAML) that CABPK merges into the
/// Ignition document: the user's, but not from `files[]`.
fn additional_config_files(clc: &str) -> Result<Vec<String>, Unparsed> {
    let doc = yaml::yaml(clc, &Limits::BOOTSTRAP_YAML)
        .map_err(|e| Unparsed::syntax("ignition.containerLinuxConfig.additionalConfig: ", e))?;
    let files = lookup(doc.value(), &["storage", "files"])
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    Ok(files
        .iter()
        .filter_map(|f| f.get("path").and_then(Value::as_str))
        .map(str::to_owned)
        .collect())
}

/// The user files of a Secret's data (`format`, `value`), `name` for messages.
pub fn from_secret(
    name: &str,
    data: &BTreeMap<String, Vec<u8>>,
    spec: &Value,
) -> Result<Vec<String>, Unreadable> {
    let format = data
        .get("format")
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .unwrap_or_default();
    let format = Format::parse(&format)?;
    let value = data
        .get("value")
        .ok_or_else(|| Unreadable::NoValue(name.to_owned()))?;
    user_files(format, value, spec)
}

// === the one read ===

/// The paths of the user files the live Machine's bootstrap data wrote, for the desired
/// KubeadmConfig `bootstrap` (none without one). When the data cannot be read or parsed,
/// none, and a warning naming the Machine and the reason: nothing is removed then. When it
/// (or the KubeadmConfig's `additionalConfig`) is over a parsing limit, an error naming the
/// Machine, the Secret and the limit: such a document is hostile or broken, never CABPK's,
/// and the update is refused rather than run without it.
pub(crate) async fn written(
    cluster: &Cluster,
    machine: &Value,
    bootstrap: Option<&Value>,
) -> Result<Vec<String>, String> {
    let Some(bootstrap) = bootstrap else {
        return Ok(Vec::new());
    };
    let meta = |k: &str| {
        lookup(machine, &["metadata", k])
            .and_then(Value::as_str)
            .unwrap_or("")
    };
    let (namespace, name) = (meta("namespace"), meta("name"));
    let spec = bootstrap.get("spec").unwrap_or(&Value::Null);
    match read(cluster, namespace, machine, spec).await {
        Ok(paths) => Ok(paths),
        Err(Unreadable::OverLimit { format, field, why }) => {
            let secret = lookup(machine, &["spec", "bootstrap", "dataSecretName"])
                .and_then(Value::as_str)
                .unwrap_or("");
            let what = if field.is_empty() {
                format!("the bootstrap data ({format}) in Secret {namespace}/{secret}")
            } else {
                format!("the KubeadmConfig's {}", field.trim_end_matches(": "))
            };
            let message = format!(
                "Machine {namespace}/{name}: {what} is refused: {why}; make it smaller or \
                 remove its aliases (docs/updater.md, \"Bootstrap data\")"
            );
            tracing::warn!(machine = %format!("{namespace}/{name}"), "{message}");
            Err(message)
        }
        Err(reason) => {
            tracing::warn!(
                machine = %format!("{namespace}/{name}"),
                %reason,
                "bootstrap data not used: files it wrote that files[] no longer lists are not removed"
            );
            Ok(Vec::new())
        }
    }
}

async fn read(
    cluster: &Cluster,
    namespace: &str,
    machine: &Value,
    spec: &Value,
) -> Result<Vec<String>, Unreadable> {
    let secret = lookup(machine, &["spec", "bootstrap", "dataSecretName"])
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or(Unreadable::NoSecretName)?;
    let full = format!("{namespace}/{secret}");
    let data = cluster
        .secret(namespace, secret)
        .await
        .map_err(|e: ClusterError| Unreadable::Read(e.to_string()))?
        .ok_or_else(|| Unreadable::Missing(full.clone()))?;
    from_secret(&full, &data, spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Bootstrap data as CABPK renders it (written by hand from its templates; see
    /// tests/fixtures/updater/README.md).
    const WORKER_CLOUD_CONFIG: &str =
        include_str!("../../../tests/fixtures/updater/bootstrap-data/worker.cloud-config");
    const CONTROL_PLANE_CLOUD_CONFIG: &str =
        include_str!("../../../tests/fixtures/updater/bootstrap-data/control-plane.cloud-config");
    const WORKER_IGNITION: &str =
        include_str!("../../../tests/fixtures/updater/bootstrap-data/worker.ignition.json");
    const CONTROL_PLANE_IGNITION: &str =
        include_str!("../../../tests/fixtures/updater/bootstrap-data/control-plane.ignition.json");

    const TOKEN: &str = "abcdef.0123456789abcdef";

    /// Whatever CABPK writes for itself in the fixtures: never a user file.
    fn is_cabpk_own(p: &str) -> bool {
        p.starts_with("/run/")
            || p.starts_with("/tmp/")
            || p.starts_with("/etc/kubernetes/pki/")
            || p.starts_with("/etc/kubeadm.")
            || p.starts_with("/etc/sudoers.d/")
            || p == "/etc/ssh/sshd_config"
            || p == "/etc/ntp.conf"
            || p == "/usr/local/bin/kubeadm-bootstrap-script"
    }

    fn files(format: Format, doc: &str, spec: &Value) -> Vec<String> {
        let got = user_files(format, doc.as_bytes(), spec).unwrap_or_else(|e| panic!("{e}"));
        for p in &got {
            assert!(!is_cabpk_own(p), "CABPK's own {p} returned");
        }
        got
    }

    #[test]
    fn a_worker_cloud_config_gives_the_users_files_only() {
        let spec =
            json!({"joinConfiguration": {"discovery": {"bootstrapToken": {"token": TOKEN}}}});
        assert_eq!(
            files(Format::CloudConfig, WORKER_CLOUD_CONFIG, &spec),
            [
                "/etc/kubernetes/inplace-demo.conf",
                "/etc/kubernetes/extra.conf"
            ],
            "the join configuration and the placeholder are CABPK's; /etc/environment was \
             appended to; the Jinja path is rendered on the node"
        );
    }

    #[test]
    fn a_control_plane_cloud_config_keeps_its_certificates_and_kubeadm_config() {
        let spec = json!({"clusterConfiguration": {}, "initConfiguration": {}});
        assert_eq!(
            files(Format::CloudConfig, CONTROL_PLANE_CLOUD_CONFIG, &spec),
            [
                "/etc/kubernetes/audit-policy.yaml",
                "/etc/kubernetes/inplace-demo.conf"
            ]
        );
    }

    #[test]
    fn a_worker_ignition_config_leaves_out_clc_files_and_the_additional_config() {
        let spec = json!({
            "format": "ignition",
            "ntp": {"enabled": true, "servers": ["0.pool.ntp.org"]},
            "users": [{"name": "capi", "sudo": "ALL=(ALL) NOPASSWD:ALL", "lockPassword": false}],
            "ignition": {"containerLinuxConfig": {"additionalConfig":
                "storage:\n  files:\n  - path: /etc/flatcar/update.conf\n    mode: 0644\n    contents:\n      inline: |\n        REBOOT_STRATEGY=off\n"}},
        });
        assert_eq!(
            files(Format::Ignition, WORKER_IGNITION, &spec),
            [
                "/etc/kubernetes/inplace-demo.conf",
                "/etc/kubernetes/extra.conf"
            ]
        );
    }

    #[test]
    fn a_control_plane_ignition_config_with_an_external_etcd_keeps_its_certificates() {
        let ext = "/etc/kubernetes/pki/etcd-external";
        let spec = json!({
            "format": "ignition",
            "clusterConfiguration": {"etcd": {"external": {
                "endpoints": ["https://10.0.0.9:2379"],
                "caFile": format!("{ext}/ca.crt"),
                "certFile": format!("{ext}/apiserver-etcd-client.crt"),
                "keyFile": format!("{ext}/apiserver-etcd-client.key"),
            }}},
        });
        assert_eq!(
            files(Format::Ignition, CONTROL_PLANE_IGNITION, &spec),
            ["/etc/kubernetes/audit-policy.yaml"]
        );
    }

    #[test]
    fn the_spec_places_certificates_and_the_discovery_kubeconfig() {
        let doc = "#cloud-config\nwrite_files:\n\
                   - {path: /srv/pki/ca.crt, content: x}\n\
                   - {path: /srv/pki/etcd/ca.key, content: x}\n\
                   - {path: /etc/kubernetes/discovery.conf, content: x}\n\
                   - {path: /etc/kubernetes/mine.conf, content: x}\n\
                   - {path: /etc/kubernetes/mine.conf, content: y}\n\
                   - {path: relative/x, content: x}\n\
                   - {path: /etc/kubernetes/../x, content: x}\n";
        let spec = json!({
            "clusterConfiguration": {"certificatesDir": "/srv/pki/"},
            "joinConfiguration": {"discovery": {"file": {"kubeConfigPath": "/etc/kubernetes/discovery.conf"}}},
        });
        assert_eq!(
            files(Format::CloudConfig, doc, &spec),
            ["/etc/kubernetes/mine.conf"]
        );
        // Without the spec's directories, they are user files like any other.
        assert_eq!(
            files(Format::CloudConfig, doc, &json!({})),
            [
                "/srv/pki/ca.crt",
                "/srv/pki/etcd/ca.key",
                "/etc/kubernetes/discovery.conf",
                "/etc/kubernetes/mine.conf"
            ]
        );
    }

    #[test]
    fn a_secrets_data_names_its_format_and_an_empty_one_is_cloud_config() {
        let data = |format: Option<&str>, value: &str| {
            let mut d = BTreeMap::new();
            if let Some(f) = format {
                d.insert("format".to_owned(), f.as_bytes().to_vec());
            }
            d.insert("value".to_owned(), value.as_bytes().to_vec());
            d
        };
        let spec = json!({});
        for format in [None, Some(""), Some("cloud-config")] {
            assert_eq!(
                from_secret("ns/m", &data(format, WORKER_CLOUD_CONFIG), &spec).unwrap(),
                [
                    "/etc/kubernetes/inplace-demo.conf",
                    "/etc/kubernetes/extra.conf"
                ]
            );
        }
        assert_eq!(
            from_secret("ns/m", &data(Some("ignition"), WORKER_IGNITION), &spec).unwrap(),
            [
                "/etc/kubernetes/inplace-demo.conf",
                "/etc/kubernetes/extra.conf",
                "/etc/flatcar/update.conf"
            ],
            "without the additionalConfig in the spec, its file reads as a user file"
        );
        assert_eq!(
            from_secret("ns/m", &data(Some("butane"), WORKER_CLOUD_CONFIG), &spec),
            Err(Unreadable::Format("butane".into()))
        );
        let mut no_value = data(None, "");
        no_value.remove("value");
        assert_eq!(
            from_secret("ns/m", &no_value, &spec),
            Err(Unreadable::NoValue("ns/m".into()))
        );
    }

    #[test]
    fn an_alias_bomb_is_over_a_limit_not_merely_unusable() {
        let mut bomb = format!(
            "#cloud-config\nbootcmd: &l [{}]\nruncmd: [*l",
            vec![TOKEN; 500].join(",")
        );
        while bomb.len() < 40_000 {
            bomb.push_str(",*l");
        }
        bomb.push_str("]\n");
        let e = user_files(Format::CloudConfig, bomb.as_bytes(), &json!({})).unwrap_err();
        assert!(
            matches!(&e, Unreadable::OverLimit { field: "", why, .. } if why.limit() == Some(yaml::Limit::Nodes)),
            "{e:?}"
        );
        assert!(!e.to_string().contains("abcdef"), "{e}");
        let spec = json!({"ignition": {"containerLinuxConfig": {"additionalConfig": bomb.trim_start_matches("#cloud-config\n")}}});
        let e = user_files(Format::Ignition, WORKER_IGNITION.as_bytes(), &spec).unwrap_err();
        assert!(
            matches!(&e, Unreadable::OverLimit { field, .. } if field.contains("additionalConfig")),
            "{e:?}"
        );
        assert!(e.to_string().contains("node count limit of 100000"), "{e}");
    }

    #[test]
    fn what_does_not_parse_is_refused_without_quoting_it() {
        let spec = json!({});
        let cases: &[(Format, Vec<u8>)] = &[
            (Format::CloudConfig, format!("#!/bin/sh\necho {TOKEN}\n").into_bytes()),
            (
                Format::CloudConfig,
                format!("#cloud-config\nwrite_files:\n- path: /etc/x\n  content: {TOKEN}\n bad: [\n")
                    .into_bytes(),
            ),
            (
                Format::CloudConfig,
                format!("#cloud-config\nwrite_files: {TOKEN}\n").into_bytes(),
            ),
            (
                Format::CloudConfig,
                format!("#cloud-config\nwrite_files:\n- content: {TOKEN}\n").into_bytes(),
            ),
            (Format::CloudConfig, b"#cloud-config\n\xff\xfe".to_vec()),
            (Format::Ignition, format!("{{\"token\": \"{TOKEN}\"").into_bytes()),
            (Format::Ignition, format!("{{\"token\": \"{TOKEN}\"}}").into_bytes()),
            (
                Format::Ignition,
                format!("{{\"ignition\": {{}}, \"storage\": {{\"files\": [{{\"path\": 7, \"x\": \"{TOKEN}\"}}]}}}}")
                    .into_bytes(),
            ),
        ];
        for (format, doc) in cases {
            let e = user_files(*format, doc, &spec).unwrap_err();
            assert!(matches!(e, Unreadable::Malformed { .. }), "{e:?}");
            let text = e.to_string();
            assert!(!text.contains(TOKEN), "{text}");
            assert!(!text.contains("abcdef"), "{text}");
        }
        let spec = json!({"ignition": {"containerLinuxConfig": {"additionalConfig": format!("storage: [{TOKEN}")}}});
        let e = user_files(Format::Ignition, WORKER_IGNITION.as_bytes(), &spec).unwrap_err();
        assert!(!e.to_string().contains(TOKEN), "{e}");
        // A cloud-config without files writes none.
        assert_eq!(
            user_files(
                Format::CloudConfig,
                b"#cloud-config\nruncmd: [true]\n",
                &spec
            ),
            Ok(Vec::new())
        );
    }
}
