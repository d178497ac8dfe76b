//! Command-line entry points.

/// Runs the CLI and returns the process exit code.
pub fn main() -> std::process::ExitCode {
    std::process::ExitCode::SUCCESS
}
