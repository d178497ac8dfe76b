//! The release linker lays the agent's binary out by a list of functions
//! (`packaging/layout/link-gcc`): a new list must relink, so it counts as an input.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../packaging/layout/hot-functions.txt");
}
