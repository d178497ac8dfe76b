//! Drift and repair without a daemon, through the real binary on a sandbox node: `drift`
//! checks the node itself (the daemon's check, read-only) instead of repeating what the
//! journal last recorded, says "unknown" with exit 3 when it cannot check, and `repair`
//! re-applies the last succeeded plan locally, as `apply` does. `status` read from the
//! journal names the node.

use std::path::PathBuf;
use std::process::Output;

use serde_json::Value;

use crate::support::agent::Agent;
use crate::support::patience::eventually;
use crate::support::pki::{As, NodePki};
use crate::support::{Node, bin, journal, text};

const NODE: &str = "local-node";

const SYSCTL_FILE: &str = "/etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf";

/// A plan of a file and a sysctl for [`NODE`].
fn baseline(node: &Node) -> PathBuf {
    node.plan_file(
        "baseline.yaml",
        &format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: baseline\nnodeName: {NODE}\nchanges:\n\
             \x20 - file: {{path: /etc/kubernetes/extra.conf, content: \"extra\\n\"}}\n\
             \x20 - sysctl: {{key: net.ipv4.ip_forward, value: \"1\"}}\n"
        ),
    )
}

/// `inplace-agent ARGS --root <node>` with no configuration file of the host's.
fn agent(node: &Node, args: &[&str]) -> Output {
    let mut all = args.to_vec();
    all.extend(["--config", "/dev/null"]);
    node.agent(&all)
}

fn applied(node: &Node) {
    let plan = baseline(node);
    let out = node.agent(&["apply", "--no-progress", &plan.display().to_string()]);
    assert!(out.status.success(), "{}", text(&out));
}

/// A hand edit of the managed file and the sysctl's file removed.
fn drift_the_node(node: &Node) {
    std::fs::write(node.path("/etc/kubernetes/extra.conf"), "edited by hand\n").unwrap();
    std::fs::remove_file(node.path(SYSCTL_FILE)).unwrap();
}

/// Failed on the code before: with no daemon, `drift` answered "drift: none, the node
/// matches plan baseline ... as last journaled", exit 0, without looking at the node.
#[test]
fn drift_without_a_daemon_checks_the_node_itself() {
    let node = Node::new();
    applied(&node);
    let out = agent(&node, &["drift"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("drift: none"), "{said}");
    assert!(said.contains("checked"), "{said}");
    assert!(!said.contains("as last journaled"), "{said}");

    drift_the_node(&node);
    let out = agent(&node, &["drift"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("in 2 change(s)"), "{said}");
    assert!(
        said.contains("changes[0] file /etc/kubernetes/extra.conf"),
        "{said}"
    );
    assert!(said.contains("changes[1] sysctl"), "{said}");
    assert!(
        said.contains("/etc/kubernetes/extra.conf content"),
        "{said}"
    );

    let out = agent(&node, &["drift", "-o", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let d: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["drifted"], true, "{d:#}");
    assert_eq!(d["changes"].as_array().map(Vec::len), Some(2), "{d:#}");
    assert!(d["checkedAtMs"].is_u64(), "{d:#}");

    // Read-only: nothing journaled, nothing repaired.
    let records = journal(&node);
    let count = |t: &str| records.iter().filter(|r| r["type"] == t).count();
    assert_eq!(
        (count("driftFound"), count("planAccepted")),
        (0, 1),
        "the check wrote to the journal"
    );
    assert_eq!(
        std::fs::read_to_string(node.path("/etc/kubernetes/extra.conf")).unwrap(),
        "edited by hand\n"
    );
}

/// Failed on the code before (exit 0, "drift: none"): a check that cannot be made is
/// "unknown", exit 3, saying why and what to do.
#[test]
fn a_check_that_cannot_be_made_is_unknown_with_exit_3() {
    let node = Node::new();
    applied(&node);
    drift_the_node(&node);
    // The configuration names another node than the plan's: the check refuses.
    let config = node.beside("config.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"other-node\"\nroot = \"{}\"\n",
            node.root().display()
        ),
    )
    .unwrap();
    let out = node.agent(&["drift", "--config", &config.display().to_string()]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(3), "{said}");
    assert!(said.contains("drift: unknown"), "{said}");
    assert!(!said.contains("drift: none"), "{said}");
    assert!(said.contains("other-node"), "{said}");
}

/// Failed on the code before: once the daemon stopped, `drift` repeated the journal's "none"
/// after a file changed.
#[test]
fn after_the_daemon_stopped_drift_checks_the_node() {
    let node = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let mut daemon = Agent::start(&node, &pki, &[]);
    let plan = baseline(&node);
    let out = std::process::Command::new(bin())
        .args(["submit", &plan.display().to_string(), "--wait", "--addr"])
        .arg(&daemon.addr)
        .args(pki.client_flags(As::Updater))
        .env("INPLACE_AGENT_LOG", "error")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    eventually("the daemon's first check", || {
        let (_, status) = daemon.get("/v1/status");
        status["drift"]["checkedAtMs"].is_u64().then_some(())
    });
    daemon.terminate();
    std::fs::write(node.path("/etc/kubernetes/extra.conf"), "edited\n").unwrap();
    let out = agent(&node, &["drift"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("changes[0] file"), "{said}");
}

/// Failed on the code before: `repair` required `--addr`; a node managed by `apply` alone
/// could not be repaired.
#[test]
fn repair_without_a_daemon_reapplies_the_last_plan_locally() {
    let node = Node::new();
    applied(&node);
    drift_the_node(&node);
    let out = node.agent(&["repair", "--no-progress"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("baseline"), "{said}");
    assert_eq!(
        std::fs::read_to_string(node.path("/etc/kubernetes/extra.conf")).unwrap(),
        "extra\n"
    );
    assert!(node.path(SYSCTL_FILE).exists());
    let sources: Vec<String> = journal(&node)
        .iter()
        .filter(|r| r["type"] == "planAccepted")
        .map(|r| {
            r["record"]["planAccepted"]["source"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(sources, ["cli", "repair of run 1 by cli"], "{sources:?}");
    let out = agent(&node, &["drift"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // Nothing to repair to on a fresh node: refused, saying why.
    let fresh = Node::new();
    let out = fresh.agent(&["repair"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("no plan has succeeded"), "{said}");
}

/// Failed on the code before: read from the journal, `status` said "node (unnamed)".
#[test]
fn status_from_the_journal_names_the_node() {
    let node = Node::new();
    applied(&node);
    let out = agent(&node, &["status"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(!said.contains("(unnamed)"), "{said}");
    assert!(said.contains(&format!("node {NODE}")), "{said}");
    // The configuration's name wins, and the plan's other name is said.
    let config = node.beside("named.toml");
    std::fs::write(&config, "[node]\nname = \"configured-name\"\n").unwrap();
    let out = node.agent(&["status", "--config", &config.display().to_string()]);
    let said = text(&out);
    assert!(said.contains("node configured-name"), "{said}");
    assert!(said.contains(NODE), "{said}");
}
