//! Health gates (`verify[]`): each probe is polled every `period` until it passes or its
//! `timeout` runs out; the last observation is what the status reports.
//!
//! Polling: an attempt may run for whatever is left of the gate's `timeout` (a slow command
//! or an HTTP server that answers late is not cut short by a fixed per-attempt cap); after a
//! failed attempt the gate waits `period` and tries again, unless that next attempt would
//! start after the deadline, in which case the gate fails with the last observation.

use std::time::{Duration, Instant};

use crate::host::{Host, ServiceCall, http};
use inplace_plan::{Check, Probe};

/// Where `kubeletVersion` looks for the node's kubelet, in this order (the `PATH` of a root
/// shell on the node); the first that exists in the node's root is run.
pub const KUBELET_DIRS: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// The outcome of one gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    /// Whether it passed.
    pub passed: bool,
    /// What it saw last ("got 500 after 3 attempts in 10s: ...").
    pub message: String,
    /// How many times it was tried.
    pub attempts: u32,
}

/// Why this build cannot run a probe, or `None`.
pub fn unsupported(probe: &Probe) -> Option<String> {
    match probe {
        Probe::HttpGet { url, .. } if !url.starts_with("http://") => {
            Some("httpGet over https is not supported by this agent yet".into())
        }
        _ => None,
    }
}

/// Why a gate cannot run without service management, or `None`.
pub fn unsupported_without_services(probe: &Probe) -> Option<String> {
    matches!(probe, Probe::UnitActive { .. }).then(|| {
        "unitActive gates need service management, which is off on this agent \
         (--services off)"
            .to_string()
    })
}

/// The node's kubelet binary: its path on the node, and where the agent finds it.
pub fn find_kubelet(host: &Host) -> Option<(String, std::path::PathBuf)> {
    KUBELET_DIRS.iter().find_map(|dir| {
        let node_path = format!("{dir}/kubelet");
        let here = host.root_path().join(node_path.trim_start_matches('/'));
        here.is_file().then_some((node_path, here))
    })
}

/// The version the node's kubelet reports, found and run as the `kubeletVersion` gate runs
/// it (the root's own kubelet, chrooted or not: [`crate::host::command::node_program`]);
/// `GetNodeInfo.kubelet_version`, which the updater's drain compares with the Machine's
/// version.
pub fn kubelet_version(host: &Host) -> Option<String> {
    let (node_path, _) = find_kubelet(host)?;
    let spec = crate::host::command::node_program(host, [node_path, "--version".to_string()])
        .timeout(Duration::from_secs(5));
    let out = crate::host::command::run(&spec).ok()?;
    if !out.success() {
        return None;
    }
    parse_kubelet_version(&out.stdout)
}

/// One attempt of a probe: `Ok(observation)` when it passes, `Err(observation)` when not;
/// `baseline` is the `controlPlane` gate's from before the plan, if any.
pub fn probe_once(
    host: &Host,
    probe: &Probe,
    baseline: Option<&super::control_plane::Baseline>,
    budget: Duration,
) -> Result<String, String> {
    match probe {
        Probe::ControlPlane(gate) => super::control_plane::probe(host, gate, baseline, budget),
        Probe::HttpGet { url, expect_status } => match http::get(url, budget) {
            Ok(reply) if reply.status == *expect_status => Ok(format!("answered {}", reply.status)),
            Ok(reply) => Err(format!(
                "answered {} (expected {expect_status}){}",
                reply.status,
                body_hint(&reply.body)
            )),
            Err(e) => Err(e),
        },
        Probe::Command { argv } => {
            let spec = host.command(argv.iter().cloned()).timeout(budget);
            match crate::host::command::run(&spec) {
                Ok(out) if out.success() => Ok(format!("{} exited 0", spec.display())),
                Ok(out) => Err(format!("{}: {}", spec.display(), out.summary())),
                Err(e) => Err(e.to_string()),
            }
        }
        Probe::KubeletVersion { version } => {
            // The root's kubelet, run inside the root (chroot) or by its path in it.
            let Some((node_path, _)) = find_kubelet(host) else {
                return Err(format!(
                    "no kubelet binary on the node (looked in {})",
                    KUBELET_DIRS.join(", ")
                ));
            };
            let spec = crate::host::command::node_program(
                host,
                [node_path.clone(), "--version".to_string()],
            )
            .timeout(budget);
            match crate::host::command::run(&spec) {
                Ok(out) if out.success() => {
                    let seen = parse_kubelet_version(&out.stdout).unwrap_or_default();
                    if seen == *version {
                        Ok(format!("{node_path} reports {seen}"))
                    } else {
                        Err(format!(
                            "{node_path} reports {} (expected {version})",
                            if seen.is_empty() {
                                out.stdout.trim()
                            } else {
                                &seen
                            }
                        ))
                    }
                }
                Ok(out) => Err(format!("{node_path} --version: {}", out.summary())),
                Err(e) => Err(e.to_string()),
            }
        }
        Probe::UnitActive { name } => {
            let Some(services) = host.services() else {
                return Err(format!(
                    "cannot check {name}: service management is off on this agent"
                ));
            };
            let mut call = ServiceCall::within(budget);
            match services.unit_state(name, &mut call) {
                Ok(state) if state.is_active() => Ok(format!("{name}: {state}")),
                Ok(state) => Err(format!("{name}: {state}")),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

fn body_hint(body: &str) -> String {
    let line = body
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    if line.is_empty() {
        String::new()
    } else {
        format!(": {}", line.chars().take(200).collect::<String>())
    }
}

/// `Kubernetes v1.31.2` → `v1.31.2` (pure).
pub fn parse_kubelet_version(out: &str) -> Option<String> {
    out.split_whitespace()
        .find(|w| w.starts_with('v') && w[1..].starts_with(|c: char| c.is_ascii_digit()))
        .map(str::to_string)
}

/// Polls a gate until it passes, its timeout runs out, or `stop()` says to give up;
/// `baseline` is the `controlPlane` gate's from before the plan, if any.
pub fn run_check(
    host: &Host,
    check: &Check,
    baseline: Option<&super::control_plane::Baseline>,
    stop: &dyn Fn() -> bool,
    progress: &mut dyn FnMut(&str),
) -> CheckOutcome {
    let start = Instant::now();
    let deadline = start + check.timeout;
    let mut attempts = 0;
    loop {
        attempts += 1;
        // An attempt may use all the time the gate has left (a command that takes 15 s
        // passes a gate of 60 s); at least 200 ms, so the last attempt is a real one.
        let left = deadline.saturating_duration_since(Instant::now());
        let budget = left.max(Duration::from_millis(200));
        match probe_once(host, &check.probe, baseline, budget) {
            Ok(seen) => {
                return CheckOutcome {
                    passed: true,
                    message: seen,
                    attempts,
                };
            }
            Err(seen) => {
                let now = Instant::now();
                let stopped = stop();
                if now + check.period > deadline || stopped {
                    // Cut short (the plan's timeout, a cancel): the time it had, not its own
                    // timeout, which it never reached.
                    let message = if stopped && now + check.period <= deadline {
                        format!(
                            "{seen} (after {attempts} attempt{} in {}s, stopped before its \
                             {}s timeout)",
                            if attempts == 1 { "" } else { "s" },
                            start.elapsed().as_secs(),
                            check.timeout.as_secs()
                        )
                    } else {
                        format!(
                            "{seen} (after {attempts} attempt{} in {}s)",
                            if attempts == 1 { "" } else { "s" },
                            check.timeout.as_secs()
                        )
                    };
                    return CheckOutcome {
                        passed: false,
                        message,
                        attempts,
                    };
                }
                progress(&format!("attempt {attempts}: {seen}"));
                let next = now + check.period;
                while Instant::now() < next {
                    if stop() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50).min(next - Instant::now()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_version_is_parsed() {
        assert_eq!(
            parse_kubelet_version("Kubernetes v1.31.2\n").as_deref(),
            Some("v1.31.2")
        );
        assert_eq!(parse_kubelet_version("garbage"), None);
    }

    /// A gate whose command takes longer than any fixed per-attempt cap (10 s used to be
    /// one) passes within its own timeout, in one attempt.
    #[test]
    fn an_attempt_may_use_the_whole_gate_timeout() {
        let t = tempfile::tempdir().unwrap();
        let host = Host::open(crate::host::HostSettings {
            root: t.path().to_path_buf(),
            allow: inplace_plan::AllowList::default(),
            commands_in_root: false,
            boot_id_path: None,
            services: crate::host::ServiceSettings::Off,
            packages: Default::default(),
            downloads: crate::host::download::DownloadConfig::new(t.path()),
        })
        .unwrap();
        let check = Check {
            probe: Probe::Command {
                argv: vec!["sleep".into(), "11".into()],
            },
            timeout: Duration::from_secs(30),
            period: Duration::from_secs(1),
        };
        let outcome = run_check(&host, &check, None, &|| false, &mut |_| {});
        assert!(outcome.passed, "{outcome:?}");
        assert_eq!(outcome.attempts, 1);

        // A gate cut short (the plan's timeout) says how long it ran, not its own timeout.
        let failing = Check {
            probe: Probe::Command {
                argv: vec!["false".into()],
            },
            timeout: Duration::from_secs(300),
            period: Duration::from_secs(1),
        };
        let outcome = run_check(&host, &failing, None, &|| true, &mut |_| {});
        assert!(!outcome.passed);
        assert!(
            outcome
                .message
                .ends_with("(after 1 attempt in 0s, stopped before its 300s timeout)"),
            "{outcome:?}"
        );
    }
}
