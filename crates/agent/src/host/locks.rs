//! Who holds a package manager's lock: fcntl (POSIX or open-file-description) locks as dpkg,
//! apt and rpm take them, and the PID files dnf uses.
//!
//! We never take a lock ourselves to find out (a moment's hold could make another tool fail);
//! we look the lock up in `/proc/locks` by the file's device and inode, and when the kernel
//! does not tell the owner (OFD locks show PID -1) we find the process through the `lock:`
//! lines of `/proc/<pid>/fdinfo/<fd>`. PIDs are as seen by this process's `/proc`, which is the
//! host's when the agent runs with the host PID namespace.

use std::fmt;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, StatxFlags};

/// A process holding a lock, as far as we could tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockHolder {
    /// Its PID in our PID namespace, when the kernel told us.
    pub pid: Option<u32>,
    /// Its command name (`/proc/<pid>/comm`), when readable.
    pub command: Option<String>,
}

impl LockHolder {
    /// A holder with a known PID; its command name is read from `/proc`.
    pub fn from_pid(pid: u32) -> LockHolder {
        let command = std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty());
        LockHolder {
            pid: Some(pid),
            command,
        }
    }
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.pid, &self.command) {
            (Some(pid), Some(cmd)) => write!(f, "PID {pid} ({cmd})"),
            (Some(pid), None) => write!(f, "PID {pid}"),
            (None, _) => f.write_str("an unknown process"),
        }
    }
}

/// Opens `rel` under `root` without letting a symlink lead outside the root.
pub(crate) fn open_in_root(root: &Path, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let rel = rel.strip_prefix("/").unwrap_or(rel);
    // openat2 refuses O_NOCTTY next to O_PATH.
    let extra = if flags.contains(OFlags::PATH) {
        OFlags::CLOEXEC
    } else {
        OFlags::CLOEXEC | OFlags::NOCTTY
    };
    Ok(rustix::fs::openat2(
        &dir,
        rel,
        flags | extra,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )?)
}

/// The identity of a file as `/proc/locks` prints it: (major, minor, inode). A file may show
/// up under either of two devices: the one `stat` reports and the one of its mount's
/// superblock (overlayfs and btrfs report different ones).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileKey {
    devs: Vec<(u32, u32)>,
    ino: u64,
}

fn file_key(fd: &OwnedFd) -> io::Result<FileKey> {
    let st = rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::INO | StatxFlags::MNT_ID,
    )?;
    let mut devs = vec![(st.stx_dev_major, st.stx_dev_minor)];
    if st.stx_mask & StatxFlags::MNT_ID.bits() != 0
        && let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo")
        && let Some(dev) = mount_device(&info, st.stx_mnt_id)
        && !devs.contains(&dev)
    {
        devs.push(dev);
    }
    Ok(FileKey {
        devs,
        ino: st.stx_ino,
    })
}

/// The `major:minor` of mount `id` in a `/proc/self/mountinfo` text.
fn mount_device(mountinfo: &str, id: u64) -> Option<(u32, u32)> {
    mountinfo.lines().find_map(|line| {
        let mut fields = line.split_ascii_whitespace();
        let mount_id: u64 = fields.next()?.parse().ok()?;
        if mount_id != id {
            return None;
        }
        let _parent = fields.next()?;
        let (major, minor) = fields.next()?.split_once(':')?;
        Some((major.parse().ok()?, minor.parse().ok()?))
    })
}

/// One entry of `/proc/locks` (or a `lock:` line of fdinfo).
#[derive(Debug, Clone, PartialEq, Eq)]
struct LockEntry {
    /// `POSIX`, `OFDLCK`, `FLOCK`, `LEASE`, ...
    class: String,
    /// PID as printed; -1 for OFD locks, 0 when the owner is in a PID namespace we cannot see.
    pid: i64,
    dev: (u32, u32),
    ino: u64,
}

/// Parses a line such as `1: POSIX  ADVISORY  WRITE 4242 00:37:382079 0 EOF`. Waiters
/// (`1: -> POSIX ...`) are skipped: they do not hold the lock.
fn parse_lock_line(line: &str) -> Option<LockEntry> {
    let line = line.trim_start().strip_prefix("lock:").unwrap_or(line);
    let mut fields = line.split_ascii_whitespace();
    let _ordinal = fields.next()?;
    let class = fields.next()?;
    if class == "->" {
        return None;
    }
    let _mode = fields.next()?;
    let _rw = fields.next()?;
    let pid: i64 = fields.next()?.parse().ok()?;
    let mut id = fields.next()?.split(':');
    let major = u32::from_str_radix(id.next()?, 16).ok()?;
    let minor = u32::from_str_radix(id.next()?, 16).ok()?;
    let ino = id.next()?.parse().ok()?;
    Some(LockEntry {
        class: class.to_string(),
        pid,
        dev: (major, minor),
        ino,
    })
}

fn matches(entry: &LockEntry, key: &FileKey) -> bool {
    // flock(2) locks and leases do not conflict with fcntl locks.
    matches!(entry.class.as_str(), "POSIX" | "OFDLCK")
        && entry.ino == key.ino
        && key.devs.contains(&entry.dev)
}

/// Finds a process with an open file description carrying a lock on `key`, for OFD locks
/// whose owner `/proc/locks` does not name.
fn find_ofd_owner(key: &FileKey) -> Option<u32> {
    let procs = std::fs::read_dir("/proc").ok()?;
    for proc_entry in procs.flatten() {
        let Some(pid) = proc_entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(proc_entry.path().join("fdinfo")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(info) = std::fs::read_to_string(fd.path()) else {
                continue;
            };
            if info
                .lines()
                .filter(|l| l.starts_with("lock:"))
                .filter_map(parse_lock_line)
                .any(|e| matches(&e, key))
            {
                return Some(pid);
            }
        }
    }
    None
}

/// Who holds an fcntl lock on `rel` under `root`, or `None` when the file is unlocked or
/// does not exist.
///
/// Not for a process that may hold the lock itself: closing our descriptor of the file would
/// release that process's POSIX locks on it.
pub fn fcntl_holder(root: &Path, rel: &Path) -> io::Result<Option<LockHolder>> {
    let fd = match open_in_root(root, rel, OFlags::RDONLY | OFlags::NONBLOCK) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let key = file_key(&fd)?;
    // Closing our descriptor cannot drop anyone's lock: POSIX locks are only released when
    // their owning process closes a descriptor, and we own none.
    drop(fd);
    let locks = std::fs::read_to_string("/proc/locks")?;
    let Some(entry) = locks
        .lines()
        .filter_map(parse_lock_line)
        .find(|e| matches(e, &key))
    else {
        return Ok(None);
    };
    let pid = match u32::try_from(entry.pid) {
        Ok(pid) if pid > 0 => Some(pid),
        _ => find_ofd_owner(&key),
    };
    Ok(Some(match pid {
        Some(pid) => LockHolder::from_pid(pid),
        None => LockHolder {
            pid: None,
            command: None,
        },
    }))
}

/// Who holds a PID-file lock (dnf's `*_lock.pid`): the file exists and names a live process.
pub fn pidfile_holder(root: &Path, rel: &Path) -> io::Result<Option<LockHolder>> {
    let fd = match open_in_root(root, rel, OFlags::RDONLY | OFlags::NONBLOCK) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut buf = [0u8; 32];
    let n = rustix::io::read(&fd, &mut buf)?;
    let Some(pid) = std::str::from_utf8(&buf[..n])
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|p| *p > 0)
    else {
        return Ok(None);
    };
    if Path::new(&format!("/proc/{pid}")).exists() {
        Ok(Some(LockHolder::from_pid(pid)))
    } else {
        Ok(None)
    }
}

/// How a package manager's lock is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockStyle {
    /// An fcntl write lock on the file (dpkg, apt, rpm).
    Fcntl,
    /// A file holding the PID of the owner (dnf).
    PidFile,
}

/// One lock a package manager takes, by its path inside the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockSpec {
    /// For messages: "dpkg lock", "rpm lock", "dnf lock".
    pub label: &'static str,
    /// Absolute path inside the root.
    pub path: PathBuf,
    /// How it is taken.
    pub style: LockStyle,
}

impl LockSpec {
    /// An fcntl lock.
    pub fn fcntl(label: &'static str, path: &str) -> LockSpec {
        LockSpec {
            label,
            path: PathBuf::from(path),
            style: LockStyle::Fcntl,
        }
    }

    /// A PID-file lock.
    pub fn pidfile(label: &'static str, path: &str) -> LockSpec {
        LockSpec {
            label,
            path: PathBuf::from(path),
            style: LockStyle::PidFile,
        }
    }

    /// Who holds this lock under `root`, if anyone.
    pub fn holder(&self, root: &Path) -> io::Result<Option<LockHolder>> {
        match self.style {
            LockStyle::Fcntl => fcntl_holder(root, &self.path),
            LockStyle::PidFile => pidfile_holder(root, &self.path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn parses_proc_locks_lines() {
        assert_eq!(
            parse_lock_line("1: POSIX  ADVISORY  WRITE 4242 00:37:382079 0 EOF"),
            Some(LockEntry {
                class: "POSIX".into(),
                pid: 4242,
                dev: (0, 0x37),
                ino: 382079
            })
        );
        assert_eq!(
            parse_lock_line("2: OFDLCK ADVISORY  READ  -1 fd:01:12 0 EOF"),
            Some(LockEntry {
                class: "OFDLCK".into(),
                pid: -1,
                dev: (0xfd, 1),
                ino: 12
            })
        );
        assert_eq!(
            parse_lock_line("lock:\t1: POSIX  ADVISORY  WRITE 7 103:02:99 0 EOF"),
            Some(LockEntry {
                class: "POSIX".into(),
                pid: 7,
                dev: (0x103, 2),
                ino: 99
            })
        );
        assert_eq!(
            parse_lock_line("1: -> POSIX  ADVISORY  WRITE 4243 00:37:382079 0 EOF"),
            None
        );
        assert_eq!(parse_lock_line("garbage"), None);
    }

    #[test]
    fn finds_the_device_of_a_mount() {
        let info = "24 1 0:22 / /sys rw - sysfs sysfs rw\n202 27 0:55 / /tmp/R rw - overlay o rw\n";
        assert_eq!(mount_device(info, 202), Some((0, 55)));
        assert_eq!(mount_device(info, 7), None);
    }

    const HOLD_ENV: &str = "INPLACE_AGENT_TEST_HOLD_LOCK";

    /// Run by the tests below in a child process (closing any descriptor of a file drops the
    /// POSIX locks of the whole process, so the holder must be another process): takes an
    /// fcntl write lock on the file named by the environment, says so, and keeps it until its
    /// stdin closes.
    #[test]
    #[ignore = "helper process for the lock tests, started by them"]
    fn lock_holder_process() {
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
        rustix::fs::fcntl_lock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .unwrap();
        println!("\nLOCK-HELD");
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new()).unwrap();
    }

    /// A child process holding an fcntl lock; dropping it releases the lock. Its stdout is
    /// kept open so the child can finish its report.
    struct Holder(
        std::process::Child,
        #[allow(dead_code)] std::io::BufReader<std::process::ChildStdout>,
    );

    impl Holder {
        fn start(path: &Path) -> Holder {
            use std::io::BufRead;
            let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "host::locks::tests::lock_holder_process",
                    "--exact",
                    "--ignored",
                ])
                .args(["--nocapture", "--test-threads=1"])
                .env(HOLD_ENV, path)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            while out.read_line(&mut line).unwrap() > 0 {
                if line.contains("LOCK-HELD") {
                    return Holder(child, out);
                }
                line.clear();
            }
            let status = child.wait();
            panic!("lock holder exited without taking the lock: {status:?}");
        }
        fn pid(&self) -> u32 {
            self.0.id()
        }
    }

    impl Drop for Holder {
        fn drop(&mut self) {
            drop(self.0.stdin.take());
            let _ = self.0.wait();
        }
    }

    #[test]
    fn reports_the_holder_and_nothing_after_release() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("var/lib/dpkg/lock-frontend");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(b"")
            .unwrap();
        let rel = Path::new("/var/lib/dpkg/lock-frontend");
        assert_eq!(fcntl_holder(dir.path(), rel).unwrap(), None);

        let holder = Holder::start(&path);
        let found = fcntl_holder(dir.path(), rel)
            .unwrap()
            .expect("lock is held");
        assert_eq!(found.pid, Some(holder.pid()));
        assert!(found.command.is_some());
        assert!(
            found
                .to_string()
                .starts_with(&format!("PID {} (", holder.pid()))
        );
        // The fdinfo search (used for OFD locks, whose owner /proc/locks hides) finds it too.
        let fd = open_in_root(dir.path(), rel, OFlags::RDONLY).unwrap();
        assert_eq!(find_ofd_owner(&file_key(&fd).unwrap()), Some(holder.pid()));

        drop(holder);
        assert_eq!(fcntl_holder(dir.path(), rel).unwrap(), None);
        assert_eq!(
            fcntl_holder(dir.path(), Path::new("/missing")).unwrap(),
            None
        );
    }

    #[test]
    fn a_lock_on_another_file_is_not_ours() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::File::create(dir.path().join("b")).unwrap();
        let _holder = Holder::start(&dir.path().join("a"));
        assert!(fcntl_holder(dir.path(), Path::new("a")).unwrap().is_some());
        assert_eq!(fcntl_holder(dir.path(), Path::new("b")).unwrap(), None);
    }

    #[test]
    fn symlinks_cannot_lead_outside_the_root() {
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("lock");
        let _holder = Holder::start(&target);
        let root = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&target, root.path().join("lock")).unwrap();
        assert!(
            fcntl_holder(outside.path(), Path::new("lock"))
                .unwrap()
                .is_some()
        );
        // The absolute symlink is resolved inside the root, where it names nothing.
        assert_eq!(fcntl_holder(root.path(), Path::new("lock")).unwrap(), None);
    }

    #[test]
    fn pid_files_name_live_processes_only() {
        let dir = tempfile::tempdir().unwrap();
        let rel = Path::new("/var/cache/dnf/metadata_lock.pid");
        std::fs::create_dir_all(dir.path().join("var/cache/dnf")).unwrap();
        assert_eq!(pidfile_holder(dir.path(), rel).unwrap(), None);
        let file = dir.path().join("var/cache/dnf/metadata_lock.pid");
        std::fs::write(&file, std::process::id().to_string()).unwrap();
        let holder = pidfile_holder(dir.path(), rel).unwrap().unwrap();
        assert_eq!(holder.pid, Some(std::process::id()));
        // A PID beyond pid_max cannot be alive.
        std::fs::write(&file, "4194305").unwrap();
        assert_eq!(pidfile_holder(dir.path(), rel).unwrap(), None);
        std::fs::write(&file, "junk").unwrap();
        assert_eq!(pidfile_holder(dir.path(), rel).unwrap(), None);
    }
}
