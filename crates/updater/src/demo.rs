//! `inplace-updater demo`: emulated Cluster API calls drive a real agent. It starts the
//! Kubernetes API stand-in (the paths the updater reads), a real `inplace-agent serve` on a
//! sandbox node tree (services off: nothing on this machine is touched) and the updater
//! itself, then plays CAPI's controllers: discovery, CanUpdateMachineSet, UpdateMachine
//! polled until done, the same desired state again, a dropped file, a version bump that
//! drains the node first (the stand-in is the workload cluster too: Pods evicted, one held
//! by a PodDisruptionBudget until it allows, DaemonSet and mirror Pods left, the node
//! uncordoned after), a control-plane Machine's version bump proved healthy by the
//! `controlPlane` gate (a worker asking to move ahead of it refused for version skew first),
//! and a call for a Machine that is not being updated.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::{Value, json};

use super::emulate::{CapiClient, Pki};
use super::hooks::{Hook, PENDING_HOOKS_ANNOTATION, UPDATE_IN_PROGRESS_ANNOTATION};
use super::standin::{ApiStandin, node, object_path, pdb, pod, secret};

/// `demo` flags.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Keep the sandbox directory (printed at the start) instead of removing it
    #[arg(long)]
    keep: bool,
    /// The inplace-agent binary (default: beside this one)
    #[arg(long)]
    agent: Option<PathBuf>,
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("inplace-updater demo: start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(demo(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inplace-updater demo: {}", super::errors::chain(&e));
            ExitCode::from(1)
        }
    }
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn step(title: &str) {
    println!("\n== {title}");
}

fn agent_binary(args: &DemoArgs) -> anyhow::Result<PathBuf> {
    if let Some(p) = &args.agent {
        return Ok(p.clone());
    }
    let me = std::env::current_exe().context("find this binary")?;
    let beside = me.with_file_name("inplace-agent");
    anyhow::ensure!(
        beside.is_file(),
        "no inplace-agent beside {} (pass --agent)",
        me.display()
    );
    Ok(beside)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `inplace-agent serve` for `node` on the sandbox `root`, listening on `ip:port`;
/// returns once it listens.
fn start_agent(
    bin: &Path,
    root: &Path,
    pki: &Pki,
    (node, ip): (&str, &str),
    port: u16,
) -> anyhow::Result<KillOnDrop> {
    // The agent is bound to the demo Machine's cluster (default/demo), as the updater
    // requires with agentCA: File.
    let server = pki.server_with_uris(
        node,
        &[node, ip],
        &[&inplace_api::pki::cluster_identity("default", "demo")],
    )?;
    let log = root.with_extension("agent.log");
    let out = std::fs::File::create(&log)?;
    let child = Command::new(bin)
        .args(["serve", "--config", "/dev/null", "--root"])
        .arg(root)
        .arg("--state-dir")
        .arg(root.with_extension("state"))
        .args(["--node-name", node, "--listen"])
        .arg(format!("{ip}:{port}"))
        .arg("--tls-cert")
        .arg(&server.cert)
        .arg("--tls-key")
        .arg(&server.key)
        .arg("--client-ca")
        .arg(pki.ca())
        .args([
            "--admin",
            inplace_api::pki::DEFAULT_UPDATER_IDENTITY,
            "--no-chroot",
        ])
        .env("INPLACE_AGENT_SERVICES", "off")
        .env("INPLACE_AGENT_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let child = KillOnDrop(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string(&log)
        .map(|l| !l.contains("listening on"))
        .unwrap_or(true)
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the agent did not start; its log is {}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child)
}

/// The node's "kubelet": a script reporting the version in `kubelet.version` beside it
/// (returned; written with `version`).
fn kubelet_standin(root: &Path, version: &str) -> anyhow::Result<PathBuf> {
    let kubelet = root.join("usr/local/bin/kubelet");
    std::fs::create_dir_all(kubelet.parent().unwrap_or(root))?;
    let version_file = root.join("usr/local/bin/kubelet.version");
    std::fs::write(&version_file, format!("{version}\n"))?;
    std::fs::write(
        &kubelet,
        format!(
            "#!/bin/sh\necho \"Kubernetes $(cat '{}')\"\n",
            version_file.display()
        ),
    )?;
    std::fs::set_permissions(
        &kubelet,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    Ok(version_file)
}

fn machine(version: &str, in_place: bool) -> Value {
    let mut annotations = serde_json::Map::new();
    if in_place {
        annotations.insert(UPDATE_IN_PROGRESS_ANNOTATION.into(), json!(""));
        annotations.insert(PENDING_HOOKS_ANNOTATION.into(), json!("UpdateMachine"));
    }
    json!({
        "kind": "Machine",
        "apiVersion": "cluster.x-k8s.io/v1beta2",
        "metadata": {"name": "demo-md-0-x7k2p", "namespace": "default", "annotations": annotations},
        "spec": {
            "clusterName": "demo",
            "bootstrap": {"configRef": {"kind": "KubeadmConfig", "name": "demo-md-0-x7k2p", "apiGroup": "bootstrap.cluster.x-k8s.io"}},
            "infrastructureRef": {"kind": "DevMachine", "name": "demo-md-0-x7k2p", "apiGroup": "infrastructure.cluster.x-k8s.io"},
            "version": version,
        },
        "status": {
            "nodeRef": {"name": "demo-node"},
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        },
    })
}

fn kubeadm_config(files: Value) -> Value {
    json!({
        "apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2",
        "kind": "KubeadmConfig",
        "metadata": {"name": "demo-md-0-x7k2p", "namespace": "default"},
        "spec": {
            "files": files,
            "joinConfiguration": {
                "discovery": {"bootstrapToken": {"token": "abcdef.0123456789abcdef"}},
                "nodeRegistration": {"kubeletExtraArgs": [{"name": "max-pods", "value": "150"}]},
            },
        },
    })
}

fn update_request(machine: &Value, config: &Value, port: u16) -> Vec<u8> {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(m) = v.as_object_mut() {
            m.remove("status");
        }
        v
    };
    serde_json::to_vec(&json!({
        "kind": "UpdateMachineRequest",
        "apiVersion": super::hooks::HOOKS_API_VERSION,
        "settings": {"agentPort": port.to_string()},
        "desired": {"machine": strip(machine), "bootstrapConfig": strip(config)},
    }))
    .unwrap_or_default()
}

/// UpdateMachine until done, waiting a tenth of `retryAfterSeconds` between calls.
async fn poll(capi: &mut CapiClient, body: &[u8]) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v = capi.call(Hook::UpdateMachine, body).await?.json();
        let retry = v["retryAfterSeconds"].as_i64().unwrap_or(0);
        println!(
            "   UpdateMachine → {} retryAfterSeconds={retry} {:?}",
            v["status"].as_str().unwrap_or("?"),
            v["message"].as_str().unwrap_or("")
        );
        if v["status"] != "Success" || retry == 0 {
            return Ok(v);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the update did not finish in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(100 * retry as u64)).await;
    }
}

fn show(root: &Path, path: &str) {
    let file = root.join(path.trim_start_matches('/'));
    match (std::fs::read_to_string(&file), std::fs::metadata(&file)) {
        // Secret contents are not printed.
        (Ok(text), Ok(meta)) if path.ends_with("-auth") => println!(
            "   {path}: {} bytes, mode {:04o}",
            text.len(),
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777
        ),
        (Ok(text), _) => println!("   {path}: {:?}", text.trim_end()),
        _ => println!("   {path}: (absent)"),
    }
}

async fn demo(args: &DemoArgs) -> anyhow::Result<()> {
    let agent_bin = agent_binary(args)?;
    // The updater's log lines that say why a change is not in place (the rest of its log
    // would drown the demo's story).
    {
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        let layer = tracing_subscriber::fmt::layer()
            .with_target(false)
            .without_time()
            .with_ansi(false)
            .with_writer(std::io::stdout)
            .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                m.fields().field("reason_class").is_some()
            }));
        let _ = tracing_subscriber::registry().with(layer).try_init();
    }
    let dir = tempfile::Builder::new()
        .prefix("inplace-updater-demo-")
        .tempdir()?;
    let root = dir.path().join("node");
    std::fs::create_dir_all(&root)?;
    inplace_demo_node::build_kubeadm_worker(&root)?;
    // The node's "kubelet" reports the version in kubelet.version beside it (the demo's node
    // has no package manager: the version is verified, not installed; the demo writes the
    // file where a package upgrade would replace the kubelet).
    let version_file = kubelet_standin(&root, "v1.35.2")?;
    println!("sandbox: {}", dir.path().display());

    let pki = Pki::new(&dir.path().join("pki"))?;
    let port = free_port()?;
    let _agent = start_agent(&agent_bin, &root, &pki, ("demo-node", "127.0.0.1"), port)?;
    let api = ApiStandin::start().await?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let serving = pki.server(
        "updater",
        &["inplace-updater.inplace-system.svc", "127.0.0.1"],
    )?;
    let client = pki.updater_client()?;
    let (updater, tls) = super::setup::build(
        &serving.cert,
        &serving.key,
        super::agent::paths(pki.ca(), client.cert.clone(), client.key.clone()),
        port,
        Some(&kubeconfig),
        vec![super::edge::extension_config::DEFAULT_NAME.to_owned()],
        // The stand-in serves the demo's workload cluster too, on loopback.
        crate::edge::kubeconfig::LocalServers::Allow,
    )
    .await?;
    // The operator registers the updater; its settings are every request's (a request whose
    // settings differ is refused).
    api.put(super::standin::extension_config(
        super::edge::extension_config::DEFAULT_NAME,
        serde_json::json!({"agentPort": port.to_string()}),
        serde_json::Value::Null,
    ));
    let server = super::server::Server::start(
        "127.0.0.1:0".parse()?,
        tls,
        updater,
        super::deadlines::ConnectionLimits::default(),
    )
    .await?;
    println!(
        "agent demo-node on 127.0.0.1:{port}, Kubernetes API stand-in on {}, updater on {}",
        api.addr, server.addr
    );
    let mut capi = CapiClient::new(server.addr, "inplace-updater.inplace-system.svc", &pki.ca())?;

    step("CAPI discovers the extension");
    let v = capi
        .call(
            Hook::Discovery,
            br#"{"kind":"DiscoveryRequest","apiVersion":"hooks.runtime.cluster.x-k8s.io/v1alpha1"}"#,
        )
        .await?
        .json();
    for h in v["handlers"].as_array().cloned().unwrap_or_default() {
        println!(
            "   {} for {} (failurePolicy {}, {} s)",
            h["name"].as_str().unwrap_or(""),
            h["requestHook"]["hook"].as_str().unwrap_or(""),
            h["failurePolicy"].as_str().unwrap_or(""),
            h["timeoutSeconds"]
        );
    }

    step(
        "the MachineDeployment controller asks CanUpdateMachineSet (new file content, version, kubelet flag)",
    );
    let files_v1 = json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=v1\n"}]);
    let files_v2 = json!([
        {"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=v2\n", "permissions": "0640"},
        {"path": "/etc/kubernetes/registry-auth", "contentFrom": {"secret": {"name": "registry", "key": "auth"}}, "permissions": "0600"},
    ]);
    let template = |name: &str, files: &Value, args: Value| {
        json!({"apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2", "kind": "KubeadmConfigTemplate",
               "metadata": {"name": name, "namespace": "default"},
               "spec": {"template": {"spec": {"files": files, "joinConfiguration": {"nodeRegistration": {"kubeletExtraArgs": args}}}}}})
    };
    let ms = |name: &str, version: &str, tpl: &str| {
        json!({"kind": "MachineSet", "apiVersion": "cluster.x-k8s.io/v1beta2",
               "metadata": {"name": name, "namespace": "default"},
               "spec": {"clusterName": "demo", "replicas": 1, "template": {"spec": {"clusterName": "demo", "version": version,
                   "bootstrap": {"configRef": {"kind": "KubeadmConfigTemplate", "name": tpl, "apiGroup": "bootstrap.cluster.x-k8s.io"}}}}}})
    };
    let request = json!({
        "kind": "CanUpdateMachineSetRequest", "apiVersion": super::hooks::HOOKS_API_VERSION,
        "settings": {"agentPort": port.to_string()},
        "current": {"machineSet": ms("demo-md-0-a", "v1.35.1", "demo-v1"), "bootstrapConfigTemplate": template("demo-v1", &files_v1, json!([]))},
        "desired": {"machineSet": ms("demo-md-0-b", "v1.35.2", "demo-v2"), "bootstrapConfigTemplate": template("demo-v2", &files_v2, json!([{"name": "max-pods", "value": "150"}]))},
    });
    // The current MachineSet exists (the updater reads it, and asks its Machines' agents).
    api.put(request["current"]["machineSet"].clone());
    let v = capi
        .call(Hook::CanUpdateMachineSet, &serde_json::to_vec(&request)?)
        .await?
        .json();
    if v["status"] != "Success" || v.get("machineSetPatch").is_none() {
        anyhow::bail!(
            "CanUpdateMachineSet did not cover the change: {}",
            v["message"].as_str().unwrap_or_default()
        );
    }
    for key in ["machineSetPatch", "bootstrapConfigTemplatePatch"] {
        if let Some(p) = v.get(key) {
            let ops = super::hooks::Patch {
                patch_type: "JSONPatch",
                patch: p["patch"].as_str().unwrap_or("").to_owned(),
            }
            .operations();
            println!("   {key}:");
            for op in ops {
                println!(
                    "     {} {}",
                    op["op"].as_str().unwrap_or(""),
                    op["path"].as_str().unwrap_or("")
                );
            }
        }
    }
    println!("   (everything covered: CAPI updates the Machine in place instead of replacing it)");

    step("the Machine controller calls UpdateMachine until done");
    api.put(secret("default", "registry", &[("auth", b"user:s3cr3t")]));
    let live = machine("v1.35.2", true);
    let config = kubeadm_config(files_v2.clone());
    api.put(live.clone());
    api.put(config.clone());
    show(&root, "/etc/kubernetes/inplace-demo.conf");
    let body = update_request(&live, &config, port);
    poll(&mut capi, &body).await?;
    show(&root, "/etc/kubernetes/inplace-demo.conf");
    show(&root, "/etc/kubernetes/registry-auth");
    let flags =
        std::fs::read_to_string(root.join("var/lib/kubelet/kubeadm-flags.env")).unwrap_or_default();
    println!("   kubeadm-flags.env: {}", flags.trim_end());

    step(
        "CAPI calls again with the same desired state (a controller restart): done at once, nothing runs",
    );
    poll(&mut capi, &body).await?;

    step("a file is dropped from files[]: the agent removes it (managed set)");
    let fewer = kubeadm_config(json!([files_v2[0].clone()]));
    api.put(fewer.clone());
    poll(&mut capi, &update_request(&live, &fewer, port)).await?;
    show(&root, "/etc/kubernetes/registry-auth");

    step("a version bump (v1.35.3): the updater cordons and drains the node first, as CAPI drains");
    drain_demo(&api, &mut capi, port, &version_file).await?;

    step(
        "a worker may not move ahead of its control plane; a control-plane Machine moves v1.35.3 → v1.36.0 in place, proved healthy by the controlPlane gate",
    );
    control_plane_demo(&api, &mut capi, port, (&agent_bin, &pki), dir.path()).await?;

    step(
        "a change that cannot go in place (preKubeadmCommands): CAPI rolls out, and the updater says why",
    );
    why_not_demo(&api, &mut capi, port, &request).await?;

    step("someone calls UpdateMachine for a Machine CAPI is not updating: refused, nothing starts");
    let idle = machine("v1.35.3", false);
    if let Some(path) = object_path(&idle) {
        api.edit(&path, |m| m["metadata"]["annotations"] = json!({}));
    }
    let v = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&idle, &kubeadm_config(json!([])), port),
        )
        .await?
        .json();
    println!(
        "   UpdateMachine → {} {:?}",
        v["status"].as_str().unwrap_or("?"),
        v["message"].as_str().unwrap_or("")
    );

    server.shutdown().await;
    if args.keep {
        let kept = dir.keep();
        println!("\nsandbox kept: {}", kept.display());
    }
    println!(
        "\ndone: docs/updater.md explains what the updater covers in place and how to install it"
    );
    Ok(())
}

/// The not-in-place step: the MachineDeployment owns the current MachineSet; a new
/// template adds a preKubeadmCommands entry, which runs only when a node is bootstrapped.
/// The answer's reason is in the updater's log line and in an Event on the
/// MachineDeployment (docs/updater.md, "Why was my Machine replaced?").
async fn why_not_demo(
    api: &ApiStandin,
    capi: &mut CapiClient,
    port: u16,
    covered: &Value,
) -> anyhow::Result<()> {
    let uid = "d3a0d3a0-0000-4000-8000-000000000001";
    api.put(
        json!({"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
        "metadata": {"name": "demo-md-0", "namespace": "default", "uid": uid},
        "spec": {"clusterName": "demo", "replicas": 1,
                 "template": covered["current"]["machineSet"]["spec"]["template"].clone()}}),
    );
    let mut set = covered["current"]["machineSet"].clone();
    set["metadata"]["ownerReferences"] = json!([{"apiVersion": "cluster.x-k8s.io/v1beta2",
        "kind": "MachineDeployment", "name": "demo-md-0", "uid": uid, "controller": true}]);
    api.put(set);
    let mut request = covered.clone();
    request["settings"] = json!({"agentPort": port.to_string()});
    request["desired"]["machineSet"]["spec"]["template"]["spec"]["version"] =
        covered["current"]["machineSet"]["spec"]["template"]["spec"]["version"].clone();
    request["desired"]["bootstrapConfigTemplate"] =
        covered["current"]["bootstrapConfigTemplate"].clone();
    request["desired"]["bootstrapConfigTemplate"]["spec"]["template"]["spec"]["preKubeadmCommands"] =
        json!(["echo hello from a new node"]);
    let v = capi
        .call(Hook::CanUpdateMachineSet, &serde_json::to_vec(&request)?)
        .await?
        .json();
    println!(
        "   CanUpdateMachineSet → {} (no bootstrapConfigTemplatePatch: CAPI rolls out)",
        v["status"].as_str().unwrap_or("?")
    );
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let events = api.events();
        if let Some(e) = events
            .iter()
            .find(|e| e["involvedObject"]["kind"] == "MachineDeployment")
        {
            println!(
                "   Event on MachineDeployment default/{}: {} {} (count {}): {}",
                e["involvedObject"]["name"].as_str().unwrap_or(""),
                e["type"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or(""),
                e["count"],
                e["message"].as_str().unwrap_or("")
            );
            return Ok(());
        }
        if Instant::now() > until {
            anyhow::bail!("no Event on the MachineDeployment within 5 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The drain step: the stand-in serves the workload cluster too (the `demo-kubeconfig`
/// Secret points back at it).
async fn drain_demo(
    api: &ApiStandin,
    capi: &mut CapiClient,
    port: u16,
    version_file: &Path,
) -> anyhow::Result<()> {
    api.put(api.workload_secret("default", "demo"));
    api.put(node("demo-node", "v1.35.2"));
    let rs = Some(("ReplicaSet", "web-5f7c"));
    for name in ["web-0", "web-1"] {
        api.put(pod("default", name, "demo-node", rs, json!({"app": "web"})));
    }
    api.put(pod(
        "kube-system",
        "kube-proxy-demo",
        "demo-node",
        Some(("DaemonSet", "kube-proxy")),
        json!({}),
    ));
    api.put(json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "kube-proxy", "namespace": "kube-system"}, "spec": {}}));
    let mut mirror = pod(
        "kube-system",
        "etcd-demo-node",
        "demo-node",
        None,
        json!({}),
    );
    mirror["metadata"]["annotations"] = json!({"kubernetes.io/config.mirror": "demo"});
    api.put(mirror);
    api.put(pdb("default", "web", json!({"app": "web"}), 1));
    let pods = |api: &ApiStandin| -> Vec<String> {
        [
            ("default", "web-0"),
            ("default", "web-1"),
            ("kube-system", "kube-proxy-demo"),
            ("kube-system", "etcd-demo-node"),
        ]
        .iter()
        .filter(|(ns, n)| {
            api.get(&format!("/api/v1/namespaces/{ns}/pods/{n}"))
                .is_some()
        })
        .map(|(ns, n)| format!("{ns}/{n}"))
        .collect()
    };
    let cordon = |api: &ApiStandin| {
        api.get("/api/v1/nodes/demo-node")
            .and_then(|n| n["spec"]["unschedulable"].as_bool())
            .unwrap_or(false)
    };
    println!("   pods on demo-node: {}", pods(api).join(", "));
    println!("   PodDisruptionBudget default/web (app=web) allows 1 disruption");
    let live = machine("v1.35.3", true);
    let config = kubeadm_config(
        json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=v3\n"}]),
    );
    api.put(live.clone());
    api.put(config.clone());
    let body = update_request(&live, &config, port);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut blocked = 0;
    loop {
        let v = capi.call(Hook::UpdateMachine, &body).await?.json();
        let message = v["message"].as_str().unwrap_or("").to_owned();
        println!(
            "   UpdateMachine → {} retryAfterSeconds={} {message:?} (cordoned: {})",
            v["status"].as_str().unwrap_or("?"),
            v["retryAfterSeconds"],
            cordon(api)
        );
        anyhow::ensure!(v["status"] == "Success", "the drain failed: {message}");
        if !message.starts_with("draining") {
            break;
        }
        if message.contains("blocked by PodDisruptionBudget") {
            blocked += 1;
            if blocked == 2 {
                println!("   (web-0 is back up elsewhere: the budget allows one more disruption)");
                api.edit(
                    "/apis/policy/v1/namespaces/default/poddisruptionbudgets/web",
                    |b| b["status"]["disruptionsAllowed"] = json!(1),
                );
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the drain did not end in 60 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "   drained; pods left on demo-node: {}",
        pods(api).join(", ")
    );
    println!("   (the plan moves the kubelet to v1.35.3: the demo writes the new version)");
    std::fs::write(version_file, "v1.35.3\n")?;
    poll(capi, &body).await?;
    println!("   cordoned after the plan succeeded: {}", cordon(api));
    Ok(())
}

/// The control-plane step. A second sandbox node, `demo-cp` (its agent on 127.0.0.2), is a
/// control-plane Machine of the same cluster, labelled and owned as KubeadmControlPlane
/// makes them. Its local API server is the stand-in: the node's cluster CA is the
/// stand-in's, the kube-apiserver manifest advertises the stand-in's address, the stand-in
/// answers `/readyz` and holds the node's mirror Pods (Ready, each the mirror of the pod
/// the kubelet runs). Etcd is external in this cluster, so no etcd member is checked. First
/// the worker asks to move ahead of the control plane (refused before any node work:
/// version skew); then the control-plane node moves, its plan rewriting a static pod
/// manifest (kube-vip's) and ending with the `controlPlane` gate.
async fn control_plane_demo(
    api: &ApiStandin,
    capi: &mut CapiClient,
    port: u16,
    (agent_bin, pki): (&Path, &Pki),
    dir: &Path,
) -> anyhow::Result<()> {
    const NODE: &str = "demo-cp";
    const IP: &str = "127.0.0.2";
    const NAME: &str = "demo-control-plane-4bz9k";
    const COMPONENTS: [&str; 3] = [
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ];
    let root = dir.join("cp-node");
    std::fs::create_dir_all(&root)?;
    inplace_demo_node::build_kubeadm_worker(&root)?;
    let version_file = kubelet_standin(&root, "v1.35.3")?;
    let kubernetes = root.join("etc/kubernetes");
    std::fs::create_dir_all(kubernetes.join("pki"))?;
    std::fs::create_dir_all(kubernetes.join("manifests"))?;
    std::fs::write(kubernetes.join("pki/ca.crt"), api.ca_pem())?;
    // The kubelet's credential, which the gate reads the node's mirror Pods with (the
    // stand-in does not ask for it; a real API server's Node authorizer does).
    let kubelet_cert = pki.server(&format!("kubelet-{NODE}"), &[NODE])?;
    let b64 = |path: &Path| -> anyhow::Result<String> {
        use base64::Engine as _;
        Ok(base64::engine::general_purpose::STANDARD.encode(std::fs::read(path)?))
    };
    std::fs::write(
        kubernetes.join("kubelet.conf"),
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: demo\n  cluster:\n    \
             certificate-authority-data: {}\n    server: https://{}\ncontexts:\n- name: demo\n  \
             context:\n    cluster: demo\n    user: kubelet\ncurrent-context: demo\nusers:\n\
             - name: kubelet\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&kubernetes.join("pki/ca.crt"))?,
            api.addr,
            b64(&kubelet_cert.cert)?,
            b64(&kubelet_cert.key)?,
        ),
    )?;
    for c in COMPONENTS {
        let advertise = if c == "kube-apiserver" {
            format!(
                "  annotations:\n    kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint: \"{}\"\n",
                api.addr
            )
        } else {
            String::new()
        };
        std::fs::write(
            kubernetes.join(format!("manifests/{c}.yaml")),
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {c}\n  namespace: kube-system\n{advertise}\
                 spec:\n  containers:\n  - name: {c}\n    image: registry.k8s.io/{c}:v1.36.0\n"
            ),
        )?;
        let mut mirror = pod("kube-system", &format!("{c}-{NODE}"), NODE, None, json!({}));
        let hash = format!("demo-{c}");
        mirror["metadata"]["annotations"] =
            json!({"kubernetes.io/config.hash": hash, "kubernetes.io/config.mirror": hash});
        mirror["status"]["conditions"] = json!([{"type": "Ready", "status": "True"}]);
        api.put(mirror);
    }
    let kube_vip = |tag: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: kube-vip\n  namespace: kube-system\n\
             spec:\n  containers:\n  - name: kube-vip\n    image: ghcr.io/kube-vip/kube-vip:{tag}\n"
        )
    };
    let vip = "/etc/kubernetes/manifests/kube-vip.yaml";
    std::fs::write(root.join(vip.trim_start_matches('/')), kube_vip("v1.0.0"))?;
    let _agent = start_agent(agent_bin, &root, pki, (NODE, IP), port)?;
    api.put(node(NODE, "v1.35.3"));

    let cp_machine = |version: &str, running: &str, in_place: bool| {
        let mut m = machine(version, in_place);
        m["metadata"]["name"] = json!(NAME);
        m["metadata"]["labels"] = json!({"cluster.x-k8s.io/cluster-name": "demo",
            "cluster.x-k8s.io/control-plane": "", "cluster.x-k8s.io/control-plane-name": "demo-control-plane"});
        m["metadata"]["ownerReferences"] = json!([{"apiVersion": "controlplane.cluster.x-k8s.io/v1beta2",
            "kind": "KubeadmControlPlane", "name": "demo-control-plane", "uid": "kcp-demo", "controller": true}]);
        m["spec"]["bootstrap"]["configRef"]["name"] = json!(NAME);
        m["spec"]["infrastructureRef"]["name"] = json!(NAME);
        m["status"] = json!({"nodeRef": {"name": NODE}, "addresses": [{"type": "InternalIP", "address": IP}],
            "nodeInfo": {"kubeletVersion": running}});
        m
    };
    api.put(cp_machine("v1.35.3", "v1.35.3", false));
    println!(
        "   control-plane Machine default/{NAME} on node {NODE} runs v1.35.3 (its API server: the stand-in; etcd external)"
    );

    // The worker first: refused before any node work, the control plane is behind.
    let ahead = machine("v1.36.0", true);
    let worker_config = kubeadm_config(
        json!([{"path": "/etc/kubernetes/inplace-demo.conf", "content": "mode=v3\n"}]),
    );
    api.put(ahead.clone());
    let v = capi
        .call(
            Hook::UpdateMachine,
            &update_request(&ahead, &worker_config, port),
        )
        .await?
        .json();
    println!(
        "   worker first: UpdateMachine → {} {:?}",
        v["status"].as_str().unwrap_or("?"),
        v["message"].as_str().unwrap_or("")
    );
    anyhow::ensure!(
        v["status"] == "Failure",
        "the worker was not refused ahead of its control plane"
    );
    api.put(machine("v1.35.3", true));

    // KubeadmControlPlane's trigger: the desired KubeadmConfig and Machine, UpdateMachine
    // pending; the Machine controller calls until done.
    let config = json!({
        "apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2", "kind": "KubeadmConfig",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "clusterConfiguration": {"etcd": {"external": {"endpoints": ["https://10.0.0.5:2379"]}}},
            "joinConfiguration": {"controlPlane": {}, "nodeRegistration": {"kubeletExtraArgs": [{"name": "max-pods", "value": "150"}]}},
            "files": [{"path": vip, "content": kube_vip("v1.1.0"), "permissions": "0600"}],
        },
    });
    let live = cp_machine("v1.36.0", "v1.35.3", true);
    api.put(config.clone());
    api.put(live.clone());
    show(&root, vip);
    let body = update_request(&live, &config, port);
    let before = api.requests().len();
    let v = capi.call(Hook::UpdateMachine, &body).await?.json();
    println!(
        "   UpdateMachine → {} retryAfterSeconds={} {:?}",
        v["status"].as_str().unwrap_or("?"),
        v["retryAfterSeconds"],
        v["message"].as_str().unwrap_or("")
    );
    println!("   (the plan moves the kubelet to v1.36.0: the demo writes the new version)");
    std::fs::write(&version_file, "v1.36.0\n")?;
    let v = poll(capi, &body).await?;
    anyhow::ensure!(
        v["status"] == "Success",
        "the control-plane update failed: {}",
        v["message"].as_str().unwrap_or_default()
    );
    show(&root, vip);
    let mut read: Vec<String> = api.requests()[before..]
        .iter()
        .filter(|(m, p)| {
            m == "GET" && (p == "/readyz" || p.starts_with("/api/v1/namespaces/kube-system/pods/"))
        })
        .map(|(_, p)| p.clone())
        .collect();
    read.dedup();
    read.sort();
    read.dedup();
    println!(
        "   the controlPlane gate read, before done: GET {}",
        read.join(", GET ")
    );
    api.put(cp_machine("v1.36.0", "v1.36.0", false));
    Ok(())
}
