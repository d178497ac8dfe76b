//! kubelet-standin: a TEST AND DEMO STAND-IN for the kubelet. It is not a kubelet and runs
//! no pods.
//!
//! No real kubelet can be installed on the machines the tests run on, so the tests install
//! it as `/usr/local/bin/kubelet` in a sandboxed node: the `kubelet-standin` program
//! (`tests/kubelet-standin/standin.rs`, a `main` that calls [`run`]), or, in `inplace-agent
//! demo --systemd`, the agent's own binary through its hidden `kubelet-standin` subcommand.
//! It behaves like a kubelet in the ways the agent can observe:
//!
//! - `--version` prints `Kubernetes v1.30.4`. The version comes from, in order: the
//!   environment variable `KUBELET_STANDIN_VERSION`; a file next to the binary named like it
//!   plus `.version` (`/usr/local/bin/kubelet.version`), so a package test can ship a "newer
//!   kubelet" by shipping this binary with a different version file (the binary is found by
//!   `/proc/self/exe`, else by the path it was started by); the compile-time
//!   `KUBELET_STANDIN_VERSION`; `v1.30.4`.
//! - Otherwise it reads `--config` (default `/var/lib/kubelet/config.yaml`) and refuses to
//!   start (exit 1, reason on stderr and as the systemd `STATUS=`) when the file is missing,
//!   is not a YAML mapping with `kind: KubeletConfiguration`, has an `apiVersion` outside
//!   `kubelet.config.k8s.io`, or has a `maxPods` that is not a positive integer.
//! - Then it serves `GET /healthz` → `200 ok` on `healthzBindAddress:healthzPort` (default
//!   `127.0.0.1:10248`; `--healthz-port` overrides the config, as kubelet flags do), tells
//!   systemd `READY=1` when started under `Type=notify`, and runs until killed.
//! - Every other flag kubeadm passes (`--container-runtime-endpoint=...`, `--node-labels`...)
//!   is accepted and ignored.
//! - For tests that count starts and need slow ones: with `KUBELET_STANDIN_START_LOG=FILE`
//!   each start appends a line to FILE (`<$INVOCATION_ID> ok|refused ...`), and with
//!   `KUBELET_STANDIN_READY_DELAY_MS=N` it waits N ms before it reports ready.
//!
//! The config reader is deliberately minimal: it looks at top-level `key: value` lines only
//! (nested blocks and block sequences under a key are skipped), which covers the files
//! kubeadm writes and the agent's merge patches. JSON configs are not understood.

use std::env;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::thread;
use std::time::Duration;

const DEFAULT_VERSION: &str = match option_env!("KUBELET_STANDIN_VERSION") {
    Some(v) => v,
    None => "v1.30.4",
};
const DEFAULT_CONFIG: &str = "/var/lib/kubelet/config.yaml";
const DEFAULT_HEALTHZ_PORT: u16 = 10248;

/// Runs the stand-in with the kubelet's command-line arguments (without the program name).
pub fn run(args: &[String]) -> ExitCode {
    let flags = match Flags::parse(args) {
        Ok(flags) => flags,
        Err(msg) => return fail(&msg),
    };
    if flags.help {
        println!(
            "kubelet-standin (a test stand-in for the kubelet)\n\
             usage: kubelet [--version] [--config=PATH] [--healthz-port=N] [other kubelet flags, ignored]"
        );
        return ExitCode::SUCCESS;
    }
    if flags.version {
        return match version() {
            Ok(v) => {
                println!("Kubernetes {v}");
                ExitCode::SUCCESS
            }
            Err(msg) => fail(&msg),
        };
    }
    let config_path = flags
        .config
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
    let config = match fs::read_to_string(&config_path) {
        Ok(text) => match Config::parse(&text) {
            Ok(config) => config,
            Err(msg) => return fail(&format!("invalid config {}: {msg}", config_path.display())),
        },
        Err(err) => return fail(&format!("read config {}: {err}", config_path.display())),
    };
    let port = flags
        .healthz_port
        .or(config.healthz_port)
        .unwrap_or(DEFAULT_HEALTHZ_PORT);
    let address = SocketAddr::new(config.healthz_bind_address, port);
    let version = match version() {
        Ok(v) => v,
        Err(msg) => return fail(&msg),
    };
    if port == 0 {
        // Like the kubelet: healthzPort 0 turns the health endpoint off.
        let status = format!("kubelet-standin {version}: running, healthz disabled");
        log_start(&format!("ok {status}"));
        eprintln!("{status}");
        notify(&format!("READY=1\nSTATUS={status}"));
        loop {
            thread::park();
        }
    }
    let listener = match TcpListener::bind(address) {
        Ok(l) => l,
        Err(err) => return fail(&format!("listen on {address}: {err}")),
    };
    let status = format!(
        "kubelet-standin {version}: serving /healthz on {address} (config {}{})",
        config_path.display(),
        config
            .max_pods
            .map(|n| format!(", maxPods {n}"))
            .unwrap_or_default()
    );
    if let Some(ms) = env::var("KUBELET_STANDIN_READY_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        thread::sleep(Duration::from_millis(ms));
    }
    log_start(&format!("ok {status}"));
    eprintln!("{status}");
    notify(&format!("READY=1\nSTATUS={status}"));
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                thread::spawn(move || {
                    if let Err(err) = serve(stream) {
                        eprintln!("kubelet-standin: healthz connection: {err}");
                    }
                });
            }
            Err(err) => eprintln!("kubelet-standin: accept: {err}"),
        }
    }
    ExitCode::SUCCESS
}

/// Appends a line about this start to `$KUBELET_STANDIN_START_LOG`, if set (best effort).
fn log_start(line: &str) {
    let Ok(path) = env::var("KUBELET_STANDIN_START_LOG") else {
        return;
    };
    let invocation = env::var("INVOCATION_ID").unwrap_or_else(|_| "-".to_string());
    let appended = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{invocation} {line}"));
    if let Err(err) = appended {
        eprintln!("kubelet-standin: start log {path}: {err}");
    }
}

/// Prints why we refuse to run, tells systemd too, and exits 1 (as the kubelet does).
fn fail(msg: &str) -> ExitCode {
    log_start(&format!("refused {msg}"));
    eprintln!("kubelet-standin: refusing to start: {msg}");
    notify(&format!("STATUS=refusing to start: {msg}"));
    ExitCode::FAILURE
}

/// The version to report (see the module docs for where it comes from).
fn version() -> Result<String, String> {
    if let Ok(v) = env::var("KUBELET_STANDIN_VERSION") {
        return check_version(v.trim(), "KUBELET_STANDIN_VERSION");
    }
    if let Some(exe) = own_path() {
        let mut file = exe.into_os_string();
        file.push(".version");
        let file = PathBuf::from(file);
        match fs::read_to_string(&file) {
            Ok(text) => return check_version(text.trim(), &file.display().to_string()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(format!("read {}: {err}", file.display())),
        }
    }
    Ok(DEFAULT_VERSION.to_string())
}

/// The path of this program: `/proc/self/exe`, or, when that cannot be read, the path it was
/// started by (`argv[0]`, looked up on `PATH` when it has no `/`). `/proc/self` does not
/// resolve for a process outside the PID namespace of the `/proc` it sees — as when the agent
/// runs a sandboxed node's kubelet chrooted into `/proc/<pid>/root` from the host.
fn own_path() -> Option<PathBuf> {
    if let Ok(exe) = env::current_exe() {
        return Some(exe);
    }
    let arg0 = PathBuf::from(env::args_os().next()?);
    if arg0.components().count() > 1 {
        return Some(arg0);
    }
    env::split_paths(&env::var_os("PATH")?)
        .map(|dir| dir.join(&arg0))
        .find(|p| p.is_file())
}

fn check_version(v: &str, from: &str) -> Result<String, String> {
    let rest = v.strip_prefix('v').unwrap_or("");
    let numeric = rest.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = numeric.split('.').collect();
    if parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        Ok(v.to_string())
    } else {
        Err(format!("version {v:?} from {from} is not like v1.30.4"))
    }
}

/// Sends a notification to systemd when started with `NOTIFY_SOCKET` (best effort).
fn notify(message: &str) {
    let Ok(socket) = env::var("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let sent = if let Some(name) = socket.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|addr| sock.send_to_addr(message.as_bytes(), &addr))
    } else {
        sock.send_to(message.as_bytes(), Path::new(&socket))
    };
    if let Err(err) = sent {
        eprintln!("kubelet-standin: notify systemd: {err}");
    }
}

/// Answers one HTTP/1.x request: `GET /healthz` → 200 `ok`, anything else 404/405.
fn serve(mut stream: TcpStream) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut request_line = head.lines().next().unwrap_or("").split_whitespace();
    let method = request_line.next().unwrap_or("");
    let target = request_line.next().unwrap_or("");
    let path = target.split('?').next().unwrap_or("");
    let (status, body) = match (method, path) {
        ("GET" | "HEAD", "/healthz") => ("200 OK", "ok"),
        ("GET" | "HEAD", _) => ("404 Not Found", "404 page not found\n"),
        _ => ("405 Method Not Allowed", "method not allowed\n"),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n\
         X-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        response.push_str(body);
    }
    stream.write_all(response.as_bytes())?;
    stream.flush()
}

/// The command-line flags the stand-in acts on; all others are accepted and ignored.
#[derive(Debug, Default, PartialEq)]
struct Flags {
    version: bool,
    help: bool,
    config: Option<PathBuf>,
    healthz_port: Option<u16>,
}

impl Flags {
    fn parse(args: &[String]) -> Result<Flags, String> {
        let mut flags = Flags::default();
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            i += 1;
            let Some(body) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
                continue; // kubelet takes no positional arguments; ignore stray words
            };
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            // A flag's value is `--flag=value`, or the next word when it is not a flag.
            let value = |i: &mut usize| -> Option<String> {
                inline.clone().or_else(|| {
                    let next = args.get(*i).filter(|a| !a.starts_with('-'))?;
                    *i += 1;
                    Some(next.clone())
                })
            };
            match name {
                "version" => {
                    flags.version = inline.as_deref().is_none_or(|v| v != "false");
                }
                "h" | "help" => flags.help = true,
                "config" => {
                    let v = value(&mut i).ok_or("flag --config needs a value")?;
                    flags.config = Some(PathBuf::from(v));
                }
                "healthz-port" => {
                    let v = value(&mut i).ok_or("flag --healthz-port needs a value")?;
                    let port = v
                        .parse::<u16>()
                        .map_err(|_| format!("flag --healthz-port: {v:?} is not a port"))?;
                    flags.healthz_port = Some(port);
                }
                _ => {
                    // Ignored kubelet flag; swallow its value when given as a separate word.
                    if inline.is_none() && args.get(i).is_some_and(|a| !a.starts_with('-')) {
                        i += 1;
                    }
                }
            }
        }
        Ok(flags)
    }
}

/// What the stand-in takes from the kubelet configuration file.
#[derive(Debug, PartialEq)]
struct Config {
    max_pods: Option<u32>,
    healthz_port: Option<u16>,
    healthz_bind_address: IpAddr,
}

impl Config {
    /// Reads the top-level keys of a YAML mapping, line by line.
    fn parse(text: &str) -> Result<Config, String> {
        let mut keys: Vec<(String, String)> = Vec::new();
        let mut in_block_value = false;
        let mut seen_document = false;
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim_end_matches('\r');
            let lineno = n + 1;
            let trimmed = line.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            if line == "---" || line.starts_with("--- ") {
                if seen_document {
                    return Err(format!("line {lineno}: more than one YAML document"));
                }
                continue;
            }
            if line == "..." {
                break;
            }
            seen_document = true;
            if line.starts_with([' ', '\t']) {
                if keys.is_empty() {
                    return Err(format!("line {lineno}: not a YAML mapping"));
                }
                continue; // nested content of the previous key
            }
            if line.starts_with("- ") || line == "-" {
                // A block sequence at column 0 is allowed as the value of the previous key
                // (kubeadm writes `clusterDNS:\n- 10.96.0.10`), never as the document.
                if keys.is_empty() || !in_block_value {
                    return Err(format!("line {lineno}: not a YAML mapping"));
                }
                continue;
            }
            if line.starts_with(['{', '[']) {
                return Err(format!(
                    "line {lineno}: flow-style (JSON) configs are not supported by the stand-in"
                ));
            }
            let Some((key, value)) = split_key(line) else {
                return Err(format!(
                    "line {lineno}: not a YAML mapping (expected `key: value`)"
                ));
            };
            if keys.iter().any(|(k, _)| *k == key) {
                return Err(format!("line {lineno}: duplicate key {key:?}"));
            }
            in_block_value = value.is_empty();
            keys.push((key, value));
        }
        let get = |name: &str| {
            keys.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        match get("kind") {
            Some(kind) if unquote(kind) == "KubeletConfiguration" => {}
            Some(kind) => return Err(format!("kind is {kind:?}, want KubeletConfiguration")),
            None => return Err("no `kind: KubeletConfiguration`".to_string()),
        }
        if let Some(api) = get("apiVersion") {
            if !unquote(api).starts_with("kubelet.config.k8s.io/") {
                return Err(format!(
                    "apiVersion {api:?} is not kubelet.config.k8s.io/..."
                ));
            }
        }
        let max_pods = match get("maxPods") {
            None => None,
            Some(v) => match v.parse::<u32>() {
                Ok(n) if n > 0 && v.bytes().all(|b| b.is_ascii_digit()) => Some(n),
                _ => return Err(format!("maxPods {v:?} is not a positive integer")),
            },
        };
        let healthz_port = match get("healthzPort") {
            None => None,
            Some(v) => Some(
                v.parse::<u16>()
                    .map_err(|_| format!("healthzPort {v:?} is not a port number"))?,
            ),
        };
        let healthz_bind_address = match get("healthzBindAddress") {
            None => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Some(v) => unquote(v)
                .parse()
                .map_err(|_| format!("healthzBindAddress {v:?} is not an IP address"))?,
        };
        Ok(Config {
            max_pods,
            healthz_port,
            healthz_bind_address,
        })
    }
}

/// Splits `key: value` (or `key:`) into the unquoted key and the value without a trailing
/// comment; `None` when the line is not a mapping entry.
fn split_key(line: &str) -> Option<(String, String)> {
    let (key, value) = if let Some(key) = line.strip_suffix(':') {
        (key, "")
    } else {
        let at = line.find(": ")?;
        (&line[..at], &line[at + 2..])
    };
    let key = unquote(key.trim());
    if key.is_empty() || key.contains(": ") {
        return None;
    }
    let value = match value.find(" #") {
        Some(at) => &value[..at],
        None => value,
    };
    Some((key.to_string(), value.trim().to_string()))
}

/// Strips one pair of matching YAML quotes.
fn unquote(s: &str) -> &str {
    for q in ['"', '\''] {
        if s.len() >= 2 && s.starts_with(q) && s.ends_with(q) {
            return &s[1..s.len() - 1];
        }
    }
    s
}
