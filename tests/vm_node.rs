//! Crash safety on a real kernel (docs/testing-vm.md): the agent on a disposable Debian VM
//! node under the guest's own systemd, installed as its package installs it.
//!
//! - `power_cuts_converge`: SIGKILL of qemu at random moments of a 301-change plan. The disk
//!   is the NBD stand-in (tests/vm/nbd.rs), a disk with a volatile write cache: after a cut it
//!   holds exactly what the guest flushed, nothing it did not. qemu's own cache modes cannot
//!   give that: with `cache=none` (O_DIRECT) or `writeback` every write the guest submitted is
//!   in the host's kernel when qemu dies, flushed or not, so only the guest's page cache would
//!   be lost and a missing flush of the disk's cache would never show.
//! - `power_cuts_converge_with_replaced_files_linked`: the same, with the unit's mounts left
//!   as one (as the DaemonSet sees the node), so that the files the plans replace are kept
//!   as their own backups, hard-linked into the backup store, instead of copied.
//! - `real_reboot_resumes_after_boot`: a plan with a `reboot` change; the node really reboots
//!   (the boot id changes), the agent resumes at the change after the reboot and the plan
//!   succeeds; while the node goes down the hook response says it is rebooting and asks CAPI
//!   to come back in 60 s.
//!
//! Root only (debootstrap builds the image); CI runs them. Outside CI without root or without
//! qemu they skip, saying why.

#[path = "vm/mod.rs"]
mod vm;

use std::time::{Duration, Instant};

use serde_json::Value;

use vm::powercut::{self, CutOutcome, Route};
use vm::{BOOT_TIMEOUT, sh_ok};

fn env(test: &str) -> Option<&'static vm::VmEnv> {
    vm::require(
        test,
        env!("INPLACE_AGENT_EXE"),
        env!("CARGO_BIN_EXE_kubelet-standin"),
    )
}

fn show(report: &powercut::Report) {
    let Some(c) = report.cuts.last() else {
        return;
    };
    eprintln!("power cut: {}", c.summary());
}

#[test]
fn power_cuts_converge() {
    power_cuts(Route::PackagedUnit, "power_cuts_converge");
}

/// The same cuts with the replaced files kept as their own backups (linked into the backup
/// store), as the agent does where the root file system is one mount (the DaemonSet).
#[test]
fn power_cuts_converge_with_replaced_files_linked() {
    power_cuts(
        Route::OneMount,
        "power_cuts_converge_with_replaced_files_linked",
    );
}

fn power_cuts(route: Route, test: &str) {
    let Some(env) = env(test) else {
        return;
    };
    let cuts = std::env::var("INPLACE_VM_CUTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let began = Instant::now();
    let report = powercut::run(env, cuts, route, show).expect("power-cut run");
    eprintln!(
        "power cuts ({route:?}): {}/{} converged on {}; seed {}; boots {:?} ms; {:.0} s in all",
        report.survived(),
        cuts,
        env.accel.describe(),
        report.seed,
        report.boot_ms,
        began.elapsed().as_secs_f64()
    );
    let failed: Vec<&CutOutcome> = report.cuts.iter().filter(|c| c.failure.is_some()).collect();
    assert!(
        failed.is_empty() && report.cuts.len() == cuts,
        "power cuts that did not converge (seed {}): {failed:#?}",
        report.seed
    );
}

const REBOOT_PLAN: &str = "\
apiVersion: inplace.agent/v1
kind: Plan
id: reboot-1
nodeName: vmnode
changes:
  - file: {path: /etc/kubernetes/before-reboot.conf, content: \"written before the reboot\\n\"}
  - reboot: {reason: \"VM test: a real reboot\"}
  - file: {path: /etc/kubernetes/after-reboot.conf, content: \"written after the reboot\\n\"}
  - kubeletConfig: {mergePatch: {maxPods: 150}}
verify:
  - unitActive: {name: kubelet.service, timeoutSeconds: 120}
";

fn boot_id(qga: &mut vm::qga::Qga) -> String {
    sh_ok(
        qga,
        "cat /proc/sys/kernel/random/boot_id",
        Duration::from_secs(30),
    )
    .expect("boot id")
    .trim()
    .to_string()
}

#[test]
fn real_reboot_resumes_after_boot() {
    let Some(env) = env("real_reboot_resumes_after_boot") else {
        return;
    };
    let began = Instant::now();
    let mut node = env.node("reboot").expect("node");
    let plan = node.put_plan("reboot.yaml", REBOOT_PLAN).expect("plan");
    let mut vm = node.boot().expect("boot");
    let mut qga = vm.qga(BOOT_TIMEOUT).expect("guest agent");
    powercut::wait_agent(&mut qga).expect("agent up");
    let first_boot = boot_id(&mut qga);
    qga.spawn(&[
        "/bin/sh",
        "-c",
        &format!(
            "INPLACE_AGENT_CA=/root/pki/ca.crt INPLACE_AGENT_CERT=/root/pki/updater.crt \
             INPLACE_AGENT_KEY=/root/pki/updater.key \
             exec inplace-agent submit --addr 127.0.0.1:9443 --no-progress {plan}"
        ),
    ])
    .expect("submit");

    // While the node goes down (slow-shutdown.service holds it for 15 s with the agent and
    // the guest agent still running), the hook response must say it is rebooting.
    let mut rebooting = None;
    let mut seen = Vec::new();
    let poll_began = Instant::now();
    while poll_began.elapsed() < Duration::from_secs(300) {
        match qga.sh(
            "inplace-agent status reboot-1 -o hook-response; cat /proc/sys/kernel/random/boot_id",
            Duration::from_secs(10),
        ) {
            Ok(out) => {
                let mut lines = out.stdout.lines();
                let hook = lines.next().unwrap_or_default().to_string();
                let id = lines.next().unwrap_or_default().to_string();
                if id != first_boot && !id.is_empty() {
                    break;
                }
                if let Ok(v) = serde_json::from_str::<Value>(&hook)
                    && v["retryAfterSeconds"] == 60
                {
                    rebooting.get_or_insert(v);
                }
                if seen.last() != Some(&hook) {
                    seen.push(hook);
                }
            }
            // The guest agent is gone: the node is down or booting.
            Err(_) => {
                if rebooting.is_some() {
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let rebooting = rebooting.unwrap_or_else(|| {
        panic!("the hook response never said rebooting (retryAfterSeconds 60); it said: {seen:#?}")
    });
    eprintln!("reboot: while going down the hook response was {rebooting}");
    assert_eq!(rebooting["status"], "Success", "{rebooting}");
    assert!(
        rebooting["message"]
            .as_str()
            .is_some_and(|m| m.contains("reboot")),
        "{rebooting}"
    );

    // Back up: a new boot id; the agent resumed on its own; the updater asks again. (qemu's
    // end of the port takes one client at a time.)
    drop(qga);
    let mut qga = vm.qga(BOOT_TIMEOUT).expect("guest agent after the reboot");
    powercut::wait_agent(&mut qga).expect("agent up after the reboot");
    let second_boot = boot_id(&mut qga);
    assert_ne!(first_boot, second_boot, "the node did not reboot");
    let status = powercut::submit_wait(&mut qga, &plan, powercut::FIRST_RUN_BUDGET)
        .expect("plan succeeds after the reboot");
    assert_eq!(status["hookResponse"]["retryAfterSeconds"], 0, "{status}");
    let boots = sh_ok(&mut qga, "cat /var/lib/vm-boots", Duration::from_secs(30)).expect("boots");
    let boots: Vec<&str> = boots.lines().collect();
    assert_eq!(
        boots,
        [first_boot.as_str(), second_boot.as_str()],
        "exactly one reboot, the one the plan asked for"
    );
    let files = sh_ok(
        &mut qga,
        "cat /etc/kubernetes/before-reboot.conf /etc/kubernetes/after-reboot.conf; \
         grep '^maxPods:' /var/lib/kubelet/config.yaml; systemctl is-active kubelet.service",
        Duration::from_secs(30),
    )
    .expect("node files");
    assert_eq!(
        files,
        "written before the reboot\nwritten after the reboot\nmaxPods: 150\nactive\n"
    );

    // The journal: the reboot requested from the first boot, the change before it started
    // once (before the reboot), the changes after it started only after it.
    let journal = sh_ok(
        &mut qga,
        "inplace-agent journal -o json",
        Duration::from_secs(60),
    )
    .expect("journal");
    let records: Vec<Value> = match serde_json::from_str::<Value>(&journal) {
        Ok(Value::Array(a)) => a,
        Ok(v) => v["records"].as_array().cloned().unwrap_or_default(),
        Err(_) => journal
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
    };
    let pos = |kind: &str, index: u64| -> Vec<usize> {
        records
            .iter()
            .enumerate()
            .filter(|(_, r)| r["type"] == kind && r["record"][kind]["index"] == index)
            .map(|(i, _)| i)
            .collect()
    };
    let reboot = pos("rebootRequested", 1);
    assert_eq!(reboot.len(), 1, "one reboot request: {journal}");
    assert_eq!(
        records[reboot[0]]["record"]["rebootRequested"]["bootId"]
            .as_str()
            .map(|s| s.replace('-', "")),
        Some(first_boot.replace('-', "")),
        "the request names the first boot"
    );
    let before = pos("stepStarted", 0);
    assert!(
        before.len() == 1 && before[0] < reboot[0],
        "change 0 started once, before the reboot: {before:?}"
    );
    for index in [2, 3] {
        let started = pos("stepStarted", index);
        assert!(
            started.len() == 1 && started[0] > reboot[0],
            "change {index} started once, after the reboot: {started:?}"
        );
    }
    let verify = qga
        .sh("inplace-agent journal --verify", Duration::from_secs(60))
        .expect("verify");
    assert_eq!(verify.code, 0, "{}{}", verify.stdout, verify.stderr);
    eprintln!(
        "reboot: {} -> {}, plan succeeded; {:.0} s on {}",
        first_boot,
        second_boot,
        began.elapsed().as_secs_f64(),
        env.accel.describe()
    );
}
