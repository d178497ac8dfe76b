//! Operating the agent: the status socket, `inplace-agent status`, the metrics, the logs and
//! sd_notify, against the real `inplace-agent serve` binary on sandbox node trees.
//!
//! A slow change is `kubeadmUpgradeNode` with a stand-in `kubeadm` in the node's tree (the
//! agent runs without chroot here, and still runs the root's own kubeadm) that waits until
//! the test creates a flag file, so the test decides how long the plan stays in the middle
//! of its changes.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tonic::transport::Channel;

use crate::support;
use crate::support::agent::Agent;
use crate::support::pki::{As, NodePki};
use crate::support::{Node, bin, patience, text};
use inplace_agent::status::client;
use inplace_api::convert::plan_to_pb;
use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::pki::DEFAULT_UPDATER_IDENTITY;
use inplace_plan::{Limits, parse_plan};

const NODE: &str = "obs-node";

/// Content that must never appear in the agent's logs (plans carry secrets).
const SECRET: &str = "bootstrap-token-9c1d2e.fedcba9876543210";

// === Fixtures ===

fn pki() -> NodePki {
    NodePki::new(NODE).unwrap()
}

/// A `kubeadm` stand-in at `/usr/local/bin/kubeadm` of a node's tree that waits for
/// `<dir>/release` and a flag to release it.
struct SlowKubeadm {
    dir: tempfile::TempDir,
}

impl SlowKubeadm {
    fn new(root: &std::path::Path) -> SlowKubeadm {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "#!/bin/sh\nwhile [ ! -e {0}/release ]; do sleep 0.05; done\necho \"kubeadm $*\"\n",
            dir.path().display()
        );
        let bin = root.join("usr/local/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let path = bin.join("kubeadm");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        SlowKubeadm { dir }
    }

    fn release(&self) {
        std::fs::write(self.dir.path().join("release"), "").unwrap();
    }
}

fn plan_yaml(id: &str, body: &str) -> String {
    format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nnodeName: {NODE}\n{body}")
}

fn wire(yaml: &str) -> pb::Plan {
    let plan =
        parse_plan(yaml.as_bytes(), "test", &Limits::default()).unwrap_or_else(|e| panic!("{e}"));
    plan_to_pb(&plan)
}

async fn submit(client: &mut NodeAgentClient<Channel>, yaml: &str) -> pb::PlanStatus {
    client
        .apply_plan(pb::ApplyPlanRequest {
            plan: Some(wire(yaml)),
            retry: false,
        })
        .await
        .unwrap_or_else(|e| panic!("ApplyPlan: {e}"))
        .into_inner()
        .status
        .unwrap()
}

/// Polls `/v1/plans/{id}` until `done` holds.
fn wait_plan(agent: &Agent, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = support::deadline();
    loop {
        let (code, v) = agent.get(&format!("/v1/plans/{id}"));
        if code == 200 && done(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "plan {id}: never {what}; last: {v:#}\nlog:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn finished(agent: &Agent, id: &str) -> Value {
    wait_plan(agent, id, "finished", |v| {
        matches!(
            v["phase"].as_str(),
            Some("Succeeded" | "Failed" | "RolledBack" | "Cancelled" | "Superseded")
        )
    })
}

/// The slow plan: a file with a secret, `kubeadm upgrade node` fed by it (the stand-in
/// waits), another file, and one gate: 3 changes + 1 gate.
fn slow_plan(id: &str) -> String {
    plan_yaml(
        id,
        &format!(
            "changes:\n  - file: {{path: /etc/kubernetes/kubeadm-{id}.yaml, content: \"{SECRET}\\n\"}}\n  - kubeadmUpgradeNode: {{extraArgs: [--config, /etc/kubernetes/kubeadm-{id}.yaml]}}\n  - file: {{path: /etc/kubernetes/after-{id}.conf, content: \"after\\n\", restartUnits: [kubelet.service]}}\nverify:\n  - command: {{argv: [\"true\"]}}\n"
        ),
    )
}

/// Runs the agent binary as a client (`status` and friends).
fn cli(args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .env_remove("INPLACE_AGENT_ROOT")
        .env_remove("INPLACE_AGENT_STATE_DIR")
        .env_remove("INPLACE_AGENT_CONFIG")
        .env_remove("INPLACE_AGENT_ADDR")
        .env_remove("INPLACE_AGENT_STATUS_SOCKET")
        .env("INPLACE_AGENT_LOG", "error")
        .output()
        .unwrap()
}

fn json_out(out: &std::process::Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(out)))
}

// === The status socket and `inplace-agent status` ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_plan_says_where_it_is_and_then_how_it_ended() {
    let node = Node::new();
    let pki = pki();
    let kubeadm = SlowKubeadm::new(node.root());
    let agent = Agent::start(&node, &pki, &[]);
    let root = node.root().display().to_string();
    let mut admin = pki.client(&agent.addr, As::Updater).await;
    let accepted = submit(&mut admin, &slow_plan("slow")).await;

    // Held in changes[1]: step 2 of 4, kubeadmUpgradeNode running.
    let deadline = support::deadline();
    let status = loop {
        let (code, v) = agent.get("/v1/status");
        assert_eq!(code, 200, "{v:#}");
        if v["current"]["runningChange"]["index"] == 1 {
            break v;
        }
        assert!(Instant::now() < deadline, "never ran changes[1]: {v:#}");
        std::thread::sleep(Duration::from_millis(25));
    };
    assert_eq!(status["apiVersion"], "inplace.agent/v1");
    assert_eq!(status["kind"], "AgentStatus");
    assert_eq!(status["source"], "agent");
    assert_eq!(status["node"]["name"], NODE);
    let current = &status["current"];
    assert_eq!(current["id"], "slow");
    assert_eq!(current["digest"], accepted.digest);
    assert_eq!(current["phase"], "Applying");
    assert_eq!(
        (current["step"].as_u64(), current["steps"].as_u64()),
        (Some(2), Some(4))
    );
    assert_eq!(current["runningChange"]["kind"], "kubeadmUpgradeNode");
    assert_eq!(current["runningChange"]["state"], "Running");
    assert_eq!(current["counts"]["changed"], 1);
    assert_eq!(current["hookResponse"]["retryAfterSeconds"], 10);
    // One numbering: the hook response says the same step.
    assert!(
        current["hookResponse"]["message"]
            .as_str()
            .unwrap()
            .starts_with("plan slow: Applying step 2/4: changes[1] kubeadmUpgradeNode"),
        "{current:#}"
    );
    assert!(current["elapsedMs"].as_u64().is_some(), "{current:#}");
    assert_eq!(status["agent"]["pid"], agent.child.id());

    // The readiness probe of the DaemonSet.
    let out = cli(&["status", "--root", &root, "--healthz"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");

    // The same through the command, in JSON and for people.
    let out = cli(&["status", "--root", &root, "--output", "json"]);
    assert!(out.status.success(), "{}", text(&out));
    let seen = json_out(&out);
    assert_eq!(seen["source"], "agent");
    assert_eq!(seen["current"]["runningChange"]["index"], 1);
    assert_eq!(seen["current"]["step"], 2);
    assert_eq!(seen["current"]["steps"], 4);
    let out = cli(&["status", "--root", &root]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(shown.contains("running: plan slow attempt 1"), "{shown}");
    assert!(shown.contains("Applying, step 2/4 (50%), for "), "{shown}");
    assert!(
        shown.contains("now: changes[1] kubeadmUpgradeNode"),
        "{shown}"
    );

    // `status --watch` follows it to the end (plain lines: not a terminal).
    let watcher = Command::new(bin())
        .args(["status", "--root", &root, "--watch"])
        .env("INPLACE_AGENT_LOG", "error")
        .env_remove("INPLACE_AGENT_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let held = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    kubeadm.release();
    let watched = watcher.wait_with_output().unwrap();
    assert!(watched.status.success(), "{}", text(&watched));
    let lines = String::from_utf8_lossy(&watched.stderr).into_owned();
    assert!(
        lines.contains("[2/3] changes[1] kubeadmUpgradeNode")
            && lines.contains("[3/3] changes[2] file")
            && lines.contains("plan slow attempt 1: Succeeded"),
        "{lines}"
    );
    // What happened to the units is shown as it happens (here: no service management).
    assert!(
        lines.contains("  kubelet.service not restarted: this agent's service management is off"),
        "{lines}"
    );
    assert!(
        String::from_utf8_lossy(&watched.stdout).contains("phase: Succeeded"),
        "{}",
        text(&watched)
    );
    let done = finished(&agent, "slow");
    assert_eq!(done["kind"], "PlanStatus");
    assert_eq!(done["phase"], "Succeeded", "{done:#}");
    assert_eq!(done["hookResponse"]["status"], "Success");
    assert_eq!(done["counts"]["changed"], 3);
    let (_, after) = agent.get("/v1/status");
    assert!(after.get("current").is_none(), "{after:#}");
    let recent = &after["recent"][0];
    assert_eq!(recent["id"], "slow");
    assert_eq!(recent["phase"], "Succeeded");
    let took = recent["durationMs"].as_u64().unwrap();
    assert!(
        took >= 300 && took < held.elapsed().as_millis() as u64 + 60_000,
        "{recent:#}"
    );
    let out = cli(&["status", "--root", &root, "-o", "json"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(json_out(&out)["recent"][0]["durationMs"], took);
    let out = cli(&["status", "--root", &root, "slow", "-o", "hook-response"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(
            r#""status":"Success","message":"plan slow succeeded: 3 changed, 0 unchanged""#
        ),
        "{}",
        text(&out)
    );

    // The journal, paged, without the plan's content.
    let (code, page) = agent.get("/v1/journal?since=0&limit=3");
    assert_eq!(code, 200);
    assert_eq!(page["kind"], "JournalRecords");
    let records = page["records"].as_array().unwrap();
    assert_eq!(records.len(), 3);
    assert_eq!(page["more"], true);
    let seqs: Vec<u64> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(records[0]["type"], "planAccepted");
    assert_eq!(records[0]["record"]["planAccepted"]["plan"], Value::Null);
    assert_eq!(records[0]["redacted"], serde_json::json!(["plan"]));
    let last = after["journal"]["lastSeq"].as_u64().unwrap();
    let (_, tail) = agent.get(&format!("/v1/journal?since={}", last - 1));
    assert_eq!(tail["records"].as_array().unwrap().len(), 1);
    assert_eq!(tail["records"][0]["type"], "planFinished");
    assert_eq!(tail["more"], false);
    let (code, bad) = agent.get("/v1/journal?since=x");
    assert_eq!((code, bad["kind"].as_str()), (400, Some("Error")));
    let (code, missing) = agent.get("/v1/plans/nope");
    assert_eq!(code, 404);
    assert!(
        missing["message"]
            .as_str()
            .unwrap()
            .contains("no plan with id \"nope\""),
        "{missing}"
    );
    let whole = agent.get("/v1/journal?limit=1000").1.to_string();
    assert!(!whole.contains(SECRET), "the socket leaked plan content");

    // Log lines about the plan carry its id and digest, change lines the change index;
    // the plan's content is never logged.
    let log = agent.log();
    assert!(!log.contains(SECRET), "{log}");
    let finished_line = log
        .lines()
        .find(|l| l.contains("plan finished"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        finished_line.contains("plan=slow") && finished_line.contains(&accepted.digest),
        "{finished_line}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("status request") && l.contains("uid=0")),
        "peer credentials are logged: {log}"
    );
}

#[test]
fn without_an_agent_status_reads_the_journal_and_says_so() {
    let node = Node::new();
    let root = node.root().display().to_string();
    let good = node.plan_file(
        "good.yaml",
        "apiVersion: inplace.agent/v1\nkind: Plan\nid: good\nchanges:\n  - file: {path: /etc/kubernetes/good.conf, content: \"good\\n\"}\n",
    );
    let bad = node.plan_file(
        "bad.yaml",
        "apiVersion: inplace.agent/v1\nkind: Plan\nid: bad\nchanges:\n  - file: {path: /etc/kubernetes/bad.conf, content: \"bad\\n\"}\nverify:\n  - command: {argv: [sh, -c, \"exit 3\"], timeoutSeconds: 1}\n",
    );
    let out = node.agent(&["apply", bad.to_str().unwrap(), "--no-chroot"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let out = node.agent(&["apply", good.to_str().unwrap(), "--no-chroot"]);
    assert!(out.status.success(), "{}", text(&out));

    let out = cli(&["status", "--root", &root]);
    assert!(out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no agent is serving on")
            && stderr.contains("read the journal")
            && stderr.contains("directly (read-only"),
        "{stderr}"
    );
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("no agent running (read from the journal)"),
        "{shown}"
    );
    assert!(shown.contains("idle: no plan is running"), "{shown}");
    assert!(
        shown.contains("last failure: plan bad attempt 1 (RolledBack")
            && shown.contains("verify[0] command sh -c exit 3"),
        "{shown}"
    );

    let out = cli(&["status", "--root", &root, "-o", "json"]);
    let v = json_out(&out);
    assert_eq!(v["source"], "journal");
    assert!(v.get("agent").is_none());
    assert_eq!(v["recent"][0]["id"], "good");
    assert_eq!(v["recent"][1]["id"], "bad");
    assert_eq!(v["lastFailure"]["id"], "bad");
    assert_eq!(v["lastFailure"]["error"]["kind"], "verification");
    assert_eq!(
        v["journal"]["records"].as_u64(),
        Some(support::journal(&node).len() as u64)
    );

    // A probe never takes the journal for an agent.
    let out = cli(&["status", "--root", &root, "--healthz"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("no agent is serving on"),
        "{}",
        text(&out)
    );
    assert!(!text(&out).contains("read the journal"), "{}", text(&out));

    let out = cli(&["status", "--root", &root, "bad", "-o", "json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a failed plan exits 1: {}",
        text(&out)
    );
    let v = json_out(&out);
    assert_eq!(v["kind"], "PlanStatus");
    assert_eq!(v["phase"], "RolledBack");
    assert_eq!(v["hookResponse"]["status"], "Failure");
}

#[test]
fn config_check_names_the_key_and_line_and_the_default_file_is_valid() {
    let node = Node::new();
    std::fs::write(node.path("/etc/hostname"), "worker-5\n").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = cli(&["config", "print-default"]);
    assert!(out.status.success(), "{}", text(&out));
    let default = String::from_utf8(out.stdout).unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(
        &file,
        default.replace(
            "root = \"/\"",
            &format!("root = {:?}", node.root().display().to_string()),
        ),
    )
    .unwrap();
    // The default names certificates that are not there and lets nobody in: valid TOML,
    // but serve would not start, and config check says so, with the fixes.
    let out = cli(&["config", "check", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("serve would not start (4 problems)")
            && said.contains("tls.cert /etc/inplace-agent/pki/server.crt: no such file")
            && said.contains("authorization.admin is empty"),
        "{said}"
    );
    assert_eq!(said.matches("inplace-agent pki init").count(), 1, "{said}");
    // With certificates for the node and an updater, it is valid.
    let pki = inplace_api::pki::init(&inplace_api::pki::PkiInitOptions::new(
        dir.path().join("pki"),
        "worker-5",
    ))
    .unwrap();
    let edited = default
        .replace(
            "root = \"/\"",
            &format!("root = {:?}", node.root().display().to_string()),
        )
        .replace(
            "cert = \"/etc/inplace-agent/pki/server.crt\"",
            &format!("cert = {:?}", pki.server_cert),
        )
        .replace(
            "key = \"/etc/inplace-agent/pki/server.key\"",
            &format!("key = {:?}", pki.server_key),
        )
        .replace(
            "client_ca = \"/etc/inplace-agent/pki/ca.crt\"",
            &format!("client_ca = {:?}", pki.ca_cert),
        )
        .replace(
            "admin = []",
            &format!("admin = [{DEFAULT_UPDATER_IDENTITY:?}]"),
        );
    std::fs::write(&file, edited).unwrap();
    let out = cli(&["config", "check", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("valid (node worker-5, gRPC on 0.0.0.0:9443, status socket "),
        "{}",
        text(&out)
    );
    std::fs::write(
        &file,
        "[status]\ngroup = \"inplace-agent\"\nmode = \"0999\"\n",
    )
    .unwrap();
    let out = cli(&["config", "check", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "error: config {} line 3 key status.mode: ",
            file.display()
        )),
        "{stderr}"
    );
}

// === Metrics ===

/// Samples of a metrics text, parsed by the Prometheus project's own Python parser
/// (`prometheus_client`): `(name, labels, value)`. `None` when the parser is not installed
/// outside CI (tests/setup installs it as root).
fn parse_metrics(text: &str, openmetrics: bool) -> Option<Vec<(String, Value, f64)>> {
    let module = if openmetrics {
        "prometheus_client.openmetrics.parser"
    } else {
        "prometheus_client.parser"
    };
    let script = format!(
        "import json, sys\nfrom {module} import text_string_to_metric_families as parse\nout = []\nfor family in parse(sys.stdin.read()):\n    for s in family.samples:\n        out.append([s.name, s.labels, s.value])\nprint(json.dumps(out))\n"
    );
    let probe = Command::new("/usr/bin/python3")
        .args(["-c", &format!("import {module}")])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("python3-prometheus-client is missing: tests/setup installs it");
        }
        eprintln!("SKIP metrics parsing: python3-prometheus-client is not installed (tests/setup)");
        return None;
    }
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parser rejected the metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples: Vec<(String, Value, f64)> = serde_json::from_slice(&out.stdout).unwrap();
    Some(samples)
}

fn sample(samples: &[(String, Value, f64)], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name
                && labels.iter().all(|(k, v)| l[*k] == *v)
                && l.as_object().map_or(0, |o| o.len()) == labels.len()
        })
        .map(|(_, _, v)| *v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_and_count_what_happened() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start_env(&node, &pki, &["--metrics-listen", "127.0.0.1:0"], &[]);
    let metrics_addr = agent
        .log()
        .split("serving metrics on http://")
        .nth(1)
        .and_then(|s| s.split('/').next())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no metrics listener: {}", agent.log()));
    let mut admin = pki.client(&agent.addr, As::Updater).await;
    submit(
        &mut admin,
        &plan_yaml(
            "ok",
            "changes:\n  - file: {path: /etc/kubernetes/ok-1.conf, content: \"1\\n\"}\n  - file: {path: /etc/kubernetes/ok-2.conf, content: \"2\\n\"}\nverify:\n  - command: {argv: [\"true\"]}\n",
        ),
    )
    .await;
    let ok = finished(&agent, "ok");
    assert_eq!(ok["phase"], "Succeeded");
    submit(
        &mut admin,
        &plan_yaml(
            "bad",
            "changes:\n  - file: {path: /etc/kubernetes/bad.conf, content: \"bad\\n\"}\nverify:\n  - command: {argv: [sh, -c, \"exit 3\"], timeoutSeconds: 1}\n",
        ),
    )
    .await;
    assert_eq!(finished(&agent, "bad")["phase"], "RolledBack");
    // A reader may not apply: one denied call.
    let mut reader = pki.client(&agent.addr, As::Reader).await;
    let denied = reader
        .apply_plan(pb::ApplyPlanRequest {
            plan: Some(wire(&plan_yaml("denied", "changes: []\n"))),
            retry: false,
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    // A client that speaks plain HTTP to the TLS port: one failed handshake.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut raw = tokio::net::TcpStream::connect(&agent.addr).await.unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(patience(), raw.read_to_end(&mut sink)).await;
    }

    // Over TCP (what a scraper sees) and over the socket: the same families.
    let tcp_text = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&metrics_addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let r = client::parse_response(&raw).unwrap();
        assert_eq!(r.status, 200);
        assert!(
            r.content_type.starts_with("text/plain; version=0.0.4"),
            "{}",
            r.content_type
        );
        let mut s = std::net::TcpStream::connect(&metrics_addr).unwrap();
        s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut other = Vec::new();
        s.read_to_end(&mut other).unwrap();
        assert_eq!(
            client::parse_response(&other).unwrap().status,
            404,
            "TCP serves metrics only"
        );
        String::from_utf8(r.body).unwrap()
    })
    .await
    .unwrap();
    let Some(samples) = parse_metrics(&tcp_text, false) else {
        return;
    };
    let get = |name: &str, labels: &[(&str, &str)]| {
        sample(&samples, name, labels)
            .unwrap_or_else(|| panic!("{name} {labels:?} missing:\n{tcp_text}"))
    };
    assert_eq!(
        get("inplace_agent_plans_total", &[("result", "Succeeded")]),
        1.0
    );
    assert_eq!(
        get("inplace_agent_plans_total", &[("result", "RolledBack")]),
        1.0
    );
    assert_eq!(
        get(
            "inplace_agent_plan_errors_total",
            &[("kind", "verification")]
        ),
        1.0
    );
    assert_eq!(
        get(
            "inplace_agent_verification_failures_total",
            &[("kind", "command")]
        ),
        1.0
    );
    assert_eq!(
        get(
            "inplace_agent_change_duration_seconds_count",
            &[("kind", "file"), ("result", "changed")]
        ),
        3.0
    );
    assert_eq!(
        get(
            "inplace_agent_rpc_denied_total",
            &[("reason", "insufficient_role")]
        ),
        1.0
    );
    let tls_failures: f64 = samples
        .iter()
        .filter(|(n, _, _)| n == "inplace_agent_tls_handshake_failures_total")
        .map(|(_, _, v)| v)
        .sum();
    assert_eq!(tls_failures, 1.0, "{tcp_text}");
    assert_eq!(
        get(
            "inplace_agent_plan_submissions_total",
            &[("outcome", "accepted")]
        ),
        2.0
    );
    assert_eq!(get("inplace_agent_phase", &[("phase", "Idle")]), 1.0);
    assert_eq!(get("inplace_agent_phase", &[("phase", "Applying")]), 0.0);
    assert_eq!(get("inplace_agent_unit_restarts_issued_total", &[]), 0.0);
    let finished_at = ok["finishedAtMs"].as_u64().unwrap() as f64 / 1000.0;
    assert!(
        (get("inplace_agent_last_success_timestamp_seconds", &[]) - finished_at).abs() < 0.0015,
        "{tcp_text}"
    );
    let journal_lines =
        std::fs::read_to_string(node.path("/var/lib/inplace-agent/journal/journal.log"))
            .unwrap()
            .lines()
            .count();
    assert_eq!(
        get("inplace_agent_journal_records", &[]),
        journal_lines as f64
    );
    let commit = inplace_agent::BUILD.commit_label();
    assert_eq!(
        get(
            "inplace_agent_build_info",
            &[("version", env!("CARGO_PKG_VERSION")), ("commit", &commit)]
        ),
        1.0
    );

    // OpenMetrics when asked for, through the socket, parsed by the OpenMetrics parser.
    let socket = agent.socket.clone();
    let open = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        s.write_all(
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text; version=1.0.0\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let r = client::parse_response(&raw).unwrap();
        assert!(r.content_type.starts_with("application/openmetrics-text"), "{}", r.content_type);
        String::from_utf8(r.body).unwrap()
    })
    .await
    .unwrap();
    let open_samples = parse_metrics(&open, true).unwrap();
    assert_eq!(
        sample(
            &open_samples,
            "inplace_agent_plans_total",
            &[("result", "RolledBack")]
        ),
        Some(1.0)
    );
}

// === Permissions ===

#[test]
fn only_root_and_the_group_can_read_the_socket() {
    if !support::require_root(
        "only_root_and_the_group_can_read_the_socket",
        "the socket belongs to root and a group",
    ) {
        return;
    }
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start_env(&node, &pki, &[], &[]);
    let meta = std::fs::metadata(&agent.socket).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o660);
    // The group was created in the node's /etc/group (not this machine's) and owns it.
    let groups = std::fs::read_to_string(node.path("/etc/group")).unwrap();
    let gid: u32 = groups
        .lines()
        .find_map(|l| l.strip_prefix("inplace-agent:x:"))
        .and_then(|rest| rest.split(':').next())
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no inplace-agent group in the node's /etc/group:\n{groups}"));
    assert_eq!(meta.gid(), gid);
    assert_eq!(meta.uid(), 0);

    // The directories on the way are open to everyone here, so the socket's own mode is what
    // decides; a copy of the binary that uid 65534 can run.
    for dir in ["/", "/run", "/run/inplace-agent"] {
        std::fs::set_permissions(node.path(dir), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let tools = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tools.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let agent_bin = tools.path().join("inplace-agent");
    std::fs::copy(bin(), &agent_bin).unwrap();
    let socket = agent.socket.display().to_string();
    let as_nobody = |groups: &str| {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid", "65534", "--regid", "65534"]);
        if groups.is_empty() {
            cmd.arg("--clear-groups");
        } else {
            cmd.args(["--groups", groups]);
        }
        cmd.arg(&agent_bin)
            .args([
                "status",
                "--socket",
                &socket,
                "--config",
                "/dev/null",
                "-o",
                "json",
            ])
            .env("INPLACE_AGENT_LOG", "error")
            .env_remove("INPLACE_AGENT_ROOT")
            .output()
            .unwrap()
    };
    let out = as_nobody("");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("permission denied on {socket}")),
        "{}",
        text(&out)
    );
    assert!(out.stdout.is_empty(), "nothing was read: {}", text(&out));
    let out = as_nobody(&gid.to_string());
    assert!(
        out.status.success(),
        "a member of the group reads it: {}",
        text(&out)
    );
    assert_eq!(json_out(&out)["source"], "agent");
    // The refused connection never reached the server; the member's did, with its uid
    // (the log is read by another thread: wait for the line).
    let deadline = support::deadline();
    while !agent
        .log()
        .lines()
        .any(|l| l.contains("status request") && l.contains("uid=65534"))
    {
        assert!(Instant::now() < deadline, "{}", agent.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

// === Load ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_status_requests_during_an_apply_all_succeed() {
    const FILES: usize = 300;
    const REQUESTS: usize = 1000;
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start_env(&node, &pki, &[], &[]);
    let mut admin = pki.client(&agent.addr, As::Updater).await;
    let flag = node.beside("release");
    let mut body = String::from("changes:\n");
    for i in 0..FILES {
        body.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/load/f-{i:03}.conf, content: \"file {i}\\n\"}}\n"
        ));
    }
    body.push_str(&format!(
        "verify:\n  - command: {{argv: [sh, -c, \"while [ ! -e {} ]; do sleep 0.05; done\"], timeoutSeconds: 120}}\n",
        flag.display()
    ));
    submit(&mut admin, &plan_yaml("load", &body)).await;

    // All at once, while the plan applies its files and then waits at its gate.
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..REQUESTS {
        let socket = agent.socket.clone();
        tasks.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::UnixStream::connect(&socket)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .map_err(|e| format!("send: {e}"))?;
            let mut raw = Vec::new();
            s.read_to_end(&mut raw)
                .await
                .map_err(|e| format!("read: {e}"))?;
            let r = client::parse_response(&raw)?;
            if r.status != 200 {
                return Err(format!("status {}", r.status));
            }
            let v: Value = serde_json::from_slice(&r.body).map_err(|e| e.to_string())?;
            Ok::<String, String>(v["current"]["phase"].as_str().unwrap_or("none").to_owned())
        });
    }
    let mut phases = std::collections::BTreeMap::<String, usize>::new();
    let mut failures = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined.unwrap() {
            Ok(phase) => *phases.entry(phase).or_default() += 1,
            Err(e) => failures.push(e),
        }
    }
    let took = started.elapsed();
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    eprintln!("{REQUESTS} concurrent status requests in {took:?}, phases seen: {phases:?}");
    // Every answer came while the plan was unfinished: its gate waits for the flag.
    assert_eq!(phases.values().sum::<usize>(), REQUESTS);
    assert!(!phases.contains_key("none"), "{phases:?}");

    std::fs::write(&flag, "").unwrap();
    let done = finished(&agent, "load");
    assert_eq!(done["phase"], "Succeeded", "{done:#}");
    assert_eq!(done["counts"]["changed"], FILES as u64);
    for i in 0..FILES {
        let path = node.path(&format!("/etc/kubernetes/load/f-{i:03}.conf"));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("file {i}\n")
        );
    }
    let records = support::journal(&node);
    let step_done = records.iter().filter(|r| r["type"] == "stepDone").count();
    assert_eq!(step_done, FILES);
}

// === systemd integration: sd_notify and journald lines ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_tells_systemd_it_is_ready_where_the_plan_is_and_that_it_lives() {
    let node = Node::new();
    let pki = pki();
    let kubeadm = SlowKubeadm::new(node.root());
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let received = Arc::new(Mutex::new(Vec::<(Instant, String)>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let received = received.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(n) = notify.recv(&mut buf) {
                    received.lock().unwrap().push((
                        Instant::now(),
                        String::from_utf8_lossy(&buf[..n]).into_owned(),
                    ));
                }
            }
        })
    };
    let mut agent = Agent::start_env(
        &node,
        &pki,
        &[],
        &[
            ("NOTIFY_SOCKET", notify_path.to_str().unwrap()),
            ("WATCHDOG_USEC", "200000"),
        ],
    );
    let mut admin = pki.client(&agent.addr, As::Updater).await;
    submit(&mut admin, &slow_plan("notified")).await;
    wait_plan(&agent, "notified", "in changes[1]", |v| {
        v["changes"][1]["state"] == "Running"
    });
    // Held a while: the watchdog keeps pinging and STATUS= shows the step.
    std::thread::sleep(Duration::from_millis(1500));
    kubeadm.release();
    finished(&agent, "notified");
    std::thread::sleep(Duration::from_millis(300));
    agent.terminate();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    reader.join().unwrap();
    let got = received.lock().unwrap().clone();
    let messages: Vec<&str> = got.iter().map(|(_, m)| m.as_str()).collect();
    let first = messages.first().copied().unwrap_or_default();
    assert!(
        first.starts_with("READY=1\nSTATUS=idle; serving on 127.0.0.1:"),
        "{messages:#?}"
    );
    let statuses: Vec<&str> = messages
        .iter()
        .filter_map(|m| m.lines().find_map(|l| l.strip_prefix("STATUS=")))
        .collect();
    assert!(
        statuses
            .iter()
            .any(|s| s
                .starts_with("plan notified: Applying step 2/4: changes[1] kubeadmUpgradeNode")),
        "STATUS= shows the phase and step: {statuses:#?}"
    );
    assert!(
        statuses
            .iter()
            .any(|s| s.contains("last: plan notified succeeded: 3 changed")),
        "{statuses:#?}"
    );
    let pings: Vec<Instant> = got
        .iter()
        .filter(|(_, m)| m == "WATCHDOG=1")
        .map(|(t, _)| *t)
        .collect();
    assert!(
        pings.len() >= 10,
        "WATCHDOG=1 every 100 ms: {} pings",
        pings.len()
    );
    let longest = pings
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    assert!(
        longest < Duration::from_millis(1000),
        "the watchdog kept pinging while a step ran (longest gap {longest:?})"
    );
    // The last word is STOPPING=1 (watchdog pings may go on while it stops).
    assert!(
        messages
            .iter()
            .rev()
            .find(|m| !m.starts_with("WATCHDOG=1"))
            .is_some_and(|m| m.starts_with("STOPPING=1")),
        "{messages:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_carry_the_plan_and_change_never_its_content() {
    // JSON: every line about the plan names it, its digest and, for a change, the index.
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start_env(&node, &pki, &["--log-format", "json"], &[]);
    let mut admin = pki.client(&agent.addr, As::Updater).await;
    let accepted = submit(
        &mut admin,
        &plan_yaml(
            "logged",
            &format!(
                "changes:\n  - file: {{path: /etc/kubernetes/logged.conf, content: \"{SECRET}\\n\"}}\nverify:\n  - command: {{argv: [sh, -c, \"exit 3\"], timeoutSeconds: 1}}\n"
            ),
        ),
    )
    .await;
    assert_eq!(finished(&agent, "logged")["phase"], "RolledBack");
    std::thread::sleep(Duration::from_millis(200));
    let log = agent.log();
    assert!(!log.contains(SECRET), "{log}");
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {e}: {l}")))
        .collect();
    let about_plan: Vec<&Value> = lines
        .iter()
        .filter(|l| {
            l["spans"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["name"] == "plan"))
        })
        .collect();
    assert!(about_plan.len() >= 4, "{log}");
    for l in &about_plan {
        let plan = l["spans"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == "plan")
            .unwrap();
        assert_eq!(plan["plan"], "logged", "{l}");
        assert_eq!(plan["digest"], accepted.digest, "{l}");
    }
    let rolled_back = about_plan
        .iter()
        .find(|l| l["message"] == "change rolled back")
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(rolled_back["span"]["name"], "change");
    assert_eq!(rolled_back["span"]["change"], 0);
    let finished_line = about_plan
        .iter()
        .find(|l| l["message"] == "plan finished")
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(finished_line["level"], "WARN");
    assert_eq!(finished_line["result"], "RolledBack");
    assert_eq!(finished_line["error_kind"], "verification");
    drop(agent);

    // Plain under journald ($JOURNAL_STREAM names stderr): a priority prefix, no timestamp.
    let node = Node::new();
    let dir = tempfile::tempdir().unwrap();
    let stderr_path = dir.path().join("stderr");
    std::fs::write(&stderr_path, "").unwrap();
    let meta = std::fs::metadata(&stderr_path).unwrap();
    let stream = format!("{}:{}", meta.dev(), meta.ino());
    let agent = Agent::start_with_stderr(
        &node,
        &pki,
        &[],
        &[("JOURNAL_STREAM", &stream), ("INPLACE_AGENT_LOG", "info")],
        Some(&stderr_path),
    );
    drop(agent);
    let written = std::fs::read_to_string(&stderr_path).unwrap();
    let first = written.lines().next().unwrap_or_default();
    assert!(first.starts_with("<6> INFO "), "{written}");
    let year = &inplace_base::time::rfc3339(inplace_base::time::now_ms())[..5];
    assert!(
        written
            .lines()
            .all(|l| l.starts_with('<') && !l.contains(year)),
        "no timestamps under journald: {written}"
    );
}
