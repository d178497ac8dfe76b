//! Running node commands: argv only (never a shell string), optional chroot into the root,
//! a hard timeout that kills the whole process group, and bounded captured output.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// How to run one command.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    /// Program and arguments; `argv[0]` is looked up on `PATH` (inside the root when chrooted).
    pub argv: Vec<String>,
    /// Run inside this root with `chroot(8)`; `None` runs on the agent's own filesystem.
    pub chroot: Option<PathBuf>,
    /// Kill the command (and its process group) after this long.
    pub timeout: Duration,
    /// Keep at most this many bytes of stdout and of stderr (the tail is kept).
    pub max_output: usize,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
}

impl CommandSpec {
    /// A command with the default timeout (5 minutes) and output bound (64 KiB), not chrooted.
    pub fn new<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> CommandSpec {
        CommandSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            chroot: None,
            timeout: Duration::from_secs(300),
            max_output: 64 * 1024,
            env: Vec::new(),
        }
    }

    /// Runs inside `root` when it is not `/`.
    pub fn in_root(mut self, root: &Path) -> CommandSpec {
        self.chroot = (root != Path::new("/")).then(|| root.to_path_buf());
        self
    }

    /// Sets the timeout.
    pub fn timeout(mut self, timeout: Duration) -> CommandSpec {
        self.timeout = timeout;
        self
    }

    /// The command line as one string, for messages.
    pub fn display(&self) -> String {
        self.argv.join(" ")
    }
}

/// What a finished (or killed) command left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutput {
    /// Exit code; `None` when killed by a signal (including our timeout).
    pub code: Option<i32>,
    /// True when the timeout fired and the command was killed.
    pub timed_out: bool,
    /// Tail of stdout, lossily decoded.
    pub stdout: String,
    /// Tail of stderr, lossily decoded.
    pub stderr: String,
    /// How long it ran.
    pub elapsed: Duration,
}

impl CommandOutput {
    /// True when the command exited with status 0.
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }

    /// A one-line summary: "exit status 1: last line of stderr".
    pub fn summary(&self) -> String {
        let status = if self.timed_out {
            format!("timed out after {:.1}s", self.elapsed.as_secs_f64())
        } else {
            match self.code {
                Some(c) => format!("exit status {c}"),
                None => "killed by a signal".to_string(),
            }
        };
        let last = last_line(&self.stderr).or_else(|| last_line(&self.stdout));
        match last {
            Some(line) => format!("{status}: {line}"),
            None => status,
        }
    }
}

fn last_line(s: &str) -> Option<&str> {
    s.lines().rev().map(str::trim).find(|l| !l.is_empty())
}

/// Errors that prevent a command from running at all.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The argv was empty.
    #[error("empty command")]
    Empty,
    /// The program could not be started.
    #[error("start {program}: {source}")]
    Spawn {
        /// The program that failed to start.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Waiting for the child failed.
    #[error("wait for {program}: {source}")]
    Wait {
        /// The program being waited for.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Runs a command to completion or timeout, capturing bounded output.
pub fn run(spec: &CommandSpec) -> Result<CommandOutput, CommandError> {
    let Some(program) = spec.argv.first() else {
        return Err(CommandError::Empty);
    };
    let mut cmd = match &spec.chroot {
        Some(root) => {
            let mut c = Command::new("chroot");
            c.arg(root).args(&spec.argv);
            c
        }
        None => {
            let mut c = Command::new(program);
            c.args(&spec.argv[1..]);
            c
        }
    };
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .env("LC_ALL", "C");
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|source| CommandError::Spawn {
        program: program.clone(),
        source,
    })?;
    let out = child.stdout.take().map(|p| drain(p, spec.max_output));
    let err = child.stderr.take().map(|p| drain(p, spec.max_output));
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() >= spec.timeout => {
                timed_out = true;
                let pgid = rustix::process::Pid::from_child(&child);
                let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
                let _ = child.kill();
                break child.wait().map_err(|source| CommandError::Wait {
                    program: program.clone(),
                    source,
                })?;
            }
            Ok(None) => thread::sleep(poll_interval(start.elapsed())),
            Err(source) => {
                return Err(CommandError::Wait {
                    program: program.clone(),
                    source,
                });
            }
        }
    };
    let join = |h: Option<thread::JoinHandle<Vec<u8>>>| {
        h.and_then(|h| h.join().ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    Ok(CommandOutput {
        code: status.code(),
        timed_out,
        stdout: join(out),
        stderr: join(err),
        elapsed: start.elapsed(),
    })
}

/// Short polls at first so quick commands return quickly, then back off to 50 ms.
fn poll_interval(elapsed: Duration) -> Duration {
    if elapsed < Duration::from_millis(20) {
        Duration::from_millis(1)
    } else if elapsed < Duration::from_millis(500) {
        Duration::from_millis(10)
    } else {
        Duration::from_millis(50)
    }
}

/// Reads a pipe to the end on a thread, keeping only the last `max` bytes.
fn drain(mut pipe: impl Read + Send + 'static, max: usize) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut kept: Vec<u8> = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    kept.extend_from_slice(&buf[..n]);
                    if kept.len() > max.saturating_mul(2).max(16 * 1024) {
                        let cut = kept.len() - max;
                        kept.drain(..cut);
                    }
                }
            }
        }
        if kept.len() > max {
            let cut = kept.len() - max;
            kept.drain(..cut);
        }
        kept
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_exit_code_and_output() {
        let out = run(&CommandSpec::new([
            "sh",
            "-c",
            "echo hello; echo oops >&2; exit 3",
        ]))
        .unwrap();
        assert_eq!(out.code, Some(3));
        assert_eq!(out.stdout, "hello\n");
        assert_eq!(out.summary(), "exit status 3: oops");
        assert!(!out.success());
    }

    #[test]
    fn timeout_kills_the_process_group() {
        let spec = CommandSpec::new(["sh", "-c", "sleep 30 & sleep 30"])
            .timeout(Duration::from_millis(200));
        let out = run(&spec).unwrap();
        assert!(out.timed_out);
        assert!(out.elapsed < Duration::from_secs(5), "{:?}", out.elapsed);
        assert!(out.summary().starts_with("timed out after"));
    }

    #[test]
    fn output_is_bounded_to_the_tail() {
        let mut spec = CommandSpec::new(["sh", "-c", "seq 1 100000"]);
        spec.max_output = 100;
        let out = run(&spec).unwrap();
        assert!(out.stdout.len() <= 100);
        assert!(out.stdout.ends_with("100000\n"));
    }

    #[test]
    fn missing_program_is_a_spawn_error() {
        let err = run(&CommandSpec::new(["/nonexistent/program"])).unwrap_err();
        assert!(
            err.to_string().starts_with("start /nonexistent/program:"),
            "{err}"
        );
    }
}
