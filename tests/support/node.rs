//! A sandbox node tree (a kubeadm worker's files in a temp dir), the real binary run on it,
//! and snapshots of a whole tree (content hash, mode, owner) for before/after comparisons.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

/// The agent binary under test.
pub fn bin() -> &'static str {
    super::programs::check_fresh();
    super::programs::AGENT
}

/// True when the tests run as root (CI does).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Whether a root-only test runs: yes as root; a failure when CI=true without root (CI must
/// run it); otherwise a loud SKIP line saying `why` root is needed, and no.
pub fn require_root(test: &str, why: &str) -> bool {
    if is_root() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test} needs root ({why}) and CI=true: it must run here");
    }
    super::say(&format!(
        "\n*** SKIPPED {test}: needs root ({why}); CI runs it as root ***\n"
    ));
    false
}

/// A sandbox node: a temp dir holding a kubeadm worker tree.
pub struct Node {
    pub dir: tempfile::TempDir,
    /// Files a test keeps beside the node (configuration, flags, plans): removed with it.
    scratch: tempfile::TempDir,
}

impl Node {
    /// A fresh kubeadm-like worker tree.
    pub fn new() -> Node {
        super::programs::check_fresh();
        let dir = tempfile::Builder::new()
            .prefix("inplace-test-")
            .tempdir()
            .expect("tempdir");
        inplace_demo_node::build_kubeadm_worker(dir.path()).expect("sandbox tree");
        let scratch = tempfile::Builder::new()
            .prefix("inplace-test-scratch-")
            .tempdir()
            .expect("tempdir");
        Node { dir, scratch }
    }

    /// A path outside the node's tree for the test's own files (`name`), removed when the
    /// node is dropped.
    pub fn beside(&self, name: &str) -> PathBuf {
        self.scratch.path().join(name)
    }

    /// The root path.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// A path inside the node.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel.trim_start_matches('/'))
    }

    /// Writes a plan file next to (not inside) the node tree and returns its path.
    pub fn plan_file(&self, name: &str, text: &str) -> PathBuf {
        let dir = self.dir.path().with_extension("plans");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// Runs the agent with `--root` set to this node.
    pub fn agent(&self, args: &[&str]) -> Output {
        self.agent_env(args, &[])
    }

    /// Runs the agent with extra environment.
    pub fn agent_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(bin());
        cmd.args(args)
            .arg("--root")
            .arg(self.root())
            .env_remove("INPLACE_AGENT_CRASH_AT")
            .env("INPLACE_AGENT_LOG", "error")
            // A plain directory tree: no systemd to manage (restarts are journaled skipped).
            .env("INPLACE_AGENT_SERVICES", "off");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("run inplace-agent")
    }

    /// A snapshot of the whole tree.
    pub fn snapshot(&self) -> Snapshot {
        snapshot(self.root(), &[])
    }

    /// A snapshot without the agent's state directory.
    pub fn snapshot_without_state(&self) -> Snapshot {
        snapshot(self.root(), &["var/lib/inplace-agent"])
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.dir.path().with_extension("plans"));
    }
}

/// Per path: kind, sha256 of content (or link target), mode, uid, gid.
pub type Snapshot = BTreeMap<String, (char, String, u32, u32, u32)>;

/// Walks a tree (not following symlinks), skipping the given relative prefixes.
pub fn snapshot(root: &Path, skip: &[&str]) -> Snapshot {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if skip
                .iter()
                .any(|s| rel == *s || rel.starts_with(&format!("{s}/")))
            {
                continue;
            }
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let (kind, hash) = if meta.file_type().is_symlink() {
                (
                    'l',
                    std::fs::read_link(&path).unwrap().display().to_string(),
                )
            } else if meta.is_dir() {
                stack.push(path.clone());
                ('d', String::new())
            } else if !meta.is_file() {
                // A socket (the status socket of a `serve` on this root) or a FIFO.
                ('s', String::new())
            } else {
                (
                    'f',
                    hex::encode(Sha256::digest(std::fs::read(&path).unwrap())),
                )
            };
            out.insert(
                rel,
                (kind, hash, meta.mode() & 0o7777, meta.uid(), meta.gid()),
            );
        }
    }
    out
}

/// Lines of the differences between two snapshots, for assertion messages.
pub fn diff(a: &Snapshot, b: &Snapshot) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in a {
        match b.get(k) {
            None => out.push(format!("only before: {k}")),
            Some(w) if w != v => out.push(format!("changed: {k}: {v:?} -> {w:?}")),
            _ => {}
        }
    }
    for k in b.keys() {
        if !a.contains_key(k) {
            out.push(format!("only after: {k}"));
        }
    }
    out
}

/// stdout + stderr as text.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The plan header with an id.
pub fn header(id: &str) -> String {
    format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\n")
}

/// The journal records of a node, as JSON values.
pub fn journal(node: &Node) -> Vec<serde_json::Value> {
    let out = node.agent(&["journal", "--output", "json"]);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}
