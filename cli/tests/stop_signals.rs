//! SIGTERM (Kubernetes, systemd) and SIGINT (Ctrl-C) stop the daemons cleanly, as real
//! processes against a real etcd: the placer stops serving and exits 0, a tuner saves its
//! state, deletes its device record and exits 0. (The agent's side is in `emulate.rs`.)

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

mod common;

use common::{free_ports, http_get};
use iadeep_state::testing::start_etcd;

/// Polls `probe` every 100 ms for at most `limit`; whether it became true.
fn eventually(limit: Duration, mut probe: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if probe() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// `iadeep state get KEY`: the value's JSON, or `None` when the key is absent.
fn state_get(store: &str, key: &str) -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["state", "get", key, "--store", store])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep state get");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn iadeep")
}

/// Sends `signal` and waits for the exit; asserts a clean one (status 0, not killed).
fn stop_cleanly(child: Child, signal: Signal, what: &str) {
    let pid = Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    kill(pid, signal).expect("send the signal");
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{what} stops cleanly on {signal}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_placer_stops_cleanly_on_sigterm_and_sigint() {
    let etcd = start_etcd();
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let [metrics, grpc] = free_ports().map(|port| format!("127.0.0.1:{port}"));
        let child = spawn(&[
            "placer",
            "--grpc",
            &grpc,
            "--metrics",
            &metrics,
            "--store",
            &etcd.url(),
        ]);
        let ready = eventually(Duration::from_secs(20), || {
            http_get(&metrics, "/readyz").is_some_and(|r| r.contains("200 OK"))
        });
        assert!(ready, "the placer became ready");
        stop_cleanly(child, signal, "the placer");
    }
}

#[test]
fn a_tuner_deregisters_its_device_on_sigterm_and_sigint() {
    let etcd = start_etcd();
    let store = etcd.url();
    for (device, signal) in [("t-term", Signal::SIGTERM), ("t-int", Signal::SIGINT)] {
        // The record's lease lives 10 s: gone right after the exit, it was deleted.
        let child = spawn(&[
            "tuner",
            "--device",
            device,
            "--no-nvml",
            "--memory-mib",
            "16384",
            "--store",
            &store,
        ]);
        let info = format!("/iadeep/v1/devices/{device}/info");
        let registered = eventually(Duration::from_secs(20), || {
            state_get(&store, &info).is_some()
        });
        assert!(registered, "{device} registered");
        stop_cleanly(child, signal, "the tuner");
        assert!(
            state_get(&store, &info).is_none(),
            "{device} still registered after {signal}"
        );
    }
}
