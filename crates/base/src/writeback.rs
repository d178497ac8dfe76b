//! Starting a file's writeback early.

use std::os::fd::AsFd;

/// Starts writing `file`'s dirty pages to the disk without waiting (Linux
/// `sync_file_range(SYNC_FILE_RANGE_WRITE)`), so the `fsync` that later makes it durable
/// mostly finds the work done: a batch's files are written one after the other while the
/// disk works on the earlier ones. Only a hint: the `fsync` is what guarantees durability,
/// and a failure here (a file system without it) changes nothing.
pub fn start_writeback(file: &impl AsFd) {
    use std::os::fd::AsRawFd;
    // The crate's other `unsafe` besides host/memory.rs: no safe wrapper exists (rustix has
    // none). SAFETY: a descriptor open for the call's duration; no memory is passed.
    #[allow(unsafe_code)]
    unsafe {
        libc::sync_file_range(file.as_fd().as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
    }
}
