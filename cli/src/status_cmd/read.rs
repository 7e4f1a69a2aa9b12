//! One read of the cluster's state, gathered into what `iadeep status` shows.
//!
//! Three reads (the devices and tasks prefixes, and one page of release markers) and
//! nothing else: the status must not load the
//! store it describes, and every figure it prints is one the placer, the tuners or the
//! agents wrote. A value that does not decode is reported as a problem and skipped, so one
//! damaged key does not hide the rest of the cluster.

use std::collections::BTreeMap;

use iadeep_tuner::daemon::tasks::TaskEntry;

use iadeep_objective::PdInput;
use iadeep_placer::UnreservedRunning;
use iadeep_proto::{
    CapBreach, DeviceInfo, DeviceResidents, Placement, TaskReport, TaskSpec, TunerState,
};
use iadeep_state::keys::{self, KeyKind};
use iadeep_state::{KeyValue, StateStore, typed};
use iadeep_tuner::{TaskKnowledge, candidate_sizes};

/// Everything the store says about one device.
#[derive(Debug, Default)]
struct DeviceKeys {
    info: Option<DeviceInfo>,
    residents: Option<DeviceResidents>,
    tuner: Option<TunerState>,
    breach: Option<CapBreach>,
    /// Whether the device's `owner` key is there: a tuner holds the device.
    owned: bool,
}

/// The cluster as `iadeep status` shows it.
#[derive(Debug)]
pub struct Snapshot {
    /// The store, as its backend describes itself.
    pub store: String,
    /// The store revision of the task read (the later of the two ranges).
    pub revision: i64,
    pub now_unix_ms: i64,
    pub devices: Vec<DeviceRow>,
    /// Placed tasks, by device then id.
    pub jobs: Vec<JobRow>,
    /// Released tasks whose keys are kept for reading (under `keys::ARCHIVE`), counted
    /// up to [`RELEASED_COUNTED`]; `released_more` when there are more.
    pub released: usize,
    pub released_more: bool,
    /// Live task ids with no placement: a task released while its agent still runs (the
    /// placer's reaper places it again), or one caught between two writes. Only while
    /// its agent is alive and has not reported finishing, as the placer counts them
    /// (`UnreservedRunning::applies`): a job never placed (started without `iadeep
    /// run`) runs nowhere once it ends, and the placer's reaper archives what it left
    /// (unless its dead-task grace is 0).
    pub unplaced: Vec<String>,
    /// Keys that did not decode, named, so an operator can look at them.
    pub problems: Vec<String>,
}

/// One GPU.
#[derive(Debug)]
pub struct DeviceRow {
    pub id: String,
    /// Absent when the device's tuner is not running (its record is leased by the tuner)
    /// while reservations on it remain.
    pub info: Option<DeviceInfo>,
    /// Σ of the placer's reservations, MiB.
    pub reserved_mib: u64,
    /// Σ of the residents' last reported peaks, MiB; `None` when none reported one.
    pub measured_mib: Option<u64>,
    /// Total minus the larger of reserved and measured, MiB; `None` without a record.
    pub free_mib: Option<u64>,
    pub residents: Vec<String>,
    pub tuner: Option<TunerSummary>,
    /// Whether a tuner holds the device (its leased `owner` key). A record without one
    /// was written by hand or outlived its tuner: the placer places there all the same,
    /// and nothing tunes what runs there.
    pub tuner_running: bool,
    /// The tuner's record of a production job staying above its cap with every
    /// opportunistic co-runner at its floor: the placer is about to evict one of them.
    pub breach: Option<CapBreach>,
}

/// What the device's persisted tuner state says.
#[derive(Debug)]
pub struct TunerSummary {
    pub round: u64,
    /// Tasks the tuner's observations describe (its current co-location).
    pub task_ids: Vec<String>,
    /// Configurations measured for that co-location (Σ PD known).
    pub measured: usize,
    /// Configurations that ran out of memory.
    pub out_of_memory: usize,
    /// The lowest Σ PD measured, while every task of the co-location still runs here.
    pub best_sum_pd: Option<f64>,
    pub updated_at_unix_ms: i64,
}

/// One placed job.
#[derive(Debug)]
pub struct JobRow {
    pub id: String,
    pub model: String,
    pub device: String,
    /// The agent holds its `alive` lease.
    pub running: bool,
    pub finished: bool,
    /// What the job runs at: its last report's batch size, else its assignment's.
    pub batch_size: u32,
    pub assigned_batch_size: Option<u32>,
    pub m0: u32,
    pub min_batch_size: u32,
    pub max_batch_size: u32,
    pub lr_factor: Option<f64>,
    pub lr_rule: String,
    pub reserved_mib: Option<u64>,
    pub provisional: bool,
    pub peak_mem_mib: Option<u64>,
    pub step_time_s: Option<f64>,
    /// PD at the last report, against the solo step time at m0 named by `pd_basis`.
    pub pd: Option<f64>,
    pub pd_basis: Option<&'static str>,
    pub reported_at_unix_ms: Option<i64>,
    /// When the placer placed the job (`None` where the placement does not say), so that
    /// a job whose agent never reported can be told from one placed moments ago.
    pub placed_at_unix_ms: Option<i64>,
    pub tuning: Tuning,
    /// `production` or `opportunistic` ([`TaskSpec::class_name`]).
    pub class: &'static str,
    /// A production job's slowdown cap (its own, else the default); `None` for an
    /// opportunistic job, which has none.
    pub cap: Option<f64>,
    /// Whether `pd` is above `cap`: the tuner's measured test, not a prediction. `None`
    /// when the job has no cap or no measured PD.
    pub above_cap: Option<bool>,
    /// Why the placer evicted the job (its assignment says evict), if it did.
    pub evicted: Option<String>,
}

/// The tuner's state for one job, as far as the store tells it. The tuner persists its
/// observations and whether its search settled, not its phase, so this is derived (see
/// [`tuning`]).
#[derive(Debug, PartialEq)]
pub struct Tuning {
    /// `fixed`, `waiting`, `holding`, `tuning`, `settled` or `finished`.
    pub phase: &'static str,
    pub why: String,
}

/// Released tasks counted at most: one page of release markers, so the status costs the
/// same however long the retention keeps them.
pub const RELEASED_COUNTED: usize = 1000;

/// Reads the store once.
pub async fn read(store: &dyn StateStore, now_unix_ms: i64) -> iadeep_state::Result<Snapshot> {
    let devices_range = store.range(keys::DEVICES).await?;
    let tasks_range = store.range(keys::TASKS).await?;
    let released = store
        .range_page(keys::RELEASED, None, RELEASED_COUNTED)
        .await?;
    let mut problems = Vec::new();
    let devices = group_devices(&devices_range.kvs, &mut problems);
    let tasks = group_tasks(&tasks_range.kvs, &mut problems);
    let mut snapshot = assemble(
        store.describe(),
        tasks_range.revision,
        now_unix_ms,
        devices,
        tasks,
        problems,
    );
    snapshot.released = released.kvs.len();
    snapshot.released_more = released.more;
    Ok(snapshot)
}

/// Decodes `kv` as `M`, or notes the key as a problem.
fn decoded<M: prost::Message + Default>(kv: &KeyValue, problems: &mut Vec<String>) -> Option<M> {
    typed::decode(kv)
        .map_err(|err| problems.push(err.to_string()))
        .ok()
}

fn group_devices(kvs: &[KeyValue], problems: &mut Vec<String>) -> BTreeMap<String, DeviceKeys> {
    let mut devices: BTreeMap<String, DeviceKeys> = BTreeMap::new();
    for kv in kvs {
        match KeyKind::parse(&kv.key) {
            KeyKind::DeviceInfo { device } => {
                devices.entry(device).or_default().info = decoded(kv, problems);
            }
            KeyKind::DeviceResidents { device } => {
                devices.entry(device).or_default().residents = decoded(kv, problems);
            }
            KeyKind::DeviceTuner { device } => {
                devices.entry(device).or_default().tuner = decoded(kv, problems);
            }
            KeyKind::DeviceBreach { device } => {
                devices.entry(device).or_default().breach = decoded(kv, problems);
            }
            KeyKind::DeviceOwner { device } => devices.entry(device).or_default().owned = true,
            _ => {}
        }
    }
    devices
}

fn group_tasks(kvs: &[KeyValue], problems: &mut Vec<String>) -> BTreeMap<String, TaskEntry> {
    let mut tasks: BTreeMap<String, TaskEntry> = BTreeMap::new();
    for kv in kvs {
        match KeyKind::parse(&kv.key) {
            KeyKind::TaskSpec { task } => {
                tasks.entry(task).or_default().spec = decoded(kv, problems)
            }
            KeyKind::TaskPlacement { task } => {
                tasks.entry(task).or_default().placement = decoded(kv, problems);
            }
            KeyKind::TaskAlive { task } => tasks.entry(task).or_default().alive = true,
            KeyKind::TaskReport { task } => {
                tasks.entry(task).or_default().report = decoded(kv, problems);
            }
            KeyKind::TaskAssignment { task } => {
                tasks.entry(task).or_default().assignment = decoded(kv, problems);
            }
            _ => {}
        }
    }
    tasks
}

fn assemble(
    store: String,
    revision: i64,
    now_unix_ms: i64,
    devices: BTreeMap<String, DeviceKeys>,
    tasks: BTreeMap<String, TaskEntry>,
    problems: Vec<String>,
) -> Snapshot {
    let mut jobs = Vec::new();
    let mut unplaced = Vec::new();
    for (id, task) in &tasks {
        let Some(placement) = &task.placement else {
            if UnreservedRunning::applies(task.alive, false, task.report.as_ref()) {
                unplaced.push(id.clone());
            }
            continue;
        };
        let device = devices.get(&placement.device_id);
        jobs.push(job_row(id, task, placement, device));
    }
    jobs.sort_by(|a, b| (&a.device, &a.id).cmp(&(&b.device, &b.id)));
    let devices = devices
        .into_iter()
        .map(|(id, keys)| device_row(id, keys, &tasks))
        .collect();
    Snapshot {
        store,
        revision,
        now_unix_ms,
        devices,
        jobs,
        released: 0,
        released_more: false,
        unplaced,
        problems,
    }
}

fn device_row(id: String, keys: DeviceKeys, tasks: &BTreeMap<String, TaskEntry>) -> DeviceRow {
    let reservations = keys.residents.map(|r| r.reservations).unwrap_or_default();
    let reserved_mib: u64 = reservations.iter().map(|r| r.reserved_mem_mib).sum();
    let residents: Vec<String> = reservations.into_iter().map(|r| r.task_id).collect();
    let peaks: Vec<u64> = residents
        .iter()
        .filter_map(|t| tasks.get(t)?.report.as_ref()?.peak_mem_mib)
        .collect();
    let measured_mib = (!peaks.is_empty()).then(|| peaks.iter().sum());
    let free_mib = keys.info.as_ref().map(|info| {
        info.memory_mib
            .saturating_sub(reserved_mib.max(measured_mib.unwrap_or(0)))
    });
    let tuner = keys.tuner.map(|state| TunerSummary {
        round: state.round,
        measured: state
            .observations
            .iter()
            .filter(|o| o.sum_pd.is_some())
            .count(),
        out_of_memory: state
            .observations
            .iter()
            .filter(|o| o.sum_pd.is_none())
            .count(),
        // Only while its co-location still runs: with its jobs gone, the observations the
        // tuner keeps (until its residents change) describe nothing on the card.
        best_sum_pd: state
            .observations
            .iter()
            .filter_map(|o| o.sum_pd)
            .min_by(f64::total_cmp)
            .filter(|_| state.task_ids.iter().all(|t| residents.contains(t))),
        task_ids: state.task_ids,
        updated_at_unix_ms: state.updated_at_unix_ms,
    });
    DeviceRow {
        id,
        info: keys.info,
        reserved_mib,
        measured_mib,
        free_mib,
        residents,
        tuner,
        tuner_running: keys.owned,
        breach: keys.breach,
    }
}

fn job_row(
    id: &str,
    task: &TaskEntry,
    placement: &Placement,
    device: Option<&DeviceKeys>,
) -> JobRow {
    let spec = task.spec.clone().unwrap_or_default();
    let m0 = spec.initial_batch_size;
    let report = task.report.as_ref();
    let reservation = device
        .and_then(|d| d.residents.as_ref())
        .and_then(|r| r.reservations.iter().find(|r| r.task_id == id));
    let knowledge = device
        .and_then(|d| d.tuner.as_ref())
        .and_then(|t| t.tasks.iter().find(|k| k.task_id == id))
        .map(TaskKnowledge::from_proto);
    let (pd, pd_basis) = measured_pd(&spec, report, knowledge.as_ref());
    let tuner = device.and_then(|d| d.tuner.as_ref());
    let finished = report.is_some_and(|r| r.finished);
    let cap = spec.slowdown_cap();
    let evicted = task
        .assignment
        .as_ref()
        .filter(|a| a.evict)
        .map(|a| a.evict_reason.clone());
    JobRow {
        id: id.to_owned(),
        model: spec.model.clone(),
        device: placement.device_id.clone(),
        running: task.alive,
        finished,
        batch_size: report
            .map(|r| r.batch_size)
            .or(task.assignment.as_ref().map(|a| a.batch_size))
            .unwrap_or(placement.batch_size),
        assigned_batch_size: task.assignment.as_ref().map(|a| a.batch_size),
        m0,
        min_batch_size: bound_or_m0(spec.min_batch_size, m0),
        max_batch_size: bound_or_m0(spec.max_batch_size, m0),
        lr_factor: task.assignment.as_ref().map(|a| a.lr_factor),
        lr_rule: lr_rule_name(spec.lr_rule),
        reserved_mib: reservation.map(|r| r.reserved_mem_mib),
        provisional: reservation.is_some_and(|r| r.provisional),
        peak_mem_mib: report.and_then(|r| r.peak_mem_mib),
        step_time_s: report.map(|r| r.step_time_s).filter(|t| *t > 0.0),
        pd,
        pd_basis,
        reported_at_unix_ms: report.map(|r| r.reported_at_unix_ms),
        placed_at_unix_ms: (placement.placed_at_unix_ms > 0).then_some(placement.placed_at_unix_ms),
        tuning: tuning(id, &spec, finished, pd.is_some(), tuner),
        class: spec.class_name(),
        cap,
        above_cap: above_cap(pd, cap),
        evicted,
    }
}

/// Whether a measured `pd` is above a production job's `cap`, as the tuner decides it
/// (strictly above: a job exactly at its cap is within it).
pub fn above_cap(pd: Option<f64>, cap: Option<f64>) -> Option<bool> {
    Some(pd? > cap?)
}

/// A spec's bound, where 0 means m0 (`TaskSpec`'s convention).
fn bound_or_m0(bound: u32, m0: u32) -> u32 {
    if bound == 0 { m0 } else { bound }
}

/// `LINEAR`, `SQRT`, ... as the proto names them, without the enum's prefix.
fn lr_rule_name(rule: i32) -> String {
    iadeep_proto::LrScalingRule::try_from(rule)
        .map(|r| {
            r.as_str_name()
                .trim_start_matches("LR_SCALING_RULE_")
                .to_ascii_lowercase()
        })
        .unwrap_or_else(|_| format!("unknown ({rule})"))
}

/// The job's PD at its last report, computed as the tuner computes it: against the solo
/// step time at m0 its tuner knows (measured alone, else estimated from the placer's
/// predicted slowdown), else a solo profile the job brought at m0.
fn measured_pd(
    spec: &TaskSpec,
    report: Option<&TaskReport>,
    knowledge: Option<&TaskKnowledge>,
) -> (Option<f64>, Option<&'static str>) {
    let m0 = spec.initial_batch_size;
    let solo = match knowledge {
        Some(k) if k.solo_at(m0).is_some() => k.solo_at(m0).map(|s| (s, "measured alone")),
        Some(k) => k.solo_for_pd(m0).map(|s| (s, "estimated")),
        None => None,
    }
    .or_else(|| {
        let profile = spec.profile.as_ref().filter(|p| p.batch_size == m0)?;
        profile.step_time_s.map(|s| (s, "profile"))
    });
    let (Some(report), Some((solo_step_s_m0, basis))) = (report, solo) else {
        return (None, None);
    };
    let pd = PdInput {
        m0: f64::from(m0),
        solo_step_s_m0,
        m: f64::from(report.batch_size),
        co_step_s: report.step_time_s,
        noise_scale: report.grad_noise_scale,
    }
    .pd()
    .ok();
    (pd, pd.map(|_| basis))
}

/// What the tuner is doing with the job, derived from what the store holds: its bounds
/// (a job with one candidate size is never moved), whether the tuner's persisted
/// co-location includes it, and whether its PD can be measured (the tuner holds the batch
/// sizes while a resident's solo step time at m0 is unknown).
pub fn tuning(
    id: &str,
    spec: &TaskSpec,
    finished: bool,
    pd_known: bool,
    tuner: Option<&TunerState>,
) -> Tuning {
    let (phase, why) = if finished {
        ("finished", "its agent reported the end".to_owned())
    } else if candidate_sizes(spec).len() <= 1 {
        ("fixed", "its bounds allow one batch size".to_owned())
    } else if !tuner.is_some_and(|t| t.task_ids.iter().any(|t| t == id)) {
        (
            "waiting",
            "its GPU's tuner has not yet started a search with it".to_owned(),
        )
    } else if !pd_known {
        (
            "holding",
            "no solo step time at m0 yet, so PD cannot be measured".to_owned(),
        )
    } else {
        let measured = tuner.map_or(0, |t| {
            t.observations.iter().filter(|o| o.sum_pd.is_some()).count()
        });
        let plural = if measured == 1 { "" } else { "s" };
        if tuner.is_some_and(|t| t.settled) {
            (
                "settled",
                format!(
                    "{measured} configuration{plural} of its GPU measured; what runs is kept \
                     and checked for drift"
                ),
            )
        } else {
            (
                "tuning",
                format!("{measured} configuration{plural} of its GPU measured"),
            )
        }
    };
    Tuning { phase, why }
}
