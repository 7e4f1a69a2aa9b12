//! Lines on stdout that may go to a pipe the reader closes early.
//!
//! `println!` panics when stdout is a closed pipe (`iadeep state ls | head`); these
//! return the error instead, and `main` ends the command quietly on it.

use std::io::Write;

/// Writes one line to stdout.
pub fn line(args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)?;
    out.write_all(b"\n")
}

/// Writes text to stdout as it is.
pub fn text(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// `outln!(...)`: `println!` that returns the write error (`?` it).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}
