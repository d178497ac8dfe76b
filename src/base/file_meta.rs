//! File metadata the agent sets and records (journal pre-images, mutations).

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
