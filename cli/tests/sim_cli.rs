//! `iadeep sim` and `iadeep demo` as a user runs them.

mod common;

use common::{iadeep, succeeded_json};

#[test]
fn sim_json_has_every_requested_policy_with_the_issue_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("out");
    let out_arg = out_dir.to_str().expect("utf-8 path");
    let out = iadeep(&[
        "sim",
        "--worker-type",
        "p100",
        "--tasks",
        "12",
        "--gpus",
        "2",
        "--load",
        "2",
        "--seed",
        "4",
        "--max-duration-h",
        "2",
        "--policies",
        "exclusive,packing,iadeep",
        "--out",
        out_arg,
        "--json",
    ]);
    let json = succeeded_json(&out);
    let policies = json["policies"].as_object().expect("policies object");
    assert_eq!(policies.len(), 3);
    for name in ["exclusive", "packing", "iadeep"] {
        for key in ["avg_ct_s", "p99_ct_s", "makespan_s", "ooms", "avg_util"] {
            assert!(policies[name][key].is_number(), "{name} {key}");
        }
    }
    assert_eq!(policies["exclusive"]["ooms"], 0);
    for file in [
        "summary.csv",
        "tasks.csv",
        "utilisation.csv",
        "completion_cdf.svg",
        "utilisation.svg",
    ] {
        let path = out_dir.join(file);
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        assert!(size > 100, "{} missing or empty", path.display());
    }
    let summary = std::fs::read_to_string(out_dir.join("summary.csv")).expect("summary");
    assert_eq!(summary.lines().count(), 4, "{summary}");
}

#[test]
fn sim_rejects_bad_input_with_a_clear_error() {
    let out = iadeep(&["sim", "--worker-type", "v100"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("k80, p100"));
    let out = iadeep(&["sim", "--policies", "fifo"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy \"fifo\""));
}
