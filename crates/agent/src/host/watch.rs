//! Notice of writes under the node's directories (inotify), for drift checks: which
//! directories to watch is the caller's; this only says "something changed there". Nothing
//! is read or written on the node.

use std::collections::BTreeSet;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use rustix::fs::inotify;

use super::Host;
use inplace_plan::NodePath;

/// What is noticed in a watched directory: a file written and closed, renamed in or out,
/// created, removed, or its mode or owner changed.
fn interesting() -> inotify::WatchFlags {
    use inotify::WatchFlags as W;
    W::CLOSE_WRITE | W::MOVED_TO | W::MOVED_FROM | W::CREATE | W::DELETE | W::ATTRIB
}

/// An inotify instance watching directories of the node (non-blocking).
#[derive(Debug)]
pub struct DirWatch {
    fd: OwnedFd,
    /// The directories watched (those that existed when added).
    watched: Vec<NodePath>,
}

impl DirWatch {
    /// Watches each of `dirs` that exists (a missing one is skipped: the periodic check
    /// covers it). Symlinks are not followed.
    pub fn new(host: &Host, dirs: &BTreeSet<NodePath>) -> std::io::Result<DirWatch> {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?;
        let mut watched = Vec::new();
        for dir in dirs {
            let path = host.root.host_path(dir);
            let flags =
                interesting() | inotify::WatchFlags::ONLYDIR | inotify::WatchFlags::DONT_FOLLOW;
            if inotify::add_watch(&fd, &path, flags).is_ok() {
                watched.push(dir.clone());
            }
        }
        Ok(DirWatch { fd, watched })
    }

    /// Registers the watch with the current Tokio runtime, to await its readiness.
    pub fn into_async(self) -> std::io::Result<tokio::io::unix::AsyncFd<DirWatch>> {
        // SAFETY: the descriptor is owned by the `DirWatch` that the `AsyncFd` owns from
        // here on, so it stays open and is not reused until the `AsyncFd` is dropped (which
        // deregisters it before it drops the `DirWatch`).
        #[allow(unsafe_code)]
        unsafe {
            tokio::io::unix::AsyncFd::register(self).map_err(std::io::Error::from)
        }
    }

    /// The descriptor to wait on (readable when something changed).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The directories watched.
    pub fn watched(&self) -> &[NodePath] {
        &self.watched
    }

    /// Reads every pending event; true when there was at least one.
    pub fn drain(&self) -> bool {
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(&self.fd, &mut buf);
        let mut any = false;
        while reader.next().is_ok() {
            any = true;
        }
        any
    }
}

impl AsRawFd for DirWatch {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// What a path's metadata says about it: equal stamps mean the same file with the same
/// content, mode and owner (any write, chmod, chown or rename changes its inode change time,
/// which nobody can set back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

/// The stamp of each of `paths` on the node (`None`: nothing there, or it cannot be read);
/// a final symlink is not followed.
pub fn stamps(host: &Host, paths: &[NodePath]) -> Vec<Option<Stamp>> {
    paths.iter().map(|p| stamp(host, p.as_str())).collect()
}

/// The stamp of the node path `path`.
fn stamp(host: &Host, path: &str) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::symlink_metadata(host.root.path().join(path.trim_start_matches('/'))).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mode: m.mode(),
        uid: m.uid(),
        gid: m.gid(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// Node paths with the stamps they had, kept between drift checks in two allocations: the
/// paths in one string, the stamps in one array. (Five hundred separately allocated paths,
/// made while a check's larger buffers came and went, stayed scattered over the heap and
/// kept its pages resident after the rest was given back.)
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stamped {
    /// The paths, each followed by a NUL (which no node path holds).
    paths: String,
    stamps: Vec<Option<Stamp>>,
}

impl Stamped {
    /// The stamps of `paths` now.
    pub fn take(host: &Host, paths: &[NodePath]) -> Stamped {
        let mut text = String::with_capacity(paths.iter().map(|p| p.as_str().len() + 1).sum());
        for p in paths {
            text.push_str(p.as_str());
            text.push('\0');
        }
        Stamped {
            paths: text,
            stamps: stamps(host, paths),
        }
    }

    /// True when every path still has the stamp it had.
    pub fn unchanged(&self, host: &Host) -> bool {
        let paths = self.paths.split_terminator('\0');
        paths.clone().count() == self.stamps.len()
            && paths
                .zip(&self.stamps)
                .all(|(path, was)| stamp(host, path) == *was)
    }

    /// How many paths.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host over the tree at `root`, with no services.
    fn host_at(root: &std::path::Path) -> Host {
        Host::open(crate::host::HostSettings {
            root: root.to_path_buf(),
            allow: inplace_plan::AllowList::default(),
            commands_in_root: false,
            boot_id_path: None,
            services: crate::host::ServiceSettings::Off,
            packages: Default::default(),
            downloads: crate::host::download::DownloadConfig::new(root),
        })
        .unwrap()
    }

    #[test]
    fn a_write_in_a_watched_directory_is_noticed_and_elsewhere_is_not() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc/kubernetes")).unwrap();
        std::fs::create_dir_all(dir.path().join("etc/other")).unwrap();
        let host = host_at(dir.path());
        let dirs: BTreeSet<NodePath> = ["/etc/kubernetes", "/etc/missing"]
            .iter()
            .map(|p| NodePath::parse(p).unwrap())
            .collect();
        let watch = DirWatch::new(&host, &dirs).unwrap();
        assert_eq!(
            watch.watched(),
            &[NodePath::parse("/etc/kubernetes").unwrap()]
        );
        assert!(!watch.drain());
        std::fs::write(dir.path().join("etc/other/x"), "x").unwrap();
        assert!(!watch.drain());
        std::fs::write(dir.path().join("etc/kubernetes/x"), "x").unwrap();
        assert!(watch.drain());
        assert!(!watch.drain());
    }

    #[test]
    fn a_stamp_changes_with_content_mode_and_presence() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        let host = host_at(dir.path());
        let paths = [NodePath::parse("/etc/x").unwrap()];
        let file = dir.path().join("etc/x");
        assert_eq!(stamps(&host, &paths), vec![None]);
        std::fs::write(&file, "a").unwrap();
        let first = stamps(&host, &paths);
        assert!(first[0].is_some());
        assert_eq!(stamps(&host, &paths), first);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let second = stamps(&host, &paths);
        assert_ne!(second, first);
        std::fs::write(&file, "b").unwrap();
        assert_ne!(stamps(&host, &paths), second);
    }

    #[test]
    fn stamped_paths_vouch_until_one_of_them_changes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc/a")).unwrap();
        std::fs::write(dir.path().join("etc/a/x"), "x").unwrap();
        std::fs::write(dir.path().join("etc/y"), "y").unwrap();
        let host = host_at(dir.path());
        let paths = ["/etc/a/x", "/etc/y", "/etc/missing"].map(|p| NodePath::parse(p).unwrap());
        let stamped = Stamped::take(&host, &paths);
        assert_eq!(stamped.len(), 3);
        assert!(stamped.unchanged(&host));
        let copy: Stamped =
            serde_json::from_str(&serde_json::to_string(&stamped).unwrap()).unwrap();
        assert_eq!(copy, stamped);
        std::fs::write(dir.path().join("etc/missing"), "now here").unwrap();
        assert!(!stamped.unchanged(&host));
        assert!(Stamped::take(&host, &paths).unchanged(&host));
        let only_x = Stamped::take(&host, &paths[..1]);
        std::fs::write(dir.path().join("etc/y"), "Y").unwrap();
        assert!(only_x.unchanged(&host), "a path not stamped does not count");
    }
}
