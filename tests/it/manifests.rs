//! The deployment files in `deploy/`: the Kubernetes Kustomize base and every overlay,
//! rendered with `kubectl kustomize` as an operator applies them, each object parsing into
//! its `k8s-openapi` type with no field left unread (a misspelt or misplaced field is an
//! error, as `kubectl apply --validate=strict` would say); in each, the scheduler
//! configuration agrees with the placer's Service, bind timeout and TLS, the store URL is
//! one iadeep parses with its certificates mounted, and the ServiceMonitors find their
//! Services; the Grafana dashboard asks only for metrics the daemons export.
//!
//! Needs `kubectl` (Debian's `kubernetes-client`, 1.20 or later: `scripts/install-deps.sh`
//! installs it). The kustomizations keep to what kubectl 1.20's kustomize reads.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use iadeep_state::StoreUrl;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every kustomization: the base (which overlays build on; it leaves the store out) and
/// each overlay an operator applies.
const KUSTOMIZATIONS: [&str; 5] = [
    "base",
    "overlays/in-cluster-etcd",
    "overlays/external-etcd",
    "overlays/gpu-nodes",
    "overlays/tls",
];

/// Parses `value` as `T`, failing on any field `T` does not have.
fn strict<T: DeserializeOwned>(value: &Value, what: &str) -> T {
    let mut unknown = Vec::new();
    let parsed: T = serde_ignored::deserialize(value, |path| unknown.push(path.to_string()))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(unknown.is_empty(), "{what}: unknown fields {unknown:?}");
    parsed
}

/// The objects `kubectl kustomize deploy/kubernetes/DIR` renders, as (DIR, JSON value).
fn rendered(dir: &str) -> Vec<(String, Value)> {
    let path = deploy_dir().join("kubernetes").join(dir);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "kubectl kustomize {}: {e}; install kubectl (scripts/install-deps.sh installs \
                 Debian's kubernetes-client)",
                path.display()
            )
        });
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{dir}: {e}\n{text}"));
    // kubectl 1.20 leaves an empty document where a patch deleted an object.
    let docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    assert!(docs.len() >= 10, "{dir}: {} objects", docs.len());
    docs.into_iter().map(|d| (dir.to_owned(), d)).collect()
}

/// The base's objects.
fn objects() -> Vec<(String, Value)> {
    rendered("base")
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
    #[serde(default)]
    tls_config: Option<ExtenderTls>,
}

/// The extender's `tlsConfig`: files kube-scheduler reads.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ExtenderTls {
    ca_file: String,
    cert_file: String,
    key_file: String,
}

/// `monitoring.coreos.com/v1` `ServiceMonitor`, the fields iadeep sets.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    endpoints: Vec<MonitorEndpoint>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MonitorEndpoint {
    port: String,
    path: String,
    interval: String,
    #[serde(default)]
    scheme: Option<String>,
    #[serde(default)]
    tls_config: Option<Value>,
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

/// Parses `object` strictly into its kind's type; the kind.
fn check_object(dir: &str, object: &Value) -> String {
    let kind = object["kind"].as_str().unwrap_or("?");
    let what = format!("{dir}: {kind} {}", object["metadata"]["name"]);
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
        ("batch/v1", "CronJob") => drop(strict::<CronJob>(object, &what)),
        ("monitoring.coreos.com/v1", "ServiceMonitor") => {
            drop(strict::<ServiceMonitor>(object, &what))
        }
        (api, kind) => panic!("{what}: no check for {api} {kind}"),
    }
    kind.to_owned()
}

#[test]
fn every_kustomization_is_tested_and_renders() {
    let overlays = deploy_dir().join("kubernetes/overlays");
    let mut found: Vec<String> = std::fs::read_dir(&overlays)
        .expect("deploy/kubernetes/overlays exists")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("kustomization.yaml").exists())
        .map(|p| {
            format!(
                "overlays/{}",
                p.file_name().expect("name").to_string_lossy()
            )
        })
        .collect();
    found.push("base".to_owned());
    found.sort();
    let mut listed = KUSTOMIZATIONS.map(str::to_owned).to_vec();
    listed.sort();
    assert_eq!(found, listed, "KUSTOMIZATIONS lists every overlay");
}

#[test]
fn every_kubernetes_object_parses_strictly_into_its_type() {
    for dir in KUSTOMIZATIONS {
        let objects = rendered(dir);
        let kinds: BTreeSet<String> = objects.iter().map(|(d, o)| check_object(d, o)).collect();
        for expected in [
            "Deployment",
            "DaemonSet",
            "Service",
            "ClusterRole",
            "ConfigMap",
            "ServiceMonitor",
        ] {
            assert!(kinds.contains(expected), "{dir}: {kinds:?}");
        }
    }
}

#[test]
fn a_misspelt_field_is_caught() {
    let mut object = find(&objects(), "Deployment", "iadeep-placer").clone();
    object["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always".into();
    let result = std::panic::catch_unwind(|| strict::<Deployment>(&object, "typo"));
    assert!(result.is_err(), "an unknown field must fail the check");
}

/// The pod template of the workload `kind` `name`.
fn pod_spec(objects: &[(String, Value)], kind: &str, name: &str) -> PodSpec {
    let object = &find(objects, kind, name)["spec"]["template"]["spec"];
    strict(object, &format!("{kind} {name}'s pod"))
}

/// Whether `file` lies in a Secret volume mounted into `container` of `pod`.
fn in_mounted_secret(pod: &PodSpec, container: &Container, file: &str) -> bool {
    container.volume_mounts.iter().flatten().any(|mount| {
        let is_secret = pod
            .volumes
            .iter()
            .flatten()
            .any(|v| v.name == mount.name && v.secret.is_some());
        is_secret && file.starts_with(&format!("{}/", mount.mount_path.trim_end_matches('/')))
    })
}

/// The scheduler configuration of `dir`'s objects agrees with its placer: the URL reaches
/// the placer's Service on the extender port, over HTTPS exactly when the placer serves
/// TLS (then with certificates mounted into the scheduler), and the scheduler waits longer
/// than the placer's bind timeout.
fn check_scheduler(dir: &str, objects: &[(String, Value)]) {
    let config_map: ConfigMap = strict(
        find(objects, "ConfigMap", "iadeep-scheduler-config"),
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
    assert!(extender.weight > 0 && extender.node_cache_capable);
    assert!(!extender.ignorable);
    assert_eq!(extender.managed_resources[0].name, "nvidia.com/gpumem");
    assert!(extender.managed_resources[0].ignored_by_scheduler);

    // The URL reaches the placer's Service on its extender port.
    let service: Service = strict(find(objects, "Service", "iadeep-placer"), "Service");
    let port = service
        .spec
        .expect("spec")
        .ports
        .expect("ports")
        .into_iter()
        .find(|p| p.name.as_deref() == Some("extender"))
        .expect("extender port")
        .port;
    let scheme = if extender.enable_https {
        "https"
    } else {
        "http"
    };
    assert_eq!(
        extender.url_prefix,
        format!("{scheme}://iadeep-placer.iadeep-system.svc:{port}"),
        "{dir}"
    );

    let deployment: Deployment = strict(find(objects, "Deployment", "iadeep-placer"), "Deployment");
    let spec = deployment.spec.expect("spec");
    assert_eq!(
        spec.replicas,
        Some(1),
        "one replica (see the file's comment)"
    );
    let pod = spec.template.spec.expect("pod spec");
    let container = &pod.containers[0];
    let args = container.args.clone().expect("args");
    // The placer answers a bind before the scheduler gives up on it.
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
    check_placer_tls(dir, objects, extender, &pod, container, &args);
}

/// HTTPS to the extender exactly when the placer serves TLS; every certificate file either
/// side names is in a mounted Secret.
fn check_placer_tls(
    dir: &str,
    objects: &[(String, Value)],
    extender: &Extender,
    pod: &PodSpec,
    container: &Container,
    args: &[String],
) {
    let tls_cert = flag(args, "tls-cert");
    assert_eq!(extender.enable_https, tls_cert.is_some(), "{dir}: {args:?}");
    assert_eq!(
        extender.tls_config.is_some(),
        extender.enable_https,
        "{dir}"
    );
    for name in ["tls-cert", "tls-key", "tls-client-ca"] {
        if let Some(file) = flag(args, name) {
            assert!(
                in_mounted_secret(pod, container, file),
                "{dir}: --{name}={file}"
            );
        }
    }
    if let Some(tls) = &extender.tls_config {
        let scheduler = pod_spec(objects, "Deployment", "iadeep-scheduler");
        for file in [&tls.ca_file, &tls.cert_file, &tls.key_file] {
            assert!(
                in_mounted_secret(&scheduler, &scheduler.containers[0], file),
                "{dir}: the scheduler's {file}"
            );
        }
        // kubelet's gRPC probe speaks no TLS: a TLS placer is probed over HTTPS.
        let liveness = container.liveness_probe.as_ref().expect("liveness");
        assert!(liveness.grpc.is_none(), "{dir}");
        let http = liveness.http_get.as_ref().expect("HTTPS liveness");
        assert_eq!(http.scheme.as_deref(), Some("HTTPS"), "{dir}");
    }
}

#[test]
fn the_scheduler_configuration_matches_the_placer() {
    for dir in KUSTOMIZATIONS {
        check_scheduler(dir, &rendered(dir));
    }
}

/// The placer's ClusterRole allows every call it makes: read and annotate pods, create
/// their Bindings (bind) and their Evictions (a pod whose job ignored its eviction).
#[test]
fn the_placers_role_allows_every_call_it_makes() {
    for dir in KUSTOMIZATIONS {
        let objects = rendered(dir);
        let role: ClusterRole = strict(find(&objects, "ClusterRole", "iadeep-placer"), dir);
        let rules = role.rules.unwrap_or_default();
        for (resource, verb) in [
            ("pods", "get"),
            ("pods", "patch"),
            ("pods/binding", "create"),
            ("pods/eviction", "create"),
        ] {
            let allowed = rules.iter().any(|rule| {
                rule.api_groups
                    .as_ref()
                    .is_some_and(|g| g.iter().any(|g| g.is_empty()))
                    && rule
                        .resources
                        .as_ref()
                        .is_some_and(|r| r.iter().any(|r| r == resource))
                    && rule.verbs.iter().any(|v| v == verb)
            });
            assert!(allowed, "{dir}: the placer may not {verb} {resource}");
        }
    }
}

#[test]
fn the_tuner_runs_every_gpu_of_its_node_under_the_node_name() {
    for dir in KUSTOMIZATIONS {
        let pod = pod_spec(&rendered(dir), "DaemonSet", "iadeep-tuner");
        let container = &pod.containers[0];
        let args = container.args.clone().expect("args");
        assert_eq!(args[0], "tuner");
        assert!(args.iter().any(|a| a == "--all-gpus"), "{dir}: {args:?}");
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
        let selector = pod.node_selector.clone().unwrap_or_default();
        assert_eq!(
            selector.get("nvidia.com/gpu.present").map(String::as_str),
            Some("true"),
            "{dir}: GPU nodes only"
        );
        let shared_only = selector.get("iadeep.io/gpu-sharing").map(String::as_str);
        let expected = (dir == "overlays/gpu-nodes").then_some("true");
        assert_eq!(shared_only, expected, "{dir}: {selector:?}");
    }
}

/// The store every daemon of `dir` reads: IADEEP_STORE from the `iadeep-store` ConfigMap,
/// a URL iadeep parses, the in-cluster etcd's Service exactly where the overlay brings it
/// (the base names it for the overlays that do), with TLS files in a Secret mounted into
/// every daemon.
fn check_store(dir: &str, objects: &[(String, Value)]) {
    let config_map: ConfigMap = strict(find(objects, "ConfigMap", "iadeep-store"), "ConfigMap");
    let url = config_map.data.expect("data")["url"].clone();
    let parsed = StoreUrl::from_str(&url).unwrap_or_else(|e| panic!("{dir}: {url}: {e}"));
    let StoreUrl::Etcd(config) = parsed else {
        panic!("{dir}: {url} is not etcd")
    };
    let in_cluster = objects.iter().any(|(_, o)| o["kind"] == "StatefulSet");
    assert_eq!(
        config.endpoints == ["iadeep-etcd.iadeep-system.svc:2379"],
        in_cluster || dir == "base",
        "{dir}: {url}"
    );
    if in_cluster {
        find(objects, "Service", "iadeep-etcd");
        // The etcd iadeep deploys is defragmented by the CronJob beside it, at the
        // address the daemons use (README, "Compaction and defragmentation").
        let defrag: CronJob = strict(find(objects, "CronJob", "iadeep-etcd-defrag"), "CronJob");
        let pod = defrag
            .spec
            .and_then(|s| s.job_template.spec)
            .and_then(|s| s.template.spec)
            .unwrap_or_else(|| panic!("{dir}: the defragmentation CronJob has a pod"));
        let command = pod.containers[0].command.clone().unwrap_or_default();
        assert_eq!(
            command.first().map(String::as_str),
            Some("etcdctl"),
            "{dir}"
        );
        assert_eq!(command.last().map(String::as_str), Some("defrag"), "{dir}");
        let endpoints: Vec<String> = config
            .endpoints
            .iter()
            .map(|e| format!("http://{e}"))
            .collect();
        assert_eq!(
            flag(&command, "endpoints"),
            Some(endpoints.join(",").as_str()),
            "{dir}: the CronJob defragments the store the daemons use"
        );
    } else {
        assert!(
            !objects.iter().any(|(_, o)| o["kind"] == "CronJob"),
            "{dir}: an etcd iadeep does not run is not iadeep's to defragment"
        );
    }
    for (kind, name) in [
        ("Deployment", "iadeep-placer"),
        ("DaemonSet", "iadeep-tuner"),
    ] {
        let pod = pod_spec(objects, kind, name);
        let container = &pod.containers[0];
        let store = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "IADEEP_STORE")
            .and_then(|e| e.value_from.as_ref()?.config_map_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{dir}: {name} reads IADEEP_STORE from a ConfigMap"));
        assert_eq!(
            (store.name.as_str(), store.key.as_str()),
            ("iadeep-store", "url")
        );
        let args = container.args.clone().unwrap_or_default();
        assert!(
            flag(&args, "store").is_none(),
            "{dir}: {name}: one place for the URL"
        );
        let files = config
            .tls
            .iter()
            .flat_map(|t| [&t.ca, &t.client_cert, &t.client_key]);
        for file in files.flatten() {
            let file = file.to_string_lossy();
            assert!(
                in_mounted_secret(&pod, container, &file),
                "{dir}: {name}: {file}"
            );
        }
    }
    assert_eq!(config.tls.is_some(), dir == "overlays/tls", "{dir}: {url}");
}

#[test]
fn every_daemon_reads_one_store_url_that_iadeep_parses() {
    for dir in KUSTOMIZATIONS {
        check_store(dir, &rendered(dir));
    }
}

/// Each ServiceMonitor selects a Service of the same objects that has the port it scrapes,
/// over HTTPS exactly when the daemon behind it serves TLS.
#[test]
fn the_service_monitors_find_the_daemons_metrics() {
    for dir in KUSTOMIZATIONS {
        let objects = rendered(dir);
        let monitors: Vec<ServiceMonitor> = objects
            .iter()
            .filter(|(_, o)| o["kind"] == "ServiceMonitor")
            .map(|(_, o)| strict(o, "ServiceMonitor"))
            .collect();
        assert_eq!(monitors.len(), 2, "{dir}: the placer's and the tuners'");
        let placer_tls = {
            let pod = pod_spec(&objects, "Deployment", "iadeep-placer");
            flag(
                &pod.containers[0].args.clone().unwrap_or_default(),
                "tls-cert",
            )
            .is_some()
        };
        for monitor in &monitors {
            assert_eq!(monitor.api_version, "monitoring.coreos.com/v1");
            assert_eq!(monitor.kind, "ServiceMonitor");
            let wanted = monitor
                .spec
                .selector
                .match_labels
                .clone()
                .unwrap_or_default();
            assert!(!wanted.is_empty(), "{dir}: selects something");
            let services: Vec<Service> = objects
                .iter()
                .filter(|(_, o)| o["kind"] == "Service")
                .map(|(_, o)| strict::<Service>(o, "Service"))
                .filter(|s| {
                    let labels = s.metadata.labels.clone().unwrap_or_default();
                    wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
                })
                .collect();
            assert_eq!(
                services.len(),
                1,
                "{dir}: {:?} selects one Service",
                monitor.metadata.name
            );
            let ports = services[0]
                .spec
                .clone()
                .and_then(|s| s.ports)
                .unwrap_or_default();
            for endpoint in &monitor.spec.endpoints {
                assert!(
                    ports
                        .iter()
                        .any(|p| p.name.as_deref() == Some(endpoint.port.as_str())),
                    "{dir}: port {}",
                    endpoint.port
                );
                assert_eq!(endpoint.path, "/metrics");
                assert!(!endpoint.interval.is_empty());
                let https = endpoint.scheme.as_deref() == Some("https");
                let is_placer = monitor.metadata.name.as_deref() == Some("iadeep-placer");
                assert_eq!(
                    https,
                    is_placer && placer_tls,
                    "{dir}: {:?}",
                    monitor.metadata.name
                );
                assert_eq!(endpoint.tls_config.is_some(), https, "{dir}");
            }
        }
    }
}

/// Metric names the daemons export (histograms with their series suffixes).
fn exported_metrics() -> BTreeSet<String> {
    let mut text = iadeep_placer::PlacerMetrics::default().render(0, 0);
    // Per-task families have no series (and no TYPE line) until a task is resident.
    let tuner = Arc::new(iadeep_tuner::daemon::Metrics::default());
    tuner.set_task_pds(vec![("t".into(), "production", 1.0)]);
    text.push_str(&tuner.render("d"));
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
