//! Why not in place, as a Kubernetes Event where an operator looks
//! (docs/decisions/0017-why-not-in-place.md).
//!
//! - **On what**: a `CanUpdateMachineSet` answer is about a MachineDeployment's rollout, so
//!   its Event is on the MachineDeployment, found through the live current MachineSet's
//!   controller owner reference (the MachineSet itself when it has none); a
//!   `CanUpdateMachine` answer is KubeadmControlPlane's question, so its Event is on the live
//!   Machine's controller owner when that is a KubeadmControlPlane, naming the Machine (the
//!   Machine itself otherwise). Objects are read live by the names of the request; one that
//!   does not exist gets no Event.
//! - **Which API**: core `v1` Events, as the updater's other Events ([`super::recovery`]):
//!   `kubectl describe` lists them by `involvedObject` and shows `count` ("x4 over 2m";
//!   k8s.io/kubectl `pkg/describe/describe.go`, `DescribeEvents`), and an Event written
//!   through events.k8s.io/v1 — controller-runtime's recorder, which Cluster API's
//!   controllers use (`pkg/internal/recorder/recorder.go`) — is the same stored object.
//! - **Deduplicated**: one Event per (object, hook, reason): its name is derived from the
//!   object's uid, the hook and the message, so every replica and a restarted one find the
//!   same Event; a repeat bumps its `count` and `lastTimestamp` (a merge patch), as
//!   client-go's event correlator does, instead of creating another.
//! - **Rate-bounded per object**: at most one write per object every [`EVENT_INTERVAL`];
//!   the calls in between are counted and added by the next write (Cluster API calls these
//!   hooks on every reconcile of a rollout).
//!
//! Never changes the hook's answer: a failed write is logged at warn. The message is the
//! reason's sentence ([`super::why`]): field paths, node and Machine names, what an agent
//! lacks; never a value of the spec or a Secret's content.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use super::cluster::Cluster;
use super::hooks::Hook;
use super::recovery::{Involved, event, event_name};
use super::translate::lookup;
use super::why::Why;

/// The Event's `reason`.
pub const REASON: &str = "NotUpdatedInPlace";

/// The least time between two writes of Events about one object.
pub const EVENT_INTERVAL: Duration = Duration::from_secs(10);

/// The longest Event message.
const MAX_MESSAGE: usize = 1024;

/// The most objects remembered; beyond, the memory starts afresh (a forgotten Event is
/// found again by its name: one create answered 409, one get).
const MAX_KNOWN: usize = 10_000;

/// What one object's Events wait for.
#[derive(Debug, Default)]
struct Object {
    /// When an Event about it was last written (Unix ms).
    last_write: Option<u64>,
    /// A decision not yet written (within the interval): its message and how many calls.
    pending: Option<(String, u32)>,
    /// The count each Event (by name) was last written with.
    written: HashMap<String, u32>,
}

/// The decision of one call for one object (pure): `Some((message, n))` to write now, with
/// `n` calls to add to its count; `None` to keep it for a later call.
fn take(object: &mut Object, message: &str, now_ms: u64, interval: Duration) -> Option<u32> {
    let n = match &object.pending {
        Some((m, n)) if m == message => n + 1,
        _ => 1,
    };
    let interval = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
    if object
        .last_write
        .is_some_and(|t| now_ms.saturating_sub(t) < interval)
    {
        object.pending = Some((message.to_owned(), n));
        return None;
    }
    object.last_write = Some(now_ms);
    object.pending = None;
    Some(n)
}

/// Reports not-in-place answers as Events, for one replica.
pub struct NotInPlace {
    cluster: Cluster,
    instance: String,
    objects: Mutex<HashMap<String, Object>>,
}

impl std::fmt::Debug for NotInPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotInPlace")
            .field("instance", &self.instance)
            .finish()
    }
}

/// The Event message of a reason (`not in place: …`); of a Machine's under its control
/// plane, naming the Machine.
pub fn message(hook: Hook, machine: Option<&str>, why: &Why) -> String {
    let text = match (hook, machine) {
        (Hook::CanUpdateMachine, Some(m)) => {
            format!("not in place: Machine {m}: {}", why.sentence())
        }
        _ => format!("not in place: {}", why.sentence()),
    };
    inplace_api::bounded::bounded(&text, MAX_MESSAGE)
}

impl NotInPlace {
    /// Nothing reported yet; `instance` is the `reportingInstance` (the pod's name).
    pub fn new(cluster: Cluster, instance: &str) -> NotInPlace {
        NotInPlace {
            cluster,
            instance: instance.to_owned(),
            objects: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Object>> {
        self.objects.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `hook` answered about `namespace/name` (the current MachineSet, or the Machine) not
    /// everything in place, because of `why`: an Event, in the background, when this object
    /// had none written within [`EVENT_INTERVAL`]; otherwise counted for the next.
    pub fn report(
        self: &Arc<Self>,
        hook: Hook,
        namespace: &str,
        name: &str,
        why: &Why,
        now_ms: u64,
    ) {
        let key = format!("{}:{namespace}/{name}", hook.as_str());
        let machine = format!("{namespace}/{name}");
        // The message as for the Machine's control plane; the object read decides.
        let text = message(hook, Some(&machine), why);
        let n = {
            let mut objects = self.lock();
            if objects.len() >= MAX_KNOWN && !objects.contains_key(&key) {
                objects.clear();
            }
            let object = objects.entry(key.clone()).or_default();
            match take(object, &text, now_ms, EVENT_INTERVAL) {
                Some(n) => n,
                None => return,
            }
        };
        let (this, namespace, name, why) = (
            self.clone(),
            namespace.to_owned(),
            name.to_owned(),
            why.clone(),
        );
        tokio::spawn(async move {
            this.write(hook, &key, (&namespace, &name), &why, n, now_ms)
                .await;
        });
    }

    /// The object an Event about `namespace/name` goes on, and the Machine it names (when
    /// on its control plane); `None` when the object does not exist.
    async fn involved(
        &self,
        hook: Hook,
        (namespace, name): (&str, &str),
    ) -> Result<Option<(Involved, Option<String>)>, super::cluster::ClusterError> {
        let (live, owner_kind, kind, api_version) = if hook == Hook::CanUpdateMachineSet {
            (
                self.cluster.machine_set(namespace, name).await?,
                "MachineDeployment",
                "MachineSet",
                super::cluster::machine_set_resource().api_version,
            )
        } else {
            (
                self.cluster.machine(namespace, name).await?,
                "KubeadmControlPlane",
                "Machine",
                super::cluster::machine_resource().api_version,
            )
        };
        let Some(live) = live else {
            return Ok(None);
        };
        let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        let owner = lookup(&live, &["metadata", "ownerReferences"])
            .and_then(Value::as_array)
            .and_then(|refs| {
                refs.iter().find(|r| {
                    r.get("controller").and_then(Value::as_bool) == Some(true)
                        && r.get("kind").and_then(Value::as_str) == Some(owner_kind)
                })
            })
            .and_then(|r| {
                Some(Involved {
                    api_version: text(r, "apiVersion")?,
                    kind: owner_kind.to_owned(),
                    namespace: namespace.to_owned(),
                    name: text(r, "name")?,
                    uid: text(r, "uid")?,
                })
            });
        let machine = (hook == Hook::CanUpdateMachine && owner.is_some())
            .then(|| format!("{namespace}/{name}"));
        let involved = match owner {
            Some(o) => o,
            None => Involved {
                api_version,
                kind: kind.to_owned(),
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                uid: lookup(&live, &["metadata", "uid"])
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            },
        };
        Ok(Some((involved, machine)))
    }

    async fn write(&self, hook: Hook, key: &str, at: (&str, &str), why: &Why, n: u32, now_ms: u64) {
        let object = format!("{}/{}", at.0, at.1);
        let (involved, machine) = match self.involved(hook, at).await {
            Ok(Some(found)) => found,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(%object, hook = hook.as_str(), error = %e, "not-in-place event not written");
                return;
            }
        };
        let message = message(hook, machine.as_deref(), why);
        let name = event_name(&involved, hook.as_str(), 0, &message);
        let known = self
            .lock()
            .get(key)
            .and_then(|o| o.written.get(&name).copied());
        let now = metav1_time(now_ms);
        let written = match known {
            Some(count) => self.bump(&involved, &name, count + n, &message, &now).await,
            None => Ok(None),
        };
        let count = match written {
            Ok(Some(count)) => Ok(count),
            // Not known here, or expired: create it; another replica's (or this one's
            // before a restart) is bumped instead.
            Ok(None) => {
                self.create(hook, &involved, &name, n, &message, now_ms)
                    .await
            }
            Err(e) => Err(e),
        };
        match count {
            Ok(count) => {
                tracing::info!(%object, on = %format!("{}/{}", involved.kind, involved.name), event = %name, count, "not-in-place event written");
                if let Some(o) = self.lock().get_mut(key) {
                    o.written.insert(name, count);
                }
            }
            Err(e) => {
                tracing::warn!(%object, hook = hook.as_str(), error = %e, "not-in-place event not written");
            }
        }
    }

    /// Sets the Event's count; `Ok(None)` when it does not exist.
    async fn bump(
        &self,
        involved: &Involved,
        name: &str,
        count: u32,
        message: &str,
        now: &str,
    ) -> Result<Option<u32>, super::cluster::ClusterError> {
        let patch = json!({"count": count, "lastTimestamp": now, "message": message});
        Ok(self
            .cluster
            .patch_event(&involved.namespace, name, &patch)
            .await?
            .then_some(count))
    }

    async fn create(
        &self,
        hook: Hook,
        involved: &Involved,
        name: &str,
        n: u32,
        message: &str,
        now_ms: u64,
    ) -> Result<u32, super::cluster::ClusterError> {
        let mut body = event(
            involved,
            name,
            (REASON, "Normal"),
            message,
            &self.instance,
            now_ms,
        );
        body["action"] = json!(hook.as_str());
        body["count"] = json!(n);
        if self.cluster.create_event(&body).await? {
            return Ok(n);
        }
        // 409: it exists (another replica's, or this one's before a restart).
        let live = self
            .cluster
            .event(&involved.namespace, name)
            .await?
            .and_then(|e| e.get("count").and_then(Value::as_u64))
            .and_then(|c| u32::try_from(c).ok())
            .unwrap_or(1);
        let now = metav1_time(now_ms);
        Ok(self
            .bump(involved, name, live + n, message, &now)
            .await?
            .unwrap_or(n))
    }
}

/// metav1.Time: RFC 3339 to the second.
fn metav1_time(now_ms: u64) -> String {
    inplace_base::time::rfc3339(now_ms - now_ms % 1000).replace(".000Z", "Z")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::why::{Class, Gap};

    #[test]
    fn one_write_per_object_and_interval_and_the_calls_between_are_counted() {
        let mut o = Object::default();
        let i = Duration::from_secs(10);
        assert_eq!(take(&mut o, "a", 1_000, i), Some(1));
        assert_eq!(take(&mut o, "a", 2_000, i), None);
        assert_eq!(take(&mut o, "a", 3_000, i), None);
        assert_eq!(take(&mut o, "a", 11_000, i), Some(3), "1 + the 2 between");
        // Another reason within the interval waits too, and replaces what waited.
        assert_eq!(take(&mut o, "a", 12_000, i), None);
        assert_eq!(take(&mut o, "b", 13_000, i), None);
        assert_eq!(take(&mut o, "b", 21_000, i), Some(2));
    }

    #[test]
    fn the_message_names_the_machine_only_on_its_control_plane() {
        let why = Why::of(vec![Gap::new(
            "preKubeadmCommands",
            Class::FieldNotInPlace,
            "runs only when the node is bootstrapped",
        )])
        .unwrap();
        assert_eq!(
            message(Hook::CanUpdateMachine, Some("ns/cp-0"), &why),
            "not in place: Machine ns/cp-0: preKubeadmCommands runs only when the node is bootstrapped"
        );
        assert_eq!(
            message(Hook::CanUpdateMachineSet, Some("ns/ms"), &why),
            "not in place: preKubeadmCommands runs only when the node is bootstrapped"
        );
        let long = Why::whole(Class::Lookup, "x".repeat(5000));
        assert!(message(Hook::CanUpdateMachineSet, None, &long).len() <= MAX_MESSAGE);
    }
}
