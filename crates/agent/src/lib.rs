//! inplace-agent: the node-side agent for Cluster API in-place updates.
//!
//! Data flows one way: the plan (`inplace_plan`: model, validation, digest, one file per
//! change kind) → `engine` (state machine, scheduling, rollback) → `steps` (the executor every
//! kind's mutations go through) over `host` (the only code that touches the node), with
//! `journal` beside the engine. The crate graph holds the flow between crates;
//! `architecture.rs` checks the rooms inside this one; see ARCHITECTURE.md.
// Unsafe code only in `host::memory` (two allocator calls), which says why.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cli;
pub mod config;
pub mod engine;
pub(crate) mod failpoint;
pub mod host;
pub mod journal;
pub(crate) mod notify;
pub mod rpc;
pub mod sandbox;
pub mod status;
pub(crate) mod steps;
