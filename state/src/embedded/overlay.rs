//! A redb storage backend over a file that it never writes: reads come from the file,
//! writes stay in memory.
//!
//! Why: redb reads a file that was not closed cleanly (its process was killed, or the
//! disk filled mid-commit) only after repairing it, and the repair writes. A read-only
//! command (`iadeep state get/ls/watch`) must neither change the store nor depend on
//! being able to write it: on a full disk the repair itself fails, so the store could
//! not be read at all exactly when an operator most needs to look at it. Through this
//! backend redb repairs its view of the file in memory, and the file stays as it was
//! (the next read-write open repairs it for real). Memory holds only the blocks the
//! repair rewrote, not the file.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::sync::{Mutex, MutexGuard};

/// Unit in which written bytes are kept: redb's page size.
const BLOCK: u64 = 4096;

/// A file seen through an in-memory layer of writes (see the module documentation).
pub(super) struct CopyOnWrite {
    state: Mutex<State>,
}

struct State {
    file: File,
    /// How much of the file still shows through: a shrink hides what lies beyond it,
    /// so that growing again reads zeros there, as redb's backends must.
    visible: u64,
    /// The length redb sees.
    len: u64,
    /// Block index → the block's bytes as written (each `BLOCK` long).
    written: BTreeMap<u64, Box<[u8]>>,
}

impl std::fmt::Debug for CopyOnWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("CopyOnWrite")
            .field("len", &state.len)
            .field("blocks_written", &state.written.len())
            .finish()
    }
}

impl CopyOnWrite {
    /// A layer over `file`, which is only ever read.
    pub(super) fn new(file: File) -> io::Result<CopyOnWrite> {
        let len = file.metadata()?.len();
        Ok(CopyOnWrite {
            state: Mutex::new(State {
                file,
                visible: len,
                len,
                written: BTreeMap::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is consistent between calls: a panic while holding the lock (a
        // failed read) leaves nothing half-changed.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// Reads the file's bytes at `start` into `out` as the file shows them (zeros past
    /// what is visible), ignoring what was written.
    fn read_file(&mut self, start: u64, out: &mut [u8]) -> io::Result<()> {
        let from_file = usize::try_from(self.visible.saturating_sub(start))
            .unwrap_or(usize::MAX)
            .min(out.len());
        let (head, tail) = out.split_at_mut(from_file);
        if !head.is_empty() {
            self.file.seek(SeekFrom::Start(start))?;
            self.file.read_exact(head)?;
        }
        tail.fill(0);
        Ok(())
    }

    /// Calls `each(block index, offset in block, range in the caller's buffer)` for
    /// every block that `[offset, offset + len)` touches.
    fn spans(offset: u64, len: usize, mut each: impl FnMut(u64, usize, std::ops::Range<usize>)) {
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            let in_block = (pos % BLOCK) as usize;
            let n = (BLOCK as usize - in_block).min(len - done);
            each(pos / BLOCK, in_block, done..done + n);
            done += n;
        }
    }
}

fn out_of_range(offset: u64, len: usize, size: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("read of {len} bytes at {offset} past the end ({size})"),
    )
}

impl redb::StorageBackend for CopyOnWrite {
    fn len(&self) -> io::Result<u64> {
        Ok(self.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let mut state = self.lock();
        let end = offset.checked_add(out.len() as u64);
        if end.is_none_or(|end| end > state.len) {
            return Err(out_of_range(offset, out.len(), state.len));
        }
        let mut result = Ok(());
        State::spans(offset, out.len(), |block, in_block, range| {
            if result.is_err() {
                return;
            }
            let n = range.len();
            match state.written.get(&block) {
                Some(bytes) => out[range].copy_from_slice(&bytes[in_block..in_block + n]),
                None => result = state.read_file(block * BLOCK + in_block as u64, &mut out[range]),
            }
        });
        result
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut state = self.lock();
        if len < state.len {
            state.visible = state.visible.min(len);
            state.written.retain(|&block, _| block * BLOCK < len);
            let cut = (len % BLOCK) as usize;
            if let Some(bytes) = state.written.get_mut(&(len / BLOCK)) {
                bytes[cut..].fill(0);
            }
        }
        state.len = len;
        Ok(())
    }

    /// Nothing to make durable: the written blocks live and die with this process.
    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut state = self.lock();
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| out_of_range(offset, data.len(), u64::MAX))?;
        state.len = state.len.max(end);
        let mut result = Ok(());
        State::spans(offset, data.len(), |block, in_block, range| {
            if result.is_err() {
                return;
            }
            if !state.written.contains_key(&block) {
                let mut bytes = vec![0u8; BLOCK as usize].into_boxed_slice();
                if let Err(e) = state.read_file(block * BLOCK, &mut bytes) {
                    result = Err(e);
                    return;
                }
                state.written.insert(block, bytes);
            }
            if let Some(bytes) = state.written.get_mut(&block) {
                bytes[in_block..in_block + range.len()].copy_from_slice(&data[range]);
            }
        });
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::StorageBackend;

    #[test]
    fn writes_are_read_back_and_never_reach_the_file() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        let original: Vec<u8> = (0..3 * BLOCK + 100).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &original).expect("write");
        let layer = CopyOnWrite::new(File::open(&path).expect("open")).expect("layer");
        // A write across a block boundary, and one past the end.
        layer.write(BLOCK - 2, &[7; 4]).expect("write");
        let end = original.len() as u64;
        layer.write(end + 10, &[9; 3]).expect("write past the end");
        assert_eq!(layer.len().expect("len"), end + 13);
        let mut expected = original.clone();
        expected[(BLOCK - 2) as usize..(BLOCK + 2) as usize].fill(7);
        expected.extend_from_slice(&[0; 10]);
        expected.extend_from_slice(&[9; 3]);
        let mut seen = vec![0u8; expected.len()];
        layer.read(0, &mut seen).expect("read");
        assert_eq!(seen, expected);
        let mut one = [0u8; 1];
        assert!(layer.read(end + 13, &mut one).is_err(), "past the end");
        // Shrinking, then growing, shows zeros where the file's bytes were.
        layer.set_len(BLOCK + 1).expect("shrink");
        layer.set_len(3 * BLOCK).expect("grow");
        let mut seen = vec![1u8; (3 * BLOCK) as usize];
        layer.read(0, &mut seen).expect("read");
        assert_eq!(seen[..=BLOCK as usize], expected[..=BLOCK as usize]);
        assert!(seen[BLOCK as usize + 1..].iter().all(|&b| b == 0));
        assert_eq!(std::fs::read(&path).expect("read file"), original);
    }
}

#[cfg(test)]
mod store_tests {
    use crate::{EmbeddedStore, StateStore};
    use std::time::Duration;

    /// What a killed process leaves: the file as it is on disk while its writer still
    /// holds it (redb marks an open file as needing recovery until it is closed).
    #[test]
    fn a_store_not_closed_cleanly_is_read_without_writing_it() {
        let dir = tempfile::tempdir().expect("dir");
        let live = dir.path().join("live.redb");
        let crashed = dir.path().join("crashed.redb");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let store = EmbeddedStore::open(&live).expect("open");
        rt.block_on(async {
            for i in 0..50 {
                let key = format!("/k/{i:03}");
                store.put(&key, vec![b'v'; 100], None).await.expect("put");
            }
            let lease = store
                .grant_lease(Duration::from_secs(60))
                .await
                .expect("lease");
            store
                .put("/leased", b"x".to_vec(), Some(lease))
                .await
                .expect("put");
        });
        std::fs::copy(&live, &crashed).expect("copy the open file");
        drop(store);
        assert!(
            matches!(
                redb::ReadOnlyDatabase::open(&crashed),
                Err(redb::DatabaseError::RepairAborted)
            ),
            "the copy should need a repair, or this test tests nothing"
        );
        let before = std::fs::read(&crashed).expect("read");
        let store = EmbeddedStore::open_read_only(&crashed).expect("read-only open");
        assert!(store.is_read_only());
        rt.block_on(async {
            let snapshot = store.range("/").await.expect("range");
            let keys: Vec<&str> = snapshot.kvs.iter().map(|kv| kv.key.as_str()).collect();
            // Every key, the dead process's leased one hidden as a read-write open drops it.
            assert_eq!(keys.len(), 50, "{keys:?}");
            assert_eq!(keys[0], "/k/000");
            let kv = store.get("/k/049").await.expect("get").expect("kept");
            assert_eq!(kv.value, vec![b'v'; 100]);
            let err = store.put("/b", vec![], None).await.expect_err("read-only");
            assert!(err.to_string().contains("read-only"), "{err}");
        });
        drop(store);
        assert!(
            std::fs::read(&crashed).expect("read") == before,
            "the file changed"
        );
        // A read-write open still repairs it for real, and finds the same keys.
        let store = EmbeddedStore::open(&crashed).expect("repairing open");
        let n = rt.block_on(store.range("/k/")).expect("range").kvs.len();
        assert_eq!(n, 50);
    }
}
