//! End-to-end tests of the gRPC wire security: a real tonic server on 127.0.0.1 with the
//! agent's TLS acceptor, authorization layer, health and reflection, and a test-only
//! `NodeAgent` that returns canned answers. Certificates are made with rcgen, and in one
//! test with the `openssl` CLI.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::support::{eventually_async, patience};
use inplace_agent::rpc::server::{Security, ServeError, ServeOptions, serve};
use inplace_api::authz::{AuthzCounters, AuthzRules, Caller};
use inplace_api::pb::node_agent_client::NodeAgentClient;
use inplace_api::pb::node_agent_server::NodeAgent;
use inplace_api::pb::{self, Phase};
use inplace_api::tls::{
    self, ClientTlsPaths, HandshakeFailure, ReloadingServerConfig, ServerTlsPaths, TlsConnectInfo,
    TlsCounters,
};

const ADMIN: &str = "spiffe://test/updater";
const READER: &str = "spiffe://test/reader";
const STRANGER: &str = "spiffe://test/stranger";

// === Certificates ===

struct TestCa {
    params: CertificateParams,
    key: KeyPair,
    pem: String,
}

/// What a leaf certificate should look like.
struct Leaf {
    sans: Vec<SanType>,
    common_name: String,
    eku: Vec<ExtendedKeyUsagePurpose>,
    expired: bool,
}

/// A certificate and key, as PEM.
struct Material {
    cert: String,
    key: String,
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

impl TestCa {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let pem = params.self_signed(&key).unwrap().pem();
        Self { params, key, pem }
    }

    fn issue(&self, leaf: Leaf) -> Material {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(&leaf.common_name);
        params.subject_alt_names = leaf.sans;
        params.extended_key_usages = leaf.eku;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.is_ca = IsCa::ExplicitNoCa;
        let now = time::OffsetDateTime::now_utc();
        if leaf.expired {
            params.not_before = now - time::Duration::days(2);
            params.not_after = now - time::Duration::days(1);
        } else {
            params.not_before = now - time::Duration::hours(1);
            params.not_after = now + time::Duration::days(1);
        }
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).unwrap();
        Material {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

fn uri(s: &str) -> SanType {
    SanType::URI(s.try_into().unwrap())
}

fn client_leaf(identity: &str) -> Leaf {
    Leaf {
        sans: vec![uri(identity)],
        common_name: "client".into(),
        eku: vec![ExtendedKeyUsagePurpose::ClientAuth],
        expired: false,
    }
}

fn server_leaf() -> Leaf {
    Leaf {
        sans: vec![
            SanType::DnsName("test-node".try_into().unwrap()),
            SanType::DnsName("localhost".try_into().unwrap()),
            SanType::IpAddress([127, 0, 0, 1].into()),
        ],
        common_name: "test-node".into(),
        eku: vec![ExtendedKeyUsagePurpose::ServerAuth],
        expired: false,
    }
}

/// Replaces a file by rename, as a Kubernetes Secret volume update does (new inode).
fn write_atomic(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Writes the server's files (server.crt, server.key, ca.crt) into `dir`.
fn install_server_material(dir: &Path, ca: &TestCa, server: &Material) -> ServerTlsPaths {
    let paths = ServerTlsPaths::in_dir(dir);
    write_atomic(&paths.cert, &server.cert);
    write_atomic(&paths.key, &server.key);
    write_atomic(&paths.client_ca, &ca.pem);
    paths
}

/// Writes a client's files into `dir/<name>.*`, trusting the CAs in `trust`.
fn install_client_material(
    dir: &Path,
    name: &str,
    trust: &[&str],
    client: &Material,
) -> ClientTlsPaths {
    let paths = ClientTlsPaths {
        ca: dir.join(format!("{name}-ca.crt")),
        cert: dir.join(format!("{name}.crt")),
        key: dir.join(format!("{name}.key")),
    };
    std::fs::write(&paths.ca, trust.concat()).unwrap();
    std::fs::write(&paths.cert, &client.cert).unwrap();
    std::fs::write(&paths.key, &client.key).unwrap();
    paths
}

// === A test-only NodeAgent ===

/// Canned answers; every status message records who called (from the `Caller` and
/// `TlsConnectInfo` extensions) so tests can see what reached the handler.
struct FakeAgent;

fn caller<T>(request: &Request<T>) -> String {
    let caller = request.extensions().get::<Caller>();
    let info = request.extensions().get::<TlsConnectInfo>();
    match (caller, info) {
        (Some(caller), Some(info))
            if info.remote_addr.is_some_and(|a| a.ip().is_loopback())
                && info.peer_certificate.is_some() =>
        {
            format!("{} as {}", caller.identity, caller.role)
        }
        _ => "caller unknown".into(),
    }
}

fn status(id: &str, phase: Phase, attempt: u32, by: String) -> pb::PlanStatus {
    pb::PlanStatus {
        id: id.into(),
        digest: "0".repeat(64),
        attempt,
        phase: phase as i32,
        step: Some(pb::Step {
            index: 0,
            total: 1,
            message: by,
        }),
        ..Default::default()
    }
}

type StatusStream = Pin<Box<dyn Stream<Item = Result<pb::PlanStatus, Status>> + Send>>;

#[tonic::async_trait]
impl NodeAgent for FakeAgent {
    async fn get_node_info(
        &self,
        request: Request<pb::GetNodeInfoRequest>,
    ) -> Result<Response<pb::GetNodeInfoResponse>, Status> {
        Ok(Response::new(pb::GetNodeInfoResponse {
            node_name: "test-node".into(),
            agent_version: caller(&request),
            ..Default::default()
        }))
    }

    async fn check_plan(
        &self,
        request: Request<pb::CheckPlanRequest>,
    ) -> Result<Response<pb::CheckPlanResponse>, Status> {
        let plan = request.into_inner().plan.unwrap_or_default();
        Ok(Response::new(pb::CheckPlanResponse {
            digest: "0".repeat(64),
            applicable: true,
            would_change: !plan.changes.is_empty(),
            ..Default::default()
        }))
    }

    async fn apply_plan(
        &self,
        request: Request<pb::ApplyPlanRequest>,
    ) -> Result<Response<pb::ApplyPlanResponse>, Status> {
        let by = caller(&request);
        let plan = request.into_inner().plan.unwrap_or_default();
        Ok(Response::new(pb::ApplyPlanResponse {
            status: Some(status(&plan.id, Phase::Pending, 1, by)),
            created: true,
        }))
    }

    async fn get_plan_status(
        &self,
        request: Request<pb::GetPlanStatusRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        let by = caller(&request);
        let id = request.into_inner().id;
        if id == "missing" {
            return Err(Status::not_found("plan missing is not known"));
        }
        Ok(Response::new(status(&id, Phase::Applying, 1, by)))
    }

    type WatchPlanStream = StatusStream;

    async fn watch_plan(
        &self,
        request: Request<pb::WatchPlanRequest>,
    ) -> Result<Response<Self::WatchPlanStream>, Status> {
        let by = caller(&request);
        let id = request.into_inner().id;
        let snapshots = vec![
            Ok(status(&id, Phase::Applying, 1, by.clone())),
            Ok(status(&id, Phase::Succeeded, 1, by)),
        ];
        Ok(Response::new(Box::pin(tokio_stream::iter(snapshots))))
    }

    async fn cancel_plan(
        &self,
        request: Request<pb::CancelPlanRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        let by = caller(&request);
        let id = request.into_inner().id;
        Ok(Response::new(status(&id, Phase::Cancelled, 1, by)))
    }

    async fn retry_plan(
        &self,
        request: Request<pb::RetryPlanRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        let by = caller(&request);
        let id = request.into_inner().id;
        Ok(Response::new(status(&id, Phase::Pending, 2, by)))
    }

    /// As an agent from before `SubmitPlanDocument` (the `submit` command then falls back
    /// to `ApplyPlan`).
    async fn submit_plan_document(
        &self,
        _request: Request<tonic::Streaming<pb::PlanDocumentPiece>>,
    ) -> Result<Response<pb::ApplyPlanResponse>, Status> {
        Err(Status::unimplemented(
            "this stand-in has no SubmitPlanDocument",
        ))
    }

    async fn get_drift(
        &self,
        _request: Request<pb::GetDriftRequest>,
    ) -> Result<Response<pb::DriftStatus>, Status> {
        Ok(Response::new(pb::DriftStatus::default()))
    }

    async fn repair_plan(
        &self,
        request: Request<pb::RepairPlanRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        let by = caller(&request);
        let id = request.into_inner().id;
        Ok(Response::new(status(&id, Phase::Pending, 2, by)))
    }
}

// === Server and clients ===

struct TestServer {
    addr: SocketAddr,
    tls_counters: Arc<TlsCounters>,
    authz_counters: Arc<AuthzCounters>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

fn rules() -> AuthzRules {
    AuthzRules::new(
        vec![ADMIN.parse().unwrap()],
        vec![
            READER.parse().unwrap(),
            "spiffe://test/readers/*".parse().unwrap(),
            "openssl-reader".parse().unwrap(),
        ],
    )
}

async fn start(paths: ServerTlsPaths, options: ServeOptions) -> TestServer {
    let tls_counters = Arc::new(TlsCounters::default());
    let authz_counters = Arc::new(AuthzCounters::default());
    let tls = Arc::new(ReloadingServerConfig::new(paths, tls_counters.clone()).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (health, _) = tonic_health::server::health_reporter();
    let security = Security {
        tls,
        rules: Arc::new(rules()),
        authz_counters: authz_counters.clone(),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(
        listener,
        FakeAgent,
        health,
        security,
        options,
        async {
            let _ = stopped.await;
        },
    ));
    TestServer {
        addr,
        tls_counters,
        authz_counters,
        stop: Some(stop),
        task,
    }
}

impl TestServer {
    fn target(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Stops the server and checks it ran without error until then.
    async fn shutdown(mut self) {
        assert!(!self.task.is_finished(), "server stopped on its own");
        let _ = self.stop.take().unwrap().send(());
        let result = tokio::time::timeout(patience(), self.task).await;
        result.expect("server shuts down").unwrap().unwrap();
    }
}

async fn channel(
    server: &TestServer,
    client: &ClientTlsPaths,
) -> Result<Channel, tls::ConnectError> {
    let config = Arc::new(tls::client_config(client).unwrap());
    tokio::time::timeout(patience(), tls::connect(&server.target(), None, config))
        .await
        .expect("connect finishes")
}

async fn node_agent(server: &TestServer, client: &ClientTlsPaths) -> NodeAgentClient<Channel> {
    NodeAgentClient::new(channel(server, client).await.expect("client connects"))
}

/// Runs a TLS handshake with `config` and reads the first byte: the server's HTTP/2
/// SETTINGS frame when it accepted us. Returns the server's certificate on success.
async fn raw_handshake(
    addr: SocketAddr,
    config: rustls::ClientConfig,
) -> Result<CertificateDer<'static>, String> {
    let attempt = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let name = ServerName::try_from("127.0.0.1").unwrap();
        let mut tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        let mut byte = [0u8; 1];
        match tls.read(&mut byte).await {
            Ok(1) => Ok(tls.get_ref().1.peer_certificates().unwrap()[0]
                .clone()
                .into_owned()),
            Ok(_) => Err("connection closed".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    };
    tokio::time::timeout(patience(), attempt)
        .await
        .expect("handshake finishes")
}

fn client_config_from(paths: &ClientTlsPaths) -> rustls::ClientConfig {
    tls::client_config(paths).unwrap()
}

/// A client configuration that presents no certificate at all.
fn anonymous_client_config(ca_pem: &str) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    config
}

/// Waits until `check` holds (server-side counters are updated asynchronously).
async fn eventually(what: &str, check: impl Fn() -> bool) {
    eventually_async(what, || check().then_some(())).await
}

fn plan(id: &str) -> pb::Plan {
    pb::Plan {
        id: id.into(),
        node_name: "test-node".into(),
        changes: vec![pb::Change {
            kind: Some(pb::change::Kind::Sysctl(pb::SysctlChange {
                key: "net.ipv4.ip_forward".into(),
                value: "1".into(),
            })),
        }],
        ..Default::default()
    }
}

fn apply_request(plan: pb::Plan) -> pb::ApplyPlanRequest {
    pb::ApplyPlanRequest {
        plan: Some(plan),
        retry: false,
    }
}

/// One CA, the server's material installed in a fresh directory.
struct Setup {
    dir: tempfile::TempDir,
    ca: TestCa,
    server_paths: ServerTlsPaths,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("test CA 1");
    let server = ca.issue(server_leaf());
    let server_paths = install_server_material(dir.path(), &ca, &server);
    Setup {
        dir,
        ca,
        server_paths,
    }
}

impl Setup {
    fn client(&self, name: &str, identity: &str) -> ClientTlsPaths {
        let material = self.ca.issue(client_leaf(identity));
        install_client_material(self.dir.path(), name, &[&self.ca.pem], &material)
    }
}

// === Tests: authorization ===

#[tokio::test]
async fn admin_may_mutate_and_reader_may_only_read() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let mut admin = node_agent(&server, &s.client("admin", ADMIN)).await;
    let mut reader = node_agent(&server, &s.client("reader", READER)).await;

    // Admin: every mutating call reaches the handler, with the caller attached.
    let applied = admin
        .apply_plan(apply_request(plan("p1")))
        .await
        .unwrap()
        .into_inner();
    let applied = applied.status.unwrap();
    assert_eq!(applied.id, "p1");
    assert_eq!(applied.step.unwrap().message, format!("{ADMIN} as admin"));
    let cancelled = admin
        .cancel_plan(pb::CancelPlanRequest {
            id: "p1".into(),
            reason: "test".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cancelled.phase(), Phase::Cancelled);
    let retried = admin
        .retry_plan(pb::RetryPlanRequest {
            id: "p1".into(),
            from_attempt: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(retried.attempt, 2);

    // Reader: the three mutating calls are denied before reaching the handler.
    let denied = [
        reader
            .apply_plan(apply_request(plan("p2")))
            .await
            .unwrap_err(),
        reader
            .cancel_plan(pb::CancelPlanRequest {
                id: "p1".into(),
                reason: String::new(),
            })
            .await
            .unwrap_err(),
        reader
            .retry_plan(pb::RetryPlanRequest {
                id: "p1".into(),
                from_attempt: 0,
            })
            .await
            .unwrap_err(),
    ];
    for status in &denied {
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(status.message().contains("requires admin"), "{status:?}");
    }
    assert_eq!(server.authz_counters.denied("insufficient_role"), 3);

    // Reader: every read works.
    let info = reader
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_name, "test-node");
    assert_eq!(info.agent_version, format!("{READER} as reader"));
    let check = reader
        .check_plan(pb::CheckPlanRequest {
            plan: Some(plan("p2")),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(check.applicable && check.would_change);
    let got = reader
        .get_plan_status(pb::GetPlanStatusRequest { id: "p1".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.phase(), Phase::Applying);
    let missing = reader
        .get_plan_status(pb::GetPlanStatusRequest {
            id: "missing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let phases: Vec<Phase> = reader
        .watch_plan(pb::WatchPlanRequest { id: "p1".into() })
        .await
        .unwrap()
        .into_inner()
        .map(|s| s.unwrap().phase())
        .collect()
        .await;
    assert_eq!(phases, [Phase::Applying, Phase::Succeeded]);

    // Health, for a reader.
    let channel = channel(
        &server,
        &s.client("reader2", "spiffe://test/readers/metrics"),
    )
    .await
    .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let serving = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        serving.status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    assert_eq!(server.authz_counters.denied("unknown_identity"), 0);
    assert!(server.authz_counters.allowed() >= 9);
    server.shutdown().await;
}

/// `submit` against an agent without `SubmitPlanDocument` parses the plan itself and sends
/// it through `ApplyPlan`: a plan file, and one on standard input (read once, for both).
#[tokio::test]
async fn submit_falls_back_to_apply_plan_on_an_agent_without_plan_documents() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let admin = s.client("admin", ADMIN);
    let plan = |id: &str| {
        format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n  - file: {{path: /etc/x, content: \"x\"}}\n"
        )
    };
    let file = s.dir.path().join("plan.yaml");
    std::fs::write(&file, plan("older-file")).unwrap();
    for (id, arg, stdin) in [
        ("older-file", file.clone(), None),
        ("older-stdin", PathBuf::from("-"), Some(plan("older-stdin"))),
    ] {
        let (addr, admin) = (server.addr.to_string(), admin.clone());
        let out = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut child = std::process::Command::new(crate::support::bin())
                .arg("submit")
                .arg(&arg)
                .args(["--addr", &addr, "-o", "json"])
                .arg("--ca")
                .arg(&admin.ca)
                .arg("--cert")
                .arg(&admin.cert)
                .arg("--key")
                .arg(&admin.key)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut input = child.stdin.take().unwrap();
            if let Some(text) = stdin {
                input.write_all(text.as_bytes()).unwrap();
            }
            drop(input);
            child.wait_with_output().unwrap()
        })
        .await
        .unwrap();
        let all = crate::support::text(&out);
        assert_eq!(out.status.code(), Some(0), "{id}: {all}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["id"], id, "{all}");
        assert_eq!(json["phase"], "Pending", "{all}");
    }
    server.shutdown().await;
}

#[tokio::test]
async fn valid_certificate_with_unknown_identity_is_permission_denied() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let stranger = s.client("stranger", STRANGER);
    let mut client = node_agent(&server, &stranger).await;

    let status = client
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains(STRANGER), "{status:?}");
    let status = client
        .apply_plan(apply_request(plan("p")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);

    let channel = channel(&server, &stranger).await.unwrap();
    let status = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);

    assert_eq!(server.authz_counters.denied("unknown_identity"), 3);
    assert_eq!(server.authz_counters.allowed(), 0);
    // The handshake itself succeeded: it is a valid certificate from our CA.
    assert_eq!(
        server
            .tls_counters
            .failures_by_reason()
            .iter()
            .map(|(_, n)| n)
            .sum::<u64>(),
        0
    );
    server.shutdown().await;
}

#[tokio::test]
async fn oversize_request_is_resource_exhausted() {
    let s = setup();
    let options = ServeOptions {
        max_message_bytes: 64 * 1024,
        ..ServeOptions::default()
    };
    let server = start(s.server_paths.clone(), options).await;
    let mut admin = node_agent(&server, &s.client("admin", ADMIN)).await;

    let mut big = plan("big");
    big.changes.push(pb::Change {
        kind: Some(pb::change::Kind::File(pb::FileChange {
            path: "/etc/kubernetes/big".into(),
            content: vec![b'x'; 100 * 1024].into(),
            ..Default::default()
        })),
    });
    let status = admin.apply_plan(apply_request(big)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("65536"), "{status:?}");

    // A plan under the limit on the same connection still goes through.
    admin
        .apply_plan(apply_request(plan("small")))
        .await
        .unwrap();
    server.shutdown().await;
}

#[tokio::test]
async fn reflection_lists_the_node_agent_service() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let channel = channel(&server, &s.client("reader", READER)).await.unwrap();
    let mut client = ServerReflectionClient::new(channel);

    let requests = vec![
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol(
                "inplace.agent.v1.NodeAgent".into(),
            )),
        },
    ];
    let mut responses = client
        .server_reflection_info(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();

    let Some(MessageResponse::ListServicesResponse(list)) =
        responses.next().await.unwrap().unwrap().message_response
    else {
        panic!("expected a list of services");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"inplace.agent.v1.NodeAgent"), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");

    let Some(MessageResponse::FileDescriptorResponse(files)) =
        responses.next().await.unwrap().unwrap().message_response
    else {
        panic!("expected file descriptors");
    };
    use prost::Message;
    let file = prost_types::FileDescriptorProto::decode(files.file_descriptor_proto[0].as_slice())
        .unwrap();
    assert_eq!(file.name(), "inplace/agent/v1/agent.proto");
    assert_eq!(file.service[0].method.len(), 10);

    // The v1alpha service older grpcurl and grpc-go use, built at its own first request.
    {
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        let channel = self::channel(&server, &s.client("reader", READER))
            .await
            .unwrap();
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = ServerReflectionClient::new(channel)
            .server_reflection_info(tokio_stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            responses.next().await.unwrap().unwrap().message_response
        else {
            panic!("expected a list of services from v1alpha");
        };
        assert!(
            list.service
                .iter()
                .any(|s| s.name == "inplace.agent.v1.NodeAgent"),
            "{list:?}"
        );
    }
    server.shutdown().await;
}

// === Tests: handshake failures ===

/// Asserts that `config` cannot complete a handshake, that the server counted exactly one
/// failure for `reason`, and that a gRPC call with the same material fails as well.
async fn assert_handshake_rejected(
    server: &TestServer,
    config: rustls::ClientConfig,
    reason: HandshakeFailure,
) {
    let result = raw_handshake(server.addr, config.clone()).await;
    assert!(
        result.is_err(),
        "handshake unexpectedly succeeded ({reason})"
    );
    eventually(&format!("handshake failure {reason}"), || {
        server.tls_counters.failures(reason) == 1
    })
    .await;
    assert_eq!(server.tls_counters.handshakes(), 0);

    // Through tonic: either connecting or the first call fails; it never gets a status
    // from our service.
    let outcome = async {
        let channel = tls::connect(&server.target(), None, Arc::new(config))
            .await
            .map_err(|e| e.to_string())?;
        NodeAgentClient::new(channel)
            .get_node_info(pb::GetNodeInfoRequest {})
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    };
    let outcome = tokio::time::timeout(patience(), outcome).await.unwrap();
    let error = outcome.expect_err("grpc call unexpectedly succeeded");
    assert!(!error.starts_with("PermissionDenied"), "{error}");
    assert_eq!(server.authz_counters.allowed(), 0);
}

#[tokio::test]
async fn handshake_fails_without_client_certificate() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let config = anonymous_client_config(&s.ca.pem);
    assert_handshake_rejected(&server, config, HandshakeFailure::NoClientCertificate).await;
    server.shutdown().await;
}

#[tokio::test]
async fn handshake_fails_with_certificate_from_another_ca() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let other = TestCa::new("someone else's CA");
    // Trusts our server, but presents a certificate from another CA with an admin name.
    let material = other.issue(client_leaf(ADMIN));
    let paths = install_client_material(s.dir.path(), "other", &[&s.ca.pem], &material);
    assert_handshake_rejected(
        &server,
        client_config_from(&paths),
        HandshakeFailure::UnknownIssuer,
    )
    .await;
    server.shutdown().await;
}

#[tokio::test]
async fn handshake_fails_with_expired_certificate() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let mut leaf = client_leaf(ADMIN);
    leaf.expired = true;
    let paths = install_client_material(s.dir.path(), "expired", &[&s.ca.pem], &s.ca.issue(leaf));
    assert_handshake_rejected(
        &server,
        client_config_from(&paths),
        HandshakeFailure::Expired,
    )
    .await;
    server.shutdown().await;
}

#[tokio::test]
async fn handshake_fails_with_server_auth_only_certificate() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    // E.g. another node's serving certificate from the same CA, used as a client cert.
    let mut leaf = client_leaf(ADMIN);
    leaf.eku = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let paths =
        install_client_material(s.dir.path(), "serverauth", &[&s.ca.pem], &s.ca.issue(leaf));
    assert_handshake_rejected(
        &server,
        client_config_from(&paths),
        HandshakeFailure::WrongKeyUsage,
    )
    .await;
    server.shutdown().await;
}

#[tokio::test]
async fn handshake_fails_with_certificate_without_any_eku() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    // webpki alone would accept this one; the agent insists on clientAuth.
    let mut leaf = client_leaf(ADMIN);
    leaf.eku = vec![];
    let paths = install_client_material(s.dir.path(), "noeku", &[&s.ca.pem], &s.ca.issue(leaf));
    assert_handshake_rejected(
        &server,
        client_config_from(&paths),
        HandshakeFailure::WrongKeyUsage,
    )
    .await;
    server.shutdown().await;
}

#[tokio::test]
async fn plain_http2_without_tls_is_rejected() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = channel {
        let status = NodeAgentClient::new(channel)
            .get_node_info(pb::GetNodeInfoRequest {})
            .await
            .unwrap_err();
        assert_ne!(status.code(), Code::PermissionDenied);
    }
    eventually("protocol failure", || {
        server.tls_counters.failures(HandshakeFailure::Protocol) >= 1
    })
    .await;
    server.shutdown().await;
}

#[tokio::test]
async fn silent_client_times_out_in_the_handshake() {
    let s = setup();
    let mut options = ServeOptions::default();
    options.accept.handshake_timeout = Duration::from_millis(200);
    let server = start(s.server_paths.clone(), options).await;
    // Opens TCP and never says anything.
    let _silent = TcpStream::connect(server.addr).await.unwrap();
    eventually("handshake timeout", || {
        server.tls_counters.failures(HandshakeFailure::Timeout) == 1
    })
    .await;
    // The listener keeps serving others.
    let mut reader = node_agent(&server, &s.client("reader", READER)).await;
    reader
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap();
    server.shutdown().await;
}

// === Tests: rotation ===

#[tokio::test]
async fn rotated_material_is_used_without_restarting_the_server() {
    let s = setup();
    let options = ServeOptions {
        // Old connections are closed soon after rotation, so old clients are cut off.
        max_connection_age: Duration::from_secs(1),
        max_connection_age_grace: Duration::from_secs(1),
        ..ServeOptions::default()
    };
    let server = start(s.server_paths.clone(), options).await;
    let addr = server.addr;
    let old_admin_paths = s.client("old-admin", ADMIN);
    let mut old_admin = node_agent(&server, &old_admin_paths).await;
    old_admin
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap();
    let old_server_cert = raw_handshake(addr, client_config_from(&old_admin_paths))
        .await
        .unwrap();

    // cert-manager issues from a new CA: server certificate, key and CA bundle replaced.
    let ca2 = TestCa::new("test CA 2");
    let server2 = ca2.issue(server_leaf());
    install_server_material(s.dir.path(), &ca2, &server2);
    let new_server_cert = CertificateDer::from_pem_slice(server2.cert.as_bytes()).unwrap();
    assert_ne!(old_server_cert, new_server_cert);

    // A new client from the new CA connects, and sees the new server certificate.
    let new_admin_paths = install_client_material(
        s.dir.path(),
        "new-admin",
        &[&ca2.pem],
        &ca2.issue(client_leaf(ADMIN)),
    );
    let seen = raw_handshake(addr, client_config_from(&new_admin_paths))
        .await
        .unwrap();
    assert_eq!(seen, new_server_cert);
    let mut new_admin = node_agent(&server, &new_admin_paths).await;
    new_admin
        .apply_plan(apply_request(plan("after-rotation")))
        .await
        .unwrap();
    assert_eq!(server.tls_counters.reloads(), 1);

    // A client that accepts the new server certificate but presents one from the old CA
    // is rejected by the server.
    let old_cert_new_trust = install_client_material(
        s.dir.path(),
        "old-cert-new-trust",
        &[&s.ca.pem, &ca2.pem],
        &s.ca.issue(client_leaf(ADMIN)),
    );
    let before = server
        .tls_counters
        .failures(HandshakeFailure::UnknownIssuer);
    assert!(
        raw_handshake(addr, client_config_from(&old_cert_new_trust))
            .await
            .is_err()
    );
    eventually("unknown issuer after rotation", || {
        server
            .tls_counters
            .failures(HandshakeFailure::UnknownIssuer)
            == before + 1
    })
    .await;

    // A client that still has only the old material cannot connect at all.
    assert!(
        raw_handshake(addr, client_config_from(&old_admin_paths))
            .await
            .is_err()
    );
    assert!(
        channel(&server, &old_admin_paths).await.is_err() || {
            let mut c = node_agent(&server, &old_admin_paths).await;
            c.get_node_info(pb::GetNodeInfoRequest {}).await.is_err()
        }
    );

    // The connection it opened before the rotation is closed by max_connection_age, and
    // its channel cannot reconnect.
    let deadline = tokio::time::Instant::now() + patience();
    loop {
        let result = old_admin.get_node_info(pb::GetNodeInfoRequest {}).await;
        if result.is_err() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "old connection still serves"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Half-written material (a key that does not parse) is rejected; the server keeps
    // serving with the previous material.
    let key_path = s.server_paths.key.clone();
    write_atomic(&key_path, "-----BEGIN PRIVATE KEY-----\nnot a key\n");
    let seen = raw_handshake(addr, client_config_from(&new_admin_paths))
        .await
        .unwrap();
    assert_eq!(seen, new_server_cert);
    assert_eq!(server.tls_counters.reload_failures(), 1);
    assert_eq!(server.tls_counters.reloads(), 1);
    // ... and picked up once the file is complete.
    write_atomic(&key_path, &server2.key);
    raw_handshake(addr, client_config_from(&new_admin_paths))
        .await
        .unwrap();
    assert_eq!(server.tls_counters.reloads(), 2);
    assert_eq!(server.tls_counters.reload_failures(), 1);

    // Same listener, same task, throughout.
    assert_eq!(server.addr, addr);
    server.shutdown().await;
}

// === Tests: certificates made by openssl ===

fn openssl(dir: &Path, args: &[&str]) {
    let output = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (is it installed?)");
    assert!(
        output.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Issues a leaf with openssl: key (generated by `keygen`), CSR, signature by ca.crt.
fn openssl_leaf(dir: &Path, name: &str, keygen: &[&str], extensions: &str) -> PathBuf {
    let key = format!("{name}.key");
    let mut args = keygen.to_vec();
    args.extend(["-out", key.as_str()]);
    openssl(dir, &args);
    let csr = format!("{name}.csr");
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &key,
            "-subj",
            &format!("/CN={name}"),
            "-out",
            &csr,
        ],
    );
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), extensions).unwrap();
    let crt = format!("{name}.crt");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ],
    );
    dir.join(crt)
}

#[tokio::test]
async fn openssl_generated_material_works() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("ca.cnf"),
        "[req]\ndistinguished_name = dn\nx509_extensions = v3_ca\nprompt = no\n\
         [dn]\nCN = openssl test CA\n\
         [v3_ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n\
         subjectKeyIdentifier = hash\n",
    )
    .unwrap();
    // RSA CA with a PKCS#8 key.
    openssl(
        d,
        &[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-config", "ca.cnf",
        ],
    );
    // Server: P-256 key in SEC1 ("EC PRIVATE KEY") form.
    openssl_leaf(
        d,
        "server",
        &["ecparam", "-name", "prime256v1", "-genkey", "-noout"],
        "subjectAltName=DNS:test-node,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n\
         keyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\n",
    );
    // Admin client: RSA key in PKCS#1 ("RSA PRIVATE KEY") form, identity from a URI SAN.
    openssl_leaf(
        d,
        "updater",
        &["genrsa", "-traditional"],
        &format!(
            "subjectAltName=URI:{ADMIN}\nextendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n"
        ),
    );
    // Reader client: no SAN, identity from the common name.
    openssl_leaf(
        d,
        "openssl-reader",
        &["ecparam", "-name", "prime256v1", "-genkey", "-noout"],
        "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n",
    );
    // No EKU at all.
    openssl_leaf(
        d,
        "noeku",
        &["ecparam", "-name", "prime256v1", "-genkey", "-noout"],
        &format!("subjectAltName=URI:{ADMIN}\nbasicConstraints=CA:FALSE\n"),
    );
    assert!(
        std::fs::read_to_string(d.join("server.key"))
            .unwrap()
            .contains("EC PRIVATE KEY")
    );
    assert!(
        std::fs::read_to_string(d.join("updater.key"))
            .unwrap()
            .contains("RSA PRIVATE KEY")
    );

    let server = start(ServerTlsPaths::in_dir(d), ServeOptions::default()).await;
    let client_paths = |name: &str| ClientTlsPaths {
        ca: d.join("ca.crt"),
        cert: d.join(format!("{name}.crt")),
        key: d.join(format!("{name}.key")),
    };

    let mut admin = node_agent(&server, &client_paths("updater")).await;
    let applied = admin
        .apply_plan(apply_request(plan("openssl")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        applied.status.unwrap().step.unwrap().message,
        format!("{ADMIN} as admin")
    );

    let mut reader = node_agent(&server, &client_paths("openssl-reader")).await;
    let info = reader
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.agent_version, "openssl-reader as reader");
    let denied = reader
        .apply_plan(apply_request(plan("openssl")))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);

    let noeku = tls::client_config(&client_paths("noeku")).unwrap();
    assert!(raw_handshake(server.addr, noeku).await.is_err());
    eventually("wrong key usage", || {
        server
            .tls_counters
            .failures(HandshakeFailure::WrongKeyUsage)
            == 1
    })
    .await;
    server.shutdown().await;
}

// === Tests: why a client cannot connect (issue 15) ===

/// Connects like the CLI does and makes one call; on failure, the diagnosis of whichever
/// step failed.
async fn reach(
    target: &str,
    server_name: Option<&str>,
    config: rustls::ClientConfig,
) -> Result<(), tls::Diagnosis> {
    let attempt = async {
        let channel = tls::connect(target, server_name, Arc::new(config))
            .await
            .map_err(|e| match &e {
                tls::ConnectError::Transport { source, .. } => tls::diagnose(source),
                other => tls::diagnose(other),
            })?;
        NodeAgentClient::new(channel)
            .get_node_info(pb::GetNodeInfoRequest {})
            .await
            .map(|_| ())
            .map_err(|status| tls::diagnose(&status))
    };
    tokio::time::timeout(patience(), attempt)
        .await
        .expect("connect finishes")
}

#[tokio::test]
async fn a_client_that_cannot_connect_is_told_why() {
    let s = setup();
    let reader = client_config_from(&s.client("reader", READER));

    // Nothing listening.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let d = reach(&format!("127.0.0.1:{port}"), None, reader.clone())
        .await
        .unwrap_err();
    eprintln!("nothing listening: {}", d.chain());
    assert_eq!(d.problem, Some(tls::ConnectProblem::Refused), "{d:?}");
    assert!(
        d.chain().to_lowercase().contains("connection refused"),
        "{d:?}"
    );

    let server = start(s.server_paths.clone(), ServeOptions::default()).await;

    // A name the certificate does not have: the names it has are listed.
    let d = reach(&server.target(), Some("worker-7"), reader.clone())
        .await
        .unwrap_err();
    eprintln!("wrong server name: {}", d.chain());
    match &d.problem {
        Some(tls::ConnectProblem::WrongName {
            expected,
            presented,
        }) => {
            assert_eq!(expected, "worker-7");
            assert!(presented.iter().any(|n| n == "test-node"), "{presented:?}");
        }
        other => panic!("{other:?}: {d:?}"),
    }
    assert!(d.chain().contains("test-node"), "{d:?}");

    // A CA bundle that did not issue the agent's certificate.
    let other = TestCa::new("another CA");
    let mut config = client_config_from(&install_client_material(
        s.dir.path(),
        "wrong-ca",
        &[&other.pem],
        &s.ca.issue(client_leaf(READER)),
    ));
    config.alpn_protocols = vec![b"h2".to_vec()];
    let d = reach(&server.target(), None, config).await.unwrap_err();
    eprintln!("unknown CA: {}", d.chain());
    assert_eq!(d.problem, Some(tls::ConnectProblem::UnknownIssuer), "{d:?}");

    // A client certificate the agent does not accept: the agent ends the handshake.
    let stranger = TestCa::new("stranger CA").issue(client_leaf(ADMIN));
    let paths = install_client_material(s.dir.path(), "stranger", &[&s.ca.pem], &stranger);
    let d = reach(&server.target(), None, client_config_from(&paths))
        .await
        .unwrap_err();
    eprintln!("client certificate refused: {}", d.chain());
    assert!(
        matches!(&d.problem, Some(tls::ConnectProblem::RefusedByPeer(_))),
        "{d:?}"
    );
    server.shutdown().await;

    // An agent whose certificate expired.
    let dir = tempfile::tempdir().unwrap();
    let mut leaf = server_leaf();
    leaf.expired = true;
    let paths = install_server_material(dir.path(), &s.ca, &s.ca.issue(leaf));
    let server = start(paths, ServeOptions::default()).await;
    let d = reach(&server.target(), None, reader).await.unwrap_err();
    eprintln!("expired server certificate: {}", d.chain());
    assert!(
        matches!(
            d.problem,
            Some(tls::ConnectProblem::Expired { not_after: Some(_) })
        ),
        "{d:?}"
    );
    assert!(
        d.chain().contains("the agent's certificate expired at "),
        "{d:?}"
    );
    server.shutdown().await;
}

/// A TCP probe (the kubelet's tcpSocket probe, a load balancer) connects and closes without
/// a byte: not a failed handshake, so the handshake-failure alert does not fire on probes.
#[tokio::test]
async fn a_tcp_probe_is_not_a_failed_handshake() {
    let s = setup();
    let server = start(s.server_paths.clone(), ServeOptions::default()).await;
    for _ in 0..5 {
        let probe = TcpStream::connect(server.addr).await.unwrap();
        drop(probe);
    }
    // A real client after the probes: served, and counted as a handshake.
    let mut reader = node_agent(&server, &s.client("reader", READER)).await;
    reader
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .unwrap();
    eventually("the client's handshake", || {
        server.tls_counters.handshakes() == 1
    })
    .await;
    let failures: u64 = server
        .tls_counters
        .failures_by_reason()
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(
        failures,
        0,
        "{:?}",
        server.tls_counters.failures_by_reason()
    );
    server.shutdown().await;
}

/// The kubelet's serving certificate as the agent's (a certificate per node, renewed by the
/// kubelet): one PEM file with certificate and key, reached through the symlink
/// `kubelet-server-current.pem` that the kubelet points at a new dated file when it renews.
/// The agent serves it and picks the renewed one up without a restart
/// (packaging/kubernetes/agent/kubelet-serving, docs/pki.md).
#[tokio::test]
async fn a_kubelet_serving_certificate_is_served_and_its_renewal_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("kubernetes");
    let pki = dir.path().join("var/lib/kubelet/pki");
    std::fs::create_dir_all(&pki).unwrap();
    let current = pki.join("kubelet-server-current.pem");
    let renew = |stamp: &str| {
        let m = ca.issue(server_leaf());
        let file = pki.join(format!("kubelet-server-{stamp}.pem"));
        std::fs::write(&file, format!("{}{}", m.cert, m.key)).unwrap();
        // As the kubelet does: a new symlink renamed over the old one.
        let tmp = pki.join("kubelet-server-current.pem.tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&file, &tmp).unwrap();
        std::fs::rename(&tmp, &current).unwrap();
        CertificateDer::from_pem_slice(m.cert.as_bytes()).unwrap()
    };
    let first = renew("2026-01-01-00-00-00");
    let client_ca = dir.path().join("ca.crt");
    std::fs::write(&client_ca, &ca.pem).unwrap();
    let paths = ServerTlsPaths {
        cert: current.clone(),
        key: current.clone(),
        client_ca,
    };
    let server = start(paths, ServeOptions::default()).await;
    let s = setup();
    let reader = install_client_material(
        s.dir.path(),
        "reader",
        &[&ca.pem],
        &ca.issue(client_leaf(READER)),
    );
    assert_eq!(
        raw_handshake(server.addr, client_config_from(&reader))
            .await
            .unwrap(),
        first
    );
    let second = renew("2026-09-01-00-00-00");
    assert_ne!(first, second);
    assert_eq!(
        raw_handshake(server.addr, client_config_from(&reader))
            .await
            .unwrap(),
        second,
        "the renewed certificate is served"
    );
    assert_eq!(server.tls_counters.reloads(), 1);
    server.shutdown().await;
}
