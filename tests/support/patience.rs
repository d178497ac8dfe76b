//! How long a test waits for anything before it fails: one bound for every wait of the tests
//! and benches (a daemon to listen, a plan to finish, a counter to move, a unit to restart),
//! so that a hang fails instead of blocking CI. `INPLACE_TEST_PATIENCE_SECS` sets it.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The environment variable that sets [`patience`], in whole seconds.
pub const PATIENCE_ENV: &str = "INPLACE_TEST_PATIENCE_SECS";

/// 120 s unless [`PATIENCE_ENV`] says otherwise: the longest bound any test had before
/// they shared this one (the updater's fleet), so that no wait got shorter. A passing test
/// never waits this long; only a failing one does.
const DEFAULT: Duration = Duration::from_secs(120);

/// The upper bound of every wait.
pub fn patience() -> Duration {
    static PATIENCE: OnceLock<Duration> = OnceLock::new();
    *PATIENCE.get_or_init(|| match std::env::var(PATIENCE_ENV) {
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(secs) if secs > 0 => Duration::from_secs(secs),
            _ => panic!("{PATIENCE_ENV}={v:?}: expected a whole number of seconds above 0"),
        },
        Err(_) => DEFAULT,
    })
}

/// The moment [`patience`] from now.
pub fn deadline() -> Instant {
    Instant::now() + patience()
}

/// The pause between two polls: short at first (most conditions hold within milliseconds),
/// longer later (a poll may run a command inside a sandboxed node).
fn pause(polls: u32) -> Duration {
    Duration::from_millis((10u64 << polls.min(4)).min(100))
}

/// Polls `check` until it returns `Some`, for at most [`patience`]: its value, or `None`.
pub fn poll<T>(mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = deadline();
    let mut polls = 0;
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(pause(polls));
        polls += 1;
    }
}

/// [`poll`] that panics naming `what` when `check` never returned `Some`.
pub fn eventually<T>(what: &str, check: impl FnMut() -> Option<T>) -> T {
    poll(check).unwrap_or_else(|| panic!("never happened within {:?}: {what}", patience()))
}

/// [`eventually`] for async tests: sleeps on the runtime, so that the tasks that make
/// `check` true (a server on the same runtime) keep running.
pub async fn eventually_async<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = deadline();
    let mut polls = 0;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "never happened within {:?}: {what}",
            patience()
        );
        tokio::time::sleep(pause(polls)).await;
        polls += 1;
    }
}
