//! The predictor's co-location samples in the store.
//!
//! Samples live at `/iadeep/v1/samples/{device}/{seq:020}` (see [`keys::sample`]).
//! The sequence is per device; [`append_sample`] claims the next free one with a
//! compare-and-swap, so two writers for the same device cannot overwrite each
//! other. [`load_samples`] returns them ordered by measurement time (then key), the
//! order a running predictor saw them in, so a predictor rebuilt from them
//! (`iadeep_predictor::OnlinePredictor::from_samples`) trains on the same window as
//! the predictor that stopped.
//!
//! The store checks the device id, not the sample: a writer checks a sample first
//! (`iadeep_predictor::validate_sample`), as the predictor refuses to learn from one
//! that fails.

use iadeep_proto::CoLocationSample;
use prost::Message;

use crate::error::{Result, StateError};
use crate::keys::{self, KeyKind};
use crate::store::{CasOutcome, Expect, StateStore};
use crate::typed;

/// Most compare-and-swap attempts before giving up on a contended device.
const MAX_APPEND_ATTEMPTS: usize = 16;

/// Writes `sample` under `device` at the next free sequence number; returns the key.
pub async fn append_sample(
    store: &dyn StateStore,
    device: &str,
    sample: &CoLocationSample,
) -> Result<String> {
    keys::validate_id("device", device)?;
    let prefix = keys::device_samples_prefix(device);
    let mut next = store
        .range(&prefix)
        .await?
        .kvs
        .iter()
        .filter_map(|kv| match KeyKind::parse(&kv.key) {
            KeyKind::Sample { seq, .. } => Some(seq + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let value = sample.encode_to_vec();
    for _ in 0..MAX_APPEND_ATTEMPTS {
        let key = keys::sample(device, next);
        match store
            .compare_and_swap(&key, Expect::Absent, value.clone(), None)
            .await?
        {
            CasOutcome::Swapped { .. } => {
                tracing::debug!(%key, "co-location sample stored");
                return Ok(key);
            }
            CasOutcome::Conflict { .. } => next += 1,
        }
    }
    Err(StateError::Backend {
        op: "append sample",
        target: prefix,
        reason: format!("could not claim a sample key after {MAX_APPEND_ATTEMPTS} attempts"),
    })
}

/// Every stored sample, ordered by `measured_at_unix_ms` and then by key.
pub async fn load_samples(store: &dyn StateStore) -> Result<Vec<CoLocationSample>> {
    let (listed, revision) = typed::list::<CoLocationSample>(store, keys::SAMPLES, |key| {
        matches!(KeyKind::parse(key), KeyKind::Sample { .. })
    })
    .await?;
    let mut listed: Vec<(CoLocationSample, String)> =
        listed.into_iter().map(|(s, kv)| (s, kv.key)).collect();
    listed.sort_by(|(a, ka), (b, kb)| {
        a.measured_at_unix_ms
            .cmp(&b.measured_at_unix_ms)
            .then_with(|| ka.cmp(kb))
    });
    tracing::info!(
        samples = listed.len(),
        revision,
        "loaded co-location samples"
    );
    Ok(listed.into_iter().map(|(s, _)| s).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EmbeddedStore;

    fn sample(device: &str, at: i64) -> CoLocationSample {
        CoLocationSample {
            device_kind: "v100".into(),
            slowdown: 1.25,
            measured_at_unix_ms: at,
            device_id: device.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn appends_per_device_and_loads_in_measurement_order() {
        let store = EmbeddedStore::in_memory().expect("store");
        assert!(load_samples(&store).await.expect("load").is_empty());
        let written = [("n0:gpu0", 30), ("n1:gpu0", 10), ("n0:gpu0", 20)];
        let mut keys_written = Vec::new();
        for (device, at) in written {
            let key = append_sample(&store, device, &sample(device, at))
                .await
                .expect("append");
            keys_written.push(key);
        }
        assert_eq!(
            keys_written,
            [
                keys::sample("n0:gpu0", 0),
                keys::sample("n1:gpu0", 0),
                keys::sample("n0:gpu0", 1)
            ]
        );
        let loaded = load_samples(&store).await.expect("load");
        let order: Vec<i64> = loaded.iter().map(|s| s.measured_at_unix_ms).collect();
        assert_eq!(order, [10, 20, 30]);
    }

    #[tokio::test]
    async fn a_device_id_outside_the_key_layout_is_refused() {
        let store = EmbeddedStore::in_memory().expect("store");
        assert!(
            append_sample(&store, "a/b", &sample("a/b", 1))
                .await
                .is_err()
        );
        assert!(load_samples(&store).await.expect("load").is_empty());
    }
}
