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

/// A refused permission when not root ends with what to do: run as root. (Run as root, the
/// test drops to uid 65534 with `setpriv`; as another user it cannot make a directory that
/// user may not write, and says so.)
#[test]
fn a_permission_refused_to_a_non_root_user_says_run_as_root() {
    if !rustix::process::geteuid().is_root() {
        eprintln!(
            "\n*** SKIPPED a_permission_refused_to_a_non_root_user_says_run_as_root: needs root \
             to make a directory another user may not write; CI runs it as root ***\n"
        );
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI runs as root: this test must run there"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.yaml");
    std::fs::write(
        &plan,
        "apiVersion: inplace.agent/v1\nkind: Plan\nid: t/1\nchanges:\n  - file: {path: /etc/kubernetes/x.conf, content: \"x\\n\"}\n",
    )
    .unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::set_permissions(&plan, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_inplace-agent"))
        .args(["apply", "--services", "off", "--root"])
        .arg(dir.path())
        .arg("--state-dir")
        .arg(&state)
        .arg(&plan)
        .output()
        .expect("run setpriv (util-linux)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("Permission denied"), "{err}");
    assert!(
        err.contains("not root") && err.contains("run it as root"),
        "{err}"
    );
}

/// A `check` that cannot read the node as another user says so and how to fix it, and
/// exits 1 (could not be run), not 2 (the plan is invalid): the refused permission's kind
/// is carried from the file system layer through the preflight to the report. As root the
/// same plan checks fine.
#[test]
fn a_check_refused_a_permission_is_not_an_invalid_plan() {
    if !rustix::process::geteuid().is_root() {
        eprintln!(
            "\n*** SKIPPED a_check_refused_a_permission_is_not_an_invalid_plan: needs root to \
             make a directory another user may not read; CI runs it as root ***\n"
        );
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI runs as root: this test must run there"
        );
        return;
    }
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let plan = dir.path().join("plan.yaml");
    std::fs::write(
        &plan,
        "apiVersion: inplace.agent/v1\nkind: Plan\nid: t/1\nchanges:\n  - file: {path: /etc/kubernetes/x.conf, content: \"x\\n\"}\n",
    )
    .unwrap();
    std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o644)).unwrap();
    let private = dir.path().join("etc/kubernetes");
    std::fs::create_dir_all(&private).unwrap();
    std::fs::set_permissions(
        dir.path().join("etc"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let check = |as_nobody: bool| {
        let mut cmd = if as_nobody {
            let mut c = Command::new("setpriv");
            c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
                .arg(env!("CARGO_BIN_EXE_inplace-agent"));
            c
        } else {
            Command::new(env!("CARGO_BIN_EXE_inplace-agent"))
        };
        cmd.args(["check", "--services", "off", "--root"])
            .arg(dir.path())
            .arg(&plan)
            .output()
            .expect("run setpriv (util-linux)")
    };
    let out = check(true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the node could not be checked, the plan was not judged")
            && err.contains("Permission denied"),
        "{err}"
    );
    assert!(
        err.contains("not root") && err.contains("run it as root"),
        "{err}"
    );
    let out = check(false);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
