//! A small blocking HTTP/1.1 client for the status socket (`inplace-agent status`, tests):
//! one request per connection, `Connection: close`, bounded answer.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Largest answer read.
const MAX_RESPONSE: u64 = 64 << 20;

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: String,
    /// The body.
    pub body: Vec<u8>,
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens on the socket (no file, or nobody accepting).
    #[error("no agent is serving on {path}: {source}")]
    NotServing {
        /// The socket.
        path: String,
        /// What connecting said.
        #[source]
        source: std::io::Error,
    },
    /// The socket exists but this user may not connect.
    #[error(
        "permission denied on {path}: the status socket is readable by root and the members \
         of its group (inplace-agent unless configured otherwise)"
    )]
    PermissionDenied {
        /// The socket.
        path: String,
    },
    /// The exchange failed.
    #[error("status socket {path}: {message}")]
    Failed {
        /// The socket.
        path: String,
        /// What failed.
        message: String,
    },
}

/// `GET target` (a path with its query, `/v1/status`) on the socket at `socket`.
pub fn get(socket: &Path, target: &str, timeout: Duration) -> Result<Response, ClientError> {
    let path = socket.display().to_string();
    let failed = |message: String| ClientError::Failed {
        path: path.clone(),
        message,
    };
    let mut stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        std::io::ErrorKind::PermissionDenied => {
            ClientError::PermissionDenied { path: path.clone() }
        }
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
            ClientError::NotServing {
                path: path.clone(),
                source: e,
            }
        }
        _ => failed(format!("connect: {e}")),
    })?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| failed(format!("set timeouts: {e}")))?;
    let request = format!(
        "GET {target} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: inplace-agent/{}\r\nAccept: application/json\r\nConnection: close\r\n\r\n",
        env!("CARGO_PKG_VERSION")
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| failed(format!("send the request: {e}")))?;
    let mut raw = Vec::new();
    stream
        .take(MAX_RESPONSE)
        .read_to_end(&mut raw)
        .map_err(|e| failed(format!("read the answer: {e}")))?;
    parse_response(&raw).map_err(failed)
}

/// Parses a whole HTTP/1.1 answer (headers, then a body by length, chunked, or to the end).
pub fn parse_response(raw: &[u8]) -> Result<Response, String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| "the answer has no complete header".to_string())?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "the header is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut content_type = String::new();
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-type" => content_type = value.to_string(),
            "content-length" => length = value.parse::<usize>().ok(),
            "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
            _ => {}
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        if rest.len() < n {
            return Err(format!("the body ended after {} of {n} bytes", rest.len()));
        }
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response {
        status,
        content_type,
        body,
    })
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk has no size line")?;
        let size_text = std::str::from_utf8(&data[..line_end]).map_err(|_| "bad chunk size")?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size + 2 {
            return Err("a chunk ended early".into());
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_by_length_chunks_or_end() {
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}extra",
        )
        .unwrap();
        assert_eq!(
            (r.status, r.content_type.as_str(), &r.body[..]),
            (200, "application/json", &b"{}"[..])
        );
        let r = parse_response(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, &r.body[..]), (404, &b"abcde"[..]));
        let r = parse_response(b"HTTP/1.1 200 OK\r\n\r\nto the end").unwrap();
        assert_eq!(r.body, b"to the end");
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort").is_err());
        assert!(parse_response(b"garbage").is_err());
    }
}
