//! The protobuf schema of iadeep.
//!
//! One schema serves the wire (the `Placer` gRPC service) and the values kept in
//! the state store, so a report written by an agent and read by a tuner, or a
//! placement answered over gRPC and stored, can never drift apart.
//!
//! Every message also derives serde (`Serialize`, `Deserialize` with defaults
//! for absent fields and an error for unknown ones) so that operators can read
//! and write stored values as JSON.

/// Version 1 of the schema (`package iadeep.v1`).
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod v1 {
    tonic::include_proto!("iadeep.v1");
}

pub use v1::*;

/// Milliseconds since the Unix epoch, the unit of every `*_unix_ms` field.
///
/// A clock before 1970 (a broken host) gives 0 rather than a panic.
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn task_spec_round_trips_through_protobuf_and_json() {
        let spec = TaskSpec {
            task_id: "job-42".into(),
            model: "ResNet-50".into(),
            initial_batch_size: 64,
            min_batch_size: 16,
            max_batch_size: 256,
            lr_rule: LrScalingRule::Sqrt as i32,
            profile: Some(SoloProfile {
                batch_size: 64,
                step_time_s: Some(0.12),
                sm_util_pct: None,
                ..Default::default()
            }),
            ..Default::default()
        };
        let bytes = spec.encode_to_vec();
        assert_eq!(TaskSpec::decode(bytes.as_slice()).ok(), Some(spec.clone()));
        let json = serde_json::to_string(&spec).expect("serialise");
        let back: TaskSpec = serde_json::from_str(&json).expect("parse");
        assert_eq!(back, spec);
    }

    #[test]
    fn json_rejects_unknown_fields_and_fills_defaults() {
        let partial: DeviceInfo =
            serde_json::from_str(r#"{"device_id":"n1/gpu0","memory_mib":24576}"#).expect("parse");
        assert_eq!(partial.memory_mib, 24576);
        assert!(partial.uuid.is_empty());
        assert!(serde_json::from_str::<DeviceInfo>(r#"{"memory":1}"#).is_err());
    }
}
