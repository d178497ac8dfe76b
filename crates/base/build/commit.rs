// Records the git commit a program is built from, for `inplace_base::build!()`. Not a module
// of the library: each program crate's build script includes this file
// (`include!("../base/build/commit.rs")`) and calls `record_commit` with the crates its
// binary is built from, so an edit to one program does not rebuild the other (a library-wide
// record made every edit anywhere rebuild the whole workspace).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root, two levels above the program crate (`crates/<name>`).
fn workspace_root() -> PathBuf {
    PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../..")
}

/// Runs git at the workspace root; `None` when git is missing or this is not a checkout.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Sets `INPLACE_AGENT_GIT_COMMIT` (the commit, or empty when unknown) and
/// `INPLACE_AGENT_GIT_MODIFIED` (`true` when `sources` — paths relative to the workspace root,
/// what goes into the binary besides `.git` — differ from that commit, `false`, or empty when
/// unknown). Without git (a source tarball, a container build without `.git`) the builder may
/// pass the commit in `INPLACE_AGENT_GIT_COMMIT`; whether the tree was modified is then
/// unknown.
#[allow(dead_code)] // each build script uses what it needs of this file
fn record_commit(sources: &[&str]) {
    let root = workspace_root();
    println!("cargo:rerun-if-env-changed=INPLACE_AGENT_GIT_COMMIT");
    println!("cargo:rerun-if-changed=../base/build/commit.rs");
    for source in sources {
        println!("cargo:rerun-if-changed={}", root.join(source).display());
    }
    let (commit, modified) = match git(&root, &["rev-parse", "HEAD"]) {
        Some(commit) if !commit.is_empty() => {
            // The commit moves when HEAD or the branch it names moves (a commit, a checkout).
            for file in ["HEAD", "index"] {
                if let Some(path) = git(&root, &["rev-parse", "--git-path", file]) {
                    println!("cargo:rerun-if-changed={}", root.join(path).display());
                }
            }
            if let Some(branch) = git(&root, &["symbolic-ref", "-q", "HEAD"])
                && let Some(path) = git(&root, &["rev-parse", "--git-path", &branch])
            {
                println!("cargo:rerun-if-changed={}", root.join(path).display());
            }
            let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
            status.extend(sources);
            let modified = git(&root, &status).map(|s| (!s.is_empty()).to_string());
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
