//! The human-readable texts: why a device was rejected, and the explanation that
//! comes with every decision.
use std::fmt;

use iadeep_proto::{CandidateScore, Explanation};

use super::{Assessment, Placer, Rejection, Verdict};

impl fmt::Display for Rejection {
    /// long: one match with a text per rejection variant; split up, the texts
    /// would only be scattered away from the variants they describe.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::UnknownDevice => f.write_str("unknown device"),
            Rejection::NotRegistered => {
                f.write_str("device not registered (its tuner is not running)")
            }
            Rejection::UnknownTaskMemory => f.write_str(
                "the task's memory is unknown (no request, profile or registry entry) and a \
                 resident's is not measured yet; asked again once it reports its peak",
            ),
            Rejection::Memory { need_mib, free_mib } => write!(
                f,
                "memory: the task needs {need_mib} MiB, {free_mib} MiB are free after the margin"
            ),
            Rejection::TooLarge {
                need_mib,
                usable_mib,
            } => write!(
                f,
                "never fits: the task needs {need_mib} MiB at the batch size it starts at, \
                 more than the {usable_mib} MiB this GPU has even when empty"
            ),
            Rejection::SmCap {
                predicted_pct,
                cap_pct,
            } => write!(
                f,
                "predicted SM utilisation {predicted_pct:.0}% is over the cap of {cap_pct:.0}%"
            ),
            Rejection::MemBwCap {
                predicted_pct,
                cap_pct,
            } => write!(
                f,
                "predicted memory-bandwidth utilisation {predicted_pct:.0}% is over the cap of {cap_pct:.0}%"
            ),
            Rejection::PdCap { predicted, cap } => write!(
                f,
                "predicted increase of the device's summed PD {predicted:.2} is over the cap of {cap:.2}"
            ),
            Rejection::ThroughputGain {
                before,
                after,
                min_gain,
            } => {
                // As many decimals as it takes to show the gain below the minimum.
                let gain = after - before;
                let d = separating_decimals(gain, *min_gain, 2);
                write!(
                    f,
                    "sharing gains too little: predicted combined normalised throughput \
                     {before:.d$} → {after:.d$}, a gain of {gain:.d$}, less than the \
                     required {min_gain:.d$} (the task would do its work sooner later, alone)"
                )
            }
            Rejection::SlowdownCap {
                task_id,
                newcomer,
                predicted_upper,
                cap,
            } => {
                // As many decimals as it takes to show the prediction above the cap.
                let d = separating_decimals(*cap, *predicted_upper, 2);
                let whose = if *newcomer {
                    format!("the task's own (production job {task_id})")
                } else {
                    format!("production job {task_id}'s")
                };
                write!(
                    f,
                    "slowdown cap: with the task here, {whose} predicted slowdown could reach \
                     {predicted_upper:.d$} (upper end of the 90 % interval), over its cap of {cap:.d$}"
                )
            }
            Rejection::Avoided { task_id } => write!(
                f,
                "avoided pairing: the task must not share a GPU with {task_id} for a while \
                 (one of the two was evicted to protect the other)"
            ),
            Rejection::Claimed {
                task_id,
                claimed_mib,
                until_unix_ms,
            } => write!(
                f,
                "claimed: {claimed_mib} MiB are held for production task {task_id}, which evicted \
                 jobs to make room here; the GPU takes no other task until {task_id} is placed \
                 or its claim expires (at {until_unix_ms} Unix ms), so that nothing joining it \
                 can push {task_id} over its slowdown cap and make it evict again"
            ),
        }
    }
}

impl Placer {
    pub(super) fn explain(&self, assessment: &Assessment<'_>, verdict: &Verdict) -> Explanation {
        let k = self.params.explain_top_k;
        let mut candidates: Vec<CandidateScore> = assessment
            .candidates
            .iter()
            .take(k)
            .map(|c| CandidateScore {
                device_id: c.device_id.to_owned(),
                predicted_pd_increase: c.pd_increase,
                uncertainty: c.uncertainty,
                feasible: true,
                rejected_because: String::new(),
            })
            .collect();
        candidates.extend(
            assessment
                .rejected
                .iter()
                .take(k)
                .map(|(id, why)| CandidateScore {
                    device_id: (*id).to_owned(),
                    predicted_pd_increase: 0.0,
                    uncertainty: 0.0,
                    feasible: false,
                    rejected_because: why.to_string(),
                }),
        );
        let head = match verdict {
            Verdict::Place { device_id, .. } => {
                let best = assessment.candidates.first();
                format!(
                    "placed on {device_id}: predicted summed PD +{:.2} (±{:.2}); {}",
                    best.map_or(0.0, |c| c.pd_increase),
                    best.map_or(0.0, |c| c.uncertainty),
                    waiting_ahead_text(assessment.waiting_ahead)
                )
            }
            Verdict::Queue {
                retry_after,
                reason,
            } => {
                format!("queued, retry after {} s: {reason}", retry_after.as_secs())
            }
            Verdict::Evict {
                retry_after,
                reason,
                ..
            } => format!(
                "queued while room is made, retry after {} s: {reason}",
                retry_after.as_secs()
            ),
        };
        let rejected = if assessment.rejected.is_empty() {
            "none rejected".to_owned()
        } else {
            format!(
                "{} rejected ({})",
                assessment.rejected.len(),
                rejection_counts(&assessment.rejected)
            )
        };
        let unscored = if assessment.unscored > 0 {
            format!(
                " ({} more feasible shared devices not scored: busier than the {} scored)",
                assessment.unscored, self.params.max_scored_devices
            )
        } else {
            String::new()
        };
        Explanation {
            summary: format!(
                "{head}; {} feasible{unscored}, {rejected}",
                assessment.candidates.len()
            ),
            candidates,
        }
    }
}

/// The fewest decimals, at least `min` and at most 12, with which `smaller` prints
/// below `larger`: a text that says one figure is less than another must show it so
/// (a gain of −0.001 against a minimum of 0 printed with two decimals read "1.67 →
/// 1.67, less than the required gain of 0.00").
pub(super) fn separating_decimals(smaller: f64, larger: f64, min: usize) -> usize {
    let rounded = |x: f64, d: usize| format!("{x:.d$}").parse::<f64>().unwrap_or(x);
    (min..=12)
        .find(|&d| rounded(smaller, d) < rounded(larger, d))
        .unwrap_or(12)
}

/// "no task waits ahead", "1 task waits ahead", "3 tasks wait ahead".
pub(super) fn waiting_ahead_text(ahead: usize) -> String {
    match ahead {
        0 => "no task waits ahead".to_owned(),
        1 => "1 task waits ahead".to_owned(),
        n => format!("{n} tasks wait ahead"),
    }
}

/// "1st", "2nd", "3rd", "4th", … "11th", "21st".
pub(super) fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// Which production job's slowdown cap refused which device, for a queue reason: "d0
/// (production job r1 up to 1.32 > cap 1.10), d3 (…)", at most `k` devices (and how
/// many more); `None` when no cap refused any.
pub(super) fn cap_refusals_text(rejected: &[(&str, Rejection)], k: usize) -> Option<String> {
    let refusals: Vec<String> = rejected
        .iter()
        .filter_map(|(device, why)| match why {
            Rejection::SlowdownCap {
                task_id,
                newcomer,
                predicted_upper,
                cap,
            } => {
                let d = separating_decimals(*cap, *predicted_upper, 2);
                let whose = if *newcomer { "the task itself, " } else { "" };
                Some(format!(
                    "{device} ({whose}production job {task_id} up to {predicted_upper:.d$} > cap {cap:.d$})"
                ))
            }
            _ => None,
        })
        .collect();
    if refusals.is_empty() {
        return None;
    }
    let more = refusals.len().saturating_sub(k.max(1));
    let mut text = refusals
        .into_iter()
        .take(k.max(1))
        .collect::<Vec<_>>()
        .join(", ");
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    Some(format!("slowdown caps refused {text}"))
}

/// How many devices a production job's slowdown cap refused (the
/// [`crate::PlacementEvent::CapRefusal`] count, one per device).
pub fn cap_refusals(rejected: &[(&str, Rejection)]) -> usize {
    rejected
        .iter()
        .filter(|(_, why)| matches!(why, Rejection::SlowdownCap { .. }))
        .count()
}

/// "memory: 12, sm_cap: 3", in a stable order.
pub(super) fn rejection_counts(rejected: &[(&str, Rejection)]) -> String {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for (_, why) in rejected {
        match counts.iter_mut().find(|(k, _)| *k == why.kind()) {
            Some((_, n)) => *n += 1,
            None => counts.push((why.kind(), 1)),
        }
    }
    counts.sort();
    counts
        .iter()
        .map(|(k, n)| format!("{k}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every number in `text` that follows `after` (up to the next space or comma).
    fn number_after(text: &str, after: &str) -> f64 {
        let rest = &text[text.find(after).expect(after) + after.len()..];
        let end = rest.find([' ', ',', ')']).unwrap_or(rest.len());
        rest[..end].parse().expect("a number")
    }

    /// Issue 26: "predicted combined normalised throughput 1.67 → 1.67, less than the
    /// required gain of 0.00". The rejection text must show the gain below the minimum
    /// and be the difference of the two throughputs it prints.
    #[test]
    fn a_throughput_rejection_shows_a_gain_below_the_minimum() {
        for (before, after, min_gain) in [
            (1.6712, 1.6698, 0.0),
            (1.0, 1.0999, 0.1),
            (2.0, 1.5, 0.1),
            (1.0, 1.0 - 1e-9, 0.0),
        ] {
            let text = Rejection::ThroughputGain {
                before,
                after,
                min_gain,
            }
            .to_string();
            let gain = number_after(&text, "a gain of ");
            let required = number_after(&text, "less than the required ");
            assert!(gain < required, "{text}");
            let shown_before = number_after(&text, "throughput ");
            let shown_after = number_after(&text, "→ ");
            assert!(shown_after <= shown_before + required, "{text}");
        }
    }

    #[test]
    fn separating_decimals_are_the_fewest_that_order_the_figures() {
        assert_eq!(separating_decimals(0.3, 0.4, 0), 1);
        assert_eq!(separating_decimals(10.2, 30.0, 0), 0);
        assert_eq!(separating_decimals(-0.0014, 0.0, 2), 3);
        // Not separable: the most decimals.
        assert_eq!(separating_decimals(1.0, 1.0, 0), 12);
    }

    #[test]
    fn ordinals_read_right() {
        let got: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111]
            .into_iter()
            .map(ordinal)
            .collect();
        assert_eq!(
            got,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st",
                "111th"
            ]
        );
    }
}
