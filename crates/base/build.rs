//! Records the git commit the binaries are built from (`inplace-agent version`, the status
//! socket, the `build_info` metric, `inplace-updater version`): `inplace_base::build`.

use std::path::PathBuf;
use std::process::Command;

/// The workspace root: this crate is `crates/base`.
fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What goes into the binary besides `.git`: a change here makes the tree "modified".
/// Paths relative to the workspace root.
const SOURCES: &[&str] = &["crates", "Cargo.toml", "Cargo.lock"];

/// Runs git in the crate's directory; `None` when git is missing or this is not a checkout.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(workspace_root())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Sets `INPLACE_AGENT_GIT_COMMIT` (the commit, or empty when unknown) and
/// `INPLACE_AGENT_GIT_MODIFIED` (`true` when the sources of the binary differ from that
/// commit, `false`, or empty when unknown). Without git (a source tarball, a container build
/// without `.git`) the builder may pass the commit in `INPLACE_AGENT_GIT_COMMIT`; whether the
/// tree was modified is then unknown.
fn record_commit() {
    println!("cargo:rerun-if-env-changed=INPLACE_AGENT_GIT_COMMIT");
    for source in SOURCES {
        println!(
            "cargo:rerun-if-changed={}",
            workspace_root().join(source).display()
        );
    }
    let (commit, modified) = match git(&["rev-parse", "HEAD"]) {
        Some(commit) if !commit.is_empty() => {
            // The commit moves when HEAD or the branch it names moves (a commit, a checkout).
            for file in ["HEAD", "index"] {
                if let Some(path) = git(&["rev-parse", "--git-path", file]) {
                    println!("cargo:rerun-if-changed={path}");
                }
            }
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
                && let Some(path) = git(&["rev-parse", "--git-path", &branch])
            {
                println!("cargo:rerun-if-changed={path}");
            }
            let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
            status.extend(SOURCES);
            let modified = git(&status).map(|s| (!s.is_empty()).to_string());
            (commit, modified.unwrap_or_default())
        }
        _ => (
            std::env::var("INPLACE_AGENT_GIT_COMMIT").unwrap_or_default(),
            String::new(),
        ),
    };
    let commit = if commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        commit
    } else {
        String::new()
    };
    println!("cargo:rustc-env=INPLACE_AGENT_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=INPLACE_AGENT_GIT_MODIFIED={modified}");
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    record_commit();
}
