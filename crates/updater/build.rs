//! Records the commit the updater is built from (`inplace_base::build!`).

include!("../base/build/commit.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    record_commit(&[
        "crates/base",
        "crates/plan",
        "crates/api",
        "crates/demo-node",
        "crates/updater",
        "Cargo.toml",
        "Cargo.lock",
    ]);
}
