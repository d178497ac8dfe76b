//! Notice of writes under the node's directories (inotify), for drift checks: which
//! directories to watch is the caller's; this only says "something changed there". Nothing
//! is read or written on the node.
//!
//! A directory asked for that does not exist (yet) is stood in for by its nearest existing
//! ancestor, watched only for the entry on the way to it: when that entry appears, the watch
//! moves down (to the directory itself once it exists), and when a watched directory goes,
//! back up to what remains. So a file made in a directory created after the watch began is
//! noticed as soon as any other write (decision 0016). At most [`MAX_WATCHES`] directories
//! are watched; the rest are covered by the periodic check only.

use std::collections::{BTreeMap, BTreeSet};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;

use rustix::fs::inotify;

use super::Host;
use inplace_plan::NodePath;

/// The most directories one watch asks for (each is at most one inotify watch: the
/// directory or its stand-in). The kernel's default `max_user_watches` is 8,192 or more per
/// user; a plan writing into more directories than this is covered by the periodic check.
pub const MAX_WATCHES: usize = 1024;

/// What is noticed in a watched directory: a file written and closed, renamed in or out,
/// created, removed, or its mode or owner changed; and the directory itself removed or
/// renamed (the watch then moves to what remains).
fn interesting() -> inotify::WatchFlags {
    use inotify::WatchFlags as W;
    W::CLOSE_WRITE
        | W::MOVED_TO
        | W::MOVED_FROM
        | W::CREATE
        | W::DELETE
        | W::ATTRIB
        | W::DELETE_SELF
        | W::MOVE_SELF
}

/// One inotify watch: the directory (its node path; `/` is the root) and why it is watched.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Watched {
    /// The node path watched.
    dir: String,
    /// It is a directory asked for: every event in it counts.
    wanted: bool,
    /// Its entries on the way to directories asked for that do not exist yet: an event
    /// naming one of them moves the watches.
    toward: BTreeSet<String>,
}

/// An inotify instance watching directories of the node (non-blocking).
#[derive(Debug)]
pub struct DirWatch {
    fd: OwnedFd,
    /// The node's root on this host.
    root: PathBuf,
    /// The directories asked for (at most [`MAX_WATCHES`]).
    wanted: Vec<NodePath>,
    /// How many directories asked for were left out (beyond [`MAX_WATCHES`]).
    left_out: usize,
    /// Each watch, by its descriptor.
    watches: BTreeMap<i32, Watched>,
}

/// How many times one rescan follows directories that appeared while it placed watches.
const MAX_RESCANS: usize = 16;

impl DirWatch {
    /// Watches each of `dirs`, or, for one that does not exist, its nearest existing
    /// ancestor until it does. Symlinks are not followed (a directory reached through one is
    /// stood in for by the directory holding the link).
    pub fn new(host: &Host, dirs: &BTreeSet<NodePath>) -> std::io::Result<DirWatch> {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?;
        let mut watch = DirWatch {
            fd,
            root: host.root.path().to_path_buf(),
            wanted: dirs.iter().take(MAX_WATCHES).cloned().collect(),
            left_out: dirs.len().saturating_sub(MAX_WATCHES),
            watches: BTreeMap::new(),
        };
        watch.rescan();
        Ok(watch)
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

    /// The directories asked for that are watched themselves (they exist).
    pub fn watched(&self) -> Vec<NodePath> {
        let mut out: Vec<NodePath> = self
            .watches
            .values()
            .filter(|w| w.wanted)
            .filter_map(|w| NodePath::parse(&w.dir).ok())
            .collect();
        out.sort();
        out
    }

    /// The directories watched in place of ones asked for that do not exist (`/`: the root).
    pub fn stand_ins(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .watches
            .values()
            .filter(|w| !w.wanted)
            .map(|w| w.dir.clone())
            .collect();
        out.sort();
        out
    }

    /// How many directories asked for are not watched at all (beyond [`MAX_WATCHES`]).
    pub fn left_out(&self) -> usize {
        self.left_out
    }

    /// Reads every pending event; true when one may matter for drift: a change in a
    /// directory asked for, or a directory on the way to one appearing or going (the
    /// watches then move). Writes elsewhere in a stand-in directory do not count.
    pub fn drain(&mut self) -> bool {
        use inotify::ReadFlags as R;
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(&self.fd, &mut buf);
        let (mut relevant, mut rescan) = (false, false);
        while let Ok(event) = reader.next() {
            let flags = event.events();
            if flags.contains(R::QUEUE_OVERFLOW) {
                // Events were lost: anything may have happened.
                relevant = true;
                rescan = true;
                continue;
            }
            let Some(watched) = self.watches.get(&event.wd()) else {
                continue;
            };
            if flags.intersects(R::IGNORED | R::DELETE_SELF | R::MOVE_SELF | R::UNMOUNT) {
                rescan = true;
                relevant |= watched.wanted;
                continue;
            }
            let on_the_way = event
                .file_name()
                .and_then(|n| n.to_str().ok())
                .is_some_and(|n| watched.toward.contains(n));
            if on_the_way {
                rescan = true;
                relevant = true;
            }
            relevant |= watched.wanted;
        }
        if rescan {
            relevant |= self.rescan();
        }
        relevant
    }

    /// Puts the watches where they belong now ([`DirWatch::place`]), again while a
    /// directory on the way appeared between the look and the watch: its creation happened
    /// before anything watched its parent, so no event will ever tell of it, nor of what was
    /// made inside it meanwhile. True when that happened (a check is due: files may already
    /// be there). Bounded: a tree made faster than it can be followed is left to the next
    /// event or the interval.
    fn rescan(&mut self) -> bool {
        let mut appeared = false;
        for _ in 0..MAX_RESCANS {
            // A directory that went between the look and the watch leaves its targets
            // unwatched, and no event would move them again: look again.
            let vanished = !self.place();
            let missed = self.watches.values().any(|w| {
                w.toward.iter().any(|name| {
                    std::fs::symlink_metadata(
                        self.root.join(w.dir.trim_start_matches('/')).join(name),
                    )
                    .is_ok_and(|m| m.is_dir())
                })
            });
            if !missed && !vanished {
                return appeared;
            }
            appeared = true;
        }
        appeared
    }

    /// Puts the watches where they belong as the node is now: on each directory asked for
    /// that exists, else on its nearest existing ancestor; removes those no longer needed.
    /// False when a directory looked at was gone before it could be watched.
    fn place(&mut self) -> bool {
        let mut all = true;
        // Node path watched -> (asked for itself, entries on the way).
        let mut plan: BTreeMap<String, (bool, BTreeSet<String>)> = BTreeMap::new();
        for dir in &self.wanted {
            let (existing, next) = self.nearest_existing(dir);
            let entry = plan.entry(existing).or_default();
            match next {
                None => entry.0 = true,
                Some(name) => {
                    entry.1.insert(name);
                }
            }
        }
        let mut now: BTreeMap<i32, Watched> = BTreeMap::new();
        let flags = interesting() | inotify::WatchFlags::ONLYDIR | inotify::WatchFlags::DONT_FOLLOW;
        for (dir, (wanted, toward)) in plan {
            let path = self.root.join(dir.trim_start_matches('/'));
            match inotify::add_watch(&self.fd, &path, flags) {
                Ok(wd) => {
                    now.insert(
                        wd,
                        Watched {
                            dir,
                            wanted,
                            toward,
                        },
                    );
                }
                // Gone since it was looked at: the caller looks again.
                Err(_) => all = false,
            }
        }
        for wd in self.watches.keys() {
            if !now.contains_key(wd) {
                // Already gone when its directory went; nothing to do then.
                let _ = inotify::remove_watch(&self.fd, *wd);
            }
        }
        self.watches = now;
        all
    }

    /// The deepest directory of `dir` and its ancestors that exists as a directory (not
    /// through a symlink), as a node path (`/` for the root), and the name of its entry on
    /// the way to `dir` (`None` when it is `dir`).
    fn nearest_existing(&self, dir: &NodePath) -> (String, Option<String>) {
        let mut found = "/".to_string();
        for ancestor in dir.ancestors_from_top() {
            let is_dir = std::fs::symlink_metadata(self.root.join(ancestor.relative()))
                .is_ok_and(|m| m.is_dir());
            if !is_dir {
                return (found, Some(ancestor.file_name().to_string()));
            }
            found = ancestor.as_str().to_string();
        }
        (found, None)
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
        let dirs: BTreeSet<NodePath> = ["/etc/kubernetes"]
            .iter()
            .map(|p| NodePath::parse(p).unwrap())
            .collect();
        let mut watch = DirWatch::new(&host, &dirs).unwrap();
        assert_eq!(
            watch.watched(),
            vec![NodePath::parse("/etc/kubernetes").unwrap()]
        );
        assert!(!watch.drain());
        std::fs::write(dir.path().join("etc/other/x"), "x").unwrap();
        assert!(!watch.drain());
        std::fs::write(dir.path().join("etc/kubernetes/x"), "x").unwrap();
        assert!(watch.drain());
        assert!(!watch.drain());
    }

    #[test]
    fn a_directory_made_after_the_watch_began_is_watched_as_it_appears_and_goes() {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc");
        std::fs::create_dir_all(&etc).unwrap();
        let host = host_at(dir.path());
        let dirs: BTreeSet<NodePath> = [NodePath::parse("/etc/late.d/deeper").unwrap()].into();
        let mut watch = DirWatch::new(&host, &dirs).unwrap();
        assert!(watch.watched().is_empty());
        assert_eq!(watch.stand_ins(), ["/etc"]);
        // Other writes beside the way do not count.
        std::fs::write(etc.join("unrelated"), "x").unwrap();
        assert!(!watch.drain());
        // The way appears: noticed, and the watch moves down, then onto the directory.
        std::fs::create_dir(etc.join("late.d")).unwrap();
        assert!(watch.drain());
        assert_eq!(watch.stand_ins(), ["/etc/late.d"]);
        std::fs::create_dir(etc.join("late.d/deeper")).unwrap();
        assert!(watch.drain());
        assert!(watch.stand_ins().is_empty());
        assert_eq!(watch.watched(), dirs.iter().cloned().collect::<Vec<_>>());
        std::fs::write(etc.join("late.d/deeper/x.conf"), "x").unwrap();
        assert!(watch.drain());
        std::fs::write(etc.join("unrelated"), "y").unwrap();
        assert!(!watch.drain(), "the stand-in was left");
        // Removed with its parent: noticed, and stood in for by what remains.
        std::fs::remove_dir_all(etc.join("late.d")).unwrap();
        assert!(watch.drain());
        assert_eq!(watch.stand_ins(), ["/etc"]);
        // Made at once, as `mkdir -p` does: the watch lands on the directory.
        std::fs::create_dir_all(etc.join("late.d/deeper")).unwrap();
        assert!(watch.drain());
        assert_eq!(watch.watched().len(), 1, "{:?}", watch.stand_ins());
    }

    #[test]
    fn a_missing_top_level_directory_is_stood_in_for_by_the_root_and_watches_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let host = host_at(dir.path());
        let dirs: BTreeSet<NodePath> = (0..MAX_WATCHES + 5)
            .map(|i| NodePath::parse(&format!("/opt{i}")).unwrap())
            .collect();
        let mut watch = DirWatch::new(&host, &dirs).unwrap();
        assert_eq!(watch.stand_ins(), ["/"]);
        assert_eq!(watch.left_out(), 5);
        std::fs::write(dir.path().join("elsewhere"), "x").unwrap();
        assert!(!watch.drain());
        std::fs::create_dir(dir.path().join("opt1")).unwrap();
        assert!(watch.drain());
        assert_eq!(watch.watched(), [NodePath::parse("/opt1").unwrap()]);
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
