//! A disposable node for tests and the demo: the machine's real systemd, booted as PID 1 of
//! fresh namespaces on a copy-on-write overlay of `/` (DESIGN.md §7).
//!
//! **A test and demo facility, not part of the agent.** The agent never uses it; the
//! integration tests (`tests/sandbox/mod.rs` re-exports it) and `inplace-agent demo
//! --systemd` do. It needs root, and it refuses to boot systemd anywhere but on the overlay:
//! the boot script exits 97 unless the new root is an overlayfs, and every access to the
//! node checks `statfs(/proc/<pid>/root)` again (see the safety rules below).
//!
//! ```ignore
//! let Some(node) = SandboxNode::boot() else { return }; // skipped: not root
//! let systemd = node.connect();
//! node.write_file("/etc/systemd/system/x.service", "...", 0o644);
//! ```
//!
//! [`standin`] is the kubelet STAND-IN the node runs as `kubelet.service`; [`packages`]
//! builds stand-in `kubeadm`/`kubelet`/`kubectl` packages and a local apt or rpm repository
//! of them in a root, and makes a node a kubeadm node installed from them
//! ([`SandboxNode::install_kube_packages`]) for the Kubernetes version bump.
//!
//! # Safety rules (read before changing this file)
//!
//! 1. **Never boot systemd without the overlay.** systemd's boot-time tmpfiles run wipes
//!    `/tmp`, and other early units write all over `/etc`, `/var` and `/dev`. The boot script
//!    mounts the overlay first and refuses to go on (exit 97) unless the new root really is
//!    an overlayfs; the harness then checks `statfs(/proc/<pid>/root)` again before it talks
//!    to the node, so it never mistakes the host's own bus for the sandbox's.
//! 2. Everything is mounted *inside* the sandbox's private mount namespace — the tmpfs that
//!    holds the overlay's upper and work dirs, the overlay, `/proc`, `/sys`, `/dev`, `/run`,
//!    `/tmp`. Nothing is mounted in the host's namespace, so when the namespace's PID 1 dies
//!    the kernel releases every mount and the tmpfs memory: there is nothing to unmount, and
//!    a test process killed with SIGKILL leaves no mount behind.
//! 3. The sandbox dies with the test: the launcher runs under `setpriv --pdeathsig KILL` and
//!    `unshare --kill-child=SIGKILL`, so if the thread that booted it exits (or the test
//!    process is killed, or Ctrl-C'd) systemd gets SIGKILL, and the kernel kills everything
//!    else in the PID namespace. [`SandboxNode`]'s `Drop` does the same deliberately.
//!    Because of `--pdeathsig`, keep a node on the thread that booted it.
//! 4. Units that reach outside the node or are unwanted in it are masked (linked to
//!    `/dev/null`, see [`MASKED_UNITS`]), and every unit the host's administrator enabled
//!    (`/etc/systemd/system/*.wants/`, `*.requires/`) is disabled in the overlay, so the
//!    sandbox boots the distribution's defaults plus what the test installs.
//! 5. Beyond §7's recipe, the node also gets its own network, UTS and IPC namespaces (a
//!    kubelet stand-in in one sandbox listens on 127.0.0.1:10248 without clashing with another
//!    sandbox; systemd cannot set the host's hostname), a read-only `/sys` (udev and friends
//!    stay off; cgroup file systems below it stay writable) and its own cgroup
//!    (`/sys/fs/cgroup/<hierarchy>/inplace-sandbox-<id>`) so that two sandboxes never manage
//!    the same `system.slice/<unit>` cgroup and nothing is created at the host's cgroup root.
//!
//! # Parallel tests
//!
//! Several sandboxes may run at once (cargo runs tests on parallel threads): each has a
//! unique id `<test pid>-<counter>`, its own directory `/run/inplace-agent-sandbox/<id>/`,
//! its own namespaces and cgroup. No lock is needed. Leftovers of test processes that died
//! without running `Drop` (directories and empty cgroups) are swept at the next boot.
//!
//! # Debugging
//!
//! See docs/testing-systemd.md: `nsenter -t <pid> -m -u -i -n -p -r -w systemctl status`,
//! the console log at `/run/inplace-agent-sandbox/<id>/console.log` (kept when a test panics),
//! and `INPLACE_SANDBOX_HOLD=<seconds>` to keep each node alive that long after its test
//! (before teardown) for inspection.

use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::host::systemd::{Systemd, unix_path_address};

pub mod packages;
pub mod standin;

/// Where each sandbox keeps its host-side files (boot script, seed, console log).
pub const SANDBOX_BASE: &str = "/run/inplace-agent-sandbox";
/// Prefix of the per-sandbox cgroup directories.
const CGROUP_PREFIX: &str = "inplace-sandbox-";
/// The overlay's magic number as `statfs` reports it.
const OVERLAYFS_SUPER_MAGIC: u32 = 0x794c_7630;
/// How long a boot may take before we give up.
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
/// The timeout for D-Bus calls made through [`SandboxNode::connect`].
pub const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// Units masked in every sandbox: DESIGN.md §7's list (tmpfiles, remount-fs, sysctl,
/// modules-load, binfmt, gettys, postgresql) plus others that would touch the host kernel,
/// its devices or its clock, or just cost time.
pub const MASKED_UNITS: &[&str] = &[
    // DESIGN.md §7
    "systemd-tmpfiles-setup.service",
    "systemd-tmpfiles-clean.timer",
    "systemd-remount-fs.service",
    "systemd-sysctl.service",
    "systemd-modules-load.service",
    "systemd-binfmt.service",
    "getty@.service",
    "getty@tty1.service",
    "serial-getty@.service",
    "console-getty.service",
    "postgresql.service",
    // device nodes in the host's /dev, kernel modules, binfmt_misc
    "systemd-tmpfiles-setup-dev.service",
    "systemd-tmpfiles-setup-dev-early.service",
    "kmod-static-nodes.service",
    "modprobe@.service",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    // udev (also kept off by the read-only /sys)
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-hwdb-update.service",
    // clock, network, pstore, disks
    "systemd-timesyncd.service",
    "systemd-networkd.service",
    "systemd-resolved.service",
    "systemd-pstore.service",
    "fstrim.timer",
    "fstrim.service",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    // periodic jobs
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "man-db.timer",
];

/// Where [`Standin::Agent`] puts the agent's binary inside the node.
pub const AGENT_IN_NODE: &str = "/usr/local/libexec/inplace-agent-demo/inplace-agent";
/// The stand-in's kubelet configuration (a trimmed kubeadm one).
pub const KUBELET_CONFIG: &str = include_str!("../../../../tests/fixtures/kubelet-config.yaml");
/// The stand-in's `kubeadm-flags.env`.
pub const KUBEADM_FLAGS: &str = include_str!("../../../../tests/fixtures/kubeadm-flags.env");
/// The stand-in's `kubelet.service`.
pub const KUBELET_UNIT: &str = include_str!("../../../../tests/fixtures/kubelet.service");
/// Where the stand-in's units make it log each start (`<InvocationID> ok|refused ...`).
pub const START_LOG: &str = "/var/log/kubelet-standin.starts";

/// Which program plays the kubelet in a node.
#[derive(Debug, Clone, Copy)]
pub enum Standin<'a> {
    /// The `kubelet-standin` program (tests: `env!("CARGO_BIN_EXE_kubelet-standin")`),
    /// copied to `/usr/local/bin/kubelet`.
    Binary(&'a Path),
    /// This agent's own binary, copied into the node; `/usr/local/bin/kubelet` is a script
    /// that runs its hidden `kubelet-standin` subcommand (the demo, which has no separate
    /// stand-in binary to hand).
    Agent(&'a Path),
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A running sandboxed node. Dropping it kills it and removes what it left on the host.
#[derive(Debug)]
pub struct SandboxNode {
    id: String,
    dir: PathBuf,
    launcher: Child,
    pid: u32,
    /// A pidfd for `pid`: signals through it can never hit a process that reused the PID.
    pidfd: Option<OwnedFd>,
    cgroups: Vec<PathBuf>,
    boot_time: Duration,
    reaped: bool,
}

impl SandboxNode {
    /// Boots a sandboxed node. Returns `None`, after printing a loud SKIP line, when the
    /// tests do not run as root or the machine lacks what the sandbox needs; panics instead
    /// when `CI=true`, where every sandbox test must run.
    pub fn boot() -> Option<SandboxNode> {
        match SandboxNode::try_boot() {
            Ok(node) => Some(node),
            Err(BootError::Unavailable(why)) => {
                if std::env::var("CI").is_ok_and(|v| v == "true") {
                    panic!("sandbox: cannot boot a sandboxed systemd with CI=true: {why}");
                }
                // Written straight to fd 2 so that libtest's output capture does not hide it.
                let _ = writeln!(
                    std::io::stderr(),
                    "\n**** SKIP: {}: sandboxed-systemd test not run: {why} ****\n",
                    thread::current().name().unwrap_or("test")
                );
                None
            }
            Err(BootError::Failed(why)) => panic!("sandbox: boot failed: {why}"),
        }
    }

    /// Boots a node, or says why not.
    pub fn try_boot() -> Result<SandboxNode, BootError> {
        if !rustix::process::geteuid().is_root() {
            return Err(BootError::Unavailable(
                "needs root (it creates namespaces, mounts and cgroups)".into(),
            ));
        }
        let systemd_bin = check_prerequisites().map_err(BootError::Unavailable)?;
        sweep_stale();

        let id = format!(
            "{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let dir = Path::new(SANDBOX_BASE).join(&id);
        let fail = |what: &str, e: std::io::Error| BootError::Failed(format!("{what}: {e}"));
        fs::create_dir_all(dir.join("mnt")).map_err(|e| fail("create sandbox dir", e))?;
        write_seed(&dir.join("seed"), &id).map_err(|e| fail("write seed", e))?;
        let cgroups = create_cgroups(&id).map_err(BootError::Failed)?;
        let script = boot_script(&dir, &cgroups, &systemd_bin);
        fs::write(dir.join("boot.sh"), script).map_err(|e| fail("write boot.sh", e))?;
        let console =
            fs::File::create(dir.join("console.log")).map_err(|e| fail("create console.log", e))?;
        let console2 = console
            .try_clone()
            .map_err(|e| fail("dup console.log", e))?;

        let started = Instant::now();
        let launcher = Command::new("setpriv")
            .args(["--pdeathsig", "KILL", "--", "setsid", "unshare"])
            .args(["--fork", "--kill-child=SIGKILL", "--pid", "--mount"])
            .args(["--net", "--uts", "--ipc", "--propagation", "private", "--"])
            .arg("/bin/sh")
            .arg(dir.join("boot.sh"))
            .stdin(Stdio::null())
            .stdout(console)
            .stderr(console2)
            .spawn()
            .map_err(|e| fail("spawn setpriv/unshare", e))?;
        let mut node = SandboxNode {
            id,
            dir,
            launcher,
            pid: 0,
            pidfd: None,
            cgroups,
            boot_time: Duration::ZERO,
            reaped: false,
        };
        node.wait_booted(started)?;
        node.boot_time = started.elapsed();
        Ok(node)
    }

    /// The sandbox id (`<test pid>-<n>`), also the name of its host-side directory.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Host PID of the node's PID 1 (systemd).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// How long the boot took, from spawning the namespace to systemd reporting
    /// `running` with its bus up.
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    /// The node's root directory as seen from the host: `/proc/<pid>/root`.
    pub fn root(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.pid))
    }

    /// The node's system bus: `unix:path=/proc/<pid>/root/run/dbus/system_bus_socket`.
    pub fn bus_address(&self) -> String {
        unix_path_address(&self.root().join("run/dbus/system_bus_socket"))
    }

    /// Host-side path of an absolute path inside the node. Panics when the node's root is
    /// not an overlay any more (the node is gone and its PID may belong to another process),
    /// so that a test can never write into the host's filesystem through a stale PID.
    pub fn path(&self, node_path: &str) -> PathBuf {
        assert!(
            self.root_is_overlay(),
            "sandbox {}: node is not running (its root is no longer an overlay)",
            self.id
        );
        self.root().join(node_path.trim_start_matches('/'))
    }

    /// Writes a file inside the node (creating parent directories) with `mode`.
    pub fn write_file(&self, node_path: &str, contents: impl AsRef<[u8]>, mode: u32) {
        let path = self.path(node_path);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)
                .unwrap_or_else(|e| panic!("sandbox: create {}: {e}", parent.display()));
        }
        fs::write(&path, contents).unwrap_or_else(|e| panic!("sandbox: write {node_path}: {e}"));
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("sandbox: chmod {node_path}: {e}"));
    }

    /// Reads a file inside the node.
    pub fn read_file(&self, node_path: &str) -> String {
        fs::read_to_string(self.path(node_path))
            .unwrap_or_else(|e| panic!("sandbox: read {node_path}: {e}"))
    }

    /// Waits until the node's system bus accepts connections and systemd answers on it.
    pub fn wait_for_bus(&self, timeout: Duration) -> Result<Systemd, String> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("not tried");
        while Instant::now() < deadline {
            if self.root_is_overlay() && self.root().join("run/dbus/system_bus_socket").exists() {
                match Systemd::connect(&self.bus_address(), Duration::from_secs(2)) {
                    Ok(systemd) => return Ok(systemd),
                    Err(e) => last = e.to_string(),
                }
            }
            thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "system bus of sandbox {} not up after {timeout:?}: {last}",
            self.id
        ))
    }

    /// A connection to the node's systemd (panics when there is none).
    pub fn connect(&self) -> Systemd {
        Systemd::connect(&self.bus_address(), CALL_TIMEOUT)
            .unwrap_or_else(|e| panic!("sandbox {}: {e}", self.id))
    }

    /// Installs the kubelet STAND-IN ([`standin`]) as `/usr/local/bin/kubelet` with a valid
    /// `/var/lib/kubelet/config.yaml`, `kubeadm-flags.env` and
    /// `/etc/systemd/system/kubelet.service` (tests/fixtures), reloads systemd and starts it.
    pub fn install_kubelet(&self, standin: Standin<'_>) -> Result<Systemd, String> {
        match standin {
            Standin::Binary(path) => {
                let binary = fs::read(path)
                    .map_err(|e| format!("read kubelet stand-in {}: {e}", path.display()))?;
                self.write_file("/usr/local/bin/kubelet", binary, 0o755);
            }
            Standin::Agent(path) => {
                let binary = fs::read(path)
                    .map_err(|e| format!("read agent binary {}: {e}", path.display()))?;
                self.write_file(AGENT_IN_NODE, binary, 0o755);
                self.write_file(
                    "/usr/local/bin/kubelet",
                    format!(
                        "#!/bin/sh\n# DEMO STAND-IN for the kubelet (inplace-agent demo --systemd); \
                         not a kubelet.\nexec {AGENT_IN_NODE} kubelet-standin \"$@\"\n"
                    ),
                    0o755,
                );
            }
        }
        self.write_file("/var/lib/kubelet/config.yaml", KUBELET_CONFIG, 0o644);
        self.write_file("/var/lib/kubelet/kubeadm-flags.env", KUBEADM_FLAGS, 0o644);
        self.write_file("/etc/systemd/system/kubelet.service", KUBELET_UNIT, 0o644);
        let systemd = Systemd::connect(&self.bus_address(), CALL_TIMEOUT)
            .map_err(|e| format!("sandbox {}: {e}", self.id))?;
        systemd
            .daemon_reload()
            .map_err(|e| format!("sandbox {}: {e}", self.id))?;
        systemd
            .start("kubelet.service", Duration::from_secs(30))
            .map_err(|e| format!("sandbox {}: {e}\n{}", self.id, self.journal("kubelet")))?;
        Ok(systemd)
    }

    /// Replaces `reboot.target` in the node by a target that does nothing, so that a reboot
    /// requested over D-Bus is seen (the target becomes active) without taking the node
    /// down — which would throw its overlay away. Tests then simulate the reboot.
    pub fn defuse_reboot(&self) -> Result<(), String> {
        self.write_file(
            "/etc/systemd/system/reboot.target",
            "[Unit]\nDescription=Reboot (sandbox: does nothing, see inplace_agent::sandbox)\n\
             DefaultDependencies=no\nAllowIsolate=no\n",
            0o644,
        );
        let systemd = Systemd::connect(&self.bus_address(), CALL_TIMEOUT)
            .map_err(|e| format!("sandbox {}: {e}", self.id))?;
        systemd
            .daemon_reload()
            .map_err(|e| format!("sandbox {}: {e}", self.id))
    }

    /// A command that runs `program` in the node's network namespace only, on the host's
    /// filesystem (`nsenter --net=/proc/<pid>/ns/net`): how the agent runs against the node
    /// (`--root` [`SandboxNode::root`], `--bus` [`SandboxNode::bus_address`]) so that its
    /// health gates reach the node's `127.0.0.1` and `net.*` sysctls are the node's.
    pub fn command_in_netns(&self, program: &Path) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/proc/{}/ns/net", self.pid))
            .arg("--")
            .arg(program);
        cmd
    }

    /// A command that runs `program` inside all of the node's namespaces and root
    /// (`nsenter -t <pid> -m -u -i -n -p -r -w`).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.args([
            "-t",
            &self.pid.to_string(),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "-r",
            "-w",
        ])
        .arg(program);
        cmd
    }

    /// The node's journal for `unit` (`journalctl -u`), for failure messages.
    pub fn journal(&self, unit: &str) -> String {
        match self
            .command("journalctl")
            .args(["--no-pager", "-o", "short-precise", "-n", "60", "-u", unit])
            .output()
        {
            Ok(out) => format!(
                "--- journal of {unit} in sandbox {} ---\n{}{}",
                self.id,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => format!("(journalctl for {unit}: {e})"),
        }
    }

    /// `GET http://127.0.0.1:<port><path>` from inside the node's network namespace;
    /// returns the status code and body.
    pub fn http_get(&self, port: u16, path: &str) -> Result<(u16, String), String> {
        let netns = format!("/proc/{}/ns/net", self.pid);
        let path = path.to_string();
        // setns() changes the namespace of the calling thread only, so use a fresh one.
        thread::spawn(move || -> Result<(u16, String), String> {
            let ns = fs::File::open(&netns).map_err(|e| format!("open {netns}: {e}"))?;
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .map_err(|e| format!("setns {netns}: {e}"))?;
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                .map_err(|e| format!("connect {addr}: {e}"))?;
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .map_err(|e| e.to_string())?;
            write!(
                stream,
                "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            )
            .map_err(|e| format!("send request: {e}"))?;
            let mut response = String::new();
            stream
                .read_to_string(&mut response)
                .map_err(|e| format!("read response: {e}"))?;
            let status = response
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse::<u16>().ok())
                .ok_or_else(|| format!("bad response {response:?}"))?;
            let body = response
                .split_once("\r\n\r\n")
                .map(|(_, b)| b.to_string())
                .unwrap_or_default();
            Ok((status, body))
        })
        .join()
        .map_err(|_| "http_get thread panicked".to_string())?
    }

    /// True while the node's PID 1 runs.
    pub fn is_running(&mut self) -> bool {
        !self.reaped && matches!(self.launcher.try_wait(), Ok(None))
    }

    /// Waits up to `timeout` for the node to stop by itself (e.g. after a reboot request);
    /// true when it did.
    pub fn wait_stopped(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.is_running() {
                return true;
            }
            thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The console output of the node's systemd (its stdout and stderr).
    pub fn console_log(&self) -> String {
        fs::read_to_string(self.dir.join("console.log")).unwrap_or_default()
    }

    /// Kills the node now (what `Drop` does), and removes its host-side leftovers.
    pub fn kill(&mut self) {
        if !self.reaped {
            if let Some(pidfd) = &self.pidfd {
                let _ = rustix::process::pidfd_send_signal(pidfd, rustix::process::Signal::KILL);
            }
            // unshare --kill-child also SIGKILLs the namespace's PID 1 when unshare dies.
            let _ = self.launcher.kill();
            let _ = self.launcher.wait();
            self.reaped = true;
        }
        self.pidfd = None;
        for cg in &self.cgroups {
            remove_cgroup_tree(cg);
        }
    }

    /// Waits for the boot: the PID 1 appears, becomes systemd on the overlay, its bus comes
    /// up and it reports `running` (or `degraded`).
    fn wait_booted(&mut self, started: Instant) -> Result<(), BootError> {
        let deadline = started + BOOT_TIMEOUT;
        let launcher = self.launcher.id();
        let children = format!("/proc/{launcher}/task/{launcher}/children");
        let mut phase = "waiting for the namespace's PID 1";
        let mut systemd: Option<Systemd> = None;
        loop {
            if Instant::now() > deadline {
                return Err(self.boot_failure(&format!("timed out ({phase})")));
            }
            if let Ok(Some(status)) = self.launcher.try_wait() {
                self.reaped = true;
                return Err(self.boot_failure(&format!("the sandbox exited with {status}")));
            }
            if self.pid == 0 {
                // The launcher (unshare) is alive, so its child cannot have been reaped and
                // its PID reused: opening the pidfd now pins the right process.
                let child = fs::read_to_string(&children)
                    .ok()
                    .and_then(|t| t.split_whitespace().next()?.parse::<i32>().ok())
                    .and_then(rustix::process::Pid::from_raw);
                if let Some(pid) = child {
                    self.pidfd = Some(
                        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
                            .map_err(|e| {
                                self.boot_failure(&format!("pidfd_open {}: {e}", pid.as_raw_pid()))
                            })?,
                    );
                    self.pid = pid.as_raw_pid() as u32;
                }
            } else if !self.is_systemd_on_overlay() {
                phase = "waiting for systemd to start on the overlay";
            } else if systemd.is_none() {
                phase = "waiting for the system bus";
                if self.root().join("run/dbus/system_bus_socket").exists() {
                    systemd = Systemd::connect(&self.bus_address(), Duration::from_secs(2)).ok();
                }
            } else if let Some(bus) = &systemd {
                phase = "waiting for multi-user.target";
                match bus.system_state().as_deref() {
                    Ok("running") => return Ok(()),
                    Ok("degraded") => {
                        let _ = writeln!(
                            std::io::stderr(),
                            "sandbox {}: booted degraded (some unit failed)",
                            self.id
                        );
                        return Ok(());
                    }
                    Ok(_) => {}
                    Err(_) => systemd = None,
                }
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// True once PID 1 has exec'd systemd and its root is an overlayfs (not the host's `/`).
    fn is_systemd_on_overlay(&self) -> bool {
        let exe = fs::read_link(format!("/proc/{}/exe", self.pid)).unwrap_or_default();
        exe.file_name().is_some_and(|n| n == "systemd") && self.root_is_overlay()
    }

    /// True when `/proc/<pid>/root` is an overlayfs, i.e. PID 1 is ours and chrooted.
    fn root_is_overlay(&self) -> bool {
        self.pid != 0
            && rustix::fs::statfs(self.root().as_path())
                .is_ok_and(|s| s.f_type as u32 == OVERLAYFS_SUPER_MAGIC)
    }

    fn boot_failure(&mut self, what: &str) -> BootError {
        self.kill();
        let log = self.console_log();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        BootError::Failed(format!(
            "sandbox {}: {what}; console log ({}):\n{}",
            self.id,
            self.dir.join("console.log").display(),
            tail.join("\n")
        ))
    }
}

impl Drop for SandboxNode {
    fn drop(&mut self) {
        if let Some(secs) = std::env::var("INPLACE_SANDBOX_HOLD")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|_| !self.reaped)
        {
            let _ = writeln!(
                std::io::stderr(),
                "sandbox {}: holding for {secs}s (INPLACE_SANDBOX_HOLD) before teardown; \
                 inspect it with: nsenter -t {} -m -u -i -n -p -r -w systemctl status",
                self.id,
                self.pid
            );
            thread::sleep(Duration::from_secs(secs));
        }
        self.kill();
        if thread::panicking() {
            let _ = writeln!(
                std::io::stderr(),
                "sandbox {}: kept {} for debugging (console.log)",
                self.id,
                self.dir.display()
            );
        } else {
            remove_host_dir(&self.dir);
        }
    }
}

/// Why a sandbox did not boot.
#[derive(Debug)]
pub enum BootError {
    /// This machine or user cannot run sandboxes (not root, systemd or dbus missing): skip.
    Unavailable(String),
    /// It should have worked and did not: a bug or a broken machine.
    Failed(String),
}

impl std::fmt::Display for BootError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BootError::Unavailable(s) => write!(f, "unavailable: {s}"),
            BootError::Failed(s) => write!(f, "failed: {s}"),
        }
    }
}

/// Finds systemd and checks the tools and packages the sandbox needs; returns systemd's path.
fn check_prerequisites() -> Result<String, String> {
    let systemd = ["/lib/systemd/systemd", "/usr/lib/systemd/systemd"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .ok_or("systemd is not installed (/lib/systemd/systemd); install tests/packages.txt")?;
    let has_unit = |name: &str| {
        ["/lib/systemd/system", "/usr/lib/systemd/system"]
            .iter()
            .any(|d| Path::new(d).join(name).exists())
    };
    if !has_unit("dbus.service") || !has_unit("dbus.socket") {
        return Err(
            "the dbus package (dbus.service, dbus.socket) is not installed; install \
             tests/packages.txt"
                .into(),
        );
    }
    for tool in ["setpriv", "setsid", "unshare", "nsenter", "chroot", "mount"] {
        let found = std::env::var_os("PATH")
            .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(tool).is_file()));
        if !found {
            return Err(format!(
                "{tool} is not on PATH (util-linux/coreutils); install tests/packages.txt"
            ));
        }
    }
    if !Path::new("/proc/self/ns/pid").exists() {
        return Err("this kernel has no PID namespaces".into());
    }
    Ok(systemd.to_string())
}

/// The files copied over the overlay before systemd starts: the masks and a hostname.
fn write_seed(seed: &Path, id: &str) -> std::io::Result<()> {
    let units = seed.join("etc/systemd/system");
    fs::create_dir_all(&units)?;
    for unit in MASKED_UNITS {
        symlink("/dev/null", units.join(unit))?;
    }
    fs::write(seed.join("etc/hostname"), format!("sandbox-{id}\n"))?;
    Ok(())
}

/// The script run as PID 1 of the new namespaces; it ends by exec'ing systemd.
fn boot_script(dir: &Path, cgroups: &[PathBuf], systemd: &str) -> String {
    let dir = dir.display();
    let mut s = String::from(
        "#!/bin/sh\n# inplace-agent test sandbox, see tests/sandbox/mod.rs\nset -eu\n",
    );
    s.push_str(
        "# our own cgroup in every hierarchy systemd uses, so it manages only its subtree\n",
    );
    for cg in cgroups {
        s.push_str(&format!("echo $$ > '{}/cgroup.procs'\n", cg.display()));
    }
    s.push_str(&format!(
        r#"B='{dir}/mnt'
R="$B/root"
# 1. the copy-on-write root: upper and work dirs on a private tmpfs, lower is the host's /
mount -t tmpfs -o mode=0700,size=4g inplace-sandbox "$B"
mkdir "$B/upper" "$B/work" "$R"
mount -t overlay -o lowerdir=/,upperdir="$B/upper",workdir="$B/work" inplace-sandbox "$R"
if [ "$(stat -f -c %T "$R")" != overlayfs ]; then
    echo "sandbox: $R is not an overlay; refusing to boot systemd on the real filesystem" >&2
    exit 97
fi
# 2. masks and hostname; units the host's administrator enabled are disabled here
cp -a '{dir}/seed/.' "$R/"
rm -f "$R"/etc/systemd/system/*.wants/* "$R"/etc/systemd/system/*.requires/*
# 3. the API file systems (all in this private mount namespace)
mount -t proc proc "$R/proc"
# The kernel's global sysctls are the host's even in these namespaces: read-only here, so
# no plan and no unit of the sandbox can change them (net.* belong to its own network
# namespace and stay writable).
for d in kernel vm fs dev; do
    mount --bind "$R/proc/sys/$d" "$R/proc/sys/$d"
    mount -o remount,bind,ro "$R/proc/sys/$d"
done
mount --rbind /sys "$R/sys"
mount -o remount,bind,ro "$R/sys"
mount --rbind /dev "$R/dev"
mount -t tmpfs -o mode=0755 tmpfs "$R/run"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
cd "$R"
exec chroot . env container=other {systemd} --system --unit=multi-user.target
"#
    ));
    s
}

/// Creates the sandbox's cgroup in each mounted hierarchy systemd uses.
fn create_cgroups(id: &str) -> Result<Vec<PathBuf>, String> {
    let mut made: Vec<PathBuf> = Vec::new();
    for mount in cgroup_mounts() {
        let cg = mount.join(format!("{CGROUP_PREFIX}{id}"));
        if let Err(e) = fs::create_dir(&cg) {
            for done in &made {
                remove_cgroup_tree(done);
            }
            return Err(format!("create cgroup {}: {e}", cg.display()));
        }
        made.push(cg);
    }
    if made.is_empty() {
        return Err("no cgroup file system is mounted under /sys/fs/cgroup".into());
    }
    Ok(made)
}

/// Mount points of the cgroup2 hierarchy and of the cgroup v1 hierarchies systemd manages
/// (`name=systemd`, cpu, cpuacct, blkio, memory, devices, pids). Others (cpuset needs its
/// cpus and mems set up before a process can join) are left alone.
fn cgroup_mounts() -> Vec<PathBuf> {
    const V1_USED: &[&str] = &[
        "name=systemd",
        "cpu",
        "cpuacct",
        "blkio",
        "memory",
        "devices",
        "pids",
    ];
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut mounts = Vec::new();
    for line in info.lines() {
        // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut right = right.split_whitespace();
        let (fstype, _source, superopts) = (right.next(), right.next(), right.next());
        let Some(mount_point) = left.split_whitespace().nth(4) else {
            continue;
        };
        let wanted = match fstype {
            Some("cgroup2") => true,
            Some("cgroup") => superopts
                .unwrap_or("")
                .split(',')
                .any(|o| V1_USED.contains(&o)),
            _ => false,
        };
        if wanted && mount_point.starts_with("/sys/fs/cgroup") {
            mounts.push(PathBuf::from(mount_point));
        }
    }
    mounts
}

/// Removes a cgroup directory and the sub-cgroups systemd made in it, deepest first.
/// Retries a little: a cgroup stays busy for a moment after its last process is reaped.
fn remove_cgroup_tree(cg: &Path) {
    for _ in 0..50 {
        remove_dirs_depth_first(cg);
        if !cg.exists() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn remove_dirs_depth_first(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_dirs_depth_first(&entry.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}

/// Removes a sandbox's host-side directory, unless something is mounted below it in our
/// mount namespace (which the design rules out; never recurse into a mount).
fn remove_host_dir(dir: &Path) {
    let mounted = fs::read_to_string("/proc/self/mountinfo").is_ok_and(|info| {
        info.lines().any(|l| {
            l.split_whitespace()
                .nth(4)
                .is_some_and(|mp| Path::new(mp).starts_with(dir))
        })
    });
    if mounted {
        let _ = writeln!(
            std::io::stderr(),
            "sandbox: not removing {}: something is mounted below it",
            dir.display()
        );
        return;
    }
    let _ = fs::remove_dir_all(dir);
}

/// Removes directories and cgroups of sandboxes whose test process is gone (killed before
/// `Drop` ran). A sandbox's processes die with its test process, so they are empty.
fn sweep_stale() {
    let owner_alive = |name: &str| {
        name.split('-')
            .next()
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_none_or(|pid| Path::new(&format!("/proc/{pid}")).exists())
    };
    if let Ok(entries) = fs::read_dir(SANDBOX_BASE) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !owner_alive(&name) {
                remove_host_dir(&entry.path());
            }
        }
    }
    for mount in cgroup_mounts() {
        let Ok(entries) = fs::read_dir(&mount) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_prefix(CGROUP_PREFIX) {
                if !owner_alive(id) {
                    remove_cgroup_tree(&entry.path());
                }
            }
        }
    }
}
