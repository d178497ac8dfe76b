//! Content-addressed store of pre-images: `<state>/backups/<sha256 hex>`.
//!
//! A blob is written atomically and durably before the journal record that references it,
//! so a `StepStarted` record never points at a missing backup. Identical content is stored
//! once. Blobs no unfinished plan references are removed by [`BackupStore::retain`].

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::host::fs::{FileMeta, open_dir, write_in_dir};

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
        let dir = open_dir(&self.dir).map_err(io("open", &self.dir))?;
        let meta = FileMeta {
            mode: 0o600,
            uid: rustix::process::geteuid().as_raw(),
            gid: rustix::process::getegid().as_raw(),
        };
        write_in_dir(&dir, &sha, content, meta).map_err(|(op, e)| io(op, &path)(e))?;
        Ok(sha)
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
