//! `iadeep predictor eval` as an operator runs it: on samples converted from the
//! bundled Gavel measurements, with seed ranges and parameter overrides.

mod common;

use common::{iadeep, succeeded_json};

const GAVEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../data/gavel/throughputs-k80-p100.json"
);

/// A small, fast parameter set for debug builds.
const FAST: &str = r#"{"refit_every": 25, "forest": {"n_trees": 4, "max_depth": 8}}"#;

fn k80_samples(dir: &std::path::Path) -> String {
    let out = iadeep(&["data", "gavel-pairs", GAVEL, "--worker-type", "k80"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = dir.join("k80.jsonl");
    std::fs::write(&path, &out.stdout).expect("write samples");
    path.to_str().expect("utf-8 path").to_owned()
}

#[test]
fn eval_reports_ours_and_the_reference_over_a_seed_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let samples = k80_samples(dir.path());
    let out = iadeep(&[
        "predictor",
        "eval",
        &samples,
        "--seeds",
        "1",
        "--seed-offset",
        "7",
        "--params",
        FAST,
        "--json",
    ]);
    let json = succeeded_json(&out);
    assert!(json["samples"].as_u64().expect("samples") > 400);
    let ours = json["ours"]["mape_100_135"].as_f64().expect("ours");
    let reference = json["reference"]["mape_100_135"]
        .as_f64()
        .expect("reference");
    assert!(json["ours"]["mape_from_135"].is_number());
    assert!(ours > 0.0 && ours < reference, "{ours} vs {reference}");
    assert_eq!(json["split"], "default");
    assert!(json["plain_forest"]["mape_100_135"].is_number());
    for approach in ["ours", "reference", "plain_forest"] {
        let coverage = json[approach]["coverage_90"].as_f64().expect("coverage");
        assert!((0.0..=1.0).contains(&coverage), "{approach}: {coverage}");
    }
}

/// The unseen-models split prints its own JSON line: one MAPE per approach over
/// every sample, and the coverage of the 90 % intervals.
#[test]
fn eval_reports_the_unseen_models_split() {
    let dir = tempfile::tempdir().expect("tempdir");
    let samples = k80_samples(dir.path());
    let out = iadeep(&[
        "predictor",
        "eval",
        &samples,
        "--split",
        "unseen-models",
        "--seeds",
        "1",
        "--params",
        FAST,
        "--json",
    ]);
    let json = succeeded_json(&out);
    assert_eq!(json["split"], "unseen-models");
    assert!(json["samples"].as_u64().expect("samples") > 400);
    for approach in ["ours", "reference", "plain_forest"] {
        let mape = json[approach]["mape"].as_f64().expect("mape");
        assert!(mape > 0.0 && mape < 1.0, "{approach}: {mape}");
        let coverage = json[approach]["coverage_90"].as_f64().expect("coverage");
        assert!((0.0..=1.0).contains(&coverage), "{approach}: {coverage}");
    }
    let bad = iadeep(&["predictor", "eval", &samples, "--split", "by-magic"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unseen-models"));
}

#[test]
fn bad_params_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let samples = dir.path().join("none.jsonl");
    std::fs::write(&samples, "").expect("write");
    let samples = samples.to_str().expect("utf-8 path");
    for (params, expect) in [
        (r#"{"n_tres": 3}"#, "unknown key \"n_tres\""),
        (
            r#"{"forest": {"depth": 3}}"#,
            "unknown key \"forest.depth\"",
        ),
        ("[1]", "must be a JSON object"),
        (r#"{"target_floor": 1.5}"#, "target_floor"),
        ("{", "not valid JSON"),
    ] {
        let out = iadeep(&["predictor", "eval", samples, "--params", params]);
        assert!(!out.status.success(), "{params} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{params}: {err}");
    }
}
