//! Helpers shared by the CLI test binaries (each `cli/tests/*.rs` is its own crate
//! and includes this module with `mod common;`).
// Each test binary uses a different part of it.
#![allow(dead_code)]

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

/// GET http://addr/path with a bare HTTP/1.0 request; `None` while nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).ok()?;
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .ok()?;
    let mut body = String::new();
    conn.read_to_string(&mut body).ok()?;
    Some(body)
}

/// A loopback address with a port that was free a moment ago.
pub fn free_loopback_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    format!("127.0.0.1:{port}")
}
