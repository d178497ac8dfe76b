//! The `inplace-agent` binary starts and says what it is. (Having an integration test also
//! makes `cargo test` build the binary that the workspace's system tests run.)

use std::process::Command;

#[test]
fn version_names_the_program() {
    let out = Command::new(env!("CARGO_BIN_EXE_inplace-agent"))
        .arg("version")
        .output()
        .expect("run inplace-agent version");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("inplace-agent"), "{text}");
}
