//! The tuner daemon against a real etcd, with in-process agents whose step time follows a
//! known synthetic surface.
//!
//! The surface: solo step time T(b) = A + C·b, co-located step time IF·T(b), gradient noise
//! scale φ. Then PD(b) = m0/T(m0) · IF·T(b)/b · (φ + b)/(φ + m0), minimised at
//! b* = √(A·φ/C) = 64 for every task, whatever the other runs. Memory: M(b) = 500 + 8·b MiB on a
//! 3000 MiB card with a 10% margin, so (128, 128) and above do not fit (3048 MiB).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::runtime;
use iadeep_agent::Agent;
use iadeep_proto::{
    BatchSizeAssignment, CoLocationSample, DeviceInfo, LrScalingRule, Placement, SoloProfile,
    TaskSpec, TunerState,
};
use iadeep_state::testing::EtcdServer;
use iadeep_state::{EtcdStore, StateStore, WatchEvent, keys, typed};
use iadeep_tuner::daemon::{Daemon, DaemonParams, RoundParams};

const A_S: f64 = 0.004;
const C_S: f64 = 0.004 / 64.0;
const PHI: f64 = 64.0;
const IF: f64 = 1.25;
const M0: u32 = 16;
const DEVICE: &str = "gpu0";
const CARD_MIB: u64 = 3000;
const MARGIN: f64 = 0.10;

fn solo_step_s(b: u32) -> f64 {
    A_S + C_S * f64::from(b)
}

fn memory_mib(b: u32) -> u64 {
    500 + 8 * u64::from(b)
}

/// Σ PD of the surface (what the tuner should measure, up to timing noise).
fn true_sum_pd(sizes: &[u32]) -> f64 {
    sizes
        .iter()
        .map(|&b| {
            let (m0, m) = (f64::from(M0), f64::from(b));
            (m0 / solo_step_s(M0)) * IF * solo_step_s(b) / m * (PHI + m) / (PHI + m0)
        })
        .sum()
}

/// One emulated training job: a thread stepping on the surface through a real agent.
struct Job {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Job {
    fn start(
        rt: &tokio::runtime::Runtime,
        store: &Arc<dyn StateStore>,
        url: &str,
        task: &str,
    ) -> Job {
        let spec = TaskSpec {
            task_id: task.into(),
            model: "synthetic".into(),
            initial_batch_size: M0,
            min_batch_size: 8,
            max_batch_size: 256,
            profile: Some(SoloProfile {
                batch_size: M0,
                step_time_s: Some(solo_step_s(M0)),
                peak_mem_mib: Some(memory_mib(M0)),
                device_kind: "test".into(),
                ..Default::default()
            }),
            lr_rule: LrScalingRule::Sqrt as i32,
            ..Default::default()
        };
        let placement = Placement {
            task_id: task.into(),
            device_id: DEVICE.into(),
            reserved_mem_mib: memory_mib(M0),
            ..Default::default()
        };
        rt.block_on(async {
            typed::put(store.as_ref(), &keys::task_spec(task), &spec, None).await?;
            typed::put(
                store.as_ref(),
                &keys::task_placement(task),
                &placement,
                None,
            )
            .await
        })
        .expect("placer writes spec and placement");
        let current = Arc::new(AtomicU32::new(M0));
        let probe_size = current.clone();
        let agent = Agent::builder()
            .task_id(task)
            .store(url)
            .model("synthetic")
            .initial_batch_size(M0)
            .batch_size_bounds(8..=256)
            .lr_rule(LrScalingRule::Sqrt)
            .device_id(DEVICE)
            .use_nvml(false)
            .memory_probe(move || Some(memory_mib(probe_size.load(Ordering::Relaxed))))
            .report_interval(Duration::from_millis(100))
            .lease_ttl(Duration::from_secs(3))
            .op_timeout(Duration::from_millis(500))
            .connect()
            .expect("agent connects");
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                agent.poll_change();
                let b = agent.batch_size();
                current.store(b, Ordering::Relaxed);
                let started = Instant::now();
                std::thread::sleep(Duration::from_secs_f64(IF * solo_step_s(b)));
                agent.record_step(b, started.elapsed());
                // Noise-free norms with |G|² = 1 and tr Σ = φ: the estimator returns φ.
                let small = (b / 4).max(1);
                let norm = |x: u32| 1.0 + PHI / f64::from(x);
                agent.record_gradient_norms(small, norm(small), b, norm(b));
            }
            let _ = agent.finish();
        });
        Job {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Round → (task, batch size) of every assignment written under it.
type AssignedRounds = BTreeMap<u64, Vec<(String, u32)>>;

fn params() -> DaemonParams {
    let mut p = DaemonParams {
        round: RoundParams {
            timeout: Duration::from_secs(5),
            reports_per_round: 2,
        },
        memory_margin: MARGIN,
        settled_interval: Duration::from_millis(500),
        idle_poll: Duration::from_millis(100),
        lease_ttl: Duration::from_secs(3),
        seed: 1,
        ..DaemonParams::default()
    };
    p.controller.patience = 6;
    p
}

fn device() -> DeviceInfo {
    DeviceInfo {
        device_id: DEVICE.into(),
        memory_mib: CARD_MIB,
        kind: "test".into(),
        name: "synthetic".into(),
        ..Default::default()
    }
}

fn tuner_state(rt: &tokio::runtime::Runtime, store: &Arc<dyn StateStore>) -> Option<TunerState> {
    rt.block_on(typed::get::<TunerState>(
        store.as_ref(),
        &keys::device_tuner(DEVICE),
    ))
    .expect("read tuner state")
    .map(|(s, _)| s)
}

/// Waits until `f` holds for the persisted state, at most `limit`.
fn wait_state(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn StateStore>,
    limit: Duration,
    f: impl Fn(&TunerState) -> bool,
) -> TunerState {
    let start = Instant::now();
    loop {
        if let Some(s) = tuner_state(rt, store)
            && f(&s)
        {
            return s;
        }
        assert!(
            start.elapsed() < limit,
            "state condition not reached within {limit:?}: {:?}",
            tuner_state(rt, store).map(|s| s.observations)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn connect(rt: &tokio::runtime::Runtime, etcd: &EtcdServer) -> Arc<dyn StateStore> {
    Arc::new(
        rt.block_on(EtcdStore::connect(&[etcd.endpoint()]))
            .expect("connect"),
    )
}

#[test]
fn the_daemon_moves_batch_sizes_towards_the_optimum_within_memory() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    // Every assignment, as the agents see it, grouped by round.
    let mut watch = rt.block_on(store.watch(keys::TASKS, None)).expect("watch");
    let assignments: Arc<std::sync::Mutex<AssignedRounds>> = Arc::default();
    let seen = assignments.clone();
    rt.spawn(async move {
        while let Some(Ok(event)) = watch.next().await {
            if let WatchEvent::Put(kv) = event
                && kv.key.ends_with("/assignment")
                && let Ok(a) = typed::decode::<BatchSizeAssignment>(&kv)
            {
                seen.lock()
                    .expect("lock")
                    .entry(a.round)
                    .or_default()
                    .push((a.task_id, a.batch_size));
            }
        }
    });
    let jobs = [
        Job::start(&rt, &store, &etcd.url(), "job-a"),
        Job::start(&rt, &store, &etcd.url(), "job-b"),
    ];
    let daemon = Daemon::new(store.clone(), device(), params()).expect("valid daemon");
    let metrics = daemon.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let running = rt.spawn(daemon.run(async {
        let _ = stop_rx.await;
    }));

    // The device registers itself.
    let info = rt
        .block_on(async {
            let start = Instant::now();
            loop {
                if let Some(found) =
                    typed::get::<DeviceInfo>(store.as_ref(), &keys::device_info(DEVICE)).await?
                {
                    return Ok(Some(found));
                }
                if start.elapsed() > Duration::from_secs(5) {
                    return Ok(None);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .map_err(|e: iadeep_state::StateError| e)
        .expect("read device");
    let (info, kv) = info.expect("device registered within 5 s");
    assert_eq!(info.memory_mib, CARD_MIB);
    assert!(kv.lease.is_some(), "the device record is leased");

    let state = wait_state(&rt, &store, Duration::from_secs(40), |s| {
        s.observations.len() >= 22
            || metrics.settled.load(Ordering::Relaxed) == 1 && s.observations.len() >= 8
    });
    let tuning_s = started.elapsed().as_secs_f64();
    let settled = metrics.settled.load(Ordering::Relaxed) == 1;
    let _ = stop_tx.send(());
    rt.block_on(running)
        .expect("daemon task")
        .expect("daemon stops cleanly");
    drop(jobs);

    let first = &state.observations[0];
    assert_eq!(first.batch_sizes, vec![M0, M0], "the search starts at m0");
    let measured: Vec<(&Vec<u32>, f64)> = state
        .observations
        .iter()
        .filter_map(|o| o.sum_pd.map(|v| (&o.batch_sizes, v)))
        .collect();
    let (best, best_pd) = measured
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .copied()
        .expect("measurements");
    let start_pd = first.sum_pd.expect("m0 measured");
    eprintln!(
        "start Σ PD {start_pd:.3} at {:?} (true {:.3}); best {best_pd:.3} at {best:?} (true {:.3}; optimum {:.3} at [64, 64]); {} rounds in {tuning_s:.2} s, settled: {settled}",
        first.batch_sizes,
        true_sum_pd(&first.batch_sizes),
        true_sum_pd(best),
        true_sum_pd(&[64, 64]),
        state.observations.len()
    );
    // True Σ PD: 2.5 at (16, 16), 1.6 at the optimum (64, 64), 36% lower. Ask for a measured
    // best at least 15% below the start, at sizes around 64.
    assert!(
        best_pd < 0.85 * start_pd,
        "best {best_pd} vs start {start_pd}"
    );
    assert!(
        best.iter().all(|&b| (32..=128).contains(&b)),
        "best configuration {best:?} is not near the optimum (64, 64)"
    );
    // Never over the memory limit: every round's assignments, summed with the TRUE memory.
    let rounds = assignments.lock().expect("lock").clone();
    assert!(rounds.len() >= state.observations.len());
    for (round, tasks) in &rounds {
        let total: u64 = tasks.iter().map(|(_, b)| memory_mib(*b)).sum();
        assert!(
            (total as f64) <= CARD_MIB as f64 * (1.0 - MARGIN),
            "round {round} assigned {tasks:?} = {total} MiB over the limit"
        );
    }
    // Learning-rate factors follow the sqrt rule, and co-location samples were written.
    let samples = rt
        .block_on(typed::list::<CoLocationSample>(
            store.as_ref(),
            &keys::device_samples_prefix(DEVICE),
            |_| true,
        ))
        .expect("samples")
        .0;
    assert!(
        samples.len() >= 2,
        "at least the (m0, m0) round yields samples"
    );
    for (s, _) in &samples {
        assert_eq!(s.corunners.len(), 1);
        assert!(
            (1.1..2.0).contains(&s.slowdown),
            "slowdown {} should be near IF = {IF}",
            s.slowdown
        );
    }
    let metrics_text = metrics.render(DEVICE);
    assert!(
        metrics_text.contains("iadeep_tuner_rounds_total"),
        "{metrics_text}"
    );
}

#[test]
fn a_restarted_daemon_resumes_and_a_leaving_task_restarts_the_search() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let jobs = [
        Job::start(&rt, &store, &etcd.url(), "job-a"),
        Job::start(&rt, &store, &etcd.url(), "job-b"),
    ];
    let first = rt.spawn(
        Daemon::new(store.clone(), device(), params())
            .expect("valid")
            .run(std::future::pending()),
    );
    wait_state(&rt, &store, Duration::from_secs(20), |s| {
        s.observations.len() >= 4
    });
    // Kill it: the future is dropped mid-round; its control loop stops at the next check.
    first.abort();
    std::thread::sleep(Duration::from_millis(400));
    let before = tuner_state(&rt, &store).expect("persisted");
    let second = rt.spawn(
        Daemon::new(store.clone(), device(), params())
            .expect("valid")
            .run(std::future::pending()),
    );
    let after = wait_state(&rt, &store, Duration::from_secs(20), |s| {
        s.observations.len() >= before.observations.len() + 2
    });
    // A task leaves (finishes, its lease is revoked): the search restarts for the other one.
    let [job_a, job_b] = jobs;
    drop(job_b);
    let alone = wait_state(&rt, &store, Duration::from_secs(20), |s| {
        s.task_ids == ["job-a"] && !s.observations.is_empty()
    });
    assert!(alone.observations.iter().all(|o| o.batch_sizes.len() == 1));
    second.abort();
    drop(job_a);
    assert_eq!(
        after.observations[..before.observations.len()],
        before.observations[..],
        "the restarted tuner keeps the earlier observations"
    );
    let rounds: Vec<u64> = after.observations.iter().map(|o| o.round).collect();
    assert!(
        rounds.windows(2).all(|w| w[0] < w[1]),
        "rounds keep rising across the restart: {rounds:?}"
    );
    assert!(after.round > before.round);
}
