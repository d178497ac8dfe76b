//! Benchmarks of the node API against the real `inplace-agent serve` binary (release build)
//! on a sandbox node, over mutual TLS on 127.0.0.1:
//!
//! - `GetPlanStatus` latency (p50, p99, max) over one connection, sequential calls;
//! - new mTLS connections per second (TCP connect, TLS 1.3 handshake with client
//!   certificate, HTTP/2 setup, one `GetPlanStatus`), sequential;
//! - resident memory of `serve`: after start, and idle after N applied plans (each a file
//!   change, applied one after another), plus the peak;
//! - memory under abuse: a fresh `serve` gets 64 concurrent 16 MiB `CheckPlan`s, each on its
//!   own connection (a reader's identity is enough): the peak RSS, how many were answered and
//!   how many were told the agent is busy, and how long until RSS is back under 16 MiB.
//!
//! Run: `cargo bench --bench rpc` (see benches/README.md for the options). It prints a
//! table and, with `--json FILE`, writes the figures for the performance suite.

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inplace_api::convert::plan_to_pb;
use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::pki::DEFAULT_READER_IDENTITY;
use inplace_api::tls::{client_config, connect};
use inplace_plan::{Limits, parse_plan};
use rustls::ClientConfig;
use tonic::transport::Channel;

use support::daemon::{Daemon, OnDrop, Ready, serve_command};
use support::pki::{As, NodePki};

const NODE: &str = "bench-node";

struct Options {
    calls: usize,
    connect_seconds: u64,
    plans: usize,
    idle_seconds: u64,
    json: Option<std::path::PathBuf>,
}

impl Options {
    fn parse() -> Result<Options, String> {
        let mut o = Options {
            calls: 20_000,
            connect_seconds: 5,
            plans: 1000,
            idle_seconds: 15,
            json: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match arg.as_str() {
                // What `cargo bench` passes to every bench target.
                "--bench" => {}
                "--calls" => {
                    o.calls = value("--calls")?
                        .parse()
                        .map_err(|e| format!("--calls: {e}"))?
                }
                "--connect-seconds" => {
                    o.connect_seconds = value("--connect-seconds")?
                        .parse()
                        .map_err(|e| format!("--connect-seconds: {e}"))?
                }
                "--plans" => {
                    o.plans = value("--plans")?
                        .parse()
                        .map_err(|e| format!("--plans: {e}"))?
                }
                "--idle-seconds" => {
                    o.idle_seconds = value("--idle-seconds")?
                        .parse()
                        .map_err(|e| format!("--idle-seconds: {e}"))?
                }
                "--json" => o.json = Some(value("--json")?.into()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        Ok(o)
    }
}

/// The daemon under test (`INPLACE_AGENT_BIN`, else the bench's build), its log at warnings
/// and its start-up line; stopped with SIGTERM.
fn serve(root: &Path, pki: &NodePki) -> Result<Daemon, String> {
    let f = &pki.files;
    let mut cmd = serve_command(
        &support::daemon::agent_under_test(),
        root,
        NODE,
        &f.server_cert,
        &f.server_key,
        &f.ca_cert,
    );
    cmd.args(["--listen", "127.0.0.1:0", "--no-chroot"])
        .args(["--reader", DEFAULT_READER_IDENTITY])
        .env("INPLACE_AGENT_LOG", "warn,inplace_agent::cli::serve=info");
    Ok(Daemon::start(cmd, Ready::Log)?.on_drop(OnDrop::Term))
}

async fn client(
    addr: &str,
    config: &Arc<ClientConfig>,
) -> Result<NodeAgentClient<Channel>, String> {
    let channel = connect(addr, Some(NODE), config.clone())
        .await
        .map_err(|e| e.to_string())?;
    Ok(NodeAgentClient::new(channel))
}

fn plan(i: usize) -> pb::Plan {
    let text = format!(
        "apiVersion: inplace.agent/v1\nkind: Plan\nid: default/bench@{i}\nnodeName: {NODE}\nchanges:\n  - file: {{path: /etc/kubernetes/bench.conf, content: \"plan {i}\\n\"}}\n"
    );
    let plan =
        parse_plan(text.as_bytes(), "bench", &Limits::default()).unwrap_or_else(|e| panic!("{e}"));
    plan_to_pb(&plan)
}

async fn apply_and_wait(client: &mut NodeAgentClient<Channel>, i: usize) -> Result<(), String> {
    let response = client
        .apply_plan(pb::ApplyPlanRequest {
            plan: Some(plan(i)),
            retry: false,
        })
        .await
        .map_err(|e| format!("apply plan {i}: {e}"))?
        .into_inner();
    let id = response.status.map(|s| s.id).unwrap_or_default();
    loop {
        let s = client
            .get_plan_status(pb::GetPlanStatusRequest { id: id.clone() })
            .await
            .map_err(|e| format!("status of plan {i}: {e}"))?
            .into_inner();
        match pb::Phase::try_from(s.phase) {
            Ok(pb::Phase::Succeeded) => return Ok(()),
            Ok(
                p @ (pb::Phase::Failed
                | pb::Phase::RolledBack
                | pb::Phase::Superseded
                | pb::Phase::Cancelled),
            ) => {
                return Err(format!("plan {i} ended {p:?}"));
            }
            _ => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

async fn run(options: Options) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let root = dir.path().join("node");
    inplace_demo_node::build_kubeadm_worker(&root).map_err(|e| e.to_string())?;
    let pki = NodePki::new(NODE)?;
    let serve = serve(&root, &pki)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start = serve.memory();
    let config =
        Arc::new(client_config(&pki.client_paths(As::Updater)).map_err(|e| e.to_string())?);
    let mut admin = client(&serve.addr, &config).await?;
    apply_and_wait(&mut admin, 0).await?;

    // GetPlanStatus latency over one connection.
    let request = pb::GetPlanStatusRequest {
        id: "default/bench@0".into(),
    };
    for _ in 0..500 {
        admin
            .get_plan_status(request.clone())
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut latencies = Vec::with_capacity(options.calls);
    let started = Instant::now();
    for _ in 0..options.calls {
        let t = Instant::now();
        admin
            .get_plan_status(request.clone())
            .await
            .map_err(|e| e.to_string())?;
        latencies.push(t.elapsed());
    }
    let calls_per_second = options.calls as f64 / started.elapsed().as_secs_f64();
    latencies.sort();
    let (p50, p99, max) = (
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1],
    );

    // New connections per second.
    let window = Duration::from_secs(options.connect_seconds);
    let started = Instant::now();
    let mut connections = 0u64;
    while started.elapsed() < window {
        let mut c = client(&serve.addr, &config).await?;
        c.get_plan_status(request.clone())
            .await
            .map_err(|e| e.to_string())?;
        connections += 1;
    }
    let connections_per_second = connections as f64 / started.elapsed().as_secs_f64();

    // Idle memory after N applied plans.
    let started = Instant::now();
    for i in 1..=options.plans {
        apply_and_wait(&mut admin, i).await?;
    }
    let apply_seconds = started.elapsed().as_secs_f64();
    drop(admin);
    tokio::time::sleep(Duration::from_secs(options.idle_seconds)).await;
    let idle = serve.memory();

    println!("inplace-agent node API benchmark (serve: release build, 127.0.0.1, TLS 1.3 mTLS)");
    println!(
        "  GetPlanStatus, one connection, {} calls: p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs ({:.0} calls/s)",
        options.calls,
        micros(p50),
        micros(p99),
        micros(max),
        calls_per_second
    );
    println!(
        "  new mTLS connections (connect + handshake + HTTP/2 + one call), sequential: {connections_per_second:.0}/s"
    );
    println!(
        "  {} plans applied one after another in {apply_seconds:.1}s ({:.1} ms each)",
        options.plans,
        apply_seconds * 1000.0 / options.plans.max(1) as f64
    );
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "  serve RSS: {:.1} MiB after start (anon {:.1}, file {:.1}), {:.1} MiB idle {}s after {} plans (anon {:.1}, file {:.1}; peak {:.1} MiB)",
        mib(start.rss),
        mib(start.anon),
        mib(start.file),
        mib(idle.rss),
        options.idle_seconds,
        options.plans,
        mib(idle.anon),
        mib(idle.file),
        mib(idle.hwm)
    );
    drop(serve);
    let abuse = abuse(&root, &pki).await?;
    println!(
        "  64 concurrent 16 MiB CheckPlans: peak RSS {:.1} MiB ({} answered, {} busy in {:.1}s); RSS {:.1} MiB (anon {:.1}) {:.0}s later",
        mib(abuse.peak),
        abuse.answered,
        abuse.busy,
        abuse.seconds,
        mib(abuse.rss_after),
        mib(abuse.anon_after),
        abuse.back_after_seconds
    );
    if let Some(path) = &options.json {
        let figures = serde_json::json!({
            "abuse": {
                "requests": 64,
                "requestBytes": abuse.request_bytes,
                "answered": abuse.answered,
                "busy": abuse.busy,
                "seconds": abuse.seconds,
                "peakKiB": abuse.peak,
                "rssAfterKiB": abuse.rss_after,
                "anonAfterKiB": abuse.anon_after,
                "backUnder16MiBAfterSeconds": abuse.back_after_seconds,
            },
            "getPlanStatus": {
                "calls": options.calls,
                "p50Micros": micros(p50),
                "p99Micros": micros(p99),
                "maxMicros": micros(max),
                "callsPerSecond": calls_per_second,
            },
            "connectionsPerSecond": connections_per_second,
            "plans": {"count": options.plans, "seconds": apply_seconds},
            "rssKiB": {
                "start": start.rss,
                "startAnon": start.anon,
                "startFile": start.file,
                "idle": idle.rss,
                "idleAnon": idle.anon,
                "idleFile": idle.file,
                "peak": idle.hwm,
            },
        });
        std::fs::write(path, format!("{figures:#}\n"))
            .map_err(|e| format!("write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// What 64 concurrent 16 MiB `CheckPlan`s did to a fresh daemon.
struct Abuse {
    request_bytes: usize,
    answered: usize,
    busy: usize,
    seconds: f64,
    peak: u64,
    rss_after: u64,
    anon_after: u64,
    back_after_seconds: f64,
}

async fn abuse(root: &Path, pki: &NodePki) -> Result<Abuse, String> {
    let serve = serve(root, pki)?;
    let config = Arc::new(client_config(&pki.client_paths(As::Reader)).map_err(|e| e.to_string())?);
    // Four files of just under the 4 MiB content limit: a valid plan of 16 MiB.
    let content = bytes::Bytes::from(vec![b'x'; (4 << 20) - 4096]);
    let plan = pb::Plan {
        id: "default/bench@big".into(),
        node_name: NODE.into(),
        changes: (0..4)
            .map(|i| pb::Change {
                kind: Some(pb::change::Kind::File(pb::FileChange {
                    path: format!("/etc/kubernetes/big-{i}.conf"),
                    content: content.clone(),
                    ..Default::default()
                })),
            })
            .collect(),
        ..Default::default()
    };
    let request_bytes = prost::Message::encoded_len(&plan);
    let mut clients = Vec::new();
    for _ in 0..64 {
        clients.push(client(&serve.addr, &config).await?);
    }
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for mut c in clients {
        let plan = plan.clone();
        tasks.spawn(async move {
            c.check_plan(pb::CheckPlanRequest { plan: Some(plan) })
                .await
        });
    }
    let (mut answered, mut busy) = (0, 0);
    while let Some(result) = tasks.join_next().await {
        match result.map_err(|e| e.to_string())? {
            Ok(_) => answered += 1,
            Err(e) if e.code() == tonic::Code::ResourceExhausted => busy += 1,
            Err(e) => return Err(format!("CheckPlan: {e}")),
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let peak = serve.memory().hwm;
    let done = Instant::now();
    let (mut rss_after, mut anon_after) = (0, 0);
    while done.elapsed() < Duration::from_secs(60) {
        let now = serve.memory();
        (rss_after, anon_after) = (now.rss, now.anon);
        if now.rss <= 16 * 1024 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(Abuse {
        request_bytes,
        answered,
        busy,
        seconds,
        peak,
        rss_after,
        anon_after,
        back_after_seconds: done.elapsed().as_secs_f64(),
    })
}

fn main() -> std::process::ExitCode {
    let options = match Options::parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(options)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
