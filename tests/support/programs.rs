//! The two programs under test, `inplace-agent` and `inplace-updater`, from the same profile's
//! directory as the test (the root `build.rs` gives their paths). They belong to other
//! packages of the workspace, so `cargo test --test it` alone does not rebuild them; a test
//! run against binaries older than their sources would test old code, so the first use says
//! so and stops. `cargo test` at the root (and `tests/run`) builds them.

use std::path::Path;
use std::sync::OnceLock;
use std::time::SystemTime;

/// The `inplace-agent` binary.
pub const AGENT: &str = env!("INPLACE_AGENT_EXE");
/// The `inplace-updater` binary.
pub const UPDATER: &str = env!("INPLACE_UPDATER_EXE");

/// The newest modification time of a file under `dir`.
fn newest(dir: &Path, newest_so_far: &mut Option<(SystemTime, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            newest(&path, newest_so_far);
        } else if let Ok(modified) = entry.metadata().and_then(|m| m.modified())
            && newest_so_far.as_ref().is_none_or(|(t, _)| modified > *t)
        {
            *newest_so_far = Some((modified, path.display().to_string()));
        }
    }
}

/// Panics, saying what to run, when either program is missing or older than a source it is
/// built from. Checked once per process.
pub fn check_fresh() {
    static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();
    let verdict = CHECKED.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        // Each program against the crates it is built from.
        let shared = [
            "crates/base",
            "crates/plan",
            "crates/api",
            "crates/demo-node",
        ];
        for (program, own) in [(AGENT, "crates/agent"), (UPDATER, "crates/updater")] {
            let mut source = None;
            for dir in shared.iter().chain([&own]) {
                newest(&root.join(dir), &mut source);
            }
            if let Ok(m) = std::fs::metadata(root.join("Cargo.lock")).and_then(|m| m.modified())
                && source.as_ref().is_none_or(|(t, _)| m > *t)
            {
                source = Some((m, "Cargo.lock".into()));
            }
            let built = std::fs::metadata(program)
                .and_then(|m| m.modified())
                .map_err(|e| {
                    format!(
                        "{program}: {e}; build the programs first: `cargo build` at the \
                         workspace root (`cargo test` and tests/run do)"
                    )
                })?;
            if let Some((changed, file)) = &source
                && changed > &built
            {
                return Err(format!(
                    "{program} is older than {file}: the tests would run old code; build the \
                     programs first: `cargo build` at the workspace root (`cargo test` and \
                     tests/run do)"
                ));
            }
        }
        Ok(())
    });
    if let Err(e) = verdict {
        panic!("{e}");
    }
}
