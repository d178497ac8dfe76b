//! `inplace-agent config`: print the default configuration, check a file.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::Exit;
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
            let checked = load_config(file)
                .map_err(|e| e.to_string())
                .and_then(|input| {
                    input
                        .resolve()
                        .map_err(|e| format!("config {}: {e}", file.display()))
                });
            match checked {
                Ok(settings) => {
                    let findings = super::selfcheck::check(&settings, Some(file));
                    for w in &findings.warnings {
                        errln!("warning: {w}");
                    }
                    if !findings.problems.is_empty() {
                        errln!(
                            "error: config {}: serve would not start ({} problem{}):",
                            file.display(),
                            findings.problems.len(),
                            if findings.problems.len() == 1 {
                                ""
                            } else {
                                "s"
                            }
                        );
                        for p in &findings.problems {
                            errln!("error: {p}");
                        }
                        return Exit::Invalid;
                    }
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
                Err(e) => {
                    errln!("error: {e}");
                    Exit::Invalid
                }
            }
        }
    }
}
