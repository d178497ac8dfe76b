//! Drift end to end: the real `inplace-agent serve` on a sandbox node tree. A plan is
//! applied, a managed file is edited by hand, and the agent reports it (status socket,
//! `drift` command, metrics, gRPC for the reader role, the journal) within seconds, naming
//! the field; restoring the file clears it; a restart keeps it; `repair` (admin only)
//! restores the node, also of a baseline applied without `nodeName`; a file made in a
//! directory created after the watch began is noticed within seconds; and a run in progress
//! is never reported as drift. Without a daemon: `tests/it/drift_local.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::agent::Agent;
use crate::support::patience::eventually;
use crate::support::pki::{As, NodePki};
use crate::support::{Node, bin, journal, text};
use inplace_agent::status::client;

const NODE: &str = "drift-node";

const KUBELET_CONFIG: &str = "/var/lib/kubelet/config.yaml";

fn plan(node: &Node, id: &str, body: &str) -> PathBuf {
    node.plan_file(
        &format!("{id}.yaml"),
        &format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nnodeName: {NODE}\n{body}"),
    )
}

const BASELINE: &str = "changes:\n\
    \x20 - file: {path: /etc/kubernetes/extra.conf, content: \"extra\\n\"}\n\
    \x20 - kubeletConfig: {mergePatch: {maxPods: 90}}\n";

/// Runs the agent's client command `args` against `agent` as `who`: exit code and output.
fn run(agent: &Agent, pki: &NodePki, who: As, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(bin())
        .args(args)
        .args(["--addr", &agent.addr])
        .args(pki.client_flags(who))
        .env("INPLACE_AGENT_LOG", "error")
        .output()
        .unwrap();
    (out.status.code(), text(&out))
}

/// `inplace-agent drift` on the local socket: exit code and output.
fn local_drift(agent: &Agent) -> (Option<i32>, String) {
    let out = Command::new(bin())
        .args(["drift", "--config", "/dev/null", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    (out.status.code(), text(&out))
}

/// The status document's `drift` section.
fn drift(agent: &Agent) -> Value {
    let (code, status) = agent.get("/v1/status");
    assert_eq!(code, 200, "{status:#}");
    status.get("drift").cloned().unwrap_or(Value::Null)
}

fn edit(node: &Node, path: &str, from: &str, to: &str) {
    let path = node.path(path);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{} has no {from:?}", path.display());
    std::fs::write(&path, text.replace(from, to)).unwrap();
}

/// Waits for the drift section to say `drifted`; returns it.
fn wait_for(agent: &Agent, drifted: bool) -> Value {
    eventually(&format!("drift.drifted = {drifted}"), || {
        let d = drift(agent);
        (d["drifted"] == drifted && d["checkedAtMs"].is_u64()).then_some(d)
    })
}

fn start(node: &Node, pki: &NodePki) -> Agent {
    Agent::start(node, pki, &[])
}

fn metrics(socket: &Path) -> String {
    let r = client::get(socket, "/metrics", Duration::from_secs(30)).unwrap();
    String::from_utf8_lossy(&r.body).into_owned()
}

#[test]
fn a_hand_edit_is_reported_with_its_field_cleared_when_restored_and_repaired_on_request() {
    let node = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let mut agent = start(&node, &pki);
    let baseline = plan(&node, "baseline", BASELINE);
    let (code, out) = run(
        &agent,
        &pki,
        As::Updater,
        &["submit", &baseline.display().to_string(), "--wait"],
    );
    assert_eq!(code, Some(0), "{out}");
    let d = wait_for(&agent, false);
    assert_eq!(d["baseline"]["id"], "baseline", "{d:#}");
    assert_eq!(local_drift(&agent).0, Some(0));

    // A hand edit of a managed file: reported within seconds, naming the field.
    let edited = Instant::now();
    edit(&node, KUBELET_CONFIG, "maxPods: 90", "maxPods: 250");
    let d = wait_for(&agent, true);
    let noticed = edited.elapsed();
    let change = &d["changes"][0];
    assert_eq!(change["index"], 1, "{d:#}");
    assert_eq!(change["kind"], "kubeletConfig");
    assert_eq!(change["differences"][0]["field"], "maxPods");
    assert_eq!(change["differences"][0]["expected"], "90");
    assert_eq!(change["differences"][0]["found"], "250");
    eprintln!("drift noticed {noticed:?} after the edit (interval: 300 s)");
    assert!(
        noticed < Duration::from_secs(60),
        "noticed after {noticed:?}: by the interval, not by the write"
    );
    let (code, out) = local_drift(&agent);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("maxPods: expected 90, found 250"), "{out}");
    let m = metrics(&agent.socket);
    assert!(
        m.contains("inplace_agent_drifted_changes{kind=\"kubeletConfig\"} 1"),
        "{m}"
    );
    assert!(m.contains("inplace_agent_drift_events_total 1"), "{m}");
    // The reader role may ask over gRPC.
    let (code, out) = run(&agent, &pki, As::Reader, &["drift", "-o", "json"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("\"maxPods\""), "{out}");
    assert!(
        agent
            .log()
            .contains("drift: the node no longer matches changes[1]")
    );

    // Restored by hand: cleared.
    edit(&node, KUBELET_CONFIG, "maxPods: 250", "maxPods: 90");
    wait_for(&agent, false);
    let records: Vec<String> = journal(&node)
        .iter()
        .filter_map(|r| r["type"].as_str().map(str::to_string))
        .filter(|t| t.starts_with("drift"))
        .collect();
    assert_eq!(records, ["driftFound", "driftCleared"]);

    // Drifted again, across a restart: still drifted, first seen kept.
    edit(&node, "/etc/kubernetes/extra.conf", "extra", "edited");
    let before = wait_for(&agent, true);
    agent.terminate();
    let agent = start(&node, &pki);
    let after = wait_for(&agent, true);
    assert_eq!(
        after["changes"][0]["firstSeenMs"], before["changes"][0]["firstSeenMs"],
        "{after:#}"
    );
    assert_eq!(
        after["changes"][0]["differences"][0]["field"],
        "/etc/kubernetes/extra.conf content"
    );

    // Repair: admin only; a new attempt of the plan, which restores the file.
    let (code, out) = run(&agent, &pki, As::Reader, &["repair"]);
    assert_ne!(code, Some(0), "{out}");
    let (code, out) = run(&agent, &pki, As::Updater, &["repair", "--wait"]);
    assert_eq!(code, Some(0), "{out}");
    let d = wait_for(&agent, false);
    assert_eq!(d["baseline"]["attempt"], 2, "{d:#}");
    assert_eq!(
        std::fs::read_to_string(node.path("/etc/kubernetes/extra.conf")).unwrap(),
        "extra\n"
    );
    let (code, out) = run(&agent, &pki, As::Reader, &["drift"]);
    assert_eq!(code, Some(0), "{out}");
}

#[test]
fn a_run_in_progress_is_never_reported_as_drift() {
    let node = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let agent = start(&node, &pki);
    let first = plan(&node, "first", BASELINE);
    let (code, out) = run(
        &agent,
        &pki,
        As::Updater,
        &["submit", &first.display().to_string(), "--wait"],
    );
    assert_eq!(code, Some(0), "{out}");
    wait_for(&agent, false);
    // The next plan rewrites both managed files, then waits at its gate until told.
    let flag = node.beside("go");
    let next = plan(
        &node,
        "next",
        &format!(
            "changes:\n\
             \x20 - file: {{path: /etc/kubernetes/extra.conf, content: \"next\\n\"}}\n\
             \x20 - kubeletConfig: {{mergePatch: {{maxPods: 80}}}}\n\
             verify:\n\
             \x20 - command: {{argv: [sh, -c, \"while [ ! -e {} ]; do sleep 0.05; done\"], timeoutSeconds: 120}}\n",
            flag.display()
        ),
    );
    let (code, out) = run(
        &agent,
        &pki,
        As::Updater,
        &["submit", &next.display().to_string()],
    );
    assert_eq!(code, Some(0), "{out}");
    eventually("the next plan at its gate", || {
        (std::fs::read_to_string(node.path("/etc/kubernetes/extra.conf")).ok()? == "next\n")
            .then_some(())
    });
    // Longer than the debounce after the writes: a check would have run by now.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(drift(&agent)["drifted"], false);
    std::fs::write(&flag, "").unwrap();
    let d = eventually("the next plan as the baseline", || {
        let d = drift(&agent);
        (d["baseline"]["id"] == "next").then_some(d)
    });
    assert_eq!(d["drifted"], false, "{d:#}");
    let drift_records = journal(&node)
        .iter()
        .filter(|r| r["type"] == "driftFound")
        .count();
    assert_eq!(
        drift_records, 0,
        "the agent's own writes were reported as drift"
    );
}

/// A package moved outside the agent (real apt and dpkg in a disposable overlay root, with
/// the stand-in kube packages, as tests/it/packages_plan.rs): drift naming the version.
#[test]
fn a_package_moved_outside_the_agent_is_drift() {
    use crate::support::daemon::{Daemon, Ready, serve_command};
    use crate::support::overlay::{self, Overlay};
    if !crate::support::require_root(
        "a_package_moved_outside_the_agent_is_drift",
        "mounts an overlay root",
    ) {
        return;
    }
    const OLD: &str = "1.30.4-1.1";
    const NEW: &str = "1.31.2-1.1";
    let overlay = Overlay::new();
    let mut debs = overlay::kube_debs(OLD);
    debs.extend(overlay::kube_debs(NEW));
    overlay::apt_repo(&overlay, &debs);
    overlay.chroot(&["apt-get", "update", "-q"]);
    let plans = tempfile::tempdir().unwrap();
    let plan = plans.path().join("kubelet.yaml");
    std::fs::write(
        &plan,
        format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: kubelet\nnodeName: {NODE}\nchanges:\n\
             \x20 - package: {{name: kubelet, version: {OLD}, hold: true}}\n"
        ),
    )
    .unwrap();
    // Applied by the CLI into the overlay's journal; the daemon then takes it as its baseline.
    let out = Command::new(bin())
        .args(["apply", "--no-progress", "--node-name", NODE, "--root"])
        .arg(overlay.root())
        .arg(&plan)
        .env("INPLACE_AGENT_LOG", "error")
        .env("INPLACE_AGENT_SERVICES", "off")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let pki = NodePki::new(NODE).unwrap();
    let f = &pki.files;
    let mut cmd = serve_command(
        Path::new(bin()),
        overlay.root(),
        &pki.node,
        &f.server_cert,
        &f.server_key,
        &f.ca_cert,
    );
    cmd.args(["--listen", "127.0.0.1:0"])
        .env("INPLACE_AGENT_LOG", "debug")
        .env("INPLACE_AGENT_SERVICES", "off");
    let agent = Daemon::start(cmd, Ready::Log).unwrap_or_else(|e| panic!("serve: {e}"));
    let socket = overlay.path("/run/inplace-agent/status.sock");
    let drift_of = || {
        let r = client::get(&socket, "/v1/status", Duration::from_secs(30)).ok()?;
        let status: Value = serde_json::from_slice(&r.body).ok()?;
        let d = status.get("drift")?.clone();
        d["checkedAtMs"].is_u64().then_some(d)
    };
    let d = eventually("the start-up check", drift_of);
    assert_eq!(d["drifted"], false, "{d:#}");
    // unattended-upgrades, or a person, moves the held package.
    overlay.chroot(&[
        "apt-get",
        "install",
        "-y",
        "-q",
        "--allow-downgrades",
        "--allow-change-held-packages",
        &format!("kubelet={NEW}"),
    ]);
    let d = eventually("drift of the package", || {
        drift_of().filter(|d| d["drifted"] == true)
    });
    let differences = &d["changes"][0]["differences"];
    assert_eq!(d["changes"][0]["kind"], "package", "{d:#}");
    assert_eq!(differences[0]["field"], "kubelet version", "{d:#}");
    assert_eq!(differences[0]["expected"], OLD);
    assert_eq!(differences[0]["found"], NEW);
    drop(agent);
}

/// `drift.repair = "auto"`: found drift is repaired without being asked, at most once per
/// `repair_min_interval_seconds` (the second drift within it stays reported).
#[test]
fn auto_repair_repairs_once_per_interval() {
    let node = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let config = node.beside("toml");
    let agent = configured_with_baseline(&node, &pki, &config, "repair = \"auto\"\n");
    let extra = node.path("/etc/kubernetes/extra.conf");
    std::fs::write(&extra, "edited\n").unwrap();
    eventually("the automatic repair", || {
        (std::fs::read_to_string(&extra).ok()? == "extra\n").then_some(())
    });
    let repairs = || {
        journal(&node)
            .iter()
            .filter(|r| r["type"] == "planAccepted")
            .filter(|r| {
                r["record"]["planAccepted"]["source"]
                    .as_str()
                    .is_some_and(|s| s == "repair of run 1 by drift.repair=auto")
            })
            .count()
    };
    assert_eq!(repairs(), 1);
    let d = wait_for(&agent, false);
    assert_eq!(d["baseline"]["attempt"], 2, "{d:#}");
    // Drift again within the interval: reported, not repaired.
    std::fs::write(&extra, "edited again\n").unwrap();
    wait_for(&agent, true);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(std::fs::read_to_string(&extra).unwrap(), "edited again\n");
    assert_eq!(repairs(), 1);
    assert!(
        agent.log().contains("drift.repair_min_interval_seconds"),
        "{}",
        agent.log()
    );
}

/// Starts the agent configured by `config` (written: [`write_config`] of the node's root
/// and `drift`), applies the baseline plan and waits for a check to find the node matching it.
fn configured_with_baseline(node: &Node, pki: &NodePki, config: &Path, drift: &str) -> Agent {
    write_config(config, pki, node.root(), drift);
    let mut agent = Agent::start_with_config(config);
    agent.socket = node.path("/run/inplace-agent/status.sock");
    let baseline = plan(node, "baseline", BASELINE);
    let (code, out) = run(
        &agent,
        pki,
        As::Updater,
        &["submit", &baseline.display().to_string(), "--wait"],
    );
    assert_eq!(code, Some(0), "{out}");
    wait_for(&agent, false);
    agent
}

/// Writes the configuration of an agent serving `root` with `pki`, whose drift checks wait
/// 200 ms after a write, plus `drift` (lines of its `[drift]` table).
fn write_config(config: &Path, pki: &NodePki, root: &Path, drift: &str) {
    use inplace_api::pki::{DEFAULT_READER_IDENTITY, DEFAULT_UPDATER_IDENTITY};
    let f = &pki.files;
    std::fs::write(
        config,
        format!(
            "[node]\nname = \"{NODE}\"\nroot = \"{}\"\nchroot = false\n\n[grpc]\nlisten = \"127.0.0.1:0\"\n\n\
             [tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n\
             [authorization]\nadmin = [\"{DEFAULT_UPDATER_IDENTITY}\"]\nreader = [\"{DEFAULT_READER_IDENTITY}\"]\n\n\
             [drift]\ndebounce_ms = 200\n{drift}",
            root.display(),
            f.server_cert.display(),
            f.server_key.display(),
            f.ca_cert.display()
        ),
    )
    .unwrap();
}

/// The daemon reads the node for a check in a process of its own (`serve ... --drift-probe`,
/// with the daemon's own arguments). When the configuration file has been changed to another
/// root since the daemon started, that process refuses to check the other tree: the drift
/// section says why and what to do, no drift is claimed, and the daemon serves on; with the
/// file put back, checks find drift again.
#[test]
fn a_check_process_refuses_a_configuration_changed_to_another_root() {
    let node = Node::new();
    let other = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let config = node.beside("toml");
    let agent = configured_with_baseline(&node, &pki, &config, "");

    write_config(&config, &pki, other.root(), "");
    std::fs::write(node.path("/etc/kubernetes/extra.conf"), "edited\n").unwrap();
    let d = eventually("the check process's refusal", || {
        let d = drift(&agent);
        d["problem"]
            .as_str()
            .is_some_and(|p| p.contains("configuration changed"))
            .then_some(d)
    });
    let problem = d["problem"].as_str().unwrap();
    assert!(
        problem.contains("--drift-probe) exited with status 1"),
        "{problem}"
    );
    assert!(
        problem.contains(&format!("serves root {}", node.root().display())),
        "{problem}"
    );
    assert!(
        problem.contains(&format!("now says root {}", other.root().display())),
        "{problem}"
    );
    assert!(problem.contains("restart the agent"), "{problem}");
    assert_eq!(d["drifted"], false, "{d:#}");
    let (code, out) = local_drift(&agent);
    assert!(out.contains("configuration changed"), "{code:?} {out}");

    write_config(&config, &pki, node.root(), "");
    std::fs::write(node.path("/etc/kubernetes/extra.conf"), "edited again\n").unwrap();
    let d = wait_for(&agent, true);
    assert_eq!(d["problem"], Value::Null, "{d:#}");
    assert_eq!(d["changes"][0]["index"], 0, "{d:#}");
}

/// `--drift-probe` is the daemon's, not people's: a request that cannot be read is refused
/// with exit 2, saying which command people want.
#[test]
fn a_check_process_without_a_request_says_what_to_run_instead() {
    let node = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let f = &pki.files;
    let mut cmd = crate::support::daemon::serve_command(
        Path::new(bin()),
        node.root(),
        NODE,
        &f.server_cert,
        &f.server_key,
        &f.ca_cert,
    );
    let out = cmd
        .arg("--drift-probe")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("run inplace-agent drift"), "{said}");
}

/// Failed on the code before: a baseline applied by the CLI without `nodeName` was reported
/// drifted by the daemon, and its repair was refused ("nodeName: is required by this
/// agent"). The plan already succeeded on this very node (its journal says so): a repair of
/// it needs no name to be sure of the node.
#[test]
fn a_baseline_applied_without_a_node_name_is_repaired() {
    let node = Node::new();
    let plan = node.plan_file(
        "unnamed.yaml",
        &format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: unnamed\n{BASELINE}"),
    );
    let out = node.agent(&["apply", "--no-progress", &plan.display().to_string()]);
    assert!(out.status.success(), "{}", text(&out));
    let pki = NodePki::new(NODE).unwrap();
    let agent = start(&node, &pki);
    wait_for(&agent, false);
    edit(&node, "/etc/kubernetes/extra.conf", "extra", "edited");
    wait_for(&agent, true);
    let (code, out) = run(&agent, &pki, As::Updater, &["repair", "--wait"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("unnamed"), "{out}");
    assert_eq!(
        std::fs::read_to_string(node.path("/etc/kubernetes/extra.conf")).unwrap(),
        "extra\n"
    );
    let d = wait_for(&agent, false);
    assert_eq!(d["baseline"]["attempt"], 2, "{d:#}");
}

/// Failed on the code before: an `absent` path whose directory did not exist when the
/// watch began was never watched, so a file recreated there was noticed only by the 5-minute
/// interval. The nearest existing ancestor is watched, and the directory once it appears.
#[test]
fn a_file_in_a_directory_made_after_the_watch_began_is_noticed_within_seconds() {
    let node = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let agent = start(&node, &pki);
    // Nothing else of the plan is in /etc/kubernetes: no watch of it for another reason.
    let baseline = plan(
        &node,
        "late",
        "changes:\n\
         \x20 - kubeletConfig: {mergePatch: {maxPods: 90}}\n\
         \x20 - absent: {path: /etc/kubernetes/late.d/deeper/stale.conf}\n",
    );
    let (code, out) = run(
        &agent,
        &pki,
        As::Updater,
        &["submit", &baseline.display().to_string(), "--wait"],
    );
    assert_eq!(code, Some(0), "{out}");
    wait_for(&agent, false);
    assert!(!node.path("/etc/kubernetes/late.d").exists());
    // Made as `mkdir -p` and a write would: each directory, then the file at once.
    let edited = Instant::now();
    std::fs::create_dir_all(node.path("/etc/kubernetes/late.d/deeper")).unwrap();
    std::fs::write(
        node.path("/etc/kubernetes/late.d/deeper/stale.conf"),
        "back\n",
    )
    .unwrap();
    let noticed = loop {
        let d = drift(&agent);
        if d["drifted"] == true {
            break edited.elapsed();
        }
        assert!(
            edited.elapsed() < Duration::from_secs(60),
            "not noticed within 60 s (the interval is 300 s): {d:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("noticed {noticed:?} after the file was made");
    // Removed again, with its directories: noticed, then made again: noticed again.
    std::fs::remove_dir_all(node.path("/etc/kubernetes/late.d")).unwrap();
    wait_for(&agent, false);
    std::fs::create_dir_all(node.path("/etc/kubernetes/late.d/deeper")).unwrap();
    let again = Instant::now();
    std::fs::write(
        node.path("/etc/kubernetes/late.d/deeper/stale.conf"),
        "again\n",
    )
    .unwrap();
    loop {
        if drift(&agent)["drifted"] == true {
            break;
        }
        assert!(
            again.elapsed() < Duration::from_secs(60),
            "the second time not noticed within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
