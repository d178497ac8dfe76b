//! `package` and `kubeadmUpgradeNode` changes through the real binary, against real apt and
//! dpkg in a disposable overlay root with a local repository of stand-in `kubeadm`,
//! `kubelet` and `kubectl` packages at 1.30.4-1.1 and 1.31.2-1.1 (`overlay::kube_debs`).
//! Service management is off here (restarts are journaled as skipped); the version bump on a
//! real systemd is tests/systemd_packages.rs. Needs root.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::overlay::{self, Overlay};
use crate::support::require_root;
use serde_json::Value;

const OLD: &str = "1.30.4-1.1";
const NEW: &str = "1.31.2-1.1";
const EXAMPLE: &str = include_str!("../../examples/plans/upgrade-1.30-to-1.31.yaml");

#[test]
#[ignore = "helper process for the lock test, started by it"]
fn lock_holder_process() {
    overlay::lock_holder_main();
}

/// An overlay root with both versions of the stand-ins in its only apt source.
struct Node {
    overlay: Overlay,
    plans: tempfile::TempDir,
}

impl Node {
    fn new(test: &str) -> Option<Node> {
        if !require_root(test, "mounts an overlay root") {
            return None;
        }
        let overlay = Overlay::new();
        let mut debs = overlay::kube_debs(OLD);
        debs.extend(overlay::kube_debs(NEW));
        overlay::apt_repo(&overlay, &debs);
        overlay.chroot(&["apt-get", "update", "-q"]);
        Some(Node {
            overlay,
            plans: tempfile::tempdir().unwrap(),
        })
    }

    fn root(&self) -> &Path {
        self.overlay.root()
    }

    fn plan_file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.plans.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// `inplace-agent ARGS --root <overlay>`.
    fn agent(&self, args: &[&str]) -> Output {
        Command::new(crate::support::bin())
            .args(args)
            .arg("--root")
            .arg(self.root())
            .env("INPLACE_AGENT_LOG", "error")
            // The overlay root has no running systemd: restarts are journaled as skipped.
            .env("INPLACE_AGENT_SERVICES", "off")
            .output()
            .unwrap()
    }

    /// Applies a plan and returns the exit code and the JSON status.
    fn apply(&self, name: &str, text: &str) -> (i32, Value, String) {
        let path = self.plan_file(name, text);
        let out = self.agent(&[
            "apply",
            "--no-progress",
            "-o",
            "json",
            path.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let status = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "status JSON: {e}\nstdout: {}\nstderr: {stderr}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        (out.status.code().unwrap_or(-1), status, stderr)
    }

    fn journal(&self) -> Vec<Value> {
        let out = self.agent(&["journal", "-o", "json"]);
        assert!(out.status.success());
        serde_json::from_slice::<Value>(&out.stdout)
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    }

    /// Records of one run of a type.
    fn records(&self, run: u64, kind: &str) -> Vec<Value> {
        self.journal()
            .into_iter()
            .filter(|e| e["run"] == run && e["type"] == kind)
            .map(|e| e["record"][kind].clone())
            .collect()
    }

    /// (version, held) of a package in the overlay's dpkg database.
    fn package(&self, name: &str) -> Option<(String, bool)> {
        let out = Command::new("chroot")
            .arg(self.root())
            .args([
                "dpkg-query",
                "-W",
                "-f=${db:Status-Want} ${db:Status-Status} ${Version}",
                name,
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let fields: Vec<&str> = text.split_whitespace().collect();
        match fields[..] {
            [want, "installed", version] => Some((version.to_string(), want == "hold")),
            _ => None,
        }
    }

    fn kubeadm_log(&self) -> String {
        std::fs::read_to_string(self.overlay.path("/var/log/kubeadm-standin.log"))
            .unwrap_or_default()
    }
}

fn plan(id: &str, changes: &str, verify: &str) -> String {
    format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n{changes}{verify}")
}

fn packages(version: &str, hold: bool) -> String {
    ["kubeadm", "kubelet", "kubectl"]
        .map(|n| format!("  - package: {{name: {n}, version: {version}, hold: {hold}}}\n"))
        .concat()
}

/// Milliseconds of the day of a journal time (`2026-11-30T14:35:46.123Z`).
fn ms_of_day(time: &str) -> u64 {
    let t = &time[11..23];
    let (h, m, s, ms) = (&t[0..2], &t[3..5], &t[6..8], &t[9..12]);
    [(h, 3_600_000), (m, 60_000), (s, 1000), (ms, 1)]
        .iter()
        .map(|(v, f)| v.parse::<u64>().unwrap() * f)
        .sum()
}

/// "Preparing 0.01s, Applying 9.1s, ..." from the journal's phase records of a run.
fn phase_times(journal: &[Value], run: u64) -> String {
    let marks: Vec<(String, u64)> = journal
        .iter()
        .filter(|e| e["run"] == run && (e["type"] == "phase" || e["type"] == "planFinished"))
        .map(|e| {
            let rec = &e["record"][e["type"].as_str().unwrap()];
            (
                rec["phase"].as_str().unwrap().to_string(),
                ms_of_day(e["time"].as_str().unwrap()),
            )
        })
        .collect();
    marks
        .windows(2)
        .map(|w| format!("{} {:.2}s", w[0].0, (w[1].1 - w[0].1) as f64 / 1000.0))
        .collect::<Vec<_>>()
        .join(", ")
}

fn states(status: &Value) -> Vec<String> {
    status["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["state"].as_str().unwrap().to_string())
        .collect()
}

/// The kubelet stand-in serving /healthz on a free port (the overlay has no systemd to run
/// the kubelet; the gates still need one).
struct Kubelet {
    child: Child,
    port: u16,
    _config: tempfile::TempDir,
}

impl Kubelet {
    fn start() -> Kubelet {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = tempfile::tempdir().unwrap();
        let file = config.path().join("config.yaml");
        std::fs::write(
            &file,
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n",
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kubelet-standin"))
            .arg(format!("--config={}", file.display()))
            .arg(format!("--healthz-port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the kubelet stand-in did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Kubelet {
            child,
            port,
            _config: config,
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The example plan with its health gate pointed at the stand-in and another id, without its
/// `unitActive` gate (refused with service management off; tests/systemd_packages.rs runs
/// the example as it is on a real systemd).
fn example(id: &str, kubelet: &Kubelet) -> String {
    let unit_gate = "  - unitActive: {name: kubelet.service, timeoutSeconds: 120}\n";
    assert!(EXAMPLE.contains(unit_gate), "{EXAMPLE}");
    let text = EXAMPLE
        .replace(unit_gate, "")
        .replace("127.0.0.1:10248", &format!("127.0.0.1:{}", kubelet.port))
        .replace("id: default/md-0-7d9f4-abcde@v1.31.2", &format!("id: {id}"));
    assert!(text.contains(&format!("id: {id}\n")), "{text}");
    text
}

#[test]
fn install_hold_upgrade_and_downgrade_through_plans() {
    let Some(node) = Node::new("install_hold_upgrade_and_downgrade_through_plans") else {
        return;
    };
    assert_eq!(node.package("kubelet"), None);

    // Install, not held.
    let (code, status, err) = node.apply("1.yaml", &plan("t/1", &packages(OLD, false), ""));
    assert_eq!(code, 0, "{status:#}\n{err}");
    assert_eq!(states(&status), ["Changed", "Changed", "Changed"]);
    assert_eq!(
        status["changes"][1]["message"],
        "install kubelet 1.30.4-1.1 (not installed before), release the hold"
    );
    assert_eq!(node.package("kubelet"), Some((OLD.into(), false)));
    // The commands and their output are in the journal; the restart is computed (kubelet).
    let run = status["run"].as_u64().unwrap();
    let output = node.records(run, "stepOutput");
    assert_eq!(output.len(), 3);
    assert!(
        output[1]["output"]
            .as_str()
            .unwrap()
            .contains("$ apt-get install -y -q --no-remove --allow-downgrades"),
        "{output:#?}"
    );
    let restarts = node.records(run, "unitJobDone");
    assert_eq!(restarts.len(), 1, "{restarts:#?}");
    assert_eq!(restarts[0]["unit"], "kubelet.service");
    assert_eq!(restarts[0]["outcome"], "skipped");

    // The same desired state under a new id: nothing to do, nothing journaled as a mutation.
    let (code, status, _) = node.apply("2.yaml", &plan("t/2", &packages(OLD, false), ""));
    assert_eq!(code, 0);
    assert_eq!(states(&status), ["Unchanged", "Unchanged", "Unchanged"]);
    assert_eq!(
        status["changes"][1]["message"],
        "kubelet 1.30.4-1.1 is installed (apt) and not held"
    );
    let run = status["run"].as_u64().unwrap();
    assert!(node.records(run, "stepStarted").is_empty());
    assert!(node.records(run, "unitJobDone").is_empty());

    // Hold: only the hold changes.
    let (code, status, _) = node.apply("3.yaml", &plan("t/3", &packages(OLD, true), ""));
    assert_eq!(code, 0);
    assert_eq!(
        status["changes"][1]["message"],
        "hold kubelet (at 1.30.4-1.1)"
    );
    assert_eq!(node.package("kubelet"), Some((OLD.into(), true)));

    // A dry run of the upgrade says what would change, and changes nothing.
    let up = node.plan_file("4.yaml", &plan("t/4", &packages(NEW, true), ""));
    let out = node.agent(&["check", "-o", "json", up.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let check: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(check["changes"][1]["result"], "wouldChange");
    assert_eq!(
        check["changes"][1]["detail"],
        "install kubelet 1.31.2-1.1 (was 1.30.4-1.1), hold"
    );
    assert_eq!(
        check["restartUnits"],
        serde_json::json!(["kubelet.service"])
    );
    assert_eq!(node.package("kubelet"), Some((OLD.into(), true)));

    // Upgrade the held packages: they move and stay held.
    let (code, status, _) = node.apply("4.yaml", &plan("t/4", &packages(NEW, true), ""));
    assert_eq!(code, 0, "{status:#}");
    for name in ["kubeadm", "kubelet", "kubectl"] {
        assert_eq!(node.package(name), Some((NEW.into(), true)), "{name}");
    }
    assert_eq!(
        node.overlay.chroot(&["kubelet", "--version"]).trim(),
        "Kubernetes v1.31.2"
    );

    // Downgrade (the plan asks for the older version).
    let (code, status, _) = node.apply("5.yaml", &plan("t/5", &packages(OLD, true), ""));
    assert_eq!(code, 0, "{status:#}");
    assert_eq!(
        status["changes"][1]["message"],
        "install kubelet 1.30.4-1.1 (was 1.31.2-1.1), hold"
    );
    assert_eq!(node.package("kubelet"), Some((OLD.into(), true)));
    assert_eq!(
        node.overlay.chroot(&["kubelet", "--version"]).trim(),
        "Kubernetes v1.30.4"
    );

    // A version no repository has: the plan fails at that step, saying so, and the packages
    // changed before it are put back.
    let missing = "  - package: {name: kubectl, version: 1.31.2-1.1, hold: true}\n  \
                   - package: {name: kubelet, version: 1.29.0-1.1, hold: true}\n";
    let (code, status, _) = node.apply("6.yaml", &plan("t/6", missing, ""));
    assert_eq!(code, 1);
    assert_eq!(status["phase"], "RolledBack");
    assert_eq!(status["error"]["kind"], "package");
    assert_eq!(
        status["error"]["step"],
        "changes[1] package kubelet=1.29.0-1.1"
    );
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(
        detail.starts_with(
            "kubelet 1.29.0-1.1 is not offered by any configured repository (after refreshing \
             the package lists; offered: 1.31.2-1.1, 1.30.4-1.1): install kubelet=1.29.0-1.1 in "
        ),
        "{detail}"
    );
    assert_eq!(node.package("kubectl"), Some((OLD.into(), true)));
    assert_eq!(node.package("kubelet"), Some((OLD.into(), true)));
}

#[test]
fn the_version_upgrade_plan_end_to_end() {
    let Some(node) = Node::new("the_version_upgrade_plan_end_to_end") else {
        return;
    };
    let started = Instant::now();
    let (code, _, err) = node.apply("old.yaml", &plan("t/old", &packages(OLD, true), ""));
    assert_eq!(code, 0, "{err}");
    node.overlay.write(
        "/var/lib/kubelet/config.yaml",
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n",
    );
    let kubelet = Kubelet::start();

    let upgrade = Instant::now();
    let (code, status, err) = node.apply("up.yaml", &example("t/up", &kubelet));
    let took = upgrade.elapsed();
    assert_eq!(code, 0, "{status:#}\n{err}");
    assert_eq!(status["phase"], "Succeeded");
    assert_eq!(
        states(&status),
        ["Changed", "Changed", "Changed", "Changed"]
    );
    assert!(
        status["changes"][1]["message"]
            .as_str()
            .unwrap()
            .starts_with("run kubeadm upgrade node (changes[0] changed an input of kubeadm"),
        "{status:#}"
    );
    for name in ["kubeadm", "kubelet", "kubectl"] {
        assert_eq!(node.package(name), Some((NEW.into(), true)), "{name}");
    }
    assert_eq!(
        node.kubeadm_log(),
        "kubeadm v1.31.2 upgrade node (kubelet v1.30.4)\n",
        "the new kubeadm ran it, before the kubelet was upgraded"
    );
    assert_eq!(
        status["checks"][1]["message"],
        "/usr/bin/kubelet reports v1.31.2"
    );
    let run = status["run"].as_u64().unwrap();
    let output = node.records(run, "stepOutput");
    assert!(
        output.iter().any(|o| o["output"]
            .as_str()
            .unwrap()
            .contains("$ kubeadm upgrade node (exit 0")
            && o["output"]
                .as_str()
                .unwrap()
                .contains("successfully updated")),
        "{output:#?}"
    );
    // One restart of the kubelet, after both of its inputs; recorded as skipped here.
    let restarts = node.records(run, "unitJobDone");
    assert_eq!(restarts.len(), 1, "{restarts:#?}");
    assert_eq!(restarts[0]["unit"], "kubelet.service");
    assert_eq!(restarts[0]["outcome"], "skipped");

    eprintln!("upgrade plan phases: {}", phase_times(&node.journal(), run));
    let steps: Vec<String> = status["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| format!("{} {}ms", c["target"], c["durationMs"]))
        .collect();
    eprintln!("upgrade plan steps: {}", steps.join(", "));

    // The same plan again: it already ran, nothing runs.
    let (code, again, err) = node.apply("up.yaml", &example("t/up", &kubelet));
    assert_eq!(code, 0);
    assert_eq!(again["run"], status["run"]);
    assert!(err.contains("already ran on this node"), "{err}");

    // The same desired state under a new id: every change unchanged, kubeadm skipped.
    let (code, status, _) = node.apply("up2.yaml", &example("t/up2", &kubelet));
    assert_eq!(code, 0, "{status:#}");
    assert_eq!(
        states(&status),
        ["Unchanged", "Unchanged", "Unchanged", "Unchanged"]
    );
    assert_eq!(
        status["changes"][1]["message"],
        "skipped: nothing kubeadm reads changed in this run and no version bump is pending \
         (kubeadm v1.31.2, kubelet v1.31.2)"
    );
    let run = status["run"].as_u64().unwrap();
    assert!(node.records(run, "stepStarted").is_empty());
    assert!(node.records(run, "unitJobDone").is_empty());
    assert_eq!(node.kubeadm_log().lines().count(), 1, "not run again");
    eprintln!(
        "upgrade plan applied in {took:?} (test {:?})",
        started.elapsed()
    );
}

#[test]
fn a_failing_kubeadm_upgrade_node_fails_the_plan_at_that_step() {
    let Some(node) = Node::new("a_failing_kubeadm_upgrade_node_fails_the_plan_at_that_step") else {
        return;
    };
    let (code, _, err) = node.apply("old.yaml", &plan("t/old", &packages(OLD, true), ""));
    assert_eq!(code, 0, "{err}");
    let config = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n";
    node.overlay.write("/var/lib/kubelet/config.yaml", config);
    node.overlay
        .write("/etc/kubernetes/kubeadm-standin-fail", "");
    let kubelet = Kubelet::start();

    let (code, status, err) = node.apply("up.yaml", &example("t/up", &kubelet));
    assert_eq!(code, 1, "{status:#}\n{err}");
    assert_eq!(status["phase"], "RolledBack");
    // The failed step is rolled back too: the files kubeadm touched are restored.
    assert_eq!(
        states(&status),
        ["RolledBack", "RolledBack", "Skipped", "Skipped"]
    );
    let error = &status["error"];
    assert_eq!(error["kind"], "command");
    assert_eq!(
        error["step"],
        "changes[1] kubeadmUpgradeNode kubeadm upgrade node"
    );
    let detail = error["detail"].as_str().unwrap();
    assert!(
        detail.starts_with(
            "kubeadm upgrade node: exit status 1: error execution phase kubelet-config: \
             stand-in failure requested by the test\noutput:\n"
        ),
        "{detail}"
    );
    assert!(
        detail.contains("[upgrade/kubelet-config] writing the kubelet configuration"),
        "stdout too: {detail}"
    );
    // The hook response CAPI gets carries it.
    let hook = status["hookResponse"]["message"].as_str().unwrap();
    assert!(
        hook.contains("stand-in failure requested by the test"),
        "{hook}"
    );
    // Nothing after it ran; kubeadm is back at the old version, still held; the kubelet
    // configuration kubeadm touched before failing is restored.
    assert_eq!(node.package("kubelet"), Some((OLD.into(), true)));
    assert_eq!(node.package("kubectl"), Some((OLD.into(), true)));
    assert_eq!(node.package("kubeadm"), Some((OLD.into(), true)));
    assert_eq!(
        std::fs::read_to_string(node.overlay.path("/var/lib/kubelet/config.yaml")).unwrap(),
        config
    );
    assert!(status["checks"][0]["state"] == "Skipped", "{status:#}");

    // Without rollback the node stays half-way; the retry runs kubeadm upgrade node again
    // even though the kubeadm package does not change any more (kubeadm is newer than the
    // kubelet), and finishes the bump.
    let no_rollback =
        example("t/half", &kubelet).replace("rollbackOnFailure: true", "rollbackOnFailure: false");
    let (code, status, _) = node.apply("half.yaml", &no_rollback);
    assert_eq!(code, 1);
    assert_eq!(status["phase"], "Failed");
    assert_eq!(node.package("kubeadm"), Some((NEW.into(), true)));
    assert_eq!(node.package("kubelet"), Some((OLD.into(), true)));
    std::fs::remove_file(node.overlay.path("/etc/kubernetes/kubeadm-standin-fail")).unwrap();
    let path = node.plan_file("half.yaml", &no_rollback);
    let out = node.agent(&[
        "apply",
        "--retry",
        "--no-progress",
        "-o",
        "json",
        path.to_str().unwrap(),
    ]);
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{status:#}");
    assert_eq!(status["attempt"], 2);
    assert_eq!(
        states(&status),
        ["Unchanged", "Changed", "Changed", "Changed"]
    );
    assert!(
        status["changes"][1]["message"]
            .as_str()
            .unwrap()
            .contains("kubeadm v1.31.2 is newer than the kubelet v1.30.4"),
        "{status:#}"
    );
    assert_eq!(node.package("kubelet"), Some((NEW.into(), true)));
}

#[test]
fn rollback_says_plainly_when_the_old_version_is_gone() {
    let Some(node) = Node::new("rollback_says_plainly_when_the_old_version_is_gone") else {
        return;
    };
    let one = |v: &str| format!("  - package: {{name: kubelet, version: {v}, hold: true}}\n");
    let (code, _, err) = node.apply("old.yaml", &plan("t/old", &one(OLD), ""));
    assert_eq!(code, 0, "{err}");
    // The repository stops offering the old version.
    std::fs::remove_file(
        node.overlay
            .path(&format!("/srv/repo/kubelet_{OLD}_all.deb")),
    )
    .unwrap();
    overlay::apt_repo_index(&node.overlay);

    let gate =
        "verify:\n  - command: {argv: [sh, -c, \"echo no >&2; exit 1\"], timeoutSeconds: 5}\n";
    let (code, status, _) = node.apply("new.yaml", &plan("t/new", &one(NEW), gate));
    assert_eq!(code, 1);
    assert_eq!(status["phase"], "Failed", "{status:#}");
    assert_eq!(status["error"]["kind"], "rollback_failed");
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(
        detail.starts_with(
            "rollback could not restore this change: cannot reinstall kubelet 1.30.4-1.1 with \
             apt: no configured repository offers that version any more (offered: \
             1.31.2-1.1); kubelet stays at 1.31.2-1.1; the node needs attention"
        ),
        "{detail}"
    );
    assert_eq!(node.package("kubelet"), Some((NEW.into(), true)));
}

#[test]
fn a_held_dpkg_lock_is_shown_in_the_status_and_waited_for() {
    use inplace_agent::config::SettingsInput;
    use inplace_agent::engine::Engine;
    use inplace_agent::host::Host;

    let Some(node) = Node::new("a_held_dpkg_lock_is_shown_in_the_status_and_waited_for") else {
        return;
    };
    let settings = SettingsInput {
        root: Some(node.root().to_path_buf()),
        services_off: true,
        ..SettingsInput::default()
    }
    .resolve()
    .unwrap();
    let text = plan(
        "t/lock",
        "  - package: {name: kubelet, version: 1.31.2-1.1, hold: true}\n",
        "",
    );
    let parsed = inplace_plan::parse_plan(text.as_bytes(), "t/lock", &settings.limits).unwrap();
    let host = Arc::new(Host::open(settings.host.clone()).unwrap());
    let (engine, _) = Engine::open(settings.engine.clone(), host).unwrap();
    let mut events = engine.subscribe();

    let holder = overlay::LockHolder::start(
        module_path!(),
        &node.overlay.path("/var/lib/dpkg/lock-frontend"),
    );
    let pid = holder.pid();
    engine.submit(parsed, "test", false).unwrap();
    let worker = engine.spawn_worker().unwrap();

    // The status says who holds the lock, for as long as it is held.
    let waiting = format!(
        "changes[0] package kubelet=1.31.2-1.1: waiting for the dpkg lock \
         (/var/lib/dpkg/lock-frontend), held by PID {pid} ("
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let seen = loop {
        let status = engine.status("t/lock").unwrap();
        if status.progress.message.starts_with(&waiting) {
            break status;
        }
        assert!(
            Instant::now() < deadline && !status.phase.is_terminal(),
            "no lock wait in the status: {status:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let hook = seen.hook_response();
    assert_eq!(hook.retry_after_seconds, 10);
    assert!(
        hook.message
            .starts_with(&format!("plan t/lock: Applying step 1/1: {waiting}")),
        "{}",
        hook.message
    );
    // Watchers heard it too.
    let note = loop {
        match events.try_recv() {
            Ok(inplace_agent::engine::Event::Progress(p)) if p.note.is_some() => {
                break p.note.clone().unwrap();
            }
            Ok(_) => continue,
            Err(e) => panic!("no note event: {e:?}"),
        }
    };
    assert!(note.starts_with(&waiting), "{note}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        node.package("kubelet"),
        None,
        "nothing installed while the lock is held"
    );

    holder.release();
    let deadline = Instant::now() + Duration::from_secs(120);
    let done = loop {
        let status = engine.status("t/lock").unwrap();
        if status.phase.is_terminal() {
            break status;
        }
        assert!(Instant::now() < deadline, "{status:#?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    engine.shutdown();
    let _ = worker.join();
    assert_eq!(
        done.phase,
        inplace_agent::engine::state::Phase::Succeeded,
        "{done:#?}"
    );
    assert_eq!(node.package("kubelet"), Some((NEW.into(), true)));
}
