//! A node whose filesystem fills up: a plan whose staged contents do not fit is refused
//! before anything changes; a write that does not fit mid-plan fails cleanly and rolls
//! back. Neither leaves a partial, temp or staged file. A backup store that fills up fails
//! the plan at the first change whose backup does not fit. Needs root (it mounts a small
//! tmpfs).

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

/// Runs an eight-file plan (96 KiB each, `append` as given) on a 512 KiB tmpfs; returns the
/// output, with the tree before and after.
fn fill_the_disk(append: bool) -> (std::process::Output, TreeDiff, tempfile::TempDir, Tmpfs) {
    let fs = Tmpfs::mount("512k");
    let root = fs.dir.path().to_path_buf();
    inplace_demo_node::build_kubeadm_worker(&root).unwrap();
    // The journal and backups live on the ordinary disk; the node's filesystem fills up.
    let state = tempfile::tempdir().unwrap();
    let before = support::snapshot(&root, &[]);

    // Each file is 96 KiB: the first few fit, one of them does not.
    let chunk = "x".repeat(96 * 1024);
    let mut changes = String::from(
        "  - kubeletConfig: {mergePatch: {maxPods: 150}}\n  - kubeletFlags: {set: {v: \"4\"}}\n",
    );
    for i in 0..8 {
        changes.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/big/f{i}.bin, content: \"{chunk}\", append: {append}}}\n"
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
        .arg(&root)
        .arg("--state-dir")
        .arg(state.path())
        .arg(&plan)
        .output()
        .unwrap();
    let after = support::snapshot(&root, &[]);
    let leftovers = after
        .keys()
        .filter(|k| k.contains("inplace-tmp") || k.contains(".inplace-r"))
        .cloned()
        .collect();
    let verify = Command::new(support::bin())
        .args(["journal", "--verify", "--root"])
        .arg(&root)
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .unwrap();
    assert!(verify.status.success(), "{}", text(&verify));
    let diff = TreeDiff {
        changed: support::diff(&before, &after),
        leftovers,
    };
    (out, diff, state, fs)
}

/// What differs from the tree before the apply, and the temp or staged files left.
struct TreeDiff {
    changed: Vec<String>,
    leftovers: Vec<String>,
}

/// Written at their steps (`append` is never staged): the step that does not fit fails,
/// the run rolls back.
#[test]
fn filling_the_disk_rolls_back_and_leaves_no_temp_file() {
    if !support::require_root(
        "filling_the_disk_rolls_back_and_leaves_no_temp_file",
        "it mounts a small tmpfs",
    ) {
        return;
    }
    let (out, diff, _state, _fs) = fill_the_disk(true);
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
    assert_eq!(diff.changed, Vec::<String>::new(), "tree not restored");
    assert_eq!(diff.leftovers, Vec::<String>::new(), "temp files left");
}

/// Staged before the plan is accepted (more than 64 KiB of content): the content that does
/// not fit refuses the plan, and nothing on the node changed at all.
#[test]
fn a_plan_whose_contents_do_not_fit_is_refused_before_anything_changes() {
    if !support::require_root(
        "a_plan_whose_contents_do_not_fit_is_refused_before_anything_changes",
        "it mounts a small tmpfs",
    ) {
        return;
    }
    let (out, diff, state, _fs) = fill_the_disk(false);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("could not stage the plan's file contents")
            && stderr.contains("/etc/kubernetes/big/f")
            && stderr.contains("No space left on device")
            && stderr.contains("nothing on the node was changed"),
        "{stderr}"
    );
    assert_eq!(diff.changed, Vec::<String>::new(), "tree changed");
    assert_eq!(diff.leftovers, Vec::<String>::new(), "staged files left");
    // Not accepted: the agent knows no such plan.
    let status = Command::new(support::bin())
        .args(["status", "ns/m@enospc", "--state-dir"])
        .arg(state.path())
        .output()
        .unwrap();
    assert!(!status.status.success(), "{}", text(&status));
}

/// The backup store fills up while a batch's pre-images are captured (two at a time): the
/// first change in order whose backup does not fit fails the plan, the changes before it
/// are rolled back from their backups, and no temporary blob is left behind.
#[test]
fn backups_that_do_not_fit_fail_the_plan_at_the_first_change_and_roll_back() {
    if !support::require_root(
        "backups_that_do_not_fit_fail_the_plan_at_the_first_change_and_roll_back",
        "it mounts a small tmpfs",
    ) {
        return;
    }
    // The node is on the ordinary disk; the journal and backups on a 640 KiB tmpfs, which
    // holds six of the eight 96 KiB files being replaced.
    let state = Tmpfs::mount("640k");
    let node = tempfile::tempdir().unwrap();
    let root = node.path();
    inplace_demo_node::build_kubeadm_worker(root).unwrap();
    let big = root.join("etc/kubernetes/big");
    std::fs::create_dir_all(&big).unwrap();
    let mut changes = String::new();
    for i in 0..8 {
        let old: String = format!("old {i} ").repeat(96 * 1024 / 6);
        std::fs::write(big.join(format!("f{i}.bin")), &old[..96 * 1024]).unwrap();
        changes.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/big/f{i}.bin, content: \"{}\"}}\n",
            "x".repeat(96 * 1024)
        ));
    }
    let before = support::snapshot(root, &[]);
    let plan_dir = tempfile::tempdir().unwrap();
    let plan = plan_dir.path().join("p.yaml");
    std::fs::write(
        &plan,
        format!("{}changes:\n{changes}", header("ns/m@backups-full")),
    )
    .unwrap();

    let out = Command::new(support::bin())
        .args(["apply", "--services", "off", "--output", "json", "--root"])
        .arg(root)
        .arg("--state-dir")
        .arg(state.dir.path())
        .arg(&plan)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    assert_eq!(status["error"]["kind"], "disk_full", "{status:#}");
    let step = status["error"]["step"].as_str().unwrap();
    assert!(step.contains("/etc/kubernetes/big/f"), "{status:#}");
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("backing up /etc/kubernetes/big/f")
            && detail.contains("No space left on device"),
        "{detail}"
    );
    // The failure reported is the first change in order that failed: every change before
    // it was applied (and then rolled back), none after it.
    let failed: usize = step
        .strip_prefix("changes[")
        .and_then(|s| s.split(']').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("step {step:?}"));
    let steps = status["changes"].as_array().unwrap();
    for (i, s) in steps.iter().enumerate() {
        let want = match i.cmp(&failed) {
            std::cmp::Ordering::Less => "RolledBack",
            std::cmp::Ordering::Equal => "Failed",
            std::cmp::Ordering::Greater => "Skipped",
        };
        assert_eq!(s["state"], want, "change {i}: {status:#}");
    }

    let after = support::snapshot(root, &[]);
    assert_eq!(
        support::diff(&before, &after),
        Vec::<String>::new(),
        "tree not restored"
    );
    let leftovers: Vec<String> = support::snapshot(state.dir.path(), &[])
        .into_keys()
        .filter(|k| k.contains("partial"))
        .collect();
    assert_eq!(leftovers, Vec::<String>::new(), "temporary blobs left");
    let verify = Command::new(support::bin())
        .args(["journal", "--verify", "--root"])
        .arg(root)
        .arg("--state-dir")
        .arg(state.dir.path())
        .output()
        .unwrap();
    assert!(verify.status.success(), "{}", text(&verify));
}
