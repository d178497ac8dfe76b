//! A minimal HTTPS GET for the control-plane gate: one request to one of the node's own
//! listeners (the local API server), the server verified against a CA the caller read from
//! the node (`/etc/kubernetes/pki/ca.crt`) under a name the caller gives, an optional client
//! certificate (the kubelet's), `Connection: close`, a hard deadline, and a bounded body.
//!
//! HTTP/1.1 with `Content-Length`, chunked or close-delimited bodies (a Go server chunks a
//! body of unknown length even when the connection closes after it).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

/// What a GET returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpsReply {
    /// Status code.
    pub status: u16,
    /// The body, at most the caller's limit.
    pub body: Vec<u8>,
}

/// A client identity: certificate chain and key (PEM parsed).
pub struct ClientIdentity {
    /// The chain, leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The key.
    pub key: PrivateKeyDer<'static>,
}

/// A TLS client configuration trusting only the certificates in `ca_pem`, presenting
/// `identity` when given. `origin` names where the CA came from, for errors.
pub fn client(
    ca_pem: &[u8],
    origin: &str,
    identity: Option<ClientIdentity>,
) -> Result<Arc<ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(ca_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{origin}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{origin}: holds no certificate"));
    }
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!("{origin}: no certificate usable as a trust anchor"));
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("tls: {e}"))?
            .with_root_certificates(roots);
    let config = match identity {
        Some(id) => builder
            .with_client_auth_cert(id.chain, id.key)
            .map_err(|e| format!("client certificate: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// GETs `https://<addr><path>` (`addr` is `host:port`), verifying the server as
/// `server_name`, within `timeout`, keeping at most `max_body` bytes of the body (a longer
/// body is an error: the caller's parse would see a cut document).
pub fn get(
    config: &Arc<ClientConfig>,
    addr: &str,
    server_name: &str,
    path: &str,
    timeout: Duration,
    max_body: usize,
) -> Result<HttpsReply, String> {
    let deadline = Instant::now() + timeout;
    let url = format!("https://{addr}{path}");
    let name = ServerName::try_from(server_name.to_owned())
        .map_err(|e| format!("{url}: server name {server_name:?}: {e}"))?;
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| format!("{url}: resolve {addr}: {e}"))?
        .collect();
    let mut last = format!("{url}: resolve {addr}: no addresses");
    let mut stream = None;
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = format!("{url}: connect {a}: {e}"),
        }
    }
    let tcp = stream.ok_or(last)?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    tcp.set_read_timeout(Some(left))
        .and_then(|()| tcp.set_write_timeout(Some(left)))
        .map_err(|e| format!("{url}: {e}"))?;
    let conn =
        ClientConnection::new(config.clone(), name).map_err(|e| format!("{url}: tls: {e}"))?;
    let mut tls = StreamOwned::new(conn, tcp);
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: inplace-agent/{}\r\n\
         Accept: application/json, */*\r\nConnection: close\r\n\r\n",
        env!("CARGO_PKG_VERSION")
    );
    tls.write_all(request.as_bytes())
        .and_then(|()| tls.flush())
        .map_err(|e| format!("{url}: {e}"))?;
    // Head and body together may not exceed the body limit plus a head of 16 KiB.
    let cap = max_body + 16 * 1024;
    let mut raw = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    loop {
        if Instant::now() >= deadline {
            return Err(format!("{url}: no complete answer within {timeout:?}"));
        }
        match tls.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                raw.extend_from_slice(&chunk[..n]);
                if raw.len() > cap {
                    return Err(format!("{url}: answer longer than {cap} bytes"));
                }
            }
            // A server that closes without close_notify after a complete answer.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => break,
            Err(e) => return Err(format!("{url}: {e}")),
        }
    }
    parse_reply(&raw, max_body).map_err(|e| format!("{url}: {e}"))
}

/// Splits an HTTP/1.1 answer into status and body, decoding a chunked body (pure).
pub fn parse_reply(raw: &[u8], max_body: usize) -> Result<HttpsReply, String> {
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the answer has no complete head")?;
    let head = String::from_utf8_lossy(&raw[..head_end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|_| status_line.starts_with("HTTP/"))
        .ok_or_else(|| format!("not an HTTP answer: {:?}", truncate(status_line, 80)))?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if k.eq_ignore_ascii_case("content-length") {
            length = v.parse::<usize>().ok();
        }
    }
    let rest = &raw[head_end + 4..];
    let body = if chunked {
        dechunk(rest, max_body)?
    } else if let Some(n) = length {
        if n > max_body {
            return Err(format!("body of {n} bytes, more than {max_body}"));
        }
        rest.get(..n)
            .ok_or_else(|| format!("body cut short ({} of {n} bytes)", rest.len()))?
            .to_vec()
    } else {
        if rest.len() > max_body {
            return Err(format!("body longer than {max_body} bytes"));
        }
        rest.to_vec()
    };
    Ok(HttpsReply { status, body })
}

fn dechunk(mut rest: &[u8], max_body: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("chunked body cut short")?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("bad chunk size {:?}", truncate(size_text, 20)))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if out.len() + size > max_body {
            return Err(format!("body longer than {max_body} bytes"));
        }
        let data = rest.get(..size).ok_or("chunked body cut short")?;
        out.extend_from_slice(data);
        rest = rest.get(size + 2..).ok_or("chunked body cut short")?;
    }
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_split_and_dechunked() {
        let r = parse_reply(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 10).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"ok"[..]));
        let r = parse_reply(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x\r\nde\r\n0\r\n\r\n",
            10,
        )
        .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (503, &b"abcde"[..]));
        let r = parse_reply(b"HTTP/1.1 200 OK\r\n\r\nuntil close", 20).unwrap();
        assert_eq!(r.body, b"until close");
        assert!(parse_reply(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nx", 10).is_err());
        assert!(
            parse_reply(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nff\r\nab",
                10
            )
            .is_err()
        );
        assert!(parse_reply(b"SSH-2.0\r\n\r\n", 10).is_err());
    }
}
