//! The kubelet STAND-IN (tests/kubelet-standin) as the tests see it: run as a program, as
//! systemd runs it in a sandboxed node. No root needed.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const STANDIN: &str = env!("CARGO_BIN_EXE_kubelet-standin");
const VALID_CONFIG: &str = include_str!("../fixtures/kubelet-config.yaml");

fn standin() -> Command {
    let mut cmd = Command::new(STANDIN);
    cmd.env_remove("KUBELET_STANDIN_VERSION")
        .env_remove("NOTIFY_SOCKET");
    cmd
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("run kubelet-standin")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// Kills the stand-in when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` on 127.0.0.1:port, retried until the server is up (5 s at most).
fn get(port: u16, path: &str) -> (u16, String) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(mut stream) => {
                write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").expect("send request");
                let mut response = String::new();
                stream.read_to_string(&mut response).expect("read response");
                let status = response
                    .split_whitespace()
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .expect("status code");
                let body = response
                    .split_once("\r\n\r\n")
                    .map(|(_, b)| b.to_string())
                    .unwrap_or_default();
                return (status, body);
            }
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("connect to stand-in on port {port}: {e}"),
        }
    }
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("config.yaml");
    fs::write(&path, text).expect("write config");
    path
}

#[test]
fn reports_the_default_version() {
    let out = run(standin().arg("--version"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "Kubernetes v1.30.4\n");
}

#[test]
fn version_comes_from_the_environment() {
    let out = run(standin()
        .arg("--version")
        .env("KUBELET_STANDIN_VERSION", "v1.31.2"));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "Kubernetes v1.31.2\n");
}

#[test]
fn version_comes_from_a_file_next_to_the_binary() {
    // What a package test does: ship the same binary with a "newer" version file.
    let dir = tempfile::tempdir().expect("tempdir");
    let kubelet = dir.path().join("kubelet");
    fs::copy(STANDIN, &kubelet).expect("copy stand-in");
    fs::write(dir.path().join("kubelet.version"), "v1.31.2\n").expect("write version");
    let out = run(Command::new(&kubelet)
        .arg("--version")
        .env_remove("KUBELET_STANDIN_VERSION"));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "Kubernetes v1.31.2\n");

    fs::write(dir.path().join("kubelet.version"), "one-thirty-one\n").expect("write version");
    let out = run(Command::new(&kubelet)
        .arg("--version")
        .env_remove("KUBELET_STANDIN_VERSION"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("is not like v1.30.4"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn refuses_to_start_without_a_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.yaml");
    let out = run(standin().arg(format!("--config={}", missing.display())));
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("refusing to start: read config"), "{err}");
    assert!(err.contains("nope.yaml"), "{err}");
}

#[test]
fn refuses_to_start_with_an_invalid_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (text, want) in [
        ("", "no `kind: KubeletConfiguration`"),
        ("kind: Pod\n", "kind is \"Pod\""),
        ("- a\n- b\n", "not a YAML mapping"),
        ("just some text\n", "not a YAML mapping"),
        ("{\"kind\": \"KubeletConfiguration\"}\n", "flow-style"),
        ("kind: KubeletConfiguration\napiVersion: v1\n", "apiVersion"),
        ("kind: KubeletConfiguration\nmaxPods: 0\n", "maxPods \"0\""),
        ("kind: KubeletConfiguration\nmaxPods: -3\n", "maxPods"),
        ("kind: KubeletConfiguration\nmaxPods: lots\n", "maxPods"),
        ("kind: KubeletConfiguration\nmaxPods: \"110\"\n", "maxPods"),
        (
            "kind: KubeletConfiguration\nmaxPods: 1\nmaxPods: 2\n",
            "duplicate key",
        ),
        (
            "kind: KubeletConfiguration\nhealthzPort: 70000\n",
            "healthzPort",
        ),
    ] {
        let config = write_config(dir.path(), text);
        let out = run(standin().args(["--config", &config.display().to_string()]));
        assert_eq!(out.status.code(), Some(1), "{text:?} was accepted");
        assert!(stderr(&out).contains(want), "{text:?}: {}", stderr(&out));
    }
}

#[test]
fn serves_healthz_with_a_kubeadm_config_and_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    // The fixture says healthzPort 10248; the flag wins, as with the kubelet.
    let config = write_config(dir.path(), VALID_CONFIG);
    let child = standin()
        .args([
            "--container-runtime-endpoint=unix:///var/run/containerd/containerd.sock",
            "--node-labels",
            "tier=web",
            "--v=2",
        ])
        .arg(format!("--config={}", config.display()))
        .args(["--healthz-port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn stand-in");
    let _running = Running(child);
    assert_eq!(get(port, "/healthz"), (200, "ok".to_string()));
    assert_eq!(get(port, "/healthz?verbose").0, 200);
    assert_eq!(get(port, "/metrics").0, 404);
}

#[test]
fn healthz_port_comes_from_the_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let config = write_config(
        dir.path(),
        &format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n\
             maxPods: 150\nhealthzPort: {port}\n"
        ),
    );
    let child = standin()
        .arg(format!("--config={}", config.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn stand-in");
    let mut running = Running(child);
    assert_eq!(get(port, "/healthz"), (200, "ok".to_string()));
    let _ = running.0.kill();
    let mut err = String::new();
    if let Some(mut pipe) = running.0.stderr.take() {
        let _ = pipe.read_to_string(&mut err);
    }
    assert!(err.contains("maxPods 150"), "{err}");
}
