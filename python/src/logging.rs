//! The agent's log lines (registration, assignments, outages) on stderr.
//!
//! The Rust agent logs through `tracing`; in a Python process nothing would
//! subscribe, and a user would never see why the batch size changed or that the
//! store is unreachable. The first agent created installs a plain stderr
//! subscriber, filtered by `IADEEP_LOG` (same syntax as `RUST_LOG`), unless the
//! process already has one (another Rust extension's).

use std::io::IsTerminal;
use std::sync::Once;

/// The variable that sets the filter, e.g. `IADEEP_LOG=debug`.
const FILTER_VARIABLE: &str = "IADEEP_LOG";
/// The agent's own notices; the store client's chatter only when it is a warning.
const DEFAULT_FILTER: &str = "warn,iadeep=info,iadeep_agent=info";

static INIT: Once = Once::new();

/// Installs the subscriber once per process.
pub fn init() {
    INIT.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env(FILTER_VARIABLE)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_FILTER));
        // An error means a subscriber is already installed: keep that one.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .try_init();
    });
}
