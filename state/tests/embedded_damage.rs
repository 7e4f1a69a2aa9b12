//! The embedded store on damaged and foreign files: always an error, never a
//! panic, never a silent new store, and read-only opens never touch the file.

use std::path::Path;
use std::time::Duration;

use iadeep_state::testing::runtime;
use iadeep_state::{EmbeddedStore, StateError, StateStore, StoreUrl};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Trials of random damage; each copies the store and overwrites 16 random bytes.
const TRIALS: usize = 300;

/// A cleanly closed store with a few hundred keys and their history.
fn make_store(path: &Path) {
    let rt = runtime();
    let store = EmbeddedStore::open(path).expect("open");
    rt.block_on(async {
        for i in 0..300u32 {
            let key = format!("/iadeep/v1/tasks/t{i}/spec");
            store
                .put(
                    &key,
                    format!("value {i} {}", "x".repeat(64)).into_bytes(),
                    None,
                )
                .await
                .expect("put");
        }
        for i in 0..100u32 {
            store
                .delete(&format!("/iadeep/v1/tasks/t{i}/spec"))
                .await
                .expect("delete");
        }
    });
}

/// Everything a component does with a store, on a damaged file. Any error is
/// fine; the point is that it returns.
fn exercise(rt: &tokio::runtime::Runtime, path: &Path) -> &'static str {
    let store = match EmbeddedStore::open(path) {
        Ok(store) => store,
        // A damaged file (Embedded) or a damaged record met while dropping the
        // keys of ended leases (Corrupt): both name what is wrong.
        Err(StateError::Embedded { .. } | StateError::Corrupt { .. }) => return "refused at open",
        Err(other) => panic!("unexpected error kind at open: {other}"),
    };
    rt.block_on(async {
        let mut failed = false;
        match store.range("/").await {
            Ok(snapshot) => {
                for kv in snapshot.kvs.iter().take(50) {
                    failed |= store.get(&kv.key).await.is_err();
                }
            }
            Err(_) => failed = true,
        }
        failed |= store.put("/after", b"v".to_vec(), None).await.is_err();
        failed |= store.watch("/", Some(1)).await.is_err();
        let lease = store.grant_lease(Duration::from_secs(1)).await;
        if let Ok(lease) = lease {
            failed |= store.put("/leased", vec![], Some(lease)).await.is_err();
            failed |= store.revoke_lease(lease).await.is_err();
        }
        if failed {
            "opened, some calls failed"
        } else {
            "opened, every call answered"
        }
    })
}

#[test]
fn random_damage_is_an_error_never_a_panic() {
    let dir = tempfile::tempdir().expect("dir");
    let pristine = dir.path().join("pristine.redb");
    make_store(&pristine);
    let bytes = std::fs::read(&pristine).expect("read");
    let rt = runtime();
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let mut outcomes: std::collections::BTreeMap<&str, usize> = Default::default();
    for trial in 0..TRIALS {
        let mut damaged = bytes.clone();
        let at = rng.random_range(0..damaged.len() - 16);
        rng.fill(&mut damaged[at..at + 16]);
        let path = dir.path().join(format!("trial-{trial}.redb"));
        std::fs::write(&path, &damaged).expect("write");
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| exercise(&rt, &path)))
                .unwrap_or("PANICKED");
        *outcomes.entry(outcome).or_default() += 1;
        let _ = std::fs::remove_file(&path);
    }
    eprintln!(
        "{TRIALS} trials of 16 random bytes over a {} byte store: {outcomes:?}",
        bytes.len()
    );
    assert_eq!(outcomes.get("PANICKED"), None, "{outcomes:?}");
}

#[test]
fn empty_foreign_and_non_redb_files_are_refused_and_left_alone() {
    let dir = tempfile::tempdir().expect("dir");
    let empty = dir.path().join("empty.redb");
    std::fs::write(&empty, b"").expect("write");
    let text = dir.path().join("notes.redb");
    std::fs::write(&text, b"some operator notes, not a database\n").expect("write");
    let foreign = dir.path().join("foreign.redb");
    {
        let db = redb::Database::create(&foreign).expect("redb");
        let txn = db.begin_write().expect("txn");
        {
            let table: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("theirs");
            let mut t = txn.open_table(table).expect("table");
            t.insert("k", 1).expect("insert");
        }
        txn.commit().expect("commit");
    }
    for (path, needle) in [
        (&empty, "empty (0 bytes)"),
        (&text, "not a redb"),
        (&foreign, "not an iadeep store"),
        (&dir.path().to_path_buf(), "directory"),
    ] {
        let before = std::fs::read(path).ok();
        for read_only in [false, true] {
            let opened = if read_only {
                EmbeddedStore::open_read_only(path)
            } else {
                EmbeddedStore::open(path)
            };
            let err = opened.expect_err("refused").to_string();
            assert!(err.contains(needle), "{}: {err}", path.display());
        }
        assert!(
            std::fs::read(path).ok() == before,
            "{} changed",
            path.display()
        );
    }
}

#[test]
fn read_only_opens_never_create_or_modify_the_file() {
    let dir = tempfile::tempdir().expect("dir");
    let missing = dir.path().join("sub/missing.redb");
    let err = EmbeddedStore::open_read_only(&missing)
        .expect_err("nothing there")
        .to_string();
    assert!(err.contains("never create"), "{err}");
    assert!(!missing.exists() && !dir.path().join("sub").exists());

    let path = dir.path().join("state.redb");
    let rt = runtime();
    {
        let store = EmbeddedStore::open(&path).expect("open");
        rt.block_on(async {
            store.put("/a", b"1".to_vec(), None).await.expect("put");
            let lease = store
                .grant_lease(Duration::from_secs(60))
                .await
                .expect("lease");
            store
                .put("/leased", b"2".to_vec(), Some(lease))
                .await
                .expect("put");
        });
        // Dropped without revoking, as a killed process would leave it.
    }
    // Dropping the last handle closed the file cleanly: a read-only open (which
    // cannot repair) works at once.
    let before = std::fs::read(&path).expect("read");
    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
    let url: StoreUrl = path.display().to_string().parse().expect("url");
    rt.block_on(async {
        let store = url.open_read_only().await.expect("read-only open");
        let snapshot = store.range("/").await.expect("range");
        // The dead process's leased key is not shown, as a read-write open would drop it.
        let keys: Vec<&str> = snapshot.kvs.iter().map(|kv| kv.key.as_str()).collect();
        assert_eq!(keys, ["/a"]);
        assert!(store.get("/leased").await.expect("get").is_none());
        let err = store.put("/b", vec![], None).await.expect_err("read-only");
        assert!(err.to_string().contains("read-only"), "{err}");
    });
    assert!(
        std::fs::read(&path).expect("read") == before,
        "the file changed"
    );
    assert_eq!(
        std::fs::metadata(&path).and_then(|m| m.modified()).ok(),
        modified
    );
}
