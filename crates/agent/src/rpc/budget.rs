//! A bound on the bytes of requests the agent holds at once.
//!
//! Each request message is held several times while it is handled (the wire buffer, the
//! decoded message, the plan document, the validated plan), so 64 concurrent 16 MiB
//! `CheckPlan`s used to take the daemon to 400 MiB — an OOM kill on a node, or under a
//! DaemonSet's memory limit. Before a request reaches the service, this layer reads the
//! length its first gRPC message declares (the 5-byte prefix of the body) and takes that
//! many bytes from a budget shared by all connections; the request waits for earlier ones to
//! finish, and gets RESOURCE_EXHAUSTED when the budget stays taken for `wait`. Small
//! requests (status, watch, node info) take a few bytes and are never held up by each
//! other. The bytes go back when the response is produced. While large requests are in
//! flight the allocator reuses large buffers, and after the burst the freed memory is
//! returned to the kernel ([`crate::host::memory::for_large_requests`]).
//!
//! A `SubmitPlanDocument` call sends its plan in pieces and declares the whole length in its
//! metadata (`document.rs`): that length is what it takes.
//!
//! A waiting request costs only what HTTP/2 flow control lets its client send before the
//! body is read: the server's windows are kept small for that (see `server.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;

/// Requests of at least this many bytes make the budget return freed memory to the kernel
/// once nothing large is in flight.
const LARGE: u64 = 1 << 20;

/// The shared budget.
#[derive(Debug)]
pub struct RequestBudget {
    bytes: u32,
    permits: Arc<Semaphore>,
    wait: Duration,
    /// Bytes of large requests in flight.
    large_in_flight: AtomicU64,
    /// Held while the allocator is set for the large requests in flight (or none).
    memory_mode: std::sync::Mutex<()>,
}

impl RequestBudget {
    /// A budget of `bytes` (at least the largest message allowed, so every allowed message
    /// fits); requests wait at most `wait` for their share.
    pub fn new(bytes: usize, max_message_bytes: usize, wait: Duration) -> Arc<RequestBudget> {
        let bytes = u32::try_from(bytes.max(max_message_bytes)).unwrap_or(u32::MAX);
        Arc::new(RequestBudget {
            bytes,
            permits: Arc::new(Semaphore::new(bytes as usize)),
            wait,
            large_in_flight: AtomicU64::new(0),
            memory_mode: std::sync::Mutex::new(()),
        })
    }

    /// Sets the allocator for whether large requests are in flight now (blocking: giving
    /// memory back takes a while). Calls are taken one at a time and each reads the count
    /// afresh, so the last one leaves the setting for the current count.
    fn settle_memory(&self) {
        let _one_at_a_time = self.memory_mode.lock().unwrap_or_else(|p| p.into_inner());
        crate::host::memory::for_large_requests(self.large_in_flight.load(Ordering::SeqCst) > 0);
    }
}

/// The layer holding requests to the budget.
#[derive(Debug, Clone)]
pub struct BudgetLayer {
    budget: Arc<RequestBudget>,
}

impl BudgetLayer {
    /// The layer for a budget.
    pub fn new(budget: Arc<RequestBudget>) -> BudgetLayer {
        BudgetLayer { budget }
    }
}

impl<S> tower::Layer<S> for BudgetLayer {
    type Service = Budgeted<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Budgeted {
            inner,
            budget: self.budget.clone(),
        }
    }
}

/// The service of [`BudgetLayer`].
#[derive(Debug, Clone)]
pub struct Budgeted<S> {
    inner: S,
    budget: Arc<RequestBudget>,
}

type Body = tonic::body::Body;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<S> tower::Service<http::Request<Body>> for Budgeted<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The clone waits for readiness on its own; the ready one handles this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let budget = self.budget.clone();
        Box::pin(async move {
            let (parts, mut body) = request.into_parts();
            let mut head = BytesMut::new();
            let mut rest_done = false;
            let declared = if parts.uri.path() == inplace_api::document::PATH {
                // A plan document comes in pieces; its whole length is declared before the
                // first (the service refuses a call without it, or with a wrong one).
                inplace_api::document::declared_in(&parts.headers).unwrap_or(0)
            } else {
                rest_done = read_prefix(&mut body, &mut head).await;
                if head.len() >= 5 {
                    u64::from(u32::from_be_bytes([head[1], head[2], head[3], head[4]]))
                } else {
                    0
                }
            };
            // A message over the budget is over the message limit too: the service refuses
            // it from the prefix without reading it, so it needs no share.
            let weight = if declared > u64::from(budget.bytes) {
                0
            } else {
                (declared as u32).max(1)
            };
            let permit = match tokio::time::timeout(
                budget.wait,
                budget.permits.clone().acquire_many_owned(weight),
            )
            .await
            {
                Ok(Ok(permit)) => permit,
                _ => {
                    // Said on the agent's side too: the caller's retry hides it otherwise.
                    tracing::warn!(
                        method = parts.uri.path(),
                        declared_bytes = declared,
                        budget_bytes = budget.bytes,
                        waited = ?budget.wait,
                        "request refused (RESOURCE_EXHAUSTED): the shared request budget stayed \
                         taken by other requests"
                    );
                    let status = tonic::Status::resource_exhausted(format!(
                        "the agent is busy with {} bytes of other requests (its limit); retry \
                         in a few seconds",
                        budget.bytes
                    ));
                    return Ok(status.into_http());
                }
            };
            let large = u64::from(weight) >= LARGE;
            if large
                && budget
                    .large_in_flight
                    .fetch_add(u64::from(weight), Ordering::SeqCst)
                    == 0
            {
                // The first large request of a burst: its buffers are reused from the heap
                // instead of mapped afresh (`host::memory`).
                let settling = budget.clone();
                let _ = tokio::task::spawn_blocking(move || settling.settle_memory()).await;
            }
            let body = Body::new(Prefixed {
                head: Some(head.freeze()),
                rest: (!rest_done).then_some(body),
            });
            let result = inner.call(http::Request::from_parts(parts, body)).await;
            drop(permit);
            if large
                && budget
                    .large_in_flight
                    .fetch_sub(u64::from(weight), Ordering::SeqCst)
                    == u64::from(weight)
            {
                // The last large request of a burst: the idle setting again, and its memory
                // given back, off the runtime.
                let settling = budget.clone();
                tokio::task::spawn_blocking(move || settling.settle_memory());
            }
            result
        })
    }
}

/// Reads the first bytes of `body` into `head` until they hold the first message's
/// compression flag and length (5 bytes); true when the body ended before (trailers, a
/// reset stream or an empty body: the service reports it as usual).
async fn read_prefix(body: &mut Body, head: &mut BytesMut) -> bool {
    while head.len() < 5 {
        match body.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => head.extend_from_slice(&data),
                Err(_trailers) => return true,
            },
            Some(Err(_)) | None => return true,
        }
    }
    false
}

/// The body with the bytes already read put back in front.
struct Prefixed {
    head: Option<Bytes>,
    rest: Option<Body>,
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(head) = self.head.take()
            && head.has_remaining()
        {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|s| Box::new(s) as BoxError))),
            None => Poll::Ready(None),
        }
    }
}
