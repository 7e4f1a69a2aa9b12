//! `iadeep state`: direct access to the cluster state for operators.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use iadeep_state::{StateError, StateStore, WatchEvent};

use crate::StoreArgs;
use crate::codec;

#[derive(Debug, Args)]
pub struct StateArgs {
    #[command(flatten)]
    store: StoreArgs,
    #[command(subcommand)]
    command: StateCommand,
}

#[derive(Debug, Subcommand)]
enum StateCommand {
    /// Print the value at KEY (JSON for iadeep's own keys). Exits 1 if absent.
    Get {
        /// The key, e.g. /iadeep/v1/tasks/ID/report (`iadeep state ls` lists them).
        key: String,
        /// Also print revision, version and lease to stderr.
        #[arg(long)]
        meta: bool,
    },
    /// Store VALUE at KEY. For iadeep's keys VALUE is JSON of the key's message
    /// (e.g. a DeviceInfo for /iadeep/v1/devices/ID/info, a TunerState for
    /// .../devices/ID/tuner) and is checked, including that its id is the key's;
    /// a key under /iadeep/v1/ outside the layout is refused. `-` reads stdin.
    Put {
        /// The key, e.g. /iadeep/v1/devices/ID/info.
        key: String,
        /// The value: JSON of the key's message for iadeep's keys, `-` for stdin.
        value: String,
        /// Store VALUE's bytes as given, without checking them against the key's message.
        #[arg(long)]
        raw: bool,
        /// Bind the key to a new lease of this many seconds: it disappears unless
        /// someone keeps the lease alive (mostly useful for testing).
        #[arg(long, value_name = "SECONDS")]
        lease_ttl: Option<u64>,
    },
    /// Delete KEY.
    Del {
        /// The key, e.g. /iadeep/v1/tasks/ID/alive.
        key: String,
    },
    /// List keys under PREFIX, one per line.
    Ls {
        /// Key prefix, e.g. /iadeep/v1/tasks/
        #[arg(default_value = iadeep_state::keys::ROOT)]
        prefix: String,
        /// Print each value (one line of JSON or text) after its key.
        #[arg(short, long)]
        long: bool,
    },
    /// Print changes under PREFIX as they happen, one line each, until interrupted.
    Watch {
        /// Key prefix, e.g. /iadeep/v1/tasks/
        #[arg(default_value = iadeep_state::keys::ROOT)]
        prefix: String,
        /// Replay history from this revision first (inclusive).
        #[arg(long, value_name = "REVISION")]
        from_revision: Option<i64>,
        /// Stop after this many events.
        #[arg(long, value_name = "N")]
        count: Option<u64>,
    },
}

pub async fn run(args: StateArgs) -> Result<ExitCode> {
    let url = args.store.url();
    // Reading never creates, repairs or rewrites an embedded store file.
    let read_only = matches!(
        args.command,
        StateCommand::Get { .. } | StateCommand::Ls { .. } | StateCommand::Watch { .. }
    );
    let store = if read_only {
        crate::open_store_read_only(&url).await?
    } else {
        crate::open_store(&url).await?
    };
    match args.command {
        StateCommand::Get { key, meta } => get(store.as_ref(), &key, meta).await,
        StateCommand::Put {
            key,
            value,
            raw,
            lease_ttl,
        } => put(store.as_ref(), &key, &value, raw, lease_ttl).await,
        StateCommand::Del { key } => {
            codec::check_key(&key)?;
            if store.delete(&key).await? {
                outln!("deleted {key}")?;
            } else {
                outln!("{key} did not exist")?;
            }
            Ok(ExitCode::SUCCESS)
        }
        StateCommand::Ls { prefix, long } => ls(store.as_ref(), &prefix, long).await,
        StateCommand::Watch {
            prefix,
            from_revision,
            count,
        } => watch(store.as_ref(), &prefix, from_revision, count).await,
    }
}

/// Keys one page of `state ls` asks for: ten times the store's default, because etcd
/// answers each page at the cost of counting the rest of the prefix (see
/// `iadeep_state::DEFAULT_PAGE_SIZE`), so a listing of millions needs few pages; a page
/// too large for one answer is halved by the store.
const LS_PAGE: usize = 5_000;

/// Lists the keys under `prefix` page by page, printing each page as it comes, so a
/// prefix of millions of keys lists in bounded memory and no answer exceeds gRPC's
/// message limit. Pages are each consistent; a key written or deleted while the
/// listing runs may or may not be in it.
async fn ls(store: &dyn StateStore, prefix: &str, long: bool) -> Result<ExitCode> {
    codec::check_key(prefix)?;
    let mut after: Option<String> = None;
    let mut listed = 0usize;
    loop {
        let page = store.range_page(prefix, after.as_deref(), LS_PAGE).await?;
        for kv in &page.kvs {
            if long {
                outln!("{} {}", kv.key, codec::one_line(&kv.key, &kv.value))?;
            } else {
                outln!("{}", kv.key)?;
            }
        }
        listed += page.kvs.len();
        match page.next_after() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    tracing::debug!(keys = listed, "listed");
    Ok(ExitCode::SUCCESS)
}

async fn get(store: &dyn StateStore, key: &str, meta: bool) -> Result<ExitCode> {
    codec::check_key(key)?;
    let Some(kv) = store.get(key).await? else {
        eprintln!("{key}: not found");
        return Ok(ExitCode::from(1));
    };
    if meta {
        eprintln!(
            "create_revision={} mod_revision={} version={} lease={}",
            kv.create_revision,
            kv.mod_revision,
            kv.version,
            kv.lease
                .map_or_else(|| "none".to_owned(), |l| l.to_string())
        );
    }
    let value = codec::to_json(key, &kv.value)?;
    match value {
        serde_json::Value::String(text) => outln!("{text}")?,
        other => outln!("{}", serde_json::to_string_pretty(&other)?)?,
    }
    Ok(ExitCode::SUCCESS)
}

async fn put(
    store: &dyn StateStore,
    key: &str,
    value: &str,
    raw: bool,
    lease_ttl: Option<u64>,
) -> Result<ExitCode> {
    codec::check_key(key)?;
    let input = if value == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read the value from stdin")?;
        text
    } else {
        value.to_owned()
    };
    let bytes = codec::from_input(key, &input, raw)?;
    let lease = match lease_ttl {
        Some(secs) => Some(store.grant_lease(Duration::from_secs(secs)).await?),
        None => None,
    };
    let revision = store.put(key, bytes, lease).await?;
    outln!("put {key} at revision {revision}")?;
    Ok(ExitCode::SUCCESS)
}

/// A watch's error, with what to do instead when the revision asked for is compacted
/// (the placer compacts every `--compact-every`, so an old `--from-revision` stops
/// working on its own).
fn watch_error(err: StateError) -> anyhow::Error {
    match err {
        StateError::Compacted { oldest, .. } => anyhow::anyhow!(
            "{err}: --from-revision {oldest} or later replays the history kept; without \
             --from-revision the watch starts now"
        ),
        err => err.into(),
    }
}

async fn watch(
    store: &dyn StateStore,
    prefix: &str,
    from_revision: Option<i64>,
    count: Option<u64>,
) -> Result<ExitCode> {
    codec::check_key(prefix)?;
    let mut events = store
        .watch(prefix, from_revision)
        .await
        .map_err(watch_error)?;
    eprintln!("watching {prefix} on {} (Ctrl-C to stop)", store.describe());
    let mut seen = 0u64;
    while count.is_none_or(|n| seen < n) {
        let event = tokio::select! {
            event = events.next() => event,
            _ = tokio::signal::ctrl_c() => break,
        };
        match event {
            Some(Ok(WatchEvent::Put(kv))) => outln!(
                "PUT {} {} {}",
                kv.mod_revision,
                kv.key,
                codec::one_line(&kv.key, &kv.value)
            )?,
            Some(Ok(WatchEvent::Delete { key, revision })) => outln!("DELETE {revision} {key}")?,
            Some(Err(err)) => return Err(watch_error(err)),
            None => break,
        }
        seen += 1;
    }
    Ok(ExitCode::SUCCESS)
}
