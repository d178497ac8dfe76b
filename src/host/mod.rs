//! The node: the only module that touches files, processes and services of the machine
//! being updated. Everything here is root-relative (see `fs`).

pub mod command;
pub mod locks;
pub mod pkgversion;
