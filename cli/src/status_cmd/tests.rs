//! `iadeep status` on a store written by hand: what it computes and how it lays it out.

use iadeep_proto::{
    BatchSizeAssignment, DeviceInfo, DeviceResidents, Placement, Reservation, SoloProfile,
    TaskReport, TaskSpec, TunerObservation, TunerSoloTime, TunerState, TunerTaskKnowledge,
};
use iadeep_state::{EmbeddedStore, StateStore, keys, typed};

use super::read::{self, Snapshot};
use super::render;

const NOW_MS: i64 = 1_700_000_010_000;

fn spec(id: &str, m0: u32, min: u32, max: u32) -> TaskSpec {
    TaskSpec {
        task_id: id.into(),
        model: "resnet".into(),
        initial_batch_size: m0,
        min_batch_size: min,
        max_batch_size: max,
        ..TaskSpec::default()
    }
}

async fn put_task(store: &dyn StateStore, spec: &TaskSpec, batch: u32, step_s: f64, peak: u64) {
    let id = &spec.task_id;
    typed::put(store, &keys::task_spec(id), spec, None)
        .await
        .expect("spec");
    let placement = Placement {
        task_id: id.clone(),
        device_id: "gpu-0".into(),
        reserved_mem_mib: 4000,
        batch_size: spec.initial_batch_size,
        ..Placement::default()
    };
    typed::put(store, &keys::task_placement(id), &placement, None)
        .await
        .expect("placement");
    let report = TaskReport {
        task_id: id.clone(),
        device_id: "gpu-0".into(),
        batch_size: batch,
        step_time_s: step_s,
        peak_mem_mib: Some(peak),
        reported_at_unix_ms: NOW_MS - 3_000,
        ..TaskReport::default()
    };
    typed::put(store, &keys::task_report(id), &report, None)
        .await
        .expect("report");
    let assignment = BatchSizeAssignment {
        task_id: id.clone(),
        batch_size: batch,
        lr_factor: 1.5,
        round: 4,
        ..BatchSizeAssignment::default()
    };
    typed::put(store, &keys::task_assignment(id), &assignment, None)
        .await
        .expect("assignment");
}

/// One 16 GiB GPU with two jobs: `a` (tuned, its solo step time at m0 known to the tuner)
/// and `b` (pinned at m0, with a solo profile at m0).
async fn two_jobs() -> Snapshot {
    let store = EmbeddedStore::in_memory().expect("store");
    let info = DeviceInfo {
        device_id: "gpu-0".into(),
        kind: "h100".into(),
        memory_mib: 16_384,
        ..DeviceInfo::default()
    };
    typed::put(&store, &keys::device_info("gpu-0"), &info, None)
        .await
        .expect("info");
    let reservation = |id: &str, mib| Reservation {
        task_id: id.into(),
        reserved_mem_mib: mib,
        ..Reservation::default()
    };
    let residents = DeviceResidents {
        device_id: "gpu-0".into(),
        reservations: vec![reservation("a", 5000), reservation("b", 4000)],
        ..Default::default()
    };
    typed::put(&store, &keys::device_residents("gpu-0"), &residents, None)
        .await
        .expect("res");
    let tuner = TunerState {
        device_id: "gpu-0".into(),
        round: 4,
        task_ids: vec!["a".into(), "b".into()],
        observations: vec![
            TunerObservation {
                batch_sizes: vec![32, 16],
                sum_pd: Some(2.5),
                round: 2,
            },
            TunerObservation {
                batch_sizes: vec![64, 16],
                sum_pd: Some(2.25),
                round: 3,
            },
            TunerObservation {
                batch_sizes: vec![128, 16],
                sum_pd: None,
                round: 4,
            },
        ],
        tasks: vec![TunerTaskKnowledge {
            task_id: "a".into(),
            solo: vec![TunerSoloTime {
                batch_size: 32,
                step_time_s: 0.1,
            }],
            ..TunerTaskKnowledge::default()
        }],
        updated_at_unix_ms: NOW_MS - 1_000,
        ..TunerState::default()
    };
    typed::put(&store, &keys::device_tuner("gpu-0"), &tuner, None)
        .await
        .expect("tuner");
    put_task(&store, &spec("a", 32, 8, 256), 64, 0.25, 6000).await;
    let mut b = spec("b", 16, 0, 0);
    b.profile = Some(SoloProfile {
        batch_size: 16,
        step_time_s: Some(0.2),
        ..SoloProfile::default()
    });
    put_task(&store, &b, 16, 0.3, 3000).await;
    let lease = store
        .grant_lease(std::time::Duration::from_secs(60))
        .await
        .expect("lease");
    store
        .put(&keys::task_alive("a"), b"x".to_vec(), Some(lease))
        .await
        .expect("alive");
    // A released task: its marker, its keys in the archive.
    let marker = typed::encode_released_at(NOW_MS - 60_000);
    store
        .put(&keys::task_released("old"), marker, None)
        .await
        .expect("marker");
    let old = spec("old", 8, 0, 0);
    typed::put(&store, &keys::archived_spec("old"), &old, None)
        .await
        .expect("old");
    // A live task without placement (its reservation lost while its agent runs).
    let lease = store
        .grant_lease(std::time::Duration::from_secs(60))
        .await
        .expect("lease");
    store
        .put(&keys::task_alive("lost"), b"x".to_vec(), Some(lease))
        .await
        .expect("lost");
    read::read(&store, NOW_MS).await.expect("read")
}

#[tokio::test]
async fn figures_come_from_the_store_and_pd_is_the_tuners() {
    let s = two_jobs().await;
    assert_eq!(s.devices.len(), 1);
    let d = &s.devices[0];
    assert_eq!(d.reserved_mib, 9000);
    assert_eq!(d.measured_mib, Some(9000));
    assert_eq!(d.free_mib, Some(16_384 - 9000));
    assert_eq!(d.residents, ["a", "b"]);
    let t = d.tuner.as_ref().expect("tuner state");
    assert_eq!((t.round, t.measured, t.out_of_memory), (4, 2, 1));
    assert_eq!(t.best_sum_pd, Some(2.25));

    assert_eq!(
        (s.released, s.released_more),
        (1, false),
        "one release marker"
    );
    assert_eq!(s.unplaced, ["lost"], "a live task without placement");
    let [a, b] = &s.jobs[..] else {
        panic!("two jobs: {:?}", s.jobs)
    };
    // a: goodput alone at m0 = 32 / 0.1 = 320; now 64 / 0.25 = 256; no noise scale: E = 1.
    assert_eq!(
        (a.batch_size, a.m0, a.min_batch_size, a.max_batch_size),
        (64, 32, 8, 256)
    );
    assert!((a.pd.expect("pd of a") - 1.25).abs() < 1e-12, "{:?}", a.pd);
    assert_eq!(a.pd_basis, Some("measured alone"));
    assert_eq!(a.tuning.phase, "tuning");
    assert!(a.running);
    assert_eq!(a.lr_factor, Some(1.5));
    // b: bounds 0 mean m0, so the tuner never moves it; PD against its profile: 0.3 / 0.2.
    assert_eq!((b.min_batch_size, b.max_batch_size), (16, 16));
    assert!((b.pd.expect("pd of b") - 1.5).abs() < 1e-12, "{:?}", b.pd);
    assert_eq!(b.pd_basis, Some("profile"));
    assert_eq!(b.tuning.phase, "fixed");
    assert!(!b.running, "b's agent holds no alive key");
}

#[tokio::test]
async fn text_fits_100_columns_and_json_carries_every_figure() {
    let s = two_jobs().await;
    let lines = render::text(&s);
    for line in &lines {
        assert!(
            line.chars().count() <= render::WIDTH,
            "{} columns: {line}",
            line.chars().count()
        );
    }
    let text = lines.join("\n");
    assert!(text.contains("gpu-0"), "{text}");
    assert!(
        text.contains("1.25") && text.contains("1.50"),
        "both PDs shown:\n{text}"
    );
    assert!(text.contains("fixed"), "{text}");
    assert!(
        text.contains("Running without a reservation: lost"),
        "{text}"
    );
    assert!(text.contains("1 released job(s)"), "{text}");
    let json = render::json(&s);
    assert_eq!(json["jobs"][0]["pd"], 1.25);
    assert_eq!(json["jobs"][0]["report_age_s"], 3.0);
    assert_eq!(json["devices"][0]["free_mib"], 16_384 - 9000);
    assert_eq!(json["jobs"][1]["tuner"]["phase"], "fixed");
}

#[tokio::test]
async fn an_empty_store_says_so() {
    let store = EmbeddedStore::in_memory().expect("store");
    let s = read::read(&store, NOW_MS).await.expect("read");
    let text = render::text(&s).join("\n");
    assert!(text.contains("No GPUs registered"), "{text}");
    assert!(text.contains("No jobs placed."), "{text}");
}

#[tokio::test]
async fn a_damaged_value_is_named_and_the_rest_still_shown() {
    let store = EmbeddedStore::in_memory().expect("store");
    typed::put(&store, &keys::task_spec("a"), &spec("a", 32, 0, 0), None)
        .await
        .expect("spec");
    let placement = Placement {
        task_id: "a".into(),
        device_id: "gpu-0".into(),
        ..Placement::default()
    };
    typed::put(&store, &keys::task_placement("a"), &placement, None)
        .await
        .expect("placement");
    store
        .put(&keys::task_report("a"), vec![0xff, 0xff, 0xff], None)
        .await
        .expect("junk");
    let s = read::read(&store, NOW_MS).await.expect("read");
    assert_eq!(s.jobs.len(), 1, "the job is still listed");
    assert_eq!(s.problems.len(), 1, "{:?}", s.problems);
    assert!(
        s.problems[0].contains(&keys::task_report("a")),
        "{:?}",
        s.problems
    );
}

/// The derived phase follows what the store holds, in order: a finished job, a job its
/// bounds pin, one its GPU's tuner has not taken into a search, one whose PD cannot be
/// measured, and one being tuned.
#[test]
fn the_tuner_phase_is_derived_from_what_the_store_holds() {
    let movable = spec("j", 32, 16, 64);
    let with_j = TunerState {
        task_ids: vec!["j".into()],
        ..TunerState::default()
    };
    let phase = |spec: &TaskSpec, finished, pd_known, tuner: Option<&TunerState>| {
        read::tuning("j", spec, finished, pd_known, tuner).phase
    };
    assert_eq!(phase(&movable, true, true, Some(&with_j)), "finished");
    assert_eq!(
        phase(&spec("j", 32, 0, 0), false, true, Some(&with_j)),
        "fixed"
    );
    assert_eq!(phase(&movable, false, true, None), "waiting");
    assert_eq!(
        phase(&movable, false, true, Some(&TunerState::default())),
        "waiting"
    );
    assert_eq!(phase(&movable, false, false, Some(&with_j)), "holding");
    assert_eq!(phase(&movable, false, true, Some(&with_j)), "tuning");
}
