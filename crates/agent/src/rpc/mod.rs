//! The agent's side of the gRPC API (the wire itself, TLS and identity are `inplace_api`).
//!
//! - [`server`]: `serve()`, wiring NodeAgent, health and reflection behind TLS and
//!   authorization, with the transport limits.
//! - [`service`]: the `NodeAgent` implementation over the engine (idempotent apply, watch
//!   streams that never skip a phase, error → status code mapping).
//! - [`replies`]: engine statuses and check reports ↔ their wire messages.
//! - [`budget`]: request bytes held at once across all connections, bounded before bodies
//!   are read.
//!
//! Architecture invariant: this module never touches the node and never logs request
//! contents (plans may carry bootstrap tokens).

pub(crate) mod budget;
pub mod replies;
pub mod server;
pub(crate) mod service;
