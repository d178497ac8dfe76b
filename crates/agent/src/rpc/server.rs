//! The gRPC server: `NodeAgent`, `grpc.health.v1` and server reflection, behind mutual TLS
//! ([`inplace_api::tls`]) and per-method authorization ([`inplace_api::authz`]), with the transport
//! limits of DESIGN §4 (message size, concurrent streams, request deadline, open
//! connections, handshakes in flight).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::TcpListener;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use super::budget::{BudgetLayer, RequestBudget};
use inplace_api::FILE_DESCRIPTOR_SET;
use inplace_api::authz::{AuthzCounters, AuthzLayer, AuthzRules};
use inplace_api::pb::node_agent_server::{NodeAgent, NodeAgentServer};
use inplace_api::tls::{AcceptOptions, ReloadingServerConfig, tls_incoming};

/// Transport limits of the server.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Largest request or response message, in bytes. A larger request is refused with
    /// RESOURCE_EXHAUSTED before it is decoded.
    pub max_message_bytes: usize,
    /// Concurrent HTTP/2 streams (calls) per connection.
    pub max_concurrent_streams: u32,
    /// Upper bound for producing a response (the first message of a stream); the client's
    /// `grpc-timeout` applies when shorter. Streams themselves are not cut off.
    pub request_timeout: Duration,
    /// Interval of HTTP/2 pings that detect dead peers on idle connections.
    pub keepalive_interval: Duration,
    /// Connections are closed (HTTP/2 GOAWAY, calls in flight may finish) after this long,
    /// so a client whose certificate was authenticated against rotated-out material cannot
    /// keep using an old connection indefinitely. gRPC clients reconnect transparently.
    pub max_connection_age: Duration,
    /// After `max_connection_age`, calls in flight (e.g. a WatchPlan stream) get this long
    /// before the connection is closed; a watcher then re-watches on a new connection.
    pub max_connection_age_grace: Duration,
    /// Bytes of request messages held at once, across all connections (see `budget.rs`);
    /// at least `max_message_bytes`.
    pub request_budget_bytes: usize,
    /// How long a request waits for its share of the budget before RESOURCE_EXHAUSTED.
    pub request_budget_wait: Duration,
    /// HTTP/2 flow-control window per connection and per stream: what a client can send
    /// before the agent reads it, so what a request waiting for the budget can cost.
    pub window_bytes: u32,
    /// Limits of the TLS accept loop.
    pub accept: AcceptOptions,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            // The plan-file limit (plan::Limits::max_plan_bytes) is 16 MiB as well.
            max_message_bytes: 16 * 1024 * 1024,
            max_concurrent_streams: 32,
            request_timeout: Duration::from_secs(30),
            keepalive_interval: Duration::from_secs(60),
            max_connection_age: Duration::from_secs(30 * 60),
            max_connection_age_grace: Duration::from_secs(5 * 60),
            request_budget_bytes: 16 * 1024 * 1024,
            request_budget_wait: Duration::from_secs(20),
            // 128 KiB: 64 connections waiting hold 8 MiB. With HTTP/2's own 64 KiB a large
            // plan's sender kept waiting for window updates (`submit --wait` of a 50 MiB
            // plan over loopback, medians of six alternating rounds: 64 KiB 323 ms against
            // 266 ms for 256 KiB; 399 against 315 ms for 128 KiB with a build running beside
            // them). 1 and 4 MiB were within the noise of 256 KiB, and 128 KiB of 256 KiB.
            window_bytes: 128 * 1024,
            accept: AcceptOptions::default(),
        }
    }
}

/// Who may connect and what they may call.
#[derive(Debug, Clone)]
pub struct Security {
    /// Server TLS material, reloaded when its files change.
    pub tls: Arc<ReloadingServerConfig>,
    /// Identity → role rules.
    pub rules: Arc<AuthzRules>,
    /// Authorization outcome counters.
    pub authz_counters: Arc<AuthzCounters>,
}

/// Serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The HTTP/2 server failed.
    #[error("grpc server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `node_agent`, health (statuses set through `health`) and reflection on
/// `listener` until `shutdown` completes. Requests pass the TLS handshake, then
/// authorization, then the size limit, then reach the service.
pub async fn serve<S, F>(
    listener: TcpListener,
    node_agent: S,
    health: HealthReporter,
    security: Security,
    options: ServeOptions,
    shutdown: F,
) -> Result<(), ServeError>
where
    S: NodeAgent,
    F: Future<Output = ()>,
{
    // v1 for current clients, v1alpha for older grpcurl and grpc-go tools. Each decodes the
    // descriptor sets (comments and all) into 400 KiB of heap, so each is built at its first
    // request: an agent nobody inspects with grpcurl does not hold them.
    let reflection_v1 = Lazy::new(|| reflection().build_v1());
    let reflection_v1alpha = Lazy::new(|| reflection().build_v1alpha());
    let health = HealthServer::new(HealthService::from_health_reporter(health));
    let node_agent = NodeAgentServer::new(node_agent)
        .max_decoding_message_size(options.max_message_bytes)
        .max_encoding_message_size(options.max_message_bytes);

    let layers = tower::ServiceBuilder::new()
        .layer(AuthzLayer::new(security.rules, security.authz_counters))
        .layer(BudgetLayer::new(RequestBudget::new(
            options.request_budget_bytes,
            options.max_message_bytes,
            options.request_budget_wait,
        )))
        .layer(MessageLimitLayer {
            limit: options.max_message_bytes,
        });
    let incoming = tls_incoming(listener, security.tls, options.accept);
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(options.max_concurrent_streams))
        .initial_connection_window_size(options.window_bytes)
        .initial_stream_window_size(options.window_bytes)
        .timeout(options.request_timeout)
        .http2_keepalive_interval(Some(options.keepalive_interval))
        .max_connection_age(options.max_connection_age)
        .max_connection_age_grace(options.max_connection_age_grace)
        .layer(layers)
        .add_service(node_agent)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

// === Server reflection, built at its first request ===

/// The reflection service's builder: this agent's API and `grpc.health.v1`.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

type Body = tonic::body::Body;
type BoxedResponse = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

/// A gRPC service made by `make` when its first request arrives, then kept (for services
/// that cost memory and are seldom called). A service `make` cannot build is logged once
/// and answers `INTERNAL` with why.
struct Lazy<F, S> {
    make: Arc<F>,
    built: Arc<std::sync::OnceLock<Result<S, String>>>,
}

impl<F, S> Lazy<F, S> {
    fn new(make: F) -> Self {
        Lazy {
            make: Arc::new(make),
            built: Arc::new(std::sync::OnceLock::new()),
        }
    }
}

impl<F, S> Clone for Lazy<F, S> {
    fn clone(&self) -> Self {
        Lazy {
            make: self.make.clone(),
            built: self.built.clone(),
        }
    }
}

impl<F, S: tonic::server::NamedService> tonic::server::NamedService for Lazy<F, S> {
    const NAME: &'static str = S::NAME;
}

impl<F, S, E> tower::Service<http::Request<Body>> for Lazy<F, S>
where
    F: Fn() -> Result<S, E> + Send + Sync + 'static,
    E: std::fmt::Display,
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxedResponse;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let built = self.built.get_or_init(|| {
            (self.make)().map_err(|e| {
                tracing::error!(service = S::NAME, error = %e, "cannot build the service");
                e.to_string()
            })
        });
        match built {
            Ok(service) => Box::pin(tower::ServiceExt::oneshot(service.clone(), request)),
            Err(e) => {
                let answer = tonic::Status::internal(format!("{} cannot be built: {e}", S::NAME));
                Box::pin(std::future::ready(Ok(answer.into_http())))
            }
        }
    }
}

// === Oversize requests ===

/// Message tonic puts into the status when a request message exceeds the decoding limit.
const TONIC_TOO_LARGE: &str = "Error, decoded message length too large";

/// Turns tonic's OUT_OF_RANGE for an oversize request message into RESOURCE_EXHAUSTED, the
/// code gRPC specifies (and grpc-go returns) for it, so updaters can branch on one code.
#[derive(Debug, Clone, Copy)]
struct MessageLimitLayer {
    limit: usize,
}

impl<S> tower::Layer<S> for MessageLimitLayer {
    type Service = MessageLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MessageLimit {
            inner,
            limit: self.limit,
        }
    }
}

#[derive(Debug, Clone)]
struct MessageLimit<S> {
    inner: S,
    limit: usize,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for MessageLimit<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let limit = self.limit;
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            rewrite_oversize_status(response.headers_mut(), limit);
            Ok(response)
        })
    }
}

/// Rewrites a trailers-only OUT_OF_RANGE "decoded message length too large" status.
fn rewrite_oversize_status(headers: &mut http::HeaderMap, limit: usize) {
    let Some(status) = tonic::Status::from_header_map(headers) else {
        return;
    };
    if status.code() != tonic::Code::OutOfRange || !status.message().starts_with(TONIC_TOO_LARGE) {
        return;
    }
    let status = tonic::Status::resource_exhausted(format!(
        "request message exceeds the limit of {limit} bytes"
    ));
    headers.remove("grpc-message");
    headers.remove("grpc-status");
    // add_header only fails on values that cannot be headers; ours are ASCII.
    let _ = status.add_header(headers);
}

#[cfg(test)]
mod tests {
    /// Server reflection is built at its first request; that it can be built at all (from
    /// the descriptor sets compiled in) is checked here instead of at every start.
    #[test]
    fn both_reflection_services_build_from_the_compiled_in_descriptors() {
        super::reflection().build_v1().unwrap();
        super::reflection().build_v1alpha().unwrap();
    }

    use super::*;

    #[test]
    fn oversize_status_is_rewritten() {
        let mut headers = http::HeaderMap::new();
        tonic::Status::out_of_range(format!(
            "{TONIC_TOO_LARGE}: found 5000000 bytes, the limit is: 4194304 bytes"
        ))
        .add_header(&mut headers)
        .unwrap();
        rewrite_oversize_status(&mut headers, 4194304);
        let status = tonic::Status::from_header_map(&headers).unwrap();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            status.message(),
            "request message exceeds the limit of 4194304 bytes"
        );
    }

    #[test]
    fn other_statuses_are_left_alone() {
        let mut headers = http::HeaderMap::new();
        tonic::Status::out_of_range("attempt 3 is out of range")
            .add_header(&mut headers)
            .unwrap();
        let before = headers.clone();
        rewrite_oversize_status(&mut headers, 10);
        assert_eq!(headers, before);
    }
}
