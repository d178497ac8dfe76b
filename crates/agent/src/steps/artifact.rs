//! `artifact`: a binary downloaded from a URL (or one member of a downloaded `.tar.gz`),
//! verified against its sha256, installed at a path with a mode.
//!
//! The download happens while the plan is Preparing ([`fetch`], for every artifact of the
//! plan, before anything on the node changes), into the content-addressed cache of
//! `host::download`. Applying then installs from the cache as an ordinary file mutation
//! ([`super::Mutation::WriteFrom`]): batched, backed up and rolled back like any file, with
//! the content streamed and its sha256 checked again while it is copied, so a large binary is
//! never held in memory and a corrupted cache entry never lands on the node.

use inplace_base::FileMeta;
use std::path::Path;

use super::{Note, StepError};
use crate::host::Host;
use crate::host::download::{DownloadError, DownloadEvent, ExtractLimits, VerifyingReader};
use inplace_base::ErrorKind;
use inplace_plan::NodePath;

fn download_error(e: DownloadError) -> StepError {
    let kind = match e {
        DownloadError::Io { .. } => ErrorKind::Io,
        _ => ErrorKind::Download,
    };
    StepError::new(kind, e.to_string())
}

/// `12.3 MiB`.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Downloads and verifies an artifact into the cache (a cache hit makes no request), and
/// extracts `member` when it names one. Returns what happened, for people.
pub fn fetch(
    host: &Host,
    url: &str,
    sha256: &str,
    member: Option<&str>,
    note: &mut dyn FnMut(Note),
) -> Result<String, StepError> {
    let downloader = host.downloader().map_err(download_error)?;
    let origin = match member {
        Some(m) => format!("{m} of {url}"),
        None => url.to_string(),
    };
    let mut events = |e: &DownloadEvent| match e {
        DownloadEvent::Progress { bytes, total } => {
            let of = total.map(|t| format!(" of {}", mib(t))).unwrap_or_default();
            note(Note::Status(&format!(
                "downloading {url}: {}{of}",
                mib(*bytes)
            )));
        }
        DownloadEvent::Retrying {
            attempt,
            delay,
            reason,
        } => note(Note::Event(&format!(
            "download {url}: attempt {attempt} failed ({reason}); trying again in {:.1}s",
            delay.as_secs_f64()
        ))),
    };
    let fetched = match member {
        None => downloader.fetch(url, sha256, &mut events),
        Some(member) => downloader
            .fetch_member(url, sha256, member, ExtractLimits::default(), &mut events)
            .map(|(f, _)| f),
    }
    .map_err(download_error)?;
    Ok(if fetched.from_cache {
        format!(
            "{} ({}) is in the download cache",
            origin,
            mib(fetched.size)
        )
    } else {
        format!(
            "downloaded {} ({}, {} attempt{})",
            origin,
            mib(fetched.size),
            fetched.attempts,
            if fetched.attempts == 1 { "" } else { "s" }
        )
    })
}

/// Installs `source` at `path` atomically, checking its sha256 while copying: on a mismatch
/// the rename never happens and the old file stays.
pub fn install(
    host: &Host,
    path: &NodePath,
    source: &Path,
    sha256: &str,
    meta: FileMeta,
) -> Result<(), StepError> {
    let file = std::fs::File::open(source).map_err(|e| {
        StepError::new(
            ErrorKind::Download,
            format!(
                "install {path}: open {} in the download cache: {e}",
                source.display()
            ),
        )
    })?;
    let mut reader = VerifyingReader::new(
        file,
        sha256,
        format!(
            "{} in the download cache does not have sha256 {sha256}",
            source.display()
        ),
    );
    host.root.write_atomic_from(path, &mut reader, meta)?;
    Ok(())
}
