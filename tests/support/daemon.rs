//! A daemon under test (`inplace-agent serve`, `inplace-updater serve`): started, waited for
//! until it serves, its log kept, stopped with SIGKILL or SIGTERM, its memory read.
//!
//! "Serves" is what the daemon says: a stderr line `... listening on ADDR` (the agent's and
//! the updater's first info line), read from a pipe or from a file, or the agent's `READY=1`
//! on a notify socket (`NOTIFY_SOCKET`, with `... serving on ADDR` in its status).

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inplace_api::pki::DEFAULT_UPDATER_IDENTITY;

use super::memory::Memory;
use super::patience::{deadline, patience};

/// The agent binary a bench measures: `INPLACE_AGENT_BIN` when set (two builds compared
/// side by side), else the one cargo built for the bench.
pub fn agent_under_test() -> PathBuf {
    std::env::var_os("INPLACE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            super::programs::check_fresh();
            PathBuf::from(super::programs::AGENT)
        })
}

/// `inplace-agent serve` (the program `bin`) for `node` on `root`: no configuration file,
/// the server certificate `cert`/`key`, client certificates checked against `client_ca`, the
/// updater's identity as admin; none of the agent's or systemd's variables of this process
/// reach it. The caller adds `--listen`, `--no-chroot`, `--reader` and the rest.
pub fn serve_command(
    bin: &Path,
    root: &Path,
    node: &str,
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--config", "/dev/null", "--root"])
        .arg(root)
        .args(["--node-name", node, "--tls-cert"])
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .arg("--client-ca")
        .arg(client_ca)
        .args(["--admin", DEFAULT_UPDATER_IDENTITY]);
    for var in [
        "INPLACE_AGENT_ROOT",
        "INPLACE_AGENT_STATE_DIR",
        "INPLACE_AGENT_CONFIG",
        "INPLACE_AGENT_SERVICES",
        "INPLACE_AGENT_CRASH_AT",
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "JOURNAL_STREAM",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Raises this process's soft open-file limit to the hard one, for a program that starts many
/// daemons (each a child with pipes or a notify socket) and holds a connection to each.
pub fn raise_nofile() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    if let Some(max) = getrlimit(Resource::Nofile).maximum {
        let _ = setrlimit(
            Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(max),
                maximum: Some(max),
            },
        );
    }
}

/// How to tell that a daemon serves.
pub enum Ready {
    /// A stderr line with `listening on ADDR`; stderr is kept as the log.
    Log,
    /// The same, with stderr written to this file (the log is the file).
    LogFile(PathBuf),
    /// `READY=1` on a notify socket bound at this path (`NOTIFY_SOCKET` is set for the
    /// daemon); the address from its `serving on ADDR`. Stderr is not kept.
    Notify(PathBuf),
}

/// What dropping a [`Daemon`] does to its process.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnDrop {
    /// SIGKILL (a test is over: nothing of the daemon's matters any more).
    Kill,
    /// SIGTERM, then SIGKILL if it has not exited within [`patience`] (a bench that measures
    /// a daemon that shuts down as in production).
    Term,
}

enum Log {
    Lines(Arc<Mutex<Vec<String>>>),
    File(PathBuf),
    None,
}

/// A running daemon; stopped when dropped (see [`OnDrop`]).
pub struct Daemon {
    pub child: Child,
    /// The address it said it serves on.
    pub addr: String,
    /// From spawn until it said it serves.
    pub ready_after: Duration,
    log: Log,
    /// Hears when the stderr reader is done (the pipe closed).
    drained: Option<Receiver<()>>,
    on_drop: OnDrop,
}

/// A daemon spawned and not yet known to serve (see [`Starting::wait`]).
pub struct Starting {
    daemon: Daemon,
    spawned: Instant,
    wait: Wait,
}

enum Wait {
    Line(Receiver<String>),
    File(PathBuf),
    Notify(UnixDatagram),
}

/// The address in `text` after `marker`, up to a space, a quote or a separator.
fn address_after(text: &str, marker: &str) -> Option<String> {
    let rest = text.split(marker).nth(1)?;
    let addr: String = rest
        .chars()
        .take_while(|c| !c.is_whitespace() && !matches!(c, '"' | ';' | ','))
        .collect();
    (!addr.is_empty()).then_some(addr)
}

impl Daemon {
    /// Spawns `cmd` and waits until it serves ([`Daemon::spawn`], then [`Starting::wait`]).
    pub fn start(cmd: Command, ready: Ready) -> Result<Daemon, String> {
        Daemon::spawn(cmd, ready)?.wait()
    }

    /// Spawns `cmd` (stdin and stdout closed, stderr as `ready` needs) without waiting, so
    /// that several can start at once.
    pub fn spawn(mut cmd: Command, ready: Ready) -> Result<Starting, String> {
        let what = cmd.get_program().to_string_lossy().into_owned();
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        let spawn = |cmd: &mut Command| cmd.spawn().map_err(|e| format!("start {what}: {e}"));
        let spawned = Instant::now();
        let (child, log, drained, wait) = match ready {
            Ready::Log => {
                let mut child = spawn(cmd.stderr(Stdio::piped()))?;
                let stderr = child.stderr.take().ok_or("no stderr pipe")?;
                let lines = Arc::new(Mutex::new(Vec::new()));
                let (found, heard) = std::sync::mpsc::channel();
                let (done, drained) = std::sync::mpsc::channel();
                let kept = lines.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stderr).lines() {
                        let Ok(line) = line else { break };
                        if line.contains("listening on ") {
                            let _ = found.send(line.clone());
                        }
                        kept.lock().unwrap().push(line);
                    }
                    let _ = done.send(());
                });
                (child, Log::Lines(lines), Some(drained), Wait::Line(heard))
            }
            Ready::LogFile(path) => {
                let file = std::fs::File::create(&path)
                    .map_err(|e| format!("create {}: {e}", path.display()))?;
                let child = spawn(cmd.stderr(file))?;
                (child, Log::File(path.clone()), None, Wait::File(path))
            }
            Ready::Notify(path) => {
                let _ = std::fs::remove_file(&path);
                let socket = UnixDatagram::bind(&path)
                    .map_err(|e| format!("bind notify socket {}: {e}", path.display()))?;
                socket
                    .set_read_timeout(Some(patience()))
                    .map_err(|e| format!("notify socket timeout: {e}"))?;
                let child = spawn(cmd.env("NOTIFY_SOCKET", &path).stderr(Stdio::null()))?;
                (child, Log::None, None, Wait::Notify(socket))
            }
        };
        Ok(Starting {
            daemon: Daemon {
                child,
                addr: String::new(),
                ready_after: Duration::ZERO,
                log,
                drained,
                on_drop: OnDrop::Kill,
            },
            spawned,
            wait,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it logged so far (empty with [`Ready::Notify`]).
    pub fn log(&self) -> String {
        match &self.log {
            Log::Lines(lines) => lines.lock().unwrap().join("\n"),
            Log::File(path) => std::fs::read_to_string(path).unwrap_or_default(),
            Log::None => String::new(),
        }
    }

    /// Its memory now.
    pub fn memory(&self) -> Memory {
        Memory::of(self.pid())
    }

    /// Sets what dropping it does.
    pub fn on_drop(mut self, on_drop: OnDrop) -> Daemon {
        self.on_drop = on_drop;
        self
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill9(&mut self) {
        self.child.kill().expect("kill -9 the daemon");
        self.child.wait().expect("wait for the daemon");
        self.drain();
    }

    /// Sends SIGTERM.
    pub fn signal_term(&self) {
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }

    /// Waits for the process to exit until `deadline`; its status (with all it logged in
    /// [`Daemon::log`]), or None if it still runs.
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.drain();
                    return Some(status);
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// Sends SIGTERM and waits for the process to exit; panics if it does not within
    /// [`patience`].
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal_term();
        self.wait_until(deadline())
            .unwrap_or_else(|| panic!("the daemon did not stop after SIGTERM:\n{}", self.log()))
    }

    /// Waits until the stderr reader has read all the exited process wrote.
    fn drain(&mut self) {
        if let Some(drained) = self.drained.take() {
            // A grandchild may hold the pipe open: do not wait for it for long.
            let _ = drained.recv_timeout(Duration::from_secs(1));
        }
    }

    /// Kills the process and collects what it logged until then (the log of a failure).
    fn kill_and_drain(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.drain();
        self.log()
    }
}

impl Starting {
    /// Waits until the daemon serves, for at most [`patience`]; the daemon, or why not (with
    /// its log).
    pub fn wait(mut self) -> Result<Daemon, String> {
        let what = self.daemon.child.id();
        let found = match &self.wait {
            Wait::Line(heard) => match heard.recv_timeout(patience()) {
                Ok(line) => address_after(&line, "listening on ")
                    .ok_or_else(|| format!("no address in {line:?}")),
                Err(RecvTimeoutError::Timeout) => {
                    Err(format!("did not start listening within {:?}", patience()))
                }
                Err(RecvTimeoutError::Disconnected) => Err("exited before listening".into()),
            },
            Wait::File(path) => {
                let deadline = deadline();
                loop {
                    let text = std::fs::read_to_string(path).unwrap_or_default();
                    if let Some(addr) = address_after(&text, "listening on ") {
                        break Ok(addr);
                    }
                    if let Ok(Some(status)) = self.daemon.child.try_wait() {
                        break Err(format!("exited before listening: {status}"));
                    }
                    if Instant::now() > deadline {
                        break Err(format!("did not start listening within {:?}", patience()));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            Wait::Notify(socket) => {
                let mut buf = [0u8; 4096];
                loop {
                    let n = match socket.recv(&mut buf) {
                        Ok(n) => n,
                        Err(e) => break Err(format!("no READY=1 within {:?}: {e}", patience())),
                    };
                    let text = String::from_utf8_lossy(&buf[..n]);
                    if text.lines().any(|l| l == "READY=1") {
                        break address_after(&text, "serving on ")
                            .ok_or_else(|| format!("READY=1 without an address: {text:?}"));
                    }
                }
            }
        };
        match found {
            Ok(addr) => {
                self.daemon.addr = addr;
                self.daemon.ready_after = self.spawned.elapsed();
                Ok(self.daemon)
            }
            Err(why) => {
                let log = self.daemon.kill_and_drain();
                Err(format!("daemon (pid {what}) {why}:\n{log}"))
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.on_drop == OnDrop::Term && matches!(self.child.try_wait(), Ok(None)) {
            self.signal_term();
            if self.wait_until(deadline()).is_some() {
                return;
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
