//! `iadeep placer` as an operator runs it: the bench client end to end (in-process
//! daemon over loopback gRPC), and clear errors for bad flags.

mod common;

use common::{iadeep, succeeded_json};

#[test]
fn bench_client_places_and_releases_over_grpc_and_reports_json() {
    let out = iadeep(&[
        "placer",
        "bench-client",
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
