//! Protobuf-typed access to the store.
//!
//! Values are protobuf messages from `iadeep-proto`. Decoding happens here, once,
//! so that a value which does not decode always becomes a
//! [`StateError::Decode`] naming its key, never a panic or a silently empty message.

use prost::Message;

use crate::error::{Result, StateError};
use crate::store::{KeyValue, LeaseId, Revision, StateStore};

/// The short name of a message type for error messages (`TaskSpec`, not the full path).
fn type_name<M>() -> &'static str {
    let full = std::any::type_name::<M>();
    full.rsplit("::").next().unwrap_or(full)
}

/// Decodes the value of `kv` as `M`.
pub fn decode<M: Message + Default>(kv: &KeyValue) -> Result<M> {
    decode_bytes(&kv.key, &kv.value)
}

/// Decodes `bytes` read at `key` as `M`.
pub fn decode_bytes<M: Message + Default>(key: &str, bytes: &[u8]) -> Result<M> {
    M::decode(bytes).map_err(|err| StateError::Decode {
        key: key.to_owned(),
        expected: type_name::<M>(),
        reason: err.to_string(),
    })
}

/// The message at `key` with its metadata, if the key exists.
pub async fn get<M: Message + Default>(
    store: &dyn StateStore,
    key: &str,
) -> Result<Option<(M, KeyValue)>> {
    match store.get(key).await? {
        Some(kv) => Ok(Some((decode(&kv)?, kv))),
        None => Ok(None),
    }
}

/// Writes `message` at `key`.
pub async fn put<M: Message>(
    store: &dyn StateStore,
    key: &str,
    message: &M,
    lease: Option<LeaseId>,
) -> Result<Revision> {
    store.put(key, message.encode_to_vec(), lease).await
}

/// Every message under `prefix` whose key satisfies `accept`, decoded as `M`.
///
/// `accept` lets a caller pick one kind of key out of a mixed prefix (e.g. the
/// `spec` keys among all task keys); a selected value that does not decode is an error.
pub async fn list<M: Message + Default>(
    store: &dyn StateStore,
    prefix: &str,
    accept: impl Fn(&str) -> bool,
) -> Result<(Vec<(M, KeyValue)>, Revision)> {
    let snapshot = store.range(prefix).await?;
    let mut out = Vec::new();
    for kv in snapshot.kvs {
        if accept(&kv.key) {
            out.push((decode(&kv)?, kv));
        }
    }
    Ok((out, snapshot.revision))
}

/// The value of a release marker ([`crate::keys::task_released`]): the release time as
/// decimal Unix ms, text an operator can read with `state get` and write by hand.
pub fn encode_released_at(unix_ms: i64) -> Vec<u8> {
    unix_ms.to_string().into_bytes()
}

/// The release time a marker read at `key` holds (see [`encode_released_at`]).
pub fn decode_released_at(key: &str, bytes: &[u8]) -> Result<i64> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok())
        .ok_or_else(|| StateError::Decode {
            key: key.to_owned(),
            expected: "release time (decimal Unix ms)",
            reason: format!("{:?} is not a whole number", String::from_utf8_lossy(bytes)),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_times_round_trip_and_garbage_names_the_key() {
        let bytes = encode_released_at(1_700_000_000_123);
        assert_eq!(
            decode_released_at("k", &bytes).ok(),
            Some(1_700_000_000_123)
        );
        let err = decode_released_at("/iadeep/v1/released/t", b"yesterday").expect_err("text");
        assert!(err.to_string().contains("/iadeep/v1/released/t"), "{err}");
    }
}
