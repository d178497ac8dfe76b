//! inplace-agent: the node-side agent for Cluster API in-place updates.
//!
//! Data flows one way: the plan (`inplace_plan`: model, validation, digest, one file per
//! change kind) → `engine` (state machine, scheduling, rollback) → `steps` (the executor every
//! kind's mutations go through) over `host` (the only code that touches the node), with
//! `journal` beside the engine. The crate graph holds the flow between crates;
//! `architecture.rs` checks the rooms inside this one; see ARCHITECTURE.md.
// Unsafe code only in `host::memory` (two allocator calls), which says why.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cli;
pub mod config;
pub mod engine;
pub(crate) mod failpoint;
pub mod host;
pub mod journal;
pub(crate) mod notify;
pub mod rpc;
pub mod sandbox;
pub mod status;
pub(crate) mod steps;

/// The agent's version and the commit it was built from (`inplace-agent version`, the status
/// document, the `build_info` metric).
pub const BUILD: inplace_base::build::Build = inplace_base::build!();

#[cfg(test)]
mod build_tests {
    /// Built from a git checkout in development and CI: the commit is known, is the one
    /// `git rev-parse HEAD` names, and the label agrees with it.
    #[test]
    fn the_commit_is_the_checkouts() {
        let build = super::BUILD;
        let head = std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success());
        let Some(head) = head else {
            assert_eq!(
                build.commit(),
                None,
                "no git here, yet a commit was recorded"
            );
            assert_eq!(build.commit_label(), "unknown");
            return;
        };
        let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
        assert_eq!(build.commit(), Some(head.as_str()));
        assert!(build.modified().is_some());
        assert!(
            build.commit_label().starts_with(&head[..12]),
            "{}",
            build.commit_label()
        );
        assert!(
            build
                .describe_commit()
                .starts_with(&format!("commit {}", &head[..12]))
        );
    }
}
