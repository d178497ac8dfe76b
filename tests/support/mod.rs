//! The shared harness of the integration tests (`tests/it`) and the benches, included by each
//! as a module (`#[path = ".../support/mod.rs"] mod support;`):
//! it uses `env!("CARGO_BIN_EXE_...")` and `CARGO_TARGET_TMPDIR`, which Cargo sets only for a
//! package's own tests and benches, and keeps the library's public surface as it is.
//!
//! - [`patience`]: the one bound of every wait (`INPLACE_TEST_PATIENCE_SECS`), `eventually`;
//! - [`programs`]: the agent and updater binaries, checked to be as new as their sources;
//! - [`node`]: a sandbox node tree, the binary run on it, snapshots, `require_root`;
//! - [`pki`]: throwaway PKIs (a node's, an HTTPS server's);
//! - [`daemon`]: a daemon started, waited for, logged, stopped; [`memory`]: its memory;
//! - [`agent`]: `inplace-agent serve` on a sandbox node over mutual TLS;
//! - [`sandbox`]: this machine's systemd booted in namespaces on an overlay (root);
//! - [`overlay`]: a copy-on-write overlay of `/` for apt and dnf, stand-in packages (root);
//! - [`updater`]: the updater's world (API stand-in, agents, `inplace-updater serve`);
//! - [`control_plane`]: a kubeadm control-plane node's files, API server and etcd stand-ins;
//! - [`restarting_control_plane`]: the same wire shapes for the benches, whose static pods
//!   restart for a set time after a manifest changes (`benches/cluster.rs`);
//! - [`kcp`]: KubeadmControlPlane's request shapes, a node's last plan and its gates;
//! - [`rbac`]: Kubernetes RBAC decided for a ServiceAccount, requests read from HTTP paths.
#![allow(dead_code)] // every test module and bench uses a different part

pub mod agent;
pub mod control_plane;
pub mod daemon;
pub mod kcp;
pub mod memory;
pub mod node;
pub mod overlay;
pub mod patience;
pub mod pki;
pub mod programs;
pub mod rbac;
pub mod restarting_control_plane;
pub mod sandbox;
pub mod updater;

// Not every includer uses every name (a bench uses none of these).
#[allow(unused_imports)]
pub use node::{Node, Snapshot, bin, diff, header, is_root, journal, require_root, snapshot, text};
#[allow(unused_imports)]
pub use patience::{deadline, eventually, eventually_async, patience, poll};

/// Writes straight to stderr: libtest captures `eprintln!` of passing tests, and a SKIP line
/// or a figure must be seen.
pub fn say(text: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{text}\n").as_bytes());
}
