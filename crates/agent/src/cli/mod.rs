//! Command-line entry points. Exit codes: 0 succeeded (or nothing to do), 1 the plan failed
//! or was rolled back (or the agent could not run it), 2 the input was invalid and nothing
//! was changed; `drift` alone: 1 drifted, 3 unknown (the check could not be made).
//!
//! Everything the commands print goes through `outln!` and `errln!`: a reader that goes
//! away (`inplace-agent journal | head`) ends the output quietly instead of a panic.

/// `println!` that never panics: when standard output is closed (its reader went away) the
/// line is dropped and [`stdout_closed`] turns true, so long output can stop early.
macro_rules! outln {
    () => { $crate::cli::write_out(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::cli::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `eprintln!` that never panics: a closed standard error drops the line.
macro_rules! errln {
    () => { $crate::cli::write_err(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::cli::write_err(format_args!("{}\n", format_args!($($arg)*))) };
}

mod apply;
mod config_cmd;
pub(crate) mod demo;
mod demo_grpc;
mod demo_systemd;
mod drift;
pub mod drift_probe;
mod drift_watch;
mod env_hint;
mod journal;
mod logging;
mod pki;
pub(crate) mod remote;
mod render;
pub(crate) mod selfcheck;
pub mod serve;
mod status;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{ConfigError, SettingsInput};
use crate::engine::SubmitError;
use crate::engine::state::Phase;

/// How a command ended. [`Exit::code`] is the one place its number is chosen — the
/// contract every script and unit depends on: 0 succeeded (or nothing to do), 1 the plan
/// failed, was rolled back or could not be run, 2 the input was invalid and nothing was
/// changed (the unit does not restart on 2: `RestartPreventExitStatus=2`); 3, for `drift`
/// only, the node could not be checked (unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Succeeded, or nothing to do.
    Ok,
    /// The plan failed, was rolled back, or could not be run.
    Failed,
    /// The input was invalid; nothing was changed.
    Invalid,
    /// `drift` only: whether the node matches its last plan is not known, because the check
    /// could not be made (never 0, never `drift`'s 1 = drifted; decision 0016).
    Unknown,
}

impl Exit {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Exit::Ok => 0,
            Exit::Failed => 1,
            Exit::Invalid => 2,
            Exit::Unknown => 3,
        }
    }

    /// For a plan in `phase`: failed when it ended without succeeding; a plan still running
    /// (submitted, not waited for) is not a failure. The one mapping the local commands,
    /// the remote ones and `status` share.
    pub fn of_phase(phase: Phase) -> Exit {
        if phase.is_terminal() && phase != Phase::Succeeded {
            Exit::Failed
        } else {
            Exit::Ok
        }
    }

    /// For a refused submission: invalid input, unless the journal could not record it or
    /// another process holds it.
    pub fn of_submit_error(e: &SubmitError) -> Exit {
        match e {
            SubmitError::Journal(_) | SubmitError::Staging(_) | SubmitError::Conflict(_) => {
                Exit::Failed
            }
            _ => Exit::Invalid,
        }
    }

    /// For an error that ended a command: invalid input when its chain holds an error that
    /// says so ([`Invalid`], a configuration file that could not be used, a refused
    /// submission or call), else failed. The one error→exit mapping of the commands' flows.
    pub fn of_error(e: &anyhow::Error) -> Exit {
        for cause in e.chain() {
            if cause.is::<Invalid>() || cause.is::<ConfigError>() {
                return Exit::Invalid;
            }
            if let Some(refused) = cause.downcast_ref::<SubmitError>() {
                return Exit::of_submit_error(refused);
            }
            if let Some(status) = cause.downcast_ref::<tonic::Status>() {
                return Exit::of_call(status);
            }
        }
        Exit::Failed
    }

    /// For a failed call to a remote agent: invalid input when the agent refused it as
    /// such (invalid, too large, not for this node), else failed.
    pub fn of_call(status: &tonic::Status) -> Exit {
        match status.code() {
            tonic::Code::InvalidArgument
            | tonic::Code::ResourceExhausted
            | tonic::Code::FailedPrecondition => Exit::Invalid,
            _ => Exit::Failed,
        }
    }
}

/// The input was invalid and nothing was changed (exit 2): a flow wraps a settings or node
/// problem in it, and [`Exit::of_error`] finds it anywhere in the chain. Shows the error it
/// wraps, and that error's causes.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Invalid(pub anyhow::Error);

impl Invalid {
    /// `message` (a validation message, an error) marked as invalid input.
    pub fn new<M>(message: M) -> Invalid
    where
        M: std::fmt::Display + std::fmt::Debug + Send + Sync + 'static,
    {
        Invalid(anyhow::Error::msg(message))
    }
}

/// Prints the error that ended a command with its causes on one line (`error: open the
/// journal in /var/lib/…: …: Permission denied (os error 13)`) and says how the command ends.
pub fn fail(e: &anyhow::Error) -> Exit {
    errln!("error: {}", inplace_base::chain(e.as_ref()));
    if let Some(hint) = not_root_hint(e) {
        errln!("{hint}");
    }
    Exit::of_error(e)
}

/// When a permission was refused and this process is not root: what to do about it (the
/// agent reads and writes the node's files, its journal and state directory as root).
fn not_root_hint(e: &anyhow::Error) -> Option<String> {
    let refused = e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied)
    });
    if refused {
        not_root_hint_for_node()
    } else {
        None
    }
}

/// When this process is not root: that it reads and changes the node's files as root, and
/// what to do (for an error of the node's files, such as a check that could not read them).
pub(crate) fn not_root_hint_for_node() -> Option<String> {
    let uid = rustix::process::geteuid();
    (!uid.is_root()).then(|| {
        format!(
            "hint: inplace-agent runs as uid {} here, not root: it changes the node's files and \
             keeps its journal as root; run it as root (or with sudo)",
            uid.as_raw()
        )
    })
}

#[derive(Debug, Parser)]
#[command(
    name = "inplace-agent",
    version,
    about = "Node-side agent for Cluster API in-place updates",
    long_about = "Applies declarative update plans to a node idempotently, with a crash-safe \
                  journal and rollback. Try `inplace-agent demo` for a tour in a sandbox."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Dry run: what a plan would change on this node, and whether it can
    Check(PlanArgs),
    /// Apply a plan locally, without a daemon
    Apply(ApplyArgs),
    /// Print the journal
    Journal(journal::JournalArgs),
    /// Show the version and what this build supports
    Version(OutputArgs),
    /// A guided tour in a sandbox node tree: apply, re-apply, roll back
    Demo(demo::DemoArgs),
    /// DEMO STAND-IN for the kubelet, run by `demo --systemd` inside its sandboxed node (not
    /// a kubelet; see inplace_agent::sandbox::standin)
    #[command(hide = true, disable_help_flag = true)]
    KubeletStandin {
        /// kubelet arguments
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the agent: the gRPC API over mutual TLS, plans through the journal
    Serve(serve::ServeArgs),
    /// Apply a plan on a remote agent (over mutual TLS)
    Submit(remote::SubmitArgs),
    /// What the local agent is doing (its status socket; the journal when it is not
    /// running), or a plan's status; `--addr`: of a remote agent
    Status(remote::StatusArgs),
    /// Cancel a running plan on a remote agent
    Cancel(remote::CancelArgs),
    /// Start a new attempt of a failed plan on a remote agent
    Retry(remote::RetryArgs),
    /// Whether the node still matches the last plan that succeeded on it: exit 0 it
    /// matches, 1 it has drifted, 3 unknown (the check could not be made; the output says
    /// why and what to do), 2 invalid flags or configuration; `--addr`: ask a remote agent
    #[command(
        after_help = "Exit codes: 0 the node matches its last succeeded plan (or no plan has \
                      succeeded: nothing to drift from); 1 it has drifted; 2 the flags or the \
                      configuration file are invalid; 3 unknown: the check could not be made \
                      (the output says why and what to do). Without --addr the local agent's \
                      last check is shown when it serves; when none serves, this command \
                      checks the node itself, read-only."
    )]
    Drift(drift::DriftArgs),
    /// Re-apply the last plan that succeeded on this node as a new attempt of it: locally
    /// (as `apply`, with --root and the node flags), or on a remote agent with --addr
    Repair(drift::RepairArgs),
    /// Certificates for trying the agent out
    Pki(pki::PkiArgs),
    /// The configuration file: print the default, check a file
    Config(config_cmd::ConfigArgs),
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// For people.
    Text,
    /// For scripts (versioned JSON).
    Json,
}

#[derive(Debug, Args, Clone)]
struct OutputArgs {
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
}

/// Where the node and the agent's state are.
#[derive(Debug, Args, Clone)]
pub struct NodeArgs {
    /// The node's root directory (`/host` in the DaemonSet; a sandbox in tests)
    #[arg(long, env = "INPLACE_AGENT_ROOT", default_value = "/")]
    pub root: PathBuf,
    /// State directory (journal, backups) [default: <root>/var/lib/inplace-agent]
    #[arg(long, env = "INPLACE_AGENT_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Also allow plans to write under this directory (repeatable)
    #[arg(long = "allow-path", value_name = "DIR")]
    pub allow_paths: Vec<String>,
    /// This node's name; plans for other nodes are refused
    #[arg(long)]
    pub node_name: Option<String>,
    /// Run node commands (gates) on the agent's filesystem instead of chrooting into the root
    #[arg(long)]
    pub no_chroot: bool,
    /// Allow `exec` changes
    #[arg(long)]
    pub allow_exec: bool,
    /// Use this package manager instead of detecting one in the root (a plan's `manager` wins)
    #[arg(long, value_name = "apt|dnf")]
    pub package_manager: Option<String>,
    /// Allow artifact downloads over plain http from this host (repeatable; https otherwise)
    #[arg(long = "allow-http-host", value_name = "HOST")]
    pub allow_http_hosts: Vec<String>,
    /// Also trust the CA certificates in this PEM file for artifact downloads (repeatable)
    #[arg(long = "download-ca", value_name = "FILE")]
    pub download_ca_files: Vec<PathBuf>,
    /// Manage units through systemd (restarts, unit changes, reboots) or not at all; `off`
    /// is for plain directory trees: restarts are then journaled as skipped
    #[arg(long, env = "INPLACE_AGENT_SERVICES", value_enum, default_value_t = Services::Systemd)]
    pub services: Services,
    /// D-Bus address of the node's system bus [default: unix:path=<root>/run/dbus/system_bus_socket]
    #[arg(long, env = "INPLACE_AGENT_BUS", value_name = "ADDRESS")]
    pub bus: Option<String>,
    /// Read the boot id from this file instead of <root>/proc/sys/kernel/random/boot_id
    /// (a reboot is seen as a different boot id; tests use this to simulate one)
    #[arg(long, value_name = "FILE")]
    pub boot_id_file: Option<PathBuf>,
}

/// How the agent manages units (`--services`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Services {
    /// systemd over D-Bus.
    Systemd,
    /// No service management.
    Off,
}

impl NodeArgs {
    /// The settings these flags describe.
    pub fn input(&self) -> SettingsInput {
        SettingsInput {
            root: Some(self.root.clone()),
            state_dir: self.state_dir.clone(),
            allow_paths: self.allow_paths.clone(),
            node_name: self.node_name.clone(),
            no_chroot: self.no_chroot,
            allow_exec: self.allow_exec,
            package_manager: self.package_manager.clone(),
            allow_http_hosts: self.allow_http_hosts.clone(),
            download_ca_files: self.download_ca_files.clone(),
            services_off: self.services == Services::Off,
            bus: self.bus.clone(),
            boot_id_file: self.boot_id_file.clone(),
            ..SettingsInput::default()
        }
    }
}

#[derive(Debug, Args, Clone)]
struct PlanArgs {
    /// Plan file (YAML or JSON); `-` reads standard input
    plan: PathBuf,
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    out: OutputArgs,
}

#[derive(Debug, Args, Clone)]
struct ApplyArgs {
    #[command(flatten)]
    plan: PlanArgs,
    /// Run the plan again if its last attempt failed (a new attempt)
    #[arg(long)]
    retry: bool,
    /// Never draw a progress bar, print a line per step
    #[arg(long)]
    no_progress: bool,
}

/// Set once standard output could not be written (its reader is gone).
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// True once a write to standard output failed: the reader is gone (`| head` got its lines),
/// so there is no point producing more.
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// Writes to standard output (in one piece); a failure marks it closed and is not an error.
pub fn write_out(text: std::fmt::Arguments<'_>) {
    if stdout_closed() {
        return;
    }
    let mut out = std::io::stdout().lock();
    if out.write_fmt(text).and_then(|()| out.flush()).is_err() {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    }
}

/// Writes to standard error (in one piece); a failure is ignored.
pub fn write_err(text: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(text);
}

/// The command line of `inplace-agent`, for tests that check what messages name.
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

/// Runs the CLI and returns the process exit code.
pub fn main() -> ExitCode {
    // Like `Cli::parse()`, and names an environment variable behind a parse error.
    let cli: Cli = env_hint::parse();
    // `serve` sets logging up once it has read its configuration (log.format).
    if !matches!(cli.command, Command::Serve(_)) {
        logging::init("error", crate::config::LogFormat::Plain, false);
    }
    let code = match cli.command {
        Command::Check(a) => apply::check(&a.plan, &a.node, a.out.output),
        Command::Apply(a) => apply::apply(
            &a.plan.plan,
            &a.plan.node,
            a.plan.out.output,
            a.retry,
            a.no_progress,
        ),
        Command::Journal(a) => journal::run(&a),
        Command::Version(a) => version(a.output),
        Command::Demo(a) => demo::run(&a),
        Command::KubeletStandin { args } => return crate::sandbox::standin::run(&args),
        Command::Serve(a) => serve::run(&a),
        Command::Submit(a) => remote::submit(&a),
        Command::Status(a) => match &a.agent.addr {
            Some(addr) => remote::status(&a, addr),
            None => status::local(&a),
        },
        Command::Cancel(a) => remote::cancel(&a),
        Command::Retry(a) => remote::retry(&a),
        Command::Drift(a) => drift::drift(&a),
        Command::Repair(a) => drift::repair(&a),
        Command::Pki(a) => pki::run(&a),
        Command::Config(a) => config_cmd::run(&a),
    };
    ExitCode::from(code.code())
}

fn version(output: Output) -> Exit {
    let kinds: Vec<&str> = crate::steps::Capabilities::implemented()
        .iter()
        .map(|k| k.as_str())
        .collect();
    match output {
        Output::Json => {
            let v = serde_json::json!({
                "apiVersion": inplace_plan::API_VERSION,
                "kind": "Version",
                "version": crate::BUILD.version,
                "commit": crate::BUILD.commit(),
                "modified": crate::BUILD.modified(),
                "changeKinds": kinds,
                "failpoints": cfg!(feature = "failpoints"),
            });
            outln!("{v:#}");
        }
        Output::Text => {
            outln!(
                "inplace-agent {} ({})",
                crate::BUILD.version,
                crate::BUILD.describe_commit()
            );
            outln!("change kinds: {}", kinds.join(", "));
            if cfg!(feature = "failpoints") {
                outln!("built with crash-test failpoints (not for production)");
            }
        }
    }
    Exit::Ok
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_formats_utc() {
        assert_eq!(inplace_base::time::rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            inplace_base::time::rfc3339(1_796_049_346_123),
            "2026-11-30T14:35:46.123Z"
        );
        assert_eq!(
            inplace_base::time::rfc3339(951_782_400_000),
            "2000-02-29T00:00:00.000Z"
        );
    }
}
