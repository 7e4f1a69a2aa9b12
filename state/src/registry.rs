//! The profile registry: what jobs of a model measured on each kind of GPU (solo step
//! time and peak memory per batch size), kept in the store under
//! [`crate::keys::profile`] and bounded, so a later job of the same
//! model starts with a profile although its user gave none (docs/design.md, "Profile
//! registry"). Tuners write it as they measure; the placer reads it when a task arrives
//! without a profile or a memory figure.
//!
//! The merge is a pure function ([`merge`]) and one read-modify-write transaction
//! ([`record`]) applies it, so concurrent tuners recording the same model never lose
//! each other's points.

use iadeep_proto::{KindProfile, ModelProfile, ProfilePoint, SoloProfile};
use prost::Message;

use crate::error::Result;
use crate::keys;
use crate::store::{Expect, StateStore, Txn, TxnOutcome};
use crate::typed;

/// Most batch sizes kept per model and GPU kind: the newest measurements win.
pub const MAX_POINTS_PER_KIND: usize = 32;
/// Most GPU kinds kept per model: the most recently measured win.
pub const MAX_KINDS: usize = 8;
/// Read-modify-write attempts of [`record`] before it gives up (another writer kept
/// changing the entry; the next measurement records again).
const ATTEMPTS: usize = 4;

/// Merges `points` measured on `device_kind` into `entry`: per batch size, the newer
/// measurement of each figure replaces the older (a figure the new point lacks is kept),
/// and the entry is bounded ([`MAX_POINTS_PER_KIND`], [`MAX_KINDS`]). Points without a
/// batch size or without any valid figure are ignored. Returns whether it changed.
pub fn merge(entry: &mut ModelProfile, device_kind: &str, points: &[ProfilePoint]) -> bool {
    let before = entry.clone();
    let kind = match entry
        .kinds
        .iter()
        .position(|k| k.device_kind == device_kind)
    {
        Some(i) => &mut entry.kinds[i],
        None => {
            entry.kinds.push(KindProfile {
                device_kind: device_kind.to_owned(),
                points: Vec::new(),
            });
            let last = entry.kinds.len() - 1;
            &mut entry.kinds[last]
        }
    };
    for p in points {
        let step = p.solo_step_time_s.filter(|t| t.is_finite() && *t > 0.0);
        let peak = p.peak_mem_mib.filter(|&m| m > 0);
        if p.batch_size == 0 || (step.is_none() && peak.is_none()) {
            continue;
        }
        match kind
            .points
            .iter_mut()
            .find(|q| q.batch_size == p.batch_size)
        {
            Some(q) => {
                q.solo_step_time_s = step.or(q.solo_step_time_s);
                q.peak_mem_mib = peak.or(q.peak_mem_mib);
                q.measured_at_unix_ms = q.measured_at_unix_ms.max(p.measured_at_unix_ms);
            }
            None => kind.points.push(ProfilePoint {
                batch_size: p.batch_size,
                solo_step_time_s: step,
                peak_mem_mib: peak,
                measured_at_unix_ms: p.measured_at_unix_ms,
            }),
        }
    }
    keep_newest(&mut kind.points, MAX_POINTS_PER_KIND, |p| {
        p.measured_at_unix_ms
    });
    kind.points.sort_by_key(|p| p.batch_size);
    entry.kinds.retain(|k| !k.points.is_empty());
    keep_newest(&mut entry.kinds, MAX_KINDS, |k| {
        k.points
            .iter()
            .map(|p| p.measured_at_unix_ms)
            .max()
            .unwrap_or(i64::MIN)
    });
    *entry != before
}

/// Keeps the `max` items with the largest `at`, in their order.
fn keep_newest<T>(items: &mut Vec<T>, max: usize, at: impl Fn(&T) -> i64) {
    if items.len() <= max {
        return;
    }
    let mut times: Vec<i64> = items.iter().map(&at).collect();
    times.sort_unstable_by(|a, b| b.cmp(a));
    let cutoff = times[max - 1];
    let mut above = times.iter().filter(|&&t| t > cutoff).count();
    items.retain(|item| {
        let t = at(item);
        if t > cutoff {
            true
        } else if t == cutoff && above < max {
            above += 1;
            true
        } else {
            false
        }
    });
}

/// Records `points` of `model` measured on `device_kind` in the store: one
/// read-modify-write transaction on the model's key, retried when another writer
/// changed it meanwhile. Nothing is written when the points change nothing.
pub async fn record(
    store: &dyn StateStore,
    model: &str,
    device_kind: &str,
    points: &[ProfilePoint],
) -> Result<()> {
    let key = keys::profile(model);
    for _ in 0..ATTEMPTS {
        let (mut entry, expect) = match typed::get::<ModelProfile>(store, &key).await? {
            // Another model whose name maps to the same key: this one takes it over.
            Some((entry, kv)) if entry.model == model => {
                (entry, Expect::ModRevision(kv.mod_revision))
            }
            Some((_, kv)) => (
                ModelProfile::default(),
                Expect::ModRevision(kv.mod_revision),
            ),
            None => (ModelProfile::default(), Expect::Absent),
        };
        entry.model = model.to_owned();
        if !merge(&mut entry, device_kind, points) && expect != Expect::Absent {
            return Ok(());
        }
        let txn =
            Txn::new()
                .compare(key.as_str(), expect)
                .put(key.as_str(), entry.encode_to_vec(), None);
        if let TxnOutcome::Committed { .. } = store.transact(txn).await? {
            return Ok(());
        }
    }
    tracing::debug!(%model, "profile registry entry kept changing; this measurement is not recorded");
    Ok(())
}

/// The registry's entry of `model`, if any job of that model recorded one.
pub async fn load(store: &dyn StateStore, model: &str) -> Result<Option<ModelProfile>> {
    Ok(typed::get::<ModelProfile>(store, &keys::profile(model))
        .await?
        .map(|(entry, _)| entry)
        .filter(|entry| entry.model == model))
}

/// A solo profile for a job of `entry`'s model starting at `m0`, marked as coming from
/// the registry, from the GPU kind with the most measured sizes: its measurement at the
/// smallest size at or above m0 that has a peak memory (memory grows with the batch, so
/// that peak bounds m0's), else at m0 without a memory figure. Never a size below m0:
/// extrapolating memory upwards from one smaller size is so conservative that the job
/// could look too large for any card, where it would otherwise be granted what is free
/// and fenced there. `None` when nothing useful was recorded.
pub fn solo_profile(entry: &ModelProfile, m0: u32) -> Option<SoloProfile> {
    let kind = entry.kinds.iter().max_by_key(|k| k.points.len())?;
    let point = kind
        .points
        .iter()
        .filter(|p| p.batch_size >= m0 && p.peak_mem_mib.is_some())
        .min_by_key(|p| p.batch_size)
        .or_else(|| kind.points.iter().find(|p| p.batch_size == m0))?;
    Some(SoloProfile {
        batch_size: point.batch_size,
        step_time_s: point.solo_step_time_s,
        peak_mem_mib: point.peak_mem_mib,
        device_kind: kind.device_kind.clone(),
        from_registry: true,
        ..SoloProfile::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EmbeddedStore;

    fn point(batch_size: u32, step: Option<f64>, peak: Option<u64>, at: i64) -> ProfilePoint {
        ProfilePoint {
            batch_size,
            solo_step_time_s: step,
            peak_mem_mib: peak,
            measured_at_unix_ms: at,
        }
    }

    #[test]
    fn newer_figures_replace_older_ones_and_missing_ones_are_kept() {
        let mut entry = ModelProfile::default();
        assert!(merge(
            &mut entry,
            "k80",
            &[point(64, Some(0.2), Some(3000), 1)]
        ));
        assert!(merge(&mut entry, "k80", &[point(64, None, Some(3100), 2)]));
        assert!(!merge(&mut entry, "k80", &[point(0, Some(1.0), None, 3)]));
        assert!(!merge(
            &mut entry,
            "k80",
            &[point(32, Some(f64::NAN), None, 3)]
        ));
        let k = &entry.kinds[0];
        assert_eq!(k.points, vec![point(64, Some(0.2), Some(3100), 2)]);
    }

    #[test]
    fn the_entry_is_bounded_keeping_the_newest() {
        let mut entry = ModelProfile::default();
        for b in 1..=100u32 {
            merge(
                &mut entry,
                "k80",
                &[point(b, Some(0.1), None, i64::from(b))],
            );
        }
        let sizes: Vec<u32> = entry.kinds[0].points.iter().map(|p| p.batch_size).collect();
        assert_eq!(sizes, (69..=100).collect::<Vec<_>>());
        for k in 0..20 {
            merge(
                &mut entry,
                &format!("kind{k}"),
                &[point(8, Some(0.1), None, 1000 + k)],
            );
        }
        assert_eq!(entry.kinds.len(), MAX_KINDS);
        assert!(entry.kinds.iter().all(|k| k.device_kind != "k80"));
    }

    #[test]
    fn a_profile_is_taken_at_m0_or_the_next_larger_size_with_memory() {
        let mut entry = ModelProfile::default();
        merge(
            &mut entry,
            "p100",
            &[
                point(32, Some(0.1), Some(2000), 1),
                point(128, None, Some(5000), 1),
            ],
        );
        let at_32 = solo_profile(&entry, 32).expect("a profile");
        assert_eq!(
            (at_32.batch_size, at_32.step_time_s, at_32.peak_mem_mib),
            (32, Some(0.1), Some(2000))
        );
        assert!(at_32.from_registry);
        assert_eq!(at_32.device_kind, "p100");
        let at_100 = solo_profile(&entry, 100).expect("a profile");
        assert_eq!((at_100.batch_size, at_100.peak_mem_mib), (128, Some(5000)));
        // Nothing measured at or above 256: no figure to bound it by.
        assert_eq!(solo_profile(&entry, 256), None);
        assert_eq!(solo_profile(&ModelProfile::default(), 32), None);
    }

    #[tokio::test]
    async fn recorded_points_are_loaded_by_model_name() {
        let store = EmbeddedStore::in_memory().expect("store");
        record(
            &store,
            "ResNet 50",
            "k80",
            &[point(64, Some(0.3), Some(4000), 5)],
        )
        .await
        .expect("record");
        record(
            &store,
            "ResNet 50",
            "k80",
            &[point(32, None, Some(2500), 6)],
        )
        .await
        .expect("record");
        let entry = load(&store, "ResNet 50")
            .await
            .expect("load")
            .expect("entry");
        assert_eq!(entry.kinds[0].points.len(), 2);
        // Another name on the same key segment is not this model's entry.
        assert_eq!(load(&store, "ResNet/50").await.expect("load"), None);
    }
}
