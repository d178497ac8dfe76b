//! A minimal HTTP/1.1 GET over plain TCP for health gates such as the kubelet's
//! `http://127.0.0.1:10248/healthz`: one request, `Connection: close`, a hard deadline, and
//! only the status line and a bounded body read.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// What a GET returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpReply {
    /// Status code.
    pub status: u16,
    /// The start of the body (at most 512 bytes), lossily decoded.
    pub body: String,
}

/// Splits `http://host[:port]/path` into (host, port, path).
pub fn split_http_url(url: &str) -> Result<(String, u16, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// is supported here"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, tail) = v6
            .split_once(']')
            .ok_or_else(|| format!("{url}: bad IPv6 address"))?;
        let port = tail.strip_prefix(':').unwrap_or("80");
        (h.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), p),
            None => (authority.to_string(), "80"),
        }
    };
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{url}: bad port {port:?}"))?;
    Ok((host, port, path.to_string()))
}

/// Performs one GET with an overall deadline.
pub fn get(url: &str, timeout: Duration) -> Result<HttpReply, String> {
    let deadline = Instant::now() + timeout;
    let (host, port, path) = split_http_url(url)?;
    let addrs: Vec<_> = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("resolve {host}: {e}"))?
        .collect();
    let mut last_err = format!("resolve {host}: no addresses");
    let mut stream = None;
    for addr in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last_err = format!("connect {addr}: {e}"),
        }
    }
    let mut stream = stream.ok_or(last_err)?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(left))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(left))
        .map_err(|e| e.to_string())?;
    let host_header = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: inplace-agent/{}\r\n\
         Accept: */*\r\nConnection: close\r\n\r\n",
        env!("CARGO_PKG_VERSION")
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("send request to {url}: {e}"))?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if buf.len() > 8192 {
                    break;
                }
            }
            Err(e) if buf.is_empty() => return Err(format!("read reply from {url}: {e}")),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let status_line = text.lines().next().unwrap_or("");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|_| status_line.starts_with("HTTP/"))
        .ok_or_else(|| format!("{url} did not answer with HTTP: {status_line:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.chars().take(512).collect())
        .unwrap_or_default();
    Ok(HttpReply { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn splits_urls() {
        assert_eq!(
            split_http_url("http://127.0.0.1:10248/healthz").unwrap(),
            ("127.0.0.1".into(), 10248, "/healthz".into())
        );
        assert_eq!(
            split_http_url("http://[::1]:80").unwrap(),
            ("::1".into(), 80, "/".into())
        );
        assert!(split_http_url("https://x/").is_err());
    }

    #[test]
    fn reads_status_and_body() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut req = [0u8; 1024];
            let n = s.read(&mut req).unwrap();
            assert!(String::from_utf8_lossy(&req[..n]).starts_with("GET /healthz HTTP/1.1"));
            s.write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nbad!")
                .unwrap();
        });
        let reply = get(
            &format!("http://127.0.0.1:{port}/healthz"),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(reply.status, 500);
        assert_eq!(reply.body, "bad!");
        server.join().unwrap();
    }

    #[test]
    fn refused_connections_say_where() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let err = get(&format!("http://127.0.0.1:{port}/"), Duration::from_secs(2)).unwrap_err();
        assert!(
            err.starts_with(&format!("connect 127.0.0.1:{port}:")),
            "{err}"
        );
    }
}
