//! A socket read in large pieces under TLS.
//!
//! rustls asks its transport for at most 4 KiB at a time (`DeframerVecBuffer::prepare_read`),
//! so a 16 KiB TLS record costs four `recv` calls, and a 50 MiB plan about 13,000, each
//! taking the socket's lock against the sender on the other end. [`ReadAhead`] reads up to
//! [`CHUNK`] from the socket when asked for less and serves the small reads from that. The
//! buffer exists only while it holds bytes: an idle connection holds none, and a busy one
//! at most [`CHUNK`] that the kernel would otherwise have held in its socket buffer, and it
//! is allocated only once the socket is readable.
//! Writes pass through unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Bytes read from the socket at once when a read asks for less.
pub const CHUNK: usize = 64 * 1024;

/// `inner` read in pieces of up to [`CHUNK`] bytes.
#[derive(Debug)]
pub struct ReadAhead<S> {
    inner: S,
    /// Bytes read from `inner` and not yet handed out: `buf[at..]`. Empty (no allocation)
    /// when everything was handed out.
    buf: Vec<u8>,
    at: usize,
}

impl<S> ReadAhead<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> ReadAhead<S> {
        ReadAhead {
            inner,
            buf: Vec::new(),
            at: 0,
        }
    }

    /// The wrapped stream; bytes read ahead and not handed out are dropped.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Hands out what is buffered into `out`; frees the buffer once it is all handed out.
    fn hand_out(&mut self, out: &mut ReadBuf<'_>) {
        let n = out.remaining().min(self.buf.len() - self.at);
        out.put_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        if self.at == self.buf.len() {
            self.buf = Vec::new();
            self.at = 0;
        }
    }
}

impl AsyncRead for ReadAhead<TcpStream> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.at < this.buf.len() {
            this.hand_out(out);
            return Poll::Ready(Ok(()));
        }
        // A large read goes straight to the socket.
        if out.remaining() >= CHUNK {
            return Pin::new(&mut this.inner).poll_read(cx, out);
        }
        // The buffer is allocated only once the socket has bytes: a connection waiting for
        // its next request allocates nothing each time it is polled.
        loop {
            std::task::ready!(this.inner.poll_read_ready(cx))?;
            // Read into the spare capacity: the 64 KiB are not zeroed first.
            let mut buf = Vec::with_capacity(CHUNK);
            match this.inner.try_read_buf(&mut buf) {
                // The end of the stream: nothing kept, nothing handed out.
                Ok(0) => return Poll::Ready(Ok(())),
                Ok(_) => {
                    this.buf = buf;
                    this.at = 0;
                    this.hand_out(out);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadAhead<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A connected pair of TCP streams on the loopback interface.
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap());
        let (near, far) = tokio::join!(near, listener.accept());
        (near.unwrap(), far.unwrap().0)
    }

    #[tokio::test]
    async fn small_reads_get_every_byte_in_order_and_nothing_is_held_between_chunks() {
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let (mut near, far) = pair().await;
        let sending = data.clone();
        let writer = tokio::spawn(async move {
            near.write_all(&sending).await.unwrap();
        });
        let mut reader = ReadAhead::new(far);
        let (mut got, mut reads, mut most_read) = (Vec::new(), 0, 0);
        let mut small = [0u8; 4096];
        loop {
            let n = reader.read(&mut small).await.unwrap();
            if n == 0 {
                break;
            }
            reads += 1;
            got.extend_from_slice(&small[..n]);
            assert!(reader.buf.len() <= CHUNK);
            most_read = most_read.max(reader.buf.len());
            if reader.at == 0 {
                assert_eq!(reader.buf.capacity(), 0, "a drained buffer is freed");
            }
        }
        writer.await.unwrap();
        assert_eq!(got.len(), data.len());
        assert!(got == data, "the bytes arrive as sent");
        assert!(reads >= data.len() / small.len());
        assert!(
            most_read > small.len(),
            "the socket was read ahead of the 4 KiB asked"
        );
        assert_eq!(reader.buf.capacity(), 0, "nothing is held at the end");
    }

    #[tokio::test]
    async fn a_large_read_goes_straight_to_the_socket_and_writes_pass_through() {
        let (mut near, far) = pair().await;
        let mut wrapped = ReadAhead::new(far);
        near.write_all(&vec![7u8; 2 * CHUNK]).await.unwrap();
        let mut big = vec![0u8; 2 * CHUNK];
        let n = wrapped.read(&mut big).await.unwrap();
        assert!(n > 0 && big[..n].iter().all(|b| *b == 7));
        assert_eq!(wrapped.buf.capacity(), 0, "nothing was buffered");
        wrapped.write_all(b"reply").await.unwrap();
        let mut reply = [0u8; 5];
        near.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"reply");
    }
}
