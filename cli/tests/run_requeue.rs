//! `iadeep run` after an eviction, against `iadeep up --no-nvml` (real processes, real
//! etcd, ports picked free): the test writes the placer's evict assignment for a
//! running job; the job (an emulated one with the real agent) leaves and exits, `iadeep
//! run` releases it, places it again under the same id and restarts the command with
//! IADEEP_REQUEUED=1 and the reason, and the restarted job finishes. The task is never
//! placed twice at once. A production job is not restarted (its default), and a cap on
//! an opportunistic job is refused before anything is placed. A job that ignores its
//! eviction (no agent, SIGTERM trapped, a grandchild that ignores SIGTERM) is stopped by
//! `iadeep run` after `--evict-grace` (SIGTERM, then SIGKILL, to its whole process tree)
//! and re-queued like one that left; one whose last report says finished is not.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{DEADLINE, LocalCluster};
use serde_json::Value;

const REASON: &str = "prod-1 ran at PD 1.31 above its cap 1.10 for 3 rounds";

/// A job script: notes each start (its IADEEP_REQUEUED, class and eviction reason) in
/// `$RUNS`, then runs an emulated job: until stopped on its first run, 20 steps after a
/// restart.
const JOB: &str = r#"
echo "run ${IADEEP_REQUEUED:-0} ${IADEEP_PRIORITY_CLASS} ${IADEEP_EVICTED_REASON}" >> "$RUNS"
if [ -z "$IADEEP_REQUEUED" ]; then steps=100000000; else steps=20; fi
exec "$IADEEP_BIN" emulate-job --task-id "$IADEEP_TASK_ID" --model cifar10 \
    --initial-batch-size 64 --min-batch-size 32 --max-batch-size 256 \
    --time-scale 0.05 --report-interval 0.2 --lease-ttl 2 --steps "$steps"
"#;

/// A job that ignores its eviction: no iadeep agent, and SIGTERM only noted in
/// `$MARKS`; it runs until killed, and so does the process it started in the
/// background (a trainer under a wrapper), which ignores SIGTERM and whose id is in
/// `$MARKS.grandchild`, and one it started with a double fork (its parent exits at once,
/// as a daemonising launcher's does), id in `$MARKS.escaped`. Restarted, it exits 0 at
/// once.
const STUBBORN_JOB: &str = r#"
echo "run ${IADEEP_REQUEUED:-0} ${IADEEP_PRIORITY_CLASS} ${IADEEP_EVICTED_REASON}" >> "$RUNS"
if [ -n "$IADEEP_REQUEUED" ]; then exit 0; fi
trap 'echo "got SIGTERM; carrying on" >> "$MARKS"' TERM
sh -c 'trap "" TERM; while :; do sleep 0.1; done' &
echo "$!" > "$MARKS.grandchild"
(sh -c 'trap "" TERM; while :; do sleep 0.1; done' & echo "$!" > "$MARKS.escaped")
echo started >> "$MARKS"
while :; do sleep 0.1; done
"#;

/// A job without an agent that runs until `$MARKS.done` exists, noting SIGTERM in
/// `$MARKS`: one writing its outputs after its last report said finished. It leaves
/// behind a server it started with a double fork (id in `$MARKS.server`).
const FINISHING_JOB: &str = r#"
echo "run ${IADEEP_REQUEUED:-0}" >> "$RUNS"
trap 'echo "got SIGTERM" >> "$MARKS"' TERM
(sh -c 'while :; do sleep 0.1; done' & echo "$!" > "$MARKS.server")
echo started >> "$MARKS"
while [ ! -e "$MARKS.done" ]; do sleep 0.1; done
"#;

/// Put before [`JOB`]: on its first run the job leaves behind a process it started with
/// a double fork (id in `$RUNS.leftover`), as a daemonising data server would.
const LEAVES_A_PROCESS: &str = r#"
if [ -z "$IADEEP_REQUEUED" ]; then
    (sh -c 'while :; do sleep 0.1; done' & echo "$!" > "$RUNS.leftover")
fi
"#;

/// `iadeep run ARGS -- sh JOB` in the background, its output in `dir`/TASK.log.
fn start_run(cluster: &LocalCluster, dir: &Path, task: &str, args: &[&str]) -> Child {
    start_job(cluster, dir, task, JOB, args)
}

/// `iadeep run ARGS -- sh SCRIPT` in the background, its output in `dir`/TASK.log.
fn start_job(cluster: &LocalCluster, dir: &Path, task: &str, job: &str, args: &[&str]) -> Child {
    let script = dir.join(format!("{task}.sh"));
    std::fs::write(&script, job).expect("write the job script");
    let log = std::fs::File::create(dir.join(format!("{task}.log"))).expect("log");
    Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args([
            "run",
            "--task-id",
            task,
            "--model",
            "cifar10",
            "--batch-size",
            "64",
        ])
        .args(["--min-batch-size", "32", "--max-batch-size", "256"])
        .args(["--gpu-mem-mib", "2000"])
        .args(args)
        .arg("--")
        .arg("sh")
        .arg(&script)
        .env("IADEEP_STORE", &cluster.store)
        .env("IADEEP_PLACER", &cluster.placer)
        .env("IADEEP_BIN", env!("CARGO_BIN_EXE_iadeep"))
        .env("RUNS", dir.join(format!("{task}.runs")))
        .env("MARKS", dir.join(format!("{task}.marks")))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("spawn iadeep run")
}

/// How many times `task` is among the residents of the cluster's devices now.
fn residencies(cluster: &LocalCluster, task: &str) -> usize {
    cluster
        .device_infos()
        .iter()
        .filter_map(|info| cluster.get(&info.replace("/info", "/residents")))
        .map(|record| {
            record["reservations"]
                .as_array()
                .map_or(0, |r| r.iter().filter(|r| r["taskId"] == task).count())
        })
        .sum()
}

/// Writes the placer's eviction of `task`: its assignment repeated, with evict set.
fn evict(cluster: &LocalCluster, task: &str) {
    let key = format!("/iadeep/v1/tasks/{task}/assignment");
    let mut assignment = cluster.get(&key).unwrap_or_else(
        || serde_json::json!({"taskId": task, "batchSize": 64, "lrFactor": 1.0, "round": "1"}),
    );
    assignment["evict"] = Value::Bool(true);
    assignment["evictReason"] = Value::String(REASON.into());
    common::state_put(&cluster.store, &[&key, &assignment.to_string()]);
}

/// Waits until `task` has reported steps, checking it is placed at most once meanwhile.
fn wait_for_steps(cluster: &LocalCluster, dir: &Path, task: &str) {
    let started = Instant::now();
    loop {
        assert!(residencies(cluster, task) <= 1, "placed twice");
        let steps = cluster
            .get(&format!("/iadeep/v1/tasks/{task}/report"))
            .and_then(|r| r["stepsDone"].as_str().and_then(|s| s.parse::<u64>().ok()));
        if steps.is_some_and(|s| s > 0) {
            return;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{task} reported no steps:\n{}\n{}",
            read(&dir.join(format!("{task}.log"))),
            cluster.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for `iadeep run` to exit, checking the task is placed at most once meanwhile.
fn wait_for_exit(cluster: &LocalCluster, dir: &Path, task: &str, run: &mut Child) -> i32 {
    let started = Instant::now();
    loop {
        assert!(residencies(cluster, task) <= 1, "placed twice");
        if let Some(status) = run.try_wait().expect("wait") {
            return status.code().expect("an exit code");
        }
        if started.elapsed() > DEADLINE {
            let _ = run.kill();
            panic!(
                "iadeep run did not exit:\n{}\n{}",
                read(&dir.join(format!("{task}.log"))),
                cluster.log()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn an_evicted_job_is_released_placed_again_and_restarted_until_it_finishes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let dir = tmp.path();
    let task = "rq-1";
    let job = format!("{LEAVES_A_PROCESS}{JOB}");
    let mut run = start_job(&cluster, dir, task, &job, &[]);
    wait_for_steps(&cluster, dir, task);
    let leftover = pid_in(&dir.join(format!("{task}.runs.leftover")));
    let _cleanup = KillOnDrop::new(&[leftover]);
    assert!(runs(leftover), "the leftover started");
    evict(&cluster, task);
    let code = wait_for_exit(&cluster, dir, task, &mut run);
    let log = read(&dir.join(format!("{task}.log")));
    assert_eq!(code, 0, "the restarted job's exit code:\n{log}");
    // The job left on its own, but what it left behind would keep the GPU given away.
    assert!(
        !runs(leftover),
        "the evicted job's leftover was killed:\n{log}"
    );
    assert!(
        log.contains("the evicted job left processes behind"),
        "{log}"
    );
    assert_eq!(
        read(&dir.join(format!("{task}.runs"))),
        format!("run 0 opportunistic \nrun 1 opportunistic {REASON}\n"),
        "started twice, the second time told it was re-queued and why:\n{log}"
    );
    assert!(log.contains("evicted"), "{log}");
    // How the job ended, as a field (not ExitStatus's "status=exit status: 0").
    assert!(
        log.lines()
            .any(|line| line.contains("job exited") && line.contains("exit_code=0")),
        "{log}"
    );
    // The second run finished its work; nothing of the task is placed any more.
    let report = cluster
        .get(&format!("/iadeep/v1/archive/{task}/report"))
        .expect("the archived report");
    assert_eq!(report["finished"], true, "{report}");
    assert_eq!(report["stepsDone"], "20", "{report}");
    assert_eq!(residencies(&cluster, task), 0);
    assert!(
        cluster
            .get(&format!("/iadeep/v1/tasks/{task}/placement"))
            .is_none()
    );
}

#[test]
fn a_production_job_is_not_restarted_and_a_cap_needs_the_production_class() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let dir = tmp.path();

    // A cap on an opportunistic job: refused before anything is placed.
    let out = cluster.run(&["--batch-size", "64", "--max-slowdown", "1.2", "--", "true"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--max-slowdown applies to --class production only"),
        "{err}"
    );
    let out = cluster.run(&[
        "--batch-size",
        "64",
        "--class",
        "production",
        "--max-slowdown",
        "0.9",
        "--",
        "true",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not a slowdown cap"),
        "{err}"
    );

    let task = "prod-rq";
    let mut run = start_run(
        &cluster,
        dir,
        task,
        &["--class", "production", "--max-slowdown", "1.25"],
    );
    wait_for_steps(&cluster, dir, task);
    let spec = cluster
        .get(&format!("/iadeep/v1/tasks/{task}/spec"))
        .expect("spec");
    assert_eq!(spec["priorityClass"], "PRIORITY_CLASS_PRODUCTION", "{spec}");
    assert_eq!(spec["maxSlowdown"], 1.25, "{spec}");
    evict(&cluster, task);
    let code = wait_for_exit(&cluster, dir, task, &mut run);
    let log = read(&dir.join(format!("{task}.log")));
    assert_eq!(code, 75, "the evicted job's own exit code:\n{log}");
    assert_eq!(
        read(&dir.join(format!("{task}.runs"))),
        "run 0 production \n",
        "{log}"
    );
    assert!(log.contains("not restarting it"), "{log}");
    assert_eq!(residencies(&cluster, task), 0, "released");
}

/// Waits until `path` holds `line`.
/// [`start_job`] for a job that writes the lines of its life to `{task}.marks`, once
/// its first line, `started`, is there; with the marks' path.
fn started(
    cluster: &LocalCluster,
    dir: &Path,
    task: &str,
    job: &str,
    args: &[&str],
) -> (Child, PathBuf) {
    let marks = dir.join(format!("{task}.marks"));
    let run = start_job(cluster, dir, task, job, args);
    wait_for_line(dir, task, &marks, "started");
    (run, marks)
}

fn wait_for_line(dir: &Path, task: &str, path: &Path, line: &str) {
    let started = Instant::now();
    while !read(path).lines().any(|l| l == line) {
        assert!(
            started.elapsed() < DEADLINE,
            "no {line:?} in {}:\n{}",
            path.display(),
            read(&dir.join(format!("{task}.log")))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The process id a job script wrote into `path` (`echo "$!" > path`).
fn pid_in(path: &Path) -> i32 {
    let text = read(path);
    text.trim()
        .parse()
        .unwrap_or_else(|err| panic!("{}: {text:?} is not a pid: {err}", path.display()))
}

/// `/proc/PID/stat`'s fields after the command name (the state first), while `pid` is
/// listed.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, tail) = stat.rsplit_once(')')?;
    Some(tail.split_whitespace().map(str::to_owned).collect())
}

/// Whether process `pid` still runs: listed by /proc and not a zombie (one that exited,
/// unreaped, holds no memory).
fn runs(pid: i32) -> bool {
    stat_fields(pid)
        .and_then(|fields| fields.first().cloned())
        .is_some_and(|state| state != "Z" && state != "X")
}

/// SIGKILL to the job's background processes when the test ends, however it ends: one
/// that outlived a failed assertion would spin on for the rest of the test run. Each is
/// known by its pid and start time, so a pid reused since is left alone.
struct KillOnDrop(Vec<(i32, Option<String>)>);

impl KillOnDrop {
    fn new(pids: &[i32]) -> Self {
        let start = |pid: i32| stat_fields(pid).and_then(|f| f.get(19).cloned());
        Self(pids.iter().map(|&pid| (pid, start(pid))).collect())
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for (pid, start) in &self.0 {
            let now = stat_fields(*pid).and_then(|f| f.get(19).cloned());
            if start.is_some() && now == *start {
                let _ = Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

/// Waits until the log of `task` has a line holding every one of `parts`, while
/// `iadeep run` (`run`) is still running.
fn wait_for_log(dir: &Path, task: &str, run: &mut Child, parts: &[&str]) {
    let path = dir.join(format!("{task}.log"));
    let started = Instant::now();
    while !read(&path)
        .lines()
        .any(|line| parts.iter().all(|part| line.contains(part)))
    {
        if let Some(status) = run.try_wait().expect("wait") {
            panic!(
                "iadeep run exited ({status}) with no line with {parts:?}:\n{}",
                read(&path)
            );
        }
        assert!(
            started.elapsed() < DEADLINE,
            "no line with {parts:?}:\n{}",
            read(&path)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The gap of issue 27: a job that ignores the evict flag kept its GPU, and the
/// production job it was evicted for stayed above its cap. `iadeep run` stops it once
/// `--evict-grace` is over (SIGTERM, which this one traps, then SIGKILL), releases it,
/// and re-queues and restarts it as after any eviction. The signals reach the whole
/// tree: a grandchild that ignores SIGTERM is gone too once `iadeep run` exits, rather
/// than left on the GPU beside the restarted job. What is asserted is what `iadeep run`
/// says it sent, not when the shell got to its trap (late on a loaded machine).
#[test]
fn a_job_that_ignores_its_eviction_is_stopped_after_the_grace_and_requeued() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let dir = tmp.path();
    let task = "stubborn-1";
    let (mut run, marks) = started(
        &cluster,
        dir,
        task,
        STUBBORN_JOB,
        &["--evict-grace", "1s", "--evict-kill-after", "5s"],
    );
    let grandchild = pid_in(&dir.join(format!("{task}.marks.grandchild")));
    assert!(runs(grandchild), "the grandchild started");
    let escaped = pid_in(&dir.join(format!("{task}.marks.escaped")));
    let _cleanup = KillOnDrop::new(&[grandchild, escaped]);
    assert!(runs(escaped), "the double-forked process started");
    evict(&cluster, task);
    let code = wait_for_exit(&cluster, dir, task, &mut run);
    let log = read(&dir.join(format!("{task}.log")));
    assert_eq!(code, 0, "the restarted job's exit code:\n{log}");
    assert!(
        !runs(grandchild),
        "the grandchild that ignored SIGTERM was killed with the job:\n{log}"
    );
    assert!(
        !runs(escaped),
        "the double-forked process, adopted by iadeep run, was killed with the job:\n{log}"
    );
    let sent = |sig: &str| {
        log.lines()
            .filter(|line| line.contains(&format!("iadeep run sends {sig} to it")))
            .count()
    };
    assert_eq!(sent("SIGTERM"), 1, "SIGTERM once, after the grace:\n{log}");
    assert_eq!(sent("SIGKILL"), 1, "then SIGKILL:\n{log}");
    assert!(
        read(&marks).starts_with("started\n"),
        "{}:\n{log}",
        read(&marks)
    );
    assert_eq!(
        read(&dir.join(format!("{task}.runs"))),
        format!("run 0 opportunistic \nrun 1 opportunistic {REASON}\n"),
        "restarted once, told it was re-queued and why:\n{log}"
    );
    assert!(
        log.lines()
            .any(|line| line.contains("the placer evicted the job")
                && line.contains(REASON)
                && line.contains("1s (--evict-grace)")),
        "a warning names the reason and the grace:\n{log}"
    );
    assert!(
        log.lines().any(|line| line
            .contains("job exited: stopped by iadeep run because of the eviction")
            && line.contains("was killed by SIGKILL")),
        "the exit line says iadeep run killed it:\n{log}"
    );
    assert!(log.contains("queueing it again"), "{log}");
    assert_eq!(residencies(&cluster, task), 0, "released");
}

/// A job whose last report says it finished its work is writing its outputs: evicted
/// then, it is not stopped however long it takes, and not restarted once it exits.
#[test]
fn an_evicted_job_whose_report_says_finished_is_not_stopped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let dir = tmp.path();
    let task = "finishing-1";
    let (mut run, marks) = started(
        &cluster,
        dir,
        task,
        FINISHING_JOB,
        &["--evict-grace", "0s", "--evict-kill-after", "0s"],
    );
    let report = serde_json::json!({"taskId": task, "stepsDone": "20", "finished": true});
    common::state_put(
        &cluster.store,
        &[
            &format!("/iadeep/v1/tasks/{task}/report"),
            &report.to_string(),
        ],
    );
    evict(&cluster, task);
    // Said where SIGTERM would have been sent.
    wait_for_log(
        dir,
        task,
        &mut run,
        &["says it finished its work", "not stopping it"],
    );
    std::fs::write(dir.join(format!("{task}.marks.done")), "").expect("done");
    let code = wait_for_exit(&cluster, dir, task, &mut run);
    let log = read(&dir.join(format!("{task}.log")));
    assert_eq!(code, 0, "its own exit code:\n{log}");
    assert_eq!(read(&marks), "started\n", "no SIGTERM:\n{log}");
    assert!(!log.contains("iadeep run sends"), "{log}");
    assert_eq!(read(&dir.join(format!("{task}.runs"))), "run 0\n", "{log}");
    let server = pid_in(&dir.join(format!("{task}.marks.server")));
    let _cleanup = KillOnDrop::new(&[server]);
    assert!(
        log.lines()
            .any(|line| line.contains("processes it started still run")
                && line.contains(&server.to_string())),
        "what the job left running is named, not stopped:\n{log}"
    );
    assert!(
        runs(server),
        "a job that was not stopped keeps what it started"
    );
}
