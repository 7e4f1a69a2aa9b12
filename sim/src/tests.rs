//! Bookkeeping tests of the engine with every policy on small streams.

use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_datasets::philly;
use proptest::prelude::*;

use crate::experiment::{Experiment, ExperimentParams};
use crate::metrics::RunMetrics;
use crate::policy;
use crate::view::JobInfo;

fn experiment(worker: &str, tasks: usize, gpus: usize, load: f64, seed: u64) -> Experiment {
    experiment_in(JobInfo::None, worker, tasks, gpus, load, seed)
}

/// [`experiment`] with jobs bringing `job_info`.
fn experiment_in(
    job_info: JobInfo,
    worker: &str,
    tasks: usize,
    gpus: usize,
    load: f64,
    seed: u64,
) -> Experiment {
    let gavel = GavelThroughputs::bundled().expect("bundled gavel");
    let trace = philly::bundled().expect("bundled philly");
    let mut params = ExperimentParams {
        worker_type: worker.into(),
        ..ExperimentParams::default()
    };
    params.workload.tasks = tasks;
    params.workload.load = load;
    params.workload.seed = seed;
    // Short jobs keep debug-mode runs fast without changing the bookkeeping.
    params.workload.max_duration_s = 4.0 * 3600.0;
    params.engine.gpus = gpus;
    params.engine.seed = seed;
    params.engine.job_info = job_info;
    Experiment::new(params, &gavel, &trace).expect("experiment")
}

fn run(experiment: &Experiment, name: &str) -> RunMetrics {
    let mut policy = experiment.policy(name).expect("policy");
    experiment
        .run_policy(policy.as_mut(), &mut |_, _| {})
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every task finished once, after it arrived, having done exactly its work.
fn assert_bookkeeping(experiment: &Experiment, metrics: &RunMetrics) {
    assert_bookkeeping_of(&experiment.workload, metrics);
}

/// [`assert_bookkeeping`] of a run over `workload`.
pub(crate) fn assert_bookkeeping_of(
    workload: &[crate::workload::TaskTemplate],
    metrics: &RunMetrics,
) {
    let name = &metrics.policy;
    assert_eq!(metrics.tasks.len(), workload.len(), "{name}: tasks lost");
    for (task, template) in metrics.tasks.iter().zip(workload) {
        assert_eq!(task.id, template.id);
        assert!(
            task.start_s >= task.submit_s - 1e-9,
            "{name}: task {} started early",
            task.id
        );
        assert!(
            task.finish_s > task.start_s,
            "{name}: task {} ended before it started",
            task.id
        );
        let relative = (task.done_samples - template.work_samples).abs() / template.work_samples;
        assert!(
            relative < 1e-6,
            "{name}: task {} did {} of {} samples",
            task.id,
            task.done_samples,
            template.work_samples
        );
    }
    let crashes: u64 = metrics.tasks.iter().map(|t| u64::from(t.ooms)).sum();
    assert_eq!(crashes, metrics.ooms, "{name}: OOM counts disagree");
    let fenced: u64 = metrics.tasks.iter().map(|t| u64::from(t.fenced_ooms)).sum();
    assert_eq!(
        fenced, metrics.fenced_ooms,
        "{name}: fenced OOM counts disagree"
    );
}

#[test]
fn exclusive_runs_every_job_at_its_solo_duration() {
    let experiment = experiment("k80", 40, 4, 1.0, 7);
    let metrics = run(&experiment, "exclusive");
    assert_bookkeeping(&experiment, &metrics);
    assert_eq!(metrics.ooms, 0);
    for (task, template) in metrics.tasks.iter().zip(&experiment.workload) {
        let ran = task.finish_s - task.start_s;
        assert!(
            (ran - template.solo_duration_s).abs() < 1e-6 * template.solo_duration_s.max(1.0),
            "task {}: ran {ran} s, alone {} s",
            task.id,
            template.solo_duration_s
        );
    }
}

/// In both modes of job information: the baselines decide from reports alone as well as
/// from profiles. None of them fences its jobs.
#[test]
fn every_baseline_conserves_work_and_loses_no_task() {
    for (job_info, worker) in [
        (JobInfo::None, "k80"),
        (JobInfo::None, "p100"),
        (JobInfo::Profiled, "k80"),
        (JobInfo::Profiled, "p100"),
    ] {
        let experiment = experiment_in(job_info, worker, 40, 3, 2.0, 3);
        for name in ["exclusive", "packing", "util", "memory", "reference"] {
            let metrics = run(&experiment, name);
            assert_bookkeeping(&experiment, &metrics);
            assert_eq!(metrics.fenced_ooms, 0, "{job_info} {worker} {name}: fenced");
            if name != "reference" {
                // Nothing tunes: sharing can only slow a job down.
                for (task, template) in metrics.tasks.iter().zip(&experiment.workload) {
                    if task.ooms == 0 {
                        assert!(
                            task.finish_s - task.start_s >= template.solo_duration_s * (1.0 - 1e-9),
                            "{job_info} {name}: task {} faster than alone",
                            task.id
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_same_seed_gives_the_same_numbers() {
    let a = experiment("p100", 30, 3, 2.0, 11);
    let b = experiment("p100", 30, 3, 2.0, 11);
    for name in ["packing", "reference"] {
        let (x, y) = (run(&a, name).summary(), run(&b, name).summary());
        assert_eq!(
            (x.avg_ct_s, x.p99_ct_s, x.makespan_s, x.ooms, x.avg_util),
            (y.avg_ct_s, y.p99_ct_s, y.makespan_s, y.ooms, y.avg_util),
            "{name}"
        );
    }
    let c = experiment("p100", 30, 3, 2.0, 12);
    assert_ne!(
        run(&a, "packing").summary().avg_ct_s,
        run(&c, "packing").summary().avg_ct_s
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, .. ProptestConfig::default() })]

    #[test]
    fn bookkeeping_holds_for_any_stream(seed in 0u64..10_000, gpus in 1usize..5, load in 0.5f64..4.0) {
        let experiment = experiment("k80", 25, gpus, load, seed);
        for name in ["packing", "util", "memory"] {
            let metrics = run(&experiment, name);
            assert_bookkeeping(&experiment, &metrics);
        }
    }
}

/// The iadeep policies and the oracle keep the books in a world whose memory is not affine
/// in the batch size, with the jobs' default information (no profiles). Their agents are
/// fenced at the placer's reservations and the tuners' memory bounds, which never add up
/// to more than a card: a run that needs more than its fence fails its own allocation
/// and falls back, so no out-of-memory crash reaches a card. The oracle knows the world's
/// memory (its bounds take the largest fragmentation): it never exceeds its fences either.
/// The ablation without the tuner included: once its agent fell back below m0, its tuner
/// (which may only assign m0) does not assign m0 again past what the memory model vouches
/// for, where the fence would protect nobody.
#[test]
fn iadeep_keeps_the_books_and_no_out_of_memory_error_reaches_a_card() {
    for worker in ["k80", "p100"] {
        // Loaded enough that GPUs are shared and tuned.
        let experiment = experiment(worker, 30, 3, 3.0, 5);
        for name in ["iadeep", "iadeep-no-tuner", "iadeep-no-predictor", "oracle"] {
            let metrics = run(&experiment, name);
            assert_bookkeeping(&experiment, &metrics);
            assert_eq!(
                metrics.ooms, 0,
                "{worker} {name}: memory went over the card"
            );
            if name == "oracle" {
                assert_eq!(metrics.fenced_ooms, 0, "{worker} oracle: over a fence");
            }
            if name != "iadeep-no-tuner" {
                assert!(metrics.tuning_rounds > 0, "{worker} {name}: never tuned");
            }
            if worker == "k80" && name == "iadeep" {
                // The tuner's GP and the predictor's forest are seeded: same numbers again.
                let again = run(&experiment, name).summary();
                let first = metrics.summary();
                assert_eq!(
                    (first.avg_ct_s, first.makespan_s, first.tuning_rounds),
                    (again.avg_ct_s, again.makespan_s, again.tuning_rounds)
                );
            }
        }
    }
}

/// A policy with its agents' memory fences taken away: every out-of-memory error is a
/// crash again, so a test can see what the memory accounting alone achieves.
struct Unfenced(Box<dyn policy::Policy>);

impl policy::Policy for Unfenced {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn place(
        &mut self,
        view: &dyn crate::view::PolicyView,
        task: crate::view::Waiting<'_>,
    ) -> policy::PlaceOrQueue {
        match self.0.place(view, task) {
            policy::PlaceOrQueue::Place {
                device,
                batch_size,
                shrinks,
                ..
            } => policy::PlaceOrQueue::Place {
                device,
                batch_size,
                shrinks,
                fence_mib: None,
            },
            queue => queue,
        }
    }
    fn tunes(&self) -> bool {
        self.0.tunes()
    }
    fn first_tune_in_s(&self) -> Option<f64> {
        self.0.first_tune_in_s()
    }
    fn tune(&mut self, view: &dyn crate::view::PolicyView, device: usize) -> policy::TuneStep {
        self.0.tune(view, device)
    }
    fn on_oom(&mut self, device: usize, task: usize, batch_size: u32) -> policy::OomAction {
        self.0.on_oom(device, task, batch_size)
    }
    fn on_finish(&mut self, device: usize, task: usize) {
        self.0.on_finish(device, task)
    }
    fn on_left(&mut self, device: usize, task: usize) {
        self.0.on_left(device, task)
    }
    fn take_evictions(&mut self) -> Vec<usize> {
        self.0.take_evictions()
    }
}

/// A stream on which the tuner crashed two tasks when it grew them one doubling past the one
/// size they were measured at (ResNet-50's memory bends there): memory measured once is now
/// extrapolated as steeply as memory measured at two sizes, and nothing crashes. Later, with
/// the predictor refitted at production's cadence, three tasks measured at 16, 32 and 64
/// crashed at 128 under the measured curvature's bound: a jump longer than a step is now
/// bounded by the prior whatever was measured below it (`TaskKnowledge::upper_bounds`). Without
/// fences (a fence would turn such a crash into a fenced out-of-memory of the task alone,
/// and hide what the extrapolation does) and with profiles, where the one measured size
/// was the profile's: without profiles a job of unknown memory joins a card on a
/// provisional grant that only its fence makes safe.
#[test]
fn iadeep_does_not_crash_a_task_grown_past_the_one_size_it_was_measured_at() {
    let experiment = experiment_in(JobInfo::Profiled, "k80", 60, 6, 1.0, 6);
    let mut policy = Unfenced(experiment.policy("iadeep").expect("policy"));
    let metrics = experiment
        .run_policy(&mut policy, &mut |_, _| {})
        .expect("runs");
    assert_bookkeeping(&experiment, &metrics);
    assert!(metrics.tuning_rounds > 0, "never tuned");
    assert_eq!(metrics.fenced_ooms, 0, "fenced without fences");
    assert_eq!(metrics.ooms, 0, "memory went over the card");
}

/// Whether two tasks ran on one device at the same time (first start to finish).
fn shared_a_device(metrics: &RunMetrics) -> bool {
    metrics.tasks.iter().enumerate().any(|(i, a)| {
        metrics.tasks[i + 1..]
            .iter()
            .any(|b| a.device == b.device && a.start_s < b.finish_s && b.start_s < a.finish_s)
    })
}

/// Under a burst far larger than the cluster, iadeep's placer co-locates instead of
/// queueing everything, while exclusive FIFO never shares a device; in the default mode,
/// where no job brings a profile or a memory figure (a provisional grant, then the
/// measured peak, makes room next to a resident).
#[test]
fn iadeep_co_locates_under_a_burst() {
    let experiment = experiment("p100", 30, 3, 4.0, 7);
    assert!(!shared_a_device(&run(&experiment, "exclusive")));
    let metrics = run(&experiment, "iadeep-no-tuner");
    assert_bookkeeping(&experiment, &metrics);
    assert!(
        shared_a_device(&metrics),
        "iadeep never shared a device with 30 tasks on 3 GPUs"
    );
}

/// The placement audit assesses each task as the placer decides it: with the profile
/// registry's entry of its model when it brings no profile. A "place" verdict is the
/// placer's, so the task has started by then (the audit once assessed the task without
/// the registry's profile, and said "place" for tasks the placer kept queued for hours).
#[test]
fn the_audit_sees_the_task_the_placer_decides_on() {
    let experiment = experiment("k80", 80, 4, 2.0, 5);
    let mut policy = experiment.policy("iadeep").expect("policy");
    let (metrics, records) = experiment
        .run_policy_audited(policy.as_mut(), &mut |_, _| {})
        .expect("audited run");
    assert_bookkeeping(&experiment, &metrics);
    let placed: Vec<_> = records.iter().filter(|r| r.verdict == "place").collect();
    assert!(placed.len() >= 80, "{} place verdicts", placed.len());
    let wrong: Vec<_> = placed
        .iter()
        .filter(|r| r.started_s.is_none_or(|started| started > r.at_s + 1e-6))
        .map(|r| (r.task, r.at_s, r.started_s))
        .collect();
    assert!(
        wrong.is_empty(),
        "said place, but the task started later: {wrong:?}"
    );
}

/// Runs every task alone at its smallest allowed batch size and never tunes: after the
/// placement nothing on its device causes an event until it finishes.
struct SmallestAlone;

impl policy::Policy for SmallestAlone {
    fn name(&self) -> &str {
        "smallest-alone"
    }
    fn place(
        &mut self,
        view: &dyn crate::view::PolicyView,
        task: crate::view::Waiting<'_>,
    ) -> policy::PlaceOrQueue {
        match (0..view.devices()).find(|d| view.resident_count(*d) == 0) {
            Some(device) => {
                let smallest = task.spec.batch_sizes.first().copied();
                policy::PlaceOrQueue::place(device, smallest.unwrap_or(task.batch_size))
            }
            None => policy::PlaceOrQueue::Queue,
        }
    }
    fn tunes(&self) -> bool {
        false
    }
    fn tune(&mut self, _: &dyn crate::view::PolicyView, _: usize) -> policy::TuneStep {
        policy::TuneStep::Done
    }
}

/// A job's statistical efficiency follows φ as it trains even when nothing happens on its
/// device: with the default refresh (every 10 s) the completion times are those of a
/// refresh every 2 s (within 1 %). Without refreshes (one per 10⁹ s) a job kept below m0 keeps the
/// efficiency of its first minutes, when φ is small and small batches are worth the
/// most, and finishes far sooner than the world allows: the error `pollux` profited from
/// before the refresh existed.
#[test]
fn efficiency_follows_progress_without_events_on_the_device() {
    let avg_ct = |refresh_s: f64| {
        let mut experiment = experiment("k80", 20, 4, 1.0, 3);
        experiment.params.engine.progress_refresh_s = refresh_s;
        let metrics = experiment
            .run_policy(&mut SmallestAlone, &mut |_, _| {})
            .expect("runs");
        assert_bookkeeping(&experiment, &metrics);
        metrics.summary().avg_ct_s
    };
    let fine = avg_ct(2.0);
    let default = avg_ct(crate::engine::EngineParams::default().progress_refresh_s);
    let never = avg_ct(1e9);
    assert!(
        (default / fine - 1.0).abs() < 0.01,
        "default refresh {default} s vs 2 s refresh {fine} s"
    );
    assert!(
        never < 0.9 * fine,
        "stale efficiency {never} s vs refreshed {fine} s"
    );
}

/// Wraps a policy and records every offer: (time, task, told to wait) and the spec seen.
struct Recording {
    inner: Box<dyn policy::Policy>,
    offers: Vec<(f64, usize, bool)>,
    specs: std::collections::BTreeMap<usize, crate::view::JobSpec>,
}

impl policy::Policy for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn place(
        &mut self,
        view: &dyn crate::view::PolicyView,
        task: crate::view::Waiting<'_>,
    ) -> policy::PlaceOrQueue {
        let decision = self.inner.place(view, task);
        self.offers.push((
            view.now_s(),
            task.spec.id,
            decision == policy::PlaceOrQueue::Queue,
        ));
        self.specs.insert(task.spec.id, task.spec.clone());
        decision
    }
    fn tunes(&self) -> bool {
        self.inner.tunes()
    }
    fn first_tune_in_s(&self) -> Option<f64> {
        self.inner.first_tune_in_s()
    }
    fn tune(&mut self, view: &dyn crate::view::PolicyView, device: usize) -> policy::TuneStep {
        self.inner.tune(view, device)
    }
    fn on_oom(&mut self, device: usize, task: usize, batch_size: u32) -> policy::OomAction {
        self.inner.on_oom(device, task, batch_size)
    }
    fn on_finish(&mut self, device: usize, task: usize) {
        self.inner.on_finish(device, task)
    }
    fn on_left(&mut self, device: usize, task: usize) {
        self.inner.on_left(device, task)
    }
    fn take_evictions(&mut self) -> Vec<usize> {
        self.inner.take_evictions()
    }
}

fn recorded(experiment: &Experiment, name: &str) -> Recording {
    let mut recording = Recording {
        inner: experiment.policy(name).expect("policy"),
        offers: Vec::new(),
        specs: Default::default(),
    };
    let metrics = experiment
        .run_policy(&mut recording, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_bookkeeping(experiment, &metrics);
    recording
}

/// Whether some pass offered a later task after an earlier one was told to wait.
fn backfilled(offers: &[(f64, usize, bool)]) -> bool {
    offers
        .windows(2)
        .any(|w| w[0].2 && w[1].0 == w[0].0 && w[1].1 > w[0].1)
}

/// Level baselines: every policy is offered waiting tasks by the same rule (per-task
/// backfill by default, FIFO when asked for all) and sees the same spec of every task:
/// by default no solo profile and no memory figure (what `iadeep run` brings), with
/// `JobInfo::Profiled` every task's profile.
#[test]
fn every_policy_gets_the_same_admission_and_the_same_information() {
    assert_eq!(
        crate::engine::EngineParams::default().job_info,
        JobInfo::None
    );
    let experiment = experiment("k80", 24, 2, 4.0, 3);
    // Every policy but the two ablations and the single-part oracles (same placer as
    // iadeep and the oracle, and slow in debug).
    let names = crate::POLICY_NAMES
        .iter()
        .filter(|name| !name.starts_with("iadeep-") && !name.starts_with("oracle-"));
    let mut first: Option<Recording> = None;
    for name in names {
        let recording = recorded(&experiment, name);
        assert!(
            backfilled(&recording.offers),
            "{name}: a waiting task held back the tasks behind it"
        );
        assert_eq!(recording.specs.len(), experiment.workload.len(), "{name}");
        for (id, spec) in &recording.specs {
            assert_eq!(spec.profile, None, "{name}: task {id} came with a profile");
        }
        if let Some(first) = &first {
            for (id, spec) in &recording.specs {
                if let Some(other) = first.specs.get(id) {
                    assert_eq!(spec, other, "{name}: task {id} seen differently");
                }
            }
        } else {
            first = Some(recording);
        }
    }
    // With profiles every task brings one, the same for every policy.
    let profiled = experiment_in(JobInfo::Profiled, "k80", 24, 2, 4.0, 3);
    let exclusive = recorded(&profiled, "exclusive");
    let iadeep = recorded(&profiled, "iadeep-no-tuner");
    assert_eq!(exclusive.specs.len(), profiled.workload.len());
    for (id, spec) in &exclusive.specs {
        assert!(spec.profile.is_some(), "task {id} without its profile");
        assert_eq!(
            iadeep.specs.get(id),
            Some(spec),
            "task {id} seen differently"
        );
    }
    // One rule for all: FIFO for every policy, iadeep included.
    let mut fifo = experiment;
    fifo.params.engine.admission = policy::Admission::Fifo;
    for name in ["exclusive", "pollux", "iadeep-no-tuner"] {
        let recording = recorded(&fifo, name);
        assert!(
            !backfilled(&recording.offers),
            "{name}: a later task passed a waiting one under FIFO"
        );
    }
}

/// `pollux` never shares a GPU and moves jobs off their m0 when the objective says so;
/// `reference-fixed` runs as the reference does, under its own name.
#[test]
fn pollux_and_the_fixed_reference_keep_the_books() {
    let experiment = experiment("p100", 20, 3, 2.0, 4);
    let metrics = run(&experiment, "pollux");
    assert_bookkeeping(&experiment, &metrics);
    assert!(!shared_a_device(&metrics));
    assert_eq!(metrics.ooms, 0);
    assert!(metrics.tuning_rounds > 0, "pollux never tried a batch size");
    assert!(
        metrics
            .tasks
            .iter()
            .zip(&experiment.workload)
            .any(|(t, w)| t.final_batch_size != w.m0),
        "pollux kept every job at its m0"
    );
    let fixed = run(&experiment, "reference-fixed");
    assert_bookkeeping(&experiment, &fixed);
    assert_eq!(fixed.policy, "reference-fixed");
}

/// What an agent reported, as a policy saw it at a tuning call.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Seen {
    at_s: f64,
    task: usize,
    batch_size: u32,
    oom_batch_size: Option<u32>,
    running: bool,
}

/// Places every task on device 0 with its fence from `fences` (by task id), at
/// `batch_sizes` (by task id; its waiting batch size when absent), and records what the
/// agents reported at each tuning call, every 2 s.
struct Together {
    fences: Vec<Option<u64>>,
    batch_sizes: Vec<Option<u32>>,
    seen: Vec<Seen>,
}

impl policy::Policy for Together {
    fn name(&self) -> &str {
        "together"
    }
    fn place(
        &mut self,
        _: &dyn crate::view::PolicyView,
        task: crate::view::Waiting<'_>,
    ) -> policy::PlaceOrQueue {
        let id = task.spec.id;
        policy::PlaceOrQueue::Place {
            device: 0,
            batch_size: self.batch_sizes[id].unwrap_or(task.batch_size),
            shrinks: Vec::new(),
            fence_mib: self.fences[id],
        }
    }
    fn tunes(&self) -> bool {
        true
    }
    fn first_tune_in_s(&self) -> Option<f64> {
        Some(2.0)
    }
    fn tune(&mut self, view: &dyn crate::view::PolicyView, device: usize) -> policy::TuneStep {
        for r in view.residents(device) {
            self.seen.push(Seen {
                at_s: view.now_s(),
                task: r.spec.id,
                batch_size: r.report.batch_size,
                oom_batch_size: r.report.oom_batch_size,
                running: r.report.running,
            });
        }
        policy::TuneStep::Wait {
            again_in_s: Some(2.0),
        }
    }
}

/// Two jobs for one K80: `b` (task 0, submitted first) and `a` (task 1, a second later),
/// such that `a` at its m0 and `b` together need more than the card, while `a` one
/// halving smaller (`fallback`) fits next to `b`. With `b` fenced at its largest possible
/// peak, `fence_a` (the rest of the card) is below anything `a` needs at m0 and above
/// anything it needs at `fallback`.
struct Pair {
    world: crate::world::World,
    tasks: Vec<crate::workload::TaskTemplate>,
    fallback: u32,
    fence_a: u64,
    fence_b: u64,
}

fn pair() -> Pair {
    use crate::world::memory::FRAGMENTATION_MAX;
    let gavel = GavelThroughputs::bundled().expect("bundled gavel");
    let world = crate::world::World::new(&gavel, "k80", None, Default::default()).expect("world");
    let catalogue = &world.catalogue;
    let capacity = world.memory.capacity_mib;
    let least = |job| world.memory.peak_mib(job, 0.0);
    let most = |job| world.memory.peak_mib(job, FRAGMENTATION_MAX);
    let (a, b, fallback, fence_a, fence_b) = (0..catalogue.len())
        .flat_map(|a| (0..catalogue.len()).map(move |b| (a, b)))
        .find_map(|(a, b)| {
            let info = &catalogue.types[a];
            let family = &catalogue.families[info.family];
            let fallback = *family
                .batch_sizes
                .iter()
                .rev()
                .find(|s| **s <= info.batch_size / 2)?;
            let smaller = catalogue.type_of(info.family, fallback)?;
            let fence_b = most(b);
            let fence_a = capacity.checked_sub(fence_b)?;
            (least(a) > fence_a && most(smaller) <= fence_a && least(a) + least(b) > capacity)
                .then_some((a, b, fallback, fence_a, fence_b))
        })
        .expect("a pair of K80 job types that overflow the card together");
    let template = |id: usize, job: usize, submit_s: f64| {
        let info = &catalogue.types[job];
        let solo_duration_s = 900.0;
        crate::workload::TaskTemplate {
            id,
            submit_s,
            family: info.family,
            m0: info.batch_size,
            job,
            work_samples: solo_duration_s * info.solo_steps_per_s * f64::from(info.batch_size),
            solo_duration_s,
            mem_request_mib: 0,
            max_slowdown: None,
        }
    };
    let tasks = vec![template(0, b, 0.0), template(1, a, 1.0)];
    Pair {
        world,
        tasks,
        fallback,
        fence_a,
        fence_b,
    }
}

impl Pair {
    /// Runs both jobs on one GPU, `a` fenced at `fence_a` or not and started at
    /// `a_batch_size` (its m0 when `None`); `b` fenced at its largest peak when `a` is.
    fn run(&self, fence_a: Option<u64>, a_batch_size: Option<u32>) -> (RunMetrics, Vec<Seen>) {
        let params = crate::engine::EngineParams {
            gpus: 1,
            ..Default::default()
        };
        let engine = crate::engine::Engine::new(&self.world, &self.tasks, params).expect("engine");
        let mut policy = Together {
            fences: vec![fence_a.map(|_| self.fence_b), fence_a],
            batch_sizes: vec![None, a_batch_size],
            seen: Vec::new(),
        };
        let metrics = engine.run(&mut policy, &mut |_, _| {}).expect("runs");
        (metrics, policy.seen)
    }

    /// `a`'s reports before the restart time after its start had passed.
    fn a_before_restart(&self, seen: &[Seen]) -> Vec<Seen> {
        let restart_s = crate::engine::EngineParams::default().restart_s;
        seen.iter()
            .copied()
            .filter(|s| s.task == 1 && s.at_s < self.tasks[1].submit_s + restart_s - 1.0)
            .collect()
    }
}

/// A fenced job whose run needs more than its fence fails its own allocation, not the
/// card: it reports the size that failed, falls back as the real agent does (here nothing
/// ran below, so half), loses about one step and runs on where it was; its co-runner is
/// not touched and no crash is counted.
#[test]
fn a_fenced_job_over_its_fence_falls_back_without_touching_its_co_runner() {
    let pair = pair();
    let m0 = pair.tasks[1].m0;
    let (fenced, seen) = pair.run(Some(pair.fence_a), None);
    let (a, b) = (&fenced.tasks[1], &fenced.tasks[0]);
    assert_bookkeeping_of(&pair.tasks, &fenced);
    assert_eq!(fenced.ooms, 0, "a crash reached the card");
    assert_eq!(fenced.fenced_ooms, 1);
    assert_eq!((a.fenced_ooms, a.ooms), (1, 0));
    assert_eq!((b.fenced_ooms, b.ooms), (0, 0), "the co-runner was touched");
    assert_eq!(a.final_batch_size, pair.fallback);
    assert_eq!((a.device, a.start_s), (0, 1.0), "the job left its GPU");
    // It runs on at the fall-back size after the step it lost (long before a restart),
    // and its agent tells the tuner which size failed; the co-runner's reports say
    // nothing of the kind.
    let step_s = 1.0
        / pair
            .world
            .steps_per_s(pair.tasks[1].job, std::iter::once(pair.tasks[0].job));
    let early = pair.a_before_restart(&seen);
    let first_run = early
        .iter()
        .find(|s| s.running)
        .expect("it ran again before the restart time");
    assert!(first_run.at_s <= 1.0 + step_s + 2.0, "{first_run:?}");
    assert!(
        early
            .iter()
            .all(|s| s.oom_batch_size == Some(m0) && (!s.running || s.batch_size == pair.fallback))
    );
    assert!(
        seen.iter()
            .all(|s| s.task == 1 || s.oom_batch_size.is_none())
    );
    // It lost one step: against the same jobs with `a` started at the fall-back size, both
    // end within a few of `a`'s steps of the same time.
    let (direct, _) = pair.run(Some(pair.fence_a), Some(pair.fallback));
    assert_eq!((direct.ooms, direct.fenced_ooms), (0, 0));
    for task in 0..2 {
        let late_s = fenced.tasks[task].finish_s - direct.tasks[task].finish_s;
        assert!(
            late_s.abs() <= 3.0 * step_s,
            "task {task} ended {late_s} s later (a step of a: {step_s} s)"
        );
    }
}

/// Without a fence the same jobs overflow the card: the job that allocated last crashes,
/// counted as a crash, and runs again only after the restart time, at half its batch
/// size, as before fences existed.
#[test]
fn an_unfenced_job_over_the_card_crashes_as_before() {
    let pair = pair();
    let m0 = pair.tasks[1].m0;
    let (unfenced, seen) = pair.run(None, None);
    let (a, b) = (&unfenced.tasks[1], &unfenced.tasks[0]);
    assert_bookkeeping_of(&pair.tasks, &unfenced);
    assert_eq!((unfenced.ooms, unfenced.fenced_ooms), (1, 0));
    assert_eq!((a.ooms, a.fenced_ooms), (1, 0));
    assert_eq!((b.ooms, b.fenced_ooms), (0, 0));
    assert_eq!(a.final_batch_size, pair.fallback);
    let early = pair.a_before_restart(&seen);
    assert!(!early.is_empty());
    assert!(
        early
            .iter()
            .all(|s| !s.running && s.oom_batch_size == Some(m0))
    );
    assert!(
        seen.iter()
            .any(|s| s.task == 1 && s.running && s.batch_size == pair.fallback)
    );
}

/// The single-part oracles (the gap attributed, `policy::iadeep::Oracle`) each replace
/// exactly their part: `oracle-tuning` runs no tuner search (and so its predictor gets
/// no samples), `oracle-prediction` still tunes but its placer learns no sample, the
/// others tune and learn as `iadeep` does. All keep the books and crash no card.
#[test]
fn each_single_part_oracle_replaces_its_part_only() {
    let experiment = experiment("k80", 30, 3, 3.0, 5);
    for name in [
        "oracle-prediction",
        "oracle-memory",
        "oracle-tuning",
        "oracle-wait",
    ] {
        let mut policy = experiment.policy(name).expect("policy");
        assert_eq!(policy.name(), name);
        let metrics = experiment
            .run_policy(policy.as_mut(), &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bookkeeping(&experiment, &metrics);
        assert_eq!(metrics.ooms, 0, "{name}: memory went over the card");
        assert!(metrics.tuning_rounds > 0, "{name}: never tuned");
        let said = policy.diagnostics();
        let count = |label: &str| -> u64 {
            let rest = &said[said.find(label).unwrap_or_else(|| panic!("{said}")) + label.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits
                .parse()
                .unwrap_or_else(|_| panic!("{label} in {said}"))
        };
        let (searches, accepted) = (count("tuning searches "), count("accepted "));
        match name {
            "oracle-tuning" => assert_eq!((searches, accepted), (0, 0), "{said}"),
            "oracle-prediction" => assert!(searches > 0 && accepted == 0, "{said}"),
            _ => assert!(searches > 0 && accepted > 0, "{said}"),
        }
    }
}

/// `oracle-wait` given iadeep's run of the experiment (as `iadeep sim` does when iadeep
/// ran first) reads the same waits as when it runs iadeep itself, so its figures are
/// the same: the run it skips is deterministic.
#[test]
fn oracle_wait_from_iadeeps_run_is_oracle_wait() {
    let experiment = experiment("k80", 30, 3, 3.0, 5);
    let iadeep = run(&experiment, "iadeep");
    let mut given = experiment
        .policy_after("oracle-wait", Some(&iadeep))
        .expect("policy");
    let given = experiment
        .run_policy(given.as_mut(), &mut |_, _| {})
        .expect("run");
    let own = run(&experiment, "oracle-wait");
    assert_eq!(given.tasks, own.tasks);
}
