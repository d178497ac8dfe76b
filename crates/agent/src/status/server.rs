//! The status socket and the optional TCP metrics listener: HTTP/1.1 (hyper) on the daemon's
//! runtime. Endpoints (all `GET`):
//!
//! | path | answer |
//! |---|---|
//! | `/v1/status` | `AgentStatus` |
//! | `/v1/plans/{id}` | `PlanStatus` of the plan's latest attempt, with its hook response |
//! | `/v1/journal?since=SEQ&limit=N` | `JournalRecords` (plan documents left out) |
//! | `/metrics` | Prometheus text (OpenMetrics when asked for in `Accept`) |
//! | `/healthz` | `ok` |
//!
//! The TCP listener answers `/metrics` and `/healthz` only. Requests are bounded: a request
//! head of at most 16 KiB read within 5 seconds, no body, a connection lives at most 60
//! seconds, at most 1,024 connections at once (more wait in the listen backlog). Engine
//! reads run on the blocking pool, two at a time, so a burst of status requests leaves room
//! for the gRPC API's engine calls and never blocks the runtime.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::{Body, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Semaphore, watch};

use super::api::{
    self, AgentInfo, Context, ErrorDocument, JournalSummary, NodeInfo, PlanStatusDocument, Source,
};
use super::metrics::{Metrics, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE};
use crate::engine::Engine;
use inplace_base::time::now_ms;

/// Where the status socket is and who may read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusSocketSettings {
    /// The socket file.
    pub path: PathBuf,
    /// The node's group that may read it (created when missing); `None`: root only.
    pub group: Option<String>,
    /// Its permission bits.
    pub mode: u32,
}

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;
/// The listen backlog of the socket (the kernel caps it at `net.core.somaxconn`).
const BACKLOG: i32 = 1024;
/// Largest request head (request line and headers).
const MAX_REQUEST_HEAD: usize = 16 * 1024;
/// How long a client has to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection stays open (keep-alive included).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Engine reads running on the blocking pool at once for this server.
const CONCURRENT_READS: usize = 2;
/// Default and largest `limit` of `/v1/journal`.
const JOURNAL_LIMIT: (usize, usize) = (100, 1000);

/// What the handlers share.
#[derive(Debug)]
pub struct State {
    engine: Engine,
    metrics: Arc<Metrics>,
    agent: AgentInfo,
    metrics_addr: std::sync::OnceLock<SocketAddr>,
    node: RwLock<NodeInfo>,
    reads: Semaphore,
}

impl State {
    /// The handlers' state: `agent` describes this process; node facts are filled in by
    /// [`State::refresh_node`].
    pub fn new(engine: Engine, metrics: Arc<Metrics>, agent: AgentInfo, node_name: &str) -> State {
        let node = NodeInfo {
            name: node_name.to_string(),
            root: engine.host().root_path().display().to_string(),
            ..NodeInfo::default()
        };
        State {
            engine,
            metrics,
            agent,
            metrics_addr: std::sync::OnceLock::new(),
            node: RwLock::new(node),
            reads: Semaphore::new(CONCURRENT_READS),
        }
    }

    /// Reads the node's facts again (os-release, kernel, `kubelet --version`); blocking.
    pub fn refresh_node(&self) {
        let host = self.engine.host();
        let os = crate::host::node::os_info(host);
        let kubelet = crate::host::node::kubelet_version(host).unwrap_or_default();
        let mut node = self.node.write().unwrap_or_else(|p| p.into_inner());
        node.os_id = os.id;
        node.os_version_id = os.version_id;
        node.os_pretty_name = os.pretty_name;
        node.kernel_release = os.kernel_release;
        node.architecture = os.architecture;
        node.kubelet_version = kubelet;
    }

    /// The agent's status now (takes the engine lock briefly).
    pub fn agent_status(&self) -> api::AgentStatus {
        let now = now_ms();
        let mut agent = self.agent.clone();
        agent.uptime_seconds = now.saturating_sub(agent.started_at_ms) / 1000;
        if let Some(addr) = self.metrics_addr.get() {
            agent.metrics_listen = Some(addr.to_string());
        }
        let journal = self.engine.journal_info();
        let ctx = Context {
            source: Source::Agent,
            node: self.node.read().unwrap_or_else(|p| p.into_inner()).clone(),
            agent: Some(agent),
            services: self.engine.host().services_description(),
            journal: JournalSummary {
                path: journal.path.display().to_string(),
                bytes: journal.bytes,
                records: journal.records,
                last_seq: journal.last_seq,
            },
            drift: api::DriftStatus::of(&self.engine.drift()),
        };
        self.engine.read(|t| api::agent_status(t, ctx, now))
    }

    /// Runs `f` on the blocking pool, at most [`CONCURRENT_READS`] at once.
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&State) -> T + Send + 'static,
    ) -> Result<T, String> {
        let _permit = self
            .reads
            .acquire()
            .await
            .map_err(|_| "the server is stopping".to_string())?;
        let state = self.clone();
        tokio::task::spawn_blocking(move || f(&state))
            .await
            .map_err(|e| format!("status task failed: {e}"))
    }
}

/// Which endpoints a listener answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Everything (the status socket).
    All,
    /// `/metrics` and `/healthz` (the TCP listener).
    Metrics,
}

/// Who is asking (from `SO_PEERCRED` on the socket, the address over TCP).
#[derive(Debug, Clone)]
enum Peer {
    Local { uid: u32, pid: i32 },
    Tcp(SocketAddr),
    Unknown,
}

/// The running listeners.
#[derive(Debug)]
pub struct StatusServer {
    socket: PathBuf,
    metrics_addr: Option<SocketAddr>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl StatusServer {
    /// Binds the status socket (and the metrics listener when configured) and serves them
    /// until `stop` turns true. The socket's group is resolved in the node's `/etc/group`
    /// and created there when missing; if that fails the socket stays root-only and the
    /// reason is logged. Must be called within a Tokio runtime.
    pub async fn start(
        settings: &StatusSocketSettings,
        metrics_listen: Option<SocketAddr>,
        state: Arc<State>,
        stop: watch::Receiver<bool>,
    ) -> Result<StatusServer, String> {
        let gid = match &settings.group {
            None => None,
            Some(group) => {
                let engine = state.engine.clone();
                let name = group.clone();
                let found = tokio::task::spawn_blocking(move || {
                    crate::host::users::ensure_group(engine.host(), &name)
                })
                .await
                .map_err(|e| format!("status socket group: {e}"))?;
                match found {
                    Ok((gid, created)) => {
                        if created {
                            tracing::info!(group = %group, gid, "created the status socket's group on the node");
                        }
                        Some(gid)
                    }
                    Err(e) => {
                        tracing::warn!(
                            group = %group,
                            error = %e,
                            "the status socket's group is missing and could not be created; \
                             only root can read the socket"
                        );
                        None
                    }
                }
            }
        };
        let listener = bind_socket(&settings.path, gid, settings.mode)?;
        let listener = tokio::net::UnixListener::from_std(listener)
            .map_err(|e| format!("status socket {}: {e}", settings.path.display()))?;
        let mut tasks = Vec::new();
        let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        tasks.push(tokio::spawn(serve_unix(
            listener,
            state.clone(),
            permits.clone(),
            stop.clone(),
        )));
        let mut metrics_addr = None;
        if let Some(addr) = metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                if e.kind() == std::io::ErrorKind::AddrInUse {
                    format!(
                        "metrics listener on {addr}: the address is already in use, {}: stop \
                         that process, or set metrics.listen in the configuration file (or \
                         --metrics-listen) to a free address",
                        crate::host::ports::held_by(addr)
                    )
                } else {
                    format!("metrics listener on {addr}: {e}")
                }
            })?;
            let local = listener
                .local_addr()
                .map_err(|e| format!("metrics listener on {addr}: {e}"))?;
            metrics_addr = Some(local);
            let _ = state.metrics_addr.set(local);
            tracing::info!("serving metrics on http://{local}/metrics");
            tasks.push(tokio::spawn(serve_tcp(
                listener,
                state.clone(),
                permits,
                stop.clone(),
            )));
        }
        tasks.push(tokio::spawn(refresh_node_facts(state, stop)));
        tracing::info!(socket = %settings.path.display(), mode = format!("{:04o}", settings.mode), gid, "status socket ready");
        Ok(StatusServer {
            socket: settings.path.clone(),
            metrics_addr,
            tasks,
        })
    }

    /// The status socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The metrics listener's address, when there is one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Stops serving and removes the socket file.
    pub fn stop(self) {
        for task in &self.tasks {
            task.abort();
        }
        if std::fs::symlink_metadata(&self.socket).is_ok_and(|m| m.file_type().is_socket()) {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// Binds the socket with its group and mode set before it listens, so nobody connects
/// while it is more open than configured. A socket file left by a crash is replaced; one
/// that still answers is another process's, and an error.
fn bind_socket(
    path: &Path,
    gid: Option<u32>,
    mode: u32,
) -> Result<std::os::unix::net::UnixListener, String> {
    use rustix::fs::{AtFlags, CWD, Gid, Mode};
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let at = |what: &str, e: &dyn std::fmt::Display| {
        format!("status socket {}: {what}: {e}", path.display())
    };
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
        && !dir.exists()
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| at(&format!("create {}", dir.display()), &e))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(format!(
                    "status socket {}: in use by another process (another agent?)",
                    path.display()
                ));
            }
            std::fs::remove_file(path).map_err(|e| at("remove the stale socket", &e))?;
        }
        Ok(_) => {
            return Err(format!(
                "status socket {}: exists and is not a socket",
                path.display()
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(at("inspect", &e)),
    }
    let addr = SocketAddrUnix::new(path).map_err(|e| at("address", &e))?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| at("socket", &e))?;
    rustix::net::bind(&fd, &addr).map_err(|e| at("bind", &e))?;
    let set_up = || -> Result<(), String> {
        if let Some(gid) = gid {
            rustix::fs::chownat(
                CWD,
                path,
                None,
                Some(Gid::from_raw(gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| at(&format!("set its group to gid {gid}"), &e))?;
        }
        rustix::fs::chmodat(CWD, path, Mode::from_raw_mode(mode), AtFlags::empty())
            .map_err(|e| at(&format!("set its mode to {mode:04o}"), &e))?;
        rustix::net::listen(&fd, BACKLOG).map_err(|e| at("listen", &e))
    };
    if let Err(e) = set_up() {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(std::os::unix::net::UnixListener::from(fd))
}

use std::os::unix::fs::DirBuilderExt;

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn serve_unix(
    listener: tokio::net::UnixListener,
    state: Arc<State>,
    permits: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            () = stopped(&mut stop) => return,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "status socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = stopped(&mut stop) => return,
        };
        let peer = match rustix::net::sockopt::socket_peercred(&stream) {
            Ok(cred) => Peer::Local {
                uid: cred.uid.as_raw(),
                pid: cred.pid.as_raw_nonzero().get(),
            },
            Err(_) => Peer::Unknown,
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            serve_connection(TokioIo::new(stream), state, Scope::All, peer).await;
        });
    }
}

async fn serve_tcp(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    permits: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            () = stopped(&mut stop) => return,
        };
        let (stream, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = stopped(&mut stop) => return,
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            serve_connection(TokioIo::new(stream), state, Scope::Metrics, Peer::Tcp(addr)).await;
        });
    }
}

async fn serve_connection<I>(io: TokioIo<I>, state: Arc<State>, scope: Scope, peer: Peer)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let state = state.clone();
        let peer = peer.clone();
        async move { Ok::<_, Infallible>(handle(state, scope, &peer, req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_REQUEST_HEAD)
        .serve_connection(io, service);
    match tokio::time::timeout(CONNECTION_LIFETIME, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "status connection ended with an error"),
        Err(_) => tracing::debug!("status connection closed after {CONNECTION_LIFETIME:?}"),
    }
}

type Answer = Response<Full<Bytes>>;

fn answer(code: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Answer {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = code;
    if let Ok(v) = header::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
}

fn json<T: serde::Serialize>(value: &T, pretty: bool) -> Answer {
    let body = if pretty {
        serde_json::to_vec_pretty(value)
    } else {
        serde_json::to_vec(value)
    };
    match body {
        Ok(mut body) => {
            body.push(b'\n');
            answer(StatusCode::OK, "application/json", body)
        }
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encode the answer: {e}"),
        ),
    }
}

fn error(code: StatusCode, message: impl Into<String>) -> Answer {
    let doc = ErrorDocument::new(code.as_u16(), message);
    let mut body = serde_json::to_vec(&doc).unwrap_or_default();
    body.push(b'\n');
    answer(code, "application/json", body)
}

/// The endpoint a path belongs to (a bounded metric label).
fn endpoint(path: &str) -> &'static str {
    match path {
        "/v1/status" => "status",
        "/v1/journal" => "journal",
        "/metrics" => "metrics",
        "/healthz" => "healthz",
        p if p.starts_with("/v1/plans/") => "plan",
        _ => "other",
    }
}

async fn handle(state: Arc<State>, scope: Scope, peer: &Peer, req: Request<Incoming>) -> Answer {
    let path = req.uri().path().to_string();
    let endpoint = endpoint(&path);
    let response = route(&state, scope, &req, &path, endpoint).await;
    let code = response.status().as_u16();
    state.metrics.request(endpoint, code);
    match peer {
        Peer::Local { uid, pid } => {
            tracing::debug!(uid, pid, method = %req.method(), path = %path, code, "status request")
        }
        Peer::Tcp(addr) => {
            tracing::debug!(peer = %addr, method = %req.method(), path = %path, code, "metrics request")
        }
        Peer::Unknown => {
            tracing::debug!(method = %req.method(), path = %path, code, "status request")
        }
    }
    response
}

async fn route(
    state: &Arc<State>,
    scope: Scope,
    req: &Request<Incoming>,
    path: &str,
    endpoint: &'static str,
) -> Answer {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{} {path}: only GET is served", req.method()),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if !req.body().is_end_stream() {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{path}: requests have no body"),
        );
    }
    if scope == Scope::Metrics && !matches!(endpoint, "metrics" | "healthz") {
        return error(
            StatusCode::NOT_FOUND,
            format!("{path}: the metrics listener serves /metrics and /healthz only"),
        );
    }
    let query = match parse_query(req.uri().query().unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let pretty = query.iter().any(|(k, _)| k == "pretty");
    let allow = |known: &[&str]| -> Result<(), String> {
        match query
            .iter()
            .find(|(k, _)| k != "pretty" && !known.contains(&k.as_str()))
        {
            Some((k, _)) => Err(format!("{path}: unknown query parameter {k:?}")),
            None => Ok(()),
        }
    };
    match endpoint {
        "healthz" => answer(StatusCode::OK, "text/plain; charset=utf-8", "ok\n"),
        "status" => {
            if let Err(e) = allow(&[]) {
                return error(StatusCode::BAD_REQUEST, e);
            }
            match state.blocking(|s| s.agent_status()).await {
                Ok(status) => json(&status, pretty),
                Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
            }
        }
        "plan" => {
            if let Err(e) = allow(&[]) {
                return error(StatusCode::BAD_REQUEST, e);
            }
            let raw = &path["/v1/plans/".len()..];
            let id = match percent_decode(raw) {
                Some(id) if !id.is_empty() => id,
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        format!("{path}: the plan id is empty or not valid percent-encoded UTF-8"),
                    );
                }
            };
            let lookup = id.clone();
            match state.blocking(move |s| s.engine.status(&lookup)).await {
                Ok(Some(status)) => json(&PlanStatusDocument::new(status), pretty),
                Ok(None) => error(
                    StatusCode::NOT_FOUND,
                    format!("no plan with id {id:?} is known to this agent"),
                ),
                Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
            }
        }
        "journal" => {
            if let Err(e) = allow(&["since", "limit"]) {
                return error(StatusCode::BAD_REQUEST, e);
            }
            let number = |name: &str| -> Result<Option<u64>, String> {
                match query.iter().find(|(k, _)| k == name) {
                    None => Ok(None),
                    Some((_, v)) => v
                        .parse::<u64>()
                        .map(Some)
                        .map_err(|_| format!("{path}: {name}={v:?} is not a number")),
                }
            };
            let since = match number("since") {
                Ok(v) => v.unwrap_or(0),
                Err(e) => return error(StatusCode::BAD_REQUEST, e),
            };
            let limit = match number("limit") {
                Ok(None) => JOURNAL_LIMIT.0,
                Ok(Some(n)) if (1..=JOURNAL_LIMIT.1 as u64).contains(&n) => n as usize,
                Ok(Some(n)) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        format!("{path}: limit={n} is not between 1 and {}", JOURNAL_LIMIT.1),
                    );
                }
                Err(e) => return error(StatusCode::BAD_REQUEST, e),
            };
            let file = state.engine.journal_info().path;
            match state
                .blocking(move |_| api::journal_page(&file, since, limit, true))
                .await
            {
                Ok(Ok(page)) => json(&page, pretty),
                Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
            }
        }
        "metrics" => {
            if let Err(e) = allow(&[]) {
                return error(StatusCode::BAD_REQUEST, e);
            }
            let openmetrics = req
                .headers()
                .get_all(header::ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains("application/openmetrics-text"));
            match state.blocking(move |s| s.metrics.encode(openmetrics)).await {
                Ok(text) => answer(
                    StatusCode::OK,
                    if openmetrics {
                        OPENMETRICS_CONTENT_TYPE
                    } else {
                        PROMETHEUS_CONTENT_TYPE
                    },
                    text,
                ),
                Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e),
            }
        }
        _ => error(
            StatusCode::NOT_FOUND,
            format!(
                "{path}: not found (endpoints: /v1/status, /v1/plans/ID, /v1/journal?since=SEQ, \
                 /metrics, /healthz)"
            ),
        ),
    }
}

/// `a=1&b&c=x%20y` → pairs, percent-decoded.
fn parse_query(query: &str) -> Result<Vec<(String, String)>, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match (percent_decode(k), percent_decode(v)) {
                (Some(k), Some(v)) => Ok((k, v)),
                _ => Err(format!(
                    "query parameter {pair:?} is not valid percent-encoding"
                )),
            }
        })
        .collect()
}

/// Decodes `%XX` escapes (and `+` as a space in queries is not used: ids may contain `+`).
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Keeps the node's facts fresh: at start, after every plan that ends (a version bump
/// changes the kubelet's version), and every ten minutes.
async fn refresh_node_facts(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    use crate::engine::Event;
    let mut events = state.engine.subscribe();
    loop {
        let s = state.clone();
        let _ = tokio::task::spawn_blocking(move || s.refresh_node()).await;
        let wait = async {
            loop {
                match events.recv().await {
                    Ok(Event::Status(s)) if s.phase.is_terminal() => return,
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => return,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        std::future::pending::<()>().await
                    }
                }
            }
        };
        tokio::select! {
            () = wait => {}
            () = tokio::time::sleep(Duration::from_secs(600)) => {}
            () = stopped(&mut stop) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_and_ids_are_percent_decoded() {
        assert_eq!(
            parse_query("since=5&limit=10&pretty").unwrap(),
            vec![
                ("since".to_string(), "5".to_string()),
                ("limit".to_string(), "10".to_string()),
                ("pretty".to_string(), String::new()),
            ]
        );
        assert_eq!(percent_decode("a%2Fb%20c+d").as_deref(), Some("a/b c+d"));
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
        assert!(parse_query("x=%zz").is_err());
    }

    #[test]
    fn endpoints_are_a_bounded_label() {
        assert_eq!(endpoint("/v1/status"), "status");
        assert_eq!(endpoint("/v1/plans/a/b"), "plan");
        assert_eq!(endpoint("/v1/plans"), "other");
        assert_eq!(endpoint("/etc/passwd"), "other");
    }
}
