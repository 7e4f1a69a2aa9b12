//! What every integration test builds its jobs from, once: a resnet50 job that brings a
//! measured solo profile. Tests that need another job say only how theirs differs,
//! with struct-update syntax (`TaskSpec { gpu_mem_request_mib: 1024, ..spec(id) }`).
//! The store and the runtime come from `iadeep_state::testing` (`start_etcd`, `runtime`).

use iadeep_proto::{LrScalingRule, SoloProfile, TaskSpec};

/// A resnet50 job submitted at batch size 32 (allowed 16–64) with a 2,000 MiB request and
/// a solo profile measured at 32: 50 ms a step, 2,000 MiB peak.
pub(crate) fn spec(id: &str) -> TaskSpec {
    TaskSpec {
        task_id: id.into(),
        model: "resnet50".into(),
        initial_batch_size: 32,
        min_batch_size: 16,
        max_batch_size: 64,
        gpu_mem_request_mib: 2_000,
        lr_rule: LrScalingRule::Linear as i32,
        profile: Some(SoloProfile {
            batch_size: 32,
            step_time_s: Some(0.05),
            peak_mem_mib: Some(2_000),
            ..Default::default()
        }),
        ..Default::default()
    }
}
