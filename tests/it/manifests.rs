//! The deployment files in `deploy/`: every Kubernetes object parses into its
//! `k8s-openapi` type with no field left unread (a misspelt or misplaced field is an
//! error, as `kubectl apply --validate=strict` would say), the scheduler
//! configuration agrees with the placer's Service and bind timeout, and the Grafana
//! dashboard asks only for metrics the daemons export.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Parses `value` as `T`, failing on any field `T` does not have.
fn strict<T: DeserializeOwned>(value: &Value, what: &str) -> T {
    let mut unknown = Vec::new();
    let parsed: T = serde_ignored::deserialize(value, |path| unknown.push(path.to_string()))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(unknown.is_empty(), "{what}: unknown fields {unknown:?}");
    parsed
}

/// Every Kubernetes object in `deploy/kubernetes/`, as (file, JSON value).
fn objects() -> Vec<(String, Value)> {
    let dir = deploy_dir().join("kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("deploy/kubernetes exists")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read");
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.extend(docs.into_iter().map(|d| (name.clone(), d)));
    }
    out
}

fn find<'a>(objects: &'a [(String, Value)], kind: &str, name: &str) -> &'a Value {
    &objects
        .iter()
        .find(|(_, o)| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
        .1
}

/// `kubescheduler.config.k8s.io/v1` `KubeSchedulerConfiguration`, the fields iadeep
/// sets (anything else is refused, so a typo cannot hide).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SchedulerConfiguration {
    api_version: String,
    kind: String,
    leader_election: LeaderElection,
    client_connection: ClientConnection,
    profiles: Vec<Profile>,
    extenders: Vec<Extender>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LeaderElection {
    leader_elect: bool,
    resource_namespace: String,
    resource_name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ClientConnection {
    kubeconfig: String,
    qps: f64,
    burst: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Profile {
    scheduler_name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Extender {
    url_prefix: String,
    filter_verb: String,
    prioritize_verb: String,
    bind_verb: String,
    weight: i64,
    #[serde(rename = "enableHTTPS")]
    enable_https: bool,
    node_cache_capable: bool,
    managed_resources: Vec<ManagedResource>,
    ignorable: bool,
    http_timeout: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ManagedResource {
    name: String,
    ignored_by_scheduler: bool,
}

/// A Go duration of the simple forms used here ("5s", "500ms").
fn go_duration(text: &str) -> Duration {
    if let Some(ms) = text.strip_suffix("ms") {
        Duration::from_millis(ms.parse().expect("ms"))
    } else if let Some(s) = text.strip_suffix('s') {
        Duration::from_secs_f64(s.parse().expect("s"))
    } else {
        panic!("unsupported duration {text:?}")
    }
}

/// The value of `--flag=value` in a container's args.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let prefix = format!("--{name}=");
    args.iter().find_map(|a| a.strip_prefix(&prefix))
}

#[test]
fn every_kubernetes_object_parses_strictly_into_its_type() {
    let objects = objects();
    let mut kinds = BTreeSet::new();
    for (file, object) in &objects {
        let kind = object["kind"].as_str().unwrap_or("?");
        let what = format!("{file}: {kind} {}", object["metadata"]["name"]);
        match (object["apiVersion"].as_str().unwrap_or("?"), kind) {
            ("v1", "Namespace") => drop(strict::<Namespace>(object, &what)),
            ("v1", "ServiceAccount") => drop(strict::<ServiceAccount>(object, &what)),
            ("v1", "Service") => drop(strict::<Service>(object, &what)),
            ("v1", "ConfigMap") => drop(strict::<ConfigMap>(object, &what)),
            ("apps/v1", "Deployment") => drop(strict::<Deployment>(object, &what)),
            ("apps/v1", "DaemonSet") => drop(strict::<DaemonSet>(object, &what)),
            ("apps/v1", "StatefulSet") => drop(strict::<StatefulSet>(object, &what)),
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                drop(strict::<ClusterRole>(object, &what))
            }
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                drop(strict::<ClusterRoleBinding>(object, &what))
            }
            ("rbac.authorization.k8s.io/v1", "Role") => drop(strict::<Role>(object, &what)),
            ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
                drop(strict::<RoleBinding>(object, &what))
            }
            (api, kind) => panic!("{what}: no check for {api} {kind}"),
        }
        kinds.insert(kind.to_owned());
    }
    for expected in [
        "Deployment",
        "DaemonSet",
        "Service",
        "ClusterRole",
        "ConfigMap",
        "StatefulSet",
    ] {
        assert!(kinds.contains(expected), "{kinds:?}");
    }
}

#[test]
fn a_misspelt_field_is_caught() {
    let mut object = find(&objects(), "Deployment", "iadeep-placer").clone();
    object["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always".into();
    let result = std::panic::catch_unwind(|| strict::<Deployment>(&object, "typo"));
    assert!(result.is_err(), "an unknown field must fail the check");
}

#[test]
fn the_scheduler_configuration_matches_the_placer() {
    let objects = objects();
    let config_map: ConfigMap = strict(
        find(&objects, "ConfigMap", "iadeep-scheduler-config"),
        "ConfigMap",
    );
    let text = &config_map.data.expect("data")["scheduler-config.yaml"];
    let config: SchedulerConfiguration = serde_saphyr::from_str(text).expect("strict config");
    assert_eq!(config.api_version, "kubescheduler.config.k8s.io/v1");
    assert_eq!(config.kind, "KubeSchedulerConfiguration");
    assert!(config.leader_election.leader_elect);
    assert_eq!(config.leader_election.resource_namespace, "iadeep-system");
    assert!(!config.leader_election.resource_name.is_empty());
    assert!(config.client_connection.kubeconfig.is_empty(), "in-cluster");
    assert!(config.client_connection.qps > 0.0 && config.client_connection.burst > 0);
    assert_eq!(config.profiles[0].scheduler_name, "iadeep");

    let extender = &config.extenders[0];
    // The verbs are the extender's routes.
    assert_eq!(
        (
            extender.filter_verb.as_str(),
            extender.prioritize_verb.as_str(),
            extender.bind_verb.as_str()
        ),
        ("filter", "prioritize", "bind")
    );
    assert!(extender.weight > 0 && !extender.enable_https && extender.node_cache_capable);
    assert!(!extender.ignorable);
    assert_eq!(extender.managed_resources[0].name, "nvidia.com/gpumem");
    assert!(extender.managed_resources[0].ignored_by_scheduler);

    // The URL reaches the placer's Service on its extender port.
    let service: Service = strict(find(&objects, "Service", "iadeep-placer"), "Service");
    let port = service
        .spec
        .expect("spec")
        .ports
        .expect("ports")
        .into_iter()
        .find(|p| p.name.as_deref() == Some("extender"))
        .expect("extender port")
        .port;
    assert_eq!(
        extender.url_prefix,
        format!("http://iadeep-placer.iadeep-system.svc:{port}")
    );

    // The placer answers a bind before the scheduler gives up on it.
    let deployment: Deployment =
        strict(find(&objects, "Deployment", "iadeep-placer"), "Deployment");
    let spec = deployment.spec.expect("spec");
    assert_eq!(
        spec.replicas,
        Some(1),
        "one replica (see the file's comment)"
    );
    let container = &spec.template.spec.expect("pod spec").containers[0];
    let args = container.args.clone().expect("args");
    let bind_ms: u64 = flag(&args, "bind-timeout-ms")
        .expect("--bind-timeout-ms")
        .parse()
        .expect("ms");
    assert!(
        Duration::from_millis(bind_ms) < go_duration(&extender.http_timeout),
        "bind {bind_ms} ms must be under httpTimeout {}",
        extender.http_timeout
    );
    assert_eq!(flag(&args, "kube-api"), Some("auto"));
    assert_eq!(
        flag(&args, "extender").and_then(|a| a.rsplit(':').next()),
        Some(port.to_string().as_str())
    );
}

#[test]
fn the_tuner_runs_every_gpu_of_its_node_under_the_node_name() {
    let objects = objects();
    let daemon_set: DaemonSet = strict(find(&objects, "DaemonSet", "iadeep-tuner"), "DaemonSet");
    let pod = daemon_set
        .spec
        .expect("spec")
        .template
        .spec
        .expect("pod spec");
    let container = &pod.containers[0];
    let args = container.args.clone().expect("args");
    assert_eq!(args[0], "tuner");
    assert!(args.iter().any(|a| a == "--all-gpus"), "{args:?}");
    let node_name = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME");
    let field = node_name
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .expect("from the downward API");
    assert_eq!(field.field_path, "spec.nodeName");
}

/// Metric names the daemons export (histograms with their series suffixes).
fn exported_metrics() -> BTreeSet<String> {
    let mut text = iadeep_placer::PlacerMetrics::default().render(0, 0);
    text.push_str(&Arc::new(iadeep_tuner::daemon::Metrics::default()).render("d"));
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        names.insert(name.to_owned());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

#[test]
fn the_grafana_dashboard_asks_only_for_exported_metrics() {
    let path = deploy_dir().join("grafana/iadeep-dashboard.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("JSON");
    let exported = exported_metrics();
    assert!(
        exported.contains("process_cpu_seconds_total"),
        "{exported:?}"
    );
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8);
    let mut asked = 0;
    for panel in panels {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            let names = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .filter(|w| w.starts_with("iadeep_") || w.starts_with("process_"));
            for name in names {
                assert!(
                    exported.contains(name),
                    "panel {:?} asks for {name}, which no daemon exports",
                    panel["title"]
                );
                asked += 1;
            }
        }
    }
    assert!(asked >= 20, "{asked}");
}

#[test]
fn systemd_units_start_the_daemons() {
    for (unit, expect) in [
        ("iadeep-placer.service", "iadeep placer "),
        ("iadeep-tuner.service", "iadeep tuner --all-gpus"),
    ] {
        let text = std::fs::read_to_string(deploy_dir().join("systemd").join(unit)).expect("unit");
        for section in ["[Unit]", "[Service]", "[Install]"] {
            assert!(text.contains(section), "{unit}: {section}");
        }
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .expect("ExecStart");
        assert!(
            exec.starts_with("/usr/local/bin/") && exec.contains(expect),
            "{exec}"
        );
    }
}
