//! A failed plan, seen and retried from kubectl.
//!
//! - **Why it failed**: when the updater answers Cluster API `Failure` for a plan's attempt,
//!   it creates one `v1` Event on the Machine (reason `InPlaceUpdateFailed`, type
//!   `Warning`) with the agent's message, so `kubectl describe machine` shows it. The Event's
//!   name is derived from the Machine's uid, the plan and the attempt: every replica, and a
//!   restarted one, creates the same name, and the API server's 409 AlreadyExists makes the
//!   second create a no-op. This replica also remembers what it reported, so a failure
//!   polled for hours costs one create, not one per poll, and the Machine's uid from the
//!   last time it read the Machine, so a report costs no read.
//! - **Retry**: a person sets the annotation [`RETRY_ANNOTATION`] on the Machine to any
//!   value. When the agent says the plan's latest attempt failed and the live Machine
//!   carries a value not yet acted on for this plan, the updater records the value on the
//!   Machine ([`RETRIED_ANNOTATION`]: plan, the attempt it retried from, the value) and then
//!   asks the agent `RetryPlan` with `from_attempt` = the failed attempt. The record makes it
//!   once per value, for every replica and across restarts; `from_attempt` makes two
//!   replicas (or a record written by a replica that died before it asked the agent) start
//!   one attempt, not two.
//!
//! Neither ever changes the hook's answer: a failure to create the Event or to write the
//! record is logged at warn (a record not written means no retry yet: the next call that
//! takes the slow way tries again).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::agent::Agents;
use super::cluster::Cluster;
use super::progress::{Heard, PlanRef, Plans, terminal};
use super::translate::lookup;
use inplace_api::pb;

/// Set on a Machine (to any value, e.g. `$(date +%s)`) to retry its failed plan once per
/// value.
pub const RETRY_ANNOTATION: &str = "inplace-agent.github.io/retry";

/// Written by the updater on a Machine: the retry it acted on ([`Retried`], JSON).
pub const RETRIED_ANNOTATION: &str = "inplace-agent.github.io/retried";

/// The Event reason of a failed attempt.
pub const FAILED_REASON: &str = "InPlaceUpdateFailed";

/// The Event reason of a retry the annotation started.
pub const RETRIED_REASON: &str = "InPlaceUpdateRetried";

/// `source.component` and `reportingComponent` of the Events.
pub const COMPONENT: &str = "inplace-updater";

/// The longest Event message (the API server takes more; `kubectl describe` shows one line).
const MAX_MESSAGE: usize = 1024;

/// The most Machines remembered; beyond, the memory starts afresh (a report forgotten costs
/// one read and one create answered 409).
const MAX_KNOWN: usize = 10_000;

/// Whether the agent's word is a finished attempt that did not succeed (CAPI is answered
/// `Failure`).
pub fn failed(heard: &Heard) -> bool {
    terminal(heard.phase) && heard.hook.status == pb::HookStatus::Failure as i32
}

/// The retry acted on for a Machine, as [`RETRIED_ANNOTATION`] records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Retried {
    /// The plan id retried.
    pub plan: String,
    /// The attempt that had failed and was retried.
    pub from_attempt: u32,
    /// The value of [`RETRY_ANNOTATION`] that asked for it.
    pub value: String,
    /// When it was acted on (Unix seconds; absent in records written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<u64>,
}

/// What the live Machine asks: the value of its [`RETRY_ANNOTATION`], and the retry acted
/// on last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wish {
    /// The Machine's namespace.
    pub namespace: String,
    /// The Machine's name.
    pub name: String,
    /// The annotation's value (any string, empty included).
    pub value: String,
    /// [`RETRIED_ANNOTATION`], when present and readable.
    pub done: Option<Retried>,
    /// The least time between two retries (`settings.retryMinIntervalSeconds`).
    pub min_interval: std::time::Duration,
}

impl Wish {
    /// The wish of a live Machine; `None` without the retry annotation.
    pub fn of(live: &Value) -> Option<Wish> {
        let annotations = lookup(live, &["metadata", "annotations"])?;
        let value = annotations.get(RETRY_ANNOTATION)?.as_str()?.to_owned();
        let meta = |k: &str| {
            lookup(live, &["metadata", k])
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        Some(Wish {
            namespace: meta("namespace"),
            name: meta("name"),
            value,
            done: annotations
                .get(RETRIED_ANNOTATION)
                .and_then(Value::as_str)
                .and_then(|s| serde_json::from_str(s).ok()),
            min_interval: std::time::Duration::ZERO,
        })
    }

    /// The same wish, held to at least `min_interval` between two retries.
    pub fn at_most_every(mut self, min_interval: std::time::Duration) -> Wish {
        self.min_interval = min_interval;
        self
    }

    /// How long a new retry must still wait at `now_s` (Unix seconds): the time left of
    /// [`Wish::min_interval`] since the last retry acted on; `None` when it may start.
    pub fn too_soon(&self, now_s: u64) -> Option<u64> {
        let last = self.done.as_ref()?.at?;
        let left = (last + self.min_interval.as_secs()).saturating_sub(now_s);
        (left > 0).then_some(left)
    }
}

/// What to do about a wish, given the agent's word on the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Nothing: the plan did not fail, or this value was acted on for it.
    Leave,
    /// Retry from the failed attempt; `record`: write the record first (it is there when
    /// an earlier call wrote it but did not get to ask the agent).
    Retry {
        /// Write [`RETRIED_ANNOTATION`] before asking the agent.
        record: bool,
    },
}

/// Whether `wish` asks for a retry of plan `plan_id`, whose latest attempt the agent
/// described as `heard` (pure).
pub fn decide(wish: &Wish, plan_id: &str, heard: &Heard) -> Decision {
    if !failed(heard) {
        return Decision::Leave;
    }
    match &wish.done {
        Some(done) if done.plan == plan_id && done.value == wish.value => {
            if done.from_attempt == heard.attempt {
                // Recorded, but the attempt it asked for never started: ask again
                // (`from_attempt` keeps it at one).
                Decision::Retry { record: false }
            } else {
                Decision::Leave
            }
        }
        _ => Decision::Retry { record: true },
    }
}

/// The Machine an Event is about (its `involvedObject`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Involved {
    /// `cluster.x-k8s.io/v1beta2`.
    pub api_version: String,
    /// `Machine`.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// uid (`kubectl describe` finds Events by it).
    pub uid: String,
}

/// The name of the Event of (`reason`, plan, attempt) on a Machine: the same for every
/// replica and restart, another for a Machine of the same name created again (uid).
pub fn event_name(involved: &Involved, plan_id: &str, attempt: u32, reason: &str) -> String {
    use sha2::Digest as _;
    let hash = sha2::Sha256::digest(format!("{}\n{plan_id}\n{attempt}\n{reason}", involved.uid));
    // A DNS subdomain of at most 253 characters: the Machine's name (cut to leave room,
    // not ending in '.' or '-'), a dot, 16 hex digits.
    let mut base: String = involved.name.chars().take(253 - 17).collect();
    while base.ends_with(['.', '-']) {
        base.pop();
    }
    format!("{base}.{}", &hex::encode(hash)[..16])
}

/// The message of a failed attempt's Event: the attempt and the agent's message (which
/// names the plan, the failed step and why), bounded.
pub fn failure_message(plan_id: &str, attempt: u32, agent_message: &str) -> String {
    let text = if agent_message.contains(plan_id) {
        format!("attempt {attempt}: {agent_message}")
    } else {
        format!("plan {plan_id} attempt {attempt}: {agent_message}")
    };
    inplace_api::bounded::bounded(&text, MAX_MESSAGE)
}

/// The message of a retry's Event.
pub fn retried_message(plan_id: &str, attempt: u32, value: &str) -> String {
    inplace_api::bounded::bounded(
        &format!(
            "plan {plan_id}: attempt {attempt} started, asked by {RETRY_ANNOTATION}={:?}",
            inplace_api::bounded::bounded(value, 128)
        ),
        MAX_MESSAGE,
    )
}

/// A `v1` Event as the API server takes it (`now_ms`: its timestamps, Unix milliseconds).
pub fn event(
    involved: &Involved,
    name: &str,
    (reason, kind): (&str, &str),
    message: &str,
    instance: &str,
    now_ms: u64,
) -> Value {
    // metav1.Time: RFC 3339 to the second.
    let at = inplace_base::time::rfc3339(now_ms - now_ms % 1000).replace(".000Z", "Z");
    json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": involved.namespace},
        "involvedObject": {
            "apiVersion": involved.api_version,
            "kind": involved.kind,
            "namespace": involved.namespace,
            "name": involved.name,
            "uid": involved.uid,
        },
        "reason": reason,
        "message": message,
        "type": kind,
        "action": "UpdateMachine",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
        "firstTimestamp": at,
        "lastTimestamp": at,
        "count": 1,
    })
}

/// What this replica knows of a Machine for its Events.
#[derive(Debug, Default)]
struct Known {
    /// The uid it last read.
    uid: Option<String>,
    /// The (plan, attempt) whose failure it reported.
    reported: Option<(String, u32)>,
}

/// By Machine (`namespace/name`): its uid, and what was reported (pure memory).
#[derive(Debug, Default)]
struct Machines(Mutex<HashMap<String, Known>>);

impl Machines {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Known>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn known(&self, machine: &str, f: impl FnOnce(&mut Known)) {
        let mut machines = self.lock();
        if machines.len() >= MAX_KNOWN && !machines.contains_key(machine) {
            machines.clear();
        }
        f(machines.entry(machine.to_owned()).or_default());
    }

    /// The Machine's uid as just read.
    fn read(&self, machine: &str, uid: &str) {
        self.known(machine, |k| k.uid = Some(uid.to_owned()));
    }

    fn uid(&self, machine: &str) -> Option<String> {
        self.lock().get(machine).and_then(|k| k.uid.clone())
    }

    /// True the first time (for this replica) the failure of (plan, attempt) is seen.
    fn first(&self, machine: &str, plan: &str, attempt: u32) -> bool {
        let now = Some((plan.to_owned(), attempt));
        let mut first = false;
        self.known(machine, |k| {
            first = k.reported != now;
            k.reported = now;
        });
        first
    }

    /// The report of (plan, attempt) did not reach the API server: try on a later call.
    fn unreported(&self, machine: &str, plan: &str, attempt: u32) {
        if let Some(k) = self.lock().get_mut(machine)
            && k.reported == Some((plan.to_owned(), attempt))
        {
            k.reported = None;
        }
    }
}

/// Reports failed plans as Events and retries them on request, for one replica.
pub struct Recovery {
    cluster: Cluster,
    agents: Arc<Agents>,
    machines: Machines,
    /// `reportingInstance`: the pod's name.
    instance: String,
}

impl std::fmt::Debug for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recovery")
            .field("instance", &self.instance)
            .finish()
    }
}

impl Recovery {
    /// Nothing reported yet; the instance is the host (pod) name.
    pub fn new(cluster: Cluster, agents: Arc<Agents>) -> Recovery {
        Recovery {
            cluster,
            agents,
            machines: Machines::default(),
            instance: std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| COMPONENT.to_owned()),
        }
    }

    /// The `reportingInstance` of its Events (the pod's name).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The slow way read the live Machine `machine` (`namespace/name`): its uid is kept for
    /// its Events, and what it asks of a failed plan is returned.
    pub fn read_live(&self, machine: &str, live: &Value) -> Option<Wish> {
        if let Some(uid) = lookup(live, &["metadata", "uid"]).and_then(Value::as_str) {
            self.machines.read(machine, uid);
        }
        Wish::of(live)
    }

    /// `UpdateMachine` of `machine` was answered `Failure` with `message`: when that is the
    /// agent's word on a failed attempt (`plans`), it is reported as an Event, in the
    /// background, once per attempt.
    pub fn answered_failure(self: &Arc<Self>, plans: &Plans, machine: &str, message: &str) {
        let Some((plan, heard)) = plans.current(machine) else {
            return;
        };
        if !failed(&heard)
            || heard.hook.message != message
            || !self.machines.first(machine, &plan.id, heard.attempt)
        {
            return;
        }
        let (this, machine) = (self.clone(), machine.to_owned());
        tokio::spawn(async move {
            let message = failure_message(&plan.id, heard.attempt, &heard.hook.message);
            let what = (FAILED_REASON, "Warning");
            if !this
                .emit(&machine, &plan.id, heard.attempt, what, &message)
                .await
            {
                this.machines.unreported(&machine, &plan.id, heard.attempt);
            }
        });
    }

    /// Creates the Event of (`reason`, plan, attempt) on `machine` (`namespace/name`);
    /// false when the API server could not be told (logged at warn). The agent-unreachable
    /// Events use it too, with the wait in place of the plan (`handlers`).
    pub(crate) async fn emit(
        &self,
        machine: &str,
        plan_id: &str,
        attempt: u32,
        what: (&str, &str),
        message: &str,
    ) -> bool {
        let (namespace, name) = machine.split_once('/').unwrap_or(("", machine));
        let uid = match self.machines.uid(machine) {
            Some(uid) => uid,
            None => match self.cluster.machine(namespace, name).await {
                Ok(Some(live)) => lookup(&live, &["metadata", "uid"])
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                Ok(None) => return true,
                Err(e) => {
                    tracing::warn!(%machine, reason = what.0, error = %e, "event not created");
                    return false;
                }
            },
        };
        let involved = Involved {
            api_version: super::cluster::machine_resource().api_version,
            kind: "Machine".into(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid,
        };
        let event_name = event_name(&involved, plan_id, attempt, what.0);
        let event = event(
            &involved,
            &event_name,
            what,
            message,
            &self.instance,
            inplace_base::time::now_ms(),
        );
        match self.cluster.create_event(&event).await {
            Ok(true) => {
                tracing::info!(%machine, plan = %plan_id, attempt, reason = what.0, event = %event_name, "event created");
                true
            }
            Ok(false) => {
                tracing::debug!(%machine, plan = %plan_id, attempt, event = %event_name, "event exists already");
                true
            }
            Err(e) => {
                tracing::warn!(%machine, plan = %plan_id, attempt, reason = what.0, error = %e, "event not created");
                false
            }
        }
    }

    /// The agent said `status` of `plan`: when it failed and the live Machine asks for a
    /// retry not yet acted on, record it and start the next attempt; the status to answer
    /// with (the new attempt's, or `status` as it was).
    pub async fn retry_if_asked(
        self: &Arc<Self>,
        machine: &str,
        plan: &PlanRef,
        wish: Option<&Wish>,
        status: pb::PlanStatus,
    ) -> pb::PlanStatus {
        let Some(wish) = wish else {
            return status;
        };
        let heard = Heard::of(&status);
        let Decision::Retry { record } = decide(wish, &plan.id, &heard) else {
            return status;
        };
        let now_s = inplace_base::time::now_ms() / 1000;
        if record && let Some(left) = wish.too_soon(now_s) {
            // Anyone who may patch the Machine could otherwise rerun its plan (a reboot, a
            // drain) as fast as they can write an annotation.
            tracing::warn!(%machine, plan = %plan.id, wait_seconds = left,
                "retry asked again within settings.retryMinIntervalSeconds of the last one; not yet");
            return status;
        }
        if record {
            let retried = Retried {
                plan: plan.id.clone(),
                from_attempt: heard.attempt,
                value: wish.value.clone(),
                at: Some(now_s),
            };
            let text = serde_json::to_string(&retried).unwrap_or_default();
            if let Err(e) = self
                .cluster
                .annotate_machine(&wish.namespace, &wish.name, RETRIED_ANNOTATION, &text)
                .await
            {
                tracing::warn!(%machine, plan = %plan.id, error = %e, "retry not started: the record of it could not be written");
                return status;
            }
        }
        match self.agents.retry(&plan.peer, &plan.id, heard.attempt).await {
            Ok(next) if next.hook_response.is_some() => {
                if next.attempt == heard.attempt + 1 {
                    tracing::info!(%machine, node = %plan.peer.node(), plan = %plan.id, attempt = next.attempt, "plan retried ({RETRY_ANNOTATION})");
                    let (this, machine, id, attempt) = (
                        self.clone(),
                        machine.to_owned(),
                        plan.id.clone(),
                        next.attempt,
                    );
                    let message = retried_message(&id, attempt, &wish.value);
                    tokio::spawn(async move {
                        let what = (RETRIED_REASON, "Normal");
                        this.emit(&machine, &id, attempt, what, &message).await;
                    });
                }
                next
            }
            Ok(_) => status,
            Err(e) => {
                tracing::warn!(%machine, plan = %plan.id, error = %e, "retry not started");
                status
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heard(phase: pb::Phase, status: pb::HookStatus, attempt: u32) -> Heard {
        Heard {
            attempt,
            phase: phase as i32,
            hook: pb::HookResponse {
                status: status as i32,
                retry_after_seconds: 0,
                message: "plan ns/m@abc failed and was rolled back: verify[0] kubeletVersion: no"
                    .into(),
            },
            step: None,
            rebooting: false,
        }
    }

    fn failed_at(attempt: u32) -> Heard {
        heard(pb::Phase::RolledBack, pb::HookStatus::Failure, attempt)
    }

    fn wish(value: &str, done: Option<(&str, u32, &str)>) -> Wish {
        Wish {
            namespace: "ns".into(),
            name: "m".into(),
            value: value.into(),
            done: done.map(|(plan, from_attempt, value)| Retried {
                plan: plan.into(),
                from_attempt,
                value: value.into(),
                at: None,
            }),
            min_interval: std::time::Duration::ZERO,
        }
    }

    #[test]
    fn a_retry_waits_out_the_minimum_interval_since_the_last_one() {
        let mut w =
            wish("2", Some(("p", 1, "1"))).at_most_every(std::time::Duration::from_secs(300));
        assert_eq!(
            w.too_soon(1_000),
            None,
            "a record without a time does not hold it back"
        );
        w.done.as_mut().unwrap().at = Some(1_000);
        assert_eq!(w.too_soon(1_010), Some(290));
        assert_eq!(w.too_soon(1_300), None);
        let w = w.at_most_every(std::time::Duration::ZERO);
        assert_eq!(w.too_soon(1_001), None, "0: no minimum");
    }

    #[test]
    fn a_new_value_retries_a_failed_plan_once() {
        let retry = Decision::Retry { record: true };
        assert_eq!(decide(&wish("1", None), "p", &failed_at(1)), retry);
        // Acted on from attempt 1; attempt 2 failed too: the same value leaves it.
        let done = Some(("p", 1, "1"));
        assert_eq!(
            decide(&wish("1", done), "p", &failed_at(2)),
            Decision::Leave
        );
        // Another value retries again.
        assert_eq!(decide(&wish("2", done), "p", &failed_at(2)), retry);
        // A value acted on for another plan is new for this one.
        assert_eq!(
            decide(&wish("1", Some(("old", 1, "1"))), "p", &failed_at(1)),
            retry
        );
    }

    #[test]
    fn a_recorded_retry_whose_attempt_never_started_is_asked_again() {
        assert_eq!(
            decide(&wish("1", Some(("p", 1, "1"))), "p", &failed_at(1)),
            Decision::Retry { record: false }
        );
    }

    #[test]
    fn a_plan_running_or_done_is_left_alone() {
        let w = wish("1", None);
        for h in [
            heard(pb::Phase::Applying, pb::HookStatus::Success, 1),
            heard(pb::Phase::RollingBack, pb::HookStatus::Success, 1),
            heard(pb::Phase::Succeeded, pb::HookStatus::Success, 1),
        ] {
            assert_eq!(decide(&w, "p", &h), Decision::Leave, "{h:?}");
        }
    }

    #[test]
    fn the_wish_is_read_from_the_live_machine() {
        let live = json!({"metadata": {"name": "m", "namespace": "ns", "annotations": {
            RETRY_ANNOTATION: "",
            RETRIED_ANNOTATION: r#"{"plan":"p","fromAttempt":2,"value":"x"}"#,
        }}});
        assert_eq!(Wish::of(&live), Some(wish("", Some(("p", 2, "x")))));
        let unreadable = json!({"metadata": {"name": "m", "namespace": "ns", "annotations": {
            RETRY_ANNOTATION: "1", RETRIED_ANNOTATION: "garbage",
        }}});
        assert_eq!(Wish::of(&unreadable), Some(wish("1", None)));
        let none = json!({"metadata": {"name": "m", "namespace": "ns", "annotations": {
            RETRIED_ANNOTATION: r#"{"plan":"p","fromAttempt":2,"value":"x"}"#,
        }}});
        assert_eq!(Wish::of(&none), None);
        // The record round-trips through its annotation text.
        let r = Retried {
            plan: "ns/m@abc".into(),
            from_attempt: 3,
            value: "a \"b\"".into(),
            at: Some(1_765_000_000),
        };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Retried>(&text).unwrap(), r);
    }

    fn involved(name: &str, uid: &str) -> Involved {
        Involved {
            api_version: "cluster.x-k8s.io/v1beta2".into(),
            kind: "Machine".into(),
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn event_names_are_deterministic_per_machine_plan_and_attempt() {
        let m = involved("md-0-abc", "u1");
        let a = event_name(&m, "p", 1, FAILED_REASON);
        assert_eq!(a, event_name(&m, "p", 1, FAILED_REASON));
        assert!(
            a.starts_with("md-0-abc.") && a.len() == "md-0-abc.".len() + 16,
            "{a}"
        );
        for other in [
            event_name(&m, "p", 2, FAILED_REASON),
            event_name(&m, "q", 1, FAILED_REASON),
            event_name(&m, "p", 1, RETRIED_REASON),
            event_name(&involved("md-0-abc", "u2"), "p", 1, FAILED_REASON),
        ] {
            assert_ne!(a, other);
        }
        // A long name is cut to a valid DNS subdomain of at most 253 characters.
        let long = format!("{}-{}", "a".repeat(235), "b".repeat(17));
        let n = event_name(&involved(&long, "u"), "p", 1, FAILED_REASON);
        assert!(n.len() <= 253, "{}", n.len());
        assert!(!n.contains("-."), "{n}");
    }

    #[test]
    fn the_event_has_the_shape_the_api_server_takes() {
        let m = involved("m", "u1");
        let msg = failure_message("ns/m@abc", 2, &failed_at(2).hook.message);
        assert_eq!(
            msg,
            "attempt 2: plan ns/m@abc failed and was rolled back: verify[0] kubeletVersion: no"
        );
        assert_eq!(
            failure_message("p", 1, "boom"),
            "plan p attempt 1: boom",
            "the plan is named when the agent's message does not"
        );
        assert!(failure_message("p", 1, &"x".repeat(5000)).len() <= MAX_MESSAGE);
        let e = event(
            &m,
            "m.0123",
            (FAILED_REASON, "Warning"),
            &msg,
            "pod-1",
            1_764_513_346_789,
        );
        assert_eq!(e["involvedObject"]["uid"], "u1");
        assert_eq!(e["involvedObject"]["kind"], "Machine");
        assert_eq!(e["metadata"]["namespace"], "ns");
        assert_eq!(e["type"], "Warning");
        assert_eq!(e["reason"], FAILED_REASON);
        assert_eq!(e["source"]["component"], COMPONENT);
        assert_eq!(e["reportingComponent"], COMPONENT);
        assert_eq!(e["firstTimestamp"], "2025-11-30T14:35:46Z");
    }

    #[test]
    fn a_failure_is_reported_once_per_attempt_unless_the_report_failed() {
        let r = Machines::default();
        assert!(r.first("ns/m", "p", 1));
        assert!(!r.first("ns/m", "p", 1));
        assert!(r.first("ns/m", "p", 2));
        r.unreported("ns/m", "p", 2);
        assert!(r.first("ns/m", "p", 2));
        assert!(r.first("ns/other", "p", 1));
        assert_eq!(r.uid("ns/m"), None);
        r.read("ns/m", "u1");
        assert_eq!(r.uid("ns/m").as_deref(), Some("u1"));
        assert!(!r.first("ns/m", "p", 2), "a read keeps what was reported");
    }
}
