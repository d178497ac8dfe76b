//! A hook request is a pointer, never an authority (issue 44, docs/security.md): through the
//! real `inplace-updater serve` and real agents, requests sent by a caller who is not Cluster
//! API (`World::raw_client`: it does not touch the ExtensionConfig) with forged settings,
//! forged annotations, a MachineSet or a Secret not theirs. Each of these did what the
//! request said before the updater took its settings from the ExtensionConfig and its
//! annotations, selectors and owners from the live objects.

use serde_json::{Value, json};

use crate::support::updater::*;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::{extension_config, namespace, object_path, secret};
use inplace_updater::unreachable::SINCE_ANNOTATION;

fn count_accepted(w: &World, node: &str) -> usize {
    std::fs::read_to_string(inplace_agent::journal::file_path(
        &w.dir.path().join(format!("state-{node}")),
    ))
    .unwrap_or_default()
    .matches("planAccepted")
    .count()
}

fn message(v: &Value) -> &str {
    v["message"].as_str().unwrap_or_default()
}

/// The administrator's ExtensionConfig: these settings, every namespace unless `selector`.
fn register(w: &World, settings: &Value, selector: Value) {
    w.api.put(extension_config(
        "inplace-updater",
        settings.clone(),
        selector,
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_settings_change_nothing_and_only_the_registered_ones_act() {
    let mut w = World::new(90).await;
    w.add_agent("node-f", "v1.35.2");
    w.start_updater();
    let settings =
        json!({"agentPort": w.agent_port.to_string(), "kubeletHealthzURL": "", "drain": "Never"});
    register(&w, &settings, Value::Null);
    let mut caller = w.raw_client();
    let (machine, config) = w.put_machine(
        "forge-0",
        0,
        "v1.35.2",
        bootstrap_spec(json!([{"path": "/etc/kubernetes/f.conf", "content": "v=1\n"}])),
    );

    // One POST with a package repository "switch" that writes a systemd unit: refused.
    let mut forged = settings.clone();
    forged["packageRepositoryPath"] = json!("/etc/systemd/system/evil.service");
    forged["packageRepositoryTemplate"] = json!("[Service]\nExecStart=/bin/sh -c id\n");
    forged["drain"] = json!("Never");
    let r = caller
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), forged),
        )
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Failure", "{r}");
    for words in [
        "differ from those of ExtensionConfig inplace-updater",
        "settings.packageRepositoryPath",
        "settings.packageRepositoryTemplate",
        "nothing was done",
    ] {
        assert!(message(&r).contains(words), "{words:?} not in {r}");
    }
    assert!(
        !message(&r).contains("ExecStart"),
        "values are not echoed: {r}"
    );
    assert_eq!(count_accepted(&w, "node-f"), 0, "no plan reached the agent");
    assert!(
        !w.agents[0]
            .root
            .join("etc/systemd/system/evil.service")
            .exists()
    );

    // The same Machine with exactly the registered settings: updated.
    let body = update_request(&machine, Some(&config), settings.clone());
    let answers = poll_update(&mut caller, &body, 0.01).await;
    let last = answers.last().unwrap();
    assert_eq!(last["status"], "Success", "{answers:?}");
    assert_eq!(last["retryAfterSeconds"], 0, "{answers:?}");
    assert_eq!(
        std::fs::read_to_string(w.agents[0].root.join("etc/kubernetes/f.conf")).unwrap(),
        "v=1\n"
    );

    // Settings that are not strings never came from an ExtensionConfig.
    let mut numbers = settings.clone();
    numbers["agentPort"] = json!(w.agent_port);
    let r = caller
        .call(
            Hook::CanUpdateMachine,
            &go_json(&json!({
                "kind": "CanUpdateMachineRequest",
                "apiVersion": inplace_updater::hooks::HOOKS_API_VERSION,
                "settings": numbers,
                "current": {"machine": machine.clone()},
                "desired": {"machine": machine.clone()},
            })),
        )
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Failure", "{r}");
    assert!(message(&r).contains("settings.agentPort"), "{r}");
    assert!(message(&r).contains("is not a string"), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_no_extension_config_selects_and_a_misspelt_setting_are_refused_by_name() {
    let mut w = World::new(91).await;
    w.add_agent("node-g", "v1.35.2");
    w.start_updater();
    let settings = json!({"agentPort": w.agent_port.to_string(), "drain": "Never"});
    let (machine, config) = w.put_machine("sel-0", 0, "v1.35.2", bootstrap_spec(json!([])));
    let body = update_request(&machine, Some(&config), settings.clone());
    let mut caller = w.raw_client();

    // Registered for the namespaces labelled inplace=yes; "default" is not.
    register(&w, &settings, json!({"matchLabels": {"inplace": "yes"}}));
    w.api.put(namespace("default", json!({})));
    let r = caller
        .call(Hook::UpdateMachine, &body)
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Failure", "{r}");
    assert!(
        message(&r).contains(
            "no ExtensionConfig of this updater (inplace-updater) selects namespace default"
        ),
        "{r}"
    );
    // Labelled: the next call is served (the Namespace is read again on a refusal).
    w.api.put(namespace("default", json!({"inplace": "yes"})));
    let r = caller
        .call(Hook::UpdateMachine, &body)
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Success", "{r}");

    // `agentCa` for `agentCA`: today's silent fallback to File is a Failure naming both.
    let mut misspelt = settings.clone();
    misspelt["agentCa"] = json!("ClusterSecret");
    register(&w, &misspelt, Value::Null);
    let r = caller
        .call(
            Hook::UpdateMachine,
            &update_request(&machine, Some(&config), misspelt),
        )
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Failure", "{r}");
    for words in [
        "ExtensionConfig inplace-updater",
        "settings.agentCa",
        "did you mean \"agentCA\"?",
    ] {
        assert!(message(&r).contains(words), "{words:?} not in {r}");
    }
    assert!(
        w.updater_log()
            .contains("ExtensionConfig settings are invalid"),
        "the operator is told in the log too"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_since_in_the_request_is_not_believed() {
    let mut w = World::new(92).await;
    w.add_agent("node-h", "v1.35.2");
    w.start_updater();
    let settings = json!({"agentPort": w.agent_port.to_string(), "drain": "Never"});
    register(&w, &settings, Value::Null);
    let (mut machine, config) = w.put_machine("dead-1", 0, "v1.35.2", bootstrap_spec(json!([])));
    // Nothing listens at this address: the agent is unreachable.
    machine["status"]["addresses"] = json!([{"type": "InternalIP", "address": "127.0.92.250"}]);
    w.api.put(machine.clone());
    let mut caller = w.raw_client();
    // A request claiming the wait began in 1990: before, an immediate Failure (and one Event
    // per forged value).
    let mut forged = machine.clone();
    forged["metadata"]["annotations"][SINCE_ANNOTATION] = json!("1990-01-01T00:00:00Z");
    let r = caller
        .call(
            Hook::UpdateMachine,
            &update_request(&forged, Some(&config), settings.clone()),
        )
        .await
        .unwrap()
        .json();
    // The request's Machine differs from the live one (its annotations are not compared,
    // its spec is): the wait is judged from the live Machine.
    assert_eq!(r["status"], "Success", "{r}");
    assert_eq!(r["retryAfterSeconds"], 15, "{r}");
    let live = w.api.get(&object_path(&machine).unwrap()).unwrap();
    let since = live["metadata"]["annotations"][SINCE_ANNOTATION]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!since.starts_with("1990"), "{since}");
    assert!(
        since.contains(" spec="),
        "the wait names the update it belongs to: {since}"
    );

    // A wait recorded for another spec (an earlier update) or in the future is no wait.
    for stale in [
        "2000-01-01T00:00:00Z spec=000000000000",
        "2999-01-01T00:00:00Z",
    ] {
        w.api.edit(&object_path(&machine).unwrap(), |m| {
            m["metadata"]["annotations"][SINCE_ANNOTATION] = json!(stale);
        });
        let r = caller
            .call(
                Hook::UpdateMachine,
                &update_request(&machine, Some(&config), settings.clone()),
            )
            .await
            .unwrap()
            .json();
        assert_eq!(r["status"], "Success", "{stale}: {r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn can_update_machine_set_asks_only_the_live_machine_sets_own_machines() {
    let mut w = World::new(93).await;
    w.add_agent("node-i", "v1.35.2");
    w.start_updater();
    let mut body: Value = serde_json::from_slice(
        &std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/updater/can-update-machineset-request.json"),
        )
        .unwrap(),
    )
    .unwrap();
    body["settings"]["agentPort"] = json!(w.agent_port.to_string());
    register(&w, &body["settings"], Value::Null);
    let mut caller = w.raw_client();
    // Another team's Machine, labelled as the request's selector says, owned by no MachineSet
    // of that name.
    let (mut stranger, _) = w.put_machine("team-x-0", 0, "v1.35.1", bootstrap_spec(json!([])));
    stranger["metadata"]["labels"] =
        body["current"]["machineSet"]["spec"]["selector"]["matchLabels"].clone();
    w.api.put(stranger);

    // The MachineSet the request names does not exist: nothing is covered, no Machine named.
    let r = caller
        .call(Hook::CanUpdateMachineSet, &go_json(&body))
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Success", "{r}");
    assert!(r.get("machineSetPatch").is_none(), "{r}");
    assert!(message(&r).contains("does not exist"), "{r}");
    assert!(!message(&r).contains("team-x-0"), "{r}");
    assert!(!message(&r).contains("node-i"), "{r}");

    // It exists (without that Machine): the Machine that only carries its labels is not
    // asked about, even with the agent gone.
    w.api.put(body["current"]["machineSet"].clone());
    w.agents[0].proc.kill9();
    let r = caller
        .call(Hook::CanUpdateMachineSet, &go_json(&body))
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Success", "{r}");
    assert!(!message(&r).contains("team-x-0"), "{r}");
    assert!(
        r["bootstrapConfigTemplatePatch"]["patch"].is_string(),
        "{r}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_that_is_not_its_encoding_is_refused_without_a_byte_of_it() {
    let mut w = World::new(94).await;
    w.add_agent("cp-node", "v1.35.2");
    w.start_updater();
    let mut req = can_update_machine_request();
    req["settings"]["agentPort"] = json!(w.agent_port.to_string());
    register(&w, &req["settings"], Value::Null);
    let name = req["desired"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = machine(&name, "v1.35.2", "cp-node", &w.agents[0].ip, true);
    live["spec"] = req["desired"]["machine"]["spec"].clone();
    w.api.put(live);
    w.api.put(secret(
        "default",
        "registry",
        &[("password", SECRET_CONTENT.as_bytes())],
    ));
    req["desired"]["bootstrapConfig"]["spec"]["files"] = json!([{
        "path": "/etc/kubernetes/registry-auth", "encoding": "base64",
        "contentFrom": {"secret": {"name": "registry", "key": "password"}},
    }]);
    let r = w
        .raw_client()
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    let m = message(&r);
    assert!(m.contains("files[0].contentFrom.secret"), "{r}");
    assert!(m.contains("not base64"), "{r}");
    for leak in [SECRET_CONTENT, "offset", "byte", "s3cr3t"] {
        assert!(!m.contains(leak), "{leak:?} in {r}");
    }

    // A bootstrap config of another namespace is not this Machine's: nothing is read there.
    req["desired"]["bootstrapConfig"]["metadata"]["namespace"] = json!("kube-system");
    let r = w
        .raw_client()
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(r["status"], "Failure", "{r}");
    assert!(message(&r).contains("not the Machine's namespace"), "{r}");
}
