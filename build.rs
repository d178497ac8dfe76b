//! Compiles `proto/` into Rust with `protox` (a pure-Rust protobuf compiler, so no `protoc`
//! is needed) and `tonic-prost-build`, writes the encoded file descriptor set that the
//! server reflection service publishes, and records the git commit the binary is built from
//! (`inplace-agent version`, the status socket, the `build_info` metric).

use std::path::PathBuf;
use std::process::Command;

/// The proto files of the crate, relative to the crate root.
const PROTOS: &[&str] = &["proto/inplace/agent/v1/agent.proto"];

/// Include root for `import` statements; the well-known types come from protox itself.
const INCLUDE: &str = "proto";

/// File name (in `OUT_DIR`) of the descriptor set, read by `tonic::include_file_descriptor_set!`.
const DESCRIPTOR_FILE: &str = "inplace_agent_descriptor.bin";

/// What goes into the binary besides `.git`: a change here makes the tree "modified".
const SOURCES: &[&str] = &["src", "proto", "build.rs", "Cargo.toml", "Cargo.lock"];

/// Runs git in the crate's directory; `None` when git is missing or this is not a checkout.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Sets `INPLACE_AGENT_GIT_COMMIT` (the commit, or empty when unknown) and
/// `INPLACE_AGENT_GIT_MODIFIED` (`true` when the sources of the binary differ from that
/// commit, `false`, or empty when unknown). Without git (a source tarball, a container build
/// without `.git`) the builder may pass the commit in `INPLACE_AGENT_GIT_COMMIT`; whether the
/// tree was modified is then unknown.
fn record_commit() {
    println!("cargo:rerun-if-env-changed=INPLACE_AGENT_GIT_COMMIT");
    for source in SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }
    let (commit, modified) = match git(&["rev-parse", "HEAD"]) {
        Some(commit) if !commit.is_empty() => {
            // The commit moves when HEAD or the branch it names moves (a commit, a checkout).
            for file in ["HEAD", "index"] {
                if let Some(path) = git(&["rev-parse", "--git-path", file]) {
                    println!("cargo:rerun-if-changed={path}");
                }
            }
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
                && let Some(path) = git(&["rev-parse", "--git-path", &branch])
            {
                println!("cargo:rerun-if-changed={path}");
            }
            let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
            status.extend(SOURCES);
            let modified = git(&status).map(|s| (!s.is_empty()).to_string());
            (commit, modified.unwrap_or_default())
        }
        _ => (
            std::env::var("INPLACE_AGENT_GIT_COMMIT").unwrap_or_default(),
            String::new(),
        ),
    };
    let commit = if commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        commit
    } else {
        String::new()
    };
    println!("cargo:rustc-env=INPLACE_AGENT_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=INPLACE_AGENT_GIT_MODIFIED={modified}");
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    // The release linker lays the binary out by this list (packaging/layout/link-gcc): a new
    // list must relink, so it counts as an input.
    println!("cargo:rerun-if-changed=packaging/layout/hot-functions.txt");
    record_commit();

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
        // prost's codec, encoding into a buffer reserved for the whole message (src/rpc/codec.rs).
        .codec_path("crate::rpc::codec::Codec")
        .compile_fds(fds)?;
    Ok(())
}
