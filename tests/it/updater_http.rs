//! The updater's HTTP contract, driven as Cluster API's Go client calls (POST, `?timeout=10s`,
//! no Content-Type, Go's headers, ALPN `h2` + `http/1.1`), against the real binary: TLS 1.2
//! and 1.3, HTTP/1.1, the fixtures' shapes, every bad or hostile body answered with a
//! `status: Failure` body naming the field (never a panic, never an empty 500), probes and
//! metrics, the serving certificate reloaded when its files change.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncWriteExt, split};

use crate::support::updater::*;
use inplace_updater::emulate::{CapiClient, read_response};
use inplace_updater::hooks::Hook;

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/updater")
            .join(name),
    )
    .unwrap()
}

async fn world(subnet: u8) -> World {
    let mut w = World::new(subnet).await;
    w.start_updater();
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_12_and_13_http_11_and_discovery_exactly_as_capi_reads_it() {
    let w = world(30).await;
    let addr = w.updater_addr.unwrap();
    for (versions, want) in [
        (vec![&rustls::version::TLS12], "TLSv1_2"),
        (vec![&rustls::version::TLS13], "TLSv1_3"),
    ] {
        let client = CapiClient::with_versions(addr, SERVICE_HOST, &w.pki.ca(), &versions).unwrap();
        let (version, alpn, _) = client.handshake().await.unwrap();
        assert_eq!(version, want);
        assert_eq!(
            alpn.as_deref(),
            Some("http/1.1"),
            "h2 is offered, HTTP/1.1 chosen"
        );
        let mut client = client;
        let r = client
            .call(Hook::Discovery, br#"{"kind":"DiscoveryRequest","apiVersion":"hooks.runtime.cluster.x-k8s.io/v1alpha1"}"#)
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(
            r.body,
            fixture("discovery-response.json"),
            "the fixture, byte for byte"
        );
    }
    // The fixture's CanUpdateMachineSet answer from the real server, on a kept-alive
    // connection, with the query CAPI adds.
    let mut capi = w.client();
    // The current MachineSet exists (the updater reads it live).
    w.api.put(
        serde_json::from_slice::<serde_json::Value>(&fixture("can-update-machineset-request.json"))
            .unwrap()["current"]["machineSet"]
            .clone(),
    );
    for _ in 0..3 {
        let r = capi
            .call(
                Hook::CanUpdateMachineSet,
                &fixture("can-update-machineset-request.json"),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        let v = r.json();
        assert_eq!(v["kind"], "CanUpdateMachineSetResponse");
        assert_eq!(v["status"], "Success");
        let text = String::from_utf8(r.body.clone()).unwrap();
        assert!(text.starts_with(r#"{"kind":"CanUpdateMachineSetResponse","apiVersion":"hooks.runtime.cluster.x-k8s.io/v1alpha1","status":"Success""#), "{text}");
        for p in ["machineSetPatch", "bootstrapConfigTemplatePatch"] {
            assert_eq!(v[p]["patchType"], "JSONPatch");
            assert!(
                v[p]["patch"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty() && s.len() % 4 == 0),
                "{v}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_failure_bodies_that_name_the_field() {
    let w = world(31).await;
    let mut capi = w.client();
    let update = fixture("update-machine-request.json");
    let mut no_machine: Value = serde_json::from_slice(&update).unwrap();
    no_machine["desired"]
        .as_object_mut()
        .unwrap()
        .remove("machine");
    let mut wrong_object: Value = serde_json::from_slice(&update).unwrap();
    wrong_object["desired"]["machine"]["kind"] = json!("MachineSet");
    let mut bad_setting: Value = serde_json::from_slice(&update).unwrap();
    bad_setting["settings"]["agentPort"] = json!("not-a-port");
    let mut bad_api: Value = serde_json::from_slice(&update).unwrap();
    bad_api["apiVersion"] = json!("hooks.runtime.cluster.x-k8s.io/v1alpha0");
    let cases: Vec<(Hook, Vec<u8>, &str)> = vec![
        (Hook::UpdateMachine, b"{not json".to_vec(), "not JSON"),
        (Hook::UpdateMachine, b"".to_vec(), "not JSON"),
        (
            Hook::UpdateMachine,
            b"[1,2,3]".to_vec(),
            "not a JSON object",
        ),
        (
            Hook::UpdateMachine,
            fixture("can-update-machine-request.json"),
            "kind: is \"CanUpdateMachineRequest\"",
        ),
        (
            Hook::CanUpdateMachine,
            fixture("update-machine-request.json"),
            "kind: is \"UpdateMachineRequest\"",
        ),
        (
            Hook::CanUpdateMachineSet,
            fixture("can-update-machine-request.json"),
            "kind:",
        ),
        (Hook::UpdateMachine, go_json(&bad_api), "apiVersion:"),
        (
            Hook::UpdateMachine,
            go_json(&no_machine),
            "desired.machine: missing",
        ),
        (
            Hook::UpdateMachine,
            go_json(&wrong_object),
            "desired.machine.kind",
        ),
        (
            Hook::UpdateMachine,
            go_json(&bad_setting),
            "settings.agentPort",
        ),
        (
            Hook::Discovery,
            br#"{"kind":"UpdateMachineRequest"}"#.to_vec(),
            "kind:",
        ),
    ];
    for (hook, body, want) in cases {
        let r = capi.call(hook, &body).await.unwrap();
        assert_eq!(r.status, 200, "{hook}");
        let v = r.json();
        assert_eq!(v["status"], "Failure", "{hook}: {v}");
        assert_eq!(v["kind"], hook.response_kind());
        let message = v["message"].as_str().unwrap();
        assert!(
            message.contains(want),
            "{hook}: {message:?} should say {want:?}"
        );
        if hook == Hook::UpdateMachine {
            assert_eq!(v["retryAfterSeconds"], 0, "always written, no omitempty");
        }
    }
    // Wrong method and unknown paths: still a JSON body.
    let r = capi
        .request("GET", &Hook::UpdateMachine.path(), b"")
        .await
        .unwrap();
    assert_eq!(r.status, 405);
    assert_eq!(r.json()["status"], "Failure");
    let r = capi
        .request(
            "POST",
            "/hooks.runtime.cluster.x-k8s.io/v1alpha1/updatemachine/other?timeout=10s",
            b"{}",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 404);
    assert!(r.json()["message"].as_str().unwrap().contains("no hook at"));
    // The log names the hook and the body's digest; never a body.
    assert!(!w.updater_log().contains(BOOTSTRAP_TOKEN));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_are_refused_with_a_body_and_the_server_keeps_serving() {
    let w = world(32).await;
    let capi = w.client();
    let path = format!("{}?timeout=10s", Hook::UpdateMachine.path());

    // 100 MB announced: refused from the head, without reading the body.
    let mut tls = capi.connect().await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {SERVICE_HOST}:443\r\nUser-Agent: Go-http-client/1.1\r\nContent-Length: {}\r\nAccept-Encoding: gzip\r\n\r\n",
        100u64 << 20
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.write_all(&[b' '; 4096]).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), read_response(&mut tls))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "Failure");
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("larger than the limit"),
        "{}",
        r.json()
    );

    // 100 MB streamed without a length (chunked): cut at the limit, answered, closed.
    let tls = capi.connect().await.unwrap();
    let (mut rd, mut wr) = split(tls);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {SERVICE_HOST}:443\r\nUser-Agent: Go-http-client/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        let chunk = vec![b'['; 1 << 20];
        let mut sent = 0u64;
        while sent < 100 << 20 {
            wr.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .await?;
            wr.write_all(&chunk).await?;
            wr.write_all(b"\r\n").await?;
            sent += chunk.len() as u64;
        }
        wr.write_all(b"0\r\n\r\n").await?;
        Ok::<u64, std::io::Error>(sent)
    });
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(60), read_response(&mut rd))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.json()["status"], "Failure", "{}", r.json());
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("larger than the limit")
    );
    assert_eq!(r.header("connection"), Some("close"));
    writer.abort();
    assert!(started.elapsed() < Duration::from_secs(60));

    // Deep nesting: refused by the JSON reader's depth limit, not by a stack overflow.
    let mut capi = w.client();
    let deep = format!("{}{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
    let r = capi
        .call(Hook::UpdateMachine, deep.as_bytes())
        .await
        .unwrap();
    assert_eq!(r.json()["status"], "Failure");
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("nesting depth limit of 64"),
        "{}",
        r.json()
    );
    let deep_object = format!("{}1{}", r#"{"kind":"#.repeat(200_000), "}".repeat(200_000));
    let r = capi
        .call(Hook::CanUpdateMachine, deep_object.as_bytes())
        .await
        .unwrap();
    assert_eq!(r.json()["status"], "Failure");

    // Still serving, and the probes and metrics say so.
    let r = capi
        .call(Hook::Discovery, br#"{"kind":"DiscoveryRequest","apiVersion":"hooks.runtime.cluster.x-k8s.io/v1alpha1"}"#)
        .await
        .unwrap();
    assert_eq!(r.json()["status"], "Success");
    for p in ["/healthz", "/readyz"] {
        assert_eq!(
            capi.request("GET", p, b"").await.unwrap().status,
            200,
            "{p}"
        );
    }
    let metrics =
        String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    assert!(
        metrics.contains(
            r#"inplace_updater_requests_total{hook="UpdateMachine",outcome="failure"} 3"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("inplace_updater_request_duration_seconds_bucket"),
        "{metrics}"
    );
    assert!(
        metrics.contains("inplace_updater_agents_unreachable_total"),
        "{metrics}"
    );
    assert!(
        w.updater.as_ref().unwrap().log().contains("body too large")
            || w.updater_log_shows("larger than")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serving_certificate_is_reloaded_when_its_files_change() {
    let w = world(33).await;
    let client = w.client();
    let (_, _, before) = client.handshake().await.unwrap();
    // cert-manager writes a new pair into the same files.
    let serving = w
        .pki
        .server("serving", &[SERVICE_HOST, "rotated.inplace-system.svc"])
        .unwrap();
    let new_der = inplace_api::tls::load_certificates(&serving.cert).unwrap()[0].to_vec();
    assert_ne!(before, new_der);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, _, now) = client.handshake().await.unwrap();
        if now == new_der {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new certificate was not served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut capi = w.client();
    let metrics =
        String::from_utf8(capi.request("GET", "/metrics", b"").await.unwrap().body).unwrap();
    assert!(
        metrics.contains("inplace_updater_tls_reloads_total 1"),
        "{metrics}"
    );
}

#[test]
fn a_missing_certificate_stops_serve_with_the_file_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.crt");
    let out = std::process::Command::new(UPDATER)
        .args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&missing)
        .arg("--tls-key")
        .arg(&missing)
        .arg("--agent-ca")
        .arg(&missing)
        .arg("--agent-cert")
        .arg(&missing)
        .arg("--agent-key")
        .arg(&missing)
        .arg("--kubeconfig")
        .arg(&missing)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().last().unwrap_or("");
    assert!(line.contains(&missing.display().to_string()), "{err}");
    assert_eq!(
        line.matches("No such file or directory").count(),
        1,
        "{line}"
    );
}

const DISCOVERY: &[u8] =
    br#"{"kind":"DiscoveryRequest","apiVersion":"hooks.runtime.cluster.x-k8s.io/v1alpha1"}"#;

/// Cluster API's client sends its next call on the pooled connection when the updater asked
/// it to come back (`retryAfterSeconds`: 10 while a plan runs). The updater's old 10 s header
/// timeout closed that idle connection just as the call went out (`EOF`, a spurious hook
/// failure). Now the connection outlives the wait: the next call goes out on the same
/// connection, past the request limit of 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_outlives_the_wait_capi_is_asked_for() {
    let w = world(33).await;
    let mut client = w.client();
    let r = client.call(Hook::Discovery, DISCOVERY).await.unwrap();
    assert_eq!(r.status, 200);
    // 1.1 × the request limit (10 s) and more than the retryAfterSeconds of a running plan.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let r = client.call(Hook::Discovery, DISCOVERY).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        client.connections(),
        1,
        "the second call went out on the pooled connection"
    );
}

/// With the server's idle limit shortened to 3 s and a client whose pool keeps connections
/// for 2.25 s (Go's 90 s against the default 120 s), calls 0.9×, 1.0× and 1.1× the server's
/// limit after the last never meet a connection closed under them; a request that has
/// started and stalls is still cut off after 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_at_the_idle_limit_never_meet_a_closed_connection_and_a_stalled_request_is_cut() {
    let mut w = World::new(34).await;
    w.start_updater_with(&["--idle-timeout", "3"]);
    let mut client = w.client().with_idle_timeout(Duration::from_millis(2250));
    client.call(Hook::Discovery, DISCOVERY).await.unwrap();
    for wait_ms in [2700, 3000, 3300] {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        let r = client.call(Hook::Discovery, DISCOVERY).await;
        assert!(r.is_ok(), "after {wait_ms} ms: {r:?}");
    }
    // A client that keeps its connection longer than the server's limit finds it closed
    // before it sends (as Go's read loop would), never after.
    let mut late = w.client().with_idle_timeout(Duration::from_secs(90));
    late.call(Hook::Discovery, DISCOVERY).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3300)).await;
    late.call(Hook::Discovery, DISCOVERY).await.unwrap();
    assert_eq!(late.connections(), 2, "the server closed the idle one");

    // A request whose head stalls is closed 10 s after its first byte.
    let mut conn = w.client().connect().await.unwrap();
    conn.write_all(
        b"POST /hooks.runtime.cluster.x-k8s.io/v1alpha1/discovery HTTP/1.1\r\nHost: x\r\n",
    )
    .await
    .unwrap();
    let started = Instant::now();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::io::AsyncReadExt::read_to_end(&mut conn, &mut rest),
    )
    .await
    .expect("the server closes a stalled request");
    let _ = read;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(20),
        "closed after {took:?}"
    );
}
