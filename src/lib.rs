//! inplace-agent: the node-side agent for Cluster API in-place updates.
//!
//! Data flows one way: `plan` (model, validation, digest, and one file per change kind) →
//! `engine` (state machine, scheduling, rollback) → `steps` (the executor every kind's
//! mutations go through) over `host` (the only code that touches the node), with `journal`
//! beside the engine. `architecture.rs` checks it; see ARCHITECTURE.md.
// Unsafe code only in `host::memory` (two allocator calls), which says why.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(test)]
mod architecture;
pub mod base;
pub mod cli;
pub mod config;
pub mod engine;
pub(crate) mod failpoint;
pub mod host;
pub mod journal;
pub(crate) mod notify;
pub mod plan;
pub mod rpc;
pub mod sandbox;
pub mod status;
pub(crate) mod steps;
pub mod updater;
