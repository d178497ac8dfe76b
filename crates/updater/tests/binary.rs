//! The `inplace-updater` binary starts and lists its commands. (Having an integration test
//! also makes `cargo test` build the binary that the workspace's system tests run.)

use std::process::Command;

#[test]
fn help_lists_the_commands() {
    let out = Command::new(env!("CARGO_BIN_EXE_inplace-updater"))
        .arg("--help")
        .output()
        .expect("run inplace-updater --help");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("serve") && text.contains("demo"), "{text}");
}
