//! The placer daemon: view sync, gRPC (with `grpc.health.v1` and server
//! reflection), the Kubernetes extender and the operators' HTTP endpoints
//! (`/metrics`, `/healthz`, `/readyz`), each on its own listener, and the loops that
//! keep the store in order (the [`crate::reaper`] and the [`crate::eviction`] loop that
//! acts on the tuners' cap breaches), and, when the extender binds pods through the
//! Kubernetes API, the driver that evicts the pods of tasks that ignored their eviction
//! (`extender::pod_evictor`), stopped together.
//!
//! Every listener is created by [`bind`] and every HTTP server started by
//! [`serve_http`]. With [`DaemonConfig::tls`] every listener speaks TLS with the
//! same certificate; when it verifies clients, gRPC and the extender (the listeners
//! that change state) refuse a client without a certificate signed by its client CA,
//! while `/metrics`, `/healthz` and `/readyz` stay readable by kubelet's probes.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::Router;
use iadeep_ops::tls::ServerTls;
use iadeep_proto::placer_server::PlacerServer;
use iadeep_state::StateStore;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::{PlacerError, Result};
#[cfg(feature = "kubernetes")]
use crate::extender::pod_evictor::{self, PodEvictor};
#[cfg(feature = "kubernetes")]
use crate::extender::{Extender, ExtenderConfig, kube_api::KubeApi};
use crate::grpc::GrpcPlacer;
use crate::metrics::PlacerMetrics;
use crate::model::MemoryEstimator;
use crate::policy::Placer;
use crate::service::PlacementService;
use crate::sync::ViewSync;
use crate::view::ClusterView;

/// Where the daemon listens. Port 0 picks a free port (see [`Daemon`]'s accessors).
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub grpc: SocketAddr,
    /// The Kubernetes scheduler extender; `None` to not serve it.
    #[cfg(feature = "kubernetes")]
    pub extender: Option<ExtenderConfig>,
    /// `/metrics`, `/healthz` and `/readyz`; `None` to not serve them.
    pub metrics: Option<SocketAddr>,
    /// Release the reservation of a task whose agent has been gone (its `alive` key
    /// deleted, its lease expired) this long; `None` never does (see [`crate::reaper`]).
    pub dead_task_grace: Option<std::time::Duration>,
    /// Release the reservation of a task whose agent never appeared (no `alive` key, no
    /// report) this long after it was placed; `None` never does (see [`crate::reaper`]).
    pub unstarted_task_grace: Option<std::time::Duration>,
    /// TLS on every listener (see the module's documentation); `None` serves plain text.
    pub tls: Option<ServerTls>,
}

/// A running placer.
#[derive(Debug)]
pub struct Daemon {
    grpc_addr: SocketAddr,
    extender_addr: Option<SocketAddr>,
    metrics_addr: Option<SocketAddr>,
    service: PlacementService,
    metrics: Arc<PlacerMetrics>,
    stop: watch::Sender<bool>,
    servers: Vec<(&'static str, JoinHandle<Result<()>>)>,
    /// The tasks following the store into the view: stopped, and waited for, last.
    view_sync: ViewSync,
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| PlacerError::Serve {
            what,
            addr: addr.to_string(),
            reason: e.to_string(),
        })
}

fn local_addr(what: &'static str, listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|e| PlacerError::Serve {
        what,
        addr: "?".into(),
        reason: e.to_string(),
    })
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    // An error means the daemon handle was dropped: stop as well.
    let _ = stop.wait_for(|s| *s).await;
}

fn serve_http(
    what: &'static str,
    listener: TcpListener,
    router: Router,
    tls: Option<ServerTls>,
    stop: watch::Receiver<bool>,
) -> JoinHandle<Result<()>> {
    tokio::spawn(async move {
        let addr = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        iadeep_ops::tls::serve_http(listener, router, tls.as_ref(), stopped(stop))
            .await
            .map_err(|e| PlacerError::Serve {
                what,
                addr,
                reason: e.to_string(),
            })
    })
}

/// tonic's TLS settings for the gRPC server: the certificate and key of `tls`, and
/// its client CA (a client without a certificate signed by it is refused).
fn grpc_tls(tls: &ServerTls) -> tonic::transport::ServerTlsConfig {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let config = ServerTlsConfig::new()
        .identity(Identity::from_pem(tls.cert_pem(), tls.key_pem()))
        .timeout(iadeep_ops::tls::HANDSHAKE_TIMEOUT);
    match tls.client_ca_pem() {
        Some(ca) => config.client_ca_root(Certificate::from_pem(ca)),
        None => config,
    }
}

/// Binds the gRPC listener and serves the Placer service there, with
/// `grpc.health.v1` and server reflection, until `stop`. Returns the address bound.
async fn serve_grpc(
    service: &PlacementService,
    addr: SocketAddr,
    tls: Option<&ServerTls>,
    stop: watch::Receiver<bool>,
) -> Result<(SocketAddr, JoinHandle<Result<()>>)> {
    let grpc_listener = bind("gRPC listener", addr).await?;
    let grpc_addr = local_addr("gRPC listener", &grpc_listener)?;
    let grpc = GrpcPlacer::server(service.clone());
    // grpc.health.v1 for Kubernetes' gRPC probes and load balancers: the Placer
    // service (and the server as a whole, "") serve once the view is loaded, which
    // it is by now.
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<PlacerServer<GrpcPlacer>>()
        .await;
    let reflection_error = |e: tonic_reflection::server::Error| PlacerError::Serve {
        what: "gRPC reflection",
        addr: grpc_addr.to_string(),
        reason: e.to_string(),
    };
    // Server reflection (v1 and the v1alpha older grpcurl versions ask for).
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(iadeep_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(reflection_error)?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(iadeep_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(reflection_error)?;
    let mut grpc_server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        grpc_server = grpc_server
            .tls_config(grpc_tls(tls))
            .map_err(|e| PlacerError::Serve {
                what: "gRPC TLS",
                addr: grpc_addr.to_string(),
                reason: e.to_string(),
            })?;
    }
    let server = tokio::spawn(async move {
        // Kept alive with the server: dropping it would end the health watches.
        let _health_reporter = health_reporter;
        grpc_server
            .add_service(health)
            .add_service(reflection)
            .add_service(reflection_alpha)
            .add_service(grpc)
            .serve_with_incoming_shutdown(
                // Without TCP_NODELAY a response written in two pieces waits for the
                // client's delayed ACK: a flat 40 ms per Place.
                tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
                stopped(stop),
            )
            .await
            .map_err(|e| PlacerError::Serve {
                what: "gRPC server",
                addr: grpc_addr.to_string(),
                reason: e.to_string(),
            })
    });
    Ok((grpc_addr, server))
}

/// Connects to the Kubernetes API when `extender` binds through it, binds the
/// extender's listener and serves it until `stop`. Returns the address bound.
#[cfg(feature = "kubernetes")]
async fn serve_extender(
    extender: &ExtenderConfig,
    service: &PlacementService,
    metrics: &Arc<PlacerMetrics>,
    tls: Option<ServerTls>,
    stop: watch::Receiver<bool>,
) -> Result<(SocketAddr, JoinHandle<Result<()>>)> {
    let kube = match &extender.kube_api {
        Some(api) => {
            let kube = KubeApi::connect(api).await?;
            tracing::info!(
                server = kube.server(),
                "extender binds pods through the Kubernetes API"
            );
            Some(kube)
        }
        None => None,
    };
    let listener = bind("extender listener", extender.listen).await?;
    let addr = local_addr("extender listener", &listener)?;
    let router = Arc::new(
        Extender::new(
            service.clone(),
            metrics.clone(),
            kube,
            extender.bind_timeout,
        )
        .with_priority_rule(extender.priority_rule.clone()),
    )
    .router();
    Ok((
        addr,
        serve_http("extender server", listener, router, tls, stop),
    ))
}

/// Refuses a pod-eviction grace that does not end before the dead-task grace when the
/// pod evictor runs (only with the Kubernetes API): it must end an evicted pod before
/// the reaper gives the pod's memory away (see [`crate::pod_eviction::check_grace`]).
#[cfg(feature = "kubernetes")]
fn check_pod_evict_grace(placer: &Placer, config: &DaemonConfig) -> Result<()> {
    if config
        .extender
        .as_ref()
        .is_some_and(|e| e.kube_api.is_some())
    {
        crate::pod_eviction::check_grace(placer.params().pod_evict_grace, config.dead_task_grace)?;
    }
    Ok(())
}

/// Starts the driver that evicts the pods of tasks that ignored their eviction
/// (`extender::pod_evictor`), when the extender binds pods through the Kubernetes API:
/// only then do tasks know their pod.
#[cfg(feature = "kubernetes")]
async fn spawn_pod_evictor(
    extender: &ExtenderConfig,
    service: &PlacementService,
    metrics: &Arc<PlacerMetrics>,
    stop: watch::Receiver<bool>,
) -> Result<Option<JoinHandle<Result<()>>>> {
    let Some(api) = &extender.kube_api else {
        return Ok(None);
    };
    let kube = KubeApi::connect_without_retries(api).await?;
    let evictor = PodEvictor::new(service.clone(), kube, metrics.clone());
    Ok(Some(pod_evictor::spawn(evictor, stop)))
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` there until `stop`,
/// without asking clients for certificates (kubelet's probes have none). Returns the
/// address bound.
async fn serve_metrics(
    addr: SocketAddr,
    service: &PlacementService,
    metrics: &Arc<PlacerMetrics>,
    store: Arc<dyn StateStore>,
    tls: Option<&ServerTls>,
    stop: watch::Receiver<bool>,
) -> Result<(SocketAddr, JoinHandle<Result<()>>)> {
    let listener = bind("metrics listener", addr).await?;
    let bound = local_addr("metrics listener", &listener)?;
    let scrape_service = service.clone();
    let metrics = metrics.clone();
    let scrape: iadeep_ops::Scrape = Arc::new(move || {
        let (devices, residents) = {
            let view = scrape_service.view();
            (view.len(), view.resident_count())
        };
        metrics.render(devices, residents)
    });
    let router = iadeep_ops::router(scrape, iadeep_ops::store_ready(store));
    Ok((
        bound,
        serve_http(
            "metrics server",
            listener,
            router,
            tls.map(ServerTls::without_client_verification),
            stop,
        ),
    ))
}

/// Spawns the loops that run beside the listeners, whatever the config: the
/// dead-task reaper and the eviction loop, each named for the
/// errors and logs that report it.
fn spawn_loops(
    service: &PlacementService,
    config: &DaemonConfig,
    stop_rx: &watch::Receiver<bool>,
) -> [(&'static str, JoinHandle<Result<()>>); 2] {
    let graces = crate::reaper::Graces {
        dead: config.dead_task_grace,
        unstarted: config.unstarted_task_grace,
    };
    [
        // Always: besides the graces' releases, it re-admits running tasks released
        // while their agent ran and applies the retention of released tasks.
        (
            "dead-task reaper",
            crate::reaper::spawn(service.clone(), graces, stop_rx.clone()),
        ),
        // Acts on the tuners' cap breaches: evicts the opportunistic job blamed most.
        (
            "eviction loop",
            crate::eviction::spawn(service.clone(), stop_rx.clone()),
        ),
    ]
}

impl Daemon {
    /// Loads the view from `store`, binds every listener, and serves until [`Daemon::shutdown`].
    ///
    /// `memory` estimates footprints for the view (see [`ClusterView::new`]).
    pub async fn start(
        store: Arc<dyn StateStore>,
        placer: Placer,
        memory: Arc<dyn MemoryEstimator>,
        config: DaemonConfig,
    ) -> Result<Daemon> {
        #[cfg(feature = "kubernetes")]
        check_pod_evict_grace(&placer, &config)?;
        let metrics = Arc::new(PlacerMetrics::default());
        let view = Arc::new(RwLock::new(ClusterView::new(memory)));
        let sync = ViewSync::start(
            store.clone(),
            view.clone(),
            placer.slowdown_model().clone(),
            metrics.clone(),
        )
        .await?;
        let service = PlacementService::new(store.clone(), view, Arc::new(placer))
            .with_events(metrics.clone())
            .with_instance(instance_name());
        tracing::info!(instance = %service.instance(), "placer instance (named in the evictions it writes)");
        let (stop, stop_rx) = watch::channel(false);
        let mut servers = Vec::new();

        let (grpc_addr, grpc) =
            serve_grpc(&service, config.grpc, config.tls.as_ref(), stop_rx.clone()).await?;
        servers.push(("gRPC", grpc));

        #[cfg_attr(not(feature = "kubernetes"), allow(unused_mut))]
        let mut extender_addr = None;
        #[cfg(feature = "kubernetes")]
        if let Some(extender) = &config.extender {
            let (addr, server) = serve_extender(
                extender,
                &service,
                &metrics,
                config.tls.clone(),
                stop_rx.clone(),
            )
            .await?;
            extender_addr = Some(addr);
            servers.push(("extender", server));
            // Kubernetes' counterpart of `iadeep run`'s enforcement of evictions.
            if let Some(evictor) =
                spawn_pod_evictor(extender, &service, &metrics, stop_rx.clone()).await?
            {
                servers.push(("pod evictor", evictor));
            }
        }

        let mut metrics_addr = None;
        if let Some(addr) = config.metrics {
            let (addr, server) = serve_metrics(
                addr,
                &service,
                &metrics,
                store.clone(),
                config.tls.as_ref(),
                stop_rx.clone(),
            )
            .await?;
            metrics_addr = Some(addr);
            servers.push(("metrics", server));
        }
        servers.extend(spawn_loops(&service, &config, &stop_rx));
        tracing::info!(grpc = %grpc_addr, extender = ?extender_addr, metrics = ?metrics_addr,
            tls = ?config.tls, "placer serving");
        Ok(Daemon {
            grpc_addr,
            extender_addr,
            metrics_addr,
            service,
            metrics,
            stop,
            servers,
            view_sync: sync,
        })
    }

    /// The gRPC address actually bound.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The extender address actually bound.
    pub fn extender_addr(&self) -> Option<SocketAddr> {
        self.extender_addr
    }

    /// The metrics address actually bound.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The service behind the front ends.
    pub fn service(&self) -> &PlacementService {
        &self.service
    }

    /// The metrics the daemon serves (what the service and the extender counted).
    pub fn metrics(&self) -> &Arc<PlacerMetrics> {
        &self.metrics
    }

    /// Resolves when any server stops on its own (an error), with that error.
    pub async fn failed(&mut self) -> PlacerError {
        if self.servers.is_empty() {
            futures::future::pending::<()>().await;
        }
        let futures = self.servers.iter_mut().map(|(_, h)| h);
        let (result, index, _) = futures::future::select_all(futures).await;
        let what = self.servers[index].0;
        self.servers.remove(index);
        match result {
            Ok(Err(err)) => err,
            Ok(Ok(())) => PlacerError::Serve {
                what,
                addr: String::new(),
                reason: "stopped unexpectedly".into(),
            },
            Err(join) => PlacerError::Serve {
                what,
                addr: String::new(),
                reason: join.to_string(),
            },
        }
    }

    /// Stops accepting, lets in-flight requests finish, and waits for the servers.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for (what, handle) in self.servers {
            match handle.await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(server = what, %err, "server ended with an error"),
                Err(err) => tracing::warn!(server = what, %err, "server task failed"),
            }
        }
        self.view_sync.stop().await;
        tracing::info!("placer stopped");
    }
}

/// This placer's name among those sharing the store: `host:pid`. The host name is the
/// kernel's (a pod's name on Kubernetes, so two replicas differ even as pid 1 each).
fn instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    format!("{host}:{}", std::process::id())
}
