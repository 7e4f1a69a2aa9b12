//! Compiles `proto/iadeep/v1/*.proto` with protox (a pure-Rust protobuf
//! compiler), so building iadeep never needs a `protoc` on the machine.

use std::path::PathBuf;

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
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let descriptors = protox::compile(PROTOS, [&root])?;
    tonic_prost_build::configure()
        // Serde lets operators read and write stored values as JSON (`iadeep state`).
        .message_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")
        .message_attribute(".", "#[serde(default, deny_unknown_fields)]")
        .enum_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")
        .compile_fds(descriptors)?;
    Ok(())
}
