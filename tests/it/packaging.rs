//! What we ship, used the way an operator uses it (issue 7, docs/install.md):
//!
//! - the .deb that `packaging/build` makes from the binary this `cargo test` built, installed
//!   with dpkg into a sandboxed node (tests/sandbox: this machine's systemd booted on an
//!   overlay of `/`), started by systemd with the shipped unit and all its hardening, and
//!   driven over mutual TLS: a plan that changes the kubelet stand-in's configuration, sets a
//!   sysctl and installs a package; `kill -9` in the middle of a plan; an upgrade in the
//!   middle of a plan that keeps the edited conffile and the journal; remove and purge;
//! - the DaemonSet's flags (packaging/kubernetes/agent/base/daemonset.yaml) run against a sandboxed node
//!   exactly as the pod sees the host, with the node's root where the pod has `/host`;
//! - the .rpm (`rpm -qp`), the packaged config.toml, the unit's `systemd-analyze security`
//!   exposure (printed, and compared with docs/hardening.md), and `packaging/validate` (every
//!   kustomization built and each object validated, clusterctl's repository, the example's
//!   Secrets, PromQL, the Containerfiles, the shell scripts).
//!
//! The sandbox tests need root and print a SKIP line without it (and fail when CI=true).

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::daemon::{Daemon, Ready};
use crate::support::sandbox::{SandboxNode, StandinExt, Systemd};
use crate::support::{eventually, say, text};
use inplace_agent::config::parse_config;
use inplace_api::pki::{DEFAULT_READER_IDENTITY, DEFAULT_UPDATER_IDENTITY};
use serde_json::Value;

const BIN: &str = crate::support::programs::AGENT;
const REPO: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");
const AGENT: &str = "inplace-agent.service";
const STARTS: &str = "/var/log/kubelet-standin.starts";

// === Helpers ===

/// Runs `cmd`, panics with its output unless it succeeds, returns its stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("start {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `packaging/build --binary <this test's binary> --fast <kind> --version <version>`: the
/// package file, in a fresh directory.
fn build_package(kind: &str, version: &str) -> (tempfile::TempDir, PathBuf) {
    crate::support::programs::check_fresh();
    let out = tempfile::Builder::new()
        .prefix("inplace-packages-")
        .tempdir()
        .unwrap();
    let started = Instant::now();
    run(Command::new("bash")
        .arg(Path::new(REPO).join("packaging/build"))
        .args([
            "--binary",
            BIN,
            "--fast",
            kind,
            "--version",
            version,
            "--out",
        ])
        .arg(out.path()));
    let ext = kind.trim_start_matches("--");
    let file = std::fs::read_dir(out.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == ext))
        .unwrap_or_else(|| panic!("packaging/build {kind} made no .{ext}"));
    say(&format!(
        "packaging/build {kind} {version}: {} in {:.1}s",
        file.display(),
        started.elapsed().as_secs_f64()
    ));
    (out, file)
}

/// A shell script run inside the node (all its namespaces and its root).
fn in_node(node: &SandboxNode, script: &str) -> Output {
    node.command("sh")
        .args(["-c", script])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The same, which must succeed; its stdout, trimmed.
fn in_node_ok(node: &SandboxNode, script: &str) -> String {
    let out = in_node(node, script);
    assert!(
        out.status.success(),
        "in the node: {script}: {}\n{}",
        out.status,
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn unit_property(node: &SandboxNode, unit: &str, property: &str) -> String {
    in_node_ok(
        node,
        &format!("systemctl show --property={property} --value {unit}"),
    )
}

fn node_name(node: &SandboxNode) -> String {
    node.read_file("/etc/hostname").trim().to_string()
}

/// Lines of the kubelet stand-in's start log.
fn kubelet_starts(node: &SandboxNode) -> usize {
    std::fs::read_to_string(node.path(STARTS))
        .unwrap_or_default()
        .lines()
        .count()
}

/// A stand-in `cri-tools` package at 1.31.1-1.1 in a local apt repository that becomes the
/// node's only apt source (the node has no network). Like a real dependency of the
/// Kubernetes packages it ships a setuid-root helper (as `mount` does), and its postinst
/// writes under /etc and reloads systemd, as real maintainer scripts do.
fn apt_repo_with_cri_tools(node: &SandboxNode) {
    let build = tempfile::tempdir().unwrap();
    let pkg = build.path().join("pkg");
    let write = |rel: &str, body: &[u8], mode: u32| {
        let path = pkg.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, body).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    write(
        "usr/bin/crictl",
        b"#!/bin/sh\necho \"crictl version v1.31.1\"\n",
        0o755,
    );
    write(
        "usr/lib/cri-tools/suid-helper",
        &std::fs::read("/bin/true").unwrap(),
        0o4755,
    );
    write(
        "DEBIAN/control",
        b"Package: cri-tools\nVersion: 1.31.1-1.1\nArchitecture: all\n\
          Maintainer: inplace-agent tests <tests@example.invalid>\n\
          Description: stand-in cri-tools for the inplace-agent tests\n",
        0o644,
    );
    // As debhelper writes it (dh_installsystemd): a failed reload does not fail the
    // package. (Strict, it failed 2 runs in about 13 here: `Reload daemon failed:
    // Transport endpoint is not connected` from the sandboxed node's systemd.) The agent's
    // own daemon-reload after a package change covers it.
    write(
        "DEBIAN/postinst",
        b"#!/bin/sh\nset -e\nmkdir -p /etc/cri-tools-standin\n\
          echo configured > /etc/cri-tools-standin/postinst-ran\n\
          if [ -d /run/systemd/system ]; then systemctl --system daemon-reload >/dev/null || true; fi\n",
        0o755,
    );
    let repo = build.path().join("repo");
    std::fs::create_dir(&repo).unwrap();
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zgzip", "-z1", "--build"])
        .arg(&pkg)
        .arg(repo.join("cri-tools_1.31.1-1.1_all.deb")));
    let index = run(Command::new("dpkg-scanpackages")
        .args(["--multiversion", "."])
        .current_dir(&repo)
        .stderr(Stdio::null()));
    std::fs::write(repo.join("Packages"), index).unwrap();
    for name in ["cri-tools_1.31.1-1.1_all.deb", "Packages"] {
        node.write_file(
            &format!("/srv/inplace-test-repo/{name}"),
            std::fs::read(repo.join(name)).unwrap(),
            0o644,
        );
    }
    in_node_ok(node, "rm -rf /etc/apt/sources.list.d/*");
    node.write_file(
        "/etc/apt/sources.list",
        "deb [trusted=yes] file:/srv/inplace-test-repo ./\n",
        0o644,
    );
}

/// The plan both routes apply: the kubelet's configuration (one restart), a sysctl of the
/// node's network namespace, a file, and the package; gates on the kubelet, the package and
/// dnf (Python: it must run under MemoryDenyWriteExecute=).
fn node_plan(id: &str, node_name: &str) -> String {
    format!(
        "apiVersion: inplace.agent/v1
kind: Plan
id: {id}
nodeName: {node_name}
changes:
  - kubeletConfig: {{mergePatch: {{maxPods: 150}}}}
  - sysctl: {{key: net.ipv4.ip_forward, value: \"1\"}}
  - file: {{path: /etc/kubernetes/audit.yaml, content: \"kind: Policy\\n\", mode: \"0600\", restartUnits: [kubelet.service]}}
  - package: {{name: cri-tools, version: 1.31.1-1.1, hold: true}}
verify:
  - unitActive: {{name: kubelet.service, timeoutSeconds: 30}}
  - httpGet: {{url: \"http://127.0.0.1:10248/healthz\", expectStatus: 200, timeoutSeconds: 30, periodSeconds: 1}}
  - kubeletVersion: {{version: v1.30.4}}
  - command: {{argv: [crictl, --version], timeoutSeconds: 30}}
  - command: {{argv: [dnf, --version], timeoutSeconds: 60}}
"
    )
}

/// A plan that holds the agent in Verifying for a few seconds.
fn slow_plan(id: &str, node_name: &str, file: &str) -> String {
    format!(
        "apiVersion: inplace.agent/v1
kind: Plan
id: {id}
nodeName: {node_name}
changes:
  - file: {{path: /etc/kubernetes/{file}, content: \"{id}\\n\"}}
verify:
  - command: {{argv: [sh, -c, \"sleep 3\"], timeoutSeconds: 30}}
  - command: {{argv: [sh, -c, \"sleep 3\"], timeoutSeconds: 30}}
"
    )
}

/// Checks the node after [`node_plan`]: the kubelet restarted once on the new configuration,
/// the sysctl set in the node's network namespace, the package installed and held with its
/// setuid file and its postinst run.
fn assert_node_plan_applied(node: &SandboxNode, starts_before: usize, status: &Value) {
    assert_eq!(status["phase"], "Succeeded", "{status:#}");
    assert_eq!(
        kubelet_starts(node),
        starts_before + 1,
        "the kubelet restarted exactly once"
    );
    assert!(
        node.read_file("/var/lib/kubelet/config.yaml")
            .contains("maxPods: 150")
    );
    assert_eq!(
        in_node_ok(node, "cat /proc/sys/net/ipv4/ip_forward"),
        "1",
        "the sysctl is set in the node's network namespace"
    );
    assert_eq!(
        in_node_ok(
            node,
            "dpkg-query -W -f='${Version}' cri-tools; echo; apt-mark showhold"
        ),
        "1.31.1-1.1\ncri-tools"
    );
    let helper = std::fs::metadata(node.path("/usr/lib/cri-tools/suid-helper")).unwrap();
    assert_eq!(
        helper.permissions().mode() & 0o7777,
        0o4755,
        "setuid file installed"
    );
    assert_eq!(
        node.read_file("/etc/cri-tools-standin/postinst-ran"),
        "configured\n"
    );
}

/// The agent's client commands (`submit`, `status`) run in the node's network namespace, over
/// mutual TLS with the certificates `pki init` made in the node.
struct Client<'a> {
    node: &'a SandboxNode,
    pki: PathBuf,
    server_name: String,
    plans: tempfile::TempDir,
}

impl<'a> Client<'a> {
    fn new(node: &'a SandboxNode, pki: PathBuf) -> Client<'a> {
        Client {
            node,
            pki,
            server_name: node_name(node),
            plans: tempfile::tempdir().unwrap(),
        }
    }

    fn command(&self, args: &[&str], admin: bool) -> Output {
        let who = if admin { "updater" } else { "reader" };
        self.node
            .command_in_netns(Path::new(BIN))
            .args(args)
            .args([
                "--addr",
                "127.0.0.1:9443",
                "--server-name",
                &self.server_name,
            ])
            .arg("--ca")
            .arg(self.pki.join("ca.crt"))
            .arg("--cert")
            .arg(self.pki.join(format!("{who}.crt")))
            .arg("--key")
            .arg(self.pki.join(format!("{who}.key")))
            .env("INPLACE_AGENT_LOG", "error")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Submits a plan; with `wait`, returns its final status.
    fn submit(&self, name: &str, plan: &str, wait: bool) -> Value {
        self.submit_and_watch(name, plan, wait).0
    }

    /// Submits a plan; with `wait`, returns its final status and what the watch printed.
    fn submit_and_watch(&self, name: &str, plan: &str, wait: bool) -> (Value, String) {
        let path = self.plans.path().join(name);
        std::fs::write(&path, plan).unwrap();
        let path = path.display().to_string();
        let mut args = vec!["submit", path.as_str(), "-o", "json", "--no-progress"];
        if wait {
            args.push("--wait");
        }
        let out = self.command(&args, true);
        let status = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("submit {name}: {}", text(&out)));
        (status, String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// The plan's status, or None while the agent does not answer (restarting).
    fn status(&self, id: &str) -> Option<Value> {
        let out = self.command(&["status", id, "-o", "json"], false);
        serde_json::from_slice(&out.stdout).ok()
    }

    fn wait_for(&self, id: &str, phase: &str) -> Value {
        eventually(&format!("plan {id} in phase {phase}"), || {
            self.status(id).filter(|s| s["phase"] == phase)
        })
    }
}

/// `grpc.health.v1.Health/Check` over mutual TLS (reader identity) from the node's network
/// namespace: the serving status of the whole server.
fn grpc_health(node: &SandboxNode, pki: &Path, server_name: &str) -> Result<i32, String> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let netns = format!("/proc/{}/ns/net", node.pid());
    let paths = inplace_api::tls::ClientTlsPaths {
        ca: pki.join("ca.crt"),
        cert: pki.join("reader.crt"),
        key: pki.join("reader.key"),
    };
    let server_name = server_name.to_string();
    // setns() moves only the calling thread: a fresh thread with its own runtime.
    std::thread::spawn(move || -> Result<i32, String> {
        let ns = std::fs::File::open(&netns).map_err(|e| format!("open {netns}: {e}"))?;
        rustix::thread::move_into_link_name_space(
            ns.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(|e| format!("setns: {e}"))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async move {
            let config = inplace_api::tls::client_config(&paths).map_err(|e| e.to_string())?;
            let channel =
                inplace_api::tls::connect("127.0.0.1:9443", Some(&server_name), Arc::new(config))
                    .await
                    .map_err(|e| e.to_string())?;
            let response = HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .map_err(|e| e.to_string())?;
            Ok(response.into_inner().status)
        })
    })
    .join()
    .map_err(|_| "health check thread panicked".to_string())?
}

/// `GET path` on 127.0.0.1:`port` from the node's network namespace (as Prometheus scrapes
/// a hostNetwork pod): the whole answer, head and body.
fn http_get_in_netns(node: &SandboxNode, port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let netns = format!("/proc/{}/ns/net", node.pid());
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    // setns() moves only the calling thread.
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&netns).unwrap();
        rustix::thread::move_into_link_name_space(
            ns.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .unwrap();
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))
            .unwrap_or_else(|e| panic!("connect 127.0.0.1:{port} in the node: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    })
    .join()
    .unwrap()
}

/// `MainPID` of the agent's unit and that process's `/proc/<pid>/<file>` (inside the node).
fn agent_proc(node: &SandboxNode, file: &str) -> String {
    let pid = unit_property(node, AGENT, "MainPID");
    assert_ne!(pid, "0", "the agent is not running");
    in_node_ok(node, &format!("cat /proc/{pid}/{file}"))
}

/// The exposure level `systemd-analyze security` prints last (`4.1`).
fn exposure(output: &str) -> String {
    output
        .lines()
        .find_map(|l| {
            l.split_once("Overall exposure level for ")?
                .1
                .split_once(": ")
        })
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no exposure level in:\n{output}"))
        .to_string()
}

// === The .deb and the unit, in a sandboxed node ===

#[test]
fn the_deb_runs_hardened_under_systemd_survives_kill_9_and_upgrades_keeping_config_and_journal() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let started = Instant::now();
    let (_d1, deb1) = build_package("--deb", &format!("{VERSION}-1"));
    let (_d2, deb2) = build_package("--deb", &format!("{VERSION}-2"));
    let systemd: Systemd = node.install_kubelet_standin();
    apt_repo_with_cri_tools(&node);
    node.write_file(
        "/root/inplace-agent-1.deb",
        std::fs::read(&deb1).unwrap(),
        0o644,
    );
    node.write_file(
        "/root/inplace-agent-2.deb",
        std::fs::read(&deb2).unwrap(),
        0o644,
    );
    // This machine's image forbids service starts from maintainer scripts (a container
    // build's /usr/sbin/policy-rc.d exiting 101); a node has none. Its effect is tested below.
    in_node_ok(&node, "rm -f /usr/sbin/policy-rc.d");

    // --- Install: group, directories, conffile, enabled and not started.
    in_node_ok(&node, "dpkg -i /root/inplace-agent-1.deb");
    in_node_ok(&node, "getent group inplace-agent");
    assert_eq!(
        in_node(&node, "systemctl is-enabled inplace-agent").stdout,
        b"enabled\n"
    );
    assert_eq!(
        in_node(&node, "systemctl is-active inplace-agent").stdout,
        b"inactive\n"
    );
    for dir in ["/var/lib/inplace-agent", "/etc/inplace-agent/pki"] {
        let mode = std::fs::metadata(node.path(dir))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o700, "{dir}");
    }
    assert!(
        in_node_ok(&node, "dpkg-query -W -f='${Conffiles}' inplace-agent")
            .contains("/etc/inplace-agent/config.toml"),
        "config.toml is a conffile"
    );
    assert_eq!(
        node.read_file("/usr/lib/systemd/system/inplace-agent.service"),
        std::fs::read_to_string(Path::new(REPO).join("systemd/inplace-agent.service")).unwrap()
    );
    let verify = in_node(&node, "systemd-analyze verify inplace-agent.service");
    let complaints: Vec<String> = text(&verify)
        .lines()
        .filter(|l| l.contains("inplace-agent"))
        .map(str::to_string)
        .collect();
    assert!(
        verify.status.success() && complaints.is_empty(),
        "systemd-analyze verify: {}",
        text(&verify)
    );

    // --- Not configured yet: started (as at every boot, the unit is enabled), it waits
    // quietly: inactive, not failed, not restarted, and its status says what is missing.
    in_node_ok(&node, "systemctl start inplace-agent");
    assert_eq!(unit_property(&node, AGENT, "ActiveState"), "inactive");
    assert_eq!(unit_property(&node, AGENT, "NRestarts"), "0");
    let said = in_node(&node, "systemctl status inplace-agent --no-pager -l -n 20");
    assert!(
        text(&said).contains("not configured yet")
            && text(&said).contains("/etc/inplace-agent/pki/server.crt"),
        "{}",
        text(&said)
    );

    // --- Certificates, but nobody may call it yet: it refuses to start with exit 2, says
    // how to fix it, and is not restarted (RestartPreventExitStatus=2).
    let name = node_name(&node);
    in_node_ok(
        &node,
        &format!("inplace-agent pki init /etc/inplace-agent/pki --node-name {name}"),
    );
    let refused = in_node(&node, "systemctl start inplace-agent");
    assert!(!refused.status.success(), "{}", text(&refused));
    assert_eq!(unit_property(&node, AGENT, "ExecMainStatus"), "2");
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(unit_property(&node, AGENT, "ActiveState"), "failed");
    assert_eq!(
        unit_property(&node, AGENT, "NRestarts"),
        "0",
        "no restart on exit 2"
    );
    let said = in_node_ok(&node, "journalctl -u inplace-agent --no-pager -o cat");
    assert!(
        said.contains("authorization.admin is empty")
            && said.contains("admin = [\"spiffe://inplace-agent/updater\"] under [authorization]"),
        "{said}"
    );
    in_node_ok(&node, "systemctl reset-failed inplace-agent");

    // --- Configure as docs/install.md says: append who may call; the edit makes the
    // conffile "modified" for the upgrade below.
    let edited = node.read_file("/etc/inplace-agent/config.toml")
        + &format!(
            "\n# edited on this node\n[authorization]\nadmin = [\"{DEFAULT_UPDATER_IDENTITY}\"]\nreader = [\"{DEFAULT_READER_IDENTITY}\"]\n"
        );
    node.write_file("/etc/inplace-agent/config.toml", &edited, 0o644);
    in_node_ok(&node, "inplace-agent config check");

    // --- Start through systemd (Type=notify: returns once the agent sent READY=1).
    in_node_ok(&node, "systemctl start inplace-agent");
    let client = Client::new(&node, node.path("/etc/inplace-agent/pki"));
    assert_eq!(
        grpc_health(&node, &node.path("/etc/inplace-agent/pki"), &name),
        Ok(1),
        "grpc.health.v1 says SERVING"
    );
    // TODO(issue 6): once the status socket lands, also check that
    // /run/inplace-agent/status.sock exists (0660, group inplace-agent) and that
    // `inplace-agent status` answers from it inside the node.

    // The hardening is in effect: seccomp on, the bounding set without CAP_SYS_BOOT (22) but
    // with CAP_SYS_ADMIN (21) and CAP_NET_ADMIN (12), / read-only and /etc writable.
    let status = agent_proc(&node, "status");
    assert!(status.contains("Seccomp:\t2"), "{status}");
    let bounding = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:\t"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(bounding & (1 << 22), 0, "CAP_SYS_BOOT is dropped");
    assert_ne!(bounding & (1 << 21), 0, "CAP_SYS_ADMIN is kept");
    assert_ne!(bounding & (1 << 12), 0, "CAP_NET_ADMIN is kept");
    let mounts = agent_proc(&node, "mountinfo");
    let options = |target: &str| {
        mounts
            .lines()
            .rfind(|l| l.split_whitespace().nth(4) == Some(target))
            .and_then(|l| l.split_whitespace().nth(5))
            .unwrap_or_else(|| panic!("no mount at {target}:\n{mounts}"))
            .to_string()
    };
    assert!(options("/").starts_with("ro"), "{}", options("/"));
    assert!(options("/etc").starts_with("rw"), "{}", options("/etc"));
    // The state directory is a mount of its own (`StateDirectory=` under
    // `ProtectSystem=strict`), so no file the agent replaces can be linked into its backup
    // store: each is copied (docs/hardening.md, "Things to know").
    let state = options("/var/lib/inplace-agent");
    assert!(state.starts_with("rw"), "{state}");
    assert!(options("/proc/sys").starts_with("ro"));
    assert!(options("/proc/sys/net").starts_with("rw"));

    // --- A plan over mTLS: kubelet configuration, sysctl, file, package, gates.
    let starts = kubelet_starts(&node);
    let (applied, watched) = client.submit_and_watch(
        "node.yaml",
        &node_plan("default/md-0@package-route", &name),
        true,
    );
    assert_node_plan_applied(&node, starts, &applied);
    // The restart is seen as it happens (WatchPlan), with the unit's InvocationIDs.
    assert!(
        watched.contains("systemd reloaded unit files")
            && watched.contains("restarting kubelet.service (it was active/running, InvocationID ")
            && watched.contains("restarted kubelet.service in ")
            && watched.contains("unit is active/running"),
        "{watched}"
    );
    let events: Vec<&str> = applied["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["message"].as_str())
        .collect();
    assert!(
        events.iter().any(
            |e| e.starts_with("restarted kubelet.service in ") && e.contains(", InvocationID ")
        ),
        "{events:?}"
    );
    let vm = agent_proc(&node, "status");
    let field = |k: &str| {
        vm.lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or("?")
            .trim()
            .to_string()
    };
    let memory_peak = ["memory.max_usage_in_bytes", "memory.peak"]
        .iter()
        .find_map(|f| {
            let dir = if Path::new("/sys/fs/cgroup/memory").is_dir() {
                "/sys/fs/cgroup/memory"
            } else {
                "/sys/fs/cgroup"
            };
            std::fs::read_to_string(format!(
                "{dir}/inplace-sandbox-{}/system.slice/inplace-agent.service/{f}",
                node.id()
            ))
            .ok()
        })
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|b| format!("{:.1} MiB", b as f64 / 1048576.0))
        .unwrap_or_else(|| "unknown".into());
    say(&format!(
        "inplace-agent.service after the package plan: agent VmRSS {}, VmHWM {}; \
         unit cgroup memory peak (agent + apt/dpkg) {memory_peak}",
        field("VmRSS:"),
        field("VmHWM:")
    ));

    // --- kill -9 in the middle of a plan: systemd restarts the agent, which resumes it.
    let pid_before = unit_property(&node, AGENT, "MainPID");
    client.submit(
        "kill.yaml",
        &slow_plan("default/md-0@kill", &name, "kill.conf"),
        false,
    );
    let before = client.wait_for("default/md-0@kill", "Verifying");
    in_node_ok(
        &node,
        "systemctl kill --signal=SIGKILL --kill-who=main inplace-agent",
    );
    eventually("the agent restarted by systemd", || {
        let pid = unit_property(&node, AGENT, "MainPID");
        let active = unit_property(&node, AGENT, "ActiveState");
        (pid != "0" && pid != pid_before && active == "active").then_some(())
    });
    assert_eq!(unit_property(&node, AGENT, "NRestarts"), "1");
    let after = client.wait_for("default/md-0@kill", "Succeeded");
    assert_eq!(after["run"], before["run"], "the same run resumed");
    let journal = node.read_file("/var/lib/inplace-agent/journal/journal.log");
    assert_eq!(
        journal
            .lines()
            .filter(|l| l.contains("planAccepted") && l.contains("default/md-0@kill"))
            .count(),
        1
    );

    // --- Upgrade to a newer build in the middle of a plan: the postinst restarts the agent
    // (without waiting for it), the agent finishes the current step, stops, comes back on the
    // new binary and finishes the plan; the edited conffile and the journal are kept.
    let journal_before = node.read_file("/var/lib/inplace-agent/journal/journal.log");
    let invocation = unit_property(&node, AGENT, "InvocationID");
    client.submit(
        "upgrade.yaml",
        &slow_plan("default/md-0@upgrade", &name, "upgrade.conf"),
        false,
    );
    let before = client.wait_for("default/md-0@upgrade", "Verifying");
    in_node_ok(&node, "dpkg -i /root/inplace-agent-2.deb");
    assert_eq!(
        in_node_ok(&node, "dpkg-query -W -f='${Version}' inplace-agent"),
        format!("{VERSION}-2")
    );
    eventually("the agent restarted after the upgrade", || {
        (unit_property(&node, AGENT, "InvocationID") != invocation
            && unit_property(&node, AGENT, "ActiveState") == "active")
            .then_some(())
    });
    let after = client.wait_for("default/md-0@upgrade", "Succeeded");
    assert_eq!(after["run"], before["run"]);
    assert_eq!(
        node.read_file("/etc/inplace-agent/config.toml"),
        edited,
        "the edited conffile is kept"
    );
    assert!(
        node.read_file("/var/lib/inplace-agent/journal/journal.log")
            .starts_with(&journal_before),
        "the journal is kept (and only appended to)"
    );
    for id in ["default/md-0@package-route", "default/md-0@kill"] {
        let s = client.status(id).expect("status after the upgrade");
        assert_eq!(
            s["phase"], "Succeeded",
            "{id} is still known after the upgrade"
        );
    }

    // --- A policy-rc.d that forbids starts (image builds) is obeyed: no restart.
    node.write_file("/usr/sbin/policy-rc.d", "#!/bin/sh\nexit 101\n", 0o755);
    let invocation = unit_property(&node, AGENT, "InvocationID");
    in_node_ok(&node, "dpkg -i /root/inplace-agent-2.deb");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        unit_property(&node, AGENT, "InvocationID"),
        invocation,
        "restarted although policy-rc.d forbids it"
    );
    in_node_ok(&node, "rm /usr/sbin/policy-rc.d");

    let security = in_node(&node, "systemd-analyze security inplace-agent.service");
    say(&format!(
        "systemd-analyze security inplace-agent.service (running in the sandboxed node): {}",
        exposure(&text(&security))
    ));

    // --- Remove stops and disables it and keeps the configuration; purge removes it and
    // the state, and leaves the certificates (they are the operator's).
    in_node_ok(&node, "dpkg -r inplace-agent");
    assert_eq!(unit_property(&node, AGENT, "ActiveState"), "inactive");
    // debhelper masks a removed package's unit (docs/install.md says so), purge unmasks it.
    assert_eq!(
        String::from_utf8_lossy(&in_node(&node, "systemctl is-enabled inplace-agent").stdout)
            .trim(),
        "masked"
    );
    // Installing it again unmasks it; remove once more for the purge below.
    in_node_ok(&node, "dpkg -i /root/inplace-agent-2.deb");
    assert_eq!(
        String::from_utf8_lossy(&in_node(&node, "systemctl is-enabled inplace-agent").stdout)
            .trim(),
        "enabled"
    );
    in_node_ok(&node, "dpkg -r inplace-agent");
    assert!(!node.path("/usr/bin/inplace-agent").exists());
    assert!(node.path("/etc/inplace-agent/config.toml").exists());
    assert!(
        node.path("/var/lib/inplace-agent/journal/journal.log")
            .exists()
    );
    in_node_ok(&node, "dpkg -P inplace-agent");
    assert!(!node.path("/etc/inplace-agent/config.toml").exists());
    assert!(!node.path("/var/lib/inplace-agent").exists());
    assert!(node.path("/etc/inplace-agent/pki/server.key").exists());
    assert!(
        !in_node(&node, "systemctl is-enabled inplace-agent")
            .status
            .success(),
        "not enabled after purge"
    );
    assert!(
        !node
            .path("/etc/systemd/system/inplace-agent.service")
            .exists(),
        "unmasked"
    );
    // The group stays (docs/install.md): files and people may still name it.
    in_node_ok(&node, "getent group inplace-agent");
    drop(systemd);
    say(&format!(
        "the .deb test took {:.1}s",
        started.elapsed().as_secs_f64()
    ));
}

// === The DaemonSet's flags against a sandboxed node ===

/// The agent container of packaging/kubernetes/agent/base/daemonset.yaml.
fn daemonset_container() -> Value {
    let text = std::fs::read_to_string(
        Path::new(REPO).join("packaging/kubernetes/agent/base/daemonset.yaml"),
    )
    .unwrap();
    let ds: Value = serde_yaml_ng::from_str(&text).unwrap();
    ds["spec"]["template"]["spec"]["containers"][0].clone()
}

/// The config.toml of packaging/kubernetes/agent/base/configmap.yaml.
fn configmap_config() -> String {
    let text = std::fs::read_to_string(
        Path::new(REPO).join("packaging/kubernetes/agent/base/configmap.yaml"),
    )
    .unwrap();
    let cm: Value = serde_yaml_ng::from_str(&text).unwrap();
    cm["data"]["config.toml"].as_str().unwrap().to_string()
}

#[test]
fn the_daemonset_flags_run_the_agent_against_the_node_through_host() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let _systemd = node.install_kubelet_standin();
    apt_repo_with_cri_tools(&node);
    let name = node_name(&node);
    let root = node.root().display().to_string();

    // The pod's files: the Secret at /etc/inplace-agent/tls (cert-manager's names) and the
    // ConfigMap's config.toml; here in a directory of the test.
    let dir = tempfile::tempdir().unwrap();
    let files = inplace_api::pki::init(&inplace_api::pki::PkiInitOptions::new(
        dir.path().join("pki"),
        name.clone(),
    ))
    .unwrap();
    let tls = dir.path().join("tls");
    std::fs::create_dir(&tls).unwrap();
    std::fs::copy(&files.server_cert, tls.join("tls.crt")).unwrap();
    std::fs::copy(&files.server_key, tls.join("tls.key")).unwrap();
    std::fs::copy(&files.ca_cert, tls.join("ca.crt")).unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        configmap_config().replace("/etc/inplace-agent/tls/", &format!("{}/", tls.display())),
    )
    .unwrap();

    // The container's args as the kubelet expands them ($(NODE_NAME) from the downward API),
    // with the pod's paths mapped: /host is the node's root, /etc/inplace-agent the
    // ConfigMap and Secret. Any other argument fails the test: a change to the manifest must
    // be looked at here.
    let container = daemonset_container();
    let args: Vec<String> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let a = a.as_str().unwrap();
            match a.split_once('=') {
                Some(("--config", "/etc/inplace-agent/config.toml")) => {
                    format!("--config={}", config.display())
                }
                Some(("--root", "/host")) => format!("--root={root}"),
                Some(("--node-name", "$(NODE_NAME)")) => format!("--node-name={name}"),
                Some(("--bus", bus)) if bus.starts_with("unix:path=/host/") => {
                    format!("--bus={}", bus.replacen("/host", &root, 1))
                }
                // hostNetwork: the node's addresses, which here are the node's network
                // namespace's.
                Some(("--metrics-listen", _)) => a.to_string(),
                None if a == "serve" => a.to_string(),
                _ => panic!("daemonset.yaml: an argument this test does not know: {a}"),
            }
        })
        .collect();
    assert_eq!(args[0], "serve");
    let env_value = |k: &str| {
        container["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == k)
            .and_then(|e| e["value"].as_str().map(str::to_string))
    };

    // hostNetwork: the pod is in the node's network namespace.
    let mut cmd = node.command_in_netns(Path::new(BIN));
    cmd.args(&args)
        .env("INPLACE_AGENT_LOG", env_value("INPLACE_AGENT_LOG").unwrap())
        .env_remove("INPLACE_AGENT_CONFIG")
        .env_remove("INPLACE_AGENT_ROOT")
        .env_remove("INPLACE_AGENT_STATE_DIR")
        .env_remove("INPLACE_AGENT_SERVICES")
        .env_remove("INPLACE_AGENT_BUS");
    let mut agent = Daemon::start(cmd, Ready::Log).unwrap_or_else(|e| panic!("the agent: {e}"));

    // The readiness probe, as the manifest says, with the pod's /host: ready, and no TLS
    // handshake for it (a TCP probe was a failed handshake on every node every 10 s).
    let probe: Vec<String> = container["readinessProbe"]["exec"]["command"]
        .as_array()
        .expect("an exec readiness probe")
        .iter()
        .map(|a| a.as_str().unwrap().replace("/host", &root))
        .collect();
    assert_eq!(probe[0], "/usr/bin/inplace-agent", "{probe:?}");
    for _ in 0..3 {
        let out = Command::new(BIN)
            .args(&probe[1..])
            .env_remove("INPLACE_AGENT_CONFIG")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "readiness probe {probe:?}: {}",
            text(&out)
        );
    }

    let client = Client::new(&node, files.ca_cert.parent().unwrap().to_path_buf());
    let starts = kubelet_starts(&node);
    let applied = client.submit(
        "node.yaml",
        &node_plan("default/md-0@daemonset-route", &name),
        true,
    );
    let metrics = inplace_agent::status::client::get(
        &node.path("/run/inplace-agent/status.sock"),
        "/metrics",
        Duration::from_secs(10),
    )
    .expect("metrics on the status socket");
    let failures: f64 = String::from_utf8_lossy(&metrics.body)
        .lines()
        .filter(|l| l.starts_with("inplace_agent_tls_handshake_failures_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(failures, 0.0, "no handshake failed for the probes");

    // The metrics port the PodMonitor scrapes (packaging/kubernetes/monitoring/agent): the
    // container port named metrics is the one --metrics-listen binds, and it serves /metrics
    // in the node's network namespace, with the plan just applied counted.
    let listen = args
        .iter()
        .find_map(|a| a.strip_prefix("--metrics-listen="))
        .expect("the DaemonSet serves metrics on TCP");
    let port: u16 = listen.rsplit(':').next().unwrap().parse().unwrap();
    let named = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("a container port named metrics");
    assert_eq!(named["containerPort"], port);
    let scraped = http_get_in_netns(&node, port, "/metrics");
    let counted = format!(
        "inplace_agent_plans_total{{result=\"{}\"}} 1",
        applied["phase"].as_str().unwrap_or_default()
    );
    assert!(
        scraped.starts_with("HTTP/1.1 200") && scraped.contains(&counted),
        "GET 127.0.0.1:{port}/metrics in the node has no {counted}:\n{scraped}"
    );
    let exit = agent.terminate();
    let log = agent.log();
    assert_node_plan_applied(&node, starts, &applied);
    assert!(exit.success(), "SIGTERM ends it cleanly: {exit}\n{log}");
    assert!(
        log.contains(&format!(
            "services=systemd on unix:path={root}/run/dbus/system_bus_socket"
        )),
        "{log}"
    );
    assert!(
        node.read_file("/var/lib/inplace-agent/journal/journal.log")
            .contains("default/md-0@daemonset-route"),
        "the journal lives on the node, where the package route keeps it"
    );
}

// === The .rpm ===

#[test]
fn the_rpm_has_the_expected_files_config_and_scripts() {
    let (_dir, rpm) = build_package("--rpm", VERSION);
    let query = |args: &[&str]| run(Command::new("rpm").args(["-qp"]).args(args).arg(&rpm));
    let files = query(&["-l"]);
    say(&format!("rpm -qlp {}:\n{files}", rpm.display()));
    let mut listed: Vec<&str> = files.lines().collect();
    listed.sort_unstable();
    assert_eq!(
        listed,
        [
            "/etc/inplace-agent/config.toml",
            "/usr/bin/inplace-agent",
            "/usr/lib/systemd/system-preset/80-inplace-agent.preset",
            "/usr/lib/systemd/system/inplace-agent.service",
            "/usr/lib/sysusers.d/inplace-agent.conf",
            "/usr/lib/tmpfiles.d/inplace-agent.conf",
            "/usr/share/doc/inplace-agent/README.md",
            "/usr/share/doc/inplace-agent/api.md",
            "/usr/share/doc/inplace-agent/configuration.md",
            "/usr/share/doc/inplace-agent/examples/config.toml",
            "/usr/share/doc/inplace-agent/hardening.md",
            "/usr/share/doc/inplace-agent/install.md",
            "/usr/share/doc/inplace-agent/observability.md",
            "/usr/share/doc/inplace-agent/packages.md",
            "/usr/share/doc/inplace-agent/pki.md",
            "/usr/share/doc/inplace-agent/status-api.schema.json",
        ]
    );
    // Every doc a shipped doc links to is shipped too (the developers' testing docs aside).
    for doc in listed.iter().filter(|f| f.ends_with(".md")) {
        let name = Path::new(doc).file_name().unwrap().to_str().unwrap();
        let source = if name == "README.md" {
            Path::new(REPO).join(name)
        } else {
            Path::new(REPO).join("docs").join(name)
        };
        let text = std::fs::read_to_string(&source).unwrap();
        for link in text.split("](").skip(1) {
            let target = link.split([')', '#']).next().unwrap_or_default();
            let Some(file) = target.rsplit('/').next().filter(|f| f.ends_with(".md")) else {
                continue;
            };
            if target.contains("://") || file.starts_with("testing-") {
                continue;
            }
            assert!(
                listed.iter().any(|l| l.ends_with(&format!("/{file}"))),
                "{name} links to {target}, which the package does not ship"
            );
        }
    }
    assert_eq!(query(&["-c"]), "/etc/inplace-agent/config.toml\n");
    let flags = query(&["--queryformat", "[%{FILENAMES} %{FILEFLAGS:fflags}\\n]"]);
    assert!(
        flags.contains("/etc/inplace-agent/config.toml cn\n"),
        "config(noreplace): {flags}"
    );
    assert_eq!(
        query(&["--queryformat", "%{NAME} %{VERSION}"]),
        format!("inplace-agent {VERSION}")
    );
    let scripts = query(&["--scripts"]);
    for needle in [
        "systemd-sysusers inplace-agent.conf",
        "systemd-tmpfiles --create inplace-agent.conf",
        "preset inplace-agent.service",
        "--no-block try-restart inplace-agent.service",
        "disable --now inplace-agent.service",
    ] {
        assert!(scripts.contains(needle), "{needle} not in:\n{scripts}");
    }
    assert!(
        query(&["--requires"])
            .lines()
            .any(|l| l.trim() == "systemd")
    );
}

// === The packaged config.toml ===

const PACKAGED_CONFIG: &str = include_str!("../../packaging/config.toml");
const EXAMPLE_CONFIG: &str = include_str!("../../examples/config.toml");

/// The packaged file with every `# key = value` line uncommented; with `examples` false,
/// lines marked as examples (`# default: ...` after the value) stay commented.
fn uncommented(examples: bool) -> String {
    PACKAGED_CONFIG
        .lines()
        .map(|line| match line.strip_prefix("# ") {
            // (Indented lines are the example in the file's introduction.)
            Some(rest)
                if !rest.starts_with(' ')
                    && rest.contains(" = ")
                    && (examples || !rest.contains("# default:")) =>
            {
                rest.to_string()
            }
            // The table headers, commented out too.
            Some(rest) if rest.starts_with('[') && rest.ends_with(']') && !rest.contains(' ') => {
                rest.to_string()
            }
            _ => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `table.key` of every assignment in a TOML text.
fn keys(text: &str) -> Vec<String> {
    let mut table = String::new();
    let mut keys = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            table = name.to_string();
        } else if !line.starts_with('#')
            && let Some((key, _)) = line.split_once(" = ")
        {
            keys.push(format!("{table}.{}", key.trim()));
        }
    }
    keys.sort();
    keys
}

/// The daemon settings a configuration text gives (node name set, as every node has one).
fn resolved(text: &str) -> String {
    let input = parse_config(text, Path::new("/etc/inplace-agent/config.toml"))
        .unwrap_or_else(|e| panic!("{e}"));
    let flags = parse_config("[node]\nname = \"worker-1\"\n", Path::new("flags")).unwrap();
    format!("{:?}", input.overlay(flags).resolve().unwrap())
}

#[test]
fn the_packaged_config_is_the_defaults_and_names_every_key() {
    // As shipped it changes nothing.
    assert_eq!(resolved(PACKAGED_CONFIG), resolved(""));
    // Its commented values are the defaults (except the marked examples).
    assert_eq!(resolved(&uncommented(false)), resolved(""));
    // With the examples too it parses, and it names every key examples/config.toml names.
    let all = uncommented(true);
    resolved(&all);
    let missing: Vec<String> = keys(EXAMPLE_CONFIG)
        .into_iter()
        .filter(|k| !keys(&all).contains(k))
        .collect();
    assert!(
        missing.is_empty(),
        "packaging/config.toml lacks {missing:?}"
    );
    // The documented edit works on the file as shipped: appending a table (every header in
    // it is commented out, so nothing is defined twice).
    let appended = format!(
        "{PACKAGED_CONFIG}\n[authorization]\nadmin = [\"{DEFAULT_UPDATER_IDENTITY}\"]\nreader = [\"{DEFAULT_READER_IDENTITY}\"]\n\n[node]\nname = \"worker-9\"\n\n[tls]\ncert = \"/etc/inplace-agent/tls/tls.crt\"\n"
    );
    let input = parse_config(&appended, Path::new("/etc/inplace-agent/config.toml"))
        .unwrap_or_else(|e| panic!("appending tables to the packaged file: {e}"));
    let settings = input.resolve().unwrap();
    assert_eq!(settings.node_name, "worker-9");
    assert_eq!(
        settings.rules.admin(),
        [DEFAULT_UPDATER_IDENTITY.parse().unwrap()]
    );
    assert_eq!(
        settings.tls.cert,
        Path::new("/etc/inplace-agent/tls/tls.crt")
    );
    // The ConfigMap's configuration parses too.
    parse_config(&configmap_config(), Path::new("configmap.yaml"))
        .unwrap_or_else(|e| panic!("{e}"));
}

// === systemd-analyze security ===

#[test]
fn the_units_exposure_is_printed_and_is_the_one_docs_hardening_records() {
    let unit = Path::new(REPO).join("systemd/inplace-agent.service");
    let Ok(out) = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
    else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("systemd-analyze is not installed (tests/packages.txt: systemd)");
        }
        say("\n**** SKIP: systemd-analyze is not installed ****\n");
        return;
    };
    let report = text(&out);
    let score = exposure(&report);
    let version = run(Command::new("systemd-analyze").arg("--version"));
    let version = version.lines().next().unwrap_or_default();
    say(&format!(
        "systemd-analyze security --offline=true systemd/inplace-agent.service ({version}): \
         exposure {score}"
    ));
    let docs = std::fs::read_to_string(Path::new(REPO).join("docs/hardening.md")).unwrap();
    let recorded = format!("systemd 252: **{score}**");
    if version.starts_with("systemd 252 ") {
        assert!(
            docs.contains(&recorded),
            "docs/hardening.md does not record the exposure {score} ({recorded:?}):\n{report}"
        );
    } else {
        say("(docs/hardening.md records the score of systemd 252; not compared)");
    }
}

// === Manifests, Containerfile, scripts ===

fn yaml_documents(rel: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(Path::new(REPO).join(rel)).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

#[test]
fn the_manifests_validate_and_agree_with_each_other() {
    run(Command::new("bash").arg(Path::new(REPO).join("packaging/validate")));

    // (packaging/validate built every kustomization with kustomize: each resource exists.)
    // The overlays are siblings of the agent's base, which kustomize requires.
    for overlay in ["cert-manager", "kubelet-serving"] {
        let k = &yaml_documents(&format!(
            "packaging/kubernetes/agent/{overlay}/kustomization.yaml"
        ))[0];
        assert_eq!(k["resources"][0], "../base", "{overlay}");
    }
    // A certificate per node: the overlay replaces the base ConfigMap (same name) with one
    // whose certificate and key are the node's kubelet serving certificate under /host, a
    // path the pod has (the host's / is mounted there).
    let base = &yaml_documents("packaging/kubernetes/agent/base/configmap.yaml")[0];
    let per_node = &yaml_documents("packaging/kubernetes/agent/kubelet-serving/configmap.yaml")[0];
    assert_eq!(per_node["metadata"], base["metadata"]);
    let config = parse_config(
        per_node["data"]["config.toml"].as_str().unwrap(),
        Path::new("kubelet-serving/configmap.yaml"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let kubelet = Path::new("/host/var/lib/kubelet/pki/kubelet-server-current.pem");
    assert_eq!(config.tls_cert.as_deref(), Some(kubelet));
    assert_eq!(config.tls_key.as_deref(), Some(kubelet));
    let overlay =
        &yaml_documents("packaging/kubernetes/agent/kubelet-serving/kustomization.yaml")[0];
    assert_eq!(overlay["patches"][0]["path"], "configmap.yaml");

    // The DaemonSet as the issue asks for it.
    let ds = &yaml_documents("packaging/kubernetes/agent/base/daemonset.yaml")[0];
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert_eq!(
        pod["tolerations"],
        serde_json::json!([{"operator": "Exists"}])
    );
    let container = &pod["containers"][0];
    assert_eq!(container["securityContext"]["privileged"], true);
    let mounts = container["volumeMounts"].as_array().unwrap();
    let volumes = pod["volumes"].as_array().unwrap();
    let volume = |mount: &str| {
        let m = mounts.iter().find(|m| m["mountPath"] == mount).unwrap();
        volumes
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap()
            .clone()
    };
    assert_eq!(volume("/host")["hostPath"]["path"], "/");
    let secret = volume("/etc/inplace-agent/tls")["secret"]["secretName"].clone();
    // cert-manager writes the Secret the DaemonSet mounts, with an issuer that exists, whose
    // CA Secret is the one the CA Certificate writes.
    let issuers = yaml_documents("packaging/kubernetes/agent/cert-manager/issuer.yaml");
    let certificate =
        &yaml_documents("packaging/kubernetes/agent/cert-manager/certificate.yaml")[0];
    assert_eq!(certificate["spec"]["secretName"], secret);
    // Cluster API generates node names: the shared certificate names them by a wildcard for
    // their DNS domain, never by a list of names (it listed worker-1..3).
    let names = certificate["spec"]["dnsNames"].as_array().unwrap();
    assert!(
        !names.is_empty()
            && names.iter().all(|n| n
                .as_str()
                .is_some_and(|n| n.starts_with("*.") && n.ends_with(".example"))),
        "cert-manager/certificate.yaml names nodes: {names:?}"
    );
    assert_eq!(
        certificate["spec"]["usages"],
        serde_json::json!(["digital signature", "server auth"])
    );
    let issuer_of = |c: &Value| {
        issuers
            .iter()
            .find(|d| {
                d["kind"] == c["spec"]["issuerRef"]["kind"]
                    && d["metadata"]["name"] == c["spec"]["issuerRef"]["name"]
            })
            .unwrap_or_else(|| panic!("no issuer for {c}"))
            .clone()
    };
    let ca_issuer = issuer_of(certificate);
    let ca_certificate = issuers
        .iter()
        .find(|d| d["kind"] == "Certificate" && d["spec"]["isCA"] == true)
        .unwrap();
    assert_eq!(
        ca_issuer["spec"]["ca"]["secretName"],
        ca_certificate["spec"]["secretName"]
    );
    assert!(issuer_of(ca_certificate)["spec"]["selfSigned"].is_object());
    for doc in issuers.iter().chain([certificate]) {
        assert_eq!(doc["apiVersion"], "cert-manager.io/v1");
        assert_eq!(doc["metadata"]["namespace"], "inplace-agent");
    }
}

/// `packaging/validate` looks for the tools nothing installs for it before anything else and,
/// with one missing, names it, its Debian package and tests/setup at once (it used to fail
/// at its last step, shellcheck, after about 110 s). Here PATH holds every tool it looks for
/// but shellcheck.
#[test]
fn validate_names_a_missing_tool_first_and_how_to_get_it() {
    let bin = tempfile::Builder::new()
        .prefix("inplace-test-path-")
        .tempdir()
        .unwrap();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let which = |tool: &str| {
        std::env::split_paths(&path)
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("{tool} is not on PATH (tests/setup)"))
    };
    for tool in ["python3", "openssl"] {
        std::os::unix::fs::symlink(which(tool), bin.path().join(tool)).unwrap();
    }
    let started = std::time::Instant::now();
    let out = Command::new(which("bash"))
        .arg(Path::new(REPO).join("packaging/validate"))
        .env("PATH", bin.path())
        .output()
        .unwrap();
    let err = text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("shellcheck (Debian package shellcheck)")
            && err.contains("tests/setup")
            && !err.contains("openssl (")
            && !err.contains("python3 ("),
        "{err}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "took {:?}: {err}",
        started.elapsed()
    );
}
