//! The etcd backend against a real etcd server started by the test: the shared
//! conformance suite, plus what only a networked store has (restarts of the
//! server, unreachable endpoints).

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use iadeep_state::testing::conformance::next_event;
use iadeep_state::testing::start_etcd;
use iadeep_state::{EtcdStore, StateError, StateStore, StoreUrl, WatchEvent};

async fn fresh() -> (Arc<dyn StateStore>, Box<dyn Any + Send>) {
    let server = start_etcd();
    let store = EtcdStore::connect(&[server.endpoint()])
        .await
        .expect("connect");
    (Arc::new(store), Box::new(server))
}

mod conformance {
    use super::fresh;
    iadeep_state::conformance_tests!(fresh);
}

/// Proves the suite ran against a real server, and says which one.
#[tokio::test]
async fn talks_to_a_real_etcd_server() {
    let server = start_etcd();
    let store = EtcdStore::connect(&[server.endpoint()])
        .await
        .expect("connect");
    let version = store.server_version().await.expect("version");
    println!(
        "etcd conformance tests ran against etcd server version {version} at {}",
        server.url()
    );
    assert!(
        version.starts_with('3'),
        "unexpected etcd version {version}"
    );
    // The daemons' start-up warning is for clusters of several members: with one there
    // is no other leader to keep leases alive (state/tests/etcd_failover.rs checks three).
    assert_eq!(store.lease_bug_warning().await, None);
}

/// Fault: a watch interrupted by an etcd restart resumes from its last revision
/// without losing or duplicating an event, including events written while the
/// watch was still reconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_survives_an_etcd_restart_without_loss_or_duplicates() {
    let mut server = start_etcd();
    let store = EtcdStore::connect(&[server.endpoint()])
        .await
        .expect("connect");
    let mut watch = store.watch("/restart/", None).await.expect("watch");
    store.put("/restart/0", vec![0], None).await.expect("put");
    store.put("/restart/1", vec![1], None).await.expect("put");
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(next_event(&mut watch).await);
    }

    server.restart().expect("restart etcd");
    // Write right away: the watch is still reconnecting and must pick these up
    // from its resume revision.
    let mut written = 2u8;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while written < 6 {
        match store
            .put(&format!("/restart/{written}"), vec![written], None)
            .await
        {
            Ok(_) => written += 1,
            Err(err) if std::time::Instant::now() < deadline => {
                // The client reconnects lazily; the first calls may fail.
                tracing_free_log(&err);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("etcd did not come back: {err}"),
        }
    }
    while seen.len() < 6 {
        seen.push(next_event(&mut watch).await);
    }
    let keys: Vec<String> = seen.iter().map(|e| e.key().to_owned()).collect();
    let expected: Vec<String> = (0..6).map(|i| format!("/restart/{i}")).collect();
    assert_eq!(keys, expected, "every event exactly once, in order");
    assert!(seen.windows(2).all(|w| w[0].revision() < w[1].revision()));
    assert!(seen.iter().all(|e| matches!(e, WatchEvent::Put(_))));
    // And nothing extra arrives afterwards.
    iadeep_state::testing::conformance::assert_no_event_before_marker(
        &store,
        &mut watch,
        "/restart/marker",
    )
    .await;
}

fn tracing_free_log(err: &StateError) {
    eprintln!("(while etcd restarts) {err}");
}

/// An unreachable cluster is reported promptly, naming the endpoint.
#[tokio::test]
async fn unreachable_etcd_is_a_clear_error() {
    // A port nobody listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    let url: StoreUrl = format!("etcd://127.0.0.1:{port}").parse().expect("url");
    let started = std::time::Instant::now();
    let err = url.open().await.expect_err("nothing listens there");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    assert!(matches!(err, StateError::Unavailable { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.contains("unreachable"), "{text}");
}
