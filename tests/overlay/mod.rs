//! Shared pieces of the host-level package tests: a disposable copy-on-write root, root checks
//! and a child process that holds an fcntl lock.
#![allow(dead_code)]

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

/// True when tests that need root must run: we are root, or CI=true (where skipping is a
/// failure). Otherwise prints a loud skip notice and returns false.
pub fn require_root(test: &str) -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: must run as root when CI=true");
    }
    // Straight to the stderr handle: libtest captures eprintln! of passing tests.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("\n*** SKIPPED {test}: needs root (mounts an overlay root) ***\n").as_bytes(),
    );
    false
}

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

/// Body of the `lock_holder_process` helper test of each test binary: takes an fcntl write
/// lock on the file named by the environment (as dpkg, apt and rpm do), says so, and keeps it
/// until stdin closes. Does nothing when not started by [`LockHolder::start`].
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
    /// Starts this test binary's `lock_holder_process` test as a child holding `path`.
    pub fn start(path: &Path) -> LockHolder {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["lock_holder_process", "--exact", "--ignored", "--nocapture"])
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
        panic!("lock holder exited without taking the lock: {status:?}");
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

/// One file of a stand-in package.
pub struct DebFile {
    /// Absolute path it installs to.
    pub path: String,
    /// Its bytes.
    pub content: Vec<u8>,
    /// Its mode.
    pub mode: u32,
}

/// A stand-in Debian package.
pub struct Deb {
    pub name: String,
    pub version: String,
    pub files: Vec<DebFile>,
}

/// `1.31.2-1.1` → `1.31.2`.
pub fn upstream(version: &str) -> &str {
    version.split('-').next().unwrap()
}

impl Deb {
    /// A package whose `/usr/bin/<name>` prints `Kubernetes v<upstream version>`.
    pub fn printing_version(name: &str, version: &str) -> Deb {
        Deb {
            name: name.to_string(),
            version: version.to_string(),
            files: vec![DebFile {
                path: format!("/usr/bin/{name}"),
                content: format!("#!/bin/sh\necho \"Kubernetes v{}\"\n", upstream(version))
                    .into_bytes(),
                mode: 0o755,
            }],
        }
    }
}

/// Stand-ins of the three Kubernetes packages at `version`, close enough to the real ones for
/// a version bump:
/// - `kubeadm version -o short` prints `v<version>`; `kubeadm upgrade node ARGS` appends a
///   line to `/var/log/kubeadm-standin.log`, adds a comment to `/var/lib/kubelet/config.yaml`
///   when there is one (the real one rewrites it), and fails with exit 1 after having done
///   that when `/etc/kubernetes/kubeadm-standin-fail` exists;
/// - `kubelet` is the kubelet stand-in binary with a `kubelet.version` file next to it;
/// - `kubectl version --client` prints `Client Version: v<version>`.
pub fn kube_debs(version: &str) -> Vec<Deb> {
    let v = upstream(version);
    let kubeadm = format!(
        r##"#!/bin/sh
# stand-in kubeadm v{v} for the inplace-agent tests
case "$1 $2" in
  "version -o") echo "v{v}" ;;
  "upgrade node")
    shift 2
    echo "[upgrade] Reading configuration from the cluster..."
    echo "kubeadm v{v} upgrade node $*" >> /var/log/kubeadm-standin.log
    if [ -f /var/lib/kubelet/config.yaml ]; then
      echo "# written by kubeadm v{v}" >> /var/lib/kubelet/config.yaml
    fi
    if [ -e /etc/kubernetes/kubeadm-standin-fail ]; then
      echo "[upgrade/kubelet-config] writing the kubelet configuration"
      echo "error execution phase kubelet-config: stand-in failure requested by the test" >&2
      exit 1
    fi
    echo "[upgrade] The configuration for this node was successfully updated!"
    ;;
  *) echo "stand-in kubeadm: unsupported arguments: $*" >&2; exit 2 ;;
esac
"##
    );
    let kubectl = format!("#!/bin/sh\necho \"Client Version: v{v}\"\n");
    let standin = std::fs::read(env!("CARGO_BIN_EXE_kubelet-standin")).unwrap();
    let file = |path: &str, content: Vec<u8>, mode| DebFile {
        path: path.to_string(),
        content,
        mode,
    };
    vec![
        Deb {
            name: "kubeadm".into(),
            version: version.into(),
            files: vec![file("/usr/bin/kubeadm", kubeadm.into_bytes(), 0o755)],
        },
        Deb {
            name: "kubelet".into(),
            version: version.into(),
            files: vec![
                file("/usr/bin/kubelet", standin, 0o755),
                file(
                    "/usr/bin/kubelet.version",
                    format!("v{v}\n").into_bytes(),
                    0o644,
                ),
            ],
        },
        Deb {
            name: "kubectl".into(),
            version: version.into(),
            files: vec![file("/usr/bin/kubectl", kubectl.into_bytes(), 0o755)],
        },
    ]
}

/// Builds the packages with `dpkg-deb` into `/srv/repo` of the overlay, indexes them, and
/// makes that repository the overlay's only apt source (no network). Run `apt-get update`
/// (or let the agent refresh) afterwards.
pub fn apt_repo(overlay: &Overlay, debs: &[Deb]) {
    let repo = overlay.path("/srv/repo");
    let build = overlay.path("/tmp/build");
    std::fs::create_dir_all(&repo).unwrap();
    for deb in debs {
        let dir = build.join(format!("{}-{}", deb.name, deb.version));
        std::fs::create_dir_all(dir.join("DEBIAN")).unwrap();
        for f in &deb.files {
            let path = dir.join(f.path.trim_start_matches('/'));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &f.content).unwrap();
            sh(&["chmod", &format!("{:o}", f.mode), path.to_str().unwrap()]);
        }
        std::fs::write(
            dir.join("DEBIAN/control"),
            format!(
                "Package: {}\nVersion: {}\nArchitecture: all\n\
                 Maintainer: inplace-agent tests <tests@example.invalid>\n\
                 Description: stand-in {} for the inplace-agent tests\n",
                deb.name, deb.version, deb.name
            ),
        )
        .unwrap();
        let out = repo.join(format!("{}_{}_all.deb", deb.name, deb.version));
        sh(&[
            "dpkg-deb",
            "--root-owner-group",
            "-Zgzip",
            "-z1",
            "--build",
            dir.to_str().unwrap(),
            out.to_str().unwrap(),
        ]);
    }
    let _ = std::fs::remove_dir_all(&build);
    apt_repo_index(overlay);
    // Only our repository: no network, and nothing else to resolve.
    let _ = std::fs::remove_dir_all(overlay.path("/etc/apt/sources.list.d"));
    std::fs::create_dir_all(overlay.path("/etc/apt/sources.list.d")).unwrap();
    overlay.write(
        "/etc/apt/sources.list",
        "deb [trusted=yes] file:/srv/repo ./\n",
    );
}

/// Indexes `/srv/repo` again (after packages were added or removed).
pub fn apt_repo_index(overlay: &Overlay) {
    let repo = overlay.path("/srv/repo");
    let index = sh(&[
        "sh",
        "-c",
        &format!(
            "cd {} && dpkg-scanpackages --multiversion . 2>/dev/null",
            repo.display()
        ),
    ]);
    std::fs::write(repo.join("Packages"), index).unwrap();
}
