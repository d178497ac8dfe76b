//! The agent's own heap: returned to the kernel after a burst of large requests.
//!
//! **One of the two places of the crate with `unsafe` code** (the other is
//! `base::start_writeback`, one `sync_file_range` call): two calls into glibc's
//! allocator, which have no safe wrapper. glibc serves large allocations with `mmap` and
//! gives them back on `free` — until the first large free raises its mmap threshold
//! (dynamically, up to 32 MiB), after which 16 MiB request buffers come from the heap
//! arenas and stay there: a burst of 64 large requests left the daemon at 93–166 MiB.
//! [`tune`] fixes the thresholds at start (which turns the dynamic adjustment off), so large
//! buffers are always mapped and unmapped; [`give_back`] returns what is free in every arena
//! after a burst. Both are no-ops on other C libraries.

/// Large allocations (request buffers, plan contents) are mapped and unmapped, never kept
/// in an arena; free memory at an arena's top above this is trimmed.
const THRESHOLD: i32 = 256 * 1024;

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

/// Returns the free memory of every arena to the kernel (after a burst of large requests).
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: malloc_trim only releases free pages of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
