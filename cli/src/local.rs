//! This machine, as `iadeep up` registers its GPUs and `iadeep run` finds them.

/// This machine's host name (Linux: the kernel's), or "" when it cannot be read.
pub fn node_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| name.trim().to_owned())
        .unwrap_or_default()
}

/// The device id of GPU `index` of `node`: `NODE-gpuN`, unique in a cluster shared by
/// several machines (id characters only: anything else in a host name becomes `-`).
pub fn device_id(node: &str, index: u32) -> String {
    let node: String = node
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if node.is_empty() {
        format!("gpu{index}")
    } else {
        format!("{node}-gpu{index}")
    }
}

/// Whether a device registered on `device_node` is on this machine (`this_node`). A
/// device registered without a node name (a tuner started by hand without --node)
/// counts as local: nothing says otherwise.
pub fn is_local(device_node: &str, this_node: &str) -> bool {
    device_node.is_empty() || device_node == this_node
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_are_valid_ids() {
        assert_eq!(device_id("host-1.lab", 0), "host-1.lab-gpu0");
        assert_eq!(device_id("", 3), "gpu3");
        let odd = device_id("my host/x", 1);
        assert_eq!(odd, "my-host-x-gpu1");
        assert!(iadeep_state::keys::validate_id("device", &odd).is_ok());
    }

    #[test]
    fn an_unnamed_device_counts_as_local() {
        assert!(is_local("", "n1"));
        assert!(is_local("n1", "n1"));
        assert!(!is_local("n2", "n1"));
    }
}
