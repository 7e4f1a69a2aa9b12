//! The key layout of the state store, in one place.
//!
//! ```text
//! /iadeep/v1/devices/{device}/info        DeviceInfo; leased by the device's tuner
//! /iadeep/v1/devices/{device}/owner       leased by the device's one tuner (text: who it is)
//! /iadeep/v1/devices/{device}/tuner       tuner state (observations), so a restarted tuner resumes
//! /iadeep/v1/devices/{device}/tuner.corrupt  the bytes of a tuner state that did not decode
//! /iadeep/v1/devices/{device}/residents   the placer's reservations on the device (compare-and-swap)
//! /iadeep/v1/devices/{device}/breach      CapBreach: a production job above its cap (tuner → placer)
//! /iadeep/v1/tasks/{task}/spec            TaskSpec
//! /iadeep/v1/tasks/{task}/placement       Placement (device id and reserved memory)
//! /iadeep/v1/tasks/{task}/alive           leased by the task's agent: the task is running
//! /iadeep/v1/tasks/{task}/report          latest TaskReport
//! /iadeep/v1/tasks/{task}/assignment      BatchSizeAssignment
//! /iadeep/v1/samples/{device}/{seq:020}   CoLocationSample; seq is per device (one tuner each)
//! /iadeep/v1/released/{task}              when the task was released (decimal Unix ms)
//! /iadeep/v1/archive/{task}/spec          a released task's TaskSpec, kept for its retention
//! /iadeep/v1/archive/{task}/report        its last TaskReport
//! /iadeep/v1/archive/{task}/assignment    its last BatchSizeAssignment
//! /iadeep/v1/profiles/{model}             ModelProfile: the profile registry (see [`profile_key_segment`])
//! /iadeep/v1/avoid/{production}/{evicted} AvoidPairing: not co-located again until it expires
//! ```
//!
//! The release marker lives under its own prefix, not beside the task's keys, so the
//! placer's retention pass (see `iadeep_placer::retention`) reads only the released
//! tasks rather than every key of every task. What a released task keeps for an
//! operator to read (its spec, last report and assignment) moves, in the Release's
//! transaction, from `tasks/` to `archive/`: everything that reads `tasks/` whole (the
//! placer's start, every tuner's follow) then reads the live tasks only, however many
//! finished in the retention period (a day of them once made `tasks/` too large for
//! one gRPC answer).
//!
//! Why the device's own record is `.../info` rather than the bare
//! `/devices/{device}` of the first design (docs/design.md, "Key layout"): a prefix
//! range over `/devices/` would then mix device records with their tuner state, and a
//! reader could not tell a device named `a/tuner` from the tuner state of device `a`.
//! Ids therefore may not contain `/` (see [`validate_id`]).

use crate::error::{Result, StateError};

/// Root of every key iadeep writes. The version lets a future layout live beside this one.
pub const ROOT: &str = "/iadeep/v1/";
/// Prefix of all device keys.
pub const DEVICES: &str = "/iadeep/v1/devices/";
/// Prefix of all task keys.
pub const TASKS: &str = "/iadeep/v1/tasks/";
/// Prefix of all co-location samples.
pub const SAMPLES: &str = "/iadeep/v1/samples/";
/// Prefix of the release markers of released tasks.
pub const RELEASED: &str = "/iadeep/v1/released/";
/// Prefix of what released tasks keep until their retention ends.
pub const ARCHIVE: &str = "/iadeep/v1/archive/";
/// Prefix of the profile registry, one key per model.
pub const PROFILES: &str = "/iadeep/v1/profiles/";
/// Prefix of the pairings the placer avoids after evictions.
pub const AVOID: &str = "/iadeep/v1/avoid/";

/// Longest id accepted, so keys stay readable and bounded.
pub const MAX_ID_LEN: usize = 128;

/// Checks that `id` can be used as one path segment of a key.
///
/// Allowed: ASCII letters, digits, `.`, `_`, `-`, `:`; not empty, not starting
/// with `.`, at most [`MAX_ID_LEN`] bytes.
pub fn validate_id(kind: &'static str, id: &str) -> Result<()> {
    let reason = if id.is_empty() {
        Some("must not be empty")
    } else if id.len() > MAX_ID_LEN {
        Some("is longer than 128 bytes")
    } else if id.starts_with('.') {
        Some("must not start with '.'")
    } else if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'))
    {
        Some("may only contain ASCII letters, digits, '.', '_', '-' and ':'")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(StateError::InvalidId {
            kind,
            id: id.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// `/iadeep/v1/devices/{device}/info`
pub fn device_info(device: &str) -> String {
    format!("{DEVICES}{device}/info")
}
/// `/iadeep/v1/devices/{device}/tuner`
pub fn device_tuner(device: &str) -> String {
    format!("{DEVICES}{device}/tuner")
}
/// `/iadeep/v1/devices/{device}/owner`
pub fn device_owner(device: &str) -> String {
    format!("{DEVICES}{device}/owner")
}
/// `/iadeep/v1/devices/{device}/tuner.corrupt`
pub fn device_tuner_corrupt(device: &str) -> String {
    format!("{DEVICES}{device}/tuner.corrupt")
}
/// `/iadeep/v1/devices/{device}/residents`
pub fn device_residents(device: &str) -> String {
    format!("{DEVICES}{device}/residents")
}
/// `/iadeep/v1/devices/{device}/`: everything about one device.
pub fn device_prefix(device: &str) -> String {
    format!("{DEVICES}{device}/")
}
/// `/iadeep/v1/devices/{device}/breach`: a production job above its slowdown cap with
/// every opportunistic co-runner at its floor (a CapBreach), written by the tuner.
pub fn device_breach(device: &str) -> String {
    format!("{DEVICES}{device}/breach")
}
/// `/iadeep/v1/avoid/{production}/{evicted}`: an AvoidPairing.
pub fn avoid_pairing(production: &str, evicted: &str) -> String {
    format!("{AVOID}{production}/{evicted}")
}
/// `/iadeep/v1/tasks/{task}/spec`
pub fn task_spec(task: &str) -> String {
    format!("{TASKS}{task}/spec")
}
/// `/iadeep/v1/tasks/{task}/placement`
pub fn task_placement(task: &str) -> String {
    format!("{TASKS}{task}/placement")
}
/// `/iadeep/v1/tasks/{task}/alive`
pub fn task_alive(task: &str) -> String {
    format!("{TASKS}{task}/alive")
}
/// `/iadeep/v1/tasks/{task}/report`
pub fn task_report(task: &str) -> String {
    format!("{TASKS}{task}/report")
}
/// `/iadeep/v1/tasks/{task}/assignment`
pub fn task_assignment(task: &str) -> String {
    format!("{TASKS}{task}/assignment")
}
/// `/iadeep/v1/released/{task}`: when the task was released (decimal Unix ms).
pub fn task_released(task: &str) -> String {
    format!("{RELEASED}{task}")
}
/// `/iadeep/v1/archive/{task}/spec`: a released task's spec.
pub fn archived_spec(task: &str) -> String {
    format!("{ARCHIVE}{task}/spec")
}
/// `/iadeep/v1/archive/{task}/report`: a released task's last report.
pub fn archived_report(task: &str) -> String {
    format!("{ARCHIVE}{task}/report")
}
/// `/iadeep/v1/archive/{task}/assignment`: a released task's last assignment.
pub fn archived_assignment(task: &str) -> String {
    format!("{ARCHIVE}{task}/assignment")
}
/// `/iadeep/v1/archive/{task}/`: everything a released task keeps.
pub fn archive_prefix(task: &str) -> String {
    format!("{ARCHIVE}{task}/")
}
/// The keys of a task that its Release moves to the archive, with where each goes:
/// (live key, archived key).
pub fn archived_task_keys(task: &str) -> [(String, String); 3] {
    [
        (task_spec(task), archived_spec(task)),
        (task_report(task), archived_report(task)),
        (task_assignment(task), archived_assignment(task)),
    ]
}
/// `/iadeep/v1/tasks/{task}/`: everything about one task.
pub fn task_prefix(task: &str) -> String {
    format!("{TASKS}{task}/")
}
/// A model's name as one key segment: every byte an id may not hold becomes `_`, a
/// leading `.` too, and the result is cut to [`MAX_ID_LEN`] bytes. Model names are the
/// user's free text ("ResNet 50", "org/model"); two names that map to the same segment
/// share a key, so the stored `ModelProfile.model` says whose entry it is.
pub fn profile_key_segment(model: &str) -> String {
    let mut segment: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':') {
                c
            } else {
                '_'
            }
        })
        .take(MAX_ID_LEN)
        .collect();
    if segment.starts_with('.') {
        segment.replace_range(..1, "_");
    }
    if segment.is_empty() {
        segment.push('_');
    }
    segment
}
/// `/iadeep/v1/profiles/{model}`: the profile registry's entry of a model.
pub fn profile(model: &str) -> String {
    format!("{PROFILES}{}", profile_key_segment(model))
}
/// `/iadeep/v1/samples/{device}/{seq:020}`: zero-padded so keys sort by sequence.
pub fn sample(device: &str, seq: u64) -> String {
    format!("{SAMPLES}{device}/{seq:020}")
}
/// `/iadeep/v1/samples/{device}/`
pub fn device_samples_prefix(device: &str) -> String {
    format!("{SAMPLES}{device}/")
}

/// What a key is, parsed back from its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyKind {
    DeviceInfo {
        device: String,
    },
    DeviceTuner {
        device: String,
    },
    /// Text naming the tuner that owns the device.
    DeviceOwner {
        device: String,
    },
    /// Raw bytes kept aside from an undecodable tuner state.
    DeviceTunerCorrupt {
        device: String,
    },
    DeviceResidents {
        device: String,
    },
    /// A CapBreach written by the device's tuner.
    DeviceBreach {
        device: String,
    },
    TaskSpec {
        task: String,
    },
    TaskPlacement {
        task: String,
    },
    TaskAlive {
        task: String,
    },
    TaskReport {
        task: String,
    },
    TaskAssignment {
        task: String,
    },
    /// Text: when the task was released, decimal Unix ms.
    TaskReleased {
        task: String,
    },
    /// A released task's spec (a TaskSpec), kept for its retention.
    ArchivedSpec {
        task: String,
    },
    /// A released task's last report (a TaskReport).
    ArchivedReport {
        task: String,
    },
    /// A released task's last assignment (a BatchSizeAssignment).
    ArchivedAssignment {
        task: String,
    },
    Sample {
        device: String,
        seq: u64,
    },
    /// The profile registry's entry of a model (its key segment).
    Profile {
        model: String,
    },
    /// An AvoidPairing: the evicted task is not placed beside the production task.
    AvoidPairing {
        production: String,
        evicted: String,
    },
    /// Not part of iadeep's layout.
    Other,
}

impl KeyKind {
    /// Classifies a key of the layout above; anything else is [`KeyKind::Other`].
    ///
    /// long: one dispatch over the key layout, a prefix and its leaves per branch; split
    /// up, the layout would no longer read in one place beside the enum it fills.
    pub fn parse(key: &str) -> KeyKind {
        let two_segments = |rest: &str| -> Option<(String, String)> {
            let (id, leaf) = rest.split_once('/')?;
            if leaf.contains('/') || validate_id("key", id).is_err() {
                return None;
            }
            Some((id.to_owned(), leaf.to_owned()))
        };
        if let Some(rest) = key.strip_prefix(DEVICES) {
            return match two_segments(rest) {
                Some((device, leaf)) => match leaf.as_str() {
                    "info" => KeyKind::DeviceInfo { device },
                    "tuner" => KeyKind::DeviceTuner { device },
                    "owner" => KeyKind::DeviceOwner { device },
                    "tuner.corrupt" => KeyKind::DeviceTunerCorrupt { device },
                    "residents" => KeyKind::DeviceResidents { device },
                    "breach" => KeyKind::DeviceBreach { device },
                    _ => KeyKind::Other,
                },
                None => KeyKind::Other,
            };
        }
        if let Some(rest) = key.strip_prefix(TASKS) {
            return match two_segments(rest) {
                Some((task, leaf)) => match leaf.as_str() {
                    "spec" => KeyKind::TaskSpec { task },
                    "placement" => KeyKind::TaskPlacement { task },
                    "alive" => KeyKind::TaskAlive { task },
                    "report" => KeyKind::TaskReport { task },
                    "assignment" => KeyKind::TaskAssignment { task },
                    _ => KeyKind::Other,
                },
                None => KeyKind::Other,
            };
        }
        if let Some(rest) = key.strip_prefix(ARCHIVE) {
            return match two_segments(rest) {
                Some((task, leaf)) => match leaf.as_str() {
                    "spec" => KeyKind::ArchivedSpec { task },
                    "report" => KeyKind::ArchivedReport { task },
                    "assignment" => KeyKind::ArchivedAssignment { task },
                    _ => KeyKind::Other,
                },
                None => KeyKind::Other,
            };
        }
        if let Some(rest) = key.strip_prefix(AVOID) {
            return match two_segments(rest) {
                Some((production, evicted)) if validate_id("key", &evicted).is_ok() => {
                    KeyKind::AvoidPairing {
                        production,
                        evicted,
                    }
                }
                _ => KeyKind::Other,
            };
        }
        if let Some(task) = key.strip_prefix(RELEASED) {
            return match validate_id("key", task) {
                Ok(()) => KeyKind::TaskReleased {
                    task: task.to_owned(),
                },
                Err(_) => KeyKind::Other,
            };
        }
        if let Some(model) = key.strip_prefix(PROFILES) {
            return match validate_id("key", model) {
                Ok(()) => KeyKind::Profile {
                    model: model.to_owned(),
                },
                Err(_) => KeyKind::Other,
            };
        }
        if let Some(rest) = key.strip_prefix(SAMPLES) {
            return match two_segments(rest) {
                Some((device, seq)) => match seq.parse::<u64>() {
                    Ok(seq) => KeyKind::Sample { device, seq },
                    Err(_) => KeyKind::Other,
                },
                None => KeyKind::Other,
            };
        }
        KeyKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builder_parses_back_to_its_kind() {
        let d = "node-3:gpu1".to_owned();
        let t = "job-42".to_owned();
        assert_eq!(
            KeyKind::parse(&device_info(&d)),
            KeyKind::DeviceInfo { device: d.clone() }
        );
        assert_eq!(
            KeyKind::parse(&device_tuner(&d)),
            KeyKind::DeviceTuner { device: d.clone() }
        );
        assert_eq!(
            KeyKind::parse(&device_owner(&d)),
            KeyKind::DeviceOwner { device: d.clone() }
        );
        assert_eq!(
            KeyKind::parse(&device_tuner_corrupt(&d)),
            KeyKind::DeviceTunerCorrupt { device: d.clone() }
        );
        assert_eq!(
            KeyKind::parse(&device_residents(&d)),
            KeyKind::DeviceResidents { device: d.clone() }
        );
        assert_eq!(
            KeyKind::parse(&device_breach(&d)),
            KeyKind::DeviceBreach { device: d.clone() }
        );
        assert_eq!(
            KeyKind::parse(&avoid_pairing(&t, &d)),
            KeyKind::AvoidPairing {
                production: t.clone(),
                evicted: d.clone()
            }
        );
        assert_eq!(
            KeyKind::parse(&task_spec(&t)),
            KeyKind::TaskSpec { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&task_placement(&t)),
            KeyKind::TaskPlacement { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&task_alive(&t)),
            KeyKind::TaskAlive { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&task_report(&t)),
            KeyKind::TaskReport { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&task_assignment(&t)),
            KeyKind::TaskAssignment { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&task_released(&t)),
            KeyKind::TaskReleased { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&archived_spec(&t)),
            KeyKind::ArchivedSpec { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&archived_report(&t)),
            KeyKind::ArchivedReport { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&archived_assignment(&t)),
            KeyKind::ArchivedAssignment { task: t.clone() }
        );
        assert_eq!(
            KeyKind::parse(&sample(&d, 7)),
            KeyKind::Sample { device: d, seq: 7 }
        );
        assert_eq!(
            KeyKind::parse(&profile("ResNet-50")),
            KeyKind::Profile {
                model: "ResNet-50".into()
            }
        );
    }

    #[test]
    fn any_model_name_makes_one_valid_key_segment() {
        for (model, segment) in [
            ("resnet18", "resnet18"),
            ("ResNet 50", "ResNet_50"),
            ("org/bert-base", "org_bert-base"),
            (".hidden", "_hidden"),
            ("", "_"),
        ] {
            assert_eq!(profile_key_segment(model), segment);
            assert!(validate_id("model", &profile_key_segment(model)).is_ok());
        }
        assert_eq!(profile_key_segment(&"é".repeat(300)).len(), MAX_ID_LEN);
    }

    #[test]
    fn foreign_and_malformed_keys_are_other() {
        for key in [
            "/other/thing",
            "/iadeep/v1/devices/a/b/info",
            "/iadeep/v1/tasks/t/unknown",
            "/iadeep/v1/samples/d/notanumber",
            "/iadeep/v1/tasks//spec",
            "/iadeep/v1/released/a/b",
            "/iadeep/v1/archive/a/placement",
            "/iadeep/v1/archive/a",
            "/iadeep/v1/profiles/a/b",
        ] {
            assert_eq!(KeyKind::parse(key), KeyKind::Other, "{key}");
        }
    }

    #[test]
    fn sample_keys_sort_by_sequence() {
        assert!(sample("d", 9) < sample("d", 10));
    }

    #[test]
    fn ids_with_separators_are_rejected_with_a_reason() {
        assert!(validate_id("task", "job-1.v2:x_y").is_ok());
        for bad in ["", "a/b", ".hidden", "sp ace", &"x".repeat(129)] {
            let err = validate_id("task", bad).expect_err(bad);
            assert!(err.to_string().contains("invalid task id"), "{err}");
        }
    }
}
