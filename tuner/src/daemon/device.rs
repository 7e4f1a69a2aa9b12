//! What the card is: NVML when present, operator flags otherwise (its `DeviceInfo`
//! record is published by [`super::ownership`]).

use iadeep_proto::DeviceInfo;
use iadeep_state::keys;

use crate::error::{Result, TunerError};

/// What the operator said about the device (flags).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceFlags {
    pub device_id: String,
    /// NVML index of the GPU on this node.
    pub index: u32,
    /// Total memory, MiB; required without NVML, overrides NVML's figure with a warning.
    pub memory_mib: Option<u64>,
    /// Short kind (predictor feature), e.g. "h100"; derived from the NVML name if absent.
    pub kind: Option<String>,
    /// Node name; default: the host name, if known.
    pub node: Option<String>,
    /// Skip NVML even if it is installed (tests, CPU-only hosts).
    pub no_nvml: bool,
}

/// What NVML says about one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmlDevice {
    pub uuid: String,
    pub name: String,
    pub memory_mib: u64,
}

/// Queries NVML for GPU `index`. `Ok(None)` when NVML is not loadable (no driver: a logged
/// fact, not an error); an error when NVML loads but the GPU cannot be read.
pub fn query_nvml(index: u32) -> Result<Option<NvmlDevice>> {
    let nvml = match nvml_wrapper::Nvml::init() {
        Ok(nvml) => nvml,
        Err(err) => {
            tracing::info!(%err, "NVML not available (no NVIDIA driver?): the device is described by flags");
            return Ok(None);
        }
    };
    let nvml_err = |what: &str, e: nvml_wrapper::error::NvmlError| {
        TunerError::Daemon(format!("NVML: cannot read the {what} of GPU {index}: {e}"))
    };
    let device = nvml
        .device_by_index(index)
        .map_err(|e| nvml_err("handle", e))?;
    let memory = device.memory_info().map_err(|e| nvml_err("memory", e))?;
    Ok(Some(NvmlDevice {
        uuid: device.uuid().map_err(|e| nvml_err("UUID", e))?,
        name: device.name().map_err(|e| nvml_err("name", e))?,
        memory_mib: memory.total / (1024 * 1024),
    }))
}

/// A short kind from a marketing name: "NVIDIA H100 80GB HBM3" → "h100", "Tesla K80" → "k80".
pub fn kind_from_name(name: &str) -> String {
    let generic = ["nvidia", "tesla", "geforce", "quadro", "rtx"];
    name.split_whitespace()
        .map(str::to_ascii_lowercase)
        .find(|w| !generic.contains(&w.as_str()) && w.chars().any(|c| c.is_ascii_digit()))
        .unwrap_or_else(|| name.to_ascii_lowercase().replace(' ', "-"))
}

/// The device record from NVML (if any) and the flags.
pub fn describe(flags: &DeviceFlags, nvml: Option<NvmlDevice>) -> Result<DeviceInfo> {
    keys::validate_id("device", &flags.device_id)?;
    let node = flags.node.clone().unwrap_or_default();
    let info = match nvml {
        Some(gpu) => {
            let memory_mib = match flags.memory_mib {
                Some(m) if m != gpu.memory_mib => {
                    tracing::warn!(
                        nvml = gpu.memory_mib,
                        flag = m,
                        "--memory-mib overrides the memory NVML reports"
                    );
                    m
                }
                _ => gpu.memory_mib,
            };
            DeviceInfo {
                device_id: flags.device_id.clone(),
                node,
                index: flags.index,
                kind: flags
                    .kind
                    .clone()
                    .unwrap_or_else(|| kind_from_name(&gpu.name)),
                uuid: gpu.uuid,
                name: gpu.name,
                memory_mib,
                from_nvml: true,
            }
        }
        None => {
            let memory_mib = flags.memory_mib.filter(|&m| m > 0).ok_or_else(|| {
                TunerError::Daemon(
                    "the GPU is not described by NVML (--no-nvml, or NVML found none), so --memory-mib is \
                     required (the card's total memory in MiB)"
                        .to_owned(),
                )
            })?;
            let kind = flags.kind.clone().unwrap_or_else(|| "unknown".to_owned());
            tracing::info!(memory_mib, %kind, "device described by flags, not NVML");
            DeviceInfo {
                device_id: flags.device_id.clone(),
                node,
                index: flags.index,
                uuid: String::new(),
                name: kind.clone(),
                memory_mib,
                kind,
                from_nvml: false,
            }
        }
    };
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_from_marketing_names() {
        assert_eq!(kind_from_name("NVIDIA H100 80GB HBM3"), "h100");
        assert_eq!(kind_from_name("Tesla K80"), "k80");
        assert_eq!(kind_from_name("NVIDIA GeForce RTX 4090"), "4090");
    }

    #[test]
    fn without_nvml_memory_must_come_from_flags() {
        let flags = DeviceFlags {
            device_id: "n1-gpu0".into(),
            ..Default::default()
        };
        let err = describe(&flags, None).expect_err("no memory");
        assert!(err.to_string().contains("--memory-mib"), "{err}");
        let info = describe(
            &DeviceFlags {
                memory_mib: Some(16384),
                ..flags.clone()
            },
            None,
        )
        .expect("flags suffice");
        assert_eq!((info.memory_mib, info.from_nvml), (16384, false));
        let gpu = NvmlDevice {
            uuid: "GPU-1".into(),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81559,
        };
        let info = describe(&flags, Some(gpu)).expect("nvml");
        assert_eq!(
            (info.kind.as_str(), info.from_nvml, info.memory_mib),
            ("h100", true, 81559)
        );
        assert!(
            describe(
                &DeviceFlags {
                    device_id: "a/b".into(),
                    memory_mib: Some(1),
                    ..Default::default()
                },
                None
            )
            .is_err()
        );
    }
}
