//! `inplace-agent demo`.

use clap::Args;

/// Arguments of `demo`.
#[derive(Debug, Args, Clone)]
pub struct DemoArgs {}

/// Runs the demo.
pub fn run(_args: &DemoArgs) -> u8 {
    0
}
