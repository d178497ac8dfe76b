//! `kubeadmUpgradeNode`: runs `kubeadm upgrade node` in the node's root with the step timeout.
//!
//! It is an action, not a state, so "desired state" needs a definition. It **runs** when
//!
//! 1. an earlier change of the plan that feeds kubeadm changed the node in this run (or, in
//!    a dry run, would): a `package` named `kubeadm`, an `artifact` installed at a path whose
//!    file name is `kubeadm`, or a `file`/`absent` at the `--config` file or under the
//!    `--patches` directory given in `extraArgs` ([`feeds`]); or
//! 2. the node shows a version bump that has not finished: the installed kubeadm
//!    (`kubeadm version -o short`) is newer than the kubelet (`kubelet --version`). In the
//!    upstream order (kubeadm, `kubeadm upgrade node`, then kubelet) that is exactly the state
//!    a failed or interrupted earlier attempt leaves behind, whose kubeadm package is
//!    already new and so does not change again.
//!
//! Otherwise it is **skipped** and reported unchanged. `kubeadm upgrade node` is idempotent,
//! so running it again after a crash in the middle is safe.
//!
//! It rewrites the kubelet configuration (workers) and the static pod manifests
//! (control-plane nodes); those files ([`REWRITES`]) are its pre-image, restored on
//! rollback. What else kubeadm does (certificate renewal, etcd upgrade on control-plane
//! nodes) is not undone.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Diff, Mutation, Note, StepCtx, StepError};
use crate::base::ErrorKind;
use crate::host::Host;
use crate::host::command;
use crate::journal::backup::BackupStore;
use crate::journal::{FileBefore, Preimage};
use crate::plan::{Change, KubeadmUpgradeNodeChange, NodePath, Plan};

/// `Preimage::Other` kind of this step's pre-images.
pub const PREIMAGE_KIND: &str = "kubeadmUpgradeNode";

/// The key its mutation and pre-image share.
pub const TARGET: &str = "kubeadm:upgrade-node";

/// Files `kubeadm upgrade node` may rewrite; backed up before it runs, restored on rollback.
pub const REWRITES: [&str; 7] = [
    "/var/lib/kubelet/config.yaml",
    "/var/lib/kubelet/kubeadm-flags.env",
    "/var/lib/kubelet/instance-config.yaml",
    "/etc/kubernetes/manifests/etcd.yaml",
    "/etc/kubernetes/manifests/kube-apiserver.yaml",
    "/etc/kubernetes/manifests/kube-controller-manager.yaml",
    "/etc/kubernetes/manifests/kube-scheduler.yaml",
];

/// Most bytes of kubeadm's output kept (journal and error).
const MAX_OUTPUT: usize = 64 * 1024;

/// Running `kubeadm upgrade node`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeNode {
    /// Arguments after `kubeadm upgrade node`.
    pub args: Vec<String>,
    /// Kill it after this long (the plan's step timeout).
    pub timeout: Duration,
    /// Why it runs, for people.
    pub reason: String,
}

impl UpgradeNode {
    /// The command line.
    pub fn argv(&self) -> Vec<String> {
        let mut argv: Vec<String> = ["kubeadm", "upgrade", "node"].map(String::from).to_vec();
        argv.extend(self.args.iter().cloned());
        argv
    }

    /// `run kubeadm upgrade node (changes[0] changed an input of kubeadm in this run)`.
    pub fn describe(&self) -> String {
        format!("run {} ({})", self.argv().join(" "), self.reason)
    }
}

/// The value of `--name` in `args` (`--name=v` or `--name v`).
fn arg_value<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Some(v);
        }
        if a == name {
            return it.next().map(String::as_str);
        }
    }
    None
}

/// Whether `change` is an input of `kubeadm upgrade node` as `k` runs it (pure): the kubeadm
/// package or binary, its `--config` file, or a file under its `--patches` directory.
pub fn feeds(change: &Change, k: &KubeadmUpgradeNodeChange) -> bool {
    let patches = arg_value(&k.extra_args, "--patches").and_then(|d| NodePath::parse(d).ok());
    let config = arg_value(&k.extra_args, "--config").and_then(|f| NodePath::parse(f).ok());
    let read_by_kubeadm = |p: &NodePath| {
        config.as_ref() == Some(p) || patches.as_ref().is_some_and(|d| p.starts_with(d) && p != d)
    };
    match change {
        Change::Package(p) => p.name == "kubeadm",
        Change::Artifact(a) => a.path.file_name() == "kubeadm",
        Change::File(f) => read_by_kubeadm(&f.path),
        Change::Absent(a) => read_by_kubeadm(&a.path),
        _ => false,
    }
}

/// The first change before `index` that feeds the `kubeadmUpgradeNode` change at `index`
/// and for which `changed` says yes (pure).
pub fn inputs_changed(plan: &Plan, index: usize, changed: impl Fn(u32) -> bool) -> Option<u32> {
    let Some(Change::KubeadmUpgradeNode(k)) = plan.changes.get(index) else {
        return None;
    };
    plan.changes[..index]
        .iter()
        .enumerate()
        .find(|(j, c)| feeds(c, k) && changed(*j as u32))
        .map(|(j, _)| j as u32)
}

/// `v1.31.2`, `1.31.2-rc.0` → (1, 31, 2) (pure).
pub fn parse_kube_version(s: &str) -> Option<(u64, u64, u64)> {
    let s = s.trim();
    let s = s.strip_prefix('v').unwrap_or(s);
    let mut parts = s.splitn(3, '.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    let patch_text = parts.next()?;
    let digits: String = patch_text
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, minor, digits.parse().ok()?))
}

/// Whether a kubeadm at `kubeadm` next to a kubelet at `kubelet` is a version bump that has
/// not finished (kubeadm is newer) (pure).
pub fn upgrade_pending(kubeadm: &str, kubelet: &str) -> bool {
    match (parse_kube_version(kubeadm), parse_kube_version(kubelet)) {
        (Some(a), Some(b)) => a > b,
        _ => false,
    }
}

/// Runs a version query in the root; the trimmed output or why not.
fn query(host: &Host, argv: &[&str], timeout: Duration) -> Result<String, String> {
    let spec = host.command(argv.iter().copied()).timeout(timeout);
    match command::run(&spec) {
        Ok(out) if out.success() => Ok(out.stdout.trim().to_string()),
        Ok(out) => Err(format!("{}: {}", spec.display(), out.summary())),
        Err(e) => Err(e.to_string()),
    }
}

/// What the change needs now: a run of `kubeadm upgrade node`, or nothing.
pub fn diff(
    host: &Host,
    change: &KubeadmUpgradeNodeChange,
    ctx: StepCtx,
) -> Result<Diff, StepError> {
    let run = |reason: String| Diff {
        mutations: vec![Mutation::KubeadmUpgradeNode(UpgradeNode {
            args: change.extra_args.clone(),
            timeout: ctx.step_timeout,
            reason,
        })],
        note: None,
    };
    if let Some(j) = ctx.inputs_changed {
        return Ok(run(format!(
            "changes[{j}] changed an input of kubeadm in this run"
        )));
    }
    let budget = if ctx.step_timeout.is_zero() {
        Duration::from_secs(30)
    } else {
        ctx.step_timeout.min(Duration::from_secs(30))
    };
    let kubeadm = query(host, &["kubeadm", "version", "-o", "short"], budget);
    let kubelet = query(host, &["kubelet", "--version"], budget)
        .map(|out| super::verify::parse_kubelet_version(&out).unwrap_or(out));
    if let (Ok(a), Ok(b)) = (&kubeadm, &kubelet)
        && upgrade_pending(a, b)
    {
        return Ok(run(format!(
            "kubeadm {a} is newer than the kubelet {b}: a version bump has not finished"
        )));
    }
    let seen = match (kubeadm, kubelet) {
        (Ok(a), Ok(b)) => format!("kubeadm {a}, kubelet {b}"),
        (Err(e), _) | (_, Err(e)) => e,
    };
    Ok(Diff {
        mutations: Vec::new(),
        note: Some(format!(
            "skipped: nothing kubeadm reads changed in this run and no version bump is \
             pending ({seen})"
        )),
    })
}

/// One file of the pre-image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Rewritten {
    path: NodePath,
    before: FileBefore,
}

/// The pre-image: the files kubeadm may rewrite.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct UpgradeNodeBefore {
    target: String,
    files: Vec<Rewritten>,
}

/// Backs up the files `kubeadm upgrade node` may rewrite.
pub fn capture(host: &Host, backups: &BackupStore) -> Result<Preimage, StepError> {
    let mut files = Vec::new();
    for p in REWRITES {
        let path = NodePath::parse(p)
            .map_err(|e| StepError::new(ErrorKind::Internal, format!("{p}: {e}")))?;
        let before = super::capture_file(host, backups, &path)?;
        files.push(Rewritten { path, before });
    }
    let before = UpgradeNodeBefore {
        target: TARGET.to_string(),
        files,
    };
    Ok(Preimage::Other {
        kind: PREIMAGE_KIND.to_string(),
        data: serde_json::to_value(&before)
            .map_err(|e| StepError::new(ErrorKind::Internal, e.to_string()))?,
    })
}

/// Runs `kubeadm upgrade node`; its bounded output is the result (for the journal) or, when
/// it fails, part of the error (and so of the status).
pub fn execute(
    host: &Host,
    m: &UpgradeNode,
    note: &mut dyn FnMut(Note),
) -> Result<String, StepError> {
    let mut spec = host.command(m.argv()).timeout(m.timeout);
    spec.max_output = MAX_OUTPUT;
    note(Note::Status(&format!("running {}", spec.display())));
    let out = command::run(&spec)
        .map_err(|e| StepError::new(ErrorKind::Command, format!("{}: {e}", spec.display())))?;
    let record = crate::host::packages::CommandRecord {
        command: spec.display(),
        output: out.clone(),
    };
    if out.success() {
        return Ok(super::package::transcript_text(&[record], MAX_OUTPUT));
    }
    let kind = if out.timed_out {
        ErrorKind::Timeout
    } else {
        ErrorKind::Command
    };
    let mut detail = format!("{}: {}", spec.display(), out.summary());
    let tail =
        super::package::output_tail(&out.stderr, &out.stdout, super::package::MAX_ERROR_OUTPUT);
    if !tail.is_empty() {
        detail.push_str("\noutput:\n");
        detail.push_str(&tail);
    }
    Err(StepError::new(kind, detail))
}

/// Puts back the files kubeadm rewrote.
pub fn restore(
    host: &Host,
    backups: &BackupStore,
    data: &serde_json::Value,
) -> Result<(), StepError> {
    let before: UpgradeNodeBefore = serde_json::from_value(data.clone()).map_err(|e| {
        StepError::new(
            ErrorKind::Internal,
            format!("kubeadm upgrade node pre-image: {e}"),
        )
    })?;
    for f in before.files.iter().rev() {
        super::restore_file(host, backups, &f.path, &f.before)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Limits, parse_plan};

    fn plan(changes: &str) -> Plan {
        let text = format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: t\nchanges:\n{changes}");
        parse_plan(text.as_bytes(), "t", &Limits::default()).unwrap()
    }

    #[test]
    fn versions_are_compared_as_kubernetes_versions() {
        assert_eq!(parse_kube_version("v1.31.2"), Some((1, 31, 2)));
        assert_eq!(parse_kube_version("1.31.10-rc.0\n"), Some((1, 31, 10)));
        assert_eq!(parse_kube_version("Kubernetes v1.31.2"), None);
        assert!(upgrade_pending("v1.31.2", "v1.30.4"));
        assert!(upgrade_pending("v1.31.10", "v1.31.9"), "numeric, not text");
        assert!(!upgrade_pending("v1.31.2", "v1.31.2"));
        assert!(
            !upgrade_pending("v1.30.4", "v1.31.2"),
            "kubelet ahead: not ours"
        );
        assert!(!upgrade_pending("garbage", "v1.31.2"));
    }

    #[test]
    fn inputs_are_the_kubeadm_binary_its_config_and_patches() {
        let p = plan(
            "  - package: {name: kubeadm, version: 1.31.2-1.1}\n\
             \x20 - package: {name: kubectl, version: 1.31.2-1.1}\n\
             \x20 - artifact: {url: https://x/kubeadm, sha256: \"0000000000000000000000000000000000000000000000000000000000000000\", path: /usr/local/bin/kubeadm}\n\
             \x20 - file: {path: /etc/kubernetes/patches/kubeletconfiguration.yaml, content: x}\n\
             \x20 - file: {path: /etc/kubernetes/other.yaml, content: x}\n\
             \x20 - file: {path: /etc/kubernetes/upgrade.yaml, content: x}\n\
             \x20 - kubeadmUpgradeNode: {extraArgs: [--patches, /etc/kubernetes/patches, --config=/etc/kubernetes/upgrade.yaml]}\n\
             \x20 - package: {name: kubelet, version: 1.31.2-1.1}\n",
        );
        let Change::KubeadmUpgradeNode(k) = &p.changes[6] else {
            panic!()
        };
        let fed: Vec<bool> = p.changes.iter().map(|c| feeds(c, k)).collect();
        assert_eq!(fed, [true, false, true, true, false, true, false, false]);
        assert_eq!(inputs_changed(&p, 6, |_| true), Some(0));
        assert_eq!(inputs_changed(&p, 6, |j| j == 3 || j == 4), Some(3));
        assert_eq!(inputs_changed(&p, 6, |j| j == 1 || j == 4 || j == 7), None);
        assert_eq!(
            inputs_changed(&p, 0, |_| true),
            None,
            "not a kubeadm change"
        );

        let plain = KubeadmUpgradeNodeChange { extra_args: vec![] };
        assert!(
            !feeds(&p.changes[3], &plain),
            "no --patches: files are not inputs"
        );
    }

    #[test]
    fn the_command_line_reads_well() {
        let m = UpgradeNode {
            args: vec!["--patches=/etc/kubernetes/patches".into()],
            timeout: Duration::from_secs(300),
            reason: "changes[0] changed an input of kubeadm in this run".into(),
        };
        assert_eq!(
            m.describe(),
            "run kubeadm upgrade node --patches=/etc/kubernetes/patches (changes[0] changed an \
             input of kubeadm in this run)"
        );
    }
}
