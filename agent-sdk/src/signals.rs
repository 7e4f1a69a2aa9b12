//! Finishing the task when the process is told to stop.
//!
//! Kubernetes and systemd stop a training job with SIGTERM, a user with Ctrl-C (SIGINT).
//! Left to the default action the process dies at once: its alive key outlives it by the
//! lease's TTL and the placer frees its GPU only after that plus its grace. So the agent
//! catches the signals it is told to ([`StopSignals`]), marks the task finished (a final
//! report with `finished = true`, which the placer releases at once) and revokes its
//! lease, within [`Agent`](crate::Agent)'s finish deadline (twice the store-operation
//! timeout plus a second), and then ends the process as the signal would have (killed by
//! it, same exit status), so a supervisor sees what it expects.
//!
//! A signal the program already handles or ignores when its first agent starts (Python's
//! SIGINT, which raises `KeyboardInterrupt`; a job's own SIGTERM handler that checkpoints
//! first; SIGINT ignored by a background job) stays the program's: on Linux the agent reads
//! which signals are caught or ignored from `/proc/self/status` (`SigCgt`, `SigIgn`), once
//! per process. A program that installs its handler later, or wants the agent out of the
//! way anyway, leaves the signal out of [`StopSignals`] and calls `finish()` when it is
//! done.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

use crate::shared::{Control, Outcome};

/// Which termination signals make the agent finish the task and end the process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StopSignals {
    /// None: the program handles signals itself and calls `finish()`.
    None,
    /// SIGTERM only (what Kubernetes and systemd send).
    Terminate,
    /// SIGTERM and SIGINT (Ctrl-C). The default.
    #[default]
    TerminateAndInterrupt,
}

/// Runs the reporter to its end; if one of `which` arrives first, asks it to finish the
/// task and waits for that at most `deadline`. Returns how the reporter ended and the
/// signal that stopped it, which the caller re-delivers with [`end_process`] once it has
/// passed the outcome on.
pub(crate) async fn run_until_stop_signal(
    reporter: impl Future<Output = Outcome>,
    which: StopSignals,
    control: &watch::Sender<Control>,
    deadline: Duration,
    task_id: &str,
) -> (Outcome, Option<i32>) {
    tokio::pin!(reporter);
    let signal = tokio::select! {
        outcome = &mut reporter => return (outcome, None),
        signal = next_stop_signal(which) => signal,
    };
    tracing::info!(
        task = task_id,
        signal,
        "stop signal: finishing the task before the process ends"
    );
    control.send_replace(Control::Finish);
    let outcome = match tokio::time::timeout(deadline, reporter).await {
        Ok(outcome) => outcome,
        Err(_) => Err(format!("the task was not finished within {deadline:?}")),
    };
    (outcome, Some(signal))
}

/// The next of `which`, as its number; never resolves for [`StopSignals::None`] or where
/// a handler cannot be installed (then the signal keeps its previous action).
#[cfg(unix)]
async fn next_stop_signal(which: StopSignals) -> i32 {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use tokio::signal::unix::{Signal, SignalKind, signal};
    let install = |number: i32, wanted: bool| {
        if !wanted {
            return None;
        }
        signal(SignalKind::from_raw(number))
            .inspect_err(|err| tracing::warn!(%err, signal = number, "cannot handle a stop signal"))
            .ok()
    };
    async fn received(stream: Option<&mut Signal>) {
        match stream {
            Some(stream) => {
                stream.recv().await;
            }
            None => std::future::pending().await,
        }
    }
    let programs = programs_signals();
    let mut terminate = install(
        SIGTERM,
        which != StopSignals::None && !programs.contains(SIGTERM),
    );
    let mut interrupt = install(
        SIGINT,
        which == StopSignals::TerminateAndInterrupt && !programs.contains(SIGINT),
    );
    tokio::select! {
        () = received(terminate.as_mut()) => SIGTERM,
        () = received(interrupt.as_mut()) => SIGINT,
    }
}

/// A set of signal numbers 1..=64, as the kernel's masks in `/proc/PID/status` hold them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SignalMask(u64);

impl SignalMask {
    fn contains(self, signal: i32) -> bool {
        (1..=64).contains(&signal) && self.0 & (1 << (signal - 1)) != 0
    }

    /// The union of the `SigCgt` (caught) and `SigIgn` (ignored) masks of a status text.
    fn caught_or_ignored(status: &str) -> SignalMask {
        let mask = status
            .lines()
            .filter_map(|line| {
                let hex = line
                    .strip_prefix("SigCgt:")
                    .or_else(|| line.strip_prefix("SigIgn:"))?;
                u64::from_str_radix(hex.trim(), 16).ok()
            })
            .fold(0, |all, mask| all | mask);
        SignalMask(mask)
    }
}

/// The signals the program caught or ignored before the process's first agent started
/// (empty where `/proc` cannot tell): those stay the program's.
#[cfg(unix)]
fn programs_signals() -> SignalMask {
    static BEFORE_FIRST_AGENT: std::sync::OnceLock<SignalMask> = std::sync::OnceLock::new();
    *BEFORE_FIRST_AGENT.get_or_init(|| match std::fs::read_to_string("/proc/self/status") {
        Ok(status) => SignalMask::caught_or_ignored(&status),
        Err(err) => {
            tracing::debug!(%err, "cannot read /proc/self/status; assuming no signal handlers");
            SignalMask::default()
        }
    })
}

#[cfg(not(unix))]
async fn next_stop_signal(_which: StopSignals) -> i32 {
    std::future::pending().await
}

/// Ends the process as `signal`'s default action does (the agent's handler replaced it).
pub(crate) fn end_process(signal: i32) {
    #[cfg(unix)]
    if let Err(err) = signal_hook::low_level::emulate_default_handler(signal) {
        tracing::error!(%err, signal, "cannot end the process after a stop signal");
    }
}

#[cfg(test)]
mod tests {
    use super::SignalMask;

    #[test]
    fn caught_and_ignored_signals_are_read_from_the_status_masks() {
        // SIGINT (2) caught, as Python does; SIGHUP (1) ignored, as nohup does.
        let status = "Name:\tpython3\nSigBlk:\t0000000000008000\n\
                      SigIgn:\t0000000000000001\nSigCgt:\t0000000000000002\n";
        let mask = SignalMask::caught_or_ignored(status);
        assert!(mask.contains(1) && mask.contains(2));
        assert!(!mask.contains(15), "SIGTERM keeps its default action");
        assert!(!mask.contains(16), "a blocked signal is not a handled one");
        assert!(!mask.contains(0) && !mask.contains(65));
        assert_eq!(
            SignalMask::caught_or_ignored("no masks"),
            SignalMask::default()
        );
    }
}
