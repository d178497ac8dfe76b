//! Compiles `proto/` into Rust with `protox` (a pure-Rust protobuf compiler, so no `protoc`
//! is needed) and `tonic-prost-build`, and writes the encoded file descriptor set that the
//! server reflection service publishes.

use std::path::PathBuf;

/// The proto files of the crate, relative to the crate root.
const PROTOS: &[&str] = &["proto/inplace/agent/v1/agent.proto"];

/// Include root for `import` statements; the well-known types come from protox itself.
const INCLUDE: &str = "proto";

/// File name (in `OUT_DIR`) of the descriptor set, read by `tonic::include_file_descriptor_set!`.
const DESCRIPTOR_FILE: &str = "inplace_agent_descriptor.bin";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    // Source info is kept so the generated Rust carries the proto comments as doc comments
    // and reflection clients (grpcurl describe) show them; imports are included so the
    // descriptor set is self-contained for reflection.
    let fds = protox::compile(PROTOS, [INCLUDE])?;

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let encoded = protox::prost::Message::encode_to_vec(&fds);
    std::fs::write(out_dir.join(DESCRIPTOR_FILE), encoded)?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // rerun-if-changed is printed above for exactly the files we compile.
        .emit_rerun_if_changed(false)
        // File contents are `bytes::Bytes`: decoded as slices of the received message
        // and sent from the plan's own content, never copied (a plan may carry megabytes).
        .bytes(".inplace.agent.v1.FileChange.content")
        // The pieces of a plan document are handed to the parsing thread as they are.
        .bytes(".inplace.agent.v1.PlanDocumentPiece.data")
        // prost's codec, encoding into a buffer reserved for the whole message (src/codec.rs).
        .codec_path("crate::codec::Codec")
        .compile_fds(fds)?;
    Ok(())
}
