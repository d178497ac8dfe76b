//! Small types every room uses and that depend on nothing of the crate: error kinds, time,
//! file metadata, what this build is. Architecture invariant: `base` imports no other module
//! of the crate.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod addr;
pub mod build;
mod error;
mod file_meta;
pub mod packages;
pub mod pkgversion;
pub mod sha256;
pub mod time;
pub mod units;
mod writeback;
mod writers;

pub use addr::parse_socket_addr;
pub use error::{ErrorInfo, ErrorKind, StepError, chain};
pub use file_meta::{Compared, Existing, FileMeta};
pub use writeback::start_writeback;
pub use writers::open_for_writing;
