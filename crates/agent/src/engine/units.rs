//! What the Restarting phase does, and what rollback undoes, decided from the plan and what
//! its changes did: pure functions, tested below, that the runner (`run/units.rs`) and the
//! dry run (`check.rs`) share.
//!
//! The rules (DESIGN §2, "restarts are computed"):
//! - one daemon-reload when any change wrote or removed a file under a unit directory,
//!   enabled, disabled, masked or unmasked a unit file, or changed a package (a package may
//!   ship unit files and drop-ins, as the kubelet and kubeadm packages do; the upstream
//!   version bump is `daemon-reload` then `restart kubelet`);
//! - a unit is restarted when something it depends on changed: a `file`/`absent`/`artifact`
//!   change naming it in `restartUnits`, `kubeletConfig`/`kubeletFlags` (kubelet.service),
//!   a `package` or `kubeadmUpgradeNode` that names it, or its own unit file or drop-in;
//! - a unit change's `state` is enforced when the change found the unit in another state (and
//!   for every unit change after a reboot): `stopped` stops it (a unit that must be stopped is
//!   never restarted), `running` starts it when it is not running (a start loads the new
//!   files, so no restart follows);
//! - a unit with no desired state that is not running is left alone (a restart would start
//!   it); a failed one is restarted;
//! - each unit gets at most one job, stops first, then the rest in the order the plan first
//!   names the units;
//! - changes before a reboot that happened in the run are live after it: they cause no
//!   restart and no daemon-reload.

use std::collections::{BTreeMap, BTreeSet};

use crate::host::systemd::{ActiveState, LoadState, ObservedUnit as Observed, UnitJob};
use crate::journal::Preimage;
use crate::steps::Mutation;
use inplace_plan::kinds::{Touched, is_running, is_stopped, is_unit_path};
use inplace_plan::{Change, Disruption, Plan, UnitState};

/// What one change did (or would do) to the node, as far as units are concerned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Effect {
    /// It changed something.
    pub changed: bool,
    /// It touched unit files or their enablement: a daemon-reload is needed.
    pub reload: bool,
    /// The units it feeds must be restarted.
    pub restart: bool,
    /// It asked for a unit to be started or stopped.
    pub run_state: bool,
}

/// The effect of what one change touched (or would touch): the one rule, for the runner
/// (from the journaled pre-images) and the dry run (from the mutations) alike.
pub fn effect(touched: impl IntoIterator<Item = Touched>) -> Effect {
    let mut e = Effect::default();
    for t in touched {
        e.changed = true;
        match t {
            Touched::File(path) => {
                e.reload |= is_unit_path(&path);
                e.restart = true;
            }
            Touched::UnitFile => e.reload = true,
            Touched::UnitRun => e.run_state = true,
            Touched::Package => {
                e.reload = true;
                e.restart = true;
            }
            Touched::Sysctl | Touched::Command => e.restart = true,
        }
    }
    e
}

/// The effect of a change that journaled these pre-images (one per mutated target).
pub fn effect_of_preimages(preimages: &[Preimage]) -> Effect {
    effect(preimages.iter().map(crate::steps::preimage_touched))
}

/// The effect a change would have with these mutations (the dry run).
pub fn effect_of_mutations(mutations: &[Mutation]) -> Effect {
    effect(mutations.iter().map(Mutation::touched))
}

/// The units a change feeds: the unit itself for a unit change (restarted when its file or
/// drop-in changed), `restartUnits` and the kubelet for the others.
pub fn fed_units(change: &Change) -> Vec<String> {
    change.spec().fed_units()
}

/// What must hold for a unit at the end of the Restarting phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Want {
    /// Restarted, because something it depends on changed; started too when it is stopped
    /// and `start_if_stopped` (the plan asks for it to run).
    Restart {
        /// The plan wants the unit running.
        start_if_stopped: bool,
    },
    /// Running (started if it is not).
    Running,
    /// Stopped (stopped if it is not).
    Stopped,
}

/// One unit the Restarting phase looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitWant {
    /// The unit.
    pub unit: String,
    /// What must hold.
    pub want: Want,
    /// Why (`changes[0] kubeletConfig /var/lib/kubelet/config.yaml`), for restarts.
    pub why: Vec<String>,
}

/// The Restarting phase of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnitPlan {
    /// One daemon-reload first.
    pub reload: bool,
    /// The units, stops first, then in the order the plan first names them.
    pub units: Vec<UnitWant>,
}

impl UnitPlan {
    /// True when there is nothing to reload, restart, start or stop.
    pub fn is_empty(&self) -> bool {
        !self.reload && self.units.is_empty()
    }

    /// The units that would be restarted.
    pub fn restarts(&self) -> Vec<String> {
        self.units
            .iter()
            .filter(|u| matches!(u.want, Want::Restart { .. }))
            .map(|u| u.unit.clone())
            .collect()
    }
}

/// Decides the Restarting phase from the plan, the effect of each change that ran (by index),
/// and the index of the last change that rebooted the node in this run, if any (changes
/// before it were made live by the reboot).
pub fn plan_units(
    plan: &Plan,
    effects: &BTreeMap<usize, Effect>,
    rebooted_at: Option<usize>,
) -> UnitPlan {
    let after_reboot = |i: usize| rebooted_at.is_none_or(|r| i > r);
    let mut order: Vec<String> = Vec::new();
    let mut desired: BTreeMap<String, UnitState> = BTreeMap::new();
    let mut why: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut reload = false;
    // Units whose change found them in the wrong run state (before or after a reboot: the
    // state is checked again when the job is decided).
    let mut run_state: BTreeSet<String> = BTreeSet::new();
    for (i, change) in plan.changes.iter().enumerate() {
        for u in fed_units(change) {
            if !order.contains(&u) {
                order.push(u);
            }
        }
        if let Some((unit, state)) = change.spec().run_state() {
            desired.insert(unit.to_string(), state);
        }
        let Some(effect) = effects.get(&i).filter(|e| e.changed) else {
            continue;
        };
        if let (Some((unit, _)), true) = (change.spec().run_state(), effect.run_state) {
            run_state.insert(unit.to_string());
        }
        if !after_reboot(i) {
            continue;
        }
        reload |= effect.reload;
        if effect.restart {
            for u in fed_units(change) {
                why.entry(u).or_default().push(format!(
                    "changes[{i}] {} {}",
                    change.kind(),
                    change.target()
                ));
            }
        }
    }
    let mut stops = Vec::new();
    let mut rest = Vec::new();
    for u in order {
        let reasons = why.remove(&u).unwrap_or_default();
        // After a reboot every desired state is checked again: the boot reset them.
        let asked = run_state.contains(&u) || rebooted_at.is_some();
        let want = match desired.get(&u) {
            // A unit that must stay stopped is never restarted.
            Some(UnitState::Stopped) if asked || !reasons.is_empty() => Want::Stopped,
            Some(UnitState::Running) if !reasons.is_empty() => Want::Restart {
                start_if_stopped: true,
            },
            Some(UnitState::Running) if asked => Want::Running,
            None if !reasons.is_empty() => Want::Restart {
                start_if_stopped: false,
            },
            _ => continue,
        };
        let entry = UnitWant {
            unit: u,
            want,
            why: reasons,
        };
        if entry.want == Want::Stopped {
            stops.push(entry);
        } else {
            rest.push(entry);
        }
    }
    stops.extend(rest);
    UnitPlan {
        reload,
        units: stops,
    }
}

/// What to do for one unit, given its state now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// It is as wanted; nothing to queue or record.
    Nothing,
    /// Queue this job.
    Queue(UnitJob),
    /// Nothing to queue, but worth recording (a restart not done, and why).
    Skip(String),
}

/// Decides the job for a unit (pure).
pub fn decide(unit: &str, want: &Want, now: &Observed) -> Decision {
    match want {
        Want::Stopped if is_stopped(now) => Decision::Nothing,
        Want::Stopped => Decision::Queue(UnitJob::Stop),
        Want::Running if is_running(now) => Decision::Nothing,
        Want::Running => Decision::Queue(UnitJob::Start),
        Want::Restart { start_if_stopped } => {
            let stopped = now.active_state == ActiveState::Inactive;
            if !stopped || now.load_state == LoadState::NotFound {
                // Running, starting, failed, or unknown to systemd (the restart says so).
                Decision::Queue(UnitJob::Restart)
            } else if *start_if_stopped {
                Decision::Queue(UnitJob::Start)
            } else {
                Decision::Skip(format!(
                    "{unit} not restarted: it is not running ({}/{}) and the plan does not ask \
                     for state: running",
                    now.active_state, now.sub_state
                ))
            }
        }
    }
}

/// A unit job of the run as journaled (folded by the table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    /// The unit.
    pub unit: String,
    /// The job.
    pub job: UnitJob,
    /// During rollback.
    pub rollback: bool,
    /// The unit before the job (default for legacy records).
    pub before: crate::host::systemd::UnitBefore,
    /// How it ended; `None` while it may still be running (or after a crash).
    pub outcome: Option<crate::journal::UnitJobOutcome>,
    /// What was said about it.
    pub message: String,
    /// A `UnitJobStarted` was journaled for it (a job was or may have been queued).
    pub queued: bool,
}

/// One job of rollback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Undo {
    /// The unit.
    pub unit: String,
    /// The job.
    pub job: UnitJob,
    /// Clear the unit's failed state afterwards (a unit the plan started, now stopped again).
    pub reset_failed: bool,
}

/// The jobs that undo the forward jobs of a run, whether they finished, failed or may have
/// been cut short: a unit the plan started is stopped again (when it was not running
/// before), one it stopped is started again (when it was running), and every unit it
/// restarted — or tried to — is restarted again on the restored files. Stops first, then
/// the rest in forward order; one job per unit.
pub fn undo_jobs(forward: &[JobRecord]) -> Vec<Undo> {
    let mut seen = BTreeSet::new();
    let mut stops = Vec::new();
    let mut rest = Vec::new();
    for r in forward.iter().filter(|r| !r.rollback && r.queued) {
        if !seen.insert(r.unit.clone()) {
            continue;
        }
        let undo = match r.job {
            UnitJob::Start if !r.before.was_active() => Undo {
                unit: r.unit.clone(),
                job: UnitJob::Stop,
                reset_failed: true,
            },
            UnitJob::Stop if r.before.was_active() => Undo {
                unit: r.unit.clone(),
                job: UnitJob::Start,
                reset_failed: false,
            },
            UnitJob::Restart => Undo {
                unit: r.unit.clone(),
                job: UnitJob::Restart,
                reset_failed: false,
            },
            _ => continue,
        };
        if undo.job == UnitJob::Stop {
            stops.push(undo);
        } else {
            rest.push(undo);
        }
    }
    stops.extend(rest);
    stops
}

/// Whether the reboot change at `index` must reboot: when a change since the previous
/// reboot change (or the start of the plan) changed something, or when nothing precedes it
/// at all (a plan that only asks for a reboot). A reboot after changes that were all
/// already in place is skipped, like a restart.
pub fn reboot_needed(plan: &Plan, index: usize, changed: &BTreeSet<usize>) -> bool {
    let start = plan.changes[..index]
        .iter()
        .rposition(|c| matches!(c, Change::Reboot(_)))
        .map_or(0, |r| r + 1);
    start == index || (start..index).any(|i| changed.contains(&i))
}

/// The disruption of one change that would change something, from its effect.
pub fn disruption_of(change: &Change, effect: &Effect) -> Disruption {
    if let Some(declared) = change.spec().declared_disruption() {
        return declared;
    }
    let restarts = !change.spec().restart_units().is_empty();
    if (effect.restart && restarts) || effect.run_state {
        Disruption::Restart
    } else if effect.reload {
        Disruption::DaemonReload
    } else {
        Disruption::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::systemd::UnitBefore;
    use crate::journal::UnitJobOutcome;
    use inplace_plan::{Limits, parse_plan};

    fn plan(changes: &str) -> Plan {
        let text = format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: t\nchanges:\n{changes}");
        parse_plan(text.as_bytes(), "test", &Limits::default()).expect("valid plan")
    }

    fn changed(indices: &[usize], e: Effect) -> BTreeMap<usize, Effect> {
        indices.iter().map(|i| (*i, e)).collect()
    }

    const FILE: Effect = Effect {
        changed: true,
        reload: false,
        restart: true,
        run_state: false,
    };
    const UNIT_FILE: Effect = Effect {
        changed: true,
        reload: true,
        restart: true,
        run_state: false,
    };

    fn names(p: &UnitPlan) -> Vec<(String, Want)> {
        p.units
            .iter()
            .map(|u| (u.unit.clone(), u.want.clone()))
            .collect()
    }

    #[test]
    fn each_unit_once_in_plan_order_and_only_when_an_input_changed() {
        let p = plan(
            "  - file: {path: /etc/containerd/config.toml, content: x, restartUnits: [containerd.service]}\n\
             \x20 - kubeletConfig: {mergePatch: {maxPods: 120}}\n\
             \x20 - kubeletFlags: {set: {v: '2'}}\n\
             \x20 - file: {path: /etc/kubernetes/a, content: x, restartUnits: [kubelet.service, containerd.service]}\n",
        );
        let up = plan_units(&p, &changed(&[1, 2, 3], FILE), None);
        assert!(!up.reload);
        let restart = Want::Restart {
            start_if_stopped: false,
        };
        assert_eq!(
            names(&up),
            [
                ("containerd.service".to_string(), restart.clone()),
                ("kubelet.service".to_string(), restart)
            ]
        );
        assert_eq!(up.units[1].why.len(), 3, "{:?}", up.units[1].why);
        // Nothing changed: nothing to do.
        assert!(plan_units(&p, &BTreeMap::new(), None).is_empty());
        // Only the containerd file changed.
        let up = plan_units(&p, &changed(&[0], FILE), None);
        assert_eq!(up.restarts(), ["containerd.service"]);
    }

    #[test]
    fn unit_files_reload_once_and_desired_states_win() {
        let p = plan(
            "  - unit: {name: b.service, content: '[Service]\\nExecStart=/bin/true\\n', state: running}\n\
             \x20 - unit: {name: a.service, dropIn: {name: 10-x.conf, content: x}, state: stopped}\n\
             \x20 - unit: {name: c.service, enabled: true}\n\
             \x20 - unit: {name: d.service, state: running}\n\
             \x20 - unit: {name: e.service, state: stopped}\n",
        );
        let mut effects = changed(&[0, 1], UNIT_FILE);
        effects.insert(
            2,
            Effect {
                changed: true,
                reload: true,
                restart: false,
                run_state: false,
            },
        );
        effects.insert(
            3,
            Effect {
                changed: true,
                run_state: true,
                ..Effect::default()
            },
        );
        let up = plan_units(&p, &effects, None);
        assert!(up.reload);
        assert_eq!(
            names(&up),
            [
                ("a.service".to_string(), Want::Stopped),
                (
                    "b.service".to_string(),
                    Want::Restart {
                        start_if_stopped: true
                    }
                ),
                ("d.service".to_string(), Want::Running),
            ],
            "enabling c.service restarts nothing; stops come first; e.service was stopped already"
        );
    }

    #[test]
    fn changes_before_a_reboot_cause_no_restart_or_reload() {
        let p = plan(
            "  - unit: {name: x.service, dropIn: {name: 10-x.conf, content: x}}\n\
             \x20 - reboot: {reason: kernel}\n\
             \x20 - kubeletConfig: {mergePatch: {maxPods: 120}}\n",
        );
        let mut effects = changed(&[0], UNIT_FILE);
        effects.insert(2, FILE);
        let up = plan_units(&p, &effects, Some(1));
        assert!(!up.reload);
        assert_eq!(up.restarts(), ["kubelet.service"]);
        let all = plan_units(&p, &effects, None);
        assert!(all.reload);
        assert_eq!(all.restarts(), ["x.service", "kubelet.service"]);
    }

    #[test]
    fn a_changed_package_reloads_systemd_and_kubeadm_alone_does_not() {
        let other = |kind: &str| Preimage::Other {
            kind: kind.to_string(),
            data: serde_json::json!({}),
        };
        let pkg = effect_of_preimages(&[other(crate::steps::package::PREIMAGE_KIND)]);
        assert!(pkg.changed && pkg.reload && pkg.restart, "{pkg:?}");
        let kubeadm = effect_of_preimages(&[other(crate::steps::kubeadm::PREIMAGE_KIND)]);
        assert!(kubeadm.restart && !kubeadm.reload, "{kubeadm:?}");

        // The version bump: one reload, then one kubelet restart for its two inputs.
        let p = plan(
            "  - package: {name: kubeadm, version: 1.31.2-1.1, hold: true}\n\
             \x20 - kubeadmUpgradeNode: {}\n\
             \x20 - package: {name: kubelet, version: 1.31.2-1.1, hold: true}\n\
             \x20 - package: {name: kubectl, version: 1.31.2-1.1, hold: true}\n",
        );
        let mut effects = changed(&[0, 2, 3], pkg);
        effects.insert(1, kubeadm);
        let up = plan_units(&p, &effects, None);
        assert!(up.reload);
        assert_eq!(up.restarts(), ["kubelet.service"]);
        assert_eq!(up.units[0].why.len(), 2, "{:?}", up.units[0].why);
        // Only kubeadm upgrade node ran (an unfinished bump): a restart, no reload.
        let up = plan_units(&p, &changed(&[1], kubeadm), None);
        assert!(!up.reload);
        assert_eq!(up.restarts(), ["kubelet.service"]);
    }

    fn observed(active: &str, sub: &str, load: LoadState) -> Observed {
        Observed {
            unit: "u.service".into(),
            load_state: load,
            active_state: ActiveState::parse(active),
            sub_state: sub.into(),
            result: None,
            invocation_id: None,
            n_restarts: None,
            status_text: None,
            main_pid: None,
            job: None,
        }
    }

    #[test]
    fn decisions_follow_the_unit_state() {
        let running = observed("active", "running", LoadState::Loaded);
        let dead = observed("inactive", "dead", LoadState::Loaded);
        let failed = observed("failed", "failed", LoadState::Loaded);
        let missing = observed("inactive", "dead", LoadState::NotFound);
        let restart = Want::Restart {
            start_if_stopped: false,
        };
        let q = Decision::Queue;
        assert_eq!(decide("u", &restart, &running), q(UnitJob::Restart));
        assert_eq!(decide("u", &restart, &failed), q(UnitJob::Restart));
        assert_eq!(decide("u", &restart, &missing), q(UnitJob::Restart));
        assert!(
            matches!(decide("u", &restart, &dead), Decision::Skip(m) if m.contains("not running"))
        );
        let start = Want::Restart {
            start_if_stopped: true,
        };
        assert_eq!(decide("u", &start, &dead), q(UnitJob::Start));
        assert_eq!(decide("u", &Want::Running, &running), Decision::Nothing);
        assert_eq!(decide("u", &Want::Running, &failed), q(UnitJob::Start));
        assert_eq!(decide("u", &Want::Stopped, &running), q(UnitJob::Stop));
        assert_eq!(decide("u", &Want::Stopped, &failed), Decision::Nothing);
    }

    fn rec(unit: &str, job: UnitJob, active: &str, outcome: Option<UnitJobOutcome>) -> JobRecord {
        JobRecord {
            unit: unit.into(),
            job,
            rollback: false,
            before: UnitBefore {
                active_state: active.into(),
                sub_state: String::new(),
                invocation_id: None,
            },
            outcome,
            message: String::new(),
            queued: true,
        }
    }

    #[test]
    fn rollback_undoes_every_queued_job() {
        let done = Some(UnitJobOutcome::Done);
        let failed = Some(UnitJobOutcome::Failed);
        let forward = [
            rec("kubelet.service", UnitJob::Restart, "active", failed),
            rec("new.service", UnitJob::Start, "inactive", None),
            rec("already.service", UnitJob::Start, "active", done),
            rec("old.service", UnitJob::Stop, "active", done),
        ];
        let undo = undo_jobs(&forward);
        let got: Vec<(&str, UnitJob, bool)> = undo
            .iter()
            .map(|u| (u.unit.as_str(), u.job, u.reset_failed))
            .collect();
        assert_eq!(
            got,
            [
                ("new.service", UnitJob::Stop, true),
                ("kubelet.service", UnitJob::Restart, false),
                ("old.service", UnitJob::Start, false),
            ]
        );
        let mut skipped = rec("x.service", UnitJob::Restart, "inactive", None);
        skipped.queued = false;
        assert!(
            undo_jobs(&[skipped]).is_empty(),
            "a skipped restart is not undone"
        );
    }

    #[test]
    fn a_reboot_only_follows_changes_that_changed_something() {
        let p = plan(
            "  - file: {path: /etc/kubernetes/a, content: x}\n\
             \x20 - reboot: {reason: one}\n\
             \x20 - file: {path: /etc/kubernetes/b, content: x}\n\
             \x20 - reboot: {reason: two}\n",
        );
        let set = |v: &[usize]| v.iter().copied().collect::<BTreeSet<usize>>();
        assert!(reboot_needed(&p, 1, &set(&[0])));
        assert!(!reboot_needed(&p, 1, &set(&[])));
        assert!(
            !reboot_needed(&p, 3, &set(&[0, 1])),
            "only since the last reboot"
        );
        assert!(reboot_needed(&p, 3, &set(&[2])));
        let only = plan("  - reboot: {reason: asked}\n");
        assert!(reboot_needed(&only, 0, &set(&[])));
    }

    #[test]
    fn disruption_classes() {
        let p = plan(
            "  - kubeletConfig: {mergePatch: {maxPods: 120}}\n\
             \x20 - unit: {name: c.service, enabled: true}\n\
             \x20 - unit: {name: d.service, state: running}\n\
             \x20 - file: {path: /etc/kubernetes/x, content: x}\n\
             \x20 - file: {path: /etc/systemd/system/e.service.d/x.conf, content: x}\n\
             \x20 - reboot: {}\n",
        );
        let reload_only = Effect {
            changed: true,
            reload: true,
            restart: false,
            run_state: false,
        };
        let run = Effect {
            changed: true,
            run_state: true,
            ..Effect::default()
        };
        let c = &p.changes;
        assert_eq!(disruption_of(&c[0], &FILE), Disruption::Restart);
        assert_eq!(disruption_of(&c[1], &reload_only), Disruption::DaemonReload);
        assert_eq!(disruption_of(&c[2], &run), Disruption::Restart);
        assert_eq!(disruption_of(&c[3], &FILE), Disruption::None);
        assert_eq!(disruption_of(&c[4], &UNIT_FILE), Disruption::DaemonReload);
        assert_eq!(disruption_of(&c[5], &Effect::default()), Disruption::Reboot);
    }
}
