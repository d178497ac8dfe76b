//! The `inplace-agent` binary: see `cli` for the subcommands.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    inplace_agent::cli::main()
}
