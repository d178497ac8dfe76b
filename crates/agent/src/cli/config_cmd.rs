//! `inplace-agent config`: print the default configuration, check a file.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::Exit;
use super::selfcheck::Subject;
use crate::config::{DEFAULT_CONFIG, load_config};

/// Arguments of `config`.
#[derive(Debug, Args, Clone)]
pub struct ConfigArgs {
    #[command(subcommand)]
    command: ConfigCommand,
}

#[derive(Debug, Subcommand, Clone)]
enum ConfigCommand {
    /// Print a fully commented config.toml with every key at its default
    PrintDefault,
    /// Check a configuration file as `serve` would read it (keys, values, the node name)
    /// and what it names (the TLS files, that they name the node, an admin identity); exit 2
    /// naming the key and line, or the setting and the fix, of each problem
    Check {
        /// The file [default: /etc/inplace-agent/config.toml]
        #[arg(default_value = crate::config::DEFAULT_CONFIG_PATH)]
        file: PathBuf,
    },
}

/// Runs `config`.
pub fn run(args: &ConfigArgs) -> Exit {
    match &args.command {
        ConfigCommand::PrintDefault => {
            crate::cli::write_out(format_args!("{DEFAULT_CONFIG}"));
            Exit::Ok
        }
        ConfigCommand::Check { file } => {
            let resolved = match load_config(file) {
                Ok(input) => input.resolve_each(),
                Err(e) => {
                    errln!("error: {e}");
                    return Exit::Invalid;
                }
            };
            let findings = super::selfcheck::check(Subject::of_result(&resolved), Some(file));
            for w in &findings.warnings {
                errln!("warning: {w}");
            }
            match resolved {
                Ok(settings) if findings.problems.is_empty() => {
                    outln!(
                        "config {}: valid (node {}, gRPC on {}, status socket {}{})",
                        file.display(),
                        settings.node_name,
                        settings.listen,
                        settings.status.path.display(),
                        settings
                            .metrics_listen
                            .map(|a| format!(", metrics on {a}"))
                            .unwrap_or_default()
                    );
                    Exit::Ok
                }
                _ => {
                    let n = findings.problems.len();
                    errln!(
                        "error: config {}: serve would not start ({n} problem{}):",
                        file.display(),
                        if n == 1 { "" } else { "s" }
                    );
                    for p in &findings.problems {
                        errln!("error: {p}");
                    }
                    Exit::Invalid
                }
            }
        }
    }
}
