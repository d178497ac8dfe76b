//! Kubernetes' version skew rules, as an in-place update must keep them.
//!
//! A replacement rollout brings up a new node at the new version beside the old ones; an
//! in-place update moves an existing node, and nothing else in the chain stops it from
//! moving past what kubeadm and the Kubernetes version skew policy
//! (<https://kubernetes.io/releases/version-skew-policy/>) allow:
//!
//! - kubeadm upgrades one minor version at a time (`kubeadm upgrade node` refuses to skip
//!   one), and never downgrades a minor version (etcd may already have moved its data
//!   forward);
//! - a kubelet must not be newer than the oldest API server of its cluster, so a worker
//!   follows its control plane: it moves only to a version every control-plane node already
//!   runs;
//! - the API servers of a cluster are at most one minor version apart, so a control-plane
//!   node moves at most one minor version ahead of the oldest other control-plane node.
//!
//! The versions of the control plane are read from the live control-plane Machines of the
//! Machine's cluster (the kubelet version their node reports, else the version their spec
//! asks for), never from the hook request.

use serde_json::Value;

/// A Kubernetes version, `vMAJOR.MINOR.PATCH` (pre-release and build suffixes ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// The major version (1).
    pub major: u32,
    /// The minor version.
    pub minor: u32,
    /// The patch version.
    pub patch: u32,
}

impl Version {
    /// Parses `v1.35.2` or `1.35.2` (a suffix after `-` or `+` is ignored); `None` for
    /// anything else.
    pub fn parse(text: &str) -> Option<Version> {
        let v = text.trim();
        let v = v.strip_prefix('v').unwrap_or(v);
        let v = v.split(['-', '+']).next().unwrap_or(v);
        let mut parts = v.split('.');
        let mut next = || -> Option<u32> {
            let p = parts.next()?;
            if p.is_empty() || p.len() > 6 || !p.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            p.parse().ok()
        };
        let version = Version {
            major: next()?,
            minor: next()?,
            patch: next()?,
        };
        parts.next().is_none().then_some(version)
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The role of the Machine being moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A control-plane Machine (it runs an API server, and etcd where it is stacked).
    ControlPlane,
    /// Any other Machine.
    Worker,
}

/// One control-plane node's version, as read from its live Machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The Machine's name.
    pub machine: String,
    /// The version its node runs.
    pub version: Version,
}

/// Why a move breaks the skew rules: the rule and the versions, in words for the hook
/// message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(
    /// The sentence.
    pub String,
);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks a move of `machine` (named as the message should name it: `Machine ns/name`,
/// `MachineSet ns/name`) from `current` to `desired`. `control_plane` holds the cluster's
/// control-plane Machines other than the one moved.
pub fn check(
    machine: &str,
    role: Role,
    current: Version,
    desired: Version,
    control_plane: &[Member],
) -> Result<(), Refusal> {
    if desired == current {
        return Ok(());
    }
    if desired.major != current.major {
        return Err(Refusal(format!(
            "{machine}: {current} → {desired} changes the major version; \
             no in-place path exists between major versions"
        )));
    }
    if desired.minor < current.minor {
        return Err(Refusal(format!(
            "{machine}: {current} → {desired} is a minor version downgrade; kubeadm \
             does not downgrade a minor version in place (etcd and the API may already have \
             moved their data forward): replace the Machine instead"
        )));
    }
    if desired.minor > current.minor + 1 {
        return Err(Refusal(format!(
            "{machine}: {current} → {desired} skips v{}.{}; kubeadm upgrades one \
             minor version at a time: move to v{}.{} first",
            current.major,
            current.minor + 1,
            current.major,
            current.minor + 1
        )));
    }
    let oldest = control_plane.iter().min_by_key(|m| m.version);
    match (role, oldest) {
        (Role::Worker, Some(oldest)) if desired > oldest.version => Err(Refusal(format!(
            "{machine}: {desired} is newer than the control plane (Machine {} runs \
             {}); a kubelet must not be newer than the oldest API server: upgrade the control \
             plane first",
            oldest.machine, oldest.version
        ))),
        (Role::ControlPlane, Some(oldest)) if desired.minor > oldest.version.minor + 1 => {
            Err(Refusal(format!(
                "{machine}: {desired} would be more than one minor version ahead of \
                 control-plane Machine {} ({}); the API servers of a cluster may be at most \
                 one minor version apart: move that one first",
                oldest.machine, oldest.version
            )))
        }
        _ => Ok(()),
    }
}

/// The version a live Machine's node runs: `status.nodeInfo.kubeletVersion` (the Machine
/// controller copies it from the Node), else `spec.version`.
pub fn running_version(machine: &Value) -> Option<Version> {
    machine
        .pointer("/status/nodeInfo/kubeletVersion")
        .and_then(Value::as_str)
        .and_then(Version::parse)
        .or_else(|| {
            machine
                .pointer("/spec/version")
                .and_then(Value::as_str)
                .and_then(Version::parse)
        })
}

/// The control-plane members among live Machines, but `except` (the Machine being moved).
/// A Machine without a readable version is left out (it has no node yet).
pub fn members(machines: &[Value], except: &str) -> Vec<Member> {
    let mut out: Vec<Member> = machines
        .iter()
        .filter(|m| {
            m.pointer("/metadata/labels")
                .and_then(Value::as_object)
                .is_some_and(|l| l.contains_key(CONTROL_PLANE_LABEL))
        })
        .filter_map(|m| {
            let name = m.pointer("/metadata/name").and_then(Value::as_str)?;
            (name != except).then_some(())?;
            Some(Member {
                machine: name.to_owned(),
                version: running_version(m)?,
            })
        })
        .collect();
    out.sort_by(|a, b| a.machine.cmp(&b.machine));
    out
}

/// The label Cluster API puts on control-plane Machines.
pub const CONTROL_PLANE_LABEL: &str = "cluster.x-k8s.io/control-plane";

/// The label selector of a cluster's control-plane Machines.
pub fn control_plane_selector(cluster: &str) -> String {
    format!("cluster.x-k8s.io/cluster-name={cluster},{CONTROL_PLANE_LABEL}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn v(s: &str) -> Version {
        Version::parse(s).unwrap()
    }

    fn cp(name: &str, version: &str) -> Member {
        Member {
            machine: name.into(),
            version: v(version),
        }
    }

    #[test]
    fn versions_parse_as_kubernetes_writes_them() {
        assert_eq!(v("v1.35.2"), v("1.35.2"));
        assert_eq!(v("v1.35.2-rc.1+abc").patch, 2);
        for bad in [
            "",
            "v1.35",
            "1.35.2.1",
            "v1.x.2",
            "v1.35.2 extra",
            "v1.1234567.0",
        ] {
            assert_eq!(Version::parse(bad), None, "{bad:?}");
        }
        assert!(v("v1.35.10") > v("v1.35.9"));
    }

    #[test]
    fn a_patch_or_one_minor_up_is_allowed() {
        let plane = [cp("cp-a", "v1.36.0"), cp("cp-b", "v1.36.1")];
        assert_eq!(
            check("md-0", Role::Worker, v("v1.35.2"), v("v1.35.3"), &plane),
            Ok(())
        );
        assert_eq!(
            check("md-0", Role::Worker, v("v1.35.2"), v("v1.36.0"), &plane),
            Ok(())
        );
        assert_eq!(
            check(
                "cp-c",
                Role::ControlPlane,
                v("v1.35.2"),
                v("v1.36.0"),
                &plane
            ),
            Ok(())
        );
    }

    #[test]
    fn a_skipped_minor_a_downgrade_and_a_major_change_are_refused() {
        let skip = check("m", Role::Worker, v("v1.34.1"), v("v1.36.0"), &[]).unwrap_err();
        assert!(
            skip.0.contains("skips v1.35") && skip.0.contains("move to v1.35 first"),
            "{skip}"
        );
        let down = check("m", Role::Worker, v("v1.35.1"), v("v1.34.9"), &[]).unwrap_err();
        assert!(down.0.contains("downgrade"), "{down}");
        let major = check("m", Role::Worker, v("v1.35.1"), v("v2.0.0"), &[]).unwrap_err();
        assert!(major.0.contains("major"), "{major}");
    }

    #[test]
    fn a_worker_follows_its_control_plane() {
        let plane = [cp("cp-a", "v1.36.0"), cp("cp-b", "v1.35.4")];
        let e = check("md-0-x", Role::Worker, v("v1.35.4"), v("v1.36.0"), &plane).unwrap_err();
        assert!(
            e.0.contains("newer than the control plane") && e.0.contains("cp-b runs v1.35.4"),
            "{e}"
        );
        // A patch above the oldest control-plane node is newer too.
        assert!(check("md-0-x", Role::Worker, v("v1.35.2"), v("v1.35.5"), &plane).is_err());
    }

    #[test]
    fn a_control_plane_node_stays_within_one_minor_of_the_others() {
        let plane = [cp("cp-a", "v1.35.0"), cp("cp-b", "v1.36.0")];
        assert_eq!(
            check(
                "cp-c",
                Role::ControlPlane,
                v("v1.36.0"),
                v("v1.36.1"),
                &plane
            ),
            Ok(())
        );
        let e = check(
            "cp-b",
            Role::ControlPlane,
            v("v1.36.0"),
            v("v1.37.0"),
            &plane,
        )
        .unwrap_err();
        assert!(
            e.0.contains("more than one minor") && e.0.contains("cp-a"),
            "{e}"
        );
    }

    #[test]
    fn members_are_the_live_control_plane_machines_but_the_one_moved() {
        let machines = [
            json!({"metadata": {"name": "cp-a", "labels": {CONTROL_PLANE_LABEL: ""}},
                   "spec": {"version": "v1.36.0"},
                   "status": {"nodeInfo": {"kubeletVersion": "v1.35.4"}}}),
            json!({"metadata": {"name": "cp-b", "labels": {CONTROL_PLANE_LABEL: ""}},
                   "spec": {"version": "v1.36.0"}}),
            json!({"metadata": {"name": "cp-c", "labels": {CONTROL_PLANE_LABEL: ""}},
                   "spec": {}}),
            json!({"metadata": {"name": "md-0", "labels": {}}, "spec": {"version": "v1.30.0"}}),
        ];
        assert_eq!(
            members(&machines, "cp-b"),
            [cp("cp-a", "v1.35.4")],
            "the node's kubelet version first; no version, no member; workers are not members"
        );
        assert_eq!(members(&machines, "none").len(), 2);
    }
}
