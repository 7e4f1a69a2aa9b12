//! A synthetic cluster of a given size, for load tests, benchmarks and examples.
//!
//! Deterministic from a seed so figures can be reproduced: devices of two memory
//! sizes eight to a node, residents spread over them with memory, utilisation and
//! progress drawn uniformly from plausible ranges. It is load, not ground truth:
//! nothing here pretends to be a measured workload.

use iadeep_proto::{DeviceInfo, DeviceResidents, Reservation, SoloProfile, TaskReport, TaskSpec};
use iadeep_state::{StateStore, keys, typed};

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use iadeep_placer::{ClusterView, MemoryEstimator, Result};

/// GPUs per synthetic node.
pub const GPUS_PER_NODE: usize = 8;

/// Uniform integer in `[lo, hi)` (`lo` when the range is empty).
fn uniform(rng: &mut ChaCha8Rng, lo: u64, hi: u64) -> u64 {
    rng.random_range(lo..hi.max(lo + 1))
}

/// A synthetic cluster: `devices` GPUs and `residents` running tasks.
#[derive(Clone, Debug)]
pub struct SyntheticCluster {
    pub devices: Vec<DeviceInfo>,
    pub residents: Vec<DeviceResidents>,
    pub reports: Vec<TaskReport>,
    seed: u64,
}

/// A task spec with memory, profile and work drawn from `rng`.
fn task(rng: &mut ChaCha8Rng, task_id: String, now_ms: i64) -> TaskSpec {
    let batch = 1u32 << uniform(rng, 4, 9);
    TaskSpec {
        task_id,
        model: ["resnet50", "bert-base", "transformer", "lstm", "vgg19"]
            [uniform(rng, 0, 5) as usize]
            .to_owned(),
        initial_batch_size: batch,
        min_batch_size: (batch / 4).max(1),
        max_batch_size: batch * 4,
        gpu_mem_request_mib: uniform(rng, 2_000, 9_000),
        profile: Some(SoloProfile {
            batch_size: batch,
            step_time_s: Some(0.05 + 0.45 * rng.random::<f64>()),
            sm_util_pct: Some(20.0 + 70.0 * rng.random::<f64>()),
            mem_bw_util_pct: Some(10.0 + 60.0 * rng.random::<f64>()),
            peak_mem_mib: None,
            device_kind: "v100".to_owned(),
            from_registry: false,
        }),
        total_samples: Some(uniform(rng, 1_000_000, 50_000_000)),
        submitted_at_unix_ms: now_ms,
        ..Default::default()
    }
}

impl SyntheticCluster {
    /// `devices` GPUs (alternately 16 and 32 GiB) and `residents` tasks placed
    /// round-robin where they fit.
    pub fn new(devices: usize, residents: usize, seed: u64) -> SyntheticCluster {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let now = iadeep_proto::now_unix_ms();
        let infos: Vec<DeviceInfo> = (0..devices)
            .map(|i| DeviceInfo {
                device_id: format!("node-{}.gpu-{}", i / GPUS_PER_NODE, i % GPUS_PER_NODE),
                node: format!("node-{}", i / GPUS_PER_NODE),
                index: (i % GPUS_PER_NODE) as u32,
                name: "synthetic".to_owned(),
                memory_mib: if i % 2 == 0 { 16_384 } else { 32_768 },
                kind: "v100".to_owned(),
                ..Default::default()
            })
            .collect();
        let mut records: Vec<DeviceResidents> = infos
            .iter()
            .map(|d| DeviceResidents {
                device_id: d.device_id.clone(),
                reservations: Vec::new(),
                ..Default::default()
            })
            .collect();
        let mut used = vec![0u64; devices];
        let mut reports = Vec::new();
        let mut placed = 0;
        let mut cursor = 0;
        let mut misses = 0;
        while placed < residents && devices > 0 && misses < devices {
            let d = cursor % devices;
            cursor += 1;
            let spec = task(&mut rng, format!("resident-{placed}"), now);
            let mib = spec.gpu_mem_request_mib;
            // Leave the default placer margins free so the cluster is valid for it.
            if used[d] + mib > infos[d].memory_mib * 9 / 10 - 256 {
                misses += 1;
                continue;
            }
            misses = 0;
            used[d] += mib;
            let total = spec.total_samples.unwrap_or(0);
            let batch = spec.initial_batch_size;
            let step = spec
                .profile
                .as_ref()
                .and_then(|p| p.step_time_s)
                .unwrap_or(0.1);
            reports.push(TaskReport {
                task_id: spec.task_id.clone(),
                device_id: infos[d].device_id.clone(),
                batch_size: batch,
                step_time_s: step * 1.3,
                samples_per_s: f64::from(batch) / (step * 1.3),
                peak_mem_mib: Some(mib * 9 / 10),
                samples_done: (total as f64 * rng.random::<f64>()) as u64,
                reported_at_unix_ms: now,
                seq: 1,
                ..Default::default()
            });
            records[d].reservations.push(Reservation {
                task_id: spec.task_id.clone(),
                reserved_mem_mib: mib,
                placed_at_unix_ms: now,
                spec: Some(spec),
                provisional: false,
            });
            placed += 1;
        }
        SyntheticCluster {
            devices: infos,
            residents: records,
            reports,
            seed,
        }
    }

    /// Number of resident tasks actually placed (fewer than asked when memory ran out).
    pub fn resident_count(&self) -> usize {
        self.reports.len()
    }

    /// The `i`-th arriving task (ids `arrival-{i}`), deterministic per seed.
    pub fn arrival(&self, i: u64) -> TaskSpec {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ i.wrapping_mul(0xA24B_AED4_963E_E407));
        task(
            &mut rng,
            format!("arrival-{i}"),
            iadeep_proto::now_unix_ms(),
        )
    }

    /// The cluster as a view (revision 1 for every residents record).
    pub fn view(&self, memory: Arc<dyn MemoryEstimator>) -> ClusterView {
        let mut view = ClusterView::new(memory);
        for report in &self.reports {
            view.set_report(report.clone());
        }
        for info in &self.devices {
            view.upsert_device(info.clone());
        }
        for record in &self.residents {
            if !record.reservations.is_empty() {
                view.apply_residents(&record.device_id, Some(record.clone()), 1);
            }
        }
        view
    }

    /// Writes the cluster into `store` (device records, residents records, reports).
    pub async fn seed(&self, store: &dyn StateStore) -> Result<()> {
        for info in &self.devices {
            typed::put(store, &keys::device_info(&info.device_id), info, None).await?;
        }
        for record in &self.residents {
            if !record.reservations.is_empty() {
                typed::put(
                    store,
                    &keys::device_residents(&record.device_id),
                    record,
                    None,
                )
                .await?;
            }
        }
        for report in &self.reports {
            typed::put(store, &keys::task_report(&report.task_id), report, None).await?;
        }
        Ok(())
    }
}
