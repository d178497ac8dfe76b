//! `inplace-updater` subcommands: `serve`, `translate`, `explain`, `version`, `demo`.
//!
//! Exit codes: 0 success, 1 a runtime failure (the server could not start), 2 invalid input.

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::agent::ClientFiles;
use super::deadlines::ConnectionLimits;
use super::errors::chain;
use super::server::Server;
use super::settings::{Defaults, Settings};
use super::setup::build;
use super::translate::{Desired, NoSecrets, NodeFacts, translate};
use crate::edge::kubeconfig::LocalServers;

#[derive(Debug, Parser)]
#[command(
    name = "inplace-updater",
    version,
    about = "Cluster API Runtime Extension that updates Machines in place through inplace-agent",
    long_about = "Answers Cluster API's CanUpdateMachine, CanUpdateMachineSet and UpdateMachine \
                  hooks: translates the desired Machine and KubeadmConfig into an inplace-agent \
                  plan and drives the node's agent. Try `inplace-updater demo`."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The command line of `inplace-updater` (for tests that check what messages name).
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the Runtime Extension over HTTPS
    Serve(ServeArgs),
    /// Print the plan a desired Machine and KubeadmConfig translate to
    Translate(TranslateArgs),
    /// Would a proposed change of a MachineDeployment or KubeadmControlPlane go in place,
    /// and why not (before you apply it)
    Explain(super::explain::ExplainArgs),
    /// Print the version
    Version,
    /// Emulated Cluster API calls drive a real agent on a sandbox node
    Demo(super::demo::DemoArgs),
}

/// Log line format.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Plain,
    Json,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on (HTTPS)
    #[arg(long, default_value = "0.0.0.0:9443", value_parser = inplace_base::parse_socket_addr)]
    listen: SocketAddr,
    /// Serving certificate (PEM; re-read when it changes)
    #[arg(long)]
    tls_cert: PathBuf,
    /// Its private key (PEM)
    #[arg(long)]
    tls_key: PathBuf,
    /// CA bundle the agents' certificates chain to under the setting agentCA: File (the
    /// default); not needed when every ExtensionConfig sets agentCA: ClusterSecret
    ///
    /// Trust modes (the ExtensionConfig setting agentCA): File needs --agent-ca, --agent-cert
    /// and --agent-key; ClusterSecret needs --agent-cert and --agent-key (each cluster's CA
    /// Secret verifies its agents). Without --agent-ca, calls under File are refused,
    /// naming this flag.
    #[arg(long)]
    agent_ca: Option<PathBuf>,
    /// Client certificate presented to agents (admin role)
    #[arg(long)]
    agent_cert: PathBuf,
    /// Its private key
    #[arg(long)]
    agent_key: PathBuf,
    /// Port of the agents' gRPC API (the ExtensionConfig setting agentPort wins)
    #[arg(long, default_value_t = 9443)]
    agent_port: u16,
    /// kubeconfig of the management cluster (default: in-cluster configuration)
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The ExtensionConfig that registers this updater, whose settings govern every call
    /// about an object in a namespace it selects (repeat for several); a request whose
    /// settings are not those of one of them is refused
    #[arg(long = "extension-config", value_name = "NAME",
          default_value = super::edge::extension_config::DEFAULT_NAME)]
    extension_configs: Vec<String>,
    /// Log format
    #[arg(long, value_enum, default_value = "plain")]
    log_format: LogFormat,
    /// Runtime worker threads
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Seconds an idle kept-alive connection stays open; keep it above Cluster API's client
    /// pool (Go: 90 s), or a pooled connection may be closed as a call is sent on it
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout: u64,
    /// Allow workload clusters whose kubeconfig server is on a loopback, link-local or
    /// unspecified address (test rigs only: a tenant's kubeconfig could aim the updater's
    /// requests at its own host)
    #[arg(long)]
    allow_local_workload_servers: bool,
}

/// Output format of `translate`.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Output {
    Yaml,
    Json,
}

#[derive(Debug, clap::Args)]
struct TranslateArgs {
    /// The desired Machine (YAML or JSON)
    #[arg(long)]
    machine: PathBuf,
    /// The desired KubeadmConfig (YAML or JSON)
    #[arg(long)]
    bootstrap_config: PathBuf,
    /// The node (default: the Machine's status.nodeRef.name)
    #[arg(long)]
    node_name: Option<String>,
    /// Output format
    #[arg(long, value_enum, default_value = "yaml")]
    output: Output,
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match cli.command {
        Command::Version => {
            println!(
                "inplace-updater {} ({})",
                crate::BUILD.version,
                crate::BUILD.describe_commit()
            );
            ExitCode::SUCCESS
        }
        Command::Translate(args) => match translate_cmd(&args) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("inplace-updater translate: {}", chain(&e));
                ExitCode::from(2)
            }
        },
        Command::Serve(args) => {
            init_logging(args.log_format);
            match run_serve(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    let e = chain(&e);
                    tracing::error!("{e}");
                    eprintln!("inplace-updater serve: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Demo(args) => super::demo::run(&args),
        Command::Explain(args) => super::explain::run(&args),
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("INPLACE_UPDATER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Plain => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
}

fn read_object(path: &PathBuf) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let value: Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(&text)
            .with_context(|| format!("{}: malformed JSON", path.display()))?
    } else {
        serde_yaml_ng::from_str(&text)
            .with_context(|| format!("{}: malformed YAML", path.display()))?
    };
    Ok(value)
}

fn translate_cmd(args: &TranslateArgs) -> anyhow::Result<String> {
    let machine = read_object(&args.machine)?;
    let bootstrap = read_object(&args.bootstrap_config)?;
    let node = match &args.node_name {
        Some(n) => n.clone(),
        None => super::translate::lookup(&machine, &["status", "nodeRef", "name"])
            .and_then(Value::as_str)
            .map(str::to_owned)
            .with_context(|| {
                format!(
                    "{}: no status.nodeRef.name; pass --node-name",
                    args.machine.display()
                )
            })?,
    };
    let settings = Settings::defaults(&Defaults::default());
    let t = translate(
        &Desired {
            machine: &machine,
            infrastructure: None,
            bootstrap: Some(&bootstrap),
        },
        &settings,
        &NodeFacts::assumed(&node),
        &NoSecrets,
    )?;
    Ok(match args.output {
        Output::Json => format!("{}\n", serde_json::to_string_pretty(&t.document)?),
        Output::Yaml => serde_yaml_ng::to_string(&t.document)?,
    })
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .max_blocking_threads(4)
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async move {
        let local = if args.allow_local_workload_servers {
            tracing::warn!(
                "--allow-local-workload-servers: a workload cluster's kubeconfig may point at a \
                 loopback, link-local or unspecified address (this host, its metadata service); \
                 meant for test rigs, never for a management cluster with tenants"
            );
            LocalServers::Allow
        } else {
            LocalServers::Refuse
        };
        let (updater, tls) = build(
            &args.tls_cert,
            &args.tls_key,
            ClientFiles {
                ca: args.agent_ca.clone(),
                cert: args.agent_cert.clone(),
                key: args.agent_key.clone(),
            },
            args.agent_port,
            args.kubeconfig.as_deref(),
            args.extension_configs.clone(),
            local,
        )
        .await?;
        let limits = ConnectionLimits {
            idle: Duration::from_secs(args.idle_timeout),
            ..ConnectionLimits::default()
        };
        if args.agent_ca.is_none() {
            tracing::info!(
                "no --agent-ca: calls under agentCA: ClusterSecret are served, calls under \
                 agentCA: File (the default) are refused naming the flag"
            );
        }
        let server = Server::start(args.listen, tls, updater, limits).await?;
        tracing::info!(
            extension_configs = %args.extension_configs.join(","),
            "inplace-updater {} listening on {}",
            env!("CARGO_PKG_VERSION"),
            server.addr
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("install the SIGTERM handler")?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutting down");
        server.shutdown().await;
        Ok(())
    })
}
