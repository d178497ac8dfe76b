//! What the agent gained for the updater, through the real binary on sandbox trees:
//! managed sets (`options.prune`: a file an earlier plan of the set wrote and this one does
//! not list is removed, with its pre-image, and restored when the plan rolls back) and the
//! validation of package version patterns. (The pattern's resolution against a real package
//! manager runs in tests/updater_e2e.rs on a sandboxed systemd node with apt.)

use crate::support::{Node, header, journal, text};
use serde_json::Value;

fn plan(id: &str, files: &[(&str, &str)], gate_ok: bool) -> String {
    let mut s = header(id);
    s.push_str("options: {prune: {set: kubeadmconfig-files}}\nchanges:\n");
    for (path, content) in files {
        s.push_str(&format!(
            "  - file: {{path: {path}, content: \"{content}\\n\"}}\n"
        ));
    }
    s.push_str(&format!(
        "verify:\n  - command: {{argv: [\"{}\"], timeoutSeconds: 5}}\n",
        if gate_ok { "true" } else { "false" }
    ));
    s
}

fn apply(node: &Node, name: &str, text_: &str) -> (bool, Value, String) {
    let p = node.plan_file(name, text_);
    let out = node.agent(&[
        "apply",
        "--no-chroot",
        "--output",
        "json",
        p.to_str().unwrap(),
    ]);
    let status = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.success(), status, text(&out))
}

#[test]
fn a_file_dropped_from_a_managed_set_is_removed_and_restored_by_a_rollback() {
    let node = Node::new();
    let a = "/etc/kubernetes/a.conf";
    let b = "/etc/kubernetes/b.conf";
    let (ok, _, out) = apply(
        &node,
        "1.yaml",
        &plan("ns/m@1", &[(a, "a1"), (b, "b1")], true),
    );
    assert!(ok, "{out}");
    assert!(node.path(b).exists());

    // b is dropped but the gate fails: b is removed, then restored with a's old content.
    let (ok, status, out) = apply(&node, "2.yaml", &plan("ns/m@2", &[(a, "a2")], false));
    assert!(!ok, "{out}");
    assert_eq!(status["phase"], "RolledBack", "{status}");
    let changes = status["changes"].as_array().unwrap();
    assert_eq!(
        changes.len(),
        2,
        "the plan's file and the removal: {status}"
    );
    assert_eq!(changes[1]["kind"], "absent");
    assert_eq!(changes[1]["target"], b);
    assert_eq!(changes[1]["state"], "RolledBack", "{status}");
    assert_eq!(std::fs::read_to_string(node.path(b)).unwrap(), "b1\n");
    assert_eq!(std::fs::read_to_string(node.path(a)).unwrap(), "a1\n");

    // The same without the failing gate: b is gone; the set now has only a.
    let (ok, status, out) = apply(&node, "3.yaml", &plan("ns/m@3", &[(a, "a3")], true));
    assert!(ok, "{out}");
    assert!(!node.path(b).exists());
    assert_eq!(status["changes"][1]["state"], "Changed", "{status}");
    let records = journal(&node);
    let pruned: Vec<&Value> = records
        .iter()
        .filter(|r| r.to_string().contains("pruneResolved"))
        .collect();
    assert_eq!(pruned.len(), 3, "one decision per run: {records:?}");

    // Nothing more to remove: a fourth plan of the set removes nothing.
    let (ok, status, _) = apply(&node, "4.yaml", &plan("ns/m@4", &[(a, "a3")], true));
    assert!(ok);
    assert_eq!(status["changes"].as_array().unwrap().len(), 1, "{status}");
    // A plan of another set (or none) never removes the set's files.
    let other = plan("ns/m@5", &[("/etc/kubernetes/c.conf", "c")], true)
        .replace("kubeadmconfig-files", "other-set");
    let (ok, _, _) = apply(&node, "5.yaml", &other);
    assert!(ok);
    assert!(node.path(a).exists());
}

#[test]
fn set_names_and_version_patterns_are_validated() {
    let node = Node::new();
    let check = |body: &str| {
        let p = node.plan_file("v.yaml", &format!("{}{body}", header("ns/v@1")));
        node.agent(&["check", "--no-chroot", p.to_str().unwrap()])
    };
    let out = check("options: {prune: {set: Bad_Name}}\nchanges: []\n");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("options.prune.set"), "{}", text(&out));
    for bad in ["\"*\"", "\"1.31*2\"", "\"1.31.2-**\""] {
        let out = check(&format!(
            "changes:\n  - package: {{name: kubelet, version: {bad}}}\n"
        ));
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", text(&out));
        assert!(
            text(&out).contains("changes[0].package.version"),
            "{}",
            text(&out)
        );
    }
    let ok = inplace_plan::parse_plan(
        format!(
            "{}changes:\n  - package: {{name: kubelet, version: \"1.31.2-*\", hold: true}}\n",
            header("ns/v@2")
        )
        .as_bytes(),
        "test",
        &inplace_plan::Limits::default(),
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn a_prune_option_is_part_of_the_digest_only_when_set() {
    let limits = inplace_plan::Limits::default();
    let body = "changes:\n  - file: {path: /etc/kubernetes/a, content: x}\n";
    let without =
        inplace_plan::parse_plan(format!("{}{body}", header("a")).as_bytes(), "t", &limits)
            .unwrap();
    let with = inplace_plan::parse_plan(
        format!("{}options: {{prune: {{set: s}}}}\n{body}", header("a")).as_bytes(),
        "t",
        &limits,
    )
    .unwrap();
    assert_ne!(without.digest(), with.digest());
    assert!(without.canonical_json()["options"].get("prune").is_none());
    // The wire form carries it both ways.
    let wire = inplace_api::convert::plan_to_pb(&with);
    let back = inplace_api::convert::validate_plan(&wire, &limits).unwrap();
    assert_eq!(back.digest(), with.digest());
}
