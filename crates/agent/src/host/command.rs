//! Running node commands: argv only (never a shell string), optional chroot into the root,
//! a hard timeout that kills the whole process group, and bounded captured output.
//!
//! The node's own programs (`kubeadm`, `kubelet --version`: [`node_program`]) act on the
//! node's root whichever way commands reach it: chrooted into the root (`node.chroot`, the
//! default), or, without chroot (`--no-chroot`, sandboxes and tests), the root's own program
//! found by its path inside the root (never one on the agent's `PATH`), started in the root
//! with [`NODE_ROOT_ENV`] naming it. Package managers act on a root only chrooted into it
//! ([`super::packages::usable`]). The command lines a plan's author writes (gate `command`s,
//! `exec` changes) run as written: chrooted into the root, or on the agent's filesystem.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// The environment variable that names the node's root to a node program run without
/// chroot (a sandbox's stand-ins act on the tree it names).
pub const NODE_ROOT_ENV: &str = "INPLACE_NODE_ROOT";

/// Where a node's programs are looked up inside its root, in order (a usual `PATH`).
pub const NODE_PATH: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

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
    /// Not chrooted, but the node's own program: `argv[0]` is looked up inside this root
    /// ([`CommandSpec::on_node`]) and the command starts in it.
    pub program_in: Option<PathBuf>,
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
            program_in: None,
        }
    }

    /// The node's own program at `root`, acting on that root: chrooted into it when
    /// `chroot` (and the root is not `/`); otherwise `argv[0]` is the root's program, found
    /// by its path inside the root ([`NODE_PATH`], symlinks resolved inside the root), run
    /// on the agent's filesystem in the root as working directory, [`NODE_ROOT_ENV`] naming
    /// it. A program the root does not have is an error ([`CommandError::NotOnNode`]), never
    /// the agent's own.
    pub fn on_node(self, root: &Path, chroot: bool) -> CommandSpec {
        if root == Path::new("/") || chroot {
            return self.in_root(root);
        }
        let mut spec = self;
        spec.chroot = None;
        spec.program_in = Some(root.to_path_buf());
        spec.env
            .push((NODE_ROOT_ENV.to_string(), root.display().to_string()));
        spec
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

/// The node's program of `host` (`argv[0]` and its arguments), acting on the node's root
/// the same way with or without chroot ([`CommandSpec::on_node`]).
pub fn node_program<S: Into<String>>(
    host: &super::Host,
    argv: impl IntoIterator<Item = S>,
) -> CommandSpec {
    CommandSpec::new(argv).on_node(host.root_path(), host.settings().commands_in_root)
}

/// Where the node's program `name` is on the agent's filesystem: `name` itself when it is a
/// path (a node path), else the first of [`NODE_PATH`] that has it, resolved inside `root`
/// (an absolute symlink in the tree points into the tree, not out of it).
pub fn find_in_root(root: &Path, name: &str) -> Option<PathBuf> {
    let candidates: Vec<String> = if name.contains('/') {
        vec![name.trim_start_matches('/').to_string()]
    } else {
        NODE_PATH
            .iter()
            .map(|dir| format!("{}/{name}", dir.trim_start_matches('/')))
            .collect()
    };
    candidates.iter().find_map(|rel| {
        use std::os::fd::AsRawFd;
        let fd = super::locks::open_in_root(root, Path::new(rel), rustix::fs::OFlags::PATH).ok()?;
        let st = rustix::fs::fstat(&fd).ok()?;
        if st.st_mode & 0o170000 != 0o100000 {
            return None;
        }
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
    })
}

/// Errors that prevent a command from running at all.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The argv was empty.
    #[error("empty command")]
    Empty,
    /// The node's program is not in the node's root (looked up without chroot).
    #[error(
        "{program}: not found on the node (looked in {root} under {}); the agent runs the \
         node's own program, not one of its own",
        NODE_PATH.join(", ")
    )]
    NotOnNode {
        /// The program.
        program: String,
        /// The node's root, shown.
        root: String,
    },
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
    let mut cmd = match (&spec.chroot, &spec.program_in) {
        (Some(root), _) => {
            let mut c = Command::new("chroot");
            c.arg(root).args(&spec.argv);
            c
        }
        (None, Some(root)) => {
            let found = find_in_root(root, program).ok_or_else(|| CommandError::NotOnNode {
                program: program.clone(),
                root: root.display().to_string(),
            })?;
            let mut c = Command::new(found);
            c.args(&spec.argv[1..]).current_dir(root);
            c
        }
        (None, None) => {
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
    fn without_chroot_the_node_program_is_the_roots_own_run_in_the_root() {
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("usr/local/bin");
        std::fs::create_dir_all(&bin).unwrap();
        // Where it ran, and the root it was told: the tree's, not the agent's.
        std::fs::write(
            bin.join("where"),
            "#!/bin/sh\necho \"$(pwd -P) $INPLACE_NODE_ROOT $*\"\n",
        )
        .unwrap();
        std::fs::set_permissions(
            bin.join("where"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        // An absolute symlink inside the tree points into the tree.
        std::fs::create_dir_all(root.path().join("usr/bin")).unwrap();
        std::os::unix::fs::symlink("/usr/local/bin/where", root.path().join("usr/bin/here"))
            .unwrap();
        let real = root.path().canonicalize().unwrap();
        for name in ["where", "here", "/usr/local/bin/where"] {
            let spec = CommandSpec::new([name, "a"]).on_node(root.path(), false);
            assert!(spec.chroot.is_none());
            let out = run(&spec).unwrap();
            assert_eq!(
                out.stdout,
                format!("{} {} a\n", real.display(), root.path().display()),
                "{name}"
            );
        }
        // `sh` is on the agent's PATH, not in the tree: not found, never the agent's.
        let err =
            run(&CommandSpec::new(["sh", "-c", "true"]).on_node(root.path(), false)).unwrap_err();
        assert!(matches!(err, CommandError::NotOnNode { .. }), "{err}");
        assert!(
            err.to_string().starts_with("sh: not found on the node"),
            "{err}"
        );
        // With chroot, or on `/`, nothing is looked up here.
        let chrooted = CommandSpec::new(["kubeadm"]).on_node(root.path(), true);
        assert_eq!(chrooted.chroot.as_deref(), Some(root.path()));
        assert!(chrooted.program_in.is_none());
        let slash = CommandSpec::new(["kubeadm"]).on_node(Path::new("/"), false);
        assert!(slash.chroot.is_none() && slash.program_in.is_none());
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
