//! Stored values as operators see them: JSON for every value whose key says
//! what message it holds, text or hex for anything else.

use anyhow::{Context, Result, bail};
use iadeep_proto as pb;
use iadeep_state::keys::KeyKind;
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
            KeyKind::TaskSpec { .. } => {
                type $ty = pb::TaskSpec;
                $body
            }
            KeyKind::TaskPlacement { .. } => {
                type $ty = pb::Placement;
                $body
            }
            KeyKind::TaskReport { .. } => {
                type $ty = pb::TaskReport;
                $body
            }
            KeyKind::TaskAssignment { .. } => {
                type $ty = pb::BatchSizeAssignment;
                $body
            }
            KeyKind::Sample { .. } => {
                type $ty = pb::CoLocationSample;
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
/// message type (checked, unknown fields rejected), or the text itself for other keys.
pub fn from_input(key: &str, input: &str, raw: bool) -> Result<Vec<u8>> {
    if raw {
        return Ok(input.as_bytes().to_vec());
    }
    with_message_type!(KeyKind::parse(key), M => {
        let message: M = serde_json::from_str(input).with_context(|| {
            format!("the value for {key} must be JSON of {} (use --raw to store bytes as given)",
                std::any::type_name::<M>().rsplit("::").next().unwrap_or("its message"))
        })?;
        Ok(message.encode_to_vec())
    }, Ok(input.as_bytes().to_vec()))
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
    use iadeep_state::keys;

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
