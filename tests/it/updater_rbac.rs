//! The updater's RBAC actually runs it (issue 44, "Least privilege that works"): every
//! request the real `inplace-updater serve` makes to the management cluster in a real flow —
//! CanUpdateMachineSet, CanUpdateMachine, then UpdateMachine through a drain — is allowed for
//! its ServiceAccount by the RBAC of both installs as `kubectl kustomize` renders them:
//! packaging/kubernetes/updater (cluster-wide, the default) and
//! packaging/kubernetes/updater-namespaced (cluster-scoped reads cluster-wide, the rest bound
//! only in the Machine namespaces listed in its machine-namespaces.yaml). The requests are
//! the API stand-in's own record, read as the API server reads them and decided as its RBAC
//! authorizer decides (tests/support/rbac.rs), so reads that land later (ExtensionConfigs,
//! Namespaces, MachineSets, Clusters) are covered the day the updater makes them. The
//! workload cluster is a second stand-in, so the record holds only what the updater's own
//! ServiceAccount must be allowed (the workload cluster's kubeconfig allows the drain there).
//!
//! The namespaced install grants no Secret outside its namespaces, and its one list of
//! namespaces is the one place to change them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::rbac::{Rbac, Request, documents, kustomize};
use crate::support::updater::*;
use inplace_updater::hooks::Hook;
use inplace_updater::standin::{ApiStandin, namespace, node, pod, secret};

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const SCALE: f64 = 0.01;
const CLUSTER_WIDE: &str = "packaging/kubernetes/updater";
const NAMESPACED: &str = "packaging/kubernetes/updater-namespaced";

/// The ServiceAccount the rendered Deployment runs as: (namespace, name).
fn service_account(objects: &[Value]) -> (String, String) {
    let d = objects
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "inplace-updater")
        .expect("the updater's Deployment");
    (
        d["metadata"]["namespace"].as_str().unwrap().to_owned(),
        d["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap()
            .to_owned(),
    )
}

/// Calls until the answer is no longer the drain's.
async fn drain_through(capi: &mut inplace_updater::emulate::CapiClient, body: &[u8]) -> Value {
    for _ in 0..200 {
        let r = capi.call(Hook::UpdateMachine, body).await.unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        if !v["message"].as_str().unwrap_or("").starts_with("draining") {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the drain never ended");
}

/// A short real flow in namespace `default`, the Machine namespace of the test fixtures:
/// CanUpdateMachineSet (lists the MachineSet's Machines), CanUpdateMachine, UpdateMachine of a
/// version bump with a file from a Secret (`contentFrom`), which drains the node (a Pod, a
/// MachineDrainRule), then runs the plan. Returns the management cluster's requests, as the
/// stand-in recorded them, and the workload cluster's.
async fn requests_of_a_drained_update() -> (Vec<(String, String)>, Vec<(String, String)>) {
    let mut w = World::new(75).await;
    w.add_agent("node-r", "v1.35.1");
    w.start_updater();
    let mut capi = w.client();
    let port = w.agent_port.to_string();

    // The workload cluster: its own stand-in, which the <cluster>-kubeconfig Secret names.
    let workload = ApiStandin::start().await.unwrap();
    w.api
        .put(workload.workload_secret("default", "capi-quickstart"));
    workload.put(node("node-r", "v1.35.1"));
    workload.put(namespace("default", json!({})));
    workload.put(pod(
        "default",
        "web-0",
        "node-r",
        Some(("ReplicaSet", "web-7d9")),
        json!({"app": "web"}),
    ));
    w.api.put(
        json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDrainRule",
        "metadata": {"name": "web-first", "namespace": "default"},
        "spec": {"drain": {"behavior": "Drain", "order": 1},
                 "machines": [{"selector": {}}],
                 "pods": [{"selector": {"matchLabels": {"app": "web"}}}]}}),
    );
    w.api.put(secret(
        "default",
        "registry",
        &[("password", SECRET_CONTENT.as_bytes())],
    ));

    let mut ms: Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(REPO).join("tests/fixtures/updater/can-update-machineset-request.json"),
        )
        .unwrap(),
    )
    .unwrap();
    ms["settings"]["agentPort"] = json!(port);
    // The current MachineSet exists (the updater reads it live, then lists its Machines).
    w.api.put(ms["current"]["machineSet"].clone());
    let r = capi
        .call(Hook::CanUpdateMachineSet, &go_json(&ms))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));

    let mut req = can_update_machine_request();
    req["settings"]["agentPort"] = json!(port);
    let name = req["desired"]["machine"]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut live = machine(&name, "v1.35.2", "node-r", &w.agents[0].ip, true);
    live["spec"] = req["desired"]["machine"]["spec"].clone();
    w.api.put(live);
    let v = capi
        .call(Hook::CanUpdateMachine, &go_json(&req))
        .await
        .unwrap()
        .json();
    assert_eq!(v["status"], "Success", "{v}\n{}", w.updater_log());

    let spec = bootstrap_spec(json!([
        {"path": "/etc/kubernetes/inplace-demo.conf", "content": "rbac=1\n"},
        {"path": "/etc/kubernetes/registry-auth", "permissions": "0600",
         "contentFrom": {"secret": {"name": "registry", "key": "password"}}},
    ]));
    let (machine, config) = w.put_machine("md-r", 0, "v1.35.2", spec);
    let body = update_request(
        &machine,
        Some(&config),
        json!({"agentPort": port, "gateTimeoutSeconds": "30"}),
    );
    let v = drain_through(&mut capi, &body).await;
    assert_eq!(v["status"], "Success", "{v}\n{}", w.updater_log());
    // The new kubelet, as the package upgrade would bring it: the version gate passes.
    std::fs::write(
        w.agents[0].root.join("usr/local/bin/kubelet.version"),
        "v1.35.2\n",
    )
    .unwrap();
    let seen = poll_update(&mut capi, &body, SCALE).await;
    let last = seen.last().unwrap();
    assert_eq!(
        (&last["status"], &last["retryAfterSeconds"]),
        (&json!("Success"), &json!(0)),
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert!(
        workload
            .get("/api/v1/namespaces/default/pods/web-0")
            .is_none(),
        "the drain evicted web-0"
    );
    (w.api.requests(), workload.requests())
}

fn forbidden(rbac: &Rbac, sa: (&str, &str), requests: &[Request]) -> Vec<String> {
    requests
        .iter()
        .filter(|r| !rbac.allows(sa, r))
        .map(|r| r.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_installs_allow_every_request_a_drained_update_makes_and_the_namespaced_no_more() {
    let cluster_wide = kustomize(&Path::new(REPO).join(CLUSTER_WIDE));
    let namespaced = kustomize(&Path::new(REPO).join(NAMESPACED));
    let (sa_ns, sa_name) = service_account(&cluster_wide);
    assert_eq!(
        service_account(&namespaced),
        (sa_ns.clone(), sa_name.clone())
    );
    let sa = (sa_ns.as_str(), sa_name.as_str());

    let (management, workload) = requests_of_a_drained_update().await;
    let mut requests: Vec<Request> = management
        .iter()
        .map(|(m, p)| Request::from_http(m, p).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    requests.sort();
    requests.dedup();
    crate::support::say(&format!(
        "the updater's requests to the management cluster:\n  {}",
        requests
            .iter()
            .map(Request::to_string)
            .collect::<Vec<_>>()
            .join("\n  ")
    ));
    // The flow made the requests it is meant to cover: the record is the management
    // cluster's alone (the drain went to the workload stand-in).
    let has = |verb: &str, resource: &str| {
        requests.iter().any(|r| {
            r.verb == verb && r.resource == resource && r.namespace.as_deref() == Some("default")
        })
    };
    for (verb, resource) in [
        ("get", "machines"),
        ("list", "machines"),
        ("get", "kubeadmconfigs"),
        ("get", "secrets"),
        ("list", "machinedrainrules"),
    ] {
        assert!(has(verb, resource), "no {verb} {resource} in {requests:#?}");
    }
    assert!(
        workload
            .iter()
            .any(|(m, p)| m == "POST" && p.contains("/pods/web-0/eviction")),
        "{workload:?}"
    );
    assert!(
        !requests
            .iter()
            .any(|r| ["pods", "nodes", "pods/eviction"].contains(&r.resource.as_str())),
        "a workload request reached the management cluster: {requests:#?}"
    );

    for (install, objects) in [(CLUSTER_WIDE, &cluster_wide), (NAMESPACED, &namespaced)] {
        let rbac = Rbac::from_objects(objects).unwrap_or_else(|e| panic!("{install}: {e}"));
        let denied = forbidden(&rbac, sa, &requests);
        assert!(
            denied.is_empty(),
            "{install} forbids what the updater does:\n{}",
            denied.join("\n")
        );
        // Another ServiceAccount is given nothing.
        let denied = forbidden(&rbac, (sa.0, "default"), &requests);
        assert_eq!(denied.len(), requests.len(), "{install}");
    }

    // The same requests in a namespace the namespaced install does not list (but the
    // Namespace object's get, which is cluster-scoped): all forbidden there by the namespaced
    // install, all allowed by the cluster-wide one.
    let elsewhere: Vec<Request> = requests
        .iter()
        .filter(|r| r.namespace.as_deref() == Some("default") && r.resource != "namespaces")
        .map(|r| Request {
            namespace: Some("team-b".into()),
            ..r.clone()
        })
        .collect();
    let wide = Rbac::from_objects(&cluster_wide).unwrap();
    let narrow = Rbac::from_objects(&namespaced).unwrap();
    assert!(forbidden(&wide, sa, &elsewhere).is_empty());
    assert_eq!(forbidden(&narrow, sa, &elsewhere).len(), elsewhere.len());
    assert!(elsewhere.iter().any(|r| r.resource == "secrets"));
}

/// The cluster-scoped reads issue 44 adds (the operator's ExtensionConfigs by name, a
/// Machine's Namespace) and the read of a MachineSet: both installs allow them, as the API
/// server would see the requests kube-rs makes for them, and nothing more (no list or watch
/// of ExtensionConfigs, no Cluster).
#[test]
fn both_installs_allow_the_settings_and_ownership_reads() {
    let paths = [
        (
            "GET",
            "/apis/runtime.cluster.x-k8s.io/v1beta2/extensionconfigs/inplace-updater",
        ),
        ("GET", "/api/v1/namespaces/team-a"),
        (
            "GET",
            "/apis/cluster.x-k8s.io/v1beta2/namespaces/default/machinesets/md-0-7g4hb",
        ),
        ("POST", "/api/v1/namespaces/default/events"),
        // The not-in-place Event's count, bumped (crates/updater/src/events.rs).
        (
            "GET",
            "/api/v1/namespaces/default/events/md-0.0123456789abcdef",
        ),
        (
            "PATCH",
            "/api/v1/namespaces/default/events/md-0.0123456789abcdef",
        ),
        (
            "PATCH",
            "/apis/cluster.x-k8s.io/v1beta2/namespaces/default/machines/md-0",
        ),
    ];
    let requests: Vec<Request> = paths
        .iter()
        .map(|(m, p)| Request::from_http(m, p).unwrap())
        .collect();
    assert_eq!(requests[0].verb, "get");
    assert_eq!(requests[1].resource, "namespaces");
    for install in [CLUSTER_WIDE, NAMESPACED] {
        let objects = kustomize(&Path::new(REPO).join(install));
        let (ns, name) = service_account(&objects);
        let rbac = Rbac::from_objects(&objects).unwrap();
        let denied = forbidden(&rbac, (&ns, &name), &requests);
        assert!(denied.is_empty(), "{install}: {}", denied.join("\n"));
        // Never more than asked: no list or watch of Secrets, no write of anything else.
        for (m, p) in [
            ("GET", "/api/v1/namespaces/default/secrets"),
            ("GET", "/api/v1/secrets?watch=1"),
            (
                "PUT",
                "/apis/cluster.x-k8s.io/v1beta2/namespaces/default/machines/md-0",
            ),
            (
                "DELETE",
                "/apis/cluster.x-k8s.io/v1beta2/namespaces/default/machines/md-0",
            ),
            (
                "PATCH",
                "/apis/cluster.x-k8s.io/v1beta2/namespaces/default/machinesets/md-0",
            ),
            (
                "PATCH",
                "/apis/runtime.cluster.x-k8s.io/v1beta2/extensionconfigs/inplace-updater",
            ),
            ("POST", "/api/v1/namespaces/default/pods/web-0/eviction"),
            // Events: its own by name, never a list, a watch or a deletion.
            ("GET", "/api/v1/namespaces/default/events"),
            (
                "DELETE",
                "/api/v1/namespaces/default/events/md-0.0123456789abcdef",
            ),
        ] {
            let r = Request::from_http(m, p).unwrap();
            assert!(!rbac.allows((&ns, &name), &r), "{install} allows {r}");
        }
    }
}

/// The namespaced install's namespaces are listed in one place, machine-namespaces.yaml: a
/// copy of the two kustomizations with that file listing team-a and team-b grants Secrets in
/// those two and in no other namespace, and no ClusterRoleBinding of it grants a Secret.
#[test]
fn the_namespaced_install_lists_its_namespaces_in_one_place_and_grants_no_secret_elsewhere() {
    let tmp = tempfile::Builder::new()
        .prefix("inplace-test-rbac-")
        .tempdir()
        .unwrap();
    let copy = |from: &str, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(Path::new(REPO).join(from)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    };
    let kube: PathBuf = tmp.path().join("kubernetes");
    copy(CLUSTER_WIDE, &kube.join("updater"));
    copy(NAMESPACED, &kube.join("updater-namespaced"));
    let list = kube.join("updater-namespaced/machine-namespaces.yaml");
    let shipped = std::fs::read_to_string(&list).unwrap();
    let mut edited = shipped.replace("namespace: default", "namespace: team-a");
    assert_ne!(
        edited, shipped,
        "machine-namespaces.yaml names no namespace: default"
    );
    edited.push_str(
        "---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: inplace-updater\n  namespace: team-b\n",
    );
    std::fs::write(&list, edited).unwrap();

    let objects = kustomize(&kube.join("updater-namespaced"));
    let (ns, name) = service_account(&objects);
    let sa = (ns.as_str(), name.as_str());
    let rbac = Rbac::from_objects(&objects).unwrap();
    let get_secret = |namespace: &str| {
        Request::from_http(
            "GET",
            &format!("/api/v1/namespaces/{namespace}/secrets/capi-quickstart-kubeconfig"),
        )
        .unwrap()
    };
    assert!(rbac.allows(sa, &get_secret("team-a")));
    assert!(rbac.allows(sa, &get_secret("team-b")));
    for other in ["default", "kube-system", &ns] {
        assert!(!rbac.allows(sa, &get_secret(other)), "Secrets in {other}");
    }
    // What a namespace is given: the RoleBindings all bind the same rules to the updater.
    let bindings: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "RoleBinding")
        .collect();
    assert_eq!(bindings.len(), 2);
    for b in &bindings {
        assert_eq!(
            b["subjects"],
            json!([{"kind": "ServiceAccount", "name": name, "namespace": ns}])
        );
    }
    // Cluster-wide, nothing about Secrets or Machines: the ClusterRoles a ClusterRoleBinding
    // binds hold only the cluster-scoped reads.
    let bound: Vec<&str> = objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding")
        .map(|o| o["roleRef"]["name"].as_str().unwrap())
        .collect();
    let mut cluster_wide: Vec<String> = objects
        .iter()
        .filter(|o| {
            o["kind"] == "ClusterRole" && bound.contains(&o["metadata"]["name"].as_str().unwrap())
        })
        .flat_map(|o| o["rules"].as_array().unwrap().clone())
        .flat_map(|rule| {
            let resources: Vec<String> = rule["resources"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_str().unwrap().to_owned())
                .collect();
            resources
        })
        .collect();
    cluster_wide.sort();
    assert_eq!(cluster_wide, ["extensionconfigs", "namespaces"]);
}

/// The evaluator decides as the API server does on the cases that matter here, so a pass
/// above means something: paths to (verb, group, resource, namespace, name), and a
/// RoleBinding's ClusterRole granting only in its namespace.
#[test]
fn the_rbac_evaluator_reads_paths_and_bindings_as_the_api_server_does() {
    let r = |m: &str, p: &str| Request::from_http(m, p).unwrap();
    let cases = [
        (
            r("GET", "/api/v1/namespaces/a/secrets/x"),
            ("get", "", "secrets", Some("a"), Some("x")),
        ),
        (
            r("GET", "/api/v1/namespaces/a/secrets"),
            ("list", "", "secrets", Some("a"), None),
        ),
        (
            r("GET", "/api/v1/secrets?watch=true"),
            ("watch", "", "secrets", None, None),
        ),
        (
            r("GET", "/api/v1/secrets?watch=false"),
            ("list", "", "secrets", None, None),
        ),
        (
            r("GET", "/api/v1/namespaces/a"),
            ("get", "", "namespaces", Some("a"), Some("a")),
        ),
        (
            r("GET", "/api/v1/namespaces"),
            ("list", "", "namespaces", None, None),
        ),
        (
            r("GET", "/api/v1/nodes/n"),
            ("get", "", "nodes", None, Some("n")),
        ),
        (
            r("POST", "/api/v1/namespaces/a/pods/p/eviction"),
            ("create", "", "pods/eviction", Some("a"), Some("p")),
        ),
        (
            r(
                "GET",
                "/apis/cluster.x-k8s.io/v1beta2/namespaces/a/machines?labelSelector=x%3Dy",
            ),
            ("list", "cluster.x-k8s.io", "machines", Some("a"), None),
        ),
        (
            r(
                "PATCH",
                "/apis/cluster.x-k8s.io/v1beta2/namespaces/a/machines/m",
            ),
            (
                "patch",
                "cluster.x-k8s.io",
                "machines",
                Some("a"),
                Some("m"),
            ),
        ),
        (
            r(
                "DELETE",
                "/apis/cluster.x-k8s.io/v1beta2/namespaces/a/machines",
            ),
            (
                "deletecollection",
                "cluster.x-k8s.io",
                "machines",
                Some("a"),
                None,
            ),
        ),
    ];
    for (got, (verb, group, resource, namespace, name)) in &cases {
        assert_eq!(
            (
                got.verb.as_str(),
                got.group.as_str(),
                got.resource.as_str(),
                got.namespace.as_deref(),
                got.name.as_deref()
            ),
            (*verb, *group, *resource, *namespace, *name)
        );
    }
    assert!(Request::from_http("GET", "/healthz").is_err());
    assert!(Request::from_http("GET", "/apis/cluster.x-k8s.io/v1beta2").is_err());

    let objects = documents(
        "kind: ClusterRole\napiVersion: rbac.authorization.k8s.io/v1\nmetadata: {name: reader}\n\
         rules: [{apiGroups: [''], resources: [secrets], verbs: [get], resourceNames: [x]},\n\
                 {apiGroups: ['*'], resources: ['*/eviction'], verbs: [create]}]\n\
         ---\nkind: RoleBinding\napiVersion: rbac.authorization.k8s.io/v1\nmetadata: {name: b, namespace: a}\n\
         roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: reader}\n\
         subjects: [{kind: ServiceAccount, name: u, namespace: s}]\n",
    );
    let rbac = Rbac::from_objects(&objects).unwrap();
    let sa = ("s", "u");
    assert!(rbac.allows(sa, &r("GET", "/api/v1/namespaces/a/secrets/x")));
    assert!(
        !rbac.allows(sa, &r("GET", "/api/v1/namespaces/a/secrets/y")),
        "resourceNames"
    );
    assert!(
        !rbac.allows(sa, &r("GET", "/api/v1/namespaces/b/secrets/x")),
        "another namespace"
    );
    assert!(
        !rbac.allows(sa, &r("GET", "/api/v1/namespaces/a/secrets")),
        "a list"
    );
    assert!(
        !rbac.allows(("s", "v"), &r("GET", "/api/v1/namespaces/a/secrets/x")),
        "another account"
    );
    assert!(rbac.allows(sa, &r("POST", "/api/v1/namespaces/a/pods/p/eviction")));
    assert!(
        !rbac.allows(sa, &r("POST", "/api/v1/namespaces/a/pods")),
        "the pod itself"
    );
    let aggregated = documents(
        "kind: ClusterRole\napiVersion: rbac.authorization.k8s.io/v1\nmetadata: {name: agg}\n\
         aggregationRule: {clusterRoleSelectors: [{matchLabels: {x: y}}]}\n",
    );
    assert!(Rbac::from_objects(&aggregated).is_err());
}
