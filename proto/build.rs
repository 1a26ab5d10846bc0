//! Generates the tonic/prost stubs and the descriptor set (for gRPC server reflection).
//!
//! `protoc` comes from the `protoc-bin-vendored` crate, so a fresh machine needs no system
//! protobuf compiler.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Build scripts are single-threaded, so setting the variable is sound; prost-build reads it.
    std::env::set_var("PROTOC", protoc);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let files = [
        "ferry/v1/inference.proto",
        "ferry/internal/v1/worker.proto",
        "ferry/internal/v1/registry.proto",
        "ferry/internal/v1/transfer.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("ferry_descriptor.bin"))
        .compile_protos(&files, &["."])?;
    Ok(())
}
