//! `iadeep up` and `iadeep run` as a user runs them: real processes, a real etcd, on
//! ports the tests pick free (never the defaults, which a user's cluster may hold).

use std::process::Stdio;
use std::time::{Duration, Instant};

mod common;

use common::{DEADLINE, LocalCluster, free_ports};

/// Runs `up` to its end (killing it after `DEADLINE`): exit status, stdout, stderr.
fn finish(mut up: std::process::Command) -> (std::process::ExitStatus, String, String, Duration) {
    let started = Instant::now();
    let mut child = up
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn iadeep up");
    // Output is small (an error), so waiting before reading the pipes cannot block.
    while child.try_wait().expect("try_wait").is_none() {
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!(
                "`iadeep up` still ran after {DEADLINE:?}:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = started.elapsed();
    let out = child.wait_with_output().expect("wait");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        took,
    )
}

/// A second `iadeep up` on another folder but the first one's ports fails at once,
/// naming the port in use, who holds it and the flag that moves it; it never says
/// the cluster is up, writes no cluster.env, and the first cluster runs on unharmed.
#[test]
fn a_second_cluster_on_the_same_ports_fails_at_once_naming_the_port_and_flag() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut first = LocalCluster::start(tmp.path().join("first"));
    let second_dir = tmp.path().join("second");

    let (status, stdout, stderr, took) = finish(LocalCluster::command(
        &second_dir,
        first.etcd_port,
        first.etcd_peer_port,
        first.placer_port,
    ));
    eprintln!("second `iadeep up` ({took:?}): {status}\n{stderr}");
    assert!(!status.success(), "the second cluster failed: {status}");
    assert!(
        !stdout.contains("iadeep cluster up"),
        "it did not claim to be up:\n{stdout}"
    );
    assert!(!second_dir.join("cluster.env").exists(), "no cluster.env");
    let client = format!("127.0.0.1:{} is already in use", first.etcd_port);
    let peer = format!("127.0.0.1:{} is already in use", first.etcd_peer_port);
    let placer = format!("127.0.0.1:{} is already in use", first.placer_port);
    for needle in [&client, &peer, &placer] {
        assert!(
            stderr.contains(needle.as_str()),
            "names {needle}:\n{stderr}"
        );
    }
    for flag in [
        "--etcd-port PORT",
        "--etcd-peer-port PORT",
        "--placer 127.0.0.1:PORT",
    ] {
        assert!(stderr.contains(flag), "names {flag}:\n{stderr}");
    }
    // The holder is the first cluster's etcd (same user: /proc shows it).
    let holder = format!("--data-dir={}", first.dir.join("etcd").display());
    assert!(stderr.contains(&holder), "names the holder:\n{stderr}");
    // No etcd of its own was started, and the folder it created is gone again.
    assert!(!second_dir.join("etcd").exists(), "no etcd was started");
    assert!(!second_dir.exists(), "the folder it created is removed");

    // Only the placer's port in the way: still refused before etcd starts.
    let [etcd_port, etcd_peer_port] = free_ports();
    let third_dir = tmp.path().join("third");
    let (status, _, stderr, _) = finish(LocalCluster::command(
        &third_dir,
        etcd_port,
        etcd_peer_port,
        first.placer_port,
    ));
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains(&placer), "{stderr}");
    assert!(
        !stderr.contains("choose another with --etcd"),
        "only the placer's port:\n{stderr}"
    );
    assert!(!third_dir.join("etcd").exists(), "no etcd was started");
    assert!(!third_dir.exists(), "the folder it created is removed");

    // A folder that existed before the failed start is kept, with what it held.
    let fourth_dir = tmp.path().join("fourth");
    std::fs::create_dir(&fourth_dir).expect("mkdir");
    std::fs::write(fourth_dir.join("notes.txt"), "mine").expect("write");
    let (status, _, stderr, _) = finish(LocalCluster::command(
        &fourth_dir,
        etcd_port,
        etcd_peer_port,
        first.placer_port,
    ));
    assert!(!status.success(), "{stderr}");
    assert!(
        fourth_dir.join("notes.txt").exists(),
        "a folder it did not create is kept"
    );

    assert!(first.running(), "the first cluster still runs");
    assert_eq!(first.device_infos().len(), 1, "its GPU is still registered");
    let status = first.stop().expect("stopped");
    assert!(status.success(), "{status}\n{}", first.log());
}

/// Writes `script` to `path` as an executable: a stand-in for etcd (`--etcd-bin`).
fn write_stand_in(path: &std::path::Path, script: impl AsRef<[u8]>) {
    std::fs::write(path, script).expect("write the stand-in");
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
}

/// Kills a process the test started when the test ends, however it ends.
struct Killed(Option<std::process::Child>);

impl Killed {
    fn child(&mut self) -> &mut std::process::Child {
        self.0.as_mut().expect("not waited for yet")
    }

    /// Waits for the exit; its status and output.
    fn output(mut self) -> std::process::Output {
        let child = self.0.take().expect("not waited for yet");
        child.wait_with_output().expect("wait")
    }
}

impl Drop for Killed {
    /// SIGTERM first: an `iadeep up` stops its etcd then; SIGKILL after 20 s.
    fn drop(&mut self) {
        let Some(child) = self.0.as_mut() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let started = Instant::now();
        while matches!(child.try_wait(), Ok(None)) && started.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// If another etcd takes the client port after `iadeep up` checked it free (here: once
/// its own etcd, a stand-in that never listens, has started), `iadeep up` refuses to
/// use it: it talks only to the etcd it started, and says who holds the port.
#[test]
fn iadeep_up_never_talks_to_an_etcd_it_did_not_start() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let started = tmp.path().join("stand-in-started");
    let stand_in = tmp.path().join("etcd-stand-in");
    write_stand_in(
        &stand_in,
        "#!/bin/sh\n: > \"$IADEEP_TEST_STARTED\"\nexec sleep 600\n",
    );
    let [client, peer, placer, other_peer] = free_ports();
    let mut up = LocalCluster::command(&tmp.path().join("cluster"), client, peer, placer);
    up.arg("--etcd-bin")
        .arg(&stand_in)
        .env("IADEEP_TEST_STARTED", &started)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut up = Killed(Some(up.spawn().expect("spawn iadeep up")));
    let begun = Instant::now();
    while !started.exists() {
        assert!(
            begun.elapsed() < DEADLINE,
            "the stand-in etcd never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Someone else's etcd on the port `iadeep up` gave its own.
    let etcd = iadeep_state::etcd_program::find().expect("etcd is installed");
    let mut other = Killed(Some(
        std::process::Command::new(etcd)
            .arg("--name=other")
            .arg(format!("--data-dir={}", tmp.path().join("other").display()))
            .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{other_peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{other_peer}"
            ))
            .arg(format!(
                "--initial-cluster=other=http://127.0.0.1:{other_peer}"
            ))
            .arg("--log-level=error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start another etcd"),
    ));
    let other_pid = other.child().id();

    while up.child().try_wait().expect("try_wait").is_none() {
        assert!(
            begun.elapsed() < DEADLINE,
            "iadeep up still runs after {DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = up.output();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("iadeep up: {}\n{stderr}", out.status);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(!stdout.contains("iadeep cluster up"), "{stdout}");
    assert!(
        stderr.contains(&format!(
            "port {client} is taken by another process, pid {other_pid}"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("not by the etcd this `iadeep up` started"),
        "{stderr}"
    );
}

/// `iadeep run` without --lr-rule launches the job with sqrt, the Python agent's
/// default, in the spec the placer stores (which the tuner reads) and in the job's
/// IADEEP_LR_RULE; --lr-rule still chooses another.
#[test]
fn iadeep_run_defaults_to_the_sqrt_learning_rate_rule() {
    let help = common::iadeep(&["run", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: sqrt]"), "{help}");

    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    for (task, flags, expected) in [
        ("lr-default", &[][..], "sqrt"),
        ("lr-linear", &["--lr-rule", "linear"][..], "linear"),
    ] {
        let seen = tmp.path().join(format!("{task}.rule"));
        let mut args = vec!["--task-id", task, "--batch-size", "32"];
        args.extend_from_slice(flags);
        let script = format!("printf %s \"$IADEEP_LR_RULE\" > '{}'", seen.display());
        args.extend_from_slice(&["--", "sh", "-c", &script]);
        let out = cluster.run(&args);
        assert!(
            out.status.success(),
            "iadeep run {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let env_rule = std::fs::read_to_string(&seen).expect("the job ran");
        assert_eq!(env_rule, expected, "IADEEP_LR_RULE of {task}");
        // The job ended, so `iadeep run` released it: its spec moved to the archive.
        let spec = cluster
            .get(&format!("/iadeep/v1/archive/{task}/spec"))
            .unwrap_or_else(|| panic!("the spec of {task} is archived"));
        let stored = format!("LR_SCALING_RULE_{}", expected.to_ascii_uppercase());
        assert_eq!(spec["lrRule"], stored.as_str(), "{task}'s spec: {spec}");
    }
}

/// An etcd stand-in that records each start's arguments (a line each in `starts`), fails
/// as etcd does when its peer port is taken for the first `fails` starts, then runs the
/// real etcd.
fn etcd_failing_on_its_peer_port(
    dir: &std::path::Path,
    fails: u32,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let etcd = iadeep_state::etcd_program::find().expect("etcd is installed");
    let starts = dir.join("starts");
    let stand_in = dir.join("etcd-stand-in");
    write_stand_in(
        &stand_in,
        format!(
            "#!/bin/sh\n\
             echo \"$*\" >> '{starts}'\n\
             if [ \"$(wc -l < '{starts}')\" -le {fails} ]; then\n\
             for arg in \"$@\"; do case \"$arg\" in --listen-peer-urls=*) peer=\"${{arg##*:}}\";; esac; done\n\
             echo \"{{\\\"level\\\":\\\"fatal\\\",\\\"msg\\\":\\\"discovery failed\\\",\\\"error\\\":\
             \\\"listen tcp 127.0.0.1:$peer: bind: address already in use\\\"}}\" >&2\n\
             exit 1\n\
             fi\n\
             exec '{etcd}' \"$@\"\n",
            starts = starts.display(),
            etcd = etcd.display()
        ),
    );
    (stand_in, starts)
}

/// The arguments of each start of the stand-in, a line each.
fn starts(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// When another process takes a port `iadeep up` picked for etcd (`--etcd-port 0`) before
/// etcd binds it, etcd exits at once; `iadeep up` starts it again on other ports and
/// comes up, rather than failing (this failed a CI run: the two picked ports were the
/// same). Here the first etcd is a stand-in that fails as etcd does on a taken port.
#[test]
fn iadeep_up_starts_etcd_again_when_a_port_it_picked_was_taken() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (stand_in, starts_file) = etcd_failing_on_its_peer_port(tmp.path(), 1);
    let dir = tmp.path().join("cluster");
    let mut up = LocalCluster::command(&dir, 0, 0, 0);
    up.arg("--etcd-bin")
        .arg(&stand_in)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut up = Killed(Some(up.spawn().expect("spawn iadeep up")));
    let begun = Instant::now();
    while !dir.join("cluster.env").exists() {
        if let Some(status) = up.child().try_wait().expect("try_wait") {
            let out = up.output();
            panic!(
                "iadeep up exited with {status}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            begun.elapsed() < DEADLINE,
            "no cluster.env within {DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(up.child().id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let out = up.output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "stopped cleanly: {}\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains("starting it again on other ports"),
        "says why it started etcd twice:\n{stderr}"
    );
    let starts = starts(&starts_file);
    assert_eq!(starts.len(), 2, "{starts:#?}");
    assert_ne!(starts[0], starts[1], "the second start is on other ports");
}

/// A port the user gave (`--etcd-peer-port`) is not picked again when etcd finds it
/// taken: `iadeep up` fails after one start, naming the port, though it picked the
/// other one (`--etcd-port 0`).
#[test]
fn iadeep_up_does_not_start_etcd_again_when_a_port_the_user_gave_was_taken() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (stand_in, starts_file) = etcd_failing_on_its_peer_port(tmp.path(), 99);
    let [peer, placer] = free_ports();
    let mut up = LocalCluster::command(&tmp.path().join("cluster"), 0, peer, placer);
    up.arg("--etcd-bin").arg(&stand_in);
    let (status, _, stderr, _) = finish(up);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{peer}: bind: address already in use")),
        "names the port:\n{stderr}"
    );
    assert_eq!(starts(&starts_file).len(), 1, "started once:\n{stderr}");
}

/// A job that runs without an iadeep agent is said to, once, `--agent-patience` after it
/// started: it is never tuned, and the placer gives its memory back after its
/// unstarted-task grace. The job runs on and exits as it would.
#[test]
fn iadeep_run_warns_once_when_no_agent_reports() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let done = tmp.path().join("done");
    let err_path = tmp.path().join("run.err");
    // The job waits for the test, not for a time: the warning comes while it runs.
    let script = format!("while [ ! -e '{}' ]; do sleep 0.1; done", done.display());
    let run = Killed(Some(
        std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
            .args(["run", "--task-id", "no-agent", "--batch-size", "32"])
            .args(["--agent-patience", "1s", "--", "sh", "-c", &script])
            .env("IADEEP_STORE", &cluster.store)
            .env("IADEEP_PLACER", &cluster.placer)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err_path).expect("run.err"))
            .spawn()
            .expect("spawn iadeep run"),
    ));
    let warning = "no iadeep agent has reported 1s after the job started";
    let started = Instant::now();
    let log = || std::fs::read_to_string(&err_path).unwrap_or_default();
    while !log().contains(warning) {
        assert!(
            started.elapsed() < DEADLINE,
            "no warning within {DEADLINE:?}:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::write(&done, "").expect("done");
    let out = run.output();
    assert!(out.status.success(), "{}\n{}", out.status, log());
    assert_eq!(log().matches(warning).count(), 1, "once:\n{}", log());
    assert!(log().contains("--agent-patience"), "{}", log());
    assert!(log().contains("its reservation ("), "{}", log());
}

/// Asserts that the store at `store` holds no placement of `task`.
fn assert_not_placed(store: &str, task: &str) {
    let key = format!("/iadeep/v1/tasks/{task}/placement");
    let placement = common::iadeep(&["state", "get", "--store", store, &key]);
    assert!(
        !placement.status.success(),
        "{task} was placed: {}",
        String::from_utf8_lossy(&placement.stdout)
    );
}

/// A second `iadeep run` under a task id whose agent runs is refused before it asks the
/// placer: it would get the first run's placement, start a second copy and, on its
/// exit, release the placement under the first.
#[test]
fn a_task_id_whose_agent_runs_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    common::state_put(&cluster.store, &["/iadeep/v1/tasks/busy/alive", ""]);
    let run = |task: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
            .args(["run", "--task-id", task, "--batch-size", "32", "--", "true"])
            .env("IADEEP_STORE", &cluster.store)
            .env("IADEEP_PLACER", &cluster.placer)
            .output()
            .expect("iadeep run")
    };
    let refused = run("busy");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(stderr.contains("task id busy is in use"), "{stderr}");
    assert_not_placed(&cluster.store, "busy");
    // Another id runs as usual.
    let other = run("free");
    assert!(
        other.status.success(),
        "{}",
        String::from_utf8_lossy(&other.stderr)
    );
    // A killed job's agent holds its id until its lease ends: a retry waits for that
    // (5 s, so the key is still there when the run reads it on a loaded machine).
    common::state_put(
        &cluster.store,
        &["--lease-ttl", "5", "/iadeep/v1/tasks/crashed/alive", ""],
    );
    let retry = run("crashed");
    let stderr = String::from_utf8_lossy(&retry.stderr);
    assert!(retry.status.success(), "{stderr}");
    assert!(stderr.contains("waiting for its lease to end"), "{stderr}");
}

/// The trial's case: a job runs under `--task-id dup` and a second `iadeep run` of the
/// same id is started. The second is refused (its agent keeps reporting, so the wait for
/// a killed job's lease ends early), and the first keeps its placement.
/// `iadeep run --task-id TASK --batch-size 64 FLAGS -- iadeep emulate-job` against
/// `cluster`, not started.
fn emulated_run(cluster: &LocalCluster, task: &str, flags: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"));
    command
        .args(["run", "--task-id", task, "--batch-size", "64"])
        .args(flags)
        .args([
            "--",
            env!("CARGO_BIN_EXE_iadeep"),
            "emulate-job",
            "--model",
            "cifar10",
        ])
        .args(["--report-interval", "0.5", "--time-scale", "0.1"])
        .env("IADEEP_STORE", &cluster.store)
        .env("IADEEP_PLACER", &cluster.placer);
    command
}

#[test]
fn a_second_run_of_a_running_task_id_is_refused_and_the_first_keeps_its_gpu() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let run = || {
        let mut command = emulated_run(&cluster, "dup", &[]);
        command.stdout(Stdio::null()).stderr(Stdio::null());
        command
    };
    let _first = Killed(Some(run().spawn().expect("spawn the first run")));
    let alive = || {
        common::iadeep(&[
            "state",
            "get",
            "--store",
            &cluster.store,
            "/iadeep/v1/tasks/dup/alive",
        ])
        .status
        .success()
    };
    let started = Instant::now();
    while !alive() {
        assert!(
            started.elapsed() < DEADLINE,
            "the first job's agent never came"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let second = run()
        .stderr(Stdio::piped())
        .output()
        .expect("the second run");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{stderr}");
    assert!(stderr.contains("task id dup is in use"), "{stderr}");
    let placement = common::iadeep(&[
        "state",
        "get",
        "--store",
        &cluster.store,
        "/iadeep/v1/tasks/dup/placement",
    ]);
    assert!(
        placement.status.success() && alive(),
        "the first run keeps its placement and its agent"
    );
}

/// Queued jobs are placed in the order they were submitted: when the GPU frees up, a
/// job submitted later that asks first is told the GPU is held for the earlier one,
/// which is placed when it asks. The earlier job's `iadeep run` is stopped (SIGSTOP)
/// while the GPU frees up, so the later one asks first whatever the machine's timing.
#[test]
fn a_gpu_that_frees_up_is_held_for_the_job_submitted_first() {
    use nix::sys::signal::{Signal, kill};
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    // 10,000 MiB each on a 16,384 MiB GPU: one job at a time.
    let run = |task: &str| {
        let mut command = emulated_run(&cluster, task, &["--gpu-mem-mib", "10000"]);
        command
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        command
    };
    let placed = |task: &str| {
        let key = format!("/iadeep/v1/tasks/{task}/placement");
        common::iadeep(&["state", "get", "--store", &cluster.store, &key])
            .status
            .success()
    };
    let wait_until = |what: &str, done: &dyn Fn() -> bool| {
        let started = Instant::now();
        while !done() {
            assert!(started.elapsed() < DEADLINE, "never: {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let resident = Killed(Some(
        run("resident")
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the resident"),
    ));
    wait_until("the resident is placed", &|| placed("resident"));
    let early_log = tmp.path().join("early.log");
    let mut early = Killed(Some(
        run("early")
            .stderr(std::fs::File::create(&early_log).expect("early.log"))
            .spawn()
            .expect("spawn the early job"),
    ));
    let read_early = || std::fs::read_to_string(&early_log).unwrap_or_default();
    wait_until("the early job is told to wait", &|| {
        read_early().contains("the placer says wait")
    });
    let early_pid = nix::unistd::Pid::from_raw(i32::try_from(early.child().id()).expect("pid"));
    kill(early_pid, Signal::SIGSTOP).expect("stop the early job's run");
    // SIGTERM to the resident's run: its job leaves, and the run releases the GPU.
    drop(resident);
    wait_until("the resident's GPU is released", &|| !placed("resident"));
    // One ask (`--max-wait-s 0`); placed, its job (`true`) would end at once.
    let later = std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["run", "--task-id", "later", "--batch-size", "64"])
        .args(["--gpu-mem-mib", "10000", "--max-wait-s", "0", "--", "true"])
        .env("IADEEP_STORE", &cluster.store)
        .env("IADEEP_PLACER", &cluster.placer)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .expect("the later job's run");
    kill(early_pid, Signal::SIGCONT).expect("continue the early job's run");
    let stderr = String::from_utf8_lossy(&later.stderr);
    assert_eq!(later.status.code(), Some(75), "told to wait: {stderr}");
    assert!(stderr.contains("is held for early"), "{stderr}");
    wait_until("the early job is placed", &|| placed("early"));
    assert!(!placed("later"), "the later job gave up and holds nothing");
    drop(early);
    eprintln!("{}", read_early());
}

/// A job killed with SIGKILL leaves its agent's `alive` key behind until the agent's
/// lease ends (an hour here): `iadeep run`, which saw the job and everything it started
/// exit, deletes it before it releases the GPU, so the placer does not take the dead job
/// for one that runs without a reservation and place it again.
#[test]
fn a_killed_jobs_alive_key_goes_with_its_run() {
    use nix::sys::signal::{Signal, kill};
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let mut command = emulated_run(&cluster, "killed", &[]);
    command
        .args(["--lease-ttl", "3600"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut run = Killed(Some(command.spawn().expect("spawn the run")));
    let key = |name: &str| {
        let key = format!("/iadeep/v1/tasks/killed/{name}");
        common::iadeep(&["state", "get", "--store", &cluster.store, &key])
            .status
            .success()
    };
    let started = Instant::now();
    while !key("alive") {
        assert!(started.elapsed() < DEADLINE, "the job's agent never came");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The job is the run's one child: the process whose parent (the fourth field of
    // /proc/PID/stat, after the parenthesised command) is the run.
    let run_pid = i32::try_from(run.child().id()).expect("pid");
    let parent_of = |stat: &str| -> Option<i32> {
        let (_, rest) = stat.rsplit_once(')')?;
        rest.split_whitespace().nth(1)?.parse().ok()
    };
    let job: i32 = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| {
            let pid: i32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            (parent_of(&stat) == Some(run_pid)).then_some(pid)
        })
        .next()
        .expect("the job's pid");
    kill(nix::unistd::Pid::from_raw(job), Signal::SIGKILL).expect("kill the job");
    let output = run.output();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(137), "{stderr}");
    assert!(
        !key("alive"),
        "the dead job's agent still looks alive: {stderr}"
    );
    assert!(!key("placement"), "released: {stderr}");
}

/// `iadeep run` with the placer of one cluster and the store of another is refused
/// before anything is placed: its agent would report where no tuner reads.
#[test]
fn a_placer_and_a_store_of_different_clusters_are_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cluster = LocalCluster::start(tmp.path().join("cluster"));
    let other = iadeep_state::testing::EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    // A job placed on the cluster's own store first: the placer lists its GPU by then.
    let placed = std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["run", "--batch-size", "32", "--", "true"])
        .env("IADEEP_STORE", &cluster.store)
        .env("IADEEP_PLACER", &cluster.placer)
        .output()
        .expect("iadeep run");
    assert!(
        placed.status.success(),
        "{}",
        String::from_utf8_lossy(&placed.stderr)
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args([
            "run",
            "--task-id",
            "astray",
            "--batch-size",
            "32",
            "--",
            "true",
        ])
        .env("IADEEP_STORE", other.url())
        .env("IADEEP_PLACER", &cluster.placer)
        .output()
        .expect("iadeep run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("are of different clusters"), "{stderr}");
    assert_not_placed(&cluster.store, "astray");
}

/// A cluster asked for any free ports (0) takes its folder's last ones again when started
/// again there, while they are free: the jobs still running from before the stop know
/// only those addresses. Stopping it with a job's agent still alive names the job.
#[test]
fn port_zero_takes_the_folders_last_ports_again() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("cluster");
    let mut first = LocalCluster::start_on_any_ports(dir.clone());
    let (store, placer) = (first.store.clone(), first.placer.clone());
    // An agent's alive key, as a job still running has one.
    common::state_put(&store, &["/iadeep/v1/tasks/still-running/alive", ""]);
    assert!(first.stop().expect("stopped").success(), "{}", first.log());
    assert!(
        first.log().contains("still-running"),
        "the job still running is named:\n{}",
        first.log()
    );

    // LocalCluster logs at warn: a remembered port found taken is said there, and only
    // then may the URLs differ.
    let mut again = LocalCluster::start_on_any_ports(dir);
    let taken = again.log().contains("is taken; picking another");
    if !taken {
        assert_eq!(again.store, store, "{}", again.log());
        assert_eq!(again.placer, placer, "{}", again.log());
    }
    assert!(again.stop().expect("stopped").success(), "{}", again.log());
}

/// A remembered placer port that another program holds now is given up for any free
/// port, said in the log, rather than failing the start; the new port is remembered.
#[test]
fn a_remembered_placer_port_taken_meanwhile_is_given_up() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("cluster");
    let mut first = LocalCluster::start_on_any_ports(dir.clone());
    let placer = first.placer.clone();
    assert!(first.stop().expect("stopped").success(), "{}", first.log());
    let port = placer
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .expect("the placer's URL ends in its port");
    let _holder = std::net::TcpListener::bind(("127.0.0.1", port)).expect("hold the port");

    let mut again = LocalCluster::start_on_any_ports(dir.clone());
    assert!(
        again
            .log()
            .contains("the port this folder's last placer used is taken"),
        "{}",
        again.log()
    );
    assert_ne!(again.placer, placer, "{}", again.log());
    let remembered = std::fs::read_to_string(dir.join("ports")).expect("ports");
    assert!(
        remembered.contains(&format!(
            "placer={}",
            again.placer.rsplit(':').next().unwrap_or("")
        )),
        "{remembered}"
    );
    assert!(again.stop().expect("stopped").success(), "{}", again.log());
}

/// Two of the cluster's own ports given the same number are refused before anything
/// starts, naming both flags.
#[test]
fn the_clusters_own_ports_must_differ() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("cluster");
    let [port, placer] = free_ports();
    for (etcd_peer, placer) in [(port, placer), (0, port)] {
        let (status, _, stderr, _) = finish(LocalCluster::command(&dir, port, etcd_peer, placer));
        assert!(!status.success(), "{stderr}");
        assert!(
            stderr.contains(&format!("are both port {port}")),
            "{stderr}"
        );
        assert!(stderr.contains("--etcd-port PORT"), "{stderr}");
        assert!(!dir.exists(), "nothing started, nothing left");
    }
}

/// SIGTERM (or Ctrl-C) while `iadeep up` is still starting etcd stops it cleanly: it
/// abandons the start (or stops the cluster, if it stood by then), exits 0 and leaves no
/// etcd running (before, the signal was lost and the cluster ran on).
#[test]
fn a_signal_while_starting_stops_the_cluster_cleanly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("cluster");
    let err_path = tmp.path().join("up.err");
    let up = LocalCluster::command(&dir, 0, 0, 0)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).expect("up.err"))
        .spawn()
        .expect("spawn iadeep up");
    let mut up = Killed(Some(up));
    // etcd's pid, once its file holds one: `iadeep up` is past catching signals and
    // starting etcd.
    let pid_file = dir.join("etcd.pid");
    let started = Instant::now();
    let etcd_pid: i32 = loop {
        let read = std::fs::read_to_string(&pid_file).unwrap_or_default();
        if let Ok(pid) = read.trim().parse() {
            break pid;
        }
        assert!(started.elapsed() < DEADLINE, "etcd never started");
        std::thread::sleep(Duration::from_millis(10));
    };
    let etcd_cmdline = std::fs::read(format!("/proc/{etcd_pid}/cmdline")).unwrap_or_default();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(up.child().id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = loop {
        if let Some(status) = up.child().try_wait().expect("try_wait") {
            up.0 = None;
            break status;
        }
        // A signal lost while starting (as it once was) leaves the cluster running.
        assert!(
            started.elapsed() < DEADLINE,
            "still running {DEADLINE:?} after SIGTERM:\n{}",
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(status.success(), "{status}\n{stderr}");
    assert!(!dir.join("cluster.env").exists(), "{stderr}");
    // Its own etcd, stopped as the start is abandoned, is not blamed on an earlier one.
    assert!(!stderr.contains("an earlier `iadeep up`"), "{stderr}");
    // Gone, a zombie, or its pid reused by another process: `iadeep up` waited for it,
    // but a loaded machine may still be tearing it down.
    let etcd_gone = || {
        std::fs::read(format!("/proc/{etcd_pid}/cmdline"))
            .map_or(true, |now| now.is_empty() || now != etcd_cmdline)
    };
    while !etcd_gone() {
        assert!(
            started.elapsed() < DEADLINE,
            "etcd {etcd_pid} still runs:\n{stderr}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !dir.join("etcd.pid").exists(),
        "no pid file left:\n{stderr}"
    );
}

/// A start that fails in a folder that existed keeps the folder and what it held, but
/// not the etcd data the failed start began there (here an etcd that creates its data
/// folder and exits).
#[test]
fn a_failed_start_in_an_existing_folder_removes_only_its_etcd_data() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let stand_in = tmp.path().join("etcd-that-fails");
    write_stand_in(
        &stand_in,
        "#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in --data-dir=*) mkdir -p \"${a#--data-dir=}/member\";; esac; done\nexit 1\n",
    );
    let dir = tmp.path().join("mine");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::write(dir.join("notes.txt"), "mine").expect("write");
    let mut up = LocalCluster::command(&dir, 0, 0, 0);
    up.arg("--etcd-bin").arg(&stand_in);
    let (status, _, stderr, _) = finish(up);
    assert!(!status.success(), "{stderr}");
    assert!(dir.join("notes.txt").exists(), "{stderr}");
    assert!(
        !dir.join("etcd").exists(),
        "the failed start's etcd data is gone: {stderr}"
    );
}
