//! What a program is: its version and the git commit it was built from. The program crate's
//! build script records the commit (`crates/base/build/commit.rs`); [`build!`](crate::build!)
//! reads it where it is expanded, so only the programs' crates are rebuilt when the commit
//! moves. Unknown when built without git and without `INPLACE_AGENT_GIT_COMMIT`.

/// Expands to the [`Build`] of the crate it is used in (whose build script called
/// `record_commit`).
#[macro_export]
macro_rules! build {
    () => {
        $crate::build::Build {
            version: env!("CARGO_PKG_VERSION"),
            commit: env!("INPLACE_AGENT_GIT_COMMIT"),
            modified: env!("INPLACE_AGENT_GIT_MODIFIED"),
        }
    };
}

/// A program's version and commit, as its build script recorded them.
#[derive(Debug, Clone, Copy)]
pub struct Build {
    /// The crate version (`0.1.0`).
    pub version: &'static str,
    /// The full commit hash, or empty when unknown.
    pub commit: &'static str,
    /// `true`, `false`, or empty when unknown.
    pub modified: &'static str,
}

impl Build {
    /// The full commit hash, when known.
    pub fn commit(&self) -> Option<&'static str> {
        Some(self.commit).filter(|c| !c.is_empty())
    }

    /// Whether the sources of the binary differed from that commit when it was built;
    /// `None` when unknown.
    pub fn modified(&self) -> Option<bool> {
        match self.modified {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        }
    }

    /// The commit for labels and documents: its first 12 hex digits, `+modified` when the
    /// tree was modified, or `unknown`.
    pub fn commit_label(&self) -> String {
        match (self.commit(), self.modified()) {
            (Some(c), Some(true)) => format!("{}+modified", &c[..c.len().min(12)]),
            (Some(c), _) => c[..c.len().min(12)].to_string(),
            (None, _) => "unknown".to_string(),
        }
    }

    /// For people: `commit 79f0b64c12ab`, `commit 79f0b64c12ab, modified`, or why it is
    /// unknown.
    pub fn describe_commit(&self) -> String {
        match (self.commit(), self.modified()) {
            (Some(c), Some(true)) => format!("commit {}, modified", &c[..c.len().min(12)]),
            (Some(c), Some(false)) => format!("commit {}", &c[..c.len().min(12)]),
            (Some(c), None) => format!(
                "commit {} (given at build time; whether the tree was modified is unknown)",
                &c[..c.len().min(12)]
            ),
            (None, _) => "commit unknown: built without git metadata".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMIT: &str = "79f0b64c12ab34cd56ef79f0b64c12ab34cd56ef";

    fn build(commit: &'static str, modified: &'static str) -> Build {
        Build {
            version: "0.1.0",
            commit,
            modified,
        }
    }

    #[test]
    fn labels_say_what_is_known() {
        assert_eq!(build(COMMIT, "false").commit_label(), "79f0b64c12ab");
        assert_eq!(
            build(COMMIT, "true").commit_label(),
            "79f0b64c12ab+modified"
        );
        assert_eq!(build("", "").commit_label(), "unknown");
        assert_eq!(
            build(COMMIT, "false").describe_commit(),
            "commit 79f0b64c12ab"
        );
        assert_eq!(
            build(COMMIT, "true").describe_commit(),
            "commit 79f0b64c12ab, modified"
        );
        assert!(build(COMMIT, "").describe_commit().contains("unknown"));
        assert_eq!(build("", "").commit(), None);
        assert_eq!(build(COMMIT, "").modified(), None);
    }
}
