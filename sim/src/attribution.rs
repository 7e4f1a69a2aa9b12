//! The gap between `iadeep` and the `oracle` attributed to iadeep's learned parts: how
//! much of it each single-part oracle (`oracle-prediction`, `oracle-memory`,
//! `oracle-tuning`, `oracle-wait`, see `policy::iadeep::Oracle`) closes on its own.
//!
//! The parts interact (a better prediction places differently, which changes what the
//! tuners face), so the shares need not add up to the whole; a share above 100 % is a part
//! whose truth alone beats the oracle, a negative one a part whose truth alone makes
//! things worse.

use std::fmt::Write as _;

use serde::Serialize;

use crate::metrics::Summary;
use crate::policy::iadeep::Oracle;

/// One single-part oracle against the gap.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GapShare {
    pub policy: String,
    pub avg_ct_s: f64,
    /// `(iadeep − this) / (iadeep − oracle)` in average completion time; `None` when
    /// iadeep is not slower than the oracle (no gap to share).
    pub closed: Option<f64>,
}

/// The attribution of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Attribution {
    pub iadeep_avg_ct_s: f64,
    pub oracle_avg_ct_s: f64,
    /// The single-part oracles that ran, in table order.
    pub parts: Vec<GapShare>,
}

impl Attribution {
    /// From a run's summaries: `None` unless `iadeep`, `oracle` and at least one
    /// single-part oracle ran.
    pub fn of(summaries: &[Summary]) -> Option<Attribution> {
        let ct = |name: &str| {
            summaries
                .iter()
                .find(|s| s.policy == name)
                .map(|s| s.avg_ct_s)
        };
        let (iadeep, oracle) = (ct("iadeep")?, ct(Oracle::All.name())?);
        let gap = iadeep - oracle;
        let parts: Vec<GapShare> = Oracle::ALL
            .into_iter()
            .filter(|o| *o != Oracle::All)
            .filter_map(|o| {
                let avg_ct_s = ct(o.name())?;
                Some(GapShare {
                    policy: o.name().to_owned(),
                    avg_ct_s,
                    closed: (gap > 0.0).then(|| (iadeep - avg_ct_s) / gap),
                })
            })
            .collect();
        (!parts.is_empty()).then_some(Attribution {
            iadeep_avg_ct_s: iadeep,
            oracle_avg_ct_s: oracle,
            parts,
        })
    }

    /// Lines for the terminal, after the table.
    pub fn text(&self) -> String {
        let mut out = format!(
            "Gap attributed: iadeep {:.2} h, oracle {:.2} h ({:+.1} %); the truth for one part \
             alone closes of that gap:",
            self.iadeep_avg_ct_s / 3600.0,
            self.oracle_avg_ct_s / 3600.0,
            100.0 * (self.iadeep_avg_ct_s / self.oracle_avg_ct_s - 1.0)
        );
        for p in &self.parts {
            let closed = p
                .closed
                .map_or("no gap".to_owned(), |c| format!("{:+.0} %", 100.0 * c));
            let _ = write!(
                out,
                "\n  {:<18} {:>6.2} h  {closed}",
                p.policy,
                p.avg_ct_s / 3600.0
            );
        }
        out
    }

    /// The `--json` object's `gap_closed`: `{"oracle-prediction": 0.31, ...}` (`null`
    /// where there is no gap).
    pub fn json(&self) -> serde_json::Value {
        self.parts
            .iter()
            .map(|p| (p.policy.clone(), serde_json::json!(p.closed)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(policy: &str, avg_ct_h: f64) -> Summary {
        Summary {
            policy: policy.to_owned(),
            tasks: 1,
            avg_ct_s: avg_ct_h * 3600.0,
            p50_ct_s: 0.0,
            p99_ct_s: 0.0,
            makespan_s: 0.0,
            ooms: 0,
            fenced_ooms: 0,
            avg_util: 0.0,
            avg_work_rate: 0.0,
            tuning_rounds: 0,
            batch_changes: 0,
            decision_latency_us: 0.0,
            decision_latency_p99_us: 0.0,
            tune_latency_us: 0.0,
            classes: Default::default(),
        }
    }

    #[test]
    fn each_part_closes_its_share_of_the_gap() {
        let runs = [
            summary("exclusive", 9.0),
            summary("iadeep", 5.0),
            summary("oracle", 4.0),
            summary("oracle-prediction", 4.75),
            summary("oracle-wait", 5.5),
            summary("oracle-tuning", 3.5),
        ];
        let a = Attribution::of(&runs).expect("an attribution");
        let closed: Vec<(&str, Option<f64>)> = a
            .parts
            .iter()
            .map(|p| (p.policy.as_str(), p.closed))
            .collect();
        // Table order, only those that ran.
        assert_eq!(
            closed,
            [
                ("oracle-prediction", Some(0.25)),
                ("oracle-tuning", Some(1.5)),
                ("oracle-wait", Some(-0.5)),
            ]
        );
        assert_eq!(a.json()["oracle-prediction"], serde_json::json!(0.25));
        assert!(
            a.text().contains("oracle-wait          5.50 h  -50 %"),
            "{}",
            a.text()
        );
        // No gap: nothing to share.
        let even = [
            summary("iadeep", 4.0),
            summary("oracle", 4.0),
            summary("oracle-memory", 4.5),
        ];
        let a = Attribution::of(&even).expect("an attribution");
        assert_eq!(a.parts[0].closed, None);
        assert_eq!(a.json()["oracle-memory"], serde_json::Value::Null);
        // Without the oracle, or without any single-part oracle, there is nothing to say.
        assert_eq!(Attribution::of(&runs[..2]), None);
        assert_eq!(Attribution::of(&runs[..3]), None);
    }
}
