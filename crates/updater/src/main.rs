//! The `inplace-updater` binary: the Cluster API Runtime Extension; see
//! `inplace_updater` and docs/updater.md.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    inplace_updater::cli::main()
}
