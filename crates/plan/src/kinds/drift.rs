//! What differs, field by field, between a change and the node when its diff is not empty:
//! the words of a drift report ("mode: expected 0644, found 0600"). The verdict itself is
//! the kind's own diff (drifted = a change whose diff is not empty); this only explains the
//! mutations that diff returned, observing the node through [`Node`] like the diff did.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use sha2::Digest as _;

use super::kubelet_config::read_config;
use super::kubelet_flags::{current_flags, flags_path};
use super::{Change, Diff, Mutation, Node};
use inplace_base::{Existing, FileMeta};

/// How long a package database query of an explanation may take.
const QUERY_TIMEOUT: Duration = Duration::from_secs(30);

/// One field that differs: what the plan says and what the node has.
#[derive(
    Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct Difference {
    /// What differs (`content`, `mode`, `owner`, `evictionHard.memory.available`,
    /// `--max-pods`, `enablement`, `version`, `held`).
    pub field: String,
    /// What the plan says.
    pub expected: String,
    /// What the node has (`absent` when there is nothing).
    pub found: String,
}

impl Difference {
    fn new(
        field: impl Into<String>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        Difference {
            field: field.into(),
            expected: expected.into(),
            found: found.into(),
        }
    }
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: expected {}, found {}",
            self.field, self.expected, self.found
        )
    }
}

/// The fields in which the node differs from `change`, given the (non-empty) `diff` the
/// change's kind computed. Field-level for the kubelet's configuration and flags; by
/// mutation (content, mode, owner, live value, enablement, version, hold) otherwise.
pub fn differences(change: &Change, node: &dyn Node, diff: &Diff) -> Vec<Difference> {
    let found = match change {
        Change::KubeletConfig(c) => kubelet_config_fields(node, &c.merge_patch),
        Change::KubeletFlags(c) => kubelet_flag_fields(node, &c.set, &c.remove),
        _ => None,
    };
    if let Some(found) = found.filter(|f| !f.is_empty()) {
        return found;
    }
    diff.mutations
        .iter()
        .flat_map(|m| of_mutation(node, m))
        .collect()
}

/// What one mutation would change, as fields.
fn of_mutation(node: &dyn Node, m: &Mutation) -> Vec<Difference> {
    match m {
        Mutation::Write {
            path,
            content,
            meta,
        } => of_file(node, path, meta, content.len() as u64, || {
            hex::encode(sha2::Sha256::digest(content))
        }),
        Mutation::WriteFrom {
            path,
            source,
            sha256,
            meta,
        } => {
            let len = std::fs::metadata(source).map(|m| m.len()).unwrap_or(0);
            of_file(node, path, meta, len, || sha256.clone())
        }
        Mutation::Remove { path } => vec![Difference::new(
            path.to_string(),
            "absent",
            match node.read(path) {
                Ok(Existing::File { content, .. }) => format!("a file of {} bytes", content.len()),
                Ok(Existing::Other { kind }) => format!("a {kind}"),
                Ok(Existing::Absent) => "absent".to_string(),
                Err(e) => format!("unreadable ({})", e.detail),
            },
        )],
        Mutation::SysctlLive { path, value } => vec![Difference::new(
            format!("{path} (live value)"),
            value.clone(),
            match node.read_special(path) {
                Ok(Some(v)) => v.trim().to_string(),
                Ok(None) => "absent".to_string(),
                Err(e) => format!("unreadable ({})", e.detail),
            },
        )],
        Mutation::UnitFile { unit, op } => vec![Difference::new(
            format!("{unit} enablement"),
            op.to_string(),
            match node.unit_file_state(unit) {
                Ok(Some(state)) => state.to_string(),
                Ok(None) => "no unit file".to_string(),
                Err(e) => format!("unknown ({})", e.detail),
            },
        )],
        Mutation::UnitRun { unit, state } => vec![Difference::new(
            format!("{unit} state"),
            match state {
                crate::UnitState::Running => "running",
                crate::UnitState::Stopped => "stopped",
            },
            match node.unit_state(unit) {
                Ok(o) => format!("{}/{}", o.active_state, o.sub_state),
                Err(e) => format!("unknown ({})", e.detail),
            },
        )],
        Mutation::Package(p) => {
            let installed = node
                .packages(p.manager, QUERY_TIMEOUT)
                .installed(&p.name)
                .ok()
                .flatten();
            let mut out = Vec::new();
            if let Some(want) = &p.version {
                out.push(Difference::new(
                    format!("{} version", p.name),
                    want.clone(),
                    p.from.clone().unwrap_or_else(|| "not installed".into()),
                ));
            }
            let held = installed.as_ref().is_some_and(|i| i.held);
            if installed.is_some() && held != p.hold {
                out.push(Difference::new(
                    format!("{} held", p.name),
                    p.hold.to_string(),
                    held.to_string(),
                ));
            }
            out
        }
        Mutation::KubeadmUpgradeNode(_) | Mutation::Run { .. } => {
            vec![Difference::new("", m.describe(), "not done")]
        }
    }
}

/// A file's content, mode and owner against what a write would make of it.
fn of_file(
    node: &dyn Node,
    path: &crate::NodePath,
    meta: &FileMeta,
    len: u64,
    sha: impl FnOnce() -> String,
) -> Vec<Difference> {
    let field = |what: &str| format!("{path} {what}");
    let (have, have_len) = match node.file_meta(path) {
        Ok(Some(found)) => found,
        Ok(None) => {
            return vec![Difference::new(
                path.to_string(),
                format!("a file of {len} bytes"),
                match node.read(path) {
                    Ok(Existing::Other { kind }) => format!("a {kind}"),
                    _ => "absent".to_string(),
                },
            )];
        }
        Err(e) => {
            return vec![Difference::new(
                path.to_string(),
                format!("a file of {len} bytes"),
                format!("unreadable ({})", e.detail),
            )];
        }
    };
    let mut out = Vec::new();
    let want = sha();
    let found_sha = node.file_sha256(path).ok().flatten().unwrap_or_default();
    if have_len != len || found_sha != want {
        out.push(Difference::new(
            field("content"),
            format!("{len} bytes, sha256 {}", short(&want)),
            format!("{have_len} bytes, sha256 {}", short(&found_sha)),
        ));
    }
    if have.mode != meta.mode {
        out.push(Difference::new(
            field("mode"),
            format!("{:04o}", meta.mode),
            format!("{:04o}", have.mode),
        ));
    }
    if (have.uid, have.gid) != (meta.uid, meta.gid) {
        out.push(Difference::new(
            field("owner"),
            format!("{}:{}", meta.uid, meta.gid),
            format!("{}:{}", have.uid, have.gid),
        ));
    }
    out
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

/// The kubelet configuration's fields the merge patch sets (or removes, with `null`) that
/// the node's file has otherwise; `None` when the file cannot be read.
fn kubelet_config_fields(
    node: &dyn Node,
    patch: &serde_json::Map<String, Value>,
) -> Option<Vec<Difference>> {
    let (doc, _) = read_config(node).ok()?;
    let current = serde_json::to_value(&doc).ok()?;
    let mut out = Vec::new();
    patch_leaves(patch, &current, "", &mut out);
    Some(out)
}

/// Walks a JSON merge patch (RFC 7396): objects merge, `null` removes, anything else
/// replaces; each leaf that the current document does not already have is a difference.
fn patch_leaves(
    patch: &serde_json::Map<String, Value>,
    current: &Value,
    prefix: &str,
    out: &mut Vec<Difference>,
) {
    for (key, want) in patch {
        let field = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        let have = current.get(key);
        match want {
            Value::Object(inner) => {
                patch_leaves(inner, have.unwrap_or(&Value::Null), &field, out);
            }
            Value::Null => {
                if let Some(have) = have.filter(|h| !h.is_null()) {
                    out.push(Difference::new(field, "absent", have.to_string()));
                }
            }
            want => {
                if have != Some(want) {
                    out.push(Difference::new(
                        field,
                        want.to_string(),
                        have.map(Value::to_string)
                            .unwrap_or_else(|| "absent".to_string()),
                    ));
                }
            }
        }
    }
}

/// The kubelet flags the change sets or removes that `kubeadm-flags.env` has otherwise;
/// `None` when the file cannot be read.
fn kubelet_flag_fields(
    node: &dyn Node,
    set: &BTreeMap<String, String>,
    remove: &[String],
) -> Option<Vec<Difference>> {
    let text = match node.read(&flags_path()).ok()? {
        Existing::File { content, .. } => String::from_utf8_lossy(&content).into_owned(),
        Existing::Absent => String::new(),
        Existing::Other { .. } => return None,
    };
    let have = current_flags(&text);
    let mut out = Vec::new();
    for (name, want) in set {
        match have.get(name) {
            Some(value) if value == want => {}
            found => out.push(Difference::new(
                format!("--{name}"),
                want.clone(),
                found.cloned().unwrap_or_else(|| "absent".to_string()),
            )),
        }
    }
    for name in remove {
        if let Some(value) = have.get(name) {
            out.push(Difference::new(
                format!("--{name}"),
                "absent",
                value.clone(),
            ));
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use super::*;
    use crate::kinds::{Note, Packages, StepCtx};
    use crate::{Limits, NodePath, parse_plan};
    use inplace_base::packages::{InstalledPackage, ManagerKind};
    use inplace_base::units::{ObservedUnit, UnitFileState};
    use inplace_base::{ErrorKind, StepError};

    /// A node held in maps: unit file states and installed packages (files are absent).
    #[derive(Default)]
    struct MapNode {
        units: BTreeMap<String, UnitFileState>,
        packages: RefCell<BTreeMap<String, InstalledPackage>>,
    }

    struct MapPackages<'a>(&'a MapNode);

    impl Packages for MapPackages<'_> {
        fn kind(&self) -> ManagerKind {
            ManagerKind::Apt
        }
        fn installed(&self, name: &str) -> Result<Option<InstalledPackage>, StepError> {
            Ok(self.0.packages.borrow().get(name).cloned())
        }
        fn available_versions(&self, name: &str) -> Result<Vec<String>, StepError> {
            Ok(self
                .0
                .packages
                .borrow()
                .get(name)
                .map(|p| vec![p.version.clone()])
                .unwrap_or_default())
        }
        fn satisfies(&self, have: &str, want: &str) -> bool {
            have == want
        }
        fn compare(&self, a: &str, b: &str) -> std::cmp::Ordering {
            a.cmp(b)
        }
        fn refresh(&self, _note: &mut dyn FnMut(Note)) -> Result<(), StepError> {
            Ok(())
        }
    }

    impl Node for MapNode {
        fn read(&self, _p: &NodePath) -> Result<Existing, StepError> {
            Ok(Existing::Absent)
        }
        fn file_meta(&self, _p: &NodePath) -> Result<Option<(FileMeta, u64)>, StepError> {
            Ok(None)
        }
        fn file_sha256(&self, _p: &NodePath) -> Result<Option<String>, StepError> {
            Ok(None)
        }
        fn read_special(&self, _p: &NodePath) -> Result<Option<String>, StepError> {
            Ok(None)
        }
        fn dir_exists(&self, _p: &NodePath) -> bool {
            true
        }
        fn root_display(&self) -> String {
            "/".into()
        }
        fn services_on(&self) -> bool {
            true
        }
        fn unit_file_state(&self, unit: &str) -> Result<Option<UnitFileState>, StepError> {
            Ok(self.units.get(unit).cloned())
        }
        fn unit_state(&self, unit: &str) -> Result<ObservedUnit, StepError> {
            Err(StepError::new(
                ErrorKind::Internal,
                format!("{unit}: not asked"),
            ))
        }
        fn package_manager(&self, _requested: Option<&str>) -> Result<ManagerKind, String> {
            Ok(ManagerKind::Apt)
        }
        fn valid_version(&self, _manager: ManagerKind, _version: &str) -> Result<(), String> {
            Ok(())
        }
        fn packages(&self, _manager: ManagerKind, _timeout: Duration) -> Box<dyn Packages + '_> {
            Box::new(MapPackages(self))
        }
        fn cached_artifact(&self, _sha256: &str) -> Option<(PathBuf, u64)> {
            None
        }
        fn artifact_path(&self, sha256: &str) -> PathBuf {
            PathBuf::from(sha256)
        }
        fn cached_member_sha(&self, _sha256: &str, _member: &str) -> Option<String> {
            None
        }
        fn fetch_artifact(
            &self,
            _url: &str,
            _sha256: &str,
            _member: Option<&str>,
            _note: &mut dyn FnMut(Note),
        ) -> Result<String, StepError> {
            Err(StepError::new(ErrorKind::Internal, "no downloads"))
        }
        fn query(&self, _argv: &[&str], _timeout: Duration) -> Result<String, String> {
            Err("no commands".into())
        }
    }

    fn change(yaml: &str) -> Change {
        let text =
            format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: t\nchanges:\n  - {yaml}\n");
        parse_plan(text.as_bytes(), "t", &Limits::default())
            .unwrap_or_else(|e| panic!("{e}"))
            .changes
            .remove(0)
    }

    /// The verdict (the kind's diff) and, when drifted, what differs.
    fn drift_of(node: &MapNode, c: &Change) -> Option<Vec<Difference>> {
        let diff = c.spec().diff(node, StepCtx::default()).unwrap();
        (!diff.mutations.is_empty()).then(|| differences(c, node, &diff))
    }

    fn installed(version: &str, held: bool) -> InstalledPackage {
        InstalledPackage {
            name: "kubelet".into(),
            version: version.into(),
            held,
            status: "installed".into(),
            complete: true,
        }
    }

    #[test]
    fn a_unit_disabled_outside_the_agent_is_drift_naming_its_enablement() {
        let c = change("unit: {name: kubelet.service, enabled: true}");
        let mut node = MapNode::default();
        node.units
            .insert("kubelet.service".into(), UnitFileState::Enabled);
        assert_eq!(drift_of(&node, &c), None);
        node.units
            .insert("kubelet.service".into(), UnitFileState::Disabled);
        assert_eq!(
            drift_of(&node, &c),
            Some(vec![Difference::new(
                "kubelet.service enablement",
                "enable",
                "disabled"
            )])
        );
    }

    #[test]
    fn a_package_moved_or_released_outside_the_agent_is_drift_naming_version_and_hold() {
        let c = change("package: {name: kubelet, version: 1.31.2-1.1, hold: true}");
        let node = MapNode::default();
        node.packages
            .borrow_mut()
            .insert("kubelet".into(), installed("1.31.2-1.1", true));
        assert_eq!(drift_of(&node, &c), None);
        // unattended-upgrades moved it (and an upgrade keeps the hold).
        node.packages
            .borrow_mut()
            .insert("kubelet".into(), installed("1.31.3-1.1", true));
        assert_eq!(
            drift_of(&node, &c),
            Some(vec![Difference::new(
                "kubelet version",
                "1.31.2-1.1",
                "1.31.3-1.1"
            )])
        );
        // Back at the version, the hold released.
        node.packages
            .borrow_mut()
            .insert("kubelet".into(), installed("1.31.2-1.1", false));
        assert_eq!(
            drift_of(&node, &c),
            Some(vec![Difference::new("kubelet held", "true", "false")])
        );
    }
}
