//! `iadeep placer` killed with SIGKILL in the middle of a Place/Release load, as real
//! processes on loopback: a real three-member etcd, two placer processes on the same
//! store (the reservation protocol claims correctness for any number of placers, every
//! admission being a compare-and-swap of the device's residents record), and clients
//! placing and releasing tasks on both. Each placer in turn is killed once its clients
//! had a number of answers (not after a sleep), restarted on the same port and store,
//! and the load goes on; while one is dead or restarting the other keeps serving.
//!
//! Each client retries a request whose answer was lost (the transport error of a dead
//! placer, or any error) with the same task until it is answered, so at the end it
//! knows exactly which tasks it holds. The store is then audited: no device over-packed
//! by the placer's own accounting (a [`ClusterView`] built from the stored records, whose
//! footprints the placer decides on, within the card alone and within
//! [`PlacerParams::usable_memory_mib`] shared), no task reserved twice or on two
//! devices, every reservation with its placement and every placement with its
//! reservation, and the reserved tasks exactly the ones the clients were told were placed
//! and did not release since. After the clients release everything, the store holds no
//! reservation and no placement. The same invariants (all but the clients' agreement)
//! are checked at every revision of the store's history too, replayed from a watch
//! started before the load, so a state broken for a while and repaired before the end
//! (an over-packed device a release emptied again) is caught as well.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use iadeep_placer::{ClusterView, ModelledMemory, PlacerParams};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{
    BatchSizeAssignment, DeviceInfo, DeviceResidents, ListDevicesRequest, PlaceRequest, Placement,
    ReleaseRequest, SoloProfile, TaskReport, TaskSpec, place_response,
};
use iadeep_state::keys::{self, KeyKind};
use iadeep_state::{EtcdStore, KeyValue, Revision, StateStore, WatchEvent, typed};
use tonic::transport::{Channel, Endpoint};

use common::DEADLINE;

/// GPUs of 16 GiB: three tasks of the sizes below fill one, so the clients, wanting
/// up to `WORKERS * HOLD` tasks, keep every device contended and often full.
const DEVICES: usize = 3;
const DEVICE_MIB: u64 = 16_384;
/// Clients; even ones use the first placer, odd ones the second.
const WORKERS: usize = 4;
/// Answered requests each client sends (Places and Releases).
const STEPS_PER_WORKER: u64 = 150;
/// Most tasks one client holds before it releases its oldest.
const HOLD: usize = 3;
/// Each placer is killed (the first, then the second) once its clients had this many
/// answers: half of what they send. They hold their last quarter until it has been
/// restarted ([`Counts::restarted`]), so the load always goes on after the restart.
const KILL_AFTER: u64 = STEPS_PER_WORKER * (WORKERS as u64 / 2) / 2;

/// The `iadeep placer` flags of both processes: no task is released behind the
/// clients' backs (the tasks have no agents), and waiting is priced out so a task that
/// fits is placed and full devices are contended.
fn placer_command(store: &str, grpc: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_iadeep"));
    cmd.args(["placer", "--store", store, "--grpc", grpc])
        .args(["--dead-task-grace-s", "0", "--unstarted-task-grace-s", "0"])
        .args(["--wait-cost-factor", "1e9"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    cmd
}

/// A placer process, killed when dropped; its output goes to `log`.
struct PlacerProcess {
    child: Child,
    log: PathBuf,
}

impl PlacerProcess {
    fn spawn(store: &str, grpc: &str, log: PathBuf) -> PlacerProcess {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open the placer's log");
        let err = out.try_clone().expect("clone the log's handle");
        let child = placer_command(store, grpc)
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn iadeep placer");
        PlacerProcess { child, log }
    }

    /// SIGKILL, and waits until the process is gone (its port is free then).
    fn kill9(&mut self) {
        // std's kill is SIGKILL on Unix: no shutdown path runs.
        self.child.kill().expect("SIGKILL the placer");
        self.child.wait().expect("reap the placer");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PlacerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls the placer at `addr` (bounded by [`DEADLINE`]) until it answers ListDevices
/// with every device registered.
async fn wait_ready(addr: &str, placer: &mut PlacerProcess) {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = placer.child.try_wait() {
            panic!(
                "the placer at {addr} exited with {status}:\n{}",
                placer.log()
            );
        }
        if let Ok(mut client) = PlacerClient::connect(format!("http://{addr}")).await
            && let Ok(listed) = client.list_devices(ListDevicesRequest {}).await
            && listed.into_inner().devices.len() >= DEVICES
        {
            return;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the placer at {addr} was not ready within {DEADLINE:?}:\n{}",
            placer.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn device_id(i: usize) -> String {
    format!("crash-n{i}:gpu0")
}

/// Task `n` of client `worker`: 3 to 7 GiB, one batch size (nothing to shrink), light
/// utilisation (memory is what limits a device).
fn task(worker: usize, n: u64) -> TaskSpec {
    let mib = 3_000 + ((n * 7 + worker as u64 * 3) % 5) * 1_000;
    TaskSpec {
        task_id: format!("crash-w{worker}-{n}"),
        model: "resnet50".into(),
        initial_batch_size: 32,
        min_batch_size: 32,
        max_batch_size: 32,
        gpu_mem_request_mib: mib,
        profile: Some(SoloProfile {
            batch_size: 32,
            step_time_s: Some(0.05),
            sm_util_pct: Some(10.0),
            mem_bw_util_pct: Some(10.0),
            device_kind: "v100".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Registers the devices as a tuner would (without its lease: nothing expires here).
async fn register_devices(store: &dyn StateStore) {
    for i in 0..DEVICES {
        let info = DeviceInfo {
            device_id: device_id(i),
            node: format!("crash-n{i}"),
            name: "crash-test".into(),
            memory_mib: DEVICE_MIB,
            kind: "v100".into(),
            ..Default::default()
        };
        typed::put(store, &keys::device_info(&info.device_id), &info, None)
            .await
            .expect("register a device");
    }
}

/// What the clients of one placer share: answered requests and lost answers, counted,
/// and whether their placer has been killed and restarted yet.
#[derive(Default)]
struct Counts {
    answered: AtomicU64,
    lost: AtomicU64,
    restarted: AtomicBool,
    restart: tokio::sync::Notify,
}

impl Counts {
    /// Waits until this placer has been killed and restarted, so a client keeps its last
    /// quarter of requests for after the restart whatever the other placer's restart
    /// costs meanwhile: every placer is killed in the middle of its load, never idle.
    async fn restarted(&self) {
        loop {
            // Created before the check, so a restart announced in between still wakes it.
            let announced = self.restart.notified();
            if self.restarted.load(Ordering::SeqCst) {
                return;
            }
            announced.await;
        }
    }
}

/// What one client ends with.
#[derive(Debug, Default)]
struct ClientEnd {
    /// Tasks it was told were placed and did not release since, oldest first.
    held: Vec<String>,
    placed: u64,
    queued: u64,
    released: u64,
    /// What the placers answered that contradicts what the client was told before.
    contradictions: Vec<String>,
}

fn channel(addr: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid endpoint")
        .connect_lazy()
}

/// Sends `request` through a fresh connection each try until an answer comes (bounded
/// by [`DEADLINE`]); the answer, and whether an earlier try lost its answer (so its
/// effect is unknown).
async fn until_answered<T, F, Fut>(addr: &str, counts: &Counts, mut request: F) -> (T, bool)
where
    F: FnMut(PlacerClient<Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let started = Instant::now();
    let mut lost = false;
    loop {
        match request(PlacerClient::new(channel(addr))).await {
            Ok(answer) => {
                counts.answered.fetch_add(1, Ordering::Relaxed);
                return (answer.into_inner(), lost);
            }
            Err(status) => {
                lost = true;
                counts.lost.fetch_add(1, Ordering::Relaxed);
                assert!(
                    started.elapsed() < DEADLINE,
                    "no answer from the placer at {addr} within {DEADLINE:?}: {status}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Client `worker`: places new tasks until it holds [`HOLD`] or is told to wait, then
/// releases its oldest, for [`STEPS_PER_WORKER`] answered requests.
async fn client(worker: usize, addr: String, counts: Arc<Counts>) -> ClientEnd {
    let mut end = ClientEnd::default();
    let mut next = 0u64;
    let mut refused = false;
    for step in 0..STEPS_PER_WORKER {
        if step == STEPS_PER_WORKER * 3 / 4 {
            counts.restarted().await;
        }
        // Told to wait, it gives a task back instead of asking again at once: releases
        // make room, and keep the devices changing under the other clients.
        if end.held.len() >= HOLD || (refused && !end.held.is_empty()) {
            refused = false;
            let task_id = end.held.remove(0);
            release(&addr, &counts, &task_id, &mut end).await;
        } else {
            let spec = task(worker, next);
            next += 1;
            let (answer, _) = until_answered(&addr, &counts, |mut c| {
                let request = PlaceRequest {
                    task: Some(spec.clone()),
                    candidate_device_ids: Vec::new(),
                };
                async move { c.place(request).await }
            })
            .await;
            match answer.decision {
                Some(place_response::Decision::Placed(p)) => {
                    assert_eq!(p.task_id, spec.task_id);
                    end.placed += 1;
                    end.held.push(spec.task_id);
                }
                _ => {
                    end.queued += 1;
                    refused = true;
                }
            }
        }
    }
    end
}

/// Releases `task_id`, which the client holds. A Release answering "held no
/// reservation" is a contradiction, unless an earlier try of it lost its answer
/// (that try may have released it).
async fn release(addr: &str, counts: &Counts, task_id: &str, end: &mut ClientEnd) {
    let (answer, lost) = until_answered(addr, counts, |mut c| {
        let request = ReleaseRequest {
            task_id: task_id.to_owned(),
        };
        async move { c.release(request).await }
    })
    .await;
    if answer.released || lost {
        end.released += 1;
    } else {
        end.contradictions.push(format!(
            "{task_id}: told placed, but its first Release found no reservation"
        ));
    }
}

/// The stored records the audit reads.
#[derive(Default)]
struct Stored {
    infos: BTreeMap<String, DeviceInfo>,
    residents: BTreeMap<String, (DeviceResidents, i64)>,
    placements: BTreeMap<String, Placement>,
    reports: BTreeMap<String, TaskReport>,
    assignments: BTreeMap<String, (BatchSizeAssignment, i64)>,
}

/// A stored value, which the placer wrote and the audit must read.
fn decode<M: prost::Message + Default>(kv: &KeyValue) -> M {
    typed::decode(kv).unwrap_or_else(|e| panic!("{}: {e}", kv.key))
}

impl Stored {
    /// Everything under the layout's root, and the revision it was read at.
    async fn read(store: &dyn StateStore) -> (Stored, Revision) {
        let snapshot = store.range(keys::ROOT).await.expect("range the store");
        let mut stored = Stored::default();
        for kv in &snapshot.kvs {
            stored.put(kv);
        }
        (stored, snapshot.revision)
    }

    fn put(&mut self, kv: &KeyValue) {
        match KeyKind::parse(&kv.key) {
            KeyKind::DeviceInfo { device } => {
                self.infos.insert(device, decode(kv));
            }
            KeyKind::DeviceResidents { device } => {
                self.residents.insert(device, (decode(kv), kv.mod_revision));
            }
            KeyKind::TaskPlacement { task } => {
                self.placements.insert(task, decode(kv));
            }
            KeyKind::TaskReport { task } => {
                self.reports.insert(task, decode(kv));
            }
            KeyKind::TaskAssignment { task } => {
                self.assignments.insert(task, (decode(kv), kv.mod_revision));
            }
            _ => {}
        }
    }

    fn apply(&mut self, event: &WatchEvent) {
        let key = match event {
            WatchEvent::Put(kv) => return self.put(kv),
            WatchEvent::Delete { key, .. } => key,
        };
        match KeyKind::parse(key) {
            KeyKind::DeviceInfo { device } => {
                self.infos.remove(&device);
            }
            KeyKind::DeviceResidents { device } => {
                self.residents.remove(&device);
            }
            KeyKind::TaskPlacement { task } => {
                self.placements.remove(&task);
            }
            KeyKind::TaskReport { task } => {
                self.reports.remove(&task);
            }
            KeyKind::TaskAssignment { task } => {
                self.assignments.remove(&task);
            }
            _ => {}
        }
    }
}

/// Collects every change under the layout's root from `from` on, as the store
/// commits them, until the returned handle is dropped.
async fn record_history(
    store: &dyn StateStore,
    from: Revision,
) -> (Arc<Mutex<Vec<WatchEvent>>>, tokio::task::JoinHandle<()>) {
    let mut watch = store
        .watch(keys::ROOT, Some(from))
        .await
        .expect("watch the store");
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let task = tokio::spawn(async move {
        while let Some(event) = watch.next().await {
            let event = event.unwrap_or_else(|e| panic!("the audit's watch failed: {e}"));
            sink.lock().expect("events").push(event);
        }
    });
    (events, task)
}

/// Replays the history recorded from `start` up to `last` and returns every way the
/// store broke [`invariants`] at any revision, not only at the end: each revision
/// (one transaction, or several committed as one) is checked whole.
async fn audit_history(
    mut stored: Stored,
    events: &Mutex<Vec<WatchEvent>>,
    last: Revision,
) -> Vec<String> {
    let started = Instant::now();
    while events
        .lock()
        .expect("events")
        .last()
        .is_none_or(|e| e.revision() < last)
    {
        assert!(
            started.elapsed() < DEADLINE,
            "the audit's watch did not reach revision {last} within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events = events.lock().expect("events");
    let mut findings = Vec::new();
    let mut revisions = 0;
    for one_revision in events.chunk_by(|a, b| a.revision() == b.revision()) {
        for event in one_revision {
            stored.apply(event);
        }
        revisions += 1;
        let revision = one_revision[0].revision();
        findings.extend(
            invariants(&stored)
                .into_iter()
                .map(|f| format!("at revision {revision}: {f}")),
        );
    }
    eprintln!("{revisions} revisions of the store audited");
    findings
}

/// Every way the store contradicts what must hold at every revision: no device
/// over-packed, no task reserved twice or on two devices, every reservation with its
/// placement and every placement with its reservation.
fn invariants(stored: &Stored) -> Vec<String> {
    let mut findings = Vec::new();
    let reserved = reservations(stored);
    for (device, (record, _)) in &stored.residents {
        let sum: u64 = record.reservations.iter().map(|r| r.reserved_mem_mib).sum();
        let card = stored.infos.get(device).map_or(0, |i| i.memory_mib);
        if sum > card {
            findings.push(format!("{device}: {sum} MiB reserved on a {card} MiB card"));
        }
    }
    for (task, devices) in &reserved {
        if devices.len() > 1 {
            findings.push(format!(
                "{task} reserved {} times: {devices:?}",
                devices.len()
            ));
        }
        match stored.placements.get(*task) {
            Some(p) if p.device_id == devices[0] => {}
            other => findings.push(format!(
                "{task} reserved on {} but its placement is {other:?}",
                devices[0]
            )),
        }
    }
    for (task, placement) in &stored.placements {
        if !reserved.contains_key(task.as_str()) {
            findings.push(format!(
                "{task} has a placement on {} without a reservation",
                placement.device_id
            ));
        }
    }
    findings.extend(over_packed(stored));
    findings
}

/// Where each task is reserved, as often as it is.
fn reservations(stored: &Stored) -> BTreeMap<&str, Vec<&str>> {
    let mut reserved: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (device, (record, _)) in &stored.residents {
        for r in &record.reservations {
            reserved.entry(&r.task_id).or_default().push(device);
        }
    }
    reserved
}

/// [`invariants`], and the reserved tasks against the ones the clients hold.
fn audit(stored: &Stored, held: &BTreeSet<String>) -> Vec<String> {
    let mut findings = invariants(stored);
    let in_store: BTreeSet<String> = reservations(stored)
        .keys()
        .map(|t| (*t).to_owned())
        .collect();
    for task in held.difference(&in_store) {
        findings.push(format!(
            "{task}: the client was told it was placed and never released it, but the store holds no reservation"
        ));
    }
    for task in in_store.difference(held) {
        findings.push(format!(
            "{task}: reserved in the store, but no client holds it (released, or never told it was placed)"
        ));
    }
    findings
}

/// Devices whose residents' footprints, as the placer counts them ([`ClusterView`] with
/// the daemon's [`ModelledMemory`]), exceed what the placer lets them hold: the whole
/// card for a lone task, [`PlacerParams::usable_memory_mib`] for tasks sharing it.
fn over_packed(stored: &Stored) -> Vec<String> {
    let mut view = ClusterView::new(Arc::new(ModelledMemory));
    for info in stored.infos.values() {
        view.upsert_device(info.clone());
    }
    for report in stored.reports.values() {
        view.set_report(report.clone());
    }
    for (assignment, revision) in stored.assignments.values() {
        view.set_assignment(assignment.clone(), *revision);
    }
    for (device, (record, revision)) in &stored.residents {
        view.apply_residents(device, Some(record.clone()), *revision);
    }
    let params = PlacerParams::default();
    view.devices()
        .filter_map(|(id, device)| {
            let card = device.info.as_ref()?.memory_mib;
            let limit = if device.residents.len() > 1 {
                params.usable_memory_mib(card)
            } else {
                card
            };
            let used = device.summary().used_mib;
            (used > limit).then(|| {
                format!(
                    "{id} over-packed: {} residents counted at {used} MiB, at most {limit} MiB",
                    device.residents.len()
                )
            })
        })
        .collect()
}

/// Runs the clients on the placers (client `w` on placer `w % 2`), kills each placer in
/// turn with SIGKILL once its clients had [`KILL_AFTER`] answers, restarts it on the
/// same port and store, and returns what each client ends with.
async fn load_with_kills(
    store_url: &str,
    placers: &mut [(String, PlacerProcess)],
    dir: &Path,
) -> Vec<ClientEnd> {
    let counts: Vec<Arc<Counts>> = placers.iter().map(|_| Arc::default()).collect();
    let clients: Vec<_> = (0..WORKERS)
        .map(|w| {
            let p = w % placers.len();
            tokio::spawn(client(w, placers[p].0.clone(), counts[p].clone()))
        })
        .collect();
    for (p, (addr, placer)) in placers.iter_mut().enumerate() {
        let started = Instant::now();
        while counts[p].answered.load(Ordering::Relaxed) < KILL_AFTER {
            assert!(
                started.elapsed() < DEADLINE,
                "the placer at {addr} answered {} requests within {DEADLINE:?}:\n{}",
                counts[p].answered.load(Ordering::Relaxed),
                placer.log()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        placer.kill9();
        eprintln!(
            "placer {p} killed after {} answered requests",
            counts[p].answered.load(Ordering::Relaxed)
        );
        *placer = PlacerProcess::spawn(
            store_url,
            addr,
            dir.join(format!("placer-{p}-restarted.log")),
        );
        wait_ready(addr, placer).await;
        counts[p].restarted.store(true, Ordering::SeqCst);
        counts[p].restart.notify_waiters();
    }
    let mut ends = Vec::new();
    for c in clients {
        ends.push(c.await.expect("a client panicked"));
    }
    for (p, counts) in counts.iter().enumerate() {
        eprintln!(
            "placer {p}: {} requests answered, {} answers lost and retried",
            counts.answered.load(Ordering::Relaxed),
            counts.lost.load(Ordering::Relaxed)
        );
    }
    ends
}

#[test]
fn placers_killed_mid_load_leave_no_over_packed_device_and_no_double_reservation() {
    let etcd = iadeep_state::testing::EtcdCluster::start().unwrap_or_else(|e| panic!("{e}"));
    let store_url = etcd.url();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let rt = iadeep_state::testing::runtime();
    let store: Arc<dyn StateStore> = Arc::new(
        rt.block_on(EtcdStore::connect(&etcd.endpoints()))
            .expect("connect to etcd"),
    );
    rt.block_on(register_devices(store.as_ref()));
    let (registered, from) = rt.block_on(Stored::read(store.as_ref()));
    let (history, watcher) = rt.block_on(record_history(store.as_ref(), from + 1));

    let addrs = common::free_ports::<2>().map(|port| format!("127.0.0.1:{port}"));
    let mut placers: Vec<(String, PlacerProcess)> = ["a", "b"]
        .into_iter()
        .zip(addrs)
        .map(|(name, addr)| {
            let log = dir.path().join(format!("placer-{name}.log"));
            let placer = PlacerProcess::spawn(&store_url, &addr, log);
            (addr, placer)
        })
        .collect();
    for (addr, placer) in &mut placers {
        rt.block_on(wait_ready(addr, placer));
    }

    let ends = rt.block_on(load_with_kills(&store_url, &mut placers, dir.path()));
    let contradictions: Vec<&String> = ends.iter().flat_map(|e| &e.contradictions).collect();
    assert!(contradictions.is_empty(), "{contradictions:#?}");
    let (placed, queued, released) = ends.iter().fold((0, 0, 0), |acc, e| {
        (acc.0 + e.placed, acc.1 + e.queued, acc.2 + e.released)
    });
    eprintln!("{placed} placed, {queued} queued, {released} released");
    assert!(placed > 0 && released > 0, "the load placed and released");

    let held: BTreeSet<String> = ends.iter().flat_map(|e| e.held.clone()).collect();
    let findings = audit(&rt.block_on(Stored::read(store.as_ref())).0, &held);
    let logs = || {
        placers
            .iter()
            .map(|(addr, p)| format!("placer at {addr}:\n{}", p.log()))
            .collect::<String>()
    };
    assert!(
        findings.is_empty(),
        "after the kills and the load:\n{findings:#?}\n{}",
        logs()
    );

    // Everything the clients hold goes back, through the placer that placed it.
    let counts = Counts::default();
    for (worker, end) in ends.iter().enumerate() {
        let addr = &placers[worker % placers.len()].0;
        let mut leftover = ClientEnd::default();
        for task_id in &end.held {
            rt.block_on(release(addr, &counts, task_id, &mut leftover));
        }
        assert!(
            leftover.contradictions.is_empty(),
            "{:?}",
            leftover.contradictions
        );
    }
    let (released_all, last) = rt.block_on(Stored::read(store.as_ref()));
    let findings = audit(&released_all, &BTreeSet::new());
    assert!(
        findings.is_empty(),
        "after releasing everything:\n{findings:#?}"
    );

    // Not only the end: the store never broke an invariant at any revision between.
    let findings = rt.block_on(audit_history(registered, &history, last));
    watcher.abort();
    assert!(
        findings.is_empty(),
        "in the store's history:\n{findings:#?}\n{}",
        logs()
    );
}
