//! The system tests and benches run the binaries of other packages of the workspace
//! (`inplace-agent`, `inplace-updater`), for which Cargo sets no `CARGO_BIN_EXE_*`: this
//! script gives their paths in the same profile's directory as `INPLACE_AGENT_EXE` and
//! `INPLACE_UPDATER_EXE`, and the target platform as `TARGET_TRIPLE`. `cargo test` at the workspace root builds both binaries (each of
//! their crates has an integration test of its own), and so does `cargo build`; `tests/run`
//! and `benches/run` do that.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // The platform the tests were built for (tests/it/architecture.rs asks `cargo metadata`
    // for the dependencies built on it).
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    println!("cargo:rustc-env=TARGET_TRIPLE={target}");
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out.
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let profile_dir = out
        .ancestors()
        .nth(3)
        .expect("OUT_DIR is <target>/<profile>/build/<package>/out");
    for (var, name) in [
        ("INPLACE_AGENT_EXE", "inplace-agent"),
        ("INPLACE_UPDATER_EXE", "inplace-updater"),
    ] {
        println!("cargo:rustc-env={var}={}", profile_dir.join(name).display());
    }
}
