//! Bounded parsing end to end (issue 44, item 4): an alias bomb — 13.5 KB of YAML, one
//! anchored list and thousands of aliases to it — in a Machine's bootstrap data Secret
//! (UpdateMachine) and in the `ignition.containerLinuxConfig.additionalConfig` of an
//! unauthenticated CanUpdateMachine request, and request bodies built to cost memory, are
//! refused with a message naming the limit while the updater's peak RSS (VmHWM) stays under
//! 64 MiB. Before the limits (debug build) each alias bomb had taken the updater to 291 MiB
//! and no answer within 30 s, and the body of zeros to 305 MiB (its Deployment's memory
//! limit is 128 Mi: an OOM loop). The real `inplace-updater serve` binary, a real agent, the
//! stand-in Kubernetes API.

use serde_json::{Value, json};

use crate::support::memory::Memory;
use crate::support::updater::*;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::secret;

/// The most the updater may hold resident, in KiB, whatever it is sent.
const PEAK_LIMIT_KIB: u64 = 64 * 1024;

/// One anchored list of `items` scalars under `anchor_key`, and aliases to it under
/// `alias_key` until the document is 13.5 KB: millions of nodes once expanded.
fn alias_bomb(head: &str, anchor_key: &str, alias_key: &str) -> String {
    let items = vec!["a"; 1000].join(",");
    let mut doc = format!("{head}{anchor_key}: &l [{items}]\n{alias_key}: [*l");
    while doc.len() < 13_500 {
        doc.push_str(",*l");
    }
    doc.push_str("]\n");
    doc
}

fn cloud_config_bomb() -> String {
    alias_bomb(
        "## template: jinja\n#cloud-config\nwrite_files:\n-   path: /etc/kubernetes/inplace-demo.conf\n    content: |\n      m\n",
        "bootcmd",
        "runcmd",
    )
}

/// The updater's peak resident memory so far, in KiB.
fn peak(w: &World) -> u64 {
    let hwm = Memory::of(w.updater.as_ref().unwrap().pid()).hwm;
    assert!(hwm > 0, "no VmHWM for the updater");
    hwm
}

fn assert_peak_under_limit(w: &World, what: &str) {
    let hwm = peak(w);
    eprintln!("updater peak RSS after {what}: {hwm} KiB");
    assert!(
        hwm < PEAK_LIMIT_KIB,
        "{what}: the updater's peak RSS is {hwm} KiB (limit {PEAK_LIMIT_KIB} KiB)"
    );
}

fn message(v: &Value) -> &str {
    v["message"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_bomb_in_the_bootstrap_data_secret_is_refused_within_64_mib() {
    let mut w = World::new(71).await;
    w.add_agent("node-bomb", "v1.35.2");
    w.start_updater();
    let bomb = cloud_config_bomb();
    assert!(bomb.len() < 14_000, "{}", bomb.len());
    let mut s = secret(
        "default",
        "bomb-0",
        &[("format", b"cloud-config"), ("value", bomb.as_bytes())],
    );
    s["type"] = json!("cluster.x-k8s.io/secret");
    w.api.put(s);
    let files = json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "m\n"}]);
    let (machine, config) = w.put_machine("bomb-0", 0, "v1.35.2", bootstrap_spec(files));
    let settings = json!({"agentPort": w.agent_port.to_string(), "drain": "Never"});
    let mut capi = w.client();
    let answer = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), settings),
        )
        .await;
    assert_peak_under_limit(&w, "the bootstrap data alias bomb");
    let v = answer.unwrap().json();
    assert_eq!(v["status"], "Failure", "{v}\n{}", w.updater_log());
    let m = message(&v);
    assert!(m.contains("Machine default/bomb-0"), "{m}");
    assert!(m.contains("Secret default/bomb-0"), "{m}");
    assert!(m.contains("node count limit of 100000"), "{m}");
    assert!(
        !m.contains("*l") && !m.contains("a,a"),
        "quotes the document: {m}"
    );
    let journal = std::fs::read_to_string(inplace_agent::journal::file_path(
        &w.dir.path().join("state-node-bomb"),
    ))
    .unwrap_or_default();
    assert!(!journal.contains("planAccepted"), "a plan was submitted");

    // Dense YAML just under the size limit (a token per two bytes, each costing the
    // parser's event list before any limit looks): refused at the node limit, still within
    // 64 MiB.
    let mut dense = String::from("#cloud-config\nx: [a");
    while dense.len() < (256 << 10) - 4 {
        dense.push_str(",a");
    }
    dense.push_str("]\n");
    w.api.put(secret(
        "default",
        "bomb-1",
        &[("format", b"cloud-config"), ("value", dense.as_bytes())],
    ));
    let files = json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "d\n"}]);
    let (machine, config) = w.put_machine("bomb-1", 0, "v1.35.2", bootstrap_spec(files));
    let settings = json!({"agentPort": w.agent_port.to_string(), "drain": "Never"});
    let v = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), settings),
        )
        .await
        .unwrap()
        .json();
    assert_peak_under_limit(&w, "256 KiB of a YAML flow list");
    assert_eq!(v["status"], "Failure", "{v}");
    assert!(message(&v).contains("node count limit of 100000"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_bomb_in_a_can_update_machine_additional_config_is_refused_within_64_mib() {
    let mut w = World::new(72).await;
    w.add_agent("cp-bomb", "v1.35.2");
    w.start_updater();
    let mut req = can_update_machine_request();
    req["settings"]["agentPort"] = json!(w.agent_port.to_string());
    let name = req["desired"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = machine(&name, "v1.35.2", "cp-bomb", &w.agents[0].ip, true);
    live["spec"] = req["desired"]["machine"]["spec"].clone();
    w.api.put(live);
    // The Machine was bootstrapped from Ignition (CABPK's `format: ignition`).
    let ignition = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/updater/bootstrap-data/worker.ignition.json"),
    )
    .unwrap();
    w.api.put(secret(
        "default",
        &name,
        &[("format", b"ignition"), ("value", &ignition)],
    ));
    let clc = alias_bomb("storage:\n  directories: []\n", "passwd", "systemd");
    for side in ["current", "desired"] {
        req[side]["bootstrapConfig"]["spec"]["format"] = json!("ignition");
        req[side]["bootstrapConfig"]["spec"]["ignition"] =
            json!({"containerLinuxConfig": {"additionalConfig": clc}});
    }
    let mut capi = w.client();
    let answer = capi.call(Hook::CanUpdateMachine, &go_json(&req)).await;
    assert_peak_under_limit(&w, "the additionalConfig alias bomb");
    let v = answer.unwrap().json();
    // Nothing is covered (CAPI rolls the Machine out instead), and the message says why.
    assert_eq!(v["status"], "Success", "{v}");
    assert!(
        v.get("machinePatch").is_none() && v.get("bootstrapConfigPatch").is_none(),
        "{v}"
    );
    let m = message(&v);
    assert!(
        m.contains("ignition.containerLinuxConfig.additionalConfig"),
        "{m}"
    );
    assert!(m.contains("node count limit of 100000"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_built_to_cost_memory_are_refused_within_64_mib() {
    let mut w = World::new(73).await;
    w.start_updater();
    let mut capi = w.client();
    let limit = inplace_updater::edge::yaml::Limits::REQUEST_BODY.input_bytes;
    // Four million zeros: 128 MiB as a JSON value, refused at the node count limit.
    let mut zeros = br#"{"kind":"CanUpdateMachineRequest","x":["#.to_vec();
    while zeros.len() < limit - 8 {
        zeros.extend_from_slice(b"0,");
    }
    zeros.extend_from_slice(b"0]}");
    let v = capi
        .call(Hook::CanUpdateMachine, &zeros)
        .await
        .unwrap()
        .json();
    assert_peak_under_limit(&w, "a body of four million zeros");
    assert_eq!(v["status"], "Failure", "{v}");
    assert!(message(&v).contains("node count limit of 200000"), "{v}");
    drop(zeros);

    // Nested as deep as the body allows: refused at the depth limit.
    let deep = format!(
        "{{\"kind\":\"CanUpdateMachineRequest\",\"x\":{}{}}}",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    let v = capi
        .call(Hook::CanUpdateMachine, deep.as_bytes())
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Failure", "{v}");
    assert!(message(&v).contains("nesting depth limit of 64"), "{v}");

    // One string as long as the body allows: read, then refused as a request.
    let mut long = br#"{"kind":"CanUpdateMachineRequest","apiVersion":"x","x":""#.to_vec();
    long.resize(limit - 2, b'y');
    long.extend_from_slice(b"\"}");
    let v = capi
        .call(Hook::CanUpdateMachine, &long)
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Failure", "{v}");
    assert_peak_under_limit(&w, "a body of one long string");
}

/// A namespace's tenant can create as many Machines as they like: a list the updater reads
/// (here the cluster's control-plane Machines, for the version skew rules) is bounded at
/// `MAX_LISTED` and more is refused naming the limit, never read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_more_machines_than_the_limit_is_refused_naming_it() {
    use inplace_updater::MAX_LISTED;
    let mut w = World::new(74).await;
    w.add_agent("node-d", "v1.35.1");
    w.start_updater();
    for i in 0..=MAX_LISTED {
        let mut cp = machine(&format!("cp-{i}"), "v1.35.2", "cp", "10.0.0.9", false);
        cp["metadata"]["labels"]["cluster.x-k8s.io/control-plane"] = json!("");
        cp["status"]["nodeInfo"] = json!({"kubeletVersion": "v1.35.2"});
        w.api.put(cp);
    }
    let (req, live) = fixture_request_for_agent_0(&w);
    w.api.put(live);
    let v = w
        .client()
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}\n{}", w.updater_log());
    assert!(v.get("machinePatch").is_none(), "not in place: {v}");
    let message = v["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "more than {MAX_LISTED} match; the updater reads at most {MAX_LISTED}"
        )),
        "{v}"
    );
    // The list was asked for in chunks of the limit, never whole.
    assert!(
        w.api
            .requests()
            .iter()
            .any(|(_, path)| path.contains("/machines?")
                && path.contains(&format!("limit={MAX_LISTED}"))),
        "{:?}",
        w.api
            .requests()
            .iter()
            .filter(|(_, p)| p.contains("/machines?"))
            .collect::<Vec<_>>()
    );
}
