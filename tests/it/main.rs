//! The integration tests: one test binary, one module per subject (each module's first lines
//! say what it covers), all sharing `tests/support`. One binary links the dependencies once
//! instead of once per file. Run one test by name as `cargo test --test it NAME` (a substring
//! of `module::function`); docs/testing.md says more.
//!
//! A new file here must be added below: [`every_file_here_is_a_module`] fails until it is.

#[path = "../support/mod.rs"]
mod support;

mod api_server_certificate;
mod apply;
mod apt_host;
mod architecture;
mod bad_input;
mod control_plane_gate;
mod crash;
mod demo_systemd;
mod disk_full;
mod dnf_host;
mod download;
mod drift;
mod drift_local;
mod hints;
mod journal_compat;
mod kubelet_standin;
mod layout;
mod mtls;
mod node_root;
mod observability;
mod operator;
mod packages_plan;
mod packaging;
mod packaging_install;
mod properties;
mod serve;
mod startup;
mod systemd_agent;
mod systemd_host;
mod systemd_packages;
mod updater_agent_side;
mod updater_api_trouble;
mod updater_bootstrap_files;
mod updater_bound_agents;
mod updater_bounded;
mod updater_cluster_config;
mod updater_control_plane;
mod updater_dead_agent;
mod updater_drain;
mod updater_drift;
mod updater_e2e;
mod updater_forged_requests;

mod updater_http;
mod updater_kcp_flow;
mod updater_kcp_packages;
mod updater_kubeconfig;
mod updater_memory;
mod updater_packaging;
mod updater_progress;
mod updater_rbac;
mod updater_retry;
mod updater_skew;
mod updater_translate;
mod updater_trust;
mod updater_why;

/// A test file in `tests/it/` that is not a module of this binary is never compiled, so its
/// tests would silently not run.
#[test]
fn every_file_here_is_a_module() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it");
    let main = include_str!("main.rs");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        if module != "main" && !main.contains(&format!("\nmod {module};\n")) {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "tests/it/ files that tests/it/main.rs does not declare (`mod NAME;`): {missing:?}"
    );
}
