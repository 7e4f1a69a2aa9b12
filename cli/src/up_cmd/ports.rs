//! The loopback ports of a local cluster: checked free before anything starts (a second
//! `iadeep up` on the same ports must not join the first one's etcd), and who listens
//! on one, from Linux's /proc (to name the process in the way, and to make sure the
//! etcd `iadeep up` talks to is the one it started).

use std::collections::BTreeSet;
use std::io;
use std::net::{SocketAddr, TcpListener};

use anyhow::{Result, bail};

/// A port `iadeep up` is about to listen on, and the flag that sets it.
#[derive(Debug, Clone, Copy)]
pub struct Wanted<'a> {
    /// What listens there, e.g. "etcd's client port".
    pub what: &'a str,
    pub addr: SocketAddr,
    /// The flag that moves it, with a placeholder: "--etcd-port PORT".
    pub flag: &'a str,
}

/// Fails, naming both flags, if two of `wanted` are the same port (0, any free port,
/// excepted): checked before anything starts.
pub fn ensure_distinct(wanted: &[Wanted<'_>]) -> Result<()> {
    for (i, a) in wanted.iter().enumerate() {
        if let Some(b) = wanted[i + 1..]
            .iter()
            .find(|b| a.addr.port() != 0 && b.addr.port() == a.addr.port())
        {
            bail!(
                "cannot start the cluster: {} and {} are both port {}: give them different \
                 ports ({} and {}; 0 picks a free one)",
                a.what,
                b.what,
                a.addr.port(),
                a.flag,
                b.flag
            );
        }
    }
    Ok(())
}

/// Fails, naming every port already in use, who holds it (when /proc says) and the
/// flag that moves it, unless all of `wanted` can be bound now. Port 0 (any free
/// port) is always free.
pub fn ensure_free(wanted: &[Wanted<'_>]) -> Result<()> {
    ensure_distinct(wanted)?;
    let mut taken = Vec::new();
    for w in wanted.iter().filter(|w| w.addr.port() != 0) {
        // Bound and dropped at once: the real listener binds it a moment later.
        match TcpListener::bind(w.addr) {
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::AddrInUse => {
                let holder = holder(w.addr.port())
                    .map(|h| format!(" by {h}"))
                    .unwrap_or_default();
                taken.push(format!(
                    "  {} {} is already in use{holder}: choose another with {}",
                    w.what, w.addr, w.flag
                ));
            }
            Err(err) => bail!(
                "cannot listen on {} ({}, {}): {err}",
                w.addr,
                w.what,
                w.flag
            ),
        }
    }
    if taken.is_empty() {
        return Ok(());
    }
    bail!(
        "cannot start the cluster: a port it needs is taken\n{}\n\
         Is another `iadeep up` running? Use it (`source` the cluster.env in its --dir), \
         stop it, or give this cluster other ports (0 picks a free one).",
        taken.join("\n")
    )
}

/// The ports a cluster folder's last start listened on, kept in `DIR/ports` so that a
/// start asked for any free port (0) takes the same ones again while they are free: the
/// jobs still running from before the stop (their agents, `iadeep run`) know only those
/// addresses, and find the restarted cluster there.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LastPorts {
    pub etcd_client: u16,
    pub etcd_peer: u16,
    pub placer: u16,
}

impl LastPorts {
    pub const FILE: &'static str = "ports";

    /// What `dir` remembers; nothing (all 0) when it remembers nothing readable.
    pub fn read(dir: &std::path::Path) -> LastPorts {
        let text = std::fs::read_to_string(dir.join(Self::FILE)).unwrap_or_default();
        let mut last = LastPorts::default();
        for line in text.lines() {
            let Some((name, value)) = line.split_once('=') else {
                continue;
            };
            let Ok(port) = value.trim().parse::<u16>() else {
                continue;
            };
            match name.trim() {
                "etcd_client" => last.etcd_client = port,
                "etcd_peer" => last.etcd_peer = port,
                "placer" => last.placer = port,
                _ => {}
            }
        }
        last
    }

    /// Remembers these ports in `dir` (a failure only costs the next start's reuse).
    pub fn write(self, dir: &std::path::Path) {
        let text = format!(
            "# The ports of this folder's last `iadeep up`; port 0 takes them again while free.\n\
             etcd_client={}\netcd_peer={}\nplacer={}\n",
            self.etcd_client, self.etcd_peer, self.placer
        );
        if let Err(err) = std::fs::write(dir.join(Self::FILE), text) {
            tracing::warn!(%err, dir = %dir.display(), "cannot remember the cluster's ports");
        }
    }

    /// The address the placer tries first when it was asked for any free port (`asked`
    /// has port 0): the folder's last placer port on `asked`'s address, unless that is
    /// one of `others` (the ports given to etcd). Only a preference: when it is found
    /// taken just before the placer binds (`start_placer` in `up_cmd`), the placer takes
    /// any free port instead.
    pub fn placer_preference(self, asked: SocketAddr, others: &[u16]) -> Option<SocketAddr> {
        if asked.port() != 0 || self.placer == 0 || others.contains(&self.placer) {
            return None;
        }
        Some(SocketAddr::new(asked.ip(), self.placer))
    }
}

/// Says that the port `what` (etcd, placer) listened on at the folder's last start is
/// taken now, and what that costs.
pub fn last_port_taken(what: &str, port: u16) {
    tracing::warn!(
        port,
        "the port this folder's last {what} used is taken; picking another (jobs still \
         running from its last start will not find this cluster)"
    );
}

/// Who listens on a loopback port, as seen from /proc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listener {
    /// Nobody listens on the port yet.
    Nobody,
    /// `pid` or one of its descendants.
    Ours,
    /// Another process: its pid and command line when /proc shows them (a process of
    /// another user hides its file descriptors).
    Other(Option<String>),
}

/// Who listens on TCP `port` (IPv4 or IPv6, any local address): `pid` (or a process it
/// started), another process, or nobody. An error when /proc cannot be read.
pub fn listener(port: u16, pid: u32) -> io::Result<Listener> {
    let inodes = listening_inodes(port)?;
    if inodes.is_empty() {
        return Ok(Listener::Nobody);
    }
    let family = process_tree(pid);
    if family.iter().any(|&p| holds_any(p, &inodes)) {
        return Ok(Listener::Ours);
    }
    Ok(Listener::Other(holder_of(&inodes)))
}

/// The process listening on `port`, as "pid N (its command line)", when /proc shows it.
pub fn holder(port: u16) -> Option<String> {
    holder_of(&listening_inodes(port).ok()?)
}

fn holder_of(inodes: &BTreeSet<u64>) -> Option<String> {
    if inodes.is_empty() {
        return None;
    }
    let pid = pids().into_iter().find(|&p| holds_any(p, inodes))?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let mut text = cmdline
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    if text.chars().count() > 160 {
        text = text.chars().take(160).collect::<String>() + " ...";
    }
    Some(format!("pid {pid} ({text})"))
}

/// The inodes of the sockets in LISTEN state on `port`, from /proc/net/tcp and tcp6.
fn listening_inodes(port: u16) -> io::Result<BTreeSet<u64>> {
    let mut inodes = BTreeSet::new();
    let mut read_any = false;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match std::fs::read_to_string(table) {
            Ok(text) => {
                read_any = true;
                inodes.extend(parse_listening(&text, port));
            }
            // tcp6 is absent where IPv6 is disabled.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
    }
    if !read_any {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "/proc/net/tcp is not readable",
        ));
    }
    Ok(inodes)
}

/// The LISTEN (state 0A) sockets on `port` in a /proc/net/tcp{,6} table.
fn parse_listening(table: &str, port: u16) -> impl Iterator<Item = u64> + '_ {
    table.lines().skip(1).filter_map(move |line| {
        // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
        let fields: Vec<&str> = line.split_whitespace().collect();
        let local = fields.get(1)?;
        let (_, hex_port) = local.rsplit_once(':')?;
        let listening = *fields.get(3)? == "0A";
        let inode: u64 = fields.get(9)?.parse().ok()?;
        (listening && u16::from_str_radix(hex_port, 16).ok()? == port && inode != 0)
            .then_some(inode)
    })
}

/// The pids of all processes /proc lists.
fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether process `pid` has a file descriptor on one of the sockets `inodes`.
fn holds_any(pid: u32, inodes: &BTreeSet<u64>) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_str()?;
            target
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .any(|inode: u64| inodes.contains(&inode))
}

/// The parent of `pid`, from /proc/PID/stat ("pid (comm) state ppid ...").
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may contain spaces and parentheses: the fields follow the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// `root` and all its descendants (e.g. an etcd started by a wrapper script).
fn process_tree(root: u32) -> BTreeSet<u32> {
    let parents: Vec<(u32, u32)> = pids()
        .into_iter()
        .filter_map(|p| Some((p, parent(p)?)))
        .collect();
    let mut tree = BTreeSet::from([root]);
    loop {
        let before = tree.len();
        for &(pid, ppid) in &parents {
            if tree.contains(&ppid) {
                tree.insert(pid);
            }
        }
        if tree.len() == before {
            return tree;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};
    use std::sync::{Mutex, MutexGuard};

    /// Serialises the tests that open sockets: a child spawned by one of them holds, from
    /// its fork until its exec, every descriptor of this process, the other test's
    /// socket among them, which would then look held by another process or still bound.
    fn sockets_alone() -> MutexGuard<'static, ()> {
        static SOCKETS: Mutex<()> = Mutex::new(());
        SOCKETS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn a_table_line_in_listen_state_on_the_port_counts() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
           0: 0100007F:5CDE 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0 100 0 0 10 0\n\
           1: 0100007F:5CDE 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0 20 4 30 10 -1\n\
           2: 00000000:5CDF 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4444 1 0 100 0 0 10 0\n";
        // 0x5CDE = 23774: the listening socket, not the connection on the same port.
        assert_eq!(parse_listening(table, 23774).collect::<Vec<_>>(), [4242]);
        assert_eq!(parse_listening(table, 23775).collect::<Vec<_>>(), [4444]);
        assert_eq!(parse_listening(table, 1).count(), 0);
    }

    #[test]
    fn a_port_this_process_listens_on_is_ours_and_anothers_is_not() {
        let _alone = sockets_alone();
        let socket = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = socket.local_addr().expect("addr").port();
        let me = std::process::id();
        assert_eq!(listener(port, me).expect("/proc"), Listener::Ours);
        // A child of this process holds none of this process's sockets.
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        match listener(port, child.id()).expect("/proc") {
            Listener::Other(Some(holder)) => {
                assert!(holder.starts_with(&format!("pid {me} (")), "{holder}")
            }
            other => panic!("expected another process, got {other:?}"),
        }
        let _ = child.kill();
        let _ = child.wait();
        drop(socket);
        assert_eq!(listener(port, me).expect("/proc"), Listener::Nobody);
    }

    #[test]
    fn a_port_in_use_is_named_with_its_holder_and_flag() {
        let _alone = sockets_alone();
        let socket = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = socket.local_addr().expect("addr");
        let err = ensure_free(&[Wanted {
            what: "etcd's client port",
            addr,
            flag: "--etcd-port PORT",
        }])
        .expect_err("the port is taken");
        let text = err.to_string();
        assert!(text.contains(&addr.to_string()), "{text}");
        assert!(text.contains("--etcd-port PORT"), "{text}");
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "{text}"
        );
        drop(socket);
        ensure_free(&[Wanted {
            what: "etcd's client port",
            addr,
            flag: "--etcd-port PORT",
        }])
        .expect("free again");
    }
}
