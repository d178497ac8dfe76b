//! The drain in the `UpdateMachine` flow: [`Updater::drain_before`] before a new plan is
//! submitted (decide, cordon, evict, answer in progress until the node is empty) and
//! [`Updater::after_plan`] on the plan's last answer (uncordon after Succeeded, only when the
//! updater cordoned; say the node stays cordoned after a failure).
//!
//! Never blocking: each call does a round (a few requests, evictions for at most
//! [`EVICTION_BUDGET`] from the drain's start in the call), and more rounds only while its
//! evicted Pods may go within `updateWaitSeconds` ([`DRAIN_LOOK_AGAIN`]), and answers. Never stateful: what the drain has done is on the
//! workload Node ([`CORDONED_BY_ANNOTATION`], [`DRAIN_ANNOTATION`]), so another replica, or
//! a restarted updater, continues it. The memory here ([`Drains`]) only saves requests: the
//! plans whose node needs nothing more after their last answer.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::{Answer, Failure, Updater, bounded, key_of, waiting};
use crate::agent::AgentError;
use crate::drain::{
    Behavior, CORDONED_BY_ANNOTATION, Context, DRAIN_ANNOTATION, DrainMode, EXCLUDE_ANNOTATION,
    OnTimeout, PlanEffect, Pod, Round, classify, drain_mark, drain_reason, list, parse_drain_mark,
    progress_message, rules_for_machine, string_map,
};
use crate::hooks::{Hook, HookRequest, Status, UpdateMachineResponse};
use crate::progress::PlanRef;
use crate::settings::Settings;
use crate::translate::lookup;
use crate::workload::{Evicted, Workload, WorkloadError, Workloads};
use inplace_api::pb;

/// Seconds until CAPI asks again while the node drains.
pub const DRAIN_RETRY_SECONDS: i32 = 5;

/// How long one call spends on evictions (the rest continues on the next call).
pub const EVICTION_BUDGET: Duration = Duration::from_secs(4);

/// The most Machines remembered; beyond, the memory starts afresh (a forgotten entry costs
/// a read of the Node on the plan's last answer).
const MAX_SETTLED: usize = 10_000;

/// What the node still needs after a plan's last answer, by Machine.
#[derive(Debug, Default)]
pub struct Drains {
    /// The workload clusters' clients.
    pub workloads: Workloads,
    settled: Mutex<HashMap<String, Settled>>,
}

/// A plan's node needs nothing more: after `outcome` (`done`, `failure`; `any` for a plan
/// that did not drain) of `attempt` (`None`: of any attempt), with the note its failure
/// answers carry. By attempt, because a plan runs again: a retry, or the repair of a node
/// that drifted from it, may drain where the first attempt did not.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Settled {
    plan: String,
    attempt: Option<u32>,
    outcome: &'static str,
    note: Option<String>,
}

impl Drains {
    fn settle(
        &self,
        key: &str,
        plan: &str,
        attempt: Option<u32>,
        outcome: &'static str,
        note: Option<String>,
    ) {
        let mut m = self.settled.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= MAX_SETTLED && !m.contains_key(key) {
            m.clear();
        }
        m.insert(
            key.to_owned(),
            Settled {
                plan: plan.to_owned(),
                attempt,
                outcome,
                note,
            },
        );
    }

    fn settled(
        &self,
        key: &str,
        plan: &str,
        attempt: u32,
        outcome: &'static str,
    ) -> Option<Settled> {
        self.settled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .filter(|s| {
                s.plan == plan
                    && s.attempt.is_none_or(|a| a == attempt)
                    && (s.outcome == "any" || s.outcome == outcome)
            })
            .cloned()
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn in_progress(message: String, retry: i32) -> Answer {
    let message = bounded(&message, 1024);
    Answer::new(
        &UpdateMachineResponse::new(Status::Success, message.clone(), retry),
        &message,
        "in_progress",
    )
}

fn annotation<'a>(object: &'a Value, key: &str) -> Option<&'a str> {
    lookup(object, &["metadata", "annotations", key]).and_then(Value::as_str)
}

/// How a workload error is answered: a missing Secret fails (nothing will change by
/// waiting), anything else is waited out.
fn workload_answer(e: &WorkloadError, node: &str) -> Result<Answer, Failure> {
    if e.no_secret {
        return Err(Failure(format!("cannot drain node {node}: {e}")));
    }
    Ok(in_progress(
        format!("waiting to drain node {node}: {e}"),
        DRAIN_RETRY_SECONDS * 2,
    ))
}

/// One round's result.
enum Step {
    /// Nothing left to wait for (or the timeout said proceed): submit the plan.
    Drained,
    /// Every Pod of the round was evicted and none waits on a budget or on completing: they
    /// may be gone in a moment, so the call looks again ([`DRAIN_LOOK_AGAIN`]) while its
    /// time allows; else this answer.
    Evicting(Answer),
    /// The answer to give now.
    Answer(Answer),
}

/// How soon a call looks at the node again after evicting its Pods.
pub const DRAIN_LOOK_AGAIN: Duration = Duration::from_millis(500);

impl Updater {
    /// Before a plan the agent does not know yet is submitted, or a succeeded plan is
    /// repaired (`repairing`: its node drifted from it; the repair is a new attempt and
    /// drains as a new plan would): `None` to submit it now (no drain needed, or the node is
    /// drained), or the answer to give instead.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn drain_before(
        &self,
        key: &str,
        live: &Value,
        settings: &Settings,
        facts: &crate::translate::NodeFacts,
        plan: &PlanRef,
        wire: &pb::Plan,
        repairing: bool,
    ) -> Result<Option<Answer>, Failure> {
        if settings.drain == DrainMode::Never {
            self.drains.settle(key, &plan.id, None, "any", None);
            return Ok(None);
        }
        let check = match self.agents.check(&plan.peer, wire.clone()).await {
            Ok(c) => c,
            Err(e @ AgentError::Unreachable { .. }) => return Ok(Some(waiting(key, &e))),
            Err(e) => return Err(Failure(e.to_string())),
        };
        let existing = check
            .existing
            .as_ref()
            .filter(|s| plan.has_digest(&s.digest));
        if let Some(s) = existing
            && !(repairing && s.phase == pb::Phase::Succeeded as i32)
        {
            // Submitted before (its drain, if any, is done): the agent's word follows.
            return Ok(None);
        }
        // The attempt this submission (or repair) starts.
        let attempt = Some(existing.map_or(1, |s| s.attempt + 1));
        let wanted = lookup(live, &["spec", "version"]).and_then(Value::as_str);
        let effect = PlanEffect::from_check(
            &check,
            &settings.kubernetes_packages,
            version_differs(facts, wanted),
        );
        let node = plan.peer.node();
        let reason = drain_reason(settings.drain, &settings.drain_on_restart_of, &effect);
        tracing::debug!(machine = %key, %node, plan = %plan.id, ?effect, kubelet = %facts.kubelet_version,
            reason = reason.as_deref().unwrap_or("none"), "drain decided");
        let Some(reason) = reason else {
            self.drains.settle(key, &plan.id, attempt, "any", None);
            return Ok(None);
        };
        if annotation(live, EXCLUDE_ANNOTATION).is_some() {
            tracing::info!(machine = %key, %node, plan = %plan.id, "drain skipped: the Machine has {EXCLUDE_ANNOTATION}");
            self.drains.settle(key, &plan.id, attempt, "any", None);
            return Ok(None);
        }
        let (namespace, cluster) = machine_cluster(live, key)?;
        let workload = match self
            .drains
            .workloads
            .client(&self.cluster, &namespace, &cluster)
            .await
        {
            Ok(w) => w,
            Err(e) => return workload_answer(&e, node).map(Some),
        };
        // Evicted Pods that go quickly are seen gone in this very call, and the plan is
        // submitted in it, within the time a call holds its answer (`updateWaitSeconds`),
        // rather than a whole `retryAfterSeconds` later.
        let began = Instant::now();
        loop {
            match self
                .drain_step(
                    &workload,
                    key,
                    live,
                    settings,
                    plan,
                    &reason,
                    began + EVICTION_BUDGET,
                )
                .await
            {
                Ok(Step::Drained) => return Ok(None),
                Ok(Step::Evicting(_))
                    if began.elapsed() + DRAIN_LOOK_AGAIN < settings.update_wait =>
                {
                    tokio::time::sleep(DRAIN_LOOK_AGAIN).await;
                }
                Ok(Step::Evicting(a) | Step::Answer(a)) => return Ok(Some(a)),
                Err(DrainError::Workload(e)) => return workload_answer(&e, node).map(Some),
                Err(DrainError::Failed(f)) => return Err(f),
            }
        }
    }

    /// `CanUpdateMachine`: whether the plan `check` describes (for the desired version
    /// `wanted`) will drain the node of the `live` Machine.
    pub(super) fn will_drain(
        &self,
        live: &Value,
        wanted: Option<&str>,
        settings: &Settings,
        facts: &crate::translate::NodeFacts,
        check: &pb::CheckPlanResponse,
    ) -> bool {
        let effect = PlanEffect::from_check(
            check,
            &settings.kubernetes_packages,
            version_differs(facts, wanted),
        );
        annotation(live, EXCLUDE_ANNOTATION).is_none()
            && drain_reason(settings.drain, &settings.drain_on_restart_of, &effect).is_some()
    }

    /// One round of the drain of `plan.peer.node()` for `plan`; no eviction starts after
    /// `evict_until` (the call's budget, shared by its rounds, so that a call that looks
    /// again still answers within Cluster API's 10 s).
    #[allow(clippy::too_many_arguments)]
    async fn drain_step(
        &self,
        workload: &Workload,
        key: &str,
        live: &Value,
        settings: &Settings,
        plan: &PlanRef,
        reason: &str,
        evict_until: Instant,
    ) -> Result<Step, DrainError> {
        let node = plan.peer.node();
        let cluster = workload.cluster.as_str();
        let object = workload.node(node).await?.ok_or_else(|| {
            Failure(format!(
                "cannot drain node {node}: it does not exist in workload cluster {cluster} \
                 (Machine {key} status.nodeRef names it); nothing was started"
            ))
        })?;
        let now = unix_now();
        let mark = annotation(&object, DRAIN_ANNOTATION).and_then(parse_drain_mark);
        let since = match mark {
            Some((p, since)) if p == plan.id => since,
            _ => {
                // Begin: cordon (unless someone did) and mark the Node with the plan.
                let unschedulable = lookup(&object, &["spec", "unschedulable"])
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let ours = annotation(&object, CORDONED_BY_ANNOTATION).is_some();
                let mut patch = json!({"metadata": {"annotations": {
                    DRAIN_ANNOTATION: drain_mark(&plan.id, now),
                }}});
                if !unschedulable || ours {
                    patch["metadata"]["annotations"][CORDONED_BY_ANNOTATION] = json!(plan.id);
                    patch["spec"] = json!({"unschedulable": true});
                }
                workload.patch_node(node, &patch).await?;
                self.metrics.drain.started.inc();
                tracing::info!(%cluster, machine = %key, %node, plan = %plan.id, %reason,
                    cordoned = !unschedulable || ours, "drain started");
                now
            }
        };
        let timeout = lookup(live, &["spec", "deletion", "nodeDrainTimeoutSeconds"])
            .and_then(Value::as_u64)
            .filter(|n| *n > 0)
            .map(|n| (n, "the Machine's spec.deletion.nodeDrainTimeoutSeconds"))
            .or_else(|| {
                (settings.drain_timeout_seconds > 0).then(|| {
                    (
                        u64::from(settings.drain_timeout_seconds),
                        "settings.drainTimeoutSeconds",
                    )
                })
            });

        let (namespace, _) = machine_cluster(live, key)?;
        let pods: Vec<Pod> = workload
            .pods_on(node)
            .await?
            .iter()
            .map(Pod::from_json)
            .collect();
        let rules_json = self
            .cluster
            .machine_drain_rules(&namespace)
            .await
            .map_err(|e| Failure(format!("cannot drain node {node}: {e}")))?;
        let machine_labels = string_map(lookup(live, &["metadata", "labels"]));
        let rules = rules_for_machine(&rules_json, &machine_labels).map_err(|e| {
            Failure(format!(
                "cannot drain node {node}: {e}; nothing was started"
            ))
        })?;
        let mut cx = Context {
            now,
            ..Context::default()
        };
        if !rules.is_empty() {
            cx.namespaces = workload.namespaces().await?;
        }
        let owners: HashSet<(String, String)> = pods
            .iter()
            .filter_map(|p| Some((p.namespace.clone(), p.daemon_set()?.to_owned())))
            .collect();
        for (ns, name) in owners {
            if workload.daemon_set_exists(&ns, &name).await? {
                cx.daemon_sets.insert(format!("{ns}/{name}"));
            }
        }
        let mut classified = Vec::with_capacity(pods.len());
        for pod in pods {
            let behavior = classify(&pod, &rules, &cx)
                .map_err(|e| Failure(format!("cannot drain node {node}: {e}")))?;
            if let Behavior::Skip(why) = behavior {
                tracing::debug!(%cluster, %node, pod = %pod.key(), why, "not evicted");
            }
            classified.push((pod, behavior));
        }
        let round = Round::of(&classified);
        if round.left() == 0 {
            self.drain_finished(key, cluster, node, plan, now - since, "drained");
            return Ok(Step::Drained);
        }
        if let Some((limit, source)) = timeout
            && now - since > limit as i64
        {
            self.metrics.drain.timed_out.inc();
            let pods: Vec<String> = round.pods().iter().map(|p| (*p).to_owned()).collect();
            match settings.on_drain_timeout {
                OnTimeout::Proceed => {
                    tracing::warn!(%cluster, machine = %key, %node, plan = %plan.id,
                        pods = %list(&pods, 10), "drain timed out; proceeding (settings.onDrainTimeout)");
                    self.drain_finished(
                        key,
                        cluster,
                        node,
                        plan,
                        now - since,
                        "timed out, proceeding",
                    );
                    return Ok(Step::Drained);
                }
                OnTimeout::Fail => {
                    return Err(DrainError::Failed(Failure(format!(
                        "drain of node {node} timed out after {limit} s ({source}) with {} still on it: {}; \
                         the node stays cordoned and plan {} was not started (settings.onDrainTimeout: Fail; \
                         set it to Proceed, or raise the timeout, to go on)",
                        if pods.len() == 1 { "1 pod" } else { "pods" },
                        list(&pods, 5),
                        plan.id
                    ))));
                }
            }
        }

        // Evict this round's Pods, within the call's budget.
        let mut blocked: Vec<(String, String)> = Vec::new();
        let mut gone = 0usize;
        let mut budgets: HashMap<String, Vec<String>> = HashMap::new();
        let labels: BTreeMap<String, &Pod> = classified.iter().map(|(p, _)| (p.key(), p)).collect();
        for pod_key in &round.evict {
            if Instant::now() > evict_until {
                break;
            }
            let Some(pod) = labels.get(pod_key) else {
                continue;
            };
            match workload.evict(&pod.namespace, &pod.name).await? {
                Evicted::Yes => {
                    self.metrics.drain.pods_evicted.inc();
                    tracing::info!(%cluster, %node, pod = %pod_key, "pod evicted");
                }
                Evicted::Gone => gone += 1,
                Evicted::Refused(message) => {
                    self.metrics.drain.evictions_refused.inc();
                    if !budgets.contains_key(&pod.namespace) {
                        let found = workload.budgets_of(&pod.namespace, &pod.labels).await?;
                        budgets.insert(pod.namespace.clone(), found);
                    }
                    let pdb = budgets
                        .get(&pod.namespace)
                        .and_then(|b| b.first().cloned())
                        .unwrap_or_else(|| format!("in {} ({message})", pod.namespace));
                    tracing::info!(%cluster, %node, pod = %pod_key, %pdb, %message,
                        "eviction refused by a PodDisruptionBudget; retried on a later call");
                    blocked.push((pod_key.clone(), pdb));
                }
            }
        }
        let left = round.left().saturating_sub(gone);
        let message = progress_message(node, left, &blocked, &round);
        let answer = in_progress(message, DRAIN_RETRY_SECONDS);
        Ok(if blocked.is_empty() && round.wait_completed.is_empty() {
            Step::Evicting(answer)
        } else {
            Step::Answer(answer)
        })
    }

    fn drain_finished(
        &self,
        key: &str,
        cluster: &str,
        node: &str,
        plan: &PlanRef,
        seconds: i64,
        how: &str,
    ) {
        self.metrics.drain.finished.inc();
        self.metrics.drain.duration.observe(seconds.max(0) as f64);
        tracing::info!(%cluster, machine = %key, %node, plan = %plan.id, seconds, how, "drain finished; submitting the plan");
    }

    /// After an `UpdateMachine` answer: on the plan's last answer (done, or its failure),
    /// uncordon the node when the updater cordoned it for this plan, or say it stays
    /// cordoned. Answered from memory once settled.
    pub(super) async fn after_plan(&self, hook: Hook, body: &[u8], answer: &mut Answer) {
        if hook != Hook::UpdateMachine || !matches!(answer.outcome, "done" | "failure") {
            return;
        }
        let key = answer.object.clone();
        let Some((plan, heard)) = self.plans.current(&key) else {
            return;
        };
        let agent_ok = heard.hook.status == pb::HookStatus::Success as i32;
        let outcome = answer.outcome;
        // Only the agent's own last word on the plan (not a refused request).
        if (outcome == "done") != agent_ok || heard.hook.message != answer.message {
            return;
        }
        if let Some(s) = self.drains.settled(&key, &plan.id, heard.attempt, outcome) {
            if let Some(note) = s.note {
                *answer = failure_with(&answer.message, &note, key);
            }
            return;
        }
        let Some((request, namespace, cluster)) = parse_for_after(body) else {
            return;
        };
        // The operator's settings (the body's only point at them; it was accepted under them).
        let Ok(settings) = self.effective(Hook::UpdateMachine, &request).await else {
            return;
        };
        if settings.drain == DrainMode::Never {
            self.drains.settle(&key, &plan.id, None, "any", None);
            return;
        }
        let node = plan.peer.node();
        let result = async {
            let workload = self
                .drains
                .workloads
                .client(&self.cluster, &namespace, &cluster)
                .await?;
            let Some(object) = workload.node(node).await? else {
                return Ok(None);
            };
            let cordoned_by = annotation(&object, CORDONED_BY_ANNOTATION);
            let marked = annotation(&object, DRAIN_ANNOTATION)
                .and_then(parse_drain_mark)
                .is_some_and(|(p, _)| p == plan.id);
            if outcome == "failure" {
                return Ok(if cordoned_by == Some(plan.id.as_str()) {
                    Some(format!(
                        "node {node} stays cordoned: the updater cordoned and drained it for plan {}, which did not succeed; \
                         `kubectl uncordon {node}` returns it to service once it is fixed (or retry the plan)",
                        plan.id
                    ))
                } else {
                    None
                });
            }
            if cordoned_by == Some(plan.id.as_str()) {
                let patch = json!({"spec": {"unschedulable": null}, "metadata": {"annotations": {
                    CORDONED_BY_ANNOTATION: null, DRAIN_ANNOTATION: null}}});
                workload.patch_node(node, &patch).await?;
                tracing::info!(cluster = %workload.cluster, machine = %key, %node, plan = %plan.id, "node uncordoned after the plan succeeded");
            } else if marked {
                let patch = json!({"metadata": {"annotations": {DRAIN_ANNOTATION: null}}});
                workload.patch_node(node, &patch).await?;
                tracing::info!(cluster = %workload.cluster, machine = %key, %node, plan = %plan.id,
                    "node left cordoned after the plan succeeded: it was cordoned before the drain began");
            }
            Ok::<_, WorkloadError>(None)
        }
        .await;
        match result {
            Ok(note) => {
                if let Some(n) = &note {
                    *answer = failure_with(&answer.message, n, key.clone());
                }
                self.drains
                    .settle(&key, &plan.id, Some(heard.attempt), outcome, note);
            }
            Err(e) if e.no_secret => {
                self.drains
                    .settle(&key, &plan.id, Some(heard.attempt), "any", None)
            }
            Err(e) => {
                tracing::warn!(machine = %key, %node, plan = %plan.id, error = %e, "after the plan: the node's cordon was not checked");
                if outcome == "done" {
                    let mut a = in_progress(
                        format!("plan {} succeeded; uncordoning node {node}: {e}", plan.id),
                        DRAIN_RETRY_SECONDS,
                    );
                    a.object = key;
                    *answer = a;
                }
            }
        }
    }
}

/// Whether the Machine asks for another Kubernetes version than the node's kubelet runs.
fn version_differs(facts: &crate::translate::NodeFacts, wanted: Option<&str>) -> bool {
    wanted.is_some_and(|v| !facts.kubelet_version.is_empty() && facts.kubelet_version != v)
}

fn failure_with(message: &str, note: &str, object: String) -> Answer {
    let message = bounded(&format!("{message}; {note}"), 1024);
    let mut a = Answer::new(
        &UpdateMachineResponse::new(Status::Failure, message.clone(), 0),
        &message,
        "failure",
    );
    a.object = object;
    a
}

/// An UpdateMachine request, with its Machine's namespace and cluster name.
fn parse_for_after(body: &[u8]) -> Option<(HookRequest, String, String)> {
    let value: Value = super::request_body(body).ok()?;
    let request = HookRequest::parse(Hook::UpdateMachine, &value).ok()?;
    let desired = request.object("desired", "machine").ok()?;
    let (namespace, cluster) = machine_cluster(&desired.value, &key_of(&desired)).ok()?;
    Some((request, namespace, cluster))
}

/// The Machine's namespace and `spec.clusterName`.
fn machine_cluster(machine: &Value, key: &str) -> Result<(String, String), Failure> {
    let namespace = lookup(machine, &["metadata", "namespace"])
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_owned();
    let cluster = lookup(machine, &["spec", "clusterName"])
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty())
        .ok_or_else(|| {
            Failure(format!(
                "Machine {key} has no spec.clusterName: the drain cannot find its workload cluster"
            ))
        })?;
    Ok((namespace, cluster.to_owned()))
}

/// A round that could not finish.
enum DrainError {
    /// The workload cluster could not be reached or refused: waited out.
    Workload(WorkloadError),
    /// The answer is Failure.
    Failed(Failure),
}

impl From<WorkloadError> for DrainError {
    fn from(e: WorkloadError) -> DrainError {
        DrainError::Workload(e)
    }
}

impl From<Failure> for DrainError {
    fn from(f: Failure) -> DrainError {
        DrainError::Failed(f)
    }
}
