//! The sandboxed-systemd harness: `inplace_agent::sandbox` (where the harness lives, so that
//! `inplace-agent demo --systemd` can use it too), plus what only tests have — the
//! `kubelet-standin` binary Cargo builds for them. Use it as `use crate::support::sandbox::{
//! SandboxNode, StandinExt};`. See docs/testing-systemd.md.

use std::path::Path;

pub use inplace_agent::host::systemd::Systemd;
pub use inplace_agent::sandbox::*;

/// The kubelet stand-in Cargo built for the tests.
pub const STANDIN: &str = env!("CARGO_BIN_EXE_kubelet-standin");

/// Test conveniences on [`SandboxNode`].
pub trait StandinExt {
    /// Installs and starts the kubelet stand-in (`tests/kubelet-standin`) as
    /// `kubelet.service`; panics when that fails.
    fn install_kubelet_standin(&self) -> Systemd;
}

impl StandinExt for SandboxNode {
    fn install_kubelet_standin(&self) -> Systemd {
        self.install_kubelet(Standin::Binary(Path::new(STANDIN)))
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// `inplace-agent ARGS --root <node's root> --bus <node's bus>` in the node's network
/// namespace (the agent's own address family), logging warnings; none of the agent's
/// variables of this process reach it.
pub fn agent_command(node: &SandboxNode, args: &[&str]) -> std::process::Command {
    let mut cmd = node.command_in_netns(Path::new(super::bin()));
    cmd.args(args)
        .arg("--root")
        .arg(node.root())
        .arg("--bus")
        .arg(node.bus_address())
        .env("INPLACE_AGENT_LOG", "warn")
        .env_remove("INPLACE_AGENT_SERVICES")
        .env_remove("INPLACE_AGENT_BUS")
        .env_remove("INPLACE_AGENT_ROOT")
        .env_remove("INPLACE_AGENT_STATE_DIR");
    cmd
}
