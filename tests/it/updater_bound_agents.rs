//! A Machine in one namespace can never cause a call on an agent of a cluster in another
//! namespace (issue 44, items 2 and 5; crates/updater/src/edge/agent_ca.rs), through the
//! real `inplace-updater` and `inplace-agent` binaries against the stand-in API server.
//!
//! The forger is a tenant of namespace `team-b`: it can create Machines (with any `status`)
//! and Secrets there, and it knows everything public about `team-a` (its nodes' names and
//! addresses, its CA certificate). It points a Machine of its own cluster `evil` at team-a's
//! node `node-a`:
//!
//! - `agentCA: ClusterSecret`, with `team-b/evil-ca` holding team-a's CA *certificate* and
//!   no key, a key that is not that certificate's, or garbage: the CA is not proven, no
//!   connection is made, nothing reaches the agent;
//! - `agentCA: File` (one fleet CA signs every cluster's agents), where team-a's agent
//!   carries the URI SAN of cluster `team-a/prod`: the updater requires `team-b/evil`'s, so
//!   the handshake ends before any call;
//! - a forged CanUpdateMachine under another trust, sent again and again while team-a's own
//!   UpdateMachine runs, changes nothing for it (trust is per call: channels are keyed by
//!   address, node, CA fingerprint and required identity).
//!
//! Each test shows that the legitimate Machine of team-a is updated through the same
//! updater, so the refusals are about the forgery, not a broken set-up.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_api::pki::cluster_identity;
use inplace_updater::emulate::Pki;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::{extension_config, namespace, secret};

/// How much of `retryAfterSeconds` the emulated CAPI waits (10 s → 100 ms).
const SCALE: f64 = 0.01;
const FILE: &str = "/etc/kubernetes/inplace-demo.conf";

/// The Machine `namespace/name` of cluster `cluster` on agent `agent` (its status points at
/// that agent's node and address, as a tenant may write it) writing `content` to [`FILE`],
/// with its KubeadmConfig; both put into the stand-in. Returns the UpdateMachine request.
fn put(
    w: &World,
    namespace: &str,
    name: &str,
    cluster: &str,
    agent: usize,
    content: &str,
    settings: Value,
) -> Vec<u8> {
    let a = &w.agents[agent];
    let mut m = machine(name, "v1.35.2", &a.node, &a.ip, true);
    m["metadata"]["namespace"] = json!(namespace);
    m["metadata"]["labels"]["cluster.x-k8s.io/cluster-name"] = json!(cluster);
    m["spec"]["clusterName"] = json!(cluster);
    let mut c = kubeadm_config(
        name,
        bootstrap_spec(json!([{"path": FILE, "content": content}])),
    );
    c["metadata"]["namespace"] = json!(namespace);
    w.api.put(m.clone());
    w.api.put(c.clone());
    let mut req: Value = serde_json::from_slice(&update_request(&m, Some(&c), settings)).unwrap();
    req["desired"]["infrastructureMachine"]["metadata"]["namespace"] = json!(namespace);
    go_json(&req)
}

/// The CanUpdateMachine request for the same Machine (a version change).
fn can_update(update: &[u8]) -> Vec<u8> {
    let mut req: Value = serde_json::from_slice(update).unwrap();
    req["kind"] = json!("CanUpdateMachineRequest");
    req["current"] = req["desired"].clone();
    req["desired"]["machine"]["spec"]["version"] = json!("v1.35.3");
    go_json(&req)
}

fn on_node(w: &World, agent: usize) -> Option<String> {
    std::fs::read_to_string(w.agents[agent].root.join(FILE.trim_start_matches('/'))).ok()
}

/// What the agent's journal holds (empty: no plan ever reached it).
fn journal(w: &World, agent: usize) -> String {
    let node = &w.agents[agent].node;
    std::fs::read_to_string(
        w.dir
            .path()
            .join(format!("state-{node}"))
            .join("journal/journal.log"),
    )
    .unwrap_or_default()
}

/// Whether the agent's log says a client's handshake failed.
fn handshake_failed(w: &World, agent: usize) -> bool {
    w.agents[agent].proc.log().contains("tls handshake failed")
}

fn assert_says(r: &Value, words: &[&str]) {
    let message = r["message"].as_str().unwrap_or_default();
    for w in words {
        assert!(message.contains(w), "{w:?} not in {r}");
    }
}

/// The legitimate Machine of team-a is updated: the set-up works, so a refusal above was
/// about the forgery.
async fn legitimate_update_succeeds(w: &World, body: &[u8], agent: usize) {
    let mut capi = w.client();
    let seen = poll_update(&mut capi, body, SCALE).await;
    let last = seen.last().unwrap();
    assert_eq!(
        (&last["status"], &last["retryAfterSeconds"]),
        (&json!("Success"), &json!(0)),
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert_eq!(on_node(w, agent).as_deref(), Some("team-a\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_ca_certificate_does_not_reach_another_namespaces_agent() {
    let mut w = World::new(171).await;
    // Team-a's cluster prod has its own CA (Cluster API's `team-a/prod-ca`, with its key),
    // which signs its node's serving certificate (the kubelet's route).
    let team_a = Pki::new(&w.dir.path().join("pki-team-a")).unwrap();
    let node_a = w.add_agent_bound("node-a", "v1.35.2", Some(&team_a), &[]);
    w.start_updater();
    let mut capi = w.client();
    let ca_cert = std::fs::read(team_a.ca()).unwrap();
    w.api.put(secret(
        "team-a",
        "prod-ca",
        &[
            ("tls.crt", &ca_cert),
            ("tls.key", team_a.ca_key_pem().as_bytes()),
        ],
    ));
    let settings = json!({"agentPort": w.agent_port.to_string(), "agentCA": "ClusterSecret"});

    // Team-b's Secret holds team-a's CA certificate (public) and: no key, a key of its own,
    // garbage (one cluster of team-b's per case). Each is refused before any connection,
    // naming the Machine, the node, the Secret and what is missing; CanUpdateMachine
    // covers nothing.
    let team_b = Pki::new(&w.dir.path().join("pki-team-b")).unwrap();
    let cases: [(&str, Option<&[u8]>, &str); 3] = [
        (
            "no key",
            None,
            "has no key tls.key, so it does not prove that tls.crt is this cluster's CA",
        ),
        (
            "another key",
            Some(team_b.ca_key_pem().as_bytes()),
            "key tls.key is not the private key of the certificate in tls.crt",
        ),
        (
            "garbage",
            Some(b"-"),
            "key tls.key does not hold a PEM private key",
        ),
    ];
    for (i, (case, key, missing)) in cases.into_iter().enumerate() {
        let cluster = format!("evil{i}");
        let mut data: Vec<(&str, &[u8])> = vec![("tls.crt", &ca_cert)];
        if let Some(k) = key {
            data.push(("tls.key", k));
        }
        w.api.put(secret("team-b", &format!("{cluster}-ca"), &data));
        let name = format!("evil-{i}");
        let body = put(
            &w,
            "team-b",
            &name,
            &cluster,
            node_a,
            "team-b\n",
            settings.clone(),
        );
        let r = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
        eprintln!("{case}: {r}");
        assert_eq!(r["status"], "Failure", "{case}: {r}");
        let machine = format!("Machine team-b/{name}");
        let secret_name = format!("Secret team-b/{cluster}-ca");
        assert_says(&r, &[&machine, "node node-a", &secret_name, missing]);
        let message = r["message"].as_str().unwrap_or_default();
        assert!(!message.contains("PRIVATE KEY"), "{case}: {r}");
        let r = capi
            .call(Hook::CanUpdateMachine, &can_update(&body))
            .await
            .unwrap()
            .json();
        assert!(r.get("machinePatch").is_none(), "{case}: {r}");
        assert_says(&r, &[&machine, &secret_name, missing]);
    }
    // Nothing reached team-a's agent: no connection was even made (no handshake in its
    // log), no plan in its journal, nothing on the node.
    assert!(
        !handshake_failed(&w, node_a),
        "{}",
        w.agents[node_a].proc.log()
    );
    assert_eq!(journal(&w, node_a), "");
    assert_eq!(on_node(&w, node_a), None);

    // Team-a's own Machine, under its own proven CA, is updated by the same updater.
    let body = put(&w, "team-a", "prod-0", "prod", node_a, "team-a\n", settings);
    legitimate_update_succeeds(&w, &body, node_a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_ca_does_not_let_another_namespaces_machine_call_an_agent() {
    let mut w = World::new(172).await;
    // One fleet CA (the --agent-ca file) signs every cluster's agents; team-a's agent is
    // bound to its cluster by the URI SAN of team-a/prod.
    let bound = cluster_identity("team-a", "prod");
    let node_a = w.add_agent_bound("node-a", "v1.35.2", None, &[&bound]);
    w.start_updater();
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string()});

    let body = put(
        &w,
        "team-b",
        "evil-0",
        "evil",
        node_a,
        "team-b\n",
        settings.clone(),
    );
    let r = capi.call(Hook::UpdateMachine, &body).await.unwrap().json();
    eprintln!("File, another namespace's Machine: {r}");
    // The agent is not unreachable for ever: UpdateMachine waits (and fails after
    // unreachableTimeout), saying why.
    assert_says(
        &r,
        &[
            "Machine team-b/evil-0",
            "node node-a",
            "the URI SAN spiffe://inplace-agent/cluster/team-b/evil",
            &format!("has the URI SANs {bound}"),
            "docs/pki.md",
        ],
    );
    let r = capi
        .call(Hook::CanUpdateMachine, &can_update(&body))
        .await
        .unwrap()
        .json();
    assert!(r.get("machinePatch").is_none(), "{r}");
    assert_says(
        &r,
        &[
            "Machine team-b/evil-0",
            "spiffe://inplace-agent/cluster/team-b/evil",
        ],
    );
    // The handshake was the only thing that reached the agent: it ended there (the agent
    // logs the failed handshake), and no plan is in its journal.
    assert!(
        handshake_failed(&w, node_a),
        "{}",
        w.agents[node_a].proc.log()
    );
    assert_eq!(journal(&w, node_a), "");
    assert_eq!(on_node(&w, node_a), None);

    // An agent whose certificate names no cluster is refused too, saying which URI SAN it
    // needs.
    let unbound = w.add_agent_bound("node-c", "v1.35.2", None, &[]);
    let body_c = put(
        &w,
        "team-a",
        "prod-9",
        "prod",
        unbound,
        "x\n",
        settings.clone(),
    );
    let r = capi
        .call(Hook::UpdateMachine, &body_c)
        .await
        .unwrap()
        .json();
    assert_says(
        &r,
        &[
            "Machine team-a/prod-9",
            "node node-c",
            &format!("must carry the URI SAN {bound} and has no URI SAN"),
        ],
    );
    assert_eq!(journal(&w, unbound), "");

    // Team-a's own Machine is updated by the same updater.
    let body = put(&w, "team-a", "prod-0", "prod", node_a, "team-a\n", settings);
    legitimate_update_succeeds(&w, &body, node_a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_call_under_other_trust_changes_nothing_for_an_update_in_flight() {
    let mut w = World::new(173).await;
    // Team-a's node is verified by its cluster's CA (ClusterSecret); the --agent-ca file is
    // another CA, which does not sign it.
    let team_a = Pki::new(&w.dir.path().join("pki-team-a")).unwrap();
    let node_a = w.add_agent_bound(
        "node-a",
        "v1.35.2",
        Some(&team_a),
        &[&cluster_identity("team-a", "prod")],
    );
    // Both teams' namespaces are served, each by ExtensionConfigs of its own (team-b's under
    // both trust modes): the other trust of team-b's calls is legitimate as far as settings go,
    // so what is tested is that it does not reach team-a's calls.
    w.start_updater_with(&[
        "--extension-config",
        "team-a",
        "--extension-config",
        "team-b-file",
        "--extension-config",
        "team-b-secret",
    ]);
    let port = w.agent_port.to_string();
    for (team, name, settings) in [
        (
            "team-a",
            "team-a",
            json!({"agentPort": port, "agentCA": "ClusterSecret"}),
        ),
        ("team-b", "team-b-file", json!({"agentPort": port})),
        (
            "team-b",
            "team-b-secret",
            json!({"agentPort": port, "agentCA": "ClusterSecret"}),
        ),
    ] {
        w.api.put(namespace(
            team,
            json!({"kubernetes.io/metadata.name": team}),
        ));
        w.api.put(extension_config(
            name,
            settings,
            json!({"matchLabels": {"kubernetes.io/metadata.name": team}}),
        ));
    }
    w.api.put(secret(
        "team-a",
        "prod-ca",
        &[
            ("tls.crt", &std::fs::read(team_a.ca()).unwrap()),
            ("tls.key", team_a.ca_key_pem().as_bytes()),
        ],
    ));
    // Team-b's own proven CA, for a forger that uses ClusterSecret too.
    let team_b = Pki::new(&w.dir.path().join("pki-team-b")).unwrap();
    w.api.put(secret(
        "team-b",
        "evil-ca",
        &[
            ("tls.crt", &std::fs::read(team_b.ca()).unwrap()),
            ("tls.key", team_b.ca_key_pem().as_bytes()),
        ],
    ));
    let legit = put(
        &w,
        "team-a",
        "prod-0",
        "prod",
        node_a,
        "team-a\n",
        json!({"agentPort": port, "agentCA": "ClusterSecret"}),
    );
    // Two forgers at team-a's node: one under the fleet CA (File), one under team-b's CA.
    let forged = [
        can_update(&put(
            &w,
            "team-b",
            "evil-0",
            "evil",
            node_a,
            "team-b\n",
            json!({"agentPort": port}),
        )),
        can_update(&put(
            &w,
            "team-b",
            "evil-1",
            "evil",
            node_a,
            "team-b\n",
            json!({"agentPort": port, "agentCA": "ClusterSecret"}),
        )),
    ];

    // The forgers call again and again while team-a's update runs.
    let done = Arc::new(AtomicBool::new(false));
    let forger = {
        let (done, mut capi) = (done.clone(), w.raw_client());
        tokio::spawn(async move {
            let mut answers = Vec::new();
            while !done.load(Ordering::Relaxed) {
                for body in &forged {
                    let r = capi
                        .call(Hook::CanUpdateMachine, body)
                        .await
                        .unwrap()
                        .json();
                    answers.push(r);
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            answers
        })
    };
    // Let the forgers go first, so every call of the update comes after one.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let mut capi = w.raw_client();
    let seen = poll_update(&mut capi, &legit, SCALE).await;
    // And once more after it ended: the answer is still the plan's.
    let again = capi.call(Hook::UpdateMachine, &legit).await.unwrap().json();
    done.store(true, Ordering::Relaxed);
    let answers = forger.await.unwrap();

    // Every answer team-a got was its plan's: none says the agent is unreachable or names
    // a CA other than its cluster's.
    for r in seen.iter().chain([&again]) {
        assert_eq!(r["status"], "Success", "{r}\n{}", w.updater_log());
        let message = r["message"].as_str().unwrap_or_default();
        assert!(
            !message.contains("unreachable") && !message.contains("waiting"),
            "{r}\n{}",
            w.updater_log()
        );
    }
    assert_eq!(seen.last().unwrap()["retryAfterSeconds"], 0, "{seen:?}");
    assert_eq!(again["retryAfterSeconds"], 0, "{again}");
    assert_eq!(on_node(&w, node_a).as_deref(), Some("team-a\n"));
    // The forgers got nothing: covered nothing, each refused by the agent's certificate.
    assert!(answers.len() >= 2, "{answers:?}");
    for r in &answers {
        assert!(r.get("machinePatch").is_none(), "{r}");
        assert_says(r, &["Machine team-b/evil-", "node node-a"]);
    }
    assert!(
        answers.iter().any(|r| r["message"]
            .as_str()
            .unwrap_or_default()
            .contains("the CA of cluster team-b/evil")),
        "{answers:?}"
    );
    // Only team-a's plan is in the agent's journal.
    let journal = journal(&w, node_a);
    assert!(
        journal.contains("team-a/prod-0") && !journal.contains("team-b"),
        "{journal}"
    );
}
