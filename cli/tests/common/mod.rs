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

/// Asserts that `out` succeeded (showing its stderr if not) and parses the last
/// line of its stdout, where every `--json` command prints its result.
pub fn succeeded_json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().expect("some output");
    serde_json::from_str(line).expect("last line is JSON")
}
