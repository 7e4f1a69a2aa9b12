//! `iadeep status` on a store written by hand: what it computes and how it lays it out.

use iadeep_proto::{
    BatchSizeAssignment, CapBreach, DeviceInfo, DeviceResidents, Placement, PriorityClass,
    Reservation, SoloProfile, TaskReport, TaskSpec, TunerObservation, TunerSoloTime, TunerState,
    TunerTaskKnowledge,
};
use iadeep_state::{EmbeddedStore, StateStore, keys, typed};

use super::read::{self, Snapshot};
use super::render::{self, Layout};

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
    two_jobs_reserved(&["a", "b"]).await
}

/// [`two_jobs`] with only `reserved` in the GPU's residents record (the others released).
async fn two_jobs_reserved(reserved: &[&str]) -> Snapshot {
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
        reservations: vec![reservation("a", 5000), reservation("b", 4000)]
            .into_iter()
            .filter(|r| reserved.contains(&r.task_id.as_str()))
            .collect(),
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
    store
        .put(&keys::device_owner("gpu-0"), b"tuner".to_vec(), Some(lease))
        .await
        .expect("owner");
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
    // A job never placed that has ended: its last report stays, its agent is gone.
    let gone = TaskReport {
        task_id: "gone".into(),
        finished: true,
        ..TaskReport::default()
    };
    typed::put(&store, &keys::task_report("gone"), &gone, None)
        .await
        .expect("gone");
    // A live task without placement (its reservation lost while its agent runs).
    let lease = store
        .grant_lease(std::time::Duration::from_secs(60))
        .await
        .expect("lease");
    store
        .put(&keys::task_alive("lost"), b"x".to_vec(), Some(lease))
        .await
        .expect("lost");
    // One that reported finishing, its agent about to stop: the placer does not count
    // it as running without a reservation, so neither does status.
    let leaving = TaskReport {
        task_id: "leaving".into(),
        finished: true,
        ..TaskReport::default()
    };
    typed::put(&store, &keys::task_report("leaving"), &leaving, None)
        .await
        .expect("leaving");
    store
        .put(&keys::task_alive("leaving"), b"x".to_vec(), Some(lease))
        .await
        .expect("leaving");
    read::read(&store, NOW_MS).await.expect("read")
}

/// A device record no tuner holds (written by hand, or left by its tuner) is named: the
/// placer places there, and nothing tunes it.
#[tokio::test]
async fn a_gpu_without_its_tuner_is_named() {
    let mut s = two_jobs().await;
    assert!(s.devices[0].tuner_running);
    let no_tuner = |s: &Snapshot| {
        render::text(s, Layout::default())
            .into_iter()
            .filter(|l| l.starts_with("NO TUNER: "))
            .collect::<Vec<_>>()
    };
    assert!(no_tuner(&s).is_empty());
    let json = render::json(&s);
    assert_eq!(json["devices"][0]["tuner_running"], true, "{json}");

    let store = EmbeddedStore::in_memory().expect("store");
    let info = DeviceInfo {
        device_id: "n1:gpu0".into(),
        memory_mib: 24_576,
        ..DeviceInfo::default()
    };
    typed::put(&store, &keys::device_info("n1:gpu0"), &info, None)
        .await
        .expect("info");
    s = read::read(&store, NOW_MS).await.expect("read");
    assert!(!s.devices[0].tuner_running);
    let lines = no_tuner(&s);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains("n1:gpu0"), "{lines:#?}");
}

/// A PD against an estimated solo time is marked, and the mark explained.
#[tokio::test]
async fn a_pd_against_an_estimated_solo_time_is_marked() {
    let mut s = two_jobs().await;
    let lines = render::text(&s, Layout::default());
    assert!(!lines.iter().any(|l| l.starts_with("PD~")), "{lines:#?}");
    s.jobs[0].pd_basis = Some("estimated");
    let lines = render::text(&s, Layout::default());
    assert!(job_rows(&lines)[0].contains("1.25~"), "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("PD~: ")), "{lines:#?}");
}

/// The best Σ PD of a co-location is shown while it runs, not after one of its jobs left
/// (the tuner keeps its observations until its residents change).
#[tokio::test]
async fn the_best_sum_pd_is_that_of_a_co_location_that_still_runs() {
    let best = |s: &Snapshot| s.devices[0].tuner.as_ref().and_then(|t| t.best_sum_pd);
    assert_eq!(best(&two_jobs().await), Some(2.25));
    assert_eq!(best(&two_jobs_reserved(&["a"]).await), None);
    assert_eq!(best(&two_jobs_reserved(&[]).await), None);
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
    assert_eq!(
        s.unplaced,
        ["lost"],
        "a live task without placement; not one whose agent is gone or that finished"
    );
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
    let lines = render::text(&s, Layout::default());
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
        text.contains("Running without a reservation: lost")
            && text.contains("one started without `iadeep run` is"),
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
    let text = render::text(&s, Layout::default()).join("\n");
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
    let settled = TunerState {
        settled: true,
        ..with_j.clone()
    };
    assert_eq!(phase(&movable, false, true, Some(&settled)), "settled");
    assert_eq!(phase(&movable, false, false, Some(&settled)), "holding");
}

/// A job pinned at m0 = 32 with a solo profile of 0.1 s per step, in `class` with `cap`.
fn classed(id: &str, class: PriorityClass, cap: Option<f64>) -> TaskSpec {
    TaskSpec {
        priority_class: class as i32,
        max_slowdown: cap,
        profile: Some(SoloProfile {
            batch_size: 32,
            step_time_s: Some(0.1),
            ..SoloProfile::default()
        }),
        ..spec(id, 32, 0, 0)
    }
}

/// One GPU shared by `p` (production, cap 1.20, measured at PD 1.30), `q` (production,
/// default cap 1.10, PD 1.05) and `o` (opportunistic, PD 1.50, evicted by the placer),
/// with the breach its tuner recorded for `p`.
async fn classes_and_eviction() -> Snapshot {
    let store = EmbeddedStore::in_memory().expect("store");
    let info = DeviceInfo {
        device_id: "gpu-0".into(),
        memory_mib: 16_384,
        ..DeviceInfo::default()
    };
    typed::put(&store, &keys::device_info("gpu-0"), &info, None)
        .await
        .expect("info");
    let production = PriorityClass::Production;
    put_task(&store, &classed("p", production, Some(1.2)), 32, 0.13, 3000).await;
    put_task(&store, &classed("q", production, None), 32, 0.105, 3000).await;
    put_task(
        &store,
        &classed("o", PriorityClass::Opportunistic, None),
        32,
        0.15,
        3000,
    )
    .await;
    let reason = "p on gpu-0 stayed above its cap (PD 1.30 > 1.20) for 3 rounds";
    let evict = BatchSizeAssignment {
        task_id: "o".into(),
        batch_size: 32,
        lr_factor: 1.0,
        round: 5,
        evict: true,
        evict_reason: reason.into(),
        ..BatchSizeAssignment::default()
    };
    typed::put(&store, &keys::task_assignment("o"), &evict, None)
        .await
        .expect("evict");
    let breach = CapBreach {
        device_id: "gpu-0".into(),
        task_id: "p".into(),
        measured_pd: 1.3,
        max_slowdown: 1.2,
        rounds_above: 3,
        opportunistic_task_ids: vec!["o".into()],
        round: 5,
        at_unix_ms: NOW_MS - 4_000,
    };
    typed::put(&store, &keys::device_breach("gpu-0"), &breach, None)
        .await
        .expect("breach");
    read::read(&store, NOW_MS).await.expect("read")
}

/// A production job above its cap alone on its GPU is marked: no co-runner is to blame.
#[tokio::test]
async fn a_job_above_its_cap_alone_is_marked() {
    let mut s = classes_and_eviction().await;
    s.jobs.retain(|j| j.id == "p");
    let text = render::text(&s, Layout::default()).join("\n");
    assert!(
        text.contains("ABOVE CAP: p (1.30 > 1.20, alone)") && text.contains("alone: no co-runner"),
        "{text}"
    );
}

#[tokio::test]
async fn class_cap_breach_and_eviction_are_shown_and_above_cap_is_flagged() {
    let s = classes_and_eviction().await;
    let job = |id: &str| s.jobs.iter().find(|j| j.id == id).expect("job");
    let (p, q, o) = (job("p"), job("q"), job("o"));
    assert_eq!(
        (p.class, p.cap, p.above_cap),
        ("production", Some(1.2), Some(true))
    );
    assert_eq!(
        (q.class, q.cap, q.above_cap),
        (
            "production",
            Some(iadeep_proto::DEFAULT_MAX_SLOWDOWN),
            Some(false)
        ),
        "the default cap, and a PD under it"
    );
    assert_eq!((o.class, o.cap, o.above_cap), ("opportunistic", None, None));
    assert!(
        o.evicted
            .as_deref()
            .is_some_and(|r| r.contains("above its cap"))
    );
    assert_eq!((p.evicted.as_deref(), q.evicted.as_deref()), (None, None));
    let breach = s.devices[0].breach.as_ref().expect("the breach record");
    assert_eq!((breach.task_id.as_str(), breach.rounds_above), ("p", 3));

    let lines = render::text(&s, Layout::default());
    for line in &lines {
        assert!(
            line.chars().count() <= render::WIDTH,
            "{} columns: {line}",
            line.chars().count()
        );
    }
    let text = lines.join("\n");
    let row = |id: &str| {
        lines
            .iter()
            .find(|l| l.starts_with(&format!("{id} ")))
            .unwrap_or_else(|| panic!("a row for {id}:\n{text}"))
    };
    assert!(
        row("p").contains(" 1.20 ") && row("p").contains(" 1.30! "),
        "{text}"
    );
    assert!(
        row("q").contains(" 1.10 ") && row("q").contains(" 1.05 "),
        "{text}"
    );
    assert!(
        !row("q").contains('!') && row("o").contains(" - "),
        "{text}"
    );
    assert!(row("o").contains("evicted"), "{text}");
    assert!(text.contains("ABOVE CAP: p (1.30 > 1.20)"), "{text}");
    assert!(!text.contains("alone"), "p has co-runners: {text}");
    assert!(
        text.contains(&format!(
            "EVICTED o: {}",
            o.evicted.as_deref().unwrap_or("")
        )),
        "{text}"
    );
    assert!(
        text.contains("BREACH on gpu-0 (4s ago): p PD 1.30 > cap 1.20 for 3 rounds"),
        "{text}"
    );

    let json = render::json(&s);
    let jobs = json["jobs"].as_array().expect("jobs");
    let job = |id: &str| jobs.iter().find(|j| j["id"] == id).expect("job");
    assert_eq!(job("p")["class"], "production");
    assert_eq!(job("p")["max_slowdown"], 1.2);
    assert_eq!(job("p")["above_cap"], true);
    assert_eq!(job("q")["above_cap"], false);
    assert_eq!(job("o")["class"], "opportunistic");
    assert!(job("o")["max_slowdown"].is_null() && job("o")["above_cap"].is_null());
    assert_eq!(job("o")["evict"], true);
    assert!(
        job("o")["evict_reason"]
            .as_str()
            .is_some_and(|r| r.contains("PD 1.30"))
    );
    assert_eq!(job("p")["evict"], false);
    assert!(job("p")["evict_reason"].is_null());
    let breach = &json["devices"][0]["breach"];
    assert_eq!(breach["task_id"], "p");
    assert_eq!(breach["opportunistic_task_ids"][0], "o");
    assert_eq!(breach["measured_pd"], 1.3);
}

/// The job rows of `text`: the lines after the JOB header up to the first footnote.
fn job_rows(lines: &[String]) -> Vec<&str> {
    lines
        .iter()
        .skip_while(|l| !l.starts_with("JOB "))
        .skip(1)
        .take_while(|l| !l.starts_with("MiB:"))
        .map(String::as_str)
        .collect()
}

#[tokio::test]
async fn two_jobs_of_one_script_are_told_apart_in_the_table() {
    // `iadeep run` names a task SCRIPT-UNIXTIME-PID: two jobs of one script share a
    // prefix longer than the JOB column, so the column must keep their ends.
    let mut s = two_jobs().await;
    s.jobs[0].id = "train_mnist_like-1795685033-20793".into();
    s.jobs[1].id = "train_mnist_like-1795685053-21163".into();
    let lines = render::text(&s, Layout::default());
    let rows = job_rows(&lines);
    let cells: Vec<&str> = rows
        .iter()
        .map(|r| r.split_whitespace().next().unwrap_or(""))
        .collect();
    assert_eq!(cells.len(), 2, "{lines:#?}");
    assert_ne!(cells[0], cells[1], "{lines:#?}");
    assert!(
        cells[0].starts_with("train_") && cells[0].ends_with("-20793"),
        "{cells:?}"
    );
    assert!(rows.iter().all(|r| r.chars().count() <= render::WIDTH));
    assert!(
        lines.iter().any(|l| l.starts_with("Ids cut")),
        "the cut is said, with the way to see whole ids: {lines:#?}"
    );
    // The lines under the table name the jobs as the table does.
    for (phase, id) in [("tuning:", cells[0]), ("fixed:", cells[1])] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(phase) && l.ends_with(&format!("({id})"))),
            "{lines:#?}"
        );
    }
}

/// A job placed moments ago, its agent not started yet (Python still importing), is not
/// shown as one whose agent is gone.
#[tokio::test]
async fn a_job_whose_agent_never_started_is_not_gone() {
    let mut s = two_jobs().await;
    s.jobs[1].running = false;
    s.jobs[1].finished = false;
    s.jobs[1].reported_at_unix_ms = Some(NOW_MS - 3_000);
    let rows = |s: &Snapshot| {
        job_rows(&render::text(s, Layout::default()))
            .iter()
            .map(|r| (*r).to_owned())
            .collect::<Vec<String>>()
    };
    assert!(rows(&s)[1].ends_with("(agent gone)"), "{:?}", rows(&s));
    s.jobs[1].reported_at_unix_ms = None;
    assert!(rows(&s)[1].ends_with("(no agent yet)"), "{:?}", rows(&s));
    s.jobs[1].placed_at_unix_ms = Some(NOW_MS - 30_000);
    assert!(rows(&s)[1].ends_with("(no agent yet)"), "{:?}", rows(&s));
}

/// A job placed minutes ago whose agent never reported is not "yet": its script may not
/// run at all, or run without an agent, and the table says which question to ask.
#[tokio::test]
async fn a_job_whose_agent_never_came_says_for_how_long() {
    let mut s = two_jobs().await;
    s.jobs[1].running = false;
    s.jobs[1].finished = false;
    s.jobs[1].reported_at_unix_ms = None;
    s.jobs[1].placed_at_unix_ms = Some(NOW_MS - 600_000);
    let lines = render::text(&s, Layout::default());
    let rows = job_rows(&lines);
    assert!(rows[1].ends_with("(no agent 10m)"), "{rows:?}");
    assert!(
        lines.iter().any(|l| l.starts_with("no agent T:")),
        "the mark is explained: {lines:#?}"
    );
    assert_eq!(
        render::json(&s)["jobs"][1]["placed_at_unix_ms"],
        NOW_MS - 600_000
    );
    s.jobs[1].running = true;
    let lines = render::text(&s, Layout::default());
    assert!(
        !lines.iter().any(|l| l.starts_with("no agent T:")),
        "{lines:#?}"
    );
}

#[tokio::test]
async fn the_wide_table_shows_whole_ids_in_aligned_columns() {
    let mut s = two_jobs().await;
    s.jobs[0].id = "train_mnist_like-1795685033-20793".into();
    s.jobs[1].id = "b".into();
    let wide = Layout { wide: true };
    let lines = render::text(&s, wide);
    let rows = job_rows(&lines);
    let cells: Vec<&str> = rows
        .iter()
        .map(|r| r.split_whitespace().next().unwrap_or(""))
        .collect();
    assert_eq!(
        cells,
        ["train_mnist_like-1795685033-20793", "b"],
        "{lines:#?}"
    );
    // The columns after the id start at the same place in every row and the header.
    let gpu_at = |row: &str| row.find("gpu-0");
    assert_eq!(gpu_at(rows[0]), gpu_at(rows[1]), "{lines:#?}");
    let header = lines
        .iter()
        .find(|l| l.starts_with("JOB "))
        .expect("the jobs' header");
    assert_eq!(header.find("GPU"), gpu_at(rows[0]), "{lines:#?}");
    assert!(!lines.iter().any(|l| l.contains("--wide")), "{lines:#?}");
}

#[tokio::test]
async fn a_batch_size_being_moved_is_marked_next_to_the_new_lr_factor() {
    let mut s = two_jobs().await;
    let lines = render::text(&s, Layout::default());
    assert!(
        !lines.iter().any(|l| l.starts_with("BATCH*")),
        "reports match assignments: no mark\n{lines:#?}"
    );
    // a reported 64; the tuner has since assigned 128 (whose LR× the table shows).
    s.jobs[0].assigned_batch_size = Some(128);
    let lines = render::text(&s, Layout::default());
    let rows = job_rows(&lines);
    assert!(rows[0].contains(" 64* "), "{lines:#?}");
    assert!(!rows[1].contains('*'), "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.starts_with("BATCH*: ")),
        "{lines:#?}"
    );
}

#[test]
fn one_measured_configuration_is_singular() {
    let spec = spec("a", 32, 8, 256);
    let mut tuner = TunerState {
        task_ids: vec!["a".into()],
        observations: vec![TunerObservation {
            batch_sizes: vec![32],
            sum_pd: Some(1.0),
            round: 1,
        }],
        ..TunerState::default()
    };
    let why = |t: &TunerState| read::tuning("a", &spec, false, true, Some(t)).why;
    assert_eq!(why(&tuner), "1 configuration of its GPU measured");
    tuner.observations.push(TunerObservation {
        batch_sizes: vec![64],
        sum_pd: Some(1.0),
        round: 2,
    });
    assert_eq!(why(&tuner), "2 configurations of its GPU measured");
}
