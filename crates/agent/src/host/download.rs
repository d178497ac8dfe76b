//! Artifact downloads into a content-addressed cache, and extraction of one member of a
//! `.tar.gz`.
//!
//! A download streams into a temporary file next to its final place,
//! `<state>/cache/sha256/<hex>`, and is renamed there only after its sha256 matched; on any
//! error the temporary file is removed, so the cache only ever holds verified content. A file
//! already in the cache (re-verified) means no network at all. Entries are not fsynced: every
//! use verifies them again, so one a crash left incomplete is simply fetched again.
//!
//! The client is reqwest's blocking one (the engine runs on an OS thread), with rustls over
//! the `ring` provider and a TLS configuration we build: the system's CA certificates (from
//! the agent's filesystem) plus any configured extra CAs. HTTPS only, except for hosts the
//! caller allows plain HTTP to; redirects follow the same rule. Bodies are capped (announced
//! length and actual bytes). Connection errors, cut bodies, 5xx and 429 are retried with
//! exponential backoff; other 4xx are not.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use sha2::{Digest, Sha256};

/// How downloads behave.
#[derive(Debug, Clone)]
pub struct DownloadConfig {
    /// The agent's state directory; the cache is `<state_dir>/cache/sha256/`.
    pub state_dir: PathBuf,
    /// Largest body accepted, in bytes.
    pub max_size: u64,
    /// Tries after the first one for retryable failures.
    pub retries: u32,
    /// First pause before a retry; doubles each time.
    pub first_backoff: Duration,
    /// Longest pause before a retry (also caps a server's `Retry-After`).
    pub max_backoff: Duration,
    /// Timeout of connecting.
    pub connect_timeout: Duration,
    /// Timeout until the response headers arrive, and of each read of the body.
    pub io_timeout: Duration,
    /// Hosts that may be fetched over plain `http://` (e.g. a local mirror). Empty: HTTPS only.
    pub http_allowed_hosts: Vec<String>,
    /// Extra CA certificates (PEM, one or more per entry) trusted for HTTPS.
    pub extra_ca_pem: Vec<Vec<u8>>,
    /// Whether the system's CA certificates are trusted as well.
    pub system_roots: bool,
}

impl DownloadConfig {
    /// Defaults for `state_dir`: 1 GiB cap, 4 retries from 1 s to 30 s, 30 s connect and 60 s
    /// read timeouts, HTTPS only, system CAs.
    pub fn new(state_dir: impl Into<PathBuf>) -> DownloadConfig {
        DownloadConfig {
            state_dir: state_dir.into(),
            max_size: 1 << 30,
            retries: 4,
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(30),
            io_timeout: Duration::from_secs(60),
            http_allowed_hosts: Vec::new(),
            extra_ca_pem: Vec::new(),
            system_roots: true,
        }
    }
}

/// Progress of a download, for the status line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DownloadEvent {
    /// Bytes received so far in this attempt, and the announced total when known.
    Progress {
        /// Bytes so far.
        bytes: u64,
        /// Content-Length, when the server sent one.
        total: Option<u64>,
    },
    /// An attempt failed in a way worth retrying; the next one starts after `delay`.
    Retrying {
        /// The attempt that failed (1 for the first).
        attempt: u32,
        /// Pause before the next attempt.
        delay: Duration,
        /// What went wrong.
        reason: String,
    },
}

/// A verified file in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// `<state>/cache/sha256/<hex>`.
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// True when it was already cached and nothing was downloaded.
    pub from_cache: bool,
    /// Attempts made (0 for a cache hit).
    pub attempts: u32,
}

/// What went wrong with a download or an extraction.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The URL cannot be used.
    #[error("download {url}: {reason}")]
    InvalidUrl {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// Plain HTTP to a host not in the allow-list (also on a redirect).
    #[error("download {url}: plain http to {host} is not allowed (https only)")]
    InsecureUrl {
        /// The URL.
        url: String,
        /// Its host.
        host: String,
    },
    /// The expected sha256 is not 64 hex digits.
    #[error("invalid sha256 '{value}': expected 64 hex digits")]
    InvalidDigest {
        /// The value given.
        value: String,
    },
    /// The TLS configuration could not be built.
    #[error("tls configuration: {detail}")]
    Tls {
        /// What failed.
        detail: String,
    },
    /// The server answered with an error status (after retries when it was retryable).
    #[error("download {url}: HTTP {status}")]
    Status {
        /// The URL.
        url: String,
        /// The status code.
        status: u16,
    },
    /// The body is larger than allowed.
    #[error("download {url}: body exceeds the limit of {limit} bytes{}", announced.map_or(String::new(), |n| format!(" (announced {n})")))]
    TooLarge {
        /// The URL.
        url: String,
        /// The limit.
        limit: u64,
        /// The Content-Length, when that is what gave it away.
        announced: Option<u64>,
    },
    /// The content does not have the expected sha256.
    #[error("download {url}: sha256 mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The URL.
        url: String,
        /// The pinned digest.
        expected: String,
        /// The digest of what was received.
        actual: String,
    },
    /// The transfer failed (after retries).
    #[error("download {url}: {detail}")]
    Transfer {
        /// The URL.
        url: String,
        /// What failed.
        detail: String,
    },
    /// A local file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What we were doing.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The archive has no such member.
    #[error("extract {member} from {}: no such member", archive.display())]
    MemberNotFound {
        /// The archive.
        archive: PathBuf,
        /// The member asked for.
        member: String,
    },
    /// The member is not a regular file (a link, directory, device...).
    #[error("extract {member} from {}: not a regular file ({kind})", archive.display())]
    MemberNotRegular {
        /// The archive.
        archive: PathBuf,
        /// The member.
        member: String,
        /// Its tar entry type.
        kind: String,
    },
    /// The member, or the data read to reach it, is larger than allowed.
    #[error("extract {member} from {}: {detail}", archive.display())]
    ExtractTooLarge {
        /// The archive.
        archive: PathBuf,
        /// The member.
        member: String,
        /// Which limit.
        detail: String,
    },
    /// The archive is not a readable `.tar.gz`.
    #[error("extract {member} from {}: {detail}", archive.display())]
    BadArchive {
        /// The archive.
        archive: PathBuf,
        /// The member.
        member: String,
        /// What the decoder said.
        detail: String,
    },
}

impl DownloadError {
    /// A short, bounded name for metrics and for callers that branch.
    pub fn kind(&self) -> &'static str {
        match self {
            DownloadError::InvalidUrl { .. } => "invalid_url",
            DownloadError::InsecureUrl { .. } => "insecure_url",
            DownloadError::InvalidDigest { .. } => "invalid_digest",
            DownloadError::Tls { .. } => "tls_config",
            DownloadError::Status { .. } => "http_status",
            DownloadError::TooLarge { .. } => "too_large",
            DownloadError::DigestMismatch { .. } => "digest_mismatch",
            DownloadError::Transfer { .. } => "transfer",
            DownloadError::Io { .. } => "io",
            DownloadError::MemberNotFound { .. } => "member_not_found",
            DownloadError::MemberNotRegular { .. } => "member_not_regular",
            DownloadError::ExtractTooLarge { .. } => "extract_too_large",
            DownloadError::BadArchive { .. } => "bad_archive",
        }
    }
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> DownloadError + use<> {
    let path = path.to_path_buf();
    move |source| DownloadError::Io { op, path, source }
}

/// Checks and normalises a sha256 given as hex.
pub fn parse_sha256(value: &str) -> Result<String, DownloadError> {
    if value.len() == 64 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(value.to_ascii_lowercase())
    } else {
        Err(DownloadError::InvalidDigest {
            value: value.to_string(),
        })
    }
}

/// Whether plain HTTP to `url`'s host is allowed, or the URL is HTTPS; `Err` names the reason.
fn check_scheme(url: &reqwest::Url, allowed: &[String]) -> Result<(), DownloadError> {
    match url.scheme() {
        "https" => Ok(()),
        "http" => {
            let host = url.host_str().unwrap_or_default();
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if allowed.iter().any(|a| a.eq_ignore_ascii_case(host)) {
                Ok(())
            } else {
                Err(DownloadError::InsecureUrl {
                    url: url.to_string(),
                    host: host.to_string(),
                })
            }
        }
        other => Err(DownloadError::InvalidUrl {
            url: url.to_string(),
            reason: format!("unsupported scheme {other}"),
        }),
    }
}

/// The outcome of one attempt that did not produce a verified file.
enum AttemptError {
    /// Worth another try (after the server's `Retry-After`, when it sent one).
    Retry(String, Option<Duration>),
    /// Final.
    Fatal(DownloadError),
}

/// Downloads artifacts into the cache. Holds one HTTP client (and its connection pool).
#[derive(Debug)]
pub struct Downloader {
    config: DownloadConfig,
    client: reqwest::blocking::Client,
}

impl Downloader {
    /// A downloader with `config`'s trust roots and limits.
    pub fn new(config: DownloadConfig) -> Result<Downloader, DownloadError> {
        let tls = tls_config(&config)?;
        let allowed = config.http_allowed_hosts.clone();
        let redirects = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= 10 {
                return attempt.error("too many redirects");
            }
            match check_scheme(attempt.url(), &allowed) {
                Ok(()) => attempt.follow(),
                Err(e) => attempt.error(e.to_string()),
            }
        });
        let client = reqwest::blocking::Client::builder()
            .tls_backend_preconfigured(tls)
            .redirect(redirects)
            .connect_timeout(config.connect_timeout)
            .timeout(config.io_timeout)
            .user_agent(concat!("inplace-agent/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| DownloadError::Tls {
                detail: error_chain(&e),
            })?;
        Ok(Downloader { config, client })
    }

    /// Where content with this sha256 is (or would be) cached.
    pub fn cache_path(&self, sha256: &str) -> PathBuf {
        self.cache().path(sha256)
    }

    /// The cache this downloader fills.
    pub fn cache(&self) -> Cache {
        Cache::at(&self.config.state_dir)
    }

    fn cache_dir(&self) -> PathBuf {
        self.cache().dir()
    }

    /// The cached file for `sha256`, re-verified; a cached file that no longer matches is
    /// removed and reported as absent.
    pub fn cached(&self, sha256: &str) -> Result<Option<Fetched>, DownloadError> {
        self.cache().verified(sha256)
    }

    /// The verified content of member `member` of the `.tar.gz` at `url` (with `sha256`),
    /// extracted into the cache: content-addressed by the member's own sha256, and
    /// remembered per (archive, member) so that later calls neither download nor extract.
    /// Returns the member's file and its sha256.
    pub fn fetch_member(
        &self,
        url: &str,
        sha256: &str,
        member: &str,
        limits: ExtractLimits,
        events: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<(Fetched, String), DownloadError> {
        let sha256 = parse_sha256(sha256)?;
        let cache = self.cache();
        if let Some(member_sha) = cache.member_sha(&sha256, member)
            && let Some(hit) = cache.verified(&member_sha)?
        {
            return Ok((hit, member_sha));
        }
        let archive = self.fetch(url, &sha256, events)?;
        let dir = cache.dir();
        let (member_sha, size) = with_member(&archive.path, member, limits, |reader, size| {
            let mut tmp = tempfile::Builder::new()
                .prefix(".partial-")
                .tempfile_in(&dir)
                .map_err(io_err("create temporary file in", &dir))?;
            let (sha, copied) =
                hash_copy(reader, tmp.as_file_mut()).map_err(|e| DownloadError::BadArchive {
                    archive: archive.path.clone(),
                    member: member.to_string(),
                    detail: e.to_string(),
                })?;
            check_length(&archive.path, member, copied, size)?;
            // Not fsynced, like downloads: every use verifies (see `attempt`).
            let path = dir.join(&sha);
            tmp.persist(&path)
                .map_err(|e| io_err("rename into", &path)(e.error))?;
            Ok((sha, copied))
        })?;
        cache.remember_member(&sha256, member, &member_sha)?;
        Ok((
            Fetched {
                path: cache.path(&member_sha),
                size,
                from_cache: archive.from_cache,
                attempts: archive.attempts,
            },
            member_sha,
        ))
    }

    /// Returns the verified content of `url` with `sha256` from the cache, downloading it
    /// first when it is not there.
    pub fn fetch(
        &self,
        url: &str,
        sha256: &str,
        events: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<Fetched, DownloadError> {
        let sha256 = parse_sha256(sha256)?;
        let parsed = reqwest::Url::parse(url).map_err(|e| DownloadError::InvalidUrl {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        check_scheme(&parsed, &self.config.http_allowed_hosts)?;
        if let Some(hit) = self.cached(&sha256)? {
            return Ok(hit);
        }
        let dir = self.cache_dir();
        create_private_dirs(&dir)?;

        let mut delay = self.config.first_backoff;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.attempt(&parsed, &sha256, &dir, events) {
                Ok((path, size)) => {
                    return Ok(Fetched {
                        path,
                        size,
                        from_cache: false,
                        attempts: attempt,
                    });
                }
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Retry(reason, retry_after)) => {
                    if attempt > self.config.retries {
                        return Err(DownloadError::Transfer {
                            url: url.to_string(),
                            detail: format!("{reason} (after {attempt} attempts)"),
                        });
                    }
                    let pause = retry_after.unwrap_or(delay).min(self.config.max_backoff);
                    events(&DownloadEvent::Retrying {
                        attempt,
                        delay: pause,
                        reason,
                    });
                    thread::sleep(pause);
                    delay = (delay * 2).min(self.config.max_backoff);
                }
            }
        }
    }

    /// One GET into a temporary file in `dir`, renamed into the cache when verified. The
    /// temporary file is removed on every error (it is deleted when dropped unpersisted).
    fn attempt(
        &self,
        url: &reqwest::Url,
        sha256: &str,
        dir: &Path,
        events: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<(PathBuf, u64), AttemptError> {
        let limit = self.config.max_size;
        let fatal = AttemptError::Fatal;
        let mut resp = match self.client.get(url.clone()).send() {
            Ok(r) => r,
            Err(e) => {
                // A refused redirect is final; anything else about the connection is retried.
                if e.is_redirect() {
                    return Err(fatal(DownloadError::Transfer {
                        url: url.to_string(),
                        detail: error_chain(&e),
                    }));
                }
                return Err(AttemptError::Retry(error_chain(&e), None));
            }
        };
        let status = resp.status();
        if !status.is_success() {
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            if status.is_server_error() || status.as_u16() == 429 {
                return Err(AttemptError::Retry(
                    format!("HTTP {}", status.as_u16()),
                    retry_after,
                ));
            }
            return Err(fatal(DownloadError::Status {
                url: url.to_string(),
                status: status.as_u16(),
            }));
        }
        let total = resp.content_length();
        if let Some(n) = total
            && n > limit
        {
            return Err(fatal(DownloadError::TooLarge {
                url: url.to_string(),
                limit,
                announced: Some(n),
            }));
        }

        let mut tmp = tempfile::Builder::new()
            .prefix(".partial-")
            .tempfile_in(dir)
            .map_err(|e| fatal(io_err("create temporary file in", dir)(e)))?;
        let mut hasher = Sha256::new();
        let mut bytes: u64 = 0;
        let mut last_report: u64 = 0;
        let mut buf = vec![0u8; 64 * 1024];
        events(&DownloadEvent::Progress { bytes, total });
        loop {
            let n = match resp.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(AttemptError::Retry(
                        format!("body cut after {bytes} bytes: {}", io_error_chain(&e)),
                        None,
                    ));
                }
            };
            bytes += n as u64;
            if bytes > limit {
                return Err(fatal(DownloadError::TooLarge {
                    url: url.to_string(),
                    limit,
                    announced: None,
                }));
            }
            hasher.update(&buf[..n]);
            tmp.write_all(&buf[..n])
                .map_err(|e| fatal(io_err("write", tmp.path())(e)))?;
            if bytes - last_report >= 256 * 1024 {
                last_report = bytes;
                events(&DownloadEvent::Progress { bytes, total });
            }
        }
        if let Some(n) = total
            && bytes != n
        {
            return Err(AttemptError::Retry(
                format!("body cut after {bytes} of {n} bytes"),
                None,
            ));
        }
        events(&DownloadEvent::Progress { bytes, total });
        let actual = hex::encode(hasher.finalize());
        if actual != sha256 {
            return Err(fatal(DownloadError::DigestMismatch {
                url: url.to_string(),
                expected: sha256.to_string(),
                actual,
            }));
        }
        // Renamed into place only when verified, but not fsynced: every use of a cache entry
        // verifies it again (`Cache::verified` when a plan prepares, `VerifyingReader` while
        // installing), so one that a crash left incomplete is found and downloaded again.
        // Syncing hundreds of megabytes would buy nothing and cost a good part of the time.
        let path = dir.join(sha256);
        tmp.persist(&path)
            .map_err(|e| fatal(io_err("rename into", &path)(e.error)))?;
        Ok((path, bytes))
    }
}

/// The download cache of a state directory, read without a network client:
/// `<state>/cache/sha256/<hex>` holds verified content, `<state>/cache/members/<archive
/// sha256>/<sha256 of the member name>` remembers the sha256 of a member extracted from an
/// archive.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
}

impl Cache {
    /// The cache under `state_dir`.
    pub fn at(state_dir: &Path) -> Cache {
        Cache {
            root: state_dir.join("cache"),
        }
    }

    fn dir(&self) -> PathBuf {
        self.root.join("sha256")
    }

    /// Where content with this sha256 is (or would be).
    pub fn path(&self, sha256: &str) -> PathBuf {
        self.dir().join(sha256.to_ascii_lowercase())
    }

    /// The cached file for `sha256` and its size when it is there, without re-hashing it
    /// (readers verify as they go, see [`VerifyingReader`]).
    pub fn peek(&self, sha256: &str) -> Option<(PathBuf, u64)> {
        let path = self.path(sha256);
        let meta = std::fs::metadata(&path).ok()?;
        meta.is_file().then_some((path, meta.len()))
    }

    /// The cached file for `sha256`, re-verified; a cached file that no longer matches is
    /// removed and reported as absent.
    pub fn verified(&self, sha256: &str) -> Result<Option<Fetched>, DownloadError> {
        let sha256 = parse_sha256(sha256)?;
        let path = self.path(&sha256);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        let (actual, size) = hash_reader(&mut file).map_err(io_err("read", &path))?;
        if actual != sha256 {
            tracing::warn!(path = %path.display(), actual, "cached artifact is corrupt; removing it");
            std::fs::remove_file(&path).map_err(io_err("remove", &path))?;
            return Ok(None);
        }
        Ok(Some(Fetched {
            path,
            size,
            from_cache: true,
            attempts: 0,
        }))
    }

    fn member_memo(&self, archive_sha256: &str, member: &str) -> PathBuf {
        let name = hex::encode(Sha256::digest(normalise_member(member).as_bytes()));
        self.root
            .join("members")
            .join(archive_sha256.to_ascii_lowercase())
            .join(name)
    }

    /// The sha256 of `member` of the archive with `archive_sha256`, when it was extracted
    /// into the cache before.
    pub fn member_sha(&self, archive_sha256: &str, member: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.member_memo(archive_sha256, member)).ok()?;
        parse_sha256(text.trim()).ok()
    }

    fn remember_member(
        &self,
        archive_sha256: &str,
        member: &str,
        member_sha: &str,
    ) -> Result<(), DownloadError> {
        let memo = self.member_memo(archive_sha256, member);
        let dir = memo.parent().unwrap_or(&self.root).to_path_buf();
        create_private_dirs(&dir)?;
        let mut tmp = tempfile::Builder::new()
            .prefix(".partial-")
            .tempfile_in(&dir)
            .map_err(io_err("create temporary file in", &dir))?;
        tmp.write_all(format!("{member_sha}\n").as_bytes())
            .map_err(|e| io_err("write", tmp.path())(e))?;
        // A memo a crash damaged does not parse, or names content that does not verify:
        // either way the member is extracted again.
        tmp.persist(&memo)
            .map_err(|e| io_err("rename into", &memo)(e.error))?;
        Ok(())
    }
}

/// `base::sha256`, shared with the journal's backup store; re-exported here.
pub use inplace_base::sha256::VerifyingReader;

/// Copies `from` into `to` and returns the sha256 hex and length of what was copied.
fn hash_copy(from: &mut dyn Read, to: &mut File) -> io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut size = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        to.write_all(&buf[..n])?;
        size += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), size))
}

/// Checks that `pem` holds at least one parsable certificate; returns how many.
pub fn check_ca_pem(pem: &[u8]) -> Result<usize, DownloadError> {
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        cert.map_err(|e| DownloadError::Tls {
            detail: format!("extra CA certificate: {e}"),
        })?;
        n += 1;
    }
    if n == 0 {
        return Err(DownloadError::Tls {
            detail: "extra CA certificate: no PEM certificate found".to_string(),
        });
    }
    Ok(n)
}

/// Creates `dir` and its parents, new ones private to the agent (0700).
fn create_private_dirs(dir: &Path) -> Result<(), DownloadError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err("create directory", dir))
}

fn sync_dir(dir: &Path) -> Result<(), DownloadError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("sync directory", dir))
}

/// The sha256 hex and length of everything `r` yields.
pub fn hash_reader(r: &mut impl Read) -> io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut size = 0u64;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), size))
}

/// The error and its sources, joined: reqwest's top-level messages alone say little.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

fn io_error_chain(e: &io::Error) -> String {
    match e.get_ref() {
        Some(inner) => error_chain(inner),
        None => e.to_string(),
    }
}

/// rustls over `ring` with the system CAs (when enabled) and the configured extra ones.
fn tls_config(config: &DownloadConfig) -> Result<rustls::ClientConfig, DownloadError> {
    let mut roots = rustls::RootCertStore::empty();
    if config.system_roots {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "reading system CA certificates");
        }
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        tracing::debug!(added, ignored, "system CA certificates");
    }
    for pem in &config.extra_ca_pem {
        let mut any = false;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| DownloadError::Tls {
                detail: format!("extra CA certificate: {e}"),
            })?;
            roots.add(cert).map_err(|e| DownloadError::Tls {
                detail: format!("extra CA certificate: {e}"),
            })?;
            any = true;
        }
        if !any {
            return Err(DownloadError::Tls {
                detail: "extra CA certificate: no PEM certificate found".to_string(),
            });
        }
    }
    if roots.is_empty() {
        return Err(DownloadError::Tls {
            detail: "no trusted CA certificates".to_string(),
        });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| DownloadError::Tls {
            detail: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

// === tar.gz extraction ===

/// Bounds on extracting one member of a `.tar.gz`.
#[derive(Debug, Clone, Copy)]
pub struct ExtractLimits {
    /// Largest member accepted, in bytes.
    pub max_member: u64,
    /// Most decompressed bytes read while looking for the member (guards against archives
    /// that expand enormously).
    pub max_scanned: u64,
}

impl Default for ExtractLimits {
    fn default() -> ExtractLimits {
        ExtractLimits {
            max_member: 512 << 20,
            max_scanned: 4 << 30,
        }
    }
}

/// Errors once more than its limit has been read.
struct Bounded<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One more byte would exceed the limit: is there one?
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::other("scan limit exceeded")),
            };
        }
        let max = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..max])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// `a/./b`, `./a/b` and `/a/b` all name `a/b`.
fn normalise_member(path: &str) -> String {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// Finds `member` in the archive and hands its reader and size to `sink`.
fn with_member<T>(
    archive: &Path,
    member: &str,
    limits: ExtractLimits,
    sink: impl FnOnce(&mut dyn Read, u64) -> Result<T, DownloadError>,
) -> Result<T, DownloadError> {
    let want = normalise_member(member);
    let bad = |detail: String| DownloadError::BadArchive {
        archive: archive.to_path_buf(),
        member: member.to_string(),
        detail,
    };
    let scan_limit = |e: &io::Error| e.to_string().contains("scan limit exceeded");
    let too_much = || DownloadError::ExtractTooLarge {
        archive: archive.to_path_buf(),
        member: member.to_string(),
        detail: format!(
            "more than {} bytes decompressed without finding it",
            limits.max_scanned
        ),
    };
    let file = File::open(archive).map_err(io_err("open", archive))?;
    let gz = flate2::read::GzDecoder::new(io::BufReader::new(file));
    let mut tar = tar::Archive::new(Bounded {
        inner: gz,
        left: limits.max_scanned,
    });
    let entries = tar.entries().map_err(|e| bad(e.to_string()))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| {
            if scan_limit(&e) {
                too_much()
            } else {
                bad(e.to_string())
            }
        })?;
        let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        if normalise_member(&path) != want {
            continue;
        }
        let kind = entry.header().entry_type();
        if !kind.is_file() {
            return Err(DownloadError::MemberNotRegular {
                archive: archive.to_path_buf(),
                member: member.to_string(),
                kind: format!("{kind:?}"),
            });
        }
        let size = entry.size();
        if size > limits.max_member {
            return Err(DownloadError::ExtractTooLarge {
                archive: archive.to_path_buf(),
                member: member.to_string(),
                detail: format!("member is {size} bytes, the limit is {}", limits.max_member),
            });
        }
        let mut reader = (&mut entry).take(size);
        return sink(&mut reader, size);
    }
    Err(DownloadError::MemberNotFound {
        archive: archive.to_path_buf(),
        member: member.to_string(),
    })
}

/// Reads one regular-file member of a `.tar.gz` into memory.
pub fn extract_tar_gz_member(
    archive: &Path,
    member: &str,
    limits: ExtractLimits,
) -> Result<Vec<u8>, DownloadError> {
    with_member(archive, member, limits, |reader, size| {
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0).min(64 << 20));
        reader
            .read_to_end(&mut bytes)
            .map_err(|e| DownloadError::BadArchive {
                archive: archive.to_path_buf(),
                member: member.to_string(),
                detail: e.to_string(),
            })?;
        check_length(archive, member, bytes.len() as u64, size)?;
        Ok(bytes)
    })
}

/// Writes one regular-file member of a `.tar.gz` to `dest` (mode 0600) atomically: through a
/// temporary file in the same directory, synced and renamed; nothing is left on error.
/// Returns the number of bytes written.
pub fn extract_tar_gz_member_to_file(
    archive: &Path,
    member: &str,
    limits: ExtractLimits,
    dest: &Path,
) -> Result<u64, DownloadError> {
    let dir = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    with_member(archive, member, limits, |reader, size| {
        let mut tmp = tempfile::Builder::new()
            .prefix(".partial-")
            .tempfile_in(dir)
            .map_err(io_err("create temporary file in", dir))?;
        let copied = io::copy(reader, &mut tmp).map_err(|e| DownloadError::BadArchive {
            archive: archive.to_path_buf(),
            member: member.to_string(),
            detail: e.to_string(),
        })?;
        check_length(archive, member, copied, size)?;
        tmp.as_file()
            .sync_all()
            .map_err(io_err("sync", tmp.path()))?;
        tmp.persist(dest)
            .map_err(|e| io_err("rename into", dest)(e.error))?;
        sync_dir(dir)?;
        Ok(copied)
    })
}

fn check_length(archive: &Path, member: &str, got: u64, want: u64) -> Result<(), DownloadError> {
    if got == want {
        Ok(())
    } else {
        Err(DownloadError::BadArchive {
            archive: archive.to_path_buf(),
            member: member.to_string(),
            detail: format!("member truncated: {got} of {want} bytes"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_gz(entries: &[(&str, tar::EntryType, &[u8])]) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        let gz = flate2::write::GzEncoder::new(file.reopen().unwrap(), flate2::Compression::fast());
        let mut builder = tar::Builder::new(gz);
        for (path, kind, data) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(*kind);
            header.set_size(data.len() as u64);
            header.set_mode(0o755);
            if kind.is_symlink() {
                header.set_link_name("/etc/shadow").unwrap();
            }
            builder.append_data(&mut header, path, *data).unwrap();
        }
        builder.into_inner().unwrap().finish().unwrap();
        file
    }

    #[test]
    fn verifying_readers_fail_at_the_end_on_a_mismatch() {
        let data = b"kubelet bytes".repeat(1000);
        let sha = hex::encode(Sha256::digest(&data));
        let mut ok = VerifyingReader::new(&data[..], &sha.to_ascii_uppercase(), "bad");
        let mut out = Vec::new();
        ok.read_to_end(&mut out).unwrap();
        assert_eq!(out, data);
        let mut bad = VerifyingReader::new(&data[..10], &sha, "cache entry is corrupt");
        let err = bad.read_to_end(&mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(err.to_string(), "cache entry is corrupt");
        assert!(bad.read(&mut [0u8; 8]).is_err(), "keeps failing");
    }

    #[test]
    fn extra_ca_files_must_hold_certificates() {
        assert_eq!(check_ca_pem(b"nothing").unwrap_err().kind(), "tls_config");
    }

    #[test]
    fn sha256_values_are_checked() {
        let ok = "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855";
        assert_eq!(parse_sha256(ok).unwrap(), ok.to_ascii_lowercase());
        assert_eq!(parse_sha256("abc").unwrap_err().kind(), "invalid_digest");
        assert!(parse_sha256(&"g".repeat(64)).is_err());
    }

    #[test]
    fn plain_http_needs_an_allowed_host() {
        let allowed = vec!["mirror.local".to_string(), "::1".to_string()];
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        assert!(check_scheme(&url("https://dl.k8s.io/x"), &[]).is_ok());
        assert!(check_scheme(&url("http://mirror.local/x"), &allowed).is_ok());
        assert!(check_scheme(&url("http://[::1]:8080/x"), &allowed).is_ok());
        let err = check_scheme(&url("http://dl.k8s.io/x"), &allowed).unwrap_err();
        assert_eq!(err.kind(), "insecure_url");
        assert_eq!(
            err.to_string(),
            "download http://dl.k8s.io/x: plain http to dl.k8s.io is not allowed (https only)"
        );
        assert_eq!(
            check_scheme(&url("ftp://x/y"), &allowed)
                .unwrap_err()
                .kind(),
            "invalid_url"
        );
    }

    #[test]
    fn members_are_extracted_and_checked() {
        let archive = tar_gz(&[
            (
                "kubernetes/node/bin/kubectl",
                tar::EntryType::Regular,
                b"kubectl bytes",
            ),
            (
                "kubernetes/node/bin/kubelet",
                tar::EntryType::Regular,
                b"kubelet bytes",
            ),
            ("kubernetes/node/bin/link", tar::EntryType::Symlink, b""),
            ("kubernetes/node/bin/dir", tar::EntryType::Directory, b""),
        ]);
        let limits = ExtractLimits::default();
        let got =
            extract_tar_gz_member(archive.path(), "kubernetes/node/bin/kubelet", limits).unwrap();
        assert_eq!(got, b"kubelet bytes");
        let got =
            extract_tar_gz_member(archive.path(), "./kubernetes/node/bin/kubectl", limits).unwrap();
        assert_eq!(got, b"kubectl bytes");

        let err =
            extract_tar_gz_member(archive.path(), "kubernetes/node/bin/link", limits).unwrap_err();
        assert_eq!(err.kind(), "member_not_regular", "{err}");
        let err =
            extract_tar_gz_member(archive.path(), "kubernetes/node/bin/dir", limits).unwrap_err();
        assert_eq!(err.kind(), "member_not_regular");
        let err = extract_tar_gz_member(archive.path(), "kubernetes/node/bin/kubeadm", limits)
            .unwrap_err();
        assert_eq!(err.kind(), "member_not_found");
        assert!(
            err.to_string()
                .starts_with("extract kubernetes/node/bin/kubeadm from ")
        );

        let small = ExtractLimits {
            max_member: 5,
            ..limits
        };
        let err = extract_tar_gz_member(archive.path(), "kubernetes/node/bin/kubelet", small)
            .unwrap_err();
        assert_eq!(err.kind(), "extract_too_large");
        let scan = ExtractLimits {
            max_member: 1 << 20,
            max_scanned: 600,
        };
        let err =
            extract_tar_gz_member(archive.path(), "kubernetes/node/bin/kubelet", scan).unwrap_err();
        assert_eq!(err.kind(), "extract_too_large", "{err}");

        let not_gz = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(not_gz.path(), b"plain text, not gzip").unwrap();
        let err = extract_tar_gz_member(not_gz.path(), "x", limits).unwrap_err();
        assert_eq!(err.kind(), "bad_archive", "{err}");
    }

    #[test]
    fn members_are_written_atomically_and_nothing_is_left_on_error() {
        let archive = tar_gz(&[
            ("bin/kubelet", tar::EntryType::Regular, b"kubelet bytes"),
            ("bin/link", tar::EntryType::Symlink, b""),
        ]);
        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join("kubelet");
        let n = extract_tar_gz_member_to_file(
            archive.path(),
            "bin/kubelet",
            ExtractLimits::default(),
            &dest,
        )
        .unwrap();
        assert_eq!(n, 13);
        assert_eq!(std::fs::read(&dest).unwrap(), b"kubelet bytes");
        let small = ExtractLimits {
            max_member: 4,
            max_scanned: 1 << 20,
        };
        for (member, limits) in [
            ("bin/kubelet", small),
            ("bin/link", ExtractLimits::default()),
            ("bin/none", ExtractLimits::default()),
        ] {
            let other = out.path().join("other");
            assert!(extract_tar_gz_member_to_file(archive.path(), member, limits, &other).is_err());
        }
        let names: Vec<_> = std::fs::read_dir(out.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["kubelet"]);
    }
}
