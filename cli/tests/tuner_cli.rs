//! `iadeep memory eval` and `iadeep tuner bench` as an operator runs them.

use std::process::{Command, Output};

fn iadeep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep")
}

fn last_json_line(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().expect("some output");
    serde_json::from_str(line).expect("last line is JSON")
}

#[test]
fn memory_eval_prints_both_models_as_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let csv = dir.path().join("mem.csv");
    let mut text = String::from("model,batch_size,memory_mib\n");
    for b in [2u32, 4, 8, 16, 32, 64] {
        text.push_str(&format!("a,{b},{}\n", 500 + 30 * b));
        text.push_str(&format!("b,{b},{}\n", 1200 + 3 * b * b / 4));
    }
    std::fs::write(&csv, text).expect("write csv");
    let path = csv.to_str().expect("utf-8 path");
    let out = iadeep(&["memory", "eval", path, "--fit-upto", "16", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = last_json_line(&out);
    assert_eq!(json["models"], 2);
    for key in ["underestimate_rate", "median_abs_rel_err", "p90_over"] {
        assert!(json[key].is_number(), "{key}");
        assert!(json["cubic_baseline"][key].is_number(), "cubic {key}");
    }
    // A missing file and a bad header are clear errors.
    let out = iadeep(&["memory", "eval", "/nonexistent.csv", "--fit-upto", "16"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
    std::fs::write(&csv, "name,b,m\n").expect("write csv");
    let out = iadeep(&["memory", "eval", path, "--fit-upto", "16"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("model,batch_size,memory_mib"));
}

#[test]
fn tuner_bench_on_the_bundled_gavel_data() {
    let out = iadeep(&[
        "tuner",
        "bench",
        "--worker-type",
        "k80",
        "--seeds",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = last_json_line(&out);
    assert!(json["problems"].as_u64().expect("count") > 0);
    for strategy in ["gp_lcb", "random"] {
        assert!(json[strategy]["median_rounds"].as_f64().expect("median") >= 1.0);
        assert!(json[strategy]["p90_rounds"].is_number());
    }
    let out = iadeep(&["tuner", "bench", "--worker-type", "v100"]);
    assert!(!out.status.success());
}
