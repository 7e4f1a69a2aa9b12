//! Where the `etcd` server program is on this machine, for what starts one
//! (`iadeep up`, the tests' `EtcdServer`).

use std::path::PathBuf;

/// The variable that names the etcd program explicitly.
pub const ETCD_BIN_VARIABLE: &str = "ETCD_BIN";

/// What to tell a user who has no etcd.
pub const INSTALL_HINT: &str = "install Debian's etcd-server package (apt-get install etcd-server), put etcd on the PATH, or set ETCD_BIN";

/// The etcd program: `$ETCD_BIN`, else `etcd` on the `PATH`, else Debian's
/// `/usr/bin/etcd` (the etcd-server package); `None` when there is none.
pub fn find() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(ETCD_BIN_VARIABLE).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("etcd"))
                .find(|candidate| candidate.is_file())
        })
        .or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file()))
}
