//! TLS on the daemons' listeners, over real sockets with certificates made here:
//! the placer's gRPC API and extender verify client certificates when given a
//! client CA (kube-scheduler's way of authenticating to an extender), trust goes
//! only to the right CA, plain text is not answered, and the placer's and the
//! tuner's metrics are served over HTTPS to clients without a certificate
//! (kubelet's probes).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use iadeep_ops::tls::ServerTls;
use iadeep_placer::extender::{DEFAULT_BIND_TIMEOUT, ExtenderConfig};
use iadeep_placer::{Daemon, DaemonConfig, ModelledMemory};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{PlaceRequest, place_response};
use iadeep_state::testing::Pki;
use iadeep_state::{StateStore, StoreUrl};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tonic::transport::{Certificate, Endpoint, Identity};

use crate::placer::{loopback, placer, pod, register, task};

async fn memory_store() -> Arc<dyn StateStore> {
    StoreUrl::Memory.open().await.expect("in-memory store")
}

/// A placer serving gRPC, the extender (no Kubernetes API) and metrics with `tls`.
async fn tls_placer(store: Arc<dyn StateStore>, tls: ServerTls) -> Daemon {
    let config = DaemonConfig {
        grpc: loopback(),
        extender: Some(ExtenderConfig {
            listen: loopback(),
            kube_api: None,
            bind_timeout: DEFAULT_BIND_TIMEOUT,
            priority_rule: Default::default(),
        }),
        metrics: Some(loopback()),
        dead_task_grace: None,
        unstarted_task_grace: None,
        tls: Some(tls),
    };
    Daemon::start(store, placer(), Arc::new(ModelledMemory), config)
        .await
        .expect("start the placer")
}

/// A gRPC client of the placer trusting `ca` (plain text without one), presenting
/// `identity` when given; a Place of a small task, or why it failed.
async fn place_over(
    addr: SocketAddr,
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<(), String> {
    let scheme = if ca.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    if let Some(ca) = ca {
        let mut tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(Pki::read(ca)));
        if let Some((cert, key)) = identity {
            tls = tls.identity(Identity::from_pem(Pki::read(cert), Pki::read(key)));
        }
        endpoint = endpoint.tls_config(tls).expect("TLS config");
    }
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    let response = PlacerClient::new(channel)
        .place(PlaceRequest {
            task: Some(task(&format!("t{}", rand_suffix()), 1000, 20.0)),
            candidate_device_ids: Vec::new(),
        })
        .await
        .map_err(|e| format!("{e:?}"))?
        .into_inner();
    match response.decision {
        Some(place_response::Decision::Placed(_)) => Ok(()),
        other => Err(format!("not placed: {other:?}")),
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
}

/// rustls client settings trusting `ca`, presenting `identity` when given.
fn client_config(ca: &Path, identity: Option<(&Path, &Path)>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).expect("CA file") {
        roots.add(cert.expect("CA certificate")).expect("add CA");
    }
    let builder = ClientConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(cert)
                    .expect("cert file")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("certs"),
                PrivateKeyDer::from_pem_file(key).expect("key"),
            )
            .expect("client identity"),
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

/// An HTTP/1.0 request over TLS: the status and the body, or why there was none.
async fn https(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let name = ServerName::from(addr.ip());
        let mut tls = TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let request = format!(
            "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(request.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut response = Vec::new();
        tls.read_to_end(&mut response)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&response).into_owned();
        let status = text
            .strip_prefix("HTTP/1.")
            .and_then(|rest| rest.get(2..5))
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("not an HTTP response: {text:?}"))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| "no answer in 10 s".to_owned())?
}

/// Plain text sent to a TLS listener gets no HTTP answer.
async fn plain_http_answers(addr: SocketAddr) -> bool {
    let Ok(mut tcp) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    if tcp
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut response)).await;
    response.starts_with(b"HTTP/1.")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_tls_trusts_only_its_ca_and_requires_a_client_certificate() {
    let pki = Pki::generate();
    let stranger = Pki::generate();
    let store = memory_store().await;
    register(store.as_ref(), "g0", "n0", 32_768).await;
    let tls = ServerTls::load(&pki.server_cert, &pki.server_key, Some(&pki.ca)).expect("TLS");
    let daemon = tls_placer(store, tls).await;
    let addr = daemon.grpc_addr();
    let identity = Some((pki.client_cert.as_path(), pki.client_key.as_path()));

    place_over(addr, Some(&pki.ca), identity)
        .await
        .expect("a client trusting the CA, with a certificate it signed, is served");
    let err = place_over(addr, Some(&pki.ca), None)
        .await
        .expect_err("a client without a certificate is refused");
    eprintln!("without a client certificate: {err}");
    let err = place_over(addr, Some(&stranger.ca), identity)
        .await
        .expect_err("a client that does not trust the placer's CA does not talk to it");
    eprintln!("trusting another CA: {err}");
    let stranger_identity = Some((
        stranger.client_cert.as_path(),
        stranger.client_key.as_path(),
    ));
    place_over(addr, Some(&pki.ca), stranger_identity)
        .await
        .expect_err("a client certificate signed by another CA is refused");
    place_over(addr, None, None)
        .await
        .expect_err("plain text is not served");
    daemon.shutdown().await;

    // Without a client CA, trusting the server is enough.
    let store = memory_store().await;
    register(store.as_ref(), "g0", "n0", 32_768).await;
    let tls = ServerTls::load(&pki.server_cert, &pki.server_key, None).expect("TLS");
    let daemon = tls_placer(store, tls).await;
    place_over(daemon.grpc_addr(), Some(&pki.ca), None)
        .await
        .expect("TLS without client verification serves any client trusting the CA");
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_verifies_kube_schedulers_certificate_and_metrics_stay_probeable() {
    let pki = Pki::generate();
    let store = memory_store().await;
    register(store.as_ref(), "big.gpu0", "big", 32_768).await;
    let tls = ServerTls::load(&pki.server_cert, &pki.server_key, Some(&pki.ca)).expect("TLS");
    let daemon = tls_placer(store, tls).await;
    let extender = daemon.extender_addr().expect("extender");
    let metrics = daemon.metrics_addr().expect("metrics");
    let filter = json!({"Pod": pod("bert", "4000", json!({"iadeep.io/batch-size": "32"})),
        "NodeNames": ["big"]})
    .to_string();

    let scheduler = client_config(
        &pki.ca,
        Some((pki.client_cert.as_path(), pki.client_key.as_path())),
    );
    let (status, body) = https(extender, scheduler, "POST", "/filter", &filter)
        .await
        .expect("kube-scheduler with its client certificate is answered");
    assert_eq!(status, 200, "{body}");
    let result: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(result["NodeNames"], json!(["big"]), "{result}");

    let anonymous = client_config(&pki.ca, None);
    let refused = https(extender, anonymous.clone(), "POST", "/filter", &filter).await;
    assert!(
        refused.is_err(),
        "a client without a certificate must get no answer from the extender: {refused:?}"
    );
    assert!(
        !plain_http_answers(extender).await,
        "plain HTTP is not served"
    );

    // The operators' endpoints: TLS, but no client certificate needed (kubelet's probes).
    let (status, body) = https(metrics, anonymous.clone(), "GET", "/metrics", "")
        .await
        .expect("metrics over HTTPS");
    assert_eq!(status, 200);
    assert!(body.contains("iadeep_build_info"), "{body}");
    let (status, _) = https(metrics, anonymous, "GET", "/readyz", "")
        .await
        .expect("readiness over HTTPS");
    assert_eq!(status, 200);
    assert!(
        !plain_http_answers(metrics).await,
        "plain HTTP is not served"
    );
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tuners_metrics_are_served_over_https() {
    use iadeep_tuner::daemon::metrics::{Metrics, serve_all};
    let pki = Pki::generate();
    let tls = ServerTls::load(&pki.server_cert, &pki.server_key, None).expect("TLS");
    let (addr, server) = serve_all(
        loopback(),
        vec![("d0".to_owned(), Arc::new(Metrics::default()))],
        Arc::new(|| Box::pin(async { Ok(()) })),
        Some(tls),
    )
    .await
    .expect("serve");
    let (status, body) = https(addr, client_config(&pki.ca, None), "GET", "/metrics", "")
        .await
        .expect("metrics over HTTPS");
    assert_eq!(status, 200);
    assert!(
        body.contains("iadeep_tuner_rounds_total{device=\"d0\"}"),
        "{body}"
    );
    let stranger = Pki::generate();
    let untrusted = https(
        addr,
        client_config(&stranger.ca, None),
        "GET",
        "/metrics",
        "",
    )
    .await;
    assert!(untrusted.is_err(), "{untrusted:?}");
    assert!(!plain_http_answers(addr).await, "plain HTTP is not served");
    server.abort();
}
