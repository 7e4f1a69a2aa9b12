//! Helpers shared by the CLI test binaries (each `cli/tests/*.rs` is its own crate
//! and includes this module with `mod common;`).

use std::process::{Command, Output};

/// Runs the `iadeep` binary under test with `args`, logging only warnings.
pub fn iadeep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep")
}
