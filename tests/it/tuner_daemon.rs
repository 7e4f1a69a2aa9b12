//! The tuner daemon against a real etcd, with in-process agents (the real agent SDK) whose
//! step times follow a known synthetic surface.
//!
//! The jobs record the surface's step time for each step instead of sleeping it, so what the
//! agents report does not depend on how loaded the machine is: only the pace of the test
//! does, and every wait below is for a condition, with a generous limit.
//!
//! The surface: solo step time T(b) = A + C·b, co-located step time IF·T(b), gradient noise
//! scale φ. Then PD(b) = m0/T(m0) · IF·T(b)/b · (φ + b)/(φ + m0), minimised at
//! b* = √(A·φ/C) = 64 for every task, whatever the other runs. Memory: M(b) = 500 + 8·b MiB on
//! a 3000 MiB card; with the margin (5 % + 256 MiB) (128, 128) does not fit.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::fixtures;
use iadeep_agent::Agent;
use iadeep_objective::MemoryMargin;
use iadeep_proto::{
    BatchSizeAssignment, CapBreach, DeviceInfo, DeviceResidents, LrScalingRule, Placement,
    PriorityClass, Reservation, SoloProfile, TaskSpec, TunerState,
};
use iadeep_state::testing::EtcdServer;
use iadeep_state::testing::runtime;
use iadeep_state::{EtcdStore, StateStore, Txn, keys, typed};
use iadeep_tuner::daemon::{Daemon, DaemonParams, JournalEntry};
use iadeep_tuner::{Action, DeviceTuner};

const A_S: f64 = 0.004;
const C_S: f64 = 0.004 / 64.0;
const PHI: f64 = 64.0;
const IF: f64 = 1.25;
const M0: u32 = 16;
const DEVICE: &str = "gpu0";
const CARD_MIB: u64 = 3000;

fn solo_step_s(b: u32) -> f64 {
    A_S + C_S * f64::from(b)
}

fn memory_mib(b: u32) -> u64 {
    500 + 8 * u64::from(b)
}

/// Σ PD of the surface.
fn true_sum_pd(sizes: &[u32]) -> f64 {
    sizes
        .iter()
        .map(|&b| {
            let (m0, m) = (f64::from(M0), f64::from(b));
            (m0 / solo_step_s(M0)) * IF * solo_step_s(b) / m * (PHI + m) / (PHI + m0)
        })
        .sum()
}

/// The shared job turned into this file's synthetic model, which asks for no memory.
fn spec(task: &str) -> TaskSpec {
    TaskSpec {
        model: "synthetic".into(),
        gpu_mem_request_mib: 0,
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
        ..fixtures::spec(task)
    }
}

/// Places `spec`'s task on the device as the placer does: the reservation in the device's
/// residents record, the placement and the spec.
async fn place(store: &dyn StateStore, spec: &TaskSpec) -> Result<(), iadeep_state::StateError> {
    let task = spec.task_id.as_str();
    let key = keys::device_residents(DEVICE);
    let mut record = typed::get::<DeviceResidents>(store, &key)
        .await?
        .map(|(r, _)| r)
        .unwrap_or_else(|| DeviceResidents {
            device_id: DEVICE.into(),
            reservations: Vec::new(),
            ..Default::default()
        });
    record.reservations.push(Reservation {
        task_id: task.into(),
        reserved_mem_mib: memory_mib(M0),
        placed_at_unix_ms: iadeep_proto::now_unix_ms(),
        spec: Some(spec.clone()),
        provisional: false,
    });
    typed::put(store, &key, &record, None).await?;
    let placement = Placement {
        task_id: task.into(),
        device_id: DEVICE.into(),
        reserved_mem_mib: memory_mib(M0),
        ..Default::default()
    };
    typed::put(store, &keys::task_placement(task), &placement, None).await?;
    typed::put(store, &keys::task_spec(task), spec, None).await?;
    Ok(())
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
        Job::start_spec(rt, store, url, spec(task))
    }

    /// A job of `spec` (this file's synthetic model, with another class, say).
    fn start_spec(
        rt: &tokio::runtime::Runtime,
        store: &Arc<dyn StateStore>,
        url: &str,
        spec: TaskSpec,
    ) -> Job {
        rt.block_on(place(store.as_ref(), &spec))
            .expect("the placer's writes");
        let task = spec.task_id.as_str();
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
                // The surface's step time, recorded rather than slept: the measurement does
                // not depend on the machine's load.
                agent.record_step(b, Duration::from_secs_f64(IF * solo_step_s(b)));
                // Noise-free norms with |G|² = 1 and tr Σ = φ: the estimator returns φ.
                let small = (b / 4).max(1);
                let norm = |x: u32| 1.0 + PHI / f64::from(x);
                agent.record_gradient_norms(small, norm(small), b, norm(b));
                std::thread::sleep(Duration::from_millis(2));
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

fn params() -> DaemonParams {
    let mut p = DaemonParams {
        lease_ttl: Duration::from_secs(3),
        ..DaemonParams::default()
    };
    p.tuner.round_timeout = Duration::from_secs(20);
    p.tuner.settled_interval = Duration::from_millis(500);
    p.tuner.seed = 1;
    p.tuner.controller.patience = 6;
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

/// Waits until `f` holds for the persisted state, at most `limit` (generous: the condition,
/// not the time, is what is tested).
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

/// Over a real etcd with real agents the daemon tunes towards the optimum without ever
/// assigning over the card's memory, and every decision it made is the device tuner's:
/// replaying its journal (the same inputs at the same times) into a fresh tuner gives the
/// same actions, assignment for assignment.
#[test]
fn the_daemon_runs_the_device_tuner_and_a_replay_decides_the_same() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let jobs = [
        Job::start(&rt, &store, &etcd.url(), "job-a"),
        Job::start(&rt, &store, &etcd.url(), "job-b"),
    ];
    let (journal_tx, mut journal_rx) = tokio::sync::mpsc::unbounded_channel::<JournalEntry>();
    let daemon = Daemon::new(store.clone(), device(), params())
        .expect("valid daemon")
        .with_journal(journal_tx);
    let metrics = daemon.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = rt.spawn(daemon.run(async {
        let _ = stop_rx.await;
    }));

    let state = wait_state(&rt, &store, Duration::from_secs(120), |s| {
        metrics.settled.load(Ordering::Relaxed) == 1 && s.observations.len() >= 6
    });
    let _ = stop_tx.send(());
    rt.block_on(running)
        .expect("daemon task")
        .expect("daemon stops cleanly");
    drop(jobs);

    // The search went towards the optimum.
    let first = &state.observations[0];
    assert_eq!(
        first.batch_sizes,
        vec![M0, M0],
        "the search starts at what runs"
    );
    let start_pd = first.sum_pd.expect("m0 measured");
    assert!(
        (start_pd - true_sum_pd(&[M0, M0])).abs() < 0.02 * start_pd,
        "measured {start_pd} vs true {}",
        true_sum_pd(&[M0, M0])
    );
    let (best, best_pd) = state
        .observations
        .iter()
        .filter_map(|o| o.sum_pd.map(|v| (&o.batch_sizes, v)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("measurements");
    eprintln!(
        "start Σ PD {start_pd:.3}; best {best_pd:.3} at {best:?} (optimum {:.3} at [64, 64]); {} observations",
        true_sum_pd(&[64, 64]),
        state.observations.len()
    );
    assert!(
        best_pd < 0.85 * start_pd,
        "best {best_pd} vs start {start_pd}"
    );

    // Replay: the same inputs at the same times, the same actions.
    let mut journal = Vec::new();
    while let Ok(entry) = journal_rx.try_recv() {
        journal.push(entry);
    }
    assert!(journal.len() > 10, "{} steps journalled", journal.len());
    let mut replayed = DeviceTuner::new(&device(), params().tuner, None).expect("tuner");
    let mut assignments = 0;
    let usable = MemoryMargin::DEFAULT.usable_mib(CARD_MIB as f64);
    for (i, entry) in journal.iter().enumerate() {
        let actions = replayed.step(entry.now_ms, entry.inputs.clone());
        assert_eq!(actions, entry.actions, "step {i} decided differently");
        for action in &entry.actions {
            if let Action::Assign(round) = action {
                assignments += 1;
                // Never over the memory limit, with the TRUE memory of the surface.
                let total: u64 = round.iter().map(|a| memory_mib(a.batch_size)).sum();
                assert!(total as f64 <= usable, "{round:?} needs {total} MiB");
            }
        }
    }
    assert!(assignments >= 3, "{assignments} rounds assigned");
    let samples = rt
        .block_on(store.range(&keys::device_samples_prefix(DEVICE)))
        .expect("samples")
        .kvs
        .len();
    assert!(samples >= 2, "measured co-locations become samples");
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
    wait_state(&rt, &store, Duration::from_secs(60), |s| {
        s.observations.len() >= 3
    });
    // Kill it: the future is dropped mid-round.
    first.abort();
    let _ = rt.block_on(first);
    let before = tuner_state(&rt, &store).expect("persisted");
    let second = rt.spawn(
        Daemon::new(store.clone(), device(), params())
            .expect("valid")
            .run(std::future::pending()),
    );
    let after = wait_state(&rt, &store, Duration::from_secs(60), |s| {
        s.observations.len() >= before.observations.len() + 2
    });
    // A task leaves (finishes, its lease is revoked, the placer releases it): the search
    // restarts for the other one.
    let [job_a, job_b] = jobs;
    drop(job_b);
    rt.block_on(async {
        let key = keys::device_residents(DEVICE);
        let (mut record, _) = typed::get::<DeviceResidents>(store.as_ref(), &key)
            .await?
            .expect("record");
        record.reservations.retain(|r| r.task_id != "job-b");
        typed::put(store.as_ref(), &key, &record, None).await
    })
    .expect("release");
    let alone = wait_state(&rt, &store, Duration::from_secs(60), |s| {
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
        rounds.windows(2).all(|w| w[0] <= w[1]),
        "rounds keep rising across the restart: {rounds:?}"
    );
    assert!(after.round > before.round);
}

/// Waits until `f` holds for the value at `key`, at most `limit`.
fn wait_key(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn StateStore>,
    key: &str,
    limit: Duration,
    f: impl Fn(Option<&[u8]>) -> bool,
) {
    let start = Instant::now();
    loop {
        let value = rt
            .block_on(store.get(key))
            .expect("read")
            .map(|kv| kv.value);
        if f(value.as_deref()) {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{key} not as expected within {limit:?}: {value:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn registered_memory(rt: &tokio::runtime::Runtime, store: &Arc<dyn StateStore>) -> Option<u64> {
    rt.block_on(typed::get::<DeviceInfo>(
        store.as_ref(),
        &keys::device_info(DEVICE),
    ))
    .expect("read the device record")
    .map(|(info, _)| info.memory_mib)
}

/// A tuner daemon for `DEVICE`, started and waited for until it has published its record;
/// a send on the returned channel stops it cleanly.
fn start_owner(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn StateStore>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<iadeep_tuner::Result<()>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let owner = rt.spawn(
        Daemon::new(store.clone(), device(), params())
            .expect("valid")
            .run(async {
                let _ = stopped.await;
            }),
    );
    wait_key(
        rt,
        store,
        &keys::device_info(DEVICE),
        Duration::from_secs(20),
        |v| v.is_some(),
    );
    (stop, owner)
}

/// Deletes the device record and waits, up to `within`, for its owner to publish it
/// again with the card's memory.
fn delete_record_and_wait_republished(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn StateStore>,
    within: Duration,
) {
    let info_key = keys::device_info(DEVICE);
    rt.block_on(store.delete(&info_key))
        .expect("delete the record");
    wait_key(rt, store, &info_key, within, |v| v.is_some());
    assert_eq!(
        registered_memory(rt, store),
        Some(CARD_MIB),
        "published again"
    );
}

/// One tuner per device: a second daemon for a device that a live one owns refuses to start,
/// naming the owner, and leaves the owner's record alone; the owner publishes its record
/// again when it is deleted; a clean stop takes the owner key and the record with the lease.
#[test]
fn a_device_has_one_live_tuner_which_keeps_its_record_published() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let (stop, owner) = start_owner(&rt, &store);
    let info_key = keys::device_info(DEVICE);

    let mut smaller = device();
    smaller.memory_mib = CARD_MIB / 2;
    // It waits two lease TTLs (6 s) in case the owner died; a limit well above that.
    let second = Daemon::new(store.clone(), smaller, params()).expect("valid");
    let refused = rt
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(60), second.run(std::future::pending())).await
        })
        .expect("a second tuner does not start");
    let message = refused.expect_err("a second tuner refuses").to_string();
    assert!(
        message.contains("owned by another live tuner") && message.contains("tuner pid"),
        "{message}"
    );
    assert_eq!(
        registered_memory(&rt, &store),
        Some(CARD_MIB),
        "the owner's record stays"
    );

    delete_record_and_wait_republished(&rt, &store, Duration::from_secs(20));

    stop.send(()).expect("the owner runs");
    rt.block_on(owner).expect("join").expect("a clean stop");
    for key in [info_key, keys::device_owner(DEVICE)] {
        let left = rt.block_on(store.get(&key)).expect("read");
        assert!(left.is_none(), "{key} outlived the stop: {left:?}");
    }
}

/// A tuner whose lease is revoked under it (as an etcd leader before 3.4.31 that hung and
/// resumes does to every lease, etcd-io/etcd#15247) sees its record and owner key deleted,
/// and takes the device again under a new lease: nobody else owns it, so it must not stop
/// as if another tuner had taken it (it did, before: the record's deletion reached it
/// before its keep-alive found the lease gone).
#[test]
fn a_tuner_whose_lease_is_revoked_takes_its_device_again() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let (stop, owner) = start_owner(&rt, &store);
    let info_key = keys::device_info(DEVICE);
    let lease_of = |key: &str| {
        rt.block_on(store.get(key))
            .expect("read")
            .and_then(|kv| kv.lease)
    };
    let before = lease_of(&info_key).expect("the record is leased");
    rt.block_on(store.revoke_lease(before)).expect("revoke");
    let start = Instant::now();
    loop {
        let now = lease_of(&info_key);
        if now.is_some_and(|lease| lease != before) {
            break;
        }
        assert!(
            !owner.is_finished(),
            "the tuner stopped: {:?}",
            rt.block_on(owner)
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the record did not come back under a new lease: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(lease_of(&keys::device_owner(DEVICE)), lease_of(&info_key));
    assert_eq!(registered_memory(&rt, &store), Some(CARD_MIB));
    stop.send(()).expect("the owner runs");
    rt.block_on(owner).expect("join").expect("a clean stop");
}

/// A tuner whose owner key and record are replaced by another tuner's (in one
/// transaction, under that tuner's lease) stops with an error naming that, rather than
/// tune a device someone else tunes or take it back.
#[test]
fn a_tuner_whose_device_another_tuner_took_stops() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let (_stop, owner) = start_owner(&rt, &store);
    let mut other = device();
    other.memory_mib = CARD_MIB / 2;
    rt.block_on(async {
        let lease = store
            .grant_lease(Duration::from_secs(60))
            .await
            .expect("grant");
        let txn = Txn::new()
            .put(
                keys::device_owner(DEVICE),
                b"tuner pid 1 on another node".to_vec(),
                Some(lease),
            )
            .put(
                keys::device_info(DEVICE),
                prost::Message::encode_to_vec(&other),
                Some(lease),
            );
        store.transact(txn).await.expect("take the device");
    });
    let stopped = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), owner).await })
        .expect("the tuner stops")
        .expect("join");
    let message = stopped.expect_err("stops with an error").to_string();
    assert!(
        message.contains("its owner key is another tuner's"),
        "{message}"
    );
    assert_eq!(
        registered_memory(&rt, &store),
        Some(CARD_MIB / 2),
        "the other tuner's record stays"
    );
}

/// A tuner whose watch on its quiet device record breaks after the history was compacted
/// past the record's last change (the placer compacts every few minutes, and the record is
/// written once) still sees the record deleted afterwards and publishes it again: it
/// resumes from a fresh read, not from a compacted revision it could never watch from.
#[test]
fn a_tuner_keeps_its_record_after_its_watch_breaks_past_a_compaction() {
    let mut etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let (stop, owner) = start_owner(&rt, &store);
    rt.block_on(async {
        for i in 0..20 {
            store
                .put(&format!("/iadeep-test/filler/{i}"), vec![1], None)
                .await
                .expect("filler");
        }
        let revision = store.range("/iadeep-test/").await.expect("read").revision;
        store.compact(revision).await.expect("compact");
    });
    etcd.restart().unwrap_or_else(|err| panic!("{err}"));
    delete_record_and_wait_republished(&rt, &store, Duration::from_secs(30));
    stop.send(()).expect("the owner runs");
    rt.block_on(owner).expect("join").expect("a clean stop");
}

/// A tuner state that does not decode is kept aside under `tuner.corrupt`, byte for byte,
/// and the tuner starts fresh instead of refusing to start.
#[test]
fn an_undecodable_tuner_state_is_kept_aside_and_the_tuner_starts_fresh() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let garbage = b"\xff\xff\xffnot a TunerState".to_vec();
    rt.block_on(store.put(&keys::device_tuner(DEVICE), garbage.clone(), None))
        .expect("write garbage");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let tuner = rt.spawn(
        Daemon::new(store.clone(), device(), params())
            .expect("valid")
            .run(async {
                let _ = stopped.await;
            }),
    );
    let aside = keys::device_tuner_corrupt(DEVICE);
    wait_key(&rt, &store, &aside, Duration::from_secs(20), |v| {
        v == Some(garbage.as_slice())
    });
    stop.send(()).expect("the tuner runs");
    rt.block_on(tuner).expect("join").expect("a clean stop");
    let fresh = tuner_state(&rt, &store).expect("the fresh state is saved on the way out");
    assert!(fresh.observations.is_empty(), "{fresh:?}");
}

/// A production job above its slowdown cap (the surface slows every job by IF = 1.25,
/// whatever its co-runner runs; the cap is 1.10) beside an opportunistic one: the tuner
/// shrinks the opportunistic job to its smallest size, then writes the device's breach
/// record for the placer; when the production job leaves, the tuner deletes the record.
#[test]
fn a_cap_breach_is_written_for_the_placer_and_deleted_when_it_ends() {
    let etcd = EtcdServer::start().unwrap_or_else(|err| panic!("{err}"));
    let rt = runtime();
    let store = connect(&rt, &etcd);
    let production = Job::start_spec(
        &rt,
        &store,
        &etcd.url(),
        TaskSpec {
            priority_class: PriorityClass::Production as i32,
            max_slowdown: Some(1.10),
            ..spec("job-p")
        },
    );
    let opportunistic = Job::start_spec(
        &rt,
        &store,
        &etcd.url(),
        TaskSpec {
            priority_class: PriorityClass::Opportunistic as i32,
            ..spec("job-o")
        },
    );
    let daemon = Daemon::new(store.clone(), device(), params()).expect("valid daemon");
    let metrics = daemon.metrics();
    let running = rt.spawn(daemon.run(std::future::pending()));
    let key = keys::device_breach(DEVICE);
    wait_key(&rt, &store, &key, Duration::from_secs(120), |v| v.is_some());
    let (breach, _) = rt
        .block_on(typed::get::<CapBreach>(store.as_ref(), &key))
        .expect("read the breach")
        .expect("written");
    assert_eq!(
        (breach.device_id.as_str(), breach.task_id.as_str()),
        (DEVICE, "job-p")
    );
    assert_eq!(breach.opportunistic_task_ids, ["job-o"]);
    assert_eq!(breach.rounds_above, params().tuner.breach_rounds);
    assert_eq!(breach.max_slowdown, 1.10);
    assert!((breach.measured_pd - IF).abs() < 0.05, "{breach:?}");
    assert!(breach.round > 0 && breach.at_unix_ms > 0, "{breach:?}");
    let assigned = |task: &str| {
        rt.block_on(typed::get::<BatchSizeAssignment>(
            store.as_ref(),
            &keys::task_assignment(task),
        ))
        .expect("read an assignment")
        .map(|(a, _)| a.batch_size)
    };
    assert_eq!(
        assigned("job-o"),
        Some(8),
        "the opportunistic job at its floor"
    );
    assert_eq!(
        assigned("job-p"),
        Some(M0),
        "the production job as submitted"
    );
    assert_eq!(metrics.cap_breaches.load(Ordering::Relaxed), 1);
    assert!(metrics.above_cap_ms.load(Ordering::Relaxed) > 0);

    // The production job ends and the placer releases it: the breach is over.
    drop(production);
    rt.block_on(async {
        let key = keys::device_residents(DEVICE);
        let (mut record, _) = typed::get::<DeviceResidents>(store.as_ref(), &key)
            .await?
            .expect("record");
        record.reservations.retain(|r| r.task_id != "job-p");
        typed::put(store.as_ref(), &key, &record, None).await
    })
    .expect("release");
    wait_key(&rt, &store, &key, Duration::from_secs(60), |v| v.is_none());
    assert_eq!(
        metrics.cap_breaches.load(Ordering::Relaxed),
        1,
        "reported once"
    );
    running.abort();
    drop(opportunistic);
}
