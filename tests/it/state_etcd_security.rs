//! The etcd backend against a real etcd serving TLS (certificates made here with
//! rcgen, clients verified by the server) and one with authentication turned on:
//! the store URL's CA, client certificate, key, user and password are used, and
//! each missing or wrong one is a clear error rather than a hang or a silent
//! unauthenticated connection.

use std::time::Duration;

use iadeep_state::testing::{EtcdServer, EtcdServerTls, Pki};
use iadeep_state::{StateStore, StoreUrl, WatchEvent};

async fn open(url: &str) -> Result<std::sync::Arc<dyn StateStore>, String> {
    let parsed: StoreUrl = url.parse().map_err(|e| format!("{e}"))?;
    parsed.open().await.map_err(|e| e.to_string())
}

/// A put, a get, a watch and a lease: every kind of request the components make.
async fn round_trip(store: &dyn StateStore) {
    let mut watch = store.watch("/sec/", None).await.expect("watch");
    let lease = store
        .grant_lease(Duration::from_secs(5))
        .await
        .expect("lease");
    store
        .put("/sec/k", b"v".to_vec(), Some(lease))
        .await
        .expect("put");
    let kv = store.get("/sec/k").await.expect("get").expect("present");
    assert_eq!(kv.value, b"v");
    store.keep_alive(lease).await.expect("keep-alive");
    let event = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("event in time")
        .expect("open")
        .expect("event");
    assert!(matches!(event, WatchEvent::Put(kv) if kv.key == "/sec/k"));
    store.revoke_lease(lease).await.expect("revoke");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_uses_the_ca_and_client_certificate_of_the_url() {
    let pki = Pki::generate();
    let server = EtcdServer::start_with_tls(Some(EtcdServerTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        client_ca: Some(pki.ca.clone()),
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let endpoint = server.endpoint();
    let url = format!(
        "etcds://{endpoint}?ca={}&cert={}&key={}",
        pki.ca.display(),
        pki.client_cert.display(),
        pki.client_key.display()
    );
    let store = open(&url).await.expect("TLS with a client certificate");
    assert!(
        store.describe().starts_with("etcds://"),
        "{}",
        store.describe()
    );
    round_trip(store.as_ref()).await;

    // Each missing or wrong piece fails to connect, with an error naming the cluster.
    let other = Pki::generate();
    for (what, bad) in [
        (
            "no client certificate",
            format!("etcds://{endpoint}?ca={}", pki.ca.display()),
        ),
        (
            "a CA that did not sign the server",
            format!(
                "etcds://{endpoint}?ca={}&cert={}&key={}",
                other.ca.display(),
                pki.client_cert.display(),
                pki.client_key.display()
            ),
        ),
        ("plain text to a TLS port", format!("etcd://{endpoint}")),
    ] {
        let err = open(&bad).await.expect_err(what);
        assert!(
            err.contains(&endpoint) && err.contains("unreachable"),
            "{what}: {err}"
        );
    }
    let err = open(&format!(
        "etcds://{endpoint}?ca={}/missing.pem",
        pki.ca.display()
    ))
    .await
    .expect_err("unreadable CA");
    assert!(err.contains("cannot read the ca file"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_urls_user_and_password_authenticate_with_etcd() {
    let server = EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    server.enable_auth("s3cr:t@").await.expect("enable auth");
    let endpoint = server.endpoint();

    // The password is percent-encoded in the URL (':' and '@' are separators).
    let store = open(&format!("etcd://root:s3cr%3At%40@{endpoint}"))
        .await
        .expect("authenticated");
    round_trip(store.as_ref()).await;

    let err = open(&format!("etcd://root:wrong@{endpoint}"))
        .await
        .expect_err("wrong password");
    assert!(
        err.contains("authentication failed") && err.contains("\"root\""),
        "{err}"
    );

    // Without credentials, etcd refuses the requests themselves.
    let anonymous = open(&format!("etcd://{endpoint}")).await;
    let refused = match anonymous {
        Err(err) => err,
        Ok(store) => store
            .put("/sec/anon", vec![], None)
            .await
            .expect_err("unauthenticated put")
            .to_string(),
    };
    assert!(
        refused.contains("user name is empty") || refused.contains("permission denied"),
        "{refused}"
    );
}
