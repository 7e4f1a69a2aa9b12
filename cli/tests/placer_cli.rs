//! `iadeep placer` as an operator runs it: the bench client end to end (in-process
//! daemon over loopback gRPC), the daemon serving TLS to `iadeep run`, and clear
//! errors for bad flags.

mod common;

use common::{iadeep, succeeded_json};

#[test]
fn bench_client_places_and_releases_over_grpc_and_reports_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("bench.redb");
    let out = iadeep(&[
        "placer",
        "bench-client",
        "--store",
        store.to_str().expect("utf-8 path"),
        "--devices",
        "16",
        "--residents",
        "24",
        "--requests",
        "200",
        "--concurrency",
        "3",
        "--wait-cost-factor",
        "1e9",
        "--json",
    ]);
    let json = succeeded_json(&out);
    assert_eq!(json["requests"], 200);
    assert_eq!(
        json["placed"], 200,
        "waiting is priced out, so every task is placed"
    );
    assert_eq!(json["residents"], 24);
    for key in [
        "decisions_per_s",
        "place_p50_ms",
        "place_p99_ms",
        "release_p99_ms",
    ] {
        assert!(json[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {json}");
    }
}

/// A store holding a device the benchmark did not seed (a live cluster's, as a shell
/// that sourced cluster.env names it) is refused before anything is written; a store
/// the benchmark seeded before is used again.
#[test]
fn bench_client_refuses_to_seed_a_live_clusters_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path().join("live.redb");
    let live = live.to_str().expect("utf-8 path");
    let gpu = r#"{"deviceId": "vm-gpu0", "node": "vm", "memoryMib": "16384", "kind": "t4"}"#;
    common::state_put(live, &["/iadeep/v1/devices/vm-gpu0/info", gpu]);
    let bench = |store: &str| {
        iadeep(&[
            "placer",
            "bench-client",
            "--store",
            store,
            "--devices",
            "2",
            "--residents",
            "2",
            "--requests",
            "4",
            "--json",
        ])
    };
    let out = bench(live);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already holds 1 device(s) this benchmark did not seed"),
        "{err}"
    );
    let ls = iadeep(&["state", "ls", "/iadeep/v1/devices/", "--store", live]);
    assert!(
        ls.status.success(),
        "{}",
        String::from_utf8_lossy(&ls.stderr)
    );
    let listed = String::from_utf8_lossy(&ls.stdout);
    assert!(listed.contains("vm-gpu0"), "{listed}");
    assert!(
        listed.lines().all(|line| !line.contains("node-")),
        "nothing synthetic was written:\n{listed}"
    );

    let own = dir.path().join("bench.redb");
    let own = own.to_str().expect("utf-8 path");
    succeeded_json(&bench(own));
    succeeded_json(&bench(own));
}

#[test]
fn bad_policy_flags_are_refused_naming_the_parameter() {
    let out = iadeep(&[
        "placer",
        "bench-client",
        "--max-pd-increase",
        "0.5",
        "--requests",
        "1",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_pd_increase"), "{err}");
}

/// Kills the daemon when the test ends, however it ends.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `iadeep run` against the placer at `placer` with `tls` flags: its exit code and
/// stderr. No GPU is registered, so a Place that gets through is told to wait, and
/// `--max-wait-s 0` ends the run there (exit 75) without starting the job.
/// `store` is an etcd the job's agent would report to (`iadeep run` refuses a store that
/// does not answer).
fn run_against(placer: &str, store: &str, tls: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["run", "--placer", placer, "--store", store])
        .args(["--batch-size", "32", "--max-wait-s", "0"])
        .args(tls)
        .args(["--", "true"])
        .env("RUST_LOG", "info")
        .env_remove("IADEEP_PLACER")
        .env_remove("IADEEP_PLACER_CA")
        .env_remove("IADEEP_PLACER_CERT")
        .env_remove("IADEEP_PLACER_KEY")
        .output()
        .expect("run iadeep run");
    eprintln!(
        "iadeep run --placer {placer} {tls:?}: {:?}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The placer binary with its TLS flags, and `iadeep run` as its client: served with
/// the CA and a client certificate, refused without the certificate or when trusting
/// another CA, and told what is missing for an https:// placer without a CA.
#[test]
fn the_placer_binary_serves_tls_and_verifies_iadeep_runs_certificate() {
    let pki = iadeep_state::testing::Pki::generate();
    let stranger = iadeep_state::testing::Pki::generate();
    let path = |p: &std::path::Path| p.to_str().expect("UTF-8 path").to_owned();
    let grpc = common::free_loopback_addr();
    let _placer = Running(
        std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
            .args(["placer", "--store", "memory:", "--grpc", &grpc])
            .args(["--tls-cert", &path(&pki.server_cert)])
            .args(["--tls-key", &path(&pki.server_key)])
            .args(["--tls-client-ca", &path(&pki.ca)])
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn the placer"),
    );
    let started = std::time::Instant::now();
    while std::net::TcpStream::connect(&grpc).is_err() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the placer did not listen on {grpc}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let etcd = iadeep_state::testing::EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    let store = etcd.url();
    let https = format!("https://{grpc}");
    let ca = path(&pki.ca);
    let (cert, key) = (path(&pki.client_cert), path(&pki.client_key));
    let placed_or_told_to_wait = "the placer says wait";

    let (code, err) = run_against(
        &https,
        &store,
        &[
            "--placer-ca",
            &ca,
            "--placer-cert",
            &cert,
            "--placer-key",
            &key,
        ],
    );
    assert!(
        code == Some(75) && err.contains(placed_or_told_to_wait),
        "with the CA and a client certificate the Place gets an answer: {code:?} {err}"
    );

    let (code, err) = run_against(&https, &store, &["--placer-ca", &ca]);
    assert!(
        code != Some(0) && !err.contains(placed_or_told_to_wait),
        "without a client certificate no Place is answered: {code:?} {err}"
    );

    let other_ca = path(&stranger.ca);
    let (code, err) = run_against(
        &https,
        &store,
        &[
            "--placer-ca",
            &other_ca,
            "--placer-cert",
            &cert,
            "--placer-key",
            &key,
        ],
    );
    assert!(
        code == Some(1) && err.contains("cannot reach the placer"),
        "trusting another CA, the placer's certificate is refused: {code:?} {err}"
    );
    assert!(
        err.contains("not signed by --placer-ca") && !err.contains("is `iadeep up` running"),
        "the refused certificate is named as the cause: {err}"
    );

    let (code, err) = run_against(&https, &store, &[]);
    assert!(
        code == Some(1) && err.contains("--placer-ca"),
        "an https:// placer without a CA says what is missing: {code:?} {err}"
    );

    let (code, err) = run_against(&format!("http://{grpc}"), &store, &[]);
    assert!(
        code != Some(0) && !err.contains(placed_or_told_to_wait),
        "plain text is not served: {code:?} {err}"
    );
    assert!(
        err.contains("give its address as https://"),
        "a plain-text client of a TLS placer is told so: {err}"
    );
    assert!(
        !err.contains("cannot release the placement") && !err.contains("placement not released"),
        "nothing was placed, so no lost placement is reported: {err}"
    );
}

#[test]
fn unusable_tls_files_stop_the_placer_naming_the_file() {
    let pki = iadeep_state::testing::Pki::generate();
    let cert = pki.server_cert.to_str().expect("UTF-8 path");
    let placer_with_key = |key: &str| {
        let out = iadeep(&[
            "placer",
            "--store",
            "memory:",
            "--grpc",
            "127.0.0.1:0",
            "--tls-cert",
            cert,
            "--tls-key",
            key,
        ]);
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = pki.ca.with_file_name("absent.key");
    let err = placer_with_key(missing.to_str().expect("UTF-8 path"));
    assert!(err.contains("absent.key"), "{err}");
    // A certificate given as the key: no private key in it.
    let err = placer_with_key(cert);
    assert!(err.contains("server.pem") && err.contains("key"), "{err}");
    let out = iadeep(&["placer", "--tls-client-ca", cert]);
    assert!(!out.status.success(), "a client CA without a certificate");
}
