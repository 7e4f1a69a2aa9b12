//! The bounded training window: the newest samples plus a diverse reservoir.
//!
//! The trees have no partial fit, so every refit starts from scratch and
//! must be bounded. Keeping only the newest samples would forget rare pairings the
//! cluster saw long ago; keeping everything would make refits grow without bound.
//! The window therefore holds the `newest` most recent samples and, beside them, a
//! `reservoir` of older ones chosen as the `reservoir` samples with the smallest
//! content hash (a bottom-k sample). Unlike classic reservoir sampling this choice
//! does not depend on arrival order or on a random generator's state: the same set
//! of samples always gives the same reservoir, so a predictor rebuilt from the store
//! after a restart trains on the same window as the one that was running.

use std::collections::{BTreeMap, VecDeque};

/// Stable 64-bit hash of bytes (FNV-1a followed by a splitmix64 finaliser).
///
/// Stable across processes and Rust versions, unlike `DefaultHasher`.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A window of at most `newest + reservoir` items.
#[derive(Debug, Clone)]
pub struct Window<T> {
    newest_cap: usize,
    reservoir_cap: usize,
    newest: VecDeque<(u64, T)>,
    /// Keyed by (hash, arrival number) so equal hashes cannot overwrite each other.
    reservoir: BTreeMap<(u64, u64), T>,
    arrivals: u64,
}

impl<T: Clone> Window<T> {
    /// An empty window keeping `newest` recent items and a `reservoir` of older ones.
    pub fn new(newest: usize, reservoir: usize) -> Window<T> {
        Window {
            newest_cap: newest,
            reservoir_cap: reservoir,
            newest: VecDeque::with_capacity(newest + 1),
            reservoir: BTreeMap::new(),
            arrivals: 0,
        }
    }

    /// Adds `item` whose content hash is `hash`.
    pub fn push(&mut self, hash: u64, item: T) {
        self.newest.push_back((hash, item));
        while self.newest.len() > self.newest_cap {
            let Some((old_hash, old)) = self.newest.pop_front() else {
                break;
            };
            self.arrivals += 1;
            self.reservoir.insert((old_hash, self.arrivals), old);
            while self.reservoir.len() > self.reservoir_cap {
                self.reservoir.pop_last();
            }
        }
    }

    /// Number of items held.
    pub fn len(&self) -> usize {
        self.newest.len() + self.reservoir.len()
    }

    /// The items held: the reservoir in hash order, then the newest in arrival order.
    pub fn items(&self) -> Vec<T> {
        self.reservoir
            .values()
            .cloned()
            .chain(self.newest.iter().map(|(_, item)| item.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keeps_newest_and_smallest_hashes() {
        let mut w = Window::new(3, 2);
        for i in 0..10u64 {
            w.push(stable_hash(&i.to_le_bytes()), i);
        }
        assert_eq!(w.len(), 5);
        let items = w.items();
        assert_eq!(&items[2..], &[7, 8, 9]);
        let mut old: Vec<u64> = (0..7).collect();
        old.sort_by_key(|i| stable_hash(&i.to_le_bytes()));
        assert_eq!(&items[..2], &old[..2]);
    }

    #[test]
    fn hash_is_stable() {
        assert_eq!(stable_hash(b"iadeep"), stable_hash(b"iadeep"));
        assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
    }

    proptest! {
        #[test]
        fn never_exceeds_its_bounds(n in 0usize..200, newest in 1usize..20, res in 0usize..20) {
            let mut w = Window::new(newest, res);
            for i in 0..n {
                w.push(stable_hash(&i.to_le_bytes()), i);
                prop_assert!(w.len() <= newest + res);
            }
            prop_assert_eq!(w.len(), n.min(newest + res));
        }
    }
}
