//! One updater for two workload clusters with two CAs (crates/updater/src/edge/agent_ca.rs):
//! with `settings.agentCA: ClusterSecret` each Machine's agent is verified against its own
//! cluster's `<cluster>-ca` Secret (served by the stand-in Kubernetes API, holding the CA's
//! key, which proves it) and both Machines are updated; a node of one cluster presenting a certificate of the other
//! cluster's CA is refused with a message naming the cluster, Machine, node and Secret. The
//! default (`File`: the `--agent-ca` file) refuses the other cluster's agent, as before.

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::emulate::Pki;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::secret;

/// How much of `retryAfterSeconds` the emulated CAPI waits (10 s → 100 ms).
const SCALE: f64 = 0.01;
const FILE: &str = "/etc/kubernetes/inplace-demo.conf";

/// A Machine of workload cluster `cluster` on agent `agent`, writing `content` to [`FILE`].
fn put(w: &World, name: &str, agent: usize, cluster: &str, content: &str) -> (Value, Value) {
    let (mut machine, config) = w.put_machine(
        name,
        agent,
        "v1.35.2",
        bootstrap_spec(json!([{"path": FILE, "content": content}])),
    );
    machine["spec"]["clusterName"] = json!(cluster);
    machine["metadata"]["labels"]["cluster.x-k8s.io/cluster-name"] = json!(cluster);
    w.api.put(machine.clone());
    (machine, config)
}

fn on_node(w: &World, agent: usize) -> Option<String> {
    std::fs::read_to_string(w.agents[agent].root.join(FILE.trim_start_matches('/'))).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_updater_verifies_each_clusters_agents_against_that_clusters_ca() {
    let mut w = World::new(61).await;
    // Cluster "red": this world's CA signs its node's certificate (and the updater's client
    // certificate, which every agent trusts: the management side's CA).
    let blue_ca = Pki::new(&w.dir.path().join("pki-blue")).unwrap();
    let red = w.add_agent("node-red", "v1.35.2");
    let blue = w.add_agent_signed_by("node-blue", "v1.35.2", Some(&blue_ca));
    // A node of cluster blue whose certificate comes from red's CA.
    let stray = w.add_agent("node-stray", "v1.35.2");
    w.start_updater();
    let mut capi = w.client();
    let pem = |p: &Pki| std::fs::read(p.ca()).unwrap();
    // Each CA with its key, as Cluster API keeps it (which proves it is that cluster's).
    w.api.put(secret(
        "default",
        "red-ca",
        &[
            ("tls.crt", &pem(&w.pki)),
            ("tls.key", w.pki.ca_key_pem().as_bytes()),
        ],
    ));
    w.api.put(secret(
        "default",
        "blue-ca",
        &[
            ("tls.crt", &pem(&blue_ca)),
            ("tls.key", blue_ca.ca_key_pem().as_bytes()),
        ],
    ));
    let port = w.agent_port.to_string();
    let by_secret = json!({"agentPort": port, "agentCA": "ClusterSecret"});

    // The default: the --agent-ca file (red's CA, as an install before the setting has it)
    // does not verify blue's agent.
    let (machine, config) = put(&w, "blue-0", blue, "blue", "blue\n");
    let r = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), json!({"agentPort": port})),
        )
        .await
        .unwrap()
        .json();
    let message = r["message"].as_str().unwrap_or_default();
    assert_eq!(r["status"], "Success", "{r}");
    assert!(
        message.contains("Machine default/blue-0")
            && message.contains("node-blue")
            && message.contains("verified against the --agent-ca file"),
        "{r}"
    );
    assert_eq!(on_node(&w, blue), None);

    // Each cluster's CA from its Secret: both Machines are updated by the one updater.
    for (name, agent, cluster) in [("red-0", red, "red"), ("blue-0", blue, "blue")] {
        let content = format!("{cluster}\n");
        let (machine, config) = put(&w, name, agent, cluster, &content);
        let body = update_request(&machine, Some(&config), by_secret.clone());
        let seen = poll_update(&mut capi, &body, SCALE).await;
        let last = seen.last().unwrap();
        assert_eq!(
            (&last["status"], &last["retryAfterSeconds"]),
            (&json!("Success"), &json!(0)),
            "{name}: {seen:?}\n{}",
            w.updater_log()
        );
        assert_eq!(on_node(&w, agent).as_deref(), Some(content.as_str()));
    }
    // The fleet metrics: one Machine of each cluster updated, each plan's duration.
    let metrics =
        String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    for line in [
        "inplace_updater_machines{cluster=\"default/red\",phase=\"succeeded\"} 1",
        "inplace_updater_machines{cluster=\"default/blue\",phase=\"succeeded\"} 1",
        "inplace_updater_plan_duration_seconds_count{outcome=\"succeeded\"} 2",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in\n{metrics}"
        );
    }
    assert!(
        !metrics.contains("inplace_updater_oldest_update_seconds{"),
        "nothing unfinished\n{metrics}"
    );

    // A node of cluster blue presenting a certificate of red's CA is refused, and the
    // message says which cluster, Machine, node and CA.
    let (machine, config) = put(&w, "blue-1", stray, "blue", "stray\n");
    let r = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), by_secret.clone()),
        )
        .await
        .unwrap()
        .json();
    let message = r["message"].as_str().unwrap_or_default();
    eprintln!("a certificate of the other cluster's CA: {message}");
    for words in [
        "Machine default/blue-1",
        "node node-stray",
        "the CA of cluster default/blue (Secret default/blue-ca, key tls.crt)",
        "the agent's certificate",
    ] {
        assert!(message.contains(words), "{words:?} not in {r}");
    }
    assert_ne!(r["retryAfterSeconds"], 0, "{r}");
    assert_eq!(on_node(&w, stray), None);
    // CanUpdateMachine says the same, and covers nothing (a rollout is safe).
    let mut req: Value =
        serde_json::from_slice(&update_request(&machine, Some(&config), by_secret.clone()))
            .unwrap();
    req["kind"] = json!("CanUpdateMachineRequest");
    req["current"] = req["desired"].clone();
    req["desired"]["machine"]["spec"]["version"] = json!("v1.35.3");
    let r = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    let message = r["message"].as_str().unwrap_or_default();
    assert!(r.get("machinePatch").is_none(), "{r}");
    assert!(
        message.contains("Machine default/blue-1") && message.contains("Secret default/blue-ca"),
        "{r}"
    );

    // A cluster whose CA Secret does not exist: named, with what to do.
    let (machine, config) = put(&w, "green-0", red, "green", "green\n");
    let r = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), by_secret),
        )
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Failure", "{r}");
    let message = r["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Secret default/green-ca does not exist")
            && message.contains("settings.agentCA to File"),
        "{r}"
    );
    // Only gets by name of the CA Secrets: never a list or a watch.
    let requests = w.api.requests();
    assert!(
        requests
            .iter()
            .any(|(m, p)| m == "GET" && p.ends_with("/secrets/blue-ca")),
        "{requests:?}"
    );
    assert!(
        !requests.iter().any(|(_, p)| p.contains("watch")),
        "{requests:?}"
    );
}
