//! Cluster API's side of the wire, emulated for the demo, the tests and the benchmark: an
//! HTTPS client that calls an extension exactly as CAPI's Go client does (POST, the path
//! plus `?timeout=10s`, no Content-Type, Go's default headers, compact JSON, ALPN offering
//! `h2` and `http/1.1`, one kept-alive connection), and a throwaway PKI for the updater's
//! serving certificate, the agents' server certificates and the updater's client
//! certificate. Not used by `serve`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::deadlines::GO_CLIENT_IDLE;
use super::hooks::Hook;
use inplace_api::pki::DEFAULT_UPDATER_IDENTITY;

/// A CA that signs the certificates of a demo or test setup, kept in a directory.
pub struct Pki {
    /// Where the files are.
    pub dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    key_pem: String,
}

/// A certificate and key on disk.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// PEM certificate.
    pub cert: PathBuf,
    /// PEM key.
    pub key: PathBuf,
}

impl Pki {
    /// A new CA in `dir` (`ca.crt`).
    pub fn new(dir: &Path) -> anyhow::Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "inplace-updater demo CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        std::fs::write(dir.join("ca.crt"), cert.pem())?;
        Ok(Pki {
            dir: dir.to_path_buf(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate file.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    fn leaf(&self, name: &str, mut params: CertificateParams) -> anyhow::Result<CertFiles> {
        let key = KeyPair::generate()?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer)?;
        let files = CertFiles {
            cert: self.dir.join(format!("{name}.crt")),
            key: self.dir.join(format!("{name}.key")),
        };
        std::fs::write(&files.cert, cert.pem())?;
        std::fs::write(&files.key, key.serialize_pem())?;
        Ok(files)
    }

    /// The CA's private key (PEM): for a test or demo that puts this CA where Cluster API
    /// keeps a workload cluster's (the `<cluster>-ca` Secret's `tls.key`).
    pub fn ca_key_pem(&self) -> &str {
        &self.key_pem
    }

    /// A server certificate for `names` (DNS names or IP addresses), saved as `<file>.crt`.
    pub fn server(&self, file: &str, names: &[&str]) -> anyhow::Result<CertFiles> {
        self.server_with_uris(file, names, &[])
    }

    /// [`Pki::server`] with URI SANs too: an agent bound to its workload cluster carries
    /// `inplace_api::pki::cluster_identity(namespace, name)`.
    pub fn server_with_uris(
        &self,
        file: &str,
        names: &[&str],
        uris: &[&str],
    ) -> anyhow::Result<CertFiles> {
        let mut params =
            CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())?;
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into()?));
        }
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or(file));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.leaf(file, params)
    }

    /// The updater's client certificate for the agents (`spiffe://inplace-agent/updater`).
    pub fn updater_client(&self) -> anyhow::Result<CertFiles> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "inplace-updater");
        params.subject_alt_names = vec![SanType::URI(DEFAULT_UPDATER_IDENTITY.try_into()?)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.leaf("updater-client", params)
    }
}

/// The response CAPI would read.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// HTTP status code.
    pub status: u16,
    /// Header lines, lowercased names.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The body as JSON (Null when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// An HTTPS client that calls like CAPI's runtime client, Go's `http.Transport`: one
/// connection kept alive between calls and dropped after [`GO_CLIENT_IDLE`] unused; a pooled
/// connection the server has already closed is noticed before it is used (Go's read loop
/// sees the close) and replaced; a call whose request was sent on a connection that then
/// closes fails (`EOF`), not retried, as Go does for a POST.
pub struct CapiClient {
    addr: SocketAddr,
    host: String,
    config: Arc<rustls::ClientConfig>,
    conn: Option<(TlsStream<TcpStream>, Instant)>,
    idle_timeout: Duration,
    connections: usize,
    registry: Option<super::standin::ApiStandin>,
}

impl CapiClient {
    /// A client of the extension at `addr` whose certificate chains to `ca` and names
    /// `host` (what CAPI puts in the URL, e.g. `inplace-updater.inplace-system.svc`).
    pub fn new(addr: SocketAddr, host: &str, ca: &Path) -> anyhow::Result<CapiClient> {
        CapiClient::with_versions(
            addr,
            host,
            ca,
            &[&rustls::version::TLS13, &rustls::version::TLS12],
        )
    }

    /// The same, offering only `versions` of TLS.
    pub fn with_versions(
        addr: SocketAddr,
        host: &str,
        ca: &Path,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> anyhow::Result<CapiClient> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in inplace_api::tls::load_certificates(ca)? {
            roots.add(cert).context("add the CA")?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // Go's transport offers both; the extension picks.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(CapiClient {
            addr,
            host: host.to_owned(),
            config: Arc::new(config),
            conn: None,
            idle_timeout: GO_CLIENT_IDLE,
            connections: 0,
            registry: None,
        })
    }

    /// The same client with a pool that drops a connection unused for `idle` (Go's
    /// `IdleConnTimeout`).
    pub fn with_idle_timeout(mut self, idle: Duration) -> CapiClient {
        self.idle_timeout = idle;
        self
    }

    /// The same client with the updater's ExtensionConfig in `api`: before each hook call,
    /// the ExtensionConfig [`DEFAULT_NAME`](super::edge::extension_config::DEFAULT_NAME)
    /// (every namespace) is given the request's `settings`, as if an administrator had set
    /// them and Cluster API sent them, so a test that is not about settings names them in its
    /// request alone. A test about forged settings uses a client without it.
    pub fn registering_in(mut self, api: &super::standin::ApiStandin) -> CapiClient {
        self.registry = Some(api.clone());
        self
    }

    /// How many connections this client has opened for its calls.
    pub fn connections(&self) -> usize {
        self.connections
    }

    /// A new TLS connection (for writing raw requests).
    pub async fn connect(&self) -> anyhow::Result<TlsStream<TcpStream>> {
        let tcp = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(self.addr))
            .await
            .context("connect timed out")??;
        tcp.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::try_from(self.host.clone())?;
        let tls = tokio::time::timeout(
            Duration::from_secs(10),
            tokio_rustls::TlsConnector::from(self.config.clone()).connect(name, tcp),
        )
        .await
        .context("tls handshake timed out")??;
        Ok(tls)
    }

    /// The negotiated TLS version, ALPN protocol and server certificate (DER) of a fresh
    /// connection.
    pub async fn handshake(&self) -> anyhow::Result<(String, Option<String>, Vec<u8>)> {
        let tls = self.connect().await?;
        let (_, session) = tls.get_ref();
        Ok((
            session
                .protocol_version()
                .map(|v| format!("{v:?}"))
                .unwrap_or_default(),
            session
                .alpn_protocol()
                .map(|p| String::from_utf8_lossy(p).into_owned()),
            session
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.to_vec())
                .unwrap_or_default(),
        ))
    }

    /// Calls `hook` with `body` (what `json.Marshal` of the request produced).
    pub async fn call(&mut self, hook: Hook, body: &[u8]) -> anyhow::Result<HttpResponse> {
        if let Some(api) = &self.registry
            && hook != Hook::Discovery
        {
            let settings = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("settings").cloned())
                .unwrap_or_else(|| serde_json::json!({}));
            api.put(super::standin::extension_config(
                super::edge::extension_config::DEFAULT_NAME,
                settings,
                serde_json::Value::Null,
            ));
        }
        let path = format!("{}?timeout=10s", hook.path());
        self.request("POST", &path, body).await
    }

    /// Any request, with Go's default headers and no Content-Type.
    pub async fn request(
        &mut self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
    ) -> anyhow::Result<HttpResponse> {
        let head = format!(
            "{method} {path_and_query} HTTP/1.1\r\nHost: {}:443\r\nUser-Agent: Go-http-client/1.1\r\n\
             Content-Length: {}\r\nAccept-Encoding: gzip\r\n\r\n",
            self.host,
            body.len()
        );
        let pooled = match self.conn.take() {
            Some((conn, since)) if since.elapsed() < self.idle_timeout => Some(conn),
            _ => None,
        };
        let reused = match pooled {
            Some(mut conn) => still_open(&mut conn).await.then_some(conn),
            None => None,
        };
        let mut conn = match reused {
            Some(conn) => conn,
            None => {
                self.connections += 1;
                self.connect().await?
            }
        };
        let sent = async {
            conn.write_all(head.as_bytes()).await?;
            conn.write_all(body).await?;
            conn.flush().await?;
            read_response(&mut conn).await
        };
        match tokio::time::timeout(Duration::from_secs(30), sent).await {
            Ok(Ok(response)) => {
                if response.header("connection") != Some("close") {
                    self.conn = Some((conn, Instant::now()));
                }
                Ok(response)
            }
            Ok(Err(e)) => Err(e.context(format!(
                "{method} {path_and_query}: the connection closed after the request was sent"
            ))),
            Err(_) => anyhow::bail!("{method} {path_and_query}: no response within 30 s"),
        }
    }
}

/// Whether a pooled connection is still open: nothing to read and no end seen (what Go's
/// read loop of an idle connection would have noticed).
async fn still_open(conn: &mut TlsStream<TcpStream>) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_millis(1), conn.read(&mut byte)).await,
        Err(_elapsed)
    )
}

/// Reads one HTTP/1.1 response with a Content-Length body.
pub async fn read_response<S: tokio::io::AsyncRead + Unpin>(
    conn: &mut S,
) -> anyhow::Result<HttpResponse> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            anyhow::bail!("connection closed before a response");
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 64 * 1024 {
            anyhow::bail!("response head larger than 64 KiB");
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .context("bad status line")?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < length {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            anyhow::bail!("connection closed in the body");
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}
