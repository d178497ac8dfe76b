//! `apiServerCertificate`: the API server's serving certificate (`<certificatesDir>/
//! apiserver.crt`) carries the names of `clusterConfiguration.apiServer.certSANs`, and none
//! of the previous ones it dropped; reissued in place from the node's cluster CA when it does
//! not (decision 0021). The new certificate is the content of an ordinary file write, so it
//! is backed up, journaled and rolled back like any file; `apiserver.key` is never read or
//! written, and `ca.key` is read only to sign, never kept.

use serde_json::{Map, Value, json};

use super::certificate::{self, MAX_PEM_BYTES, Reissue, San};
use super::{Diff, Kind, Mutation, Node, Note, StepCtx, Written};
use crate::parse::{Cx, join};
use crate::{Disruption, NodePath, Owner};
use inplace_base::{ErrorKind, Existing, FileMeta, StepError};
use zeroize::Zeroizing;

/// kubeadm's `clusterConfiguration.certificatesDir` by default.
pub const CERTIFICATES_DIR: &str = "/etc/kubernetes/pki";

/// The most names `certSANs` or `previous` may hold.
const MAX_NAMES: usize = 256;

/// `apiServerCertificate`: the serving certificate carries these names.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiServerCertificateChange {
    /// The desired `clusterConfiguration.apiServer.certSANs` (DNS names or IP addresses).
    pub cert_sans: Vec<String>,
    /// The current `certSANs`: each one not also in `cert_sans` leaves the certificate.
    pub previous: Vec<String>,
    /// kubeadm's `certificatesDir`: where `apiserver.crt`, `ca.crt` and `ca.key` are.
    pub certificates_dir: NodePath,
}

impl ApiServerCertificateChange {
    /// `<certificatesDir>/<name>`.
    fn file(&self, name: &str) -> NodePath {
        self.certificates_dir
            .join(name)
            .unwrap_or_else(|_| self.certificates_dir.clone())
    }

    /// The serving certificate, `<certificatesDir>/apiserver.crt`.
    pub fn certificate_path(&self) -> NodePath {
        self.file("apiserver.crt")
    }

    fn names(list: &[String]) -> Result<Vec<San>, StepError> {
        list.iter()
            .map(|s| San::parse(s).map_err(|e| StepError::new(ErrorKind::Internal, e)))
            .collect()
    }

    /// The certificate as it is and the names it must carry, when they differ from its own.
    fn decide(&self, node: &dyn Node) -> Result<Decision, StepError> {
        let crt = self.certificate_path();
        let Some((pem, meta)) = read_bounded(node, &crt)? else {
            return Err(precondition(format!(
                "{crt} does not exist on this node: apiServerCertificate changes the serving \
                 certificate of a kubeadm control-plane node (is certificatesDir right?)"
            )));
        };
        let der = certificate::certificate_der(&pem, crt.as_str()).map_err(precondition)?;
        let existing = certificate::sans_of(&der, crt.as_str()).map_err(precondition)?;
        let desired = certificate::desired_sans(
            &existing,
            &Self::names(&self.cert_sans)?,
            &Self::names(&self.previous)?,
        );
        let changes = desired != existing;
        Ok(Decision {
            pem,
            meta,
            existing,
            desired,
            changes,
        })
    }

    /// `ca.crt` and `ca.key`, which a reissue needs; a missing key is an external CA.
    /// The key is zeroed when dropped.
    fn ca_files(&self, node: &dyn Node) -> Result<(Vec<u8>, Zeroizing<Vec<u8>>), StepError> {
        let (crt, ca_crt, ca_key) = (
            self.certificate_path(),
            self.file("ca.crt"),
            self.file("ca.key"),
        );
        let Some((ca, _)) = read_bounded(node, &ca_crt)? else {
            return Err(precondition(format!(
                "{ca_crt} does not exist: {crt} can only be reissued from the node's cluster CA"
            )));
        };
        let Some((key, _)) = read_bounded(node, &ca_key)? else {
            return Err(precondition(format!(
                "{ca_key} does not exist: the cluster CA's key is not on this node (an \
                 externally managed CA), so the agent cannot reissue {crt} with the new \
                 certSANs; issue it from the external CA with the new names and install it, \
                 or replace the Machine"
            )));
        };
        Ok((ca, Zeroizing::new(key)))
    }
}

/// What the certificate is and what it must be.
struct Decision {
    pem: Vec<u8>,
    meta: FileMeta,
    existing: Vec<San>,
    desired: Vec<San>,
    changes: bool,
}

fn precondition(detail: impl Into<String>) -> StepError {
    StepError::new(ErrorKind::Precondition, detail)
}

/// The regular file at `p` (`None`: nothing there), refused past [`MAX_PEM_BYTES`].
fn read_bounded(node: &dyn Node, p: &NodePath) -> Result<Option<(Vec<u8>, FileMeta)>, StepError> {
    let too_large = || precondition(format!("{p} is larger than {MAX_PEM_BYTES} bytes"));
    match node.file_meta(p)? {
        None => return Ok(None),
        Some((_, size)) if size > MAX_PEM_BYTES => return Err(too_large()),
        Some(_) => {}
    }
    match node.read(p)? {
        Existing::File { content, .. } if content.len() as u64 > MAX_PEM_BYTES => Err(too_large()),
        Existing::File { content, meta } => Ok(Some((content, meta))),
        Existing::Absent => Ok(None),
        Existing::Other { kind } => Err(precondition(format!("{p} is a {kind}, not a file"))),
    }
}

/// `a, b` for people.
fn listed(names: &[&San]) -> String {
    names
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Kind for ApiServerCertificateChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["certSANs", "previous", "certificatesDir"]);
        let names = |cx: &mut Cx<'_>, key: &str, required: bool| -> Option<Vec<String>> {
            let field = join(path, key);
            if required && matches!(m.get(key), None | Some(Value::Null)) {
                cx.err(
                    &field,
                    "is required (a list of DNS names or IP addresses; may be empty)",
                );
                return None;
            }
            let list = cx.string_list(path, m, key)?;
            if list.len() > MAX_NAMES {
                cx.err(
                    &field,
                    format!("has {} names, more than {MAX_NAMES}", list.len()),
                );
                return None;
            }
            let mut ok = true;
            for (i, s) in list.iter().enumerate() {
                if let Err(e) = San::parse(s) {
                    cx.err(format!("{field}[{i}]"), e);
                    ok = false;
                }
            }
            ok.then_some(list)
        };
        let cert_sans = names(cx, "certSANs", true);
        let previous = names(cx, "previous", false);
        let dir_field = join(path, "certificatesDir");
        let dir = cx
            .string(path, m, "certificatesDir", false)
            .unwrap_or(CERTIFICATES_DIR);
        let certificates_dir = match NodePath::parse(dir) {
            Ok(d) => d,
            Err(e) => {
                cx.err(&dir_field, format!("path {e}"));
                return None;
            }
        };
        let change = ApiServerCertificateChange {
            cert_sans: cert_sans?,
            previous: previous?,
            certificates_dir,
        };
        let crt = change.certificate_path();
        cx.node_path(&dir_field, crt.as_str())?;
        cx.claim(&dir_field, format!("path:{crt}"), crt.as_str(), index);
        Some(change)
    }

    fn canonical(&self, _bodies: bool) -> Value {
        json!({
            "certSANs": self.cert_sans,
            "previous": self.previous,
            "certificatesDir": self.certificates_dir.as_str(),
        })
    }

    fn target(&self) -> String {
        self.certificate_path().to_string()
    }

    fn restart_units(&self) -> Vec<String> {
        Vec::new()
    }

    fn restart_field(&self) -> Option<&'static str> {
        None
    }

    // kube-apiserver is a static pod, not a unit, and reloads its serving certificate files
    // by itself: nothing restarts.
    fn fed_units(&self) -> Vec<String> {
        Vec::new()
    }

    fn run_state(&self) -> Option<(&str, super::UnitState)> {
        None
    }

    fn declared_disruption(&self) -> Option<Disruption> {
        None
    }

    fn fed_by(&self, other: &super::Change) -> bool {
        let _ = other;
        false
    }

    fn writes(&self) -> Vec<Written> {
        vec![Written::replaces(
            "certificatesDir",
            self.certificate_path(),
        )]
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        Disruption::None
    }

    fn needs_services(&self) -> bool {
        false
    }

    fn batchable(&self) -> bool {
        true
    }

    fn owner(&self) -> Option<&Owner> {
        None
    }

    fn preflight(&self, node: &dyn Node) -> Vec<(&'static str, String)> {
        let problem = match self.decide(node) {
            Ok(d) if !d.changes => return Vec::new(),
            Ok(_) => self.ca_files(node).err(),
            Err(e) => Some(e),
        };
        problem
            .map(|e| vec![("certificatesDir", e.detail)])
            .unwrap_or_default()
    }

    fn prepare(
        &self,
        _node: &dyn Node,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<String>, StepError> {
        Ok(None)
    }

    fn undecided(&self, _node: &dyn Node) -> Option<String> {
        None
    }

    fn diff(&self, node: &dyn Node, _ctx: StepCtx) -> Result<Diff, StepError> {
        let d = self.decide(node)?;
        if !d.changes {
            return Ok(Diff::default());
        }
        let (ca, key) = self.ca_files(node)?;
        let (crt, ca_crt, ca_key) = (
            self.certificate_path(),
            self.file("ca.crt"),
            self.file("ca.key"),
        );
        let pem = certificate::reissue(Reissue {
            leaf: (&d.pem, crt.as_str()),
            ca: (&ca, ca_crt.as_str()),
            ca_key: (&key, ca_key.as_str()),
            sans: &d.desired,
            now: node.now(),
        })
        .map_err(precondition)?;
        drop(key);
        let added: Vec<&San> = d
            .desired
            .iter()
            .filter(|s| !d.existing.contains(s))
            .collect();
        let removed: Vec<&San> = d
            .existing
            .iter()
            .filter(|s| !d.desired.contains(s))
            .collect();
        let mut note = format!("reissued from {ca_crt}");
        if !added.is_empty() {
            note.push_str(&format!("; adds {}", listed(&added)));
        }
        if !removed.is_empty() {
            note.push_str(&format!("; removes {}", listed(&removed)));
        }
        Ok(Diff {
            mutations: vec![Mutation::Write {
                path: crt,
                content: pem.into_bytes().into(),
                meta: d.meta,
            }],
            note: Some(note),
        })
    }

    fn resolve(
        &self,
        _node: &dyn Node,
        _timeout: std::time::Duration,
        _refresh: bool,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<Option<String>>, StepError> {
        Ok(None)
    }

    fn resolved(&self, _value: &str) -> Option<super::Change> {
        None
    }

    fn set_members(&self) -> Vec<NodePath> {
        Vec::new()
    }
}
