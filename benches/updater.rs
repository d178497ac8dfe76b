//! The updater under CAPI's load: N agents (separate `inplace-agent serve` processes on
//! sandbox trees, each on its own loopback address, all on one port), the Kubernetes API
//! stand-in in this process, the real `inplace-updater serve` binary, and C concurrent
//! callers that call UpdateMachine for the N Machines exactly as CAPI's Machine controller
//! does (HTTPS, HTTP/1.1, no Content-Type): first polling each Machine every
//! `retryAfterSeconds` until done (CAPI's hook cache), then, with new plans, in a closed loop
//! without waiting (the harshest polling: a throughput figure).
//!
//! ```text
//! updater [--agents N] [--callers C] [--slow M] [--start-concurrency S] [--json FILE]
//! updater --done [--json FILE]
//! ```
//!
//! `--done` measures only "done when the node is done" (docs/decisions/0018): Machines whose
//! plan lasts 3 s, 30 s and 3 min (the kubelet stand-in keeps the version gate waiting that
//! long after the plan wrote the Machine's file), called as CAPI calls (each Machine by a
//! worker of its own, again `retryAfterSeconds` after an in-progress answer), all rows at
//! once; per plan the delay from the node finishing it (the agent's `finishedAtMs`) to the
//! done answer, and the calls per Machine per second. Run it against another
//! `INPLACE_UPDATER_BIN` for the figures of another version.
//!
//! Figures: for each Machine polled as CAPI does, how long after its first UpdateMachine
//! call it was answered done (a plan of one file, and, on M of the Machines, a plan whose
//! version gate waits 30 s); UpdateMachine latency p50/p99/max polled as CAPI does, in the closed loop while
//! the fleet converges and once it has (the plan is known: GetPlanStatus only); time until
//! all N converged; the updater's RSS
//! idle (before any call, after 3 s), after the load, and its peak (VmHWM). Baseline in the
//! same run: the same callers calling the agents' GetPlanStatus directly over mutual TLS
//! (what one UpdateMachine costs at least), so the updater's own overhead is a ratio.

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::tls::{ClientTlsPaths, client_config, connect};
use inplace_updater::emulate::{CapiClient, Pki};
use inplace_updater::hooks::{Hook, PENDING_HOOKS_ANNOTATION, UPDATE_IN_PROGRESS_ANNOTATION};
use inplace_updater::standin::ApiStandin;
use serde_json::{Value, json};

use inplace_api::pki::DEFAULT_UPDATER_IDENTITY;
use support::daemon::{Daemon, Ready, Starting, raise_nofile, serve_command};
use support::memory::Memory;

type Error = Box<dyn std::error::Error + Send + Sync>;

const HOST: &str = "inplace-updater.inplace-system.svc";

/// How long a slow plan's version gate waits (the kubelet stand-in's script).
const SLOW_PLAN_SECONDS: u64 = 30;

fn bin(name: &str, built: &str) -> PathBuf {
    let var = format!(
        "INPLACE_{}_BIN",
        name.to_ascii_uppercase().replace('-', "_")
    );
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(built))
}

struct Options {
    agents: usize,
    callers: usize,
    slow: usize,
    start_concurrency: usize,
    json: Option<PathBuf>,
    done: bool,
}

fn options() -> Result<Options, Error> {
    let mut o = Options {
        agents: 500,
        callers: 100,
        slow: 100,
        start_concurrency: 16,
        json: None,
        done: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--bench" => {}
            "--agents" => o.agents = value()?.parse()?,
            "--callers" => o.callers = value()?.parse()?,
            "--slow" => o.slow = value()?.parse()?,
            "--start-concurrency" => o.start_concurrency = value()?.parse()?,
            "--json" => o.json = Some(value()?.into()),
            "--done" => o.done = true,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    Ok(o)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

fn ip(i: usize) -> String {
    format!("127.77.{}.{}", i / 200, i % 200 + 2)
}

fn node(i: usize) -> String {
    format!("node-{i:04}")
}

/// Spawns agent `i` on its own sandbox tree (a kubelet that reports v1.35.2) on its own
/// loopback address and `port`; it is ready when its `READY=1` arrives.
fn spawn_agent(dir: &Path, pki: &Pki, i: usize, port: u16) -> Result<Starting, Error> {
    let home = dir.join(node(i));
    let root = home.join("root");
    inplace_demo_node::build_kubeadm_worker(&root)?;
    let kubelet = root.join("usr/local/bin/kubelet");
    std::fs::create_dir_all(kubelet.parent().ok_or("no parent")?)?;
    // A kubelet at v1.35.2, except for 30 s after a plan wrote "slow" into the Machine's
    // file (N s after "slow=N"): then it still says v1.35.1, and the plan's version gate
    // waits (a 30 s plan, an N s plan).
    let file = root.join("etc/kubernetes/inplace-demo.conf");
    std::fs::write(
        &kubelet,
        format!(
            "#!/bin/sh\nf='{}'\ns=$(sed -n 's/^slow=\\([0-9]*\\).*/\\1/p' \"$f\" 2>/dev/null)\n\
             if [ -z \"$s\" ] && grep -q slow \"$f\" 2>/dev/null; then s={SLOW_PLAN_SECONDS}; fi\n\
             if [ -n \"$s\" ] && [ $(( $(date +%s) - $(stat -c %Y \"$f\") )) -lt \"$s\" ]; then\n  \
             echo 'Kubernetes v1.35.1'\nelse\n  echo 'Kubernetes v1.35.2'\nfi\n",
            file.display()
        ),
    )?;
    std::fs::set_permissions(
        &kubelet,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    // Bound to the Machines' cluster (default/bench), as the updater requires with
    // agentCA: File.
    let cert = pki.server_with_uris(
        &node(i),
        &[&node(i), &ip(i)],
        &[&inplace_api::pki::cluster_identity("default", "bench")],
    )?;
    let mut cmd = serve_command(
        &bin("agent", support::programs::AGENT),
        &root,
        &node(i),
        &cert.cert,
        &cert.key,
        &pki.ca(),
    );
    cmd.args(["--no-chroot", "--services", "off"])
        .args(["--reader", DEFAULT_UPDATER_IDENTITY])
        .arg("--listen")
        .arg(format!("{}:{port}", ip(i)))
        .arg("--state-dir")
        .arg(home.join("state"))
        .env("INPLACE_AGENT_LOG", "warn");
    Ok(Daemon::spawn(cmd, Ready::Notify(home.join("notify.sock")))?)
}

fn machine(i: usize) -> Value {
    json!({
        "kind": "Machine", "apiVersion": "cluster.x-k8s.io/v1beta2",
        "metadata": {"name": format!("md-0-{i:04}"), "namespace": "default",
            "annotations": {UPDATE_IN_PROGRESS_ANNOTATION: "", PENDING_HOOKS_ANNOTATION: "UpdateMachine"}},
        "spec": {"clusterName": "bench", "version": "v1.35.2",
            "bootstrap": {"configRef": {"kind": "KubeadmConfig", "name": format!("md-0-{i:04}"), "apiGroup": "bootstrap.cluster.x-k8s.io"}},
            "infrastructureRef": {"kind": "DevMachine", "name": format!("md-0-{i:04}"), "apiGroup": "infrastructure.cluster.x-k8s.io"}},
        "status": {"nodeRef": {"name": node(i)}, "addresses": [{"type": "InternalIP", "address": ip(i)}]},
    })
}

fn config(i: usize) -> Value {
    json!({
        "apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2", "kind": "KubeadmConfig",
        "metadata": {"name": format!("md-0-{i:04}"), "namespace": "default"},
        "spec": {
            "files": [{"path": "/etc/kubernetes/inplace-demo.conf", "owner": "root:root", "permissions": "0644", "content": "mode=v2\n"}],
            "joinConfiguration": {
                "discovery": {"bootstrapToken": {"token": "abcdef.0123456789abcdef"}},
                "nodeRegistration": {"kubeletExtraArgs": [{"name": "max-pods", "value": "150"}]}},
        },
    })
}

/// The ExtensionConfig's settings, which every request carries.
fn request_settings(port: u16) -> Value {
    // No workload cluster here: the drain (one CheckPlan more per new plan) is off.
    // Gates wait up to 10 minutes (`--done` has a 3 min plan).
    json!({"agentPort": port.to_string(), "drain": "Never", "gateTimeoutSeconds": "600"})
}

fn request(i: usize, port: u16) -> Vec<u8> {
    let mut m = machine(i);
    if let Some(o) = m.as_object_mut() {
        o.remove("status");
    }
    serde_json::to_vec(&json!({
        "kind": "UpdateMachineRequest", "apiVersion": "hooks.runtime.cluster.x-k8s.io/v1alpha1",
        "settings": request_settings(port),
        "desired": {"machine": m, "bootstrapConfig": config(i)},
    }))
    .unwrap_or_default()
}

/// C callers, Machine i polled by caller i % C, until every Machine answered done; the
/// latency of every call (ms), split in progress / done, and the time to converge.
async fn converge(
    addr: SocketAddr,
    ca: &Path,
    bodies: Arc<Vec<Vec<u8>>>,
    callers: usize,
) -> Result<(Vec<f64>, Vec<f64>, Duration), Error> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..callers {
        let (bodies, ca) = (bodies.clone(), ca.to_path_buf());
        tasks.push(tokio::spawn(async move {
            let mut client = CapiClient::new(addr, HOST, &ca).map_err(|e| e.to_string())?;
            let mut pending: Vec<usize> = (c..bodies.len()).step_by(callers).collect();
            let (mut progress, mut done) = (Vec::new(), Vec::new());
            let deadline = Instant::now() + Duration::from_secs(600);
            while !pending.is_empty() {
                let mut still = Vec::new();
                for i in pending {
                    let t = Instant::now();
                    let r = client
                        .call(Hook::UpdateMachine, &bodies[i])
                        .await
                        .map_err(|e| e.to_string())?;
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    let v = r.json();
                    if v["status"] != "Success" {
                        return Err(format!("machine {i}: {v}"));
                    }
                    if v["retryAfterSeconds"] == 0 {
                        done.push(ms);
                    } else {
                        progress.push(ms);
                        still.push(i);
                    }
                }
                pending = still;
                if Instant::now() > deadline {
                    return Err("not converged in 600 s".to_string());
                }
            }
            Ok::<_, String>((progress, done))
        }));
    }
    let (mut progress, mut done) = (Vec::new(), Vec::new());
    for t in tasks {
        let (p, d) = t.await??;
        progress.extend(p);
        done.extend(d);
    }
    let took = started.elapsed();
    Ok((progress, done, took))
}

/// As CAPI's Machine controller polls: C callers (its reconcile workers), Machine i with
/// caller i % C, each Machine called again `retryAfterSeconds` after an in-progress answer
/// (CAPI's hook cache) until done; every call timed, and the time until all converged.
async fn converge_as_capi(
    addr: SocketAddr,
    ca: &Path,
    bodies: Arc<Vec<Vec<u8>>>,
    callers: usize,
) -> Result<CapiLike, Error> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..callers {
        let (bodies, ca) = (bodies.clone(), ca.to_path_buf());
        tasks.push(tokio::spawn(async move {
            let mut client = CapiClient::new(addr, HOST, &ca).map_err(|e| e.to_string())?;
            // (next call at, machine)
            let mut queue: Vec<(Instant, usize)> = (c..bodies.len())
                .step_by(callers)
                .map(|i| (Instant::now(), i))
                .collect();
            let (mut out, mut firsts, mut later) = (Vec::new(), Vec::new(), Vec::new());
            let mut first_call = std::collections::HashMap::new();
            let mut done_after = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(600);
            while !queue.is_empty() {
                queue.sort_by_key(|(at, _)| *at);
                let (at, i) = queue.remove(0);
                tokio::time::sleep_until(at.into()).await;
                let t = Instant::now();
                let r = client
                    .call(Hook::UpdateMachine, &bodies[i])
                    .await
                    .map_err(|e| e.to_string())?;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                out.push(ms);
                if let std::collections::hash_map::Entry::Vacant(e) = first_call.entry(i) {
                    e.insert(t);
                    firsts.push(ms);
                } else {
                    later.push(ms);
                }
                let v = r.json();
                if v["status"] != "Success" {
                    return Err(format!("machine {i}: {v}"));
                }
                let retry = v["retryAfterSeconds"].as_u64().unwrap_or(0);
                if retry > 0 {
                    queue.push((Instant::now() + Duration::from_secs(retry), i));
                } else {
                    done_after.push(first_call[&i].elapsed().as_secs_f64());
                }
                if Instant::now() > deadline {
                    return Err("not converged in 600 s".to_string());
                }
            }
            Ok::<_, String>((out, firsts, later, done_after))
        }));
    }
    let mut got = CapiLike::default();
    for t in tasks {
        let (a, f, l, d) = t.await??;
        got.all_ms.extend(a);
        got.first_ms.extend(f);
        got.later_ms.extend(l);
        got.done_after_s.extend(d);
    }
    got.took = started.elapsed();
    Ok(got)
}

/// What a CAPI-like run measured.
#[derive(Default)]
struct CapiLike {
    /// Every call's latency (ms), each Machine's first, the later ones.
    all_ms: Vec<f64>,
    first_ms: Vec<f64>,
    later_ms: Vec<f64>,
    /// For each Machine, seconds from the start of its first call to the done answer.
    done_after_s: Vec<f64>,
    /// Until all were done.
    took: Duration,
}

/// Every Machine once more per caller round, `rounds` times: the steady state (plan known).
async fn steady(
    addr: SocketAddr,
    ca: &Path,
    bodies: Arc<Vec<Vec<u8>>>,
    callers: usize,
    rounds: usize,
) -> Result<Vec<f64>, Error> {
    let mut tasks = Vec::new();
    for c in 0..callers {
        let (bodies, ca) = (bodies.clone(), ca.to_path_buf());
        tasks.push(tokio::spawn(async move {
            let mut client = CapiClient::new(addr, HOST, &ca).map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            for _ in 0..rounds {
                for i in (c..bodies.len()).step_by(callers) {
                    let t = Instant::now();
                    let r = client
                        .call(Hook::UpdateMachine, &bodies[i])
                        .await
                        .map_err(|e| e.to_string())?;
                    out.push(t.elapsed().as_secs_f64() * 1e3);
                    if r.json()["retryAfterSeconds"] != 0 {
                        return Err(format!("machine {i} not done: {}", r.json()));
                    }
                }
            }
            Ok::<_, String>(out)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// The baseline: the same callers calling each Machine's agent GetPlanStatus directly.
async fn baseline(
    pki: &Pki,
    client: &inplace_updater::emulate::CertFiles,
    agents: usize,
    port: u16,
    callers: usize,
    rounds: usize,
) -> Result<Vec<f64>, Error> {
    let config = Arc::new(client_config(&ClientTlsPaths {
        ca: pki.ca(),
        cert: client.cert.clone(),
        key: client.key.clone(),
    })?);
    let mut channels = Vec::new();
    for i in 0..agents {
        channels.push(NodeAgentClient::new(
            connect(
                &format!("https://{}:{port}", ip(i)),
                Some(&node(i)),
                config.clone(),
            )
            .await?,
        ));
    }
    let channels = Arc::new(channels);
    let mut tasks = Vec::new();
    for c in 0..callers {
        let channels = channels.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for _ in 0..rounds {
                for i in (c..channels.len()).step_by(callers) {
                    let mut ch = channels[i].clone();
                    let t = Instant::now();
                    ch.get_plan_status(pb::GetPlanStatusRequest { id: String::new() })
                        .await
                        .map_err(|e| e.to_string())?;
                    out.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            Ok::<_, String>(out)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

fn summary(name: &str, mut v: Vec<f64>) -> Value {
    v.sort_by(|a, b| a.total_cmp(b));
    let s = json!({
        "calls": v.len(),
        "p50_ms": percentile(&v, 0.50),
        "p99_ms": percentile(&v, 0.99),
        "max_ms": v.last().copied().unwrap_or(0.0),
    });
    println!(
        "{name}: {} calls, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        v.len(),
        percentile(&v, 0.5),
        percentile(&v, 0.99),
        v.last().copied().unwrap_or(0.0)
    );
    s
}

/// Median, p99 and max of seconds, printed and as JSON.
fn seconds_summary(name: &str, mut v: Vec<f64>) -> Value {
    v.sort_by(f64::total_cmp);
    let (p50, p99, max) = (
        percentile(&v, 0.5),
        percentile(&v, 0.99),
        v.last().copied().unwrap_or(0.0),
    );
    println!(
        "{name}: p50 {p50:.2} s, p99 {p99:.2} s, max {max:.2} s (n={})",
        v.len()
    );
    json!({"n": v.len(), "p50_s": p50, "p99_s": p99, "max_s": max})
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The plan durations of `--done`, and how many plans of each one Machine runs in a row.
const DONE_ROWS: [(u64, usize); 3] = [(3, 6), (30, 2), (180, 1)];

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One Machine of `--done`: `plans` plans of `seconds` each, one after the other, called as
/// CAPI calls; per plan (delay from the node's finish to the done answer in seconds, calls,
/// seconds from the first call to done).
async fn done_machine(
    addr: SocketAddr,
    ca: PathBuf,
    api: Arc<ApiStandin>,
    i: usize,
    port: u16,
    (seconds, plans): (u64, usize),
    root: PathBuf,
) -> Result<Vec<(f64, usize, f64)>, String> {
    let mut client = CapiClient::new(addr, HOST, &ca).map_err(|e| e.to_string())?;
    let socket = root.join("run/inplace-agent/status.sock");
    let mut out = Vec::new();
    for k in 0..plans {
        let content = format!("slow={seconds} plan {k}\n");
        let mut c = config(i);
        c["spec"]["files"][0]["content"] = json!(content);
        api.put(c);
        let mut v: Value = serde_json::from_slice(&request(i, port)).map_err(|e| e.to_string())?;
        v["desired"]["bootstrapConfig"]["spec"]["files"][0]["content"] = json!(content);
        let body = serde_json::to_vec(&v).map_err(|e| e.to_string())?;
        let first = now_ms();
        let mut calls = 0;
        let done = loop {
            let r = client
                .call(Hook::UpdateMachine, &body)
                .await
                .map_err(|e| e.to_string())?;
            calls += 1;
            let at = now_ms();
            let v = r.json();
            if v["status"] != "Success" {
                return Err(format!("machine {i}: {v}"));
            }
            let retry = v["retryAfterSeconds"].as_u64().unwrap_or(0);
            if retry == 0 {
                break at;
            }
            if at - first > (seconds + 120) * 1000 {
                return Err(format!(
                    "machine {i}: not done after {} s",
                    (at - first) / 1000
                ));
            }
            tokio::time::sleep(Duration::from_secs(retry)).await;
        };
        let status = tokio::task::block_in_place(|| {
            inplace_agent::status::client::get(&socket, "/v1/status", Duration::from_secs(30))
        })
        .map_err(|e| format!("machine {i}: the agent's status: {e}"))?;
        let status: Value = serde_json::from_slice(&status.body).map_err(|e| e.to_string())?;
        let finished = status["recent"][0]["finishedAtMs"]
            .as_u64()
            .ok_or_else(|| format!("machine {i}: no finishedAtMs in {status}"))?;
        out.push((
            done.saturating_sub(finished) as f64 / 1000.0,
            calls,
            (done - first) as f64 / 1000.0,
        ));
    }
    Ok(out)
}

/// `--done`: one agent per row of [`DONE_ROWS`], all rows at once.
fn done_main(o: &Options) -> Result<(), Error> {
    let work = tempfile::Builder::new()
        .prefix("inplace-updater-bench-done-")
        .tempdir()?;
    let dir = work.path();
    let pki = Pki::new(&dir.join("pki"))?;
    let client_cert = pki.updater_client()?;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let load_start = loadavg();
    println!("load average at start: {load_start}");
    let mut daemons: Vec<Daemon> = Vec::new();
    for i in 0..DONE_ROWS.len() {
        daemons.push(spawn_agent(dir, &pki, i, port)?.wait()?);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let api = Arc::new(ApiStandin::start().await?);
        for i in 0..DONE_ROWS.len() {
            api.put(machine(i));
            api.put(config(i));
        }
        api.put(inplace_updater::standin::extension_config(
            "inplace-updater",
            request_settings(port),
            serde_json::Value::Null,
        ));
        let kubeconfig = dir.join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let serving = pki.server("serving", &[HOST, "127.0.0.1"])?;
        let mut cmd = support::updater::updater_serve_command(
            Path::new(&bin("updater", support::programs::UPDATER)),
            &serving,
            &client_cert,
            &pki.ca(),
            &kubeconfig,
        );
        cmd.env("INPLACE_UPDATER_LOG", "warn,inplace_updater::cli=info");
        let updater = tokio::task::block_in_place(|| {
            Daemon::start(cmd, Ready::LogFile(dir.join("updater.log")))
        })
        .map_err(|e| format!("the updater did not start: {e}"))?;
        let addr: SocketAddr = updater.addr.parse()?;
        daemons.push(updater);
        let mut tasks = Vec::new();
        for (i, (seconds, plans)) in DONE_ROWS.iter().copied().enumerate() {
            let root = dir.join(node(i)).join("root");
            tasks.push(tokio::spawn(done_machine(
                addr,
                pki.ca(),
                api.clone(),
                i,
                port,
                (seconds, plans),
                root,
            )));
        }
        let mut rows = Vec::new();
        for ((seconds, _), t) in DONE_ROWS.iter().zip(tasks) {
            let got = t.await??;
            let delays: Vec<f64> = got.iter().map(|g| g.0).collect();
            let calls: usize = got.iter().map(|g| g.1).sum();
            let took: f64 = got.iter().map(|g| g.2).sum();
            let rate = calls as f64 / took.max(1e-9);
            let row = json!({
                "plan_seconds": seconds,
                "plans": got.len(),
                "delay_after_node_done_s": seconds_summary(&format!("a {seconds} s plan: node done → Machine done"), delays),
                "calls_per_machine_per_second": rate,
                "calls": calls,
            });
            println!("a {seconds} s plan: {calls} calls in {took:.1} s, {rate:.2} calls per Machine per second");
            rows.push(row);
        }
        Ok::<Value, Error>(json!({
            "updater": bin("updater", support::programs::UPDATER).display().to_string(),
            "rows": rows,
            "loadavg_start": load_start, "loadavg_end": loadavg(),
        }))
    });
    drop(daemons);
    let figures = result?;
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_vec_pretty(&figures)?)?;
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let o = options()?;
    raise_nofile();
    if o.done {
        return done_main(&o);
    }
    let work = tempfile::Builder::new()
        .prefix("inplace-updater-bench-")
        .tempdir()?;
    let dir = work.path();
    let pki = Pki::new(&dir.join("pki"))?;
    let client_cert = pki.updater_client()?;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    println!("load average at start: {}", loadavg());

    // The fleet, a few agents at a time.
    let started = Instant::now();
    // Every process started here, killed at the end (also on an error).
    let mut daemons: Vec<Daemon> = Vec::new();
    let mut next = 0;
    while next < o.agents {
        let batch: Vec<usize> = (next..(next + o.start_concurrency).min(o.agents)).collect();
        let mut starting = Vec::with_capacity(batch.len());
        for &i in &batch {
            starting.push(spawn_agent(dir, &pki, i, port)?);
        }
        for (s, i) in starting.into_iter().zip(&batch) {
            daemons.push(s.wait().map_err(|e| format!("{}: {e}", node(*i)))?);
        }
        next += batch.len();
    }
    println!(
        "{} agents listening after {:.1} s",
        o.agents,
        started.elapsed().as_secs_f64()
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let api = ApiStandin::start().await?;
        for i in 0..o.agents {
            api.put(machine(i));
            api.put(config(i));
        }
        // The administrator's registration: the requests carry its settings.
        api.put(inplace_updater::standin::extension_config(
            "inplace-updater",
            request_settings(port),
            serde_json::Value::Null,
        ));
        let kubeconfig = dir.join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let serving = pki.server("serving", &[HOST, "127.0.0.1"])?;
        let mut cmd = support::updater::updater_serve_command(
            Path::new(&bin("updater", support::programs::UPDATER)),
            &serving,
            &client_cert,
            &pki.ca(),
            &kubeconfig,
        );
        cmd.env("INPLACE_UPDATER_LOG", "warn,inplace_updater::cli=info");
        // Its log in a file (it is not read while the load runs).
        let updater = tokio::task::block_in_place(|| {
            Daemon::start(cmd, Ready::LogFile(dir.join("updater.log")))
        })
        .map_err(|e| format!("the updater did not start: {e}"))?;
        let pid = updater.pid();
        let addr: SocketAddr = updater.addr.parse()?;
        daemons.push(updater);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let idle_rss = Memory::of(pid).rss;
        println!("updater idle RSS: {:.1} MiB", idle_rss as f64 / 1024.0);

        let bodies = Arc::new((0..o.agents).map(|i| request(i, port)).collect::<Vec<_>>());
        let load_start = loadavg();
        // First as CAPI polls (every retryAfterSeconds), then, with new plans (another
        // file content), in a closed loop: the harshest polling.
        let capi = converge_as_capi(addr, &pki.ca(), bodies.clone(), o.callers).await?;
        let capi_took = capi.took;
        println!("CAPI-like polling: all {} Machines converged in {:.2} s", o.agents, capi_took.as_secs_f64());
        let capi_s = summary("UpdateMachine, polled as CAPI does (every retryAfterSeconds)", capi.all_ms);
        let capi_first_s = summary("  of which each Machine's first call (in one burst: check, translate, submit)", capi.first_ms);
        let capi_later_s = summary("  of which the later calls", capi.later_ms);
        let done_fast = seconds_summary("a plan of one file: done to CAPI after the Machine's first call", capi.done_after_s);

        // A 30 s plan on the first `slow` Machines: their file says "slow", and the kubelet
        // stand-in reports the old version for 30 s after it was written.
        let slow = o.slow.min(o.agents);
        for i in 0..slow {
            let mut c = config(i);
            c["spec"]["files"][0]["content"] = json!("slow\n");
            api.put(c);
        }
        let slow_bodies = Arc::new((0..slow).map(|i| {
            let mut v: Value = serde_json::from_slice(&request(i, port)).unwrap_or(Value::Null);
            v["desired"]["bootstrapConfig"]["spec"]["files"][0]["content"] = json!("slow\n");
            serde_json::to_vec(&v).unwrap_or_default()
        }).collect::<Vec<_>>());
        let done_slow = if slow > 0 {
            let got = converge_as_capi(addr, &pki.ca(), slow_bodies, o.callers.min(slow)).await?;
            println!("CAPI-like polling: {slow} Machines with a {SLOW_PLAN_SECONDS} s plan converged in {:.2} s", got.took.as_secs_f64());
            seconds_summary(&format!("a {SLOW_PLAN_SECONDS} s plan: done to CAPI after the Machine's first call"), got.done_after_s)
        } else {
            Value::Null
        };
        for i in 0..o.agents {
            let mut c = config(i);
            c["spec"]["files"][0]["content"] = json!("mode=v3\n");
            api.put(c);
        }
        let bodies = Arc::new((0..o.agents).map(|i| {
            let mut v: Value = serde_json::from_slice(&request(i, port)).unwrap_or(Value::Null);
            v["desired"]["bootstrapConfig"]["spec"]["files"][0]["content"] = json!("mode=v3\n");
            serde_json::to_vec(&v).unwrap_or_default()
        }).collect::<Vec<_>>());
        let (progress, done, took) = converge(addr, &pki.ca(), bodies.clone(), o.callers).await?;
        println!("closed loop: all {} Machines converged in {:.2} s ({} calls in progress, {} done)", o.agents, took.as_secs_f64(), progress.len(), done.len());
        let mut during = progress.clone();
        during.extend(done.iter().copied());
        let during = summary("UpdateMachine, closed loop while converging", during);
        let rounds = 10;
        let steady_ms = steady(addr, &pki.ca(), bodies.clone(), o.callers, rounds).await?;
        let steady_s = summary("UpdateMachine, closed loop, converged (plan known)", steady_ms.clone());
        let base = baseline(&pki, &client_cert, o.agents, port, o.callers, rounds).await?;
        let base_s = summary("baseline: GetPlanStatus direct to the agents", base.clone());
        let Memory {
            rss: after_rss,
            hwm: peak,
            ..
        } = Memory::of(pid);
        println!("updater RSS after the load: {:.1} MiB, peak {:.1} MiB", after_rss as f64 / 1024.0, peak as f64 / 1024.0);
        let ratio = steady_s["p50_ms"].as_f64().unwrap_or(0.0) / base_s["p50_ms"].as_f64().unwrap_or(1.0).max(1e-9);
        println!("steady UpdateMachine p50 / direct GetPlanStatus p50: {ratio:.2}");
        println!("load average at end: {}", loadavg());
        Ok::<Value, Error>(json!({
            "agents": o.agents, "callers": o.callers,
            "capi_like_converged_seconds": capi_took.as_secs_f64(),
            "update_machine_capi_like": capi_s,
            "update_machine_capi_like_first_calls": capi_first_s,
            "update_machine_capi_like_later_calls": capi_later_s,
            "done_after_first_call_fast": done_fast,
            "done_after_first_call_slow": done_slow,
            "slow_machines": slow,
            "closed_loop_converged_seconds": took.as_secs_f64(),
            "update_machine_converging": during,
            "update_machine_converged": steady_s,
            "baseline_get_plan_status": base_s,
            "steady_over_baseline_p50": ratio,
            "updater_idle_rss_kib": idle_rss, "updater_rss_after_kib": after_rss, "updater_peak_rss_kib": peak,
            "loadavg_start": load_start, "loadavg_end": loadavg(),
        }))
    });
    drop(daemons);
    let figures = result?;
    if let Some(path) = o.json {
        std::fs::write(path, serde_json::to_vec_pretty(&figures)?)?;
    }
    Ok(())
}
