//! `iadeep status` against `iadeep up --no-nvml` with two jobs running (real processes,
//! real etcd, ports picked free): its JSON says what the store says, its text fits 100
//! columns, and an empty or unreachable cluster is said in words, in bounded time.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{DEADLINE, LocalCluster, free_port};
use serde_json::{Value, json};

/// `iadeep status ARGS` on the cluster.
fn status(cluster: &LocalCluster, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .arg("status")
        .args(args)
        .env("IADEEP_STORE", &cluster.store)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep status")
}

fn status_json(cluster: &LocalCluster) -> Value {
    common::succeeded_json(&status(cluster, &["--json"]))
}

/// An `iadeep run` of an emulated job, stopped (SIGTERM, as Ctrl-C would) when dropped.
struct Job(Child);

impl Job {
    /// `class` is `iadeep run`'s class flags (none: opportunistic).
    fn start(cluster: &LocalCluster, task: &str, m0: &str, class: &[&str]) -> Job {
        let child = Command::new(env!("CARGO_BIN_EXE_iadeep"))
            .args([
                "run",
                "--task-id",
                task,
                "--model",
                "cifar10",
                "--batch-size",
                m0,
            ])
            .args(["--min-batch-size", "32", "--max-batch-size", "256"])
            .args(class)
            .args(["--gpu-mem-mib", "2000", "--"])
            .arg(env!("CARGO_BIN_EXE_iadeep"))
            .args(["emulate-job", "--task-id", task, "--model", "cifar10"])
            .args(["--initial-batch-size", m0, "--min-batch-size", "32"])
            .args(["--max-batch-size", "256", "--time-scale", "0.05"])
            .args(["--report-interval", "0.2"])
            .env("IADEEP_STORE", &cluster.store)
            .env("IADEEP_PLACER", &cluster.placer)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn iadeep run");
        Job(child)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("pid"));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let started = Instant::now();
        while matches!(self.0.try_wait(), Ok(None)) && started.elapsed() < DEADLINE {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The job of `status` with id `task`.
fn job<'a>(status: &'a Value, task: &str) -> &'a Value {
    status["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["id"] == task))
        .unwrap_or_else(|| panic!("{task} in {status}"))
}

/// Σ reserved MiB of the device's residents record, and its task ids, as the store has them.
fn residents(cluster: &LocalCluster, device: &str) -> (u64, Vec<String>) {
    let record = cluster
        .get(&format!("/iadeep/v1/devices/{device}/residents"))
        .expect("a residents record");
    let reservations = record["reservations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    // Protobuf's JSON mapping writes 64-bit integers as strings.
    let mib = |r: &Value| {
        r["reservedMemMib"]
            .as_str()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let mut ids: Vec<String> = reservations
        .iter()
        .filter_map(|r| r["taskId"].as_str().map(str::to_owned))
        .collect();
    ids.sort();
    (reservations.iter().map(mib).sum(), ids)
}

#[test]
fn status_shows_what_the_store_holds_for_two_jobs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));

    let empty = status_json(&cluster);
    assert_eq!(empty["jobs"], Value::Array(vec![]), "{empty}");
    let text = String::from_utf8_lossy(&status(&cluster, &[]).stdout).into_owned();
    assert!(text.contains("No jobs placed."), "{text}");

    // st-a is production with the loosest cap there is, so st-b still shares its GPU.
    let _job_a = Job::start(
        &cluster,
        "st-a",
        "64",
        &["--class", "production", "--max-slowdown", "10"],
    );
    let job_b = Job::start(&cluster, "st-b", "32", &[]);
    let started = Instant::now();
    let reported = |task: &str| {
        cluster
            .get(&format!("/iadeep/v1/tasks/{task}/report"))
            .is_some()
    };
    while !(reported("st-a") && reported("st-b")) {
        assert!(
            started.elapsed() < DEADLINE,
            "both jobs reported:\n{}",
            cluster.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let shown = status_json(&cluster);
    let device = shown["devices"][0]["id"]
        .as_str()
        .expect("a device id")
        .to_owned();
    let info = cluster
        .get(&format!("/iadeep/v1/devices/{device}/info"))
        .expect("its record");
    assert_eq!(shown["devices"][0]["memory_mib"].as_u64(), Some(16384));
    assert_eq!(info["memoryMib"], "16384", "{info}");
    for (task, m0) in [("st-a", 64), ("st-b", 32)] {
        let j = job(&shown, task);
        let spec = cluster
            .get(&format!("/iadeep/v1/tasks/{task}/spec"))
            .expect("spec");
        let placement = cluster
            .get(&format!("/iadeep/v1/tasks/{task}/placement"))
            .expect("placement");
        assert_eq!(j["device"], placement["deviceId"], "{j}");
        assert_eq!(j["m0"], spec["initialBatchSize"], "{j}");
        assert_eq!(j["m0"], m0);
        assert_eq!(j["min_batch_size"], spec["minBatchSize"]);
        assert_eq!(j["max_batch_size"], spec["maxBatchSize"]);
        assert_eq!(j["model"], spec["model"]);
        assert_eq!(j["lr_rule"], "sqrt");
        assert_eq!(j["running"], true, "its agent holds its lease: {j}");
        let batch = j["batch_size"].as_u64().expect("a batch size");
        assert!((32..=256).contains(&batch), "{j}");
        assert!(
            j["report_age_s"].as_f64().is_some_and(|age| age < 60.0),
            "{j}"
        );
        assert_eq!(j["evict"], false, "{j}");
        assert!(j["evict_reason"].is_null(), "{j}");
    }
    // The class and cap are the spec's; above_cap is the tuner's test on the PD shown.
    let a = job(&shown, "st-a");
    assert_eq!(
        (&a["class"], &a["max_slowdown"]),
        (&json!("production"), &json!(10.0)),
        "{a}"
    );
    match a["pd"].as_f64() {
        Some(pd) => assert_eq!(a["above_cap"], json!(pd > 10.0), "{a}"),
        None => assert!(a["above_cap"].is_null(), "{a}"),
    }
    let b = job(&shown, "st-b");
    assert_eq!(b["class"], "opportunistic", "{b}");
    assert!(
        b["max_slowdown"].is_null() && b["above_cap"].is_null(),
        "{b}"
    );
    assert!(shown["devices"][0]["breach"].is_null(), "{shown}");

    // Reservations move when a job reports its first peak: compare when two reads of the
    // status agree, so the store read between them saw the same state.
    let agreed = (0..20).find_map(|_| {
        let before = status_json(&cluster);
        let store = residents(&cluster, &device);
        let after = status_json(&cluster);
        let pick = |s: &Value| {
            (
                s["devices"][0]["reserved_mib"].clone(),
                s["devices"][0]["residents"].clone(),
            )
        };
        (pick(&before) == pick(&after)).then(|| (pick(&after), store))
    });
    let ((reserved, ids), (store_reserved, store_ids)) = agreed.expect("two reads agreed");
    assert_eq!(reserved.as_u64(), Some(store_reserved));
    let mut shown_ids: Vec<String> = serde_json::from_value(ids).expect("ids");
    shown_ids.sort();
    assert_eq!(shown_ids, store_ids);
    assert_eq!(store_ids, ["st-a", "st-b"]);

    let out = status(&cluster, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for line in text.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns:\n{line}",
            line.chars().count()
        );
    }
    eprintln!("{text}");
    assert!(text.contains("st-a") && text.contains("st-b"), "{text}");
    let row = |id: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{id} ")))
            .unwrap_or_else(|| panic!("a row for {id}:\n{text}"))
    };
    assert!(row("st-a").contains(" 10.00 "), "st-a's cap:\n{text}");
    assert!(row("st-b").contains(" - "), "st-b has no cap:\n{text}");
    assert!(text.contains(&device), "{text}");

    // A job that ends is released: it leaves the list and counts as released.
    drop(job_b);
    let started = Instant::now();
    let after = loop {
        let shown = status_json(&cluster);
        if shown["jobs"].as_array().is_some_and(|jobs| jobs.len() == 1) {
            break shown;
        }
        assert!(started.elapsed() < DEADLINE, "st-b released: {shown}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(after["jobs"][0]["id"], "st-a", "{after}");
    assert_eq!(after["released_jobs"], 1, "{after}");
}

#[test]
fn an_unreachable_store_is_said_in_words_not_waited_on() {
    let started = Instant::now();
    let store = format!("etcd://127.0.0.1:{}", free_port());
    let out = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["status", "--store", &store, "--timeout", "5"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("cannot reach etcd"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// A port that accepts connections but never answers (the kernel's backlog accepts them;
/// nobody reads): the status gives up after --timeout instead of hanging.
#[test]
fn a_store_that_never_answers_times_out() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args([
            "status",
            "--store",
            &format!("etcd://127.0.0.1:{port}"),
            "--timeout",
            "2",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep status");
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("did not answer within 2 s"), "{stderr}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    drop(silent);
}

/// An embedded store file at `path` holding one registered GPU, `w-gpu0` of 8192 MiB.
fn store_with_one_gpu(path: &std::path::Path) {
    let runtime = iadeep_state::testing::runtime();
    let store = iadeep_state::EmbeddedStore::open(path).expect("create the store");
    let info = iadeep_proto::DeviceInfo {
        device_id: "w-gpu0".into(),
        memory_mib: 8192,
        ..iadeep_proto::DeviceInfo::default()
    };
    runtime
        .block_on(iadeep_state::typed::put(
            &store,
            &iadeep_state::keys::device_info("w-gpu0"),
            &info,
            None,
        ))
        .expect("put");
}

/// `iadeep status --watch | head -3`: once the reader has closed the pipe, the watch
/// ends, quietly and successfully, as `main` ends on a closed pipe, instead of printing
/// "error: Broken pipe" every refresh forever.
#[test]
fn watch_ends_quietly_when_its_reader_closes_the_pipe() {
    use std::io::BufRead;

    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("state.redb");
    store_with_one_gpu(&path);
    let mut child = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["status", "--watch", "0.1", "--store"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn iadeep status --watch");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    stdout.read_line(&mut first).expect("the first line");
    assert!(first.contains("at revision"), "{first}");
    drop(stdout); // the reader leaves, as `head` does
    // Waited for on a thread, so a watch that never ends fails after DEADLINE.
    let (send, done) = std::sync::mpsc::channel();
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = send.send(child.wait_with_output().expect("wait"));
    });
    let output = done.recv_timeout(DEADLINE).unwrap_or_else(|_| {
        // Not left running after the test.
        let _ = Command::new("kill").arg(pid.to_string()).status();
        panic!("iadeep status --watch still runs {DEADLINE:?} after its reader left")
    });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{:?}: {stderr}", output.status);
    assert!(!stderr.contains("Broken pipe"), "{stderr}");
}

/// `--watch` on an embedded store file: a JSON object per refresh, with what the file holds
/// (one registered GPU), until the process is stopped.
#[test]
fn watch_prints_one_object_per_refresh_from_an_embedded_store() {
    use std::io::BufRead;

    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("state.redb");
    store_with_one_gpu(&path);
    let mut child = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["status", "--json", "--watch", "0.2", "--store"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn iadeep status --watch");
    // Lines arrive through a channel, so a status that never prints fails the test
    // after DEADLINE instead of hanging it.
    let stdout = child.stdout.take().expect("stdout");
    let (send, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            if line.is_err() || send.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let mut objects = Vec::new();
    while objects.len() < 2 {
        let line = lines
            .recv_timeout(DEADLINE)
            .expect("a refresh within the deadline");
        objects.push(serde_json::from_str::<Value>(&line).expect("JSON"));
    }
    let _ = child.kill();
    let _ = child.wait();
    for object in &objects {
        assert_eq!(object["devices"][0]["id"], "w-gpu0", "{object}");
        assert_eq!(object["devices"][0]["memory_mib"], 8192, "{object}");
        assert_eq!(object["jobs"], Value::Array(vec![]), "{object}");
    }
    assert!(objects[1]["now_unix_ms"].as_i64() >= objects[0]["now_unix_ms"].as_i64());
}
