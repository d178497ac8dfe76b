//! `artifact`: a binary downloaded from a URL (or one member of a downloaded `.tar.gz`),
//! verified against its sha256, installed at a path with a mode.
//!
//! The download happens while the plan is Preparing ([`fetch`], for every artifact of the
//! plan, before anything on the node changes), into the content-addressed cache of
//! `host::download`. Applying then installs from the cache as an ordinary file mutation
//! ([`super::Mutation::WriteFrom`]): batched, backed up and rolled back like any file, with
//! the content streamed and its sha256 checked again while it is copied, so a large binary is
//! never held in memory and a corrupted cache entry never lands on the node.

use crate::base::FileMeta;
use std::path::Path;

use super::{Diff, Mutation, Note, StepCtx, StepError};
use crate::base::ErrorKind;
use crate::host::Host;
use crate::host::download::{
    DownloadError, DownloadEvent, ExtractLimits, VerifyingReader, hash_reader,
};
use crate::host::fs::FsError;
use crate::plan::{ArtifactChange, NodePath};

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

/// What `change` is, for messages: the URL, and the member when one is extracted.
pub fn origin(change: &ArtifactChange) -> String {
    match &change.extract {
        Some(member) => format!("{member} of {}", change.url),
        None => change.url.clone(),
    }
}

/// Downloads and verifies the artifact into the cache (a cache hit makes no request), and
/// extracts its member when it names one. Returns what happened, for people.
pub fn fetch(
    host: &Host,
    change: &ArtifactChange,
    note: &mut dyn FnMut(Note),
) -> Result<String, StepError> {
    let downloader = host.downloader().map_err(download_error)?;
    let url = change.url.as_str();
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
    let fetched = match &change.extract {
        None => downloader.fetch(url, &change.sha256, &mut events),
        Some(member) => downloader
            .fetch_member(
                url,
                &change.sha256,
                member,
                ExtractLimits::default(),
                &mut events,
            )
            .map(|(f, _)| f),
    }
    .map_err(download_error)?;
    Ok(if fetched.from_cache {
        format!(
            "{} ({}) is in the download cache",
            origin(change),
            mib(fetched.size)
        )
    } else {
        format!(
            "downloaded {} ({}, {} attempt{})",
            origin(change),
            mib(fetched.size),
            fetched.attempts,
            if fetched.attempts == 1 { "" } else { "s" }
        )
    })
}

/// Why a dry run cannot tell whether the artifact would change without downloading it: the
/// member of an archive that is not in the cache yet. `None` when it can tell.
pub fn undecided(host: &Host, change: &ArtifactChange) -> Option<String> {
    let member = change.extract.as_ref()?;
    match host.artifact_cache().member_sha(&change.sha256, member) {
        Some(_) => None,
        None => Some(format!(
            "{} is compared with {} once the archive is downloaded (while the plan is Preparing)",
            origin(change),
            change.path
        )),
    }
}

/// What `change` needs on this node now: nothing when the file there has the content, mode
/// and owner (`root:root`) it should have.
pub fn diff(host: &Host, change: &ArtifactChange, ctx: StepCtx) -> Result<Diff, StepError> {
    let cache = host.artifact_cache();
    let sha256 = match &change.extract {
        None => change.sha256.to_ascii_lowercase(),
        Some(member) => cache.member_sha(&change.sha256, member).ok_or_else(|| {
            StepError::new(
                ErrorKind::Download,
                format!(
                    "{} is not in the download cache (it is fetched while the plan is \
                     Preparing)",
                    origin(change)
                ),
            )
        })?,
    };
    let meta = FileMeta {
        mode: change.mode.0,
        uid: ctx.root_ids.0,
        gid: ctx.root_ids.1,
    };
    if let Some((mut file, have_meta, size)) = host.root.open_file(&change.path)? {
        let same_size = cache.peek(&sha256).is_none_or(|(_, want)| want == size);
        if have_meta == meta && same_size {
            let (have, _) = hash_reader(&mut file).map_err(|source| FsError::Io {
                op: "read",
                path: change.path.to_string(),
                source,
            })?;
            if have == sha256 {
                return Ok(Diff {
                    mutations: Vec::new(),
                    note: Some(format!("{} has sha256 {}", change.path, short(&sha256))),
                });
            }
        }
    }
    Ok(Diff {
        mutations: vec![Mutation::WriteFrom {
            path: change.path.clone(),
            source: cache.path(&sha256),
            sha256,
            meta,
        }],
        note: Some(format!("from {}", origin(change))),
    })
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
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
