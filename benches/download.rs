//! Download throughput of the artifact downloader against `curl`, fetching the same file from
//! the same local HTTPS server in the same run (target: at least 0.9× curl).
//!
//! `cargo bench --bench download [-- SIZE_MIB [ROUNDS]]` (default 512 MiB, 7 rounds). Both
//! clients write into the same directory (`BENCH_DIR`, default the temp directory); ours also
//! hashes (sha256) as it goes and renames into the cache, as it does in production. Each
//! round runs both back to back; the figure is the median of the rounds' ratios. Prints one
//! line per round and a summary; exits 1 when the target is missed.

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inplace_agent::host::download::{DownloadConfig, Downloader};
use sha2::{Digest, Sha256};
use support::pki::{HttpsPki, https_pki};

/// Serves `body` for every GET, one thread per connection, HTTP/1.1 with Content-Length.
fn serve(listener: TcpListener, tls: Arc<rustls::ServerConfig>, body: Arc<Vec<u8>>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (tls, body) = (tls.clone(), body.clone());
        std::thread::spawn(move || {
            let _ = respond(stream, tls, &body);
        });
    }
}

fn respond(stream: TcpStream, tls: Arc<rustls::ServerConfig>, body: &[u8]) -> std::io::Result<()> {
    let conn = rustls::ServerConnection::new(tls).map_err(std::io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(conn, stream);
    let mut reader = BufReader::new(&mut tls);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: application/octet-stream\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes())?;
    for chunk in body.chunks(256 * 1024) {
        tls.write_all(chunk)?;
    }
    tls.conn.send_close_notify();
    tls.flush()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let all: Vec<String> = std::env::args().skip(1).collect();
    // `--json FILE` writes the figures for the performance suite (benches/run).
    let json_out = all
        .windows(2)
        .find(|w| w[0] == "--json")
        .map(|w| w[1].clone());
    let args: Vec<String> = all
        .iter()
        .filter(|a| !a.starts_with("--") && Some(*a) != json_out.as_ref())
        .cloned()
        .collect();
    let mib: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(512);
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(7);
    let body: Vec<u8> = (0..mib << 20).map(|i| (i * 31 % 251) as u8).collect();
    let sha = hex::encode(Sha256::digest(&body));
    let HttpsPki {
        ca_pem,
        server: tls,
    } = https_pki();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://{}/artifact", listener.local_addr().unwrap());
    let body = Arc::new(body);
    std::thread::spawn(move || serve(listener, tls, body));

    // BENCH_DIR picks the filesystem both clients write to (default: the temp directory).
    let dir = std::env::var_os("BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
    let work = tempfile::tempdir_in(dir).unwrap();
    let ca = work.path().join("ca.pem");
    std::fs::write(&ca, &ca_pem).unwrap();
    let mut config = DownloadConfig::new(work.path().join("state"));
    config.system_roots = false;
    config.extra_ca_pem = vec![ca_pem.into_bytes()];
    config.retries = 0;

    println!(
        "download benchmark: {mib} MiB over TLS from 127.0.0.1, {rounds} rounds, into {}",
        work.path().display()
    );
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        // Who goes first alternates, so neither always meets a warmer page cache.
        let (t_ours, t_curl) = if round % 2 == 1 {
            let a = ours_once(&config, &url, &sha, work.path(), mib);
            (a, curl_once(&url, &ca, work.path(), mib))
        } else {
            let b = curl_once(&url, &ca, work.path(), mib);
            (ours_once(&config, &url, &sha, work.path(), mib), b)
        };
        let rate = |t: Duration| mib as f64 / t.as_secs_f64();
        println!(
            "round {round}: inplace-agent {:>7.1} MiB/s ({:.2}s), curl {:>7.1} MiB/s ({:.2}s)",
            rate(t_ours),
            t_ours.as_secs_f64(),
            rate(t_curl),
            t_curl.as_secs_f64()
        );
        ours.push(rate(t_ours));
        theirs.push(rate(t_curl));
    }
    // Each round's two downloads run back to back, so their ratio is the least disturbed by
    // other load on the machine; the median of those ratios is the figure.
    let paired = median(ours.iter().zip(&theirs).map(|(a, b)| a / b).collect());
    let (a, b) = (median(ours.clone()), median(theirs.clone()));
    let ratio = paired;
    println!(
        "median: inplace-agent {a:.1} MiB/s, curl {b:.1} MiB/s; median ratio of the rounds \
         {ratio:.2} (target >= 0.90)"
    );
    if let Some(path) = json_out {
        let figures = serde_json::json!({
            "mib": mib, "rounds": rounds,
            "oursMiBps": a, "curlMiBps": b, "ratio": ratio,
            "ratioMin": ours.iter().zip(&theirs).map(|(x, y)| x / y).fold(f64::INFINITY, f64::min),
            "ratioMax": ours.iter().zip(&theirs).map(|(x, y)| x / y).fold(0.0, f64::max),
        });
        std::fs::write(&path, format!("{figures:#}\n")).unwrap();
    }
    drop(work);
    if ratio < 0.9 {
        std::process::exit(1);
    }
}

/// Times one download of ours: a fresh downloader and an empty cache (production builds the
/// client once, and the content is not cached yet when it downloads).
fn ours_once(config: &DownloadConfig, url: &str, sha: &str, work: &Path, mib: usize) -> Duration {
    let _ = std::fs::remove_dir_all(work.join("state"));
    let started = Instant::now();
    let downloader = Downloader::new(config.clone()).unwrap();
    let got = downloader.fetch(url, sha, &mut |_| {}).unwrap();
    let elapsed = started.elapsed();
    assert!(!got.from_cache && got.size == (mib << 20) as u64);
    elapsed
}

/// Times one download by curl into the same directory.
fn curl_once(url: &str, ca: &Path, work: &Path, mib: usize) -> Duration {
    let out = work.join("curl.out");
    let _ = std::fs::remove_file(&out);
    let elapsed = curl(url, ca, &out);
    assert_eq!(std::fs::metadata(&out).unwrap().len(), (mib << 20) as u64);
    elapsed
}

/// Times `curl` fetching `url` into `out`.
fn curl(url: &str, ca: &Path, out: &Path) -> Duration {
    let started = Instant::now();
    let status = Command::new("curl")
        .args(["-sS", "--fail", "--cacert"])
        .arg(ca)
        .arg("-o")
        .arg(out)
        .arg(url)
        .status()
        .expect("run curl");
    let elapsed = started.elapsed();
    assert!(status.success(), "curl failed: {status}");
    elapsed
}
