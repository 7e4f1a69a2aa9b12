//! One tuner per device: a lease-bound owner key taken in a transaction, and the device
//! record kept published under it.
//!
//! Two tuners on one device would both write assignments and samples, and the second one's
//! record (its memory size, its lease) would replace the first's. So a tuner takes the
//! device first: one transaction that finds `devices/{d}/owner` absent and writes it and
//! the `DeviceInfo` record under the tuner's lease. While another tuner owns the device the
//! transaction fails; the newcomer waits twice its lease TTL (the owner may have just died:
//! its lease then expires and its keys go) and then refuses to start, naming the owner.
//!
//! While it runs, the owner keeps the lease alive, re-publishes the record if anything
//! deletes or replaces it (compared with its own owner key, so it never writes for a device
//! it no longer owns), and takes the device again when its lease was lost (the store was
//! unreachable longer than the TTL, or the lease was revoked under it, as an etcd leader
//! before 3.4.31 or 3.5.13 that hung and resumes may do to the leases it saw expire); if
//! another tuner took it meanwhile, the daemon stops with an error at once rather than
//! tune a device someone else tunes. On shutdown it revokes the
//! lease, which deletes both keys at once.

use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::DeviceInfo;
use iadeep_state::{
    Expect, LeaseId, LeaseKeeper, Revision, StateError, StateStore, Txn, TxnOutcome, WatchEvent,
    keys,
};
use prost::Message;
use tokio::sync::watch;

use crate::error::{Result, TunerError};

/// How often a tuner waiting for a dead owner's lease to expire looks again.
const OWNER_POLL: Duration = Duration::from_millis(250);

/// The device, owned: the lease its keys are bound to and the owner key's revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owned {
    pub lease: LeaseId,
    pub owner_revision: Revision,
}

/// What this process writes into the owner key: enough for an operator to find it, and
/// to tell it from another process's. The start time is in it because the pid and node
/// are not enough: containers on one node all run as pid 1, and a tuner that lost its
/// lease must not take a replacement's key (a new pod of the same device) for its own.
fn owner_note(info: &DeviceInfo) -> Vec<u8> {
    // To the millisecond, which with the pid and node tells one tuner from its
    // replacement; in UTC as a date, for the operator the refusal names it to.
    static STARTED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let started = STARTED
        .get_or_init(|| humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string());
    let node = if info.node.is_empty() {
        "an unnamed node"
    } else {
        info.node.as_str()
    };
    format!(
        "tuner pid {} on {node}, started at {started}",
        std::process::id()
    )
    .into_bytes()
}

/// Takes the device: waits at most twice `ttl` for another owner's key to go (a dead
/// tuner's lease expiring; etcd notices expiries a little late), then refuses with the
/// owner's note.
pub async fn take(store: &dyn StateStore, info: &DeviceInfo, ttl: Duration) -> Result<Owned> {
    take_waiting(store, info, ttl, true).await
}

/// [`take`], for a tuner that owned the device and lost its lease: an owner key with
/// another tuner's note means that tuner took the device meanwhile, and this one stops at
/// once rather than tune beside it while it waits; only its own note (a take whose answer
/// was lost and whose lease could not be revoked) is waited for.
async fn take_again(store: &dyn StateStore, info: &DeviceInfo, ttl: Duration) -> Result<Owned> {
    take_waiting(store, info, ttl, false).await
}

async fn take_waiting(
    store: &dyn StateStore,
    info: &DeviceInfo,
    ttl: Duration,
    wait_for_others: bool,
) -> Result<Owned> {
    let device = &info.device_id;
    let owner_key = keys::device_owner(device);
    let deadline = tokio::time::Instant::now() + ttl * 2;
    let mut logged = false;
    loop {
        let lease = store.grant_lease(ttl).await?;
        let txn = Txn::new()
            .compare(owner_key.as_str(), Expect::Absent)
            .put(owner_key.as_str(), owner_note(info), Some(lease))
            .put(keys::device_info(device), info.encode_to_vec(), Some(lease));
        let outcome = store.transact(txn).await;
        let current = match outcome {
            Ok(TxnOutcome::Committed { revision }) => {
                tracing::info!(device, %lease, memory_mib = info.memory_mib, "device taken and registered");
                return Ok(Owned {
                    lease,
                    owner_revision: revision,
                });
            }
            Ok(TxnOutcome::Failed { current }) => current.into_iter().next().flatten(),
            Err(err) => {
                revoke_quietly(store, lease).await;
                return Err(err.into());
            }
        };
        revoke_quietly(store, lease).await;
        let owner_bytes = current.map(|kv| kv.value);
        let owner =
            String::from_utf8_lossy(owner_bytes.as_deref().unwrap_or_default()).into_owned();
        let someone_else = owner_bytes.is_some_and(|note| note != owner_note(info));
        if !wait_for_others && someone_else {
            return Err(TunerError::Daemon(format!(
                "device {device} was taken by another tuner ({owner}) while this one had \
                 lost its lease; stopping"
            )));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(TunerError::Daemon(format!(
                "device {device} is owned by another live tuner ({owner}); stop that one \
                 first (its key {owner_key} goes with its lease), or give this one another \
                 --device"
            )));
        }
        if !logged {
            tracing::warn!(device, %owner, wait = ?(ttl * 2),
                "device owned by another tuner; waiting in case it died and its lease expires");
            logged = true;
        }
        tokio::time::sleep(OWNER_POLL).await;
    }
}

async fn revoke_quietly(store: &dyn StateStore, lease: LeaseId) {
    if let Err(err) = store.revoke_lease(lease).await {
        tracing::debug!(%err, %lease, "cannot revoke an unused lease; it expires by itself");
    }
}

/// Keeps the device owned and its record published until the task is aborted; ends (with
/// the reason) only when another tuner took the device. `current` follows the lease the
/// keys are bound to, for the revocation on shutdown.
pub fn spawn_keeper(
    store: Arc<dyn StateStore>,
    info: DeviceInfo,
    ttl: Duration,
    owned: Owned,
    current: watch::Sender<Owned>,
) -> tokio::task::JoinHandle<TunerError> {
    tokio::spawn(async move {
        let mut owned = owned;
        loop {
            match hold(&store, &info, ttl, owned).await {
                Held::LeaseLost => {
                    tracing::warn!(device = %info.device_id, "device lease lost; taking the device again");
                }
                Held::Taken => {
                    return TunerError::Daemon(format!(
                        "device {} was taken by another tuner (its owner key is another \
                         tuner's); stopping",
                        info.device_id
                    ));
                }
            }
            owned = loop {
                match take_again(store.as_ref(), &info, ttl).await {
                    Ok(owned) => break owned,
                    Err(TunerError::State(err)) => {
                        tracing::warn!(%err, device = %info.device_id, "cannot take the device again; retrying");
                        tokio::time::sleep(ttl / 4).await;
                    }
                    Err(err) => return err,
                }
            };
            current.send_replace(owned);
        }
    })
}

/// How holding the device ended.
enum Held {
    LeaseLost,
    Taken,
}

/// Keeps the lease alive and the record in place until the lease is lost or the owner
/// key is someone else's.
async fn hold(store: &Arc<dyn StateStore>, info: &DeviceInfo, ttl: Duration, owned: Owned) -> Held {
    let info_key = keys::device_info(&info.device_id);
    let record = info.encode_to_vec();
    let mut keeper = LeaseKeeper::spawn(store.clone(), owned.lease, ttl);
    let store = store.as_ref();
    let mut from = owned.owner_revision + 1;
    loop {
        let mut events = match store.watch(&info_key, Some(from)).await {
            Ok(events) => events,
            Err(err) => {
                tracing::debug!(%err, "cannot watch the device record; reading it again");
                match pause_then_catch_up(store, &mut keeper, info, &record, owned, &mut from).await
                {
                    Some(held) => return held,
                    None => continue,
                }
            }
        };
        loop {
            let event = tokio::select! {
                () = keeper.lost() => return Held::LeaseLost,
                event = events.next() => event,
            };
            let changed = match event {
                Some(Ok(WatchEvent::Put(kv))) if kv.key == info_key => {
                    from = kv.mod_revision + 1;
                    kv.value != record
                }
                Some(Ok(WatchEvent::Delete { key, revision })) if key == info_key => {
                    from = revision + 1;
                    true
                }
                Some(Ok(_)) => false,
                Some(Err(err)) => {
                    tracing::debug!(%err, "the device record's watch failed; reading it again");
                    break;
                }
                None => break,
            };
            if changed && let Some(held) = republish(store, info, &record, owned).await {
                return held;
            }
        }
        if let Some(held) =
            pause_then_catch_up(store, &mut keeper, info, &record, owned, &mut from).await
        {
            return held;
        }
    }
}

/// After a failed watch: waits a poll, then reads the record afresh and resumes from
/// that read's revision rather than from the last event seen.
///
/// Why: the device record is written once and then stays quiet, so the revision of its
/// last event soon falls behind the placer's compaction (`--compact-every`); a watch
/// re-created from there would be refused as compacted on every try, and the tuner would
/// never again see its record taken. A change the lost watch missed shows in the read.
/// `Some` when the tuner no longer holds the device.
async fn pause_then_catch_up(
    store: &dyn StateStore,
    keeper: &mut LeaseKeeper,
    info: &DeviceInfo,
    record: &[u8],
    owned: Owned,
    from: &mut Revision,
) -> Option<Held> {
    tokio::select! {
        () = keeper.lost() => return Some(Held::LeaseLost),
        () = tokio::time::sleep(OWNER_POLL) => {}
    }
    let info_key = keys::device_info(&info.device_id);
    let snapshot = match store.range(&info_key).await {
        Ok(snapshot) => snapshot,
        Err(err) => {
            tracing::debug!(%err, "cannot read the device record; trying again");
            return None;
        }
    };
    *from = snapshot.revision + 1;
    let current = snapshot.kvs.iter().find(|kv| kv.key == info_key);
    let changed = current.is_none_or(|kv| kv.value != record);
    if changed {
        return republish(store, info, record, owned).await;
    }
    None
}

/// Writes the record back under the owner's lease. `None` while the device is still this
/// tuner's; [`Held::Taken`] when the owner key is another tuner's; [`Held::LeaseLost`]
/// when it is gone: the lease was revoked or expired and took both keys (the record's
/// deletion can arrive before the keep-alive finds the lease gone), or someone deleted
/// it, and either way the device is free to take again. A store error counts as still
/// owned (the next change or the lease decides).
async fn republish(
    store: &dyn StateStore,
    info: &DeviceInfo,
    record: &[u8],
    owned: Owned,
) -> Option<Held> {
    let device = &info.device_id;
    let txn = Txn::new()
        .compare(
            keys::device_owner(device),
            Expect::ModRevision(owned.owner_revision),
        )
        .put(
            keys::device_info(device),
            record.to_vec(),
            Some(owned.lease),
        );
    match store.transact(txn).await {
        Ok(TxnOutcome::Committed { .. }) => {
            tracing::warn!(
                device,
                "the device record was deleted or replaced while the tuner runs; published again"
            );
            None
        }
        Ok(TxnOutcome::Failed { current }) => {
            if current.into_iter().next().flatten().is_some() {
                return Some(Held::Taken);
            }
            tracing::warn!(
                device,
                "the device's owner key is gone (its lease was revoked or expired); taking \
                 the device again"
            );
            // The lease may still live if only the key was deleted; it holds nothing now.
            revoke_quietly(store, owned.lease).await;
            Some(Held::LeaseLost)
        }
        Err(err) => {
            tracing::warn!(%err, device, "cannot publish the device record again");
            None
        }
    }
}

/// Gives the device up: revokes the lease, which deletes the owner key and the record
/// (or, if the revocation fails, deletes both while the owner key is still this tuner's).
pub async fn release(store: &dyn StateStore, device: &str, owned: Owned) {
    let err = match store.revoke_lease(owned.lease).await {
        Ok(()) => {
            tracing::info!(device, "device released");
            return;
        }
        Err(StateError::LeaseNotFound(_)) => return,
        Err(err) => err,
    };
    tracing::warn!(%err, device, "cannot revoke the device's lease; deleting its keys");
    let owner_key = keys::device_owner(device);
    let txn = Txn::new()
        .compare(
            owner_key.as_str(),
            Expect::ModRevision(owned.owner_revision),
        )
        .delete(owner_key.as_str())
        .delete(keys::device_info(device));
    if let Err(err) = store.transact(txn).await {
        tracing::warn!(%err, device, "cannot delete the device's keys; they go when its lease expires");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_state::EmbeddedStore;

    fn device() -> DeviceInfo {
        DeviceInfo {
            device_id: "n1:gpu0".into(),
            node: "n1".into(),
            memory_mib: 16_384,
            ..Default::default()
        }
    }

    /// A tuner that lost its lease and finds the device owned under another tuner's note
    /// stops at once; under its own note (a take whose answer was lost) it waits up to two
    /// TTLs for that key to go, as a starting tuner waits for any owner's, taking the
    /// device if it goes and refusing if not.
    #[tokio::test(start_paused = true)]
    async fn taking_again_stops_at_once_only_for_another_tuners_key() {
        let info = device();
        let ttl = Duration::from_secs(10);
        for (note, stops_at_once) in [
            (b"tuner pid 1 on another node".to_vec(), true),
            (owner_note(&info), false),
        ] {
            let store = EmbeddedStore::in_memory().expect("store");
            store
                .put(&keys::device_owner(&info.device_id), note, None)
                .await
                .expect("owner key");
            let started = tokio::time::Instant::now();
            let err = take_again(&store, &info, ttl)
                .await
                .expect_err("owned")
                .to_string();
            assert_eq!(err.contains("had lost its lease"), stops_at_once, "{err}");
            assert_eq!(started.elapsed() >= ttl * 2, !stops_at_once, "{err}");
        }
    }
}
