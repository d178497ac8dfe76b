//! File metadata the agent sets and records (journal pre-images, mutations), and what is
//! at a path when the agent looks.

/// Permission bits and ownership of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileMeta {
    /// Permission bits (`0o7777` mask).
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
}

/// What is at a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Existing {
    /// Nothing.
    Absent,
    /// A regular file.
    File {
        /// Its bytes.
        content: Vec<u8>,
        /// Its mode and owner.
        meta: FileMeta,
    },
    /// Something the agent does not manage (a directory, a device, a socket).
    Other {
        /// What it is.
        kind: &'static str,
    },
}

/// What is at a path, compared with the content a change would write, without holding the
/// file's content (it is read in pieces and the comparison stops at the first difference).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compared {
    /// Nothing.
    Absent,
    /// A regular file.
    File {
        /// Its mode and owner.
        meta: FileMeta,
        /// Its bytes are exactly the expected ones.
        same: bool,
    },
    /// Something the agent does not manage (a directory, a device, a socket).
    Other {
        /// What it is.
        kind: &'static str,
    },
}

impl Compared {
    /// What `existing` is, compared with `expected`.
    pub fn of(existing: &Existing, expected: &[u8]) -> Compared {
        match existing {
            Existing::Absent => Compared::Absent,
            Existing::File { content, meta } => Compared::File {
                meta: *meta,
                same: content == expected,
            },
            Existing::Other { kind } => Compared::Other { kind },
        }
    }
}
