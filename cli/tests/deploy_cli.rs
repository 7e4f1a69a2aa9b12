//! The command lines in `deploy/` (Kubernetes container args, systemd ExecStart) are
//! ones this `iadeep` accepts: every flag exists and every value parses. (`--help`
//! at the end makes clap check everything before it, then print help and exit 0.)

use std::path::Path;
use std::process::Command;

fn deploy(path: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy")
            .join(path),
    )
    .expect("read a deploy file")
}

fn accepts(args: &[String]) {
    let out = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(args)
        .arg("--help")
        .env_remove("NODE_NAME")
        .output()
        .expect("run iadeep");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn kubernetes_container_args_are_accepted() {
    for (file, kind) in [
        ("kubernetes/placer.yaml", "Deployment"),
        ("kubernetes/tuner.yaml", "DaemonSet"),
    ] {
        let docs: Vec<serde_json::Value> =
            serde_saphyr::from_multiple(&deploy(file)).expect("YAML");
        let workload = docs
            .iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("{file}: no {kind}"));
        let args: Vec<String> = workload["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .expect("args")
            .iter()
            .map(|a| a.as_str().expect("string arg").to_owned())
            .collect();
        accepts(&args);
    }
}

#[test]
fn systemd_exec_lines_are_accepted() {
    for unit in [
        "systemd/iadeep-placer.service",
        "systemd/iadeep-tuner.service",
    ] {
        let text = deploy(unit);
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .expect("ExecStart");
        let args: Vec<String> = exec.split_whitespace().skip(1).map(str::to_owned).collect();
        accepts(&args);
    }
}
