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

/// The YAML documents of `text` (empty ones dropped).
fn documents(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
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
    // The client Secret is the operator's (docs/updater.md, "Install"): the kustomization
    // holds none, so applying it again never overwrites it with a placeholder.
    // `the_documented_install_runs_in_order_on_an_empty_cluster` checks that the documented
    // command makes it with the files the flags name.
    assert!(
        all.iter().all(|d| d["kind"] != "Secret"),
        "a Secret in {DIR} would overwrite the operator's at every apply"
    );
    for flag in ["--agent-ca", "--agent-cert", "--agent-key"] {
        assert_eq!(
            secret_at(arg(flag)),
            "inplace-updater-agent-client",
            "{flag}"
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

// === The documented install, run in the documented order ===

/// The commands of the `sh` blocks in the section of `doc` under the heading `heading` (to
/// the next heading of any level), in order: continuation lines joined, comments and blank
/// lines dropped.
fn documented_commands(doc: &str, heading: &str) -> Vec<String> {
    let mut lines = doc.lines().skip_while(|l| *l != heading);
    assert!(lines.next().is_some(), "no heading {heading:?}");
    let (mut commands, mut fence, mut current) = (Vec::new(), None::<String>, String::new());
    for line in lines {
        let trimmed = line.trim_start();
        if fence.is_none() {
            let hashes = line.chars().take_while(|c| *c == '#').count();
            if hashes > 0 && line[hashes..].starts_with(' ') {
                break;
            }
            if let Some(info) = trimmed.strip_prefix("```") {
                fence = Some(info.trim().to_owned());
            }
            continue;
        }
        if trimmed.starts_with("```") {
            fence = None;
            continue;
        }
        if fence.as_deref() != Some("sh") {
            continue;
        }
        let code = match trimmed.find(" #") {
            Some(at) => &trimmed[..at],
            None if trimmed.starts_with('#') => "",
            None => trimmed,
        };
        match code.trim_end().strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(code.trim_end());
                if !current.trim().is_empty() {
                    commands.push(current.split_whitespace().collect::<Vec<_>>().join(" "));
                }
                current.clear();
            }
        }
    }
    commands
}

/// A command line split into words as sh does for these commands (quotes, no expansions).
fn words(command: &str) -> Vec<String> {
    let (mut out, mut word, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    for c in command.chars() {
        match (quote, c) {
            (None, '"' | '\'') => (quote, any) = (Some(c), true),
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut word));
                }
                any = false;
            }
            (_, c) => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(word);
    }
    out
}

/// A management cluster as the documented commands see it: the Kubernetes API stand-in
/// (`inplace_updater::standin`) holds its objects; `kubectl kustomize` (packaging/kubectl)
/// builds what `apply -k` applies and `kubectl create secret --dry-run=client` what
/// `create secret` creates, so the objects are the real kubectl's; this harness does what the
/// API server does with them: a namespaced object needs its Namespace (`namespaces "x" not
/// found`), `create` of an existing object is refused, `apply` sets the fields the manifest
/// names (a Secret's `stringData` becomes `data`), deleting a Namespace deletes what is in it.
/// A command it does not know fails the test: doc and test cannot drift apart.
struct Cluster {
    api: inplace_updater::standin::ApiStandin,
    /// Where the operator runs the commands (the files they name are here).
    cwd: std::path::PathBuf,
    /// `export`ed variables (clusterctl's).
    env: std::collections::BTreeMap<String, String>,
    /// The clusterctl repository `packaging/clusterctl/build` made.
    clusterctl: Option<(tempfile::TempDir, std::path::PathBuf)>,
    /// Every object path ever written.
    paths: std::collections::BTreeSet<String>,
}

/// Whether `object`'s kind has no namespace (the stand-in's list of such kinds).
fn cluster_scoped(object: &Value) -> bool {
    let mut bare = object.clone();
    if let Some(m) = bare["metadata"].as_object_mut() {
        m.remove("namespace");
    }
    inplace_updater::standin::object_path(&bare).is_some()
}

/// `object` with its namespace (`default` when a namespaced object names none).
fn namespaced(mut object: Value) -> Value {
    if !cluster_scoped(&object) && object["metadata"]["namespace"].is_null() {
        object["metadata"]["namespace"] = "default".into();
    }
    object
}

/// The API path of `object` (the stand-in's).
fn path_of(object: &Value) -> String {
    inplace_updater::standin::object_path(&namespaced(object.clone()))
        .unwrap_or_else(|| panic!("no path for {object}"))
}

/// What the API server stores for a Secret: `stringData` moved into `data`, base64.
fn stored(mut object: Value) -> Value {
    use base64::Engine as _;
    if let Some(Value::Object(plain)) = object.as_object_mut().and_then(|o| o.remove("stringData"))
    {
        for (k, v) in plain {
            let encoded = base64::engine::general_purpose::STANDARD.encode(v.as_str().unwrap());
            object["data"][k] = encoded.into();
        }
    }
    object
}

/// JSON merge of `patch` onto `target` (maps merge, everything else is replaced).
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (t, p) => *t = p.clone(),
    }
}

impl Cluster {
    async fn new(cwd: &Path) -> Cluster {
        Cluster {
            api: inplace_updater::standin::ApiStandin::start().await.unwrap(),
            cwd: cwd.to_path_buf(),
            env: Default::default(),
            clusterctl: None,
            paths: Default::default(),
        }
    }

    fn kubectl() -> String {
        let out = Command::new("bash")
            .arg(Path::new(REPO).join("packaging/kubectl"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "packaging/kubectl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    fn get(&self, object: &Value) -> Option<Value> {
        self.api.get(&path_of(object))
    }

    fn namespace_exists(&self, object: &Value) -> Result<(), String> {
        if cluster_scoped(object) {
            return Ok(());
        }
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default");
        let namespace =
            serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
        match self.get(&namespace) {
            Some(_) => Ok(()),
            None => Err(format!("namespaces \"{ns}\" not found")),
        }
    }

    fn write(&mut self, object: Value) {
        self.paths.insert(path_of(&object));
        self.api.put(object);
    }

    fn apply(&mut self, objects: Vec<Value>) -> Result<(), String> {
        for object in objects.into_iter().filter(|o| !o.is_null()).map(namespaced) {
            self.namespace_exists(&object)?;
            let object = stored(object);
            let mut live = self.get(&object).unwrap_or(Value::Null);
            merge(&mut live, &object);
            self.write(live);
        }
        Ok(())
    }

    fn create(&mut self, object: Value) -> Result<(), String> {
        let object = stored(namespaced(object));
        self.namespace_exists(&object)?;
        if self.get(&object).is_some() {
            return Err(format!(
                "{} \"{}\" already exists",
                object["kind"].as_str().unwrap().to_ascii_lowercase(),
                object["metadata"]["name"].as_str().unwrap()
            ));
        }
        self.write(object);
        Ok(())
    }

    fn delete(&mut self, object: &Value) -> Result<(), String> {
        let object = namespaced(object.clone());
        let path = path_of(&object);
        if self.api.get(&path).is_none() {
            return Err(format!("{path} not found"));
        }
        self.api.delete(&path);
        if object["kind"] == "Namespace" {
            let inside = format!(
                "/namespaces/{}/",
                object["metadata"]["name"].as_str().unwrap()
            );
            for p in self.paths.iter().filter(|p| p.contains(&inside)) {
                self.api.delete(p);
            }
        }
        Ok(())
    }

    fn kustomize(&self, dir: &str) -> Vec<Value> {
        let out = Command::new(Cluster::kubectl())
            .args(["kustomize", dir])
            .current_dir(REPO)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kubectl kustomize {dir}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        documents(&String::from_utf8(out.stdout).unwrap())
    }

    /// Runs one documented command; the API server's refusal as an error.
    fn run(&mut self, command: &str) -> Result<(), String> {
        let w = words(command);
        let w: Vec<&str> = w.iter().map(String::as_str).collect();
        match w.as_slice() {
            ["export", assignment] => {
                let (k, v) = assignment.split_once('=').unwrap();
                self.env.insert(k.to_owned(), v.to_owned());
                Ok(())
            }
            ["packaging/clusterctl/build"] => {
                self.clusterctl = Some(crate::packaging_install::clusterctl_repository());
                Ok(())
            }
            [
                assignments @ ..,
                "clusterctl",
                "init",
                "--runtime-extension",
                "inplace-updater",
            ] if assignments.iter().all(|a| a.contains('=')) => {
                let (_, dir) = self
                    .clusterctl
                    .as_ref()
                    .expect("clusterctl init before packaging/clusterctl/build");
                let text =
                    std::fs::read_to_string(dir.join("runtime-extension-components.yaml")).unwrap();
                let values: std::collections::BTreeMap<&str, &str> = self
                    .env
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                let rendered = crate::packaging_install::render(&text, &values)?;
                self.apply(documents(&rendered))
            }
            ["kubectl", "apply", "-f", file] => {
                let text = std::fs::read_to_string(Path::new(REPO).join(file)).unwrap();
                self.apply(documents(&text))
            }
            ["kubectl", "apply", "-k", dir] => {
                let objects = self.kustomize(dir);
                self.apply(objects)
            }
            ["kubectl", "delete", "-k", dir, flags @ ..] => {
                let ignore = match flags {
                    [] => false,
                    ["--ignore-not-found"] => true,
                    _ => panic!("`{command}`: flags this test does not know"),
                };
                // kubectl deletes the rest and then fails naming what it did not find.
                let mut missing = Vec::new();
                for object in self.kustomize(dir).iter().rev() {
                    if let Err(e) = self.delete(object) {
                        missing.push(e);
                    }
                }
                match missing.is_empty() || ignore {
                    true => Ok(()),
                    false => Err(missing.join("; ")),
                }
            }
            [
                "kubectl",
                "-n",
                ns,
                "create",
                "secret",
                "generic",
                name,
                files @ ..,
            ] => {
                let out = Command::new(Cluster::kubectl())
                    .args(["-n", ns, "create", "secret", "generic", name])
                    .args(files)
                    .args(["--dry-run=client", "-o", "json"])
                    .current_dir(&self.cwd)
                    .output()
                    .unwrap();
                if !out.status.success() {
                    return Err(String::from_utf8_lossy(&out.stderr).into_owned());
                }
                self.create(serde_json::from_slice(&out.stdout).unwrap())
            }
            ["kubectl", "get", kind, name, "-o", "yaml"] | ["kubectl", "delete", kind, name] => {
                let object = self
                    .paths
                    .iter()
                    .filter_map(|p| self.api.get(p))
                    .find(|o| {
                        o["kind"].as_str().unwrap_or_default().to_ascii_lowercase() == *kind
                            && o["metadata"]["name"] == *name
                    })
                    .ok_or_else(|| format!("{kind} \"{name}\" not found"))?;
                if w[1] == "delete" {
                    self.delete(&object)?;
                }
                Ok(())
            }
            _ => panic!(
                "the documented command `{command}` is not one this test runs: teach \
                 Cluster::run what it does"
            ),
        }
    }

    /// Runs `commands` in order; the first refusal panics naming the command.
    fn run_all(&mut self, what: &str, commands: &[String]) {
        for c in commands {
            if let Err(e) = self.run(c) {
                panic!("{what}: `{c}` failed: {e}");
            }
        }
    }

    fn secret_data(&self, ns: &str, name: &str) -> std::collections::BTreeMap<String, Vec<u8>> {
        use base64::Engine as _;
        let secret = self
            .api
            .get(&format!("/api/v1/namespaces/{ns}/secrets/{name}"))
            .unwrap_or_else(|| panic!("no Secret {ns}/{name}"));
        secret["data"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    base64::engine::general_purpose::STANDARD
                        .decode(v.as_str().unwrap())
                        .unwrap(),
                )
            })
            .collect()
    }

    /// The Secrets a Deployment mounts exist, or a Certificate in the cluster writes them
    /// (cert-manager), so its pods can start.
    fn assert_mounts_exist(&self, ns: &str, deployment: &str) {
        let d = self
            .api
            .get(&format!(
                "/apis/apps/v1/namespaces/{ns}/deployments/{deployment}"
            ))
            .unwrap_or_else(|| panic!("no Deployment {ns}/{deployment}"));
        let issued: Vec<Value> = self
            .paths
            .iter()
            .filter_map(|p| self.api.get(p))
            .filter(|o| o["kind"] == "Certificate")
            .map(|c| c["spec"]["secretName"].clone())
            .collect();
        for v in d["spec"]["template"]["spec"]["volumes"].as_array().unwrap() {
            let Some(name) = v["secret"]["secretName"].as_str() else {
                continue;
            };
            assert!(
                self.api
                    .get(&format!("/api/v1/namespaces/{ns}/secrets/{name}"))
                    .is_some()
                    || issued.contains(&Value::from(name)),
                "Deployment {ns}/{deployment} mounts Secret {name}, which nothing made"
            );
        }
    }
}

/// The three files of "Install", step 2, as the operator has them: real PEM.
fn operator_files(dir: &Path) -> std::collections::BTreeMap<&'static str, Vec<u8>> {
    let pki = inplace_updater::emulate::Pki::new(&dir.join("pki")).unwrap();
    let client = pki.updater_client().unwrap();
    let files = [
        ("agents-ca.crt", std::fs::read(pki.ca()).unwrap()),
        ("updater.crt", std::fs::read(&client.cert).unwrap()),
        ("updater.key", std::fs::read(&client.key).unwrap()),
    ];
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    files.into_iter().collect()
}

/// docs/updater.md's "Install" commands, read from the file, run in its order on an empty
/// management cluster: each succeeds (the Namespace before the Secret in it), the Secret
/// holds the operator's files afterwards (the kustomization no longer overwrites it with a
/// placeholder), every Secret the Deployment mounts exists, and applying the kustomization
/// again (an upgrade) leaves the Secret alone. Then "Uninstall" removes every object. The
/// old order (the Secret first) is refused as the API server refuses it. install.md's
/// clusterctl route runs the same way from its `export` lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_install_runs_in_order_on_an_empty_cluster() {
    let updater_md = std::fs::read_to_string(Path::new(REPO).join("docs/updater.md")).unwrap();
    let install = documented_commands(&updater_md, "## Install");
    let uninstall = documented_commands(&updater_md, "### Uninstall");
    assert!(
        install.len() >= 3 && uninstall.len() >= 2,
        "{install:?} {uninstall:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let files = operator_files(dir.path());
    let expected = |c: &Cluster| {
        let data = c.secret_data("inplace-system", "inplace-updater-agent-client");
        for (key, file) in [
            ("ca.crt", "agents-ca.crt"),
            ("tls.crt", "updater.crt"),
            ("tls.key", "updater.key"),
        ] {
            assert!(
                data.get(key) == files.get(file),
                "the Secret's {key} is not {file}"
            );
        }
    };

    let mut c = Cluster::new(dir.path()).await;
    c.run_all("docs/updater.md, Install", &install);
    expected(&c);
    c.assert_mounts_exist("inplace-system", "inplace-updater");
    // An upgrade applies the kustomization again: the Secret stays the operator's.
    let apply = install.iter().find(|c| c.contains("apply -k")).unwrap();
    c.run(apply).unwrap();
    expected(&c);
    c.run_all("docs/updater.md, Uninstall", &uninstall);
    let left: Vec<&String> = c.paths.iter().filter(|p| c.api.get(p).is_some()).collect();
    assert!(left.is_empty(), "left after Uninstall: {left:?}");

    // The order the docs had: the Secret before its Namespace exists.
    let create = install
        .iter()
        .find(|c| c.contains("create secret"))
        .unwrap();
    let mut empty = Cluster::new(dir.path()).await;
    let e = empty.run(create).unwrap_err();
    assert_eq!(e, "namespaces \"inplace-system\" not found");

    // clusterctl (docs/install.md): build the repository, init with the variables exported,
    // then the Secret.
    let install_md = std::fs::read_to_string(Path::new(REPO).join("docs/install.md")).unwrap();
    let clusterctl = documented_commands(&install_md, "## The updater with clusterctl");
    assert!(
        clusterctl.iter().any(|c| c.contains("clusterctl init")),
        "{clusterctl:?}"
    );
    let mut c = Cluster::new(dir.path()).await;
    c.run_all("docs/install.md, The updater with clusterctl", &clusterctl);
    let ns = c
        .env
        .get("INPLACE_UPDATER_NAMESPACE")
        .cloned()
        .unwrap_or("inplace-system".into());
    expected(&c);
    c.assert_mounts_exist(&ns, "inplace-updater");
}

// === --agent-ca: needed by agentCA: File only ===

/// `inplace-updater serve` without `--agent-ca` (as under `agentCA: ClusterSecret`, where
/// each cluster's CA Secret verifies its agents) starts, says so in its log, and updates a
/// Machine whose ExtensionConfig says `ClusterSecret`; under an ExtensionConfig that says
/// `File` or nothing (the default) the call is a Failure naming the flag and the other mode,
/// and nothing reaches the node. `--help` says which flags each mode needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_starts_without_agent_ca_and_names_it_when_a_setting_needs_it() {
    use crate::support::daemon::{Daemon, Ready};
    use crate::support::updater::*;
    use serde_json::json;

    let help = Command::new(UPDATER)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        help.contains("File needs --agent-ca, --agent-cert and --agent-key")
            && help.contains("ClusterSecret needs --agent-cert and --agent-key"),
        "{help}"
    );

    let mut w = World::new(147).await;
    let agent = w.add_agent("node-a", "v1.35.2");
    let serving = w
        .pki
        .server("serving", &[SERVICE_HOST, "127.0.0.1"])
        .unwrap();
    let kubeconfig = w.dir.path().join("kubeconfig");
    w.api.write_kubeconfig(&kubeconfig).unwrap();
    let mut cmd = Command::new(UPDATER);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&serving.cert)
        .arg("--tls-key")
        .arg(&serving.key)
        .arg("--agent-cert")
        .arg(&w.client_cert.cert)
        .arg("--agent-key")
        .arg(&w.client_cert.key)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("INPLACE_UPDATER_LOG", "info");
    let proc = Daemon::start(cmd, Ready::Log).unwrap_or_else(|e| panic!("updater: {e}"));
    assert!(proc.log().contains("no --agent-ca"), "{}", proc.log());
    w.updater_addr = Some(proc.addr.parse().unwrap());
    w.updater = Some(proc);
    // The cluster's CA with its key, as Cluster API keeps it.
    w.api.put(inplace_updater::standin::secret(
        CLUSTER.0,
        &format!("{}-ca", CLUSTER.1),
        &[
            ("tls.crt", &std::fs::read(w.pki.ca()).unwrap()),
            ("tls.key", w.pki.ca_key_pem().as_bytes()),
        ],
    ));
    let file = "/etc/kubernetes/no-agent-ca.conf";
    let (machine, config) = w.put_machine(
        "m-0",
        agent,
        "v1.35.2",
        bootstrap_spec(json!([{"path": file, "content": "x\n"}])),
    );
    let on_node = |w: &World| {
        std::fs::read_to_string(w.agents[agent].root.join(file.trim_start_matches('/'))).ok()
    };
    let port = w.agent_port.to_string();
    let mut capi = w.client();
    for settings in [
        json!({"agentPort": port}),
        json!({"agentPort": port, "agentCA": "File"}),
    ] {
        let r = capi
            .call(
                inplace_updater::hooks::Hook::UpdateMachine,
                &update_request(&machine, Some(&config), settings.clone()),
            )
            .await
            .unwrap()
            .json();
        let message = r["message"].as_str().unwrap_or_default();
        assert!(
            r["status"] == "Failure"
                && message.contains("settings.agentCA")
                && message.contains("started without --agent-ca")
                && message.contains("agentCA: ClusterSecret"),
            "{settings}: {r}"
        );
        assert_eq!(on_node(&w), None);
    }
    let body = update_request(
        &machine,
        Some(&config),
        json!({"agentPort": port, "agentCA": "ClusterSecret"}),
    );
    let seen = poll_update(&mut capi, &body, 0.01).await;
    assert_eq!(
        seen.last().unwrap()["status"],
        "Success",
        "{seen:?}\n{}",
        w.updater_log()
    );
    assert_eq!(on_node(&w).as_deref(), Some("x\n"));
}

/// docs/pki.md's overlay for `agentCA: ClusterSecret` ("Fleet trust in one place"), read
/// from the file and built with kustomize over the shipped kustomization: the
/// ExtensionConfig says `ClusterSecret` and the Deployment no longer passes `--agent-ca`,
/// every other flag kept (its `test` op fails the build when the flag moves).
#[test]
fn the_cluster_secret_overlay_of_pki_md_drops_agent_ca() {
    let pki_md = std::fs::read_to_string(Path::new(REPO).join("docs/pki.md")).unwrap();
    let section = pki_md
        .split("## Fleet trust in one place")
        .nth(1)
        .expect("docs/pki.md has no \"Fleet trust in one place\"");
    let block = section
        .split("```yaml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("no yaml block in \"Fleet trust in one place\"");
    let indent = block.len() - block.trim_start().len();
    let text: String = block
        .lines()
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    // kustomize takes a relative path only: from the temporary directory up to / and down.
    let up = "../".repeat(dir.path().components().count() - 1);
    let base = format!("{up}{}/{DIR}", REPO.trim_start_matches('/'));
    let text = text.replace("../packaging/kubernetes/updater", &base);
    std::fs::write(dir.path().join("kustomization.yaml"), text).unwrap();
    let out = Command::new(Cluster::kubectl())
        .arg("kustomize")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let built = documents(&String::from_utf8(out.stdout).unwrap());
    let ext = find(&built, "ExtensionConfig", "inplace-updater");
    assert_eq!(ext["spec"]["settings"]["agentCA"], "ClusterSecret");
    let args = |all: &[Value]| -> Vec<String> {
        find(all, "Deployment", "inplace-updater")["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    };
    let shipped = args(&all());
    let overlaid = args(&built);
    let without: Vec<String> = shipped
        .iter()
        .filter(|a| !a.starts_with("--agent-ca="))
        .cloned()
        .collect();
    assert_eq!(overlaid, without);
    assert_eq!(shipped.len(), overlaid.len() + 1);
}
