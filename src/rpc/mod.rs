//! The gRPC wire: generated `inplace.agent.v1` types, mutual TLS, authorization.
//!
//! - [`pb`]: types, client and server trait generated from
//!   `proto/inplace/agent/v1/agent.proto` (the documented contract with the updater).
//! - [`tls`]: TLS 1.3 server config requiring a clientAuth client certificate, reloaded when
//!   its files change; the accept loop that feeds tonic; the client config and `connect`.
//! - [`authz`]: identity from the client certificate, identity → role rules, the per-method
//!   decision and the tower layer enforcing it.
//! - [`codec`]: prost's codec, encoding each message into a buffer reserved for its length.
//! - [`convert`]: a wire plan through the plan-file validator, and the INVALID_ARGUMENT
//!   status for its errors.
//! - [`document`]: `SubmitPlanDocument`'s side of the wire: a plan file's pieces read as
//!   they arrive, and its declared length.
//! - [`server`]: `serve()`, wiring NodeAgent, health and reflection behind the two above,
//!   with the transport limits.
//! - [`pki`]: `pki init`, a throwaway CA for trying the agent out.
//! - [`service`]: the `NodeAgent` implementation over the engine (idempotent apply, watch
//!   streams that never skip a phase, error → status code mapping).
//! - [`status`]: engine statuses and check reports ↔ their wire messages.
//!
//! Architecture invariant: this module never touches the node and never logs request
//! contents (plans may carry bootstrap tokens); denials and handshake failures are logged
//! with identity, method, peer address and a bounded reason only.

/// Code generated from `proto/inplace/agent/v1/agent.proto`; see that file for the contract.
/// The proto comments become these doc comments; they are written for proto readers (Go doc),
/// so rustdoc's HTML and link lints do not apply to them.
#[allow(
    clippy::all,
    clippy::pedantic,
    rustdoc::invalid_html_tags,
    rustdoc::bare_urls,
    rustdoc::broken_intra_doc_links
)]
pub mod pb {
    tonic::include_proto!("inplace.agent.v1");
}

/// Encoded `FileDescriptorSet` of the agent's protos (with imports and comments) for
/// server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("inplace_agent_descriptor");

pub mod authz;
pub(crate) mod budget;
pub(crate) mod codec;
pub mod convert;
pub mod document;
pub(crate) mod identity;
pub mod pki;
pub(crate) mod readahead;
pub(crate) mod replies;
pub mod server;
pub(crate) mod service;
pub mod tls;
