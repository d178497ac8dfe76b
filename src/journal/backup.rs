//! Content-addressed store of pre-images: `<state>/backups/<sha256 hex>`.
//!
//! A blob is written atomically and durably before the journal record that references it,
//! so a `StepStarted` record never points at a missing backup. Identical content is stored
//! once. Blobs no unfinished plan references are removed by [`BackupStore::retain`].

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::base::sha256::VerifyingReader;
use crate::failpoint;

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
        let path = self.blob(&sha);
        if let Ok(meta) = std::fs::metadata(&path)
            && meta.len() == content.len() as u64
        {
            return Ok(sha);
        }
        let io = |op: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| BackupError::Io { path, op, source }
        };
        super::create_private_dir(&self.dir).map_err(io("create", &self.dir))?;
        // Written next to its place under a name of its own (a crash may have left it: only
        // one agent writes the store), synced, renamed into place, and the rename synced.
        let tmp = self.dir.join(format!(".{sha}.partial"));
        let _ = std::fs::remove_file(&tmp);
        let write = || -> Result<(), (&'static str, io::Error)> {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| ("create temp file for", e))?;
            f.write_all(content).map_err(|e| ("write", e))?;
            f.sync_all().map_err(|e| ("sync", e))?;
            failpoint::hit("backup.before_rename");
            std::fs::rename(&tmp, &path).map_err(|e| ("rename", e))?;
            super::sync_dir(&self.dir).map_err(|e| ("sync directory of", e))
        };
        if let Err((op, e)) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(op, &path)(e));
        }
        Ok(sha)
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
        loop {
            let n = match content.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io("read content for", &self.dir)(e)),
            };
            hasher.update(&buf[..n]);
            tmp.write_all(&buf[..n]).map_err(io("write", tmp.path()))?;
        }
        let sha = hex::encode(hasher.finalize());
        let path = self.blob(&sha);
        if path.exists() {
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
}
