//! Artifact downloads against a local HTTPS server (test CA generated here, 127.0.0.1 only)
//! that misbehaves on purpose: cut bodies, 5xx, oversized bodies, plain http, redirects; then
//! `artifact` changes through the real binary on a sandbox node tree.

use crate::support;
use crate::support::pki::{HttpsPki, https_pki};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inplace_agent::host::download::{
    DownloadConfig, DownloadEvent, Downloader, ExtractLimits, extract_tar_gz_member,
};
use sha2::{Digest, Sha256};

/// What the server does for one request.
enum Reply {
    /// A complete response.
    Full {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Vec<u8>,
    },
    /// Announces `body.len()` bytes, sends the first `send`, then drops the connection.
    Cut { body: Vec<u8>, send: usize },
    /// Announces a length but sends only a little.
    Announce { length: u64 },
    /// No Content-Length: the body runs until the connection closes.
    Unannounced { body: Vec<u8> },
}

fn ok(body: &[u8]) -> Reply {
    Reply::Full {
        status: 200,
        headers: vec![],
        body: body.to_vec(),
    }
}

fn status(code: u16) -> Reply {
    Reply::Full {
        status: code,
        headers: vec![],
        body: b"error page".to_vec(),
    }
}

type Routes = dyn Fn(&str, usize) -> Reply + Send + Sync;

/// A tiny HTTP/1.1 server on 127.0.0.1, one connection per request, optionally over TLS.
struct Server {
    addr: SocketAddr,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    scheme: &'static str,
}

impl Server {
    fn start(tls: Option<Arc<rustls::ServerConfig>>, routes: Arc<Routes>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let hits: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let counter = hits.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (tls, routes, counter) = (tls.clone(), routes.clone(), counter.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, tls, &*routes, &counter);
                });
            }
        });
        Server { addr, hits, scheme }
    }

    fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addr)
    }

    fn hits(&self, path: &str) -> usize {
        self.hits.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

fn serve(
    stream: TcpStream,
    tls: Option<Arc<rustls::ServerConfig>>,
    routes: &Routes,
    hits: &Mutex<HashMap<String, usize>>,
) -> std::io::Result<()> {
    match tls {
        Some(config) => {
            let conn = rustls::ServerConnection::new(config).map_err(std::io::Error::other)?;
            let mut tls = rustls::StreamOwned::new(conn, stream);
            let cut = respond(&mut tls, routes, hits)?;
            if !cut {
                tls.conn.send_close_notify();
                tls.flush()?;
            }
            Ok(())
        }
        None => {
            let mut plain = stream;
            respond(&mut plain, routes, hits).map(drop)
        }
    }
}

/// Reads one request and writes the reply; true when the connection was cut on purpose.
fn respond(
    stream: &mut (impl Read + Write),
    routes: &Routes,
    hits: &Mutex<HashMap<String, usize>>,
) -> std::io::Result<bool> {
    let mut reader = BufReader::new(&mut *stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .to_string();
    let n = {
        let mut hits = hits.lock().unwrap();
        let n = hits.entry(path.clone()).or_default();
        *n += 1;
        *n
    };
    let head = |code: u16, length: Option<u64>, extra: &[(&str, String)]| {
        let mut h = format!("HTTP/1.1 {code} X\r\nConnection: close\r\n");
        if let Some(len) = length {
            h.push_str(&format!("Content-Length: {len}\r\n"));
        }
        for (k, v) in extra {
            h.push_str(&format!("{k}: {v}\r\n"));
        }
        h.push_str("\r\n");
        h.into_bytes()
    };
    match routes(&path, n) {
        Reply::Full {
            status,
            headers,
            body,
        } => {
            stream.write_all(&head(status, Some(body.len() as u64), &headers))?;
            stream.write_all(&body)?;
        }
        Reply::Cut { body, send } => {
            stream.write_all(&head(200, Some(body.len() as u64), &[]))?;
            stream.write_all(&body[..send])?;
            stream.flush()?;
            return Ok(true);
        }
        Reply::Announce { length } => {
            stream.write_all(&head(200, Some(length), &[]))?;
            stream.write_all(b"just a little")?;
            stream.flush()?;
            return Ok(true);
        }
        Reply::Unannounced { body } => {
            stream.write_all(&head(200, None, &[]))?;
            stream.write_all(&body)?;
        }
    }
    stream.flush()?;
    Ok(false)
}

fn sha(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// A body that is not all one byte, so a cut or a mix-up shows in the digest.
fn artifact(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

fn config(state: &Path, pki: &HttpsPki) -> DownloadConfig {
    let mut c = DownloadConfig::new(state);
    c.extra_ca_pem = vec![pki.ca_pem.as_bytes().to_vec()];
    c.system_roots = false;
    c.first_backoff = Duration::from_millis(200);
    c.max_backoff = Duration::from_millis(400);
    c.retries = 3;
    c.max_size = 1 << 20;
    c.io_timeout = Duration::from_secs(10);
    c
}

/// Every file in the cache directory (there must be no leftovers).
fn cache_files(state: &Path) -> Vec<String> {
    let dir = state.join("cache/sha256");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn standard_routes(body: Vec<u8>) -> Arc<Routes> {
    Arc::new(move |path, n| match path {
        "/ok" => ok(&body),
        "/cut" if n == 1 => Reply::Cut {
            body: body.clone(),
            send: body.len() / 3,
        },
        "/cut" => ok(&body),
        "/flaky" if n == 1 => status(500),
        "/flaky" => ok(&body),
        "/busy" if n == 1 => Reply::Full {
            status: 429,
            headers: vec![("Retry-After", "0".to_string())],
            body: vec![],
        },
        "/busy" => ok(&body),
        "/down" => status(503),
        "/missing" => status(404),
        "/announced-huge" => Reply::Announce { length: 10 << 20 },
        "/announced-2g" => Reply::Announce { length: 2 << 30 },
        "/unannounced-huge" => Reply::Unannounced {
            body: artifact(2 << 20),
        },
        _ => status(404),
    })
}

#[test]
fn downloads_verify_and_cache_hits_do_no_request() {
    let pki = https_pki();
    let body = artifact(700 * 1024);
    let server = Server::start(Some(pki.server.clone()), standard_routes(body.clone()));
    let state = tempfile::tempdir().unwrap();
    let dl = Downloader::new(config(state.path(), &pki)).unwrap();

    let mut events = Vec::new();
    let started = Instant::now();
    let got = dl
        .fetch(&server.url("/ok"), &sha(&body), &mut |e| {
            events.push(e.clone())
        })
        .unwrap();
    assert!(!got.from_cache);
    assert_eq!((got.attempts, got.size), (1, body.len() as u64));
    assert_eq!(got.path, state.path().join("cache/sha256").join(sha(&body)));
    assert_eq!(std::fs::read(&got.path).unwrap(), body);
    assert_eq!(
        events.last(),
        Some(&DownloadEvent::Progress {
            bytes: body.len() as u64,
            total: Some(body.len() as u64)
        })
    );
    assert!(events.len() >= 3, "progress along the way: {events:?}");
    assert_eq!(cache_files(state.path()), [sha(&body)]);
    eprintln!("700 KiB over TLS in {:?}", started.elapsed());

    // Again: from the cache, without a request.
    let again = dl
        .fetch(&server.url("/ok"), &sha(&body), &mut |_| {
            panic!("no events")
        })
        .unwrap();
    assert!(again.from_cache);
    assert_eq!(again.attempts, 0);
    assert_eq!(server.hits("/ok"), 1);
    // Even under another URL: the cache is by content.
    assert!(
        dl.fetch(&server.url("/other"), &sha(&body), &mut |_| {})
            .unwrap()
            .from_cache
    );
    assert_eq!(server.hits("/other"), 0);

    // A corrupted cache entry is noticed and replaced.
    std::fs::write(&got.path, b"bit rot").unwrap();
    let fixed = dl
        .fetch(&server.url("/ok"), &sha(&body), &mut |_| {})
        .unwrap();
    assert!(!fixed.from_cache);
    assert_eq!(std::fs::read(&fixed.path).unwrap(), body);
    assert_eq!(server.hits("/ok"), 2);
}

#[test]
fn a_wrong_sha256_leaves_nothing_behind() {
    let pki = https_pki();
    let body = artifact(100 * 1024);
    let server = Server::start(Some(pki.server.clone()), standard_routes(body.clone()));
    let state = tempfile::tempdir().unwrap();
    let dl = Downloader::new(config(state.path(), &pki)).unwrap();
    let wrong = sha(b"something else");
    let err = dl
        .fetch(&server.url("/ok"), &wrong, &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "digest_mismatch", "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "download {}: sha256 mismatch: expected {wrong}, got {}",
            server.url("/ok"),
            sha(&body)
        )
    );
    assert_eq!(cache_files(state.path()), Vec::<String>::new());
    assert!(!dl.cache_path(&wrong).exists());
    assert_eq!(server.hits("/ok"), 1, "a mismatch is not retried");
}

#[test]
fn a_cut_connection_is_retried_and_completed() {
    let pki = https_pki();
    let body = artifact(600 * 1024);
    let server = Server::start(Some(pki.server.clone()), standard_routes(body.clone()));
    let state = tempfile::tempdir().unwrap();
    let dl = Downloader::new(config(state.path(), &pki)).unwrap();
    let mut events = Vec::new();
    let got = dl
        .fetch(&server.url("/cut"), &sha(&body), &mut |e| {
            events.push(e.clone())
        })
        .unwrap();
    assert_eq!(got.attempts, 2);
    assert_eq!(std::fs::read(&got.path).unwrap(), body);
    assert_eq!(server.hits("/cut"), 2);
    let retry = events
        .iter()
        .find_map(|e| match e {
            DownloadEvent::Retrying {
                attempt, reason, ..
            } => Some((*attempt, reason.clone())),
            _ => None,
        })
        .expect("a retry event");
    assert_eq!(retry.0, 1);
    assert!(
        retry.1.contains("cut") || retry.1.contains("error"),
        "{}",
        retry.1
    );
    assert_eq!(cache_files(state.path()), [sha(&body)]);
}

#[test]
fn server_errors_back_off_and_client_errors_do_not_retry() {
    let pki = https_pki();
    let body = artifact(10 * 1024);
    let server = Server::start(Some(pki.server.clone()), standard_routes(body.clone()));
    let state = tempfile::tempdir().unwrap();
    let dl = Downloader::new(config(state.path(), &pki)).unwrap();

    let mut events = Vec::new();
    let started = Instant::now();
    let got = dl
        .fetch(&server.url("/flaky"), &sha(&body), &mut |e| {
            events.push(e.clone())
        })
        .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(got.attempts, 2);
    assert!(events.contains(&DownloadEvent::Retrying {
        attempt: 1,
        delay: Duration::from_millis(200),
        reason: "HTTP 500".to_string()
    }));
    assert!(
        elapsed >= Duration::from_millis(200),
        "backed off: {elapsed:?}"
    );

    // 429 with Retry-After: 0 is retried at once (same content: empty the cache first).
    std::fs::remove_file(&got.path).unwrap();
    let got = dl.fetch(&server.url("/busy"), &sha(&body), &mut |_| {});
    assert!(got.is_ok(), "{got:?}");
    assert_eq!(server.hits("/busy"), 2);

    // 404 is final at once.
    let other = sha(b"other");
    let err = dl
        .fetch(&server.url("/missing"), &other, &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "http_status");
    assert_eq!(
        err.to_string(),
        format!("download {}: HTTP 404", server.url("/missing"))
    );
    assert_eq!(server.hits("/missing"), 1);

    // A 503 that never ends: 1 + 3 retries with growing pauses, then a transfer error.
    let mut pauses = Vec::new();
    let err = dl
        .fetch(&server.url("/down"), &other, &mut |e| {
            if let DownloadEvent::Retrying { delay, .. } = e {
                pauses.push(*delay);
            }
        })
        .unwrap_err();
    assert_eq!(err.kind(), "transfer", "{err}");
    assert!(
        err.to_string().ends_with("HTTP 503 (after 4 attempts)"),
        "{err}"
    );
    assert_eq!(server.hits("/down"), 4);
    assert_eq!(
        pauses,
        [200, 400, 400].map(Duration::from_millis),
        "exponential, capped"
    );
    assert_eq!(cache_files(state.path()), [sha(&body)]);
}

#[test]
fn bodies_over_the_cap_are_aborted() {
    let pki = https_pki();
    let server = Server::start(Some(pki.server.clone()), standard_routes(artifact(10)));
    let state = tempfile::tempdir().unwrap();
    let dl = Downloader::new(config(state.path(), &pki)).unwrap();
    let any = sha(b"whatever");

    let err = dl
        .fetch(&server.url("/announced-huge"), &any, &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "too_large");
    assert!(
        err.to_string()
            .ends_with("body exceeds the limit of 1048576 bytes (announced 10485760)"),
        "{err}"
    );

    let mut seen = 0;
    let err = dl
        .fetch(&server.url("/unannounced-huge"), &any, &mut |e| {
            if let DownloadEvent::Progress { bytes, .. } = e {
                seen = *bytes;
            }
        })
        .unwrap_err();
    assert_eq!(err.kind(), "too_large");
    assert!(
        err.to_string()
            .ends_with("body exceeds the limit of 1048576 bytes"),
        "{err}"
    );
    assert!(seen <= 1 << 20, "stopped at the cap, saw {seen}");
    assert_eq!(server.hits("/announced-huge"), 1);
    assert_eq!(server.hits("/unannounced-huge"), 1);
    assert_eq!(cache_files(state.path()), Vec::<String>::new());
}

#[test]
fn plain_http_is_refused_unless_the_host_is_allowed() {
    let pki = https_pki();
    let body = artifact(4096);
    let plain = Server::start(None, standard_routes(body.clone()));
    let redirect_to = plain.url("/ok");
    let secure = Server::start(
        Some(pki.server.clone()),
        Arc::new(move |_, _| Reply::Full {
            status: 302,
            headers: vec![("Location", redirect_to.clone())],
            body: vec![],
        }),
    );
    let state = tempfile::tempdir().unwrap();
    let dl = Downloader::new(config(state.path(), &pki)).unwrap();

    let err = dl
        .fetch(&plain.url("/ok"), &sha(&body), &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "insecure_url");
    assert_eq!(
        err.to_string(),
        format!(
            "download {}: plain http to 127.0.0.1 is not allowed (https only)",
            plain.url("/ok")
        )
    );
    // Nor through a redirect from https.
    let err = dl
        .fetch(&secure.url("/start"), &sha(&body), &mut |_| {})
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("plain http to 127.0.0.1 is not allowed"),
        "{err}"
    );
    assert_eq!(
        secure.hits("/start"),
        1,
        "a refused redirect is not retried"
    );
    assert_eq!(plain.hits("/ok"), 0, "no plain request was made");

    let mut allowed = config(state.path(), &pki);
    allowed.http_allowed_hosts = vec!["127.0.0.1".to_string()];
    let dl = Downloader::new(allowed).unwrap();
    let got = dl
        .fetch(&plain.url("/ok"), &sha(&body), &mut |_| {})
        .unwrap();
    assert_eq!(std::fs::read(got.path).unwrap(), body);
    assert_eq!(plain.hits("/ok"), 1);
}

#[test]
fn an_untrusted_server_certificate_is_refused() {
    let pki = https_pki();
    let other = https_pki(); // a different CA
    let body = artifact(100);
    let server = Server::start(Some(pki.server.clone()), standard_routes(body.clone()));
    let state = tempfile::tempdir().unwrap();
    let mut c = config(state.path(), &other);
    c.retries = 0;
    let dl = Downloader::new(c).unwrap();
    let err = dl
        .fetch(&server.url("/ok"), &sha(&body), &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "transfer");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
    assert_eq!(cache_files(state.path()), Vec::<String>::new());

    let mut bad = DownloadConfig::new(state.path());
    bad.system_roots = false;
    bad.extra_ca_pem = vec![b"not a certificate".to_vec()];
    assert_eq!(Downloader::new(bad).unwrap_err().kind(), "tls_config");
}

#[test]
fn a_member_of_a_downloaded_tarball_is_extracted() {
    let pki = https_pki();
    let kubelet = artifact(300 * 1024);
    let archive = {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        {
            let mut tar = tar::Builder::new(&mut gz);
            for (path, data) in [
                ("kubernetes/node/bin/kubeadm", &b"kubeadm"[..]),
                ("kubernetes/node/bin/kubelet", &kubelet[..]),
            ] {
                let mut header = tar::Header::new_gnu();
                header.set_size(data.len() as u64);
                header.set_mode(0o755);
                header.set_entry_type(tar::EntryType::Regular);
                tar.append_data(&mut header, path, data).unwrap();
            }
            tar.finish().unwrap();
        }
        gz.finish().unwrap()
    };
    let served = archive.clone();
    let server = Server::start(Some(pki.server.clone()), Arc::new(move |_, _| ok(&served)));
    let state = tempfile::tempdir().unwrap();
    let dl = Downloader::new(config(state.path(), &pki)).unwrap();
    let got = dl
        .fetch(
            &server.url("/kubernetes-node-linux-amd64.tar.gz"),
            &sha(&archive),
            &mut |_| {},
        )
        .unwrap();
    let bytes = extract_tar_gz_member(
        &got.path,
        "kubernetes/node/bin/kubelet",
        ExtractLimits::default(),
    )
    .unwrap();
    assert_eq!(sha(&bytes), sha(&kubelet));
}

// === artifact changes through the binary ===

/// A sandbox node, the test CA in a file next to it, and a server.
struct PlanEnv {
    node: support::Node,
    ca: tempfile::NamedTempFile,
    server: Server,
}

impl PlanEnv {
    fn new(routes: Arc<Routes>) -> PlanEnv {
        let pki = https_pki();
        let ca = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(ca.path(), &pki.ca_pem).unwrap();
        PlanEnv {
            node: support::Node::new(),
            ca,
            server: Server::start(Some(pki.server.clone()), routes),
        }
    }

    /// `apply -o json --download-ca <test CA>` plus `extra`; exit code, JSON status (or
    /// `Null`), stderr.
    fn apply(&self, name: &str, plan: &str, extra: &[&str]) -> (i32, serde_json::Value, String) {
        let path = self.node.plan_file(name, plan);
        let mut args = vec![
            "apply",
            "--no-progress",
            "--no-chroot",
            "-o",
            "json",
            "--download-ca",
            self.ca.path().to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        args.push(path.to_str().unwrap());
        let out = self.node.agent(&args);
        let status = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        (
            out.status.code().unwrap_or(-1),
            status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

fn artifact_change(url: &str, sha256: &str, path: &str, extra: &str) -> String {
    format!("  - artifact: {{url: \"{url}\", sha256: \"{sha256}\", path: {path}{extra}}}\n")
}

fn artifact_plan(id: &str, changes: &str) -> String {
    format!("{}changes:\n{changes}", support::header(id))
}

/// A tarball with the given members.
fn tarball(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    {
        let mut tar = tar::Builder::new(&mut gz);
        for (path, data) in members {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o755);
            header.set_entry_type(tar::EntryType::Regular);
            tar.append_data(&mut header, path, *data).unwrap();
        }
        tar.finish().unwrap();
    }
    gz.finish().unwrap()
}

fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn artifact_plans_download_while_preparing_and_install_from_the_cache() {
    let kubelet = artifact(3 << 20);
    let kubeadm = artifact(200 * 1024).into_iter().rev().collect::<Vec<u8>>();
    let archive = tarball(&[
        ("kubernetes/node/bin/kubeadm", &kubeadm[..]),
        ("kubernetes/node/bin/kubelet", &kubelet[..]),
    ]);
    let (k, a) = (kubelet.clone(), archive.clone());
    let env = PlanEnv::new(Arc::new(move |path, _| match path {
        "/kubelet" => ok(&k),
        "/node.tar.gz" => ok(&a),
        _ => status(404),
    }));
    let changes = [
        artifact_change(
            &env.server.url("/kubelet"),
            &sha(&kubelet),
            "/usr/local/bin/kubelet",
            ", restartUnits: [kubelet.service]",
        ),
        artifact_change(
            &env.server.url("/node.tar.gz"),
            &sha(&archive),
            "/usr/local/bin/kubeadm",
            ", mode: \"0750\", extract: kubernetes/node/bin/kubeadm",
        ),
    ]
    .concat();
    let (code, status, err) = env.apply("1.yaml", &artifact_plan("a/1", &changes), &[]);
    assert_eq!(code, 0, "{status:#}\n{err}");
    let installed = env.node.path("/usr/local/bin/kubelet");
    assert_eq!(sha(&std::fs::read(&installed).unwrap()), sha(&kubelet));
    assert_eq!(mode_of(&installed), 0o755);
    let extracted = env.node.path("/usr/local/bin/kubeadm");
    assert_eq!(std::fs::read(&extracted).unwrap(), kubeadm);
    assert_eq!(mode_of(&extracted), 0o750);
    assert_eq!(
        status["changes"][0]["message"],
        format!(
            "write /usr/local/bin/kubelet from the artifact cache (sha256 {}, 0755 {}:{}); from {}",
            &sha(&kubelet)[..12],
            rustix::process::getuid().as_raw(),
            rustix::process::getgid().as_raw(),
            env.server.url("/kubelet")
        )
    );
    // The cache is in the node's state directory; the restart was computed (and skipped:
    // no service manager here).
    let cache = env.node.path("/var/lib/inplace-agent/cache/sha256");
    assert!(cache.join(sha(&kubelet)).is_file());
    assert!(
        cache.join(sha(&kubeadm)).is_file(),
        "the member is cached too"
    );
    let restarts: Vec<serde_json::Value> = support::journal(&env.node)
        .into_iter()
        .filter(|e| e["type"] == "unitJobDone")
        .collect();
    assert_eq!(restarts.len(), 1, "one computed restart");
    assert_eq!(
        restarts[0]["record"]["unitJobDone"]["unit"],
        "kubelet.service"
    );
    assert_eq!(restarts[0]["record"]["unitJobDone"]["outcome"], "skipped");
    assert_eq!(
        (env.server.hits("/kubelet"), env.server.hits("/node.tar.gz")),
        (1, 1)
    );

    // The same desired state again: unchanged, and no request at all.
    let before = env.node.snapshot_without_state();
    let (code, status, _) = env.apply("2.yaml", &artifact_plan("a/2", &changes), &[]);
    assert_eq!(code, 0, "{status:#}");
    for c in status["changes"].as_array().unwrap() {
        assert_eq!(c["state"], "Unchanged", "{c:#}");
    }
    assert_eq!(
        (env.server.hits("/kubelet"), env.server.hits("/node.tar.gz")),
        (1, 1)
    );
    assert!(support::diff(&before, &env.node.snapshot_without_state()).is_empty());

    // A dry run names what it cannot know before a download, and downloads nothing.
    let other = artifact_change(
        &env.server.url("/node.tar.gz"),
        &sha(&archive),
        "/usr/local/bin/kubelet",
        ", extract: kubernetes/node/bin/kubelet",
    );
    let plan = env.node.plan_file("3.yaml", &artifact_plan("a/3", &other));
    let out = env
        .node
        .agent(&["check", "-o", "json", plan.to_str().unwrap()]);
    assert!(out.status.success(), "{}", support::text(&out));
    let check: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(check["changes"][0]["result"], "wouldChange");
    assert!(
        check["changes"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("once the archive is downloaded"),
        "{check:#}"
    );
    assert_eq!(env.server.hits("/node.tar.gz"), 1);
}

#[test]
fn a_wrong_sha256_fails_the_plan_before_anything_on_the_node_changes() {
    let body = artifact(100 * 1024);
    let env = PlanEnv::new(standard_routes(body.clone()));
    let before = env.node.snapshot_without_state();
    let wrong = sha(b"not this");
    let changes = format!(
        "  - file: {{path: /etc/kubernetes/first.conf, content: \"x\"}}\n{}",
        artifact_change(&env.server.url("/ok"), &wrong, "/usr/local/bin/kubelet", "")
    );
    let (code, status, err) = env.apply("1.yaml", &artifact_plan("w/1", &changes), &[]);
    assert_eq!(code, 1, "{status:#}\n{err}");
    assert_eq!(status["phase"], "Failed", "nothing to roll back");
    assert_eq!(status["error"]["kind"], "download");
    assert_eq!(
        status["error"]["step"],
        "changes[1] artifact /usr/local/bin/kubelet"
    );
    assert_eq!(
        status["error"]["detail"],
        format!(
            "download {}: sha256 mismatch: expected {wrong}, got {}",
            env.server.url("/ok"),
            sha(&body)
        )
    );
    assert_eq!(status["changes"][0]["state"], "Skipped", "{status:#}");
    assert_eq!(status["changes"][1]["state"], "Failed");
    let after = env.node.snapshot_without_state();
    assert!(
        support::diff(&before, &after).is_empty(),
        "{:#?}",
        support::diff(&before, &after)
    );
    assert!(
        !support::journal(&env.node)
            .iter()
            .any(|e| e["type"] == "stepStarted"),
        "no mutation was even announced"
    );
    let cache = env.node.path("/var/lib/inplace-agent/cache/sha256");
    assert!(
        std::fs::read_dir(&cache).unwrap().next().is_none(),
        "nothing cached"
    );
}

#[test]
fn cut_and_failing_downloads_are_retried_through_a_plan() {
    let body = artifact(600 * 1024);
    let env = PlanEnv::new(standard_routes(body.clone()));
    let changes = [
        artifact_change(&env.server.url("/cut"), &sha(&body), "/usr/local/bin/a", ""),
        // The same content under another URL is a cache hit: no request at all.
        artifact_change(
            &env.server.url("/flaky"),
            &sha(&body),
            "/usr/local/bin/b",
            "",
        ),
    ]
    .concat();
    let (code, status, err) = env.apply("1.yaml", &artifact_plan("r/1", &changes), &[]);
    assert_eq!(code, 0, "{status:#}\n{err}");
    assert_eq!(env.server.hits("/cut"), 2, "cut once, then completed");
    assert_eq!(
        env.server.hits("/flaky"),
        0,
        "same sha256: served from the cache"
    );
    assert!(
        err.contains(&format!(
            "changes[0] artifact /usr/local/bin/a: download {}: attempt 1 failed (body cut after",
            env.server.url("/cut")
        )),
        "the retry is shown: {err}"
    );
    assert_eq!(
        std::fs::read(env.node.path("/usr/local/bin/a")).unwrap(),
        body
    );
    assert_eq!(
        std::fs::read(env.node.path("/usr/local/bin/b")).unwrap(),
        body
    );

    // 500 then 200, for content not cached yet.
    let other = artifact(10 * 1024);
    let env = PlanEnv::new(standard_routes(other.clone()));
    let change = artifact_change(
        &env.server.url("/flaky"),
        &sha(&other),
        "/usr/local/bin/c",
        "",
    );
    let started = Instant::now();
    let (code, status, err) = env.apply("2.yaml", &artifact_plan("r/2", &change), &[]);
    assert_eq!(code, 0, "{status:#}\n{err}");
    assert_eq!(env.server.hits("/flaky"), 2);
    assert!(
        err.contains("attempt 1 failed (HTTP 500); trying again in 1.0s"),
        "{err}"
    );
    assert!(started.elapsed() >= Duration::from_secs(1), "backed off");
    assert_eq!(
        std::fs::read(env.node.path("/usr/local/bin/c")).unwrap(),
        other
    );
}

#[test]
fn a_body_over_the_cap_aborts_the_plan() {
    let env = PlanEnv::new(standard_routes(artifact(10)));
    let change = artifact_change(
        &env.server.url("/announced-2g"),
        &sha(b"whatever"),
        "/usr/local/bin/kubelet",
        "",
    );
    let (code, status, _) = env.apply("1.yaml", &artifact_plan("c/1", &change), &[]);
    assert_eq!(code, 1, "{status:#}");
    assert_eq!(status["error"]["kind"], "download");
    assert_eq!(
        status["error"]["detail"],
        format!(
            "download {}: body exceeds the limit of 1073741824 bytes (announced 2147483648)",
            env.server.url("/announced-2g")
        )
    );
    assert_eq!(env.server.hits("/announced-2g"), 1, "not retried");
    assert!(!env.node.path("/usr/local/bin/kubelet").exists());
}

#[test]
fn plain_http_to_a_host_not_allowed_is_an_invalid_plan() {
    let body = artifact(4096);
    let env = PlanEnv::new(standard_routes(body.clone()));
    let plain = Server::start(None, standard_routes(body.clone()));
    let change = artifact_change(&plain.url("/ok"), &sha(&body), "/usr/local/bin/tool", "");
    let (code, status, err) = env.apply("1.yaml", &artifact_plan("h/1", &change), &[]);
    assert_eq!(code, 2, "{status:#}\n{err}");
    assert_eq!(status["kind"], "InvalidPlan");
    assert_eq!(
        status["errors"][0]["message"],
        "plain http to 127.0.0.1 is not allowed; use https, or allow the host with \
         --allow-http-host 127.0.0.1 (apply, check) or in plans.allow_http_hosts of the agent's \
         configuration (serve)"
    );
    assert!(
        !env.node.path("/var/lib/inplace-agent").exists(),
        "no trace at all"
    );
    assert_eq!(plain.hits("/ok"), 0);

    let (code, status, err) = env.apply(
        "1.yaml",
        &artifact_plan("h/1", &change),
        &["--allow-http-host", "127.0.0.1"],
    );
    assert_eq!(code, 0, "{status:#}\n{err}");
    assert_eq!(
        std::fs::read(env.node.path("/usr/local/bin/tool")).unwrap(),
        body
    );
}

#[test]
fn a_replaced_binary_is_restored_byte_for_byte_on_rollback() {
    let new = artifact(3 << 20);
    let env = PlanEnv::new(standard_routes(new.clone()));
    let old: Vec<u8> = artifact(5 << 20).into_iter().map(|b| b ^ 0x5a).collect();
    let target = env.node.path("/usr/local/bin/kubelet");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    std::fs::write(&target, &old).unwrap();
    std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let before = env.node.snapshot_without_state();
    let plan = format!(
        "{}verify:\n  - command: {{argv: [sh, -c, \"exit 1\"], timeoutSeconds: 1}}\n",
        artifact_plan(
            "b/1",
            &artifact_change(
                &env.server.url("/ok"),
                &sha(&new),
                "/usr/local/bin/kubelet",
                ""
            ),
        )
    );
    let (code, status, err) = env.apply("1.yaml", &plan, &[]);
    assert_eq!(code, 1, "{status:#}\n{err}");
    assert_eq!(status["phase"], "RolledBack");
    assert_eq!(status["changes"][0]["state"], "RolledBack");
    let after = env.node.snapshot_without_state();
    assert!(
        support::diff(&before, &after).is_empty(),
        "{:#?}",
        support::diff(&before, &after)
    );
    assert_eq!(mode_of(&target), 0o700);
}

/// A symlink planted after admission, while the plan downloads (the reproduction: file
/// `/etc/kubernetes/a.conf`, an artifact whose download is held open, file
/// `/etc/kubernetes/L/pwned`; `ln -s /root <root>/etc/kubernetes/L` during the download):
/// the write through it fails when it happens, nothing appears outside the allow-list, and
/// the plan rolls back naming the symlink.
#[test]
fn a_symlink_planted_during_the_download_leads_no_write_outside_the_allow_list() {
    let body = artifact(4096);
    let release = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let gate = release.clone();
    let b = body.clone();
    let env = PlanEnv::new(Arc::new(move |path, _| {
        if path == "/held" {
            let (lock, cv) = &*gate;
            let mut open = lock.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
        }
        ok(&b)
    }));
    std::fs::create_dir_all(env.node.path("/root")).unwrap();
    let plan = artifact_plan(
        "s/1",
        &format!(
            "  - file: {{path: /etc/kubernetes/a.conf, content: \"a\\n\"}}\n{}  - file: {{path: /etc/kubernetes/L/pwned, content: \"x\\n\"}}\n",
            artifact_change(
                &env.server.url("/held"),
                &sha(&body),
                "/usr/local/bin/tool",
                ""
            )
        ),
    );
    let path = env.node.plan_file("1.yaml", &plan);
    let child = std::process::Command::new(support::bin())
        .args([
            "apply",
            "--no-progress",
            "--no-chroot",
            "-o",
            "json",
            "--download-ca",
        ])
        .arg(env.ca.path())
        .arg("--root")
        .arg(env.node.root())
        .arg(&path)
        .env("INPLACE_AGENT_SERVICES", "off")
        .env("INPLACE_AGENT_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while env.server.hits("/held") == 0 {
        assert!(Instant::now() < deadline, "the download never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::os::unix::fs::symlink("/root", env.node.path("/etc/kubernetes/L")).unwrap();
    {
        let (lock, cv) = &*release;
        *lock.lock().unwrap() = true;
        cv.notify_all();
    }
    let out = child.wait_with_output().unwrap();
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(out.status.code(), Some(1), "{status:#}");
    assert!(
        !env.node.path("/root/pwned").exists(),
        "written outside the allow-list"
    );
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    assert_eq!(
        status["error"]["step"],
        "changes[2] file /etc/kubernetes/L/pwned"
    );
    let detail = status["error"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("/etc/kubernetes/L is a symlink to /root")
            && detail.contains("never follows symlinks below an allow-listed directory"),
        "{detail}"
    );
    assert!(
        !env.node.path("/etc/kubernetes/a.conf").exists(),
        "rolled back"
    );
    assert!(
        !env.node.path("/usr/local/bin/tool").exists(),
        "rolled back"
    );
}
