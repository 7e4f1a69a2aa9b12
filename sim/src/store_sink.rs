//! Writes a finished run into a state store in iadeep's key layout (devices, task
//! specs, placements, final reports), so the run can be inspected with the operators'
//! tools, e.g. `iadeep state ls --store out/state.redb /iadeep/v1/`, exactly like a
//! live cluster.

use iadeep_proto::{DeviceInfo, Placement, PriorityClass, SoloProfile, TaskReport, TaskSpec};
use iadeep_state::{StateStore, keys, typed};

use crate::error::Result;
use crate::experiment::Experiment;
use crate::metrics::{RunMetrics, TaskOutcome};
use crate::view::JobInfo;
use crate::workload::TaskTemplate;

/// Id of simulated GPU `index`.
pub fn device_id(index: usize) -> String {
    format!("sim-gpu-{index}")
}

/// Id of simulated task `index`.
pub fn task_id(index: usize) -> String {
    format!("sim-task-{index}")
}

fn ms(seconds: f64) -> i64 {
    (seconds * 1000.0).round() as i64
}

/// The spec `template` was submitted with, as the simulator ran it as `outcome`.
fn task_spec(
    experiment: &Experiment,
    outcome: &TaskOutcome,
    template: &TaskTemplate,
    id: String,
) -> TaskSpec {
    let world = &experiment.world;
    let kind = world.catalogue.worker_type.clone();
    let family = &world.catalogue.families[template.family];
    let solo = world.catalogue.types[template.job].solo_steps_per_s;
    TaskSpec {
        task_id: id,
        model: family.name.clone(),
        initial_batch_size: template.m0,
        min_batch_size: family.batch_sizes.first().copied().unwrap_or(template.m0),
        max_batch_size: family.batch_sizes.last().copied().unwrap_or(template.m0),
        gpu_mem_request_mib: template.mem_request_mib,
        // The spec as submitted: a profile only when the jobs brought one.
        profile: (experiment.params.engine.job_info == JobInfo::Profiled).then(|| SoloProfile {
            batch_size: template.m0,
            step_time_s: Some(1.0 / solo),
            sm_util_pct: None,
            mem_bw_util_pct: None,
            peak_mem_mib: Some(world.memory.mib(template.job)),
            device_kind: kind.clone(),
            ..SoloProfile::default()
        }),
        lr_rule: 0,
        total_samples: Some(template.work_samples.round() as u64),
        submitted_at_unix_ms: ms(outcome.submit_s),
        allowed_batch_sizes: family.batch_sizes.clone(),
        // The job's class as the workload drew it, with a production job's cap.
        priority_class: if template.max_slowdown.is_some() {
            PriorityClass::Production
        } else {
            PriorityClass::Opportunistic
        } as i32,
        max_slowdown: template.max_slowdown,
        kubernetes_pod: None,
    }
}

/// Records `run` of `experiment`; returns the number of keys written.
pub async fn record_run(
    store: &dyn StateStore,
    experiment: &Experiment,
    run: &RunMetrics,
) -> Result<usize> {
    let world = &experiment.world;
    let kind = world.catalogue.worker_type.clone();
    let mut written = 0;
    for index in 0..run.gpus {
        let id = device_id(index);
        let info = DeviceInfo {
            device_id: id.clone(),
            node: "simulated".into(),
            index: index as u32,
            uuid: String::new(),
            name: format!("simulated {kind}"),
            memory_mib: world.memory.capacity_mib,
            kind: kind.clone(),
            from_nvml: false,
        };
        typed::put(store, &keys::device_info(&id), &info, None).await?;
        written += 1;
    }
    for (outcome, template) in run.tasks.iter().zip(&experiment.workload) {
        let id = task_id(outcome.id);
        let spec = task_spec(experiment, outcome, template, id.clone());
        typed::put(store, &keys::task_spec(&id), &spec, None).await?;
        let device = device_id(outcome.device);
        let placement = Placement {
            task_id: id.clone(),
            device_id: device.clone(),
            reserved_mem_mib: template.mem_request_mib,
            batch_size: template.m0,
            placed_at_unix_ms: ms(outcome.start_s),
        };
        typed::put(store, &keys::task_placement(&id), &placement, None).await?;
        let report = TaskReport {
            task_id: id.clone(),
            device_id: device,
            batch_size: outcome.final_batch_size,
            samples_done: outcome.done_samples.round() as u64,
            finished: true,
            reported_at_unix_ms: ms(outcome.finish_s),
            ..TaskReport::default()
        };
        typed::put(store, &keys::task_report(&id), &report, None).await?;
        written += 3;
    }
    tracing::info!(policy = %run.policy, keys = written, "recorded the run in the state store");
    Ok(written)
}
