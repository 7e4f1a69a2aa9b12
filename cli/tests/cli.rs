//! The `iadeep` binary as an operator runs it: real processes, a real file
//! store, a real etcd.

use std::process::{Command, Output};

use iadeep_state::testing::EtcdServer;

fn iadeep(store: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(args)
        .env("IADEEP_STORE", store)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// put, get, ls, watch --from-revision and del, against one backend.
fn round_trip(store: &str) {
    let key = "/iadeep/v1/devices/n1:gpu0/info";
    let put = iadeep(
        store,
        &[
            "state",
            "put",
            key,
            r#"{"device_id":"n1:gpu0","memory_mib":24576,"kind":"rtx3090"}"#,
        ],
    );
    assert!(put.status.success(), "{}", stderr(&put));
    assert!(stdout(&put).contains("at revision"), "{}", stdout(&put));

    let get = iadeep(store, &["state", "get", key]);
    assert!(get.status.success(), "{}", stderr(&get));
    let json: serde_json::Value = serde_json::from_str(&stdout(&get)).expect("get prints JSON");
    assert_eq!(
        json["memoryMib"], "24576",
        "protobuf JSON: 64-bit integers are strings"
    );
    assert_eq!(json["kind"], "rtx3090");

    let plain = iadeep(store, &["state", "put", "/ops/note", "hello operator"]);
    assert!(plain.status.success(), "{}", stderr(&plain));

    let ls = iadeep(store, &["state", "ls", "/iadeep/v1/"]);
    assert_eq!(stdout(&ls).lines().collect::<Vec<_>>(), [key]);
    let long = iadeep(store, &["state", "ls", "--long", "/ops/"]);
    assert_eq!(stdout(&long).trim(), "/ops/note hello operator");

    let watch = iadeep(
        store,
        &[
            "state",
            "watch",
            "/",
            "--from-revision",
            "1",
            "--count",
            "2",
        ],
    );
    assert!(watch.status.success(), "{}", stderr(&watch));
    let lines: Vec<String> = stdout(&watch).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].starts_with("PUT ") && lines[0].contains(key),
        "{lines:?}"
    );
    assert!(lines[1].contains("/ops/note hello operator"), "{lines:?}");

    let del = iadeep(store, &["state", "del", key]);
    assert_eq!(stdout(&del).trim(), format!("deleted {key}"));
    let missing = iadeep(store, &["state", "get", key]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing).contains("not found"),
        "{}",
        stderr(&missing)
    );
}

#[test]
fn state_commands_on_the_embedded_store() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("state.redb");
    round_trip(path.to_str().expect("utf-8 path"));
}

#[test]
fn state_commands_on_etcd() {
    let server = EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    round_trip(&server.url());
}

/// `state watch --from-revision` below what etcd keeps (the placer compacts every
/// `--compact-every`): the error names the oldest revision that works and the way to
/// watch from now, not only that the revision is too old.
#[test]
fn a_watch_from_compacted_history_says_where_history_starts_and_what_to_do() {
    let server = EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    let oldest = iadeep_state::testing::runtime().block_on(async {
        let store = iadeep_state::EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect");
        let mut revision = 0;
        for i in 0..3 {
            revision = iadeep_state::StateStore::put(&store, "/ops/n", vec![i], None)
                .await
                .expect("put");
        }
        iadeep_state::StateStore::compact(&store, revision)
            .await
            .expect("compact");
        revision
    });
    let watch = iadeep(
        &server.url(),
        &["state", "watch", "/ops/", "--from-revision", "1"],
    );
    assert!(!watch.status.success(), "{}", stdout(&watch));
    assert!(
        stderr(&watch).contains(&format!("--from-revision {oldest} or later"))
            && stderr(&watch).contains("without --from-revision the watch starts now"),
        "{}",
        stderr(&watch)
    );
}

/// `state ls` over more than one answer can carry: 1,100 keys of 10 KB (11 MB, where
/// gRPC refuses an answer over 4 MiB) list whole and in order, in pages (halved from
/// the default 500 keys, 5 MB, to fit).
#[test]
fn state_ls_lists_a_prefix_larger_than_one_grpc_answer() {
    let server = EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    let keys: Vec<String> = (0..1_100).map(|i| format!("/big/{i:05}")).collect();
    iadeep_state::testing::runtime().block_on(async {
        let store = iadeep_state::EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect");
        for chunk in keys.chunks(100) {
            let txn = chunk.iter().fold(iadeep_state::Txn::new(), |txn, key| {
                txn.put(key.as_str(), vec![b'x'; 10 * 1024], None)
            });
            let written = iadeep_state::StateStore::transact(&store, txn).await;
            assert!(written.expect("write").committed());
        }
    });
    let out = iadeep(&server.url(), &["state", "ls", "/big/"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: Vec<String> = stdout(&out).lines().map(str::to_owned).collect();
    assert_eq!(listed, keys);
}

#[test]
fn invalid_json_for_a_typed_key_is_refused_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("s.redb");
    let store = store.to_str().expect("utf-8");
    let key = "/iadeep/v1/tasks/job-1/spec";
    let out = iadeep(
        store,
        &["state", "put", key, r#"{"initial_batch_sise": 64}"#],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("TaskSpec"), "{}", stderr(&out));
    assert_eq!(iadeep(store, &["state", "get", key]).status.code(), Some(1));
}

#[test]
fn unreachable_etcd_and_unreadable_file_are_clear_errors() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    let out = iadeep(&format!("etcd://127.0.0.1:{port}"), &["state", "ls", "/"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("cannot reach etcd")
            && err.contains("refused")
            && err.contains(&port.to_string()),
        "{err}"
    );
    // Words, not a client library's Debug output.
    for debug in ["Error(", "ConnectError", "Os {", "kind:"] {
        assert!(!err.contains(debug), "{err}");
    }

    let dir = tempfile::tempdir().expect("temp dir");
    let garbage = dir.path().join("garbage.redb");
    std::fs::write(&garbage, b"definitely not a database").expect("write");
    let out = iadeep(garbage.to_str().expect("utf-8"), &["state", "ls", "/"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("garbage.redb"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let out = iadeep("etcd://nohostport", &["state", "ls", "/"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("HOST:PORT"), "{}", stderr(&out));
}

/// Logs in a pipe carry no colour codes; `--log-format json` writes one JSON object a line.
#[test]
fn logs_in_a_pipe_are_plain_and_json_on_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("s.redb");
    let store = store.to_str().expect("utf-8 path");
    // `state ls` is read-only and never creates a store: make one first.
    let put = iadeep(store, &["state", "put", "/example", "value"]);
    assert!(put.status.success(), "{}", stderr(&put));
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_iadeep"))
            .args(["state", "ls", "/", "--store", store])
            .args(extra)
            .env("RUST_LOG", "debug")
            .env_remove("NO_COLOR")
            .output()
            .expect("run iadeep")
    };
    let text = run(&[]);
    assert!(text.status.success(), "{}", stderr(&text));
    assert!(stderr(&text).contains("listed"), "{}", stderr(&text));
    assert!(!stderr(&text).contains('\u{1b}'), "{:?}", stderr(&text));
    let json = run(&["--log-format", "json"]);
    assert!(json.status.success(), "{}", stderr(&json));
    let lines: Vec<serde_json::Value> = stderr(&json)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["fields"]["message"] == "listed"),
        "{lines:?}"
    );
}

/// `iadeep state get BIG | head -c 1`: the reader leaves early, iadeep ends quietly.
#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("s.redb");
    let store = store.to_str().expect("utf-8 path");
    // More than a pipe holds, so the writes meet the closed end.
    let mut put = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["state", "put", "/ops/big", "-", "--store", store])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("run iadeep");
    {
        use std::io::Write;
        let mut stdin = put.stdin.take().expect("stdin");
        stdin
            .write_all("x".repeat(1 << 20).as_bytes())
            .expect("write the value");
    }
    assert!(put.wait().expect("wait").success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["state", "get", "/ops/big", "--store", store])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run iadeep");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

/// After `source cluster.env`, a mistake in `iadeep run` is answered with a usage line
/// that asks for what is missing only, not for the placer and store the environment gave
/// (clap names every argument it was given in its own usage line).
#[test]
fn run_usage_does_not_ask_for_what_the_environment_gave() {
    let out = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["run", "--", "true"])
        .env("IADEEP_PLACER", "127.0.0.1:9")
        .env("IADEEP_STORE", "etcd://127.0.0.1:9")
        .output()
        .expect("run iadeep");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--batch-size <M0>"), "{err}");
    let usage = err
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .unwrap_or_else(|| panic!("no usage line: {err}"));
    assert!(
        !usage.contains("--placer") && !usage.contains("--store"),
        "{usage}"
    );
}

/// A store that does not answer is refused before the placer is asked: a mistyped
/// `--store` would otherwise be placed and run untuned, its agent warning all its life.
#[test]
fn run_refuses_a_store_that_cannot_be_read() {
    let ports = iadeep_state::testing::free_ports(2).expect("free ports");
    let (store_port, placer_port) = (ports[0], ports[1]);
    let out = Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(["run", "--batch-size", "8", "--", "true"])
        .env("IADEEP_PLACER", format!("127.0.0.1:{placer_port}"))
        .env("IADEEP_STORE", format!("etcd://127.0.0.1:{store_port}"))
        .output()
        .expect("run iadeep");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("etcd://127.0.0.1:{store_port}")) && err.contains("cannot be read"),
        "{err}"
    );
    assert!(!err.contains("cannot reach the placer"), "{err}");
}
