//! `iadeep sim` and `iadeep demo` as a user runs them.

mod common;

use common::{iadeep, succeeded_json};

#[test]
fn sim_json_has_every_requested_policy_with_the_issue_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("out");
    let out_arg = out_dir.to_str().expect("utf-8 path");
    // The default log filter, stderr a pipe: progress comes as plain log lines.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args([
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
        ])
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .output()
        .expect("run iadeep");
    let json = succeeded_json(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in a pipe: {stderr}"
    );
    for name in ["exclusive", "packing", "iadeep"] {
        assert!(
            stderr
                .lines()
                .any(|l| l.contains("progress 100 %") && l.contains(&format!("task={name}"))),
            "a progress line for {name}: {stderr}"
        );
    }
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
    let utilisation = std::fs::read_to_string(out_dir.join("utilisation.csv")).expect("csv");
    assert_eq!(
        utilisation.lines().count(),
        1 + 3 * iadeep_sim::report::UTIL_CSV_BINS,
        "down-sampled to a fixed number of windows per policy"
    );
    let summary = std::fs::read_to_string(out_dir.join("summary.csv")).expect("summary");
    assert_eq!(summary.lines().count(), 4, "{summary}");
}

/// The tuner warns of every out-of-memory event it sees, right for a daemon; in a
/// simulation those are simulated events the table counts, and with the default filter
/// they came by the thousand (3,437 lines for this run), burying the progress lines.
#[test]
fn sim_default_log_leaves_out_the_tuners_per_event_warnings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("out");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args([
            "sim",
            "--tasks",
            "60",
            "--gpus",
            "6",
            "--policies",
            "iadeep",
        ])
        .arg("--out")
        .arg(&out_dir)
        .env_remove("RUST_LOG")
        .output()
        .expect("run iadeep");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("iadeep_tuner"), "{stderr}");
    assert!(stderr.lines().count() < 20, "{stderr}");
    assert!(stderr.contains("progress 100 %"), "{stderr}");
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

#[test]
fn sim_audit_writes_each_iadeep_decision_with_the_truth_and_a_summary() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("out");
    let out_arg = out_dir.to_str().expect("utf-8 path");
    let out = iadeep(&[
        "sim",
        "--tasks",
        "40",
        "--gpus",
        "3",
        "--load",
        "4",
        "--seed",
        "3",
        "--max-duration-h",
        "2",
        "--policies",
        "exclusive,iadeep",
        "--out",
        out_arg,
        "--audit",
        "--json",
    ]);
    let json = succeeded_json(&out);
    assert_eq!(json["policies"].as_object().expect("policies").len(), 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("placement audit of iadeep"), "{stderr}");
    // Only iadeep's placer records decisions.
    assert!(!out_dir.join("audit-exclusive.jsonl").exists());
    let lines = std::fs::read_to_string(out_dir.join("audit-iadeep.jsonl")).expect("audit file");
    let records: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON record per line"))
        .collect();
    assert!(records.len() >= 40, "every task is decided at least once");
    let mut shared = 0;
    for r in &records {
        let verdict = r["verdict"].as_str().expect("verdict");
        assert!(verdict == "place" || verdict == "queue", "{r}");
        assert!(
            r["started_s"].as_f64().expect("every task started") >= r["at_s"].as_f64().expect("at")
        );
        for c in r["candidates"].as_array().expect("candidates") {
            shared += 1;
            let truth = c["truth"]["own"].as_f64().expect("true slowdown filled in");
            assert!(truth >= 1.0 - 1e-9, "{c}");
            assert!(c["predicted"]["own"].as_f64().expect("prediction") > 0.0);
            assert!(c["heuristic"]["own"].as_f64().expect("heuristic") >= 1.0);
        }
    }
    assert!(shared > 0, "4x load on 3 GPUs scores shared devices");
}

/// `--interference` switches the world's rule for three or more jobs on a GPU: the same
/// stream under packing (which stacks jobs by memory) ends differently under the product
/// of pairs than under the default contention model; an unknown model is refused.
#[test]
fn sim_interference_flag_switches_the_world_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_arg = dir.path().to_str().expect("utf-8 path");
    let avg_ct = |model: &str| {
        let out = iadeep(&[
            "sim",
            "--worker-type",
            "p100",
            "--tasks",
            "20",
            "--gpus",
            "2",
            "--load",
            "4",
            "--seed",
            "2",
            "--max-duration-h",
            "2",
            "--policies",
            "packing",
            "--interference",
            model,
            "--out",
            out_arg,
            "--json",
        ]);
        succeeded_json(&out)["policies"]["packing"]["avg_ct_s"]
            .as_f64()
            .expect("avg_ct_s")
    };
    let (contention, product) = (avg_ct("contention"), avg_ct("product"));
    assert!(
        (contention - product).abs() > 1e-6 * contention,
        "contention {contention} vs product {product}"
    );
    let out = iadeep(&["sim", "--interference", "sum", "--tasks", "2"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("contention or product"), "{stderr}");
}

/// Issue 25: the single-part oracles run beside iadeep and the oracle, and the JSON
/// says how much of the gap between those two each closes (the same figure as the
/// policies' own completion times give), the text too.
#[test]
fn sim_json_attributes_the_gap_to_the_single_part_oracles() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_arg = dir.path().join("out");
    let out = iadeep(&[
        "sim",
        "--tasks",
        "16",
        "--gpus",
        "2",
        "--load",
        "3",
        "--seed",
        "2",
        "--max-duration-h",
        "2",
        "--policies",
        "iadeep,oracle,oracle-memory,oracle-wait",
        "--out",
        out_arg.to_str().expect("utf-8 path"),
        "--json",
    ]);
    let json = succeeded_json(&out);
    let ct = |name: &str| json["policies"][name]["avg_ct_s"].as_f64().expect(name);
    let gap = ct("iadeep") - ct("oracle");
    for part in ["oracle-memory", "oracle-wait"] {
        let closed = &json["gap_closed"][part];
        if gap > 0.0 {
            let expect = (ct("iadeep") - ct(part)) / gap;
            let got = closed.as_f64().expect("a share");
            assert!((got - expect).abs() < 1e-9, "{part}: {got} vs {expect}");
        } else {
            assert!(closed.is_null(), "{part}: {closed}");
        }
    }
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Gap attributed: iadeep"), "{text}");
    assert!(text.contains("oracle-wait"), "{text}");
}

/// Issue 27: with a class mix every policy reports each class apart, `priority` is a
/// policy, the text output has the per-class table, and a bad fraction is refused.
#[test]
fn sim_json_reports_each_class_and_lists_the_priority_policy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_arg = dir.path().join("out");
    let out = iadeep(&[
        "sim",
        "--tasks",
        "16",
        "--gpus",
        "2",
        "--load",
        "3",
        "--seed",
        "2",
        "--max-duration-h",
        "1",
        "--production-fraction",
        "0.5",
        "--max-slowdown",
        "1.2",
        "--checkpoint-every",
        "300",
        "--policies",
        "exclusive,priority,iadeep",
        "--out",
        out_arg.to_str().expect("utf-8 path"),
        "--json",
    ]);
    let json = succeeded_json(&out);
    let policies = json["policies"].as_object().expect("policies");
    assert_eq!(policies.len(), 3);
    for name in ["exclusive", "priority", "iadeep"] {
        let classes = &policies[name]["classes"];
        let jobs = |class: &str| classes[class]["tasks"].as_u64().expect("tasks");
        assert_eq!(jobs("production") + jobs("opportunistic"), 16, "{name}");
        assert!(jobs("production") > 0, "{name}: no production job drawn");
        for class in ["production", "opportunistic"] {
            for key in [
                "avg_ct_s",
                "p99_ct_s",
                "above_cap_frac",
                "evictions",
                "evicted_work_s",
            ] {
                assert!(classes[class][key].is_number(), "{name} {class} {key}");
            }
        }
    }
    // Exclusive GPUs: no job is ever slowed, so none runs above a cap.
    for name in ["exclusive", "priority"] {
        assert_eq!(
            policies[name]["classes"]["production"]["above_cap_frac"], 0.0,
            "{name}"
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("priority") && l.contains("production")),
        "the per-class table: {stdout}"
    );
    let out = iadeep(&["sim", "--tasks", "2", "--production-fraction", "1.5"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("production fraction"), "{stderr}");
}
