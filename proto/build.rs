//! Compiles `proto/iadeep/v1/*.proto` with protox (a pure-Rust protobuf
//! compiler), so building iadeep's own schema never needs a `protoc`.
//!
//! Three outputs: the prost messages (and, with the `grpc` feature, the tonic
//! client and server stubs), serde impls following
//! protobuf's canonical JSON mapping (pbjson), and the encoded descriptor set that
//! the gRPC server's reflection service publishes.

use std::path::PathBuf;

use prost::Message;

const PROTOS: &[&str] = &[
    "iadeep/v1/task.proto",
    "iadeep/v1/device.proto",
    "iadeep/v1/sample.proto",
    "iadeep/v1/placer.proto",
    "iadeep/v1/tuner.proto",
    "iadeep/v1/reservation.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let descriptors = protox::compile(PROTOS, [&root])?;
    let encoded = descriptors.encode_to_vec();
    std::fs::write(out.join("iadeep_descriptor.bin"), &encoded)?;
    // Operators read and write stored values as JSON (`iadeep state`) in protobuf's
    // standard mapping, so tools in other languages (MessageToJson) interoperate; the
    // generated deserialisers also accept the proto field names (snake_case).
    pbjson_build::Builder::new()
        .register_descriptors(&encoded)?
        .build(&[".iadeep"])?;
    // The stubs name tonic types, so they are generated only when the crate links
    // tonic (the `grpc` feature); the messages are the same either way.
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    // The codec answers an undecodable request with INVALID_ARGUMENT, not INTERNAL
    // (src/codec.rs).
    tonic_prost_build::configure()
        .codec_path("crate::codec::IadeepCodec")
        .build_client(grpc)
        .build_server(grpc)
        .compile_fds(descriptors)?;
    Ok(())
}
