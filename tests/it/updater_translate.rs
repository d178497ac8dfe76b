//! The updater's pure parts against Cluster API's fixtures (tests/fixtures/updater/): the
//! CanUpdate* coverage, its patches applied to `current` exactly as CAPI does (RFC 6902 on the
//! whole object with an independent JSON Patch implementation, then only `spec` /
//! `spec.template.spec` copied back, the Machine fields CAPI ignores cleared, compared with
//! `desired`), and the translation of the UpdateMachine request into a plan. Also the
//! `translate` subcommand, and the architecture invariant of `src/updater/`.

use std::path::Path;
use std::process::Command;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};

use inplace_plan::{Change, Probe};
use inplace_updater::handlers::can_update_machine_set;
use inplace_updater::hooks::{Hook, HookRequest};
use inplace_updater::patch::{
    MACHINE_FIELDS_CAPI_IGNORES, cover_kubeadm, cover_machine, spec_patch,
};
use inplace_updater::settings::{Defaults, Settings};
use inplace_updater::translate::{
    Capabilities, Desired, MachineRole, NoSecrets, NodeFacts, SecretSource, plan_id, translate,
};

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/updater")
        .join(name);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn fixture_text(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/updater")
            .join(name),
    )
    .unwrap()
}

const ALL: Capabilities = Capabilities {
    files: true,
    prune: true,
    kubelet_flags: true,
    version: true,
    role: MachineRole::Worker,
    control_plane_config: true,
    api_server_certificate: true,
};

fn settings() -> Settings {
    Settings::defaults(&Defaults::default())
}

fn at<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| &v[*k])
}

/// What CAPI does with a patch (`internal/util/patch`): decode the base64, apply the RFC
/// 6902 document to the whole serialized object (an `add` needs its parent, a `remove` of a
/// missing path fails), copy back only the spec at `spec_path`.
fn capi_apply(current: &Value, patch: Option<&Value>, spec_path: &[&str]) -> Value {
    let mut object = current.clone();
    if let Some(patch) = patch {
        assert_eq!(patch["patchType"], "JSONPatch", "{patch}");
        let text = patch["patch"]
            .as_str()
            .expect("a patchType always comes with a patch");
        assert!(
            !text.is_empty(),
            "empty patch with a patchType: CAPI errors forever"
        );
        let bytes = BASE64
            .decode(text)
            .expect("standard padded base64, as Go decodes []byte");
        let ops: json_patch::Patch = serde_json::from_slice(&bytes).expect("an RFC 6902 document");
        json_patch::patch(&mut object, &ops).expect("the patch applies to current");
    }
    at(&object, spec_path).clone()
}

/// `CleanupMachineSpecForDiff`: the Machine fields CAPI never compares.
fn cleanup_machine(mut spec: Value) -> Value {
    if let Some(m) = spec.as_object_mut() {
        for f in MACHINE_FIELDS_CAPI_IGNORES {
            m.remove(*f);
        }
    }
    spec
}

/// The operations of a patch value (for asserting what a response does).
fn ops(patch: &Value) -> Vec<Value> {
    serde_json::from_slice(&BASE64.decode(patch["patch"].as_str().unwrap()).unwrap()).unwrap()
}

#[test]
fn can_update_machine_patches_make_capis_diff_empty() {
    let req = fixture("can-update-machine-request.json");
    let (cur, des) = (&req["current"], &req["desired"]);
    let machine = cover_machine(&cur["machine"]["spec"], &des["machine"]["spec"], ALL);
    assert!(machine.complete(), "{:?}", machine.uncovered);
    let bootstrap = cover_kubeadm(
        &cur["bootstrapConfig"]["spec"],
        &des["bootstrapConfig"]["spec"],
        ALL,
        true,
    );
    assert!(bootstrap.complete(), "{:?}", bootstrap.uncovered);
    let machine_patch = json!({
        "patchType": "JSONPatch",
        "patch": BASE64.encode(serde_json::to_vec(&spec_patch(&cur["machine"], &["spec"], &machine.spec)).unwrap()),
    });
    let bootstrap_patch = json!({
        "patchType": "JSONPatch",
        "patch": BASE64.encode(serde_json::to_vec(&spec_patch(&cur["bootstrapConfig"], &["spec"], &bootstrap.spec)).unwrap()),
    });
    // Before: different. After: equal, exactly as CAPI compares.
    assert_ne!(
        cleanup_machine(cur["machine"]["spec"].clone()),
        cleanup_machine(des["machine"]["spec"].clone())
    );
    assert_eq!(
        cleanup_machine(capi_apply(&cur["machine"], Some(&machine_patch), &["spec"])),
        cleanup_machine(des["machine"]["spec"].clone())
    );
    assert_eq!(
        capi_apply(&cur["bootstrapConfig"], Some(&bootstrap_patch), &["spec"]),
        des["bootstrapConfig"]["spec"]
    );
    // The machine patch is exactly the version (as the fixture response shows).
    let example = fixture("can-update-machine-response-example.json");
    assert_eq!(ops(&machine_patch), ops(&example["machinePatch"]));
    // The fixture's own response makes the diff empty with the same helper: the helper is
    // CAPI's logic, not ours.
    assert_eq!(
        capi_apply(
            &cur["bootstrapConfig"],
            Some(&example["bootstrapConfigPatch"]),
            &["spec"]
        ),
        des["bootstrapConfig"]["spec"]
    );
}

#[test]
fn without_the_agent_abilities_nothing_is_copied_and_capi_rolls_out() {
    let req = fixture("can-update-machine-request.json");
    let (cur, des) = (&req["current"], &req["desired"]);
    let none = Capabilities {
        files: false,
        prune: false,
        kubelet_flags: false,
        version: false,
        role: MachineRole::Worker,
        control_plane_config: false,
        api_server_certificate: false,
    };
    let machine = cover_machine(&cur["machine"]["spec"], &des["machine"]["spec"], none);
    let bootstrap = cover_kubeadm(
        &cur["bootstrapConfig"]["spec"],
        &des["bootstrapConfig"]["spec"],
        none,
        false,
    );
    assert!(spec_patch(&cur["machine"], &["spec"], &machine.spec).is_empty());
    assert!(spec_patch(&cur["bootstrapConfig"], &["spec"], &bootstrap.spec).is_empty());
    assert_eq!(machine.uncovered.len(), 1, "{:?}", machine.uncovered);
    assert_eq!(bootstrap.uncovered.len(), 2, "{:?}", bootstrap.uncovered);
}

#[test]
fn can_update_machine_set_answers_with_template_patches_that_cover_the_diff() {
    let body = fixture("can-update-machineset-request.json");
    let req = HookRequest::parse(Hook::CanUpdateMachineSet, &body).unwrap();
    let answer = can_update_machine_set(
        &req,
        &Settings::from_extension_config(&req.settings, &Defaults::default()).unwrap(),
    )
    .unwrap();
    let resp = &answer.json();
    assert_eq!(resp["kind"], "CanUpdateMachineSetResponse");
    assert_eq!(
        resp["apiVersion"],
        "hooks.runtime.cluster.x-k8s.io/v1alpha1"
    );
    assert_eq!(resp["status"], "Success");
    assert_eq!(answer.outcome, "covered");
    assert!(resp.get("infrastructureMachineTemplatePatch").is_none());
    // The version moves: under the default drain (Disruptive) each node is drained first,
    // so availability is affected, and said so.
    assert_eq!(resp["affectsAvailability"], true, "{resp}");
    let (cur, des) = (&body["current"], &body["desired"]);
    let spec = ["spec", "template", "spec"];
    assert_eq!(
        cleanup_machine(capi_apply(
            &cur["machineSet"],
            Some(&resp["machineSetPatch"]),
            &spec
        )),
        cleanup_machine(at(&des["machineSet"], &spec).clone())
    );
    assert_eq!(
        capi_apply(
            &cur["bootstrapConfigTemplate"],
            Some(&resp["bootstrapConfigTemplatePatch"]),
            &spec
        ),
        at(&des["bootstrapConfigTemplate"], &spec).clone()
    );
}

#[test]
fn a_files_only_change_does_not_affect_availability_and_refusals_stay_different() {
    let mut body = fixture("can-update-machineset-request.json");
    // Same version and flags on both sides: only the file content changes.
    body["desired"]["machineSet"]["spec"]["template"]["spec"]["version"] = json!("v1.35.1");
    let flags =
        body["current"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"]["joinConfiguration"]
            .clone();
    body["desired"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"]["joinConfiguration"] =
        flags;
    let req = HookRequest::parse(Hook::CanUpdateMachineSet, &body).unwrap();
    let answer = can_update_machine_set(&req, &settings()).unwrap();
    assert_eq!(
        answer.json()["affectsAvailability"],
        json!(false),
        "{}",
        answer.json()
    );
    assert!(
        answer.json().get("machineSetPatch").is_none(),
        "{}",
        answer.json()
    );

    // preKubeadmCommands and a Template file: not in place; the message says which.
    let tspec = &mut body["desired"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"];
    tspec["preKubeadmCommands"] = json!(["echo hi"]);
    tspec["diskSetup"] = json!({"partitions": [{"device": "/dev/sdb", "layout": true}]});
    let req = HookRequest::parse(Hook::CanUpdateMachineSet, &body).unwrap();
    let answer = can_update_machine_set(&req, &settings()).unwrap();
    assert_eq!(answer.outcome, "partial");
    let resp = answer.json();
    let message = resp["message"].as_str().unwrap();
    assert!(
        message.contains("preKubeadmCommands") && message.contains("diskSetup"),
        "{message}"
    );
    assert!(resp.get("affectsAvailability").is_none());
    let (cur, des) = (&body["current"], &body["desired"]);
    let spec = ["spec", "template", "spec"];
    let patched = capi_apply(
        &cur["bootstrapConfigTemplate"],
        resp.get("bootstrapConfigTemplatePatch"),
        &spec,
    );
    assert_ne!(patched, at(&des["bootstrapConfigTemplate"], &spec).clone());
    assert!(patched.get("preKubeadmCommands").is_none());
}

#[test]
fn a_minor_bump_covers_the_feature_gates_kcp_drops() {
    let mut req = fixture("can-update-machine-request.json");
    req["desired"]["machine"]["spec"]["version"] = json!("v1.36.0");
    req["desired"]["bootstrapConfig"]["spec"]["clusterConfiguration"]
        .as_object_mut()
        .unwrap()
        .remove("featureGates");
    let (cur, des) = (&req["current"], &req["desired"]);
    let machine = cover_machine(&cur["machine"]["spec"], &des["machine"]["spec"], ALL);
    let bootstrap = cover_kubeadm(
        &cur["bootstrapConfig"]["spec"],
        &des["bootstrapConfig"]["spec"],
        ALL,
        machine.covered.iter().any(|c| c == "version"),
    );
    assert!(bootstrap.complete(), "{:?}", bootstrap.uncovered);
    let patch = json!({"patchType": "JSONPatch", "patch": BASE64.encode(serde_json::to_vec(&spec_patch(&cur["bootstrapConfig"], &["spec"], &bootstrap.spec)).unwrap())});
    assert_eq!(
        capi_apply(&cur["bootstrapConfig"], Some(&patch), &["spec"]),
        des["bootstrapConfig"]["spec"]
    );
}

fn update_request_objects() -> (Value, Value, Value) {
    let req = fixture("update-machine-request.json");
    let d = &req["desired"];
    (
        d["machine"].clone(),
        d["infrastructureMachine"].clone(),
        d["bootstrapConfig"].clone(),
    )
}

#[test]
fn the_update_machine_request_translates_to_the_upstream_plan() {
    let (machine, infra, bootstrap) = update_request_objects();
    let desired = Desired {
        machine: &machine,
        infrastructure: Some(&infra),
        bootstrap: Some(&bootstrap),
    };
    let t = translate(
        &desired,
        &settings(),
        &NodeFacts::assumed("node-1"),
        &NoSecrets,
    )
    .unwrap();
    assert!(
        t.id.starts_with("default/capi-quickstart-md-0-7g4hb-2x9kd@"),
        "{}",
        t.id
    );
    assert_eq!(t.plan.node_name.as_deref(), Some("node-1"));
    assert_eq!(t.plan.options.prune.as_deref(), Some("kubeadmconfig-files"));
    let kinds: Vec<String> = t
        .plan
        .changes
        .iter()
        .map(|c| c.kind().to_string())
        .collect();
    assert_eq!(
        kinds,
        [
            "file",
            "kubeletFlags",
            "package",
            "kubeadmUpgradeNode",
            "package",
            "package"
        ]
    );
    match &t.plan.changes[0] {
        Change::File(f) => {
            assert_eq!(f.path.as_str(), "/etc/kubernetes/inplace-demo.conf");
            assert_eq!(&f.content[..], b"mode=v2\n");
            assert_eq!(f.mode.to_string(), "0644");
            assert_eq!(f.owner.to_string(), "root:root");
        }
        other => panic!("{other:?}"),
    }
    match &t.plan.changes[1] {
        Change::KubeletFlags(k) => {
            // The \u003c escape of Go's encoder decodes to '<'.
            assert_eq!(
                k.set.get("eviction-hard").map(String::as_str),
                Some("nodefs.available<0%,nodefs.inodesFree<0%,imagefs.available<0%")
            );
            assert_eq!(k.set.get("max-pods").map(String::as_str), Some("150"));
            assert!(k.remove.is_empty());
        }
        other => panic!("{other:?}"),
    }
    for (i, name) in [(2, "kubeadm"), (4, "kubelet"), (5, "kubectl")] {
        match &t.plan.changes[i] {
            Change::Package(p) => {
                assert_eq!(p.name, name);
                assert_eq!(p.version, "1.35.2-*");
                assert!(p.hold);
            }
            other => panic!("{other:?}"),
        }
    }
    let gates: Vec<&str> = t.plan.verify.iter().map(|c| c.probe.key()).collect();
    assert_eq!(gates, ["unitActive", "httpGet", "kubeletVersion"]);
    assert!(
        matches!(&t.plan.verify[2].probe, Probe::KubeletVersion { version } if version == "v1.35.2")
    );
    // The bootstrap token never reaches the plan.
    let doc = serde_json::to_string(&t.document).unwrap();
    assert!(!doc.contains("0123456789abcdef"), "{doc}");
}

#[test]
fn the_plan_follows_what_the_node_reports() {
    let (machine, infra, bootstrap) = update_request_objects();
    let desired = Desired {
        machine: &machine,
        infrastructure: Some(&infra),
        bootstrap: Some(&bootstrap),
    };
    // An agent with services off, no package manager, an old agent without features.
    let node = NodeFacts {
        node_name: "n".into(),
        change_kinds: vec!["file".into(), "kubeletFlags".into()],
        check_kinds: vec!["httpGet".into(), "kubeletVersion".into()],
        features: vec![],
        services_managed: false,
        package_manager: String::new(),
        kubelet_version: String::new(),
    };
    let t = translate(&desired, &settings(), &node, &NoSecrets).unwrap();
    let kinds: Vec<String> = t
        .plan
        .changes
        .iter()
        .map(|c| c.kind().to_string())
        .collect();
    assert_eq!(kinds, ["file", "kubeletFlags"]);
    let gates: Vec<&str> = t.plan.verify.iter().map(|c| c.probe.key()).collect();
    assert_eq!(
        gates,
        ["kubeletVersion"],
        "no unitActive, no healthz with services off"
    );
    assert_eq!(t.plan.options.prune, None);
    assert!(!node.capabilities().version && !node.capabilities().prune);
}

#[test]
fn the_plan_id_is_stable_across_key_order_and_replicas() {
    let (machine, infra, bootstrap) = update_request_objects();
    // Re-serialize with every key reversed: same specs, other bytes.
    fn reversed(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut out = serde_json::Map::new();
                for (k, v) in m.iter().rev() {
                    out.insert(k.clone(), reversed(v));
                }
                Value::Object(out)
            }
            Value::Array(a) => Value::Array(a.iter().map(reversed).collect()),
            other => other.clone(),
        }
    }
    let a = plan_id(&Desired {
        machine: &machine,
        infrastructure: Some(&infra),
        bootstrap: Some(&bootstrap),
    });
    let (m2, i2, b2) = (reversed(&machine), reversed(&infra), reversed(&bootstrap));
    let b = plan_id(&Desired {
        machine: &m2,
        infrastructure: Some(&i2),
        bootstrap: Some(&b2),
    });
    assert_eq!(a, b);
    let mut changed = bootstrap.clone();
    changed["spec"]["files"][0]["content"] = json!("mode=v3\n");
    let c = plan_id(&Desired {
        machine: &machine,
        infrastructure: Some(&infra),
        bootstrap: Some(&changed),
    });
    assert_ne!(a, c);
}

#[test]
fn secrets_and_every_encoding_reach_the_node_as_the_same_bytes() {
    struct OneSecret;
    impl SecretSource for OneSecret {
        fn secret(&self, name: &str, key: &str) -> Result<Vec<u8>, String> {
            match (name, key) {
                ("creds", "token") => Ok(b"s3cr3t\n".to_vec()),
                _ => Err(format!("secret default/{name} has no key {key:?}")),
            }
        }
    }
    let machine =
        json!({"metadata": {"name": "m", "namespace": "default"}, "spec": {"version": "v1.35.2"}});
    let bootstrap = json!({"kind": "KubeadmConfig", "spec": {"files": [
        {"path": "/etc/kubernetes/token", "contentFrom": {"secret": {"name": "creds", "key": "token"}}, "permissions": "0600", "owner": "root:root"},
        {"path": "/etc/kubernetes/b64", "content": BASE64.encode("hello"), "encoding": "base64", "append": true},
    ]}});
    let t = translate(
        &Desired {
            machine: &machine,
            infrastructure: None,
            bootstrap: Some(&bootstrap),
        },
        &settings(),
        &NodeFacts::assumed("n"),
        &OneSecret,
    )
    .unwrap();
    match (&t.plan.changes[0], &t.plan.changes[1]) {
        (Change::File(a), Change::File(b)) => {
            assert_eq!(&a.content[..], b"s3cr3t\n");
            assert_eq!(a.mode.to_string(), "0600");
            assert_eq!(&b.content[..], b"hello");
            assert!(b.append);
        }
        other => panic!("{other:?}"),
    }
    let missing = json!({"kind": "KubeadmConfig", "spec": {"files": [
        {"path": "/etc/x", "contentFrom": {"secret": {"name": "creds", "key": "other"}}}]}});
    let e = translate(
        &Desired {
            machine: &machine,
            infrastructure: None,
            bootstrap: Some(&missing),
        },
        &settings(),
        &NodeFacts::assumed("n"),
        &OneSecret,
    )
    .unwrap_err();
    assert_eq!(e.field, "bootstrapConfig.spec.files[0].contentFrom.secret");
    assert!(e.message.contains("no key \"other\""), "{e}");
}

#[test]
fn the_repository_switch_comes_from_the_template() {
    let machine =
        json!({"metadata": {"name": "m", "namespace": "default"}, "spec": {"version": "v1.36.1"}});
    let settings = Settings::from_extension_config(
        json!({
            "packageRepositoryPath": "/etc/apt/sources.list.d/kubernetes.list",
            "packageRepositoryTemplate": "deb [signed-by=/etc/apt/keyrings/kubernetes-apt-keyring.gpg] https://pkgs.k8s.io/core:/stable:/{minor}/deb/ /",
        })
        .as_object()
        .unwrap(),
        &Defaults::default(),
    )
    .unwrap();
    let t = translate(
        &Desired {
            machine: &machine,
            infrastructure: None,
            bootstrap: None,
        },
        &settings,
        &NodeFacts::assumed("n"),
        &NoSecrets,
    )
    .unwrap();
    match &t.plan.changes[0] {
        Change::File(f) => {
            assert_eq!(f.path.as_str(), "/etc/apt/sources.list.d/kubernetes.list");
            assert_eq!(
                String::from_utf8_lossy(&f.content),
                "deb [signed-by=/etc/apt/keyrings/kubernetes-apt-keyring.gpg] https://pkgs.k8s.io/core:/stable:/v1.36/deb/ /\n"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(&t.plan.changes[1], Change::Package(p) if p.name == "kubeadm" && p.version == "1.36.1-*")
    );
}

#[test]
fn translate_prints_the_plan_and_names_what_is_wrong() {
    let (mut machine, _, bootstrap) = update_request_objects();
    machine["status"] = json!({"nodeRef": {"name": "worker-7"}});
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("machine.json");
    let b = dir.path().join("kubeadmconfig.yaml");
    std::fs::write(&m, machine.to_string()).unwrap();
    std::fs::write(&b, serde_yaml_ng::to_string(&bootstrap).unwrap()).unwrap();
    let bin = crate::support::programs::UPDATER;
    let out = Command::new(bin)
        .args(["translate", "--machine"])
        .arg(&m)
        .arg("--bootstrap-config")
        .arg(&b)
        .args(["--output", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["nodeName"], "worker-7");
    assert_eq!(plan["kind"], "Plan");
    // The printed plan is a valid plan file for the agent.
    inplace_plan::parse_plan(&out.stdout, "translate", &inplace_plan::Limits::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let yaml = Command::new(bin)
        .args(["translate", "--machine"])
        .arg(&m)
        .arg("--bootstrap-config")
        .arg(&b)
        .output()
        .unwrap();
    assert!(yaml.status.success());
    let from_yaml: Value = serde_yaml_ng::from_slice(&yaml.stdout).unwrap();
    assert_eq!(from_yaml, plan);

    let mut bad = bootstrap.clone();
    bad["spec"]["files"][0]["contentFormat"] = json!("Template");
    std::fs::write(&b, bad.to_string()).unwrap();
    let out = Command::new(bin)
        .args(["translate", "--machine"])
        .arg(&m)
        .arg("--bootstrap-config")
        .arg(&b)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bootstrapConfig.spec.files[0].contentFormat"),
        "{err}"
    );
}

#[test]
fn responses_keep_capis_field_order_and_fixtures_round_trip() {
    // The discovery answer is the fixture, byte for byte.
    let ours = serde_json::to_string(&inplace_updater::hooks::discovery_response()).unwrap();
    assert_eq!(ours, fixture_text("discovery-response.json"));
    let done = inplace_updater::hooks::UpdateMachineResponse::new(
        inplace_updater::hooks::Status::Success,
        "inplace-agent: plan applied",
        0,
    );
    assert_eq!(
        serde_json::to_string(&done).unwrap(),
        fixture_text("update-machine-response-done.json")
    );
}

#[test]
fn another_bootstrap_provider_rolls_out_instead_of_failing() {
    let mut body = fixture("can-update-machineset-request.json");
    for side in ["current", "desired"] {
        body[side]["bootstrapConfigTemplate"]["kind"] = json!("RKE2ConfigTemplate");
        body[side]["bootstrapConfigTemplate"]["apiVersion"] =
            json!("bootstrap.cluster.x-k8s.io/v1beta1");
    }
    let req = HookRequest::parse(Hook::CanUpdateMachineSet, &body).unwrap();
    let answer = can_update_machine_set(&req, &settings()).unwrap();
    let v = answer.json();
    assert_eq!(v["status"], "Success", "{v}");
    assert!(
        v.get("machineSetPatch").is_none() && v.get("bootstrapConfigTemplatePatch").is_none(),
        "{v}"
    );
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("RKE2ConfigTemplate"),
        "{v}"
    );
}
