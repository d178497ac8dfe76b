//! A Machine whose agent does not answer while Cluster API waits on its `UpdateMachine`: the
//! hook keeps answering "in progress" (CAPI asks again), but says so where people look — a
//! warning log at every miss, a `Warning` Event `AgentUnreachable` on the Machine at the
//! first miss and then at most once every [`EVENT_EVERY`], the metrics
//! `inplace_updater_unreachable_machines` and `inplace_updater_unreachable_oldest_seconds` —
//! and after `settings.unreachableTimeoutSeconds` (default 300) it answers Failure naming the
//! node, address, port and last error, and what to do.
//!
//! When the wait began is kept on the Machine, in the annotation [`SINCE_ANNOTATION`]
//! (written once, at the first miss; removed when the agent answers again): a restarted
//! updater, or another replica, counts the deadline from the same moment
//! (docs/decisions/0012-fleet-trust-and-dead-agents.md). It is read from the live Machine
//! only, never from a hook request, and it counts only for the update it was written in:
//! its value names the Machine's spec then ([`since_value`]), so a wait of an earlier update,
//! a time in the future or a value in another shape is no wait at all ([`live_since`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The annotation holding when the agent was first found unreachable (RFC 3339, UTC).
pub const SINCE_ANNOTATION: &str = "inplace-agent.github.io/agent-unreachable-since";

/// The reason of the Events.
pub const EVENT_REASON: &str = "AgentUnreachable";

/// At most one Event per Machine per this long while the agent stays unreachable.
pub const EVENT_EVERY: Duration = Duration::from_secs(120);

/// An entry not heard of for this long is no longer counted (CAPI asks every 15 s while
/// waiting; a Machine deleted or rolled out is no longer asked about).
const FORGET_AFTER: Duration = Duration::from_secs(90);

/// What the hook does about one more miss.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Keep waiting; `event` is the number of the Event due now, if one is.
    Wait {
        /// How long the agent has been unreachable.
        elapsed: Duration,
        /// `Some(n)`: the n-th Event of this wait is due.
        event: Option<u64>,
    },
    /// The deadline has passed: answer Failure.
    Expired {
        /// How long the agent has been unreachable.
        elapsed: Duration,
    },
}

/// The decision for a miss at `now_ms` of a wait that began at `since_ms` (Unix ms), with
/// the Event numbers already created by this replica up to `emitted` (`None`: none).
/// `timeout` zero never expires.
pub fn judge(since_ms: u64, now_ms: u64, timeout: Duration, emitted: Option<u64>) -> Verdict {
    let elapsed = Duration::from_millis(now_ms.saturating_sub(since_ms));
    if !timeout.is_zero() && elapsed >= timeout {
        return Verdict::Expired { elapsed };
    }
    let due = elapsed.as_secs() / EVENT_EVERY.as_secs();
    Verdict::Wait {
        elapsed,
        event: (emitted.is_none_or(|e| e < due)).then_some(due),
    }
}

/// The Failure message of a wait past its deadline.
pub fn expired_message(
    machine: &str,
    agent_error: &str,
    elapsed: Duration,
    timeout: Duration,
) -> String {
    format!(
        "Machine {machine}: {agent_error}; unreachable for {}s, longer than \
         settings.unreachableTimeoutSeconds ({}s): check the agent's pod (kubectl get pods -A \
         -l app.kubernetes.io/name=inplace-agent --field-selector spec.nodeName=<node>) or its \
         unit on the node (systemctl status inplace-agent), or delete the Machine so Cluster \
         API replaces it",
        elapsed.as_secs(),
        timeout.as_secs()
    )
}

#[derive(Debug, Clone)]
struct Waiting {
    cluster: String,
    since_ms: u64,
    heard: Instant,
    emitted: Option<u64>,
}

/// The Machines this replica found waiting on an unreachable agent.
#[derive(Debug, Default)]
pub struct Waits {
    machines: Mutex<HashMap<String, Waiting>>,
    /// What the live Machine said of its wait ([`live_since`]), noted when the call read it.
    seen: Mutex<HashMap<String, Seen>>,
}

/// When a call read the live Machine, the start of the wait it recorded, its spec digest.
type Seen = (Instant, Option<u64>, String);

impl Waits {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiting>> {
        self.machines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes what the live Machine `machine` said of its wait while this call read it
    /// ([`live_since`]) and its spec's digest.
    pub fn saw_live(&self, machine: &str, since: Option<u64>, spec: String) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|_, (at, _, _)| at.elapsed() < FORGET_AFTER);
        seen.insert(machine.to_owned(), (Instant::now(), since, spec));
    }

    /// What this call's read of the live Machine said ([`Waits::saw_live`]): the wait's
    /// start, if any, and the spec digest; `None` when it was not read just now.
    pub fn take_seen(&self, machine: &str) -> Option<(Option<u64>, String)> {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.remove(machine)
            .filter(|(at, _, _)| at.elapsed() < Duration::from_secs(10))
            .map(|(_, since, spec)| (since, spec))
    }

    /// When this replica saw `machine`'s wait begin, if it did.
    pub fn since(&self, machine: &str) -> Option<u64> {
        self.lock().get(machine).map(|w| w.since_ms)
    }

    /// Records a miss of a wait of `machine` (of workload cluster `cluster`) that began at
    /// `since_ms` and returns the Event numbers already created for it.
    pub fn missed(&self, machine: &str, cluster: &str, since_ms: u64) -> Option<u64> {
        let mut machines = self.lock();
        let w = machines.entry(machine.to_owned()).or_insert(Waiting {
            cluster: cluster.to_owned(),
            since_ms,
            heard: Instant::now(),
            emitted: None,
        });
        if w.since_ms != since_ms {
            w.since_ms = since_ms;
            w.emitted = None;
        }
        w.heard = Instant::now();
        w.emitted
    }

    /// Event `n` of `machine`'s wait was created (or existed).
    pub fn emitted(&self, machine: &str, n: u64) {
        if let Some(w) = self.lock().get_mut(machine) {
            w.emitted = Some(w.emitted.map_or(n, |e| e.max(n)));
        }
    }

    /// The agent answered again (or the Machine is no longer waited on).
    pub fn answered(&self, machine: &str) -> bool {
        self.lock().remove(machine).is_some()
    }

    /// The Machines waiting now, with their cluster.
    pub fn clusters(&self) -> HashMap<String, String> {
        let mut machines = self.lock();
        machines.retain(|_, w| w.heard.elapsed() < FORGET_AFTER);
        machines
            .iter()
            .map(|(m, w)| (m.clone(), w.cluster.clone()))
            .collect()
    }

    /// How many Machines wait now, and the age in seconds of the oldest wait.
    pub fn gauges(&self, now_ms: u64) -> (u64, f64) {
        let mut machines = self.lock();
        machines.retain(|_, w| w.heard.elapsed() < FORGET_AFTER);
        let oldest = machines.values().map(|w| w.since_ms).min();
        (
            machines.len() as u64,
            oldest.map_or(0.0, |s| now_ms.saturating_sub(s) as f64 / 1000.0),
        )
    }
}

/// 12 hex of sha256 over the live Machine's `spec` in canonical JSON: which update a wait
/// belongs to.
pub fn spec_digest(live: &serde_json::Value) -> String {
    let mut text = String::new();
    crate::translate::write_canonical(
        live.get("spec").unwrap_or(&serde_json::Value::Null),
        &mut text,
    );
    let digest = <sha2::Sha256 as sha2::Digest>::digest(text.as_bytes());
    hex::encode(&digest[..6])
}

/// The annotation's value: when the wait began, and the spec it began under
/// (`2026-12-07T05:00:00Z spec=0123456789ab`).
pub fn since_value(ms: u64, spec: &str) -> String {
    format!("{} spec={spec}", format_since(ms))
}

/// When the wait recorded on the live Machine began: only a value written for its current
/// `spec` ([`since_value`]) and not later than `now_ms` counts.
pub fn live_since(live: &serde_json::Value, now_ms: u64) -> Option<u64> {
    let value =
        crate::translate::lookup(live, &["metadata", "annotations", SINCE_ANNOTATION])?.as_str()?;
    let (at, spec) = value.trim().split_once(" spec=")?;
    if spec != spec_digest(live) {
        return None;
    }
    parse_since(at).filter(|ms| *ms <= now_ms)
}

/// RFC 3339 (UTC, to the second) of Unix milliseconds.
pub fn format_since(ms: u64) -> String {
    inplace_base::time::rfc3339(ms - ms % 1000).replace(".000Z", "Z")
}

/// Unix milliseconds of an annotation written by [`format_since`]
/// (`YYYY-MM-DDTHH:MM:SSZ`); `None` for anything else.
pub fn parse_since(text: &str) -> Option<u64> {
    let t = text.trim().strip_suffix('Z')?;
    let (date, time) = t.split_once('T')?;
    let num = |s: &str| s.parse::<i64>().ok();
    let mut d = date.splitn(3, '-').map(num);
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut c = time.splitn(3, ':').map(num);
    let (hh, mm, ss) = (c.next()??, c.next()??, c.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days-from-civil (Howard Hinnant's algorithm), the inverse of inplace_base::time.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    u64::try_from(secs).ok().map(|s| s * 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(300);

    #[test]
    fn the_first_miss_has_an_event_then_one_per_interval_until_the_deadline() {
        assert_eq!(
            judge(1_000, 1_000, T, None),
            Verdict::Wait {
                elapsed: Duration::ZERO,
                event: Some(0)
            }
        );
        // Event 0 created: none again within the interval.
        assert_eq!(
            judge(1_000, 61_000, T, Some(0)),
            Verdict::Wait {
                elapsed: Duration::from_secs(60),
                event: None
            }
        );
        assert_eq!(
            judge(1_000, 1_000 + 121_000, T, Some(0)),
            Verdict::Wait {
                elapsed: Duration::from_secs(121),
                event: Some(1)
            }
        );
        // Another replica that created none yet creates the one due now (same name: 409).
        assert_eq!(
            judge(1_000, 1_000 + 250_000, T, None),
            Verdict::Wait {
                elapsed: Duration::from_secs(250),
                event: Some(2)
            }
        );
        assert_eq!(
            judge(1_000, 301_000, T, Some(2)),
            Verdict::Expired {
                elapsed: Duration::from_secs(300)
            }
        );
        // Zero: never expires.
        assert!(matches!(
            judge(0, 86_400_000, Duration::ZERO, Some(720)),
            Verdict::Wait { .. }
        ));
    }

    #[test]
    fn waits_count_machines_and_the_oldest_and_forget_answered_ones() {
        let w = Waits::default();
        assert_eq!(w.gauges(10_000), (0, 0.0));
        assert_eq!(w.missed("ns/a", "c", 4_000), None);
        w.emitted("ns/a", 0);
        assert_eq!(w.missed("ns/a", "c", 4_000), Some(0));
        w.missed("ns/b", "d", 8_000);
        assert_eq!(w.clusters().get("ns/b").map(String::as_str), Some("d"));
        assert_eq!(w.gauges(10_000), (2, 6.0));
        assert!(w.answered("ns/a"));
        assert_eq!(w.gauges(10_000), (1, 2.0));
        // A new wait of the same Machine starts its Events again.
        w.emitted("ns/b", 3);
        assert_eq!(w.missed("ns/b", "d", 9_000), None);
    }

    #[test]
    fn the_annotation_round_trips_to_the_second() {
        let ms = 1_765_000_123_456;
        let text = format_since(ms);
        assert!(text.ends_with('Z') && !text.contains('.'), "{text}");
        assert_eq!(parse_since(&text), Some(ms - 456));
    }
}
