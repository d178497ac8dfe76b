//! `inplace-updater demo` (written below).

/// `demo` flags.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {}

/// Runs the demo.
pub fn run(_args: &DemoArgs) -> std::process::ExitCode {
    std::process::ExitCode::SUCCESS
}
