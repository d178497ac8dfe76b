//! Content-addressed store of pre-images: `<state>/backups/<sha256 hex>`.
//!
//! A blob is written atomically and durably before the journal record that references it,
//! so a `StepStarted` record never points at a missing backup. Identical content is stored
//! once. Blobs no unfinished plan references are removed by [`BackupStore::retain`].
//!
//! [`BackupStore::put`] makes one blob durable on its own (two syncs). The engine backs up
//! the files of a whole batch of changes through a [`BlobBatch`] instead, from two threads:
//! each blob is written under a temporary name of its own and its writeback started at once
//! (the disk works while the next file is read and hashed), and [`BlobBatch::sync`] waits
//! for them all, renames them into place and syncs the directory once, before the batch's
//! `StepStarted` records are written. Until then no record names them, and a blob under its
//! final name is always durable, so a crash in between leaves only temporary files (removed
//! by [`BackupStore::retain`] when the next plan finishes).
//!
//! A file the step will replace by a rename (or remove) need not be copied at all: its own
//! inode can be the blob. [`BlobBatch::link`] hard-links it into the store under a
//! temporary name, [`BlobBatch::keep`] takes it as its content's blob once the caller has
//! hashed it, and the batch's sync makes it durable like a written blob (its data
//! synced, then renamed into place). Until the step's rename the file and the blob are one
//! inode; after it, only the store reaches the old content. That is as safe as a copy when
//! nothing writes the file in place in between (a batch's own mutations rename and unlink)
//! and no process held it open for writing (the caller asks first, and copies when one
//! does); a blob that still shares its inode with a live file (a step that never ran) is
//! never taken for stored content, and every read of a blob checks it against its name.

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::failpoint;
use inplace_base::sha256::VerifyingReader;

/// The backup store of one state directory.
#[derive(Debug, Clone)]
pub struct BackupStore {
    dir: PathBuf,
}

/// Backup store errors.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// An I/O error.
    #[error("backup store {path}: {op}: {source}")]
    Io {
        /// The blob or directory.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A blob does not match its name.
    #[error("backup {path} is damaged (content does not match its sha256)")]
    Damaged {
        /// The blob.
        path: PathBuf,
    },
}

impl BackupError {
    /// The OS error code, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            BackupError::Io { source, .. } => source.raw_os_error(),
            BackupError::Damaged { .. } => None,
        }
    }
}

impl BackupStore {
    /// The store under `state_dir` (not created until the first `put`).
    pub fn at(state_dir: &Path) -> BackupStore {
        BackupStore {
            dir: state_dir.join("backups"),
        }
    }

    fn blob(&self, sha: &str) -> PathBuf {
        self.dir.join(sha)
    }

    /// Stores `content` durably and returns its sha256 hex.
    pub fn put(&self, content: &[u8]) -> Result<String, BackupError> {
        let sha = hex::encode(Sha256::digest(content));
        self.put_hashed(&sha, content)?;
        Ok(sha)
    }

    /// [`BackupStore::put`] of a content whose sha256 hex the caller has (it hashed this
    /// very content, e.g. with an earlier `put`): makes sure it is stored without hashing
    /// it again.
    pub fn put_hashed(&self, sha: &str, content: &[u8]) -> Result<(), BackupError> {
        debug_assert_eq!(
            sha,
            hex::encode(Sha256::digest(content)),
            "put_hashed given another content's sha256"
        );
        if self.stored(sha, content.len()) {
            return Ok(());
        }
        // Written next to its place under a name of its own (a crash may have left it: only
        // one agent writes the store), synced, renamed into place, and the rename synced.
        let tmp = self.partial(sha, None);
        let f = self.write_partial(sha, &tmp, content)?;
        let path = self.blob(sha);
        let finish = || -> Result<(), (&'static str, io::Error)> {
            f.sync_all().map_err(|e| ("sync", e))?;
            failpoint::hit("backup.before_rename");
            std::fs::rename(&tmp, &path).map_err(|e| ("rename", e))?;
            super::sync_dir(&self.dir).map_err(|e| ("sync directory of", e))
        };
        if let Err((op, source)) = finish() {
            let _ = std::fs::remove_file(&tmp);
            return Err(BackupError::Io { path, op, source });
        }
        Ok(())
    }

    /// The blob `sha` is in the store (with the length its content has) and is nobody
    /// else's: a blob that still shares its inode with a file on the node (kept by
    /// [`BlobBatch::keep`] for a step that never replaced it) could change with that file, so
    /// it does not count as stored content.
    fn stored(&self, sha: &str, len: usize) -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(self.blob(sha)).is_ok_and(|m| m.len() == len as u64 && m.nlink() == 1)
    }

    /// Writes `content` as `tmp`, a temporary file of the blob `sha` (replacing one a crash
    /// left), not synced; on failure nothing is left.
    fn write_partial(
        &self,
        sha: &str,
        tmp: &Path,
        content: &[u8],
    ) -> Result<std::fs::File, BackupError> {
        use std::os::unix::fs::OpenOptionsExt;
        super::create_private_dir(&self.dir).map_err(|source| BackupError::Io {
            path: self.dir.clone(),
            op: "create",
            source,
        })?;
        let _ = std::fs::remove_file(tmp);
        let write = || -> Result<std::fs::File, (&'static str, io::Error)> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(tmp)
                .map_err(|e| ("create temp file for", e))?;
            f.write_all(content).map_err(|e| ("write", e))?;
            Ok(f)
        };
        write().map_err(|(op, source)| {
            let _ = std::fs::remove_file(tmp);
            BackupError::Io {
                path: self.blob(sha),
                op,
                source,
            }
        })
    }

    /// A temporary name the blob `sha` is written under before it is durable (`n`: the
    /// number of a batch's write).
    fn partial(&self, sha: &str, n: Option<u64>) -> PathBuf {
        match n {
            None => self.dir.join(format!(".{sha}.partial")),
            Some(n) => self.dir.join(format!(".{sha}.{n}.partial")),
        }
    }

    /// Stores what `content` yields durably, streaming (large files are never held in
    /// memory), and returns its sha256 hex.
    pub fn put_reader(&self, content: &mut dyn Read) -> Result<String, BackupError> {
        let io = |op: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| BackupError::Io { path, op, source }
        };
        super::create_private_dir(&self.dir).map_err(io("create", &self.dir))?;
        let mut tmp = tempfile::Builder::new()
            .prefix(".partial-")
            .tempfile_in(&self.dir)
            .map_err(io("create temp file in", &self.dir))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut len = 0;
        loop {
            let n = match content.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io("read content for", &self.dir)(e)),
            };
            hasher.update(&buf[..n]);
            tmp.write_all(&buf[..n]).map_err(io("write", tmp.path()))?;
            len += n;
        }
        let sha = hex::encode(hasher.finalize());
        let path = self.blob(&sha);
        if self.stored(&sha, len) {
            // Identical content is stored once; the temp file goes away on drop.
            return Ok(sha);
        }
        tmp.as_file().sync_all().map_err(io("sync", tmp.path()))?;
        tmp.persist(&path)
            .map_err(|e| io("rename", &path)(e.error))?;
        super::sync_dir(&self.dir).map_err(io("sync", &self.dir))?;
        Ok(sha)
    }

    /// A reader of a blob that checks it against its name as it goes: the read that reaches
    /// the end fails when the content does not match (nothing is held in memory).
    pub fn open(&self, sha: &str) -> Result<VerifyingReader<std::fs::File>, BackupError> {
        let path = self.blob(sha);
        let file = std::fs::File::open(&path).map_err(|source| BackupError::Io {
            path: path.clone(),
            op: "open",
            source,
        })?;
        Ok(VerifyingReader::new(
            file,
            sha,
            format!(
                "backup {} is damaged (content does not match its sha256)",
                path.display()
            ),
        ))
    }

    /// Reads a blob back, checking it against its name.
    pub fn get(&self, sha: &str) -> Result<Vec<u8>, BackupError> {
        let path = self.blob(sha);
        let bytes = std::fs::read(&path).map_err(|source| BackupError::Io {
            path: path.clone(),
            op: "read",
            source,
        })?;
        if hex::encode(Sha256::digest(&bytes)) != sha {
            return Err(BackupError::Damaged { path });
        }
        Ok(bytes)
    }

    /// True when the blob exists and matches its name.
    pub fn check(&self, sha: &str) -> bool {
        self.get(sha).is_ok()
    }

    /// Removes every blob not in `keep`; returns how many were removed.
    pub fn retain(&self, keep: &HashSet<String>) -> Result<usize, BackupError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(source) => {
                return Err(BackupError::Io {
                    path: self.dir.clone(),
                    op: "list",
                    source,
                });
            }
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !keep.contains(&name) {
                std::fs::remove_file(entry.path()).map_err(|source| BackupError::Io {
                    path: entry.path(),
                    op: "remove",
                    source,
                })?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

/// Blobs of one batch of captures, made durable together by [`BlobBatch::sync`] (see the
/// module's documentation); several threads may put into one batch. Blobs not synced are
/// removed when the batch is dropped.
#[derive(Debug)]
pub struct BlobBatch<'a> {
    store: &'a BackupStore,
    /// Each blob written under a temporary name and not yet synced: that name, its sha256.
    pending: std::sync::Mutex<Vec<(PathBuf, String)>>,
    /// The number of the batch's next write (its temporary name).
    next: AtomicU64,
}

impl<'a> BlobBatch<'a> {
    /// An empty batch of `store`.
    pub fn new(store: &'a BackupStore) -> BlobBatch<'a> {
        BlobBatch {
            store,
            pending: std::sync::Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        }
    }

    /// Writes `content` under a temporary name of its blob and starts its writeback;
    /// durable (and under its final name) once the batch is synced. Returns its sha256 hex.
    pub fn put(&self, content: &[u8]) -> Result<String, BackupError> {
        self.put_hashed(content, hex::encode(Sha256::digest(content)))
    }

    /// The pending writes (a panic while they were held poisons nothing: the list is only
    /// ever pushed to and drained).
    fn pending(&self) -> std::sync::MutexGuard<'_, Vec<(PathBuf, String)>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Like [`BlobBatch::put`], for content whose sha256 the caller has computed.
    pub fn put_hashed(&self, content: &[u8], sha: String) -> Result<String, BackupError> {
        // Written once: already in the store, or already written by this batch (only a
        // write that succeeded is pending, so nothing counts on one that failed).
        if self.store.stored(&sha, content.len())
            || self.pending().iter().any(|(_, pending)| *pending == sha)
        {
            return Ok(sha);
        }
        // A temporary name of its own: two threads of a batch putting the same content at
        // once both write it (both are renamed onto the one blob).
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let tmp = self.store.partial(&sha, Some(n));
        let f = self.store.write_partial(&sha, &tmp, content)?;
        inplace_base::start_writeback(&f);
        self.pending().push((tmp, sha.clone()));
        Ok(sha)
    }

    /// Hard-links the file open as `file` into the store under a temporary name, the first
    /// half of keeping it as the blob of its own content ([`BlobBatch::keep`], once the
    /// caller has hashed it). Linked before it is read, so that a file that cannot be linked
    /// (on another mount than the store) is found out before it is read, and is read once,
    /// to be copied. `None` when it cannot be linked; the link goes away with the
    /// [`Linked`] unless it is kept.
    pub fn link(&self, file: &std::fs::File) -> Result<Option<Linked>, BackupError> {
        super::create_private_dir(&self.store.dir).map_err(|source| BackupError::Io {
            path: self.store.dir.clone(),
            op: "create",
            source,
        })?;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let tmp = self.store.dir.join(format!(".link.{n}.partial"));
        let _ = std::fs::remove_file(&tmp);
        Ok(link_open_file(file, &tmp).then_some(Linked { tmp }))
    }

    /// Keeps the file linked as `linked` (open as `file`) as the blob of its content `sha`
    /// (`seen`: its status before it was linked, read and hashed), without copying a byte:
    /// the link is made durable with the batch like any blob, and the blob becomes the
    /// store's alone when the step renames the file's replacement over it (or removes it).
    /// False, the link removed, when the file changed or gained a name while it was read
    /// (the caller copies it instead).
    ///
    /// The caller vouches for what makes this as safe as a copy: that nothing writes the
    /// file in place between now and the step that replaces it (the batch's own mutations
    /// only rename and unlink), and that no process had it open for writing when it was
    /// read ([`inplace_base::open_for_writing`]), so that once replaced nothing can reach it
    /// but the store. Rollback checks every blob against its sha256 as it reads it all the
    /// same.
    pub fn keep(
        &self,
        mut linked: Linked,
        file: &std::fs::File,
        sha: &str,
        seen: &rustix::fs::Stat,
    ) -> bool {
        let unchanged = rustix::fs::fstat(file).is_ok_and(|now| {
            now.st_nlink == 2
                && now.st_size == seen.st_size
                && (now.st_mtime, now.st_mtime_nsec) == (seen.st_mtime, seen.st_mtime_nsec)
        });
        if !unchanged {
            return false;
        }
        // Already in the store, or kept by this batch: the link is not needed.
        if !self.store.stored(sha, seen.st_size as usize)
            && !self.pending().iter().any(|(_, p)| p == sha)
        {
            self.pending()
                .push((std::mem::take(&mut linked.tmp), sha.to_string()));
        }
        true
    }

    /// Stores what `content` yields, streaming, durably at once (large files are rare; they
    /// are not worth holding back). Returns its sha256 hex.
    pub fn put_reader(&self, content: &mut dyn Read) -> Result<String, BackupError> {
        self.store.put_reader(content)
    }

    /// Makes every blob put since the last sync durable under its final name: each file
    /// synced (its writeback started when it was written), renamed into place, then the
    /// directory synced once. Only then may a journal record name them.
    pub fn sync(&mut self) -> Result<(), BackupError> {
        let store = self.store;
        let pending = self.pending.get_mut().unwrap_or_else(|e| e.into_inner());
        if pending.is_empty() {
            return Ok(());
        }
        for (tmp, _) in pending.iter() {
            std::fs::File::open(tmp)
                .and_then(|f| f.sync_all())
                .map_err(|source| BackupError::Io {
                    path: tmp.clone(),
                    op: "sync",
                    source,
                })?;
        }
        failpoint::hit("backup.before_rename");
        // On a failure the blobs not renamed yet stay pending (removed on drop).
        let mut renamed = 0;
        let result = pending.iter().try_for_each(|(tmp, sha)| {
            std::fs::rename(tmp, store.blob(sha)).map_err(|source| BackupError::Io {
                path: store.blob(sha),
                op: "rename",
                source,
            })?;
            renamed += 1;
            Ok(())
        });
        pending.drain(..renamed);
        result?;
        super::sync_dir(&store.dir).map_err(|source| BackupError::Io {
            path: store.dir.clone(),
            op: "sync directory of",
            source,
        })
    }
}

/// A file hard-linked into the store under a temporary name ([`BlobBatch::link`]); the
/// link is removed on drop unless [`BlobBatch::keep`] took it.
#[derive(Debug)]
pub struct Linked {
    tmp: PathBuf,
}

impl Drop for Linked {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Hard-links the open `file` as `path`: by its descriptor (root, as the agent runs), or
/// through `/proc/self/fd` (anyone else); false when neither works.
fn link_open_file(file: &std::fs::File, path: &Path) -> bool {
    use rustix::fs::{AtFlags, CWD, linkat};
    use std::os::fd::AsRawFd;
    linkat(file, "", CWD, path, AtFlags::EMPTY_PATH).is_ok()
        || linkat(
            CWD,
            format!("/proc/self/fd/{}", file.as_raw_fd()),
            CWD,
            path,
            AtFlags::SYMLINK_FOLLOW,
        )
        .is_ok()
}

impl Drop for BlobBatch<'_> {
    fn drop(&mut self) {
        for (tmp, _) in self.pending().iter() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_blobs_are_deduplicated_and_checked_when_read() {
        let t = tempfile::tempdir().unwrap();
        let store = BackupStore::at(t.path());
        let big: Vec<u8> = (0..2_000_000).map(|i| (i % 253) as u8).collect();
        let sha = store.put_reader(&mut &big[..]).unwrap();
        assert_eq!(sha, hex::encode(Sha256::digest(&big)));
        assert_eq!(store.put_reader(&mut &big[..]).unwrap(), sha);
        assert_eq!(store.put(&big).unwrap(), sha, "same key as put");
        let mut back = Vec::new();
        store.open(&sha).unwrap().read_to_end(&mut back).unwrap();
        assert_eq!(back, big);
        let names: Vec<_> = std::fs::read_dir(t.path().join("backups"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [sha.as_str()], "no temp files left");

        std::fs::write(t.path().join("backups").join(&sha), b"tampered").unwrap();
        let err = store
            .open(&sha)
            .unwrap()
            .read_to_end(&mut Vec::new())
            .unwrap_err();
        assert!(err.to_string().contains("is damaged"), "{err}");
    }

    #[test]
    fn put_get_retain() {
        let t = tempfile::tempdir().unwrap();
        let store = BackupStore::at(t.path());
        let a = store.put(b"alpha").unwrap();
        assert_eq!(store.put(b"alpha").unwrap(), a, "deduplicated");
        let b = store.put(b"beta").unwrap();
        assert_eq!(store.get(&a).unwrap(), b"alpha");
        std::fs::write(t.path().join("backups").join(&b), b"tampered").unwrap();
        assert!(matches!(store.get(&b), Err(BackupError::Damaged { .. })));
        let keep: HashSet<String> = [a.clone()].into();
        assert_eq!(store.retain(&keep).unwrap(), 1);
        assert!(store.check(&a));
        assert!(!store.check(&b));
    }

    #[test]
    fn a_content_stored_by_its_known_sum_is_written_again_only_when_missing() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().unwrap();
        let store = BackupStore::at(t.path());
        let sha = store.put(b"bodies").unwrap();
        let inode = |sha: &str| std::fs::metadata(store.blob(sha)).unwrap().ino();
        let before = inode(&sha);
        store.put_hashed(&sha, b"bodies").unwrap();
        assert_eq!(inode(&sha), before, "a stored blob is left as it is");
        // What compaction does to a blob no record names any more.
        assert_eq!(store.retain(&HashSet::new()).unwrap(), 1);
        assert!(!store.check(&sha));
        store.put_hashed(&sha, b"bodies").unwrap();
        assert_eq!(store.get(&sha).unwrap(), b"bodies", "stored again");
        assert_eq!(names(&t), vec![sha]);
    }

    fn names(t: &tempfile::TempDir) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(t.path().join("backups"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_batch_names_its_blobs_only_once_synced_and_leaves_nothing_when_dropped() {
        let t = tempfile::tempdir().unwrap();
        let store = BackupStore::at(t.path());
        let kept = store.put(b"kept").unwrap();
        let (a, b) = {
            let mut batch = BlobBatch::new(&store);
            let a = batch.put(b"alpha").unwrap();
            assert_eq!(batch.put(b"alpha").unwrap(), a, "deduplicated in the batch");
            let b = batch.put(b"beta").unwrap();
            assert_eq!(
                batch.put(b"kept").unwrap(),
                kept,
                "deduplicated against the store"
            );
            // Nothing under a final name before the sync: no record may name them yet.
            assert!(!store.check(&a) && !store.check(&b));
            let mut want = vec![
                format!(".{a}.0.partial"),
                format!(".{b}.1.partial"),
                kept.clone(),
            ];
            want.sort();
            assert_eq!(names(&t), want);
            batch.sync().unwrap();
            (a, b)
        };
        assert_eq!(store.get(&a).unwrap(), b"alpha");
        assert_eq!(store.get(&b).unwrap(), b"beta");
        let mut want = vec![a.clone(), b.clone(), kept.clone()];
        want.sort();
        assert_eq!(names(&t), want, "no temp files left after a sync");

        // A batch dropped before its sync (a capture failed) leaves no temp file behind.
        let batch = BlobBatch::new(&store);
        let c = batch.put(b"gamma").unwrap();
        drop(batch);
        assert!(!store.check(&c));
        assert_eq!(names(&t), want);
    }

    fn ino(path: &Path) -> (u64, u64) {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).unwrap();
        (m.ino(), m.nlink())
    }

    /// A file on the node beside a store, its status, its content's sha256.
    fn node_file(t: &tempfile::TempDir, name: &str, content: &[u8]) -> (PathBuf, String) {
        let path = t.path().join(name);
        std::fs::write(&path, content).unwrap();
        (path, hex::encode(Sha256::digest(content)))
    }

    #[test]
    fn a_kept_file_is_its_own_blob_and_outlives_its_replacement() {
        let t = tempfile::tempdir().unwrap();
        let store = BackupStore::at(t.path());
        let (path, sha) = node_file(&t, "kubelet", b"old kubelet");
        let file = std::fs::File::open(&path).unwrap();
        let seen = rustix::fs::fstat(&file).unwrap();
        let mut batch = BlobBatch::new(&store);
        let linked = batch.link(&file).unwrap().expect("one mount");
        assert!(batch.keep(linked, &file, &sha, &seen));
        // Not under its final name before the sync; the same inode as the file.
        assert!(!t.path().join("backups").join(&sha).exists());
        batch.sync().unwrap();
        drop(batch);
        let blob = t.path().join("backups").join(&sha);
        assert_eq!(ino(&blob), (ino(&path).0, 2), "a second name of the file");
        // While it shares its inode with a file of the node it is not stored content: a
        // put of the same bytes writes a copy of its own.
        let mut batch = BlobBatch::new(&store);
        assert_eq!(batch.put(b"old kubelet").unwrap(), sha);
        batch.sync().unwrap();
        drop(batch);
        assert_eq!(ino(&blob).1, 1, "the copy replaced the link");
        assert_ne!(ino(&blob).0, ino(&path).0);

        // Kept again, then replaced as a step does: by a rename over it.
        let mut batch = BlobBatch::new(&store);
        let (other, sha2) = node_file(&t, "proxy", b"old proxy");
        let file = std::fs::File::open(&other).unwrap();
        let seen = rustix::fs::fstat(&file).unwrap();
        let linked = batch.link(&file).unwrap().expect("one mount");
        assert!(batch.keep(linked, &file, &sha2, &seen));
        batch.sync().unwrap();
        drop(batch);
        std::fs::write(t.path().join("new"), b"new proxy").unwrap();
        std::fs::rename(t.path().join("new"), &other).unwrap();
        assert_eq!(store.get(&sha2).unwrap(), b"old proxy");
        assert_eq!(ino(&t.path().join("backups").join(&sha2)).1, 1);
        assert_eq!(std::fs::read(&other).unwrap(), b"new proxy");
        let mut names = names(&t);
        names.sort();
        let mut want = vec![sha.clone(), sha2.clone()];
        want.sort();
        assert_eq!(names, want, "no temp files left");
    }

    #[test]
    fn a_file_that_changed_or_gained_a_name_while_read_is_not_kept() {
        let t = tempfile::tempdir().unwrap();
        let store = BackupStore::at(t.path());
        let (path, sha) = node_file(&t, "a", b"first");
        let file = std::fs::File::open(&path).unwrap();
        let seen = rustix::fs::fstat(&file).unwrap();
        std::fs::hard_link(&path, t.path().join("a-too")).unwrap();
        let batch = BlobBatch::new(&store);
        let linked = batch.link(&file).unwrap().expect("one mount");
        assert!(!batch.keep(linked, &file, &sha, &seen), "a second name");
        std::fs::remove_file(t.path().join("a-too")).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b" and more")
            .unwrap();
        let linked = batch.link(&file).unwrap().expect("one mount");
        assert!(!batch.keep(linked, &file, &sha, &seen), "grew while read");
        drop(batch);
        assert!(names(&t).is_empty(), "nothing left: {:?}", names(&t));
        assert_eq!(ino(&path).1, 1);
    }
}
