//! The agent against a real systemd: each test boots this machine's systemd in a sandbox
//! (tests/sandbox, DESIGN.md §7) with the kubelet stand-in as `kubelet.service`, and drives
//! the real binary as `inplace-agent apply --root /proc/<pid>/root --bus <the node's bus>`,
//! run in the node's network namespace (so its gates reach the node's 127.0.0.1).
//! As root these tests run; otherwise they print a SKIP line (and fail when CI=true).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support;
use crate::support::sandbox::{SandboxNode, StandinExt, Systemd, agent_command as agent};
use crate::support::text;
use inplace_agent::host::systemd::{ActiveState, SystemdError, UnitFileState};
use serde_json::Value;

const BIN: &str = crate::support::programs::AGENT;
const KUBELET: &str = "kubelet.service";
const STARTS: &str = "/var/log/kubelet-standin.starts";
const GATES: &str = "verify:
  - unitActive: {name: kubelet.service, timeoutSeconds: 20}
  - httpGet: {url: \"http://127.0.0.1:10248/healthz\", expectStatus: 200, timeoutSeconds: 20, periodSeconds: 1}
";

/// Where a test keeps its plan files and boot id file (on the host, outside the node).
struct Work {
    dir: tempfile::TempDir,
}

impl Work {
    fn new() -> Work {
        Work {
            dir: tempfile::Builder::new()
                .prefix("inplace-systemd-agent-")
                .tempdir()
                .expect("tempdir"),
        }
    }

    fn plan(&self, name: &str, id: &str, body: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        let text = format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\n{body}");
        std::fs::write(&path, text).expect("write plan");
        path
    }

    fn boot_id_file(&self, id: &str) -> PathBuf {
        let path = self.dir.path().join("boot_id");
        std::fs::write(&path, format!("{id}\n")).expect("write boot id");
        path
    }
}

/// Applies a plan; returns the exit code and the final status (`-o json`).
fn apply(node: &SandboxNode, plan: &Path, extra: &[&str]) -> (i32, Value, String) {
    let mut args = vec!["apply", "--no-progress", "-o", "json"];
    args.extend_from_slice(extra);
    let out = agent(node, &args)
        .arg(plan)
        .output()
        .expect("run the agent");
    let all = text(&out);
    let status = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), status, all)
}

fn check(node: &SandboxNode, plan: &Path) -> Value {
    let out = agent(node, &["check", "-o", "json"])
        .arg(plan)
        .output()
        .expect("run check");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("check: {}", text(&out)))
}

/// The journal records of `run` (`type`, `record` body).
fn journal(node: &SandboxNode, run: u64) -> Vec<(String, Value)> {
    let out = agent(node, &["journal", "-o", "json"])
        .output()
        .expect("run journal");
    assert!(out.status.success(), "{}", text(&out));
    let all: Value = serde_json::from_slice(&out.stdout).expect("journal json");
    all.as_array()
        .expect("array")
        .iter()
        .filter(|e| e["run"].as_u64() == Some(run))
        .map(|e| {
            let kind = e["type"].as_str().unwrap_or_default().to_string();
            let body = e["record"][&kind].clone();
            (kind, body)
        })
        .collect()
}

fn count(records: &[(String, Value)], kind: &str, pred: impl Fn(&Value) -> bool) -> usize {
    records.iter().filter(|(k, v)| k == kind && pred(v)).count()
}

fn jobs(records: &[(String, Value)], unit: &str, job: &str, rollback: bool) -> Vec<Value> {
    records
        .iter()
        .filter(|(k, v)| {
            k == "unitJobDone" && v["unit"] == unit && v["job"] == job && v["rollback"] == rollback
        })
        .map(|(_, v)| v.clone())
        .collect()
}

/// Lines of the stand-in's start log (`<invocation id> ok|refused ...`).
fn starts(node: &SandboxNode) -> Vec<String> {
    std::fs::read_to_string(node.path(STARTS))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn invocation(systemd: &Systemd, unit: &str) -> String {
    systemd
        .unit_state(unit)
        .expect("unit state")
        .invocation_id
        .map(|i| i.to_string())
        .unwrap_or_default()
}

fn run_of(status: &Value) -> u64 {
    status["run"].as_u64().expect("status has a run")
}

#[test]
fn kubelet_config_and_flags_restart_the_kubelet_once_and_pass_the_gates() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    let work = Work::new();
    let body = format!(
        "changes:
  - kubeletConfig: {{mergePatch: {{maxPods: 150, serializeImagePulls: false}}}}
  - kubeletFlags: {{set: {{node-labels: tier=db, v: \"2\"}}, remove: [pod-infra-container-image]}}
  - file: {{path: /etc/kubernetes/audit.yaml, content: \"kind: Policy\\n\", restartUnits: [kubelet.service]}}
{GATES}  - kubeletVersion: {{version: v1.30.4}}
"
    );
    let plan = work.plan("tuning.yaml", "default/md-0@tuning", &body);

    let report = check(&node, &plan);
    assert_eq!(report["disruption"], "Restart", "{report:#}");
    assert_eq!(report["restartUnits"], serde_json::json!([KUBELET]));
    assert_eq!(report["daemonReload"], false);
    assert_eq!(report["applicable"], true, "{report:#}");
    assert!(
        report["services"]
            .as_str()
            .unwrap_or_default()
            .starts_with("systemd on unix:path=/proc/"),
        "{report:#}"
    );

    let before = invocation(&systemd, KUBELET);
    let starts_before = starts(&node).len();
    let (code, status, out) = apply(&node, &plan, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(status["phase"], "Succeeded", "{status:#}");
    assert_eq!(status["hookResponse"]["retryAfterSeconds"], 0);
    assert!(
        status["services"]
            .as_str()
            .unwrap_or_default()
            .starts_with("systemd on ")
    );
    for gate in status["checks"].as_array().unwrap() {
        assert_eq!(gate["state"], "Passed", "{gate:#}");
    }
    assert_eq!(
        status["checks"][2]["message"], "/usr/local/bin/kubelet reports v1.30.4",
        "the root's kubelet ran"
    );

    // Restarted exactly once: one new invocation, one new start, one journaled restart.
    let after = invocation(&systemd, KUBELET);
    assert_ne!(after, before);
    let log = starts(&node);
    assert_eq!(log.len(), starts_before + 1, "{log:#?}");
    assert!(
        log[starts_before].starts_with(&format!("{after} ok ")),
        "{log:#?}"
    );
    assert!(log[starts_before].contains("maxPods 150"), "{log:#?}");
    let records = journal(&node, run_of(&status));
    let restarts = jobs(&records, KUBELET, "restart", false);
    assert_eq!(restarts.len(), 1, "{records:#?}");
    assert_eq!(restarts[0]["outcome"], "done");
    assert_eq!(count(&records, "unitJobStarted", |_| true), 1);
    assert_eq!(
        count(&records, "daemonReloaded", |_| true),
        0,
        "no unit file changed"
    );
    let state = systemd.unit_state(KUBELET).unwrap();
    assert!(state.is_active(), "{state}");
    assert_eq!(node.http_get(10248, "/healthz"), Ok((200, "ok".into())));

    // The same plan again: it already ran; nothing runs.
    let (code, again, out) = apply(&node, &plan, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(again["run"], status["run"]);
    assert!(out.contains("already ran on this node"), "{out}");
    // The same desired state under a new id: every change unchanged, nothing restarted.
    let same = work.plan("same.yaml", "default/md-0@tuning-again", &body);
    let (code, noop, out) = apply(&node, &same, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(noop["phase"], "Succeeded");
    assert_eq!(noop["counts"]["changed"], 0, "{noop:#}");
    assert_eq!(invocation(&systemd, KUBELET), after);
    assert_eq!(starts(&node).len(), starts_before + 1);
    let records = journal(&node, run_of(&noop));
    assert_eq!(
        count(&records, "unitJobStarted", |_| true),
        0,
        "{records:#?}"
    );
    assert_eq!(count(&records, "unitJobDone", |_| true), 0, "{records:#?}");
}

#[test]
fn a_bad_kubelet_config_fails_the_gate_and_is_rolled_back_and_restarted() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    let work = Work::new();
    let plan = work.plan(
        "bad.yaml",
        "default/md-0@bad",
        "changes:
  - kubeletConfig: {mergePatch: {maxPods: 0}}
  - file: {path: /etc/kubernetes/audit.yaml, content: x, restartUnits: [kubelet.service]}
verify:
  - httpGet: {url: \"http://127.0.0.1:10248/healthz\", timeoutSeconds: 4, periodSeconds: 1}
  - unitActive: {name: kubelet.service, timeoutSeconds: 5}
",
    );
    let config = node.read_file("/var/lib/kubelet/config.yaml");
    let before = invocation(&systemd, KUBELET);
    let starts_before = starts(&node).len();
    let (code, status, out) = apply(&node, &plan, &[]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    let error = &status["error"];
    assert_eq!(error["kind"], "verification", "{error:#}");
    assert_eq!(
        error["step"], "verify[0] httpGet http://127.0.0.1:10248/healthz",
        "{error:#}"
    );
    let detail = error["detail"].as_str().unwrap();
    assert!(
        detail.contains("earlier: restart kubelet.service: job failed"),
        "{detail}"
    );
    assert!(detail.contains("maxPods"), "{detail}");
    let hook = &status["hookResponse"];
    assert_eq!(hook["status"], "Failure");
    assert!(
        hook["message"]
            .as_str()
            .unwrap()
            .contains("failed and was rolled back: verify[0] httpGet"),
        "{hook:#}"
    );

    // Files restored, the stand-in restarted on the old config and active again.
    assert_eq!(node.read_file("/var/lib/kubelet/config.yaml"), config);
    assert!(!node.path("/etc/kubernetes/audit.yaml").exists());
    let state = systemd.unit_state(KUBELET).unwrap();
    assert!(state.is_active(), "{state}");
    assert!(
        state
            .status_text
            .unwrap_or_default()
            .contains("maxPods 110"),
        "runs the old config"
    );
    let now = invocation(&systemd, KUBELET);
    assert_ne!(now, before);
    let log = starts(&node);
    let new = &log[starts_before..];
    assert!(
        new[0].contains("refused") && new[0].contains("maxPods"),
        "{new:#?}"
    );
    assert!(
        new.last().unwrap().starts_with(&format!("{now} ok ")),
        "{new:#?}"
    );
    assert_eq!(node.http_get(10248, "/healthz"), Ok((200, "ok".into())));
    let records = journal(&node, run_of(&status));
    assert_eq!(
        jobs(&records, KUBELET, "restart", false)[0]["outcome"],
        "failed"
    );
    let back = jobs(&records, KUBELET, "restart", true);
    assert_eq!(back.len(), 1, "{records:#?}");
    assert_eq!(back[0]["outcome"], "done");
}

const HELLO: &str = "[Unit]\\nDescription=inplace-agent test unit\\n[Service]\\nExecStart=/bin/sh -c 'echo \\\"greeting=${GREETING:-none}\\\" > /run/hello.env; exec sleep infinity'\\n[Install]\\nWantedBy=multi-user.target\\n";

#[test]
fn a_new_unit_is_written_enabled_and_started_then_a_drop_in_restarts_it_once() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.connect();
    let work = Work::new();
    let unit_body = format!(
        "changes:
  - unit: {{name: hello.service, content: \"{HELLO}\", enabled: true, state: running}}
verify:
  - unitActive: {{name: hello.service, timeoutSeconds: 10}}
"
    );
    let plan = work.plan("hello.yaml", "hello@1", &unit_body);
    let report = check(&node, &plan);
    assert_eq!(report["changes"][0]["result"], "wouldChange", "{report:#}");
    assert_eq!(report["disruption"], "Restart");
    assert_eq!(report["daemonReload"], true);

    let (code, status, out) = apply(&node, &plan, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(status["phase"], "Succeeded", "{status:#}");
    let records = journal(&node, run_of(&status));
    assert_eq!(
        count(&records, "daemonReloaded", |_| true),
        1,
        "{records:#?}"
    );
    assert_eq!(jobs(&records, "hello.service", "start", false).len(), 1);
    assert_eq!(count(&records, "unitJobDone", |_| true), 1, "{records:#?}");
    assert!(
        node.path("/etc/systemd/system/multi-user.target.wants/hello.service")
            .symlink_metadata()
            .is_ok(),
        "enabled"
    );
    assert_eq!(
        systemd.unit_file_state("hello.service").unwrap(),
        UnitFileState::Enabled
    );
    assert!(systemd.unit_state("hello.service").unwrap().is_active());
    let greeting = || node.read_file("/run/hello.env");
    assert_eq!(
        support::poll(|| {
            let g = greeting();
            (!g.is_empty()).then_some(g)
        })
        .as_deref(),
        Some("greeting=none\n")
    );
    let first = invocation(&systemd, "hello.service");
    let report = check(&node, &plan);
    assert_eq!(report["changes"][0]["result"], "unchanged", "{report:#}");
    assert_eq!(report["disruption"], "None");

    let drop_in = work.plan(
        "dropin.yaml",
        "hello@2",
        "changes:
  - unit: {name: hello.service, dropIn: {name: 10-greeting.conf, content: \"[Service]\\nEnvironment=GREETING=hi\\n\"}}
",
    );
    let report = check(&node, &drop_in);
    assert_eq!(report["restartUnits"], serde_json::json!(["hello.service"]));
    assert_eq!(report["daemonReload"], true);
    let (code, status, out) = apply(&node, &drop_in, &[]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(status["phase"], "Succeeded", "{status:#}");
    let records = journal(&node, run_of(&status));
    assert_eq!(
        count(&records, "daemonReloaded", |_| true),
        1,
        "{records:#?}"
    );
    assert_eq!(
        count(&records, "unitJobStarted", |_| true),
        1,
        "{records:#?}"
    );
    assert_eq!(jobs(&records, "hello.service", "restart", false).len(), 1);
    assert_ne!(invocation(&systemd, "hello.service"), first);
    assert_eq!(
        support::poll(|| {
            let g = greeting();
            (g == "greeting=hi\n").then_some(g)
        })
        .as_deref(),
        Some("greeting=hi\n")
    );

    // Stopped and disabled: one reload, one stop, no restart.
    let off = work.plan(
        "off.yaml",
        "hello@3",
        "changes:\n  - unit: {name: hello.service, enabled: false, state: stopped}\n",
    );
    let (code, status, out) = apply(&node, &off, &[]);
    assert_eq!(code, 0, "{out}");
    let records = journal(&node, run_of(&status));
    assert_eq!(count(&records, "daemonReloaded", |_| true), 1);
    assert_eq!(jobs(&records, "hello.service", "stop", false).len(), 1);
    assert_eq!(count(&records, "unitJobDone", |_| true), 1, "{records:#?}");
    let state = systemd.unit_state("hello.service").unwrap();
    assert_eq!(state.active_state, ActiveState::Inactive, "{state}");
    assert_eq!(
        systemd.unit_file_state("hello.service").unwrap(),
        UnitFileState::Disabled
    );
}

#[test]
fn a_unit_that_fails_to_start_is_a_clear_error_and_everything_is_undone() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.connect();
    let work = Work::new();
    let plan = work.plan(
        "broken.yaml",
        "broken@1",
        "changes:
  - file: {path: /etc/kubernetes/marker.conf, content: x}
  - unit:
      name: broken.service
      content: \"[Service]\\nType=oneshot\\nRemainAfterExit=yes\\nExecStart=/bin/sh -c 'echo broken >&2; exit 3'\\n[Install]\\nWantedBy=multi-user.target\\n\"
      enabled: true
      state: running
",
    );
    let (code, status, out) = apply(&node, &plan, &[]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    let error = &status["error"];
    assert_eq!(error["kind"], "systemd", "{error:#}");
    assert_eq!(error["step"], "start broken.service", "{error:#}");
    let detail = error["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("job failed; unit is failed/failed (result exit-code)"),
        "{detail}"
    );
    assert!(
        detail.contains("broken.service is still not running"),
        "{detail}"
    );

    // Nothing half-done: no file, no unit file, no enablement link, unit not running or
    // failed, and systemd reloaded after the unit file was removed.
    assert!(!node.path("/etc/kubernetes/marker.conf").exists());
    assert!(!node.path("/etc/systemd/system/broken.service").exists());
    assert!(
        node.path("/etc/systemd/system/multi-user.target.wants/broken.service")
            .symlink_metadata()
            .is_err()
    );
    let state = systemd.unit_state("broken.service").unwrap();
    assert!(!state.is_active() && !state.is_failed(), "{state}");
    assert!(matches!(
        systemd.unit_file_state("broken.service"),
        Err(SystemdError::NoSuchUnit { .. })
    ));
    let records = journal(&node, run_of(&status));
    assert_eq!(
        count(&records, "daemonReloaded", |v| v["rollback"] == true),
        1
    );
    assert_eq!(
        jobs(&records, "broken.service", "stop", true).len(),
        1,
        "{records:#?}"
    );
}

/// Starts `apply` in the background (its pid is the agent's: nsenter execs it).
fn spawn_apply(node: &SandboxNode, plan: &Path, extra: &[&str]) -> Child {
    let mut args = vec!["apply", "--no-progress", "-o", "json"];
    args.extend_from_slice(extra);
    agent(node, &args)
        .arg(plan)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the agent")
}

fn finish(child: Child) -> (i32, Value, String) {
    let out = child.wait_with_output().expect("wait for the agent");
    let all = text(&out);
    let status = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), status, all)
}

fn reboot_target_active(systemd: &Systemd) -> bool {
    systemd
        .unit_state("reboot.target")
        .is_ok_and(|s| s.is_active())
}

#[test]
fn a_reboot_in_the_middle_resumes_after_it_and_runs_later_changes_once() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    node.defuse_reboot().expect("defuse reboot.target");
    let work = Work::new();
    let boot_id = work.boot_id_file("11111111-aaaa-4aaa-8aaa-111111111111");
    let boot_arg = boot_id.display().to_string();
    let plan = work.plan(
        "reboot.yaml",
        "default/md-0@reboot",
        &format!(
            "changes:
  - file: {{path: /etc/kubernetes/before.conf, content: before, restartUnits: [kubelet.service]}}
  - kubeletConfig: {{mergePatch: {{maxPods: 120}}}}
  - reboot: {{reason: kernel arguments changed}}
  - file: {{path: /etc/kubernetes/after.conf, content: after}}
  - kubeletFlags: {{set: {{node-labels: tier=after}}}}
{GATES}"
        ),
    );
    let report = check(&node, &plan);
    assert_eq!(report["disruption"], "Reboot", "{report:#}");
    assert_eq!(report["changes"][2]["result"], "wouldChange");

    let starts_before = starts(&node).len();
    let before = invocation(&systemd, KUBELET);
    let mut child = spawn_apply(&node, &plan, &["--boot-id-file", &boot_arg]);
    let asked = support::poll(|| reboot_target_active(&systemd).then_some(()));
    assert!(asked.is_some(), "the agent did not ask systemd to reboot");
    // It waits to be taken down, with the changes before the reboot applied, nothing
    // restarted, and nothing after the reboot done yet.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the agent should wait for the reboot"
    );
    assert!(node.path("/etc/kubernetes/before.conf").exists());
    assert!(!node.path("/etc/kubernetes/after.conf").exists());
    assert_eq!(invocation(&systemd, KUBELET), before);
    let records = journal(&node, 1);
    let requests: Vec<&Value> = records
        .iter()
        .filter(|(k, _)| k == "rebootRequested")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(requests.len(), 1, "{records:#?}");
    assert_eq!(
        requests[0]["bootId"],
        "11111111-aaaa-4aaa-8aaa-111111111111"
    );
    // The reboot kills the agent...
    child.kill().expect("kill the agent");
    let _ = child.wait();
    // ...and the node comes back with a new boot id.
    work.boot_id_file("22222222-bbbb-4bbb-8bbb-222222222222");
    let (code, status, out) = apply(&node, &plan, &["--boot-id-file", &boot_arg]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(status["phase"], "Succeeded", "{status:#}");
    assert_eq!(status["run"], 1);
    assert_eq!(status["rebooting"], false);
    assert_eq!(status["changes"][2]["state"], "Changed");
    assert!(
        status["changes"][2]["message"].as_str().unwrap().contains(
            "11111111-aaaa-4aaa-8aaa-111111111111 → 22222222-bbbb-4bbb-8bbb-222222222222"
        ),
        "{status:#}"
    );
    let records = journal(&node, 1);
    for index in [0, 1, 3, 4] {
        assert_eq!(
            count(&records, "stepStarted", |v| v["index"] == index),
            1,
            "changes[{index}] once: {records:#?}"
        );
        assert_eq!(count(&records, "stepDone", |v| v["index"] == index), 1);
    }
    assert_eq!(count(&records, "rebootRequested", |_| true), 1);
    assert_eq!(count(&records, "stepDone", |v| v["index"] == 2), 1);
    // One restart, for the kubelet flags changed after the reboot.
    assert_eq!(
        jobs(&records, KUBELET, "restart", false).len(),
        1,
        "{records:#?}"
    );
    assert_eq!(starts(&node).len(), starts_before + 1);
    assert!(node.path("/etc/kubernetes/after.conf").exists());
    assert!(
        node.read_file("/var/lib/kubelet/kubeadm-flags.env")
            .contains("tier=after")
    );
}

#[test]
fn a_reboot_that_does_not_happen_fails_the_step_and_rolls_back() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    node.defuse_reboot().expect("defuse reboot.target");
    let work = Work::new();
    let boot_id = work.boot_id_file("33333333-cccc-4ccc-8ccc-333333333333");
    let boot_arg = boot_id.display().to_string();
    let plan = work.plan(
        "reboot.yaml",
        "default/md-0@stuck-reboot",
        "options: {stepTimeoutSeconds: 3}
changes:
  - file: {path: /etc/kubernetes/before.conf, content: before}
  - reboot: {reason: kernel}
  - file: {path: /etc/kubernetes/after.conf, content: after}
",
    );
    let mut child = spawn_apply(&node, &plan, &["--boot-id-file", &boot_arg]);
    let asked = support::poll(|| reboot_target_active(&systemd).then_some(()));
    assert!(asked.is_some(), "the agent did not ask systemd to reboot");
    child.kill().expect("kill the agent");
    let _ = child.wait();
    // Started again in the same boot after the step timeout: the reboot did not happen.
    std::thread::sleep(Duration::from_secs(3));
    let (code, status, out) = apply(&node, &plan, &["--boot-id-file", &boot_arg]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    assert_eq!(status["error"]["kind"], "timeout");
    assert_eq!(status["error"]["step"], "changes[1] reboot kernel");
    assert!(
        status["error"]["detail"]
            .as_str()
            .unwrap()
            .starts_with("the node did not reboot: the boot id is still 33333333-"),
        "{status:#}"
    );
    assert!(!node.path("/etc/kubernetes/before.conf").exists());
    assert!(!node.path("/etc/kubernetes/after.conf").exists());
}

/// Kills the node's bus daemon (dbus.service's main process) from inside the node.
fn kill_bus(node: &SandboxNode, systemd: &Systemd) {
    let pid = systemd
        .unit_state("dbus.service")
        .expect("dbus state")
        .main_pid
        .expect("dbus runs");
    let out = node
        .command("kill")
        .args(["-KILL", &pid.to_string()])
        .output()
        .expect("kill dbus-daemon");
    assert!(out.status.success(), "{}", text(&out));
}

fn slow_kubelet(node: &SandboxNode, systemd: &Systemd) {
    node.write_file(
        "/etc/systemd/system/kubelet.service.d/50-slow.conf",
        "[Service]\nEnvironment=KUBELET_STANDIN_READY_DELAY_MS=3000\n",
        0o644,
    );
    systemd.daemon_reload().expect("daemon-reload");
}

fn restarting(systemd: &Systemd) -> Option<()> {
    let s = systemd.unit_state(KUBELET).ok()?;
    (s.active_state == ActiveState::Activating && s.sub_state != "auto-restart").then_some(())
}

#[test]
fn the_bus_dying_mid_restart_is_reported_and_the_restart_is_done_once() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    slow_kubelet(&node, &systemd);
    let work = Work::new();
    let plan = work.plan(
        "bus.yaml",
        "bus@1",
        &format!("changes:\n  - kubeletConfig: {{mergePatch: {{maxPods: 130}}}}\n{GATES}"),
    );
    let starts_before = starts(&node).len();
    let child = spawn_apply(&node, &plan, &[]);
    assert!(
        support::poll(|| restarting(&systemd)).is_some(),
        "the kubelet never started restarting"
    );
    kill_bus(&node, &systemd);
    let (code, status, out) = finish(child);
    assert_eq!(code, 0, "{out}");
    assert_eq!(status["phase"], "Succeeded", "{status:#}");
    let records = journal(&node, run_of(&status));
    let lost = count(&records, "systemdUnreachable", |v| {
        v["message"].as_str().is_some_and(|m| {
            m.contains("lost the connection to systemd") && m.contains("reconnecting in")
        })
    });
    assert!(lost >= 1, "the lost connection is journaled: {records:#?}");
    assert_eq!(
        count(&records, "unitJobStarted", |_| true),
        1,
        "{records:#?}"
    );
    let restarts = jobs(&records, KUBELET, "restart", false);
    assert_eq!(restarts.len(), 1, "{records:#?}");
    assert_eq!(restarts[0]["outcome"], "done");
    let log = starts(&node);
    assert_eq!(
        log.len(),
        starts_before + 1,
        "restarted exactly once: {log:#?}"
    );
    let systemd = node
        .wait_for_bus(Duration::from_secs(10))
        .expect("bus back");
    assert!(
        log.last()
            .unwrap()
            .starts_with(&format!("{} ok ", invocation(&systemd, KUBELET)))
    );
    assert!(log.last().unwrap().contains("maxPods 130"));
}

#[test]
fn a_bus_that_stays_down_never_lets_the_plan_succeed() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    slow_kubelet(&node, &systemd);
    let work = Work::new();
    let plan = work.plan(
        "bus.yaml",
        "bus@down",
        &format!(
            "options: {{stepTimeoutSeconds: 4}}\nchanges:\n  - kubeletConfig: {{mergePatch: {{maxPods: 130}}}}\n{GATES}"
        ),
    );
    let child = spawn_apply(&node, &plan, &[]);
    assert!(
        support::poll(|| restarting(&systemd)).is_some(),
        "the kubelet never started restarting"
    );
    // Stop the bus for good (systemctl talks to systemd's private socket, not the bus).
    let out = node
        .command("systemctl")
        .args(["stop", "dbus.socket", "dbus.service"])
        .output()
        .expect("systemctl stop dbus");
    assert!(out.status.success(), "{}", text(&out));
    let (code, status, out) = finish(child);
    assert_eq!(code, 1, "{out}");
    assert_ne!(status["phase"], "Succeeded", "{status:#}");
    assert_eq!(status["phase"], "Failed", "{status:#}");
    assert_eq!(status["error"]["kind"], "rollback_failed", "{status:#}");
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(detail.contains("systemd unreachable"), "{detail}");
    assert!(detail.contains("the node needs attention"), "{detail}");
    // The files were restored all the same.
    assert!(
        !node
            .read_file("/var/lib/kubelet/config.yaml")
            .contains("maxPods: 130")
    );
    let records = journal(&node, run_of(&status));
    assert!(
        count(&records, "systemdUnreachable", |_| true) >= 2,
        "{records:#?}"
    );
    assert_eq!(
        jobs(&records, KUBELET, "restart", false)[0]["outcome"],
        "failed",
        "{records:#?}"
    );
}

/// True when the agent binary was built with the crash-test failpoints (`tests/run` does).
fn has_failpoints() -> bool {
    let out = Command::new(BIN)
        .args(["version", "-o", "json"])
        .output()
        .expect("run version");
    let v: Value = serde_json::from_slice(&out.stdout).expect("version json");
    v["failpoints"] == true
}

#[test]
fn a_crash_around_a_restart_never_restarts_twice() {
    if !has_failpoints() {
        eprintln!("SKIP a_crash_around_a_restart_never_restarts_twice: built without failpoints");
        return;
    }
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    let work = Work::new();
    // Aborted after the restart was journaled but before it was queued, and after it was
    // done but before that was journaled: each resume ends with exactly one restart.
    for (n, point) in ["unit.before_job", "unit.after_job"].iter().enumerate() {
        let plan = work.plan(
            &format!("crash{n}.yaml"),
            &format!("crash@{n}"),
            &format!(
                "changes:\n  - kubeletConfig: {{mergePatch: {{maxPods: {}}}}}\n{GATES}",
                140 + n
            ),
        );
        let starts_before = starts(&node).len();
        let before = invocation(&systemd, KUBELET);
        let out = agent(&node, &["apply", "--no-progress"])
            .arg(&plan)
            .env("INPLACE_AGENT_CRASH_AT", point)
            .output()
            .expect("run the agent");
        assert!(
            out.status.code().is_none(),
            "aborted at {point}: {}",
            text(&out)
        );
        let (code, status, out) = apply(&node, &plan, &[]);
        assert_eq!(code, 0, "{point}: {out}");
        assert_eq!(status["phase"], "Succeeded", "{point}: {status:#}");
        let records = journal(&node, run_of(&status));
        assert_eq!(
            count(&records, "unitJobStarted", |_| true),
            1,
            "{point}: {records:#?}"
        );
        assert_eq!(
            jobs(&records, KUBELET, "restart", false).len(),
            1,
            "{point}"
        );
        let log = starts(&node);
        assert_eq!(
            log.len(),
            starts_before + 1,
            "{point}: restarted once: {log:#?}"
        );
        assert_ne!(invocation(&systemd, KUBELET), before);
        assert!(
            log.last()
                .unwrap()
                .contains(&format!("maxPods {}", 140 + n))
        );
    }
}

/// A unit the plan restarts or gates on must exist (`kublet.service` used to pass `check`
/// and end in `rollback_failed`): `check` names it, `apply` refuses the plan with exit 2 and
/// changes nothing; a unit the plan itself creates is fine.
#[test]
fn a_unit_that_does_not_exist_is_named_by_check_and_refused_by_apply() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let work = Work::new();
    let plan = work.plan(
        "typo.yaml",
        "typo@1",
        "changes:
  - file: {path: /etc/kubernetes/typo.conf, content: x, restartUnits: [kublet.service]}
  - unit: {name: made-here.service, content: \"[Service]\\nExecStart=/bin/true\\n\"}
verify:
  - unitActive: {name: made-here.service, timeoutSeconds: 5}
  - unitActive: {name: nosuch.service, timeoutSeconds: 5}
",
    );
    let report = check(&node, &plan);
    assert_eq!(report["applicable"], false, "{report:#}");
    assert_eq!(report["changes"][0]["result"], "invalid", "{report:#}");
    let detail = report["changes"][0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("changes[0].file.restartUnits: kublet.service does not exist on this node"),
        "{detail}"
    );
    assert_ne!(report["changes"][1]["result"], "invalid", "{report:#}");
    let errors = report["errors"].to_string();
    assert!(
        errors.contains("verify[1].unitActive.name") && errors.contains("nosuch.service"),
        "{errors}"
    );
    assert!(!errors.contains("made-here"), "{errors}");
    let (code, _, out) = apply(&node, &plan, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("kublet.service does not exist"), "{out}");
    assert!(!node.root().join("etc/kubernetes/typo.conf").exists());
}
