//! The pace of the placer's background passes (the eviction executor, the pod evictor):
//! one pass every period until the daemon says stop.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Interval, MissedTickBehavior};

/// Ticks every `period` (the first at once), late ticks delayed rather than bunched,
/// until `stop` turns true or its sender is dropped.
#[derive(Debug)]
pub(crate) struct Every {
    tick: Interval,
    stop: watch::Receiver<bool>,
}

impl Every {
    pub(crate) fn new(period: Duration, stop: watch::Receiver<bool>) -> Every {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Every { tick, stop }
    }

    /// Waits for the next pass: true when it is due, false once told to stop.
    pub(crate) async fn next(&mut self) -> bool {
        loop {
            tokio::select! {
                _ = self.tick.tick() => return true,
                changed = self.stop.changed() => {
                    if changed.is_err() || *self.stop.borrow() {
                        return false;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn passes_come_every_period_until_stop() {
        let (stop, stopped) = watch::channel(false);
        let mut every = Every::new(Duration::from_secs(1), stopped);
        let started = tokio::time::Instant::now();
        assert!(every.next().await, "the first pass at once");
        assert!(every.next().await);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        // A change that is not "stop" is not a pass either.
        stop.send(false).expect("send");
        assert!(every.next().await);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        stop.send(true).expect("send");
        assert!(!every.next().await);
        let (stop, stopped) = watch::channel(false);
        let mut every = Every::new(Duration::from_secs(1), stopped);
        assert!(every.next().await);
        drop(stop);
        assert!(!every.next().await, "a dropped sender stops it too");
    }
}
