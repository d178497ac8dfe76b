//! kubeadm-standin: a TEST STAND-IN for `kubeadm upgrade node` on a control-plane node, built
//! so the tests have `env!("CARGO_BIN_EXE_kubeadm-standin")` to put into a sandbox node as its
//! `/usr/bin/kubeadm`. Not shipped, not kubeadm.
//!
//! What it does is what kubeadm's `upgrade node` does to a control-plane node's static pod
//! manifests, and only that: it reads the cluster's `ClusterConfiguration` and writes
//! `/etc/kubernetes/manifests/{kube-apiserver,kube-controller-manager,kube-scheduler,etcd}.yaml`
//! from it — each component's command line (kubeadm's own flags, then `extraArgs` by name,
//! sorted), `extraVolumes` as hostPath volumes and mounts, `extraEnvs` as the container's
//! environment, the image `<imageRepository>/<component>:<kubernetesVersion>` (etcd:
//! `etcd.local.imageTag`) — rewriting only the manifests whose content changes, as kubeadm
//! compares the new manifest with the running one and skips a component whose manifest is
//! equal. No etcd manifest with `etcd.external`. The API server's advertise endpoint is the
//! one the current manifest's `kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint`
//! annotation names, as kubeadm takes it from the running API server.
//!
//! STAND-IN differences, on purpose: the real kubeadm reads the cluster's
//! `kube-system/kubeadm-config` ConfigMap (which KubeadmControlPlane moves before it updates
//! any Machine); this one reads the file [`CONFIG`] in the node's root, which a test writes
//! as KubeadmControlPlane would move the ConfigMap (JSON, the ConfigMap's
//! `ClusterConfiguration` in the KubeadmConfig v1beta2 form). It does not wait for the static
//! pods (the agent's `controlPlane` gate proves them), renew certificates, or touch the
//! kubelet's configuration. When [`FAIL`] exists it fails after writing the manifests, as a
//! kubeadm whose new static pod never came up does. Each run appends a line to [`LOG`].
//!
//! The node's root is `$INPLACE_NODE_ROOT` (the agent sets it when it runs the node's program
//! without chroot), else the working directory.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::{Map, Value, json};

/// Where the test puts the cluster's ClusterConfiguration (the STAND-IN for the ConfigMap).
const CONFIG: &str = "etc/kubernetes/kubeadm-standin/kubeadm-config.json";
/// When this file exists, `upgrade node` fails after writing the manifests.
const FAIL: &str = "etc/kubernetes/kubeadm-standin-fail";
/// One line per run: what was rewritten and what was left.
const LOG: &str = "var/log/kubeadm-standin.log";
const MANIFESTS: &str = "etc/kubernetes/manifests";
const ADVERTISE: &str = "kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = std::env::var_os("INPLACE_NODE_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::current_dir().ok())
        .unwrap_or_else(|| PathBuf::from("/"));
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match words.as_slice() {
        ["upgrade", "node", ..] => upgrade_node(&root),
        ["version", "-o", "short"] => config(&root).map(|c| {
            println!("{}", str_at(&c, &["kubernetesVersion"]).unwrap_or("v0.0.0"));
        }),
        _ => Err(format!(
            "stand-in kubeadm: unsupported arguments: {}",
            args.join(" ")
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn config(root: &Path) -> Result<Value, String> {
    let path = root.join(CONFIG);
    let bytes = std::fs::read(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("parse {}: {e}", path.display()))
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(*k))?.as_str()
}

fn upgrade_node(root: &Path) -> Result<(), String> {
    let c = config(root)?;
    let dir = root.join(MANIFESTS);
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let endpoint = std::fs::read_to_string(dir.join("kube-apiserver.yaml"))
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                l.trim()
                    .strip_prefix(&format!("{ADVERTISE}:"))
                    .map(|v| v.trim().trim_matches('"').to_owned())
            })
        })
        .unwrap_or_else(|| "127.0.0.1:6443".to_owned());
    let external = c.pointer("/etcd/external").is_some_and(|e| !e.is_null());
    let mut components = vec![
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ];
    if !external {
        components.push("etcd");
    }
    let (mut rewritten, mut kept) = (Vec::new(), Vec::new());
    for component in components {
        let text = manifest(&c, component, &endpoint, external);
        let path = dir.join(format!("{component}.yaml"));
        if std::fs::read_to_string(&path).ok().as_deref() == Some(text.as_str()) {
            kept.push(component);
            continue;
        }
        std::fs::write(&path, text).map_err(|e| format!("write {}: {e}", path.display()))?;
        rewritten.push(component);
    }
    let line = format!(
        "kubeadm upgrade node: rewrote [{}], equal [{}]\n",
        rewritten.join(" "),
        kept.join(" ")
    );
    let log = root.join(LOG);
    if let Some(parent) = log.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    use std::io::Write as _;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .map_err(|e| format!("write {}: {e}", log.display()))?;
    print!("{line}");
    if root.join(FAIL).exists() {
        return Err(format!(
            "[upgrade/apply] FATAL: couldn't upgrade control plane: the static pods of [{}] did \
             not come up (stand-in failure: {FAIL} exists)",
            rewritten.join(" ")
        ));
    }
    Ok(())
}

/// `[{name, value}]` → (name, value) pairs.
fn pairs(v: Option<&Value>) -> Vec<(String, String)> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|e| {
                    Some((
                        e.get("name")?.as_str()?.to_owned(),
                        e.get("value")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// kubeadm's own flags of `component` (a few of them), overridden by `extraArgs` by name,
/// sorted by name as kubeadm sorts them.
fn command(c: &Value, component: &str, endpoint: &str, external: bool) -> Vec<String> {
    let (host, port) = endpoint.rsplit_once(':').unwrap_or((endpoint, "6443"));
    let base: Vec<(&str, String)> = match component {
        "kube-apiserver" => vec![
            ("advertise-address", host.to_owned()),
            ("authorization-mode", "Node,RBAC".into()),
            ("client-ca-file", "/etc/kubernetes/pki/ca.crt".into()),
            (
                "etcd-servers",
                if external {
                    c.pointer("/etcd/external/endpoints")
                        .and_then(Value::as_array)
                        .map(|e| {
                            e.iter()
                                .filter_map(Value::as_str)
                                .collect::<Vec<_>>()
                                .join(",")
                        })
                        .unwrap_or_default()
                } else {
                    "https://127.0.0.1:2379".into()
                },
            ),
            ("secure-port", port.to_owned()),
            ("tls-cert-file", "/etc/kubernetes/pki/apiserver.crt".into()),
            (
                "tls-private-key-file",
                "/etc/kubernetes/pki/apiserver.key".into(),
            ),
        ],
        "kube-controller-manager" => vec![
            (
                "kubeconfig",
                "/etc/kubernetes/controller-manager.conf".into(),
            ),
            ("leader-elect", "true".into()),
        ],
        "kube-scheduler" => vec![
            ("kubeconfig", "/etc/kubernetes/scheduler.conf".into()),
            ("leader-elect", "true".into()),
        ],
        _ => vec![
            ("data-dir", "/var/lib/etcd".into()),
            ("listen-metrics-urls", "http://127.0.0.1:2381".into()),
        ],
    };
    let mut args: std::collections::BTreeMap<String, String> =
        base.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    for (k, v) in pairs(section(c, component).get("extraArgs")) {
        args.insert(k, v);
    }
    let program = if component == "etcd" {
        "etcd"
    } else {
        component
    };
    std::iter::once(program.to_owned())
        .chain(args.into_iter().map(|(k, v)| format!("--{k}={v}")))
        .collect()
}

/// The ClusterConfiguration section of `component`.
fn section<'a>(c: &'a Value, component: &str) -> &'a Value {
    static EMPTY: Value = Value::Null;
    let pointer = match component {
        "kube-apiserver" => "/apiServer",
        "kube-controller-manager" => "/controllerManager",
        "kube-scheduler" => "/scheduler",
        _ => "/etcd/local",
    };
    c.pointer(pointer).unwrap_or(&EMPTY)
}

fn q(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// The static pod manifest of `component` (YAML; every scalar a JSON-quoted string).
fn manifest(c: &Value, component: &str, endpoint: &str, external: bool) -> String {
    let repository = str_at(c, &["imageRepository"]).unwrap_or("registry.k8s.io");
    let tag = if component == "etcd" {
        str_at(c, &["etcd", "local", "imageTag"])
            .unwrap_or("3.6.5-0")
            .to_owned()
    } else {
        str_at(c, &["kubernetesVersion"])
            .unwrap_or("v1.35.2")
            .to_owned()
    };
    let s = section(c, component);
    let mut out = String::from("apiVersion: v1\nkind: Pod\nmetadata:\n");
    if component == "kube-apiserver" {
        out.push_str(&format!(
            "  annotations:\n    {ADVERTISE}: {}\n",
            q(endpoint)
        ));
    }
    out.push_str(&format!(
        "  labels:\n    component: {}\n    tier: control-plane\n  name: {}\n  namespace: kube-system\n",
        q(component),
        q(component)
    ));
    out.push_str("spec:\n  containers:\n  - command:\n");
    for arg in command(c, component, endpoint, external) {
        out.push_str(&format!("    - {}\n", q(&arg)));
    }
    let envs = pairs(s.get("extraEnvs"));
    if !envs.is_empty() {
        out.push_str("    env:\n");
        for (k, v) in envs {
            out.push_str(&format!("    - name: {}\n      value: {}\n", q(&k), q(&v)));
        }
    }
    out.push_str(&format!(
        "    image: {}\n    name: {}\n",
        q(&format!("{repository}/{component}:{tag}")),
        q(component)
    ));
    let volumes: Vec<&Map<String, Value>> = s
        .get("extraVolumes")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_object).collect())
        .unwrap_or_default();
    let field =
        |v: &Map<String, Value>, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    if !volumes.is_empty() {
        out.push_str("    volumeMounts:\n");
        for v in &volumes {
            out.push_str(&format!(
                "    - mountPath: {}\n      name: {}\n      readOnly: {}\n",
                q(&field(v, "mountPath")),
                q(&field(v, "name")),
                v.get("readOnly").and_then(Value::as_bool).unwrap_or(false)
            ));
        }
    }
    out.push_str("  hostNetwork: true\n  priorityClassName: system-node-critical\n");
    if !volumes.is_empty() {
        out.push_str("  volumes:\n");
        for v in &volumes {
            let mut host = json!({"path": field(v, "hostPath")});
            if let Some(t) = v.get("pathType").and_then(Value::as_str) {
                host["type"] = json!(t);
            }
            out.push_str(&format!(
                "  - hostPath: {host}\n    name: {}\n",
                q(&field(v, "name"))
            ));
        }
    }
    out
}
