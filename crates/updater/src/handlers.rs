//! The three hooks: parse, decide, call the cluster and the agent, answer.
//!
//! - `CanUpdateMachine` (a concrete control-plane Machine): coverage from the node's agent
//!   abilities (`GetNodeInfo`), then `CheckPlan` with the translated plan: not applicable or
//!   unreachable → nothing covered (a rollout is safe, a half-known node is not).
//! - `CanUpdateMachineSet` (no node): coverage from what a current agent can do; the
//!   `UpdateMachine` of each Machine checks its own node again.
//! - `UpdateMachine`: answered from memory ([`super::progress`]) when this very request was
//!   checked before and the agent's word on its plan is fresh. Otherwise the live Machine
//!   must be mid in-place update (annotations) and equal to the request, its live
//!   KubeadmConfig too; the plan is translated from the live objects, its status read
//!   (`GetPlanStatus`) and, when the agent does not know it yet, submitted (`ApplyPlan`);
//!   the agent's hook response goes back as it is, and is remembered.
//!
//! - The drain ([`draining`]): before a new plan that needs it is submitted, each call
//!   cordons and drains the node a step further; the plan's last answer uncordons it.
//!
//! Nothing durable is kept between calls: any replica answers any call the same way (one
//! that has not seen the request yet takes the slow way).

mod draining;

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::agent::{AgentError, Agents};
use super::bootstrap_data;
use super::cluster::Cluster;
use super::edge::agent_ca::{ClusterCas, Peer};
use super::edge::extension_config::{Effective, ExtensionConfigs, Refused};
use super::edge::yaml::{Document, Limits, ParseError};
use super::hooks::{
    CanUpdateMachineResponse, CanUpdateMachineSetResponse, FailureResponse, HOOKS_API_VERSION,
    Hook, HookRequest, Object, PENDING_HOOKS_ANNOTATION, Patch, RequestError, Status,
    UPDATE_IN_PROGRESS_ANNOTATION, UpdateMachineResponse,
};
use super::metrics::Metrics;
use super::patch::{Coverage, cover_kubeadm, cover_machine, spec_patch};
use super::progress::{Fingerprint, Follow, Heard, PlanRef, Plans, follow};
use super::recovery::{Recovery, Wish};
use super::settings::Settings;
use super::translate::{
    Desired, NodeFacts, SecretSource, TranslateError, lookup, translate_removing, write_canonical,
};
use super::unreachable::{SINCE_ANNOTATION, Verdict, Waits};
use super::why::{Class, Why};
use inplace_api::convert::plan_to_pb;
use inplace_api::pb;

/// How long `CanUpdateMachineSet` may spend asking the MachineSet's agents (Cluster API
/// gives a hook 10 s).
pub const SET_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(6);

/// How many agents `CanUpdateMachineSet` asks at once.
pub const SET_CHECK_CONCURRENCY: usize = 32;

/// Seconds until CAPI asks again while the agent cannot be reached.
pub const UNREACHABLE_RETRY_SECONDS: i32 = 15;

/// Seconds until CAPI asks again while a new plan is being submitted.
pub const SUBMITTING_RETRY_SECONDS: i32 = 5;

/// How long the first call of a new plan waits for the agent's answer before it says the
/// plan is being submitted (the submission goes on in the background).
pub const SUBMIT_WAIT: std::time::Duration = std::time::Duration::from_millis(25);

/// A failed hook call: the message CAPI logs.
#[derive(Debug)]
pub struct Failure(pub String);

impl From<RequestError> for Failure {
    fn from(e: RequestError) -> Failure {
        Failure(format!("bad request: {e}"))
    }
}

/// What a handler answered, for the response and the metrics.
#[derive(Debug)]
pub struct Answer {
    /// The response body (JSON, fields in CAPI's order).
    pub body: Vec<u8>,
    /// Its `message`, for the log of failures.
    pub message: String,
    /// `success`, `failure`, `in_progress`, `done`, `covered`, `not_covered`, `partial`.
    pub outcome: &'static str,
    /// The Machine (or MachineSet) it was about, for the log.
    pub object: String,
    /// The live object the decision was about (`namespace/name`): the Machine, or the
    /// current MachineSet of `CanUpdateMachineSet` (whose owner gets the Event).
    pub subject: String,
    /// The agent could not be reached: why (the answer is a wait).
    pub unreachable: Option<String>,
    /// Why a `CanUpdate*` answer covers less than everything ([`super::why`]).
    pub why: Option<Why>,
}

/// The updater: configuration, the cluster and the agents.
pub struct Updater {
    /// The operator's ExtensionConfigs: every call's effective settings
    /// ([`super::edge::extension_config`]).
    pub extension_configs: Arc<ExtensionConfigs>,
    /// The management cluster.
    pub cluster: Cluster,
    /// The agents.
    pub agents: Arc<Agents>,
    /// What the agents last said about each Machine's plan ([`super::progress`]).
    pub plans: Arc<Plans>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Failed plans reported as Events, retried on request ([`super::recovery`]).
    pub recovery: Arc<Recovery>,
    /// The workload clusters' CAs that verify their agents ([`super::edge::agent_ca`]).
    pub cluster_cas: Arc<ClusterCas>,
    /// Machines waiting on an unreachable agent ([`super::unreachable`]).
    pub waits: Arc<Waits>,
    /// The drain's workload clients and what it settled ([`draining`]).
    pub drains: Arc<Drains>,
    /// Not-in-place answers as Events, deduplicated and rate-bounded ([`super::events`]).
    pub not_in_place: Arc<super::events::NotInPlace>,
}

pub use draining::Drains;

fn to_bytes<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

impl Answer {
    fn new<T: serde::Serialize>(response: &T, message: &str, outcome: &'static str) -> Answer {
        Answer {
            body: to_bytes(response),
            message: message.to_owned(),
            outcome,
            object: String::new(),
            subject: String::new(),
            unreachable: None,
            why: None,
        }
    }

    /// The same answer, saying why it is not everything in place.
    fn because(mut self, why: Option<Why>) -> Answer {
        self.why = why;
        self
    }

    /// The body as a JSON value (tests, the demo).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// A hook request's body as JSON, within [`Limits::REQUEST_BODY`] (src/edge/yaml.rs).
pub(crate) fn request_body(body: &[u8]) -> Result<Value, ParseError> {
    crate::edge::yaml::json(body, &Limits::REQUEST_BODY).map(Document::into_value)
}

fn canonical(v: &Value) -> String {
    let mut s = String::new();
    write_canonical(v, &mut s);
    s
}

fn key_of(object: &Object) -> String {
    format!("{}/{}", object.namespace(), object.name())
}

/// Secrets fetched for one request.
struct Fetched(
    HashMap<String, Result<std::collections::BTreeMap<String, Vec<u8>>, String>>,
    String,
);

impl SecretSource for Fetched {
    fn secret(&self, name: &str, key: &str) -> Result<Vec<u8>, String> {
        match self.0.get(name) {
            Some(Ok(data)) => data
                .get(key)
                .cloned()
                .ok_or_else(|| format!("secret {}/{name} has no key {key:?}", self.1)),
            Some(Err(e)) => Err(e.clone()),
            None => Err(format!("secret {}/{name} was not read", self.1)),
        }
    }
}

impl Updater {
    /// Answers one hook call; never panics on input, every problem is a Failure body.
    pub async fn handle(self: &Arc<Self>, hook: Hook, body: &[u8]) -> Answer {
        let began = std::time::Instant::now();
        let fingerprint: Fingerprint =
            sha2::Digest::finalize(<sha2::Sha256 as sha2::Digest>::new_with_prefix(body)).into();
        if hook == Hook::UpdateMachine
            && let Some((machine, known)) = self.plans.answer_by_fingerprint(&fingerprint)
        {
            // This very body was checked and its plan's status is fresh: from memory.
            if known.refresh {
                // Checked against the cluster and the agent again, behind this answer.
                let (this, body, key) = (self.clone(), body.to_vec(), machine.clone());
                tokio::spawn(async move {
                    let recorded = this.recheck(&body, &fingerprint).await;
                    this.plans.refreshed(&key, &fingerprint, recorded);
                });
            }
            let (mut heard, mut seen) = (known.heard, known.seen);
            if known.word_stale
                && let Ok(Some(status)) = self.agents.status(&known.plan.peer, &known.plan.id).await
                && known.plan.has_digest(&status.digest)
                && status.hook_response.is_some()
                && let Some(now) = self.plans.heard_by_call(&machine, &known.plan, &status)
            {
                // The stream tells phases and steps; a gate's attempts only a call does.
                heard = now;
                seen = self.plans.seen(&machine, &known.plan).unwrap_or(seen);
            }
            // Held to the plan's end when that is near, else asked back when it will be.
            let mut answer = self.paced(&machine, &known.plan, heard, seen, began).await;
            answer.object = machine;
            self.after_plan(hook, body, &mut answer).await;
            self.answered(hook, &answer);
            return answer;
        }
        let (mut answer, trouble) =
            crate::cluster::with_read_trouble(self.handle_parsed(hook, body, fingerprint)).await;
        if let Some(trouble) = trouble {
            answer = undecided(hook, answer, &trouble);
        }
        self.after_plan(hook, body, &mut answer).await;
        self.answered(hook, &answer);
        self.decided(hook, &answer);
        answer
    }

    /// An UpdateMachine request checked again the slow way; true when the agent's answer
    /// was remembered.
    async fn recheck(self: &Arc<Self>, body: &[u8], fingerprint: &Fingerprint) -> bool {
        let Ok(value) = request_body(body) else {
            return false;
        };
        let Ok(request) = HookRequest::parse(Hook::UpdateMachine, &value) else {
            return false;
        };
        let Ok(settings) = self.effective(Hook::UpdateMachine, &request).await else {
            return false;
        };
        matches!(
            self.update_machine(&request, &settings, fingerprint).await,
            Ok((_, true))
        )
    }

    async fn handle_parsed(
        self: &Arc<Self>,
        hook: Hook,
        body: &[u8],
        fingerprint: Fingerprint,
    ) -> Answer {
        let value: Value = match request_body(body) {
            Ok(v) => v,
            Err(e @ ParseError::Syntax { .. }) => {
                return self.failure(hook, "", format!("bad request: the body is not JSON: {e}"));
            }
            Err(e) => return self.failure(hook, "", format!("bad request: the body: {e}")),
        };
        if hook == Hook::Discovery {
            let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
            if kind != "DiscoveryRequest" {
                return self.failure(
                    hook,
                    "",
                    format!("bad request: kind: is {kind:?}, expected \"DiscoveryRequest\""),
                );
            }
            return Answer::new(&super::hooks::discovery_response(), "", "success");
        }
        let request = match HookRequest::parse(hook, &value) {
            Ok(r) => r,
            Err(e) => return self.failure(hook, "", Failure::from(e).0),
        };
        let object = request
            .object(
                "desired",
                if hook == Hook::CanUpdateMachineSet {
                    "machineSet"
                } else {
                    "machine"
                },
            )
            .map(|o| key_of(&o))
            .unwrap_or_default();
        let settings = match self.effective(hook, &request).await {
            Ok(s) => s,
            Err(Refused(message)) => {
                tracing::warn!(hook = hook.path(), object = %object, reason = %message, "request refused: its settings are not its ExtensionConfig's");
                return self.failure(hook, &object, message);
            }
        };
        let result = match hook {
            Hook::CanUpdateMachine => self.can_update_machine(&request, &settings).await,
            Hook::CanUpdateMachineSet => self.can_update_machine_set(&request, &settings).await,
            Hook::UpdateMachine => {
                match self.update_machine(&request, &settings, &fingerprint).await {
                    Ok((answer, _)) => self.watch_unreachable(&request, &settings, answer).await,
                    Err(f) => Err(f),
                }
            }
            Hook::Discovery => unreachable_discovery(),
        };
        let subject = if hook == Hook::CanUpdateMachineSet {
            request
                .object("current", "machineSet")
                .map(|o| key_of(&o))
                .unwrap_or_default()
        } else {
            object.clone()
        };
        match result {
            Ok(mut answer) => {
                answer.object = object;
                answer.subject = subject;
                answer
            }
            Err(Failure(message)) => self.failure(hook, &object, message),
        }
    }

    /// The effective settings of `request`: its ExtensionConfig's, for the namespace of the
    /// object it is about ([`super::edge::extension_config`]).
    pub(crate) async fn effective(
        &self,
        hook: Hook,
        request: &HookRequest,
    ) -> Result<Effective, Refused> {
        let which = if hook == Hook::CanUpdateMachineSet {
            "machineSet"
        } else {
            "machine"
        };
        let object = request
            .object("desired", which)
            .map_err(|e| Refused(Failure::from(e).0))?;
        self.extension_configs
            .effective(&self.cluster, object.namespace(), &request.settings)
            .await
    }

    /// After a call was answered: a failed plan's `UpdateMachine` Failure becomes an Event.
    fn answered(&self, hook: Hook, answer: &Answer) {
        if hook == Hook::UpdateMachine && answer.outcome == "failure" {
            self.recovery
                .answered_failure(&self.plans, &answer.object, &answer.message);
        }
    }

    /// After a `CanUpdate*` call was answered: the decision counted by outcome and reason
    /// class, and a reason reported as an Event on the object an operator looks at
    /// ([`super::events`]; in the background, deduplicated and rate-bounded).
    fn decided(&self, hook: Hook, answer: &Answer) {
        if !matches!(hook, Hook::CanUpdateMachine | Hook::CanUpdateMachineSet) {
            return;
        }
        self.metrics.decision(
            hook.as_str(),
            answer.outcome,
            answer.why.as_ref().map(Why::class),
        );
        if let Some(why) = &answer.why
            && let Some((namespace, name)) = answer.subject.split_once('/')
        {
            self.not_in_place
                .report(hook, namespace, name, why, inplace_base::time::now_ms());
        }
    }

    fn failure(&self, hook: Hook, object: &str, message: String) -> Answer {
        let message = bounded(&message, 1024);
        let mut answer = Answer::new(
            &FailureResponse::new(hook, message.clone()),
            &message,
            "failure",
        );
        answer.object = object.to_owned();
        answer
    }

    /// After `UpdateMachine` answered: a wait on an unreachable agent is logged, its start
    /// kept on the Machine, reported as Events at a bounded rate, and past
    /// `settings.unreachableTimeoutSeconds` answered as Failure; an agent that answers
    /// again ends the wait ([`super::unreachable`]).
    async fn watch_unreachable(
        &self,
        request: &HookRequest,
        settings: &Effective,
        answer: Answer,
    ) -> Result<Answer, Failure> {
        use super::unreachable::{
            expired_message, format_since, judge, live_since, since_value, spec_digest,
        };
        let Ok(desired) = request.object("desired", "machine") else {
            return Ok(answer);
        };
        let key = key_of(&desired);
        let (namespace, name) = (desired.namespace().to_owned(), desired.name().to_owned());
        let now = inplace_base::time::now_ms();
        // Never the request's annotations: what the live Machine said when this call read it.
        let seen = self.waits.take_seen(&key);
        let in_live = seen.as_ref().and_then(|(since, _)| *since);
        let Some(error) = answer.unreachable.clone() else {
            if self.waits.answered(&key) || in_live.is_some() {
                tracing::info!(machine = %key, "the agent answers again");
                let cluster = self.cluster.clone();
                tokio::spawn(async move {
                    if let Err(e) = cluster
                        .unannotate_machine(&namespace, &name, SINCE_ANNOTATION)
                        .await
                    {
                        tracing::warn!(machine = %format!("{namespace}/{name}"), error = %e, "annotation not removed");
                    }
                });
            }
            return Ok(answer);
        };
        let since = match in_live.or_else(|| self.waits.since(&key)) {
            Some(since) => since,
            // The first miss as far as this replica knows: the live Machine may say otherwise
            // (another replica, or a restart), for this very update.
            None => match self.cluster.machine(&namespace, &name).await {
                Ok(Some(live)) if live_since(&live, now).is_some() => {
                    live_since(&live, now).unwrap_or(now)
                }
                read => {
                    // The value names the Machine spec it was written under, so it is written
                    // only when that spec is known (read live now or earlier in this call):
                    // a value under a made-up spec would be ignored by every later reader.
                    let spec = match (&read, seen) {
                        (Ok(Some(live)), _) => Some(spec_digest(live)),
                        (_, Some((_, spec))) => Some(spec),
                        _ => None,
                    };
                    match spec {
                        Some(spec) => {
                            let at = since_value(now, &spec);
                            if let Err(e) = self
                                .cluster
                                .annotate_machine(&namespace, &name, SINCE_ANNOTATION, &at)
                                .await
                            {
                                tracing::warn!(machine = %key, error = %e, "the start of the wait is not kept on the Machine");
                            }
                        }
                        None => {
                            let why = match &read {
                                Err(e) => e.to_string(),
                                _ => "the Machine is gone".to_owned(),
                            };
                            tracing::warn!(machine = %key, error = %why, "the start of the wait is not kept on the Machine: the live Machine could not be read; only this replica remembers it (a restart or another replica starts the wait anew)");
                        }
                    }
                    now - now % 1000
                }
            },
        };
        let cluster = cluster_of(desired.namespace(), desired.spec());
        let emitted = self.waits.missed(&key, &cluster, since);
        let timeout = settings.unreachable_timeout;
        match judge(since, now, timeout, emitted) {
            Verdict::Wait { elapsed, event } => {
                tracing::warn!(machine = %key, waited_seconds = elapsed.as_secs(), error = %error, "agent unreachable; waiting");
                if let Some(n) = event {
                    let message = format!(
                        "{error}; waiting since {} (Failure after {}s: settings.unreachableTimeoutSeconds)",
                        format_since(since),
                        timeout.as_secs()
                    );
                    self.unreachable_event(&key, since, n, message);
                }
                Ok(answer)
            }
            Verdict::Expired { elapsed } => {
                let message = expired_message(&key, &error, elapsed, timeout);
                tracing::warn!(machine = %key, waited_seconds = elapsed.as_secs(), error = %error, "agent unreachable past the deadline; answering Failure");
                // Once per wait and replica: the failure counted, its Event created.
                if emitted != Some(u64::MAX) {
                    self.metrics.plan_failure("unreachable_timeout");
                    self.waits.emitted(&key, u64::MAX);
                    self.unreachable_event(&key, since, u64::MAX, message.clone());
                }
                Err(Failure(message))
            }
        }
    }

    /// Creates Event `n` of the wait that began at `since` on `machine`, behind the answer
    /// (named after the wait and `n`, so another replica's or a retried creation is the same
    /// Event).
    fn unreachable_event(&self, machine: &str, since: u64, n: u64, message: String) {
        use super::unreachable::EVENT_REASON;
        let (recovery, waits) = (self.recovery.clone(), self.waits.clone());
        let machine = machine.to_owned();
        tokio::spawn(async move {
            let which = if n == u64::MAX {
                "expired".to_owned()
            } else {
                n.to_string()
            };
            let wait = format!("{EVENT_REASON}-{since}-{which}");
            let what = (EVENT_REASON, "Warning");
            let told = recovery
                .emit(&machine, &wait, 0, what, &bounded(&message, 1024))
                .await;
            if told && n != u64::MAX {
                waits.emitted(&machine, n);
            }
        });
    }

    /// `CanUpdateMachineSet`: the agents of the current MachineSet's Machines are asked
    /// (cached `GetNodeInfo`, all within [`SET_CHECK_TIMEOUT`]): any that cannot be reached
    /// covers nothing (a rollout is safe; an in-place update would wait on it), and the
    /// coverage is what every one of them can do ([`decide_machine_set`]).
    pub(crate) async fn can_update_machine_set(
        self: &Arc<Self>,
        request: &HookRequest,
        settings: &Effective,
    ) -> Result<Answer, Failure> {
        if settings.disable_in_place {
            return can_update_machine_set(request, settings);
        }
        let current = request.object("current", "machineSet")?;
        let desired = request.object("desired", "machineSet")?;
        if let Some(why) = self.machine_set_skew(&current, &desired).await {
            return Ok(machine_set_not_covered(why));
        }
        match self.ask_machine_set(&current, settings).await {
            Ok(facts) => decide_machine_set(request, settings, &facts),
            Err(why) => Ok(machine_set_not_covered(why)),
        }
    }

    /// What the agents of the current MachineSet's Machines say (by Machine), within
    /// [`SET_CHECK_TIMEOUT`], or why the MachineSet cannot be updated in place at all.
    pub(crate) async fn ask_machine_set(
        self: &Arc<Self>,
        current: &Object,
        settings: &Effective,
    ) -> Result<Vec<(String, NodeFacts)>, Why> {
        let set = key_of(current);
        let asked =
            tokio::time::timeout(SET_CHECK_TIMEOUT, self.machine_set_facts(current, settings))
                .await;
        match asked {
            Err(_) => Err(Why::whole(
                Class::Unreachable,
                format!(
                    "MachineSet {set}: its nodes' agents did not all answer within {}s; a rollout \
                     replaces the Machines",
                    SET_CHECK_TIMEOUT.as_secs()
                ),
            )),
            Ok(Err((class, problems))) => Err(Why::whole(
                class,
                format!("MachineSet {set}: {problems}; a rollout replaces the Machines"),
            )),
            Ok(Ok(facts)) => Ok(facts),
        }
    }

    /// What the agents of the MachineSet's Machines say (by Machine), or what kept some
    /// from answering.
    async fn machine_set_facts(
        self: &Arc<Self>,
        set: &Object,
        settings: &Effective,
    ) -> Result<Vec<(String, NodeFacts)>, (Class, String)> {
        let key = key_of(set);
        let lookup_failed = |e: String| (Class::Lookup, e);
        // The MachineSet as it is, in the request's namespace: the request only names it (a
        // caller could send any selector and learn of any Machine).
        let live = self
            .cluster
            .machine_set(set.namespace(), set.name())
            .await
            .map_err(|e| lookup_failed(e.to_string()))?
            .ok_or_else(|| {
                lookup_failed(format!(
                    "MachineSet {key} does not exist in the management cluster"
                ))
            })?;
        let uid = lookup(&live, &["metadata", "uid"]).and_then(Value::as_str);
        // Cluster API's MachineSets always have a selector; one without names no Machines
        // (answered with what a current agent can do, as for an empty set).
        let Some(labels) = lookup(&live, &["spec", "selector", "matchLabels"])
            .and_then(Value::as_object)
            .filter(|m| !m.is_empty())
        else {
            tracing::debug!(machine_set = %key, "no spec.selector.matchLabels: no Machines to ask");
            return Ok(Vec::new());
        };
        let selector = labels
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(",");
        let machines = self
            .cluster
            .machines(set.namespace(), &selector)
            .await
            .map_err(|e| lookup_failed(e.to_string()))?;
        // Owned by this very MachineSet (CAPI's MachineSet controller adopts by selector and
        // sets itself as the controller): a Machine that only carries its labels is not asked
        // about, and not named.
        let owned = machines.into_iter().filter(|m| {
            lookup(m, &["metadata", "ownerReferences"])
                .and_then(Value::as_array)
                .is_some_and(|refs| {
                    refs.iter().any(|r| {
                        r.get("kind").and_then(Value::as_str) == Some("MachineSet")
                            && r.get("name").and_then(Value::as_str) == Some(set.name())
                            && (uid.is_none()
                                || r.get("uid").and_then(Value::as_str).is_none()
                                || r.get("uid").and_then(Value::as_str) == uid)
                    })
                })
        });
        let mut asks = tokio::task::JoinSet::new();
        // At most this many handshakes at once: a MachineSet of hundreds of Machines.
        let at_once = Arc::new(tokio::sync::Semaphore::new(SET_CHECK_CONCURRENCY));
        for live in owned {
            let (this, settings) = (self.clone(), settings.clone());
            let namespace = set.namespace().to_owned();
            let at_once = at_once.clone();
            asks.spawn(async move {
                let _turn = at_once
                    .acquire()
                    .await
                    .map_err(|e| (Class::Unreachable, e.to_string()))?;
                let name = lookup(&live, &["metadata", "name"])
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let machine = format!("{namespace}/{name}");
                let peer = this
                    .peer(&live, &settings, &machine)
                    .await
                    .map_err(|f| (Class::AgentTrust, f.0))?;
                let facts = this
                    .agents
                    .facts(&peer)
                    .await
                    .map_err(|e| (Class::Unreachable, format!("Machine {machine}: {e}")))?;
                Ok::<_, (Class, String)>((machine, facts))
            });
        }
        let mut facts = Vec::new();
        let mut problems = Vec::new();
        while let Some(answer) = asks.join_next().await {
            match answer {
                Ok(Ok(f)) => facts.push(f),
                Ok(Err(e)) => problems.push(e),
                Err(e) => problems.push((Class::Unreachable, format!("asking an agent: {e}"))),
            }
        }
        facts.sort_by(|a, b| a.0.cmp(&b.0));
        problems.sort();
        let Some(class) = problems.first().map(|p| p.0) else {
            return Ok(facts);
        };
        let words: Vec<&str> = problems.iter().map(|p| p.1.as_str()).collect();
        Err((
            class,
            match words.len() {
                1..=2 => words.join("; "),
                n => format!("{} and {} more", words[..2].join("; "), n - 2),
            },
        ))
    }

    /// Kubernetes' version skew rules ([`super::skew`]) for moving the live Machine `live`
    /// to the version of `desired`: its role and running version from the live Machine, the
    /// control plane's versions from its cluster's live control-plane Machines.
    async fn machine_skew(&self, live: &Value, desired: &Object) -> Option<Why> {
        let current = super::skew::running_version(live)?;
        self.machine_skew_from(live, desired, current).await
    }

    /// [`Updater::machine_skew`] from the version `current` the Machine's node runs.
    async fn machine_skew_from(
        &self,
        live: &Value,
        desired: &Object,
        current: super::skew::Version,
    ) -> Option<Why> {
        use super::skew::Role;
        let role = match super::translate::MachineRole::of(live) {
            super::translate::MachineRole::ControlPlane => Role::ControlPlane,
            super::translate::MachineRole::Worker => Role::Worker,
        };
        let name = live.pointer("/metadata/name").and_then(Value::as_str)?;
        let subject = format!("Machine {}/{name}", desired.namespace());
        self.skew(
            desired.namespace(),
            live.pointer("/spec/clusterName").and_then(Value::as_str)?,
            &subject,
            name,
            role,
            current,
            desired.spec().get("version").and_then(Value::as_str)?,
        )
        .await
    }

    /// The skew rules for an `UpdateMachine` of the live Machine `live` (whose spec already
    /// asks for the desired version): from the version the node's kubelet reports
    /// (`facts`, the agent's `GetNodeInfo`), else the live Machine's ([`super::skew::running_version`]).
    /// `Some(sentence)` when the move breaks a rule or the control plane's versions could not
    /// be read.
    async fn update_skew(
        &self,
        live: &Value,
        desired: &Object,
        facts: &NodeFacts,
    ) -> Option<String> {
        use super::skew::{Version, running_version};
        let current = Version::parse(&facts.kubelet_version).or_else(|| running_version(live))?;
        self.machine_skew_from(live, desired, current)
            .await
            .and_then(|why| why.gaps.into_iter().next())
            .map(|gap| gap.why)
    }

    /// Whether the agent of `plan` already knows it (it was submitted before this process
    /// started, or by another replica): then the update is under way and not refused.
    async fn agent_runs(&self, key: &str, plan: &PlanRef) -> bool {
        match self.agents.status(&plan.peer, &plan.id).await {
            Ok(Some(status)) if plan.has_digest(&status.digest) => {
                tracing::warn!(machine = %key, plan = %plan.id, "the version skew rules would refuse this update, but the node already runs its plan: following it");
                true
            }
            _ => false,
        }
    }

    /// [`Updater::machine_skew`] for a MachineSet's Machines (workers): the version of the
    /// live MachineSet's template to that of the desired one.
    async fn machine_set_skew(&self, current: &Object, desired: &Object) -> Option<Why> {
        use super::skew::{Role, Version};
        let live = self
            .cluster
            .machine_set(current.namespace(), current.name())
            .await
            .ok()??;
        let version = |o: &Value| {
            o.pointer("/spec/template/spec/version")
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let subject = format!("MachineSet {}/{}", current.namespace(), current.name());
        self.skew(
            current.namespace(),
            live.pointer("/spec/clusterName").and_then(Value::as_str)?,
            &subject,
            "",
            Role::Worker,
            Version::parse(&version(&live)?)?,
            &version(&desired.value)?,
        )
        .await
    }

    /// Checks a move of `machine` (`subject` in words) of `cluster` in `namespace` from
    /// `current` to `desired`; `None` when it keeps the rules, or moves no version.
    #[allow(clippy::too_many_arguments)]
    async fn skew(
        &self,
        namespace: &str,
        cluster: &str,
        subject: &str,
        machine: &str,
        role: super::skew::Role,
        current: super::skew::Version,
        desired: &str,
    ) -> Option<Why> {
        use super::skew::{Version, check, control_plane_selector, members};
        let desired = Version::parse(desired)?;
        if desired == current {
            return None;
        }
        let plane = match self
            .cluster
            .machines(namespace, &control_plane_selector(cluster))
            .await
        {
            Ok(list) => members(&list, machine),
            Err(e) => {
                return Some(Why::whole(
                    Class::Lookup,
                    format!(
                        "{subject}: the control plane's versions could not be read for the version \
                         skew rules: {e}"
                    ),
                ));
            }
        };
        check(subject, role, current, desired, &plane)
            .err()
            .map(|refusal| Why::whole(Class::Skew, refusal.0))
    }

    /// The agent of the live Machine `key` and how it is verified (`settings.agentCA`):
    /// bound to the Machine's own cluster ([`super::edge::agent_ca`]).
    async fn peer(&self, live: &Value, settings: &Effective, key: &str) -> Result<Peer, Failure> {
        self.cluster_cas
            .peer(&self.cluster, settings, live, key)
            .await
            .map_err(Failure)
    }

    async fn live_machine(&self, object: &Object) -> Result<Value, Failure> {
        let key = key_of(object);
        self.cluster
            .machine(object.namespace(), object.name())
            .await
            .map_err(|e| Failure(e.to_string()))?
            .ok_or_else(|| {
                Failure(format!(
                    "Machine {key} does not exist in the management cluster"
                ))
            })
    }

    async fn secrets(&self, namespace: &str, bootstrap: Option<&Value>) -> Fetched {
        let mut names: Vec<String> = bootstrap
            .and_then(|b| lookup(b, &["spec", "files"]))
            .and_then(Value::as_array)
            .map(|files| {
                files
                    .iter()
                    .filter_map(|f| lookup(f, &["contentFrom", "secret", "name"]))
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names.dedup();
        let mut out = HashMap::new();
        for name in names {
            let got = match self.cluster.secret(namespace, &name).await {
                Ok(Some(data)) => Ok(data),
                Ok(None) => Err(format!("secret {namespace}/{name} does not exist")),
                Err(e) => Err(e.to_string()),
            };
            out.insert(name, got);
        }
        Fetched(out, namespace.to_owned())
    }

    /// `CanUpdateMachine`: [`machine_precheck`], then the node's agent: its abilities
    /// (`GetNodeInfo`) give the coverage ([`cover_machine_request`]), and `CheckPlan` of the
    /// translated plan says whether the node would accept it.
    pub(crate) async fn can_update_machine(
        &self,
        request: &HookRequest,
        settings: &Effective,
    ) -> Result<Answer, Failure> {
        let not_covered = |why: Why| -> Result<Answer, Failure> { Ok(machine_not_covered(why)) };
        if let Some(why) = machine_precheck(request, settings)? {
            return not_covered(why);
        }
        let current = request.object("current", "machine")?;
        let desired = request.object("desired", "machine")?;
        let desired_b = request.optional_object("desired", "bootstrapConfig")?;
        let infra = request.optional_object("desired", "infrastructureMachine")?;
        let key = key_of(&desired);
        let live = match self.live_machine(&desired).await {
            Ok(v) => v,
            Err(Failure(m)) => return not_covered(Why::whole(Class::Lookup, m)),
        };
        if let Some(why) = self.machine_skew(&live, &desired).await {
            return not_covered(why);
        }
        let peer = match self.peer(&live, settings, &key).await {
            Ok(p) => p,
            Err(Failure(m)) => return not_covered(Why::whole(Class::AgentTrust, m)),
        };
        let node = peer.node();
        let facts = match self.agents.facts(&peer).await {
            Ok(f) => f,
            Err(e) => {
                return not_covered(Why::whole(
                    Class::Unreachable,
                    format!("Machine {key}: {e}"),
                ));
            }
        };
        // The role is the live Machine's: a control-plane Machine's cluster configuration is
        // node work (its static pods), a worker's is not.
        let caps = facts.capabilities_for(super::translate::MachineRole::of(&live));
        let (machine, bootstrap) = cover_machine_request(request, caps)?;
        // Would the node accept the desired state at all?
        let (fetched, written) = tokio::join!(
            self.secrets(desired.namespace(), desired_b.as_ref().map(|o| &o.value)),
            bootstrap_data::written(&self.cluster, &live, desired_b.as_ref().map(|o| &o.value)),
        );
        let written = match written {
            Ok(w) => w,
            Err(m) => return not_covered(Why::whole(Class::Lookup, m)),
        };
        // The role is the live Machine's (its labels and owners), never the request's.
        let translation = super::translate::translate_for(
            &Desired {
                machine: &desired.value,
                infrastructure: infra.as_ref().map(|o| &o.value),
                bootstrap: desired_b.as_ref().map(|o| &o.value),
            },
            super::translate::MachineRole::of(&live),
            settings,
            &facts,
            &fetched,
            &written,
        );
        let translation = match translation {
            Ok(t) => t,
            Err(e) => {
                return not_covered(Why::whole(
                    Class::Translation,
                    format!("cannot translate the desired state: {e}"),
                ));
            }
        };
        let check = match self
            .agents
            .check(&peer, plan_to_pb(&translation.plan))
            .await
        {
            Ok(c) => c,
            Err(e) => return not_covered(Why::whole(Class::Unreachable, e.to_string())),
        };
        if !check.applicable {
            return not_covered(Why::whole(
                Class::AgentRefused,
                format!("node {node}: {}", not_applicable(&check)),
            ));
        }
        let current_b = request.optional_object("current", "bootstrapConfig")?;
        let machine_patch =
            Patch::json_patch(&spec_patch(&current.value, &["spec"], &machine.spec));
        let bootstrap_patch = current_b
            .as_ref()
            .and_then(|c| Patch::json_patch(&spec_patch(&c.value, &["spec"], &bootstrap.spec)));
        let complete = machine.complete() && bootstrap.complete();
        let none = check.disruption == pb::Disruption::None as i32;
        let drains = self.will_drain(
            &live,
            desired.spec().get("version").and_then(Value::as_str),
            settings,
            &facts,
            &check,
        );
        let mut message = coverage_message(&machine, &bootstrap);
        let mut why = coverage_why(&machine, &bootstrap);
        if let Some(why) = &mut why {
            super::why::attribute(why, &[(key.clone(), facts.clone())]);
            // What the node lacks, as `CanUpdateMachineSet` says it of its nodes.
            let lacking = why.lacking();
            if !message.is_empty() && !lacking.is_empty() {
                message = bounded(&format!("{message} ({lacking})"), 1024);
            }
        }
        // Drift (issue 37): said in the message; the update repairs it.
        let message = super::drift::with_drift(&self.agents, &peer, message).await;
        tracing::debug!(machine = %key, %node, plan = %translation.id, "CanUpdateMachine checked");
        Ok(Answer::new(
            &CanUpdateMachineResponse {
                kind: Hook::CanUpdateMachine.response_kind(),
                api_version: HOOKS_API_VERSION,
                status: Status::Success,
                message: message.clone(),
                machine_patch,
                infrastructure_machine_patch: None,
                bootstrap_config_patch: bootstrap_patch,
                // A restarted API server or etcd member is a control-plane node out of
                // service (decision 0019), drained or not: when the node says a change that
                // restarts one would change it (the plan carries every file, also those
                // already in place).
                affects_availability: if drains
                    || (translation.restarts_control_plane
                        && restarts_now(&translation.plan, &check))
                {
                    Some(true)
                } else {
                    (complete && none).then_some(false)
                },
            },
            &message,
            if complete { "covered" } else { "partial" },
        )
        .because(why))
    }

    /// `UpdateMachine` the slow way (what [`Updater::handle`] does not answer from
    /// memory): the live Machine and KubeadmConfig, the translation, the agent's
    /// `GetPlanStatus` (and `ApplyPlan` when it does not know the plan). True when the
    /// agent's answer was remembered for `fingerprint`.
    async fn update_machine(
        self: &Arc<Self>,
        request: &HookRequest,
        settings: &Effective,
        fingerprint: &Fingerprint,
    ) -> Result<(Answer, bool), Failure> {
        let began = std::time::Instant::now();
        let desired = request.object("desired", "machine")?;
        desired.expect("Machine", "cluster.x-k8s.io")?;
        let desired_b = request.optional_object("desired", "bootstrapConfig")?;
        let infra = request.optional_object("desired", "infrastructureMachine")?;
        let key = key_of(&desired);

        // Anyone in the cluster can call: act only for a Machine that CAPI is updating in
        // place right now, exactly as the request says.
        // The KubeadmConfig the request's Machine names is read alongside the Machine (the
        // request must equal the live Machine, so it names the same one, or is refused).
        let named = lookup(desired.spec(), &["bootstrap", "configRef"])
            .filter(|r| r.get("kind").and_then(Value::as_str) == Some("KubeadmConfig"))
            .and_then(|r| r.get("name"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let (live, mut early_b) = tokio::join!(self.live_machine(&desired), async {
            match &named {
                Some(name) => Some(self.cluster.kubeadm_config(desired.namespace(), name).await),
                None => None,
            }
        });
        let live = live?;
        self.waits.saw_live(
            &key,
            super::unreachable::live_since(&live, inplace_base::time::now_ms()),
            super::unreachable::spec_digest(&live),
        );
        let wish = self
            .recovery
            .read_live(&key, &live)
            .map(|w| w.at_most_every(settings.retry_min_interval));
        let annotations = lookup(&live, &["metadata", "annotations"]);
        let annotation = |k: &str| annotations.and_then(|a| a.get(k)).and_then(Value::as_str);
        let pending = annotation(PENDING_HOOKS_ANNOTATION)
            .map(|v| v.split(',').any(|h| h.trim() == "UpdateMachine"))
            .unwrap_or(false);
        if annotation(UPDATE_IN_PROGRESS_ANNOTATION).is_none() || !pending {
            return Err(Failure(format!(
                "Machine {key} is not being updated in place (it needs the {UPDATE_IN_PROGRESS_ANNOTATION} \
                 annotation and UpdateMachine in {PENDING_HOOKS_ANNOTATION}); nothing was started"
            )));
        }
        if lookup(&live, &["metadata", "deletionTimestamp"]).is_some_and(|v| !v.is_null()) {
            return Err(Failure(format!(
                "Machine {key} is being deleted; nothing was started"
            )));
        }
        let live_spec = live.get("spec").cloned().unwrap_or(Value::Null);
        if canonical(&live_spec) != canonical(desired.spec()) {
            return Err(Failure(format!(
                "desired.machine.spec differs from the live Machine {key}; nothing was started \
                 (CAPI calls again with the current object)"
            )));
        }
        let config_ref = lookup(&live_spec, &["bootstrap", "configRef"]);
        let bootstrap = match config_ref {
            None => {
                if desired_b.is_some() {
                    return Err(Failure(format!(
                        "desired.bootstrapConfig is set but Machine {key} has no spec.bootstrap.configRef"
                    )));
                }
                None
            }
            Some(r) => {
                let kind = r.get("kind").and_then(Value::as_str).unwrap_or("");
                let name = r.get("name").and_then(Value::as_str).unwrap_or("");
                if kind != "KubeadmConfig" {
                    return Err(Failure(format!(
                        "Machine {key} is bootstrapped by {kind:?}; this updater supports KubeadmConfig only"
                    )));
                }
                let got = match early_b.take() {
                    Some(got) if named.as_deref() == Some(name) => got,
                    _ => self.cluster.kubeadm_config(desired.namespace(), name).await,
                };
                let live_b = got.map_err(|e| Failure(e.to_string()))?.ok_or_else(|| {
                    Failure(format!(
                        "KubeadmConfig {}/{name} of Machine {key} does not exist",
                        desired.namespace()
                    ))
                })?;
                if let Some(d) = &desired_b {
                    d.expect("KubeadmConfig", "bootstrap.cluster.x-k8s.io")?;
                    let live_spec = live_b.get("spec").cloned().unwrap_or(Value::Null);
                    if canonical(&live_spec) != canonical(d.spec()) {
                        return Err(Failure(format!(
                            "desired.bootstrapConfig.spec differs from the live KubeadmConfig {}/{name}; \
                             nothing was started",
                            desired.namespace()
                        )));
                    }
                }
                Some(live_b)
            }
        };
        let peer = self.peer(&live, settings, &key).await?;
        let facts = match self.agents.facts(&peer).await {
            Ok(f) => f,
            Err(e @ AgentError::Unreachable { .. }) => return Ok((waiting(&key, &e), false)),
            Err(e) => return Err(Failure(e.to_string())),
        };
        let (fetched, written) = tokio::join!(
            self.secrets(desired.namespace(), bootstrap.as_ref()),
            bootstrap_data::written(&self.cluster, &live, bootstrap.as_ref()),
        );
        let written = written.map_err(Failure)?;
        let translation = translate_removing(
            &Desired {
                machine: &live,
                infrastructure: infra.as_ref().map(|o| &o.value),
                bootstrap: bootstrap.as_ref(),
            },
            settings,
            &facts,
            &fetched,
            &written,
        )
        .map_err(|e: TranslateError| {
            Failure(format!("Machine {key}: cannot update in place: {e}"))
        })?;
        // Both definitions: an agent before digests v2 reports the first (the updater's
        // plans are small, so computing it costs nothing worth saving).
        let wire = plan_to_pb(&translation.plan);
        let plan = PlanRef {
            id: translation.id,
            digest: translation.plan.digest(),
            digest_v1: translation.plan.digest_v1(),
            peer,
            costs: super::pace::costs(&wire),
            cluster: cluster_of(desired.namespace(), &live_spec),
            hold: settings.update_wait,
        };
        // The version skew rules once more, before any node work (no drain, no ApplyPlan):
        // the control plane may have moved since CanUpdateMachine answered, or no
        // CanUpdateMachine was asked at all (decision 0020). A plan already under way is not
        // refused here: the node is past the point the rules guard.
        if !self.plans.knows(&key, &plan)
            && let Some(refusal) = self.update_skew(&live, &desired, &facts).await
            && !self.agent_runs(&key, &plan).await
        {
            tracing::warn!(machine = %key, reason = %refusal, "UpdateMachine refused: version skew");
            return Err(Failure(format!(
                "{refusal}; nothing was started (the version skew rules are checked again when \
                 the update starts)"
            )));
        }
        // A succeeded plan whose node drifted from it is repaired (below, in `submit`): a new
        // attempt, which drains first as a new plan would.
        let said = match settings.drain {
            super::drain::DrainMode::Never => None,
            _ => Some(super::drift::ask(&self.agents, &plan).await),
        };
        let repairing = said
            .as_ref()
            .is_some_and(|said| super::drift::has_drifted_from(said, &plan));
        if (repairing || !self.plans.knows(&key, &plan))
            && let Some(answer) = self
                .drain_before(&key, &live, settings, &facts, &plan, &wire, repairing)
                .await?
        {
            // The node is being drained first (or the drain cannot go on).
            return Ok((answer, false));
        }
        if self.plans.knows(&key, &plan) {
            // Known here already (its stream broke, a check is repeated): ask the agent.
            return self
                .clone()
                .submit(key, *fingerprint, plan, wire, wish, said)
                .await;
        }
        // A new plan for this Machine: submitted in the background. This call waits for the
        // node to finish it, up to `updateWaitSeconds` after the call began: a plan the
        // agent finishes in that time is done in this very call (CAPI would otherwise wait
        // out a whole retryAfterSeconds); otherwise the answer says where it is.
        let heard = Heard {
            attempt: 0,
            phase: pb::Phase::Unspecified as i32,
            hook: pb::HookResponse {
                status: pb::HookStatus::Success as i32,
                retry_after_seconds: SUBMITTING_RETRY_SECONDS,
                message: format!(
                    "plan {} is being submitted to inplace-agent on node {}",
                    plan.id,
                    plan.peer.node()
                ),
            },
            step: None,
            rebooting: false,
        };
        self.plans
            .submitting(&key, *fingerprint, plan.clone(), heard.clone());
        let this = self.clone();
        let fingerprint = *fingerprint;
        let (task_key, task_plan) = (key.clone(), plan.clone());
        let mut task = tokio::spawn(async move {
            this.submit(task_key, fingerprint, task_plan, wire, wish, said)
                .await
        });
        let until = began + settings.update_wait.max(SUBMIT_WAIT);
        let answered = match tokio::time::timeout_at(until.into(), &mut task).await {
            Ok(Ok(result)) => result?,
            Ok(Err(e)) => return Err(Failure(format!("the submission task ended: {e}"))),
            Err(_) => {
                let retry = paced_retry(&heard, &plan, Default::default());
                return Ok((hook_answer(&heard, retry), true));
            }
        };
        if !answered.1 || answered.0.outcome != "in_progress" {
            return Ok(answered);
        }
        // Submitted and running: the agent's stream reaches the memory; done when it ends.
        if let Some(done) = self.plans.settled(&key, &plan, until).await {
            return Ok((hook_answer(&done, 0), true));
        }
        // Not done within the wait: CAPI is asked back when the plan is expected to be
        // near its end ([`super::pace::next`]; the next call holds then).
        match (self.plans.current(&key), self.plans.seen(&key, &plan)) {
            (Some((now_plan, now)), Some(seen)) if now_plan == plan => {
                let retry = paced_retry(&now, &plan, seen);
                Ok((hook_answer(&now, retry), true))
            }
            _ => Ok(answered),
        }
    }

    /// The answer to a call about `machine`'s `plan`, of which the agent last said `heard`
    /// (`seen`: what the updater saw of its pace), the call having begun at `began`: done
    /// or failed as it is; in progress, held until the plan's terminal status arrives when
    /// that is expected within the call's window (`plan.hold` after `began`, and a hold is
    /// free: [`super::progress::MAX_HOLDS`]), otherwise asked back when the end is expected
    /// within a window ([`super::pace`]). A Machine is so reported done about when its node
    /// is done, whatever the plan's length.
    async fn paced(
        &self,
        machine: &str,
        plan: &PlanRef,
        heard: Heard,
        seen: super::pace::Seen,
        began: std::time::Instant,
    ) -> Answer {
        if !in_progress(&heard) {
            return hook_answer(&heard, 0);
        }
        let until = began + plan.hold;
        let left = until.saturating_duration_since(std::time::Instant::now());
        match super::pace::next(
            &plan.costs,
            heard.position(),
            seen,
            left,
            heard.hook.retry_after_seconds,
        ) {
            super::pace::Next::Retry(retry) => return hook_answer(&heard, retry),
            super::pace::Next::Hold => {}
        }
        let Some(_holding) = self.plans.try_hold() else {
            // As many calls hold as may: this one is asked back in a second.
            return hook_answer(&heard, super::pace::MIN_RETRY_SECONDS);
        };
        if let Some(done) = self.plans.settled(machine, plan, until).await {
            return hook_answer(&done, 0);
        }
        // Not over within the window after all: the agent's word now, asked back when the
        // plan is expected near its end again.
        match (self.plans.current(machine), self.plans.seen(machine, plan)) {
            (Some((now_plan, now)), Some(seen)) if &now_plan == plan => {
                hook_answer(&now, paced_retry(&now, plan, seen))
            }
            _ => hook_answer(&heard, paced_retry(&heard, plan, seen)),
        }
    }

    /// Asks the agent about `plan` (`GetPlanStatus`), submits it when the agent does not
    /// know it (`ApplyPlan`), retries it when it failed and the Machine asks (`wish`),
    /// repairs it when it succeeded and the node drifted from it (`said`: what the agent
    /// said about drift earlier in this call, if it was asked), remembers the answer and
    /// starts following the plan.
    async fn submit(
        self: Arc<Self>,
        key: String,
        fingerprint: Fingerprint,
        plan: PlanRef,
        wire: pb::Plan,
        wish: Option<Wish>,
        said: Option<super::drift::Said>,
    ) -> Result<(Answer, bool), Failure> {
        let outcome = self.ask_agent(&key, &plan, wire).await;
        let status = match outcome {
            Ok(status) => status,
            Err(e) => {
                self.plans.submit_failed(&key, &plan);
                return e;
            }
        };
        let status = self
            .recovery
            .retry_if_asked(&key, &plan, wish.as_ref(), status)
            .await;
        // Drift (issue 37): a succeeded plan on a node that no longer matches it is repaired.
        let status = super::drift::repair_if_drifted(&self.agents, &key, &plan, status, said).await;
        let heard = Heard::of(&status);
        let following = self.plans.record(&key, fingerprint, plan.clone(), &status);
        let seen = self.plans.seen(&key, &plan).unwrap_or_default();
        let answer = hook_answer(&heard, paced_retry(&heard, &plan, seen));
        if let Follow::Start(generation) = following {
            let task = tokio::spawn(follow(
                self.plans.clone(),
                self.agents.clone(),
                key.clone(),
                plan,
                generation,
            ));
            self.plans.started(&key, generation, task.abort_handle());
        }
        Ok((answer, true))
    }

    /// The agent's status of `plan`, after submitting it if it did not know it; `Err` holds
    /// the answer to give instead (waiting for an unreachable agent, or a Failure).
    async fn ask_agent(
        &self,
        key: &str,
        plan: &PlanRef,
        wire: pb::Plan,
    ) -> Result<pb::PlanStatus, Result<(Answer, bool), Failure>> {
        let PlanRef {
            id, digest, peer, ..
        } = plan;
        let node = peer.node();
        let known = match self.agents.status(peer, id).await {
            Ok(s) => s.filter(|s| plan.has_digest(&s.digest)),
            Err(e @ AgentError::Unreachable { .. }) => return Err(Ok((waiting(key, &e), false))),
            Err(e) => return Err(Err(Failure(e.to_string()))),
        };
        let status = match known {
            Some(s) => s,
            None => match self.agents.apply(peer, wire).await {
                Ok(r) => {
                    if r.created {
                        self.metrics.plan_submitted();
                        tracing::info!(machine = %key, %node, plan = %id, %digest, "plan submitted");
                    }
                    r.status.unwrap_or_default()
                }
                Err(e @ AgentError::Unreachable { .. }) => {
                    return Err(Ok((waiting(key, &e), false)));
                }
                Err(e) => {
                    self.metrics.plan_failure("refused");
                    return Err(Err(Failure(format!("Machine {key}: {e}"))));
                }
            },
        };
        if status.hook_response.is_none() {
            return Err(Err(Failure(format!(
                "inplace-agent on node {node} sent no hook response for plan {id}"
            ))));
        }
        Ok(status)
    }
}

/// Whether the agent's word is of a plan still in progress (`Success` and a retry).
fn in_progress(heard: &Heard) -> bool {
    heard.hook.status == pb::HookStatus::Success as i32 && heard.hook.retry_after_seconds > 0
}

/// `retryAfterSeconds` for a plan in progress answered without holding: when it is expected
/// to be near its end ([`super::pace::next`] with no window left).
fn paced_retry(heard: &Heard, plan: &PlanRef, seen: super::pace::Seen) -> i32 {
    match super::pace::next(
        &plan.costs,
        heard.position(),
        seen,
        std::time::Duration::ZERO,
        heard.hook.retry_after_seconds,
    ) {
        super::pace::Next::Retry(seconds) => seconds,
        super::pace::Next::Hold => super::pace::MIN_RETRY_SECONDS,
    }
}

/// The answer for what the agent said: its hook response, a plan in progress asked back
/// after `retry` seconds (paced: [`paced_retry`], [`Updater::paced`]).
fn hook_answer(heard: &Heard, retry: i32) -> Answer {
    let hook = &heard.hook;
    let ok = hook.status == pb::HookStatus::Success as i32;
    let outcome = match (ok, hook.retry_after_seconds) {
        (true, 0) => "done",
        (true, _) => "in_progress",
        (false, _) => "failure",
    };
    let retry = if in_progress(heard) {
        retry.max(super::pace::MIN_RETRY_SECONDS)
    } else {
        0
    };
    Answer::new(
        &UpdateMachineResponse::new(
            if ok { Status::Success } else { Status::Failure },
            hook.message.clone(),
            retry,
        ),
        &hook.message,
        outcome,
    )
}

/// A Machine's workload cluster as the fleet metrics label it: `<namespace>/<spec.clusterName>`
/// (cluster names are unique only within a namespace).
fn cluster_of(namespace: &str, spec: &Value) -> String {
    let name = lookup(spec, &["clusterName"])
        .and_then(Value::as_str)
        .unwrap_or_default();
    format!("{namespace}/{name}")
}

/// A `CanUpdateMachineSet` answer that covers nothing: Cluster API rolls the MachineSet out.
fn machine_set_not_covered(why: Why) -> Answer {
    let message = bounded(&why.sentence(), 1024);
    Answer::new(
        &CanUpdateMachineSetResponse {
            kind: Hook::CanUpdateMachineSet.response_kind(),
            api_version: HOOKS_API_VERSION,
            status: Status::Success,
            message: message.clone(),
            machine_set_patch: None,
            infrastructure_machine_template_patch: None,
            bootstrap_config_template_patch: None,
            affects_availability: None,
        },
        &message,
        "not_covered",
    )
    .because(Some(why))
}

/// A `CanUpdateMachine` answer that covers nothing: Cluster API replaces the Machine.
fn machine_not_covered(why: Why) -> Answer {
    let message = bounded(&why.sentence(), 1024);
    Answer::new(
        &CanUpdateMachineResponse {
            kind: Hook::CanUpdateMachine.response_kind(),
            api_version: HOOKS_API_VERSION,
            status: Status::Success,
            message: message.clone(),
            machine_patch: None,
            infrastructure_machine_patch: None,
            bootstrap_config_patch: None,
            affects_availability: None,
        },
        &message,
        "not_covered",
    )
    .because(Some(why))
}

/// What `CanUpdateMachine` decides before any node is asked (pure): a request it answers
/// with a Failure (`Err`), why nothing can be covered (`Some`), or `None` to go on.
pub fn machine_precheck(
    request: &HookRequest,
    settings: &Settings,
) -> Result<Option<Why>, Failure> {
    let current = request.object("current", "machine")?;
    current.expect("Machine", "cluster.x-k8s.io")?;
    let desired = request.object("desired", "machine")?;
    desired.expect("Machine", "cluster.x-k8s.io")?;
    let current_b = request.optional_object("current", "bootstrapConfig")?;
    let desired_b = request.optional_object("desired", "bootstrapConfig")?;
    request.optional_object("desired", "infrastructureMachine")?;
    if settings.disable_in_place {
        return Ok(Some(Why::whole(
            Class::Settings,
            "in-place updates are disabled (settings.disableInPlaceUpdates)",
        )));
    }
    for b in [&current_b, &desired_b].into_iter().flatten() {
        if b.kind() != "KubeadmConfig" {
            return Ok(Some(Why::whole(
                Class::UnsupportedBootstrap,
                format!(
                    "{}.kind {:?}: this updater translates KubeadmConfig only; a rollout replaces the Machine",
                    b.field,
                    b.kind()
                ),
            )));
        }
        b.expect("KubeadmConfig", "bootstrap.cluster.x-k8s.io")?;
    }
    if current_b.is_some() != desired_b.is_some() {
        return Ok(Some(Why::whole(
            Class::FieldNotInPlace,
            "only one side has a bootstrap config",
        )));
    }
    // Everything a call reads is in the Machine's own namespace (the Secrets its files
    // name included): a bootstrap config of another namespace is not this Machine's.
    if let Some(b) = [&current_b, &desired_b]
        .into_iter()
        .flatten()
        .find(|b| b.namespace() != desired.namespace())
    {
        return Err(Failure(format!(
            "bad request: {}.metadata.namespace: is {:?}, not the Machine's namespace {:?}; nothing was read",
            b.field,
            b.namespace(),
            desired.namespace()
        )));
    }
    Ok(None)
}

/// The coverage of a `CanUpdateMachine` request on a node that can do `caps` (pure): of
/// the Machine's spec and of its KubeadmConfig's.
pub fn cover_machine_request(
    request: &HookRequest,
    caps: super::translate::Capabilities,
) -> Result<(Coverage, Coverage), Failure> {
    let current = request.object("current", "machine")?;
    let desired = request.object("desired", "machine")?;
    let current_b = request.optional_object("current", "bootstrapConfig")?;
    let desired_b = request.optional_object("desired", "bootstrapConfig")?;
    let machine = cover_machine(current.spec(), desired.spec(), caps);
    let version_changes = machine.covered.iter().any(|c| c == "version");
    let bootstrap = match (&current_b, &desired_b) {
        (Some(c), Some(d)) => cover_kubeadm(c.spec(), d.spec(), caps, version_changes),
        _ => Coverage::default(),
    };
    Ok((machine, bootstrap))
}

/// Why a coverage is not complete, from the gaps [`super::patch`] found.
pub fn coverage_why(machine: &Coverage, bootstrap: &Coverage) -> Option<Why> {
    Why::of(
        machine
            .uncovered
            .iter()
            .chain(&bootstrap.uncovered)
            .cloned()
            .collect(),
    )
}

/// `CanUpdateMachineSet` for the nodes whose agents said `facts` (by Machine; none: what a
/// current agent can do), pure: the coverage is what all of them can do, and the reason
/// names the nodes that lack what a field needs.
pub fn decide_machine_set(
    request: &HookRequest,
    settings: &Settings,
    facts: &[(String, NodeFacts)],
) -> Result<Answer, Failure> {
    let mut caps = NodeFacts::assumed("").capabilities();
    let mut lacking = Vec::new();
    for (machine, f) in facts {
        let c = f.capabilities();
        let missing = missing(c);
        if !missing.is_empty() {
            lacking.push(format!(
                "node {} (Machine {machine}) cannot move {}",
                f.node_name,
                missing.join(", ")
            ));
        }
        caps = super::translate::Capabilities {
            files: caps.files && c.files,
            prune: caps.prune && c.prune,
            kubelet_flags: caps.kubelet_flags && c.kubelet_flags,
            version: caps.version && c.version,
            ..caps
        };
    }
    let note = match lacking.len() {
        0 => String::new(),
        1..=3 => lacking.join("; "),
        n => format!("{} and {} more", lacking[..3].join("; "), n - 3),
    };
    let mut answer = can_update_machine_set_for(request, settings, caps, &note)?;
    if let Some(why) = &mut answer.why {
        super::why::attribute(why, facts);
    }
    Ok(answer)
}

fn unreachable_discovery() -> Result<Answer, Failure> {
    Err(Failure(
        "discovery is answered before the hook handlers".into(),
    ))
}

/// In progress while the agent cannot be reached: the message shows in the Machine's
/// `Updating` condition, and CAPI asks again.
fn waiting(machine: &str, e: &AgentError) -> Answer {
    let message = bounded(&format!("waiting: Machine {machine}: {e}"), 1024);
    let mut answer = Answer::new(
        &UpdateMachineResponse::new(Status::Success, message.clone(), UNREACHABLE_RETRY_SECONDS),
        &message,
        "in_progress",
    );
    answer.unreachable = Some(e.to_string());
    answer
}

/// Seconds until CAPI asks again after a read of the management cluster failed transiently.
pub const READ_TROUBLE_RETRY_SECONDS: i32 = 5;

/// `answer`, made while a read of the management cluster failed transiently (`trouble`,
/// [`crate::cluster::with_read_trouble`]; decision 0023): what that read would have said
/// is unknown, so an answer that did not go the whole way is no decision. A `CanUpdate*`
/// answer that does not cover everything becomes a Failure (CAPI decides nothing and asks
/// again; a Success without patches would have it replace the Machine), and an
/// `UpdateMachine` Failure becomes a wait (the Machine is not marked failed for the API
/// server's moment). A covered or in-progress answer stands.
fn undecided(hook: Hook, answer: Answer, trouble: &str) -> Answer {
    let decided = match hook {
        Hook::CanUpdateMachine | Hook::CanUpdateMachineSet => answer.outcome == "covered",
        _ => answer.outcome != "failure",
    };
    if decided {
        return answer;
    }
    let object = if answer.object.is_empty() {
        String::new()
    } else {
        let kind = if hook == Hook::CanUpdateMachineSet {
            "MachineSet"
        } else {
            "Machine"
        };
        format!("{kind} {}: ", answer.object)
    };
    let mut changed = if hook == Hook::UpdateMachine {
        let message = bounded(
            &format!(
                "waiting: {object}the management cluster's API server did not answer a read \
                 ({trouble}); asking again in {READ_TROUBLE_RETRY_SECONDS} s"
            ),
            1024,
        );
        Answer::new(
            &UpdateMachineResponse::new(
                Status::Success,
                message.clone(),
                READ_TROUBLE_RETRY_SECONDS,
            ),
            &message,
            "in_progress",
        )
    } else {
        let message = bounded(
            &format!(
                "{object}nothing decided: the management cluster's API server did not answer a \
                 read ({trouble}); Cluster API asks again"
            ),
            1024,
        );
        Answer::new(
            &FailureResponse::new(hook, message.clone()),
            &message,
            "failure",
        )
    };
    tracing::warn!(hook = hook.path(), object = %answer.object, reason = %changed.message, "a read of the management cluster failed transiently");
    changed.object = answer.object;
    changed.subject = answer.subject;
    changed
}

fn not_applicable(check: &pb::CheckPlanResponse) -> String {
    let mut reasons: Vec<String> = check
        .errors
        .iter()
        .map(|e| format!("{}: {}", e.field, e.message))
        .collect();
    for c in &check.changes {
        if c.verdict == pb::ChangeVerdict::Unsupported as i32
            || c.verdict == pb::ChangeVerdict::Invalid as i32
        {
            reasons.push(format!(
                "changes[{}] {} {}: {}",
                c.index, c.kind, c.target, c.reason
            ));
        }
    }
    for c in &check.checks {
        if !c.supported {
            reasons.push(format!(
                "verify[{}] {} {}: {}",
                c.index, c.kind, c.target, c.reason
            ));
        }
    }
    if reasons.is_empty() {
        "the agent cannot apply the plan".into()
    } else {
        format!("the agent cannot apply the plan: {}", reasons.join("; "))
    }
}

fn coverage_message(machine: &Coverage, bootstrap: &Coverage) -> String {
    let uncovered: Vec<String> = machine
        .uncovered
        .iter()
        .chain(&bootstrap.uncovered)
        .map(ToString::to_string)
        .collect();
    if uncovered.is_empty() {
        return String::new();
    }
    bounded(&format!("not in place: {}", uncovered.join("; ")), 1024)
}

/// What `caps` lacks of what a current agent can do, in words.
fn missing(caps: super::translate::Capabilities) -> Vec<&'static str> {
    let mut out = Vec::new();
    if !caps.version {
        out.push("the Kubernetes version (no package manager or kubeadm upgrade)");
    }
    if !caps.kubelet_flags {
        out.push("kubelet flags (no service management to restart the kubelet)");
    }
    if !caps.files {
        out.push("files");
    }
    if !caps.prune {
        out.push("removed files");
    }
    out
}

fn bounded(s: &str, max: usize) -> String {
    inplace_api::bounded::bounded(s, max)
}

/// `CanUpdateMachineSet` without asking any node: coverage is what a current agent on a
/// kubeadm node can do ([`NodeFacts::assumed`]). The updater asks the agents of the current
/// MachineSet's Machines first ([`Updater::handle`]) and answers with
/// [`can_update_machine_set_for`] with what they can all do.
pub fn can_update_machine_set(
    request: &HookRequest,
    settings: &Settings,
) -> Result<Answer, Failure> {
    can_update_machine_set_for(request, settings, NodeFacts::assumed("").capabilities(), "")
}

/// `CanUpdateMachineSet` for nodes that can do `caps`; `note` (why less than a current
/// agent can) goes into the message.
pub fn can_update_machine_set_for(
    request: &HookRequest,
    settings: &Settings,
    caps: super::translate::Capabilities,
    note: &str,
) -> Result<Answer, Failure> {
    let current = request.object("current", "machineSet")?;
    current.expect("MachineSet", "cluster.x-k8s.io")?;
    let desired = request.object("desired", "machineSet")?;
    desired.expect("MachineSet", "cluster.x-k8s.io")?;
    let current_t = request.optional_object("current", "bootstrapConfigTemplate")?;
    let desired_t = request.optional_object("desired", "bootstrapConfigTemplate")?;
    let mut foreign = None;
    for t in [&current_t, &desired_t].into_iter().flatten() {
        if t.kind() != "KubeadmConfigTemplate" {
            foreign = Some(format!(
                "{}.kind {:?}: this updater translates KubeadmConfigTemplate only; a rollout replaces the Machines",
                t.field,
                t.kind()
            ));
            continue;
        }
        t.expect("KubeadmConfigTemplate", "bootstrap.cluster.x-k8s.io")?;
    }
    if settings.disable_in_place {
        return Ok(machine_set_not_covered(Why::whole(
            Class::Settings,
            "in-place updates are disabled (settings.disableInPlaceUpdates)",
        )));
    }
    if let Some(message) = foreign {
        return Ok(machine_set_not_covered(Why::whole(
            Class::UnsupportedBootstrap,
            message,
        )));
    }
    if current_t.is_some() != desired_t.is_some() {
        return Ok(machine_set_not_covered(Why::whole(
            Class::FieldNotInPlace,
            "only one side has a bootstrap config template",
        )));
    }
    const TEMPLATE_SPEC: &[&str] = &["spec", "template", "spec"];
    let null = Value::Null;
    let spec_of = |o: &Object| {
        lookup(&o.value, TEMPLATE_SPEC)
            .cloned()
            .unwrap_or(Value::Null)
    };
    let machine = cover_machine(
        lookup(&current.value, TEMPLATE_SPEC).unwrap_or(&null),
        lookup(&desired.value, TEMPLATE_SPEC).unwrap_or(&null),
        caps,
    );
    let version_changes = machine.covered.iter().any(|c| c == "version");
    let bootstrap = match (&current_t, &desired_t) {
        (Some(c), Some(d)) => cover_kubeadm(&spec_of(c), &spec_of(d), caps, version_changes),
        _ => Coverage::default(),
    };
    let complete = machine.complete() && bootstrap.complete();
    let disruptive = machine.disruptive || bootstrap.disruptive;
    let machine_set_patch =
        Patch::json_patch(&spec_patch(&current.value, TEMPLATE_SPEC, &machine.spec));
    let template_patch = current_t
        .as_ref()
        .and_then(|c| Patch::json_patch(&spec_patch(&c.value, TEMPLATE_SPEC, &bootstrap.spec)));
    let mut message = coverage_message(&machine, &bootstrap);
    if !message.is_empty() && !note.is_empty() {
        message = bounded(&format!("{message} ({note})"), 1024);
    }
    Ok(Answer::new(
        &CanUpdateMachineSetResponse {
            kind: Hook::CanUpdateMachineSet.response_kind(),
            api_version: HOOKS_API_VERSION,
            status: Status::Success,
            message: message.clone(),
            machine_set_patch,
            infrastructure_machine_template_patch: None,
            bootstrap_config_template_patch: template_patch,
            affects_availability: if super::drain::machine_set_drains(
                settings.drain,
                version_changes,
                !machine.covered.is_empty() || !bootstrap.covered.is_empty(),
            ) {
                Some(true)
            } else {
                (complete && !disruptive).then_some(false)
            },
        },
        &message,
        if complete { "covered" } else { "partial" },
    )
    .because(coverage_why(&machine, &bootstrap)))
}

/// Whether the node's `CheckPlan` answer says a change of `plan` that restarts a
/// control-plane component ([`super::translate::restarts_a_component`]) would change it.
fn restarts_now(plan: &inplace_plan::Plan, check: &pb::CheckPlanResponse) -> bool {
    check
        .changes
        .iter()
        .filter(|c| c.verdict == pb::ChangeVerdict::WouldChange as i32)
        .filter_map(|c| plan.changes.get(c.index as usize))
        .any(super::translate::restarts_a_component)
}
