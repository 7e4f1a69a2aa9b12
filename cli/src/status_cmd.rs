//! `iadeep status`: one line per GPU and one per job, as `squeue` or `nvidia-smi` give,
//! read from the state store (etcd or the embedded file) without writing to it.
//!
//! What the tuner is doing with a job is derived, not read: the tuner persists its
//! observations and whether its search settled, not its phase (see `read::tuning`).
//! Queued jobs are not in the store (the placer answers "queue" to whoever asked, who
//! waits), so the view says so rather than showing an empty queue. A job's priority class
//! and cap are its spec's; whether it is above its cap is the tuner's test (measured PD >
//! cap) on the PD shown.

mod read;
mod render;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use iadeep_state::StateStore;

use crate::StoreArgs;

/// Show every GPU (memory reserved, measured and free; its jobs; its tuner; a production
/// job's cap breach its tuner recorded) and every placed job (batch size now, m0 and
/// bounds; learning-rate factor; priority class and slowdown cap; measured PD, marked
/// when above the cap; what the tuner does with it; whether the placer evicted it, and
/// why; when it last reported). Reads only.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// One JSON object (one line) instead of the tables; with --watch, one per refresh.
    #[arg(long)]
    json: bool,
    /// Cut nothing: full task and GPU ids, however wide the lines (the table is cut to
    /// 100 columns otherwise, long ids in their middle; --json never cuts).
    #[arg(long)]
    wide: bool,
    /// Refresh every SECS seconds (2 when no value is given) until Ctrl-C.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    watch: Option<f64>,
    /// Longest wait for the store to answer one read before saying it is unreachable.
    #[arg(long, value_name = "SECS", default_value_t = 15.0)]
    timeout: f64,
}

/// Milliseconds since the Unix epoch now (0 if the clock is before it).
fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn seconds(flag: &str, value: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} must be a positive number of seconds, got {value}"))
}

pub async fn run(args: StatusArgs) -> Result<ExitCode> {
    let timeout = seconds("--timeout", args.timeout)?;
    let every = args.watch.map(|w| seconds("--watch", w)).transpose()?;
    let url = args.store.url();
    let store = tokio::time::timeout(timeout, crate::open_store_read_only(&url))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "the state store {url} did not answer within {} s; is it running, and is \
                 --store (or IADEEP_STORE) right?",
                timeout.as_secs_f64()
            )
        })??;
    let view = if args.json {
        View::Json
    } else {
        View::Text(render::Layout { wide: args.wide })
    };
    let Some(every) = every else {
        show(store.as_ref(), timeout, view, false).await?;
        return Ok(ExitCode::SUCCESS);
    };
    // A terminal gets the view redrawn in place; a pipe or file gets one after another.
    let redraw = !args.json && std::io::stdout().is_terminal();
    loop {
        if let Err(err) = show(store.as_ref(), timeout, view, redraw).await {
            // The reader left (`iadeep status --watch | head`): nobody to show it to, so
            // end as `main` ends on a closed pipe, quietly.
            if crate::is_broken_pipe(&err) {
                return Err(err);
            }
            // Watching outlives a store restart: say what failed and try again.
            eprintln!("error: {}", crate::error_line(&err));
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
        }
    }
}

/// What `show` prints.
#[derive(Clone, Copy, Debug)]
enum View {
    Json,
    Text(render::Layout),
}

/// Reads the store once and prints the view.
async fn show(store: &dyn StateStore, timeout: Duration, view: View, redraw: bool) -> Result<()> {
    let snapshot = tokio::time::timeout(timeout, read::read(store, now_unix_ms()))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "the state store {} did not answer within {} s",
                store.describe(),
                timeout.as_secs_f64()
            )
        })?
        .with_context(|| format!("cannot read the state store {}", store.describe()))?;
    let layout = match view {
        View::Json => {
            outln!("{}", render::json(&snapshot))?;
            return Ok(());
        }
        View::Text(layout) => layout,
    };
    let mut text = String::new();
    if redraw {
        // Cursor home and clear the screen.
        text.push_str("\x1b[H\x1b[2J");
    }
    for line in render::text(&snapshot, layout) {
        text.push_str(&line);
        text.push('\n');
    }
    crate::output::text(&text)?;
    Ok(())
}

#[cfg(test)]
mod tests;
