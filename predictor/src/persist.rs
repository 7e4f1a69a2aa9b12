//! Co-location samples in the state store, and the rebuild after a restart.
//!
//! Samples live at `/iadeep/v1/samples/{device}/{seq:020}` (see
//! [`iadeep_state::keys`]). The sequence is per device; [`append_sample`] claims the
//! next free one with a compare-and-swap, so two writers for the same device cannot
//! overwrite each other. [`load_samples`] returns them ordered by measurement time
//! (then key), the order a running predictor saw them in, so
//! [`rebuild_predictor`] trains on the same window as the predictor that stopped.

use iadeep_proto::CoLocationSample;
use iadeep_state::keys::{self, KeyKind};
use iadeep_state::{CasOutcome, Expect, StateStore, typed};
use prost::Message;

use crate::error::PredictorError;
use crate::learner::{LearnerParams, validate_sample};
use crate::online::OnlinePredictor;

/// Most compare-and-swap attempts before giving up on a contended device.
const MAX_APPEND_ATTEMPTS: usize = 16;

/// Writes `sample` under `device` at the next free sequence number; returns the key.
pub async fn append_sample(
    store: &dyn StateStore,
    device: &str,
    sample: &CoLocationSample,
) -> Result<String, PredictorError> {
    keys::validate_id("device", device)?;
    validate_sample(sample)?;
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
    Err(PredictorError::InvalidSample(format!(
        "could not claim a sample key under {prefix} after {MAX_APPEND_ATTEMPTS} attempts"
    )))
}

/// Every stored sample, ordered by `measured_at_unix_ms` and then by key.
pub async fn load_samples(store: &dyn StateStore) -> Result<Vec<CoLocationSample>, PredictorError> {
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

/// A predictor trained on every sample in the store.
pub async fn rebuild_predictor(
    store: &dyn StateStore,
    params: LearnerParams,
) -> Result<OnlinePredictor, PredictorError> {
    let samples = load_samples(store).await?;
    OnlinePredictor::from_samples(params, samples)
}
