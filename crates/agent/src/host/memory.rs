//! The agent's own heap: returned to the kernel after a burst of large requests.
//!
//! **One of the two places of the crate with `unsafe` code** (the other is
//! `base::start_writeback`, one `sync_file_range` call): two calls into glibc's
//! allocator, which have no safe wrapper. glibc serves large allocations with `mmap` and
//! gives them back on `free` — until the first large free raises its mmap threshold
//! (dynamically, up to 32 MiB), after which 16 MiB request buffers come from the heap
//! arenas and stay there: a burst of 64 large requests left the daemon at 93–166 MiB.
//! [`tune`] fixes the thresholds at start (which turns the dynamic adjustment off), so
//! buffers above 256 KiB are mapped and unmapped and free memory above that at an arena's
//! top is trimmed; [`give_back`] returns what is free in every arena after a burst of large
//! requests and when the engine has finished its work.
//!
//! While large requests are in flight ([`for_large_requests`]) both thresholds are 4 MiB,
//! above the 1 MiB pieces of a streamed plan and the buffers they pass through: at 256 KiB
//! each of those was a fresh mapping, every page of it faulted in and zeroed, then unmapped
//! — about 25 ms of page faults on the receiving thread for a 50 MiB plan. Medians of eight
//! alternating `submit --wait` rounds of that plan over loopback: 221 ms at 256 KiB for
//! both, 148 ms with a 4 MiB mmap threshold, 128 ms with both at 4 MiB (a trimmed heap top
//! is faulted in again by the next piece). With 4 MiB all the time, an idle `serve` held
//! 2.1 MiB of heap instead of 1.3, and 8.8 MiB in all instead of 7.9 after the status
//! socket's load (the benchmark suite, `benches/`): so only while large requests run.

/// Both thresholds while no large request is in flight.
const IDLE: i32 = 256 * 1024;

/// Both thresholds while large requests are in flight. Whole request messages above it
/// (up to the 16 MiB default limit) are still mapped and unmapped.
const LARGE: i32 = 4 * 1024 * 1024;

/// Fixes the allocator's thresholds; call once at start, before threads are spawned.
pub fn tune() {
    set_thresholds(IDLE);
}

/// Sets the thresholds for large requests in flight (`large`) or none; with none, the free
/// memory is given back. The caller makes the calls one at a time, the last one for the
/// current state.
pub fn for_large_requests(large: bool) {
    if large {
        set_thresholds(LARGE);
    } else {
        set_thresholds(IDLE);
        give_back();
    }
}

fn set_thresholds(bytes: i32) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: mallopt only changes allocator parameters (under the allocator's own lock);
    // it is called with valid option numbers and values and touches no memory of ours.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, bytes);
        libc::mallopt(libc::M_TRIM_THRESHOLD, bytes);
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
