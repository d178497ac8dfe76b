//! The agent's own heap: returned to the kernel after a burst of large requests.
//!
//! **One of the two places of the crate with `unsafe` code** (the other is
//! `base::start_writeback`, one `sync_file_range` call): two calls into glibc's
//! allocator, which have no safe wrapper. glibc serves large allocations with `mmap` and
//! gives them back on `free` — until the first large free raises its mmap threshold
//! (dynamically, up to 32 MiB), after which 16 MiB request buffers come from the heap
//! arenas and stay there: a burst of 64 large requests left the daemon at 93–166 MiB.
//! [`tune`] fixes the thresholds at start (which turns the dynamic adjustment off), so
//! buffers above [`THRESHOLD`] are always mapped and unmapped; [`give_back`] returns what
//! is free in every arena after a burst of large requests and when the engine has finished
//! its work.
//!
//! The threshold is 4 MiB, above the 1 MiB pieces of a streamed plan and the buffers they
//! pass through: at 256 KiB each of those was a fresh mapping, every page of it faulted in
//! and zeroed, then unmapped — about 25 ms of page faults on the receiving thread for a
//! 50 MiB plan. Medians of eight alternating `submit --wait` rounds of that plan over
//! loopback: 221 ms at 256 KiB for both thresholds, 148 ms with a 4 MiB mmap threshold,
//! 128 ms with both at 4 MiB (a trimmed heap top is faulted in again by the next piece).

/// Larger allocations (whole request messages, large contents) are mapped and unmapped,
/// never kept in an arena; free memory at an arena's top above this is trimmed.
const THRESHOLD: i32 = 4 * 1024 * 1024;

/// Fixes the allocator's thresholds; call once at start, before threads are spawned.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: mallopt only changes allocator parameters; it is called with valid option
    // numbers and values and touches no memory of ours.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, THRESHOLD);
    }
}

/// Returns the free memory of every arena to the kernel (after a burst of large requests,
/// and when the engine has no more work).
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: malloc_trim only releases free pages of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
