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

/// The objects `kubectl kustomize deploy/kubernetes/DIR` renders (kubectl 1.20 or later:
/// scripts/install-deps.sh installs Debian's kubernetes-client).
fn rendered(dir: &str) -> Vec<serde_json::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/kubernetes")
        .join(dir);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("kubectl kustomize {}: {e}", path.display()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(&String::from_utf8_lossy(&out.stdout)).expect("YAML");
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

/// Every overlay's placer and tuner command lines, with the store URL the overlay gives
/// them (IADEEP_STORE from its ConfigMap) as --store.
#[test]
fn kubernetes_container_args_are_accepted() {
    for dir in [
        "overlays/in-cluster-etcd",
        "overlays/external-etcd",
        "overlays/gpu-nodes",
        "overlays/tls",
    ] {
        let docs = rendered(dir);
        let store = docs
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "iadeep-store")
            .and_then(|d| d["data"]["url"].as_str())
            .unwrap_or_else(|| panic!("{dir}: the store's ConfigMap"))
            .to_owned();
        for kind in ["Deployment", "DaemonSet"] {
            let workload = docs
                .iter()
                .find(|d| d["kind"] == kind && d["metadata"]["name"] != "iadeep-scheduler")
                .unwrap_or_else(|| panic!("{dir}: no {kind}"));
            let mut args: Vec<String> =
                workload["spec"]["template"]["spec"]["containers"][0]["args"]
                    .as_array()
                    .expect("args")
                    .iter()
                    .map(|a| a.as_str().expect("string arg").to_owned())
                    .collect();
            args.push(format!("--store={store}"));
            accepts(&args);
        }
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
