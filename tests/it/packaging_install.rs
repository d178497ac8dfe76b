//! The install routes of issue 39, beyond what `packaging/validate` checks object by object
//! (tests/it/packaging.rs runs it: every kustomization built with kustomize, every object
//! validated strictly, each kind refusing an unknown field):
//!
//! - clusterctl's provider repository (`packaging/clusterctl/build`): the components rendered
//!   as clusterctl renders them (`${VAR}`, `${VAR:=default}`) into another namespace, where
//!   every reference to the namespace moved together, the image is the variable's, the
//!   placeholder Secret is gone, every object carries the provider label and the hook
//!   callers' namespaces are a variable defaulting to Cluster API's; `metadata.yaml`
//!   maps this version's release series to the v1beta2 contract;
//! - images: no manifest names a published-looking image; the kustomizations name
//!   registry.example and this version;
//! - monitoring: the PodMonitor, ServiceMonitor, PrometheusRule and the metrics NetworkPolicy
//!   agree with the DaemonSet, the updater's Deployment, Service and Certificate, and the
//!   metric names the docs list;
//! - `packaging/kubectl`: PyPI's pinned kubectl (a machine without a recent one) builds the
//!   same objects as the machine's, and a kubectl with an old kustomize is refused;
//! - the docs (README.md, docs/ but for the decision records, which are history): every
//!   `kubectl apply -k` / `delete -k` they show names a kustomization, and every
//!   `packaging/...` path they name exists.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");

fn documents(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn file_documents(rel: &str) -> Vec<Value> {
    documents(&std::fs::read_to_string(Path::new(REPO).join(rel)).unwrap())
}

fn find<'a>(all: &'a [Value], kind: &str) -> &'a Value {
    all.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// clusterctl's variable substitution, as cmd/clusterctl/client/yamlprocessor does it with
/// envsubst: `${NAME}` and `${NAME:=default}`; a variable with neither a value nor a default
/// is an error naming it.
pub(crate) fn render(text: &str, values: &BTreeMap<&str, &str>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    let mut missing = Vec::new();
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find('}')
            .map(|e| start + e)
            .ok_or_else(|| format!("unclosed variable at {:?}", &rest[start..]))?;
        let inner = &rest[start + 2..end];
        let (name, default) = match inner.split_once(":=") {
            Some((n, d)) => (n.trim(), Some(d)),
            None => (inner.trim(), None),
        };
        match (values.get(name), default) {
            (Some(v), _) => out.push_str(v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => missing.push(name.to_string()),
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    if missing.is_empty() {
        Ok(out)
    } else {
        Err(format!(
            "value for variables [{}] is not set",
            missing.join(", ")
        ))
    }
}

/// `packaging/clusterctl/build --out <tmp>`: the version directory of the repository.
pub(crate) fn clusterctl_repository() -> (tempfile::TempDir, PathBuf) {
    let out = tempfile::Builder::new()
        .prefix("inplace-test-clusterctl-")
        .tempdir()
        .unwrap();
    let result = Command::new("bash")
        .arg(Path::new(REPO).join("packaging/clusterctl/build"))
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    assert!(
        result.status.success(),
        "packaging/clusterctl/build: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    let dir = PathBuf::from(String::from_utf8(result.stdout).unwrap().trim());
    assert_eq!(
        dir,
        out.path()
            .join(format!("runtime-extension-inplace-updater/v{VERSION}"))
    );
    (out, dir)
}

#[test]
fn clusterctl_components_render_into_any_namespace_with_the_image_given() {
    let (_out, dir) = clusterctl_repository();
    let raw = std::fs::read_to_string(dir.join("runtime-extension-components.yaml")).unwrap();

    // Without the image clusterctl refuses, naming the variable; the namespace has a default.
    let err = render(&raw, &BTreeMap::new()).unwrap_err();
    assert_eq!(
        err,
        "value for variables [INPLACE_UPDATER_IMAGE] is not set"
    );
    let image = "registry.example/inplace-updater@sha256:0123";
    let defaulted =
        documents(&render(&raw, &BTreeMap::from([("INPLACE_UPDATER_IMAGE", image)])).unwrap());
    assert_eq!(
        find(&defaulted, "Namespace")["metadata"]["name"],
        "inplace-system"
    );

    let values = BTreeMap::from([
        ("INPLACE_UPDATER_IMAGE", image),
        ("INPLACE_UPDATER_NAMESPACE", "fleet-ops"),
    ]);
    let rendered = render(&raw, &values).unwrap();
    let all = documents(&rendered);
    let ns = "fleet-ops";
    assert_eq!(
        all.iter().filter(|d| d["kind"] == "Namespace").count(),
        1,
        "clusterctl takes the target namespace from the one Namespace object"
    );
    assert_eq!(find(&all, "Namespace")["metadata"]["name"], ns);
    for d in &all {
        assert_eq!(
            d["metadata"]["labels"]["cluster.x-k8s.io/provider"],
            "runtime-extension-inplace-updater",
            "{d}"
        );
        let cluster_scoped = [
            "Namespace",
            "ClusterRole",
            "ClusterRoleBinding",
            "ExtensionConfig",
        ];
        if !cluster_scoped.contains(&d["kind"].as_str().unwrap()) {
            assert_eq!(d["metadata"]["namespace"], ns, "{d}");
        }
        assert!(
            !(d["kind"] == "Secret" && d["metadata"]["name"] == "inplace-updater-agent-client"),
            "clusterctl would overwrite the user's agent client Secret with the placeholder"
        );
    }
    let deployment = find(&all, "Deployment");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        image
    );
    // What CAPI dials, what the certificate names and where CAPI takes the CA from all
    // moved together.
    let service = find(&all, "Service");
    let ext = find(&all, "ExtensionConfig");
    let certificate = all
        .iter()
        .find(|d| d["kind"] == "Certificate" && d["spec"]["isCA"] != true)
        .unwrap();
    assert_eq!(ext["spec"]["clientConfig"]["service"]["namespace"], ns);
    assert_eq!(
        ext["spec"]["clientConfig"]["service"]["name"],
        service["metadata"]["name"]
    );
    let host = format!("{}.{ns}.svc", service["metadata"]["name"].as_str().unwrap());
    assert!(
        certificate["spec"]["dnsNames"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == host.as_str()),
        "{certificate}"
    );
    assert_eq!(
        ext["metadata"]["annotations"]["runtime.cluster.x-k8s.io/inject-ca-from-secret"],
        format!(
            "{ns}/{}",
            certificate["spec"]["secretName"].as_str().unwrap()
        )
        .as_str()
    );
    let binding = find(&all, "ClusterRoleBinding");
    assert_eq!(binding["subjects"][0]["namespace"], ns);
    // Who may call the hooks: the NetworkPolicy moves with the namespace; its callers'
    // namespaces default to Cluster API's controllers' and are one variable.
    let callers = |all: &[Value]| {
        find(all, "NetworkPolicy")["spec"]["ingress"][0]["from"][0]["namespaceSelector"]
            ["matchExpressions"][0]["values"]
            .clone()
    };
    assert_eq!(find(&all, "NetworkPolicy")["metadata"]["namespace"], ns);
    let capi = serde_json::json!(["capi-system", "capi-kubeadm-control-plane-system"]);
    assert_eq!(callers(&all), capi);
    assert_eq!(callers(&defaulted), capi);
    let mut values = values.clone();
    values.insert(
        "INPLACE_UPDATER_HOOK_CALLER_NAMESPACES",
        "capi-system, my-capi-controllers",
    );
    let moved = documents(&render(&raw, &values).unwrap());
    assert_eq!(
        callers(&moved),
        serde_json::json!(["capi-system", "my-capi-controllers"])
    );
    for line in rendered.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            !line.contains("inplace-system"),
            "a reference to the default namespace did not move: {line}"
        );
    }

    // metadata.yaml: this version's release series, on the v1beta2 contract (the hooks are
    // hooks.runtime.cluster.x-k8s.io/v1alpha1 of CAPI v1.12-v1.14, whose objects are v1beta2).
    assert_eq!(
        inplace_updater::hooks::HOOKS_API_VERSION,
        "hooks.runtime.cluster.x-k8s.io/v1alpha1"
    );
    let metadata = &documents(&std::fs::read_to_string(dir.join("metadata.yaml")).unwrap())[0];
    assert_eq!(metadata["kind"], "Metadata");
    let mut parts = VERSION.split('.').map(|p| p.parse::<u64>().unwrap());
    let (major, minor) = (parts.next().unwrap(), parts.next().unwrap());
    let series = metadata["releaseSeries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["major"] == major && s["minor"] == minor)
        .unwrap_or_else(|| panic!("metadata.yaml has no release series {major}.{minor}"));
    assert_eq!(series["contract"], "v1beta2");
}

#[test]
fn images_are_built_and_pushed_by_the_user_never_a_published_looking_tag() {
    let mut texts = Vec::new();
    for entry in walk(&Path::new(REPO).join("packaging")) {
        let name = entry.display().to_string();
        if name.ends_with(".yaml") || name.ends_with("Containerfile") {
            texts.push((name, std::fs::read_to_string(&entry).unwrap()));
        }
    }
    for (name, text) in &texts {
        for line in text
            .lines()
            .filter(|l| l.trim_start().starts_with("image:"))
        {
            let image = line.trim_start().trim_start_matches("image:").trim();
            assert!(
                [
                    "inplace-agent",
                    "inplace-updater",
                    "${INPLACE_UPDATER_IMAGE}"
                ]
                .contains(&image),
                "{name}: {image}: manifests name the image to set, kustomizations where it comes from"
            );
        }
        assert!(
            !text.contains("ghcr.io"),
            "{name} names a registry nothing is pushed to"
        );
    }
    for (dir, image) in [
        ("packaging/kubernetes/agent/base", "inplace-agent"),
        ("packaging/kubernetes/updater", "inplace-updater"),
    ] {
        let k = &file_documents(&format!("{dir}/kustomization.yaml"))[0];
        let entry = &k["images"][0];
        assert_eq!(entry["name"], image);
        assert_eq!(
            entry["newName"],
            format!("registry.example/{image}").as_str()
        );
        assert_eq!(
            entry["newTag"], VERSION,
            "{dir}: the tag to build is this version"
        );
        let text =
            std::fs::read_to_string(Path::new(REPO).join(dir).join("kustomization.yaml")).unwrap();
        assert!(
            text.contains("podman build") && text.contains("podman push"),
            "{dir}"
        );
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn monitoring_scrapes_the_ports_the_workloads_expose_and_alerts_on_documented_metrics() {
    // The agent: the PodMonitor selects the DaemonSet's pods, in its namespace, on the port
    // named metrics.
    let ds = &file_documents("packaging/kubernetes/agent/base/daemonset.yaml")[0];
    let pod_monitor = &file_documents("packaging/kubernetes/monitoring/agent/podmonitor.yaml")[0];
    assert_eq!(
        pod_monitor["metadata"]["namespace"],
        ds["metadata"]["namespace"]
    );
    assert_eq!(
        pod_monitor["spec"]["selector"]["matchLabels"],
        ds["spec"]["template"]["metadata"]["labels"]
    );
    let port = pod_monitor["spec"]["podMetricsEndpoints"][0]["port"].clone();
    let container = &ds["spec"]["template"]["spec"]["containers"][0];
    assert!(
        container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == port),
        "no container port {port}"
    );

    // The updater: the ServiceMonitor selects its Service, scrapes its HTTPS port and verifies
    // the serving certificate with that certificate's CA, for a name the certificate holds.
    let updater: Vec<Value> = ["service.yaml", "certificate.yaml", "deployment.yaml"]
        .iter()
        .flat_map(|f| file_documents(&format!("packaging/kubernetes/updater/{f}")))
        .collect();
    let service = find(&updater, "Service");
    let certificate = updater.iter().find(|d| d["kind"] == "Certificate").unwrap();
    let service_monitor =
        &file_documents("packaging/kubernetes/monitoring/updater/servicemonitor.yaml")[0];
    assert_eq!(
        service_monitor["metadata"]["namespace"],
        service["metadata"]["namespace"]
    );
    for (k, v) in service_monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(
            &service["metadata"]["labels"][k], v,
            "the Service lacks label {k}"
        );
    }
    let endpoint = &service_monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["port"], service["spec"]["ports"][0]["name"]);
    assert_eq!(endpoint["scheme"], "https");
    assert_eq!(
        endpoint["tlsConfig"]["ca"]["secret"]["name"],
        certificate["spec"]["secretName"]
    );
    assert!(
        certificate["spec"]["dnsNames"]
            .as_array()
            .unwrap()
            .contains(&endpoint["tlsConfig"]["serverName"])
    );
    // Once the updater's NetworkPolicy isolates its pods, the monitoring kustomization's
    // admits Prometheus — its pods only, never a whole namespace — to the container port the
    // scraped Service port targets, on the updater's pods.
    let deployment = find(&updater, "Deployment");
    let policy = &file_documents("packaging/kubernetes/monitoring/updater/networkpolicy.yaml")[0];
    assert_eq!(policy["kind"], "NetworkPolicy");
    assert_eq!(
        policy["metadata"]["namespace"],
        deployment["metadata"]["namespace"]
    );
    for (k, v) in policy["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(&deployment["spec"]["template"]["metadata"]["labels"][k], v);
    }
    let target = &service["spec"]["ports"][0]["targetPort"];
    let container_port = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| &p["name"] == target)
        .unwrap()["containerPort"]
        .clone();
    let rule = &policy["spec"]["ingress"][0];
    assert_eq!(rule["ports"][0]["port"], container_port);
    let from = &rule["from"][0];
    assert_eq!(
        from["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "prometheus"
    );
    assert!(from["namespaceSelector"].is_object(), "{from}");

    // Every metric the alerts use is one docs/observability.md documents.
    let docs = std::fs::read_to_string(Path::new(REPO).join("docs/observability.md")).unwrap();
    let rules = &file_documents("packaging/kubernetes/monitoring/updater/prometheusrule.yaml")[0];
    let mut alerts = 0;
    for group in rules["spec"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            alerts += 1;
            let expr = rule["expr"].as_str().unwrap();
            let metrics: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("inplace_"))
                .collect();
            assert!(!metrics.is_empty(), "{expr}");
            for m in metrics {
                assert!(
                    docs.contains(&format!("`{m}`")) || docs.contains(&format!("`{m}{{")),
                    "{m} is not in docs/observability.md"
                );
            }
        }
    }
    assert!(alerts >= 2);
}

#[test]
fn every_kustomization_and_path_the_docs_name_exists() {
    let mut checked = 0;
    let mut files = vec![Path::new(REPO).join("README.md")];
    // Decision records are history: they may name what was (0013 names the old layout).
    let decisions = Path::new(REPO).join("docs/decisions");
    files.extend(
        walk(&Path::new(REPO).join("docs"))
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md") && !p.starts_with(&decisions)),
    );
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, line) in text.lines().enumerate() {
            for (at, _) in line.match_indices("packaging/") {
                // The path as written: up to a character no path has.
                let path: String = line[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || "/._-".contains(*c))
                    .collect();
                let path = path.trim_end_matches(['.', '/']);
                let where_ = format!("{}:{}", file.display(), i + 1);
                assert!(
                    Path::new(REPO).join(path).exists(),
                    "{where_}: {path} does not exist"
                );
                let before = &line[..at];
                if before.trim_end().ends_with("-k") {
                    assert!(
                        Path::new(REPO)
                            .join(path)
                            .join("kustomization.yaml")
                            .exists(),
                        "{where_}: {path} is not a kustomization"
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 10, "only {checked} paths found");
}

/// `packaging/kubectl`, the kustomize that packaging/validate and packaging/clusterctl/build
/// use: PyPI's pinned kubectl (what a machine without a recent kubectl gets) builds every
/// kustomization into the same objects as the machine's kubectl, and a kubectl whose
/// kustomize is too old (Debian's 1.20 has v2.0.3) is refused by name.
#[test]
fn the_pinned_kubectl_builds_what_the_machines_kubectl_builds_and_an_old_one_is_refused() {
    let script = Path::new(REPO).join("packaging/kubectl");
    let kubectl = |pick: &str| {
        let out = Command::new("bash")
            .arg(&script)
            .env("PACKAGING_KUBECTL", pick)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, pinned, err) = kubectl("pinned");
    assert!(ok, "packaging/kubectl (pinned): {err}");

    let old = tempfile::Builder::new()
        .prefix("inplace-test-kubectl-")
        .tempdir()
        .unwrap();
    let fake = old.path().join("kubectl");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'Client Version: v1.20.2'\necho 'Kustomize Version: v2.0.3'\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (ok, _, err) = kubectl(fake.to_str().unwrap());
    assert!(
        !ok && err.contains("no kustomize v5") && err.contains("v2.0.3"),
        "{err}"
    );

    let machine = Command::new("bash")
        .arg(&script)
        .env_remove("PACKAGING_KUBECTL")
        .output()
        .unwrap();
    let machine = String::from_utf8_lossy(&machine.stdout).trim().to_string();
    if machine == pinned {
        crate::support::say("no kubectl with kustomize v5 on PATH: the pinned one is the only one");
        return;
    }
    let build = |kubectl: &str, dir: &str| -> Vec<Value> {
        let out = Command::new(kubectl)
            .args(["kustomize", dir])
            .current_dir(REPO)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{kubectl} kustomize {dir}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut docs = documents(&String::from_utf8(out.stdout).unwrap());
        docs.sort_by_key(|d| {
            format!(
                "{} {} {}",
                d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]
            )
        });
        docs
    };
    for dir in [
        "packaging/kubernetes/agent/kubelet-serving",
        "packaging/kubernetes/agent/cert-manager",
        "packaging/clusterctl",
        "packaging/examples/fleet-client-ca",
    ] {
        assert_eq!(
            build(&machine, dir),
            build(&pinned, dir),
            "{dir}: {machine} and {pinned} differ"
        );
    }
}

/// The code's metric list: the names `crates/<crate>/src/<file>` registers or encodes, with
/// its registry's prefix (`Registry::with_prefix`): the first string literal of every
/// `register(`, `encode_descriptor(`, `counter(`, `gauge(` and `labelled(` call. Each name is
/// served as itself, or with `_total` (a counter) or `_info` (an info metric).
fn code_metrics(file: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(REPO).join(file)).unwrap();
    let literal = |rest: &str| -> Option<String> {
        let rest = rest
            .trim_start()
            .strip_prefix("&mut encoder,")
            .unwrap_or(rest)
            .trim_start();
        let rest = rest.strip_prefix('"')?;
        let name = &rest[..rest.find('"')?];
        (!name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .then(|| name.to_owned())
    };
    let prefix = text
        .split("with_prefix(")
        .nth(1)
        .and_then(literal)
        .unwrap_or_else(|| panic!("{file}: no Registry::with_prefix"));
    let mut names = Vec::new();
    for call in [
        "register(",
        "encode_descriptor(",
        "counter(",
        "gauge(",
        "labelled(",
    ] {
        for (at, _) in text.match_indices(call) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue; // register_collector(, my_counter(
            }
            if let Some(name) = literal(&text[at + call.len()..]) {
                names.push(format!("{prefix}_{name}"));
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

/// Whether `name` (as a query or the docs write it) is the metric `code` (as registered).
fn is_metric(name: &str, code: &str) -> bool {
    name == code || name == format!("{code}_total") || name == format!("{code}_info")
}

/// The metric names (`inplace_...`) of every `expr` of a PrometheusRule file.
fn alert_metrics(rel: &str) -> Vec<String> {
    let rules = &file_documents(rel)[0];
    let mut out = Vec::new();
    for group in rules["spec"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let expr = rule["expr"].as_str().unwrap();
            let names: Vec<String> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("inplace_"))
                .map(str::to_owned)
                .collect();
            assert!(!names.is_empty(), "{rel}: {expr} uses no metric of ours");
            out.extend(names);
        }
    }
    out
}

/// The code's metric list is what the alerts and the docs name: every metric the two
/// PrometheusRules use (the agent's drift, certificate expiry and failed plans alerts
/// included) is one the agent's or the updater's metrics code registers, and
/// docs/observability.md has one metrics table whose first column lists exactly the metrics
/// of both (its agent table used to be cut in two by a blank line, the drift rows a paragraph
/// of their own, and the updater's drain metrics were missing). The monitoring
/// kustomizations ship both rules and docs/install.md names them.
#[test]
fn every_metric_the_alerts_and_the_docs_name_is_one_the_code_registers() {
    let agent_served = code_metrics("crates/agent/src/status/metrics.rs");
    let updater_served = code_metrics("crates/updater/src/metrics.rs");
    for (list, some) in [
        (&agent_served, "inplace_agent_drifted_changes"),
        (&agent_served, "inplace_agent_plans"),
        (&updater_served, "inplace_updater_requests"),
        (&updater_served, "inplace_updater_agents_unreachable"),
    ] {
        assert!(
            list.iter().any(|m| m == some),
            "{some} not found in {list:?}"
        );
    }
    for (rule, served) in [
        (
            "packaging/kubernetes/monitoring/agent/prometheusrule.yaml",
            &agent_served,
        ),
        (
            "packaging/kubernetes/monitoring/updater/prometheusrule.yaml",
            &updater_served,
        ),
    ] {
        for m in alert_metrics(rule) {
            assert!(
                served.iter().any(|c| is_metric(&m, c)),
                "{rule}: {m} is not a metric the code registers"
            );
        }
        let dir = Path::new(rule).parent().unwrap();
        let k = &file_documents(&format!("{}/kustomization.yaml", dir.display()))[0];
        assert!(
            k["resources"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r == "prometheusrule.yaml"),
            "{} does not ship its PrometheusRule",
            dir.display()
        );
    }
    let agent_alerts = alert_metrics("packaging/kubernetes/monitoring/agent/prometheusrule.yaml");
    for m in [
        "inplace_agent_drifted_changes",
        "inplace_agent_tls_server_certificate_expiry_timestamp_seconds",
        "inplace_agent_plans_total",
    ] {
        assert!(agent_alerts.iter().any(|a| a == m), "no agent alert on {m}");
    }

    // One table: the metric names of its first column, from the first row naming an agent
    // metric to the first line that is not a row.
    let docs = std::fs::read_to_string(Path::new(REPO).join("docs/observability.md")).unwrap();
    let tables = docs
        .split("\n\n")
        .filter(|p| p.trim_start().starts_with('|'))
        .filter(|p| p.contains("`inplace_"));
    let tables: Vec<&str> = tables.collect();
    assert_eq!(
        tables.len(),
        1,
        "docs/observability.md has {} metrics tables",
        tables.len()
    );
    let mut documented = std::collections::BTreeSet::new();
    for row in tables[0].lines() {
        assert!(row.starts_with('|'), "not a table row: {row}");
        let first = row.split('|').nth(1).unwrap_or_default();
        for name in first.split('`').skip(1).step_by(2) {
            documented.insert(name.to_owned());
        }
    }
    let all: Vec<&String> = agent_served.iter().chain(&updater_served).collect();
    let undocumented: Vec<&&String> = all
        .iter()
        .filter(|c| !documented.iter().any(|d| is_metric(d, c)))
        .collect();
    let unserved: Vec<&String> = documented
        .iter()
        .filter(|d| !all.iter().any(|c| is_metric(d, c)))
        .collect();
    assert!(
        undocumented.is_empty() && unserved.is_empty(),
        "docs/observability.md's metrics table lacks {undocumented:?} and lists {unserved:?}, \
         which no program registers"
    );

    let install = std::fs::read_to_string(Path::new(REPO).join("docs/install.md")).unwrap();
    for k in [
        "packaging/kubernetes/monitoring/agent",
        "packaging/kubernetes/monitoring/updater",
    ] {
        assert!(
            install.contains(&format!("kubectl apply -k {k}")),
            "docs/install.md does not name {k}"
        );
    }
}
