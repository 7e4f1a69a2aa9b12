//! Progress of long runs, on stderr: an indicatif bar when stderr is a terminal, a
//! log line every [`LINE_EVERY`] otherwise (a CI log, a file, `kubectl logs`), so a
//! run of many minutes never looks hung. Libraries only call a progress hook (e.g.
//! the simulator's `progress(done, total)`); the CLI decides how to show it.
//!
//! [`LogWriter`] is the log subscriber's writer: it prints log lines above the bar
//! (suspending it) instead of through it.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing_subscriber::fmt::MakeWriter;

/// How often a progress line is logged when stderr is not a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(10);

/// The bar being drawn, if any, so log lines can be written around it.
static ACTIVE_BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

fn active_bar() -> Option<ProgressBar> {
    ACTIVE_BAR.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// One long task's progress (e.g. one policy's simulation).
#[derive(Debug)]
pub struct Progress {
    label: String,
    bar: Option<ProgressBar>,
    started: Instant,
    /// When the last line was logged (`None` before the first).
    last_line: Option<Instant>,
    every: Duration,
}

impl Progress {
    /// Starts showing the progress of `label`: a bar on a terminal, lines otherwise.
    pub fn start(label: &str) -> Progress {
        Progress::with_bar(label, std::io::stderr().is_terminal())
    }

    fn with_bar(label: &str, bar: bool) -> Progress {
        let bar = bar.then(|| {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{prefix:<20} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-");
            bar.set_style(style);
            bar.set_prefix(label.to_owned());
            *ACTIVE_BAR.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar.clone());
            bar
        });
        Progress {
            label: label.to_owned(),
            bar,
            started: Instant::now(),
            last_line: None,
            every: LINE_EVERY,
        }
    }

    /// `done` of `total` units are finished.
    pub fn update(&mut self, done: usize, total: usize) {
        if let Some(bar) = &self.bar {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            return;
        }
        let due = self.last_line.is_none_or(|at| at.elapsed() >= self.every);
        if due || done == total {
            self.last_line = Some(Instant::now());
            let percent = done as f64 * 100.0 / total.max(1) as f64;
            tracing::info!(
                task = %self.label,
                done,
                total,
                elapsed_s = self.started.elapsed().as_secs(),
                "progress {percent:.0} %"
            );
        }
    }

    /// Stops showing progress (the bar is cleared; its last state stays in the logs).
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
            *ACTIVE_BAR.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

/// Writes each log line to stderr in one piece, above the progress bar if one is drawn.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogWriter;

/// One log line being formatted; written out when dropped.
#[derive(Debug)]
pub struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let write = || {
            // A closed stderr has nowhere to report to.
            let _ = std::io::stderr().lock().write_all(&self.0);
        };
        match active_bar() {
            Some(bar) => bar.suspend(write),
            None => write(),
        }
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> Self::Writer {
        LogLine(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_come_at_the_start_the_end_and_every_period() {
        let mut progress = Progress::with_bar("test", false);
        progress.every = Duration::from_secs(3600);
        progress.update(0, 10);
        let first = progress.last_line.expect("a first line at once");
        progress.update(5, 10);
        assert_eq!(
            progress.last_line,
            Some(first),
            "not again within the period"
        );
        progress.update(10, 10);
        assert!(progress.last_line > Some(first), "a last line at the end");
        progress.every = Duration::ZERO;
        let before = progress.last_line;
        progress.update(7, 10);
        assert!(progress.last_line > before, "one per period");
    }
}
