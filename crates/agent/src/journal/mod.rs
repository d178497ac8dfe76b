//! The journal: the agent's memory of what it did, durable before it acts.
//!
//! `<state>/journal/journal.log` holds one record a line:
//!
//! ```text
//! <sha256 hex of (previous hash ‖ json)> <json {"seq":N,"ts":MS,"rec":{...}}>\n
//! ```
//!
//! The hash chains every record to the one before it (the first to 32 zero bytes). A line
//! that is incomplete or fails its hash *at the end of the file* is a torn tail from a crash:
//! the writer truncates it and says so. A bad line with valid data after it is corruption:
//! opening refuses, naming the record and byte offset. Records that announce a mutation are
//! fdatasynced before the mutation starts (the write-ahead rule); others are written at once
//! and made durable by the next sync. Compaction rewrites the file atomically when no plan
//! is unfinished, keeping one summary per retained plan. An exclusive `flock` on
//! `<state>/journal/lock` keeps two agents from writing at once.
//!
//! The records (`record.rs`) are the journal's own types, format version
//! [`FORMAT_VERSION`]; the engine converts its state to and from them. The journal depends on
//! neither the engine nor the host: it writes only its own state directory.

pub(crate) mod backup;
pub(crate) mod bodies;
mod record;

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use record::{
    ChangeSummary, CheckSummary, DriftNote, FileBefore, HeldBody, PlanDoc, Preimage, Record,
    RunPhase, StagedBody, SummaryChange, SummaryChangeState, SummaryCheck, SummaryCheckState,
    SummaryCounts, SummaryEvent, SummaryProgress, SummaryStatus, UnitJobOutcome,
};

use crate::failpoint;

/// File name of the journal inside `<state>/journal/`.
pub const JOURNAL_FILE: &str = "journal.log";
const LOCK_FILE: &str = "lock";
const COMPACT_TMP: &str = "journal.log.compact";

/// One decoded record with its position.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Sequence number (never reused, also across compaction).
    pub seq: u64,
    /// Unix ms when written.
    pub ts: u64,
    /// The record.
    pub record: Record,
    /// Byte offset of the line.
    pub offset: u64,
    /// Its chain hash.
    pub hash: [u8; 32],
}

impl Entry {
    /// The chain hash in hex, as written in the file.
    pub fn hash_hex(&self) -> String {
        hex::encode(self.hash)
    }
}

/// Decodes 64 hex digits; `None` on anything else. (A table-free decoder: `hex` builds a
/// string per call, which shows up when replaying a million records.)
fn decode_hash(text: &[u8]) -> Option<[u8; 32]> {
    const INVALID: u8 = 0xff;
    const TABLE: [u8; 256] = {
        let mut t = [INVALID; 256];
        let mut i = 0;
        while i < 10 {
            t[b'0' as usize + i] = i as u8;
            i += 1;
        }
        let mut i = 0;
        while i < 6 {
            t[b'a' as usize + i] = 10 + i as u8;
            t[b'A' as usize + i] = 10 + i as u8;
            i += 1;
        }
        t
    };
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    let mut bad = 0u8;
    for (i, pair) in text.chunks_exact(2).enumerate() {
        let (hi, lo) = (TABLE[pair[0] as usize], TABLE[pair[1] as usize]);
        bad |= (hi | lo) & 0xf0;
        out[i] = (hi << 4) | (lo & 0x0f);
    }
    (bad == 0).then_some(out)
}

/// The journal format this agent writes and reads. A record's envelope names its version
/// only when it is not 1 (`{"v":2,"seq":...}`), so every journal written so far is version
/// 1 without saying so. A format change that an agent of this version would misread bumps
/// it; a reader refuses a record of a newer version wherever it is in the file (its hash
/// checks out, so it is no torn tail to truncate): an older agent must neither guess at nor
/// cut off what a newer one wrote.
pub const FORMAT_VERSION: u32 = 1;

fn is_v1(v: &u32) -> bool {
    *v == 1
}

fn v1() -> u32 {
    1
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    #[serde(skip_serializing_if = "is_v1")]
    v: u32,
    seq: u64,
    ts: u64,
    rec: &'a Record,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    #[serde(default = "v1")]
    v: u32,
    seq: u64,
    ts: u64,
    rec: Record,
}

/// The envelope without its record: what a record this agent cannot decode still tells.
#[derive(Deserialize)]
struct EnvelopeHead {
    #[serde(default = "v1")]
    v: u32,
}

/// Why a line does not read.
enum Bad {
    /// It may be a write cut short by a crash (incomplete, or failing its hash).
    Damaged(String),
    /// Its hash checks out, so it was written whole, but this agent cannot read it.
    Unreadable(String),
}

/// Journal errors.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// An I/O error on the journal.
    #[error("journal {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A record in the middle of the journal is damaged.
    #[error(
        "journal {path} is corrupt at record {seq} (byte offset {offset}): {reason}; \
         refusing to start. Inspect it with `inplace-agent journal --verify`; moving the \
         file aside starts a fresh journal and loses the agent's history"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The expected sequence number of the bad record.
        seq: u64,
        /// Its byte offset.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A record was written whole (its hash checks out) but this agent cannot read it: a
    /// newer journal format, or a record kind it does not know.
    #[error(
        "journal {path}: record {seq} (byte offset {offset}) cannot be read by this agent, \
         which reads journal format v{FORMAT_VERSION}: {reason}; it was written by another \
         version of inplace-agent: run that version or a newer one"
    )]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The sequence number of the record.
        seq: u64,
        /// Its byte offset.
        offset: u64,
        /// What does not read.
        reason: String,
    },
    /// Another process holds the journal.
    #[error(
        "journal {path} is in use by another inplace-agent process{holder}; stop it or use \
         its API instead"
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// " (pid N)" when known.
        holder: String,
    },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A torn tail found (and, by the writer, truncated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// Where the valid part ends.
    pub offset: u64,
    /// How many bytes were cut.
    pub bytes: u64,
}

/// How much of the file the read-ahead thread reads at a time (a line longer than this is
/// read whole). Small under test, so lines cross the pieces' edges everywhere.
#[cfg(not(test))]
const READ_AHEAD: usize = 256 * 1024;
#[cfg(test)]
const READ_AHEAD: usize = 97;

/// Whole lines of a journal file, each checked for its form and against the hash chain by
/// the read-ahead thread while the reader decodes the ones before.
struct Batch {
    bytes: Vec<u8>,
    /// The end (in `bytes`, after its newline) and the hash of each line that chains, in
    /// order from the start of `bytes`.
    lines: Vec<(usize, [u8; 32])>,
    /// What follows the lines.
    after: After,
}

/// What follows the lines of a batch.
enum After {
    /// The next batch.
    More,
    /// The end of the file.
    End,
    /// A line that does not chain: why, its length, and whether nothing follows it.
    Damaged {
        reason: String,
        len: u64,
        at_end: bool,
    },
    /// Reading the file failed.
    Failed(io::Error),
}

/// Checks one line (without its newline) for the form `<hash> <json>` and against the chain
/// after `prev`; returns its hash.
fn chained(prev: &[u8; 32], body: &[u8]) -> Result<[u8; 32], String> {
    if body.len() < 66 || body[64] != b' ' {
        return Err("record is not '<hash> <json>'".to_string());
    }
    let hash = decode_hash(&body[..64]).ok_or_else(|| "bad hash".to_string())?;
    let mut h = Sha256::new();
    h.update(prev);
    h.update(&body[65..]);
    if h.finalize().as_slice() != hash {
        return Err("hash does not match the chain".to_string());
    }
    Ok(hash)
}

/// Appends up to `n` bytes of `file` to `buf` (retrying interrupted reads); false when the
/// file ended first.
fn read_more(file: &mut File, buf: &mut Vec<u8>, n: usize) -> io::Result<bool> {
    buf.reserve(n);
    let got = io::Read::read_to_end(&mut io::Read::take(&mut *file, n as u64), buf)?;
    Ok(got == n)
}

/// The read-ahead thread: reads `file` piece by piece, checks each whole line against the
/// chain and sends the lines on in batches, reusing the batches handed back through
/// `spare`. Stops at the end, at the first line that does not chain, or when the reader is
/// gone.
fn read_ahead(
    mut file: File,
    batches: std::sync::mpsc::SyncSender<Batch>,
    spare: std::sync::mpsc::Receiver<Batch>,
) {
    let mut prev = [0u8; 32];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let mut batch = spare.try_recv().unwrap_or(Batch {
            bytes: Vec::new(),
            lines: Vec::new(),
            after: After::More,
        });
        batch.bytes.clear();
        batch.lines.clear();
        batch.bytes.extend_from_slice(&carry);
        carry.clear();
        // A piece, and more pieces until a line has ended in them or the file has.
        let mut scanned = 0;
        let mut more = true;
        let filled = loop {
            // Up to a piece's length, or a whole piece more for a line longer than that.
            let want = match READ_AHEAD.checked_sub(batch.bytes.len()) {
                Some(rest) if rest > 0 => rest,
                _ => READ_AHEAD,
            };
            match read_more(&mut file, &mut batch.bytes, want) {
                Ok(m) => more = m,
                Err(e) => break Err(e),
            }
            if !more || memchr::memchr(b'\n', &batch.bytes[scanned..]).is_some() {
                break Ok(());
            }
            scanned = batch.bytes.len();
        };
        batch.after = match filled {
            Err(e) => After::Failed(e),
            Ok(()) => check_lines(&mut file, &mut batch, &mut prev, more, &mut carry),
        };
        let last = !matches!(batch.after, After::More);
        if batches.send(batch).is_err() || last {
            return;
        }
    }
}

/// Checks the whole lines of `batch` against the chain after `prev`, keeping the bytes
/// after the last whole line in `carry` (`more`: the file may go on); says what follows.
fn check_lines(
    file: &mut File,
    batch: &mut Batch,
    prev: &mut [u8; 32],
    more: bool,
    carry: &mut Vec<u8>,
) -> After {
    let mut start = 0;
    while let Some(at) = memchr::memchr(b'\n', &batch.bytes[start..]) {
        let end = start + at + 1;
        match chained(prev, &batch.bytes[start..end - 1]) {
            Ok(hash) => {
                batch.lines.push((end, hash));
                *prev = hash;
                start = end;
            }
            Err(reason) => {
                let at_end = if end < batch.bytes.len() {
                    false
                } else if !more {
                    true
                } else {
                    match read_more(file, &mut batch.bytes, 1) {
                        Ok(more) => !more,
                        Err(e) => return After::Failed(e),
                    }
                };
                return After::Damaged {
                    reason,
                    len: (end - start) as u64,
                    at_end,
                };
            }
        }
    }
    if start == batch.bytes.len() && !more {
        return After::End;
    }
    if !more {
        return After::Damaged {
            reason: "record is incomplete (no end of line)".to_string(),
            len: (batch.bytes.len() - start) as u64,
            at_end: true,
        };
    }
    carry.extend_from_slice(&batch.bytes[start..]);
    batch.bytes.truncate(start);
    After::More
}

/// Streams and verifies the records of a journal file. A thread of its own reads ahead and
/// checks the hash chain; the reader decodes each record (sequence number, format version)
/// in order, so what it yields, and where it stops, is the same as reading line by line.
pub struct Reader {
    path: PathBuf,
    batches: std::sync::mpsc::Receiver<Batch>,
    spare: std::sync::mpsc::SyncSender<Batch>,
    /// The batch being read, the index of its next line and where that line starts.
    current: Option<Batch>,
    next_line: usize,
    line_start: usize,
    offset: u64,
    prev: [u8; 32],
    next_seq: Option<u64>,
    /// Set when reading stopped at a torn tail.
    pub torn: Option<TornTail>,
    done: bool,
}

impl Reader {
    /// Opens a journal file for reading; a missing file reads as empty.
    pub fn open(path: &Path) -> Result<Option<Reader>, JournalError> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_at(path)(e)),
        };
        // Three batches at most: one the reader holds, one waiting in the channel, one being
        // read. The thread reads a little ahead, not the whole file.
        let (send, batches) = std::sync::mpsc::sync_channel(1);
        let (spare, spares) = std::sync::mpsc::sync_channel(2);
        std::thread::Builder::new()
            .name("inplace-journal".into())
            .spawn(move || read_ahead(file, send, spares))
            .map_err(io_at(path))?;
        Ok(Some(Reader {
            path: path.to_path_buf(),
            batches,
            spare,
            current: None,
            next_line: 0,
            line_start: 0,
            offset: 0,
            prev: [0; 32],
            next_seq: None,
            torn: None,
            done: false,
        }))
    }

    /// Hash of the last good record (zeros before the first).
    pub fn last_hash(&self) -> [u8; 32] {
        self.prev
    }

    /// The sequence number the next record must have.
    pub fn next_seq(&self) -> u64 {
        self.next_seq.unwrap_or(1)
    }

    /// Byte length of the valid part read so far.
    pub fn valid_len(&self) -> u64 {
        self.offset
    }

    /// Decodes a line's JSON (its hash already checked).
    fn decode(&self, json: &[u8]) -> Result<EnvelopeIn, Bad> {
        let env: EnvelopeIn = serde_json::from_slice(json).map_err(|e| {
            Bad::Unreadable(match serde_json::from_slice::<EnvelopeHead>(json) {
                Ok(head) if head.v > FORMAT_VERSION => {
                    format!("it is journal format v{}", head.v)
                }
                _ => format!("undecodable record: {e}"),
            })
        })?;
        if env.v > FORMAT_VERSION {
            return Err(Bad::Unreadable(format!("it is journal format v{}", env.v)));
        }
        if let Some(want) = self.next_seq
            && env.seq != want
        {
            return Err(Bad::Damaged(format!(
                "sequence number {} where {want} was expected",
                env.seq
            )));
        }
        Ok(env)
    }

    /// Whether nothing follows the line just read.
    fn at_end(&mut self) -> Result<bool, io::Error> {
        let Some(batch) = &self.current else {
            return Ok(false);
        };
        if self.next_line < batch.lines.len() {
            return Ok(false);
        }
        match &batch.after {
            After::End => Ok(true),
            After::Damaged { .. } => Ok(false),
            After::Failed(e) => Err(io::Error::new(e.kind(), e.to_string())),
            After::More => match self.batches.recv() {
                Ok(next) => Ok(next.lines.is_empty() && matches!(next.after, After::End)),
                Err(_) => Err(gone()),
            },
        }
    }

    /// What a line that does not read means: a torn tail when nothing follows it, else
    /// corruption.
    fn damaged(
        &mut self,
        reason: String,
        len: u64,
        at_end: bool,
    ) -> Option<Result<Entry, JournalError>> {
        self.done = true;
        if at_end {
            self.torn = Some(TornTail {
                offset: self.offset,
                bytes: len,
            });
            None
        } else {
            Some(Err(JournalError::Corrupt {
                path: self.path.clone(),
                seq: self.next_seq(),
                offset: self.offset,
                reason,
            }))
        }
    }
}

/// The read-ahead thread ended without saying why (it panicked).
fn gone() -> io::Error {
    io::Error::other("the journal's read-ahead thread stopped")
}

impl Iterator for Reader {
    type Item = Result<Entry, JournalError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.done {
                return None;
            }
            let Some(batch) = &self.current else {
                match self.batches.recv() {
                    Ok(b) => {
                        self.current = Some(b);
                        self.next_line = 0;
                        self.line_start = 0;
                        continue;
                    }
                    Err(_) => {
                        self.done = true;
                        return Some(Err(io_at(&self.path)(gone())));
                    }
                }
            };
            let Some(&(end, hash)) = batch.lines.get(self.next_line) else {
                let batch = self.current.take().expect("a current batch");
                match batch.after {
                    After::More => {
                        let _ = self.spare.try_send(batch);
                        continue;
                    }
                    After::End => {
                        self.done = true;
                        return None;
                    }
                    After::Damaged {
                        reason,
                        len,
                        at_end,
                    } => return self.damaged(reason, len, at_end),
                    After::Failed(e) => {
                        self.done = true;
                        return Some(Err(io_at(&self.path)(e)));
                    }
                }
            };
            let start = self.line_start;
            let n = (end - start) as u64;
            // The line without its hash, the space and the newline.
            let result = self.decode(&batch.bytes[start + 65..end - 1]);
            self.next_line += 1;
            self.line_start = end;
            return match result {
                Ok(env) => {
                    let entry = Entry {
                        seq: env.seq,
                        ts: env.ts,
                        record: env.rec,
                        offset: self.offset,
                        hash,
                    };
                    self.offset += n;
                    self.prev = hash;
                    self.next_seq = Some(env.seq + 1);
                    Some(Ok(entry))
                }
                Err(Bad::Unreadable(reason)) => {
                    self.done = true;
                    Some(Err(JournalError::Unreadable {
                        path: self.path.clone(),
                        seq: self.next_seq(),
                        offset: self.offset,
                        reason,
                    }))
                }
                Err(Bad::Damaged(reason)) => match self.at_end() {
                    Ok(at_end) => self.damaged(reason, n, at_end),
                    Err(e) => {
                        self.done = true;
                        Some(Err(io_at(&self.path)(e)))
                    }
                },
            };
        }
    }
}

/// The journal writer: exclusive, append-only, chained.
pub struct Journal {
    dir: PathBuf,
    path: PathBuf,
    file: File,
    _lock: File,
    next_seq: u64,
    last_hash: [u8; 32],
    size: u64,
    /// Bytes the last compaction left at the head of the file (its `Compacted` record and
    /// the summaries after it); 0 for a journal never compacted.
    compacted_len: u64,
    records: u64,
    line: Vec<u8>,
}

/// What opening the journal found.
#[derive(Debug, Default)]
pub struct OpenReport {
    /// A torn tail that was truncated.
    pub torn: Option<TornTail>,
    /// Records replayed.
    pub records: u64,
}

impl Journal {
    /// Opens (creating) `<state_dir>/journal/`, takes the lock, replays every record through
    /// `replay`, truncates a torn tail, and refuses on corruption.
    pub fn open(
        state_dir: &Path,
        mut replay: impl FnMut(Entry),
    ) -> Result<(Journal, OpenReport), JournalError> {
        let dir = state_dir.join("journal");
        create_private_dir(&dir).map_err(io_at(&dir))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(io_at(&lock_path))?;
        // A lock can look taken for an instant without another agent: a process forked by
        // this one (a gate's command) holds inherited descriptors until it execs. Only a
        // lock that stays taken is another agent.
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let locked = loop {
            match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Err(rustix::io::Errno::WOULDBLOCK) if std::time::Instant::now() < give_up => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                other => break other,
            }
        };
        match locked {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let holder = std::fs::read_to_string(&lock_path)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok())
                    .map(|pid| format!(" (pid {pid})"))
                    .unwrap_or_default();
                return Err(JournalError::Locked {
                    path: lock_path,
                    holder,
                });
            }
            Err(e) => return Err(io_at(&lock_path)(e.into())),
        }
        let mut lock = lock;
        lock.set_len(0).map_err(io_at(&lock_path))?;
        write!(lock, "{}", std::process::id()).map_err(io_at(&lock_path))?;

        let _ = std::fs::remove_file(dir.join(COMPACT_TMP));
        let path = dir.join(JOURNAL_FILE);
        let existed = path.exists();
        let mut report = OpenReport::default();
        let mut compacted_len = 0;
        let (next_seq, last_hash, valid_len) = match Reader::open(&path)? {
            None => (1, [0; 32], 0),
            Some(mut reader) => {
                // The head a compaction wrote: a `Compacted` record first, then summaries.
                let mut in_head = true;
                while let Some(entry) = reader.next() {
                    let entry = entry?;
                    in_head &= match entry.record {
                        Record::Compacted { .. } => report.records == 0,
                        Record::Summary { .. } => report.records > 0,
                        _ => false,
                    };
                    if in_head {
                        compacted_len = reader.valid_len();
                    }
                    replay(entry);
                    report.records += 1;
                }
                report.torn = reader.torn.clone();
                (reader.next_seq(), reader.last_hash(), reader.valid_len())
            }
        };
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)
            .map_err(io_at(&path))?;
        let mut file = file;
        if report.torn.is_some() {
            file.set_len(valid_len).map_err(io_at(&path))?;
            rustix::fs::fsync(&file).map_err(|e| io_at(&path)(e.into()))?;
        }
        file.seek(SeekFrom::End(0)).map_err(io_at(&path))?;
        if !existed {
            // A new journal file must survive a crash together with its first records.
            sync_dir(&dir).map_err(io_at(&dir))?;
        }
        Ok((
            Journal {
                dir,
                path,
                file,
                _lock: lock,
                next_seq,
                last_hash,
                size: valid_len,
                compacted_len,
                records: report.records,
                line: Vec::with_capacity(1024),
            },
            report,
        ))
    }

    /// Appends a record; with `sync` it is durable (fdatasync) before this returns.
    /// Returns the entry as written.
    pub fn append(&mut self, ts: u64, record: Record, sync: bool) -> Result<Entry, JournalError> {
        failpoint::hit("journal.append.before");
        let seq = self.next_seq;
        let json = serde_json::to_vec(&EnvelopeOut {
            v: FORMAT_VERSION,
            seq,
            ts,
            rec: &record,
        })
        .map_err(|e| io_at(&self.path)(io::Error::other(e)))?;
        let mut h = Sha256::new();
        h.update(self.last_hash);
        h.update(&json);
        let hash: [u8; 32] = h.finalize().into();
        self.line.clear();
        self.line.extend_from_slice(hex::encode(hash).as_bytes());
        self.line.push(b' ');
        self.line.extend_from_slice(&json);
        self.line.push(b'\n');
        if let Err(e) = self.file.write_all(&self.line) {
            // Leave no partial line behind: the file is append-only, cut it back.
            let _ = self.file.set_len(self.size);
            return Err(io_at(&self.path)(e));
        }
        if sync {
            rustix::fs::fdatasync(&self.file).map_err(|e| io_at(&self.path)(e.into()))?;
        }
        let entry = Entry {
            seq,
            ts,
            record,
            offset: self.size,
            hash,
        };
        self.size += self.line.len() as u64;
        self.next_seq += 1;
        self.records += 1;
        self.last_hash = hash;
        failpoint::hit("journal.append.after");
        Ok(entry)
    }

    /// Makes everything appended so far durable.
    pub fn sync(&mut self) -> Result<(), JournalError> {
        rustix::fs::fdatasync(&self.file).map_err(|e| io_at(&self.path)(e.into()))
    }

    /// Bytes in the journal file.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes the last compaction left at the head of the file: what compacting again would
    /// write at least (0 for a journal never compacted).
    pub fn compacted_len(&self) -> u64 {
        self.compacted_len
    }

    /// Records in the journal file.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Sequence number of the last record written (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.next_seq.saturating_sub(1)
    }

    /// The journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the journal with `records` (a fresh chain starting with a `Compacted`
    /// record), atomically: the old file stays whole until the rename.
    pub fn compact(&mut self, ts: u64, records: Vec<Record>) -> Result<(), JournalError> {
        let tmp = self.dir.join(COMPACT_TMP);
        let mut out = Vec::with_capacity(64 * 1024);
        let mut prev = [0u8; 32];
        let mut seq = self.next_seq;
        let anchor = Record::Compacted {
            previous_hash: hex::encode(self.last_hash),
            previous_seq: self.next_seq.saturating_sub(1),
        };
        let count = records.len() as u64 + 1;
        for rec in std::iter::once(anchor).chain(records) {
            let json = serde_json::to_vec(&EnvelopeOut {
                v: FORMAT_VERSION,
                seq,
                ts,
                rec: &rec,
            })
            .map_err(|e| io_at(&tmp)(io::Error::other(e)))?;
            let mut h = Sha256::new();
            h.update(prev);
            h.update(&json);
            prev = h.finalize().into();
            out.extend_from_slice(hex::encode(prev).as_bytes());
            out.push(b' ');
            out.extend_from_slice(&json);
            out.push(b'\n');
            seq += 1;
        }
        let write = || -> io::Result<File> {
            let mut f = OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .open(&tmp)?;
            f.write_all(&out)?;
            rustix::fs::fsync(&f)?;
            drop(f);
            failpoint::hit("journal.compact.before_rename");
            std::fs::rename(&tmp, &self.path)?;
            sync_dir(&self.dir)?;
            OpenOptions::new().append(true).read(true).open(&self.path)
        };
        let file = match write() {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(io_at(&self.path)(e));
            }
        };
        self.file = file;
        self.size = out.len() as u64;
        self.compacted_len = self.size;
        self.records = count;
        self.next_seq = seq;
        self.last_hash = prev;
        Ok(())
    }
}

/// fsyncs a directory of the state directory (a new or renamed entry in it is durable).
fn sync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}

/// Creates a directory (and parents) readable only by its owner.
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Result of `journal --verify`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyReport {
    /// The file.
    pub path: PathBuf,
    /// Records whose hash chain checked out.
    pub records: u64,
    /// First and last sequence numbers.
    pub first_seq: Option<u64>,
    /// Last sequence number.
    pub last_seq: Option<u64>,
    /// A torn tail (what a start would truncate).
    pub torn_tail_bytes: Option<u64>,
    /// Backups referenced by unfinished plans that are missing or damaged.
    pub bad_backups: Vec<String>,
}

/// The journal file of a state directory: `<state_dir>/journal/journal.log`.
pub fn file_path(state_dir: &Path) -> PathBuf {
    state_dir.join("journal").join(JOURNAL_FILE)
}

/// Reads the whole journal without modifying it, checking the chain; stops with the error at
/// a corrupt record.
pub fn verify(state_dir: &Path) -> Result<VerifyReport, JournalError> {
    let path = file_path(state_dir);
    let mut report = VerifyReport {
        path: path.clone(),
        records: 0,
        first_seq: None,
        last_seq: None,
        torn_tail_bytes: None,
        bad_backups: Vec::new(),
    };
    let Some(mut reader) = Reader::open(&path)? else {
        return Ok(report);
    };
    let store = backup::BackupStore::at(state_dir);
    let mut referenced: Vec<String> = Vec::new();
    for entry in reader.by_ref() {
        let entry = entry?;
        report.records += 1;
        report.first_seq.get_or_insert(entry.seq);
        report.last_seq = Some(entry.seq);
        if let Record::PlanAccepted {
            bodies: Some(sha), ..
        } = &entry.record
        {
            referenced.push(sha.clone());
        }
        if let Record::StepStarted { preimages, .. } = &entry.record {
            for p in preimages {
                if let Preimage::File {
                    before: FileBefore::Present { sha256, .. },
                    ..
                } = p
                {
                    referenced.push(sha256.clone());
                }
            }
        }
    }
    report.torn_tail_bytes = reader.torn.map(|t| t.bytes);
    referenced.sort();
    referenced.dedup();
    for sha in referenced {
        if !store.check(&sha) {
            report.bad_backups.push(sha);
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(run: u64) -> Record {
        Record::Phase {
            run,
            phase: RunPhase::Applying,
            error: None,
        }
    }

    fn replay_all(dir: &Path) -> (Vec<Entry>, OpenReport) {
        let mut seen = Vec::new();
        let (_j, report) = Journal::open(dir, |e| seen.push(e)).unwrap();
        (seen, report)
    }

    #[test]
    fn appends_and_replays_in_order() {
        let t = tempfile::tempdir().unwrap();
        {
            let (mut j, report) = Journal::open(t.path(), |_| {}).unwrap();
            assert_eq!(report.records, 0);
            for i in 0..5 {
                j.append(1000 + i, rec(i), i % 2 == 0).unwrap();
            }
        }
        let (seen, report) = replay_all(t.path());
        assert!(report.torn.is_none());
        assert_eq!(seen.len(), 5);
        assert_eq!(
            seen.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
        assert_eq!(seen[3].record, rec(3));
        assert_eq!(seen[3].ts, 1003);
    }

    #[test]
    fn second_writer_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let (_j, _) = Journal::open(t.path(), |_| {}).unwrap();
        let err = Journal::open(t.path(), |_| {}).err().unwrap();
        assert!(
            err.to_string()
                .contains(&format!("(pid {})", std::process::id())),
            "{err}"
        );
    }

    #[test]
    fn torn_tail_at_every_offset_is_truncated() {
        let t = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            for i in 0..3 {
                j.append(0, rec(i), true).unwrap();
            }
        }
        let path = t.path().join("journal").join(JOURNAL_FILE);
        let full = std::fs::read(&path).unwrap();
        let last_start = full[..full.len() - 1]
            .iter()
            .rposition(|b| *b == b'\n')
            .unwrap()
            + 1;
        for cut in last_start..full.len() {
            std::fs::write(&path, &full[..cut]).unwrap();
            let (seen, report) = replay_all(t.path());
            assert_eq!(seen.len(), 2, "cut at {cut}");
            if cut > last_start {
                assert_eq!(report.torn.as_ref().unwrap().offset, last_start as u64);
            }
            assert_eq!(std::fs::metadata(&path).unwrap().len(), last_start as u64);
            // And it can be appended to again, continuing the chain.
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            j.append(0, rec(9), true).unwrap();
            drop(j);
            let (seen, _) = replay_all(t.path());
            assert_eq!(seen.len(), 3);
            assert_eq!(seen[2].seq, 3);
        }
    }

    #[test]
    fn corruption_in_the_middle_is_refused_with_the_record() {
        let t = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            for i in 0..4 {
                j.append(0, rec(i), false).unwrap();
            }
        }
        let path = t.path().join("journal").join(JOURNAL_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let second = bytes.iter().position(|b| *b == b'\n').unwrap() + 1;
        let pos = second + 80;
        bytes[pos] = if bytes[pos] == b'7' { b'8' } else { b'7' };
        std::fs::write(&path, &bytes).unwrap();
        let err = Journal::open(t.path(), |_| {}).err().unwrap();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("corrupt at record 2 (byte offset {second})")),
            "{msg}"
        );
        assert!(verify(t.path()).is_err());
    }

    #[test]
    fn the_compacted_head_is_measured_when_written_and_found_again_when_opened() {
        let t = tempfile::tempdir().unwrap();
        let head = {
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            for i in 0..10 {
                j.append(0, rec(i), false).unwrap();
            }
            assert_eq!(j.compacted_len(), 0, "never compacted");
            j.compact(5, vec![rec(42)]).unwrap();
            let head = j.compacted_len();
            assert_eq!(head, j.size());
            j.append(6, rec(43), true).unwrap();
            assert_eq!(j.compacted_len(), head);
            assert!(j.size() > head);
            head
        };
        // `rec` is no summary: the head is the `Compacted` record alone.
        let (j, _) = Journal::open(t.path(), |_| {}).unwrap();
        let first_line = std::fs::read(file_path(t.path())).unwrap();
        let first = first_line.iter().position(|&b| b == b'\n').unwrap() as u64 + 1;
        assert_eq!(j.compacted_len(), first);
        assert!(first < head);
    }

    #[test]
    fn compaction_keeps_sequence_numbers_monotonic() {
        let t = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            for i in 0..10 {
                j.append(0, rec(i), false).unwrap();
            }
            j.compact(5, vec![rec(42)]).unwrap();
            assert_eq!(j.records(), 2);
            j.append(6, rec(43), true).unwrap();
        }
        let (seen, _) = replay_all(t.path());
        assert_eq!(seen.len(), 3);
        assert!(matches!(
            seen[0].record,
            Record::Compacted {
                previous_seq: 10,
                ..
            }
        ));
        assert_eq!(seen.iter().map(|e| e.seq).collect::<Vec<_>>(), [11, 12, 13]);
        let report = verify(t.path()).unwrap();
        assert_eq!(report.records, 3);
    }
}

#[cfg(test)]
mod format_tests {
    use super::*;

    const GOLDEN: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/golden-journal/state/journal/journal.log"
    );

    /// The journal's own types read every record the release of the golden journal wrote
    /// and write it back byte for byte: the exact spellings of the format, version 1.
    #[test]
    fn golden_records_re_encode_byte_for_byte() {
        let text = std::fs::read_to_string(GOLDEN).unwrap();
        let mut kinds = std::collections::BTreeSet::new();
        for line in text.lines() {
            let json = &line[65..];
            let env: EnvelopeIn = serde_json::from_str(json).unwrap();
            assert_eq!(env.v, 1, "no version written means version 1");
            kinds.insert(env.rec.name());
            let again = serde_json::to_string(&EnvelopeOut {
                v: FORMAT_VERSION,
                seq: env.seq,
                ts: env.ts,
                rec: &env.rec,
            })
            .unwrap();
            assert_eq!(again, json);
        }
        for kind in [
            "compacted",
            "summary",
            "planAccepted",
            "phase",
            "stepStarted",
        ] {
            assert!(kinds.contains(kind), "{kind} not in the fixture: {kinds:?}");
        }
    }

    /// Appends a line whose hash fits the chain, with any JSON.
    fn append_raw(dir: &Path, json: &str) {
        let path = file_path(dir);
        let mut last = [0u8; 32];
        if let Some(reader) = Reader::open(&path).unwrap() {
            for e in reader {
                last = e.unwrap().hash;
            }
        }
        let mut h = Sha256::new();
        h.update(last);
        h.update(json.as_bytes());
        let line = format!("{} {json}\n", hex::encode(h.finalize()));
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(line.as_bytes()).unwrap();
    }

    /// The reader reads ahead in pieces (97 bytes under test) on a thread of its own. Whatever
    /// the lines' lengths against the pieces' edges, a bad line (its hash does not chain, or
    /// it chains with the wrong sequence number) is a torn tail when it is the file's last,
    /// and corruption when more follows it; the records before it are all read.
    #[test]
    fn a_bad_last_line_is_told_from_a_bad_middle_line_wherever_the_pieces_end() {
        for pad in 0..2 * READ_AHEAD {
            for (seq, broken_hash) in [(9, false), (2, true)] {
                for followed in [false, true] {
                    let case = format!("pad {pad}, seq {seq}, followed {followed}");
                    let t = tempfile::tempdir().unwrap();
                    {
                        let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
                        let set = Record::SetMembers {
                            set: "x".into(),
                            paths: Vec::new(),
                        };
                        j.append(1, set, true).unwrap();
                    }
                    let path = file_path(t.path());
                    let good_len = std::fs::metadata(&path).unwrap().len();
                    // White space inside the JSON moves the line's end across the pieces'
                    // edges.
                    let json = format!(
                        r#"{{"seq":{seq},"ts":5,{}"rec":{{"phase":{{"run":1,"phase":"Applying"}}}}}}"#,
                        " ".repeat(pad)
                    );
                    append_raw(t.path(), &json);
                    if broken_hash {
                        let mut bytes = std::fs::read(&path).unwrap();
                        let at = bytes.len() - 4;
                        bytes[at] ^= 1;
                        std::fs::write(&path, bytes).unwrap();
                    }
                    if followed {
                        append_raw(
                            t.path(),
                            r#"{"seq":3,"ts":5,"rec":{"phase":{"run":1,"phase":"Applying"}}}"#,
                        );
                    }
                    let mut seen = 0;
                    let opened = Journal::open(t.path(), |_| seen += 1);
                    assert_eq!(seen, 1, "{case}");
                    match opened {
                        Ok((_, report)) => {
                            assert!(!followed, "{case}: a bad line in the middle was cut off");
                            assert_eq!(report.torn.unwrap().offset, good_len, "{case}");
                            assert_eq!(std::fs::metadata(&path).unwrap().len(), good_len);
                        }
                        Err(e) => {
                            assert!(followed, "{case}: a torn tail was refused: {e}");
                            assert!(
                                matches!(&e, JournalError::Corrupt { seq: 2, offset, .. } if *offset == good_len),
                                "{case}: {e}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Lines much longer than a piece, and many of them, read back whole and in order; a
    /// reader can be dropped halfway.
    #[test]
    fn long_lines_and_many_batches_read_back_in_order() {
        let t = tempfile::tempdir().unwrap();
        let records: Vec<Record> = (0..200)
            .map(|i| Record::SetMembers {
                set: format!("s{i}-{}", "y".repeat((i * 37) % (READ_AHEAD * 40))),
                paths: Vec::new(),
            })
            .collect();
        {
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            for r in &records {
                j.append(7, r.clone(), false).unwrap();
            }
        }
        let path = file_path(t.path());
        let mut reader = Reader::open(&path).unwrap().unwrap();
        let read: Vec<Record> = reader.by_ref().map(|e| e.unwrap().record).collect();
        assert_eq!(read, records);
        assert!(reader.torn.is_none());
        assert_eq!(reader.valid_len(), std::fs::metadata(&path).unwrap().len());
        assert_eq!(reader.next_seq(), 201);
        let mut partial = Reader::open(&path).unwrap().unwrap();
        assert_eq!(partial.next().unwrap().unwrap().seq, 1);
        drop(partial);
    }

    /// A record written whole by a newer agent (its hash checks out) is refused wherever it
    /// is, naming it, and the file is left as it is: it is not a torn tail to cut off.
    #[test]
    fn records_of_a_newer_format_or_kind_are_refused_not_truncated() {
        for (json, says) in [
            (
                r#"{"v":2,"seq":3,"ts":5,"rec":{"phase":{"run":1,"phase":"Applying"}}}"#,
                "it is journal format v2",
            ),
            (
                r#"{"v":2,"seq":3,"ts":5,"rec":{"teleported":{"run":1}}}"#,
                "it is journal format v2",
            ),
            (
                r#"{"seq":3,"ts":5,"rec":{"teleported":{"run":1}}}"#,
                "undecodable record",
            ),
        ] {
            let t = tempfile::tempdir().unwrap();
            {
                let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
                j.append(
                    1,
                    Record::SetMembers {
                        set: "s".into(),
                        paths: Vec::new(),
                    },
                    true,
                )
                .unwrap();
                j.append(
                    2,
                    Record::SetMembers {
                        set: "t".into(),
                        paths: Vec::new(),
                    },
                    true,
                )
                .unwrap();
            }
            append_raw(t.path(), json);
            let before = std::fs::read(file_path(t.path())).unwrap();
            let err = Journal::open(t.path(), |_| {}).err().expect("refused");
            let msg = err.to_string();
            assert!(
                matches!(err, JournalError::Unreadable { seq: 3, .. }),
                "{msg}"
            );
            assert!(msg.contains(says), "{msg}");
            assert!(msg.contains("reads journal format v1"), "{msg}");
            assert_eq!(std::fs::read(file_path(t.path())).unwrap(), before);
            assert!(verify(t.path()).is_err());
        }
    }

    /// What this agent writes names no version (version 1, as every journal so far), and
    /// reads back.
    #[test]
    fn records_are_written_as_version_1_without_saying_so() {
        let t = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            j.append(
                7,
                Record::Phase {
                    run: 1,
                    phase: RunPhase::Verifying,
                    error: None,
                },
                true,
            )
            .unwrap();
        }
        let text = std::fs::read_to_string(file_path(t.path())).unwrap();
        assert!(
            text.ends_with(
                " {\"seq\":1,\"ts\":7,\"rec\":{\"phase\":{\"run\":1,\"phase\":\"Verifying\"}}}\n"
            ),
            "{text}"
        );
        let mut seen = Vec::new();
        Journal::open(t.path(), |e| seen.push(e.record)).unwrap();
        assert_eq!(
            seen,
            [Record::Phase {
                run: 1,
                phase: RunPhase::Verifying,
                error: None
            }]
        );
    }
}
