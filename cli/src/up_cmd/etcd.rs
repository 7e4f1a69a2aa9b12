//! The cluster's etcd: a child process on loopback ports, its data in the cluster's
//! folder so a later `iadeep up` resumes it, stopped with SIGTERM.

use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use iadeep_state::{StateStore, StoreUrl};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use super::ports::Listener;
use crate::ended::{Ended, signal_name};

/// How long etcd may take to answer after it starts (generous: small, busy machines).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a stopping etcd may take to exit before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// A running etcd started by this process.
#[derive(Debug)]
pub struct LocalEtcd {
    child: Child,
    client_port: u16,
    peer_port: u16,
    log_path: PathBuf,
    /// Where this start's output begins in the log (earlier starts' is above it).
    log_start: u64,
    pid_path: PathBuf,
}

/// etcd's data folder in the cluster's folder.
pub const DATA_DIR: &str = "etcd";
/// etcd's log in the cluster's folder.
pub const LOG_FILE: &str = "etcd.log";
/// The pid of the cluster's etcd, for the next `iadeep up` to stop an orphan.
pub const PID_FILE: &str = "etcd.pid";

/// Where and how to start etcd.
#[derive(Debug)]
pub struct EtcdLaunch<'a> {
    pub binary: &'a Path,
    /// The cluster's folder: etcd's data in `etcd/`, its log in `etcd.log`.
    pub dir: &'a Path,
    /// 0 picks a free port.
    pub client_port: u16,
    /// 0 picks a free port.
    pub peer_port: u16,
    /// A port of this cluster's that another part listens on later (the placer's; 0 for
    /// none): a picked port is never this one.
    pub keep_free: u16,
    /// The client and peer ports the folder's last start used (0: none): a port asked as
    /// 0 is one of these again while it is free ([`super::ports::LastPorts`]).
    pub last: (u16, u16),
}

/// How many times etcd is started in all, the first included, while each failure is a
/// picked port that another process took before etcd bound it.
const START_ATTEMPTS: u32 = 3;

/// The ports etcd is given: each one asked for as is, and for each 0 the port `last`
/// names for it if that one is free now, else a port free right now; never `keep_free`,
/// and never both the same. The ones chosen are held together while they are chosen,
/// since a port released before the next is picked may be handed out again (it was,
/// once, in CI, and etcd then failed to bind its second listener). Either way a port
/// asked as 0 counts as picked: taken before etcd binds it, another is picked.
fn choose_ports(client: u16, peer: u16, keep_free: u16, last: (u16, u16)) -> Result<(u16, u16)> {
    let mut held = Vec::new();
    let mut pick = |asked: u16, other: u16, last: u16| -> Result<u16> {
        if asked != 0 {
            return Ok(asked);
        }
        if last != 0 && last != other && last != keep_free {
            match TcpListener::bind(("127.0.0.1", last)) {
                Ok(listener) => {
                    held.push(listener);
                    return Ok(last);
                }
                Err(_) => super::ports::last_port_taken("etcd", last),
            }
        }
        loop {
            let listener =
                TcpListener::bind("127.0.0.1:0").context("cannot find a free loopback port")?;
            let port = listener.local_addr()?.port();
            held.push(listener);
            if port != other && port != keep_free {
                return Ok(port);
            }
        }
    };
    let client = pick(client, peer, last.0)?;
    let peer = pick(peer, client, last.1)?;
    Ok((client, peer))
}

/// etcd could not listen on `port`: another process holds it. When the port was picked
/// (0), another try on other ports may succeed.
#[derive(Debug)]
struct PortTaken {
    port: u16,
    message: String,
}

impl std::fmt::Display for PortTaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PortTaken {}

/// The port of the first "listen tcp HOST:PORT: bind: address already in use" in etcd's
/// output, the line etcd logs when a port it was given is taken.
fn taken_port(output: &str) -> Option<u16> {
    let before = &output[..output.find(": bind: address already in use")?];
    let digits = before.len() - before.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    before[before.len() - digits..].parse().ok()
}

/// The last lines of `output`, to show why etcd failed.
fn tail(output: &str) -> String {
    let lines: Vec<&str> = output.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

impl LocalEtcd {
    /// Starts etcd and waits until it answers; returns it with a store client on it.
    ///
    /// The caller has stopped an orphan on this folder ([`stop_orphan`]) and checked
    /// that the ports are free; still, etcd is only talked to once it is this
    /// process's child that listens on the client port, so that another etcd on the
    /// same port (taken in between) is never mistaken for this cluster's.
    pub async fn start(launch: EtcdLaunch<'_>) -> Result<(LocalEtcd, Arc<dyn StateStore>)> {
        let mut attempt = 1;
        loop {
            let (client_port, peer_port) = choose_ports(
                launch.client_port,
                launch.peer_port,
                launch.keep_free,
                launch.last,
            )?;
            let mut etcd = LocalEtcd::spawn(&launch, client_port, peer_port)?;
            let error = match etcd.wait_ready().await {
                Ok(store) => return Ok((etcd, store)),
                Err(error) => error,
            };
            etcd.stop().await;
            // Only a port this process picked is picked again: one the user gave stays
            // taken, and says so.
            let picked = |port: u16| {
                (port == client_port && launch.client_port == 0)
                    || (port == peer_port && launch.peer_port == 0)
            };
            let lost_a_pick = error
                .downcast_ref::<PortTaken>()
                .is_some_and(|taken| picked(taken.port));
            if !lost_a_pick || attempt >= START_ATTEMPTS {
                return Err(error);
            }
            attempt += 1;
            tracing::warn!(
                client_port,
                peer_port,
                "another process took a port picked for etcd before etcd bound it; \
                 starting it again on other ports"
            );
        }
    }

    /// Starts etcd on these ports, its output appended to the cluster's etcd.log.
    fn spawn(launch: &EtcdLaunch<'_>, client_port: u16, peer_port: u16) -> Result<LocalEtcd> {
        let pid_path = pid_path(launch.dir);
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log_path = launch.dir.join(LOG_FILE);
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        let log_start = log.seek(SeekFrom::End(0))?;
        let log_err = log.try_clone()?;
        let child = Command::new(launch.binary)
            .arg("--name=iadeep")
            .arg(format!(
                "--data-dir={}",
                launch.dir.join(DATA_DIR).display()
            ))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=iadeep={peer}"))
            // Keep an hour of history (watches resume from a recent revision) and
            // stop the reports' revisions from growing the database without bound.
            .arg("--auto-compaction-mode=periodic")
            .arg("--auto-compaction-retention=1h")
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            // If this process dies without stopping it, the next `iadeep up` does.
            .kill_on_drop(true)
            // Its own process group: a Ctrl-C at the terminal goes to `iadeep up`, which
            // stops the tuners and the placer while etcd still serves them, then etcd.
            .process_group(0)
            .spawn()
            .with_context(|| format!("cannot start {}", launch.binary.display()))?;
        if let Some(pid) = child.id() {
            std::fs::write(&pid_path, pid.to_string())
                .with_context(|| format!("cannot write {}", pid_path.display()))?;
        }
        Ok(LocalEtcd {
            child,
            client_port,
            peer_port,
            log_path,
            log_start,
            pid_path,
        })
    }

    /// Its client and peer ports.
    pub fn ports(&self) -> (u16, u16) {
        (self.client_port, self.peer_port)
    }

    /// The store URL clients use.
    pub fn url(&self) -> StoreUrl {
        StoreUrl::Etcd(iadeep_state::EtcdConfig::plain(vec![format!(
            "127.0.0.1:{}",
            self.client_port
        )]))
    }

    async fn wait_ready(&mut self) -> Result<Arc<dyn StateStore>> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let url = self.url();
        let pid = self.child.id().context("etcd exited at once")?;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(self.exited_while_starting(status));
            }
            match super::ports::listener(self.client_port, pid) {
                Ok(Listener::Ours) => {}
                Ok(Listener::Nobody) => {
                    tracing::debug!("etcd not listening yet");
                    if Instant::now() > deadline {
                        bail!(
                            "etcd did not listen on port {} within {READY_TIMEOUT:?}; the end of {}:\n{}",
                            self.client_port,
                            self.log_path.display(),
                            tail(&self.output())
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Ok(Listener::Other(holder)) => {
                    return Err(PortTaken {
                        port: self.client_port,
                        message: format!(
                        "port {} is taken by another process{}, not by the etcd this `iadeep up` \
                         started (pid {pid}); choose another port with --etcd-port PORT (0 picks \
                         a free one)",
                        self.client_port,
                        holder.map(|h| format!(", {h}")).unwrap_or_default()
                        ),
                    }
                    .into());
                }
                // Without /proc, the port check before the start and etcd staying
                // alive (checked above and after it answers) are all there is.
                Err(err) => tracing::debug!(%err, "cannot tell who listens on etcd's port"),
            }
            let attempt = async {
                let store = url.open().await?;
                store.range("/iadeep/v1/devices/").await?;
                Ok::<_, iadeep_state::StateError>(store)
            };
            match tokio::time::timeout(Duration::from_secs(3), attempt).await {
                Ok(Ok(store)) => {
                    if let Some(status) = self.child.try_wait()? {
                        bail!(
                            "an etcd answered on port {}, but the one this `iadeep up` started \
                             {}: is another `iadeep up` running? the end of {}:\n{}",
                            self.client_port,
                            Ended(status),
                            self.log_path.display(),
                            tail(&self.output())
                        );
                    }
                    return Ok(store);
                }
                Ok(Err(err)) => tracing::debug!(%err, "etcd not answering yet"),
                Err(_) => tracing::debug!("etcd not answering yet"),
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd did not answer on port {} within {READY_TIMEOUT:?}; the end of {}:\n{}",
                    self.client_port,
                    self.log_path.display(),
                    tail(&self.output())
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Why etcd exited before it answered: a [`PortTaken`] when it could not bind a port.
    fn exited_while_starting(&self, status: ExitStatus) -> anyhow::Error {
        let output = self.output();
        let message = format!(
            "etcd {} while starting (are its ports {} and {} taken? \
             see --etcd-port and --etcd-peer-port); the end of {}:\n{}",
            Ended(status),
            self.client_port,
            self.peer_port,
            self.log_path.display(),
            tail(&output)
        );
        match taken_port(&output) {
            Some(port) => PortTaken { port, message }.into(),
            None => anyhow::anyhow!(message),
        }
    }

    /// What this start of etcd wrote to the log so far (earlier starts' lines are above
    /// it, and may say why those failed).
    fn output(&self) -> String {
        let mut text = Vec::new();
        let read = std::fs::File::open(&self.log_path).and_then(|mut log| {
            log.seek(SeekFrom::Start(self.log_start))?;
            log.read_to_end(&mut text)
        });
        if let Err(err) = read {
            tracing::debug!(%err, path = %self.log_path.display(), "cannot read etcd's log");
        }
        String::from_utf8_lossy(&text).into_owned()
    }

    /// Resolves if etcd exits on its own.
    pub async fn exited(&mut self) -> std::io::Result<ExitStatus> {
        self.child.wait().await
    }

    /// SIGTERM (etcd flushes and exits), then SIGKILL if it takes too long.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            if let Err(err) = kill(Pid::from_raw(pid as i32), Signal::SIGTERM) {
                tracing::warn!(%err, pid, "cannot send SIGTERM to etcd");
            }
            match tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await {
                Ok(Ok(status)) => tracing::info!(
                    exit_code = status.code(),
                    signal = signal_name(status),
                    "etcd stopped"
                ),
                Ok(Err(err)) => tracing::warn!(%err, "cannot wait for etcd"),
                Err(_) => {
                    tracing::warn!(timeout = ?STOP_TIMEOUT, "etcd did not stop; killing it");
                    let _ = self.child.kill().await;
                }
            }
        }
        let _ = std::fs::remove_file(&self.pid_path);
    }
}

/// Where the pid of the etcd of the cluster in `dir` is kept while it runs.
fn pid_path(dir: &Path) -> PathBuf {
    dir.join(PID_FILE)
}

/// Whose etcd [`stop_orphan`] stops, for what it says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whose {
    /// Left by an earlier `iadeep up` on the folder that was killed.
    Earlier,
    /// Started by this `iadeep up`, whose start a signal abandoned.
    ThisStart,
}

/// An etcd left running by an `iadeep up` on `dir` that was killed (SIGKILL leaves no
/// time to stop it) still holds the data folder and the ports. The caller holds the
/// cluster's lock, so no live `iadeep up` owns it: stop it. The same for this start's
/// own etcd when a signal abandoned the start (`whose` says which, in the log).
pub async fn stop_orphan(dir: &Path, binary: &Path, whose: Whose) {
    let pid_path = pid_path(dir);
    let pid_path = pid_path.as_path();
    let Some(pid) = std::fs::read_to_string(pid_path)
        .ok()
        .and_then(|text| text.trim().parse::<i32>().ok())
    else {
        return;
    };
    let program = binary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Only a process that is still that etcd: a pid may have been reused since.
    let is_etcd = std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .and_then(|cmdline| {
            let argv0 = cmdline.split(|&b| b == 0).next()?.to_vec();
            Some(String::from_utf8_lossy(&argv0).ends_with(program.as_str()))
        })
        .unwrap_or(false);
    if is_etcd {
        match whose {
            Whose::Earlier => tracing::warn!(
                pid,
                "an etcd of an earlier `iadeep up` on this folder is still running; stopping it"
            ),
            Whose::ThisStart => {
                tracing::info!(pid, "the etcd this start launched still runs; stopping it");
            }
        }
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while alive(pid) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if alive(pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    let _ = std::fs::remove_file(pid_path);
}

/// Whether process `pid` runs: it exists and is not a zombie (one that exited and is
/// not reaped yet, as this process's own killed etcd is until tokio reaps it).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command's closing parenthesis: "pid (comm) S ...".
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The port comes from the line etcd 3.4 logs when a port it was given is taken
    /// (copied from a CI run's etcd.log); other failures name none.
    #[test]
    fn the_taken_port_is_read_from_etcds_bind_error() {
        let log = r#"{"level":"warn","ts":"2026-11-27T09:54:52.217Z","caller":"etcdmain/etcd.go:176","msg":"failed to start etcd","error":"listen tcp 127.0.0.1:39433: bind: address already in use"}"#;
        assert_eq!(taken_port(log), Some(39433));
        let other = r#"{"level":"fatal","msg":"discovery failed","error":"member has already been bootstrapped"}"#;
        assert_eq!(taken_port(other), None);
        assert_eq!(taken_port("bind: address already in use"), None);
    }

    /// Picked ports differ from each other and from the port kept free; given ones stay.
    #[test]
    fn picked_ports_are_distinct_and_given_ones_stay() {
        let keep_free = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a port")
            .port();
        let (client, peer) = choose_ports(0, 0, keep_free, (0, 0)).expect("ports");
        assert_ne!(client, peer);
        assert!(client != keep_free && peer != keep_free);
        assert_eq!(choose_ports(23790, 0, 0, (0, 0)).expect("ports").0, 23790);
        assert_eq!(choose_ports(0, 23800, 0, (0, 0)).expect("ports").1, 23800);
    }

    /// A port asked as 0 is the folder's last one while that is free, and never the
    /// port kept free nor the other one; a given port stays.
    #[test]
    fn the_last_ports_are_taken_again_while_free() {
        let free = || {
            TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a port")
                .port()
        };
        let (a, b) = (free(), free());
        assert_eq!(choose_ports(0, 0, 0, (a, b)).expect("ports"), (a, b));
        assert_eq!(
            choose_ports(0, 23800, 0, (a, b)).expect("ports"),
            (a, 23800)
        );
        let (client, _) = choose_ports(0, 0, a, (a, b)).expect("ports");
        assert_ne!(client, a, "never the port kept free");
        let (client, peer) = choose_ports(0, 0, 0, (a, a)).expect("ports");
        assert_ne!(client, peer);
        let holder = TcpListener::bind(("127.0.0.1", a)).expect("hold a");
        let (client, _) = choose_ports(0, 0, 0, (a, 0)).expect("ports");
        assert_ne!(client, a, "a taken one is not");
        drop(holder);
    }
}
