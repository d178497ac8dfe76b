//! Mutual TLS for the gRPC listener and for clients of it.
//!
//! Server side: TLS 1.3 only, a client certificate is required, must chain to the
//! configured CA bundle (rustls' `WebPkiClientVerifier`) and its leaf must carry the
//! clientAuth extended key usage — checked here because webpki accepts a leaf that has no
//! EKU extension at all. A certificate that fails any of this fails the handshake.
//!
//! The certificate, key and CA bundle are re-read when their files change (cert-manager
//! rotates them in place): [`ReloadingServerConfig::current`] stats the three files before
//! every handshake and, when anything changed, builds a complete new `ServerConfig`. Each
//! connection uses the config that was current when it was accepted, so server certificate
//! and CA always change together and the listener never restarts. New material that does
//! not load (unreadable, mismatched key and certificate, half-written file) is logged and
//! the previous config kept until the files change again.
//!
//! Session resumption is disabled so every connection verifies the full client chain at
//! that moment: a certificate that has expired since, or whose CA was rotated out, cannot
//! ride on an earlier session. (Connections already open are bounded by the server's
//! maximum connection age, see `server::ServeOptions`.)
//!
//! [`tls_incoming`] turns a `TcpListener` into the stream of authenticated connections that
//! `tonic`'s `serve_with_incoming` takes; each connection carries [`TlsConnectInfo`] (peer
//! address, certificate and [`Identity`]) into the request extensions.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use super::identity::{Identity, identity_from_certificate};
use super::readahead::ReadAhead;

/// Upper bound for TCP connect plus TLS handshake of a client connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// ALPN protocol id of HTTP/2, required by gRPC clients (grpc-go refuses TLS without it).
const ALPN_H2: &[u8] = b"h2";

// === Paths and errors ===

/// Where the server's TLS material lives (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsPaths {
    /// Server certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key of the leaf (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA bundle that client certificates must chain to.
    pub client_ca: PathBuf,
}

impl ServerTlsPaths {
    /// The conventional file names in one directory: `server.crt`, `server.key`, `ca.crt`.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            cert: dir.join("server.crt"),
            key: dir.join("server.key"),
            client_ca: dir.join("ca.crt"),
        }
    }
}

/// Where a client's TLS material lives (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTlsPaths {
    /// CA bundle that the server certificate must chain to.
    pub ca: PathBuf,
    /// Client certificate chain, leaf first (must carry the clientAuth EKU).
    pub cert: PathBuf,
    /// Private key of the leaf.
    pub key: PathBuf,
}

/// Loading TLS material or building a TLS configuration failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A file is not valid PEM of the expected kind.
    #[error("parse {}: {detail}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A certificate file holds no certificate.
    #[error("{}: no certificate found: {found}", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
        /// What the file holds instead ([`what_it_holds`]).
        found: String,
    },
    /// The CA bundle holds no certificate usable as a trust anchor.
    #[error("{}: no usable CA certificate: {detail}", path.display())]
    NoTrustAnchor {
        /// The file.
        path: PathBuf,
        /// Why the certificates were rejected.
        detail: String,
    },
    /// rustls refused the material (e.g. the key does not match the certificate).
    #[error("{context}: {source}")]
    Rustls {
        /// What was being built.
        context: &'static str,
        /// The underlying error.
        source: rustls::Error,
    },
    /// The client certificate verifier could not be built.
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Reads every certificate of a PEM file; at least one is required.
pub fn load_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read_file(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Parse {
            path: path.to_owned(),
            detail: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
            found: what_it_holds(&pem),
        });
    }
    Ok(certs)
}

/// What a file that should hold PEM certificates holds instead, in words (never its content
/// beyond a PEM label or the manifests' placeholder word).
pub fn what_it_holds(text: &[u8]) -> String {
    let text = String::from_utf8_lossy(text);
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return "the file is empty".into();
    }
    if trimmed.starts_with("REPLACE") {
        return "it still holds the placeholder of the manifests (\"REPLACE: ...\"); put the \
                PEM certificate there"
            .into();
    }
    if let Some(label) = trimmed
        .lines()
        .find_map(|l| l.trim().strip_prefix("-----BEGIN "))
        .and_then(|l| l.strip_suffix("-----"))
    {
        return format!("it holds PEM of another kind ({label}), not a CERTIFICATE");
    }
    "it is not PEM (no -----BEGIN CERTIFICATE----- line)".into()
}

/// Reads the first private key of a PEM file.
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read_file(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Parse {
        path: path.to_owned(),
        detail: e.to_string(),
    })
}

fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(load_certificates(path)?);
    if added == 0 {
        return Err(TlsError::NoTrustAnchor {
            path: path.to_owned(),
            detail: format!("{ignored} certificate(s), none parsable as a trust anchor"),
        });
    }
    Ok(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

// === Server configuration ===

/// Builds the server configuration from the files once (no reloading); see
/// [`ReloadingServerConfig`] for the reloading variant the listener uses.
pub fn server_config(paths: &ServerTlsPaths) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let roots = load_roots(&paths.client_ca)?;
    let webpki =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    let verifier = Arc::new(RequireClientAuthEku { inner: webpki });
    let chain = load_certificates(&paths.cert)?;
    let key = load_private_key(&paths.key)?;

    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| TlsError::Rustls {
            context: "server tls versions",
            source,
        })?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Rustls {
            context: "server certificate and key",
            source,
        })?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    // No resumption: every connection verifies the client chain against the current CA.
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(config)
}

/// Wraps the webpki verifier and additionally requires the clientAuth EKU on the leaf.
#[derive(Debug)]
struct RequireClientAuthEku {
    inner: Arc<dyn ClientCertVerifier>,
}

/// True when the certificate has an extended key usage extension that lists clientAuth.
/// `anyExtendedKeyUsage` alone does not count.
fn has_client_auth_eku(der: &[u8]) -> bool {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    matches!(cert.extended_key_usage(), Ok(Some(eku)) if eku.value.client_auth)
}

impl ClientCertVerifier for RequireClientAuthEku {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if !has_client_auth_eku(end_entity) {
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::InvalidPurpose,
            ));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Identity of a file's current version: device, inode, size and modification time. A
/// Kubernetes Secret volume swaps a symlink, which changes the inode; an in-place rewrite
/// changes size or mtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

/// Stamps of the three files; `None` for a file that cannot be stat'ed.
type MaterialStamp = [Option<FileStamp>; 3];

fn stamp_of(path: &Path) -> Option<FileStamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some(FileStamp {
        dev: meta.dev(),
        ino: meta.ino(),
        len: meta.len(),
        mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
    })
}

fn material_stamp(paths: &ServerTlsPaths) -> MaterialStamp {
    [
        stamp_of(&paths.cert),
        stamp_of(&paths.key),
        stamp_of(&paths.client_ca),
    ]
}

struct Loaded {
    config: Arc<ServerConfig>,
    /// Stamp of the files `config` was built from.
    stamp: MaterialStamp,
    /// Stamp of files that failed to load, so they are not retried (and logged) on every
    /// handshake; cleared by any change.
    rejected: Option<MaterialStamp>,
}

/// The server's TLS configuration, rebuilt from its files whenever they change.
pub struct ReloadingServerConfig {
    paths: ServerTlsPaths,
    state: Mutex<Loaded>,
    counters: Arc<TlsCounters>,
}

impl fmt::Debug for ReloadingServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingServerConfig")
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

impl ReloadingServerConfig {
    /// Loads the material; fails if the initial files do not make a valid configuration.
    pub fn new(paths: ServerTlsPaths, counters: Arc<TlsCounters>) -> Result<Self, TlsError> {
        let stamp = material_stamp(&paths);
        let config = server_config(&paths)?;
        counters.note_server_cert(&paths.cert);
        Ok(Self {
            paths,
            state: Mutex::new(Loaded {
                config: Arc::new(config),
                stamp,
                rejected: None,
            }),
            counters,
        })
    }

    /// The files this configuration is built from.
    pub fn paths(&self) -> &ServerTlsPaths {
        &self.paths
    }

    /// The counters this configuration reports reloads and handshake failures to.
    pub fn counters(&self) -> &Arc<TlsCounters> {
        &self.counters
    }

    /// The configuration to use for a new connection: reloads first if any file changed
    /// since the last load attempt. Never fails; bad new material keeps the old config.
    pub fn current(&self) -> Arc<ServerConfig> {
        let stamp = material_stamp(&self.paths);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if stamp == state.stamp || state.rejected == Some(stamp) {
            return state.config.clone();
        }
        match server_config(&self.paths) {
            Ok(config) => {
                state.config = Arc::new(config);
                state.stamp = stamp;
                state.rejected = None;
                self.counters.reloads.fetch_add(1, Ordering::Relaxed);
                self.counters.note_server_cert(&self.paths.cert);
                tracing::info!(
                    cert = %self.paths.cert.display(),
                    client_ca = %self.paths.client_ca.display(),
                    "reloaded tls material"
                );
            }
            Err(error) => {
                state.rejected = Some(stamp);
                self.counters
                    .reload_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "new tls material rejected, keeping the previous one");
            }
        }
        state.config.clone()
    }
}

// === Counters ===

/// Why a TLS handshake failed; a bounded set usable as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandshakeFailure {
    /// The client sent no certificate.
    NoClientCertificate,
    /// The client certificate does not chain to the configured CA.
    UnknownIssuer,
    /// The client certificate (or a certificate in its chain) has expired.
    Expired,
    /// The client certificate is not valid yet.
    NotYetValid,
    /// The client certificate lacks the clientAuth extended key usage.
    WrongKeyUsage,
    /// Any other problem with the client certificate (bad signature, encoding, ...).
    BadCertificate,
    /// The client cannot speak TLS 1.3 or offers nothing in common with the server.
    Incompatible,
    /// The client aborted the handshake with an alert (e.g. it rejected our certificate).
    PeerAlert,
    /// The bytes received are not a TLS handshake (e.g. plain HTTP/2).
    Protocol,
    /// The handshake did not finish within the handshake timeout.
    Timeout,
    /// The connection failed or closed during the handshake.
    Io,
}

impl HandshakeFailure {
    /// Every value, in label order.
    pub const ALL: [HandshakeFailure; 11] = [
        Self::NoClientCertificate,
        Self::UnknownIssuer,
        Self::Expired,
        Self::NotYetValid,
        Self::WrongKeyUsage,
        Self::BadCertificate,
        Self::Incompatible,
        Self::PeerAlert,
        Self::Protocol,
        Self::Timeout,
        Self::Io,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoClientCertificate => "no_client_certificate",
            Self::UnknownIssuer => "unknown_issuer",
            Self::Expired => "expired",
            Self::NotYetValid => "not_yet_valid",
            Self::WrongKeyUsage => "wrong_key_usage",
            Self::BadCertificate => "bad_certificate",
            Self::Incompatible => "incompatible",
            Self::PeerAlert => "peer_alert",
            Self::Protocol => "protocol",
            Self::Timeout => "timeout",
            Self::Io => "io",
        }
    }

    fn index(self) -> usize {
        // Fieldless enum: the discriminant is the declaration order, which ALL follows.
        self as usize
    }

    /// Classifies the error `tokio-rustls` returned for a failed server handshake.
    pub fn classify(error: &io::Error) -> Self {
        let Some(tls) = error
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        else {
            return Self::Io;
        };
        match tls {
            rustls::Error::NoCertificatesPresented => Self::NoClientCertificate,
            rustls::Error::InvalidCertificate(cert) => match cert {
                CertificateError::UnknownIssuer => Self::UnknownIssuer,
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    Self::Expired
                }
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    Self::NotYetValid
                }
                CertificateError::InvalidPurpose
                | CertificateError::InvalidPurposeContext { .. } => Self::WrongKeyUsage,
                _ => Self::BadCertificate,
            },
            rustls::Error::PeerIncompatible(_) => Self::Incompatible,
            rustls::Error::AlertReceived(_) => Self::PeerAlert,
            _ => Self::Protocol,
        }
    }
}

impl fmt::Display for HandshakeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// TLS counters for the metrics module: handshakes, failures by reason, reloads and the
/// expiry of the server certificate in use.
#[derive(Debug, Default)]
pub struct TlsCounters {
    handshakes: AtomicU64,
    failures: [AtomicU64; HandshakeFailure::ALL.len()],
    reloads: AtomicU64,
    reload_failures: AtomicU64,
    /// notAfter of the server certificate last loaded, Unix seconds; 0 when unknown.
    server_cert_not_after: AtomicI64,
}

impl TlsCounters {
    /// Successful handshakes.
    pub fn handshakes(&self) -> u64 {
        self.handshakes.load(Ordering::Relaxed)
    }

    /// Failed handshakes for one reason.
    pub fn failures(&self, reason: HandshakeFailure) -> u64 {
        self.failures[reason.index()].load(Ordering::Relaxed)
    }

    /// Failed handshakes for every reason, in [`HandshakeFailure::ALL`] order.
    pub fn failures_by_reason(&self) -> Vec<(HandshakeFailure, u64)> {
        HandshakeFailure::ALL
            .iter()
            .map(|r| (*r, self.failures(*r)))
            .collect()
    }

    /// Successful reloads of changed TLS material (the initial load does not count).
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Changed TLS material that was rejected (the old material stayed in use).
    pub fn reload_failures(&self) -> u64 {
        self.reload_failures.load(Ordering::Relaxed)
    }

    /// Expiry (notAfter, Unix seconds) of the server certificate in use; `None` if unknown.
    pub fn server_cert_not_after(&self) -> Option<i64> {
        match self.server_cert_not_after.load(Ordering::Relaxed) {
            0 => None,
            t => Some(t),
        }
    }

    /// Counts one failed handshake.
    pub fn record_failure(&self, reason: HandshakeFailure) {
        self.failures[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    fn note_server_cert(&self, cert_path: &Path) {
        let not_after = std::fs::read(cert_path)
            .ok()
            .and_then(|pem| CertificateDer::pem_slice_iter(&pem).next()?.ok())
            .and_then(|der| {
                let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
                Some(cert.validity().not_after.timestamp())
            })
            .unwrap_or(0);
        self.server_cert_not_after
            .store(not_after, Ordering::Relaxed);
    }
}

// === Accepting connections ===

/// Connection facts handed to every request on the connection (as a request extension,
/// `request.extensions().get::<TlsConnectInfo>()`).
#[derive(Debug, Clone)]
pub struct TlsConnectInfo {
    /// The client's address.
    pub remote_addr: Option<SocketAddr>,
    /// The verified client leaf certificate.
    pub peer_certificate: Option<CertificateDer<'static>>,
    /// The client identity taken from the certificate; `None` if it has no usable name.
    pub identity: Option<Identity>,
}

/// An accepted, authenticated TLS connection, as yielded by [`tls_incoming`].
pub struct TlsConnection {
    stream: tokio_rustls::server::TlsStream<ReadAhead<TcpStream>>,
    info: TlsConnectInfo,
    /// Held for the life of the connection; bounds the number of open connections.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl fmt::Debug for TlsConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnection")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl Connected for TlsConnection {
    type ConnectInfo = TlsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Limits of the TLS accept loop.
#[derive(Debug, Clone, Copy)]
pub struct AcceptOptions {
    /// A handshake that takes longer is abandoned (and counted as a timeout).
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once; further connections wait in the listen backlog.
    pub max_pending_handshakes: usize,
    /// Established connections at once; further connections wait in the listen backlog.
    pub max_connections: usize,
}

impl Default for AcceptOptions {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            max_pending_handshakes: 64,
            max_connections: 256,
        }
    }
}

/// Accepts TCP connections, runs the TLS handshake of each on its own task and yields the
/// connections that completed it, ready for `tonic`'s `serve_with_incoming`. Failed
/// handshakes are counted by reason and logged with the peer address. The accept loop ends
/// when the returned stream is dropped. Must be called within a Tokio runtime.
pub fn tls_incoming(
    listener: TcpListener,
    tls: Arc<ReloadingServerConfig>,
    options: AcceptOptions,
) -> ReceiverStream<Result<TlsConnection, io::Error>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(accept_loop(listener, tls, options, tx));
    ReceiverStream::new(rx)
}

async fn accept_loop(
    listener: TcpListener,
    tls: Arc<ReloadingServerConfig>,
    options: AcceptOptions,
    tx: mpsc::Sender<Result<TlsConnection, io::Error>>,
) {
    let handshakes = Arc::new(Semaphore::new(options.max_pending_handshakes.max(1)));
    let connections = Arc::new(Semaphore::new(options.max_connections.max(1)));
    loop {
        let (connection_permit, handshake_permit) = tokio::select! {
            () = tx.closed() => return,
            permits = async {
                let c = connections.clone().acquire_owned().await;
                let h = handshakes.clone().acquire_owned().await;
                (c, h)
            } => match permits {
                (Ok(c), Ok(h)) => (c, h),
                _ => return,
            },
        };
        let accepted = tokio::select! {
            () = tx.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let (tcp, remote_addr) = match accepted {
            Ok(pair) => pair,
            Err(error) => {
                // EMFILE and friends: back off instead of spinning; the listener stays.
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let config = tls.current();
        let counters = tls.counters.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let _handshake_permit = handshake_permit;
            let deadline = tokio::time::Instant::now() + options.handshake_timeout;
            let timed_out = || {
                counters.record_failure(HandshakeFailure::Timeout);
                tracing::warn!(peer = %remote_addr, reason = %HandshakeFailure::Timeout, "tls handshake failed");
            };
            // A TCP probe (a kubelet tcpSocket probe, a load balancer's health check) connects
            // and closes without sending a byte: that is no failed handshake.
            let mut first = [0u8; 1];
            match tokio::time::timeout_at(deadline, tcp.peek(&mut first)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    tracing::debug!(peer = %remote_addr, "connection closed before any tls byte (a tcp probe?)");
                    return;
                }
                Ok(Ok(_)) => {}
                Err(_) => return timed_out(),
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(config);
            let accept = acceptor.accept(ReadAhead::new(tcp)).into_fallible();
            let stream = match tokio::time::timeout_at(deadline, accept).await {
                Ok(Ok(stream)) => stream,
                Ok(Err((error, tcp))) => {
                    let reason = HandshakeFailure::classify(&error);
                    counters.record_failure(reason);
                    tracing::warn!(peer = %remote_addr, %reason, %error, "tls handshake failed");
                    linger(tcp.into_inner()).await;
                    return;
                }
                Err(_) => return timed_out(),
            };
            counters.handshakes.fetch_add(1, Ordering::Relaxed);
            let peer_certificate = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|c| c.clone().into_owned());
            let identity = peer_certificate
                .as_ref()
                .and_then(|der| identity_from_certificate(der).ok());
            let info = TlsConnectInfo {
                remote_addr: Some(remote_addr),
                peer_certificate,
                identity,
            };
            let connection = TlsConnection {
                stream,
                info,
                _permit: connection_permit,
            };
            // The receiver is gone only when the server is shutting down.
            let _ = tx.send(Ok(connection)).await;
        });
    }
}

/// How long a connection whose handshake failed is kept to let the client read the alert.
const LINGER: Duration = Duration::from_secs(1);

/// Closes a connection whose handshake failed so that the client reads the alert that says
/// why: the write side first, then what the client still sends is read and dropped (for at
/// most [`LINGER`]). Closing at once with unread bytes would send a reset, and the client
/// would see "broken pipe" instead of "bad certificate".
async fn linger(mut tcp: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.shutdown().await;
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(n) = tcp.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

// === Client side ===

/// Builds a client configuration: TLS 1.3, HTTP/2 ALPN, server verified against the CA
/// bundle, client certificate presented. For the `submit` CLI and tests.
pub fn client_config(paths: &ClientTlsPaths) -> Result<ClientConfig, TlsError> {
    client_config_requiring(paths, None)
}

/// Like [`client_config`], and when `required_uri` is given the agent's certificate must
/// also carry that URI SAN ([`crate::pki::cluster_identity`]: the agent is bound to the
/// workload cluster the caller means), checked after the chain and the name.
pub fn client_config_requiring(
    paths: &ClientTlsPaths,
    required_uri: Option<&str>,
) -> Result<ClientConfig, TlsError> {
    let roots = load_roots(&paths.ca)?;
    client_config_with_roots(roots, &paths.cert, &paths.key, required_uri)
}

/// Like [`client_config`], but the agent's certificate must chain to the CA certificates
/// in `ca_pem` (PEM held elsewhere than in a file: a workload cluster's `<cluster>-ca`
/// Secret); `origin` names where they came from in errors.
pub fn client_config_trusting(
    ca_pem: &[u8],
    origin: &str,
    cert: &Path,
    key: &Path,
) -> Result<ClientConfig, TlsError> {
    let path = PathBuf::from(origin);
    let certs = CertificateDer::pem_slice_iter(ca_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Parse {
            path: path.clone(),
            detail: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path,
            found: what_it_holds(ca_pem),
        });
    }
    let mut roots = RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(TlsError::NoTrustAnchor {
            path,
            detail: format!("{ignored} certificate(s), none parsable as a trust anchor"),
        });
    }
    client_config_with_roots(roots, cert, key, None)
}

/// Like [`client_config_trusting`], with the one CA certificate `ca` (DER) already parsed
/// and checked by the caller; `required_uri` as in [`client_config_requiring`].
pub fn client_config_trusting_der(
    ca: &CertificateDer<'_>,
    origin: &str,
    cert: &Path,
    key: &Path,
    required_uri: Option<&str>,
) -> Result<ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(ca.clone().into_owned())
        .map_err(|e| TlsError::NoTrustAnchor {
            path: PathBuf::from(origin),
            detail: e.to_string(),
        })?;
    client_config_with_roots(roots, cert, key, required_uri)
}

fn client_config_with_roots(
    roots: RootCertStore,
    cert: &Path,
    key: &Path,
    required_uri: Option<&str>,
) -> Result<ClientConfig, TlsError> {
    let chain = load_certificates(cert)?;
    let key = load_private_key(key)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| TlsError::Rustls {
            context: "client tls versions",
            source,
        })?;
    let builder = match required_uri {
        None => builder.with_root_certificates(roots),
        Some(uri) => {
            let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()
            .map_err(|e| TlsError::NoTrustAnchor {
                path: PathBuf::from("the agents' CA"),
                detail: e.to_string(),
            })?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ClusterBoundVerifier {
                    inner,
                    required: uri.to_owned(),
                }))
        }
    };
    let mut config = builder
        .with_client_auth_cert(chain, key)
        .map_err(|source| TlsError::Rustls {
            context: "client certificate and key",
            source,
        })?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(config)
}

/// The agent's certificate chains to the CA and names the node but does not carry the URI
/// SAN the client requires (it is not bound to the cluster the client means).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the agent's certificate does not carry the URI SAN {required}")]
pub struct NotBoundToCluster {
    /// The URI SAN required.
    pub required: String,
    /// The URI SANs the certificate has.
    pub presented: Vec<String>,
}

/// Verifies an agent's certificate as webpki does (chain, validity, serverAuth, the node's
/// name) and then requires one URI SAN: the identity that binds the agent to its cluster.
#[derive(Debug)]
struct ClusterBoundVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    required: String,
}

/// The URI SANs of a certificate (none when it does not parse: the chain check that comes
/// first has refused such a certificate already).
fn uri_sans(der: &[u8]) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    match cert.subject_alternative_name() {
        Ok(Some(ext)) => ext
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::URI(u) => Some((*u).to_owned()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

impl rustls::client::danger::ServerCertVerifier for ClusterBoundVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        let presented = uri_sans(end_entity.as_ref());
        if presented.contains(&self.required) {
            return Ok(verified);
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            rustls::OtherError(Arc::new(NotBoundToCluster {
                required: self.required.clone(),
                presented,
            })),
        )))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Connecting a client channel failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The target is not `https://host:port` (or `host:port`).
    #[error("invalid target {target:?}: {detail}")]
    Target {
        /// The target as given.
        target: String,
        /// What is wrong.
        detail: String,
    },
    /// The server name to verify is not a valid DNS name or IP address.
    #[error("invalid server name {0:?}")]
    ServerName(String),
    /// The TCP connection, TLS handshake or HTTP/2 setup failed. Displayed with its whole
    /// cause chain ("connect 10.0.0.5:9443: tcp connect error: Connection refused").
    #[error("connect {target}: {}", diagnose(source).chain())]
    Transport {
        /// The target as given.
        target: String,
        /// The underlying error.
        source: tonic::transport::Error,
    },
}

impl ConnectError {
    /// What went wrong, when it is one of the problems a person can fix.
    pub fn problem(&self) -> Option<ConnectProblem> {
        match self {
            ConnectError::Transport { source, .. } => diagnose(source).problem,
            _ => None,
        }
    }
}

// === Why a connection failed ===

/// A connection problem a person can act on, found in an error's cause chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectProblem {
    /// Nothing accepts connections at the address.
    Refused,
    /// Connecting or the handshake took too long.
    TimedOut,
    /// The agent's certificate is not valid for the name the client verifies.
    WrongName {
        /// The name verified.
        expected: String,
        /// The names the certificate has.
        presented: Vec<String>,
    },
    /// The agent's certificate does not chain to a CA the client trusts.
    UnknownIssuer,
    /// A trusted CA has the issuer's name but did not sign the certificate (another PKI with
    /// the same CA name, or a CA made again).
    BadSignature,
    /// The agent's certificate has expired.
    Expired {
        /// Its notAfter (Unix seconds), when known.
        not_after: Option<u64>,
    },
    /// The agent's certificate is not valid yet (a clock is wrong).
    NotYetValid {
        /// Its notBefore (Unix seconds), when known.
        not_before: Option<u64>,
    },
    /// The agent's certificate is not one for a server (no serverAuth usage).
    WrongKeyUsage,
    /// The agent's certificate chains to the CA and names the node, but lacks the URI SAN
    /// that binds it to the workload cluster the client means ([`NotBoundToCluster`]).
    NotBoundToCluster {
        /// The URI SAN required.
        required: String,
        /// The URI SANs the certificate has.
        presented: Vec<String>,
    },
    /// The agent ended the handshake with this alert: it did not accept the client's
    /// certificate (its log says why).
    RefusedByPeer(String),
    /// The server does not speak TLS (or not TLS 1.3 with HTTP/2).
    NotTls,
    /// The agent closed the connection at once (reset, broken pipe): most likely it did not
    /// accept the client's certificate, and the alert saying so was lost.
    Closed,
}

impl ConnectProblem {
    /// The agent's certificate itself was refused (issuer, signature, name, validity, usage):
    /// which CA or name was verified is worth saying.
    pub fn is_certificate(&self) -> bool {
        matches!(
            self,
            ConnectProblem::WrongName { .. }
                | ConnectProblem::UnknownIssuer
                | ConnectProblem::BadSignature
                | ConnectProblem::Expired { .. }
                | ConnectProblem::NotYetValid { .. }
                | ConnectProblem::WrongKeyUsage
                | ConnectProblem::NotBoundToCluster { .. }
        )
    }

    /// What it is, in words, for the place in the cause chain where it was found; `None`
    /// keeps the error's own words (refused, timed out).
    fn describe(&self) -> Option<String> {
        let when = |secs: &Option<u64>| {
            secs.map(|s| {
                format!(
                    " at {}",
                    inplace_base::time::rfc3339(s.saturating_mul(1000))
                )
            })
            .unwrap_or_default()
        };
        Some(match self {
            ConnectProblem::Refused | ConnectProblem::TimedOut | ConnectProblem::Closed => {
                return None;
            }
            ConnectProblem::WrongName {
                expected,
                presented,
            } => {
                let names = if presented.is_empty() {
                    "no names at all".to_string()
                } else {
                    presented.join(", ")
                };
                if expected.is_empty() {
                    format!(
                        "the agent's certificate is not valid for the name verified: it names {names}"
                    )
                } else {
                    format!(
                        "the agent's certificate is not valid for {expected:?}: it names {names}"
                    )
                }
            }
            ConnectProblem::UnknownIssuer => {
                "the agent's certificate is not signed by a CA this client trusts (unknown issuer)"
                    .to_string()
            }
            ConnectProblem::BadSignature => "the agent's certificate was not signed by the CA \
                 of that name this client trusts (bad signature): another PKI's CA, or one made \
                 again"
                .to_string(),
            ConnectProblem::Expired { not_after } => {
                format!("the agent's certificate expired{}", when(not_after))
            }
            ConnectProblem::NotYetValid { not_before } => format!(
                "the agent's certificate is not valid yet (from{}); is a clock wrong?",
                when(not_before)
            ),
            ConnectProblem::WrongKeyUsage => {
                "the agent's certificate is not one for a server (no serverAuth usage)".to_string()
            }
            ConnectProblem::NotBoundToCluster {
                required,
                presented,
            } => {
                let has = if presented.is_empty() {
                    "no URI SAN".to_string()
                } else {
                    format!("the URI SANs {}", presented.join(", "))
                };
                format!(
                    "the agent's certificate is not bound to this Machine's cluster: it must carry \
                     the URI SAN {required} and has {has}; issue the agent's certificate with it \
                     (docs/pki.md, \"An agent bound to its cluster\")"
                )
            }
            ConnectProblem::RefusedByPeer(alert) => format!(
                "the agent refused the TLS handshake (alert {alert}): it did not accept this \
                 client's certificate"
            ),
            ConnectProblem::NotTls => {
                "the server does not speak TLS 1.3 with HTTP/2: is this the agent's port?"
                    .to_string()
            }
        })
    }
}

/// An error's words without what is for a library's users, not for a person at a node: the
/// link to rustls' manual, its wording of an unexpected end of the connection.
fn plain_words(message: &str) -> String {
    let mut words = message.to_string();
    while let Some(at) = words.find(": https://docs.rs/") {
        let end = words[at + 2..]
            .find(' ')
            .map_or(words.len(), |e| at + 2 + e);
        words.replace_range(at..end, "");
    }
    words.replace(
        "peer closed connection without sending TLS close_notify",
        "the connection was closed",
    )
}

/// `test-node` for rustls' `DnsName("test-node")`, `127.0.0.1` for `IpAddress(127.0.0.1)`.
fn plain_name(presented: &str) -> String {
    let inner = presented
        .split_once('(')
        .and_then(|(_, rest)| rest.strip_suffix(')'))
        .unwrap_or(presented);
    inner.trim_matches('"').to_string()
}

/// The cause chain of an error and the problem found in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnosis {
    /// The messages of the chain, outermost first, without repeats and without the empty
    /// words of wrappers ("transport error").
    pub causes: Vec<String>,
    /// The actionable problem, when one was recognised.
    pub problem: Option<ConnectProblem>,
}

impl Diagnosis {
    /// The chain as one line: `a: b: c`.
    pub fn chain(&self) -> String {
        self.causes.join(": ")
    }
}

/// Messages of wrappers that say nothing by themselves.
const EMPTY_WORDS: &[&str] = &[
    "transport error",
    "client error (Connect)",
    "error trying to connect",
];

/// Walks the cause chain of a connection or call error (tonic, hyper, io, rustls) and
/// recognises the problems a person can fix: refused, timed out, certificate name, issuer,
/// validity, and a handshake the server refused.
pub fn diagnose(error: &(dyn std::error::Error + 'static)) -> Diagnosis {
    let mut messages: Vec<String> = Vec::new();
    // The problem, the raw message of the error it was found in, and where that was.
    let mut found: Option<(ConnectProblem, String, usize)> = None;
    let mut current = Some(error);
    while let Some(e) = current {
        let message = match e.downcast_ref::<tonic::Status>() {
            Some(status) => status.message().to_string(),
            None => e.to_string(),
        };
        let message = plain_words(message.trim());
        if found.is_none()
            && let Some(problem) = recognise(e)
        {
            found = Some((problem, message.clone(), messages.len()));
        }
        messages.push(message);
        current = e.source();
    }
    // Wrappers repeat their cause in their own message ("tcp connect error: Connection
    // refused", then "Connection refused"): keep the most specific words once.
    let mut causes: Vec<String> = Vec::new();
    for (i, message) in messages.into_iter().enumerate() {
        let message = match &found {
            Some((problem, raw, at)) if i == *at || (i > *at && message.contains(raw.as_str())) => {
                match problem.describe() {
                    Some(words) => words,
                    None => message,
                }
            }
            Some((problem, raw, at))
                if i < *at && problem.describe().is_some() && message.contains(raw.as_str()) =>
            {
                // An outer wrapper of the recognised error: its words follow.
                let rest = message.replace(raw.as_str(), "");
                rest.trim_end_matches([':', ' ']).to_string()
            }
            _ => message,
        };
        if message.is_empty() || EMPTY_WORDS.contains(&message.as_str()) {
            continue;
        }
        if causes.iter().any(|c| c.contains(message.as_str())) {
            continue;
        }
        causes.retain(|c| !message.contains(c.as_str()));
        causes.push(message);
    }
    Diagnosis {
        causes,
        problem: found.map(|(p, _, _)| p),
    }
}

fn recognise(e: &(dyn std::error::Error + 'static)) -> Option<ConnectProblem> {
    if let Some(io) = e.downcast_ref::<io::Error>() {
        if let Some(inner) = io.get_ref()
            && let Some(tls) = inner.downcast_ref::<rustls::Error>()
        {
            return recognise_tls(tls);
        }
        match io.kind() {
            io::ErrorKind::ConnectionRefused => return Some(ConnectProblem::Refused),
            io::ErrorKind::TimedOut => return Some(ConnectProblem::TimedOut),
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                return Some(ConnectProblem::Closed);
            }
            _ => {}
        }
    }
    if let Some(tls) = e.downcast_ref::<rustls::Error>() {
        return recognise_tls(tls);
    }
    // Only words are left where h2 and tower kept them: an alert the peer sent, a timeout.
    let text = e.to_string();
    if let Some(alert) = text.strip_prefix("received fatal alert: ") {
        return Some(ConnectProblem::RefusedByPeer(alert.trim().to_string()));
    }
    if text.contains("broken pipe") || text.contains("connection reset") {
        return Some(ConnectProblem::Closed);
    }
    (text == "timed out" || text.ends_with("deadline has elapsed"))
        .then_some(ConnectProblem::TimedOut)
}

fn recognise_tls(e: &rustls::Error) -> Option<ConnectProblem> {
    Some(match e {
        rustls::Error::InvalidCertificate(cert) => match cert {
            CertificateError::NotValidForName => ConnectProblem::WrongName {
                expected: String::new(),
                presented: Vec::new(),
            },
            CertificateError::NotValidForNameContext {
                expected,
                presented,
            } => ConnectProblem::WrongName {
                expected: expected.to_str().into_owned(),
                presented: presented.iter().map(|n| plain_name(n)).collect(),
            },
            CertificateError::UnknownIssuer => ConnectProblem::UnknownIssuer,
            CertificateError::BadSignature => ConnectProblem::BadSignature,
            CertificateError::Expired => ConnectProblem::Expired { not_after: None },
            CertificateError::ExpiredContext { not_after, .. } => ConnectProblem::Expired {
                not_after: Some(not_after.as_secs()),
            },
            CertificateError::NotValidYet => ConnectProblem::NotYetValid { not_before: None },
            CertificateError::NotValidYetContext { not_before, .. } => {
                ConnectProblem::NotYetValid {
                    not_before: Some(not_before.as_secs()),
                }
            }
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
                ConnectProblem::WrongKeyUsage
            }
            CertificateError::Other(other) => {
                let unbound = other.0.downcast_ref::<NotBoundToCluster>()?;
                ConnectProblem::NotBoundToCluster {
                    required: unbound.required.clone(),
                    presented: unbound.presented.clone(),
                }
            }
            _ => return None,
        },
        rustls::Error::AlertReceived(alert) => ConnectProblem::RefusedByPeer(format!("{alert:?}")),
        rustls::Error::InvalidMessage(_) | rustls::Error::PeerIncompatible(_) => {
            ConnectProblem::NotTls
        }
        _ => return None,
    })
}

/// Opens a gRPC channel to `target` (`https://host:port` or `host:port`) over mutual TLS
/// with `config`. The server certificate is verified for `server_name`, or for the target's
/// host when `None` (use the node name when connecting by IP to a certificate that only
/// names the node).
pub async fn connect(
    target: &str,
    server_name: Option<&str>,
    config: Arc<ClientConfig>,
) -> Result<tonic::transport::Channel, ConnectError> {
    let bad = |detail: &str| ConnectError::Target {
        target: target.to_owned(),
        detail: detail.to_owned(),
    };
    let without_scheme = match target.split_once("://") {
        Some(("https", rest)) => rest,
        Some((scheme, _)) => return Err(bad(&format!("scheme {scheme} is not https"))),
        None => target,
    };
    let authority: http::uri::Authority = without_scheme
        .trim_end_matches('/')
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
    let port = authority.port_u16().ok_or_else(|| bad("no port"))?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let name = server_name.unwrap_or(&host).to_owned();
    let server_name =
        ServerName::try_from(name.clone()).map_err(|_| ConnectError::ServerName(name))?;

    // The scheme only fills the :scheme pseudo-header; TLS is done by the connector.
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{authority}"))
        .map_err(|e| bad(&e.to_string()))?
        .connect_timeout(CONNECT_TIMEOUT);
    let connector = tower::service_fn(move |_: http::Uri| {
        let config = config.clone();
        let server_name = server_name.clone();
        let host = host.clone();
        async move {
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(server_name, tcp)
                .await?;
            Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    endpoint
        .connect_with_connector(connector)
        .await
        .map_err(|source| ConnectError::Transport {
            target: target.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_certificates_says_what_it_holds() {
        assert_eq!(what_it_holds(b" \n"), "the file is empty");
        assert!(
            what_it_holds(b"REPLACE: the agents' CA certificate (PEM)").contains("placeholder")
        );
        assert!(
            what_it_holds(b"-----BEGIN PRIVATE KEY-----\nMC4C\n-----END PRIVATE KEY-----\n")
                .contains("(PRIVATE KEY), not a CERTIFICATE")
        );
        assert!(what_it_holds(b"hello").contains("not PEM"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.crt");
        std::fs::write(&path, "REPLACE: the agents' CA certificate (PEM)").unwrap();
        let e = load_certificates(&path).unwrap_err().to_string();
        assert!(
            e.contains("no certificate found: it still holds the placeholder"),
            "{e}"
        );
    }

    #[test]
    fn failure_labels_are_unique_and_indexed() {
        let mut seen = std::collections::HashSet::new();
        for (i, reason) in HandshakeFailure::ALL.iter().enumerate() {
            assert_eq!(reason.index(), i);
            assert!(seen.insert(reason.as_str()), "duplicate label {reason}");
        }
    }

    #[test]
    fn classify_maps_rustls_errors() {
        let wrap = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        assert_eq!(
            HandshakeFailure::classify(&wrap(rustls::Error::NoCertificatesPresented)),
            HandshakeFailure::NoClientCertificate
        );
        assert_eq!(
            HandshakeFailure::classify(&wrap(rustls::Error::InvalidCertificate(
                CertificateError::Expired
            ))),
            HandshakeFailure::Expired
        );
        assert_eq!(
            HandshakeFailure::classify(&wrap(rustls::Error::InvalidCertificate(
                CertificateError::InvalidPurpose
            ))),
            HandshakeFailure::WrongKeyUsage
        );
        assert_eq!(
            HandshakeFailure::classify(&io::Error::from(io::ErrorKind::UnexpectedEof)),
            HandshakeFailure::Io
        );
    }

    #[test]
    fn counters_count_per_reason() {
        let counters = TlsCounters::default();
        counters.record_failure(HandshakeFailure::UnknownIssuer);
        counters.record_failure(HandshakeFailure::UnknownIssuer);
        counters.record_failure(HandshakeFailure::Timeout);
        assert_eq!(counters.failures(HandshakeFailure::UnknownIssuer), 2);
        assert_eq!(counters.failures(HandshakeFailure::Timeout), 1);
        assert_eq!(counters.failures(HandshakeFailure::Expired), 0);
        let total: u64 = counters.failures_by_reason().iter().map(|(_, n)| n).sum();
        assert_eq!(total, 3);
    }

    #[test]
    fn causes_are_said_for_people() {
        let e = io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "peer closed connection without sending TLS close_notify: \
             https://docs.rs/rustls/latest/rustls/manual/_03_howto/index.html#unexpected-eof",
        );
        assert_eq!(diagnose(&e).chain(), "the connection was closed");
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(diagnose(&refused).problem, Some(ConnectProblem::Refused));
    }

    #[test]
    fn missing_files_name_the_path() {
        let paths = ServerTlsPaths::in_dir(Path::new("/nonexistent/inplace-agent-pki"));
        let err = server_config(&paths).unwrap_err().to_string();
        assert!(
            err.starts_with("read /nonexistent/inplace-agent-pki/"),
            "{err}"
        );
    }
}
