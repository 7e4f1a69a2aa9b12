//! The agent against the in-memory embedded store (the real backend, no server).

use std::sync::Arc;
use std::time::{Duration, Instant};

use iadeep_proto::{BatchSizeAssignment, LrScalingRule, Placement, TaskReport, TaskSpec};
use iadeep_state::testing::{FaultStore, Op, runtime};
use iadeep_state::{EmbeddedStore, StateStore, keys, typed};

use super::*;

fn memory_store() -> Arc<dyn StateStore> {
    Arc::new(EmbeddedStore::in_memory().expect("in-memory store"))
}

fn builder(store: &Arc<dyn StateStore>, task: &str) -> AgentBuilder {
    Agent::builder()
        .task_id(task)
        .store_handle(store.clone())
        .model("test-model")
        .initial_batch_size(64)
        .batch_size_bounds(16..=256)
        .lr_rule(LrScalingRule::Linear)
        .use_nvml(false)
        .report_interval(Duration::from_millis(100))
}

fn report(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn StateStore>,
    task: &str,
) -> Option<TaskReport> {
    rt.block_on(typed::get::<TaskReport>(
        store.as_ref(),
        &keys::task_report(task),
    ))
    .expect("read report")
    .map(|(r, _)| r)
}

/// How long a test waits for what must happen: what takes milliseconds may take seconds
/// on a loaded 2-core machine, and a passing test never waits it out.
const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `probe` every 10 ms until it returns `Some`, at most `limit`.
fn wait_for<T>(limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(value) = probe() {
            return Some(value);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

#[test]
fn builder_rejects_bad_configuration_with_the_reason() {
    let store = memory_store();
    let cases: [(AgentBuilder, &str); 5] = [
        (
            Agent::builder()
                .store_handle(store.clone())
                .initial_batch_size(8),
            "task_id",
        ),
        (builder(&store, "a/b"), "invalid task id"),
        (
            builder(&store, "t").initial_batch_size(1024),
            "outside the bounds",
        ),
        (
            builder(&store, "t").report_interval(Duration::from_millis(1)),
            "report interval",
        ),
        (
            Agent::builder()
                .task_id("t")
                .store("http://x:1")
                .initial_batch_size(8),
            "unknown scheme",
        ),
    ];
    for (builder, needle) in cases {
        let err = builder.connect().expect_err(needle).to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

#[test]
fn registers_reports_and_finishes() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "job-1").connect().expect("connect");
    assert!(agent.is_registered());
    let alive = rt
        .block_on(store.get(&keys::task_alive("job-1")))
        .expect("get");
    assert!(
        alive.is_some_and(|kv| kv.lease.is_some()),
        "alive key is leased"
    );
    let (spec, _) = rt
        .block_on(typed::get::<TaskSpec>(
            store.as_ref(),
            &keys::task_spec("job-1"),
        ))
        .expect("get")
        .expect("spec written");
    assert_eq!(
        (
            spec.initial_batch_size,
            spec.min_batch_size,
            spec.max_batch_size
        ),
        (64, 16, 256)
    );

    for _ in 0..40 {
        let bs = agent.batch_size();
        std::thread::sleep(Duration::from_millis(5));
        agent.record_step(bs, Duration::from_millis(5));
        agent.record_gradient_norms(16, 1.0 + 100.0 / 16.0, 64, 1.0 + 100.0 / 64.0);
    }
    let measured = wait_for(PATIENCE, || {
        report(&rt, &store, "job-1").filter(|r| r.steps_done == 40 && r.step_time_s > 0.0)
    })
    .expect("a report with the steps");
    assert_eq!(measured.batch_size, 64);
    assert!(
        (measured.step_time_s - 0.005).abs() < 1e-9,
        "{}",
        measured.step_time_s
    );
    assert!((measured.samples_per_s - 64.0 / 0.005).abs() < 1e-3);
    assert_eq!(measured.samples_done, 40 * 64);
    let phi = measured.grad_noise_scale.expect("noise scale");
    assert!((phi - 100.0).abs() < 1e-6, "{phi}");
    assert!(!measured.finished);

    agent.finish().expect("finish");
    let last = report(&rt, &store, "job-1").expect("final report");
    assert!(last.finished);
    assert!(last.seq > measured.seq);
    let alive = rt
        .block_on(store.get(&keys::task_alive("job-1")))
        .expect("get");
    assert!(alive.is_none(), "finish revokes the lease at once");
}

/// The loop's calls never wait for the store: with the reporter stuck in a store call
/// that never answers (held by the fault store, under an hour's operation timeout), a
/// thousand steps' worth of every call a training loop makes return, and the reporter
/// is still stuck afterwards. No clock: a call that waited would never return.
#[test]
fn the_loop_never_waits_for_a_store_that_stopped_answering() {
    let rt = runtime();
    let faults = Arc::new(FaultStore::in_memory());
    let store: Arc<dyn StateStore> = faults.clone();
    let agent = Arc::new(
        builder(&store, "job-h")
            .op_timeout(Duration::from_secs(3600))
            .connect()
            .expect("connect"),
    );
    for op in Op::ALL {
        faults.hold_next(op, usize::MAX / 2);
    }
    agent.record_step(64, Duration::from_millis(5));
    agent.report_now();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), faults.until_holding(1)).await
    })
    .expect("the reporter's next store call is held");
    let (done, finished) = std::sync::mpsc::channel();
    let trainer = agent.clone();
    let trainer = std::thread::spawn(move || {
        for step in 0..1_000u32 {
            let bs = trainer.batch_size();
            trainer.record_step(bs, Duration::from_millis(5));
            trainer.record_gradient_norms(16, 2.0, 64, 1.5);
            trainer.record_peak_memory(1_000 + u64::from(step));
            let _ = trainer.poll_change();
            let _ = (trainer.memory_limit_mib(), trainer.evicted());
            let _ = (trainer.is_registered(), trainer.reports_published());
            trainer.report_now();
        }
        let _ = trainer.report_oom(64);
        let _ = done.send(());
    });
    // A bound for a broken build only: the loop takes milliseconds.
    finished
        .recv_timeout(Duration::from_secs(60))
        .expect("the loop's calls returned while the store did not answer");
    trainer.join().expect("the trainer thread");
    assert!(
        faults.holding() >= 1,
        "the reporter is still in its store call"
    );
    faults.stop_holding();
    let agent = Arc::try_unwrap(agent).unwrap_or_else(|_| panic!("the trainer thread is done"));
    agent.finish().expect("finish once the store answers");
    let last = report(&rt, &store, "job-h").expect("final report");
    assert!(last.finished && last.oom_batch_size == Some(64), "{last:?}");
}

/// `leave()` that cannot reach the store says it could not leave, not that the task could
/// not be marked finished (it never marks it finished).
#[test]
fn leaving_without_the_store_says_so() {
    let faults = Arc::new(FaultStore::in_memory());
    for op in Op::ALL {
        faults.fail_next(op, usize::MAX / 2);
    }
    let store: Arc<dyn StateStore> = faults.clone();
    let agent = builder(&store, "job-l").connect().expect("connect");
    let err = agent.leave().expect_err("no store, no clean leave");
    assert!(matches!(err, AgentError::LeaveIncomplete { .. }), "{err:?}");
    assert!(
        err.to_string().contains("could not leave the task"),
        "{err}"
    );
}

#[test]
fn an_existing_spec_written_by_the_placer_is_kept() {
    let rt = runtime();
    let store = memory_store();
    let placed = TaskSpec {
        task_id: "job-2".into(),
        model: "from-placer".into(),
        initial_batch_size: 32,
        ..Default::default()
    };
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_spec("job-2"),
        &placed,
        None,
    ))
    .expect("put");
    let agent = builder(&store, "job-2").connect().expect("connect");
    let (spec, _) = rt
        .block_on(typed::get::<TaskSpec>(
            store.as_ref(),
            &keys::task_spec("job-2"),
        ))
        .expect("get")
        .expect("spec");
    assert_eq!(spec.model, "from-placer");
    agent.finish().expect("finish");
}

#[test]
fn a_model_named_by_the_script_replaces_the_launchers_default_when_asked() {
    let rt = runtime();
    let store = memory_store();
    let placed = TaskSpec {
        task_id: "job-2b".into(),
        model: "train".into(), // `iadeep run` names it after the script
        initial_batch_size: 64,
        gpu_mem_request_mib: 1_000,
        ..Default::default()
    };
    let key = keys::task_spec("job-2b");
    rt.block_on(typed::put(store.as_ref(), &key, &placed, None))
        .expect("put");
    let agent = builder(&store, "job-2b")
        .model("resnet18")
        .model_replaces_placed(true)
        .connect()
        .expect("connect");
    let (spec, _) = rt
        .block_on(typed::get::<TaskSpec>(store.as_ref(), &key))
        .expect("get")
        .expect("spec");
    assert_eq!(
        spec,
        TaskSpec {
            model: "resnet18".into(),
            ..placed
        },
        "only the model changes"
    );
    agent.finish().expect("finish");
}

#[test]
fn the_memory_limit_is_the_latest_of_the_reservation_and_the_applied_bounds() {
    let rt = runtime();
    let store = memory_store();
    let placement = Placement {
        task_id: "job-fence".into(),
        device_id: "gpu0".into(),
        reserved_mem_mib: 4_096,
        ..Default::default()
    };
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_placement("job-fence"),
        &placement,
        None,
    ))
    .expect("put placement");
    let agent = builder(&store, "job-fence").connect().expect("connect");
    assert_eq!(agent.memory_limit_mib(), Some(4_096));
    // The fence: the limit and the margin's 5 % of it.
    assert_eq!(agent.memory_fence_mib(), Some(4_300));
    agent.record_step(64, Duration::from_millis(1));
    let assignment = BatchSizeAssignment {
        task_id: "job-fence".into(),
        batch_size: 128,
        lr_factor: 2.0,
        round: 1,
        memory_bound_mib: Some(6_144.5),
        ..Default::default()
    };
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_assignment("job-fence"),
        &assignment,
        None,
    ))
    .expect("put assignment");
    let change = wait_for(PATIENCE, || agent.poll_change()).expect("change");
    assert_eq!(change.memory_bound_mib, Some(6_144.5));
    assert_eq!(
        agent.memory_limit_mib(),
        Some(6_144),
        "moves when the change applies"
    );
    // A fall-back brings no bound of its own: the limit stays.
    assert_eq!(agent.report_oom(128).memory_bound_mib, None);
    assert_eq!(agent.memory_limit_mib(), Some(6_144));
    // The placer rewrites the reservation (e.g. a provisional one becomes the measured
    // peak plus the margin): the latest news wins.
    let shrunk = Placement {
        reserved_mem_mib: 3_000,
        ..placement
    };
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_placement("job-fence"),
        &shrunk,
        None,
    ))
    .expect("put placement");
    assert_eq!(
        wait_for(PATIENCE, || agent
            .memory_limit_mib()
            .filter(|&m| m == 3_000)),
        Some(3_000)
    );
    agent.finish().expect("finish");
}

/// Writes `task`'s placement reserving `mib`: the agent's memory limit follows it, with
/// no change for the loop while the task stays placed, so a test that sees the new limit
/// knows the agent has handled every earlier write to the task's keys (one watch, in
/// order): the positive marker before asserting that an earlier write changed nothing.
fn put_placement(rt: &tokio::runtime::Runtime, store: &Arc<dyn StateStore>, task: &str, mib: u64) {
    let placement = Placement {
        task_id: task.into(),
        device_id: "gpu0".into(),
        reserved_mem_mib: mib,
        ..Default::default()
    };
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_placement(task),
        &placement,
        None,
    ))
    .expect("put placement");
}

#[test]
fn assignments_apply_at_poll_change_and_reports_carry_their_round() {
    let rt = runtime();
    let store = memory_store();
    put_placement(&rt, &store, "job-3", 4_000);
    let agent = builder(&store, "job-3").connect().expect("connect");
    assert_eq!(agent.poll_change(), None);
    let assign = |round: u64, batch_size: u32, lr_factor: f64| {
        let a = BatchSizeAssignment {
            task_id: "job-3".into(),
            batch_size,
            lr_factor,
            round,
            ..Default::default()
        };
        rt.block_on(typed::put(
            store.as_ref(),
            &keys::task_assignment("job-3"),
            &a,
            None,
        ))
        .expect("put assignment");
    };
    assign(1, 128, 2.0);
    let change = wait_for(PATIENCE, || agent.poll_change()).expect("change");
    assert_eq!(
        change,
        BatchSizeChange {
            batch_size: 128,
            lr_factor: 2.0,
            round: 1,
            reason: ChangeReason::Assignment,
            memory_bound_mib: None,
        }
    );
    assert_eq!(
        (agent.batch_size(), agent.round(), agent.lr_factor()),
        (128, 1, 2.0)
    );

    // Out of bounds: clamped, and the factor recomputed by the task's (linear) rule.
    assign(2, 4096, 64.0);
    let change = wait_for(PATIENCE, || agent.poll_change()).expect("change");
    assert_eq!((change.batch_size, change.lr_factor), (256, 4.0));
    // A stale round is ignored: once the agent has seen the placement written after it,
    // it has seen the stale assignment too.
    assign(1, 32, 0.5);
    put_placement(&rt, &store, "job-3", 5_000);
    wait_for(PATIENCE, || {
        agent.memory_limit_mib().filter(|&mib| mib == 5_000)
    })
    .expect("the placement written after the stale assignment");
    assert_eq!(agent.poll_change(), None);

    for _ in 0..20 {
        agent.record_step(agent.batch_size(), Duration::from_millis(10));
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = wait_for(PATIENCE, || {
        report(&rt, &store, "job-3").filter(|r| r.assignment_round == 2)
    })
    .expect("a report of round 2");
    assert_eq!(r.batch_size, 256);
    agent.finish().expect("finish");
}

#[test]
fn out_of_memory_falls_back_to_the_largest_size_that_fit_and_tells_the_tuner() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "job-4").connect().expect("connect");
    agent.record_step(64, Duration::from_millis(1));
    agent.record_step(96, Duration::from_millis(1));
    let change = agent.report_oom(200);
    assert_eq!(change.reason, ChangeReason::OutOfMemory);
    assert_eq!(change.batch_size, 96);
    assert_eq!(change.lr_factor, 96.0 / 64.0);
    assert_eq!(agent.batch_size(), 96);
    let r = wait_for(PATIENCE, || {
        report(&rt, &store, "job-4").filter(|r| r.oom_batch_size == Some(200))
    });
    assert!(r.is_some(), "the OOM reaches the store promptly");
    // Nothing smaller is known to fit below 96: halve, within bounds.
    assert_eq!(agent.report_oom(96).batch_size, 48);
    assert_eq!(agent.report_oom(20).batch_size, 16);
    agent.finish().expect("finish");
}

#[test]
fn dropping_without_finish_revokes_but_does_not_claim_finished() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "job-5").connect().expect("connect");
    drop(agent);
    assert!(
        rt.block_on(store.get(&keys::task_alive("job-5")))
            .expect("get")
            .is_none()
    );
    assert!(!report(&rt, &store, "job-5").expect("report").finished);
}

#[test]
fn a_revoked_lease_is_granted_again_and_the_alive_key_comes_back() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "job-6")
        .lease_ttl(Duration::from_secs(2))
        .connect()
        .expect("connect");
    let kv = rt
        .block_on(store.get(&keys::task_alive("job-6")))
        .expect("get")
        .expect("alive");
    let lease = kv.lease.expect("leased");
    // Someone (an operator, a store failover) kills the lease.
    rt.block_on(store.revoke_lease(lease)).expect("revoke");
    let back = wait_for(PATIENCE, || {
        rt.block_on(store.get(&keys::task_alive("job-6")))
            .expect("get")
            .filter(|kv| kv.lease != Some(lease))
    });
    assert!(back.is_some(), "the agent re-registered with a new lease");
    agent.finish().expect("finish");
}

#[test]
fn a_peak_the_trainer_records_reaches_the_report() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "job-7").connect().expect("connect");
    agent.record_peak_memory(900);
    agent.record_peak_memory(1200);
    agent.record_peak_memory(1000);
    // A peak is reported once a step has ended (see memory::PeakMemory::sample).
    agent.record_step(32, Duration::from_millis(10));
    // A report may go out between two calls; the peak of the three arrives anyway.
    let r = wait_for(PATIENCE, || {
        report(&rt, &store, "job-7").filter(|r| r.peak_mem_mib == Some(1200))
    });
    assert!(r.is_some(), "the largest recorded value reaches the store");
    agent.finish().expect("finish");
}

/// On a real GPU the process holds its CUDA context before the first step, and that
/// figure, reported as the peak, settled the job's reservation far below what its steps
/// then used (`data/measured/h200/README.md`). Reports carry no peak until a step ended.
#[test]
fn no_peak_is_reported_before_the_first_step() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "job-c").connect().expect("connect");
    agent.record_peak_memory(518);
    let before = wait_for(PATIENCE, || {
        report(&rt, &store, "job-c").filter(|r| r.seq >= 3)
    })
    .expect("reports before any step");
    assert_eq!(before.peak_mem_mib, None, "{before:?}");
    agent.record_peak_memory(6400);
    agent.record_step(64, Duration::from_millis(10));
    let after = wait_for(PATIENCE, || {
        report(&rt, &store, "job-c").filter(|r| r.peak_mem_mib.is_some())
    })
    .expect("the peak once a step ended");
    assert_eq!(
        (after.peak_mem_mib, after.peak_mem_batch_size),
        (Some(6400), 64)
    );
    agent.finish().expect("finish");
}

/// The placer writes a starting assignment with the placement; the
/// loop's very first step runs at it, not at m0.
#[test]
fn a_starting_assignment_is_applied_before_the_first_step() {
    let rt = runtime();
    let store = memory_store();
    let start = BatchSizeAssignment {
        task_id: "job-s".into(),
        batch_size: 32,
        lr_factor: 0.5,
        lr_rule: LrScalingRule::Linear as i32,
        round: 3,
        ..Default::default()
    };
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_assignment("job-s"),
        &start,
        None,
    ))
    .expect("placer's assignment");
    let agent = builder(&store, "job-s").connect().expect("connect");
    assert_eq!(agent.batch_size(), 32, "before any step");
    assert_eq!(agent.lr_factor(), 0.5);
    assert_eq!(agent.round(), 3);
    // A loop that builds its data loader from poll_change() sees it once.
    let change = agent.poll_change().expect("the starting change");
    assert_eq!((change.batch_size, change.round), (32, 3));
    assert_eq!(agent.poll_change(), None);
    agent.finish().expect("finish");
}

/// The peak reported after a shrink is the new size's, labelled with it.
#[test]
fn reported_peak_memory_belongs_to_the_current_batch_size() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "job-p").connect().expect("connect");
    agent.record_peak_memory(6000);
    agent.record_step(64, Duration::from_millis(10));
    let first = wait_for(PATIENCE, || {
        report(&rt, &store, "job-p").filter(|r| r.peak_mem_mib == Some(6000))
    })
    .expect("peak at 64 reported");
    assert_eq!(first.peak_mem_batch_size, 64);
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_assignment("job-p"),
        &BatchSizeAssignment {
            task_id: "job-p".into(),
            batch_size: 32,
            round: 1,
            ..Default::default()
        },
        None,
    ))
    .expect("shrink");
    let change = wait_for(PATIENCE, || agent.poll_change()).expect("the shrink");
    assert_eq!(change.batch_size, 32);
    agent.record_peak_memory(4500);
    // Until a step at 32 ends, reports carry the last peak at its own size (64), never
    // a figure labelled 32 (see memory::PeakMemory::sample).
    let between = wait_for(PATIENCE, || {
        report(&rt, &store, "job-p").filter(|r| r.seq >= first.seq + 3)
    })
    .expect("reports after the change, before a step at 32");
    assert_eq!(
        (between.peak_mem_mib, between.peak_mem_batch_size),
        (Some(6000), 64),
        "{between:?}"
    );
    agent.record_step(32, Duration::from_millis(5));
    let after = wait_for(PATIENCE, || {
        report(&rt, &store, "job-p").filter(|r| r.peak_mem_batch_size == 32)
    })
    .expect("a report at the new size");
    assert_eq!(
        after.peak_mem_mib,
        Some(4500),
        "not the 6000 of the larger size"
    );
    agent.finish().expect("finish");
}

/// The loop hears that its job's placement was deleted while it runs
/// (its memory is no longer reserved), and that it holds one again.
#[test]
fn a_lost_and_restored_reservation_is_a_change_for_the_loop() {
    let rt = runtime();
    let store = memory_store();
    let placement = iadeep_proto::Placement {
        task_id: "job-9".into(),
        device_id: "d0".into(),
        reserved_mem_mib: 4_000,
        batch_size: 64,
        ..Default::default()
    };
    let placement_key = keys::task_placement("job-9");
    rt.block_on(typed::put(store.as_ref(), &placement_key, &placement, None))
        .expect("placement");
    let agent = builder(&store, "job-9").connect().expect("connect");
    agent.record_step(64, Duration::from_millis(10));
    assert_eq!(agent.poll_change(), None, "placed: nothing to tell");

    rt.block_on(store.delete(&placement_key)).expect("release");
    let lost = wait_for(PATIENCE, || agent.poll_change()).expect("told");
    assert_eq!(lost.reason, ChangeReason::ReservationLost);
    assert_eq!(lost.batch_size, 64, "the batch size stays");

    rt.block_on(typed::put(store.as_ref(), &placement_key, &placement, None))
        .expect("admitted again");
    let restored = wait_for(PATIENCE, || agent.poll_change()).expect("told");
    assert_eq!(restored.reason, ChangeReason::ReservationRestored);
    agent.finish().expect("finish");
}

/// The placer's evict assignment, on a real etcd: the loop hears of it once through
/// `poll_change` (before any later assignment, whatever round it carries), `evicted()`
/// says why, the agent keeps its lease and reports while the job checkpoints, and
/// `leave()` ends it with a final report that does not claim the task finished and the
/// lease revoked. The placement is the launcher's to release: the agent leaves it.
#[test]
fn an_evict_assignment_reaches_the_loop_once_and_leave_ends_the_task_unfinished() {
    let etcd = iadeep_state::testing::start_etcd();
    let rt = runtime();
    let store: Arc<dyn StateStore> = rt
        .block_on(
            etcd.url()
                .parse::<iadeep_state::StoreUrl>()
                .expect("url")
                .open(),
        )
        .expect("open etcd");
    let task = "evict-1";
    put_placement(&rt, &store, task, 2_000);
    let agent = Agent::builder()
        .task_id(task)
        .store(&etcd.url())
        .model("test-model")
        .initial_batch_size(64)
        .batch_size_bounds(16..=256)
        .use_nvml(false)
        .report_interval(Duration::from_millis(100))
        .connect()
        .expect("connect");
    let assign = |a: BatchSizeAssignment| {
        rt.block_on(typed::put(
            store.as_ref(),
            &keys::task_assignment(task),
            &a,
            None,
        ))
        .expect("put assignment");
    };
    let shrink = BatchSizeAssignment {
        task_id: task.into(),
        batch_size: 16,
        lr_factor: 0.5,
        round: 3,
        ..Default::default()
    };
    assign(shrink.clone());
    agent.record_step(64, Duration::from_millis(5));
    let change = wait_for(PATIENCE, || agent.poll_change()).expect("the shrink");
    assert_eq!(change.batch_size, 16);
    assert_eq!(agent.evicted(), None);

    // The placer's eviction repeats the last assignment, in the same round.
    assign(BatchSizeAssignment {
        evict: true,
        evict_reason: "prod-1 ran at PD 1.31 above its cap 1.10".into(),
        ..shrink.clone()
    });
    let reason = wait_for(PATIENCE, || agent.evicted()).expect("evicted");
    assert_eq!(reason, "prod-1 ran at PD 1.31 above its cap 1.10");
    // A later assignment (a tuner that has not heard yet) neither hides nor undoes it.
    assign(BatchSizeAssignment {
        batch_size: 32,
        round: 4,
        ..shrink
    });
    // Once the agent has seen the placement rewritten after it, it has seen it.
    put_placement(&rt, &store, task, 2_500);
    wait_for(PATIENCE, || {
        agent.memory_limit_mib().filter(|&mib| mib == 2_500)
    })
    .expect("the placement written after the later assignment");
    let told = agent.poll_change().expect("the eviction, for the loop");
    assert_eq!(
        (told.reason, told.batch_size, told.round),
        (ChangeReason::Evicted, 16, 3)
    );
    assert_eq!(agent.poll_change(), None, "told once");
    assert_eq!(
        agent.batch_size(),
        16,
        "the later assignment is not applied"
    );
    assert_eq!(agent.evicted().as_deref(), Some(reason.as_str()));
    // While the job checkpoints, the task is still alive: its reservation stays counted.
    assert!(agent.is_registered());
    let seq = wait_for(PATIENCE, || report(&rt, &store, task))
        .expect("a report")
        .seq;

    agent.leave().expect("leave");
    let last = report(&rt, &store, task).expect("final report");
    assert!(
        last.seq > seq && !last.finished,
        "a final report, not finished: {last:?}"
    );
    let alive = rt
        .block_on(store.get(&keys::task_alive(task)))
        .expect("get");
    assert!(alive.is_none(), "leave revokes the lease at once");
    let kept = rt
        .block_on(typed::get::<Placement>(
            store.as_ref(),
            &keys::task_placement(task),
        ))
        .expect("get");
    assert_eq!(
        kept.map(|(p, _)| (p.task_id, p.reserved_mem_mib)),
        Some((task.to_owned(), 2_500)),
        "the launcher releases it"
    );
}

/// The class and the slowdown cap go into the spec the agent registers, and are
/// checked as the placer checks them.
#[test]
fn the_priority_class_and_cap_reach_the_spec_and_are_validated() {
    let rt = runtime();
    let store = memory_store();
    let agent = builder(&store, "prod-1")
        .priority_class(iadeep_proto::PriorityClass::Production)
        .max_slowdown(1.2)
        .connect()
        .expect("connect");
    let (spec, _) = rt
        .block_on(typed::get::<TaskSpec>(
            store.as_ref(),
            &keys::task_spec("prod-1"),
        ))
        .expect("get")
        .expect("spec");
    assert!(spec.is_production());
    assert_eq!(spec.slowdown_cap(), Some(1.2));
    agent.finish().expect("finish");

    for (builder, needle) in [
        (
            builder(&store, "t").max_slowdown(1.2),
            "max_slowdown: applies to production jobs only",
        ),
        (
            builder(&store, "t")
                .priority_class(iadeep_proto::PriorityClass::Production)
                .max_slowdown(1.0),
            "max_slowdown: 1 is not a slowdown cap",
        ),
        (
            builder(&store, "t")
                .priority_class(iadeep_proto::PriorityClass::Production)
                .max_slowdown(f64::INFINITY),
            "is not a slowdown cap",
        ),
    ] {
        let err = builder.connect().expect_err(needle).to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
}
