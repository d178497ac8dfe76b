//! Benchmarks of the local status socket against the real `inplace-agent serve` binary
//! (bench profile) on a sandbox node whose journal holds 10,000 records:
//!
//! - `GET /v1/status` latency (p50, p99, max) at a fixed request rate (open loop: one new
//!   connection per request, started on schedule whether or not earlier ones answered;
//!   latency is measured from the scheduled start, so a stall counts for every request
//!   behind it; that includes the client's timer, which wakes up to a millisecond late, so
//!   the time from the request's actual start to its answer is reported too);
//! - resident memory of `serve` with the socket, the metrics (also on a TCP listener) and
//!   the journal loaded: after start, and after the load.
//!
//! Run: `cargo bench --bench status` (benches/README.md lists the options). It prints a
//! table and, with `--json FILE`, writes the figures for the performance suite.

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inplace_agent::config::SettingsInput;
use inplace_agent::engine::Engine;
use inplace_agent::host::Host;
use inplace_plan::{Limits, parse_plan};

use support::daemon::{Daemon, OnDrop, Ready, serve_command};
use support::pki::NodePki;

const NODE: &str = "bench-node";

struct Options {
    rate: u32,
    seconds: u64,
    records: u64,
    json: Option<PathBuf>,
}

impl Options {
    fn parse() -> Result<Options, String> {
        let mut o = Options {
            rate: 1000,
            seconds: 10,
            records: 10_000,
            json: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match arg.as_str() {
                // What `cargo bench` passes to every bench target.
                "--bench" => {}
                "--rate" => {
                    o.rate = value("--rate")?
                        .parse()
                        .map_err(|e| format!("--rate: {e}"))?
                }
                "--seconds" => {
                    o.seconds = value("--seconds")?
                        .parse()
                        .map_err(|e| format!("--seconds: {e}"))?
                }
                "--records" => {
                    o.records = value("--records")?
                        .parse()
                        .map_err(|e| format!("--records: {e}"))?
                }
                "--json" => o.json = Some(value("--json")?.into()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        if o.rate == 0 || o.seconds == 0 {
            return Err("--rate and --seconds must be above 0".into());
        }
        Ok(o)
    }
}

/// Fills the node's journal with at least `records` records by applying small plans with the
/// engine in-process (compaction off, so the records stay). Returns the count.
fn fill_journal(root: &Path, records: u64) -> Result<u64, String> {
    let mut settings = SettingsInput {
        root: Some(root.to_path_buf()),
        no_chroot: true,
        services_off: true,
        ..SettingsInput::default()
    }
    .resolve()?;
    settings.engine.compact_bytes = u64::MAX;
    let host = Arc::new(Host::open(settings.host.clone()).map_err(|e| e.to_string())?);
    let (engine, _) = Engine::open(settings.engine.clone(), host).map_err(|e| e.to_string())?;
    let mut i = 0u64;
    while engine.journal_info().records < records {
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: fill-{i}\nnodeName: {NODE}\nchanges:\n  - file: {{path: /etc/kubernetes/fill.conf, content: \"{i}\\n\"}}\n"
        );
        let plan =
            parse_plan(text.as_bytes(), "bench", &Limits::default()).map_err(|e| e.to_string())?;
        engine
            .submit(plan, "bench", false)
            .map_err(|e| e.to_string())?;
        engine.run_until_idle();
        i += 1;
    }
    Ok(engine.journal_info().records)
}

/// The daemon under test (`INPLACE_AGENT_BIN`, else the bench's build) with the metrics on
/// a TCP listener too, service management off; stopped with SIGTERM.
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
    cmd.args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--no-chroot", "--services", "off"])
        .env("INPLACE_AGENT_LOG", "warn,inplace_agent::cli::serve=info");
    Ok(Daemon::start(cmd, Ready::Log)?.on_drop(OnDrop::Term))
}

/// One `GET /v1/status` on a new connection; the body length.
async fn status_request(socket: &Path) -> Result<usize, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .map_err(|e| format!("send: {e}"))?;
    let mut raw = Vec::with_capacity(4096);
    s.read_to_end(&mut raw)
        .await
        .map_err(|e| format!("read: {e}"))?;
    let r = inplace_agent::status::client::parse_response(&raw)?;
    if r.status != 200 {
        return Err(format!("status {}", r.status));
    }
    Ok(r.body.len())
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
    let filling = Instant::now();
    let root_for_fill = root.clone();
    let records = options.records;
    let records = tokio::task::spawn_blocking(move || fill_journal(&root_for_fill, records))
        .await
        .map_err(|e| e.to_string())??;
    let fill_seconds = filling.elapsed().as_secs_f64();
    let journal_bytes = std::fs::metadata(root.join("var/lib/inplace-agent/journal/journal.log"))
        .map(|m| m.len())
        .unwrap_or(0);
    let serve = serve(&root, &pki)?;
    let socket = Arc::new(root.join("run/inplace-agent/status.sock"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start = serve.memory();

    // Warm-up, then the open-loop run.
    let mut body_bytes = 0;
    for _ in 0..200 {
        body_bytes = status_request(&socket).await?;
    }
    let total = u64::from(options.rate) * options.seconds;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(options.rate)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for _ in 0..total {
        let scheduled = tick.tick().await;
        let socket = socket.clone();
        tasks.spawn(async move {
            let sent = Instant::now();
            let result = status_request(&socket).await;
            (scheduled.elapsed(), sent.elapsed(), result)
        });
    }
    let mut latencies = Vec::with_capacity(total as usize);
    let mut service = Vec::with_capacity(total as usize);
    let mut errors = 0usize;
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (latency, answered, result) = joined.map_err(|e| e.to_string())?;
        match result {
            Ok(_) => {
                latencies.push(latency);
                service.push(answered);
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e);
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    latencies.sort();
    service.sort();
    let (service_p50, service_p99) = (percentile(&service, 0.50), percentile(&service, 0.99));
    if latencies.is_empty() {
        return Err(format!("no request succeeded: {first_error:?}"));
    }
    let (p50, p99, max) = (
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        *latencies.last().unwrap_or(&Duration::ZERO),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = serve.memory();

    println!(
        "status socket: GET /v1/status, {} requests at {}/s (open loop, new connection each)",
        total, options.rate
    );
    println!(
        "  journal: {records} records ({:.1} MiB, filled in {fill_seconds:.1}s); answer {body_bytes} bytes",
        journal_bytes as f64 / 1048576.0
    );
    println!(
        "  latency: p50 {:.0} us, p99 {:.0} us, max {:.0} us; {} ok, {errors} failed{}; achieved {:.0}/s",
        micros(p50),
        micros(p99),
        micros(max),
        latencies.len(),
        first_error
            .as_ref()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default(),
        latencies.len() as f64 / wall
    );
    println!(
        "  from the request's actual start (connect, request, whole answer): p50 {:.0} us, p99 {:.0} us",
        micros(service_p50),
        micros(service_p99)
    );
    println!(
        "  RSS of serve: {} KiB after start (anon {}, file {}), {} KiB after the load (anon {}, file {}), peak {} KiB",
        start.rss, start.anon, start.file, after.rss, after.anon, after.file, after.hwm
    );
    if let Some(path) = &options.json {
        let figures = serde_json::json!({
            "statusLatency": {
                "rate": options.rate,
                "requests": total,
                "ok": latencies.len(),
                "failed": errors,
                "p50Micros": micros(p50).round(),
                "p99Micros": micros(p99).round(),
                "maxMicros": micros(max).round(),
                "serviceP50Micros": micros(service_p50).round(),
                "serviceP99Micros": micros(service_p99).round(),
                "achievedPerSecond": (latencies.len() as f64 / wall).round(),
            },
            "journal": {"records": records, "bytes": journal_bytes},
            "rssKiB": {
                "start": start.rss, "startAnon": start.anon, "startFile": start.file,
                "afterLoad": after.rss, "afterLoadAnon": after.anon, "afterLoadFile": after.file,
                "peak": after.hwm,
            },
        });
        std::fs::write(path, format!("{figures:#}\n"))
            .map_err(|e| format!("write {}: {e}", path.display()))?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let options = match Options::parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    // The client on one worker thread, so the daemon keeps the other core of a 2-core box.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
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
