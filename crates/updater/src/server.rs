//! The Runtime SDK server: HTTPS (rustls, TLS 1.2 and 1.3, ALPN `http/1.1`), HTTP/1.1
//! (what CAPI's Go client speaks to extensions), the serving certificate re-read when its
//! files change (cert-manager rotates them).
//!
//! Routing is on the exact paths CAPI builds; the `?timeout=` query is ignored; only POST
//! reaches a hook and no Content-Type is required (CAPI sends none). `GET /healthz`,
//! `/readyz` and `/metrics` are for probes and Prometheus. Bad input never panics and never
//! gets an empty 500: a hook path always answers with a JSON body (`status: Failure` and a
//! message naming the field); a body over the limit is refused after reading at most the
//! limit. Logs name the hook, the Machine, the outcome and the sha256 of the body, never
//! the body (it holds the bootstrap token).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::ServerConfig;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::deadlines::{ConnectionLimits, Deadlines};
use super::handlers::Updater;
use super::hooks::{FailureResponse, Hook};
use super::metrics::Scraped;
use inplace_api::tls::{load_certificates, load_private_key};

pub use super::edge::yaml::MAX_BODY_BYTES;

/// Most connections served at once.
const MAX_CONNECTIONS: usize = 1024;

/// Time for the TLS handshake; time for a request's body once its head is read. How long a
/// connection may be idle, and how long a request may take to arrive, is
/// [`ConnectionLimits`].
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the certificate files are looked at.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// The serving certificate, re-read when its files change.
pub struct ServingTls {
    cert: PathBuf,
    key: PathBuf,
    state: Mutex<TlsState>,
    scraped: Arc<Scraped>,
}

struct TlsState {
    config: Arc<ServerConfig>,
    stamp: Vec<Option<(SystemTime, u64)>>,
    checked: Instant,
}

fn stamp(paths: &[&Path]) -> Vec<Option<(SystemTime, u64)>> {
    paths
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

/// A rustls server configuration for `cert`/`key`: TLS 1.2 and 1.3, `http/1.1`, no client
/// certificate.
pub fn server_config(cert: &Path, key: &Path) -> anyhow::Result<ServerConfig> {
    let chain = load_certificates(cert)?;
    let key = load_private_key(key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .context("tls versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("serving certificate and key do not match")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

impl ServingTls {
    /// Loads the certificate once (an error here stops the updater).
    pub fn new(cert: PathBuf, key: PathBuf, scraped: Arc<Scraped>) -> anyhow::Result<ServingTls> {
        let config = Arc::new(server_config(&cert, &key)?);
        let stamp = stamp(&[cert.as_path(), key.as_path()]);
        Ok(ServingTls {
            cert,
            key,
            state: Mutex::new(TlsState {
                config,
                stamp,
                checked: Instant::now(),
            }),
            scraped,
        })
    }

    /// The configuration for a new connection (reloaded first when the files changed).
    pub fn current(&self) -> Arc<ServerConfig> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.checked.elapsed() >= RELOAD_CHECK {
            state.checked = Instant::now();
            let now = stamp(&[self.cert.as_path(), self.key.as_path()]);
            if now != state.stamp {
                match server_config(&self.cert, &self.key) {
                    Ok(config) => {
                        state.config = Arc::new(config);
                        state.stamp = now;
                        self.scraped.tls_reloads.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                    }
                    Err(e) => {
                        // Half-written files (cert-manager writes key and cert one by one)
                        // are retried at the next check.
                        self.scraped
                            .tls_reload_failures
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(error = %super::errors::chain(&e), "serving certificate not reloaded; keeping the old one");
                    }
                }
            }
        }
        state.config.clone()
    }
}

/// A running server.
pub struct Server {
    /// The address it listens on.
    pub addr: SocketAddr,
    stop: Arc<tokio::sync::Notify>,
    ready: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Binds `listen` and serves until [`Server::shutdown`].
    pub async fn start(
        listen: SocketAddr,
        tls: Arc<ServingTls>,
        updater: Arc<Updater>,
        limits: ConnectionLimits,
    ) -> anyhow::Result<Server> {
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("listen on {listen}"))?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(tokio::sync::Notify::new());
        let ready = Arc::new(AtomicBool::new(true));
        let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let (stop2, ready2) = (stop.clone(), ready.clone());
        let task = tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop2.notified() => break,
                    a = listener.accept() => a,
                };
                let (tcp, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    tracing::warn!(%peer, "too many connections; closing this one");
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
                let (updater, ready) = (updater.clone(), ready2.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    let stream =
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "tls handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "tls handshake timed out");
                                return;
                            }
                        };
                    let service = hyper::service::service_fn(move |req| {
                        let (updater, ready) = (updater.clone(), ready.clone());
                        async move {
                            Ok::<_, std::convert::Infallible>(route(req, &updater, &ready).await)
                        }
                    });
                    // Hyper's header timeout would also close an idle kept-alive
                    // connection: the connection's own deadlines replace it.
                    let conn = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(None)
                        .max_buf_size(64 * 1024)
                        .serve_connection(TokioIo::new(Deadlines::new(stream, limits)), service);
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
        });
        Ok(Server {
            addr,
            stop,
            ready,
            task,
        })
    }

    /// Stops accepting (readyz turns false first); open connections finish their request.
    pub async fn shutdown(self) {
        self.ready.store(false, Ordering::SeqCst);
        self.stop.notify_one();
        let _ = self.task.await;
    }
}

fn json_response(
    status: StatusCode,
    body: &serde_json::Value,
    close: bool,
) -> Response<Full<Bytes>> {
    let mut builder = Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json");
    if close {
        builder = builder.header(http::header::CONNECTION, "close");
    }
    builder
        .body(Full::new(Bytes::from(
            serde_json::to_vec(body).unwrap_or_default(),
        )))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn text_response(status: StatusCode, body: String, content_type: &str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn status_body(message: &str) -> serde_json::Value {
    serde_json::json!({"status": "Failure", "message": message})
}

async fn route(
    req: Request<Incoming>,
    updater: &Arc<Updater>,
    ready: &AtomicBool,
) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    match (method.clone(), path.as_str()) {
        (Method::GET, "/healthz") => {
            return text_response(StatusCode::OK, "ok\n".into(), "text/plain");
        }
        (Method::GET, "/readyz") => {
            return if ready.load(Ordering::SeqCst) {
                text_response(StatusCode::OK, "ok\n".into(), "text/plain")
            } else {
                text_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "shutting down\n".into(),
                    "text/plain",
                )
            };
        }
        (Method::GET, "/metrics") => {
            return text_response(
                StatusCode::OK,
                updater.metrics.encode(),
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            );
        }
        _ => {}
    }
    let Some(hook) = Hook::from_path(&path) else {
        return json_response(
            StatusCode::NOT_FOUND,
            &status_body(&format!(
                "no hook at {path}: this extension serves {}",
                Hook::ALL
                    .iter()
                    .map(|h| h.path())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            false,
        );
    };
    if method != Method::POST {
        return json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &serde_json::to_value(FailureResponse::new(
                hook,
                format!("{method} is not allowed on {path}: hooks are POST"),
            ))
            .unwrap_or_default(),
            false,
        );
    }
    let started = Instant::now();
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        FailureResponse::new(
            hook,
            format!("bad request: the body is larger than the limit of {MAX_BODY_BYTES} bytes"),
        )
    };
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        updater
            .metrics
            .request(hook.as_str(), "failure", started.elapsed().as_secs_f64());
        tracing::warn!(hook = %hook, bytes = declared, "request refused: body too large");
        return json_response(
            StatusCode::OK,
            &serde_json::to_value(too_large()).unwrap_or_default(),
            true,
        );
    }
    let body = match tokio::time::timeout(
        BODY_TIMEOUT,
        Limited::new(req.into_body(), MAX_BODY_BYTES).collect(),
    )
    .await
    {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => {
            let message = if e
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                too_large()
            } else {
                FailureResponse::new(hook, format!("bad request: reading the body failed: {e}"))
            };
            updater
                .metrics
                .request(hook.as_str(), "failure", started.elapsed().as_secs_f64());
            tracing::warn!(hook = %hook, "request refused: {}", message.message);
            return json_response(
                StatusCode::OK,
                &serde_json::to_value(message).unwrap_or_default(),
                true,
            );
        }
        Err(_) => {
            updater
                .metrics
                .request(hook.as_str(), "failure", started.elapsed().as_secs_f64());
            return json_response(
                StatusCode::OK,
                &serde_json::to_value(FailureResponse::new(
                    hook,
                    "bad request: the body did not arrive within 10 s",
                ))
                .unwrap_or_default(),
                true,
            );
        }
    };
    let digest = hex::encode(&Sha256::digest(&body)[..6]);
    let answer = updater.handle(hook, &body).await;
    let seconds = started.elapsed().as_secs_f64();
    updater
        .metrics
        .request(hook.as_str(), answer.outcome, seconds);
    let message = answer.message.as_str();
    if answer.outcome == "failure" {
        tracing::warn!(hook = %hook, machine = %answer.object, body_sha256 = %digest, outcome = answer.outcome, ms = seconds * 1e3, message, "hook answered");
    } else if let Some(why) = &answer.why {
        // Cluster API shows no CanUpdate* message of a successful answer: the reason is
        // said here (crates/updater/src/why.rs).
        let reason = why.sentence();
        tracing::info!(hook = %hook, machine = %answer.object, body_sha256 = %digest, outcome = answer.outcome, ms = seconds * 1e3, reason_class = why.class().as_str(), reason = %reason, "hook answered: not everything in place");
    } else {
        tracing::info!(hook = %hook, machine = %answer.object, body_sha256 = %digest, outcome = answer.outcome, ms = seconds * 1e3, "hook answered");
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(answer.body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}
