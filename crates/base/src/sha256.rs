//! Content checked against its sha256 as it streams: downloads, the download cache and the
//! journal's backup store read through it.

use std::io::{self, Read};

use sha2::{Digest, Sha256};

/// A reader that hashes what passes through it and fails the read that reaches the end when
/// the sha256 is not the expected one, so a streaming copy through it never completes with
/// the wrong content. Later reads keep failing.
#[derive(Debug)]
pub struct VerifyingReader<R> {
    inner: R,
    hasher: Sha256,
    expected: String,
    mismatch: String,
    failed: bool,
    finished: bool,
}

impl<R: Read> VerifyingReader<R> {
    /// Checks `inner` against `sha256`; `mismatch` says what is wrong when it does not match.
    pub fn new(inner: R, sha256: &str, mismatch: impl Into<String>) -> VerifyingReader<R> {
        VerifyingReader {
            inner,
            hasher: Sha256::new(),
            expected: sha256.to_ascii_lowercase(),
            mismatch: mismatch.into(),
            failed: false,
            finished: false,
        }
    }
}

impl<R: Read> Read for VerifyingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.failed {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                self.mismatch.clone(),
            ));
        }
        if self.finished {
            return Ok(0);
        }
        let n = self.inner.read(buf)?;
        if n > 0 {
            self.hasher.update(&buf[..n]);
            return Ok(n);
        }
        let actual = hex::encode(std::mem::take(&mut self.hasher).finalize());
        if actual != self.expected {
            self.failed = true;
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                self.mismatch.clone(),
            ));
        }
        self.finished = true;
        Ok(0)
    }
}
