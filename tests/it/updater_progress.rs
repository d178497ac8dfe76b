//! Done when the node is done (docs/decisions/0018-done-when-the-node-is-done.md): a plan
//! that outlasts the first call's window (`updateWaitSeconds`) is reported done as the node
//! finishes it, not a retry interval later, through the real binaries: `inplace-agent serve`
//! on a sandbox tree whose kubelet stand-in keeps the plan's version gate waiting until the
//! test moves the kubelet, `inplace-updater serve`, and calls made as Cluster API's Machine
//! controller makes them (again `retryAfterSeconds` after an in-progress answer).
//!
//! Durations are judged with generous margins against the agent's own clock: when it says the
//! plan finished (`recent[0].finishedAtMs` on its status socket).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::hooks::Hook;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_longer_than_the_wait_is_reported_done_as_it_ends_not_a_retry_later() {
    let mut w = World::new(187).await;
    let i = w.add_agent("slow-node", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    // The Machine asks for v1.35.3: the plan's kubeletVersion gate waits until the kubelet
    // says so, which the test decides (about 6 s after the first call: two windows of 3 s).
    let settings =
        json!({"agentPort": w.agent_port.to_string(), "kubeletHealthzURL": "", "drain": "Never"});
    let (machine, config) = w.put_machine(
        "slow-0",
        i,
        "v1.35.3",
        bootstrap_spec(json!([
            {"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=slow\n"}])),
    );
    let body = update_request(&machine, Some(&config), settings);
    let version_file = w.agents[i].root.join("usr/local/bin/kubelet.version");
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(6)).await;
        std::fs::write(&version_file, "v1.35.3\n").unwrap();
    });

    // Called as CAPI calls: again `retryAfterSeconds` after an in-progress answer.
    let started = now_ms();
    let mut answers: Vec<(u64, Value)> = Vec::new();
    let done_at = loop {
        let r = capi.call(Hook::UpdateMachine, &body).await.unwrap();
        let v = r.json();
        let at = now_ms();
        answers.push((at, v.clone()));
        assert_eq!(v["status"], "Success", "{answers:?}\n{}", w.updater_log());
        let retry = v["retryAfterSeconds"].as_u64().unwrap_or(0);
        if retry == 0 {
            break at;
        }
        assert!(
            at - started < 120_000,
            "UpdateMachine never finished: {answers:?}\n{}",
            w.updater_log()
        );
        tokio::time::sleep(Duration::from_secs(retry)).await;
    };
    release.await.unwrap();

    // When the node says the plan finished.
    let socket = w.agents[i].root.join("run/inplace-agent/status.sock");
    let status = inplace_agent::status::client::get(&socket, "/v1/status", Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("the agent's status: {e}"));
    let status: Value = serde_json::from_slice(&status.body).unwrap();
    let last = &status["recent"][0];
    assert_eq!(last["phase"], "Succeeded", "{status:#}");
    let finished = last["finishedAtMs"]
        .as_u64()
        .unwrap_or_else(|| panic!("no finishedAtMs: {last:#}"));
    assert!(
        finished > started + 3_000,
        "the plan outlasted the first call's window (else this test shows nothing): \
         finished {} ms after the first call",
        finished.saturating_sub(started)
    );
    // Done within about a second of the node finishing (generously: 2.5 s), where the
    // estimate-paced answers came back a whole retry later.
    let delay = done_at.saturating_sub(finished);
    assert!(
        delay < 2_500,
        "done reported {delay} ms after the node finished the plan: {answers:?}"
    );
    // No in-progress answer asked Cluster API back later than a second (so no Machine waits
    // a retry interval for a node that is done), and about one call a second at most.
    for (at, v) in &answers {
        if v["retryAfterSeconds"] != 0 {
            assert!(
                v["retryAfterSeconds"].as_u64().unwrap_or(0) <= 1,
                "an in-progress answer {} ms after the first call asked for a later call: {v}",
                at - started
            );
        }
    }
    let seconds = (done_at - started) as f64 / 1000.0;
    assert!(
        (answers.len() as f64) <= seconds + 2.0,
        "{} calls in {seconds:.1} s: {answers:?}",
        answers.len()
    );
}
