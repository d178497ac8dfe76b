//! `inplace-agent serve`: the daemon. The engine runs on its worker thread; the gRPC server
//! (mutual TLS, authorization, health, reflection) on a single-threaded Tokio runtime with a
//! small blocking pool, which is what keeps the idle footprint small. SIGTERM or SIGINT stops
//! it gracefully: no new calls, watch streams end with UNAVAILABLE, the engine finishes the
//! step it is in and stops; an unfinished plan resumes from the journal at the next start. A
//! second signal exits at once (the journal makes that safe too).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::selfcheck::Subject;
use super::{Exit, Invalid};
use crate::config::{
    ConfigError, DEFAULT_CONFIG_PATH, DaemonInput, DaemonSettings, PlanLimitsInput, SettingsInput,
    Unresolved, load_config,
};
use crate::engine::Engine;
use crate::host::Host;
use crate::rpc::server::{Security, serve};
use crate::rpc::service::{AgentService, ServiceCounters};
use crate::status::api::AgentInfo;
use crate::status::metrics::{Metrics, Sources as MetricSources};
use crate::status::server::{State as StatusState, StatusServer};
use inplace_api::authz::{AuthzCounters, IdentityPattern};
use inplace_api::pb::node_agent_server::NodeAgentServer;
use inplace_api::tls::{ReloadingServerConfig, TlsCounters};

/// Blocking-pool threads: engine calls of the gRPC methods (journal appends, status reads).
const BLOCKING_THREADS: usize = 4;

/// How long idle blocking-pool threads are kept.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(10);

/// How long calls in flight get to finish once the server stops.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Arguments of `serve`. Every flag overrides the configuration file.
#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    /// Configuration file [default: /etc/inplace-agent/config.toml, if it exists]
    #[arg(long, env = "INPLACE_AGENT_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to listen on (grpc.listen) [default: 0.0.0.0:9443]
    #[arg(long, value_name = "ADDR", value_parser = inplace_base::parse_socket_addr)]
    pub listen: Option<SocketAddr>,
    /// The node's root directory (node.root) [default: /]
    #[arg(long, env = "INPLACE_AGENT_ROOT")]
    pub root: Option<PathBuf>,
    /// State directory (node.state_dir) [default: <root>/var/lib/inplace-agent]
    #[arg(long, env = "INPLACE_AGENT_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// This node's name (node.name) [default: <root>/etc/hostname]
    #[arg(long)]
    pub node_name: Option<String>,
    /// Server certificate chain (tls.cert) [default: /etc/inplace-agent/pki/server.crt]
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (tls.key) [default: /etc/inplace-agent/pki/server.key]
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// CA bundle client certificates must chain to (tls.client_ca) [default: /etc/inplace-agent/pki/ca.crt]
    #[arg(long, value_name = "FILE")]
    pub client_ca: Option<PathBuf>,
    /// Identity pattern with the admin role (repeatable; replaces authorization.admin)
    #[arg(long, value_name = "PATTERN")]
    pub admin: Vec<IdentityPattern>,
    /// Identity pattern with the reader role (repeatable; replaces authorization.reader)
    #[arg(long, value_name = "PATTERN")]
    pub reader: Vec<IdentityPattern>,
    /// Also allow plans to write under this directory (repeatable; plans.allow_paths)
    #[arg(long = "allow-path", value_name = "DIR")]
    pub allow_paths: Vec<String>,
    /// Run node commands on the agent's filesystem instead of chrooting into the root (node.chroot = false)
    #[arg(long)]
    pub no_chroot: bool,
    /// Allow `exec` changes (exec.allow)
    #[arg(long)]
    pub allow_exec: bool,
    /// Manage units through systemd or not at all (node.services) [default: systemd]
    #[arg(long, env = "INPLACE_AGENT_SERVICES", value_enum)]
    pub services: Option<super::Services>,
    /// D-Bus address of the node's system bus (node.bus) [default:
    /// unix:path=<root>/run/dbus/system_bus_socket]
    #[arg(long, env = "INPLACE_AGENT_BUS", value_name = "ADDRESS")]
    pub bus: Option<String>,
    /// Read the boot id from this file instead of <root>/proc/sys/kernel/random/boot_id
    #[arg(long, value_name = "FILE")]
    pub boot_id_file: Option<PathBuf>,
    /// Largest gRPC message in bytes (grpc.max_message_bytes)
    #[arg(long, value_name = "BYTES")]
    pub max_message_bytes: Option<std::num::NonZeroUsize>,
    /// Most changes in a plan (plans.max_changes)
    #[arg(long, value_name = "N")]
    pub max_changes: Option<std::num::NonZeroUsize>,
    /// Largest decoded content of one file, in bytes (plans.max_content_bytes)
    #[arg(long, value_name = "BYTES")]
    pub max_content_bytes: Option<std::num::NonZeroUsize>,
    /// The local status socket (status.socket) [default: <root>/run/inplace-agent/status.sock]
    #[arg(long, value_name = "FILE")]
    pub status_socket: Option<PathBuf>,
    /// The node's group that may read the status socket, created when missing; "" for root
    /// only (status.group) [default: inplace-agent]
    #[arg(long, value_name = "GROUP")]
    pub status_group: Option<String>,
    /// Also serve /metrics over plain TCP on this address, for scraping (metrics.listen)
    /// [default: off]
    #[arg(long, value_name = "ADDR", value_parser = inplace_base::parse_socket_addr)]
    pub metrics_listen: Option<SocketAddr>,
    /// How log lines look (log.format) [default: plain]
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub log_format: Option<crate::config::LogFormat>,
    /// Make no drift checks (drift.enabled = false)
    #[arg(long)]
    pub no_drift_checks: bool,
    /// Be the daemon's drift check process (`cli::drift_probe`): read the baseline on
    /// standard input, answer what differs on standard output; nothing is started
    #[arg(long, hide = true)]
    pub drift_probe: bool,
    /// Only say whether the agent is configured enough to start: exit 1 when a TLS file is
    /// missing, naming those and every other problem serve would name (the unit's
    /// ExecCondition=, so that an unconfigured agent waits quietly instead of failing); 0 when
    /// they are all there (serve then starts, or refuses naming each problem); nothing is
    /// started
    #[arg(long)]
    pub check_configured: bool,
}

impl ServeArgs {
    /// The settings the flags give (unset flags leave the file's values).
    fn input(&self) -> DaemonInput {
        let list = |l: &Vec<IdentityPattern>| (!l.is_empty()).then(|| l.clone());
        DaemonInput {
            settings: SettingsInput {
                root: self.root.clone(),
                state_dir: self.state_dir.clone(),
                allow_paths: self.allow_paths.clone(),
                node_name: self.node_name.clone(),
                no_chroot: self.no_chroot,
                allow_exec: self.allow_exec,
                plan_limits: PlanLimitsInput {
                    max_changes: self.max_changes,
                    max_content_bytes: self.max_content_bytes,
                    ..PlanLimitsInput::default()
                },
                services_off: self.services == Some(super::Services::Off),
                bus: self.bus.clone(),
                boot_id_file: self.boot_id_file.clone(),
                ..SettingsInput::default()
            },
            listen: self.listen,
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            client_ca: self.client_ca.clone(),
            admin: list(&self.admin),
            reader: list(&self.reader),
            max_message_bytes: self.max_message_bytes,
            status_socket: self.status_socket.clone(),
            status_group: self.status_group.clone(),
            metrics_listen: self.metrics_listen,
            log_format: self.log_format,
            drift: crate::config::DriftInput {
                enabled: self.no_drift_checks.then_some(false),
                ..crate::config::DriftInput::default()
            },
            ..DaemonInput::default()
        }
    }

    /// The configuration file read: `--config`, else the default file when it exists.
    pub fn config_file(&self) -> Option<PathBuf> {
        match &self.config {
            Some(path) => Some(path.clone()),
            None if std::path::Path::new(DEFAULT_CONFIG_PATH).exists() => {
                Some(PathBuf::from(DEFAULT_CONFIG_PATH))
            }
            None => None,
        }
    }

    /// The configuration file (if any) with the flags over it, validated: every problem of
    /// the settings, with what is known of the rest (`Err` inside); `Err` outside when the
    /// file itself cannot be used (the rest depends on what it says).
    pub fn resolve(&self) -> Result<Result<DaemonSettings, Box<Unresolved>>, ConfigError> {
        let file = match self.config_file() {
            Some(path) => load_config(&path)?,
            None => DaemonInput::default(),
        };
        Ok(file.overlay(self.input()).resolve_each())
    }

    /// The configuration file (if any) with the flags over it, validated. Every error is
    /// invalid input ([`ConfigError`] or [`Invalid`]).
    pub fn settings(&self) -> anyhow::Result<DaemonSettings> {
        self.resolve()?.map_err(|u| {
            let all: Vec<String> = u.problems.iter().map(ToString::to_string).collect();
            Invalid::new(all.join("; ")).into()
        })
    }
}

/// A running daemon: the engine's worker and the gRPC server on the current runtime.
pub struct Daemon {
    addr: SocketAddr,
    engine: Engine,
    counters: Arc<ServiceCounters>,
    stop: watch::Sender<bool>,
    server: tokio::task::JoinHandle<Result<(), crate::rpc::server::ServeError>>,
    worker: std::thread::JoinHandle<()>,
    status: StatusServer,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon").field("addr", &self.addr).finish()
    }
}

impl Daemon {
    /// Opens the engine (replaying the journal; an unfinished plan resumes), starts its
    /// worker, binds the listener and starts serving. Must be called within a Tokio runtime.
    pub async fn start(settings: DaemonSettings) -> anyhow::Result<Daemon> {
        crate::host::memory::tune();
        let DaemonSettings {
            settings,
            node_name,
            listen,
            tls,
            rules,
            serve: options,
            status: status_settings,
            metrics_listen,
            log_format: _,
            drift,
        } = settings;
        let started_at_ms = inplace_base::time::now_ms();
        let host = Host::open(settings.host.clone())
            .map(Arc::new)
            .with_context(|| format!("open root {}", settings.host.root.display()))?;
        let tls_counters = Arc::new(TlsCounters::default());
        let tls = ReloadingServerConfig::new(tls, tls_counters.clone()).context("tls")?;
        tracing::info!(services = %host.services_description(), "service management");
        let (engine, report) = Engine::open(settings.engine.clone(), host).with_context(|| {
            format!(
                "open the journal in {}",
                settings.engine.state_dir.display()
            )
        })?;
        if let Some(torn) = report.torn {
            tracing::warn!(
                offset = torn.offset,
                bytes = torn.bytes,
                "the journal ended in a torn record left by a crash; it was truncated"
            );
        }
        if let Some(current) = engine.current() {
            tracing::info!(id = %current.id, digest = %current.digest, phase = %current.phase, "an unfinished plan resumes");
        }
        let listener = match TcpListener::bind(listen).await {
            Ok(listener) => listener,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                anyhow::bail!(
                    "listen on {listen}: the address is already in use, {}: stop that \
                     process, or set grpc.listen in the configuration file (or --listen) to a \
                     free address",
                    crate::host::ports::held_by(listen)
                )
            }
            Err(e) => return Err(e).with_context(|| format!("listen on {listen}")),
        };
        let addr = listener
            .local_addr()
            .with_context(|| format!("listen on {listen}"))?;
        let (stop, stopping) = watch::channel(false);
        let service = AgentService::new(engine.clone(), settings.limits.clone(), stopping.clone())
            .with_max_document_bytes(options.max_message_bytes);
        let counters = service.counters().clone();
        let authz_counters = Arc::new(AuthzCounters::default());
        // The metrics count from the first record the worker journals (a resumed run too).
        let metrics = Metrics::new(MetricSources {
            engine: engine.clone(),
            tls: tls_counters,
            authz: authz_counters.clone(),
            service: counters.clone(),
            started_at_ms,
        });
        metrics.observe(&engine);
        let status_state = Arc::new(StatusState::new(
            engine.clone(),
            metrics,
            AgentInfo {
                version: env!("CARGO_PKG_VERSION").to_string(),
                commit: crate::BUILD.commit_label(),
                pid: std::process::id(),
                started_at_ms,
                uptime_seconds: 0,
                grpc_listen: addr.to_string(),
                status_socket: status_settings.path.display().to_string(),
                metrics_listen: metrics_listen.map(|a| a.to_string()),
            },
            &node_name,
        ));
        let status = StatusServer::start(
            &status_settings,
            metrics_listen,
            status_state,
            stopping.clone(),
        )
        .await
        .map_err(anyhow::Error::msg)?;
        let worker = match engine.spawn_worker() {
            Ok(w) => w,
            Err(e) => {
                status.stop();
                return Err(e).context("start the engine worker");
            }
        };
        let (health, _) = tonic_health::server::health_reporter();
        health.set_serving::<NodeAgentServer<AgentService>>().await;
        let security = Security {
            tls: Arc::new(tls),
            rules: Arc::new(rules),
            authz_counters,
        };
        tokio::spawn(super::drift_watch::run(
            engine.clone(),
            drift,
            stopping.clone(),
        ));
        let mut shutdown = stopping;
        let server = tokio::spawn(serve(
            listener,
            service,
            health,
            security,
            options,
            async move {
                let _ = shutdown.wait_for(|stop| *stop).await;
            },
        ));
        tracing::info!(node = %node_name, "listening on {addr}");
        Ok(Daemon {
            addr,
            engine,
            counters,
            stop,
            server,
            worker,
            status,
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The service's counters.
    pub fn counters(&self) -> &Arc<ServiceCounters> {
        &self.counters
    }

    /// The status socket.
    pub fn status_socket(&self) -> &std::path::Path {
        self.status.socket()
    }

    /// The TCP metrics listener's address, when configured.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.status.metrics_addr()
    }

    /// Stops gracefully: the server stops accepting and drains (watch streams end with
    /// UNAVAILABLE; calls in flight get 10 seconds), the engine finishes its current step.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.engine.shutdown();
        let mut server = self.server;
        let served = match tokio::time::timeout(DRAIN_TIMEOUT, &mut server).await {
            Ok(Ok(result)) => result.map_err(anyhow::Error::from),
            Ok(Err(e)) => Err(e).context("grpc server task"),
            Err(_) => {
                server.abort();
                tracing::warn!("calls still in flight after {DRAIN_TIMEOUT:?}; closed them");
                Ok(())
            }
        };
        self.status.stop();
        if self.engine.busy() {
            tracing::info!("waiting for the engine to finish its current step");
        }
        let worker = self.worker;
        tokio::task::spawn_blocking(move || worker.join())
            .await
            .context("join the engine worker")?
            .map_err(|_| anyhow::anyhow!("the engine worker panicked"))?;
        served
    }
}

/// Mirrors the engine's state in `systemctl status` (`STATUS=`): every phase change, and
/// step progress at most once a second; progress inside that second is shown when it ends,
/// so a long step that starts right after another is not missed.
async fn report_status(n: Arc<crate::notify::Notifier>, engine: Engine, addr: SocketAddr) {
    use crate::engine::Event;
    use tokio::sync::broadcast::error::RecvError;
    const EVERY: Duration = Duration::from_secs(1);
    let mut events = engine.subscribe();
    let mut last = tokio::time::Instant::now() - EVERY;
    // A run whose progress came within the second and is not shown yet.
    let mut pending: Option<u64> = None;
    loop {
        let event = tokio::select! {
            e = events.recv() => e,
            () = tokio::time::sleep_until(last + EVERY), if pending.is_some() => {
                let Some(run) = pending.take() else { continue };
                let engine = engine.clone();
                let summary = tokio::task::spawn_blocking(move || {
                    engine.read(|t| t.by_run(run).filter(|s| !s.phase.is_terminal()).map(|s| s.summary()))
                })
                .await
                .ok()
                .flatten();
                if let Some(text) = summary {
                    last = tokio::time::Instant::now();
                    let _ = n.status(&text);
                }
                continue;
            }
        };
        let event = match event {
            Ok(e) => e,
            Err(RecvError::Lagged(_)) => continue,
            Err(RecvError::Closed) => return,
        };
        let text = match &event {
            Event::Status(s) if s.phase.is_terminal() => {
                pending = None;
                format!("idle; serving on {addr}; last: {}", s.summary())
            }
            Event::Status(s) => {
                pending = None;
                s.summary()
            }
            Event::Progress(p) if last.elapsed() < EVERY => {
                pending = Some(p.run);
                continue;
            }
            Event::Progress(p) => {
                let (engine, run) = (engine.clone(), p.run);
                match tokio::task::spawn_blocking(move || {
                    engine.read(|t| t.by_run(run).map(|s| s.summary()))
                })
                .await
                {
                    Ok(Some(text)) => text,
                    _ => continue,
                }
            }
        };
        last = tokio::time::Instant::now();
        let _ = n.status(&text);
    }
}

/// `inplace-agent serve`.
pub fn run(args: &ServeArgs) -> Exit {
    let config = args.config_file();
    let resolved = match args.resolve() {
        Ok(r) => r,
        // What the file sets is unknown, so are the TLS files: whether it is configured is
        // for serve itself to say, with the file and line (the unit then fails, exit 2).
        Err(_) if args.check_configured => return Exit::Ok,
        // The daemon reads a check process's answer, and tells why it could not check.
        Err(e) if args.drift_probe => {
            println!("the configuration cannot be read now ({e}); fix it and restart the agent");
            return Exit::Invalid;
        }
        Err(e) => {
            super::logging::init("info", args.log_format.unwrap_or_default(), true);
            return super::fail(&anyhow::Error::new(e));
        }
    };
    if args.check_configured {
        return configured(&resolved, config.as_deref());
    }
    if args.drift_probe {
        return match resolved {
            Ok(settings) => {
                super::logging::init("warn", settings.log_format, true);
                super::drift_probe::answer(settings)
            }
            Err(u) => {
                let all: Vec<String> = u.problems.iter().map(ToString::to_string).collect();
                println!(
                    "the configuration cannot be used now ({}); fix it and restart the agent",
                    all.join("; ")
                );
                Exit::Invalid
            }
        };
    }
    let log_format = match &resolved {
        Ok(settings) => settings.log_format,
        Err(_) => args.log_format.unwrap_or_default(),
    };
    super::logging::init("info", log_format, true);
    let findings = super::selfcheck::check(Subject::of_result(&resolved), config.as_deref());
    for warning in &findings.warnings {
        tracing::warn!("{warning}");
    }
    let settings = match resolved {
        Ok(settings) if findings.problems.is_empty() => settings,
        _ => {
            let file = config
                .as_ref()
                .map(|f| format!("the configuration {}", f.display()))
                .unwrap_or_else(|| "the flags (no configuration file)".to_string());
            errln!(
                "error: inplace-agent cannot serve with {file} ({}):",
                count(findings.problems.len())
            );
            for p in &findings.problems {
                errln!("error: {p}");
            }
            return Exit::Invalid;
        }
    };
    let mut settings = settings;
    // Drift checks read the node in a process of their own, started with these same
    // arguments (`drift_probe`).
    settings.drift.check_process = Some(crate::config::CheckCommand {
        program: super::drift_probe::SELF.into(),
        args: std::env::args_os().skip(1).collect(),
        time_limit: super::drift_probe::TIME_LIMIT,
    });
    let served = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(BLOCKING_THREADS)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .thread_name("inplace-blocking")
        .build()
        .context("start the async runtime")
        .and_then(|runtime| runtime.block_on(serve_until_signalled(settings)));
    match served {
        Ok(()) => Exit::Ok,
        Err(e) => super::fail(&e),
    }
}

/// "1 problem", "3 problems".
fn count(n: usize) -> String {
    format!("{n} problem{}", if n == 1 { "" } else { "s" })
}

/// `serve --check-configured` (the unit's `ExecCondition=`): 1 when a TLS file is missing —
/// the agent is not configured yet, and the unit is skipped, not failed — naming the missing
/// files and every other problem serve would name once they are there; 0 otherwise, when
/// serve itself either starts or refuses with exit 2 naming every problem (a configured
/// agent that cannot start is a failed unit, not a skipped one).
fn configured(
    resolved: &Result<DaemonSettings, Box<Unresolved>>,
    config: Option<&std::path::Path>,
) -> Exit {
    let subject = Subject::of_result(resolved);
    let missing = super::selfcheck::missing_tls_files(subject.tls);
    if missing.is_empty() {
        return Exit::Ok;
    }
    let list: Vec<String> = missing.iter().map(|p| p.display().to_string()).collect();
    errln!(
        "inplace-agent is not configured yet, so it does not start: missing {}. Put the \
         certificates there (docs/pki.md), then: systemctl start inplace-agent \
         (docs/install.md)",
        list.join(", "),
    );
    let findings = super::selfcheck::check(subject, config);
    let others: Vec<_> = findings
        .problems
        .iter()
        .filter(|p| !p.missing_file)
        .collect();
    if !others.is_empty() {
        errln!(
            "once they are there it would still not start ({}):",
            count(others.len())
        );
        for p in others {
            errln!("error: {p}");
        }
    }
    Exit::Failed
}

async fn serve_until_signalled(settings: DaemonSettings) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("handle SIGINT")?;
    let daemon = Daemon::start(settings).await?;
    let notifier = crate::notify::Notifier::from_env().map(Arc::new);
    if let Some(n) = &notifier {
        let ready = match daemon.engine().current() {
            Some(current) => current.summary(),
            None => format!("idle; serving on {}", daemon.addr()),
        };
        if let Err(e) = n.ready(&ready) {
            tracing::warn!(error = %e, "sd_notify READY=1 failed");
        }
        tokio::spawn(report_status(
            n.clone(),
            daemon.engine().clone(),
            daemon.addr(),
        ));
        if let Some(every) = crate::notify::watchdog_interval() {
            // Pinged from the runtime that serves the API: a wedged runtime stops the pings
            // and systemd restarts the agent (a long step on the engine thread does not).
            let n = n.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    let _ = n.watchdog();
                }
            });
        }
    }
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!("{name}: stopping after the current step");
    if let Some(n) = &notifier {
        let _ = n.stopping(&format!("{name}: stopping after the current step"));
    }
    tokio::select! {
        stopped = daemon.stop() => stopped?,
        _ = term.recv() => tracing::warn!("second signal: exiting now; the plan resumes from the journal at the next start"),
        _ = int.recv() => tracing::warn!("second signal: exiting now; the plan resumes from the journal at the next start"),
    }
    tracing::info!("stopped");
    Ok(())
}
