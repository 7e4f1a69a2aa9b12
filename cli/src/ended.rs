//! How a child process (the job of `iadeep run`, the etcd of `iadeep up`) ended, said
//! the same way in every message and log line: "exited with code 1", "was killed by
//! SIGKILL"; in a log line, an `exit_code` or a `signal` field.
//!
//! Why not `ExitStatus`'s own Display: it reads "exit status: 1", which glued to a
//! field name gave `status=exit status: 0`, and after "exited with" repeats itself.

use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use nix::sys::signal::Signal;

/// How a process ended, as the end of a sentence that names it: "etcd {}".
#[derive(Debug, Clone, Copy)]
pub struct Ended(pub ExitStatus);

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.0;
        match (status.code(), signal_name(status)) {
            (Some(code), _) => write!(f, "exited with code {code}"),
            (None, Some(signal)) => {
                write!(f, "was killed by {signal}")?;
                if status.core_dumped() {
                    write!(f, " (core dumped)")?;
                }
                Ok(())
            }
            // Neither exited nor killed: Unix reports neither for an ended process.
            (None, None) => write!(f, "ended ({status})"),
        }
    }
}

/// The signal that killed the process, by name ("SIGKILL", as the `signal` field of
/// other log lines), or by number when nix has no name for it; `None` if it exited.
/// Beside `exit_code = status.code()`, the fields of a log line about its end.
pub fn signal_name(status: ExitStatus) -> Option<String> {
    let number = status.signal()?;
    Some(Signal::try_from(number).map_or_else(|_| format!("signal {number}"), |s| s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait status as `waitpid` reports it: exit code in the second byte, the
    /// killing signal in the low seven bits, 0x80 when a core was dumped.
    fn raw(status: i32) -> ExitStatus {
        ExitStatus::from_raw(status)
    }

    #[test]
    fn says_how_it_ended_in_words() {
        assert_eq!(Ended(raw(0)).to_string(), "exited with code 0");
        assert_eq!(Ended(raw(3 << 8)).to_string(), "exited with code 3");
        assert_eq!(Ended(raw(9)).to_string(), "was killed by SIGKILL");
        assert_eq!(
            Ended(raw(11 | 0x80)).to_string(),
            "was killed by SIGSEGV (core dumped)"
        );
        assert_eq!(signal_name(raw(3 << 8)), None);
        assert_eq!(signal_name(raw(15)).as_deref(), Some("SIGTERM"));
        // A real-time signal: nix names none of them.
        assert_eq!(signal_name(raw(40)).as_deref(), Some("signal 40"));
    }
}
