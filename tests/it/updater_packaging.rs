//! The updater's shipping files: the kustomization in packaging/kubernetes/updater/ (every
//! resource there, the pieces agreeing with each other and with the binary's flags, RBAC
//! that only gets, the NetworkPolicy that admits only Cluster API's controllers to the hook
//! port, the manifests valid against the Kubernetes schemas) and
//! packaging/updater.Containerfile (hadolint). tests/it/updater_rbac.rs shows that the RBAC
//! of both installs allows what the updater does.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const DIR: &str = "packaging/kubernetes/updater";

fn docs(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(Path::new(REPO).join(DIR).join(file)).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn all() -> Vec<Value> {
    let k = &docs("kustomization.yaml")[0];
    k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| docs(r.as_str().unwrap()))
        .collect()
}

fn find<'a>(all: &'a [Value], kind: &str, name: &str) -> &'a Value {
    all.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn the_kustomization_holds_what_capi_and_the_updater_need_and_agrees_with_itself() {
    let all = all();
    let kinds: Vec<&str> = all.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for kind in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Issuer",
        "Certificate",
        "Secret",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "NetworkPolicy",
        "ExtensionConfig",
    ] {
        assert!(kinds.contains(&kind), "no {kind} in {DIR}");
    }
    let deployment = find(&all, "Deployment", "inplace-updater");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);

    // The flags exist in the binary.
    let help = Command::new(crate::support::programs::UPDATER)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "serve");
    for a in &args[1..] {
        let flag = a.split('=').next().unwrap();
        assert!(help.contains(flag), "{flag} is not a serve flag:\n{help}");
    }
    let arg = |flag: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{flag}=")))
            .unwrap()
    };
    // The updater reads the ExtensionConfig that registers it, by name.
    let registration = all.iter().find(|d| d["kind"] == "ExtensionConfig").unwrap();
    assert_eq!(
        registration["metadata"]["name"].as_str(),
        Some(arg("--extension-config"))
    );

    // Volumes: the serving Secret is the Certificate's, the client Secret is shipped, and
    // the files the flags name are in them.
    let mounts = container["volumeMounts"].as_array().unwrap();
    let volumes = pod["volumes"].as_array().unwrap();
    let secret_at = |path: &str| -> String {
        let m = mounts
            .iter()
            .find(|m| path.starts_with(m["mountPath"].as_str().unwrap()))
            .unwrap();
        volumes.iter().find(|v| v["name"] == m["name"]).unwrap()["secret"]["secretName"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let certificate = find(&all, "Certificate", "inplace-updater-serving-cert");
    assert_eq!(
        secret_at(arg("--tls-cert")),
        certificate["spec"]["secretName"].as_str().unwrap()
    );
    let client = secret_at(arg("--agent-cert"));
    let client_secret = find(&all, "Secret", &client);
    for flag in ["--agent-ca", "--agent-cert", "--agent-key"] {
        let file = Path::new(arg(flag))
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            client_secret["stringData"].get(&file).is_some(),
            "{flag}: {file} not in {client}"
        );
    }

    // What CAPI dials is the Service, and the certificate names it.
    let service = find(&all, "Service", "inplace-updater");
    let ext = find(&all, "ExtensionConfig", "inplace-updater");
    let svc = &ext["spec"]["clientConfig"]["service"];
    assert_eq!(svc["name"], service["metadata"]["name"]);
    assert_eq!(svc["namespace"], service["metadata"]["namespace"]);
    assert_eq!(svc["port"], service["spec"]["ports"][0]["port"]);
    assert_eq!(
        service["spec"]["ports"][0]["targetPort"],
        container["ports"][0]["name"]
    );
    assert_eq!(
        service["spec"]["selector"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    let host = format!(
        "{}.{}.svc",
        svc["name"].as_str().unwrap(),
        svc["namespace"].as_str().unwrap()
    );
    assert!(
        certificate["spec"]["dnsNames"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == host.as_str())
    );
    assert_eq!(
        ext["metadata"]["annotations"]["runtime.cluster.x-k8s.io/inject-ca-from-secret"],
        format!(
            "{}/{}",
            certificate["metadata"]["namespace"].as_str().unwrap(),
            certificate["spec"]["secretName"].as_str().unwrap()
        )
        .as_str()
    );
    assert!(
        ext["metadata"].get("namespace").is_none(),
        "ExtensionConfig is cluster-scoped"
    );
    // Every setting is one the updater reads.
    let known: Vec<&str> = inplace_updater::settings::KEYS
        .iter()
        .map(|(k, _)| *k)
        .collect();
    for key in ext["spec"]["settings"].as_object().unwrap().keys() {
        assert!(known.contains(&key.as_str()), "unknown setting {key}");
    }
    assert_eq!(ext["spec"]["settings"]["agentPort"], arg("--agent-port"));
    let pdb = find(&all, "PodDisruptionBudget", "inplace-updater");
    assert_eq!(pdb["spec"]["selector"], deployment["spec"]["selector"]);
    let issuer = &certificate["spec"]["issuerRef"];
    find(
        &all,
        issuer["kind"].as_str().unwrap(),
        issuer["name"].as_str().unwrap(),
    );
}

#[test]
fn rbac_gets_machines_kubeadmconfigs_and_secrets_patches_machines_and_creates_events() {
    let all = all();
    let mut seen = Vec::new();
    for role in all
        .iter()
        .filter(|d| d["kind"] == "ClusterRole" || d["kind"] == "Role")
    {
        for rule in role["rules"].as_array().unwrap() {
            for r in rule["resources"].as_array().unwrap() {
                for verb in rule["verbs"].as_array().unwrap() {
                    seen.push(format!(
                        "{}/{} {}",
                        rule["apiGroups"][0].as_str().unwrap(),
                        r.as_str().unwrap(),
                        verb.as_str().unwrap()
                    ));
                }
            }
        }
    }
    seen.sort();
    seen.dedup();
    assert_eq!(
        seen,
        [
            "/events create",
            // The not-in-place Event's count, bumped (crates/updater/src/events.rs).
            "/events get",
            "/events patch",
            "/namespaces get",
            "/secrets get",
            "bootstrap.cluster.x-k8s.io/kubeadmconfigs get",
            "cluster.x-k8s.io/machinedrainrules list",
            "cluster.x-k8s.io/machines get",
            "cluster.x-k8s.io/machines list",
            "cluster.x-k8s.io/machines patch",
            "cluster.x-k8s.io/machinesets get",
            "runtime.cluster.x-k8s.io/extensionconfigs get",
        ]
    );
    // Every role is bound (the per-namespace template that shipped unbound is gone: the
    // namespaced install is packaging/kubernetes/updater-namespaced).
    let binding = find(&all, "ClusterRoleBinding", "inplace-updater");
    assert_eq!(binding["roleRef"]["name"], "inplace-updater");
    assert!(all.iter().all(|d| d["kind"] != "Role"));
    assert_eq!(
        binding["subjects"][0]["name"],
        find(&all, "Deployment", "inplace-updater")["spec"]["template"]["spec"]["serviceAccountName"]
    );
}

/// The venv of packaging/validate (kubernetes-validate, hadolint), installed by running it
/// when it is missing.
fn validators() -> std::path::PathBuf {
    let venv = std::env::var_os("PACKAGING_VENV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| Path::new(&std::env::var_os("HOME").unwrap()).join(".cache"));
            cache.join("inplace-agent/packaging-venv")
        });
    if !venv.join("bin/kubernetes-validate").exists() {
        let status = Command::new("bash")
            .arg(Path::new(REPO).join("packaging/validate"))
            .status()
            .unwrap();
        assert!(
            status.success(),
            "packaging/validate (installs the validators) failed"
        );
    }
    venv
}

/// `kubernetes-validate --strict` of `files` for Kubernetes 1.30 and 1.34.
fn kubernetes_validate(files: &[std::path::PathBuf]) {
    let venv = validators();
    for version in ["1.30", "1.34"] {
        let out = Command::new(venv.join("bin/kubernetes-validate"))
            .args(["--strict", "--quiet", "-k", version])
            .args(files)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{version}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Who may call the hooks (issue 44): the NetworkPolicy `kubectl apply -k` creates selects
/// the updater's pods, in their namespace, for ingress only, and admits one thing: TCP on the
/// container port the updater listens on (the Service's target), from the namespaces of
/// Cluster API's core and KubeadmControlPlane controllers, named by
/// kubernetes.io/metadata.name. The rendered object is valid for Kubernetes 1.30 and 1.34.
#[test]
fn the_network_policy_admits_only_capis_controllers_to_the_hook_port() {
    let rendered = crate::support::rbac::kustomize(&Path::new(REPO).join(DIR));
    let policies: Vec<&Value> = rendered
        .iter()
        .filter(|o| o["kind"] == "NetworkPolicy")
        .collect();
    assert_eq!(policies.len(), 1, "{policies:?}");
    let policy = policies[0];
    let deployment = find(&rendered, "Deployment", "inplace-updater");
    assert_eq!(
        policy["metadata"]["namespace"],
        deployment["metadata"]["namespace"]
    );
    let selector = &policy["spec"]["podSelector"];
    assert!(selector.get("matchExpressions").is_none(), "{selector}");
    let labels = selector["matchLabels"].as_object().unwrap();
    assert!(!labels.is_empty(), "an empty podSelector selects every pod");
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (k, v) in labels {
        assert_eq!(&pod_labels[k], v, "the updater's pods lack {k}={v}");
    }
    assert_eq!(
        policy["spec"]["policyTypes"],
        serde_json::json!(["Ingress"])
    );

    // The hook port: where --listen binds, the container port of that number, which the
    // Service targets (what CAPI dials).
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let listen: u64 = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|a| a.as_str().unwrap().strip_prefix("--listen="))
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["containerPort"] == listen)
        .unwrap_or_else(|| panic!("no container port {listen}"));
    let service = find(&rendered, "Service", "inplace-updater");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], port["name"]);
    let ingress = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(ingress.len(), 1, "one rule: {ingress:?}");
    assert_eq!(
        ingress[0]["ports"],
        serde_json::json!([{"protocol": "TCP", "port": listen}])
    );
    assert_eq!(
        ingress[0]["from"],
        serde_json::json!([{"namespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name",
            "operator": "In",
            "values": ["capi-system", "capi-kubeadm-control-plane-system"],
        }]}}])
    );

    let tmp = tempfile::Builder::new()
        .prefix("inplace-test-netpol-")
        .tempdir()
        .unwrap();
    let file = tmp.path().join("networkpolicy.yaml");
    std::fs::write(&file, serde_yaml_ng::to_string(policy).unwrap()).unwrap();
    kubernetes_validate(&[file]);

    // The overlay docs/updater.md ("Who may call") shows for other controller namespaces,
    // as written there, over a copy of the kustomization where it says it sits.
    let doc = std::fs::read_to_string(Path::new(REPO).join("docs/updater.md")).unwrap();
    let overlay = doc
        .split("```yaml\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .find(|b| b.contains("inplace-updater-hooks"))
        .expect("docs/updater.md shows the overlay that changes the callers' namespaces");
    let copy = tmp.path().join(DIR);
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(Path::new(REPO).join(DIR)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    std::fs::create_dir(tmp.path().join("overlay")).unwrap();
    std::fs::write(
        tmp.path().join("overlay/kustomization.yaml"),
        overlay
            .lines()
            .map(|l| l.strip_prefix("  ").unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let changed = crate::support::rbac::kustomize(&tmp.path().join("overlay"));
    let changed = find(&changed, "NetworkPolicy", "inplace-updater-hooks");
    assert_eq!(
        changed["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"],
        serde_json::json!([
            "capi-system",
            "capi-kubeadm-control-plane-system",
            "my-controlplane-system"
        ])
    );
}

/// kubernetes-validate (strict) for the core kinds and hadolint for the Containerfile, from
/// the pinned venv packaging/validate installs (it is run first when the venv is missing).
#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    let venv = validators();
    let core = [
        "namespace.yaml",
        "serviceaccount.yaml",
        "rbac.yaml",
        "agent-client-secret.yaml",
        "deployment.yaml",
        "pdb.yaml",
        "service.yaml",
        "networkpolicy.yaml",
    ];
    let files: Vec<_> = core
        .iter()
        .map(|f| Path::new(REPO).join(DIR).join(f))
        .collect();
    kubernetes_validate(&files);
    let out = Command::new(venv.join("bin/hadolint"))
        .arg(Path::new(REPO).join("packaging/updater.Containerfile"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
