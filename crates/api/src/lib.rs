//! inplace-api: the node agent's gRPC wire, used by both programs: the generated
//! `inplace.agent.v1` types, plan conversions, mutual TLS, identity and authorization.
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
//! - [`pki`]: `pki init`, a throwaway CA for trying the agent out.
//!
//! The agent's server side (the `NodeAgent` service over its engine, the request budget, the
//! status replies) is the agent crate's `rpc` module; this crate knows no engine.
//!
//! Architecture invariant: this crate never touches the node and never logs request
//! contents (plans may carry bootstrap tokens); denials and handshake failures are logged
//! with identity, method, peer address and a bounded reason only.
#![deny(unsafe_code)]
#![warn(missing_docs)]

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
pub mod bounded;
pub mod codec;
pub mod convert;
pub mod document;
pub mod identity;
pub mod pki;
pub mod readahead;
pub mod tls;
