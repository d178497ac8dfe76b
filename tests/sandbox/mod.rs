//! The sandboxed-systemd harness for integration tests: `inplace_agent::sandbox` (where the
//! harness lives, so that `inplace-agent demo --systemd` can use it too), plus what only
//! tests have — the `kubelet-standin` binary Cargo builds for them.
//!
//! Use it from an integration test as `mod sandbox;` and `use sandbox::{SandboxNode,
//! StandinExt};`. See docs/testing-systemd.md.
#![allow(dead_code)] // each integration test uses a different part of the harness

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
