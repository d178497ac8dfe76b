//! Safe, durable file I/O under a root directory.
//!
//! Every path is resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`, so a
//! symlink on the node cannot lead outside the root; [`Root::check_path`] additionally
//! refuses paths whose resolved location leaves the allow-list and final components that are
//! symlinks. Writes are atomic and durable: temp file in the same directory (`O_EXCL`),
//! fchown/fchmod, fsync, rename, fsync of the directory. A failed write removes its temp
//! file; a crash can leave one, named `.<name>.inplace-tmp`, which [`Root::sweep_temp`]
//! removes on resume.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode as RMode, OFlags, ResolveFlags};
use sha2::{Digest, Sha256};

use crate::failpoint;
use crate::plan::{AllowList, NodePath};

/// Directories resolved by [`Root::check_path_in`], by node path.
#[derive(Debug, Default)]
pub struct DirCache {
    dirs: std::collections::HashMap<String, DirEntry>,
}

#[derive(Debug)]
struct DirEntry {
    /// Real node path of the deepest existing ancestor ("" for the root).
    real: String,
    /// How many ancestors (from the top) exist.
    first_missing: usize,
    /// The parent directory, opened, when it exists.
    fd: Option<OwnedFd>,
}

/// Permission bits and ownership of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileMeta {
    /// Permission bits (`0o7777` mask).
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
}

/// What is at a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Existing {
    /// Nothing.
    Absent,
    /// A regular file.
    File {
        /// Its bytes.
        content: Vec<u8>,
        /// Its mode and owner.
        meta: FileMeta,
    },
    /// Something the agent does not manage (a directory, a device, a socket).
    Other {
        /// What it is.
        kind: &'static str,
    },
}

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
/// DaemonSet, a sandbox in tests).
#[derive(Debug)]
pub struct Root {
    dir: OwnedFd,
    path: PathBuf,
    /// What the kernel calls the root directory (`/proc/self/fd/N`), the prefix every
    /// resolved path starts with. Usually `path`; not for a root reached through another
    /// mount namespace (`/proc/<pid>/root` of a sandboxed node), whose real name is a path
    /// in that namespace.
    real: PathBuf,
}

/// What [`Root::open_existing`] found.
enum Opened {
    Absent,
    File(File, FileMeta, u64),
    Other(&'static str),
}

const RESOLVE: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);

impl Root {
    /// Opens the root directory. Its path is kept canonical when that names the same
    /// directory, and as given (made absolute) otherwise: `/proc/<pid>/root` of a process in
    /// another mount namespace canonicalizes to a path that only exists in that namespace.
    pub fn open(path: &Path) -> io::Result<Root> {
        let named = |e: &dyn std::fmt::Display| format!("root {}: {e}", path.display());
        let dir = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            RMode::empty(),
        )
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
        Ok(Root { dir, path, real })
    }

    /// The root's path on the agent's own filesystem.
    pub fn path(&self) -> &Path {
        &self.path
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

    /// Opens a directory of the node for `*at` calls.
    fn open_dir(&self, dir: Option<&NodePath>) -> io::Result<OwnedFd> {
        let rel = dir.map_or(".", NodePath::relative);
        rustix::fs::openat2(
            &self.dir,
            rel,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            RMode::empty(),
            RESOLVE,
        )
        .map_err(rio)
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

    /// Checks that `p` may be managed: the deepest existing directory on its way resolves
    /// (through any symlinks, confined to the root) inside the allow-list, and the final
    /// component is not a symlink.
    pub fn check_path(&self, p: &NodePath, allow: &AllowList) -> Result<(), FsError> {
        self.check_path_in(p, allow, &mut DirCache::default())
            .map(|_| ())
    }

    /// [`Root::check_path`] for many paths: directories already resolved in `cache` are not
    /// resolved again (a plan of 500 files in one directory opens it once). Also says what
    /// is at `p` when it is neither absent nor a regular file (`Some("directory")`), from the
    /// same `stat`.
    pub fn check_path_in(
        &self,
        p: &NodePath,
        allow: &AllowList,
        cache: &mut DirCache,
    ) -> Result<Option<&'static str>, FsError> {
        let parent = p.parent();
        let key = parent.as_ref().map_or("", NodePath::as_str).to_string();
        if !cache.dirs.contains_key(&key) {
            let resolved = self.resolve_dir(p, parent.as_ref())?;
            cache.dirs.insert(key.clone(), resolved);
        }
        let dir = &cache.dirs[&key];
        let ancestors = parent.map(|d| d.ancestors_from_top()).unwrap_or_default();
        let mut missing: Vec<&str> = vec![p.file_name()];
        for a in ancestors.iter().skip(dir.first_missing).rev() {
            missing.push(a.file_name());
        }
        missing.reverse();
        let resolved = format!("{}/{}", dir.real, missing.join("/"));
        let resolved_path = NodePath::parse(&resolved).map_err(|e| FsError::Io {
            op: "resolve",
            path: p.to_string(),
            source: io::Error::other(e.to_string()),
        })?;
        if resolved_path != *p && !allow.allows(&resolved_path) {
            return Err(FsError::Escapes {
                path: p.to_string(),
                resolved,
            });
        }
        // The parent exists: look at the final component without following it.
        let Some(fd) = &dir.fd else { return Ok(None) };
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

    /// Resolves the directory part of `p` (its `parent`): the real node path of the deepest
    /// existing ancestor, how many ancestors exist, and the parent opened when it exists.
    fn resolve_dir(&self, p: &NodePath, parent: Option<&NodePath>) -> Result<DirEntry, FsError> {
        let ancestors: Vec<NodePath> = parent.map(|d| d.ancestors_from_top()).unwrap_or_default();
        let mut existing: Option<(OwnedFd, usize)> = None;
        for (depth, dir) in ancestors.iter().enumerate().rev() {
            match self.open_dir(Some(dir)) {
                Ok(fd) => {
                    existing = Some((fd, depth));
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("open directory of", p)(e)),
            }
        }
        let (real, first_missing, fd) = match existing {
            Some((fd, depth)) => {
                // The next component does not resolve; if it exists at all, it is a
                // dangling symlink (often an absolute link meant for another root).
                if let Some(next) = ancestors.get(depth + 1)
                    && let Ok(target) = rustix::fs::readlinkat(&fd, next.file_name(), Vec::new())
                {
                    return Err(FsError::Symlink {
                        path: next.to_string(),
                        target: target.to_string_lossy().into_owned(),
                    });
                }
                let real = self.real_path_of(&fd).map_err(io_err("resolve", p))?;
                let whole = depth + 1 == ancestors.len();
                (real, depth + 1, whole.then_some(fd))
            }
            None if parent.is_none() => {
                // A path directly under the root.
                let fd = self
                    .open_dir(None)
                    .map_err(io_err("open directory of", p))?;
                (String::new(), 0, Some(fd))
            }
            None => (String::new(), 0, None),
        };
        Ok(DirEntry {
            real,
            first_missing,
            fd,
        })
    }

    /// Reads what is at `p` without following a final symlink.
    pub fn read(&self, p: &NodePath) -> Result<Existing, FsError> {
        match self.open_existing(p)? {
            Opened::Absent => Ok(Existing::Absent),
            Opened::Other(kind) => Ok(Existing::Other { kind }),
            Opened::File(mut file, meta, size) => {
                let mut content = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
                file.read_to_end(&mut content).map_err(io_err("read", p))?;
                Ok(Existing::File { content, meta })
            }
        }
    }

    /// Opens the regular file at `p` for reading (streaming large files such as binaries),
    /// with its mode, owner and size; `None` when nothing is there. A symlink or anything
    /// other than a regular file is an error.
    pub fn open_file(&self, p: &NodePath) -> Result<Option<(File, FileMeta, u64)>, FsError> {
        match self.open_existing(p)? {
            Opened::Absent => Ok(None),
            Opened::Other(kind) => Err(FsError::NotAFile {
                path: p.to_string(),
                kind,
            }),
            Opened::File(file, meta, size) => Ok(Some((file, meta, size))),
        }
    }

    /// What is at `p`, opened when it is a regular file; a final symlink is an error.
    fn open_existing(&self, p: &NodePath) -> Result<Opened, FsError> {
        let dir = match self.open_dir(p.parent().as_ref()) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Opened::Absent),
            Err(e) => return Err(io_err("open directory of", p)(e)),
        };
        let st = match rustix::fs::statat(&dir, p.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(rustix::io::Errno::NOENT) => return Ok(Opened::Absent),
            Err(e) => return Err(io_err("stat", p)(rio(e))),
        };
        use rustix::fs::FileType as T;
        match T::from_raw_mode(st.st_mode) {
            T::RegularFile => {}
            T::Symlink => {
                let target = rustix::fs::readlinkat(&dir, p.file_name(), Vec::new())
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
            &dir,
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
        let dir = match self.open_dir(p.parent().as_ref()) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open directory of", p)(e)),
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
            match self.open_dir(Some(&dir)) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(dir),
                Err(e) => return Err(io_err("open directory", &dir)(e)),
            }
        }
        missing.reverse();
        Ok(missing)
    }

    /// Creates the missing directories above `p` (mode 0755, root-owned), each made
    /// durable in its parent.
    pub fn create_dirs(&self, p: &NodePath) -> Result<(), FsError> {
        for dir in self.missing_dirs(p)? {
            let parent = self
                .open_dir(dir.parent().as_ref())
                .map_err(io_err("open directory of", &dir))?;
            match rustix::fs::mkdirat(&parent, dir.file_name(), RMode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(io_err("create directory", &dir)(rio(e))),
            }
            rustix::fs::fsync(&parent).map_err(|e| io_err("sync directory of", &dir)(rio(e)))?;
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
        self.create_dirs(p)?;
        let dir = self
            .open_dir(p.parent().as_ref())
            .map_err(io_err("open directory of", p))?;
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
        self.create_dirs(p)?;
        let dir = self
            .open_dir(p.parent().as_ref())
            .map_err(io_err("open directory of", p))?;
        write_in_dir_from(&dir, p.file_name(), content, meta).map_err(|(op, e)| io_err(op, p)(e))
    }

    /// Removes the file at `p`; false when it was already absent. Durable when it returns.
    pub fn remove(&self, p: &NodePath) -> Result<bool, FsError> {
        let dir = match self.open_dir(p.parent().as_ref()) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_err("open directory of", p)(e)),
        };
        match rustix::fs::unlinkat(&dir, p.file_name(), AtFlags::empty()) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOENT) => return Ok(false),
            Err(e) => return Err(io_err("remove", p)(rio(e))),
        }
        rustix::fs::fsync(&dir).map_err(|e| io_err("sync directory of", p)(rio(e)))?;
        Ok(true)
    }

    /// Removes the directory `p` if it exists and is empty; true when removed.
    pub fn remove_empty_dir(&self, p: &NodePath) -> Result<bool, FsError> {
        let parent = match self.open_dir(p.parent().as_ref()) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_err("open directory of", p)(e)),
        };
        match rustix::fs::unlinkat(&parent, p.file_name(), AtFlags::REMOVEDIR) {
            Ok(()) => {
                rustix::fs::fsync(&parent).map_err(|e| io_err("sync directory of", p)(rio(e)))?;
                Ok(true)
            }
            Err(
                rustix::io::Errno::NOENT | rustix::io::Errno::NOTEMPTY | rustix::io::Errno::EXIST,
            ) => Ok(false),
            Err(e) => Err(io_err("remove directory", p)(rio(e))),
        }
    }

    /// Removes a temp file a crash may have left for `p`.
    pub fn sweep_temp(&self, p: &NodePath) -> Result<bool, FsError> {
        let Ok(dir) = self.open_dir(p.parent().as_ref()) else {
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
            RESOLVE | ResolveFlags::NO_SYMLINKS,
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
            RESOLVE | ResolveFlags::NO_SYMLINKS,
        )
        .map_err(|e| io_err("open", p)(rio(e)))?;
        let mut f = File::from(fd);
        f.write_all(content).map_err(io_err("write", p))
    }

    /// True when the node directory exists.
    pub fn dir_exists(&self, p: &NodePath) -> bool {
        self.open_dir(Some(p)).is_ok()
    }
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

/// Opens a directory on the agent's own filesystem for [`write_in_dir`] (the state dir).
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        RMode::empty(),
    )
    .map_err(|e| io::Error::new(rio(e).kind(), format!("open {}: {e}", path.display())))
}

/// fsyncs a directory on the agent's own filesystem.
pub fn sync_dir(path: &Path) -> io::Result<()> {
    let fd = open_dir(path)?;
    rustix::fs::fsync(&fd).map_err(rio)
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
    fn write_read_remove_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path()).unwrap();
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
        let root = Root::open(t.path()).unwrap();
        let allow = AllowList::default();
        let err = root
            .check_path(&np("/etc/kubernetes/evil/x"), &allow)
            .unwrap_err();
        assert!(matches!(err, FsError::Symlink { .. }), "{err}");
        std::os::unix::fs::symlink("../../../../../../..", t.path().join("etc/kubernetes/up"))
            .unwrap();
        let err = root
            .check_path(&np("/etc/kubernetes/up/etc/passwd"), &allow)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/etc/kubernetes/up/etc/passwd resolves through a symlink to /etc/passwd, \
             which is outside the allow-list"
        );
        let err = root
            .check_path(&np("/etc/kubernetes/shadow"), &allow)
            .unwrap_err();
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
        assert!(
            root.check_path(&np("/etc/kubernetes/new/dir/x"), &allow)
                .is_ok()
        );
    }

    #[test]
    fn streamed_writes_are_atomic_and_a_failed_read_keeps_the_old_file() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path()).unwrap();
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
        let root = Root::open(t.path()).unwrap();
        std::fs::create_dir_all(t.path().join("etc/kubernetes")).unwrap();
        std::fs::write(t.path().join("etc/kubernetes/.a.inplace-tmp"), "stale").unwrap();
        root.write_atomic(&np("/etc/kubernetes/a"), b"new", me())
            .unwrap();
        assert!(!t.path().join("etc/kubernetes/.a.inplace-tmp").exists());
        std::fs::write(t.path().join("etc/kubernetes/.b.inplace-tmp"), "stale").unwrap();
        assert!(root.sweep_temp(&np("/etc/kubernetes/b")).unwrap());
        assert!(temp_name(&"x".repeat(250)).len() < 40);
    }
}
