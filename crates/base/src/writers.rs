//! Whether a file is open for writing anywhere on the machine.

use std::os::fd::AsFd;

/// `fcntl`'s command that sets the signal a lease break sends (Linux; not in the libc crate).
const F_SETSIG: libc::c_int = 10;

/// Whether some process has `file`'s inode open for writing (or mapped shared and
/// writable), asked the one way Linux answers it: a read lease, which it grants only when
/// no one does, taken on `file` (open read-only) and given back at once. `None` when the
/// kernel cannot say (a file system without leases, leases turned off, or not permitted).
///
/// The answer holds for the moment of the call: a process may open the file for writing
/// right after it.
pub fn open_for_writing(file: &impl AsFd) -> Option<bool> {
    use std::os::fd::AsRawFd;
    let fd = file.as_fd().as_raw_fd();
    // The crate's third `unsafe` (with writeback.rs and host/memory.rs): rustix has no lease
    // calls. SAFETY: a descriptor open for the calls' duration; no memory is passed.
    #[allow(unsafe_code)]
    unsafe {
        // A process opening the file for writing while the lease is held breaks it, and
        // the kernel signals the holder: SIGURG (ignored unless handled; this crate handles
        // it nowhere) instead of the default SIGIO, which would end the agent.
        if libc::fcntl(fd, F_SETSIG, libc::SIGURG) != 0 {
            return None;
        }
        if libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) == 0 {
            libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK);
            return Some(false);
        }
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) => Some(true),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_open_for_writing_is_seen_and_one_closed_is_not() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f");
        std::fs::write(&path, b"content").unwrap();
        let reader = std::fs::File::open(&path).unwrap();
        let Some(open) = open_for_writing(&reader) else {
            // Leases are a kernel and file-system feature; this is what the agent falls
            // back on, and it is not what this test is about.
            eprintln!(
                "SKIPPED: no file leases on the file system of {}",
                t.path().display()
            );
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must have file leases on /tmp"
            );
            return;
        };
        assert!(!open, "nobody writes it");
        let writer = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        assert_eq!(open_for_writing(&reader), Some(true), "open for writing");
        drop(writer);
        assert_eq!(open_for_writing(&reader), Some(false), "closed again");
    }
}
