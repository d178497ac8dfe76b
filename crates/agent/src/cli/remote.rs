//! Client commands for a remote agent over mutual TLS: `submit`, `status`, `cancel`,
//! `retry`. Same exit codes as `apply` (0 succeeded or accepted, 1 failed or could not
//! reach the agent, 2 refused as invalid for the node); progress on stderr (a bar on a
//! terminal, a line per step otherwise), results on stdout.

use inplace_base::time::rfc3339;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tonic::transport::Channel;

use super::render::{status_json, summary};
use super::{Exit, Output};
use crate::engine::state::{ChangeState, CheckState, Phase, PlanStatus};
use crate::rpc::replies::{phase_from_pb, status_from_pb};
use inplace_api::convert::plan_to_pb;
use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::tls::{ClientTlsPaths, ConnectProblem, client_config, connect, diagnose};
use inplace_plan::{AllowList, Limits};

/// `apiVersion` of the CAPI hook response `--output hook-response` prints.
pub const HOOK_API_VERSION: &str = "hooks.runtime.cluster.x-k8s.io/v1alpha1";

/// Deadline of one unary call.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// "No deadline" for `status --watch` and `retry --wait` (a year).
pub(crate) const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Longest pause between attempts to re-watch an agent that went away (restart, reboot).
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Output of the client commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RemoteOutput {
    /// For people.
    Text,
    /// For scripts (versioned JSON, as `apply -o json`).
    Json,
    /// Exactly the `UpdateMachineResponse` CAPI expects (one line of JSON).
    HookResponse,
}

/// How to reach the agent.
#[derive(Debug, Args, Clone)]
pub struct TlsArgs {
    /// CA bundle the agent's certificate must chain to (`--cacert`, as curl names it, is
    /// taken too)
    #[arg(long, alias = "cacert", env = "INPLACE_AGENT_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// Client certificate (must carry the clientAuth usage)
    #[arg(long, env = "INPLACE_AGENT_CERT", value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// Client private key
    #[arg(long, env = "INPLACE_AGENT_KEY", value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Name to verify the agent's certificate for [default: the host of --addr]; use the
    /// node name when connecting by IP address
    #[arg(long, value_name = "NAME")]
    pub server_name: Option<String>,
}

/// Arguments of `submit`.
#[derive(Debug, Args, Clone)]
pub struct SubmitArgs {
    /// Plan file (YAML or JSON); `-` reads standard input
    pub plan: PathBuf,
    /// The agent
    #[arg(long, env = "INPLACE_AGENT_ADDR", value_name = "HOST:PORT")]
    pub addr: String,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    /// Follow the plan until it ends
    #[arg(long)]
    pub wait: bool,
    /// Start a new attempt if the plan's last attempt failed
    #[arg(long)]
    pub retry: bool,
    /// Give up waiting after this many seconds (exit 1; the plan goes on)
    #[arg(long, default_value_t = 3600, value_name = "SECONDS")]
    pub wait_timeout: u64,
    /// Never draw a progress bar, print a line per step
    #[arg(long)]
    pub no_progress: bool,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = RemoteOutput::Text)]
    pub output: RemoteOutput,
    /// Parse and validate the plan here and send it whole, as one ApplyPlan message (as the
    /// updater does), instead of streaming the file for the agent to parse as it arrives; an
    /// invalid plan is then reported before connecting (-o json: an InvalidPlan document)
    #[arg(long)]
    pub parse_locally: bool,
}

/// Which agent `status` and `drift` ask: a remote one (`--addr`, over mutual TLS), else the
/// local one through its status socket (its journal when it does not answer).
#[derive(Debug, Args, Clone)]
pub struct AgentChoice {
    /// A remote agent to ask (over mutual TLS); without it, the local agent's status socket
    #[arg(long, env = "INPLACE_AGENT_ADDR", value_name = "HOST:PORT")]
    pub addr: Option<String>,
    /// The local agent's status socket [default: status.socket of the agent's configuration,
    /// else <root>/run/inplace-agent/status.sock]
    #[arg(
        long,
        env = "INPLACE_AGENT_STATUS_SOCKET",
        value_name = "FILE",
        conflicts_with = "addr"
    )]
    pub socket: Option<PathBuf>,
    /// The node's root: where the socket and, when no agent answers, the journal are
    /// [default: node.root of the agent's configuration, else /]
    #[arg(long, env = "INPLACE_AGENT_ROOT", conflicts_with = "addr")]
    pub root: Option<PathBuf>,
    /// State directory read when no agent answers [default: <root>/var/lib/inplace-agent]
    #[arg(long, env = "INPLACE_AGENT_STATE_DIR", conflicts_with = "addr")]
    pub state_dir: Option<PathBuf>,
    /// The agent's configuration file [default: /etc/inplace-agent/config.toml, if it exists]
    #[arg(
        long,
        env = "INPLACE_AGENT_CONFIG",
        value_name = "FILE",
        conflicts_with = "addr"
    )]
    pub config: Option<PathBuf>,
    /// The node's name, for what is read or checked here (no agent serving) [default:
    /// node.name of the agent's configuration, else the last succeeded plan's nodeName, else
    /// the root's /etc/hostname]
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
}

/// Arguments of `status`.
#[derive(Debug, Args, Clone)]
pub struct StatusArgs {
    /// Plan id [default: the agent's status (with --addr: the current plan, else the most
    /// recent one)]
    pub id: Option<String>,
    #[command(flatten)]
    pub agent: AgentChoice,
    /// Follow the plan until it ends
    #[arg(long)]
    pub watch: bool,
    /// Only ask the local agent's socket for /healthz: exit 0 when it answers ok, 1 otherwise
    /// (never reads the journal); for readiness probes and scripts
    #[arg(long, conflicts_with_all = ["addr", "id", "watch"])]
    pub healthz: bool,
    /// Never draw a progress bar, print a line per step
    #[arg(long)]
    pub no_progress: bool,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = RemoteOutput::Text)]
    pub output: RemoteOutput,
}

/// Arguments of `cancel`.
#[derive(Debug, Args, Clone)]
pub struct CancelArgs {
    /// Plan id
    pub id: String,
    /// The agent
    #[arg(long, env = "INPLACE_AGENT_ADDR", value_name = "HOST:PORT")]
    pub addr: String,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    /// Why, for the agent's log
    #[arg(long, default_value = "")]
    pub reason: String,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = RemoteOutput::Text)]
    pub output: RemoteOutput,
}

/// Arguments of `retry`.
#[derive(Debug, Args, Clone)]
pub struct RetryArgs {
    /// Plan id
    pub id: String,
    /// The agent
    #[arg(long, env = "INPLACE_AGENT_ADDR", value_name = "HOST:PORT")]
    pub addr: String,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    /// The attempt you saw fail: retry only if it is still the latest (0: whatever it is)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub from_attempt: u32,
    /// Follow the new attempt until it ends
    #[arg(long)]
    pub wait: bool,
    /// Never draw a progress bar, print a line per step
    #[arg(long)]
    pub no_progress: bool,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = RemoteOutput::Text)]
    pub output: RemoteOutput,
}

// === Connecting ===

/// A client for the agent at `addr`.
pub async fn connect_agent(addr: &str, tls: &TlsArgs) -> anyhow::Result<NodeAgentClient<Channel>> {
    let need = |v: &Option<PathBuf>, flag: &str| {
        v.clone()
            .with_context(|| format!("{flag} is required to reach {addr}"))
    };
    let paths = ClientTlsPaths {
        ca: need(&tls.ca, "--ca")?,
        cert: need(&tls.cert, "--cert")?,
        key: need(&tls.key, "--key")?,
    };
    let config = client_config(&paths).context("client tls")?;
    // A connection error's message is already its whole cause chain, in the words
    // `diagnose` chose; the hint follows it.
    let channel = connect(addr, tls.server_name.as_deref(), Arc::new(config))
        .await
        .map_err(|e| match e.problem() {
            Some(problem) => anyhow::anyhow!("{e}\n  hint: {}", hint(&problem, addr, tls)),
            None => anyhow::anyhow!("{e}"),
        })?;
    Ok(NodeAgentClient::new(channel))
}

/// What to do about a connection problem, naming the flags and keys involved.
pub(crate) fn hint(problem: &ConnectProblem, addr: &str, tls: &TlsArgs) -> String {
    let file = |f: &Option<PathBuf>| {
        f.as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    match problem {
        ConnectProblem::Refused => format!(
            "nothing accepts connections on {addr}: is the agent running, and is this its \
             grpc.listen address? On the node: systemctl status inplace-agent"
        ),
        ConnectProblem::TimedOut => format!(
            "no answer from {addr}: a firewall may drop the connection (the agent listens on TCP \
             9443 by default), or the node is down or rebooting"
        ),
        ConnectProblem::WrongName { presented, .. } => {
            let name = presented
                .iter()
                .find(|n| n.parse::<std::net::IpAddr>().is_err() && *n != "localhost")
                .map(|n| format!(" (such as --server-name {n})"))
                .unwrap_or_default();
            format!(
                "pass --server-name with the node's name that the certificate has{name}; when \
                 connecting by IP address the name to verify is the node's name"
            )
        }
        ConnectProblem::UnknownIssuer | ConnectProblem::BadSignature => format!(
            "--ca {} does not hold the CA that issued the agent's certificate: pass the agents' \
             CA bundle with --ca (docs/pki.md)",
            file(&tls.ca)
        ),
        ConnectProblem::Expired { .. } => "renew the agent's certificate on the node (tls.cert in \
             its configuration; docs/pki.md): the agent re-reads it without a restart"
            .to_string(),
        ConnectProblem::NotYetValid { .. } => {
            "check the clocks of this machine and of the CA that issued it".to_string()
        }
        ConnectProblem::NotBoundToCluster { required, .. } => format!(
            "issue the agent's certificate (tls.cert) with the URI SAN {required} (docs/pki.md)"
        ),
        ConnectProblem::WrongKeyUsage => "the agent's certificate (tls.cert) must carry the \
             serverAuth extended key usage (docs/pki.md)"
            .to_string(),
        ConnectProblem::Closed => format!(
            "the agent closed the connection at once; most likely it did not accept --cert {}: \
             its log on the node says why: journalctl -u inplace-agent | grep 'tls handshake \
             failed'",
            file(&tls.cert)
        ),
        ConnectProblem::RefusedByPeer(_) => format!(
            "the agent did not accept --cert {}; its log on the node says why: journalctl -u \
             inplace-agent | grep 'tls handshake failed' (reason=unknown_issuer: not issued by \
             the agent's tls.client_ca; expired; wrong_key_usage: no clientAuth usage)",
            file(&tls.cert)
        ),
        ConnectProblem::NotTls => {
            format!("{addr} does not answer like the agent: is it the agent's grpc.listen address?")
        }
    }
}

pub(crate) fn call<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CALL_TIMEOUT);
    request
}

/// Lowercase name of a gRPC code (`permission denied`).
fn code_name(code: tonic::Code) -> String {
    let debug = format!("{code:?}");
    let mut out = String::new();
    for (i, c) in debug.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push(' ');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// Prints a failed call and returns the exit code: 2 when the agent refused the input
/// (invalid, too large, not for this node), 1 otherwise. A call that failed on the way (the
/// connection, its TLS) says why, with the whole cause chain and what to do.
pub(crate) fn refused(what: &str, addr: &str, tls: &TlsArgs, status: &tonic::Status) -> Exit {
    let diagnosis = diagnose(status);
    match &diagnosis.problem {
        Some(problem) => errln!(
            "error: {what} on {addr}: {}: {}\n  hint: {}",
            code_name(status.code()),
            diagnosis.chain(),
            hint(problem, addr, tls)
        ),
        None => errln!(
            "error: {what} on {addr}: {}: {}",
            code_name(status.code()),
            diagnosis.chain()
        ),
    }
    Exit::of_call(status)
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, Exit> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
        .map_err(|e| super::fail(&e))
}

// === Output ===

/// The CAPI `UpdateMachineResponse` for a hook response, as one line of JSON with the keys
/// in the order CAPI documents them.
pub fn hook_response_json(hook: &pb::HookResponse) -> String {
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct UpdateMachineResponse<'a> {
        api_version: &'static str,
        kind: &'static str,
        status: &'static str,
        message: &'a str,
        retry_after_seconds: i32,
    }
    let status = match pb::HookStatus::try_from(hook.status) {
        Ok(pb::HookStatus::Success) => "Success",
        _ => "Failure",
    };
    serde_json::to_string(&UpdateMachineResponse {
        api_version: HOOK_API_VERSION,
        kind: "UpdateMachineResponse",
        status,
        message: &hook.message,
        retry_after_seconds: hook.retry_after_seconds,
    })
    .unwrap_or_default()
}

/// A status for people: identity, phase, every change and check, the error and the hook
/// response.
pub fn describe(status: &PlanStatus) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!(
        "plan {} ({}) attempt {}, run {}, from {}",
        status.id, status.digest, status.attempt, status.run, status.source
    ));
    let p = &status.progress;
    line(format!(
        "phase: {} (step {}/{}{})",
        status.phase,
        p.current,
        p.total,
        if p.message.is_empty() {
            String::new()
        } else {
            format!(": {}", p.message)
        }
    ));
    let mut times = format!("accepted {}", rfc3339(status.accepted_at_ms));
    if let Some(t) = status.started_at_ms {
        times.push_str(&format!(", started {}", rfc3339(t)));
    }
    if let Some(t) = status.finished_at_ms {
        times.push_str(&format!(", finished {}", rfc3339(t)));
    }
    line(times);
    let n = status.changes.len();
    for c in &status.changes {
        let detail = if c.message.is_empty() {
            String::new()
        } else {
            format!(": {}", c.message)
        };
        line(format!(
            "  [{}/{n}] changes[{}] {} {}: {:?}{detail}",
            c.index + 1,
            c.index,
            c.kind,
            c.target,
            c.state
        ));
    }
    for c in &status.checks {
        let detail = if c.message.is_empty() {
            String::new()
        } else {
            format!(": {}", c.message)
        };
        line(format!(
            "  verify[{}] {} {}: {:?}{detail}",
            c.index, c.kind, c.target, c.state
        ));
    }
    for e in &status.events {
        line(format!("  {} {}", rfc3339(e.at_ms), e.message));
    }
    let counts = status.counts;
    line(format!(
        "changes: {} total, {} changed, {} unchanged, {} rolled back",
        counts.total, counts.changed, counts.unchanged, counts.rolled_back
    ));
    if let Some(e) = &status.error {
        line(format!("error ({}): {e}", e.kind.as_str()));
    }
    let hook = status.hook_response();
    line(format!(
        "hook response: {:?}, retry after {}s: {}",
        hook.status, hook.retry_after_seconds, hook.message
    ));
    out.trim_end().to_owned()
}

/// Prints a final (or current) status in the chosen format.
fn print_status(wire: &pb::PlanStatus, output: RemoteOutput, detailed: bool) -> Result<(), Exit> {
    if output == RemoteOutput::HookResponse {
        let hook = wire.hook_response.clone().unwrap_or_default();
        outln!("{}", hook_response_json(&hook));
        return Ok(());
    }
    let status = status_from_pb(wire).map_err(|e| {
        errln!("error: the agent's answer: {e}");
        Exit::Failed
    })?;
    match output {
        RemoteOutput::Json => outln!("{:#}", status_json(&status)),
        _ if detailed => outln!("{}", describe(&status)),
        _ => outln!("{}", summary(&status)),
    }
    Ok(())
}

fn is_terminal(wire: &pb::PlanStatus) -> bool {
    phase_from_pb(wire.phase).is_some_and(Phase::is_terminal)
}

fn exit_for(wire: &pb::PlanStatus) -> Exit {
    // A phase this client does not know is not one it can call failed.
    phase_from_pb(wire.phase).map_or(Exit::Ok, Exit::of_phase)
}

// === Following a plan ===

/// Shows successive snapshots of one plan: a bar on a terminal, otherwise a line per phase
/// and per change or check that finished.
pub(crate) struct SnapshotView {
    bar: Option<ProgressBar>,
    last: Option<PlanStatus>,
    /// The newest event shown (journal sequence number).
    shown_seq: u64,
}

impl SnapshotView {
    pub(crate) fn new(plain: bool) -> SnapshotView {
        let bar = (!plain && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{bar:30}] {pos}/{len} {elapsed} {wide_msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        SnapshotView {
            bar,
            last: None,
            shown_seq: 0,
        }
    }

    pub(crate) fn line(&self, s: &str) {
        match &self.bar {
            Some(bar) => bar.println(s),
            None => errln!("{s}"),
        }
    }

    pub(crate) fn show(&mut self, status: PlanStatus) {
        let last = self.last.take();
        if let Some(bar) = &self.bar {
            bar.set_length(u64::from(status.progress.total));
            bar.set_position(u64::from(status.progress.current));
            bar.set_message(format!("{}: {}", status.phase, status.progress.message));
        }
        let new_phase = last.as_ref().map(|l| (l.run, l.phase)) != Some((status.run, status.phase));
        let same_run = last.as_ref().filter(|l| l.run == status.run);
        let n = status.changes.len();
        let width = n.to_string().len();
        for c in &status.changes {
            let before = same_run.and_then(|l| l.changes.get(c.index as usize));
            if before.is_some_and(|b| b.state == c.state) {
                continue;
            }
            let state = match c.state {
                ChangeState::Changed => "changed",
                ChangeState::Unchanged => "unchanged",
                ChangeState::Failed => "FAILED",
                ChangeState::RolledBack => "rolled back",
                ChangeState::RollbackFailed => "NOT RESTORED",
                ChangeState::Skipped => "skipped",
                ChangeState::Running | ChangeState::Pending => continue,
            };
            let detail = match c.state {
                ChangeState::Failed | ChangeState::RollbackFailed => format!(": {}", c.message),
                ChangeState::Changed if !c.message.is_empty() => format!(" ({})", c.message),
                _ => String::new(),
            };
            self.line(&format!(
                "  [{:>width$}/{n}] changes[{}] {} {}: {state}{detail}",
                c.index + 1,
                c.index,
                c.kind,
                c.target
            ));
        }
        // Unit jobs, reloads, reboots, agent restarts: as they happen.
        for e in status.events.iter().filter(|e| e.seq > self.shown_seq) {
            self.line(&format!("  {}", e.message));
        }
        if let Some(e) = status.events.last() {
            self.shown_seq = self.shown_seq.max(e.seq);
        }
        for c in &status.checks {
            let before = same_run.and_then(|l| l.checks.get(c.index as usize));
            if before.is_some_and(|b| b.state == c.state) {
                continue;
            }
            let state = match c.state {
                CheckState::Passed => "passed",
                CheckState::Failed => "FAILED",
                _ => continue,
            };
            self.line(&format!(
                "  verify[{}] {} {}: {state}: {}",
                c.index, c.kind, c.target, c.message
            ));
        }
        // After the changes and checks: a phase snapshot reports what led to the phase.
        if new_phase {
            self.line(&format!(
                "  plan {} attempt {}: {}",
                status.id, status.attempt, status.phase
            ));
        }
        if status.phase.is_terminal()
            && let Some(bar) = self.bar.take()
        {
            bar.finish_and_clear();
        }
        self.last = Some(status);
    }
}

/// Follows `id` with WatchPlan until a snapshot with a terminal phase, showing progress.
/// When the agent goes away (restart, node reboot) it watches again, backing off up to
/// 5 seconds between tries, until `timeout`.
pub async fn follow(
    client: &mut NodeAgentClient<Channel>,
    id: &str,
    plain: bool,
    timeout: Duration,
) -> anyhow::Result<pb::PlanStatus> {
    let deadline = Instant::now() + timeout;
    let mut view = SnapshotView::new(plain);
    let mut backoff = Duration::from_millis(200);
    let mut last: Option<pb::PlanStatus> = None;
    // When the agent went away (for the message when it is back).
    let mut lost_since: Option<Instant> = None;
    loop {
        let outcome = async {
            let mut stream = client
                .watch_plan(pb::WatchPlanRequest { id: id.to_owned() })
                .await?
                .into_inner();
            while let Some(snapshot) = stream.message().await? {
                if let Some(since) = lost_since.take() {
                    view.line(&format!(
                        "  (the agent answers again after {}s; following the plan from its \
                         status: {} step {}/{})",
                        since.elapsed().as_secs(),
                        phase_from_pb(snapshot.phase).map_or("?".to_string(), |p| p.to_string()),
                        snapshot.step.as_ref().map_or(0, |s| s.index),
                        snapshot.step.as_ref().map_or(0, |s| s.total)
                    ));
                    backoff = Duration::from_millis(200);
                }
                if let Ok(status) = status_from_pb(&snapshot) {
                    view.show(status);
                }
                let done = is_terminal(&snapshot);
                last = Some(snapshot);
                if done {
                    break;
                }
            }
            Ok::<(), tonic::Status>(())
        };
        let result = tokio::time::timeout_at(deadline.into(), outcome).await;
        match result {
            Err(_) => bail!(
                "plan {id} did not finish within {}s (it goes on; see inplace-agent status)",
                timeout.as_secs()
            ),
            Ok(Ok(())) => {
                if let Some(status) = last.take_if(|s| is_terminal(s)) {
                    return Ok(status);
                }
            }
            Ok(Err(status)) => match status.code() {
                // The connection or the agent went away (a restart, a reboot, a drained
                // connection): not an answer about the plan.
                tonic::Code::Unavailable
                | tonic::Code::Unknown
                | tonic::Code::Cancelled
                | tonic::Code::Internal
                | tonic::Code::Aborted
                | tonic::Code::DeadlineExceeded => {
                    if lost_since.is_none() {
                        view.line(&format!(
                            "  (lost the agent: {}; trying again every few seconds)",
                            diagnose(&status).chain()
                        ));
                        lost_since = Some(Instant::now());
                    }
                }
                _ => bail!(
                    "watch {id}: {}: {}",
                    code_name(status.code()),
                    status.message()
                ),
            },
        }
        if Instant::now() + backoff >= deadline {
            bail!(
                "plan {id} did not finish within {}s (it goes on; see inplace-agent status)",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

// === Commands ===

/// What the client validates locally: the plan's shape only. Node policy (allow-list, http
/// hosts, size limits) is the agent's to apply.
fn client_limits() -> Limits {
    Limits {
        allow: AllowList::everything(),
        allow_http_hosts: vec!["*".to_owned()],
        ..Limits::replay()
    }
}

/// How a plan that cannot be read is printed for `output`.
fn output_of(output: RemoteOutput) -> Output {
    if output == RemoteOutput::Json {
        Output::Json
    } else {
        Output::Text
    }
}

/// `inplace-agent submit`: the plan file goes to the agent as it is written, in pieces as
/// it is read (`SubmitPlanDocument`), and the agent validates it; an agent older than that
/// call gets it parsed and validated here first, through `ApplyPlan`.
pub fn submit(args: &SubmitArgs) -> Exit {
    let document = match Document::open(&args.plan) {
        Ok(d) => d,
        Err(e) => {
            errln!("error: read plan {}: {e}", args.plan.display());
            return Exit::Invalid;
        }
    };
    let name = args.plan.display().to_string();
    // What is parsed here (when asked, or for an older agent): standard input (or a pipe)
    // cannot be read twice, so its bytes, already read, are kept.
    let kept = match &document {
        Document::Memory(all) => Some(all.clone()),
        Document::File(..) => None,
    };
    let parse_here = || match &kept {
        Some(all) => super::apply::read_plan_from(
            &mut &all[..],
            &name,
            &client_limits(),
            output_of(args.output),
        ),
        None => super::apply::read_plan_path(&args.plan, &client_limits(), output_of(args.output)),
    };
    // Asked to parse here: before connecting, so an invalid plan is said without an agent.
    let parsed = if args.parse_locally {
        match parse_here() {
            Ok(plan) => Some(plan),
            Err(code) => return code,
        }
    } else {
        None
    };
    let runtime = match runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let mut client = match connect_agent(&args.addr, &args.tls).await {
            Ok(c) => c,
            Err(e) => return super::fail(&e),
        };
        let plan = match parsed {
            Some(plan) => plan,
            None => match send_document(&mut client, document, &name, args.retry).await {
                Ok(response) => return submitted(&mut client, response, args).await,
                Err(status) if predates_documents(&status) => match parse_here() {
                    Ok(plan) => plan,
                    Err(code) => return code,
                },
                Err(status) => {
                    return refused(
                        &format!("submit plan {name}"),
                        &args.addr,
                        &args.tls,
                        &status,
                    );
                }
            },
        };
        let request = pb::ApplyPlanRequest {
            plan: Some(plan_to_pb(&plan)),
            retry: args.retry,
        };
        match client.apply_plan(call(request)).await {
            Ok(response) => submitted(&mut client, response.into_inner(), args).await,
            Err(status) => refused(
                &format!("apply plan {}", plan.id),
                &args.addr,
                &args.tls,
                &status,
            ),
        }
    })
}

/// The rest of `submit` once the agent answered: says whether the plan is new, follows it
/// with `--wait`, prints it and returns the exit code.
async fn submitted(
    client: &mut NodeAgentClient<Channel>,
    response: pb::ApplyPlanResponse,
    args: &SubmitArgs,
) -> Exit {
    let Some(status) = response.status else {
        errln!(
            "error: the agent at {} answered without a status",
            args.addr
        );
        return Exit::Failed;
    };
    if !response.created {
        let phase = phase_from_pb(status.phase).map_or("?".to_owned(), |p| p.to_string());
        errln!(
            "plan {} ({}) is already known to the agent: attempt {}, {phase}; nothing new starts{}",
            status.id,
            status.digest,
            status.attempt,
            if is_terminal(&status) && exit_for(&status) != Exit::Ok {
                " (use --retry to run it again)"
            } else {
                ""
            }
        );
    } else if args.output == RemoteOutput::Text {
        errln!(
            "plan {} ({}) accepted by {}: attempt {}, run {}",
            status.id,
            status.digest,
            args.addr,
            status.attempt,
            status.run
        );
    }
    let wait = args.wait.then(|| Duration::from_secs(args.wait_timeout));
    conclude(client, status, wait, args.no_progress, args.output, false).await
}

/// True when the agent answered `SubmitPlanDocument` as an agent that does not have it:
/// UNIMPLEMENTED, or (agents before it, whose authorization knows no such method)
/// PERMISSION_DENIED because the method is not callable.
fn predates_documents(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::Unimplemented => true,
        tonic::Code::PermissionDenied => status.message().ends_with("method is not callable"),
        _ => false,
    }
}

/// A plan file to send: a regular file is read as it is sent; standard input (`-`, or
/// anything whose length is not known beforehand) is read whole first.
enum Document {
    File(std::fs::File, u64),
    Memory(bytes::Bytes),
}

impl Document {
    fn open(path: &Path) -> std::io::Result<Document> {
        use std::io::Read;
        let mut input: Box<dyn Read> = if path.as_os_str() == "-" {
            Box::new(std::io::stdin().lock())
        } else {
            let file = std::fs::File::open(path)?;
            let meta = file.metadata()?;
            if meta.is_file() {
                return Ok(Document::File(file, meta.len()));
            }
            Box::new(file)
        };
        let mut all = Vec::new();
        input.read_to_end(&mut all)?;
        Ok(Document::Memory(all.into()))
    }

    fn len(&self) -> u64 {
        match self {
            Document::File(_, len) => *len,
            Document::Memory(b) => b.len() as u64,
        }
    }
}

/// Sends `document` through `SubmitPlanDocument`: its length first (in the metadata),
/// then its pieces as they are read, on a thread of their own.
async fn send_document(
    client: &mut NodeAgentClient<Channel>,
    document: Document,
    name: &str,
    retry: bool,
) -> Result<pb::ApplyPlanResponse, tonic::Status> {
    use inplace_api::document::{DOCUMENT_BYTES, PIECE_BYTES};
    type Pieces = tokio::sync::mpsc::Sender<pb::PlanDocumentPiece>;
    let len = document.len();
    // The pieces are 1 MiB each: with the agent's allocator settings for large requests
    // this process reuses their memory instead of mapping (and faulting in) each one afresh
    // (the CPU time of `submit` of a 50 MiB plan, medians of twelve rounds: 52.4 → 45.3 ms).
    crate::host::memory::for_large_requests(true);
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::PlanDocumentPiece>(2);
    let first = pb::PlanDocumentPiece {
        data: bytes::Bytes::new(),
        retry,
        name: name.to_owned(),
    };
    let _ = tx.try_send(first);
    // A file that cannot be sent as it was when its length was taken: why, with the pieces'
    // sender, so that the stream is not ended normally (the agent would take the document
    // as whole) before the call is abandoned.
    let (abandon, abandoned) = tokio::sync::oneshot::channel::<(String, Pieces)>();
    // The reader stops when the call ends early (the channel closes): nothing waits on it.
    std::thread::spawn(move || match document {
        Document::Memory(all) => {
            let mut at = 0;
            while at < all.len() {
                let end = (at + PIECE_BYTES).min(all.len());
                let piece = pb::PlanDocumentPiece {
                    data: all.slice(at..end),
                    ..Default::default()
                };
                if tx.blocking_send(piece).is_err() {
                    return;
                }
                at = end;
            }
        }
        Document::File(file, len) => {
            if let Err(why) = send_file(file, len, PIECE_BYTES, &tx) {
                let _ = abandon.send((why, tx));
            }
        }
    });
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request.set_timeout(CALL_TIMEOUT);
    let value = len
        .to_string()
        .parse()
        .map_err(|_| tonic::Status::internal("a length that is not a header value"))?;
    request.metadata_mut().insert(DOCUMENT_BYTES, value);
    tokio::select! {
        result = client.submit_plan_document(request) => result.map(|r| r.into_inner()),
        Ok((why, pieces)) = abandoned => {
            // The pieces' stream must never end normally now: its end, with every declared
            // byte sent, is what makes the agent take the document as whole. Its sender is
            // kept until the process ends, which breaks the connection under the call.
            std::mem::forget(pieces);
            Err(tonic::Status::aborted(format!(
                "read plan {name}: {why}; the call was abandoned and nothing was accepted"
            )))
        }
    }
}

/// Sends the `len` bytes of `file` into `pieces`, `piece_bytes` at a time, and checks that
/// the file ends there: Ok also when the call ended early (the channel closed); an error
/// when the file cannot be read, or holds fewer or more bytes than `len` now (it changed
/// since its length was taken: what was sent is not the file, and a part of a plan can be
/// a plan by itself).
fn send_file(
    mut file: std::fs::File,
    len: u64,
    piece_bytes: usize,
    pieces: &tokio::sync::mpsc::Sender<pb::PlanDocumentPiece>,
) -> Result<(), String> {
    use std::io::Read;
    let mut left = len;
    while left > 0 {
        let want = piece_bytes.min(left as usize);
        let mut buf = Vec::with_capacity(want);
        let n = match (&mut file).take(want as u64).read_to_end(&mut buf) {
            Ok(0) => {
                return Err(format!(
                    "the file ended after {} of its {len} bytes: it changed while it was sent",
                    len - left
                ));
            }
            Ok(n) => n,
            Err(e) => return Err(e.to_string()),
        };
        left -= n as u64;
        let piece = pb::PlanDocumentPiece {
            data: buf.into(),
            ..Default::default()
        };
        if pieces.blocking_send(piece).is_err() {
            return Ok(());
        }
    }
    match file.read(&mut [0u8; 1]) {
        Ok(0) => Ok(()),
        Ok(_) => Err(format!(
            "the file grew beyond the {len} bytes it had: it changed while it was sent"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// The end of `submit`, `status` and `retry`: follows the plan to its end when `wait` says
/// for how long (and it has not ended yet), prints it, and returns the exit code.
pub(crate) async fn conclude(
    client: &mut NodeAgentClient<Channel>,
    mut status: pb::PlanStatus,
    wait: Option<Duration>,
    plain: bool,
    output: RemoteOutput,
    detailed: bool,
) -> Exit {
    if let Some(timeout) = wait
        && !is_terminal(&status)
    {
        let id = status.id.clone();
        status = match follow(client, &id, plain, timeout).await {
            Ok(s) => s,
            Err(e) => return super::fail(&e),
        };
    }
    if let Err(code) = print_status(&status, output, detailed) {
        return code;
    }
    exit_for(&status)
}

/// `inplace-agent status --addr`: a remote agent's status (without `--addr` it is the
/// local agent's, `status::local`).
pub fn status(args: &StatusArgs, addr: &str) -> Exit {
    let runtime = match runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    let id = args.id.clone().unwrap_or_default();
    runtime.block_on(async {
        let mut client = match connect_agent(addr, &args.agent.tls).await {
            Ok(c) => c,
            Err(e) => return super::fail(&e),
        };
        let request = pb::GetPlanStatusRequest { id: id.clone() };
        let status = match client.get_plan_status(call(request)).await {
            Ok(r) => r.into_inner(),
            Err(status) => return refused("get plan status", addr, &args.agent.tls, &status),
        };
        let wait = args.watch.then_some(FOREVER);
        conclude(
            &mut client,
            status,
            wait,
            args.no_progress,
            args.output,
            true,
        )
        .await
    })
}

/// `inplace-agent cancel`.
pub fn cancel(args: &CancelArgs) -> Exit {
    let runtime = match runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let mut client = match connect_agent(&args.addr, &args.tls).await {
            Ok(c) => c,
            Err(e) => return super::fail(&e),
        };
        let request = pb::CancelPlanRequest {
            id: args.id.clone(),
            reason: args.reason.clone(),
        };
        let status = match client.cancel_plan(call(request)).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                return refused(
                    &format!("cancel plan {}", args.id),
                    &args.addr,
                    &args.tls,
                    &status,
                );
            }
        };
        if let Err(code) = print_status(&status, args.output, true) {
            return code;
        }
        Exit::Ok
    })
}

/// `inplace-agent retry`.
pub fn retry(args: &RetryArgs) -> Exit {
    let runtime = match runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let mut client = match connect_agent(&args.addr, &args.tls).await {
            Ok(c) => c,
            Err(e) => return super::fail(&e),
        };
        let request = pb::RetryPlanRequest {
            id: args.id.clone(),
            from_attempt: args.from_attempt,
        };
        let status = match client.retry_plan(call(request)).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                return refused(
                    &format!("retry plan {}", args.id),
                    &args.addr,
                    &args.tls,
                    &status,
                );
            }
        };
        let wait = args.wait.then_some(FOREVER);
        conclude(
            &mut client,
            status,
            wait,
            args.no_progress,
            args.output,
            false,
        )
        .await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_response_json_is_exactly_what_capi_expects() {
        let hook = pb::HookResponse {
            status: pb::HookStatus::Failure as i32,
            message: "plan x failed and was rolled back: verify[0] httpGet \"u\": answered 500"
                .into(),
            retry_after_seconds: 0,
        };
        assert_eq!(
            hook_response_json(&hook),
            r#"{"apiVersion":"hooks.runtime.cluster.x-k8s.io/v1alpha1","kind":"UpdateMachineResponse","status":"Failure","message":"plan x failed and was rolled back: verify[0] httpGet \"u\": answered 500","retryAfterSeconds":0}"#
        );
        let in_progress = pb::HookResponse {
            status: pb::HookStatus::Success as i32,
            message: "plan x: Applying".into(),
            retry_after_seconds: 10,
        };
        assert!(hook_response_json(&in_progress).ends_with(
            r#""status":"Success","message":"plan x: Applying","retryAfterSeconds":10}"#
        ));
    }

    #[test]
    fn a_plan_file_is_sent_only_as_it_was_when_its_length_was_taken() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.yaml");
        std::fs::write(&path, vec![b'x'; 1000]).unwrap();
        let send = |len: u64| {
            let (tx, mut rx) = tokio::sync::mpsc::channel(64);
            let result = send_file(std::fs::File::open(&path).unwrap(), len, 300, &tx);
            drop(tx);
            let mut sent = Vec::new();
            while let Some(piece) = rx.blocking_recv() {
                sent.push(piece.data.len());
            }
            (result, sent)
        };
        assert_eq!(send(1000), (Ok(()), vec![300, 300, 300, 100]));
        // It grew since (its length was 600 then): what was sent is a part of it.
        let (grew, sent) = send(600);
        assert!(grew.unwrap_err().contains("grew beyond the 600 bytes"));
        assert_eq!(sent, vec![300, 300]);
        // It shrank since.
        let (shrank, _) = send(1200);
        assert!(
            shrank
                .unwrap_err()
                .contains("ended after 1000 of its 1200 bytes")
        );
    }

    #[test]
    fn agents_without_plan_documents_are_recognised_by_their_answer() {
        assert!(predates_documents(&tonic::Status::unimplemented("")));
        assert!(predates_documents(&tonic::Status::permission_denied(
            "spiffe://inplace-agent/updater: method is not callable"
        )));
        assert!(!predates_documents(&tonic::Status::permission_denied(
            "spiffe://x: role reader may not call this method, it requires admin"
        )));
        assert!(!predates_documents(&tonic::Status::invalid_argument(
            "changes[0].file.mode: is not an octal mode"
        )));
    }

    #[test]
    fn code_names_are_lowercase_words() {
        assert_eq!(
            code_name(tonic::Code::PermissionDenied),
            "permission denied"
        );
        assert_eq!(code_name(tonic::Code::Unavailable), "unavailable");
    }
}
