//! Files the bootstrap data wrote, end to end: a node bootstrapped (by cloud-init, from the
//! Machine's bootstrap data Secret) with files A and B whose first in-place update drops B
//! ends without B and keeps A and every file CABPK wrote for itself; a failing gate restores
//! B byte for byte; bootstrap data that does not parse removes nothing and the updater says
//! so for the Machine. The real updater and agent binaries, the Kubernetes API stand-in
//! serving the Secret as the API server does, CAPI emulated.

use std::os::unix::fs::PermissionsExt as _;

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::standin::secret;

/// How much of `retryAfterSeconds` the emulated CAPI waits (10 s → 100 ms).
const SCALE: f64 = 0.01;

const A: &str = "/etc/kubernetes/inplace-demo.conf";
const B: &str = "/etc/kubernetes/bootstrap-extra.conf";
/// The CA certificate the demo node has, written by CABPK for a control-plane Machine.
const CA: &str = "/etc/kubernetes/pki/ca.crt";

/// B's bytes on the node: not text, so "byte for byte" means something.
fn b_bytes() -> Vec<u8> {
    let mut b = b"extra=1\n".to_vec();
    b.extend([0u8, 0xff, 0xfe, b'\n', 0x80]);
    b
}

/// The cloud-config CABPK rendered for a control-plane Machine whose files[] were A and B
/// (`controlplane_init.go`: the certificates, the user's files, the kubeadm configuration,
/// the placeholder).
fn bootstrap_document() -> String {
    use base64::Engine as _;
    let b = base64::engine::general_purpose::STANDARD.encode(b_bytes());
    format!(
        "## template: jinja\n#cloud-config\n\nwrite_files:\n\
         -   path: {CA}\n    owner: root:root\n    permissions: '0640'\n    content: |\n      \
         -----BEGIN CERTIFICATE-----\n      (demo sandbox: not a real certificate)\n      -----END CERTIFICATE-----\n\
         -   path: /etc/kubernetes/pki/ca.key\n    owner: root:root\n    permissions: '0600'\n    content: |\n      \
         -----BEGIN RSA PRIVATE KEY-----\n      (fake)\n      -----END RSA PRIVATE KEY-----\n\
         -   path: {A}\n    owner: root:root\n    permissions: '0644'\n    content: |\n      mode=v1\n\
         -   path: {B}\n    encoding: \"base64\"\n    permissions: '0644'\n    content: |\n      {b}\n\
         -   path: /run/kubeadm/kubeadm.yaml\n    owner: root:root\n    permissions: '0640'\n    content: |\n      \
         ---\n      apiVersion: kubeadm.k8s.io/v1beta4\n      bootstrapTokens:\n      - token: {BOOTSTRAP_TOKEN}\n      \
         kind: InitConfiguration\n\
         -   path: /run/cluster-api/placeholder\n    owner: root:root\n    permissions: '0640'\n    \
         content: \"This placeholder file is used to create the /run/cluster-api sub directory\"\n\
         runcmd:\n  - 'kubeadm init --config /run/kubeadm/kubeadm.yaml  && echo success > /run/cluster-api/bootstrap-success.complete'\n"
    )
}

/// The bootstrap data Secret as CABPK stores it (`storeBootstrapData`).
fn bootstrap_secret(name: &str, format: &str, value: &[u8]) -> Value {
    let mut s = secret(
        "default",
        name,
        &[("format", format.as_bytes()), ("value", value)],
    );
    s["type"] = json!("cluster.x-k8s.io/secret");
    s["metadata"]["labels"] = json!({"cluster.x-k8s.io/cluster-name": "capi-quickstart"});
    s
}

fn path_on(agent: &Agent, path: &str) -> std::path::PathBuf {
    agent.root.join(path.trim_start_matches('/'))
}

fn read(agent: &Agent, path: &str) -> Option<Vec<u8>> {
    std::fs::read(path_on(agent, path)).ok()
}

/// What cloud-init did on the node: A and B written as the bootstrap data says (the demo
/// node already has the CA certificate).
fn bootstrap_node(agent: &Agent) {
    std::fs::write(path_on(agent, A), "mode=v1\n").unwrap();
    std::fs::write(path_on(agent, B), b_bytes()).unwrap();
    std::fs::set_permissions(path_on(agent, B), std::fs::Permissions::from_mode(0o644)).unwrap();
}

fn only_a(content: &str) -> Value {
    bootstrap_spec(
        json!([{"path": A, "owner": "root:root", "permissions": "0644", "content": content}]),
    )
}

fn assert_nothing_secret_logged(w: &World) {
    let logs = format!(
        "{}\n{}",
        w.updater_log(),
        w.agents
            .iter()
            .map(|a| a.proc.log())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        !logs.contains(BOOTSTRAP_TOKEN),
        "the bootstrap token was logged"
    );
    assert!(!logs.contains("(fake)"), "bootstrap data was logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updater_a_file_the_bootstrap_data_wrote_and_files_no_longer_lists_is_removed() {
    let mut w = World::new(40).await;
    w.add_agent("node-b0", "v1.35.2");
    w.start_updater();
    bootstrap_node(&w.agents[0]);
    let ca = read(&w.agents[0], CA).unwrap();
    w.api.put(bootstrap_secret(
        "cp-0",
        "cloud-config",
        bootstrap_document().as_bytes(),
    ));
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string()});

    // The first in-place update: files[] is A alone now.
    let (machine, config) = w.put_machine("cp-0", 0, "v1.35.2", only_a("mode=v2\n"));
    let body = update_request(&machine, Some(&config), settings.clone());
    let seen = poll_update(&mut capi, &body, SCALE).await;
    let last = seen.last().unwrap();
    assert_eq!(
        (&last["status"], &last["retryAfterSeconds"]),
        (&json!("Success"), &json!(0)),
        "{seen:?}\n{}",
        w.updater_log()
    );
    let a = &w.agents[0];
    assert_eq!(read(a, A).as_deref(), Some(&b"mode=v2\n"[..]));
    assert_eq!(read(a, B), None, "B was dropped from files[]");
    assert_eq!(read(a, CA), Some(ca.clone()), "CABPK's own file is kept");
    let state = w.dir.path().join("state-node-b0");
    let journal = std::fs::read_to_string(inplace_agent::journal::file_path(&state)).unwrap();
    assert!(journal.contains(B), "the removal is journaled");

    // The same request again: done at once, nothing else removed.
    let seen = poll_update(&mut capi, &body, SCALE).await;
    assert_eq!(seen.len(), 1, "{seen:?}");

    // B comes back through files[] (a plan of the managed set writes it), then goes again:
    // the managed set and the bootstrap data both remove it, once.
    let mut both = only_a("mode=v3\n");
    both["files"]
        .as_array_mut()
        .unwrap()
        .push(json!({"path": B, "content": "extra=2\n"}));
    for (spec, want_b) in [(both, Some(&b"extra=2\n"[..])), (only_a("mode=v4\n"), None)] {
        let (machine, config) = w.put_machine("cp-0", 0, "v1.35.2", spec);
        let body = update_request(&machine, Some(&config), settings.clone());
        let seen = poll_update(&mut capi, &body, SCALE).await;
        let last = seen.last().unwrap();
        assert_eq!(
            (&last["status"], &last["retryAfterSeconds"]),
            (&json!("Success"), &json!(0)),
            "{seen:?}\n{}",
            w.agents[0].proc.log()
        );
        assert_eq!(read(&w.agents[0], B).as_deref(), want_b);
    }
    assert_eq!(read(&w.agents[0], A).as_deref(), Some(&b"mode=v4\n"[..]));
    assert_eq!(read(&w.agents[0], CA), Some(ca));
    assert_nothing_secret_logged(&w);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updater_a_failing_gate_restores_a_removed_bootstrap_file_byte_for_byte() {
    let mut w = World::new(41).await;
    // The kubelet reports v1.35.2; the Machine wants v1.35.3: the version gate cannot pass.
    w.add_agent("node-b1", "v1.35.2");
    w.start_updater();
    bootstrap_node(&w.agents[0]);
    w.api.put(bootstrap_secret(
        "cp-1",
        "cloud-config",
        bootstrap_document().as_bytes(),
    ));
    let mut capi = w.client();
    let settings =
        json!({"agentPort": w.agent_port.to_string(), "gateTimeoutSeconds": "2", "drain": "Never"});
    let (machine, config) = w.put_machine("cp-1", 0, "v1.35.3", only_a("mode=v2\n"));
    let body = update_request(&machine, Some(&config), settings);
    let seen = poll_update(&mut capi, &body, SCALE).await;
    let last = seen.last().unwrap();
    assert_eq!(last["status"], "Failure", "{seen:?}\n{}", w.updater_log());
    assert!(
        last["message"].as_str().unwrap().contains("kubeletVersion"),
        "{last}"
    );
    let a = &w.agents[0];
    assert_eq!(read(a, B), Some(b_bytes()), "B restored byte for byte");
    let mode = std::fs::metadata(path_on(a, B))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);
    assert_eq!(read(a, A).as_deref(), Some(&b"mode=v1\n"[..]));
    let state = w.dir.path().join("state-node-b1");
    let journal = std::fs::read_to_string(inplace_agent::journal::file_path(&state)).unwrap();
    assert!(journal.contains(B), "B's removal was part of the plan");
    assert_nothing_secret_logged(&w);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updater_unreadable_bootstrap_data_removes_nothing_and_says_so() {
    let mut w = World::new(42).await;
    w.add_agent("node-b2", "v1.35.2");
    w.add_agent("node-b3", "v1.35.2");
    w.start_updater();
    for a in &w.agents {
        bootstrap_node(a);
    }
    // cp-2's bootstrap data is cut short (it does not parse); cp-3's Secret does not exist.
    let document = bootstrap_document();
    let cut = document.find("bootstrapTokens").unwrap() + 40;
    let mut broken = document.as_bytes()[..cut].to_vec();
    broken.extend_from_slice(b"\n  - [unclosed\n");
    w.api.put(bootstrap_secret("cp-2", "cloud-config", &broken));
    let mut capi = w.client();
    let settings = json!({"agentPort": w.agent_port.to_string()});
    for (i, name) in ["cp-2", "cp-3"].into_iter().enumerate() {
        let (machine, config) = w.put_machine(name, i, "v1.35.2", only_a("mode=v2\n"));
        let body = update_request(&machine, Some(&config), settings.clone());
        let seen = poll_update(&mut capi, &body, SCALE).await;
        let last = seen.last().unwrap();
        assert_eq!(
            (&last["status"], &last["retryAfterSeconds"]),
            (&json!("Success"), &json!(0)),
            "{seen:?}\n{}",
            w.updater_log()
        );
        let a = &w.agents[i];
        assert_eq!(read(a, A).as_deref(), Some(&b"mode=v2\n"[..]));
        assert_eq!(read(a, B), Some(b_bytes()), "{name}: nothing removed");
    }
    let log = w.updater_log();
    let warned = |machine: &str, reason: &str| {
        log.lines().any(|l| {
            l.contains("WARN")
                && l.contains(machine)
                && l.contains(reason)
                && l.contains("not removed")
        })
    };
    assert!(
        warned("default/cp-2", "not a valid cloud-config document"),
        "{log}"
    );
    assert!(warned("default/cp-3", "does not exist"), "{log}");
    assert_nothing_secret_logged(&w);
}
