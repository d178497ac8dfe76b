//! `inplace-agent demo --systemd`: the tour against a real systemd. It boots this machine's
//! systemd as PID 1 of fresh namespaces on a copy-on-write overlay of `/` (the test sandbox,
//! [`crate::sandbox`]), runs a kubelet STAND-IN in it as `kubelet.service`, and drives this
//! very binary against it — `inplace-agent apply --root /proc/<pid>/root --bus <its bus>`, in
//! the node's network namespace — to show a computed kubelet restart, a re-apply that
//! restarts nothing, and a bad configuration rolled back and restarted on the old one.
//!
//! Then the main use case, the Kubernetes version bump, on a second sandboxed node: it builds
//! stand-in `kubeadm`/`kubelet`/`kubectl` .debs at 1.30.4-1.1 and 1.31.2-1.1 in the node
//! (`dpkg-deb`, indexed with `dpkg-scanpackages` or `apt-ftparchive`, served as the node's only
//! apt source, [`crate::sandbox::packages`]), installs 1.30 with the packaged
//! `kubelet.service` running, and applies `examples/plans/upgrade-1.30-to-1.31.yaml` as it is:
//! kubeadm, `kubeadm upgrade node`, kubelet and kubectl, one daemon-reload, one kubelet
//! restart at the new version, the gates; then the same state again, which changes nothing.
//! Without those tools it says which are missing and skips that part.
//!
//! The stand-in is this binary too: there is no separate stand-in program to hand outside
//! `cargo test`, so the agent's binary is copied into the node and `/usr/local/bin/kubelet`
//! (in the packages, `/usr/bin/kubelet`) is a script that runs its hidden `kubelet-standin`
//! subcommand ([`crate::sandbox::standin`]).
//!
//! Needs root (namespaces, mounts, cgroups). Without it, or without systemd and dbus, it
//! says why and stops (exit 0, or 1 with `CI=true`). Nothing outside the overlay changes;
//! the node is killed at the end and the kernel drops its mounts.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, anyhow};

use super::Exit;
use crate::host::packages::ManagerKind;
use crate::host::systemd::Systemd;
use crate::sandbox::packages::{self, KUBE_PACKAGES, KUBEADM_LOG};
use crate::sandbox::{BootError, START_LOG as STARTS, SandboxNode, Standin};

/// The version bump, as in the repository.
const UPGRADE: &str = include_str!("../../../../examples/plans/upgrade-1.30-to-1.31.yaml");

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
    outln!("\n== {n}. {text}");
}

/// Runs `demo --systemd`.
pub fn run(plain: bool) -> Exit {
    outln!("inplace-agent demo --systemd: the agent against a real systemd");
    let node = match SandboxNode::try_boot() {
        Ok(node) => node,
        Err(BootError::Unavailable(why)) => {
            outln!("skipped: a real-systemd sandbox cannot run here: {why}");
            let ci = std::env::var("CI").is_ok_and(|v| v == "true");
            return if ci { Exit::Failed } else { Exit::Ok };
        }
        Err(BootError::Failed(why)) => {
            errln!("error: demo --systemd: boot the sandboxed node: {why}");
            return Exit::Failed;
        }
    };
    let first = match tour(&node, plain) {
        Ok(ok) => ok,
        Err(e) => return super::fail(&e.context("demo --systemd")),
    };
    drop(node);
    let bump = match version_bump(plain) {
        Ok(ok) => ok,
        Err(e) => return super::fail(&e.context("demo --systemd: the version bump")),
    };
    let ok = first && bump;
    outln!(
        "\nThe sandboxed nodes are gone; the kernel dropped their overlays. {}",
        if ok {
            "Everything went as described."
        } else {
            "SOMETHING DID NOT GO AS DESCRIBED (see above)."
        }
    );
    if ok { Exit::Ok } else { Exit::Failed }
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

fn show(cmd: &mut Command, what: &str) -> anyhow::Result<i32> {
    let args: Vec<String> = cmd
        .get_args()
        .skip(3)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    outln!("$ inplace-agent {}", args.join(" "));
    let status = cmd.status().with_context(|| format!("run {what}"))?;
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

/// The first node: computed restarts, an idempotent re-apply, a rollback. True when all went
/// as described.
fn tour(node: &SandboxNode, plain: bool) -> anyhow::Result<bool> {
    let exe = std::env::current_exe().context("find this binary")?;
    heading(1, "a sandboxed node");
    outln!(
        "  this machine's systemd booted as PID 1 of new namespaces on an overlay of / in {} ms",
        node.boot_time().as_millis()
    );
    outln!(
        "  (host PID {}; its root is {}, its bus {}).",
        node.pid(),
        node.root().display(),
        node.bus_address()
    );
    outln!("  Nothing outside the overlay changes; the node is killed at the end.");
    let systemd = node
        .install_kubelet(Standin::Agent(&exe))
        .map_err(anyhow::Error::msg)?;
    let (id, state) = kubelet_line(&systemd);
    outln!(
        "  kubelet.service runs a DEMO STAND-IN (this binary's hidden kubelet-standin mode: \
         /healthz on 127.0.0.1:10248, refuses bad configs): {state}"
    );
    outln!("  InvocationID {id}");

    let plans = tempfile::Builder::new()
        .prefix("inplace-agent-demo-plans-")
        .tempdir()
        .context("create a directory for the plans")?;
    let tuning = plans.path().join("kubelet-tuning.yaml");
    let again = plans.path().join("kubelet-tuning-again.yaml");
    let bad = plans.path().join("bad-kubelet-config.yaml");
    let write = |p: &Path, text: &str| {
        std::fs::write(p, text).with_context(|| format!("write {}", p.display()))
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
    outln!(
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
    outln!(
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
        .context("read the node's kubelet config")?;
    let before = starts(node).len();
    let third = show(
        &mut agent(node, &exe, &["apply", &bad.display().to_string()], plain),
        "apply",
    )?;
    std::thread::sleep(Duration::from_millis(200));
    let (id_back, state) = kubelet_line(&systemd);
    let config_after = std::fs::read(node.path("/var/lib/kubelet/config.yaml"))
        .context("read the node's kubelet config")?;
    outln!("  the stand-in's starts since: ");
    for line in &starts(node)[before..] {
        outln!("    {line}");
    }
    outln!("  kubelet.service now: {state} (InvocationID {id_back})");
    outln!(
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

    Ok(restarted_once
        && second == 0
        && id_again == id_after
        && third == 1
        && config_before == config_after
        && active)
}

/// `kubeadm 1.30.4-1.1 held, kubelet ...` from the node's dpkg database.
fn package_line(node: &SandboxNode) -> String {
    KUBE_PACKAGES
        .iter()
        .map(
            |name| match packages::installed(&node.path("/"), ManagerKind::Apt, name) {
                Some((v, held)) => format!("{name} {v}{}", if held { " (held)" } else { "" }),
                None => format!("{name} not installed"),
            },
        )
        .collect::<Vec<_>>()
        .join(", ")
}

/// The second node: the Kubernetes version bump from packages. True when all went as
/// described (or it was skipped because the tools to build the packages are missing,
/// outside CI).
fn version_bump(plain: bool) -> anyhow::Result<bool> {
    let exe = std::env::current_exe().context("find this binary")?;
    heading(
        7,
        "the Kubernetes version bump, 1.30 → 1.31, on a second node installed from packages",
    );
    if let Some(why) = packages::missing_tools(Path::new("/"), ManagerKind::Apt) {
        outln!(
            "  skipped: the demo builds its stand-in packages with this machine's Debian \
             tools, and they are not all here: {why}."
        );
        return Ok(!std::env::var("CI").is_ok_and(|v| v == "true"));
    }
    let node = SandboxNode::try_boot().map_err(|e| anyhow!("boot a second node: {e}"))?;
    let (old, new) = packages::versions(ManagerKind::Apt);
    outln!(
        "  A fresh node (booted in {} ms). In it: stand-in kubeadm, kubelet and kubectl .debs at \
         {old} and {new}, built with dpkg-deb, indexed and served as file:{} (its only apt \
         source; no network). They are laid out like pkgs.k8s.io's (the kubelet package ships \
         kubelet.service, the kubeadm package its 10-kubeadm.conf drop-in); their kubelet is a \
         DEMO STAND-IN (this binary), not a kubelet.",
        node.boot_time().as_millis(),
        packages::APT_REPO
    );
    let systemd = node
        .install_kube_packages(ManagerKind::Apt, Standin::Agent(&exe))
        .map_err(anyhow::Error::msg)?;
    outln!(
        "  1.30 installed with apt-get and held, as a kubeadm node has it: {}",
        package_line(&node)
    );
    let (id_before, state) = kubelet_line(&systemd);
    outln!("  kubelet.service (from the package): {state}");
    outln!("  InvocationID {id_before}");

    let plans = tempfile::Builder::new()
        .prefix("inplace-agent-demo-plans-")
        .tempdir()
        .context("create a directory for the plans")?;
    let upgrade = plans.path().join("upgrade-1.30-to-1.31.yaml");
    let again = plans.path().join("upgrade-1.30-to-1.31-again.yaml");
    std::fs::write(&upgrade, UPGRADE).with_context(|| format!("write {}", upgrade.display()))?;
    std::fs::write(&again, UPGRADE.replace("@v1.31.2\n", "@v1.31.2-again\n"))
        .with_context(|| format!("write {}", again.display()))?;
    let upgrade_s = upgrade.display().to_string();

    heading(
        8,
        "check examples/plans/upgrade-1.30-to-1.31.yaml: four changes, a daemon-reload, one restart",
    );
    show(
        &mut agent(&node, &exe, &["check", &upgrade_s], plain),
        "check",
    )?;

    heading(
        9,
        "apply it: kubeadm, kubeadm upgrade node, kubelet, kubectl; reload; restart; the gates",
    );
    let before = starts(&node).len();
    let first = show(
        &mut agent(&node, &exe, &["apply", &upgrade_s], plain),
        "apply",
    )?;
    let (id_after, state) = kubelet_line(&systemd);
    let log = starts(&node);
    outln!("  packages now: {}", package_line(&node));
    let kubeadm_log = std::fs::read_to_string(node.path(KUBEADM_LOG)).unwrap_or_default();
    outln!(
        "  the stand-in kubeadm logged: {}",
        kubeadm_log.trim_end().replace('\n', "; ")
    );
    outln!(
        "  kubelet.service: InvocationID {id_before} → {id_after}; {} new start(s) of the \
         stand-in:",
        log.len() - before
    );
    for line in &log[before..] {
        outln!("    {line}");
    }
    outln!("  {state}");
    let upgraded = KUBE_PACKAGES.iter().all(|name| {
        packages::installed(&node.path("/"), ManagerKind::Apt, name)
            == Some((new.to_string(), true))
    });
    let restarted_once = first == 0
        && id_after != id_before
        && log.len() == before + 1
        && log[before].contains(" ok kubelet-standin v1.31.2:");

    heading(
        10,
        "the same desired state under a new plan id: every change unchanged, no restart",
    );
    let second = show(
        &mut agent(&node, &exe, &["apply", &again.display().to_string()], plain),
        "apply",
    )?;
    let (id_again, _) = kubelet_line(&systemd);
    outln!(
        "  kubelet.service InvocationID {id_again}: {}",
        if id_again == id_after {
            "unchanged, not restarted"
        } else {
            "CHANGED (this is a bug)"
        }
    );

    heading(
        11,
        "the journal of the bump: each package step, the reload and the restart, in order",
    );
    show(&mut agent(&node, &exe, &["journal"], plain), "journal")?;
    Ok(upgraded && restarted_once && second == 0 && id_again == id_after)
}
