//! The node API end to end: the real `inplace-agent serve` binary (or, where a test needs
//! the daemon's counters, the same daemon in-process) over mutual TLS on 127.0.0.1, on a
//! sandbox node tree, driven by a gRPC client and by the `submit`/`status` commands.
//!
//! The mTLS matrix (handshakes, roles, rotation) is in tests/mtls.rs; this file is about the
//! service: refusals that change nothing, idempotence under concurrency, watch streams,
//! restarts (kill -9 and SIGTERM), the hook response, the CLI client, the config file.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tonic::Code;
use tonic::transport::Channel;

use crate::support;
use crate::support::agent::Agent;
use crate::support::pki::{As, NodePki};
use crate::support::{Node, bin, diff, patience, text};
use inplace_api::convert::plan_to_pb;
use inplace_api::pb;
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::pki::{DEFAULT_READER_IDENTITY, DEFAULT_UPDATER_IDENTITY, PkiInitOptions};
use inplace_plan::{Limits, parse_plan};

const NODE: &str = "test-node";

/// Content that must never appear in the agent's logs (plans carry secrets).
const SECRET: &str = "bootstrap-token-7f3a9c.0123456789abcdef";

// === Fixtures ===

/// A throwaway PKI for the node.
fn pki() -> NodePki {
    NodePki::new(NODE).unwrap()
}

/// A plan (YAML) for the test node, validated as a plan file and put on the wire.
fn wire(yaml: &str) -> pb::Plan {
    let plan =
        parse_plan(yaml.as_bytes(), "test", &Limits::default()).unwrap_or_else(|e| panic!("{e}"));
    plan_to_pb(&plan)
}

fn plan_yaml(id: &str, body: &str) -> String {
    format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nnodeName: {NODE}\n{body}")
}

/// A configuration file for an agent on `node` with `pki` (the updater admin, every
/// `spiffe://inplace-agent/` identity reader) and `grpc` as its `[grpc]` section.
fn config_file(node: &Node, pki: &NodePki, grpc: &str) -> PathBuf {
    let f = &pki.files;
    let config = node.beside("toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"{NODE}\"\nroot = \"{}\"\nchroot = false\n\n[grpc]\n{grpc}\n[tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n[authorization]\nadmin = [\"{DEFAULT_UPDATER_IDENTITY}\"]\nreader = [\"spiffe://inplace-agent/*\"]\n",
            node.root().display(),
            f.server_cert.display(),
            f.server_key.display(),
            f.ca_cert.display()
        ),
    )
    .unwrap();
    config
}

fn phase(status: &pb::PlanStatus) -> pb::Phase {
    pb::Phase::try_from(status.phase).unwrap()
}

fn is_terminal(p: pb::Phase) -> bool {
    matches!(
        p,
        pb::Phase::Succeeded
            | pb::Phase::Failed
            | pb::Phase::RolledBack
            | pb::Phase::Superseded
            | pb::Phase::Cancelled
    )
}

async fn apply(
    client: &mut NodeAgentClient<Channel>,
    plan: &pb::Plan,
) -> Result<pb::ApplyPlanResponse, tonic::Status> {
    client
        .apply_plan(pb::ApplyPlanRequest {
            plan: Some(plan.clone()),
            retry: false,
        })
        .await
        .map(tonic::Response::into_inner)
}

async fn status(client: &mut NodeAgentClient<Channel>, id: &str) -> pb::PlanStatus {
    client
        .get_plan_status(pb::GetPlanStatusRequest { id: id.into() })
        .await
        .unwrap_or_else(|e| panic!("GetPlanStatus {id}: {e}"))
        .into_inner()
}

/// Polls until the plan's status satisfies `done`.
async fn wait_for(
    client: &mut NodeAgentClient<Channel>,
    id: &str,
    what: &str,
    done: impl Fn(&pb::PlanStatus) -> bool,
) -> pb::PlanStatus {
    let deadline = support::deadline();
    loop {
        let s = status(client, id).await;
        if done(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "plan {id}: never {what}; last: {:?} step {:?}",
            phase(&s),
            s.step
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn finished(client: &mut NodeAgentClient<Channel>, id: &str) -> pb::PlanStatus {
    wait_for(client, id, "finished", |s| is_terminal(phase(s))).await
}

/// The phases of every snapshot of a watch stream, until it ends; `ready` hears when the
/// first snapshot arrived.
async fn watch_phases(
    client: &mut NodeAgentClient<Channel>,
    id: &str,
    ready: tokio::sync::mpsc::Sender<()>,
) -> Vec<pb::Phase> {
    let mut stream = client
        .watch_plan(pb::WatchPlanRequest { id: id.into() })
        .await
        .unwrap()
        .into_inner();
    let mut phases = Vec::new();
    while let Some(s) = tokio::time::timeout(patience(), stream.message())
        .await
        .expect("watch stream stalled")
        .unwrap()
    {
        phases.push(phase(&s));
        if phases.len() == 1 {
            ready.send(()).await.unwrap();
        }
    }
    phases
}

/// Consecutive duplicates removed.
fn distinct(phases: &[pb::Phase]) -> Vec<pb::Phase> {
    let mut out = phases.to_vec();
    out.dedup();
    out
}

/// Journal records of the node whose record type is `kind` (`planAccepted`, ...).
fn records(node: &Node, kind: &str) -> Vec<serde_json::Value> {
    support::journal(node)
        .into_iter()
        .filter_map(|r| r["record"].get(kind).cloned())
        .collect()
}

/// A plan whose gates sleep (the agent runs them with `--no-chroot`).
fn slow_plan(id: &str, file: &str, gates: usize, seconds: u32) -> String {
    let mut body = format!(
        "changes:\n  - file: {{path: /etc/kubernetes/{file}, content: \"{SECRET}\\n\"}}\nverify:\n"
    );
    for _ in 0..gates {
        body.push_str(&format!(
            "  - command: {{argv: [sh, -c, \"sleep {seconds}\"], timeoutSeconds: 60}}\n"
        ));
    }
    plan_yaml(id, &body)
}

/// A plan whose only gate waits until `flag` exists: it holds the engine until the test
/// releases it (by creating the file).
fn gated_plan(id: &str, flag: &Path) -> pb::Plan {
    wire(&plan_yaml(
        id,
        &format!(
            "changes:\n  - file: {{path: /etc/kubernetes/{}.conf, content: \"held\\n\"}}\nverify:\n  - command: {{argv: [sh, -c, \"while [ ! -e {} ]; do sleep 0.05; done\"], timeoutSeconds: 120}}\n",
            id.replace('/', "-"),
            flag.display()
        ),
    ))
}

// === Refusals ===

#[tokio::test]
async fn refused_plans_change_nothing_and_say_why() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let before = node.snapshot();

    let other = wire(
        &plan_yaml(
            "other",
            "changes:\n  - sysctl: {key: vm.swappiness, value: \"1\"}\n",
        )
        .replace(&format!("nodeName: {NODE}"), "nodeName: other-node"),
    );
    let err = apply(&mut client, &other).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("\"other-node\""),
        "{}",
        err.message()
    );

    let cases = [
        (
            "no-node",
            wire("apiVersion: inplace.agent/v1\nkind: Plan\nid: no-node\nchanges: []\n"),
            "nodeName: is required",
        ),
        (
            "unknown-owner",
            wire(&plan_yaml(
                "unknown-owner",
                &format!(
                    "changes:\n  - file: {{path: /etc/kubernetes/x.conf, content: \"{SECRET}\", owner: \"kubelet-nobody\"}}\n"
                ),
            )),
            "changes[0].file.owner: ",
        ),
    ];
    for (id, plan, expected) in cases {
        let err = apply(&mut client, &plan).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{id}: {err:?}");
        assert!(err.message().contains(expected), "{id}: {}", err.message());
    }
    // Field errors the validator finds, on a hand-made wire plan (the YAML route would
    // refuse to build them).
    let mut bad = wire(&plan_yaml(
        "bad-fields",
        &format!(
            "changes:\n  - file: {{path: /etc/kubernetes/y.conf, content: \"{SECRET}\"}}\n  - file: {{path: /etc/kubernetes/z.conf, content: \"\"}}\n"
        ),
    ));
    if let Some(pb::change::Kind::File(f)) = &mut bad.changes[0].kind {
        f.mode = "0999".into();
    }
    if let Some(pb::change::Kind::File(f)) = &mut bad.changes[1].kind {
        f.path = "/etc/shadow".into();
    }
    let err = apply(&mut client, &bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("changes[0].file.mode: ")
            && err.message().contains("changes[1].file.path: "),
        "every problem with its field path: {}",
        err.message()
    );
    let err = client
        .apply_plan(pb::ApplyPlanRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "plan: is required");

    // CheckPlan explains instead of refusing.
    let report = client
        .check_plan(pb::CheckPlanRequest {
            plan: Some(other.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!report.applicable);
    assert_eq!(report.errors[0].field, "nodeName");

    for id in ["other", "no-node", "unknown-owner", "bad-fields"] {
        let err = client
            .get_plan_status(pb::GetPlanStatusRequest { id: id.into() })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound, "{id} was recorded");
    }
    let after = node.snapshot();
    assert!(
        after == before,
        "refused plans changed the node or the journal:\n{}",
        diff(&before, &after).join("\n")
    );
    assert!(!agent.log().contains(SECRET), "plan content in the log");
}

#[tokio::test]
async fn oversize_requests_and_plans_are_resource_exhausted() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(
        &node,
        &pki,
        &["--max-message-bytes", "65536", "--max-changes", "3"],
    );
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let before = node.snapshot();

    let big = "x".repeat(100_000);
    let plan = wire(&plan_yaml(
        "big",
        &format!("changes:\n  - file: {{path: /etc/kubernetes/big, content: \"{big}\"}}\n"),
    ));
    let err = apply(&mut client, &plan).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("65536"), "{}", err.message());

    let mut body = String::from("changes:\n");
    for i in 0..4 {
        body.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/many-{i}.conf, content: \"{i}\"}}\n"
        ));
    }
    let many = wire(&plan_yaml("many", &body));
    let err = apply(&mut client, &many).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message()
            .starts_with("changes: has 4 entries, more than the limit of 3"),
        "{}",
        err.message()
    );
    // The connection is still usable.
    let err = client
        .get_plan_status(pb::GetPlanStatusRequest { id: "big".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let after = node.snapshot();
    assert!(after == before, "{}", diff(&before, &after).join("\n"));
}

// === Plan documents ===

/// Sends `doc` through `SubmitPlanDocument` in pieces of `piece` bytes, declaring
/// `declared` bytes (none: no declaration).
async fn submit_document(
    client: &mut NodeAgentClient<Channel>,
    doc: &[u8],
    declared: Option<usize>,
    piece: usize,
) -> Result<pb::ApplyPlanResponse, tonic::Status> {
    let mut pieces = vec![pb::PlanDocumentPiece {
        name: "doc.yaml".into(),
        ..Default::default()
    }];
    pieces.extend(doc.chunks(piece).map(|c| pb::PlanDocumentPiece {
        data: bytes::Bytes::copy_from_slice(c),
        ..Default::default()
    }));
    let mut request = tonic::Request::new(tokio_stream::iter(pieces));
    if let Some(n) = declared {
        request
            .metadata_mut()
            .insert("inplace-document-bytes", n.to_string().parse().unwrap());
    }
    client
        .submit_plan_document(request)
        .await
        .map(tonic::Response::into_inner)
}

/// A `SubmitPlanDocument` request that declares `declared` bytes and has sent `first` of
/// them; the rest goes through the returned sender (or never comes).
async fn open_upload(
    first: &[u8],
    declared: usize,
) -> (
    tokio::sync::mpsc::Sender<pb::PlanDocumentPiece>,
    tonic::Request<tokio_stream::wrappers::ReceiverStream<pb::PlanDocumentPiece>>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::PlanDocumentPiece {
        data: bytes::Bytes::copy_from_slice(first),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request.metadata_mut().insert(
        "inplace-document-bytes",
        declared.to_string().parse().unwrap(),
    );
    (tx, request)
}

/// A plan file sent in pieces is the plan `ApplyPlan` takes (same digest: one plan, not
/// two); a document that does not arrive whole (a length other than the one declared, a
/// call that breaks), that declares no length or more than the limit, or is invalid, is
/// refused with why, and leaves the node and the journal as they were.
#[tokio::test]
async fn plan_documents_are_read_in_pieces_and_accepted_only_whole() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &["--max-message-bytes", "1048576"]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let before = node.snapshot();
    let content = "line of the document\n".repeat(20_000);
    let yaml = plan_yaml(
        "doc",
        &format!("changes:\n  - file: {{path: /etc/kubernetes/doc.conf, content: {content:?}}}\n"),
    );
    let doc = yaml.as_bytes();
    assert!(doc.len() > 400_000, "several pieces and HTTP/2 windows");

    // Each refusal: its code and what its message must say.
    let refused = |result: Result<pb::ApplyPlanResponse, tonic::Status>, code: Code, says: &str| {
        let err = result.unwrap_err();
        assert_eq!(err.code(), code, "{err:?}");
        assert!(err.message().contains(says), "{says:?} in {err:?}");
    };
    // Before the plan is read: no length, more than the limit, the wrong role.
    let result = submit_document(&mut client, doc, None, 65536).await;
    refused(
        result,
        Code::InvalidArgument,
        "inplace-document-bytes: is required",
    );
    let result = submit_document(&mut client, doc, Some(2 << 20), 65536).await;
    refused(
        result,
        Code::ResourceExhausted,
        "more than the limit of 1048576 bytes",
    );
    let mut reader = pki.client(&agent.addr, As::Reader).await;
    let result = submit_document(&mut reader, doc, Some(doc.len()), 65536).await;
    refused(result, Code::PermissionDenied, "requires admin");

    // Once it turns out not whole: shorter or longer than declared.
    let result = submit_document(&mut client, doc, Some(doc.len() + 1), 65536).await;
    let whole = format!("ended after {} bytes", doc.len());
    refused(result, Code::InvalidArgument, &whole);
    let result = submit_document(&mut client, doc, Some(doc.len() - 1), 65536).await;
    refused(result, Code::InvalidArgument, "longer than");

    // A call that breaks in the middle: half the document, then the client goes away.
    let (tx, request) = open_upload(&doc[..doc.len() / 2], doc.len()).await;
    let mut breaking = pki.client(&agent.addr, As::Updater).await;
    let call = tokio::spawn(async move { breaking.submit_plan_document(request).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    call.abort();
    drop(tx);

    // Invalid, in pieces of 7 bytes: the validator's field path.
    let invalid = plan_yaml(
        "bad",
        "changes:\n  - file: {path: /etc/kubernetes/x, content: \"\", mode: \"0999\"}\n",
    );
    let result = submit_document(&mut client, invalid.as_bytes(), Some(invalid.len()), 7).await;
    refused(result, Code::InvalidArgument, "changes[0].file.mode");

    let after = node.snapshot();
    assert!(after == before, "{}", diff(&before, &after).join("\n"));
    for id in ["doc", "bad"] {
        let err = client
            .get_plan_status(pb::GetPlanStatusRequest { id: id.into() })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound, "{id}: {err:?}");
    }

    // Whole: accepted, in pieces of every size; the same plan through ApplyPlan is known.
    let accepted = submit_document(&mut client, doc, Some(doc.len()), 65536)
        .await
        .unwrap();
    assert!(accepted.created);
    let status = accepted.status.unwrap();
    assert_eq!(status.id, "doc");
    let again = apply(&mut client, &wire(&yaml)).await.unwrap();
    assert!(
        !again.created,
        "the same plan through ApplyPlan: already known"
    );
    assert_eq!(again.status.unwrap().digest, status.digest);
    let once_more = submit_document(&mut client, doc, Some(doc.len()), 4093).await;
    let once_more = once_more.unwrap();
    assert!(!once_more.created);
    assert_eq!(
        phase(&finished(&mut client, "doc").await),
        pb::Phase::Succeeded
    );
    assert_eq!(
        std::fs::read_to_string(node.root().join("etc/kubernetes/doc.conf")).unwrap(),
        content
    );

    // As JSON, the content (over 64 KiB) is hashed while the document arrives: the same
    // plan is known by the same digest, and a new one is staged under the sum of its
    // content, applied, and has the digest ApplyPlan gives it.
    let json = |id: &str, path: &str| {
        serde_json::json!({
            "apiVersion": "inplace.agent/v1", "kind": "Plan", "id": id, "nodeName": NODE,
            "changes": [{"file": {"path": path, "content": content}}],
        })
        .to_string()
    };
    let same = json("doc", "/etc/kubernetes/doc.conf");
    let same = submit_document(&mut client, same.as_bytes(), Some(same.len()), 65536).await;
    let same = same.unwrap();
    assert!(!same.created, "the same plan as JSON: already known");
    assert_eq!(same.status.unwrap().digest, status.digest);
    let new = json("doc-json", "/etc/kubernetes/doc-json.conf");
    let new = submit_document(&mut client, new.as_bytes(), Some(new.len()), 65536).await;
    let new = new.unwrap();
    assert!(new.created);
    assert_eq!(
        phase(&finished(&mut client, "doc-json").await),
        pb::Phase::Succeeded
    );
    assert_eq!(
        std::fs::read_to_string(node.root().join("etc/kubernetes/doc-json.conf")).unwrap(),
        content
    );
    let yaml = plan_yaml(
        "doc-json",
        &format!(
            "changes:\n  - file: {{path: /etc/kubernetes/doc-json.conf, content: {content:?}}}\n"
        ),
    );
    let known = apply(&mut client, &wire(&yaml)).await.unwrap();
    assert!(
        !known.created,
        "the JSON plan through ApplyPlan: already known"
    );
    assert_eq!(known.status.unwrap().digest, new.status.unwrap().digest);
}

/// A document whose call the agent drops at its deadline, part-way, is not accepted, though
/// the part that came is a whole plan by itself.
#[tokio::test]
async fn a_plan_document_cut_short_by_the_deadline_is_not_accepted() {
    let node = Node::new();
    let pki = pki();
    let config = config_file(
        &node,
        &pki,
        "listen = \"127.0.0.1:0\"\nrequest_timeout_seconds = 1\n",
    );
    let agent = Agent::start_with_config(&config);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let before = node.snapshot();
    let head = plan_yaml(
        "cut",
        "changes:\n  - file: {path: /etc/kubernetes/cut-1.conf, content: \"1\"}\n",
    );
    let tail = "  - file: {path: /etc/kubernetes/cut-2.conf, content: \"2\"}\n";
    let (tx, request) = open_upload(head.as_bytes(), head.len() + tail.len()).await;
    // The rest never comes: the agent's 1 s deadline ends the call.
    let err = client.submit_plan_document(request).await.unwrap_err();
    drop(tx);
    assert!(
        matches!(err.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{err:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = client
        .get_plan_status(pb::GetPlanStatusRequest { id: "cut".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let after = node.snapshot();
    assert!(after == before, "{}", diff(&before, &after).join("\n"));
}

/// Plan documents that arrive slowly do not hold up other calls: their readers wait on
/// the network on threads of their own, not on the small pool status calls run on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_plan_documents_do_not_hold_up_status_calls() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let head = plan_yaml(
        "slow",
        "changes:\n  - file: {path: /etc/kubernetes/slow.conf, content: \"1\"}\n",
    );
    // More stalled uploads than the blocking pool has threads (4): each sends its first
    // piece and then nothing for as long as the test runs.
    let mut stalled = Vec::new();
    for _ in 0..6 {
        let (tx, request) = open_upload(head.as_bytes(), head.len() + 100).await;
        let mut uploader = client.clone();
        stalled.push((
            tx,
            tokio::spawn(async move { uploader.submit_plan_document(request).await }),
        ));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_plan_status(pb::GetPlanStatusRequest { id: "slow".into() }),
    )
    .await
    .expect("GetPlanStatus answered while plan documents were arriving slowly");
    assert_eq!(answer.unwrap_err().code(), Code::NotFound);
    for (tx, call) in stalled {
        drop(tx);
        let err = call.await.unwrap().unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    }
}

// === Concurrency ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_applies_run_the_plan_once() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let plan = wire(&plan_yaml(
        "default/md-0@thousand",
        "changes:\n  - file: {path: /etc/kubernetes/once.conf, content: \"once\\n\"}\n  - kubeletConfig: {mergePatch: {maxPods: 99}}\nverify:\n  - command: {argv: [sh, -c, \"sleep 0.3\"]}\n",
    ));
    let mut clients = Vec::new();
    for _ in 0..10 {
        clients.push(pki.client(&agent.addr, As::Updater).await);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000 {
        let mut client = clients[i % clients.len()].clone();
        let plan = plan.clone();
        tasks.spawn(async move { apply(&mut client, &plan).await });
    }
    let mut created = 0;
    let mut runs = std::collections::BTreeSet::new();
    let mut digests = std::collections::BTreeSet::new();
    while let Some(result) = tasks.join_next().await {
        let response = result
            .unwrap()
            .unwrap_or_else(|e| panic!("ApplyPlan: {e:?}"));
        created += usize::from(response.created);
        let status = response.status.unwrap();
        runs.insert(status.run);
        digests.insert(status.digest);
        assert_eq!(status.attempt, 1);
    }
    assert_eq!(created, 1, "exactly one call starts the plan");
    assert_eq!(runs.len(), 1, "every caller got the same run: {runs:?}");
    assert_eq!(digests.len(), 1);
    let done = finished(&mut clients[0], "default/md-0@thousand").await;
    assert_eq!(phase(&done), pb::Phase::Succeeded);
    let accepted = records(&node, "planAccepted");
    assert_eq!(accepted.len(), 1, "journaled once: {accepted:?}");
    assert_eq!(
        std::fs::read_to_string(node.path("/etc/kubernetes/once.conf")).unwrap(),
        "once\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_watchers_see_every_phase_in_order() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let mut admin = pki.client(&agent.addr, As::Updater).await;
    // A plan that holds the engine in a gate, so the watched plan waits in Pending.
    let flag = node.beside("release");
    apply(&mut admin, &gated_plan("blocker", &flag))
        .await
        .unwrap();
    wait_for(&mut admin, "blocker", "verifying", |s| {
        phase(s) == pb::Phase::Verifying
    })
    .await;
    let watched = wire(&plan_yaml(
        "watched",
        "changes:\n  - file: {path: /etc/kubernetes/watched.conf, content: \"w\\n\"}\n  - kubeletConfig: {mergePatch: {maxPods: 42}}\nverify:\n  - command: {argv: [\"true\"]}\n",
    ));
    let accepted = apply(&mut admin, &watched).await.unwrap();
    assert_eq!(phase(accepted.status.as_ref().unwrap()), pb::Phase::Pending);

    // 20 streams per connection stay under the server's 32 concurrent streams.
    let mut readers = Vec::new();
    for _ in 0..10 {
        readers.push(pki.client(&agent.addr, As::Reader).await);
    }
    let mut tasks = tokio::task::JoinSet::new();
    let (ready, mut started) = tokio::sync::mpsc::channel(200);
    for i in 0..200 {
        let mut client = readers[i % readers.len()].clone();
        let ready = ready.clone();
        tasks.spawn(async move { watch_phases(&mut client, "watched", ready).await });
    }
    // Release the blocker once every stream has its first snapshot.
    for _ in 0..200 {
        tokio::time::timeout(patience(), started.recv())
            .await
            .expect("watchers did not start")
            .unwrap();
    }
    std::fs::write(&flag, "").unwrap();
    use pb::Phase::*;
    let expected = vec![
        Pending, Preparing, Applying, Restarting, Verifying, Succeeded,
    ];
    let mut n = 0;
    while let Some(result) = tasks.join_next().await {
        let phases = result.unwrap();
        assert_eq!(distinct(&phases), expected, "stream {n}: {phases:?}");
        n += 1;
    }
    assert_eq!(n, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_falls_behind_still_sees_every_phase() {
    use inplace_agent::cli::serve::Daemon;
    use inplace_agent::config::{DaemonInput, SettingsInput};
    let node = Node::new();
    let pki = pki();
    let f = &pki.files;
    let settings = DaemonInput {
        settings: SettingsInput {
            root: Some(node.root().to_path_buf()),
            node_name: Some(NODE.into()),
            no_chroot: true,
            services_off: true,
            ..SettingsInput::default()
        },
        listen: Some(([127, 0, 0, 1], 0).into()),
        tls_cert: Some(f.server_cert.clone()),
        tls_key: Some(f.server_key.clone()),
        client_ca: Some(f.ca_cert.clone()),
        admin: Some(vec![DEFAULT_UPDATER_IDENTITY.parse().unwrap()]),
        reader: Some(vec![DEFAULT_READER_IDENTITY.parse().unwrap()]),
        ..DaemonInput::default()
    }
    .resolve()
    .unwrap();
    let daemon = Daemon::start(settings).await.unwrap();
    let addr = daemon.addr().to_string();
    let mut admin = pki.client(&addr, As::Updater).await;
    let flag = node.beside("release");
    apply(&mut admin, &gated_plan("blocker", &flag))
        .await
        .unwrap();
    wait_for(&mut admin, "blocker", "verifying", |s| {
        phase(s) == pb::Phase::Verifying
    })
    .await;
    // Thousands of journaled steps (paths that are already absent: one record each and no
    // disk syncs): more events than the broadcast keeps for a watcher that does not read,
    // and snapshots big enough to fill the HTTP/2 flow-control windows.
    let mut body = String::from("changes:\n");
    let long = "x".repeat(200);
    for i in 0..9000 {
        body.push_str(&format!(
            "  - absent: {{path: /etc/kubernetes/gone/{long}-{i:04}.conf}}\n"
        ));
    }
    body.push_str("  - kubeletConfig: {mergePatch: {maxPods: 77}}\n");
    apply(&mut admin, &wire(&plan_yaml("big", &body)))
        .await
        .unwrap();

    let mut reader = pki.client(&addr, As::Reader).await;
    let mut stream = reader
        .watch_plan(pb::WatchPlanRequest { id: "big".into() })
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(phase(&first), pb::Phase::Pending);
    std::fs::write(&flag, "").unwrap();
    // Do not read while the plan runs.
    let done = finished(&mut admin, "big").await;
    assert_eq!(phase(&done), pb::Phase::Succeeded);
    let mut phases = vec![phase(&first)];
    while let Some(s) = tokio::time::timeout(patience(), stream.message())
        .await
        .unwrap()
        .unwrap()
    {
        phases.push(phase(&s));
    }
    use pb::Phase::*;
    assert_eq!(
        distinct(&phases),
        [
            Pending, Preparing, Applying, Restarting, Verifying, Succeeded
        ],
        "{phases:?}"
    );
    assert!(
        daemon.counters().watch_lagged() > 0,
        "the watcher never fell behind; the test did not test recovery"
    );
    daemon.stop().await.unwrap();
}

// === Restarts ===

#[tokio::test]
async fn kill_9_mid_plan_then_the_plan_resumes_and_is_reported() {
    let node = Node::new();
    let pki = pki();
    // This agent is configured by file only.
    let config = config_file(&node, &pki, "listen = \"127.0.0.1:0\"\n");
    let mut agent = Agent::start_with_config(&config);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let id = "default/md-0@resume";
    apply(&mut client, &wire(&slow_plan(id, "resume.conf", 2, 2)))
        .await
        .unwrap();
    let before = wait_for(&mut client, id, "verifying", |s| {
        phase(s) == pb::Phase::Verifying
    })
    .await;
    agent.kill9();

    let agent = Agent::start_with_config(&config);
    let mut client = pki.client(&agent.addr, As::Reader).await;
    let resumed = status(&mut client, id).await;
    assert_eq!(resumed.run, before.run);
    assert_eq!(resumed.attempt, 1);
    assert_eq!(resumed.source, "grpc");
    assert_eq!(resumed.digest, before.digest);
    assert!(
        !is_terminal(phase(&resumed)),
        "reported from the journal as unfinished: {:?}",
        phase(&resumed)
    );
    assert_eq!(
        resumed.changes[0].state,
        pb::ChangeState::Changed as i32,
        "the change made before the kill is reported"
    );
    let done = finished(&mut client, id).await;
    assert_eq!(phase(&done), pb::Phase::Succeeded, "{:?}", done.error);
    // The restart is in the plan's events, for watchers and `status ID`.
    assert!(
        done.events.iter().any(|e| e
            .message
            .starts_with("the agent restarted; the run resumes in Verifying at step ")),
        "{:?}",
        done.events
    );
    assert_eq!(
        std::fs::read_to_string(node.path("/etc/kubernetes/resume.conf")).unwrap(),
        format!("{SECRET}\n")
    );
    assert_eq!(records(&node, "planAccepted").len(), 1);
    assert!(!agent.log().contains(SECRET), "plan content in the log");
}

/// A remote `status --watch` survives the agent's restart: it says it lost the agent,
/// reconnects with backoff, and follows the plan to its end (issue 15).
#[tokio::test]
async fn a_remote_watch_survives_a_restart_of_the_agent() {
    let node = Node::new();
    let pki = pki();
    let port = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap().port()
    };
    let config = config_file(&node, &pki, &format!("listen = \"127.0.0.1:{port}\"\n"));
    let mut agent = Agent::start_with_config(&config);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let id = "default/md-0@watched";
    apply(&mut client, &wire(&slow_plan(id, "watched.conf", 3, 2)))
        .await
        .unwrap();
    wait_for(&mut client, id, "verifying", |s| {
        phase(s) == pb::Phase::Verifying
    })
    .await;
    let watcher = Command::new(bin())
        .args([
            "status",
            id,
            "--watch",
            "--no-progress",
            "--addr",
            &agent.addr,
        ])
        .args(pki.client_flags(As::Reader))
        .env("INPLACE_AGENT_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    agent.kill9();
    // Down for a while: the watcher keeps trying.
    std::thread::sleep(Duration::from_secs(2));
    let agent = Agent::start_with_config(&config);
    let watched = tokio::task::spawn_blocking(move || watcher.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let said = text(&watched);
    assert_eq!(watched.status.code(), Some(0), "{said}\n{}", agent.log());
    assert_eq!(
        said.matches("(lost the agent: ").count(),
        1,
        "said once: {said}"
    );
    assert!(said.contains("trying again every few seconds"), "{said}");
    assert!(
        said.contains("(the agent answers again after ")
            && said.contains("following the plan from its status: Verifying step "),
        "{said}"
    );
    assert!(
        said.contains("the agent restarted; the run resumes"),
        "{said}"
    );
    assert!(
        String::from_utf8_lossy(&watched.stdout).contains("phase: Succeeded"),
        "{said}"
    );
}

#[tokio::test]
async fn a_failed_plan_answers_the_same_before_and_after_a_restart() {
    let node = Node::new();
    let pki = pki();
    let mut agent = Agent::start(&node, &pki, &[]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let id = "default/md-0@fails";
    let plan = wire(&plan_yaml(
        id,
        "changes:\n  - file: {path: /etc/kubernetes/fails.conf, content: \"new\\n\"}\nverify:\n  - command: {argv: [sh, -c, \"echo kubelet is unhappy >&2; exit 3\"], timeoutSeconds: 1}\n",
    ));
    let accepted = apply(&mut client, &plan).await.unwrap();
    assert!(accepted.created);
    let failed = finished(&mut client, id).await;
    assert_eq!(phase(&failed), pb::Phase::RolledBack);
    let hook = failed.hook_response.clone().unwrap();
    assert_eq!(hook.status, pb::HookStatus::Failure as i32);
    assert_eq!(hook.retry_after_seconds, 0);
    assert!(
        hook.message.contains("verify[0] command") && hook.message.contains("kubelet is unhappy"),
        "names the step and the cause: {}",
        hook.message
    );
    assert!(!node.path("/etc/kubernetes/fails.conf").exists());
    let again = apply(&mut client, &plan).await.unwrap();
    assert!(!again.created);
    assert_eq!(again.status.as_ref(), Some(&failed));

    agent.kill9();
    let agent = Agent::start(&node, &pki, &[]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    assert_eq!(
        status(&mut client, id).await,
        failed,
        "the whole status, hook response included, is the same after a restart"
    );
    let after = apply(&mut client, &plan).await.unwrap();
    assert!(
        !after.created,
        "a failed plan does not run again by resubmission"
    );
    assert_eq!(after.status.unwrap().hook_response, Some(hook));
}

#[tokio::test]
async fn sigterm_stops_after_the_current_step_and_the_plan_resumes() {
    let node = Node::new();
    let pki = pki();
    let mut agent = Agent::start(&node, &pki, &[]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let id = "default/md-0@graceful";
    apply(&mut client, &wire(&slow_plan(id, "graceful.conf", 3, 1)))
        .await
        .unwrap();
    wait_for(&mut client, id, "verifying", |s| {
        phase(s) == pb::Phase::Verifying
    })
    .await;
    let exit = agent.terminate();
    assert!(
        exit.success(),
        "serve exits 0 after SIGTERM: {exit:?}\n{}",
        agent.log()
    );
    assert!(agent.log().contains("stopping after the current step"));
    let checks = records(&node, "checkDone");
    assert!(
        !checks.is_empty() && checks.len() < 3,
        "the gate that was running finished, the next did not start: {checks:?}"
    );
    assert!(
        records(&node, "planFinished").is_empty(),
        "the plan was left unfinished, not ended"
    );

    let agent = Agent::start(&node, &pki, &[]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let done = finished(&mut client, id).await;
    assert_eq!(phase(&done), pb::Phase::Succeeded, "{:?}", done.error);
    assert_eq!(
        records(&node, "checkDone").len(),
        3,
        "gates that passed before the stop are not run again"
    );
}

// === Node info, cancel, retry ===

#[tokio::test]
async fn node_info_cancel_and_retry() {
    let node = Node::new();
    std::fs::write(
        node.path("/etc/os-release"),
        "ID=debian\nVERSION_ID=\"12\"\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n",
    )
    .unwrap();
    std::fs::create_dir_all(node.path("/proc/sys/kernel/random")).unwrap();
    std::fs::write(node.path("/proc/sys/kernel/random/boot_id"), "b00t-1d\n").unwrap();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let mut client = pki.client(&agent.addr, As::Updater).await;
    let info = client
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_name, NODE);
    assert_eq!(info.agent_version, env!("CARGO_PKG_VERSION"));
    let os = info.os.unwrap();
    assert_eq!((os.id.as_str(), os.version_id.as_str()), ("debian", "12"));
    assert_eq!(os.pretty_name, "Debian GNU/Linux 12 (bookworm)");
    assert!(!os.kernel_release.is_empty() && !os.architecture.is_empty());
    assert_eq!(info.boot_id, "b00t-1d");
    assert_eq!(
        info.package_manager, "",
        "the sandbox has no package manager"
    );
    assert!(info.supported_change_kinds.contains(&"file".to_string()));
    // An updater tests for this before it sends a certSANs change (decision 0021).
    assert!(
        info.supported_change_kinds
            .contains(&"apiServerCertificate".to_string())
    );
    assert!(!info.supported_change_kinds.contains(&"exec".to_string()));
    assert!(!info.supported_change_kinds.contains(&"package".to_string()));
    assert_eq!(info.current_plan_id, "");

    let id = "default/md-0@cancel";
    apply(&mut client, &wire(&slow_plan(id, "cancel.conf", 2, 2)))
        .await
        .unwrap();
    wait_for(&mut client, id, "verifying", |s| {
        phase(s) == pb::Phase::Verifying
    })
    .await;
    let info = client
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.current_plan_id, id);
    client
        .cancel_plan(pb::CancelPlanRequest {
            id: id.into(),
            reason: "operator asked".into(),
        })
        .await
        .unwrap();
    let cancelled = finished(&mut client, id).await;
    assert_eq!(phase(&cancelled), pb::Phase::Cancelled);
    assert!(
        !node.path("/etc/kubernetes/cancel.conf").exists(),
        "rolled back before ending cancelled"
    );
    // Who cancelled and why are journaled and shown: the error, the hook message, the
    // events, the journal.
    let said = format!("by {DEFAULT_UPDATER_IDENTITY}: operator asked");
    let error = cancelled.error.clone().unwrap();
    assert_eq!(error.detail, format!("cancelled on request {said}"));
    assert!(
        cancelled.events.iter().any(|e| e.message
            == format!("cancel requested {said}; the run stops at the next step boundary")),
        "{:?}",
        cancelled.events
    );
    let hook = cancelled.hook_response.unwrap();
    assert_eq!(hook.status, pb::HookStatus::Failure as i32);
    assert!(hook.message.contains(&said), "{}", hook.message);
    let journaled = records(&node, "cancelRequested");
    assert_eq!(journaled.len(), 1);
    assert_eq!(journaled[0]["reason"], "operator asked");

    let retry = |from_attempt| pb::RetryPlanRequest {
        id: id.into(),
        from_attempt,
    };
    let second = client.retry_plan(retry(1)).await.unwrap().into_inner();
    assert_eq!(second.attempt, 2);
    let resent = client.retry_plan(retry(1)).await.unwrap().into_inner();
    assert_eq!(
        (resent.attempt, resent.run),
        (2, second.run),
        "a resent retry starts nothing"
    );
    let err = client.retry_plan(retry(5)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    let err = client.retry_plan(retry(0)).await.unwrap_err();
    assert_eq!(
        err.code(),
        Code::FailedPrecondition,
        "attempt 2 is still running"
    );
    let done = finished(&mut client, id).await;
    assert_eq!(phase(&done), pb::Phase::Succeeded);
    let err = client
        .cancel_plan(pb::CancelPlanRequest {
            id: "nope".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

// === The CLI client ===

#[tokio::test]
async fn submit_and_status_against_serve() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let plans = node.beside("plans");
    std::fs::create_dir_all(&plans).unwrap();
    let write = |name: &str, yaml: &str| {
        let path = plans.join(name);
        std::fs::write(&path, yaml).unwrap();
        path
    };
    let good = write(
        "good.yaml",
        &plan_yaml(
            "default/md-0@cli",
            "changes:\n  - file: {path: /etc/kubernetes/cli.conf, content: \"cli\\n\"}\nverify:\n  - command: {argv: [sh, -c, \"sleep 0.2\"]}\n",
        ),
    );
    let failing = write(
        "failing.yaml",
        &plan_yaml(
            "default/md-0@cli-fails",
            "changes:\n  - file: {path: /etc/kubernetes/cli-fails.conf, content: \"x\\n\"}\nverify:\n  - command: {argv: [\"false\"], timeoutSeconds: 1}\n",
        ),
    );
    let invalid = write(
        "invalid.yaml",
        &plan_yaml(
            "invalid",
            "changes:\n  - file: {path: /etc/kubernetes/x, content: \"\", mode: \"0999\"}\n",
        ),
    );
    let elsewhere = write(
        "elsewhere.yaml",
        &plan_yaml("elsewhere", "changes: []\n").replace(NODE, "other-node"),
    );
    let run = |args: &[&str], who: As| {
        let out = Command::new(bin())
            .args(args)
            .args(["--addr", &agent.addr])
            .args(pki.client_flags(who))
            .env("INPLACE_AGENT_LOG", "error")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            text(&out),
        )
    };
    let path = |p: &PathBuf| p.display().to_string();

    let (code, stdout, all) = run(
        &["submit", &path(&good), "--wait", "-o", "json"],
        As::Updater,
    );
    assert_eq!(code, Some(0), "{all}");
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["kind"], "PlanStatus");
    assert_eq!(json["phase"], "Succeeded");
    assert_eq!(json["hookResponse"]["retryAfterSeconds"], 0);
    assert!(all.contains("Verifying"), "progress lines on stderr: {all}");

    let (code, stdout, all) = run(
        &["submit", &path(&good), "-o", "hook-response"],
        As::Updater,
    );
    assert_eq!(code, Some(0), "{all}");
    assert_eq!(
        stdout,
        "{\"apiVersion\":\"hooks.runtime.cluster.x-k8s.io/v1alpha1\",\"kind\":\"UpdateMachineResponse\",\
         \"status\":\"Success\",\"message\":\"plan default/md-0@cli succeeded: 1 changed, 0 unchanged\",\
         \"retryAfterSeconds\":0}\n"
    );
    assert!(all.contains("already known"), "{all}");

    let (code, stdout, all) = run(
        &["submit", &path(&failing), "--wait", "-o", "hook-response"],
        As::Updater,
    );
    assert_eq!(code, Some(1), "{all}");
    assert!(
        stdout.starts_with(
            "{\"apiVersion\":\"hooks.runtime.cluster.x-k8s.io/v1alpha1\",\"kind\":\"UpdateMachineResponse\",\"status\":\"Failure\",\"message\":\"plan default/md-0@cli-fails failed and was rolled back: verify[0] command false: "
        ) && stdout.ends_with(",\"retryAfterSeconds\":0}\n"),
        "{stdout}"
    );

    // From standard input: read whole first, then sent in pieces like a file.
    let piped = plan_yaml(
        "default/md-0@stdin",
        &format!(
            "changes:\n  - file: {{path: /etc/kubernetes/stdin.conf, content: {:?}}}\n",
            "from stdin\n".repeat(150_000)
        ),
    );
    let mut child = Command::new(bin())
        .args(["submit", "-", "--wait", "-o", "json", "--addr", &agent.addr])
        .args(pki.client_flags(As::Updater))
        .env("INPLACE_AGENT_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), piped.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["phase"], "Succeeded", "{}", text(&out));

    // Parsed here and sent whole (ApplyPlan): the same plan, and invalid ones said here.
    let (code, _, all) = run(&["submit", &path(&good), "--parse-locally"], As::Updater);
    assert_eq!(code, Some(0), "{all}");
    assert!(
        all.contains("already known"),
        "the same plan and digest: {all}"
    );
    let (code, stdout, all) = run(
        &["submit", &path(&invalid), "--parse-locally", "-o", "json"],
        As::Updater,
    );
    assert_eq!(code, Some(2), "{all}");
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["kind"], "InvalidPlan", "{all}");
    assert!(
        json["errors"].to_string().contains("changes[0].file.mode"),
        "{all}"
    );

    let (code, _, all) = run(&["submit", &path(&invalid)], As::Updater);
    assert_eq!(code, Some(2), "{all}");
    assert!(all.contains("changes[0].file.mode"), "{all}");
    let (code, _, all) = run(&["submit", &path(&elsewhere)], As::Updater);
    assert_eq!(code, Some(2), "{all}");
    assert!(all.contains("failed precondition"), "{all}");
    let (code, _, all) = run(&["submit", &path(&good)], As::Reader);
    assert_eq!(code, Some(1), "{all}");
    assert!(all.contains("permission denied"), "{all}");

    let (code, stdout, all) = run(&["status", "default/md-0@cli"], As::Reader);
    assert_eq!(code, Some(0), "{all}");
    assert!(stdout.contains("phase: Succeeded"), "{stdout}");
    assert!(
        stdout.contains("changes[0] file /etc/kubernetes/cli.conf: Changed"),
        "{stdout}"
    );
    let (code, _, all) = run(&["status", "default/md-0@cli-fails"], As::Reader);
    assert_eq!(code, Some(1), "a failed plan's status exits 1: {all}");
    let (code, _, all) = run(&["status", "never-submitted"], As::Reader);
    assert_eq!(code, Some(1), "{all}");
    assert!(all.contains("not found"), "{all}");
}

/// The client commands that cannot reach the agent say why and what to do (issue 15).
#[tokio::test]
async fn clients_that_cannot_connect_say_why_and_what_to_do() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let run = |addr: &str, flags: Vec<String>| {
        let out = Command::new(bin())
            .args(["status", "--addr", addr])
            .args(flags)
            .env("INPLACE_AGENT_LOG", "error")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let with = |flag: &str, value: &str| {
        let mut flags = pki.client_flags(As::Reader);
        let at = flags.iter().position(|f| f == flag).unwrap();
        flags[at + 1] = value.to_string();
        flags
    };

    // TCP probes first: logged at debug level, never as a failed handshake.
    for _ in 0..3 {
        drop(std::net::TcpStream::connect(&agent.addr).unwrap());
    }
    let deadline = support::deadline();
    while !agent
        .log()
        .contains("connection closed before any tls byte")
    {
        assert!(Instant::now() < deadline, "{}", agent.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !agent.log().contains("tls handshake failed"),
        "{}",
        agent.log()
    );

    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nobody = free.local_addr().unwrap().to_string();
    drop(free);
    let said = run(&nobody, pki.client_flags(As::Reader));
    assert!(said.contains("Connection refused"), "{said}");
    // Each cause once (issue 39: it was said three times).
    assert_eq!(said.matches("Connection refused").count(), 1, "{said}");
    assert!(said.contains("systemctl status inplace-agent"), "{said}");

    let said = run(&agent.addr, with("--server-name", "worker-7"));
    assert!(
        said.contains("the agent's certificate is not valid for \"worker-7\": it names test-node"),
        "{said}"
    );
    assert!(said.contains("--server-name test-node"), "{said}");

    let other = tempfile::tempdir().unwrap();
    let theirs =
        inplace_api::pki::init(&PkiInitOptions::new(other.path().join("pki"), NODE)).unwrap();
    let said = run(
        &agent.addr,
        with("--ca", &theirs.ca_cert.display().to_string()),
    );
    assert!(said.contains("(bad signature): another PKI's CA"), "{said}");
    assert!(
        said.contains("pass the agents' CA bundle with --ca"),
        "{said}"
    );

    let mut flags = with("--cert", &theirs.reader_cert.display().to_string());
    let at = flags.iter().position(|f| f == "--key").unwrap();
    flags[at + 1] = theirs.reader_key.display().to_string();
    let said = run(&agent.addr, flags);
    assert!(
        said.contains("the agent refused the TLS handshake"),
        "{said}"
    );
    assert!(said.contains("tls handshake failed"), "{said}");
    drop(agent);
}

/// `serve` checks what it needs before it opens anything, exits 2 naming the setting, the
/// file and the fix; `--check-configured` (the unit's ExecCondition=) is decided by the TLS
/// files (issue 15; every problem at once: tests/it/startup.rs).
#[test]
fn serve_refuses_to_start_without_what_it_needs_and_says_how_to_fix_it() {
    let node = Node::new();
    let pki = pki();
    let f = &pki.files;
    let other = tempfile::tempdir().unwrap();
    let theirs =
        inplace_api::pki::init(&PkiInitOptions::new(other.path().join("pki"), "other-node"))
            .unwrap();
    let garbage = other.path().join("garbage.crt");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let serve = |cert: &Path, key: &Path, ca: &Path, admin: bool, extra: &[&str]| {
        let mut cmd = Command::new(bin());
        cmd.args([
            "serve",
            "--config",
            "/dev/null",
            "--node-name",
            NODE,
            "--listen",
        ])
        .arg("127.0.0.1:0")
        .arg("--root")
        .arg(node.root())
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .arg("--client-ca")
        .arg(ca)
        .args(["--reader", DEFAULT_READER_IDENTITY])
        .args(extra)
        .env("INPLACE_AGENT_SERVICES", "off")
        .env_remove("INPLACE_AGENT_CONFIG")
        .stdin(Stdio::null());
        if admin {
            cmd.args(["--admin", DEFAULT_UPDATER_IDENTITY]);
        }
        let out = cmd.output().unwrap();
        (out.status.code(), text(&out))
    };
    let missing = other.path().join("missing.crt");
    let cases: [(&Path, &Path, &Path, bool, &[&str]); 5] = [
        (
            &missing,
            &f.server_key,
            &f.ca_cert,
            true,
            &[
                "tls.cert ",
                "missing.crt: no such file",
                "fix: put the agent's server certificate there, or point tls.cert in /dev/null (or --tls-cert) at it",
                "inplace-agent pki init",
            ],
        ),
        (
            &theirs.server_cert,
            &theirs.server_key,
            &f.ca_cert,
            true,
            &[
                "does not name this node \"test-node\" (it has only other-node, localhost)",
                "with the DNS name test-node",
                "node.name in /dev/null (or --node-name)",
            ],
        ),
        (
            &f.server_cert,
            &f.server_key,
            &f.ca_cert,
            false,
            &[
                "authorization.admin is empty: only readers may call the agent",
                "authorization.admin in /dev/null (or --admin)",
            ],
        ),
        (
            &f.server_cert,
            &f.updater_key,
            &f.ca_cert,
            true,
            &[
                "tls: server certificate and key",
                "fix: tls.key must be the private key of the certificate in tls.cert",
            ],
        ),
        (
            &f.server_cert,
            &f.server_key,
            &garbage,
            true,
            &[
                "tls.client_ca: ",
                "garbage.crt",
                "fix: tls.client_ca must hold the CA certificates",
            ],
        ),
    ];
    for (cert, key, ca, admin, said) in cases {
        let (code, out) = serve(cert, key, ca, admin, &[]);
        assert_eq!(code, Some(2), "{out}");
        assert!(
            out.contains(
                "error: inplace-agent cannot serve with the configuration /dev/null (1 problem):"
            ),
            "{out}"
        );
        for s in said {
            assert!(out.contains(s), "{s:?} not in:\n{out}");
        }
        assert!(
            !node.path("/var/lib/inplace-agent").exists(),
            "nothing is opened before the check"
        );
    }

    // The unit's ExecCondition=: the files decide (with one missing it also names what else is
    // wrong; with all there, serve itself refuses, exit 2, and the unit fails).
    let (code, out) = serve(
        &missing,
        &f.server_key,
        &f.ca_cert,
        false,
        &["--check-configured"],
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("inplace-agent is not configured yet, so it does not start: missing ")
            && out.contains("missing.crt"),
        "{out}"
    );
    let (code, out) = serve(
        &f.server_cert,
        &f.server_key,
        &f.ca_cert,
        false,
        &["--check-configured"],
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(!node.path("/var/lib/inplace-agent").exists());
}

// === The config file ===

#[test]
fn config_file_errors_name_the_key_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    for (content, expected) in [
        (
            "[grpc]\nlisten = \"127.0.0.1:0\"\nlisten_adress = \"127.0.0.1:1\"\n",
            "line 3 key grpc.listen_adress: unknown field `listen_adress`",
        ),
        (
            "[node]\nname = \"worker-1\"\n\n[plans]\nmax_changes = -5\n",
            "line 5 key plans.max_changes: ",
        ),
    ] {
        std::fs::write(&config, content).unwrap();
        let out = Command::new(bin())
            .args(["serve", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with(&format!("error: config {} {expected}", config.display())),
            "{stderr}"
        );
    }
}

// === Memory under abuse ===

/// A field of `/proc/<pid>/status` in KiB (`VmHWM`, `VmRSS`, `RssAnon`).
fn proc_kib(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// 64 concurrent `CheckPlan`s of 16 MiB each, each on its own connection (the hostile
/// reader of the issue drove the daemon to 405 MiB and left it at 93–166 MiB): the bytes of
/// requests held at once are bounded, the excess waits or gets RESOURCE_EXHAUSTED, and the
/// memory goes back after the burst. The bounds here are for a debug build with slack; the
/// release figures are in benches/RESULTS.md (`benches/rpc.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_concurrent_requests_are_held_to_a_memory_bound() {
    let node = Node::new();
    let pki = pki();
    let agent = Agent::start(&node, &pki, &[]);
    let pid = agent.child.id();
    let content = "x".repeat((4 << 20) - 4096);
    let changes: Vec<pb::Change> = (0..4)
        .map(|i| pb::Change {
            kind: Some(pb::change::Kind::File(pb::FileChange {
                path: format!("/etc/kubernetes/big-{i}.conf"),
                content: content.clone().into_bytes().into(),
                ..Default::default()
            })),
        })
        .collect();
    let plan = pb::Plan {
        id: "default/md-0@big".into(),
        node_name: NODE.into(),
        changes,
        ..Default::default()
    };
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let mut client = pki.client(&agent.addr, As::Reader).await;
        let plan = plan.clone();
        tasks.spawn(async move {
            client
                .check_plan(pb::CheckPlanRequest { plan: Some(plan) })
                .await
                .map(|_| ())
        });
    }
    let (mut ok, mut busy) = (0, 0);
    while let Some(result) = tasks.join_next().await {
        match result.unwrap() {
            Ok(()) => ok += 1,
            Err(e) if e.code() == Code::ResourceExhausted => busy += 1,
            Err(e) => panic!("CheckPlan: {e:?}"),
        }
    }
    let peak_mib = proc_kib(pid, "VmHWM") / 1024;
    eprintln!("64 x 16 MiB CheckPlan: {ok} answered, {busy} busy; peak RSS {peak_mib} MiB");
    assert!(ok >= 1, "some were answered");
    assert!(peak_mib <= 96, "peak RSS {peak_mib} MiB");
    // The memory goes back within a minute.
    let deadline = support::deadline();
    loop {
        let anon_mib = proc_kib(pid, "RssAnon") / 1024;
        if anon_mib <= 16 {
            eprintln!(
                "RssAnon back to {anon_mib} MiB, RSS {} MiB",
                proc_kib(pid, "VmRSS") / 1024
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "RssAnon still {anon_mib} MiB after a minute"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // And the agent still answers.
    let mut client = pki.client(&agent.addr, As::Reader).await;
    client
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap();
}
