//! Safe, durable file I/O under a root directory, confined to the allow-list.
//!
//! **The allow-list holds at the moment of every access**, not only at admission: a path
//! below an allow-listed directory is reached by opening that directory (resolved inside the
//! root with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`, its real location read back
//! from `/proc/self/fd` and checked against the allow-list) and then resolving the rest
//! beneath it with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`. A symlink planted below an
//! allow-listed directory at any time — after admission, during a download, before a rollback
//! — makes the access fail; it can never lead a write, rename, removal or directory creation
//! elsewhere. Paths outside the allow-list can be read (accounts, os-release) but never
//! changed; directories above an allow-listed one are created (and removed, when empty) only
//! as the way to it. Final components are never followed.
//!
//! Writes are atomic and durable: temp file in the same directory (`O_EXCL`),
//! fchown/fchmod, fsync, rename, fsync of the directory. A failed write removes its temp
//! file; a crash can leave one, named `.<name>.inplace-tmp`, which [`Root::sweep_temp`]
//! removes on resume.

use inplace_base::{Compared, FileMeta};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode as RMode, OFlags, ResolveFlags};
use sha2::{Digest, Sha256};

use crate::failpoint;
use inplace_plan::{AllowList, NodePath};

/// Parent directories resolved by [`Root::check_path_in`] or [`Root::read_in`], by node
/// path (`None`: it does not exist yet). It holds at most [`DirCache::MOST`] open
/// directories: a plan of files in thousands of directories does not run out of file
/// descriptors.
#[derive(Debug, Default)]
pub struct DirCache {
    dirs: std::collections::HashMap<String, Option<OwnedFd>>,
}

impl DirCache {
    /// Directories held open at most; the cache starts over when it is full.
    const MOST: usize = 64;

    /// The parent directory of `p` as `resolve` opens it, resolved once and kept; a
    /// directory found missing is resolved again when `missing_again` is set.
    fn parent(
        &mut self,
        p: &NodePath,
        missing_again: bool,
        resolve: impl FnOnce() -> Result<Option<OwnedFd>, FsError>,
    ) -> Result<Option<&OwnedFd>, FsError> {
        let key = p.parent().map_or_else(String::new, |d| d.to_string());
        let known = match self.dirs.get(&key) {
            Some(Some(_)) => true,
            Some(None) => !missing_again,
            None => false,
        };
        if !known {
            let fd = resolve()?;
            if self.dirs.len() >= Self::MOST && !self.dirs.contains_key(&key) {
                self.dirs.clear();
            }
            self.dirs.insert(key.clone(), fd);
        }
        Ok(self.dirs[&key].as_ref())
    }
}

pub use inplace_base::Existing;

/// A failed file operation, naming the operation and the node path.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// An I/O error.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done ("write", "read", "rename").
        op: &'static str,
        /// The node path.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The final component is a symlink; the agent never writes through one.
    #[error("{path} is a symlink to {target}; refusing to follow it")]
    Symlink {
        /// The node path.
        path: String,
        /// Where it points.
        target: String,
    },
    /// The path resolves (through symlinks in its directories) outside the allow-list.
    #[error("{path} resolves through a symlink to {resolved}, which is outside the allow-list")]
    Escapes {
        /// The node path.
        path: String,
        /// Where it really is.
        resolved: String,
    },
    /// A symlink below an allow-listed directory, on the way to the path: never followed,
    /// whenever it appeared (before admission or planted since).
    #[error(
        "{path}{}: {link} is a symlink to {target}, and the agent never follows symlinks below an allow-listed directory ({entry})",
        resolved.as_ref().map(|r| format!(" resolves through a symlink to {r}")).unwrap_or_default()
    )]
    SymlinkBelow {
        /// The node path accessed.
        path: String,
        /// The symlink on its way.
        link: String,
        /// Where the symlink points.
        target: String,
        /// Where the path would really lead, when that can be told.
        resolved: Option<String>,
        /// The allow-listed directory it is below.
        entry: String,
    },
    /// A path outside the allow-list: never changed.
    #[error("{path} is outside the allow-list ({allow}); the agent changes nothing there")]
    NotAllowed {
        /// The node path.
        path: String,
        /// The allow-list.
        allow: String,
    },
    /// Something that is not a directory is on the way to the path.
    #[error("{path}: {blocker} is a {kind}, not a directory")]
    NotADirectory {
        /// The node path accessed.
        path: String,
        /// What is in the way.
        blocker: String,
        /// What it is.
        kind: &'static str,
    },
    /// Something other than a regular file is in the way.
    #[error("{path} is a {kind}, not a regular file")]
    NotAFile {
        /// The node path.
        path: String,
        /// What it is.
        kind: &'static str,
    },
}

impl FsError {
    /// The OS error code, if any (ENOSPC tests use it).
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            FsError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

fn io_err<'a>(op: &'static str, path: &'a NodePath) -> impl FnOnce(io::Error) -> FsError + 'a {
    move |source| FsError::Io {
        op,
        path: path.to_string(),
        source,
    }
}

fn rio(e: rustix::io::Errno) -> io::Error {
    io::Error::from(e)
}

/// The root directory every node path is relative to (`/` on a node, `/host` in the
/// DaemonSet, a sandbox in tests), with the allow-list every change is confined to.
#[derive(Debug)]
pub struct Root {
    dir: OwnedFd,
    path: PathBuf,
    /// What the kernel calls the root directory (`/proc/self/fd/N`), the prefix every
    /// resolved path starts with. Usually `path`; not for a root reached through another
    /// mount namespace (`/proc/<pid>/root` of a sandboxed node), whose real name is a path
    /// in that namespace.
    real: PathBuf,
    allow: AllowList,
}

/// What [`Root::open_existing`] found.
enum Opened {
    Absent,
    File(File, FileMeta, u64),
    Other(&'static str),
}

/// How a node path is reached.
enum Place<'a> {
    /// Strictly below this allow-list entry: through the entry, then beneath it without
    /// symlinks.
    Beneath(&'a NodePath),
    /// Outside every entry: read inside the root, never changed.
    Outside,
    /// The allow-list is [`AllowList::everything`]: anywhere inside the root.
    Anywhere,
}

/// What the way to a directory looks like.
enum DirState {
    /// It exists and is open.
    Open(OwnedFd),
    /// It does not exist (and creating it would put it in an allow-listed place).
    Missing,
}

/// Resolution inside the root: symlinks followed but never out of the root.
const IN_ROOT: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);
/// Resolution below an allow-listed directory: no symlink at all, never above it.
const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);
const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::CLOEXEC);

impl Root {
    /// Opens the root directory; every change through it is confined to `allow`. Its path
    /// is kept canonical when that names the same directory, and as given (made absolute)
    /// otherwise: `/proc/<pid>/root` of a process in another mount namespace canonicalizes
    /// to a path that only exists in that namespace.
    pub fn open(path: &Path, allow: AllowList) -> io::Result<Root> {
        let named = |e: &dyn std::fmt::Display| format!("root {}: {e}", path.display());
        let dir = rustix::fs::open(path, DIR_FLAGS, RMode::empty())
            .map_err(|e| io::Error::new(rio(e).kind(), named(&e)))?;
        use std::os::fd::AsRawFd;
        let real = std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))
            .map_err(|e| io::Error::new(e.kind(), named(&e)))?;
        let st = rustix::fs::fstat(&dir).map_err(|e| io::Error::new(rio(e).kind(), named(&e)))?;
        let same = |p: &Path| {
            rustix::fs::stat(p).is_ok_and(|o| o.st_dev == st.st_dev && o.st_ino == st.st_ino)
        };
        let path = match std::fs::canonicalize(path) {
            Ok(canonical) if same(&canonical) => canonical,
            _ => std::path::absolute(path).map_err(|e| io::Error::new(e.kind(), named(&e)))?,
        };
        Ok(Root {
            dir,
            path,
            real,
            allow,
        })
    }

    /// The root's path on the agent's own filesystem.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The allow-list every change is confined to.
    pub fn allow_list(&self) -> &AllowList {
        &self.allow
    }

    /// True when the root is `/`.
    pub fn is_host_root(&self) -> bool {
        self.path == Path::new("/")
    }

    /// Where a node path is on the agent's filesystem (for messages and tests only; all I/O
    /// goes through the root-relative calls).
    pub fn host_path(&self, p: &NodePath) -> PathBuf {
        self.path.join(p.relative())
    }

    fn place(&self, p: &NodePath) -> Place<'_> {
        if self.allow.is_everything() {
            return Place::Anywhere;
        }
        match self.allow.entry_of(p) {
            Some(entry) => Place::Beneath(entry),
            None => Place::Outside,
        }
    }

    /// Opens a directory of the node inside the root, following symlinks within it (for
    /// reads outside the allow-list, and the way to an allow-listed directory).
    fn open_in_root(&self, dir: Option<&NodePath>) -> io::Result<OwnedFd> {
        let rel = dir.map_or(".", NodePath::relative);
        rustix::fs::openat2(&self.dir, rel, DIR_FLAGS, RMode::empty(), IN_ROOT).map_err(rio)
    }

    /// Where an open directory really is, as a node path, from `/proc/self/fd`.
    fn real_path_of(&self, fd: &OwnedFd) -> io::Result<String> {
        use std::os::fd::AsRawFd;
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        let rel = link
            .strip_prefix(&self.real)
            .map_err(|_| io::Error::other(format!("{} is not under the root", link.display())))?;
        Ok(format!("/{}", rel.display())
            .trim_end_matches('/')
            .to_string())
    }

    /// The allow-listed directory `entry`, opened inside the root, with its real location
    /// checked against the allow-list (it may itself be reached through a symlink, as long
    /// as it really is an allow-listed place). `p` names the path being accessed.
    fn open_entry(&self, entry: &NodePath, p: &NodePath) -> Result<DirState, FsError> {
        match self.open_in_root(Some(entry)) {
            Ok(fd) => {
                let real = self.real_path_of(&fd).map_err(io_err("resolve", p))?;
                self.check_real(entry, &real, p)?;
                Ok(DirState::Open(fd))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Where it would be created: below the deepest existing ancestor.
                let ancestors = entry.ancestors_from_top();
                for (depth, dir) in ancestors.iter().enumerate().rev().skip(1) {
                    match self.open_in_root(Some(dir)) {
                        Ok(fd) => {
                            if let Some(next) = ancestors.get(depth + 1)
                                && let Ok(target) =
                                    rustix::fs::readlinkat(&fd, next.file_name(), Vec::new())
                            {
                                // It exists but does not resolve: a dangling symlink.
                                return Err(FsError::Symlink {
                                    path: next.to_string(),
                                    target: target.to_string_lossy().into_owned(),
                                });
                            }
                            let real = self.real_path_of(&fd).map_err(io_err("resolve", p))?;
                            let rest: Vec<&str> = ancestors[depth + 1..]
                                .iter()
                                .map(|a| a.file_name())
                                .collect();
                            let would_be = format!("{real}/{}", rest.join("/"));
                            self.check_real(entry, &would_be, p)?;
                            return Ok(DirState::Missing);
                        }
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(io_err("open directory of", p)(e)),
                    }
                }
                Ok(DirState::Missing)
            }
            Err(e) => Err(io_err("open directory of", p)(e)),
        }
    }

    /// Refuses an allow-listed directory whose real location is outside the allow-list.
    fn check_real(&self, entry: &NodePath, real: &str, p: &NodePath) -> Result<(), FsError> {
        let inside = NodePath::parse(real).is_ok_and(|r| self.allow.covers_dir(&r));
        if inside {
            return Ok(());
        }
        let rest = &p.as_str()[entry.as_str().len()..];
        Err(FsError::Escapes {
            path: p.to_string(),
            resolved: format!("{real}{rest}"),
        })
    }

    /// The directory `dir` (strictly below `entry`, or `entry` itself), resolved beneath
    /// the open `entry_fd` with no symlink on the way. `Ok(None)` when it does not exist.
    fn open_beneath(
        &self,
        entry: &NodePath,
        entry_fd: &OwnedFd,
        dir: &NodePath,
        p: &NodePath,
    ) -> Result<Option<OwnedFd>, FsError> {
        let rel = relative_to(dir, entry);
        if rel.is_empty() {
            return rustix::fs::openat(entry_fd, ".", DIR_FLAGS, RMode::empty())
                .map(Some)
                .map_err(|e| io_err("open directory of", p)(rio(e)));
        }
        match rustix::fs::openat2(entry_fd, rel, DIR_FLAGS, RMode::empty(), BENEATH) {
            Ok(fd) => Ok(Some(fd)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::XDEV) => {
                Err(self.symlink_below(entry, entry_fd, dir, p))
            }
            Err(rustix::io::Errno::NOTDIR) => Err(self.not_a_dir(entry, entry_fd, dir, p)),
            Err(e) => Err(io_err("open directory of", p)(rio(e))),
        }
    }

    /// The error for a symlink found below an allow-listed directory on the way to `p`:
    /// names the link, its target, and where the path would really lead.
    fn symlink_below(
        &self,
        entry: &NodePath,
        entry_fd: &OwnedFd,
        dir: &NodePath,
        p: &NodePath,
    ) -> FsError {
        let mut cur = match rustix::fs::openat(entry_fd, ".", DIR_FLAGS, RMode::empty()) {
            Ok(fd) => fd,
            Err(e) => return io_err("open directory of", p)(rio(e)),
        };
        let mut at = entry.clone();
        for name in relative_to(dir, entry).split('/') {
            let Ok(next) = at.join(name) else { break };
            if let Ok(target) = rustix::fs::readlinkat(&cur, name, Vec::new()) {
                // Where it would lead, read without following anything by hand: the kernel
                // resolves the whole path inside the root.
                let resolved = p.parent().and_then(|d| {
                    let fd = self.open_in_root(Some(&d)).ok()?;
                    let real = self.real_path_of(&fd).ok()?;
                    Some(format!("{real}/{}", p.file_name()))
                });
                return FsError::SymlinkBelow {
                    path: p.to_string(),
                    link: next.to_string(),
                    target: target.to_string_lossy().into_owned(),
                    resolved,
                    entry: entry.to_string(),
                };
            }
            match rustix::fs::openat(&cur, name, DIR_FLAGS | OFlags::NOFOLLOW, RMode::empty()) {
                Ok(fd) => cur = fd,
                Err(_) => break,
            }
            at = next;
        }
        io_err("open directory of", p)(io::Error::from_raw_os_error(libc_eloop()))
    }

    /// The error for a component on the way to `p` that is not a directory.
    fn not_a_dir(
        &self,
        entry: &NodePath,
        entry_fd: &OwnedFd,
        dir: &NodePath,
        p: &NodePath,
    ) -> FsError {
        let mut cur = match rustix::fs::openat(entry_fd, ".", DIR_FLAGS, RMode::empty()) {
            Ok(fd) => fd,
            Err(e) => return io_err("open directory of", p)(rio(e)),
        };
        let mut at = entry.clone();
        for name in relative_to(dir, entry).split('/') {
            let Ok(next) = at.join(name) else { break };
            match rustix::fs::openat(&cur, name, DIR_FLAGS | OFlags::NOFOLLOW, RMode::empty()) {
                Ok(fd) => cur = fd,
                Err(_) => {
                    let kind = rustix::fs::statat(&cur, name, AtFlags::SYMLINK_NOFOLLOW)
                        .map(|st| type_name(rustix::fs::FileType::from_raw_mode(st.st_mode)))
                        .unwrap_or("file");
                    return FsError::NotADirectory {
                        path: p.to_string(),
                        blocker: next.to_string(),
                        kind: if kind == "special file" {
                            "regular file"
                        } else {
                            kind
                        },
                    };
                }
            }
            at = next;
        }
        io_err("open directory of", p)(io::Error::from(rustix::io::Errno::NOTDIR))
    }

    /// The parent directory of `p`, opened the way every access to `p` must go: beneath its
    /// allow-list entry without symlinks, or inside the root for a path outside the
    /// allow-list (`change` refuses those). `Ok(None)` when it does not exist.
    fn parent_of(&self, p: &NodePath, change: bool) -> Result<Option<OwnedFd>, FsError> {
        match self.place(p) {
            Place::Beneath(entry) => {
                let DirState::Open(entry_fd) = self.open_entry(entry, p)? else {
                    return Ok(None);
                };
                let parent = p.parent().unwrap_or_else(|| entry.clone());
                self.open_beneath(entry, &entry_fd, &parent, p)
            }
            Place::Outside if change => Err(FsError::NotAllowed {
                path: p.to_string(),
                allow: self.allow.to_string(),
            }),
            Place::Outside | Place::Anywhere => match self.open_in_root(p.parent().as_ref()) {
                Ok(fd) => Ok(Some(fd)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io_err("open directory of", p)(e)),
            },
        }
    }

    /// The directory `dir` itself, opened as its contents would be reached (see
    /// [`Root::parent_of`]); `Ok(None)` when it does not exist.
    fn dir_for(&self, dir: &NodePath) -> Result<Option<OwnedFd>, FsError> {
        match self.place(dir) {
            Place::Beneath(entry) => {
                let DirState::Open(entry_fd) = self.open_entry(entry, dir)? else {
                    return Ok(None);
                };
                self.open_beneath(entry, &entry_fd, dir, dir)
            }
            Place::Outside | Place::Anywhere => match self.open_in_root(Some(dir)) {
                Ok(fd) => Ok(Some(fd)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io_err("open directory", dir)(e)),
            },
        }
    }

    /// Checks that `p` may be managed: its allow-list entry really is an allow-listed
    /// place, nothing between that entry and `p` is a symlink or a non-directory, and `p`
    /// itself is not a symlink — the same way every later access resolves it.
    pub fn check_path(&self, p: &NodePath) -> Result<(), FsError> {
        self.check_path_in(p, &mut DirCache::default()).map(|_| ())
    }

    /// [`Root::check_path`] for many paths: parent directories already resolved in `cache`
    /// are not resolved again (a plan of 500 files in one directory opens it once). Also
    /// says what is at `p` when it is neither absent nor a regular file (`Some("directory")`),
    /// from the same `stat`.
    pub fn check_path_in(
        &self,
        p: &NodePath,
        cache: &mut DirCache,
    ) -> Result<Option<&'static str>, FsError> {
        if let Place::Outside = self.place(p) {
            return Err(FsError::NotAllowed {
                path: p.to_string(),
                allow: self.allow.to_string(),
            });
        }
        // The parent exists: look at the final component without following it.
        let Some(fd) = cache.parent(p, false, || self.parent_of(p, true))? else {
            return Ok(None);
        };
        use rustix::fs::FileType as T;
        match rustix::fs::statat(fd, p.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => match T::from_raw_mode(st.st_mode) {
                T::Symlink => {
                    let target = rustix::fs::readlinkat(fd, p.file_name(), Vec::new())
                        .map(|t| t.to_string_lossy().into_owned())
                        .unwrap_or_else(|_| "?".into());
                    Err(FsError::Symlink {
                        path: p.to_string(),
                        target,
                    })
                }
                T::RegularFile => Ok(None),
                other => Ok(Some(type_name(other))),
            },
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(io_err("stat", p)(rio(e))),
        }
    }

    /// Reads what is at `p` without following a final symlink.
    pub fn read(&self, p: &NodePath) -> Result<Existing, FsError> {
        self.read_from(p, None)
    }

    /// [`Root::read`] for a pass of reads with no change to the node in between (the diffs
    /// of a batch): a parent directory is resolved once per `cache`, as at the pass's first
    /// read of it, and not for every file in it. A directory that did not exist is resolved
    /// again.
    pub fn read_in(&self, p: &NodePath, cache: &mut DirCache) -> Result<Existing, FsError> {
        self.read_from(p, Some(cache))
    }

    fn read_from(&self, p: &NodePath, cache: Option<&mut DirCache>) -> Result<Existing, FsError> {
        match self.open_existing(p, cache)? {
            Opened::Absent => Ok(Existing::Absent),
            Opened::Other(kind) => Ok(Existing::Other { kind }),
            Opened::File(file, meta, size) => {
                let content = read_sized(&file, size).map_err(io_err("read", p))?;
                Ok(Existing::File { content, meta })
            }
        }
    }

    /// What is at `p` compared with `expected` ([`Compared`]): a file of another size is
    /// not read, one of the same size is read in pieces up to its first difference. The
    /// parent directory comes from `cache` when given, as for [`Root::read_in`].
    pub fn compare(
        &self,
        p: &NodePath,
        expected: &[u8],
        cache: Option<&mut DirCache>,
    ) -> Result<Compared, FsError> {
        match self.open_existing(p, cache)? {
            Opened::Absent => Ok(Compared::Absent),
            Opened::Other(kind) => Ok(Compared::Other { kind }),
            Opened::File(file, meta, size) => {
                let same = size == expected.len() as u64
                    && holds(&file, expected).map_err(io_err("read", p))?;
                Ok(Compared::File { meta, same })
            }
        }
    }

    /// Opens the regular file at `p` for reading (streaming large files such as binaries),
    /// with its mode, owner and size; `None` when nothing is there. A symlink or anything
    /// other than a regular file is an error.
    pub fn open_file(&self, p: &NodePath) -> Result<Option<(File, FileMeta, u64)>, FsError> {
        match self.open_existing(p, None)? {
            Opened::Absent => Ok(None),
            Opened::Other(kind) => Err(FsError::NotAFile {
                path: p.to_string(),
                kind,
            }),
            Opened::File(file, meta, size) => Ok(Some((file, meta, size))),
        }
    }

    /// What is at `p`, opened when it is a regular file; a final symlink is an error. The
    /// parent directory comes from `cache` when given (resolved into it when missing).
    fn open_existing(&self, p: &NodePath, cache: Option<&mut DirCache>) -> Result<Opened, FsError> {
        let resolved;
        let dir = match cache {
            Some(cache) => cache.parent(p, true, || self.parent_of(p, false))?,
            None => {
                resolved = self.parent_of(p, false)?;
                resolved.as_ref()
            }
        };
        let Some(dir) = dir else {
            return Ok(Opened::Absent);
        };
        let st = match rustix::fs::statat(dir, p.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(rustix::io::Errno::NOENT) => return Ok(Opened::Absent),
            Err(e) => return Err(io_err("stat", p)(rio(e))),
        };
        use rustix::fs::FileType as T;
        match T::from_raw_mode(st.st_mode) {
            T::RegularFile => {}
            T::Symlink => {
                let target = rustix::fs::readlinkat(dir, p.file_name(), Vec::new())
                    .map(|t| t.to_string_lossy().into_owned())
                    .unwrap_or_else(|_| "?".into());
                return Err(FsError::Symlink {
                    path: p.to_string(),
                    target,
                });
            }
            other => return Ok(Opened::Other(type_name(other))),
        }
        let fd = rustix::fs::openat(
            dir,
            p.file_name(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            RMode::empty(),
        )
        .map_err(|e| io_err("open", p)(rio(e)))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err("stat", p)(rio(e)))?;
        let meta = FileMeta {
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
        };
        Ok(Opened::File(
            File::from(fd),
            meta,
            u64::try_from(st.st_size).unwrap_or(0),
        ))
    }

    /// Mode and owner of the regular file at `p`, without reading it; `None` when absent.
    pub fn meta(&self, p: &NodePath) -> Result<Option<(FileMeta, u64)>, FsError> {
        let Some(dir) = self.parent_of(p, false)? else {
            return Ok(None);
        };
        match rustix::fs::statat(&dir, p.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => {
                let meta = FileMeta {
                    mode: st.st_mode & 0o7777,
                    uid: st.st_uid,
                    gid: st.st_gid,
                };
                Ok(Some((meta, u64::try_from(st.st_size).unwrap_or(0))))
            }
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(io_err("stat", p)(rio(e))),
        }
    }

    /// The directories above `p` that do not exist yet, from the top.
    pub fn missing_dirs(&self, p: &NodePath) -> Result<Vec<NodePath>, FsError> {
        let mut missing = Vec::new();
        let Some(parent) = p.parent() else {
            return Ok(missing);
        };
        for dir in parent.ancestors_from_top().into_iter().rev() {
            match self.dir_for(&dir)? {
                Some(_) => break,
                None => missing.push(dir),
            }
        }
        missing.reverse();
        Ok(missing)
    }

    /// Creates the missing directories above `p` (mode 0755, root-owned), each made
    /// durable in its parent, and returns `p`'s parent opened. Below the allow-list entry
    /// each directory is created in, and opened from, the one above it without following
    /// anything; above it (the way to the entry), inside the root.
    fn create_dirs(&self, p: &NodePath) -> Result<OwnedFd, FsError> {
        let entry = match self.place(p) {
            Place::Beneath(entry) => entry,
            Place::Outside => {
                return Err(FsError::NotAllowed {
                    path: p.to_string(),
                    allow: self.allow.to_string(),
                });
            }
            Place::Anywhere => {
                let parent = p.parent();
                self.create_in_root(p, parent.as_ref())?;
                return self
                    .open_in_root(parent.as_ref())
                    .map_err(io_err("open directory of", p));
            }
        };
        let entry_fd = match self.open_entry(entry, p)? {
            DirState::Open(fd) => fd,
            DirState::Missing => {
                self.create_in_root(p, Some(entry))?;
                match self.open_entry(entry, p)? {
                    DirState::Open(fd) => fd,
                    DirState::Missing => {
                        return Err(io_err("create directory", entry)(io::Error::from(
                            rustix::io::Errno::NOENT,
                        )));
                    }
                }
            }
        };
        let parent = p.parent().unwrap_or_else(|| entry.clone());
        let mut cur = rustix::fs::openat(&entry_fd, ".", DIR_FLAGS, RMode::empty())
            .map_err(|e| io_err("open directory of", p)(rio(e)))?;
        let mut at = entry.clone();
        let rel = relative_to(&parent, entry);
        for name in rel.split('/').filter(|n| !n.is_empty()) {
            let next = at.join(name).map_err(|e| FsError::Io {
                op: "resolve",
                path: p.to_string(),
                source: io::Error::other(e.to_string()),
            })?;
            let flags = DIR_FLAGS | OFlags::NOFOLLOW;
            cur = match rustix::fs::openat(&cur, name, flags, RMode::empty()) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::NOENT) => {
                    match rustix::fs::mkdirat(&cur, name, RMode::from_raw_mode(0o755)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(io_err("create directory", &next)(rio(e))),
                    }
                    rustix::fs::fsync(&cur)
                        .map_err(|e| io_err("sync directory of", &next)(rio(e)))?;
                    rustix::fs::openat(&cur, name, flags, RMode::empty()).map_err(|e| match e {
                        rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                            self.symlink_or_file(entry, &entry_fd, &next, p)
                        }
                        e => io_err("open directory", &next)(rio(e)),
                    })?
                }
                Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
                    return Err(self.symlink_or_file(entry, &entry_fd, &next, p));
                }
                Err(e) => return Err(io_err("open directory", &next)(rio(e))),
            };
            at = next;
        }
        Ok(cur)
    }

    /// Why `dir` below `entry` cannot be used as a directory: a symlink or another file.
    fn symlink_or_file(
        &self,
        entry: &NodePath,
        entry_fd: &OwnedFd,
        dir: &NodePath,
        p: &NodePath,
    ) -> FsError {
        match self.symlink_below(entry, entry_fd, dir, p) {
            e @ FsError::SymlinkBelow { .. } => e,
            _ => self.not_a_dir(entry, entry_fd, dir, p),
        }
    }

    /// Creates `dir` and the missing directories above it inside the root (the way to an
    /// allow-listed directory, or anything under [`AllowList::everything`]).
    fn create_in_root(&self, p: &NodePath, dir: Option<&NodePath>) -> Result<(), FsError> {
        let Some(dir) = dir else { return Ok(()) };
        let mut missing = Vec::new();
        for d in dir.ancestors_from_top().into_iter().rev() {
            match self.open_in_root(Some(&d)) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(d),
                Err(e) => return Err(io_err("open directory of", p)(e)),
            }
        }
        for d in missing.iter().rev() {
            let parent = self
                .open_in_root(d.parent().as_ref())
                .map_err(io_err("open directory of", d))?;
            match rustix::fs::mkdirat(&parent, d.file_name(), RMode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(io_err("create directory", d)(rio(e))),
            }
            rustix::fs::fsync(&parent).map_err(|e| io_err("sync directory of", d)(rio(e)))?;
        }
        Ok(())
    }

    /// Atomically replaces (or creates) the file at `p` with `content` and `meta`, creating
    /// missing parent directories. Durable when it returns; no temp file survives an error.
    pub fn write_atomic(
        &self,
        p: &NodePath,
        content: &[u8],
        meta: FileMeta,
    ) -> Result<(), FsError> {
        let dir = self.create_dirs(p)?;
        write_in_dir(&dir, p.file_name(), content, meta).map_err(|(op, e)| io_err(op, p)(e))
    }

    /// Like [`Root::write_atomic`], with the content streamed from `content` (large files
    /// such as binaries are never held in memory). A read error (for example a checksum
    /// mismatch reported by a verifying reader) leaves the old file in place and no temp file.
    /// Returns the number of bytes written.
    pub fn write_atomic_from(
        &self,
        p: &NodePath,
        content: &mut dyn Read,
        meta: FileMeta,
    ) -> Result<u64, FsError> {
        let dir = self.create_dirs(p)?;
        write_in_dir_from(&dir, p.file_name(), content, meta).map_err(|(op, e)| io_err(op, p)(e))
    }

    /// Stages `content` for `p` as `.<name>.inplace-r<run>` beside it, with `meta`, and
    /// starts its writeback; durable once [`Root::sync_staged`] (the file) and
    /// [`Root::sync_parent`] (its directory, once per directory) have returned, so a batch
    /// of files is written while the disk works on the earlier ones. Creates the missing
    /// parent directories; returns the ones it created, from the top. A crash can leave a
    /// partial staged file; it is written again, or removed, by name.
    pub fn stage(
        &self,
        p: &NodePath,
        run: u64,
        content: &[u8],
        meta: FileMeta,
    ) -> Result<Vec<NodePath>, FsError> {
        let created = self.missing_dirs(p)?;
        let dir = self.create_dirs(p)?;
        let name = staged_name(p.file_name(), run);
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let open = || rustix::fs::openat(&dir, name.as_str(), flags, RMode::from_raw_mode(0o600));
        let fd = match open() {
            Err(rustix::io::Errno::EXIST) => {
                let _ = rustix::fs::unlinkat(&dir, name.as_str(), AtFlags::empty());
                open()
            }
            other => other,
        }
        .map_err(|e| io_err("create staged file for", p)(rio(e)))?;
        let result = (|| {
            let mut f = File::from(fd);
            f.write_all(content)
                .map_err(|e| ("write staged file for", e))?;
            let uid = rustix::fs::Uid::from_raw(meta.uid);
            let gid = rustix::fs::Gid::from_raw(meta.gid);
            rustix::fs::fchown(&f, Some(uid), Some(gid)).map_err(|e| ("chown", rio(e)))?;
            rustix::fs::fchmod(&f, RMode::from_raw_mode(meta.mode & 0o7777))
                .map_err(|e| ("chmod", rio(e)))?;
            inplace_base::start_writeback(&f);
            Ok(())
        })();
        if let Err((op, e)) = result {
            let _ = rustix::fs::unlinkat(&dir, name.as_str(), AtFlags::empty());
            return Err(io_err(op, p)(e));
        }
        Ok(created)
    }

    /// Makes the content staged for `p` by `run` durable (its writeback was started by
    /// [`Root::stage`]).
    pub fn sync_staged(&self, p: &NodePath, run: u64) -> Result<(), FsError> {
        let err = io_err("sync staged file for", p);
        let Some(dir) = self.parent_for_removal(p)? else {
            return Err(err(io::ErrorKind::NotFound.into()));
        };
        let name = staged_name(p.file_name(), run);
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        rustix::fs::openat(&dir, name.as_str(), flags, RMode::empty())
            .and_then(|f| rustix::fs::fsync(&f))
            .map_err(|e| err(rio(e)))
    }

    /// Makes the entries of `p`'s directory durable (after staging, before the journal
    /// says they exist).
    pub fn sync_parent(&self, p: &NodePath) -> Result<(), FsError> {
        if let Some(dir) = self.parent_for_removal(p)? {
            rustix::fs::fsync(&dir).map_err(|e| io_err("sync directory of", p)(rio(e)))?;
        }
        Ok(())
    }

    /// Renames the content staged for `p` by `run` into place: the mutation of a staged
    /// write. False when nothing is staged (the caller writes the content itself). Durable
    /// once `p`'s directory is synced ([`Root::sync_parent`]; the engine syncs each
    /// directory once for a batch of renames, before it journals them done).
    pub fn install_staged(&self, p: &NodePath, run: u64) -> Result<bool, FsError> {
        let Some(dir) = self.parent_for_removal(p)? else {
            return Ok(false);
        };
        let name = staged_name(p.file_name(), run);
        failpoint::hit("fs.install.before_rename");
        match rustix::fs::renameat(&dir, name.as_str(), &dir, p.file_name()) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOENT) => return Ok(false),
            Err(e) => return Err(io_err("rename staged file onto", p)(rio(e))),
        }
        Ok(true)
    }

    /// The content staged for `p` by `run` with its mode and owner; `None` when there is
    /// none.
    pub fn read_staged(
        &self,
        p: &NodePath,
        run: u64,
    ) -> Result<Option<(Vec<u8>, FileMeta)>, FsError> {
        let Some(dir) = self.parent_for_removal(p)? else {
            return Ok(None);
        };
        let name = staged_name(p.file_name(), run);
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = match rustix::fs::openat(&dir, name.as_str(), flags, RMode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(io_err("open staged file for", p)(rio(e))),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err("stat staged file for", p)(rio(e)))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Ok(None);
        }
        let meta = FileMeta {
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
        };
        let size = u64::try_from(st.st_size).unwrap_or(0);
        let content = read_sized(&fd, size).map_err(io_err("read staged file for", p))?;
        Ok(Some((content, meta)))
    }

    /// Removes what `run` staged for `p`, durably; false when nothing was staged.
    pub fn unstage(&self, p: &NodePath, run: u64) -> Result<bool, FsError> {
        let name = staged_name(p.file_name(), run);
        self.unlink_beside(p, &name, "remove staged file for")
    }

    /// Removes the entry `name` of `p`'s directory and syncs the directory; false when
    /// there is no such entry. `op` names the operation in an error.
    fn unlink_beside(&self, p: &NodePath, name: &str, op: &'static str) -> Result<bool, FsError> {
        let Some(dir) = self.parent_for_removal(p)? else {
            return Ok(false);
        };
        match rustix::fs::unlinkat(&dir, name, AtFlags::empty()) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOENT) => return Ok(false),
            Err(e) => return Err(io_err(op, p)(rio(e))),
        }
        rustix::fs::fsync(&dir).map_err(|e| io_err("sync directory of", p)(rio(e)))?;
        Ok(true)
    }

    /// The parent of `p` for a removal: `None` when `p` cannot exist (a directory on the
    /// way is missing, or is not a directory at all).
    fn parent_for_removal(&self, p: &NodePath) -> Result<Option<OwnedFd>, FsError> {
        match self.parent_of(p, true) {
            Ok(fd) => Ok(fd),
            Err(FsError::NotADirectory { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes the file at `p`; false when it was already absent. Durable when it returns.
    pub fn remove(&self, p: &NodePath) -> Result<bool, FsError> {
        self.unlink_beside(p, p.file_name(), "remove")
    }

    /// Removes the directory `p` if it exists and is empty; true when removed. Below an
    /// allow-listed directory it is reached like any change; above one (a directory created
    /// as the way to it) inside the root; anywhere else it is refused.
    pub fn remove_empty_dir(&self, p: &NodePath) -> Result<bool, FsError> {
        let parent = match self.place(p) {
            Place::Beneath(_) => self.parent_for_removal(p)?,
            Place::Outside if !self.allow.leads_to(p) => {
                return Err(FsError::NotAllowed {
                    path: p.to_string(),
                    allow: self.allow.to_string(),
                });
            }
            Place::Outside | Place::Anywhere => match self.open_in_root(p.parent().as_ref()) {
                Ok(fd) => Some(fd),
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                Err(e) => return Err(io_err("open directory of", p)(e)),
            },
        };
        let Some(parent) = parent else {
            return Ok(false);
        };
        match rustix::fs::unlinkat(&parent, p.file_name(), AtFlags::REMOVEDIR) {
            Ok(()) => {
                rustix::fs::fsync(&parent).map_err(|e| io_err("sync directory of", p)(rio(e)))?;
                Ok(true)
            }
            Err(
                rustix::io::Errno::NOENT
                | rustix::io::Errno::NOTEMPTY
                | rustix::io::Errno::EXIST
                | rustix::io::Errno::NOTDIR,
            ) => Ok(false),
            Err(e) => Err(io_err("remove directory", p)(rio(e))),
        }
    }

    /// Removes a temp file a crash may have left for `p`.
    pub fn sweep_temp(&self, p: &NodePath) -> Result<bool, FsError> {
        let Some(dir) = self.parent_for_removal(p)? else {
            return Ok(false);
        };
        match rustix::fs::unlinkat(&dir, temp_name(p.file_name()), AtFlags::empty()) {
            Ok(()) => {
                rustix::fs::fsync(&dir).map_err(|e| io_err("sync directory of", p)(rio(e)))?;
                Ok(true)
            }
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(e) => Err(io_err("remove temp file for", p)(rio(e))),
        }
    }

    /// Reads a small special file in place (for `/proc/sys`); `None` when absent.
    pub fn read_special(&self, p: &NodePath) -> Result<Option<String>, FsError> {
        let fd = match rustix::fs::openat2(
            &self.dir,
            p.relative(),
            OFlags::RDONLY | OFlags::CLOEXEC,
            RMode::empty(),
            IN_ROOT | ResolveFlags::NO_SYMLINKS,
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(io_err("open", p)(rio(e))),
        };
        let mut s = String::new();
        File::from(fd)
            .read_to_string(&mut s)
            .map_err(io_err("read", p))?;
        Ok(Some(s))
    }

    /// Writes a small special file in place (for `/proc/sys`), without a temp file.
    pub fn write_special(&self, p: &NodePath, content: &[u8]) -> Result<(), FsError> {
        let fd = rustix::fs::openat2(
            &self.dir,
            p.relative(),
            OFlags::WRONLY | OFlags::TRUNC | OFlags::CLOEXEC,
            RMode::empty(),
            IN_ROOT | ResolveFlags::NO_SYMLINKS,
        )
        .map_err(|e| io_err("open", p)(rio(e)))?;
        let mut f = File::from(fd);
        f.write_all(content).map_err(io_err("write", p))
    }

    /// True when the node directory exists.
    pub fn dir_exists(&self, p: &NodePath) -> bool {
        self.dir_for(p).is_ok_and(|d| d.is_some())
    }
}

/// Whether what `file` yields from where it is read next is exactly `expected`: read in
/// pieces of at most 64 KiB, stopping at the first piece that differs.
fn holds(mut file: &File, expected: &[u8]) -> io::Result<bool> {
    // One byte more than expected is asked for, so a file that grew is seen.
    let mut buf = vec![0u8; expected.len().min(64 * 1024) + 1];
    let mut at = 0;
    loop {
        let n = match file.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Ok(at == expected.len());
        }
        if expected.len() - at < n || buf[..n] != expected[at..at + n] {
            return Ok(false);
        }
        at += n;
    }
}

/// Reads an open file to its end, `size` (from the caller's `fstat`) being what it is
/// expected to hold. `Read::read_to_end` would ask the kernel for the size again (`statx`,
/// `lseek`) before reading: two system calls a file that a pass over 500 files pays 1,000
/// times. The file may still have grown or shrunk since: it is read until a read returns 0.
pub fn read_sized(file: &impl AsFd, size: u64) -> io::Result<Vec<u8>> {
    // One byte over the size, so that an unchanged file ends with a read of 0 bytes.
    let mut content = Vec::with_capacity(usize::try_from(size).unwrap_or(0).saturating_add(1));
    loop {
        if content.len() == content.capacity() {
            content.reserve(content.len().max(8192));
        }
        match rustix::io::read(file, rustix::buffer::spare_capacity(&mut content)) {
            Ok(0) => return Ok(content),
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(rio(e)),
        }
    }
}

/// `dir` relative to `entry` (which it starts with): "" for the entry itself.
fn relative_to<'a>(dir: &'a NodePath, entry: &NodePath) -> &'a str {
    dir.as_str()[entry.as_str().len()..].trim_start_matches('/')
}

fn libc_eloop() -> i32 {
    rustix::io::Errno::LOOP.raw_os_error()
}

fn type_name(t: rustix::fs::FileType) -> &'static str {
    use rustix::fs::FileType as T;
    match t {
        T::Directory => "directory",
        T::Symlink => "symlink",
        T::Fifo => "fifo",
        T::Socket => "socket",
        T::CharacterDevice => "character device",
        T::BlockDevice => "block device",
        _ => "special file",
    }
}

/// The temp file name used while replacing `name`.
pub fn temp_name(name: &str) -> String {
    if name.len() > 200 {
        let h = hex::encode(&Sha256::digest(name.as_bytes())[..12]);
        format!(".{h}.inplace-tmp")
    } else {
        format!(".{name}.inplace-tmp")
    }
}

/// The name content for `name` is staged under by run `run` (see [`Root::stage`]).
pub fn staged_name(name: &str, run: u64) -> String {
    if name.len() > 200 {
        let h = hex::encode(&Sha256::digest(name.as_bytes())[..12]);
        format!(".{h}.inplace-r{run}")
    } else {
        format!(".{name}.inplace-r{run}")
    }
}

/// The atomic replace of one entry of an open directory: temp (`O_EXCL`), write, fchown,
/// fchmod, fsync, rename, fsync the directory. On error the temp file is removed and the
/// failing operation named.
pub fn write_in_dir(
    dir: &impl AsFd,
    name: &str,
    content: &[u8],
    meta: FileMeta,
) -> Result<(), (&'static str, io::Error)> {
    replace_in_dir(dir, name, meta, |f| {
        f.write_all(content).map_err(|e| ("write", e))?;
        Ok(content.len() as u64)
    })
    .map(drop)
}

/// [`write_in_dir`] with the content streamed from a reader; returns the bytes written. A
/// read error counts as a failed write ("read content for"): the old entry stays.
pub fn write_in_dir_from(
    dir: &impl AsFd,
    name: &str,
    content: &mut dyn Read,
    meta: FileMeta,
) -> Result<u64, (&'static str, io::Error)> {
    replace_in_dir(dir, name, meta, |f| copy_content(content, f))
}

/// The replace itself; `fill` writes the content into the temp file.
fn replace_in_dir(
    dir: &impl AsFd,
    name: &str,
    meta: FileMeta,
    fill: impl FnOnce(&mut File) -> Result<u64, (&'static str, io::Error)>,
) -> Result<u64, (&'static str, io::Error)> {
    let tmp = temp_name(name);
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = match rustix::fs::openat(dir, tmp.as_str(), flags, RMode::from_raw_mode(0o600)) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::EXIST) => {
            // A crash left it behind: it is ours by name, and only one writer runs.
            let _ = rustix::fs::unlinkat(dir, tmp.as_str(), AtFlags::empty());
            rustix::fs::openat(dir, tmp.as_str(), flags, RMode::from_raw_mode(0o600))
                .map_err(|e| ("create temp file for", rio(e)))?
        }
        Err(e) => return Err(("create temp file for", rio(e))),
    };
    let result = (|| {
        let mut f = File::from(fd);
        let written = fill(&mut f)?;
        let uid = rustix::fs::Uid::from_raw(meta.uid);
        let gid = rustix::fs::Gid::from_raw(meta.gid);
        rustix::fs::fchown(&f, Some(uid), Some(gid)).map_err(|e| ("chown", rio(e)))?;
        rustix::fs::fchmod(&f, RMode::from_raw_mode(meta.mode & 0o7777))
            .map_err(|e| ("chmod", rio(e)))?;
        rustix::fs::fsync(&f).map_err(|e| ("sync", rio(e)))?;
        failpoint::hit("fs.write.before_rename");
        rustix::fs::renameat(dir, tmp.as_str(), dir, name).map_err(|e| ("rename", rio(e)))?;
        Ok(written)
    })();
    match result {
        Ok(written) => {
            rustix::fs::fsync(dir).map_err(|e| ("sync directory of", rio(e)))?;
            Ok(written)
        }
        Err(e) => {
            let _ = rustix::fs::unlinkat(dir, tmp.as_str(), AtFlags::empty());
            Err(e)
        }
    }
}

/// Copies `from` into `to`, telling a failed read ("read content for") from a failed write.
fn copy_content(from: &mut dyn Read, to: &mut File) -> Result<u64, (&'static str, io::Error)> {
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(("read content for", e)),
        };
        to.write_all(&buf[..n]).map_err(|e| ("write", e))?;
        total += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn np(s: &str) -> NodePath {
        NodePath::parse(s).unwrap()
    }

    fn me() -> FileMeta {
        FileMeta {
            mode: 0o640,
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
        }
    }

    #[test]
    fn a_sized_read_returns_what_the_file_holds_whatever_size_it_was_told() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f");
        for len in [0usize, 1, 4095, 4096, 4097, 100_000] {
            let content: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            std::fs::write(&path, &content).unwrap();
            // Told right, told too little (the file grew), told too much (it shrank).
            for told in [len as u64, len as u64 / 2, len as u64 * 2 + 10] {
                let file = File::open(&path).unwrap();
                assert_eq!(
                    read_sized(&file, told).unwrap(),
                    content,
                    "{len} told {told}"
                );
            }
        }
    }

    #[test]
    fn a_comparison_says_what_a_full_read_compared_would_say() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        let p = np("/etc/kubernetes/c.conf");
        let big: Vec<u8> = (0..200_000).map(|i| (i % 251) as u8).collect();
        let mut late = big.clone();
        late[150_000] ^= 1;
        let mut last = big.clone();
        *last.last_mut().unwrap() ^= 1;
        let cases: [(&[u8], &[u8]); 9] = [
            (b"", b""),
            (b"a\n", b"a\n"),
            (b"a\n", b"b\n"),
            (b"a\n", b"a\nb\n"),
            (b"a\nb\n", b"a\n"),
            (&big, &big),
            (&big, &late),
            (&big, &last),
            (&big, &big[..big.len() - 1]),
        ];
        for (on_disk, expected) in cases {
            root.write_atomic(&p, on_disk, me()).unwrap();
            let want = Compared::of(&root.read(&p).unwrap(), expected);
            assert_eq!(root.compare(&p, expected, None).unwrap(), want);
            let mut cache = DirCache::default();
            assert_eq!(root.compare(&p, expected, Some(&mut cache)).unwrap(), want);
            assert_eq!(
                want,
                Compared::File {
                    meta: me(),
                    same: on_disk == expected
                }
            );
        }
        assert_eq!(
            root.compare(&np("/etc/kubernetes/none"), b"x", None)
                .unwrap(),
            Compared::Absent
        );
        assert!(matches!(
            root.compare(&np("/etc/kubernetes"), b"x", None).unwrap(),
            Compared::Other { .. }
        ));
    }

    #[test]
    fn a_file_is_held_only_up_to_its_end_whatever_pieces_it_is_read_in() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f");
        let content: Vec<u8> = (0..300_000).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        let file = File::open(&path).unwrap();
        assert!(holds(&file, &content).unwrap());
        for cut in [0, 1, 65_536, 65_537, 299_999] {
            let file = File::open(&path).unwrap();
            assert!(!holds(&file, &content[..cut]).unwrap(), "shorter by {cut}");
        }
        let mut longer = content.clone();
        longer.push(0);
        let file = File::open(&path).unwrap();
        assert!(!holds(&file, &longer).unwrap());
    }

    #[test]
    fn reads_through_a_pass_cache_see_what_plain_reads_see_and_hold_few_directories() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        let mut cache = DirCache::default();
        let p = np("/etc/kubernetes/pki/x.conf");
        // A directory that does not exist yet is not remembered as missing.
        assert_eq!(root.read_in(&p, &mut cache).unwrap(), Existing::Absent);
        root.write_atomic(&p, b"hello", me()).unwrap();
        for _ in 0..2 {
            assert_eq!(
                root.read_in(&p, &mut cache).unwrap(),
                root.read(&p).unwrap()
            );
        }
        let absent = np("/etc/kubernetes/pki/none.conf");
        assert_eq!(root.read_in(&absent, &mut cache).unwrap(), Existing::Absent);
        // A final symlink and a symlinked directory are refused as by a plain read.
        std::os::unix::fs::symlink("/etc/shadow", t.path().join("etc/kubernetes/pki/l")).unwrap();
        let link = np("/etc/kubernetes/pki/l");
        assert!(matches!(
            root.read_in(&link, &mut cache),
            Err(FsError::Symlink { .. })
        ));
        std::os::unix::fs::symlink(outside.path(), t.path().join("etc/kubernetes/evil")).unwrap();
        let below = np("/etc/kubernetes/evil/x");
        let (cached, plain) = (root.read_in(&below, &mut cache), root.read(&below));
        assert!(cached.is_err() && plain.is_err(), "{cached:?} {plain:?}");
        assert_eq!(
            cached.unwrap_err().to_string(),
            plain.unwrap_err().to_string()
        );
        // Files in many directories: the cache never holds more than its bound.
        for d in 0..(DirCache::MOST * 2) {
            let f = np(&format!("/etc/kubernetes/many/d{d}/f"));
            root.write_atomic(&f, b"x", me()).unwrap();
            assert!(matches!(
                root.read_in(&f, &mut cache).unwrap(),
                Existing::File { .. }
            ));
            assert!(cache.dirs.len() <= DirCache::MOST);
        }
    }

    #[test]
    fn write_read_remove_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        let p = np("/etc/kubernetes/pki/x.conf");
        assert_eq!(root.read(&p).unwrap(), Existing::Absent);
        assert_eq!(
            root.missing_dirs(&p).unwrap(),
            [np("/etc"), np("/etc/kubernetes"), np("/etc/kubernetes/pki")]
        );
        root.write_atomic(&p, b"hello", me()).unwrap();
        assert_eq!(
            root.read(&p).unwrap(),
            Existing::File {
                content: b"hello".to_vec(),
                meta: me()
            }
        );
        let names: Vec<_> = std::fs::read_dir(t.path().join("etc/kubernetes/pki"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["x.conf"], "no temp file left");
        assert!(root.remove(&p).unwrap());
        assert!(!root.remove(&p).unwrap());
        assert!(root.remove_empty_dir(&np("/etc/kubernetes/pki")).unwrap());
        assert!(!root.remove_empty_dir(&np("/etc")).unwrap(), "not empty");
    }

    #[test]
    fn symlinks_cannot_escape_the_root() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("etc/kubernetes")).unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("etc/kubernetes/evil")).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", t.path().join("etc/kubernetes/shadow")).unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        let err = root.check_path(&np("/etc/kubernetes/evil/x")).unwrap_err();
        assert!(matches!(err, FsError::SymlinkBelow { .. }), "{err}");
        std::os::unix::fs::symlink("../../../../../../..", t.path().join("etc/kubernetes/up"))
            .unwrap();
        let err = root
            .check_path(&np("/etc/kubernetes/up/etc/passwd"))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/etc/kubernetes/up/etc/passwd resolves through a symlink to /etc/passwd: \
             /etc/kubernetes/up is a symlink to ../../../../../../.., and the agent never \
             follows symlinks below an allow-listed directory (/etc/kubernetes)"
        );
        let err = root.check_path(&np("/etc/kubernetes/shadow")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "/etc/kubernetes/shadow is a symlink to /etc/shadow; refusing to follow it"
        );
        // Even a write that ignored the check cannot leave the root.
        assert!(
            root.write_atomic(&np("/etc/kubernetes/evil/x"), b"x", me())
                .is_err()
        );
        assert!(std::fs::read_dir(outside.path()).unwrap().next().is_none());
        assert!(root.check_path(&np("/etc/kubernetes/new/dir/x")).is_ok());
    }

    #[test]
    fn streamed_writes_are_atomic_and_a_failed_read_keeps_the_old_file() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        let p = np("/usr/local/bin/kubelet");
        let big: Vec<u8> = (0..3 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let n = root.write_atomic_from(&p, &mut &big[..], me()).unwrap();
        assert_eq!(n, big.len() as u64);
        let (mut file, meta, size) = root.open_file(&p).unwrap().unwrap();
        assert_eq!((meta, size), (me(), big.len() as u64));
        let mut back = Vec::new();
        file.read_to_end(&mut back).unwrap();
        assert_eq!(back, big);

        struct Failing(usize);
        impl Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "checksum mismatch",
                    ));
                }
                let n = buf.len().min(self.0);
                buf[..n].fill(b'x');
                self.0 -= n;
                Ok(n)
            }
        }
        let err = root
            .write_atomic_from(&p, &mut Failing(1 << 20), me())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "read content for /usr/local/bin/kubelet: checksum mismatch"
        );
        let names: Vec<_> = std::fs::read_dir(t.path().join("usr/local/bin"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["kubelet"], "no temp file left");
        assert_eq!(
            std::fs::read(t.path().join("usr/local/bin/kubelet")).unwrap(),
            big
        );

        assert!(
            root.open_file(&np("/usr/local/bin/none"))
                .unwrap()
                .is_none()
        );
        let err = root.open_file(&np("/usr/local/bin")).unwrap_err();
        assert!(matches!(err, FsError::NotAFile { .. }), "{err}");
    }

    #[test]
    fn stale_temp_files_are_replaced_and_swept() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        std::fs::create_dir_all(t.path().join("etc/kubernetes")).unwrap();
        std::fs::write(t.path().join("etc/kubernetes/.a.inplace-tmp"), "stale").unwrap();
        root.write_atomic(&np("/etc/kubernetes/a"), b"new", me())
            .unwrap();
        assert!(!t.path().join("etc/kubernetes/.a.inplace-tmp").exists());
        std::fs::write(t.path().join("etc/kubernetes/.b.inplace-tmp"), "stale").unwrap();
        assert!(root.sweep_temp(&np("/etc/kubernetes/b")).unwrap());
        assert!(temp_name(&"x".repeat(250)).len() < 40);
    }

    /// The allow-list holds at the moment of each access: a symlink planted after a path was
    /// checked (the admission) cannot lead a write, removal, directory creation or temp-file
    /// sweep anywhere, whatever it points at.
    #[test]
    fn a_symlink_planted_after_the_check_leads_nothing_anywhere() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        std::fs::create_dir_all(t.path().join("etc/kubernetes")).unwrap();
        std::fs::create_dir_all(t.path().join("root")).unwrap();
        std::fs::write(t.path().join("root/keep"), "x").unwrap();
        let p = np("/etc/kubernetes/L/pwned");
        assert!(root.check_path(&p).is_ok(), "L does not exist yet");
        // Planted afterwards: absolute (resolved inside the root), relative, and to a
        // directory that is itself allow-listed.
        for target in ["/root", "../../root", "/etc/kubernetes"] {
            let link = t.path().join("etc/kubernetes/L");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(target, &link).unwrap();
            let err = root.write_atomic(&p, b"x", me()).unwrap_err();
            assert!(
                matches!(err, FsError::SymlinkBelow { .. }),
                "{target}: {err}"
            );
            let err = root
                .write_atomic(&np("/etc/kubernetes/L/a/b"), b"x", me())
                .unwrap_err();
            assert!(
                matches!(err, FsError::SymlinkBelow { .. }),
                "{target}: {err}"
            );
            assert!(root.remove(&np("/etc/kubernetes/L/keep")).is_err());
            assert!(root.sweep_temp(&np("/etc/kubernetes/L/keep")).is_err());
            assert!(root.read(&np("/etc/kubernetes/L/keep")).is_err());
            assert!(root.check_path(&p).is_err());
        }
        let names: Vec<_> = std::fs::read_dir(t.path().join("root"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            ["keep"],
            "nothing written or removed outside the allow-list"
        );
        assert!(!t.path().join("etc/kubernetes/pwned").exists());
    }

    #[test]
    fn an_allow_listed_directory_must_really_be_allow_listed() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        std::fs::create_dir_all(t.path().join("etc")).unwrap();
        std::fs::create_dir_all(t.path().join("root")).unwrap();
        // The allow-listed directory itself points elsewhere: refused.
        std::os::unix::fs::symlink("/root", t.path().join("etc/kubernetes")).unwrap();
        let err = root
            .write_atomic(&np("/etc/kubernetes/x"), b"x", me())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/etc/kubernetes/x resolves through a symlink to /root/x, which is outside the \
             allow-list"
        );
        assert!(!t.path().join("root/x").exists());
        // ... to another allow-listed place: fine (the entry may be reached by a symlink).
        std::fs::remove_file(t.path().join("etc/kubernetes")).unwrap();
        std::fs::create_dir_all(t.path().join("etc/containerd/k8s")).unwrap();
        std::os::unix::fs::symlink("containerd/k8s", t.path().join("etc/kubernetes")).unwrap();
        root.write_atomic(&np("/etc/kubernetes/x"), b"x", me())
            .unwrap();
        assert!(t.path().join("etc/containerd/k8s/x").is_file());
    }

    #[test]
    fn outside_the_allow_list_is_read_only_and_missing_entries_are_created() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), AllowList::default()).unwrap();
        std::fs::create_dir_all(t.path().join("etc")).unwrap();
        std::fs::write(t.path().join("etc/passwd"), "root:x:0:0::/:/bin/sh\n").unwrap();
        assert!(matches!(
            root.read(&np("/etc/passwd")).unwrap(),
            Existing::File { .. }
        ));
        for err in [
            root.write_atomic(&np("/etc/passwd"), b"x", me())
                .unwrap_err(),
            root.remove(&np("/etc/passwd")).unwrap_err(),
            root.remove_empty_dir(&np("/etc/ssh")).unwrap_err(),
        ] {
            assert!(matches!(err, FsError::NotAllowed { .. }), "{err}");
        }
        // /opt/cni/bin does not exist: it and the way to it are created ...
        let p = np("/opt/cni/bin/bridge");
        assert_eq!(
            root.missing_dirs(&p).unwrap(),
            [np("/opt"), np("/opt/cni"), np("/opt/cni/bin")]
        );
        root.write_atomic(&p, b"elf", me()).unwrap();
        // ... and, being the way to an allow-listed directory, removed again when empty.
        assert!(root.remove(&p).unwrap());
        for d in ["/opt/cni/bin", "/opt/cni", "/opt"] {
            assert!(root.remove_empty_dir(&np(d)).unwrap(), "{d}");
        }
        // A file where a directory should be: nothing can be below it, so it is absent.
        std::fs::create_dir_all(t.path().join("etc/kubernetes")).unwrap();
        std::fs::write(t.path().join("etc/kubernetes/d"), "file").unwrap();
        assert!(!root.remove(&np("/etc/kubernetes/d/y.conf")).unwrap());
        let err = root
            .write_atomic(&np("/etc/kubernetes/d/y.conf"), b"x", me())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/etc/kubernetes/d/y.conf: /etc/kubernetes/d is a regular file, not a directory"
        );
    }
}
