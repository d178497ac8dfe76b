//! How long a connection of the Runtime SDK server may wait for its client.
//!
//! Two different waits, two limits:
//!
//! - **Idle, between requests**: Cluster API's runtime client is Go's `http.Transport`, which
//!   keeps connections in a pool for 90 s (`IdleConnTimeout`) and sends the next call on a
//!   pooled one; it does not retry a POST whose request was written when the server closed
//!   the connection under it (the hook fails with `EOF`). So an idle connection must outlive
//!   the client's pool: [`ConnectionLimits::idle`] defaults to 120 s, more than Go's 90 s and
//!   than any `retryAfterSeconds` this server answers with, and the client is always the one
//!   that closes an idle connection.
//! - **A request that has started**: from its first byte, the whole request must have arrived
//!   within [`ConnectionLimits::request`] (10 s), so a client that trickles a request cannot
//!   hold a connection.
//!
//! Hyper's own `header_read_timeout` cannot tell the two apart (it starts when the server
//! waits for the next request, that is on every idle kept-alive connection), so it is off and
//! [`Deadlines`] wraps the connection's stream instead: a read that has to wait is bounded by
//! the limit of the state the connection is in. A response being written ends a request; the
//! next byte read starts the next one.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Go's `http.DefaultTransport` `IdleConnTimeout`: how long CAPI's client keeps an idle
/// connection in its pool.
pub const GO_CLIENT_IDLE: Duration = Duration::from_secs(90);

/// The limits of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A connection that has answered its last request and waits for the next one is closed
    /// after this long.
    pub idle: Duration,
    /// A request must have arrived whole this long after its first byte (and a new
    /// connection must have sent its first request this long after the TLS handshake).
    pub request: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            idle: Duration::from_secs(120),
            request: Duration::from_secs(10),
        }
    }
}

/// Where a connection is: reading a request (since when), or idle after an answer.
#[derive(Debug, Clone, Copy)]
enum Waiting {
    Request { since: Instant },
    Idle { since: Instant },
}

/// A stream whose reads wait at most as long as the connection's state allows; a read that
/// waits longer fails with `TimedOut`, which ends the connection.
pub struct Deadlines<S> {
    inner: S,
    limits: ConnectionLimits,
    waiting: Waiting,
    timer: Pin<Box<Sleep>>,
    armed_for: Option<Instant>,
}

impl<S> Deadlines<S> {
    /// `inner`, a connection that has just been accepted (its first request is due within
    /// `limits.request`).
    pub fn new(inner: S, limits: ConnectionLimits) -> Deadlines<S> {
        let now = Instant::now();
        Deadlines {
            inner,
            limits,
            waiting: Waiting::Request { since: now },
            timer: Box::pin(tokio::time::sleep_until(now + limits.request)),
            armed_for: None,
        }
    }

    /// After a write: bytes of an answer went out, so the connection waits for the next
    /// request from now on.
    fn answered(&mut self, written: &Poll<io::Result<usize>>) {
        if let Poll::Ready(Ok(n)) = written
            && *n > 0
        {
            self.waiting = Waiting::Idle {
                since: Instant::now(),
            };
        }
    }

    fn deadline(&self) -> Instant {
        match self.waiting {
            Waiting::Request { since } => since + self.limits.request,
            Waiting::Idle { since } => since + self.limits.idle,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Deadlines<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before
                    && let Waiting::Idle { .. } = this.waiting
                {
                    // The first byte of the next request.
                    this.waiting = Waiting::Request {
                        since: Instant::now(),
                    };
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let deadline = this.deadline();
                if this.armed_for != Some(deadline) {
                    this.timer.as_mut().reset(deadline);
                    this.armed_for = Some(deadline);
                }
                match this.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        match this.waiting {
                            Waiting::Request { .. } => "the request did not arrive in time",
                            Waiting::Idle { .. } => "the connection was idle too long",
                        },
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Deadlines<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, data);
        this.answered(&written);
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.answered(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    const LIMITS: ConnectionLimits = ConnectionLimits {
        idle: Duration::from_secs(120),
        request: Duration::from_secs(10),
    };

    #[test]
    fn an_idle_connection_outlives_gos_pool_and_every_retry_we_ask_for() {
        let limits = ConnectionLimits::default();
        assert!(limits.idle > GO_CLIENT_IDLE);
        for retry in [
            crate::handlers::UNREACHABLE_RETRY_SECONDS,
            crate::handlers::SUBMITTING_RETRY_SECONDS,
            crate::hooks::MAX_RETRY_SECONDS,
        ] {
            assert!(Duration::from_secs(retry as u64) < limits.idle, "{retry}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_after_an_answer_is_bounded_by_the_idle_limit_not_the_request_limit() {
        let (client, server) = duplex(1024);
        let (mut client_read, mut client_write) = tokio::io::split(client);
        let mut conn = Deadlines::new(server, LIMITS);
        client_write
            .write_all(b"GET / HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0);
        conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        let mut answer = [0u8; 19];
        client_read.read_exact(&mut answer).await.unwrap();
        // 110 s of nothing, then the next request: still served.
        let reader = tokio::spawn(async move {
            let n = conn.read(&mut buf).await;
            (n.map_err(|e| e.kind()), conn)
        });
        tokio::time::sleep(Duration::from_secs(110)).await;
        client_write
            .write_all(b"GET / HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let (n, mut conn) = reader.await.unwrap();
        assert!(n.unwrap() > 0);
        conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        // Then idle past the limit: closed.
        let started = Instant::now();
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), LIMITS.idle);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_has_started_must_arrive_within_the_request_limit() {
        let (mut client, server) = duplex(1024);
        let mut conn = Deadlines::new(server, LIMITS);
        let mut buf = [0u8; 64];
        conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_secs(50)).await;
        // The first byte of a request after 50 s idle, then nothing more.
        client.write_all(b"POST /hooks").await.unwrap();
        assert!(conn.read(&mut buf).await.unwrap() > 0);
        let started = Instant::now();
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), LIMITS.request);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_must_send_its_first_request_within_the_request_limit() {
        let (_client, server) = duplex(1024);
        let mut conn = Deadlines::new(server, LIMITS);
        let started = Instant::now();
        let err = conn.read(&mut [0u8; 8]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), LIMITS.request);
    }
}
