//! The drain before a disruptive plan, as pure decisions (no I/O): whether a plan drains
//! ([`drain_reason`]), how each Pod on the node is treated ([`classify`]), which Pods one
//! call evicts ([`Round`]) and what the hook says ([`progress_message`]). The I/O (the
//! workload cluster's Node, Pods, Evictions) is in [`super::workload`]; the handlers call
//! both.
//!
//! The rules are Cluster API's own drain on Machine deletion, so an operator configures once
//! (kubernetes-sigs/cluster-api `internal/controllers/machine/drain/drain.go` and
//! `filters.go`; docs/decisions/0011-drain-before-disruptive-plans.md):
//!
//! - Pods are classified by the first filter that decides, in CAPI's order: a Pod whose
//!   deletion began more than [`SKIP_WAIT_FOR_DELETE_SECONDS`] ago is not waited for; a
//!   running DaemonSet Pod whose DaemonSet exists is skipped (an orphan is evicted); a
//!   mirror (static) Pod is skipped; the label `cluster.x-k8s.io/drain: skip` skips,
//!   `wait-completed` waits for the Pod to finish without evicting it; then the first
//!   matching `MachineDrainRule` by name decides (`Drain` with its `order`, `Skip`,
//!   `WaitCompleted`); no rule: `Drain`, order 0.
//! - Only the lowest order still present is evicted (or waited for); higher orders start
//!   when it is gone.
//! - Pods being deleted are waited for, never evicted again.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::Value;

pub use super::settings::{DrainMode, OnTimeout};
use super::translate::lookup;
use inplace_api::pb;

/// On the workload Node: the plan whose drain cordoned it (set only when the updater
/// cordoned it; a Node a person cordoned never carries it).
pub const CORDONED_BY_ANNOTATION: &str = "inplace-agent.github.io/cordoned-for-plan";

/// On the workload Node: the plan being drained for and when its drain began,
/// `<plan id>@<unix seconds>` (what a replica, or a restarted updater, continues from).
pub const DRAIN_ANNOTATION: &str = "inplace-agent.github.io/drain";

/// On the Machine: skip the drain (CAPI's `machine.cluster.x-k8s.io/exclude-node-draining`).
pub const EXCLUDE_ANNOTATION: &str = "machine.cluster.x-k8s.io/exclude-node-draining";

/// On a Pod: `skip` or `wait-completed` (CAPI's `cluster.x-k8s.io/drain`).
pub const DRAIN_LABEL: &str = "cluster.x-k8s.io/drain";

/// On a mirror (static) Pod.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A Pod whose deletion began longer ago than this is not waited for (CAPI's Machine
/// controller sets `SkipWaitForDeleteTimeoutSeconds` to 5 minutes).
pub const SKIP_WAIT_FOR_DELETE_SECONDS: i64 = 300;

/// What a plan does to the node, for the decision: from the agent's `CheckPlan` and the
/// node's kubelet version (`GetNodeInfo`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanEffect {
    /// At least one change would change the node.
    pub would_change: bool,
    /// The plan reboots the node (or its disruption is unknown, which counts as a reboot).
    pub reboots: bool,
    /// The plan moves the Kubernetes version: a Kubernetes package or `kubeadm upgrade
    /// node` would change, or the Machine asks for another version than the kubelet runs.
    pub version_changes: bool,
    /// The units the plan restarts.
    pub restart_units: Vec<String>,
}

impl PlanEffect {
    /// From `CheckPlan`'s answer; `kubernetes_packages` are the packages the version moves,
    /// `version_differs` whether the Machine's version is not the kubelet's.
    pub fn from_check(
        check: &pb::CheckPlanResponse,
        kubernetes_packages: &[String],
        version_differs: bool,
    ) -> PlanEffect {
        let changing = |c: &&pb::ChangeCheck| c.verdict == pb::ChangeVerdict::WouldChange as i32;
        let moves_version = check.changes.iter().filter(changing).any(|c| {
            c.kind == "kubeadmUpgradeNode"
                || (c.kind == "package" && kubernetes_packages.iter().any(|p| p == &c.target))
        });
        PlanEffect {
            would_change: check.would_change,
            reboots: check.would_change
                && (check.disruption == pb::Disruption::Reboot as i32
                    || check.disruption == pb::Disruption::Unspecified as i32),
            version_changes: moves_version || (check.would_change && version_differs),
            restart_units: check.restart_units.clone(),
        }
    }
}

/// Why the plan drains the node, or `None` when it does not: a pure function of the
/// settings and the plan's effect.
pub fn drain_reason(
    mode: DrainMode,
    drain_on_restart_of: &[String],
    effect: &PlanEffect,
) -> Option<String> {
    if !effect.would_change {
        return None;
    }
    match mode {
        DrainMode::Never => None,
        DrainMode::Always => Some("settings.drain is Always".into()),
        DrainMode::Disruptive => {
            if effect.reboots {
                return Some("the plan reboots the node".into());
            }
            if effect.version_changes {
                return Some("the plan changes the Kubernetes version".into());
            }
            effect
                .restart_units
                .iter()
                .find(|u| drain_on_restart_of.iter().any(|d| unit_is(u, d)))
                .map(|u| format!("the plan restarts {u} (settings.drainOnRestartOf)"))
        }
    }
}

/// `CanUpdateMachineSet` (no node to ask): whether the Machines' plans will drain, from the
/// template's changes alone — under `Disruptive` when the version moves (a reboot or a
/// runtime restart shows only on the node; each Machine's `CanUpdateMachine` says), under
/// `Always` when anything changes.
pub fn machine_set_drains(mode: DrainMode, version_changes: bool, changes: bool) -> bool {
    match mode {
        DrainMode::Never => false,
        DrainMode::Disruptive => version_changes,
        DrainMode::Always => changes,
    }
}

/// `containerd` names `containerd.service`.
fn unit_is(unit: &str, name: &str) -> bool {
    unit == name || unit.strip_suffix(".service") == Some(name)
}

// === Pods ===

/// What the drain reads of a Pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Whether it is a mirror Pod.
    pub mirror: bool,
    /// Its controller's kind and name (the ownerReference with `controller: true`).
    pub controller: Option<(String, String)>,
    /// `status.phase`.
    pub phase: String,
    /// `metadata.deletionTimestamp` in Unix seconds.
    pub deleting_since: Option<i64>,
}

impl Pod {
    /// From the API server's JSON.
    pub fn from_json(v: &Value) -> Pod {
        let s = |path: &[&str]| {
            lookup(v, path)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let controller = lookup(v, &["metadata", "ownerReferences"])
            .and_then(Value::as_array)
            .and_then(|refs| {
                refs.iter()
                    .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))
            })
            .map(|r| {
                let f = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                (f("kind"), f("name"))
            });
        Pod {
            namespace: s(&["metadata", "namespace"]),
            name: s(&["metadata", "name"]),
            labels: string_map(lookup(v, &["metadata", "labels"])),
            mirror: lookup(v, &["metadata", "annotations", MIRROR_ANNOTATION]).is_some(),
            controller,
            phase: s(&["status", "phase"]),
            deleting_since: lookup(v, &["metadata", "deletionTimestamp"])
                .and_then(Value::as_str)
                .and_then(unix_seconds),
        }
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn finished(&self) -> bool {
        self.phase == "Succeeded" || self.phase == "Failed"
    }

    /// The DaemonSet that controls it, when one does.
    pub fn daemon_set(&self) -> Option<&str> {
        self.controller
            .as_ref()
            .filter(|(kind, _)| kind == "DaemonSet")
            .map(|(_, name)| name.as_str())
    }
}

/// A JSON object of strings as a map (labels, annotations, matchLabels).
pub fn string_map(v: Option<&Value>) -> BTreeMap<String, String> {
    v.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// RFC 3339 `YYYY-MM-DDTHH:MM:SS[.frac]Z` (as the API server writes times) → Unix seconds.
pub fn unix_seconds(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || !s.ends_with('Z') {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (h, mi, se) = (n(11..13)?, n(14..16)?, n(17..19)?);
    let month = time::Month::try_from(u8::try_from(mo).ok()?).ok()?;
    let date = time::Date::from_calendar_date(i32::try_from(y).ok()?, month, u8::try_from(d).ok()?)
        .ok()?;
    // 2440588: the Julian day of 1970-01-01.
    let days = i64::from(date.to_julian_day()) - 2_440_588;
    Some(days * 86400 + h * 3600 + mi * 60 + se)
}

// === Selectors and MachineDrainRules ===

/// A `metav1.LabelSelector`: matchLabels and matchExpressions (In, NotIn, Exists,
/// DoesNotExist). Empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    labels: BTreeMap<String, String>,
    expressions: Vec<(String, String, Vec<String>)>,
}

impl Selector {
    /// From JSON; `Err` names what is wrong (`field` is where it is).
    pub fn from_json(v: Option<&Value>, field: &str) -> Result<Selector, String> {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            return Ok(Selector::default());
        };
        let mut expressions = Vec::new();
        for (i, e) in v
            .get("matchExpressions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let key = e.get("key").and_then(Value::as_str).unwrap_or("");
            let op = e.get("operator").and_then(Value::as_str).unwrap_or("");
            let values: Vec<String> = e
                .get("values")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect();
            if !matches!(op, "In" | "NotIn" | "Exists" | "DoesNotExist") || key.is_empty() {
                return Err(format!(
                    "{field}.matchExpressions[{i}]: operator {op:?} on key {key:?} is not a label selector operator (In, NotIn, Exists, DoesNotExist)"
                ));
            }
            expressions.push((key.to_owned(), op.to_owned(), values));
        }
        Ok(Selector {
            labels: string_map(v.get("matchLabels")),
            expressions,
        })
    }

    /// Whether `labels` match.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.expressions.iter().all(|(k, op, values)| {
                let got = labels.get(k);
                match op.as_str() {
                    "In" => got.is_some_and(|g| values.contains(g)),
                    "NotIn" => got.is_none_or(|g| !values.contains(g)),
                    "Exists" => got.is_some(),
                    _ => got.is_none(),
                }
            })
    }
}

/// A MachineDrainRule's `spec.drain.behavior`, with its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behavior {
    /// Evict, in this order.
    Drain(i32),
    /// Wait for the Pod to finish by itself, in this order.
    WaitCompleted(i32),
    /// Leave it (why, for logs).
    Skip(&'static str),
}

/// A MachineDrainRule that applies to the Machine (its `spec.machines` matched).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Its name (rules apply in name order; the first that matches a Pod decides).
    pub name: String,
    /// What it does.
    pub behavior: Behavior,
    /// `spec.pods`: (selector, namespaceSelector); empty: every Pod.
    pub pods: Vec<(Selector, Selector)>,
}

/// The MachineDrainRules of the Machine's namespace that apply to the Machine, in name
/// order. A rule with a `clusterSelector` is refused: the updater does not read Cluster
/// objects (its RBAC has no `get` on them), and guessing would drain Pods the rule keeps.
pub fn rules_for_machine(
    rules: &[Value],
    machine_labels: &BTreeMap<String, String>,
) -> Result<Vec<Rule>, String> {
    let mut out = Vec::new();
    for r in rules {
        let name = lookup(r, &["metadata", "name"])
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let at = |f: &str| format!("MachineDrainRule {name} {f}");
        let machines = lookup(r, &["spec", "machines"])
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut applies = machines.is_empty();
        for (i, m) in machines.iter().enumerate() {
            let cluster = m.get("clusterSelector").filter(|c| !c.is_null());
            if cluster.is_some_and(|c| c.as_object().is_some_and(|o| !o.is_empty())) {
                return Err(format!(
                    "{}: this updater does not read Cluster objects, so it cannot evaluate a clusterSelector; \
                     select the Machines by their cluster.x-k8s.io/cluster-name label in spec.machines[].selector instead",
                    at(&format!("spec.machines[{i}].clusterSelector"))
                ));
            }
            let selector = Selector::from_json(
                m.get("selector"),
                &at(&format!("spec.machines[{i}].selector")),
            )?;
            applies |= selector.matches(machine_labels);
        }
        if !applies {
            continue;
        }
        let order = lookup(r, &["spec", "drain", "order"])
            .and_then(Value::as_i64)
            .unwrap_or(0) as i32;
        let behavior = match lookup(r, &["spec", "drain", "behavior"]).and_then(Value::as_str) {
            Some("Drain") => Behavior::Drain(order),
            Some("WaitCompleted") => Behavior::WaitCompleted(order),
            Some("Skip") => Behavior::Skip("MachineDrainRule"),
            other => {
                return Err(format!(
                    "{}: {other:?} is not Drain, Skip or WaitCompleted",
                    at("spec.drain.behavior")
                ));
            }
        };
        let mut pods = Vec::new();
        for (i, p) in lookup(r, &["spec", "pods"])
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            pods.push((
                Selector::from_json(p.get("selector"), &at(&format!("spec.pods[{i}].selector")))?,
                Selector::from_json(
                    p.get("namespaceSelector"),
                    &at(&format!("spec.pods[{i}].namespaceSelector")),
                )?,
            ));
        }
        out.push(Rule {
            name,
            behavior,
            pods,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// What the workload cluster says besides the Pods: the DaemonSets that exist (by
/// `namespace/name`) and each namespace's labels.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// `namespace/name` of the DaemonSets controlling Pods on the node that exist.
    pub daemon_sets: HashSet<String>,
    /// Labels of every namespace.
    pub namespaces: HashMap<String, BTreeMap<String, String>>,
    /// Now, in Unix seconds.
    pub now: i64,
}

/// How the drain treats `pod`, by CAPI's filters in CAPI's order (the first to skip or
/// wait decides); `Err` for a Pod that cannot be classified (its namespace is unknown).
pub fn classify(pod: &Pod, rules: &[Rule], cx: &Context) -> Result<Behavior, String> {
    if pod
        .deleting_since
        .is_some_and(|t| cx.now - t > SKIP_WAIT_FOR_DELETE_SECONDS)
    {
        return Ok(Behavior::Skip("deleting for longer than the bound"));
    }
    if let Some(ds) = pod.daemon_set()
        && !pod.finished()
        && cx.daemon_sets.contains(&format!("{}/{ds}", pod.namespace))
    {
        return Ok(Behavior::Skip("DaemonSet"));
    }
    if pod.mirror {
        return Ok(Behavior::Skip("mirror Pod"));
    }
    match pod.labels.get(DRAIN_LABEL).map(String::as_str) {
        Some("skip") => return Ok(Behavior::Skip("label cluster.x-k8s.io/drain: skip")),
        Some("wait-completed") => return Ok(Behavior::WaitCompleted(0)),
        _ => {}
    }
    if rules.is_empty() {
        return Ok(Behavior::Drain(0));
    }
    let Some(ns_labels) = cx.namespaces.get(&pod.namespace) else {
        return Err(format!("Pod {}: its namespace does not exist", pod.key()));
    };
    for rule in rules {
        let applies = rule.pods.is_empty()
            || rule
                .pods
                .iter()
                .any(|(p, n)| p.matches(&pod.labels) && n.matches(ns_labels));
        if applies {
            return Ok(rule.behavior);
        }
    }
    Ok(Behavior::Drain(0))
}

/// One call's share of the drain: what to evict now and what is still waited for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Round {
    /// Pods to evict now (the lowest order, not being deleted), by `namespace/name`.
    pub evict: Vec<String>,
    /// Pods being deleted (evicted earlier), waited for.
    pub terminating: Vec<String>,
    /// Pods waited for to complete now (WaitCompleted at the lowest order).
    pub wait_completed: Vec<String>,
    /// Pods of higher orders, evicted or waited for once the lower ones are gone.
    pub later: Vec<String>,
}

impl Round {
    /// From the classified Pods (sorted by `namespace/name`, as CAPI sorts).
    pub fn of(pods: &[(Pod, Behavior)]) -> Round {
        let order_of = |b: &Behavior| match b {
            Behavior::Drain(o) | Behavior::WaitCompleted(o) => Some(*o),
            Behavior::Skip(_) => None,
        };
        let min = pods.iter().filter_map(|(_, b)| order_of(b)).min();
        let mut sorted: Vec<&(Pod, Behavior)> = pods.iter().collect();
        sorted.sort_by_key(|(p, _)| p.key());
        let mut round = Round::default();
        for (pod, behavior) in sorted {
            let now = order_of(behavior) == min;
            match behavior {
                Behavior::Skip(_) => {}
                Behavior::Drain(_) if pod.deleting_since.is_some() => {
                    round.terminating.push(pod.key())
                }
                Behavior::Drain(_) if now => round.evict.push(pod.key()),
                Behavior::WaitCompleted(_) if now => round.wait_completed.push(pod.key()),
                _ => round.later.push(pod.key()),
            }
        }
        round
    }

    /// Pods the drain still waits for (every one but the skipped).
    pub fn left(&self) -> usize {
        self.evict.len() + self.terminating.len() + self.wait_completed.len() + self.later.len()
    }

    /// Every Pod still waited for, in order.
    pub fn pods(&self) -> Vec<&str> {
        self.evict
            .iter()
            .chain(&self.terminating)
            .chain(&self.wait_completed)
            .chain(&self.later)
            .map(String::as_str)
            .collect()
    }
}

/// The hook's message while the drain goes on, e.g. `draining node worker-7: 3 pods left;
/// default/web-0 blocked by PodDisruptionBudget default/web`. `left` counts the Pods still
/// on the node after this call's evictions; `blocked` are (Pod, PDB) pairs whose eviction
/// was refused.
pub fn progress_message(
    node: &str,
    left: usize,
    blocked: &[(String, String)],
    round: &Round,
) -> String {
    let mut m = format!(
        "draining node {node}: {left} {} left",
        if left == 1 { "pod" } else { "pods" }
    );
    for (pod, pdb) in blocked.iter().take(3) {
        m.push_str(&format!("; {pod} blocked by PodDisruptionBudget {pdb}"));
    }
    if blocked.len() > 3 {
        m.push_str(&format!("; {} more blocked", blocked.len() - 3));
    }
    if !round.wait_completed.is_empty() {
        m.push_str(&format!(
            "; waiting for {} to complete",
            list(&round.wait_completed, 3)
        ));
    }
    if !round.later.is_empty() {
        m.push_str(&format!("; then {}", list(&round.later, 3)));
    }
    m
}

/// The first `n` names, and how many more.
pub fn list(names: &[String], n: usize) -> String {
    let mut s = names.iter().take(n).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > n {
        s.push_str(&format!(" and {} more", names.len() - n));
    }
    s
}

/// The value of [`DRAIN_ANNOTATION`] for `plan` begun at `since`.
pub fn drain_mark(plan: &str, since: i64) -> String {
    format!("{plan}@{since}")
}

/// (plan, since) from a [`DRAIN_ANNOTATION`] value.
pub fn parse_drain_mark(v: &str) -> Option<(&str, i64)> {
    let (plan, since) = v.rsplit_once('@')?;
    Some((plan, since.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn effect(reboots: bool, version: bool, units: &[&str]) -> PlanEffect {
        PlanEffect {
            would_change: true,
            reboots,
            version_changes: version,
            restart_units: units.iter().map(|u| (*u).to_owned()).collect(),
        }
    }

    #[test]
    fn the_decision_follows_the_mode_and_the_plans_effect() {
        let runtime = vec!["containerd".to_owned()];
        let d = |mode, e: &PlanEffect| drain_reason(mode, &runtime, e);
        let files = effect(false, false, &[]);
        let kubelet = effect(false, false, &["kubelet.service"]);
        assert_eq!(d(DrainMode::Disruptive, &files), None);
        assert_eq!(
            d(DrainMode::Disruptive, &kubelet),
            None,
            "a kubelet restart keeps pods"
        );
        assert_eq!(
            d(
                DrainMode::Disruptive,
                &effect(false, false, &["containerd.service"])
            )
            .as_deref(),
            Some("the plan restarts containerd.service (settings.drainOnRestartOf)")
        );
        assert_eq!(
            d(DrainMode::Disruptive, &effect(true, false, &[])).as_deref(),
            Some("the plan reboots the node")
        );
        assert_eq!(
            d(
                DrainMode::Disruptive,
                &effect(false, true, &["kubelet.service"])
            )
            .as_deref(),
            Some("the plan changes the Kubernetes version")
        );
        assert_eq!(d(DrainMode::Never, &effect(true, true, &[])), None);
        assert!(d(DrainMode::Always, &files).is_some());
        assert!(machine_set_drains(DrainMode::Disruptive, true, true));
        assert!(!machine_set_drains(DrainMode::Disruptive, false, true));
        assert!(machine_set_drains(DrainMode::Always, false, true));
        assert!(!machine_set_drains(DrainMode::Always, false, false));
        assert!(!machine_set_drains(DrainMode::Never, true, true));
        let unchanged = PlanEffect::default();
        assert_eq!(
            d(DrainMode::Always, &unchanged),
            None,
            "nothing changes: no drain"
        );
    }

    #[test]
    fn the_effect_reads_check_plan() {
        let change = |kind: &str, target: &str, verdict: pb::ChangeVerdict| pb::ChangeCheck {
            kind: kind.into(),
            target: target.into(),
            verdict: verdict as i32,
            ..Default::default()
        };
        let packages = vec!["kubeadm".to_owned(), "kubelet".to_owned()];
        let mut check = pb::CheckPlanResponse {
            would_change: true,
            disruption: pb::Disruption::Restart as i32,
            restart_units: vec!["kubelet.service".into()],
            changes: vec![
                change("file", "/etc/x", pb::ChangeVerdict::WouldChange),
                change("package", "kubelet", pb::ChangeVerdict::Unchanged),
            ],
            ..Default::default()
        };
        let e = PlanEffect::from_check(&check, &packages, false);
        assert!(!e.version_changes && !e.reboots);
        check.changes[1].verdict = pb::ChangeVerdict::WouldChange as i32;
        assert!(PlanEffect::from_check(&check, &packages, false).version_changes);
        check.changes[1].verdict = pb::ChangeVerdict::Unchanged as i32;
        assert!(PlanEffect::from_check(&check, &packages, true).version_changes);
        check.disruption = pb::Disruption::Unspecified as i32;
        assert!(PlanEffect::from_check(&check, &packages, false).reboots);
        check.would_change = false;
        let e = PlanEffect::from_check(&check, &packages, true);
        assert!(
            !e.reboots && !e.version_changes,
            "a plan already applied changes nothing"
        );
    }

    fn pod(v: Value) -> Pod {
        Pod::from_json(&v)
    }

    fn cx() -> Context {
        Context {
            daemon_sets: ["kube-system/kube-proxy".to_owned()].into(),
            namespaces: [
                ("default".to_owned(), BTreeMap::new()),
                (
                    "db".to_owned(),
                    [("tier".to_owned(), "data".to_owned())].into(),
                ),
            ]
            .into(),
            now: 1_000_000,
        }
    }

    #[test]
    fn daemon_set_mirror_label_and_deleted_pods_are_not_evicted() {
        let ds = pod(
            json!({"metadata": {"namespace": "kube-system", "name": "kube-proxy-x",
            "ownerReferences": [{"kind": "DaemonSet", "name": "kube-proxy", "controller": true}]},
            "status": {"phase": "Running"}}),
        );
        assert_eq!(classify(&ds, &[], &cx()), Ok(Behavior::Skip("DaemonSet")));
        let mut orphan = ds.clone();
        orphan.controller = Some(("DaemonSet".into(), "gone".into()));
        assert_eq!(
            classify(&orphan, &[], &cx()),
            Ok(Behavior::Drain(0)),
            "orphans go"
        );
        let mut done = ds.clone();
        done.phase = "Succeeded".into();
        assert_eq!(
            classify(&done, &[], &cx()),
            Ok(Behavior::Drain(0)),
            "finished ones go"
        );
        let mirror = pod(
            json!({"metadata": {"namespace": "kube-system", "name": "etcd-n",
            "annotations": {MIRROR_ANNOTATION: "abc"}}}),
        );
        assert_eq!(
            classify(&mirror, &[], &cx()),
            Ok(Behavior::Skip("mirror Pod"))
        );
        let labelled = pod(json!({"metadata": {"namespace": "default", "name": "a",
            "labels": {DRAIN_LABEL: "skip"}}}));
        assert!(matches!(
            classify(&labelled, &[], &cx()),
            Ok(Behavior::Skip(_))
        ));
        let waits = pod(json!({"metadata": {"namespace": "default", "name": "a",
            "labels": {DRAIN_LABEL: "wait-completed"}}}));
        assert_eq!(classify(&waits, &[], &cx()), Ok(Behavior::WaitCompleted(0)));
        let stuck = pod(json!({"metadata": {"namespace": "default", "name": "a",
            "deletionTimestamp": "1970-01-12T13:00:00Z"}}));
        assert_eq!(stuck.deleting_since, Some(11 * 86400 + 13 * 3600));
        assert!(matches!(
            classify(&stuck, &[], &cx()),
            Ok(Behavior::Skip(_))
        ));
        let mut fresh = stuck.clone();
        fresh.deleting_since = Some(cx().now - 10);
        assert_eq!(
            classify(&fresh, &[], &cx()),
            Ok(Behavior::Drain(0)),
            "waited for"
        );
    }

    #[test]
    fn machine_drain_rules_apply_by_machine_and_pod_in_name_order() {
        let machine: BTreeMap<String, String> = [("role".to_owned(), "worker".to_owned())].into();
        let rules = rules_for_machine(
            &[
                json!({"metadata": {"name": "b-db-last"}, "spec": {"drain": {"behavior": "Drain", "order": 10},
                    "pods": [{"namespaceSelector": {"matchLabels": {"tier": "data"}}}]}}),
                json!({"metadata": {"name": "a-keep"}, "spec": {"drain": {"behavior": "Skip"},
                    "pods": [{"selector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["agent"]}]}}]}}),
                json!({"metadata": {"name": "c-other-machines"}, "spec": {"drain": {"behavior": "Skip"},
                    "machines": [{"selector": {"matchLabels": {"role": "control-plane"}}}]}}),
                json!({"metadata": {"name": "d-jobs"}, "spec": {"drain": {"behavior": "WaitCompleted"},
                    "pods": [{"selector": {"matchLabels": {"job": "batch"}}}]}}),
            ],
            &machine,
        )
        .unwrap();
        assert_eq!(
            rules.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["a-keep", "b-db-last", "d-jobs"]
        );
        let p = |ns: &str, name: &str, labels: Value| {
            pod(json!({"metadata": {"namespace": ns, "name": name, "labels": labels}}))
        };
        let agent = p("db", "agent", json!({"app": "agent"}));
        let db = p("db", "pg-0", json!({}));
        let web = p("default", "web-0", json!({}));
        let job = p("default", "job-1", json!({"job": "batch"}));
        assert_eq!(
            classify(&agent, &rules, &cx()),
            Ok(Behavior::Skip("MachineDrainRule"))
        );
        assert_eq!(classify(&db, &rules, &cx()), Ok(Behavior::Drain(10)));
        assert_eq!(classify(&web, &rules, &cx()), Ok(Behavior::Drain(0)));
        assert_eq!(
            classify(&job, &rules, &cx()),
            Ok(Behavior::WaitCompleted(0))
        );
        let nowhere = p("gone", "x", json!({}));
        assert!(
            classify(&nowhere, &rules, &cx())
                .unwrap_err()
                .contains("gone/x")
        );

        let classified: Vec<(Pod, Behavior)> = [db.clone(), web.clone(), job.clone(), agent]
            .into_iter()
            .map(|p| {
                let b = classify(&p, &rules, &cx()).unwrap();
                (p, b)
            })
            .collect();
        let round = Round::of(&classified);
        assert_eq!(round.evict, ["default/web-0"]);
        assert_eq!(round.wait_completed, ["default/job-1"]);
        assert_eq!(round.later, ["db/pg-0"], "order 10 waits for order 0");
        assert_eq!(round.left(), 3);
        let only_db = Round::of(&[(db, Behavior::Drain(10))]);
        assert_eq!(only_db.evict, ["db/pg-0"], "then the higher order goes");

        let refused = rules_for_machine(
            &[
                json!({"metadata": {"name": "by-cluster"}, "spec": {"drain": {"behavior": "Skip"},
                "machines": [{"clusterSelector": {"matchLabels": {"env": "prod"}}}]}}),
            ],
            &machine,
        )
        .unwrap_err();
        assert!(
            refused.contains("MachineDrainRule by-cluster spec.machines[0].clusterSelector"),
            "{refused}"
        );
        let bad = rules_for_machine(
            &[json!({"metadata": {"name": "odd"}, "spec": {"drain": {"behavior": "Later"}}})],
            &machine,
        )
        .unwrap_err();
        assert!(bad.contains("spec.drain.behavior"), "{bad}");
    }

    #[test]
    fn the_message_names_what_holds_the_drain() {
        let round = Round {
            evict: vec!["default/web-0".into(), "default/web-1".into()],
            terminating: vec!["default/api-0".into()],
            ..Default::default()
        };
        assert_eq!(
            progress_message(
                "worker-7",
                3,
                &[("default/web-0".into(), "default/web".into())],
                &round
            ),
            "draining node worker-7: 3 pods left; default/web-0 blocked by PodDisruptionBudget default/web"
        );
        let waiting = Round {
            wait_completed: vec!["default/job-1".into()],
            later: vec!["db/pg-0".into()],
            ..Default::default()
        };
        assert_eq!(
            progress_message("w", 1, &[], &waiting),
            "draining node w: 1 pod left; waiting for default/job-1 to complete; then db/pg-0"
        );
        assert_eq!(
            parse_drain_mark(&drain_mark("p-1@x", 42)),
            Some(("p-1@x", 42))
        );
        assert_eq!(parse_drain_mark("nonsense"), None);
    }
}
