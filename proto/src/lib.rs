//! The protobuf schema of iadeep.
//!
//! One schema serves the wire (the `Placer` gRPC service) and the values kept in
//! the state store, so a report written by an agent and read by a tuner, or a
//! placement answered over gRPC and stored, can never drift apart.
//!
//! The messages are always there; the gRPC client and server stubs
//! (`placer_client`, `placer_server`) come with the `grpc` feature, so crates that
//! only read and write the values do not link tonic.
//!
//! Every message also implements serde in protobuf's canonical JSON mapping
//! (pbjson: lowerCamelCase names, enum names, 64-bit integers as strings, default
//! values omitted), so JSON written by `MessageToJson` in any language is read
//! back, and operators can read and write stored values as JSON. On input the
//! proto field names (`device_id`) are accepted as well as the JSON names
//! (`deviceId`), absent fields take their defaults, and unknown fields are an error.

/// Version 1 of the schema (`package iadeep.v1`).
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/iadeep.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/iadeep.v1.serde.rs"));
}

/// The codec of the generated gRPC stubs (INVALID_ARGUMENT for an undecodable request).
#[cfg(feature = "grpc")]
pub mod codec;

/// The encoded `FileDescriptorSet` of the schema, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/iadeep_descriptor.bin"));

pub use v1::*;

impl From<LrScalingRule> for iadeep_objective::LrScalingRule {
    fn from(rule: LrScalingRule) -> Self {
        match rule {
            LrScalingRule::Unspecified => Self::Unspecified,
            LrScalingRule::Linear => Self::Linear,
            LrScalingRule::Sqrt => Self::Sqrt,
            LrScalingRule::Adascale => Self::Adascale,
        }
    }
}

/// The slowdown cap of a production job that names none (TGS's production jobs run
/// within a few percent of alone; 10 % leaves room for measurement noise).
pub const DEFAULT_MAX_SLOWDOWN: f64 = 1.10;

impl TaskSpec {
    /// Whether the job is production (anything else, unspecified included, is
    /// opportunistic).
    pub fn is_production(&self) -> bool {
        self.priority_class == PriorityClass::Production as i32
    }

    /// The most PD the job accepts: its `max_slowdown` (or [`DEFAULT_MAX_SLOWDOWN`]) when
    /// it is production, `None` for an opportunistic job, which has no cap.
    pub fn slowdown_cap(&self) -> Option<f64> {
        self.is_production()
            .then(|| self.max_slowdown.unwrap_or(DEFAULT_MAX_SLOWDOWN))
    }

    /// The class's name as operators and metrics labels spell it.
    pub fn class_name(&self) -> &'static str {
        PriorityClass::try_from(self.priority_class)
            .unwrap_or(PriorityClass::Unspecified)
            .name()
    }
}

impl PriorityClass {
    /// The class's name as users, operators and metrics labels spell it (one of
    /// [`PRIORITY_CLASS_NAMES`]; unspecified is opportunistic).
    pub fn name(self) -> &'static str {
        match self {
            PriorityClass::Production => "production",
            PriorityClass::Unspecified | PriorityClass::Opportunistic => "opportunistic",
        }
    }
}

/// Most slowdown cap a production job may name: a job that accepts running ten
/// times slower than alone has no reason to be production.
pub const MAX_SLOWDOWN_CAP: f64 = 10.0;

/// The names of the priority classes as users write them (`iadeep run --class`, the
/// Python agent's `priority_class=`), in [`PriorityClass`] order.
pub const PRIORITY_CLASS_NAMES: [&str; 2] = ["opportunistic", "production"];

/// The class a name of [`PRIORITY_CLASS_NAMES`] means (any case).
pub fn priority_class_from_name(name: &str) -> Option<PriorityClass> {
    match name.to_ascii_lowercase().as_str() {
        "opportunistic" => Some(PriorityClass::Opportunistic),
        "production" => Some(PriorityClass::Production),
        _ => None,
    }
}

/// Checks a priority class (as its wire number) and slowdown cap together, as every
/// entry point takes them (the placer's request validation, `iadeep run`, the agent's
/// configuration): on a problem, the field at fault (`priority_class` or
/// `max_slowdown`) and why. One definition, so they all refuse the same values.
pub fn check_priority(
    priority_class: i32,
    max_slowdown: Option<f64>,
) -> Result<(), (&'static str, String)> {
    if PriorityClass::try_from(priority_class).is_err() {
        return Err((
            "priority_class",
            format!(
                "{priority_class} is not a known PriorityClass (0 unspecified, 1 opportunistic, 2 production)"
            ),
        ));
    }
    let Some(cap) = max_slowdown else {
        return Ok(());
    };
    if priority_class != PriorityClass::Production as i32 {
        return Err((
            "max_slowdown",
            "applies to production jobs only (set priority_class to production, or leave it out)"
                .to_owned(),
        ));
    }
    if !(cap.is_finite() && cap > 1.0 && cap <= MAX_SLOWDOWN_CAP) {
        return Err((
            "max_slowdown",
            format!(
                "{cap} is not a slowdown cap: it must be greater than 1 (1.10 means at most 10 % slower than alone) and at most {MAX_SLOWDOWN_CAP}"
            ),
        ));
    }
    Ok(())
}

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
    fn json_follows_the_protobuf_mapping() {
        let spec = TaskSpec {
            task_id: "job-42".into(),
            gpu_mem_request_mib: 12_000,
            lr_rule: LrScalingRule::Sqrt as i32,
            submitted_at_unix_ms: 1_700_000_000_000,
            ..Default::default()
        };
        let json = serde_json::to_value(&spec).expect("serialise");
        assert_eq!(
            json,
            serde_json::json!({
                "taskId": "job-42",
                "gpuMemRequestMib": "12000",
                "lrRule": "LR_SCALING_RULE_SQRT",
                "submittedAtUnixMs": "1700000000000",
            }),
            "camelCase names, enum names, 64-bit integers as strings, defaults omitted"
        );
    }

    #[test]
    fn json_accepts_proto_names_numbers_and_enum_numbers() {
        let old: DeviceInfo = serde_json::from_str(r#"{"device_id":"n1:gpu0","memory_mib":24576}"#)
            .expect("the snake_case names of older iadeep versions");
        let new: DeviceInfo = serde_json::from_str(r#"{"deviceId":"n1:gpu0","memoryMib":"24576"}"#)
            .expect("the standard mapping");
        assert_eq!(old, new);
        assert_eq!(old.memory_mib, 24576);
        let spec: TaskSpec =
            serde_json::from_str(r#"{"task_id":"t","lr_rule":2}"#).expect("enum number");
        assert_eq!(spec.lr_rule, LrScalingRule::Sqrt as i32);
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
