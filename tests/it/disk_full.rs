//! A node whose filesystem fills up mid-plan: the apply fails cleanly, rolls back, and leaves
//! no partial or temp file. Needs root (it mounts a small tmpfs).

use std::process::Command;

use crate::support;
use crate::support::{header, text};

/// A tmpfs mounted for the test, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::Builder::new()
            .prefix("inplace-enospc-")
            .tempdir()
            .unwrap();
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(dir.path())
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount tmpfs");
        Tmpfs { dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[test]
fn filling_the_disk_rolls_back_and_leaves_no_temp_file() {
    if !support::require_root(
        "filling_the_disk_rolls_back_and_leaves_no_temp_file",
        "it mounts a small tmpfs",
    ) {
        return;
    }
    let fs = Tmpfs::mount("512k");
    let root = fs.dir.path();
    inplace_agent::sandbox::tree::build_kubeadm_worker(root).unwrap();
    // The journal and backups live on the ordinary disk; the node's filesystem fills up.
    let state = tempfile::tempdir().unwrap();
    let before = support::snapshot(root, &[]);

    // Each file is 96 KiB: the first few fit, one of them does not.
    let chunk = "x".repeat(96 * 1024);
    let mut changes = String::from(
        "  - kubeletConfig: {mergePatch: {maxPods: 150}}\n  - kubeletFlags: {set: {v: \"4\"}}\n",
    );
    for i in 0..8 {
        changes.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/big/f{i}.bin, content: \"{chunk}\"}}\n"
        ));
    }
    let plan_dir = tempfile::tempdir().unwrap();
    let plan = plan_dir.path().join("p.yaml");
    std::fs::write(
        &plan,
        format!("{}changes:\n{changes}", header("ns/m@enospc")),
    )
    .unwrap();

    let out = Command::new(support::bin())
        .args(["apply", "--services", "off", "--output", "json", "--root"])
        .arg(root)
        .arg("--state-dir")
        .arg(state.path())
        .arg(&plan)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    assert_eq!(status["error"]["kind"], "disk_full", "{status:#}");
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(detail.contains("No space left on device"), "{detail}");
    assert!(
        status["error"]["step"]
            .as_str()
            .unwrap()
            .contains("/etc/kubernetes/big/f"),
        "{status:#}"
    );

    let after = support::snapshot(root, &[]);
    assert_eq!(
        support::diff(&before, &after),
        Vec::<String>::new(),
        "tree not restored"
    );
    let leftovers: Vec<_> = after.keys().filter(|k| k.contains("inplace-tmp")).collect();
    assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");

    let verify = Command::new(support::bin())
        .args(["journal", "--verify", "--root"])
        .arg(root)
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .unwrap();
    assert!(verify.status.success(), "{}", text(&verify));
}
