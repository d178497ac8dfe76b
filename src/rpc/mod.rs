//! The gRPC wire: generated `inplace.agent.v1` types, mutual TLS, authorization.

/// Code generated from `proto/inplace/agent/v1/agent.proto`; see that file for the contract.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("inplace.agent.v1");
}

/// Encoded `FileDescriptorSet` of the agent's protos (with imports and comments) for
/// server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("inplace_agent_descriptor");

pub mod authz;
pub mod pki;
pub mod server;
pub mod tls;
