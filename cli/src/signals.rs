//! The signals that stop a foreground daemon (`iadeep placer`, `iadeep up`).

use tokio::signal::unix::{Signal, SignalKind, signal};

/// Ctrl-C (SIGINT), SIGTERM and SIGHUP, caught from when [`Shutdown::install`] returns:
/// one that comes before [`Shutdown::wait`] is awaited is kept, not lost, and not the
/// default action that would end the process at once (a daemon still starting would
/// leave what it started behind).
pub struct Shutdown {
    interrupt: Signal,
    terminate: Signal,
    /// The terminal closed: `iadeep up`'s etcd runs in its own process group and gets
    /// no hangup of its own, so `iadeep up` must stop it.
    hangup: Signal,
}

impl Shutdown {
    pub fn install() -> std::io::Result<Shutdown> {
        Ok(Shutdown {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// Resolves on the first SIGINT, SIGTERM or SIGHUP since [`Shutdown::install`].
    pub async fn wait(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
            _ = self.hangup.recv() => {}
        }
    }
}

/// Resolves on Ctrl-C (SIGINT), SIGTERM or SIGHUP, whichever comes first.
pub async fn shutdown() {
    match Shutdown::install() {
        Ok(mut shutdown) => shutdown.wait().await,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
