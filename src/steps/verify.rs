//! Health gates (`verify[]`): each probe is polled every `period` until it passes or its
//! `timeout` runs out; the last observation is what the status reports.

use std::time::{Duration, Instant};

use crate::host::{Host, http};
use crate::plan::{Check, Probe};

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
        Probe::UnitActive { .. } => {
            Some("unitActive checks are not supported by this agent yet".into())
        }
        _ => None,
    }
}

/// One attempt of a probe: `Ok(observation)` when it passes, `Err(observation)` when not.
pub fn probe_once(host: &Host, probe: &Probe, budget: Duration) -> Result<String, String> {
    match probe {
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
            let spec = host.command(["kubelet", "--version"]).timeout(budget);
            match crate::host::command::run(&spec) {
                Ok(out) if out.success() => {
                    let seen = parse_kubelet_version(&out.stdout).unwrap_or_default();
                    if seen == *version {
                        Ok(format!("kubelet reports {seen}"))
                    } else {
                        Err(format!(
                            "kubelet reports {} (expected {version})",
                            if seen.is_empty() {
                                out.stdout.trim()
                            } else {
                                &seen
                            }
                        ))
                    }
                }
                Ok(out) => Err(format!("kubelet --version: {}", out.summary())),
                Err(e) => Err(e.to_string()),
            }
        }
        Probe::UnitActive { name } => Err(format!("cannot check {name}: no service manager")),
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

/// Polls a gate until it passes, its timeout runs out, or `stop()` says to give up.
pub fn run_check(
    host: &Host,
    check: &Check,
    stop: &dyn Fn() -> bool,
    progress: &mut dyn FnMut(&str),
) -> CheckOutcome {
    let start = Instant::now();
    let deadline = start + check.timeout;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        let budget = left.clamp(Duration::from_millis(200), Duration::from_secs(10));
        match probe_once(host, &check.probe, budget) {
            Ok(seen) => {
                return CheckOutcome {
                    passed: true,
                    message: seen,
                    attempts,
                };
            }
            Err(seen) => {
                let now = Instant::now();
                if now + check.period > deadline || stop() {
                    let message = format!(
                        "{seen} (after {attempts} attempt{} in {}s)",
                        if attempts == 1 { "" } else { "s" },
                        check.timeout.as_secs()
                    );
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
}
