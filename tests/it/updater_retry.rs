//! A failed in-place update seen and retried from kubectl (crates/updater/src/recovery.rs):
//! a plan whose gate fails is one Warning Event on its Machine (however often Cluster API
//! polls, and across an updater restart), and the retry annotation starts exactly one new
//! attempt per value. The real `inplace-updater serve` binary, a real agent, the stand-in
//! Kubernetes API; every request is built from the live Machine, annotations included, as
//! Cluster API's Machine controller builds it.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::patience::deadline;
use crate::support::updater::*;
use inplace_updater::emulate::CapiClient;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::object_path;

const RETRY: &str = "inplace-agent.github.io/retry";
const RETRIED: &str = "inplace-agent.github.io/retried";

/// The attempt number of every attempt the agent accepted, in order (its journal).
fn attempts(state: &Path) -> Vec<u64> {
    std::fs::read_to_string(inplace_agent::journal::file_path(state))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let at = l.find("\"planAccepted\"")?;
            let rest = &l[at..];
            let a = rest.find("\"attempt\":")? + "\"attempt\":".len();
            let digits: String = rest[a..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

struct Case {
    machine_path: String,
    config: Value,
    settings: Value,
}

impl Case {
    /// The request Cluster API sends now: the live Machine, its annotations included.
    fn request(&self, w: &World) -> Vec<u8> {
        let live = w.api.get(&self.machine_path).unwrap();
        // CAPI's cleanupMachine: name, namespace, labels, annotations and spec.
        let mut sent = live.clone();
        sent["metadata"] = json!({});
        for k in ["name", "namespace", "labels", "annotations"] {
            sent["metadata"][k] = live["metadata"][k].clone();
        }
        update_request(&sent, Some(&self.config), self.settings.clone())
    }

    fn annotate(&self, w: &World, value: Option<&str>) {
        w.api.edit(&self.machine_path, |m| {
            let a = m["metadata"]["annotations"].as_object_mut().unwrap();
            match value {
                Some(v) => a.insert(RETRY.into(), json!(v)),
                None => a.remove(RETRY),
            };
        });
    }

    async fn call(&self, w: &World, capi: &mut CapiClient) -> Value {
        let r = capi
            .call(Hook::UpdateMachine, &self.request(w))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        r.json()
    }

    /// Polls as Cluster API would (faster) until the hook answers Failure; every answer.
    async fn until_failure(&self, w: &World, capi: &mut CapiClient) -> Vec<Value> {
        let deadline = deadline();
        let mut seen = Vec::new();
        loop {
            let v = self.call(w, capi).await;
            seen.push(v.clone());
            if v["status"] == "Failure" {
                return seen;
            }
            assert_eq!(v["status"], "Success", "{seen:?}");
            assert_ne!(v["retryAfterSeconds"], 0, "done? {seen:?}");
            assert!(
                Instant::now() < deadline,
                "never failed: {seen:?}\n{}",
                w.updater_log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The Events created so far, once `n` exist (they are created behind the answers).
async fn events(w: &World, n: usize) -> Vec<Value> {
    let deadline = deadline();
    loop {
        let events = w.api.events();
        if events.len() >= n {
            assert_eq!(events.len(), n, "{events:#?}");
            return events;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} events: {events:#?}\n{}",
            events.len(),
            w.updater_log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn restart_updater(w: &mut World) -> CapiClient {
    drop(w.updater.take());
    w.start_updater();
    w.client()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_plan_is_one_event_and_the_retry_annotation_starts_one_attempt_per_value() {
    let mut w = World::new(35).await;
    // The kubelet reports v1.35.2 and the Machine wants v1.35.3: the version gate waits
    // gateTimeoutSeconds and fails, on every attempt.
    w.add_agent("node-f", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    let (machine, config) = w.put_machine(
        "retry-0",
        0,
        "v1.35.3",
        bootstrap_spec(json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "r\n"}])),
    );
    let mut case = Case {
        machine_path: object_path(&machine).unwrap(),
        config,
        settings: json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "2", "updateWaitSeconds": "0", "drain": "Never"}),
    };
    w.api.edit(&case.machine_path, |m| {
        m["metadata"]["uid"] = json!("0b5c1d7e-uid-retry-0");
    });
    let state = w.dir.path().join("state-node-f");

    // Attempt 1 fails; polled many times, it is one Event.
    let seen = case.until_failure(&w, &mut capi).await;
    let failure = seen.last().unwrap().clone();
    let message = failure["message"].as_str().unwrap().to_owned();
    assert!(message.contains("kubeletVersion"), "{failure}");
    let plan = message
        .split_whitespace()
        .nth(1)
        .unwrap()
        .trim_end_matches(':')
        .to_owned();
    assert!(plan.starts_with("default/retry-0@"), "{message}");
    for _ in 0..20 {
        assert_eq!(case.call(&w, &mut capi).await, failure);
    }
    let first = events(&w, 1).await;
    let e = &first[0];
    assert_eq!(
        e["involvedObject"],
        json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
               "namespace": "default", "name": "retry-0", "uid": "0b5c1d7e-uid-retry-0"})
    );
    assert_eq!(e["metadata"]["namespace"], "default");
    assert_eq!(e["reason"], "InPlaceUpdateFailed");
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["source"]["component"], "inplace-updater");
    assert_eq!(e["reportingComponent"], "inplace-updater");
    let text = e["message"].as_str().unwrap();
    assert!(
        text.starts_with(&format!("attempt 1: plan {plan} ")),
        "{text}"
    );
    assert!(
        text.contains("verify[") && text.contains("kubeletVersion"),
        "the failed step and why: {text}"
    );
    assert_eq!(attempts(&state), [1]);
    // The fleet metrics say so: one rolled-back plan, the Machine in that phase.
    let metrics =
        String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    for line in [
        "inplace_updater_plan_failures_total{kind=\"rolled_back\"} 1",
        "inplace_updater_machines{cluster=\"default/capi-quickstart\",phase=\"rolled_back\"} 1",
        "inplace_updater_plan_duration_seconds_count{outcome=\"rolled_back\"} 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in\n{metrics}"
        );
    }

    // A restarted updater (or another replica) reports the same Event again: the API
    // server's AlreadyExists, ignored; the answer is unchanged.
    let mut capi = restart_updater(&mut w);
    let posts = |w: &World| {
        w.api
            .requests()
            .iter()
            .filter(|(m, p)| m == "POST" && p.contains("/events"))
            .count()
    };
    assert_eq!(posts(&w), 1);
    // Its first call takes the slow way (GetNodeInfo, GetPlanStatus): under load the agent
    // may answer after the submit wait, and the call says the plan is being submitted.
    let seen = case.until_failure(&w, &mut capi).await;
    assert_eq!(seen.last().unwrap(), &failure, "{seen:?}");
    let deadline = deadline();
    while posts(&w) < 2 {
        assert!(Instant::now() < deadline, "{}", w.updater_log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..10 {
        assert_eq!(case.call(&w, &mut capi).await, failure);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(w.api.events().len(), 1);
    assert_eq!(posts(&w), 2, "reported once per replica");
    assert!(
        w.updater_log_shows("event exists already"),
        "{}",
        w.updater_log()
    );

    // `kubectl annotate machine retry-0 inplace-agent.github.io/retry=1`: the next call
    // starts attempt 2 and answers its progress.
    case.annotate(&w, Some("1"));
    let started = case.call(&w, &mut capi).await;
    assert_eq!(started["status"], "Success", "{started}");
    assert_ne!(started["retryAfterSeconds"], 0, "{started}");
    assert_eq!(attempts(&state), [1, 2]);
    let live = w.api.get(&case.machine_path).unwrap();
    let mut record: Value =
        serde_json::from_str(live["metadata"]["annotations"][RETRIED].as_str().unwrap()).unwrap();
    let at = record.as_object_mut().unwrap().remove("at");
    assert!(
        at.is_some_and(|t| t.is_u64()),
        "when it was acted on: {record}"
    );
    assert_eq!(
        record,
        json!({"plan": plan, "fromAttempt": 1, "value": "1"})
    );
    // Attempt 2 fails the same way; polling on with the same value starts nothing more,
    // neither from memory nor the slow way (a restarted updater).
    // (Its progress was answered: `started` above. How many polls see it running depends on
    // the machine's load against the 2 s gate, so the test does not count them.)
    case.until_failure(&w, &mut capi).await;
    for _ in 0..10 {
        assert_eq!(case.call(&w, &mut capi).await["status"], "Failure");
    }
    let mut capi = restart_updater(&mut w);
    case.until_failure(&w, &mut capi).await;
    for _ in 0..5 {
        assert_eq!(case.call(&w, &mut capi).await["status"], "Failure");
    }
    assert_eq!(attempts(&state), [1, 2]);
    let got = events(&w, 3).await;
    assert_eq!(got[1]["reason"], "InPlaceUpdateRetried");
    assert_eq!(got[1]["type"], "Normal");
    assert!(
        got[1]["message"]
            .as_str()
            .unwrap()
            .contains("attempt 2 started"),
        "{}",
        got[1]
    );
    assert_eq!(got[2]["reason"], "InPlaceUpdateFailed");
    assert!(
        got[2]["message"]
            .as_str()
            .unwrap()
            .starts_with("attempt 2: "),
        "{}",
        got[2]
    );

    // Another value at once: within settings.retryMinIntervalSeconds (300 by default) of the
    // last retry, it waits (whoever may patch the Machine cannot rerun its plan in a loop).
    case.annotate(&w, Some("2"));
    for _ in 0..3 {
        assert_eq!(case.call(&w, &mut capi).await["status"], "Failure");
    }
    assert_eq!(attempts(&state), [1, 2]);
    assert!(
        w.updater_log()
            .contains("within settings.retryMinIntervalSeconds"),
        "{}",
        w.updater_log()
    );
    // The administrator allows one retry a second: once that is past, one more attempt.
    case.settings["retryMinIntervalSeconds"] = json!("1");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let started = case.call(&w, &mut capi).await;
    assert_eq!(started["status"], "Success", "{started}");
    assert_eq!(attempts(&state), [1, 2, 3]);
    case.until_failure(&w, &mut capi).await;
    for _ in 0..5 {
        assert_eq!(case.call(&w, &mut capi).await["status"], "Failure");
    }
    assert_eq!(attempts(&state), [1, 2, 3]);
    events(&w, 5).await;

    // The annotation removed: nothing changes (still the failure, nothing started).
    case.annotate(&w, None);
    for _ in 0..5 {
        assert_eq!(case.call(&w, &mut capi).await["status"], "Failure");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(attempts(&state), [1, 2, 3]);
    assert_eq!(w.api.events().len(), 5);
    // The only writes: Events, and the record of each retry on the Machine.
    for (method, path) in w.api.requests() {
        match method.as_str() {
            "GET" => {}
            "POST" => assert!(
                path.starts_with("/api/v1/namespaces/default/events"),
                "{path}"
            ),
            "PATCH" => assert!(
                path.starts_with(
                    "/apis/cluster.x-k8s.io/v1beta2/namespaces/default/machines/retry-0"
                ),
                "{path}"
            ),
            other => panic!("{other} {path}"),
        }
    }
}
