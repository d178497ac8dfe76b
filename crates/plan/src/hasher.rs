//! Hashing a plan's long contents while the rest of it is still being read.
//!
//! The plan's digest and its staged files need the sha256 of every `file` content. Hashed
//! after the whole plan was read, a plan of 50 MiB of content waited about 18 ms on two
//! cores for its sums after its last byte arrived. The JSON reader (`plan::json`) instead
//! hands each long `content` string, as soon as it is decoded, to a thread of its own here,
//! which hashes it while the reader goes on with the next one; what is still waiting when
//! the sums are needed (beside staging, when the plan is accepted) is hashed then, beside
//! that thread ([`KnownSums::resolve`]).
//!
//! A sum is tied to its content by the content's memory, which the sums keep alive
//! ([`KnownSums`]): see [`super::ContentSums::of_known`].

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// Contents to hash, by the reader's number for them, and their sums.
#[derive(Default)]
struct Queue {
    todo: VecDeque<(usize, Bytes)>,
    done: Vec<(usize, [u8; 32])>,
    /// No more contents will come; the thread leaves once `todo` is empty.
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hashes contents from the queue until it is empty (and, for the thread, until it is
    /// closed too).
    fn work(&self, wait: bool) {
        let mut q = self.lock();
        loop {
            if let Some((n, bytes)) = q.todo.pop_front() {
                drop(q);
                let sum = <[u8; 32]>::from(Sha256::digest(&bytes));
                drop(bytes);
                q = self.lock();
                q.done.push((n, sum));
            } else if q.closed || !wait {
                return;
            } else {
                q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        }
    }
}

/// A thread hashing contents as they are handed to it; started by the first one.
#[derive(Default)]
pub(super) struct Hasher {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    started: bool,
}

impl Hasher {
    /// Hands content number `n` over to be hashed.
    pub(super) fn push(&mut self, n: usize, content: Bytes) {
        self.shared.lock().todo.push_back((n, content));
        self.shared.ready.notify_one();
        if !self.started {
            self.started = true;
            let shared = self.shared.clone();
            // Without the thread the contents are hashed by `finish`.
            self.thread = std::thread::Builder::new()
                .name("inplace-hash".into())
                .spawn(move || {
                    // The lowest priority: it takes the time the reader, the network and
                    // the client leave, never theirs (on two cores, at the same priority it
                    // slowed the transfer of a 50 MiB plan by more than it saved).
                    // Raising one's nice value needs no privilege; when it fails the
                    // thread hashes at the usual priority.
                    let _ =
                        rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19);
                    shared.work(true)
                })
                .ok();
        }
    }

    /// Drops the contents still waiting whose number `wanted` refuses: they turned out not
    /// to be plain `file` contents, their sums would not be used, and while they wait they
    /// share their memory (the reader, putting them back as text, would copy them).
    pub(super) fn retain(&self, wanted: impl Fn(usize) -> bool) {
        self.shared.lock().todo.retain(|(n, _)| wanted(*n));
    }

    /// The sums of every content handed over, by number: what is still waiting is hashed
    /// here, beside the thread, which is then joined.
    pub(super) fn finish(mut self) -> Vec<(usize, [u8; 32])> {
        self.shared.lock().closed = true;
        self.shared.ready.notify_all();
        self.shared.work(false);
        if let Some(thread) = self.thread.take() {
            // It only hashes: it cannot panic but by running out of memory (an abort).
            let _ = thread.join();
        }
        std::mem::take(&mut self.shared.lock().done)
    }
}

impl Drop for Hasher {
    /// A plan that is not read to its end (a syntax error, a broken upload): the thread
    /// drops what is waiting and leaves after the content it is hashing.
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.closed = true;
        q.todo.clear();
        drop(q);
        self.shared.ready.notify_all();
    }
}

/// The sums of contents hashed while their plan was read, each with the content it is
/// computed from: handed over as the plan is validated, they may still be being hashed
/// ([`KnownSums::resolve`] waits for them). Holding the content keeps its memory from being
/// freed and reused, so a content of the plan at the same address and of the same length is
/// the same bytes (`Bytes` never changes what it holds): [`super::ContentSums::of_known`]
/// takes a sum only on that identity, never on a position in the plan.
#[derive(Default)]
pub struct KnownSums {
    hasher: Option<Hasher>,
    /// The contents whose sums are wanted, by the hasher's number for them.
    contents: Vec<(usize, Bytes)>,
}

impl KnownSums {
    /// The sums of `contents` (by number) that `hasher` was given.
    pub(super) fn new(hasher: Option<Hasher>, contents: Vec<(usize, Bytes)>) -> KnownSums {
        KnownSums { hasher, contents }
    }

    /// How many contents have (or will have) a known sum.
    pub fn len(&self) -> usize {
        self.contents.len()
    }

    /// True when none has.
    pub fn is_empty(&self) -> bool {
        self.contents.is_empty()
    }

    /// Each content with its sum, once hashed (those still waiting are hashed here, beside
    /// the hasher's thread).
    pub(super) fn resolve(self) -> Vec<(Bytes, [u8; 32])> {
        let Some(hasher) = self.hasher else {
            return Vec::new();
        };
        let done: std::collections::HashMap<usize, [u8; 32]> =
            hasher.finish().into_iter().collect();
        self.contents
            .into_iter()
            .filter_map(|(n, bytes)| done.get(&n).map(|sum| (bytes, *sum)))
            .collect()
    }
}

impl std::fmt::Debug for KnownSums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KnownSums({} contents)", self.contents.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(b: &[u8]) -> [u8; 32] {
        Sha256::digest(b).into()
    }

    #[test]
    fn every_content_handed_over_is_hashed_once_by_its_number() {
        let contents: Vec<Bytes> = (0..40)
            .map(|i| Bytes::from(vec![i as u8; 1000 + i * 997]))
            .collect();
        let mut h = Hasher::default();
        for (i, c) in contents.iter().enumerate() {
            h.push(i * 3, c.clone());
        }
        let mut done = h.finish();
        done.sort();
        let want: Vec<_> = contents
            .iter()
            .enumerate()
            .map(|(i, c)| (i * 3, sha(c)))
            .collect();
        assert_eq!(done, want);
    }

    #[test]
    fn nothing_handed_over_starts_no_thread() {
        let h = Hasher::default();
        assert!(h.thread.is_none());
        assert!(h.finish().is_empty());
    }

    #[test]
    fn contents_not_wanted_any_more_are_not_hashed() {
        // No thread (as if it could not be started), so none is taken before `retain`.
        let mut h = Hasher::default();
        h.started = true;
        for i in 0..6 {
            h.push(i, Bytes::from(vec![i as u8; 10]));
        }
        h.retain(|n| n % 2 == 0);
        let mut done = h.finish();
        done.sort();
        let numbers: Vec<usize> = done.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers, vec![0, 2, 4]);
    }

    #[test]
    fn a_hasher_dropped_unfinished_lets_its_thread_go() {
        let mut h = Hasher::default();
        for i in 0..8 {
            h.push(i, Bytes::from(vec![7u8; 1 << 20]));
        }
        let shared = h.shared.clone();
        let thread = h.thread.take().expect("started");
        drop(h);
        thread.join().expect("the thread leaves");
        assert!(shared.lock().todo.is_empty());
    }
}
