//! Stored values as operators see them: JSON for every value whose key says
//! what message it holds, text or hex for anything else.

use anyhow::{Context, Result, bail};
use iadeep_proto as pb;
use iadeep_state::keys::{self, KeyKind};
use iadeep_state::typed;
use prost::Message;
use serde_json::Value;

/// Runs `$body` with `$ty` bound to the message type stored at keys of `$kind`;
/// evaluates `$other` for keys whose values are not (yet) a known message.
macro_rules! with_message_type {
    ($kind:expr, $ty:ident => $body:expr, $other:expr) => {
        match $kind {
            KeyKind::DeviceInfo { .. } => {
                type $ty = pb::DeviceInfo;
                $body
            }
            KeyKind::DeviceResidents { .. } => {
                type $ty = pb::DeviceResidents;
                $body
            }
            KeyKind::DeviceTuner { .. } => {
                type $ty = pb::TunerState;
                $body
            }
            KeyKind::TaskSpec { .. } | KeyKind::ArchivedSpec { .. } => {
                type $ty = pb::TaskSpec;
                $body
            }
            KeyKind::TaskPlacement { .. } => {
                type $ty = pb::Placement;
                $body
            }
            KeyKind::TaskReport { .. } | KeyKind::ArchivedReport { .. } => {
                type $ty = pb::TaskReport;
                $body
            }
            KeyKind::TaskAssignment { .. } | KeyKind::ArchivedAssignment { .. } => {
                type $ty = pb::BatchSizeAssignment;
                $body
            }
            KeyKind::Sample { .. } => {
                type $ty = pb::CoLocationSample;
                $body
            }
            KeyKind::Profile { .. } => {
                type $ty = pb::ModelProfile;
                $body
            }
            KeyKind::DeviceBreach { .. } => {
                type $ty = pb::CapBreach;
                $body
            }
            KeyKind::AvoidPairing { .. } => {
                type $ty = pb::AvoidPairing;
                $body
            }
            _ => $other,
        }
    };
}

/// The value at `key` as JSON.
pub fn to_json(key: &str, bytes: &[u8]) -> Result<Value> {
    with_message_type!(KeyKind::parse(key), M => {
        let message: M = typed::decode_bytes(key, bytes)?;
        Ok(serde_json::to_value(&message)?)
    }, Ok(raw_to_json(bytes)))
}

/// A value with no known message type: its text when UTF-8, else `{"hex": ...}`.
fn raw_to_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => Value::String(text.to_owned()),
        Err(_) => {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            serde_json::json!({ "hex": hex })
        }
    }
}

/// The bytes to store at `key` for what the operator typed: JSON of the key's
/// message type (checked, unknown fields rejected, ids matching the key), the text
/// itself for an alive key or a key outside iadeep's layout. A key under
/// [`keys::ROOT`] that is not part of the layout is refused: nothing would read it,
/// so it is almost certainly a typo.
pub fn from_input(key: &str, input: &str, raw: bool) -> Result<Vec<u8>> {
    if raw {
        return Ok(input.as_bytes().to_vec());
    }
    let kind = KeyKind::parse(key);
    if kind == KeyKind::Other && key.starts_with(keys::ROOT) {
        bail!(
            "{key} is not one of iadeep's keys (devices/ID/{{info,owner,tuner,tuner.corrupt,residents,breach}}, \
             tasks/ID/{{spec,placement,alive,report,assignment}}, samples/ID/SEQ, released/ID, archive/ID/{{spec,report,assignment}}, profiles/MODEL, avoid/ID/ID); \
             use --raw to store it anyway"
        );
    }
    if let KeyKind::TaskReleased { .. } = kind {
        let unix_ms = typed::decode_released_at(key, input.as_bytes())?;
        return Ok(typed::encode_released_at(unix_ms));
    }
    with_message_type!(&kind, M => {
        let message: M = serde_json::from_str(input).with_context(|| {
            format!("the value for {key} must be JSON of {} (use --raw to store bytes as given)",
                std::any::type_name::<M>().rsplit("::").next().unwrap_or("its message"))
        })?;
        check_ids(key, &kind, &message)?;
        Ok(message.encode_to_vec())
    }, Ok(input.as_bytes().to_vec()))
}

/// The ids a stored message carries, for comparison with the ids its key names.
trait CarriesIds {
    /// `(field, value)` of the device or task id the message says it is about.
    fn ids(&self) -> Vec<(&'static str, &str)>;
}

macro_rules! carries_ids {
    ($($ty:ty => $($field:ident),+;)+) => {
        $(impl CarriesIds for $ty {
            fn ids(&self) -> Vec<(&'static str, &str)> {
                vec![$((stringify!($field), self.$field.as_str())),+]
            }
        })+
    };
}

carries_ids! {
    pb::DeviceInfo => device_id;
    pb::DeviceResidents => device_id;
    pb::TunerState => device_id;
    pb::TaskSpec => task_id;
    pb::Placement => task_id;
    pb::TaskReport => task_id;
    pb::BatchSizeAssignment => task_id;
    pb::CoLocationSample => device_id;
    pb::CapBreach => device_id;
    pb::AvoidPairing => production_task_id, evicted_task_id;
}

/// A registry entry names its model, which its key holds in sanitised form (checked in
/// [`check_ids`]), not a device or task id.
impl CarriesIds for pb::ModelProfile {
    fn ids(&self) -> Vec<(&'static str, &str)> {
        Vec::new()
    }
}

/// Refuses a message whose own device or task id differs from the key's: readers
/// trust both, and a record filed under the wrong id corrupts another's state.
fn check_ids(key: &str, kind: &KeyKind, message: &impl CarriesIds) -> Result<()> {
    let expected = match kind {
        KeyKind::DeviceInfo { device }
        | KeyKind::DeviceTuner { device }
        | KeyKind::DeviceOwner { device }
        | KeyKind::DeviceTunerCorrupt { device }
        | KeyKind::DeviceResidents { device }
        | KeyKind::DeviceBreach { device }
        | KeyKind::Sample { device, .. } => device,
        KeyKind::TaskSpec { task }
        | KeyKind::TaskPlacement { task }
        | KeyKind::TaskReport { task }
        | KeyKind::TaskAssignment { task }
        | KeyKind::TaskReleased { task }
        | KeyKind::ArchivedSpec { task }
        | KeyKind::ArchivedReport { task }
        | KeyKind::ArchivedAssignment { task }
        | KeyKind::TaskAlive { task } => task,
        KeyKind::AvoidPairing {
            production,
            evicted,
        } => {
            let pairing: Vec<(&'static str, &str)> = message.ids();
            for ((field, value), expected) in pairing.into_iter().zip([production, evicted]) {
                if value != expected {
                    bail!("{field} is {value:?} but the key {key} names {expected:?}");
                }
            }
            return Ok(());
        }
        KeyKind::Profile { .. } | KeyKind::Other => return Ok(()),
    };
    for (field, value) in message.ids() {
        if value != expected {
            bail!("{field} is {value:?} but the key {key} is about {expected:?}");
        }
    }
    Ok(())
}

/// One line summarising a value for listings.
pub fn one_line(key: &str, bytes: &[u8]) -> String {
    match to_json(key, bytes) {
        Ok(Value::String(text)) => text,
        Ok(value) => value.to_string(),
        Err(err) => format!("<{err}>"),
    }
}

/// Checks that a key is absolute, so `ls` and `watch` prefixes are unambiguous.
pub fn check_key(key: &str) -> Result<()> {
    if !key.starts_with('/') {
        bail!("keys start with '/': {key:?} (iadeep's keys live under /iadeep/v1/)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_keys_round_trip_through_json() {
        let key = keys::device_info("n1:gpu0");
        let bytes = from_input(&key, r#"{"device_id":"n1:gpu0","memory_mib":24576}"#, false)
            .expect("valid JSON");
        let json = to_json(&key, &bytes).expect("decodes");
        // Written with the proto names, printed in protobuf's JSON mapping.
        assert_eq!(json["memoryMib"], "24576");
        assert_eq!(json["deviceId"], "n1:gpu0");
        let again = from_input(&key, &json.to_string(), false).expect("standard JSON");
        assert_eq!(again, bytes);
    }

    #[test]
    fn bad_json_for_a_known_key_is_refused_with_the_type() {
        let key = keys::task_spec("t");
        let err = from_input(&key, r#"{"modle":"typo"}"#, false).expect_err("unknown field");
        assert!(format!("{err:#}").contains("TaskSpec"), "{err:#}");
        assert!(
            from_input(&key, "not json", true).is_ok(),
            "--raw stores anything"
        );
    }

    #[test]
    fn every_iadeep_key_is_type_checked() {
        let tuner = keys::device_tuner("d0");
        let err = from_input(&tuner, "garbage", false).expect_err("not JSON");
        assert!(format!("{err:#}").contains("TunerState"), "{err:#}");
        let bytes = from_input(&tuner, r#"{"device_id":"d0","round":3}"#, false).expect("valid");
        // Protobuf's JSON mapping writes 64-bit integers as strings.
        assert_eq!(to_json(&tuner, &bytes).expect("decodes")["round"], "3");

        let residents = keys::device_residents("d0");
        let err = from_input(
            &residents,
            r#"{"device_id":"d0","reservations":[{"bogus":1}]}"#,
            false,
        )
        .expect_err("unknown field in a reservation");
        assert!(format!("{err:#}").contains("DeviceResidents"), "{err:#}");

        // The message's own id must be the key's.
        let err = from_input(&residents, r#"{"device_id":"d1"}"#, false).expect_err("wrong id");
        assert!(err.to_string().contains("device_id is \"d1\""), "{err}");
        let err =
            from_input(&keys::task_spec("t"), r#"{"task_id":"u"}"#, false).expect_err("wrong task");
        assert!(err.to_string().contains("task_id"), "{err}");

        // A key under the root that is not in the layout is a typo.
        let err = from_input("/iadeep/v1/devices/d0/tunr", "{}", false).expect_err("typo");
        assert!(
            err.to_string().contains("not one of iadeep's keys"),
            "{err}"
        );
        assert!(from_input("/iadeep/v1/devices/d0/tunr", "x", true).is_ok());
        // An alive key holds text.
        assert_eq!(
            from_input(&keys::task_alive("t"), "pid 7", false).ok(),
            Some(b"pid 7".to_vec())
        );
        // A release marker holds a release time, which the placer's retention reads.
        let released = keys::task_released("t");
        assert_eq!(
            from_input(&released, "1700000000000", false).ok(),
            Some(b"1700000000000".to_vec())
        );
        let err = from_input(&released, "yesterday", false).expect_err("not a time");
        assert!(err.to_string().contains("release time"), "{err}");
    }

    #[test]
    fn other_keys_are_text_or_hex() {
        assert_eq!(
            to_json("/x", b"hello").ok(),
            Some(Value::String("hello".into()))
        );
        assert_eq!(
            to_json("/x", &[0xff, 0x00]).ok(),
            Some(serde_json::json!({"hex": "ff00"}))
        );
    }
}
