//! What this binary is: its version and the git commit it was built from (recorded by
//! `build.rs`; unknown when it was built without git and without `INPLACE_AGENT_GIT_COMMIT`).

/// The crate version (`0.1.0`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The full commit hash, when known.
pub fn commit() -> Option<&'static str> {
    Some(env!("INPLACE_AGENT_GIT_COMMIT")).filter(|c| !c.is_empty())
}

/// Whether the sources of the binary (the workspace's `crates/`, `Cargo.toml`, `Cargo.lock`)
/// differed from that commit when it was built; `None` when unknown.
pub fn modified() -> Option<bool> {
    match env!("INPLACE_AGENT_GIT_MODIFIED") {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// The commit for labels and documents: its first 12 hex digits, `+modified` when the tree
/// was modified, or `unknown`.
pub fn commit_label() -> String {
    match (commit(), modified()) {
        (Some(c), Some(true)) => format!("{}+modified", &c[..c.len().min(12)]),
        (Some(c), _) => c[..c.len().min(12)].to_string(),
        (None, _) => "unknown".to_string(),
    }
}

/// For people: `commit 79f0b64c12ab`, `commit 79f0b64c12ab, modified`, or why it is unknown.
pub fn describe_commit() -> String {
    match (commit(), modified()) {
        (Some(c), Some(true)) => format!("commit {}, modified", &c[..c.len().min(12)]),
        (Some(c), Some(false)) => format!("commit {}", &c[..c.len().min(12)]),
        (Some(c), None) => format!(
            "commit {} (given at build time; whether the tree was modified is unknown)",
            &c[..c.len().min(12)]
        ),
        (None, _) => "commit unknown: built without git metadata".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This crate is built from a git checkout in development and CI: the commit is known,
    /// is the one `git rev-parse HEAD` names, and the label agrees with it.
    #[test]
    fn the_commit_is_the_checkouts() {
        let head = std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success());
        let Some(head) = head else {
            assert_eq!(commit(), None, "no git here, yet a commit was recorded");
            assert_eq!(commit_label(), "unknown");
            return;
        };
        let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
        assert_eq!(commit(), Some(head.as_str()));
        assert!(modified().is_some());
        assert!(
            commit_label().starts_with(&head[..12]),
            "{}",
            commit_label()
        );
        assert!(describe_commit().starts_with(&format!("commit {}", &head[..12])));
    }
}
