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

/// `--listen 9443` (a port alone) is refused with the form to use, not with the parser's
/// "invalid socket address syntax".
#[test]
fn a_port_alone_is_refused_with_an_example() {
    let out = Command::new(env!("CARGO_BIN_EXE_inplace-agent"))
        .args(["serve", "--listen", "9443"])
        .output()
        .expect("run inplace-agent serve");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a port alone is not an address") && err.contains("e.g. 0.0.0.0:9443"),
        "{err}"
    );
}

/// `--cacert` (curl's name) is taken for `--ca`: the call gets as far as reading the file.
#[test]
fn cacert_is_taken_for_ca() {
    let out = Command::new(env!("CARGO_BIN_EXE_inplace-agent"))
        .args([
            "status",
            "--addr",
            "127.0.0.1:9",
            "--cacert",
            "/nonexistent/ca.crt",
        ])
        .args([
            "--cert",
            "/nonexistent/c.crt",
            "--key",
            "/nonexistent/c.key",
        ])
        .output()
        .expect("run inplace-agent status");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("unexpected argument"), "{err}");
    assert!(err.contains("/nonexistent/"), "{err}");
}
