//! The agent SDK against a real etcd: assignment latency, outages, recovery.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use iadeep_agent::Agent;
use iadeep_proto::{BatchSizeAssignment, TaskReport};
use iadeep_state::testing::{EtcdServer, runtime, start_etcd};
use iadeep_state::{EtcdStore, StateStore, keys, typed};

fn agent(etcd: &EtcdServer, task: &str) -> Agent {
    Agent::builder()
        .task_id(task)
        .store(&etcd.url())
        .initial_batch_size(64)
        .batch_size_bounds(16..=512)
        .use_nvml(false)
        .report_interval(Duration::from_millis(200))
        .lease_ttl(Duration::from_secs(4))
        // Short enough that a loop waiting on the store would show (the outage test), long
        // enough that a loaded machine's slow fsync does not fail a registration or the
        // final report (the finishing budget is twice this plus a second).
        .op_timeout(Duration::from_secs(2))
        .connect()
        .expect("connect")
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
    .ok()
    .flatten()
    .map(|(r, _)| r)
}

/// Polls `probe` every 20 ms until it returns `Some`, at most `limit` (a bound for a
/// broken build, far above what a loaded machine needs).
fn wait_for<T>(limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe() {
            return Some(value);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The tuner's assignment reaches a running loop over a real etcd. The latency is
/// printed, not asserted: on a loaded machine it says more about the scheduler than
/// about the agent (the agent hands it over through one watch event and one atomic).
#[test]
fn an_assignment_reaches_the_running_loop() {
    let etcd = start_etcd();
    let rt = runtime();
    let store: Arc<dyn StateStore> = Arc::new(
        rt.block_on(EtcdStore::connect(&[etcd.endpoint()]))
            .expect("connect"),
    );
    let agent = agent(&etcd, "latency");
    wait_for(Duration::from_secs(30), || {
        agent.is_registered().then_some(())
    })
    .expect("the agent registers");
    let assignment = BatchSizeAssignment {
        task_id: "latency".into(),
        batch_size: 256,
        lr_factor: 2.0,
        round: 7,
        ..Default::default()
    };
    let written = Instant::now();
    rt.block_on(typed::put(
        store.as_ref(),
        &keys::task_assignment("latency"),
        &assignment,
        None,
    ))
    .expect("tuner writes the assignment");
    // The loop: 1 ms steps, polling between steps as a trainer does.
    let change = wait_for(Duration::from_secs(30), || {
        let bs = agent.batch_size();
        std::thread::sleep(Duration::from_millis(1));
        agent.record_step(bs, Duration::from_millis(1));
        agent.poll_change()
    })
    .expect("the assignment reached the loop");
    eprintln!(
        "assignment -> loop latency over etcd: {:?}",
        written.elapsed()
    );
    assert_eq!(
        (change.batch_size, change.lr_factor, change.round),
        (256, 2.0, 7)
    );
    assert_eq!(agent.batch_size(), 256);
    agent.finish().expect("finish");
}

#[test]
fn stopping_etcd_does_not_stop_the_loop_and_reports_resume() {
    let mut etcd = start_etcd();
    let rt = runtime();
    let agent = Arc::new(agent(&etcd, "outage"));
    let running = Arc::new(AtomicBool::new(true));
    let steps = Arc::new(AtomicU64::new(0));
    // Worst cost of the agent's calls in one step, in ns, while etcd is down.
    let worst_ns = Arc::new(AtomicU64::new(0));
    let measure = Arc::new(AtomicBool::new(false));
    let trainer = {
        let (agent, running, steps, worst_ns, measure) = (
            agent.clone(),
            running.clone(),
            steps.clone(),
            worst_ns.clone(),
            measure.clone(),
        );
        std::thread::spawn(move || {
            while running.load(Ordering::Relaxed) {
                let started = Instant::now();
                let bs = agent.batch_size();
                std::thread::sleep(Duration::from_millis(2));
                let before = Instant::now();
                agent.record_step(bs, before - started);
                let _ = agent.poll_change();
                let cost = u64::try_from(before.elapsed().as_nanos()).unwrap_or(u64::MAX);
                if measure.load(Ordering::Relaxed) {
                    worst_ns.fetch_max(cost, Ordering::Relaxed);
                }
                steps.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let store: Arc<dyn StateStore> = Arc::new(
        rt.block_on(EtcdStore::connect(&[etcd.endpoint()]))
            .expect("connect"),
    );
    let before = wait_for(Duration::from_secs(30), || {
        report(&rt, &store, "outage").filter(|r| r.steps_done > 0)
    })
    .expect("reports before the outage");

    etcd.stop();
    measure.store(true, Ordering::Relaxed);
    // The loop must go on stepping while etcd is down: the reporter tries to publish
    // every 200 ms and each try waits up to the 2 s operation timeout, so a loop that
    // waited for the store would manage a step every second or two, not 500 in a minute.
    let steps_at_stop = steps.load(Ordering::Relaxed);
    let during = 500;
    wait_for(Duration::from_secs(60), || {
        (steps.load(Ordering::Relaxed) >= steps_at_stop + during).then_some(())
    })
    .expect("the loop goes on while etcd is down");
    measure.store(false, Ordering::Relaxed);
    // A figure, not an assertion: a preempted thread makes any bound flaky on a loaded
    // machine. That no agent call waits for the store is asserted without a clock by the
    // agent's unit tests (`the_loop_never_waits_for_a_store_that_stopped_answering`).
    let worst = Duration::from_nanos(worst_ns.load(Ordering::Relaxed));
    eprintln!("etcd down: {during} steps of ~2 ms, worst agent cost per step {worst:?}");

    etcd.restart().expect("etcd restarts");
    let resumed = wait_for(Duration::from_secs(30), || {
        report(&rt, &store, "outage").filter(|r| r.steps_done >= steps_at_stop + during)
    })
    .expect("reports resume after etcd returns");
    assert!(resumed.seq > before.seq);
    wait_for(Duration::from_secs(30), || {
        rt.block_on(store.get(&keys::task_alive("outage")))
            .expect("get")
    })
    .expect("the task is alive again");

    running.store(false, Ordering::Relaxed);
    trainer.join().expect("trainer thread");
    let agent = Arc::try_unwrap(agent).expect("sole owner");
    agent.finish().expect("finish");
    let last = report(&rt, &store, "outage").expect("final report");
    assert!(last.finished);
}
