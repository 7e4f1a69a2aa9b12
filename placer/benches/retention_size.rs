//! The state store's size after many placements and releases, with and without the
//! retention of released tasks. Not a timing benchmark: it prints
//! the number of keys, their bytes and the size of the embedded store's file.
//!
//! Each task is placed (spec, placement and starting assignment in one transaction),
//! reports once as its agent would, and is released (the release marker is written);
//! a virtual clock moves one second per task, and the reaper's sweep runs every
//! `--sweep-every` tasks with the retention given. The same run without retention is
//! the store as it grew before.
//!
//! `cargo bench -p iadeep-placer --bench retention_size -- --placements 100000`
//! (options: `--placements N`, `--sweep-every N`, `--retention never|0s|1h|...` as
//! seconds or `never`, repeated to compare several; defaults: never, 3600 and 0).

use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use iadeep_placer::{
    Clock, ClusterView, ModelledMemory, PlacementService, Placer, PlacerParams, retention,
};
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_proto::{DeviceInfo, SoloProfile, TaskReport, TaskSpec};
use iadeep_state::{EmbeddedStore, StateStore, keys, typed};

struct Options {
    placements: u64,
    sweep_every: u64,
    retentions: Vec<Option<Duration>>,
}

fn options() -> Options {
    let mut options = Options {
        placements: 10_000,
        sweep_every: 1_000,
        retentions: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--placements" => options.placements = value().parse().expect("--placements N"),
            "--sweep-every" => options.sweep_every = value().parse().expect("--sweep-every N"),
            "--retention" => options.retentions.push(match value().as_str() {
                "never" => None,
                secs => Some(Duration::from_secs(
                    secs.parse().expect("--retention SECONDS|never"),
                )),
            }),
            // `cargo bench` passes `--bench`; nothing else is ours.
            _ => {}
        }
    }
    if options.retentions.is_empty() {
        options.retentions = vec![None, Some(Duration::from_secs(3600)), Some(Duration::ZERO)];
    }
    options
}

fn spec(id: &str) -> TaskSpec {
    TaskSpec {
        task_id: id.to_owned(),
        model: "resnet50".into(),
        initial_batch_size: 64,
        min_batch_size: 16,
        max_batch_size: 256,
        gpu_mem_request_mib: 4_000,
        profile: Some(SoloProfile {
            batch_size: 64,
            step_time_s: Some(0.2),
            peak_mem_mib: Some(4_000),
            sm_util_pct: Some(60.0),
            mem_bw_util_pct: Some(40.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn service(
    store: Arc<dyn StateStore>,
    now: Arc<AtomicI64>,
    retention: Option<Duration>,
) -> PlacementService {
    let mut view = ClusterView::new(Arc::new(ModelledMemory));
    for d in 0..8 {
        view.upsert_device(DeviceInfo {
            device_id: format!("d{d}"),
            node: "n".into(),
            memory_mib: 16_384,
            kind: "v100".into(),
            ..Default::default()
        });
    }
    let params = PlacerParams {
        task_retention: retention,
        ..PlacerParams::default()
    };
    let slowdown =
        Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("cold predictor"));
    let placer = Placer::new(params, slowdown).expect("params");
    PlacementService::new(store, Arc::new(RwLock::new(view)), Arc::new(placer))
        .with_clock(Clock::from_fn(move || now.load(Ordering::SeqCst)))
}

async fn run(path: &Path, placements: u64, sweep_every: u64, retention: Option<Duration>) {
    let started = Instant::now();
    let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::open(path).expect("open store"));
    let now = Arc::new(AtomicI64::new(1_700_000_000_000));
    let service = service(store.clone(), now.clone(), retention);
    let batch = service.placer().params().retention_batch;
    let mut deleted = 0;
    for i in 0..placements {
        let id = format!("job-{i:06}");
        service.place(spec(&id), Vec::new()).await.expect("place");
        let report = TaskReport {
            task_id: id.clone(),
            batch_size: 64,
            step_time_s: 0.21,
            steps_done: 1_000,
            device_id: "d0".into(),
            finished: true,
            peak_mem_mib: Some(4_100),
            peak_mem_batch_size: 64,
            ..Default::default()
        };
        typed::put(store.as_ref(), &keys::task_report(&id), &report, None)
            .await
            .expect("report");
        service
            .release(&id)
            .await
            .expect("release")
            .expect("was placed");
        now.fetch_add(1_000, Ordering::SeqCst);
        if let Some(retention) = retention
            && (i + 1) % sweep_every == 0
        {
            let mut from = None;
            loop {
                let swept = retention::sweep(&service, retention, batch, from)
                    .await
                    .expect("sweep");
                deleted += swept.deleted.len();
                from = swept.resume_after;
                if from.is_none() {
                    break;
                }
            }
        }
    }
    let all = store.range(keys::ROOT).await.expect("range");
    let bytes: usize = all.kvs.iter().map(|kv| kv.key.len() + kv.value.len()).sum();
    drop(service);
    drop(store);
    let file = std::fs::metadata(path).expect("store file").len();
    println!(
        "retention {:>6}: {placements} placements and releases, sweep every {sweep_every}: \
         {} keys, {:.1} KiB of keys and values, file {:.1} MiB; {deleted} tasks deleted; {:.0} s",
        retention.map_or("never".to_owned(), |r| format!("{}s", r.as_secs())),
        all.kvs.len(),
        bytes as f64 / 1024.0,
        file as f64 / (1024.0 * 1024.0),
        started.elapsed().as_secs_f64()
    );
}

fn main() {
    let options = options();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    for (n, retention) in options.retentions.iter().enumerate() {
        let path = dir.path().join(format!("store-{n}.redb"));
        runtime.block_on(run(
            &path,
            options.placements,
            options.sweep_every,
            *retention,
        ));
    }
}
