//! `inplace-agent apply` end to end on sandbox trees: idempotence, rollback, retry, resume
//! after a torn journal, exit codes.

use std::os::unix::fs::MetadataExt;

use crate::support;
use crate::support::{Node, header, journal, text};

/// A plan touching every kind this build implements, with a gate that passes.
fn full_plan(id: &str) -> String {
    format!(
        "{}changes:
  - file: {{path: /etc/kubernetes/audit/policy.yaml, content: \"kind: Policy\\n\", mode: \"0640\", owner: \"root:adm\"}}
  - file: {{path: /etc/kubernetes/kubelet.conf, content: \"replaced\\n\"}}
  - file: {{path: /etc/sysctl.d/99-sysctl.conf, content: \"net.core.somaxconn = 1024\\n\", append: true}}
  - absent: {{path: /etc/kubernetes/old-bootstrap.conf}}
  - kubeletConfig: {{mergePatch: {{maxPods: 150, evictionHard: {{memory.available: 200Mi}}}}}}
  - kubeletFlags: {{set: {{node-labels: tier=web, v: 2}}, remove: [pod-infra-container-image]}}
  - sysctl: {{key: net.ipv4.ip_forward, value: \"1\"}}
verify:
  - command: {{argv: [\"true\"], timeoutSeconds: 5}}
",
        header(id)
    )
}

fn failing_plan(id: &str) -> String {
    full_plan(id).replace(
        "argv: [\"true\"]",
        "argv: [\"sh\", \"-c\", \"echo gate says no >&2; exit 3\"]",
    )
}

#[test]
fn second_apply_changes_nothing_and_journals_no_mutation() {
    let node = Node::new();
    let p1 = node.plan_file("p1.yaml", &full_plan("ns/m@1"));
    let out = node.agent(&["apply", "--no-chroot", p1.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("7 changed, 0 unchanged"),
        "{}",
        text(&out)
    );

    let managed = [
        "etc/kubernetes/audit/policy.yaml",
        "etc/kubernetes/kubelet.conf",
        "etc/sysctl.d/99-sysctl.conf",
        "var/lib/kubelet/config.yaml",
        "var/lib/kubelet/kubeadm-flags.env",
        "etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf",
    ];
    let stat = |rel: &str| {
        let m = std::fs::metadata(node.path(rel)).unwrap();
        (
            m.ino(),
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec(),
        )
    };
    let before: Vec<_> = managed.iter().map(|r| stat(r)).collect();
    let tree_before = node.snapshot_without_state();

    // Same desired state, new plan id: every change reports unchanged.
    let p2 = node.plan_file("p2.yaml", &full_plan("ns/m@2"));
    let out = node.agent(&[
        "apply",
        "--no-chroot",
        "--output",
        "json",
        p2.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "Succeeded");
    for c in status["changes"].as_array().unwrap() {
        assert_eq!(c["state"], "Unchanged", "{c}");
    }
    let after: Vec<_> = managed.iter().map(|r| stat(r)).collect();
    assert_eq!(
        before, after,
        "inode, mtime or ctime of a managed file changed"
    );
    assert_eq!(tree_before, node.snapshot_without_state());

    let run2: Vec<_> = journal(&node)
        .into_iter()
        .filter(|r| r["run"] == 2)
        .map(|r| r["type"].as_str().unwrap().to_string())
        .collect();
    assert!(!run2.is_empty());
    for t in &run2 {
        assert!(
            ![
                "stepStarted",
                "stepRolledBack",
                "unitJobStarted",
                "unitJobDone",
                "daemonReloaded"
            ]
            .contains(&t.as_str()),
            "run 2 journaled a mutation record: {run2:?}"
        );
    }

    // The same plan id again: nothing runs, the old status is returned.
    let out = node.agent(&["apply", "--no-chroot", p1.to_str().unwrap()]);
    assert!(out.status.success());
    assert!(
        text(&out).contains("already ran on this node"),
        "{}",
        text(&out)
    );
}

#[test]
fn failing_gate_restores_every_file_with_mode_and_owner() {
    let node = Node::new();
    if support::is_root() {
        // Owners that differ from root, to see them restored.
        std::fs::write(
            node.path("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\netcd:x:998:997::/var/lib/etcd:/sbin/nologin\n",
        )
        .unwrap();
        std::fs::write(node.path("etc/group"), "root:x:0:\nadm:x:4:\netcd:x:997:\n").unwrap();
        std::os::unix::fs::chown(
            node.path("etc/kubernetes/kubelet.conf"),
            Some(998),
            Some(997),
        )
        .unwrap();
    }
    std::fs::set_permissions(
        node.path("etc/kubernetes/kubelet.conf"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let before = node.snapshot_without_state();
    let plan = node.plan_file("bad.yaml", &failing_plan("ns/m@bad"));
    let out = node.agent(&[
        "apply",
        "--no-chroot",
        "--output",
        "json",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "RolledBack");
    assert_eq!(status["error"]["kind"], "verification");
    assert_eq!(
        status["error"]["step"],
        "verify[0] command sh -c echo gate says no >&2; exit 3"
    );
    assert!(
        status["error"]["detail"]
            .as_str()
            .unwrap()
            .contains("exit status 3: gate says no"),
        "{status}"
    );
    assert_eq!(status["hookResponse"]["status"], "Failure");
    assert_eq!(status["counts"]["rolledBack"], 7);
    let after = node.snapshot_without_state();
    assert_eq!(support::diff(&before, &after), Vec::<String>::new());
    assert!(
        !node.path("etc/kubernetes/audit").exists(),
        "created directory not removed"
    );

    // A finished failed plan does not run again by itself...
    let out = node.agent(&["apply", "--no-chroot", plan.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("use --retry"), "{}", text(&out));
    assert_eq!(
        support::diff(&before, &node.snapshot_without_state()),
        Vec::<String>::new()
    );
    // ...only through an explicit retry, as attempt 2.
    let out = node.agent(&[
        "apply",
        "--no-chroot",
        "--retry",
        "--output",
        "json",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["attempt"], 2);
}

#[test]
fn rollback_can_be_turned_off() {
    let node = Node::new();
    let text_plan = failing_plan("ns/m@norollback")
        .replace("changes:", "options: {rollbackOnFailure: false}\nchanges:");
    let plan = node.plan_file("p.yaml", &text_plan);
    let out = node.agent(&[
        "apply",
        "--no-chroot",
        "--output",
        "json",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "Failed");
    assert!(node.path("etc/kubernetes/audit/policy.yaml").exists());
}

#[test]
fn torn_journal_tail_is_truncated_with_a_warning_and_the_agent_converges() {
    let reference = Node::new();
    let plan_text = full_plan("ns/m@torn");
    let p = reference.plan_file("p.yaml", &plan_text);
    assert!(
        reference
            .agent(&["apply", "--no-chroot", p.to_str().unwrap()])
            .status
            .success()
    );
    let want = reference.snapshot_without_state();

    let node = Node::new();
    let p = node.plan_file("p.yaml", &plan_text);
    assert!(
        node.agent(&["apply", "--no-chroot", p.to_str().unwrap()])
            .status
            .success()
    );
    let jpath = node.path("var/lib/inplace-agent/journal/journal.log");
    let full = std::fs::read(&jpath).unwrap();
    let last = full[..full.len() - 1]
        .iter()
        .rposition(|b| *b == b'\n')
        .unwrap()
        + 1;
    for cut in last + 1..full.len() {
        std::fs::write(&jpath, &full[..cut]).unwrap();
        // The torn record is the plan's last one: the same plan resumes and finishes.
        let out = node.agent(&["apply", "--no-chroot", p.to_str().unwrap()]);
        assert!(out.status.success(), "cut at {cut}: {}", text(&out));
        assert!(
            text(&out).contains("torn record"),
            "cut at {cut}: no warning: {}",
            text(&out)
        );
        assert_eq!(node.snapshot_without_state(), want, "cut at {cut}");
        let verify = node.agent(&["journal", "--verify"]);
        assert!(verify.status.success(), "{}", text(&verify));
    }
}

#[test]
fn check_reports_changes_and_disruption_without_writing() {
    let node = Node::new();
    let before = node.snapshot();
    let plan = node.plan_file(
        "p.yaml",
        &format!(
            "{}changes:\n  - kubeletConfig: {{mergePatch: {{maxPods: 110}}}}\n  - file: {{path: /etc/kubernetes/x, content: x, restartUnits: [containerd.service]}}\n  - package: {{name: kubelet, version: 1.31.2-1.1}}\n",
            header("ns/m@check")
        ),
    );
    let out = node.agent(&["check", "--output", "json", plan.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "the sandbox has no package manager: {}",
        text(&out)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["kind"], "CheckResult");
    assert_eq!(report["changes"][0]["result"], "unchanged");
    assert_eq!(report["changes"][1]["result"], "wouldChange");
    assert_eq!(report["changes"][2]["result"], "invalid");
    assert!(
        report["changes"][2]["detail"]
            .as_str()
            .unwrap()
            .contains("no supported package manager in "),
        "{report:#}"
    );
    assert_eq!(report["disruption"], "Restart");
    assert_eq!(
        report["restartUnits"],
        serde_json::json!(["containerd.service"])
    );
    assert_eq!(node.snapshot(), before, "check wrote something");
}

#[test]
fn plans_for_another_node_are_refused() {
    let node = Node::new();
    let plan = node.plan_file(
        "p.yaml",
        &format!("{}nodeName: worker-2\nchanges: []\n", header("ns/m@other")),
    );
    let before = node.snapshot();
    let out = node.agent(&["apply", "--node-name", "worker-1", plan.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("is for node \"worker-2\", this is node \"worker-1\""),
        "{}",
        text(&out)
    );
    assert_eq!(node.snapshot(), before);
}

/// Rollback attempts every undo in reverse order and says exactly which could not be
/// restored: a change whose file the gate replaced by a directory cannot be put back, and
/// the changes before and after it are restored all the same.
#[test]
fn rollback_restores_every_change_it_can_and_names_the_one_it_cannot() {
    let node = Node::new();
    let dir = node.path("etc/kubernetes/ra");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("b.conf"), "b before\n").unwrap();
    let before = node.snapshot_without_state();
    let b = dir.join("b.conf");
    let gate = format!("rm -f {b} && mkdir -p {b}/x && exit 1", b = b.display());
    let plan = format!(
        "{}changes:
  - file: {{path: /etc/kubernetes/ra/a.conf, content: \"a\\n\"}}
  - file: {{path: /etc/kubernetes/ra/b.conf, content: \"b after\\n\"}}
  - file: {{path: /etc/kubernetes/ra/c.conf, content: \"c\\n\"}}
  - kubeletConfig: {{mergePatch: {{maxPods: 42}}}}
verify:
  - command: {{argv: [\"sh\", \"-c\", {gate:?}], timeoutSeconds: 1, periodSeconds: 1}}
",
        header("ns/m@rollback-all")
    );
    let p = node.plan_file("p.yaml", &plan);
    let out = node.agent(&[
        "apply",
        "--no-chroot",
        "--output",
        "json",
        p.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "Failed", "{status}");
    assert_eq!(status["error"]["kind"], "rollback_failed");
    assert_eq!(
        status["error"]["step"],
        "changes[1] file /etc/kubernetes/ra/b.conf"
    );
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("rollback could not restore this change: ")
            && detail.contains("is a directory")
            && detail
                .contains("; the other 3 changed changes were restored; the node needs attention"),
        "{detail}"
    );
    let states: Vec<&str> = status["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states,
        ["RolledBack", "RollbackFailed", "RolledBack", "RolledBack"]
    );
    assert_eq!(status["counts"]["rolledBack"], 3);
    // Everything but b.conf (now the gate's directory) is as before.
    let after = node.snapshot_without_state();
    let diff = support::diff(&before, &after);
    assert!(
        diff.iter().all(|d| d.contains("etc/kubernetes/ra/b.conf")),
        "{diff:?}"
    );
    assert!(!node.path("etc/kubernetes/ra/a.conf").exists());
    assert!(!node.path("etc/kubernetes/ra/c.conf").exists());
    let kinds: Vec<String> = journal(&node)
        .iter()
        .map(|r| r["type"].as_str().unwrap().to_string())
        .filter(|t| t.starts_with("stepRoll"))
        .collect();
    assert_eq!(
        kinds,
        [
            "stepRolledBack",
            "stepRolledBack",
            "stepRollbackFailed",
            "stepRolledBack"
        ]
    );
}

/// The reproduction of a plan whose paths fight: `check` refuses it (it used to say it
/// applies cleanly, and `apply` then failed half-way with "Not a directory" and left the
/// first changes applied).
#[test]
fn a_plan_whose_paths_fight_is_refused_before_anything_changes() {
    let node = Node::new();
    let plan = format!(
        "{}changes:
  - file: {{path: /etc/kubernetes/first.conf, content: \"1\\n\"}}
  - file: {{path: /etc/kubernetes/d, content: \"d\\n\"}}
  - file: {{path: /etc/kubernetes/d/y.conf, content: \"y\\n\"}}
",
        header("ns/m@fight")
    );
    let p = node.plan_file("p.yaml", &plan);
    let before = node.snapshot();
    for cmd in ["check", "apply"] {
        let out = node.agent(&[cmd, p.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {}", text(&out));
        assert!(
            text(&out).contains(
                "changes[2].file.path: /etc/kubernetes/d/y.conf is below /etc/kubernetes/d"
            ),
            "{cmd}: {}",
            text(&out)
        );
    }
    assert_eq!(
        support::diff(&before, &node.snapshot()),
        Vec::<String>::new()
    );
}

/// A file a plan replaces is backed up as itself, hard-linked into the backup store instead
/// of copied, unless a process has it open for writing (which could still change it once
/// replaced): that one is copied. A plan that fails without rolling back keeps both backups;
/// the same plan rolling back restores both byte for byte.
#[test]
fn a_replaced_file_is_backed_up_as_itself_unless_it_is_open_for_writing() {
    let sha = |b: &[u8]| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(b))
    };
    let old_a: Vec<u8> = (0..(2 << 20) as u32).map(|i| (i * 7 % 251) as u8).collect();
    let old_b: Vec<u8> = (0..(64 << 10) as u32)
        .map(|i| (i * 13 % 241) as u8)
        .collect();
    let setup = |node: &Node| {
        std::fs::create_dir_all(node.path("etc/kubernetes/big")).unwrap();
        std::fs::write(node.path("etc/kubernetes/big/a.conf"), &old_a).unwrap();
        std::fs::write(node.path("etc/kubernetes/big/b.conf"), &old_b).unwrap();
        // Held open for writing while the plan runs.
        std::fs::OpenOptions::new()
            .append(true)
            .open(node.path("etc/kubernetes/big/b.conf"))
            .unwrap()
    };
    let plan = |id: &str, rollback: bool| {
        format!(
            "{}options: {{rollbackOnFailure: {rollback}}}\nchanges:
  - file: {{path: /etc/kubernetes/big/a.conf, content: \"new a\\n\"}}
  - file: {{path: /etc/kubernetes/big/b.conf, content: \"new b\\n\"}}
verify:
  - command: {{argv: [\"false\"], timeoutSeconds: 5}}
",
            header(id)
        )
    };

    let node = Node::new();
    let writer = setup(&node);
    let ino_a = std::fs::metadata(node.path("etc/kubernetes/big/a.conf"))
        .unwrap()
        .ino();
    let ino_b = std::fs::metadata(node.path("etc/kubernetes/big/b.conf"))
        .unwrap()
        .ino();
    let p = node.plan_file("p.yaml", &plan("ns/m@kept", false));
    let out = node.agent(&["apply", "--no-chroot", "-o", "json", p.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "Failed");
    drop(writer);
    let backups = node.path("var/lib/inplace-agent/backups");
    let blob_a = std::fs::metadata(backups.join(sha(&old_a))).unwrap();
    assert_eq!(
        (blob_a.ino(), blob_a.nlink()),
        (ino_a, 1),
        "the replaced file itself, the store's alone"
    );
    let blob_b = std::fs::metadata(backups.join(sha(&old_b))).unwrap();
    assert_ne!(blob_b.ino(), ino_b, "a copy of the file open for writing");
    assert_eq!(std::fs::read(backups.join(sha(&old_b))).unwrap(), old_b);
    assert_eq!(
        std::fs::read(node.path("etc/kubernetes/big/a.conf")).unwrap(),
        b"new a\n"
    );

    let node = Node::new();
    let writer = setup(&node);
    let before = node.snapshot_without_state();
    let p = node.plan_file("p.yaml", &plan("ns/m@back", true));
    let out = node.agent(&["apply", "--no-chroot", "-o", "json", p.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    drop(writer);
    let after = node.snapshot_without_state();
    assert!(
        support::diff(&before, &after).is_empty(),
        "{:#?}",
        support::diff(&before, &after)
    );
}
