//! The fleet: N agents (separate `inplace-agent serve` processes, each with its own sandbox
//! root, state directory, port and server certificate from one CA) on this machine, driven
//! by one updater process that submits a plan to every agent over mutual TLS with bounded
//! concurrency and waits until all of them report `SUCCEEDED`.
//!
//! ```text
//! fleet [--agents N] [--concurrency C] [--start-concurrency S] [--idle-seconds I]
//!       [--json FILE] [--pids FILE]
//! fleet updater TARGETS CA CERT KEY CONCURRENCY     (internal: the updater process)
//! ```
//!
//! Figures: start-up of the fleet (spawn → `READY=1` on each agent's `NOTIFY_SOCKET`), wall
//! time from the updater's start until every agent succeeded, the updater's peak RSS, and
//! the agents' memory once idle (sum and max of VmRSS, RssAnon, RssFile; sum of Pss, which
//! splits shared pages of the binary and libc fairly). Every agent is stopped (SIGTERM, then
//! SIGKILL after 10 s) and the sandbox removed at the end; `--pids FILE` lists the agents'
//! pids while they run, so `benches/run` can stop them if this program is killed.

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inplace_agent::plan::{Limits, parse_plan};
use inplace_agent::rpc::convert::plan_to_pb;
use inplace_agent::rpc::pb;
use inplace_agent::rpc::pb::node_agent_client::NodeAgentClient;
use inplace_agent::rpc::pki::DEFAULT_UPDATER_IDENTITY;
use inplace_agent::rpc::tls::{ClientTlsPaths, client_config, connect};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn agent_bin() -> PathBuf {
    std::env::var_os("INPLACE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_inplace-agent")))
}

// === PKI: one CA, one updater certificate, a server certificate per node ===

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

fn ca() -> Result<Ca, Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "inplace-agent fleet bench CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key)?;
    Ok(Ca {
        issuer: Issuer::new(params, key),
        pem: cert.pem(),
    })
}

/// Signs a leaf; returns (certificate PEM, key PEM).
fn leaf(ca: &Ca, mut params: CertificateParams) -> Result<(String, String), Error> {
    let key = KeyPair::generate()?;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, &ca.issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn server_cert(ca: &Ca, node: &str) -> Result<(String, String), Error> {
    let mut params = CertificateParams::new(vec![node.to_string(), "127.0.0.1".to_string()])?;
    params.distinguished_name.push(DnType::CommonName, node);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf(ca, params)
}

fn updater_cert(ca: &Ca) -> Result<(String, String), Error> {
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "updater");
    params.subject_alt_names = vec![SanType::URI(DEFAULT_UPDATER_IDENTITY.try_into()?)];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    leaf(ca, params)
}

// === The agents ===

struct Agent {
    node: String,
    child: Child,
    addr: String,
    startup: Duration,
}

/// Memory of a process in KiB: (VmRSS, RssAnon, RssFile, Pss, threads).
fn memory(pid: u32) -> (u64, u64, u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |text: &str, name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (
        field(&status, "VmRSS:"),
        field(&status, "RssAnon:"),
        field(&status, "RssFile:"),
        field(&rollup, "Pss:"),
        field(&status, "Threads:"),
    )
}

/// Every agent started so far; stopped on drop (also when starting the fleet fails).
struct Fleet {
    agents: Vec<Agent>,
    starting: Vec<Child>,
}

impl Fleet {
    fn stop(&mut self) {
        let mut children: Vec<Child> = self.agents.drain(..).map(|a| a.child).collect();
        children.append(&mut self.starting);
        for c in &children {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_child(c),
                rustix::process::Signal::TERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for mut c in children {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Spawns one agent; returns it with the socket its `READY=1` arrives on.
fn spawn_agent(dir: &Path, i: usize, ca: &Ca) -> Result<(String, Child, UnixDatagram), Error> {
    let node = format!("node-{i:04}");
    let home = dir.join(&node);
    let root = home.join("root");
    inplace_agent::sandbox::tree::build_kubeadm_worker(&root)?;
    let (cert, key) = server_cert(ca, &node)?;
    std::fs::write(home.join("server.crt"), cert)?;
    std::fs::write(home.join("server.key"), key)?;
    let notify = home.join("notify.sock");
    let socket = UnixDatagram::bind(&notify)?;
    socket.set_read_timeout(Some(Duration::from_secs(60)))?;
    let child = Command::new(agent_bin())
        .args([
            "serve",
            "--config",
            "/dev/null",
            "--listen",
            "127.0.0.1:0",
            "--no-chroot",
            "--services",
            "off",
            "--admin",
            DEFAULT_UPDATER_IDENTITY,
            "--node-name",
            &node,
        ])
        .arg("--root")
        .arg(&root)
        .arg("--tls-cert")
        .arg(home.join("server.crt"))
        .arg("--tls-key")
        .arg(home.join("server.key"))
        .arg("--client-ca")
        .arg(dir.join("ca.crt"))
        .env("NOTIFY_SOCKET", &notify)
        .env("INPLACE_AGENT_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    Ok((node, child, socket))
}

/// Waits for `READY=1` ("...serving on ADDR") and returns the address.
fn wait_ready(socket: &UnixDatagram) -> Result<String, Error> {
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.recv(&mut buf)?;
        let text = String::from_utf8_lossy(&buf[..n]);
        if text.lines().any(|l| l == "READY=1") {
            let addr = text
                .split("serving on ")
                .nth(1)
                .and_then(|rest| rest.split([';', '\n', ' ']).next())
                .ok_or_else(|| format!("READY=1 without an address: {text:?}"))?;
            return Ok(addr.to_string());
        }
    }
}

struct Options {
    agents: usize,
    concurrency: usize,
    start_concurrency: usize,
    idle_seconds: u64,
    json: Option<PathBuf>,
    pids: Option<PathBuf>,
}

fn options(args: &[String]) -> Result<Options, Error> {
    let mut o = Options {
        agents: 500,
        concurrency: 64,
        start_concurrency: 8,
        idle_seconds: 12,
        json: None,
        pids: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--bench" => {}
            "--agents" => o.agents = value()?.parse()?,
            "--concurrency" => o.concurrency = value()?.parse()?,
            "--start-concurrency" => o.start_concurrency = value()?.parse()?,
            "--idle-seconds" => o.idle_seconds = value()?.parse()?,
            "--json" => o.json = Some(value()?.into()),
            "--pids" => o.pids = Some(value()?.into()),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    if o.agents == 0 || o.concurrency == 0 || o.start_concurrency == 0 {
        return Err("--agents, --concurrency and --start-concurrency must be positive".into());
    }
    Ok(o)
}

/// Raises the soft open-file limit to the hard one (each agent is a child with pipes and a
/// notify socket here; the updater holds a connection per agent in flight).
fn raise_nofile() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let Some(max) = limit.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(max),
                maximum: Some(max),
            },
        );
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

fn harness(o: Options) -> Result<(), Error> {
    raise_nofile();
    let base = std::env::var_os("BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let work = tempfile::Builder::new()
        .prefix("inplace-fleet-")
        .tempdir_in(base)?;
    let dir = work.path();
    let ca = ca()?;
    std::fs::write(dir.join("ca.crt"), &ca.pem)?;
    let (cert, key) = updater_cert(&ca)?;
    std::fs::write(dir.join("updater.crt"), cert)?;
    std::fs::write(dir.join("updater.key"), key)?;

    // Start the fleet, a few agents at a time, each timed from spawn to READY=1.
    let mut fleet = Fleet {
        agents: Vec::with_capacity(o.agents),
        starting: Vec::new(),
    };
    let started = Instant::now();
    let mut next = 0;
    while next < o.agents {
        let n = o.start_concurrency.min(o.agents - next);
        let mut batch = Vec::with_capacity(n);
        for i in next..next + n {
            let t = Instant::now();
            let (node, child, socket) = spawn_agent(dir, i, &ca)?;
            fleet.starting.push(child);
            batch.push((node, socket, t));
        }
        let children: Vec<Child> = fleet.starting.drain(..).collect();
        for ((node, socket, t), mut child) in batch.into_iter().zip(children) {
            match wait_ready(&socket) {
                Ok(addr) => fleet.agents.push(Agent {
                    node,
                    child,
                    addr,
                    startup: t.elapsed(),
                }),
                Err(e) => {
                    let status = child.try_wait().ok().flatten();
                    fleet.starting.push(child);
                    return Err(format!("{node} did not become ready ({status:?}): {e}").into());
                }
            }
        }
        next += n;
        if let Some(p) = &o.pids {
            let list: String = fleet
                .agents
                .iter()
                .map(|a| format!("{}\n", a.child.id()))
                .collect();
            std::fs::write(p, list)?;
        }
    }
    let start_all = started.elapsed();
    let mut startups: Vec<f64> = fleet
        .agents
        .iter()
        .map(|a| a.startup.as_secs_f64() * 1000.0)
        .collect();
    startups.sort_by(f64::total_cmp);
    eprintln!(
        "fleet: {} agents ready in {:.1}s (spawn → READY=1 p50 {:.0} ms, max {:.0} ms)",
        o.agents,
        start_all.as_secs_f64(),
        percentile(&startups, 0.5),
        startups.last().copied().unwrap_or(0.0)
    );
    let (idle_rss, idle_anon, idle_file, idle_pss, threads) = fleet
        .agents
        .iter()
        .map(|a| memory(a.child.id()))
        .fold((0, 0, 0, 0, 0), |s, m| {
            (s.0 + m.0, s.1 + m.1, s.2 + m.2, s.3 + m.3, s.4 + m.4)
        });
    eprintln!(
        "fleet: before the plan: RSS sum {:.0} MiB (anon {:.0}, file {:.0}), Pss sum {:.0} MiB, {threads} threads",
        idle_rss as f64 / 1024.0,
        idle_anon as f64 / 1024.0,
        idle_file as f64 / 1024.0,
        idle_pss as f64 / 1024.0
    );

    // The updater: a separate process, so its memory is its own.
    let targets = dir.join("targets");
    let mut f = std::fs::File::create(&targets)?;
    for a in &fleet.agents {
        writeln!(f, "{} {}", a.node, a.addr)?;
    }
    drop(f);
    let out = Command::new(std::env::current_exe()?)
        .arg("updater")
        .arg(&targets)
        .arg(dir.join("ca.crt"))
        .arg(dir.join("updater.crt"))
        .arg(dir.join("updater.key"))
        .arg(o.concurrency.to_string())
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("the updater failed: {}", out.status).into());
    }
    let updater: serde_json::Value = serde_json::from_slice(&out.stdout)?;

    // Idle again (the blocking pools' threads have gone), then the memory of every agent.
    std::thread::sleep(Duration::from_secs(o.idle_seconds));
    let mems: Vec<_> = fleet.agents.iter().map(|a| memory(a.child.id())).collect();
    let alive = fleet
        .agents
        .iter_mut()
        .map(|a| matches!(a.child.try_wait(), Ok(None)))
        .filter(|alive| *alive)
        .count();
    let sum = |f: fn(&(u64, u64, u64, u64, u64)) -> u64| mems.iter().map(f).sum::<u64>();
    let max = |f: fn(&(u64, u64, u64, u64, u64)) -> u64| mems.iter().map(f).max().unwrap_or(0);
    let over_8 = mems.iter().filter(|m| m.0 > 8 * 1024).count();
    let figures = serde_json::json!({
        "agents": o.agents,
        "alive": alive,
        "concurrency": o.concurrency,
        "startAllSeconds": start_all.as_secs_f64(),
        "startupMillis": {"p50": percentile(&startups, 0.5), "p99": percentile(&startups, 0.99),
                           "max": startups.last().copied().unwrap_or(0.0)},
        "updater": updater,
        "agentsKiB": {
            "rssSum": sum(|m| m.0), "rssMax": max(|m| m.0),
            "anonSum": sum(|m| m.1), "anonMax": max(|m| m.1),
            "fileSum": sum(|m| m.2), "fileMax": max(|m| m.2),
            "pssSum": sum(|m| m.3), "threads": sum(|m| m.4),
            "over8MiB": over_8,
        },
    });
    println!("{figures:#}");
    if let Some(path) = &o.json {
        std::fs::write(path, format!("{figures:#}\n"))?;
    }
    fleet.stop();
    if let Some(p) = &o.pids {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

// === The updater ===

fn fleet_plan(node: &str) -> Result<pb::Plan, Error> {
    let text = format!(
        "apiVersion: inplace.agent/v1\nkind: Plan\nid: default/md-0@fleet-1\nnodeName: {node}\n\
         changes:\n\
         \x20 - kubeletConfig: {{mergePatch: {{maxPods: 150, serializeImagePulls: false}}}}\n\
         \x20 - kubeletFlags: {{set: {{node-labels: tier=web}}}}\n\
         \x20 - file: {{path: /etc/kubernetes/audit/policy.yaml, mode: \"0640\", content: \"apiVersion: audit.k8s.io/v1\\nkind: Policy\\nrules:\\n  - level: Metadata\\n\"}}\n\
         \x20 - file: {{path: /etc/containerd/certs.d/registry.local/hosts.toml, content: \"server = \\\"https://registry.local\\\"\\n\"}}\n\
         \x20 - absent: {{path: /etc/kubernetes/old-bootstrap.conf}}\n"
    );
    let plan = parse_plan(text.as_bytes(), "fleet", &Limits::default())
        .map_err(|e| format!("fleet plan: {e}"))?;
    Ok(plan_to_pb(&plan))
}

/// Submits the plan to one agent and follows it (WatchPlan) to its end.
async fn drive(
    node: String,
    addr: String,
    config: Arc<rustls::ClientConfig>,
) -> Result<Duration, Error> {
    let t = Instant::now();
    let channel = connect(&addr, Some(&node), config).await?;
    let mut client = NodeAgentClient::new(channel);
    let plan = fleet_plan(&node)?;
    let id = plan.id.clone();
    client
        .apply_plan(pb::ApplyPlanRequest {
            plan: Some(plan),
            retry: false,
        })
        .await?;
    let mut stream = client
        .watch_plan(pb::WatchPlanRequest { id: id.clone() })
        .await?
        .into_inner();
    while let Some(status) = stream.message().await? {
        match pb::Phase::try_from(status.phase) {
            Ok(pb::Phase::Succeeded) => return Ok(t.elapsed()),
            Ok(
                p @ (pb::Phase::Failed
                | pb::Phase::RolledBack
                | pb::Phase::Superseded
                | pb::Phase::Cancelled),
            ) => return Err(format!("{node}: plan ended {p:?}: {:?}", status.error).into()),
            _ => {}
        }
    }
    Err(format!("{node}: the watch ended before the plan did").into())
}

fn updater(args: &[String]) -> Result<(), Error> {
    let [targets, ca, cert, key, concurrency] = args else {
        return Err("updater TARGETS CA CERT KEY CONCURRENCY".into());
    };
    raise_nofile();
    let concurrency: usize = concurrency.parse()?;
    let targets: Vec<(String, String)> = std::fs::read_to_string(targets)?
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(n, a)| (n.to_string(), a.to_string()))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let (mut latencies, failures) = runtime.block_on(async {
        let config = Arc::new(client_config(&ClientTlsPaths {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
        })?);
        let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
        let mut tasks = tokio::task::JoinSet::new();
        for (node, addr) in targets.iter().cloned() {
            let (limit, config) = (limit.clone(), config.clone());
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                tokio::time::timeout(Duration::from_secs(120), drive(node.clone(), addr, config))
                    .await
                    .unwrap_or_else(|_| Err(format!("{node}: no result in 120 s").into()))
            });
        }
        let (mut ok, mut failed) = (Vec::new(), Vec::new());
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(Ok(took)) => ok.push(took.as_secs_f64() * 1000.0),
                Ok(Err(e)) => failed.push(e.to_string()),
                Err(e) => failed.push(e.to_string()),
            }
        }
        Ok::<_, Error>((ok, failed))
    })?;
    let wall = started.elapsed();
    latencies.sort_by(f64::total_cmp);
    let me = memory(std::process::id());
    let hwm = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0);
    for f in failures.iter().take(5) {
        eprintln!("updater: {f}");
    }
    let figures = serde_json::json!({
        "wallSeconds": wall.as_secs_f64(),
        "succeeded": latencies.len(),
        "failed": failures.len(),
        "perAgentMillis": {"p50": percentile(&latencies, 0.5), "p99": percentile(&latencies, 0.99),
                            "max": latencies.last().copied().unwrap_or(0.0)},
        "rssKiB": me.0,
        "peakRssKiB": hwm,
    });
    println!("{figures}");
    if !failures.is_empty() {
        return Err(format!("{} agents did not succeed", failures.len()).into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("updater") => updater(&args[1..]),
        _ => options(&args).and_then(harness),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
