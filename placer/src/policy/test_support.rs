//! What the policy's tests share: a slowdown rule worked out by hand, placers,
//! task specs and views.
use std::sync::Arc;

use iadeep_proto::{
    CoLocationSample, DeviceInfo, DeviceResidents, Reservation, SoloProfile, TaskProfile,
    TaskReport, TaskSpec,
};

use super::Placer;
use crate::model::ModelledMemory;
use crate::params::PlacerParams;
use crate::view::ClusterView;
use iadeep_predictor::{Prediction, PredictionSource, SlowdownModel};

/// A fixed rule so the expected numbers can be worked out by hand: a GPU time-slices,
/// so IF = max(1, ΣSM / 100, ΣBW / 100) over the task and its co-runners.
#[derive(Debug)]
pub(super) struct TimeShare;

impl SlowdownModel for TimeShare {
    fn predict(&self, _: &str, task: &TaskProfile, corunners: &[TaskProfile]) -> Prediction {
        let all = || std::iter::once(task).chain(corunners);
        let sm: f64 = all().map(|p| p.sm_util_pct.unwrap_or(100.0)).sum();
        let bw: f64 = all().map(|p| p.mem_bw_util_pct.unwrap_or(100.0)).sum();
        Prediction::certain(
            (sm / 100.0).max(bw / 100.0).max(1.0),
            PredictionSource::Given,
        )
    }
    fn observe(&self, _: &CoLocationSample) {}
}

pub(super) fn placer() -> Placer {
    Placer::new(PlacerParams::default(), Arc::new(TimeShare)).expect("valid params")
}

/// The queue-or-place rule alone: these tests pair heavy tasks (SM 95% each, a
/// combined throughput gain of only 0.05 under [`TimeShare`]) that the throughput
/// guard would otherwise reject before the rule is reached.
pub(super) fn queue_rule_placer() -> Placer {
    let params = PlacerParams {
        min_throughput_gain: 0.0,
        ..Default::default()
    };
    Placer::new(params, Arc::new(TimeShare)).expect("valid params")
}

pub(super) fn spec(id: &str, mib: u64, sm: f64, total: Option<u64>) -> TaskSpec {
    TaskSpec {
        task_id: id.into(),
        initial_batch_size: 32,
        gpu_mem_request_mib: mib,
        total_samples: total,
        profile: Some(SoloProfile {
            batch_size: 32,
            step_time_s: Some(0.1),
            sm_util_pct: Some(sm),
            mem_bw_util_pct: Some(sm / 2.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(super) fn device(view: &mut ClusterView, id: &str, mib: u64, residents: &[TaskSpec]) {
    view.upsert_device(DeviceInfo {
        device_id: id.into(),
        node: "n".into(),
        memory_mib: mib,
        kind: "v100".into(),
        ..Default::default()
    });
    if !residents.is_empty() {
        let record = DeviceResidents {
            device_id: id.into(),
            reservations: residents
                .iter()
                .map(|s| Reservation {
                    task_id: s.task_id.clone(),
                    reserved_mem_mib: s.gpu_mem_request_mib,
                    spec: Some(s.clone()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        view.apply_residents(id, Some(record), 1);
    }
}

/// A view with shared devices `(id, MiB of the resident, seconds until it
/// finishes)`, each resident reporting 900 samples/s, and `ahead` tasks told to
/// queue before the newcomer submitted at 5 s.
pub(super) fn freeing_view(devices: &[(&str, u64, u64)], ahead: usize) -> ClusterView {
    let mut view = ClusterView::new(Arc::new(ModelledMemory));
    for (id, mib, left_s) in devices {
        let resident = format!("r-{id}");
        device(
            &mut view,
            id,
            32_000,
            &[spec(&resident, *mib, 40.0, Some(1000 + 900 * left_s))],
        );
        view.set_report(TaskReport {
            task_id: resident,
            samples_done: 1000,
            samples_per_s: 900.0,
            reported_at_unix_ms: 0,
            ..Default::default()
        });
    }
    for k in 0..ahead {
        let mut earlier = spec(&format!("early{k}"), 4000, 95.0, None);
        earlier.submitted_at_unix_ms = 1_000;
        view.note_waiting(&earlier, &[], 0, 600_000, None);
    }
    view
}

pub(super) fn light_newcomer() -> TaskSpec {
    // 1e6 samples × 0.1 s / 32 = 3125 s alone; at 4% SM it slows nobody.
    let mut new = spec("new", 1000, 4.0, Some(1_000_000));
    new.submitted_at_unix_ms = 5_000;
    new
}
