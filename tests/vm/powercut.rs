//! Power cuts on the VM node: a plan of 300 file changes and a kubelet configuration change
//! is submitted to the agent (the packaged unit under the guest's systemd), qemu is SIGKILLed
//! at a random moment, the node boots again and the agent resumes on its own; the harness
//! then submits the same plan again (as the updater would: CAPI calls the hook again) and
//! waits for it to end. After each cut the node must be exactly as after an uninterrupted run
//! (content, mode and owner of every managed path), `journal --verify` must pass and no temp
//! file may be left.
//!
//! Two plans alternate: A writes the 300 files (100 of them exist with other content) and sets
//! `maxPods: 150`; B puts the 100 back, removes the 200 and sets `maxPods: 110`. So each
//! recovered boot is the starting point of the next cut, and a run of N cuts costs N + 1
//! boots. The reference end states of A and B come from one uninterrupted run of each on the
//! fresh node, before the first cut.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::qga::Qga;
use super::{BOOT_TIMEOUT, Node, VmEnv, sh_ok};

/// The managed paths whose end state is compared.
const MANAGED: &str = "/etc/kubernetes /var/lib/kubelet";

/// The CLI client inside the guest, as the updater would call it (over mTLS to the agent).
const CLIENT: &str = "INPLACE_AGENT_ADDR=127.0.0.1:9443 INPLACE_AGENT_CA=/root/pki/ca.crt \
                      INPLACE_AGENT_CERT=/root/pki/updater.crt INPLACE_AGENT_KEY=/root/pki/updater.key";

/// One plan's text, `a` or `b`, with the given id.
pub fn plan(which: char, id: &str) -> String {
    let mut p =
        format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nnodeName: vmnode\nchanges:\n");
    for i in 0..300 {
        let path = format!("/etc/kubernetes/powercut/f{i:03}.conf");
        match (which, i < 100) {
            ('a', _) => {
                // Sizes from 40 bytes to 8 KiB (every 7th), so the plan's contents pass the
                // 64 KiB above which the journal keeps them as one blob.
                let body = if i % 7 == 0 {
                    format!("large file {i:03} ").repeat(512)
                } else {
                    format!("new content of file {i:03}, plan A")
                };
                let mode = ["0644", "0600", "0640"][i % 3];
                let owner = if i % 5 == 0 {
                    "nobody:nogroup"
                } else {
                    "root:root"
                };
                p.push_str(&format!(
                    "  - file: {{path: {path}, content: \"{body}\", mode: \"{mode}\", owner: \"{owner}\"}}\n"
                ));
            }
            ('b', true) => p.push_str(&format!(
                "  - file: {{path: {path}, content: \"original content of file {i:03}\\n\", mode: \"0644\"}}\n"
            )),
            _ => p.push_str(&format!("  - absent: {{path: {path}}}\n")),
        }
    }
    let max_pods = if which == 'a' { 150 } else { 110 };
    p.push_str(&format!(
        "  - kubeletConfig: {{mergePatch: {{maxPods: {max_pods}}}}}\n\
         verify:\n\
         \x20 - unitActive: {{name: kubelet.service, timeoutSeconds: 120}}\n\
         \x20 - httpGet: {{url: \"http://127.0.0.1:10248/healthz\", expectStatus: 200, timeoutSeconds: 120, periodSeconds: 1}}\n"
    ));
    p
}

/// Kind, mode and owner of every managed path, then the content hash of every file, sorted.
pub fn snapshot(qga: &mut Qga) -> Result<String> {
    sh_ok(
        qga,
        &format!(
            "find {MANAGED} -printf '%y %#m %u:%g %p\\n' | sort; \
             find {MANAGED} -type f -exec sha256sum {{}} + | sort -k2"
        ),
        Duration::from_secs(300),
    )
}

/// Lines of `a` not in `b` and of `b` not in `a`, for a failure message.
pub fn diff(want: &str, got: &str) -> String {
    let w: std::collections::BTreeSet<&str> = want.lines().collect();
    let g: std::collections::BTreeSet<&str> = got.lines().collect();
    let mut out = String::new();
    for l in w.difference(&g).take(20) {
        out.push_str(&format!("  want: {l}\n"));
    }
    for l in g.difference(&w).take(20) {
        out.push_str(&format!("  got:  {l}\n"));
    }
    out
}

/// Waits until the agent serves (the unit is active: `READY=1` was sent).
pub fn wait_agent(qga: &mut Qga) -> Result<()> {
    let began = Instant::now();
    loop {
        let out = qga.sh(
            "systemctl is-active inplace-agent.service",
            Duration::from_secs(60),
        )?;
        if out.stdout.trim() == "active" {
            return Ok(());
        }
        if began.elapsed() > Duration::from_secs(180) {
            let st = qga.sh(
                "systemctl status --no-pager inplace-agent.service; journalctl -b --no-pager -u inplace-agent | tail -n 30",
                Duration::from_secs(60),
            )?;
            bail!("the agent is not active after 180 s: {}", st.stdout);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Submits a plan from inside the guest and waits for it to end; the final status JSON.
///
/// The node is judged, not one client call: as the updater does (Cluster API calls the hook
/// again), a submission that ends without the plan's end — the client's deadline while the
/// agent is still starting after a boot, a refused connection, an answer that is not a
/// status — is made again until `budget` has passed. A plan that ended in any phase but
/// Succeeded is a final answer and fails at once; so does running out of `budget`, with
/// every attempt's words.
pub fn submit_wait(qga: &mut Qga, plan_path: &str, budget: Duration) -> Result<Value> {
    let began = Instant::now();
    let mut attempts = Vec::new();
    loop {
        let left = budget
            .saturating_sub(began.elapsed())
            .max(Duration::from_secs(30));
        let out = qga.sh(
            &format!(
                "{CLIENT} inplace-agent submit --wait --wait-timeout {} --no-progress -o json {plan_path}",
                left.as_secs()
            ),
            left + Duration::from_secs(60),
        );
        let words = match out {
            Ok(out) => match serde_json::from_str::<Value>(&out.stdout) {
                Ok(status) => match status.get("phase").and_then(Value::as_str) {
                    Some("Succeeded") if out.code == 0 => return Ok(status),
                    Some(phase @ ("Failed" | "RolledBack" | "Superseded" | "Cancelled")) => {
                        bail!(
                            "plan {plan_path} ended {phase} (exit {}): {status}\n{}",
                            out.code,
                            out.stderr
                        )
                    }
                    _ => format!("exit {}: {status} {}", out.code, out.stderr.trim()),
                },
                Err(_) => format!("exit {}: {}{}", out.code, out.stdout, out.stderr.trim()),
            },
            Err(e) => format!("the guest agent: {e:#}"),
        };
        eprintln!(
            "power cuts: submit {plan_path} after {} ms did not see the plan end ({words}); \
             submitting again, as the updater would",
            began.elapsed().as_millis()
        );
        attempts.push(words);
        if began.elapsed() >= budget {
            bail!(
                "plan {plan_path} did not end within {} s; {} submissions: {attempts:#?}",
                budget.as_secs(),
                attempts.len()
            );
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// What one cut found.
#[derive(Debug, Clone)]
pub struct CutOutcome {
    pub plan: String,
    /// Milliseconds after the submission started.
    pub at_ms: u64,
    /// Where the cut fell: the phase the agent resumed the plan in after the boot,
    /// "<phase> before the cut" when it had already ended, "not accepted" when the
    /// acceptance was not durable yet.
    pub phase_after: String,
    /// Sectors the guest wrote and never flushed, dropped by the cut.
    pub dropped_sectors: u64,
    /// Write and flush requests the disk served from the submission to the cut.
    pub writes: u64,
    pub flushes: u64,
    /// The agent truncated a torn journal tail at its start.
    pub torn_tail: bool,
    /// None: converged; Some: why not.
    pub failure: Option<String>,
}

impl CutOutcome {
    /// One line for the test's and the bench's output.
    pub fn summary(&self) -> String {
        format!(
            "{} at {} ms ({} writes, {} flushes before it), cut in: {}, {} unflushed sectors \
             dropped, torn tail {}: {}",
            self.plan,
            self.at_ms,
            self.writes,
            self.flushes,
            self.phase_after,
            self.dropped_sectors,
            if self.torn_tail { "truncated" } else { "none" },
            self.failure.as_deref().unwrap_or("converged")
        )
    }
}

/// How long an uninterrupted run took.
#[derive(Debug, Clone)]
pub struct Timing {
    pub plan: char,
    /// The submission (the client started) → the client saw Succeeded.
    pub total_ms: u64,
    /// Of that, until the plan was accepted (the client starting, parsing, connecting).
    pub before_accepted_ms: u64,
    /// Accepted → Succeeded, by the agent's clock.
    pub run_ms: u64,
}

/// A run of cuts.
#[derive(Debug, Default)]
pub struct Report {
    pub cuts: Vec<CutOutcome>,
    /// The uninterrupted runs of plans A and B.
    pub reference: Vec<Timing>,
    /// Each boot until the agent answered.
    pub boot_ms: Vec<u64>,
    pub seed: u64,
}

impl Report {
    /// Cuts after which the node converged.
    pub fn survived(&self) -> usize {
        self.cuts.iter().filter(|c| c.failure.is_none()).count()
    }
}

/// A small deterministic generator (xorshift64*): the seed is printed, so a failing cut can
/// be replayed with `INPLACE_VM_SEED`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// The seed: `INPLACE_VM_SEED`, else the clock.
pub fn seed() -> u64 {
    std::env::var("INPLACE_VM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        })
}

/// Boots the node and waits for the agent. A boot in which the guest kernel reported CPU
/// stalls (the host did not run the emulator for seconds) and never reached the guest agent
/// is cut and booted once more, loudly: that is the host's load, not the node. A second such
/// boot, or a boot that fails any other way, is a failure.
fn boot_and_wait(node: &mut Node, report: &mut Report) -> Result<(super::Vm, Qga)> {
    let began = Instant::now();
    let mut vm = node.boot()?;
    let mut qga = match vm.qga(BOOT_TIMEOUT) {
        Ok(q) => q,
        Err(e) if vm.guest_starved() => {
            eprintln!(
                "VM node: WARNING: the guest's CPUs stalled during the boot (the host did not \
                 run it); cutting and booting once more. The first boot: {e:#}"
            );
            vm.cut();
            vm = node.boot()?;
            vm.qga(BOOT_TIMEOUT)?
        }
        Err(e) => return Err(e),
    };
    wait_agent(&mut qga)?;
    report.boot_ms.push(began.elapsed().as_millis() as u64);
    Ok((vm, qga))
}

/// How long a re-submission after a boot may take until the plan ends: four times the
/// slowest boot and the slowest uninterrupted run measured on this node, at least 240 s.
fn judge_budget(report: &Report) -> Duration {
    let boot = report.boot_ms.iter().copied().max().unwrap_or(0);
    let run = report
        .reference
        .iter()
        .map(|t| t.total_ms)
        .max()
        .unwrap_or(0);
    Duration::from_millis(4 * (boot + run)).max(Duration::from_secs(240))
}

/// The budget of a run with nothing measured yet (the reference runs).
pub const FIRST_RUN_BUDGET: Duration = Duration::from_secs(900);

/// The reference: plans A and B run uninterrupted on the fresh node; their end states. The
/// node is then as it was before (B undoes A).
fn reference(node: &Node, qga: &mut Qga, report: &mut Report) -> Result<(String, String)> {
    let mut states = Vec::new();
    for which in ['a', 'b'] {
        let path = node.put_plan(
            &format!("ref-{which}.yaml"),
            &plan(which, &format!("ref-{which}")),
        )?;
        let began = Instant::now();
        let status = submit_wait(qga, &path, FIRST_RUN_BUDGET)
            .with_context(|| format!("reference run of plan {which}"))?;
        let total = began.elapsed().as_millis() as u64;
        let ms = |k: &str| status.get(k).and_then(Value::as_u64).unwrap_or(0);
        let run = ms("finishedAtMs")
            .saturating_sub(ms("acceptedAtMs"))
            .min(total);
        report.reference.push(Timing {
            plan: which,
            total_ms: total,
            before_accepted_ms: total - run,
            run_ms: run,
        });
        states.push(snapshot(qga)?);
    }
    let b = states.pop().unwrap_or_default();
    let a = states.pop().unwrap_or_default();
    if !a.contains("f299.conf") || b.contains("f299.conf") {
        bail!("the reference end states are not what plans A and B make:\nA:\n{a}\nB:\n{b}");
    }
    Ok((a, b))
}

/// How the agent runs on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The packaged unit as shipped: `/etc`, `/usr`, `/var` and the state directory are
    /// mounts of their own in its namespace, so the files it replaces are backed up by
    /// copies.
    PackagedUnit,
    /// The packaged unit with a drop-in that leaves the root file system one mount (as the
    /// DaemonSet sees it): the files it replaces are kept as their own backups, linked into
    /// the backup store.
    OneMount,
}

/// The drop-in of [`Route::OneMount`]: no read-only root, no read-write bind mounts (the
/// sysctl directories keep theirs) and no state directory of systemd's, which it mounts on
/// itself whenever the unit has a mount namespace (the directory exists from the first
/// start, 0700).
const ONE_MOUNT: &str = "[Service]\nProtectSystem=no\nStateDirectory=\nReadWritePaths=\nReadWritePaths=-/proc/sys/abi -/proc/sys/debug -/proc/sys/dev -/proc/sys/fs -/proc/sys/kernel -/proc/sys/net -/proc/sys/user -/proc/sys/vm\n";

/// Puts the agent on `route` (after the first boot) and checks its mounts.
fn take_route(qga: &mut Qga, route: Route) -> Result<()> {
    if route == Route::OneMount {
        sh_ok(
            qga,
            &format!(
                "mkdir -p /etc/systemd/system/inplace-agent.service.d && \
                 printf '{ONE_MOUNT}' > /etc/systemd/system/inplace-agent.service.d/one-mount.conf && \
                 sync && systemctl daemon-reload && systemctl restart inplace-agent.service"
            ),
            Duration::from_secs(120),
        )?;
        wait_agent(qga)?;
    }
    let mounts = sh_ok(
        qga,
        "cat /proc/$(systemctl show -p MainPID --value inplace-agent.service)/mountinfo",
        Duration::from_secs(60),
    )?;
    let own = |target: &str| {
        mounts
            .lines()
            .any(|l| l.split_whitespace().nth(4) == Some(target))
    };
    let expected = match route {
        Route::PackagedUnit => own("/etc") && own("/var/lib/inplace-agent"),
        Route::OneMount => !own("/etc") && !own("/var") && !own("/var/lib/inplace-agent"),
    };
    if !expected {
        bail!("the agent's mounts are not those of {route:?}:\n{mounts}");
    }
    Ok(())
}

/// `cuts` power cuts at random moments; every outcome in the report (the caller judges).
/// `progress` is called after each cut with the report so far.
pub fn run(
    env: &VmEnv,
    cuts: usize,
    route: Route,
    mut progress: impl FnMut(&Report),
) -> Result<Report> {
    let mut report = Report {
        seed: seed(),
        ..Report::default()
    };
    let mut rng = Rng::new(report.seed);
    eprintln!(
        "power cuts: {cuts}, seed {} (INPLACE_VM_SEED replays them)",
        report.seed
    );
    let mut node = env.node(match route {
        Route::PackagedUnit => "powercut",
        Route::OneMount => "powercut-one-mount",
    })?;
    let (mut vm, mut qga) = boot_and_wait(&mut node, &mut report)?;
    take_route(&mut qga, route)?;
    let (state_a, state_b) = reference(&node, &mut qga, &mut report)?;
    // Cut moments, from the submission: mostly while the agent runs the plan (accepted →
    // Succeeded in the longer reference run), some while the client is still submitting,
    // some after the end (a cut then must converge too). A plan that ended before its cut
    // shortens the window to its own run: later runs on a settled node are faster than the
    // reference on a node just booted.
    let slowest = report
        .reference
        .iter()
        .max_by_key(|t| t.total_ms)
        .cloned()
        .context("reference timings")?;
    let from = slowest.before_accepted_ms / 2;
    let mut run_ms = slowest.run_ms;
    let mut to = slowest.before_accepted_ms + run_ms * 5 / 4;
    eprintln!(
        "power cuts: uninterrupted runs {:?}; cuts between {from} and {to} ms after the submission",
        report.reference
    );

    for k in 0..cuts {
        let which = if k % 2 == 0 { 'a' } else { 'b' };
        let id = format!("cut-{k}-{which}");
        let path = node.put_plan(&format!("{id}.yaml"), &plan(which, &id))?;
        let at_ms = from + rng.below(to - from);
        let before = node.disk.stats();
        let began = Instant::now();
        qga.spawn(&[
            "/bin/sh",
            "-c",
            &format!("{CLIENT} exec inplace-agent submit --no-progress {path}"),
        ])?;
        std::thread::sleep(Duration::from_millis(at_ms).saturating_sub(began.elapsed()));
        vm.cut();
        if !node.disk.wait_disconnected(Duration::from_secs(30)) {
            bail!("the disk stayed connected after the cut");
        }
        let after = node.disk.stats();

        let (v, q) = boot_and_wait(&mut node, &mut report)
            .with_context(|| format!("boot after cut {k} at {at_ms} ms"))?;
        vm = v;
        qga = q;
        let outcome = judge(
            &mut qga,
            &id,
            &path,
            if which == 'a' { &state_a } else { &state_b },
            judge_budget(&report),
        );
        let (phase_after, torn_tail, failure) = match outcome {
            Ok((phase, torn, ended_in)) => {
                if let Some(d) = ended_in.filter(|&d| d < run_ms) {
                    run_ms = d;
                    to = (slowest.before_accepted_ms + run_ms * 5 / 4).max(from + 1);
                    eprintln!("power cuts: a run took {d} ms; cuts now up to {to} ms");
                }
                (phase, torn, None)
            }
            Err(e) => ("?".into(), false, Some(format!("{e:#}"))),
        };
        let c = CutOutcome {
            plan: id,
            at_ms,
            phase_after,
            dropped_sectors: after.dropped_sectors - before.dropped_sectors,
            writes: after.writes - before.writes,
            flushes: after.flushes - before.flushes,
            torn_tail,
            failure,
        };
        report.cuts.push(c);
        progress(&report);
        if report.cuts.last().is_some_and(|c| c.failure.is_some()) {
            // The node is in an unknown state: the next cuts would judge the wrong thing.
            break;
        }
    }
    vm.cut();
    Ok(report)
}

/// After the boot that follows a cut: where the cut fell, whether a torn tail was truncated;
/// an error when the node did not converge.
fn judge(
    qga: &mut Qga,
    id: &str,
    path: &str,
    want: &str,
    budget: Duration,
) -> Result<(String, bool, Option<u64>)> {
    // Where the cut fell: the phase the agent resumed the plan in (it says so as it starts),
    // else, if the plan is known, it had ended before the cut; else it was not accepted yet.
    let log = qga.sh(
        "journalctl -b --no-pager -o cat -u inplace-agent.service",
        Duration::from_secs(60),
    )?;
    let resumed = log
        .stdout
        .lines()
        .find(|l| l.contains("an unfinished plan resumes") && l.contains(id))
        .and_then(|l| l.split("phase=").nth(1))
        .map(|p| p.split_whitespace().next().unwrap_or_default().to_string());
    let torn = log.stdout.contains("torn record");
    let mut ended_in = None;
    let phase_at_cut = match resumed {
        Some(phase) => phase,
        None => {
            let first = qga.sh(
                &format!("inplace-agent status {id} -o json"),
                Duration::from_secs(60),
            )?;
            match serde_json::from_str::<Value>(&first.stdout).ok() {
                Some(v) if v.get("phase").and_then(Value::as_str).is_some() => {
                    let ms = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
                    ended_in = Some(ms("finishedAtMs").saturating_sub(ms("acceptedAtMs")));
                    format!("{} before the cut", v["phase"].as_str().unwrap_or_default())
                }
                _ => "not accepted".into(),
            }
        }
    };
    submit_wait(qga, path, budget)?;
    let got = snapshot(qga)?;
    if got != want {
        bail!(
            "the end state differs from the uninterrupted run:\n{}",
            diff(want, &got)
        );
    }
    let verify = qga.sh("inplace-agent journal --verify", Duration::from_secs(120))?;
    if verify.code != 0 {
        bail!(
            "journal --verify failed: {}{}",
            verify.stdout,
            verify.stderr
        );
    }
    // Temp and staged files are made beside the file they replace (and in the state
    // directory); once the plan has ended none may be left.
    let temp = sh_ok(
        qga,
        "find /etc /var/lib -xdev \\( -name '.*.inplace-tmp' -o -name '.*.inplace-r[0-9]*' \\) \
         2>/dev/null || true",
        Duration::from_secs(120),
    )?;
    if !temp.trim().is_empty() {
        bail!("temp files left: {temp}");
    }
    Ok((phase_at_cut, torn, ended_in))
}
