//! The updater answers UpdateMachine from memory while a plan is in flight (src/updater/
//! progress.rs): after the first call of a request (checked against the live objects, the
//! plan submitted) later calls make no Kubernetes request and no agent round trip, and still
//! follow the progress the agent pushes on its WatchPlan stream, through a failing gate to
//! `Failure`; another desired state is another plan; an agent killed and restarted mid-plan
//! keeps being followed; a health gate's attempts, which the stream does not carry, reach
//! the answer (one `GetPlanStatus` once the word is older than the grace). The real `inplace-updater serve` binary, real agents, the stand-in
//! Kubernetes API.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::patience::deadline;
use crate::support::updater::*;
use inplace_updater::hooks::Hook;

/// Requests to the Kubernetes API other than creating Events (a failed plan is reported as
/// one, in the background: crates/updater/src/recovery.rs, tests/it/updater_retry.rs).
/// The reads of the Machine's objects (not Events, not the ExtensionConfig, which is read
/// once per 30 s for every Machine).
fn reads(w: &World) -> Vec<(String, String)> {
    w.api
        .requests()
        .into_iter()
        .filter(|(m, p)| {
            !(p.contains("/extensionconfigs/") || m == "POST" && p.contains("/events"))
        })
        .collect()
}

fn count_accepted(state: &Path) -> usize {
    std::fs::read_to_string(inplace_agent::journal::file_path(state))
        .unwrap_or_default()
        .matches("planAccepted")
        .count()
}

/// Calls UpdateMachine every `every` until it is done or fails; every answer.
async fn poll_every(
    capi: &mut inplace_updater::emulate::CapiClient,
    body: &[u8],
    every: Duration,
) -> Vec<Value> {
    let deadline = deadline();
    let mut seen = Vec::new();
    loop {
        let v = capi.call(Hook::UpdateMachine, body).await.unwrap().json();
        seen.push(v.clone());
        if v["status"] != "Success" || v["retryAfterSeconds"] == 0 {
            return seen;
        }
        assert!(Instant::now() < deadline, "never finished: {seen:?}");
        tokio::time::sleep(every).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_pushed_by_the_agent_is_followed_from_memory_and_a_new_desired_state_is_a_new_plan()
 {
    let mut w = World::new(25).await;
    // The kubelet reports v1.35.2 and the Machine wants v1.35.3: the version gate waits
    // gateTimeoutSeconds and fails, the plan rolls back.
    w.add_agent("node-m", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    // The first call answers at once (no wait for the plan): what follows is from memory.
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "3", "updateWaitSeconds": "0", "drain": "Never"});
    let (machine, config) = w.put_machine(
        "mem-0",
        0,
        "v1.35.3",
        bootstrap_spec(json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "m1\n"}])),
    );
    let body = update_request(&machine, Some(&config), settings.clone());
    let first = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
    assert_eq!(first["status"], "Success", "{first}");
    assert!(first["retryAfterSeconds"].as_i64().unwrap() > 0, "{first}");
    let gets = reads(&w).len();
    assert_eq!(
        gets,
        4,
        "the Machine, its KubeadmConfig, its bootstrap data Secret and its cluster's \
         control-plane Machines (the version skew rules, checked before any node work): {:?}",
        w.api.requests()
    );

    // Polled much faster than retryAfterSeconds: the answers move (in progress, then the
    // gate's Failure) without one more Kubernetes request.
    let seen = poll_every(&mut capi, &body, Duration::from_millis(50)).await;
    let failure = seen.last().unwrap().clone();
    assert_eq!(
        failure["status"],
        "Failure",
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert!(
        failure["message"]
            .as_str()
            .unwrap()
            .contains("kubeletVersion"),
        "{failure}"
    );
    assert!(seen.len() > 3, "polled while in flight: {seen:?}");
    assert_eq!(
        reads(&w).len(),
        gets,
        "answered from memory: {:?}",
        w.api.requests()
    );
    // The same Failure on every later call, still from memory, nothing submitted again.
    for _ in 0..5 {
        assert_eq!(
            capi.call(Hook::UpdateMachine, &body).await.unwrap().json(),
            failure
        );
    }
    assert_eq!(reads(&w).len(), gets);
    let state = w.dir.path().join("state-node-m");
    assert_eq!(count_accepted(&state), 1);
    assert!(
        w.updater_log_shows("plan stream opened"),
        "{}",
        w.updater_log()
    );

    // Another desired state (the version the node has): another plan, submitted once,
    // done; the old request now differs from the live Machine and is refused.
    let (machine2, config2) = w.put_machine(
        "mem-0",
        0,
        "v1.35.2",
        bootstrap_spec(json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "m2\n"}])),
    );
    let body2 = update_request(&machine2, Some(&config2), settings.clone());
    let seen = poll_every(&mut capi, &body2, Duration::from_millis(50)).await;
    assert_eq!(seen.last().unwrap()["retryAfterSeconds"], 0, "{seen:?}");
    assert_eq!(seen.last().unwrap()["status"], "Success", "{seen:?}");
    assert_eq!(count_accepted(&state), 2);
    assert_eq!(
        std::fs::read_to_string(w.agents[0].root.join("etc/kubernetes/inplace-demo.conf")).unwrap(),
        "m2\n"
    );
    let old = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
    assert_eq!(old["status"], "Failure", "{old}");
    assert!(
        old["message"]
            .as_str()
            .unwrap()
            .contains("differs from the live Machine"),
        "{old}"
    );
    // And the done answer of the new one stays, from memory.
    let gets = w.api.requests().len();
    for _ in 0..5 {
        let v = capi.call(Hook::UpdateMachine, &body2).await.unwrap().json();
        assert_eq!(v["retryAfterSeconds"], 0, "{v}");
    }
    assert_eq!(w.api.requests().len(), gets);
    assert_eq!(count_accepted(&state), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_and_restarted_mid_plan_keeps_being_followed() {
    let mut w = World::new(26).await;
    let env = [("INPLACE_AGENT_SERVICES", "off")];
    w.add_agent("node-r", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    // A gate that waits 4 s and fails: the plan is in flight long enough to kill the agent.
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "4", "updateWaitSeconds": "0", "drain": "Never"});
    let (machine, config) = w.put_machine(
        "mem-1",
        0,
        "v1.35.3",
        bootstrap_spec(json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "r\n"}])),
    );
    let body = update_request(&machine, Some(&config), settings);
    let first = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
    assert_eq!(first["status"], "Success", "{first}");
    // Wait until the agent verifies (the stream said so), then kill it and start it again.
    let deadline = deadline();
    loop {
        let v = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
        assert_eq!(v["status"], "Success", "{v}");
        if v["message"]
            .as_str()
            .unwrap_or("")
            .to_lowercase()
            .contains("verif")
        {
            break;
        }
        assert!(Instant::now() < deadline, "never verifying: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.restart_agent(0, &["--no-chroot"], &env);

    // The plan resumes on the restarted agent; the updater follows it to the gate's Failure.
    let seen = poll_every(&mut capi, &body, Duration::from_millis(100)).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Failure", "{seen:?}\n{}", w.updater_log());
    assert!(
        last["message"].as_str().unwrap().contains("kubeletVersion"),
        "{last}"
    );
    let state = w.dir.path().join("state-node-r");
    assert_eq!(count_accepted(&state), 1, "followed, not submitted again");
    let log = w.updater_log();
    assert!(
        log.matches("plan stream opened").count() >= 2,
        "the stream was opened again after the restart:\n{log}"
    );
}

/// The first UpdateMachine call of a plan waits (up to `updateWaitSeconds`, 3 by default)
/// for the node: a plan the agent finishes in that time is done in that very call, so
/// Cluster API does not wait out a retryAfterSeconds for a node that is already done. A plan
/// that takes longer answers in progress, with retryAfterSeconds paced by what it still has
/// to do (a health gate: 2 s), not the agent's flat 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_call_answers_done_for_a_fast_plan_and_paces_a_slow_one() {
    let mut w = World::new(27).await;
    w.add_agent("node-fast", "v1.35.2");
    w.add_agent("node-slow", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "20", "drain": "Never"});
    let files = json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "fast\n"}]);
    let (machine, config) = w.put_machine("fast-0", 0, "v1.35.2", bootstrap_spec(files));
    let fast = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), settings.clone()),
        )
        .await
        .unwrap()
        .json();
    assert_eq!(fast["status"], "Success", "{fast}");
    assert_eq!(
        fast["retryAfterSeconds"], 0,
        "done in the first call: {fast}"
    );
    assert!(
        fast["message"].as_str().unwrap().contains("succeeded"),
        "{fast}"
    );

    // The Machine wants a version its kubelet does not report: the version gate waits (20 s).
    let files = json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "slow\n"}]);
    let (machine, config) = w.put_machine("slow-0", 1, "v1.35.3", bootstrap_spec(files));
    let body = update_request(&machine, Some(&config), settings);
    let slow = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
    assert_eq!(slow["status"], "Success", "{slow}");
    let retry = slow["retryAfterSeconds"].as_i64().unwrap();
    assert!(
        (1..10).contains(&retry),
        "in progress, asked back sooner than the agent's 10 s: {slow}"
    );
    // From memory, still paced while the gate waits.
    let again = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
    assert_eq!(again["status"], "Success", "{again}");
    assert!(
        (1..10).contains(&again["retryAfterSeconds"].as_i64().unwrap()),
        "{again}"
    );
}

/// The message of a remembered in-flight answer follows the agent's health gate attempt by
/// attempt: the stream sends phases and steps, not a gate's attempts (status notes), so a
/// word older than the grace is asked for again (issue 39: "attempt 1" for 25 s while the
/// agent was at attempt 11).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_answer_shows_the_gates_current_attempt() {
    let mut w = World::new(64).await;
    // The kubelet reports v1.35.2 and the Machine wants v1.35.3: the version gate retries.
    w.add_agent("node-g", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    let (machine, config) = w.put_machine(
        "gate-0",
        0,
        "v1.35.3",
        bootstrap_spec(json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "g\n"}])),
    );
    let body = update_request(
        &machine,
        Some(&config),
        json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "30", "updateWaitSeconds": "0", "drain": "Never"}),
    );
    let deadline_at = deadline();
    let mut attempts: Vec<u32> = Vec::new();
    let gets_before = loop {
        let v = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
        assert_eq!(v["status"], "Success", "{v}");
        let message = v["message"].as_str().unwrap_or_default();
        if let Some(n) = message
            .split("attempt ")
            .nth(1)
            .and_then(|rest| rest.split(':').next())
            .and_then(|n| n.parse().ok())
        {
            attempts.push(n);
        }
        if attempts.last().is_some_and(|n| *n >= 3) {
            break reads(&w).len();
        }
        assert!(
            Instant::now() < deadline_at,
            "the answer never showed attempt 3: {attempts:?} {v}\n{}",
            w.updater_log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(attempts.windows(2).all(|p| p[0] <= p[1]), "{attempts:?}");
    // Asking the agent again is no Kubernetes request.
    for _ in 0..5 {
        capi.call(Hook::UpdateMachine, &body).await.unwrap();
    }
    assert_eq!(reads(&w).len(), gets_before, "{:?}", reads(&w));
}
