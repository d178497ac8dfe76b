//! `kubeadmUpgradeNode`: runs `kubeadm upgrade node` in the node's root with the step timeout:
//! the node's own kubeadm, chrooted into the root, or without chroot the root's kubeadm
//! started in the root ([`command::node_program`]), never one on the agent's `PATH`.
//!
//! It is an action, not a state, so "desired state" needs a definition. It **runs** when
//!
//! 1. an earlier change of the plan that feeds kubeadm changed the node in this run (or, in
//!    a dry run, would): a `package` named `kubeadm`, an `artifact` installed at a path whose
//!    file name is `kubeadm`, a `file`/`absent` at the `--config` file or under the
//!    `--patches` directory given in `extraArgs`, or a `file`/`absent` at the cluster
//!    configuration record ([`CLUSTER_CONFIGURATION_RECORD`]: the updater's plans for a
//!    control-plane Machine write the cluster configuration KubeadmControlPlane moved
//!    there, so its change regenerates the static pod manifests) ([`feeds`]); or
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
//! rollback (the record itself is a `file` change, restored by its own step). What else
//! kubeadm does (certificate renewal, etcd upgrade on control-plane nodes) is not undone.

use serde::{Deserialize, Serialize};

use super::{Note, StepError};
use crate::host::Host;
use crate::host::command;
use crate::journal::backup::{BackupStore, BlobBatch};
use crate::journal::{FileBefore, Preimage};
use inplace_base::ErrorKind;
use inplace_plan::NodePath;
use inplace_plan::kinds::{KUBEADM_TARGET, REWRITES, UpgradeNode};

/// `Preimage::Other` kind of this step's pre-images.
pub const PREIMAGE_KIND: &str = "kubeadmUpgradeNode";

/// Most bytes of kubeadm's output kept (journal and error).
const MAX_OUTPUT: usize = 64 * 1024;

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
pub fn capture(host: &Host, backups: &BlobBatch<'_>) -> Result<Preimage, StepError> {
    let mut files = Vec::new();
    for p in REWRITES {
        let path = NodePath::parse(p)
            .map_err(|e| StepError::new(ErrorKind::Internal, format!("{p}: {e}")))?;
        let before = super::capture_file(host, backups, &path, super::Keep::Copy)?;
        files.push(Rewritten { path, before });
    }
    let before = UpgradeNodeBefore {
        target: KUBEADM_TARGET.to_string(),
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
    let mut spec = command::node_program(host, m.argv()).timeout(m.timeout);
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
    use std::time::Duration;

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
