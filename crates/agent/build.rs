//! Records the commit the agent is built from (`inplace_base::build!`), and makes the
//! release linker's function list (`packaging/layout/link-gcc`) an input: a new list must
//! relink.

include!("../base/build/commit.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../packaging/layout/hot-functions.txt");
    record_commit(&[
        "crates/base",
        "crates/plan",
        "crates/api",
        "crates/demo-node",
        "crates/agent",
        "Cargo.toml",
        "Cargo.lock",
    ]);
}
