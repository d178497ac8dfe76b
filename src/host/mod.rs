//! The node: the only module that touches files, processes and services of the machine
//! being updated. Everything here is root-relative (see `fs`).

pub mod apt;
pub mod command;
pub mod dnf;
pub mod download;
pub mod locks;
pub mod packages;
pub mod pkgversion;
