//! Journal compatibility: nodes upgrade the agent while a journal written by the previous
//! release is on disk, possibly with an unfinished plan. `tests/fixtures/golden-journal/` is
//! such a journal, written by the release at commit 79f0b64 (`make.sh` there says how): the
//! demo's plans, a compaction with its summary records, succeeded, rolled-back and failed
//! plans, and a plan aborted after its second change. The current agent must read it, report
//! the same statuses, and resume the unfinished plan from the old records (it is long past
//! its timeout, so it rolls back from the pre-images the old release journaled). A change of the on-disk format keeps
//! this test green or adds a migration; never edit the fixture to make it pass.

use std::path::Path;

use crate::support;
use crate::support::{Node, text};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/golden-journal");

fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&dest).unwrap();
            copy_tree(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), &dest).unwrap();
        }
    }
}

/// A kubeadm-like node as the old release left it: its files and its state directory.
fn golden_node() -> Node {
    let node = Node::new();
    copy_tree(&Path::new(FIXTURE).join("node"), node.root());
    std::fs::remove_file(node.path("etc/kubernetes/old-bootstrap.conf")).unwrap();
    let state = node.path("var/lib/inplace-agent");
    std::fs::create_dir_all(&state).unwrap();
    copy_tree(&Path::new(FIXTURE).join("state"), &state);
    node
}

fn fixture_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(Path::new(FIXTURE).join(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fields of a plan status whose meaning the on-disk format fixes.
fn stable(status: &serde_json::Value) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for key in [
        "id", "digest", "attempt", "run", "source", "phase", "counts", "error",
    ] {
        if let Some(v) = status.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    serde_json::Value::Object(out)
}

/// The local status (read from the journal: no agent runs). It exits 1 when the most recent
/// plan did not succeed, so only a document is required here.
fn local_status(node: &Node) -> serde_json::Value {
    let out = node.agent(&["status", "--output", "json"]);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
}

#[test]
fn a_journal_of_the_previous_release_reads_verifies_and_resumes() {
    let node = golden_node();

    // It verifies, record by record, with the same sequence numbers and hashes.
    let out = node.agent(&["journal", "--verify"]);
    assert!(out.status.success(), "{}", text(&out));
    let want: Vec<serde_json::Value> = fixture_json("expected-records.json")
        .as_array()
        .unwrap()
        .clone();
    let got: Vec<serde_json::Value> = support::journal(&node)
        .iter()
        .map(|r| serde_json::json!([r["seq"], r["run"], r["type"], r["hash"]]))
        .collect();
    assert_eq!(got, want, "the records as the old release wrote them");

    // The same statuses as the old release reported.
    let want = fixture_json("expected-status.json");
    let status = local_status(&node);
    assert_eq!(stable(&status["current"]), want["current"]);
    let recent: Vec<_> = status["recent"]
        .as_array()
        .unwrap()
        .iter()
        .map(stable)
        .collect();
    assert_eq!(recent, *want["recent"].as_array().unwrap());

    // The unfinished plan resumes, in the same run. It was started when the fixture was made,
    // so its 900 s timeout has long passed: it times out at its first step boundary and is
    // rolled back from the pre-images the old release journaled — every file it wrote is
    // removed, the kubelet configuration restored byte for byte.
    let config_before = std::fs::read(node.path("var/lib/kubelet/config.yaml")).unwrap();
    let plan = Path::new(FIXTURE).join("unfinished.yaml");
    let out = node.agent(&["apply", "--no-progress", plan.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    for file in ["u1", "u2", "u3"] {
        let p = node.path(&format!("etc/kubernetes/golden/{file}.conf"));
        assert!(!p.exists(), "{file} rolled back");
    }
    let config = std::fs::read_to_string(node.path("var/lib/kubelet/config.yaml")).unwrap();
    assert!(!config.contains("maxPods: 130"), "{config}");
    assert_ne!(
        config.as_bytes(),
        config_before,
        "the resumed run's write was undone"
    );
    let status = local_status(&node);
    let finished = &status["recent"][0];
    assert_eq!(finished["id"], "golden/unfinished@crash");
    assert_eq!(finished["run"], 21, "the same run, resumed, not a new one");
    assert_eq!(finished["phase"], "RolledBack", "{finished}");
    assert_eq!(finished["error"]["kind"], "timeout", "{finished}");
    let out = node.agent(&["journal", "--verify"]);
    assert!(out.status.success(), "{}", text(&out));
    // Submitted again, it is the same plan (the old release journaled its digest by the
    // first definition): it already ran, nothing starts.
    let out = node.agent(&["apply", "--no-progress", plan.to_str().unwrap()]);
    assert!(
        text(&out).contains("already ran on this node: attempt 1"),
        "{}",
        text(&out)
    );
    let status = local_status(&node);
    assert_eq!(status["recent"][0]["run"], 21, "{status}");
    assert_eq!(status["recent"][0]["digest"], finished["digest"]);
    let leftovers: Vec<_> = support::snapshot(node.root(), &[])
        .into_keys()
        .filter(|k| k.ends_with(".inplace-tmp") || k.contains(".inplace-r"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
