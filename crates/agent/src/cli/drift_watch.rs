//! The daemon's drift checks: one at start-up (a reboot is when sysctls and runtime state
//! are lost), one every `drift.interval_seconds`, one `drift.debounce_ms` after a write to a
//! directory the last succeeded plan wrote into or one of those directories appearing
//! (inotify, `host::watch`, which watches the nearest existing ancestor of a directory that
//! does not exist yet), one more as soon as a new set of directories is watched (a write
//! between the check that found them and the watch would otherwise go unseen until the
//! interval), and one after each run ends. A run in progress suspends checks (the engine refuses to check then). A check
//! that must read the node does so in a check process (`drift_probe`). Idle, the task waits
//! on the inotify descriptor, the engine's events and one timer: no polling.
//! With `drift.repair = "auto"`, found drift is repaired, at most once per
//! `drift.repair_min_interval_seconds` (counted from the last repair in the journal, so a
//! restart does not reset it).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::{CheckCommand, DriftSettings, RepairMode};
use crate::engine::drift::{Begun, CheckOutcome, Pending};
use crate::engine::{Engine, Event};
use crate::host::watch::DirWatch;
use inplace_plan::NodePath;

/// The source of automatic repairs, as journaled (`repair of run N by drift.repair=auto`).
pub const AUTO_REPAIR: &str = "drift.repair=auto";

/// Runs drift checks until `stopping` turns true.
pub async fn run(engine: Engine, settings: DriftSettings, mut stopping: watch::Receiver<bool>) {
    if !settings.enabled {
        return;
    }
    let mut events = engine.subscribe();
    let mut due = Instant::now();
    let mut watching: Option<(BTreeSet<NodePath>, AsyncFd<DirWatch>)> = None;
    loop {
        let readable = async {
            match &mut watching {
                Some((_, fd)) => fd.readable_mut().await.map(|mut g| {
                    let relevant = g.get_inner_mut().drain();
                    g.clear_ready();
                    relevant
                }),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stopping.changed() => {
                if *stopping.borrow() {
                    return;
                }
            }
            noticed = readable => match noticed {
                // A write in a watched directory, or one on the way to it appearing.
                Ok(true) => due = due.min(Instant::now() + settings.debounce),
                // Only writes beside the way to a directory that does not exist yet.
                Ok(false) => {}
                Err(_) => {
                    watching = None;
                    due = due.min(Instant::now() + settings.debounce);
                }
            },
            event = events.recv() => match event {
                Ok(Event::Status(s)) if s.phase.is_terminal() => due = Instant::now(),
                Ok(_) => {}
                Err(RecvError::Lagged(_)) => due = Instant::now(),
                Err(RecvError::Closed) => return,
            },
            () = tokio::time::sleep_until(due) => {
                due = Instant::now() + settings.interval;
                let Some(outcome) = check(&engine, settings.check_process.as_ref()).await
                else {
                    continue;
                };
                if outcome != CheckOutcome::Checked {
                    continue;
                }
                let dirs = engine.drift().watch;
                if watching.as_ref().is_none_or(|(w, _)| *w != dirs) {
                    watching = watch_dirs(&engine, &dirs);
                    // A write after this check read the node and before the watch was placed
                    // was seen by neither: look once more now that it is (the next write
                    // wakes the watch). The set is the same then, so this happens once per
                    // change of the managed directories.
                    if watching.is_some() {
                        due = Instant::now();
                        continue;
                    }
                }
                if settings.repair == RepairMode::Auto && engine.drift().drifted() {
                    auto_repair(&engine, settings.repair_min_interval).await;
                }
            }
        }
    }
}

/// One check: metadata first, then, when the node must be read, a look in a check process
/// (`drift_probe`) or, for a daemon started without one, in this process. `None` when a
/// thread of the check panicked.
pub async fn check(engine: &Engine, process: Option<&CheckCommand>) -> Option<CheckOutcome> {
    let begun = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.begin_drift_check())
            .await
            .ok()?
    };
    let pending: Arc<Pending> = match begun {
        Begun::Done(outcome) => return Some(outcome),
        Begun::Look(pending) => Arc::from(pending),
    };
    let look = match process {
        Some(command) => {
            super::drift_probe::look_in_a_process(command, engine, pending.clone()).await
        }
        None => {
            let (engine, pending) = (engine.clone(), pending.clone());
            tokio::task::spawn_blocking(move || engine.look(&pending))
                .await
                .ok()?
        }
    };
    let engine = engine.clone();
    // What the check allocated (the baseline, the answer; a look in this process also the
    // plan's contents) goes back to the kernel once it is done, as after a run
    // (`host::memory`).
    tokio::task::spawn_blocking(move || {
        let outcome = engine.finish_drift_check(&pending, look);
        drop(pending);
        crate::host::memory::give_back();
        outcome
    })
    .await
    .ok()
}

/// Watches `dirs` on the node; `None` (checks on the interval only) when inotify cannot be
/// had, which is logged.
fn watch_dirs(
    engine: &Engine,
    dirs: &BTreeSet<NodePath>,
) -> Option<(BTreeSet<NodePath>, AsyncFd<DirWatch>)> {
    let watch = DirWatch::new(engine.host(), dirs)
        .and_then(DirWatch::into_async)
        .map_err(|e| {
            tracing::warn!(
                error = %e,
                "cannot watch the managed directories for writes; drift is checked every \
                 interval only"
            )
        })
        .ok()?;
    let w = watch.get_ref();
    if w.left_out() > 0 {
        tracing::warn!(
            "the last succeeded plan writes into {} directories; {} of them are watched for \
             writes, the others are checked every drift.interval_seconds only",
            dirs.len(),
            crate::host::watch::MAX_WATCHES
        );
    }
    tracing::debug!(
        dirs = w.watched().len(),
        stand_ins = w.stand_ins().len(),
        "watching for drift"
    );
    Some((dirs.clone(), watch))
}

/// Repairs unless the last repair was less than `min_interval` ago.
async fn auto_repair(engine: &Engine, min_interval: Duration) {
    let now = inplace_base::time::now_ms();
    let last = engine
        .plans()
        .iter()
        .filter(|p| p.source.starts_with("repair of"))
        .map(|p| p.accepted_at_ms)
        .max();
    if let Some(last) = last
        && now.saturating_sub(last) < min_interval.as_millis() as u64
    {
        tracing::info!(
            "drift found; the last repair was {} s ago, the next is allowed after {} s \
             (drift.repair_min_interval_seconds)",
            now.saturating_sub(last) / 1000,
            min_interval.as_secs()
        );
        return;
    }
    let engine = engine.clone();
    match tokio::task::spawn_blocking(move || engine.repair(AUTO_REPAIR)).await {
        Ok(Ok(s)) => tracing::warn!(
            plan = %s.status().id,
            run = s.status().run,
            "drift found: repairing (drift.repair = \"auto\")"
        ),
        Ok(Err(e)) => tracing::warn!(error = %e, "drift found and cannot be repaired"),
        Err(_) => {}
    }
}
