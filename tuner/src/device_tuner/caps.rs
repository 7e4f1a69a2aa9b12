//! The slowdown caps of the device's production jobs, as measured round after round: when
//! a job is above its cap, when a breach is to be reported, and when it is over (see the
//! module documentation of `device_tuner`, "Slowdown caps").

/// What the tuner knows of one production resident's cap.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct CapWatch {
    /// Its PD in the last measured round was above its cap (cleared when the residents
    /// change: the next round measures the new co-location).
    pub above: bool,
    /// Consecutive measured rounds above the cap with every one of `floor_set` at its
    /// smallest size.
    pub rounds_at_floor: u32,
    /// The opportunistic co-runners of the current streak, sorted.
    pub floor_set: Vec<String>,
    /// The co-runners named by the breach reported since the residents last changed: a
    /// breach is reported once, and again only for another set of co-runners (one was
    /// evicted and the job is still above its cap) or after the residents changed (the
    /// placer may have dropped the record while another job was leaving).
    pub breached: Option<Vec<String>>,
    /// A breach was reported and its end was not: [`Verdict::Restored`] is owed.
    pub reported: bool,
}

/// What one measured round means for the cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Nothing,
    /// Report a breach over the streak's co-runners.
    Breach,
    /// The reported breach is over.
    Restored,
}

impl CapWatch {
    /// Takes in one measured round: the job's `pd` against its `cap`; `at_floor` names the
    /// opportunistic co-runners (sorted) when every one of them ran at its smallest size
    /// and there is at least one, `None` otherwise (shrinking can still help, or there is
    /// no one to evict).
    pub fn measured(
        &mut self,
        pd: f64,
        cap: f64,
        at_floor: Option<Vec<String>>,
        breach_rounds: u32,
    ) -> Verdict {
        if pd <= cap {
            self.above = false;
            self.rounds_at_floor = 0;
            self.floor_set.clear();
            self.breached = None;
            return if std::mem::take(&mut self.reported) {
                Verdict::Restored
            } else {
                Verdict::Nothing
            };
        }
        self.above = true;
        match at_floor {
            Some(set) if set == self.floor_set => self.rounds_at_floor += 1,
            Some(set) => {
                self.floor_set = set;
                self.rounds_at_floor = 1;
            }
            None => {
                self.floor_set.clear();
                self.rounds_at_floor = 0;
            }
        }
        if self.rounds_at_floor >= breach_rounds && self.breached.as_ref() != Some(&self.floor_set)
        {
            self.breached = Some(self.floor_set.clone());
            self.reported = true;
            return Verdict::Breach;
        }
        Verdict::Nothing
    }

    /// The residents changed: the streak ends (what was measured described another
    /// co-location) and a breach may be reported again; a reported breach is owed its end
    /// until the job is measured under its cap or leaves.
    pub fn residents_changed(&mut self) {
        self.above = false;
        self.rounds_at_floor = 0;
        self.floor_set.clear();
        self.breached = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[&str]) -> Option<Vec<String>> {
        Some(ids.iter().map(|s| (*s).to_owned()).collect())
    }

    #[test]
    fn a_breach_is_reported_once_per_set_of_co_runners_and_ends_under_the_cap() {
        let mut w = CapWatch::default();
        // Above, but a co-runner can still shrink: no streak.
        assert_eq!(w.measured(1.3, 1.1, None, 3), Verdict::Nothing);
        assert!(w.above);
        assert_eq!(
            w.measured(1.3, 1.1, set(&["o1", "o2"]), 3),
            Verdict::Nothing
        );
        assert_eq!(
            w.measured(1.3, 1.1, set(&["o1", "o2"]), 3),
            Verdict::Nothing
        );
        assert_eq!(w.measured(1.3, 1.1, set(&["o1", "o2"]), 3), Verdict::Breach);
        assert_eq!(
            w.measured(1.3, 1.1, set(&["o1", "o2"]), 3),
            Verdict::Nothing
        );
        // o1 evicted and gone: a new streak, a new breach.
        assert_eq!(w.measured(1.2, 1.1, set(&["o2"]), 3), Verdict::Nothing);
        assert_eq!(w.measured(1.2, 1.1, set(&["o2"]), 3), Verdict::Nothing);
        assert_eq!(w.measured(1.2, 1.1, set(&["o2"]), 3), Verdict::Breach);
        // Another job left (the placer dropped the record meanwhile): reported again,
        // after a new streak.
        w.residents_changed();
        assert!(!w.above);
        assert_eq!(w.measured(1.2, 1.1, set(&["o2"]), 3), Verdict::Nothing);
        assert_eq!(w.measured(1.2, 1.1, set(&["o2"]), 3), Verdict::Nothing);
        assert_eq!(w.measured(1.2, 1.1, set(&["o2"]), 3), Verdict::Breach);
        // Exactly at the cap is not above it; the end is reported once.
        assert_eq!(w.measured(1.1, 1.1, set(&["o2"]), 3), Verdict::Restored);
        assert!(!w.above);
        assert_eq!(w.measured(1.0, 1.1, set(&["o2"]), 3), Verdict::Nothing);
        // A change of residents does not forget a breach's end.
        for _ in 0..3 {
            w.measured(1.2, 1.1, set(&["o2"]), 3);
        }
        w.residents_changed();
        assert_eq!(w.measured(1.0, 1.1, None, 3), Verdict::Restored);
    }
}
