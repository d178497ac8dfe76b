//! `sysctl`: persisted as `/etc/sysctl.d/90-inplace-agent-<key>.conf` and applied live
//! through `<root>/proc/sys` when the root has one (a sandbox root has not: then the value
//! is persisted only, and the step says so).

use super::{Diff, Mutation, StepError};
use crate::base::FileMeta;
use crate::host::Host;
use crate::host::fs::Existing;
use crate::plan::{NodePath, SysctlChange, sysctl_segments};

/// The persisted file for a key.
pub fn conf_path(key: &str) -> Result<NodePath, String> {
    crate::plan::sysctl_conf_path(key)
}

/// The live file for a key.
pub fn proc_path(key: &str) -> Result<NodePath, String> {
    let segs = sysctl_segments(key)?;
    NodePath::parse(&format!("/proc/sys/{}", segs.join("/"))).map_err(|e| e.to_string())
}

/// The persisted file's content (pure).
pub fn conf_content(change: &SysctlChange) -> String {
    format!(
        "# Managed by inplace-agent; the next plan that sets this key overwrites it.\n{} = {}\n",
        change.key, change.value
    )
}

/// True when a live value already equals the desired one; the kernel prints multi-field
/// values separated by tabs (pure).
pub fn same_value(live: &str, desired: &str) -> bool {
    live.split_whitespace().eq(desired.split_whitespace())
}

fn has_proc_sys(host: &Host) -> bool {
    host.root
        .dir_exists(&NodePath::parse("/proc/sys").expect("constant path"))
}

/// Checks that the kernel knows the key when it can be applied live.
pub fn preflight(host: &Host, change: &SysctlChange) -> Result<(), String> {
    if !has_proc_sys(host) {
        return Ok(());
    }
    let path = proc_path(&change.key)?;
    match host.root.read_special(&path) {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(format!(
            "the node's kernel has no sysctl {} ({path} does not exist)",
            change.key
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads the node and diffs a `sysctl` change.
pub fn diff(host: &Host, change: &SysctlChange, root_ids: (u32, u32)) -> Result<Diff, StepError> {
    let invalid = |e: String| StepError::new(crate::base::ErrorKind::Precondition, e);
    let conf = conf_path(&change.key).map_err(invalid)?;
    let content = conf_content(change).into_bytes();
    let meta = FileMeta {
        mode: 0o644,
        uid: root_ids.0,
        gid: root_ids.1,
    };
    let mut mutations = Vec::new();
    let current_ok = matches!(host.root.read(&conf)?, Existing::File { content: c, meta: m } if c == content && m == meta);
    if !current_ok {
        mutations.push(Mutation::Write {
            path: conf,
            content,
            meta,
        });
    }
    let note = if has_proc_sys(host) {
        let path = proc_path(&change.key).map_err(invalid)?;
        let live = host.root.read_special(&path)?.unwrap_or_default();
        if !same_value(&live, &change.value) {
            mutations.push(Mutation::SysctlLive {
                path,
                value: change.value.clone(),
            });
        }
        None
    } else {
        Some(format!(
            "persisted only: {} has no /proc/sys, so the value takes effect at the next boot",
            host.root.path().display()
        ))
    };
    Ok(Diff { mutations, note })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_values() {
        assert_eq!(
            conf_path("net.ipv4.ip_forward").unwrap().as_str(),
            "/etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf"
        );
        assert_eq!(
            proc_path("net.ipv4.ip_forward").unwrap().as_str(),
            "/proc/sys/net/ipv4/ip_forward"
        );
        assert_eq!(
            proc_path("net/ipv4/conf/eth0.1/rp_filter")
                .unwrap()
                .as_str(),
            "/proc/sys/net/ipv4/conf/eth0.1/rp_filter"
        );
        assert!(same_value("32768\t60999\n", "32768 60999"));
        assert!(!same_value("1\n", "0"));
    }
}
