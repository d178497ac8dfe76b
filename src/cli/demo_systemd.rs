//! `inplace-agent demo --systemd`: the tour against a real systemd. It boots this machine's
//! systemd as PID 1 of fresh namespaces on a copy-on-write overlay of `/` (the test sandbox,
//! [`crate::sandbox`]), runs a kubelet STAND-IN in it as `kubelet.service`, and drives this
//! very binary against it — `inplace-agent apply --root /proc/<pid>/root --bus <its bus>`, in
//! the node's network namespace — to show a computed kubelet restart, a re-apply that
//! restarts nothing, and a bad configuration rolled back and restarted on the old one.
//!
//! The stand-in is this binary too: there is no separate stand-in program to hand outside
//! `cargo test`, so the agent's binary is copied into the node and `/usr/local/bin/kubelet` is
//! a script that runs its hidden `kubelet-standin` subcommand ([`crate::sandbox::standin`]).
//!
//! Needs root (namespaces, mounts, cgroups). Without it, or without systemd and dbus, it
//! says why and stops (exit 0, or 1 with `CI=true`). Nothing outside the overlay changes;
//! the node is killed at the end and the kernel drops its mounts.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{EXIT_FAILED, EXIT_OK};
use crate::host::systemd::Systemd;
use crate::sandbox::{BootError, SandboxNode, Standin};

const STARTS: &str = "/var/log/kubelet-standin.starts";

const TUNING: &str =
    "# The kubelet tuning of examples/plans/kubelet-tuning.yaml, with every gate kind.
apiVersion: inplace.agent/v1
kind: Plan
id: default/md-0-7d9f4-abcde@kubelet-tuning
changes:
  - kubeletConfig:
      mergePatch: {maxPods: 150, serializeImagePulls: false}
  - kubeletFlags:
      set: {node-labels: tier=web}
      remove: [pod-infra-container-image]
  - file:
      path: /etc/kubernetes/audit/policy.yaml
      mode: \"0640\"
      restartUnits: [kubelet.service]
      content: |
        apiVersion: audit.k8s.io/v1
        kind: Policy
        rules:
          - level: Metadata
verify:
  - unitActive: {name: kubelet.service, timeoutSeconds: 20}
  - httpGet: {url: \"http://127.0.0.1:10248/healthz\", expectStatus: 200, timeoutSeconds: 20}
  - kubeletVersion: {version: v1.30.4}
";

const BAD: &str = "# A kubelet configuration the kubelet refuses: the gate fails, everything is restored.
apiVersion: inplace.agent/v1
kind: Plan
id: default/md-0-7d9f4-abcde@bad-max-pods
changes:
  - kubeletConfig:
      mergePatch: {maxPods: 0}
verify:
  - httpGet: {url: \"http://127.0.0.1:10248/healthz\", expectStatus: 200, timeoutSeconds: 4, periodSeconds: 1}
";

fn heading(n: u32, text: &str) {
    println!("\n== {n}. {text}");
}

/// Runs `demo --systemd`.
pub fn run(plain: bool) -> u8 {
    println!("inplace-agent demo --systemd: the agent against a real systemd");
    let node = match SandboxNode::try_boot() {
        Ok(node) => node,
        Err(BootError::Unavailable(why)) => {
            println!("skipped: a real-systemd sandbox cannot run here: {why}");
            let ci = std::env::var("CI").is_ok_and(|v| v == "true");
            return if ci { EXIT_FAILED } else { EXIT_OK };
        }
        Err(BootError::Failed(why)) => {
            eprintln!("error: demo --systemd: boot the sandboxed node: {why}");
            return EXIT_FAILED;
        }
    };
    match tour(&node, plain) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: demo --systemd: {e}");
            EXIT_FAILED
        }
    }
}

/// This binary, run in the node's network namespace against its root and bus.
fn agent(node: &SandboxNode, exe: &Path, args: &[&str], plain: bool) -> Command {
    let mut cmd = node.command_in_netns(exe);
    cmd.args(args)
        .arg("--root")
        .arg(node.root())
        .arg("--bus")
        .arg(node.bus_address())
        .env_remove("INPLACE_AGENT_SERVICES")
        .env_remove("INPLACE_AGENT_STATE_DIR");
    if plain && args.first() == Some(&"apply") {
        cmd.arg("--no-progress");
    }
    cmd
}

fn show(cmd: &mut Command, what: &str) -> Result<i32, String> {
    let args: Vec<String> = cmd
        .get_args()
        .skip(3)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    println!("$ inplace-agent {}", args.join(" "));
    let status = cmd.status().map_err(|e| format!("run {what}: {e}"))?;
    Ok(status.code().unwrap_or(-1))
}

fn kubelet_line(systemd: &Systemd) -> (String, String) {
    match systemd.unit_state("kubelet.service") {
        Ok(s) => (
            s.invocation_id.map(|i| i.to_string()).unwrap_or_default(),
            s.to_string(),
        ),
        Err(e) => (String::new(), e.to_string()),
    }
}

fn starts(node: &SandboxNode) -> Vec<String> {
    std::fs::read_to_string(node.path(STARTS))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn tour(node: &SandboxNode, plain: bool) -> Result<u8, String> {
    let exe = std::env::current_exe().map_err(|e| format!("find this binary: {e}"))?;
    heading(1, "a sandboxed node");
    println!(
        "  this machine's systemd booted as PID 1 of new namespaces on an overlay of / in {} ms",
        node.boot_time().as_millis()
    );
    println!(
        "  (host PID {}; its root is {}, its bus {}).",
        node.pid(),
        node.root().display(),
        node.bus_address()
    );
    println!("  Nothing outside the overlay changes; the node is killed at the end.");
    let systemd = node.install_kubelet(Standin::Agent(&exe))?;
    let (id, state) = kubelet_line(&systemd);
    println!(
        "  kubelet.service runs a DEMO STAND-IN (this binary's hidden kubelet-standin mode: \
         /healthz on 127.0.0.1:10248, refuses bad configs): {state}"
    );
    println!("  InvocationID {id}");

    let plans = tempfile::Builder::new()
        .prefix("inplace-agent-demo-plans-")
        .tempdir()
        .map_err(|e| format!("create a directory for the plans: {e}"))?;
    let tuning = plans.path().join("kubelet-tuning.yaml");
    let again = plans.path().join("kubelet-tuning-again.yaml");
    let bad = plans.path().join("bad-kubelet-config.yaml");
    let write = |p: &Path, text: &str| {
        std::fs::write(p, text).map_err(|e| format!("write {}: {e}", p.display()))
    };
    write(&tuning, TUNING)?;
    write(
        &again,
        &TUNING.replace("@kubelet-tuning", "@kubelet-tuning-2"),
    )?;
    write(&bad, BAD)?;
    let tuning_s = tuning.display().to_string();

    heading(
        2,
        "check: what would the kubelet tuning change, and how disruptive is it?",
    );
    show(
        &mut agent(node, &exe, &["check", &tuning_s], plain),
        "check",
    )?;

    heading(
        3,
        "apply it: one kubelet restart, computed from what changed, then the gates",
    );
    let before = starts(node).len();
    let first = show(
        &mut agent(node, &exe, &["apply", &tuning_s], plain),
        "apply",
    )?;
    let (id_after, state) = kubelet_line(&systemd);
    let log = starts(node);
    println!(
        "  kubelet.service: InvocationID {id} → {id_after}; {} new start(s) of the stand-in; {state}",
        log.len() - before
    );
    let restarted_once = first == 0 && id_after != id && log.len() == before + 1;

    heading(
        4,
        "the same desired state under a new plan id: nothing changes, nothing restarts",
    );
    let second = show(
        &mut agent(node, &exe, &["apply", &again.display().to_string()], plain),
        "apply",
    )?;
    let (id_again, _) = kubelet_line(&systemd);
    println!(
        "  kubelet.service InvocationID {}: {}",
        id_again,
        if id_again == id_after {
            "unchanged, not restarted"
        } else {
            "CHANGED (this is a bug)"
        }
    );

    heading(
        5,
        "a bad kubelet configuration: the restart fails, the gate fails, all is restored",
    );
    let config_before = std::fs::read(node.path("/var/lib/kubelet/config.yaml"))
        .map_err(|e| format!("read the node's kubelet config: {e}"))?;
    let before = starts(node).len();
    let third = show(
        &mut agent(node, &exe, &["apply", &bad.display().to_string()], plain),
        "apply",
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let (id_back, state) = kubelet_line(&systemd);
    let config_after = std::fs::read(node.path("/var/lib/kubelet/config.yaml"))
        .map_err(|e| format!("read the node's kubelet config: {e}"))?;
    println!("  the stand-in's starts since: ");
    for line in &starts(node)[before..] {
        println!("    {line}");
    }
    println!("  kubelet.service now: {state} (InvocationID {id_back})");
    println!(
        "  /var/lib/kubelet/config.yaml: {}",
        if config_before == config_after {
            "byte for byte what it was before"
        } else {
            "DIFFERENT (this is a bug)"
        }
    );
    let active = systemd
        .unit_state("kubelet.service")
        .is_ok_and(|s| s.is_active());

    heading(
        6,
        "the journal: every step, unit job and reload, written before it happened",
    );
    show(
        &mut agent(node, &exe, &["journal", "--tail", "40"], plain),
        "journal",
    )?;

    let ok = restarted_once
        && second == 0
        && id_again == id_after
        && third == 1
        && config_before == config_after
        && active;
    println!(
        "\nThe sandboxed node is killed now; the kernel drops its overlay. {}",
        if ok {
            "Everything went as described."
        } else {
            "SOMETHING DID NOT GO AS DESCRIBED (see above)."
        }
    );
    Ok(if ok { EXIT_OK } else { EXIT_FAILED })
}
