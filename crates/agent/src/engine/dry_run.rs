//! The dry run: what a plan would do on this node, without changing anything or touching
//! the journal. What an updater needs to answer `CanUpdateMachine` and decide on a drain.

use serde::Serialize;

use std::collections::{BTreeMap, BTreeSet};

use super::EngineConfig;
use super::units;
use crate::host::Host;
use crate::steps;
use inplace_base::ErrorKind;
use inplace_plan::{Change, Disruption, FieldError, Plan};

/// What one change would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ChangeVerdict {
    /// The node differs from the desired state: applying changes it.
    WouldChange,
    /// The node is already in the desired state.
    Unchanged,
    /// This node cannot apply the change (kind not supported, exec disabled).
    Unsupported,
    /// The change does not fit this node (owner unknown, path escapes, file missing).
    Invalid,
}

/// One change in a check report.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DryRunChange {
    /// Index in `changes[]`.
    pub index: u32,
    /// Kind.
    pub kind: String,
    /// What it is about.
    pub target: String,
    /// Result.
    pub result: ChangeVerdict,
    /// Disruption if it changes something.
    pub disruption: Disruption,
    /// What would be done, or why not.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// What differs, field by field (only when asked for: a drift check).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub differences: Vec<inplace_plan::kinds::Difference>,
}

/// One gate in a check report.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DryRunCheck {
    /// Index in `verify[]`.
    pub index: u32,
    /// Kind.
    pub kind: String,
    /// What it checks.
    pub target: String,
    /// Whether this node can run it.
    pub supported: bool,
    /// Why not.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// The dry-run report of a plan (`kind: CheckResult`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DryRunReport {
    /// `inplace.agent/v1`.
    pub api_version: &'static str,
    /// `CheckResult`.
    pub kind: &'static str,
    /// Plan id.
    pub id: String,
    /// Plan digest.
    pub digest: String,
    /// True when every change and gate can be applied on this node.
    pub applicable: bool,
    /// The most disruptive effect of the changes that would change something.
    pub disruption: Disruption,
    /// Units that would be restarted (units a `state` would start or stop are not listed).
    pub restart_units: Vec<String>,
    /// Whether systemd would reload its unit files (once).
    pub daemon_reload: bool,
    /// How this agent manages units (`systemd on ...`, `off`).
    pub services: String,
    /// What could not be read or written on this node while checking (a refused
    /// permission, an I/O error): the node, not the plan, is at fault. Also in the changes'
    /// details; not part of the JSON shape.
    #[serde(skip)]
    pub environment: Vec<String>,
    /// Plan-level problems (node name, accounts).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
    /// Per change.
    pub changes: Vec<DryRunChange>,
    /// Per gate.
    pub checks: Vec<DryRunCheck>,
}

/// Checks a validated plan against the node. Reads only.
pub fn check_plan(config: &EngineConfig, host: &Host, plan: &Plan) -> DryRunReport {
    check(config, host, plan, false)
}

/// [`check_plan`], with each change that would change saying what differs, field by field
/// (a drift check).
pub fn check_plan_explained(config: &EngineConfig, host: &Host, plan: &Plan) -> DryRunReport {
    check(config, host, plan, true)
}

fn check(config: &EngineConfig, host: &Host, plan: &Plan, explain: bool) -> DryRunReport {
    let mut report = DryRunReport {
        api_version: inplace_plan::API_VERSION,
        kind: "CheckResult",
        id: plan.id.clone(),
        digest: plan.digest(),
        applicable: true,
        disruption: Disruption::None,
        restart_units: Vec::new(),
        daemon_reload: false,
        services: host.services_description(),
        environment: Vec::new(),
        errors: Vec::new(),
        changes: Vec::new(),
        checks: Vec::new(),
    };
    if let (Some(node), Some(want)) = (&config.node_name, &plan.node_name)
        && node != want
    {
        report.errors.push(FieldError::new(
            "nodeName",
            format!("plan is for node {want:?}, this is node {node:?}"),
        ));
    }
    let (prepared, field_errors) = match steps::preflight(host, plan) {
        Ok(p) => (Some(p), Vec::new()),
        Err(errors) => (None, errors),
    };
    // Ask systemd once, up front, when the plan needs it: a unit change is not diffed
    // against an unreachable bus (each call would keep reconnecting for a minute).
    let needs_bus = plan
        .changes
        .iter()
        .any(|c| c.spec().needs_services() || !c.restart_units().is_empty())
        || plan
            .verify
            .iter()
            .any(|c| steps::check::unsupported_without_services(&c.probe).is_some());
    let bus_down = match host.services() {
        Some(services) if needs_bus => services.ping().err().map(|e| {
            format!(
                "the plan needs systemd but it is not reachable: {e} (use --services off to \
                 apply without service management)"
            )
        }),
        _ => None,
    };
    if let Some(why) = &bus_down {
        report.errors.push(FieldError::new("", why.clone()));
    }
    let mut effects: BTreeMap<usize, units::Effect> = BTreeMap::new();
    let mut would_change: BTreeSet<usize> = BTreeSet::new();
    let mut last_reboot: Option<usize> = None;
    for (i, change) in plan.changes.iter().enumerate() {
        let mut differences = Vec::new();
        let prefix = format!("changes[{i}].");
        let mine: Vec<String> = field_errors
            .iter()
            .filter(|e| e.field.starts_with(&prefix))
            .map(|e| e.to_string())
            .collect();
        report.environment.extend(
            field_errors
                .iter()
                .filter(|e| e.field.starts_with(&prefix) && e.of_environment())
                .map(|e| e.to_string()),
        );
        let mut disruption = change.spec().disruption();
        let unsupported = config.capabilities.unsupported(change).or_else(|| {
            host.services()
                .is_none()
                .then(|| steps::unsupported_without_services(change))
                .flatten()
        });
        let (result, detail) = if let Some(why) = unsupported {
            (ChangeVerdict::Unsupported, why)
        } else if !mine.is_empty() {
            (ChangeVerdict::Invalid, mine.join("; "))
        } else if let (true, Some(why)) = (change.spec().needs_services(), &bus_down) {
            (ChangeVerdict::Invalid, why.clone())
        } else if let Change::Reboot(_) = change {
            if units::reboot_needed(plan, i, &would_change) {
                last_reboot = Some(i);
                (
                    ChangeVerdict::WouldChange,
                    "reboot the node and resume after it".to_string(),
                )
            } else {
                (
                    ChangeVerdict::Unchanged,
                    "not needed: no change before it would change anything".to_string(),
                )
            }
        } else if let Some(why) = steps::undecided(host, change) {
            (ChangeVerdict::WouldChange, why)
        } else {
            let mut ctx = prepared.as_ref().map(|p| p.ctx(i)).unwrap_or_default();
            ctx.inputs_changed = inplace_plan::kinds::inputs_changed(plan, i, |j| {
                would_change.contains(&(j as usize))
            });
            match steps::diff(host, change, ctx) {
                Ok(d) if d.mutations.is_empty() => {
                    (ChangeVerdict::Unchanged, d.note.unwrap_or_default())
                }
                Ok(d) => {
                    if explain {
                        differences = steps::explain(host, change, &d);
                    }
                    let effect = units::effect_of_mutations(&d.mutations);
                    disruption = units::disruption_of(change, &effect);
                    effects.insert(i, effect);
                    let mut parts: Vec<String> = d.mutations.iter().map(|m| m.describe()).collect();
                    parts.extend(d.note);
                    (ChangeVerdict::WouldChange, parts.join("; "))
                }
                Err(e) => {
                    if matches!(e.kind, ErrorKind::Io | ErrorKind::DiskFull) {
                        report.environment.push(format!(
                            "changes[{i}].{}: {}",
                            change.kind(),
                            e.detail
                        ));
                    }
                    (ChangeVerdict::Invalid, e.detail)
                }
            }
        };
        if result == ChangeVerdict::WouldChange {
            would_change.insert(i);
            report.disruption = report.disruption.max(disruption);
        }
        if matches!(result, ChangeVerdict::Unsupported | ChangeVerdict::Invalid) {
            report.applicable = false;
        }
        report.changes.push(DryRunChange {
            index: i as u32,
            kind: change.kind().to_string(),
            target: change.target(),
            result,
            disruption,
            detail,
            differences,
        });
    }
    let up = units::plan_units(plan, &effects, last_reboot);
    report.daemon_reload = up.reload;
    report.restart_units = up.restarts();
    report.errors.extend(
        field_errors
            .into_iter()
            .filter(|e| !e.field.starts_with("changes[")),
    );
    for (i, c) in plan.verify.iter().enumerate() {
        let why = config.capabilities.unsupported_check(&c.probe).or_else(|| {
            host.services()
                .is_none()
                .then(|| steps::check::unsupported_without_services(&c.probe))
                .flatten()
        });
        if why.is_some() {
            report.applicable = false;
        }
        report.checks.push(DryRunCheck {
            index: i as u32,
            kind: c.probe.key().to_string(),
            target: c.probe.target(),
            supported: why.is_none(),
            detail: why.unwrap_or_default(),
        });
    }
    if !report.errors.is_empty() {
        report.applicable = false;
    }
    report
}
