//! `iadeep memory eval` and `iadeep tuner bench` as an operator runs them.

use std::process::Command;

mod common;

use common::{free_loopback_addr, http_get, iadeep, succeeded_json};

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
    let json = succeeded_json(&out);
    assert_eq!(json["models"], 2);
    for key in ["underestimate_rate", "median_abs_rel_err", "p90_over"] {
        assert!(json[key].is_number(), "{key}");
        assert!(json["cubic_baseline"][key].is_number(), "cubic {key}");
        assert!(json["held"][key].is_number(), "held {key}");
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
        "--first-seed",
        "100",
        "--json",
    ]);
    let json = succeeded_json(&out);
    assert!(json["problems"].as_u64().expect("count") > 0);
    assert_eq!(json["first_seed"].as_u64(), Some(100));
    let problems = json["problems"].as_u64().expect("count");
    assert_eq!(json["gp_lcb"]["runs"].as_u64(), Some(problems * 2));
    for strategy in ["gp_lcb", "random"] {
        assert!(json[strategy]["median_rounds"].as_f64().expect("median") >= 1.0);
        assert!(json[strategy]["p90_rounds"].is_number());
    }
    let out = iadeep(&["tuner", "bench", "--worker-type", "v100"]);
    assert!(!out.status.success());
}

#[test]
fn tuner_daemon_needs_a_device_and_without_nvml_its_memory() {
    let out = iadeep(&["tuner"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--device"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("s.redb");
    let store = store.to_str().expect("utf-8 path");
    let out = iadeep(&["tuner", "--device", "g0", "--no-nvml", "--store", store]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--memory-mib"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--all-gpus`: one process registers and tunes every GPU of the node, under the node
/// name from $NODE_NAME (the DaemonSet's downward API), and stops on SIGTERM.
#[test]
fn tuner_all_gpus_registers_every_device_of_the_node_and_serves_metrics() {
    let etcd = iadeep_state::testing::EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    let addr = free_loopback_addr();
    let mut child = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args([
            "tuner",
            "--all-gpus",
            "--gpus",
            "2",
            "--no-nvml",
            "--memory-mib",
            "16384",
            "--kind",
            "test",
            "--metrics",
            &addr,
            "--store",
            &etcd.url(),
        ])
        .env("RUST_LOG", "warn")
        .env("NODE_NAME", "n1")
        .spawn()
        .expect("start the tuner");
    let get = |key: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_iadeep"))
            .args(["state", "get", key, "--store", &etcd.url()])
            .output()
            .expect("run iadeep state get");
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let start = std::time::Instant::now();
    let (mut infos, mut metrics, mut ready) = (Vec::new(), None, None);
    // A bound for a broken build only: the loop ends as soon as all three are there.
    while start.elapsed() < std::time::Duration::from_secs(60)
        && (infos.len() < 2 || metrics.is_none() || ready.is_none())
    {
        infos = ["n1-gpu0", "n1-gpu1"]
            .iter()
            .filter_map(|d| get(&format!("/iadeep/v1/devices/{d}/info")))
            .collect();
        metrics = metrics.or_else(|| http_get(&addr, "/metrics"));
        ready = ready.or_else(|| http_get(&addr, "/readyz").filter(|r| r.contains("200 OK")));
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let stopped = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("send SIGTERM");
    assert!(stopped.success());
    let status = child.wait().expect("wait");
    assert!(status.success(), "a clean stop on SIGTERM: {status}");
    assert_eq!(infos.len(), 2, "both GPUs registered: {infos:?}");
    // Deregistered on the way out, not left to the lease's expiry.
    for device in ["n1-gpu0", "n1-gpu1"] {
        let info = get(&format!("/iadeep/v1/devices/{device}/info"));
        assert!(info.is_none(), "{device} still registered after SIGTERM");
    }
    for info in &infos {
        let compact: String = info.split_whitespace().collect();
        assert!(
            compact.contains("\"memoryMib\":\"16384\"") && compact.contains("\"node\":\"n1\""),
            "{info}"
        );
    }
    let metrics = metrics.expect("metrics served");
    assert!(metrics.contains("200 OK"), "{metrics}");
    for device in ["n1-gpu0", "n1-gpu1"] {
        assert!(
            metrics.contains(&format!(
                "iadeep_tuner_rounds_total{{device=\"{device}\"}} 0"
            )),
            "{metrics}"
        );
    }
    assert!(
        metrics.contains("iadeep_build_info{component=\"tuner\""),
        "{metrics}"
    );
    assert!(ready.is_some(), "ready once the store answers");
}
