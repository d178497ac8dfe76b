//! Shared pieces of the host-level package tests: a disposable copy-on-write root, stand-in
//! packages and an apt repository of them, and a child process that holds an fcntl lock.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

/// Runs a command on the host and panics with its output when it fails.
pub fn sh(argv: &[&str]) -> String {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .env("LC_ALL", "C")
        .output()
        .unwrap_or_else(|e| panic!("start {}: {e}", argv[0]));
    assert!(
        out.status.success(),
        "{} failed: {}\n{}\n{}",
        argv.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A copy-on-write overlay of `/` on a tmpfs, with /proc and /dev inside so apt and dnf work
/// in a chroot. Writes land on the tmpfs; the real system is never modified. Unmounted on drop.
pub struct Overlay {
    base: tempfile::TempDir,
    root: PathBuf,
    mounts: Vec<PathBuf>,
}

impl Overlay {
    pub fn new() -> Overlay {
        let base = tempfile::Builder::new()
            .prefix("inplace-overlay-")
            .tempdir()
            .unwrap();
        let mut overlay = Overlay {
            root: base.path().join("root"),
            base,
            mounts: Vec::new(),
        };
        let tmpfs = overlay.base.path().join("rw");
        std::fs::create_dir(&tmpfs).unwrap();
        std::fs::create_dir(&overlay.root).unwrap();
        overlay.mount(&["-t", "tmpfs", "-o", "size=512m", "tmpfs"], &tmpfs);
        let (upper, work) = (tmpfs.join("upper"), tmpfs.join("work"));
        std::fs::create_dir(&upper).unwrap();
        std::fs::create_dir(&work).unwrap();
        let opts = format!(
            "lowerdir=/,upperdir={},workdir={}",
            upper.display(),
            work.display()
        );
        let root = overlay.root.clone();
        overlay.mount(&["-t", "overlay", "-o", &opts, "overlay"], &root);
        overlay.mount(&["-t", "proc", "proc"], &root.join("proc"));
        // This /proc shows the host's own sysctls (no namespaces here): read-only, so no
        // test can change one through the overlay root.
        let sys = root.join("proc/sys");
        overlay.mount(&["--bind", sys.to_str().unwrap()], &sys);
        sh(&["mount", "-o", "remount,bind,ro", sys.to_str().unwrap()]);
        overlay.mount(&["--bind", "/dev"], &root.join("dev"));
        overlay.mount(&["-t", "tmpfs", "tmpfs"], &root.join("tmp"));
        overlay.mount(&["-t", "tmpfs", "tmpfs"], &root.join("run"));
        overlay
    }

    fn mount(&mut self, args: &[&str], target: &Path) {
        let mut argv = vec!["mount"];
        argv.extend_from_slice(args);
        let target_str = target.to_str().unwrap().to_string();
        argv.push(&target_str);
        sh(&argv);
        self.mounts.push(target.to_path_buf());
    }

    /// The overlay's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A path inside the overlay.
    pub fn path(&self, abs: &str) -> PathBuf {
        self.root.join(abs.trim_start_matches('/'))
    }

    /// Writes a file inside the overlay, creating its directory.
    pub fn write(&self, abs: &str, content: &str) {
        let path = self.path(abs);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }

    /// Runs a command inside the overlay (chroot) and returns its stdout.
    pub fn chroot(&self, argv: &[&str]) -> String {
        let mut all = vec!["chroot", self.root.to_str().unwrap()];
        all.extend_from_slice(argv);
        sh(&all)
    }
}

impl AsRef<Path> for Overlay {
    fn as_ref(&self) -> &Path {
        &self.root
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        for target in self.mounts.iter().rev() {
            let ok = Command::new("umount")
                .arg(target)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(target).status();
            }
        }
    }
}

const HOLD_ENV: &str = "INPLACE_AGENT_TEST_HOLD_LOCK";

/// Body of the `lock_holder_process` helper test of each test module that holds locks: takes
/// an fcntl write lock on the file named by the environment (as dpkg, apt and rpm do), says
/// so, and keeps it until stdin closes. Does nothing when not started by [`LockHolder::start`].
pub fn lock_holder_main() {
    let Ok(path) = std::env::var(HOLD_ENV) else {
        return;
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap();
    rustix::fs::fcntl_lock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    println!("\nLOCK-HELD");
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new()).unwrap();
}

/// Another process holding an fcntl lock on a file until dropped (or [`LockHolder::release`]).
pub struct LockHolder {
    child: Child,
    _stdout: std::io::BufReader<ChildStdout>,
}

impl LockHolder {
    /// Starts the `lock_holder_process` test of the test module `module` (its
    /// `module_path!()`) as a child, running this test binary again, holding `path`.
    pub fn start(module: &str, path: &Path) -> LockHolder {
        // libtest names a test by its module path without the crate.
        let test = match module.split_once("::") {
            Some((_, inner)) => format!("{inner}::lock_holder_process"),
            None => "lock_holder_process".to_owned(),
        };
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([&test, "--exact", "--ignored", "--nocapture"])
            .env(HOLD_ENV, path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 {
            if line.contains("LOCK-HELD") {
                return LockHolder {
                    child,
                    _stdout: out,
                };
            }
            line.clear();
        }
        let status = child.wait();
        panic!("lock holder {test} exited without taking the lock: {status:?}");
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Releases the lock and waits for the process to exit.
    pub fn release(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for LockHolder {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A stand-in package (`inplace_agent::sandbox::packages`, shared with the sandboxed-node
/// tests and the demo).
pub use inplace_agent::sandbox::packages::Package as Deb;

/// The stand-ins of the three Kubernetes packages at `version`, with the `kubelet-standin`
/// program Cargo built for the tests as `/usr/bin/kubelet` (`sandbox::packages` says what
/// they hold; `kubeadm upgrade node` fails when `/etc/kubernetes/kubeadm-standin-fail`
/// exists).
pub fn kube_debs(version: &str) -> Vec<Deb> {
    let standin = standin_for_packages();
    inplace_agent::sandbox::packages::kube_packages(
        version,
        inplace_agent::sandbox::Standin::Binary(&standin),
    )
}

/// The kubelet stand-in program to put in packages: Cargo's `kubelet-standin` with its debug
/// information stripped (`strip`, from binutils, into the target's temp dir; about 2 MB
/// instead of 166 MB, which was most of the time spent building, installing and upgrading
/// the packages), or as it is when `strip` is not there. The program is the same.
pub fn standin_for_packages() -> PathBuf {
    let program = Path::new(env!("CARGO_BIN_EXE_kubelet-standin"));
    let stripped = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kubelet-standin.stripped");
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if mtime(&stripped).is_some() && mtime(&stripped) >= mtime(program) {
        return stripped;
    }
    // Parallel tests may strip at once: each into its own file, renamed into place.
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let tmp = stripped.with_extension(format!(
        "{}-{}.tmp",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    ));
    let done = Command::new("strip")
        .args(["--strip-debug", "-o"])
        .arg(&tmp)
        .arg(program)
        .status()
        .is_ok_and(|s| s.success())
        && std::fs::rename(&tmp, &stripped).is_ok();
    if done {
        stripped
    } else {
        let _ = std::fs::remove_file(&tmp);
        program.to_path_buf()
    }
}

/// Builds the packages with `dpkg-deb` into `/srv/repo` of `root` (an [`Overlay`], a sandboxed
/// node's `/proc/<pid>/root`, any system root), indexes them, and makes that repository the
/// root's only apt source (no network). Run `apt-get update` (or let the agent refresh)
/// afterwards.
pub fn apt_repo(root: impl AsRef<Path>, debs: &[Deb]) {
    inplace_agent::sandbox::packages::apt_repo(root.as_ref(), debs)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Indexes `/srv/repo` of `root` again (after packages were added or removed).
pub fn apt_repo_index(root: impl AsRef<Path>) {
    inplace_agent::sandbox::packages::apt_repo_index(root.as_ref())
        .unwrap_or_else(|e| panic!("{e}"));
}
