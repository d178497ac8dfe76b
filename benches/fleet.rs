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

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inplace_api::convert::plan_to_pb;
use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::tls::{ClientTlsPaths, client_config, connect};
use inplace_plan::{Limits, parse_plan};
use inplace_updater::emulate::Pki;

use support::daemon::{Daemon, Ready, Starting, raise_nofile, serve_command};
use support::memory::Memory;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn agent_bin() -> PathBuf {
    support::daemon::agent_under_test()
}

// === The agents ===

struct Agent {
    node: String,
    daemon: Daemon,
}

/// Every agent started so far; stopped on drop (also when starting the fleet fails).
struct Fleet {
    agents: Vec<Agent>,
}

impl Fleet {
    /// SIGTERM to every agent at once, then each waited for; SIGKILL after 10 s.
    fn stop(&mut self) {
        for a in &self.agents {
            a.daemon.signal_term();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for mut a in self.agents.drain(..) {
            // A daemon dropped while it still runs is killed.
            let _ = a.daemon.wait_until(deadline);
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Spawns agent `i` on its own sandbox root with its own server certificate; it is ready when
/// its `READY=1` ("...serving on ADDR") arrives.
fn spawn_agent(dir: &Path, i: usize, pki: &Pki) -> Result<(String, Starting), Error> {
    let node = format!("node-{i:04}");
    let home = dir.join(&node);
    let root = home.join("root");
    inplace_demo_node::build_kubeadm_worker(&root)?;
    let cert = pki.server(&node, &[&node, "127.0.0.1"])?;
    let mut cmd = serve_command(&agent_bin(), &root, &node, &cert.cert, &cert.key, &pki.ca());
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--no-chroot",
        "--services",
        "off",
    ])
    .env("INPLACE_AGENT_LOG", "warn")
    .process_group(0);
    let starting = Daemon::spawn(cmd, Ready::Notify(home.join("notify.sock")))?;
    Ok((node, starting))
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
    let pki = Pki::new(&dir.join("pki"))?;
    let updater_cert = pki.updater_client()?;

    // Start the fleet, a few agents at a time, each timed from spawn to READY=1.
    let mut fleet = Fleet {
        agents: Vec::with_capacity(o.agents),
    };
    let started = Instant::now();
    let mut next = 0;
    while next < o.agents {
        let n = o.start_concurrency.min(o.agents - next);
        let mut batch = Vec::with_capacity(n);
        for i in next..next + n {
            batch.push(spawn_agent(dir, i, &pki)?);
        }
        for (node, starting) in batch {
            let daemon = starting
                .wait()
                .map_err(|e| format!("{node} did not become ready: {e}"))?;
            fleet.agents.push(Agent { node, daemon });
        }
        next += n;
        if let Some(p) = &o.pids {
            let list: String = fleet
                .agents
                .iter()
                .map(|a| format!("{}\n", a.daemon.pid()))
                .collect();
            std::fs::write(p, list)?;
        }
    }
    let start_all = started.elapsed();
    let mut startups: Vec<f64> = fleet
        .agents
        .iter()
        .map(|a| a.daemon.ready_after.as_secs_f64() * 1000.0)
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
        .map(|a| a.daemon.memory())
        .fold((0, 0, 0, 0, 0), |s, m| {
            (
                s.0 + m.rss,
                s.1 + m.anon,
                s.2 + m.file,
                s.3 + m.pss,
                s.4 + m.threads,
            )
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
        writeln!(f, "{} {}", a.node, a.daemon.addr)?;
    }
    drop(f);
    let out = Command::new(std::env::current_exe()?)
        .arg("updater")
        .arg(&targets)
        .arg(pki.ca())
        .arg(&updater_cert.cert)
        .arg(&updater_cert.key)
        .arg(o.concurrency.to_string())
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("the updater failed: {}", out.status).into());
    }
    let updater: serde_json::Value = serde_json::from_slice(&out.stdout)?;

    // Idle again (the blocking pools' threads have gone), then the memory of every agent.
    std::thread::sleep(Duration::from_secs(o.idle_seconds));
    let mems: Vec<Memory> = fleet.agents.iter().map(|a| a.daemon.memory()).collect();
    let alive = fleet
        .agents
        .iter_mut()
        .map(|a| matches!(a.daemon.child.try_wait(), Ok(None)))
        .filter(|alive| *alive)
        .count();
    let sum = |f: fn(&Memory) -> u64| mems.iter().map(f).sum::<u64>();
    let max = |f: fn(&Memory) -> u64| mems.iter().map(f).max().unwrap_or(0);
    let over_8 = mems.iter().filter(|m| m.rss > 8 * 1024).count();
    let figures = serde_json::json!({
        "agents": o.agents,
        "alive": alive,
        "concurrency": o.concurrency,
        "startAllSeconds": start_all.as_secs_f64(),
        "startupMillis": {"p50": percentile(&startups, 0.5), "p99": percentile(&startups, 0.99),
                           "max": startups.last().copied().unwrap_or(0.0)},
        "updater": updater,
        "agentsKiB": {
            "rssSum": sum(|m| m.rss), "rssMax": max(|m| m.rss),
            "anonSum": sum(|m| m.anon), "anonMax": max(|m| m.anon),
            "fileSum": sum(|m| m.file), "fileMax": max(|m| m.file),
            "pssSum": sum(|m| m.pss), "threads": sum(|m| m.threads),
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
    let me = Memory::of_self();
    for f in failures.iter().take(5) {
        eprintln!("updater: {f}");
    }
    let figures = serde_json::json!({
        "wallSeconds": wall.as_secs_f64(),
        "succeeded": latencies.len(),
        "failed": failures.len(),
        "perAgentMillis": {"p50": percentile(&latencies, 0.5), "p99": percentile(&latencies, 0.99),
                            "max": latencies.last().copied().unwrap_or(0.0)},
        "rssKiB": me.rss,
        "peakRssKiB": me.hwm,
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
