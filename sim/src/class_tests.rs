//! Job classes, per-class results, evictions and the `priority` baseline (issue 27), on
//! hand-built streams where the expected numbers can be worked out.

use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_datasets::philly;

use crate::engine::{Engine, EngineParams};
use crate::experiment::{Experiment, ExperimentParams};
use crate::metrics::RunMetrics;
use crate::policy::{self, PlaceOrQueue, Policy, TuneStep};
use crate::view::{PolicyView, Waiting};
use crate::workload::TaskTemplate;
use crate::world::{TypeId, World};

fn world() -> World {
    let gavel = GavelThroughputs::bundled().expect("bundled gavel");
    World::new(&gavel, "k80", None, Default::default()).expect("world")
}

/// A job of type `job` submitted at `submit_s` that runs `solo_s` alone at m0.
fn job(world: &World, id: usize, job: TypeId, submit_s: f64, solo_s: f64) -> TaskTemplate {
    let info = &world.catalogue.types[job];
    TaskTemplate {
        id,
        submit_s,
        family: info.family,
        m0: info.batch_size,
        job,
        work_samples: solo_s * info.solo_steps_per_s * f64::from(info.batch_size),
        solo_duration_s: solo_s,
        mem_request_mib: 0,
        max_slowdown: None,
    }
}

fn run(
    world: &World,
    tasks: &[TaskTemplate],
    params: EngineParams,
    p: &mut dyn Policy,
) -> RunMetrics {
    let engine = Engine::new(world, tasks, params).expect("engine");
    engine.run(p, &mut |_, _| {}).expect("runs")
}

fn stream(fraction: f64, seed: u64) -> Vec<TaskTemplate> {
    let gavel = GavelThroughputs::bundled().expect("bundled gavel");
    let trace = philly::bundled().expect("bundled philly");
    let mut params = ExperimentParams::default();
    params.workload.seed = seed;
    params.workload.production_fraction = fraction;
    params.workload.max_slowdown = 1.25;
    Experiment::new(params, &gavel, &trace)
        .expect("experiment")
        .workload
}

/// Each job is production with the given probability, with the stream's cap; the jobs
/// themselves do not depend on the fraction.
#[test]
fn class_draws_respect_the_production_fraction() {
    for seed in [1, 2] {
        let none = stream(0.0, seed);
        let all = stream(1.0, seed);
        let half = stream(0.5, seed);
        assert!(none.iter().all(|t| t.max_slowdown.is_none()));
        assert!(all.iter().all(|t| t.max_slowdown == Some(1.25)));
        let production = half.iter().filter(|t| t.max_slowdown.is_some()).count();
        // 300 draws at 0.5: 150 ± 8.7 (one standard deviation).
        assert!(
            (115..=185).contains(&production),
            "{production} of {} production",
            half.len()
        );
        for (a, b) in none.iter().zip(&half) {
            let unclassed = TaskTemplate {
                max_slowdown: None,
                ..b.clone()
            };
            assert_eq!(*a, unclassed, "the stream moved with the fraction");
        }
    }
}

/// Places every waiting task on device 0 at m0, next to whatever runs there; with
/// `evict_at`, evicts the task on device 0 at each of those times (it tunes every
/// `EngineParams::tune_interval_s` to get the chance).
#[derive(Default)]
struct Scripted {
    evict_at: Vec<f64>,
    evictions: Vec<usize>,
    alone: bool,
}

impl Policy for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        if self.alone && view.resident_count(0) > 0 {
            return PlaceOrQueue::Queue;
        }
        PlaceOrQueue::place(0, task.batch_size)
    }
    fn tunes(&self) -> bool {
        !self.evict_at.is_empty()
    }
    fn tune(&mut self, view: &dyn PolicyView, device: usize) -> TuneStep {
        if self.evict_at.first().is_some_and(|at| view.now_s() >= *at) {
            self.evict_at.remove(0);
            self.evictions
                .extend(view.residents(device).iter().map(|r| r.spec.id));
        }
        TuneStep::Wait { again_in_s: None }
    }
    fn take_evictions(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.evictions)
    }
}

/// A production job next to an opportunistic one that slows it past its cap: it runs
/// above its cap exactly while they overlap, and each class reports its own job.
#[test]
fn per_class_results_of_a_hand_built_run() {
    let world = world();
    let n = world.catalogue.len();
    let cap = 1.10;
    // A pair that fits the card (peaks at the most fragmentation) and slows the first
    // past the cap.
    let (a, b, pd) = (0..n)
        .flat_map(|a| (0..n).map(move |b| (a, b)))
        .find_map(|(a, b)| {
            let most = |j| {
                world
                    .memory
                    .peak_mib(j, crate::world::memory::FRAGMENTATION_MAX)
            };
            let pd = world.catalogue.types[a].solo_steps_per_s
                / world.steps_per_s(a, std::iter::once(b));
            (world.memory.fits([most(a), most(b)].into_iter()) && pd > cap + 0.05)
                .then_some((a, b, pd))
        })
        .expect("a pair that fits and slows the first past the cap");
    let mut tasks = vec![
        job(&world, 0, a, 0.0, 3600.0),
        job(&world, 1, b, 100.0, 1800.0),
    ];
    tasks[0].max_slowdown = Some(cap);
    let params = EngineParams {
        gpus: 1,
        ..EngineParams::default()
    };
    let metrics = run(&world, &tasks, params, &mut Scripted::default());
    let (p, o) = (&metrics.tasks[0], &metrics.tasks[1]);
    let overlap = p.finish_s.min(o.finish_s) - o.start_s;
    assert!(overlap > 1000.0, "{p:?} {o:?}");
    assert!((p.running_s - (p.finish_s - p.start_s)).abs() < 1e-6);
    assert!(
        (p.above_cap_s - overlap).abs() < 1e-6,
        "above its cap {} s, overlapped {overlap} s (PD {pd})",
        p.above_cap_s
    );
    // At its m0 all along, shared while they overlap.
    let at = p.above_cap_where;
    assert_eq!((at.below_m0_s, at.above_m0_s), (0.0, 0.0), "{at:?}");
    assert!((at.shared_s - overlap).abs() < 1e-6, "{at:?}");
    let summary = metrics.summary();
    let (prod, opp) = (&summary.classes.production, &summary.classes.opportunistic);
    assert_eq!((prod.tasks, opp.tasks), (1, 1));
    assert_eq!(prod.avg_ct_s, p.completion_s());
    assert_eq!(prod.p99_ct_s, p.completion_s());
    assert_eq!(opp.avg_ct_s, o.completion_s());
    assert!((prod.above_cap_frac - overlap / p.running_s).abs() < 1e-9);
    assert_eq!((prod.evictions, opp.evictions), (0, 0));
    // The opportunistic job is measured against the production default: whether it ran
    // above it depends on what the production job does to it.
    let opp_pd =
        world.catalogue.types[b].solo_steps_per_s / world.steps_per_s(b, std::iter::once(a));
    let expected = if opp_pd > iadeep_proto::DEFAULT_MAX_SLOWDOWN {
        overlap / o.running_s
    } else {
        0.0
    };
    assert!((opp.above_cap_frac - expected).abs() < 1e-9, "{opp:?}");
    // Alone, nobody is above any cap.
    let alone = run(
        &world,
        &tasks,
        EngineParams {
            gpus: 1,
            ..EngineParams::default()
        },
        &mut Scripted {
            alone: true,
            ..Scripted::default()
        },
    );
    let summary = alone.summary();
    assert_eq!(summary.classes.production.above_cap_frac, 0.0);
    assert_eq!(summary.classes.opportunistic.above_cap_frac, 0.0);
}

/// An evicted job loses exactly its progress since its last checkpoint, counted from its
/// last restart: evicted after 1,000 s of running (checkpoint at 600 s) it loses 400 s;
/// placed again after the restart time and evicted 700 s later, it loses 100 s more; then
/// it finishes with all its work done, that much later.
#[test]
fn an_eviction_loses_exactly_the_work_since_the_last_checkpoint() {
    let world = world();
    let solo_s = 3600.0;
    let tasks = vec![job(&world, 0, 0, 0.0, solo_s)];
    let params = EngineParams {
        gpus: 1,
        tune_interval_s: 100.0,
        checkpoint_every_s: 600.0,
        ..EngineParams::default()
    };
    let restart_s = params.restart_s;
    let second = 1000.0 + restart_s + 700.0;
    let mut policy = Scripted {
        evict_at: vec![1000.0, second],
        ..Scripted::default()
    };
    let metrics = run(&world, &tasks, params, &mut policy);
    let t = &metrics.tasks[0];
    assert_eq!(metrics.evictions, 2);
    assert_eq!(t.evictions, 2);
    // Alone at m0 a job progresses at its solo speed: lost seconds are running seconds.
    assert!(
        (t.evicted_work_s - 500.0).abs() < 1e-6,
        "lost {} s",
        t.evicted_work_s
    );
    assert!((t.done_samples - t.work_samples).abs() < 1e-6 * t.work_samples);
    let expected_finish = solo_s + 500.0 + 2.0 * restart_s;
    assert!(
        (t.finish_s - expected_finish).abs() < 1e-6,
        "finished at {} s, expected {expected_finish} s",
        t.finish_s
    );
    let summary = metrics.summary();
    assert_eq!(summary.classes.opportunistic.evictions, 2);
    assert!((summary.classes.opportunistic.evicted_work_s - 500.0).abs() < 1e-6);
}

/// `priority` gives a freed GPU to the production job that waits, even one submitted
/// after an opportunistic job; `exclusive` goes by submission. With 70 opportunistic jobs
/// waiting ahead (past the engine's cut of a pass) the production job is still first.
#[test]
fn priority_places_waiting_production_jobs_first() {
    let world = world();
    for ahead in [1, 70] {
        let mut tasks = vec![job(&world, 0, 0, 0.0, 1000.0)];
        for i in 0..ahead {
            tasks.push(job(&world, 1 + i, 0, 10.0 + i as f64, 600.0));
        }
        let production = tasks.len();
        tasks.push(job(&world, production, 0, 500.0, 600.0));
        tasks[production].max_slowdown = Some(1.1);
        let params = || EngineParams {
            gpus: 1,
            ..EngineParams::default()
        };
        let mut priority = policy::build("priority", 1).expect("priority");
        let prioritised = run(&world, &tasks, params(), priority.as_mut());
        let mut exclusive = policy::build("exclusive", 1).expect("exclusive");
        let fifo = run(&world, &tasks, params(), exclusive.as_mut());
        let near = |a: f64, b: f64| (a - b).abs() < 1e-6;
        let (p, o) = (&prioritised.tasks[production], &prioritised.tasks[1]);
        assert!(near(p.start_s, 1000.0), "{ahead} ahead: {p:?}");
        assert!(near(o.start_s, 1600.0), "{ahead} ahead: {o:?}");
        assert!(near(fifo.tasks[1].start_s, 1000.0));
        assert!(fifo.tasks[production].start_s > 1500.0);
        // Exclusive GPUs: nobody shares, nobody is above a cap.
        let summary = prioritised.summary();
        assert_eq!(summary.classes.production.above_cap_frac, 0.0);
        assert_eq!(summary.classes.opportunistic.above_cap_frac, 0.0);
    }
}

/// iadeep and the oracle with half the jobs production: every job finishes with all its
/// work (an evicted one redoes what it lost), only opportunistic jobs are evicted, and the
/// placer's evictions reach the engine (a burst on few GPUs makes production jobs evict
/// for room).
#[test]
fn iadeep_with_production_jobs_evicts_opportunistic_ones_and_keeps_the_books() {
    let gavel = GavelThroughputs::bundled().expect("bundled gavel");
    let trace = philly::bundled().expect("bundled philly");
    let mut params = ExperimentParams::default();
    params.workload.tasks = 60;
    params.workload.load = 3.0;
    params.workload.max_duration_s = 4.0 * 3600.0;
    params.workload.production_fraction = 0.5;
    params.engine.gpus = 4;
    let experiment = Experiment::new(params, &gavel, &trace).expect("experiment");
    for name in ["iadeep", "oracle"] {
        let mut policy = experiment.policy(name).expect("policy");
        let metrics = experiment
            .run_policy(policy.as_mut(), &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        crate::tests::assert_bookkeeping_of(&experiment.workload, &metrics);
        let summary = metrics.summary();
        let classes = &summary.classes;
        assert_eq!(classes.production.evictions, 0, "{name}: {classes:?}");
        assert!(classes.opportunistic.evictions > 0, "{name}: {classes:?}");
        assert_eq!(
            classes.opportunistic.evictions, metrics.evictions,
            "{name}: {classes:?}"
        );
        assert!(
            policy.diagnostics().contains("evictions for room"),
            "{}",
            policy.diagnostics()
        );
    }
}

/// The store sink writes each job's class and cap with its spec, as drawn.
#[test]
fn the_store_sink_writes_each_jobs_class_and_cap() {
    let gavel = GavelThroughputs::bundled().expect("bundled gavel");
    let trace = philly::bundled().expect("bundled philly");
    let mut params = ExperimentParams::default();
    params.workload.tasks = 12;
    params.workload.max_duration_s = 3600.0;
    params.workload.production_fraction = 0.5;
    params.workload.max_slowdown = 1.3;
    params.engine.gpus = 4;
    let experiment = Experiment::new(params, &gavel, &trace).expect("experiment");
    let mut policy = experiment.policy("exclusive").expect("policy");
    let run = experiment
        .run_policy(policy.as_mut(), &mut |_, _| {})
        .expect("run");
    let store = iadeep_state::EmbeddedStore::in_memory().expect("store");
    futures::executor::block_on(crate::store_sink::record_run(&store, &experiment, &run))
        .expect("recorded");
    let mut production = 0;
    for template in &experiment.workload {
        let id = crate::store_sink::task_id(template.id);
        let spec: iadeep_proto::TaskSpec = futures::executor::block_on(iadeep_state::typed::get(
            &store,
            &iadeep_state::keys::task_spec(&id),
        ))
        .expect("read")
        .map(|(spec, _)| spec)
        .expect("spec written");
        assert_eq!(spec.slowdown_cap(), template.max_slowdown, "{id}");
        assert_eq!(spec.max_slowdown, template.max_slowdown, "{id}");
        production += usize::from(spec.is_production());
    }
    assert!(production > 0 && production < 12, "{production} of 12");
}
