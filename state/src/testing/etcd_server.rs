//! Real etcd servers for tests: one member ([`EtcdServer`]) or a three-member
//! cluster ([`EtcdCluster`]), on free loopback ports with temporary data
//! directories, killed on drop.
//!
//! Tests must talk to the real thing: if `etcd` is missing, starting fails loudly
//! with how to install it, and never lets a test silently skip.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long etcd may take to become healthy (generous: CI machines are small and busy).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How many times a start is tried on fresh ports.
const START_ATTEMPTS: u32 = 3;

/// `count` different loopback ports free right now: all are held while they are picked,
/// since a port released before the next is picked may be handed out again.
pub fn free_ports(count: usize) -> Result<Vec<u16>, String> {
    let held = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("no free port: {e}"))?;
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("no free port: {e}"))
}

/// The etcd binary (see [`crate::etcd_program::find`]).
fn etcd_binary() -> Result<PathBuf, String> {
    crate::etcd_program::find().ok_or_else(|| {
        format!(
            "etcd not found: {} (the README's test command, scripts/test.sh, installs it)",
            crate::etcd_program::INSTALL_HINT
        )
    })
}

/// TLS for a test server's client port (PEM files, e.g. made with `rcgen`).
#[derive(Clone, Debug)]
pub struct EtcdServerTls {
    /// The server's certificate (with `127.0.0.1` among its names) and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When given, clients must present a certificate signed by this CA
    /// (`--client-cert-auth`).
    pub client_ca: Option<PathBuf>,
}

/// A plain HTTP GET on `port` of loopback; the body, if anything answered.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// One etcd process: its ports, data directory and (while running) child.
#[derive(Debug)]
struct Member {
    name: String,
    data_dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    /// Plain-HTTP `/health` and `/metrics`, so health is checked the same way with TLS.
    metrics_port: u16,
    tls: Option<EtcdServerTls>,
    child: Option<Child>,
}

impl Member {
    /// A member on `ports`: client, peer and metrics.
    fn new(name: String, ports: [u16; 3], tls: Option<EtcdServerTls>) -> Result<Member, String> {
        let [client_port, peer_port, metrics_port] = ports;
        Ok(Member {
            name,
            data_dir: tempfile::Builder::new()
                .prefix("iadeep-etcd-")
                .tempdir()
                .map_err(|e| format!("cannot create etcd data dir: {e}"))?,
            client_port,
            peer_port,
            metrics_port,
            tls,
            child: None,
        })
    }

    fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    fn log_path(&self) -> PathBuf {
        self.data_dir.path().join("etcd.log")
    }

    fn spawn(&mut self, binary: &Path, initial_cluster: &str) -> Result<(), String> {
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let log_err = log
            .try_clone()
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let client = self.client_url();
        let peer = self.peer_url();
        let mut command = Command::new(binary);
        command
            .arg(format!("--name={}", self.name))
            .arg(format!(
                "--data-dir={}",
                self.data_dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster={initial_cluster}"))
            .arg("--initial-cluster-state=new")
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{}",
                self.metrics_port
            ))
            // Short raft timings make the minimum lease TTL about one second and
            // an election after a leader loss take about half a second.
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=500")
            .arg("--logger=zap")
            .arg("--log-level=warn");
        if let Some(tls) = &self.tls {
            command
                .arg(format!("--cert-file={}", tls.cert.display()))
                .arg(format!("--key-file={}", tls.key.display()));
            if let Some(ca) = &tls.client_ca {
                command
                    .arg("--client-cert-auth")
                    .arg(format!("--trusted-ca-file={}", ca.display()));
            }
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        self.child = Some(child);
        Ok(())
    }

    fn healthy(&self) -> bool {
        http_get(self.metrics_port, "/health").is_some_and(|b| b.contains("\"health\":\"true\""))
    }

    fn is_leader(&self) -> bool {
        http_get(self.metrics_port, "/metrics").is_some_and(|body| {
            body.lines()
                .any(|line| line.trim() == "etcd_server_is_leader 1")
        })
    }

    /// An error with etcd's log if the process already exited.
    fn exited(&mut self) -> Option<String> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        Some(format!("etcd {} exited with {status}:\n{log}", self.name))
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits until every member of `members` reports healthy.
fn wait_healthy(members: &mut [Member]) -> Result<(), String> {
    let deadline = Instant::now() + START_TIMEOUT;
    while Instant::now() < deadline {
        for member in members.iter_mut() {
            if let Some(err) = member.exited() {
                return Err(err);
            }
        }
        if members.iter().all(Member::healthy) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let logs: Vec<String> = members
        .iter()
        .map(|m| {
            format!(
                "--- {}:\n{}",
                m.name,
                std::fs::read_to_string(m.log_path()).unwrap_or_default()
            )
        })
        .collect();
    Err(format!(
        "etcd did not become healthy within {START_TIMEOUT:?}:\n{}",
        logs.join("\n")
    ))
}

/// Starts `count` members forming one cluster, retrying on fresh ports.
fn start_members(
    count: usize,
    tls: Option<EtcdServerTls>,
) -> Result<(Vec<Member>, PathBuf), String> {
    let binary = etcd_binary()?;
    let mut last_error = String::new();
    for attempt in 1..=START_ATTEMPTS {
        let ports = free_ports(3 * count)?;
        let mut members = ports
            .chunks_exact(3)
            .enumerate()
            .map(|(i, p)| Member::new(format!("iadeep-test-{i}"), [p[0], p[1], p[2]], tls.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let mut started = members
            .iter_mut()
            .try_for_each(|m| m.spawn(&binary, &initial_cluster));
        if started.is_ok() {
            started = wait_healthy(&mut members);
        }
        match started {
            Ok(()) => return Ok((members, binary)),
            Err(err) => {
                members.iter_mut().for_each(Member::stop);
                eprintln!("etcd start attempt {attempt}/{START_ATTEMPTS} failed: {err}");
                last_error = err;
            }
        }
    }
    Err(last_error)
}

/// A running single-member etcd on `127.0.0.1`, killed when dropped.
#[derive(Debug)]
pub struct EtcdServer {
    member: Member,
    binary: PathBuf,
}

impl EtcdServer {
    /// Starts etcd and waits until it reports healthy.
    ///
    /// Free ports are found by binding port 0 and releasing it, which can race with
    /// another test doing the same; a start that fails is therefore retried on fresh
    /// ports a few times before giving up with the last error and etcd's log.
    pub fn start() -> Result<EtcdServer, String> {
        Self::start_with_tls(None)
    }

    /// Starts etcd serving clients over TLS (see [`EtcdServerTls`]).
    pub fn start_with_tls(tls: Option<EtcdServerTls>) -> Result<EtcdServer, String> {
        let (mut members, binary) = start_members(1, tls)?;
        let member = members.pop().ok_or("no member started")?;
        Ok(EtcdServer { member, binary })
    }

    /// `127.0.0.1:PORT`, as [`crate::EtcdStore::connect`] takes it.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.member.client_port)
    }

    /// `etcd://127.0.0.1:PORT`, as `--store` takes it (plain-text servers).
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoint())
    }

    /// Kills the server (as a crash would), keeping its data directory.
    pub fn stop(&mut self) {
        self.member.stop();
    }

    /// Starts the server again on the same ports and data.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        let initial = format!("{}={}", self.member.name, self.member.peer_url());
        self.member.spawn(&self.binary, &initial)?;
        let healthy = wait_healthy(std::slice::from_mut(&mut self.member));
        if healthy.is_err() {
            self.stop();
        }
        healthy
    }

    /// Creates user `root` with `password`, grants it the root role and turns
    /// etcd's authentication on: from then on every request needs credentials.
    pub async fn enable_auth(&self, password: &str) -> Result<(), String> {
        let mut client = etcd_client::Client::connect([self.endpoint()], None)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        client
            .user_add("root", password, None)
            .await
            .map_err(|e| format!("user add: {e}"))?;
        client
            .user_grant_role("root", "root")
            .await
            .map_err(|e| format!("grant root role: {e}"))?;
        client
            .auth_enable()
            .await
            .map_err(|e| format!("auth enable: {e}"))?;
        Ok(())
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A running three-member etcd cluster on loopback, every member killed on drop.
///
/// Members are addressed by index (0, 1, 2). Killing one keeps quorum; killing
/// two loses it until one is restarted.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    binary: PathBuf,
    initial_cluster: String,
}

impl EtcdCluster {
    /// Starts three members and waits until all report healthy.
    pub fn start() -> Result<EtcdCluster, String> {
        let (members, binary) = start_members(3, None)?;
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        Ok(EtcdCluster {
            members,
            binary,
            initial_cluster,
        })
    }

    /// Every member's client endpoint (`127.0.0.1:PORT`), in index order.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// `etcd://A,B,C`, as `--store` takes it.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }

    /// The index of the member that is leader now, waiting up to `within` for
    /// the cluster to have one (during an election it has none).
    pub fn leader(&self, within: Duration) -> Result<usize, String> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(index) = self.leader_now() {
                return Ok(index);
            }
            if Instant::now() >= deadline {
                return Err(format!("no etcd leader within {within:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The index of the running member that says it leads, if one does.
    fn leader_now(&self) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.child.is_some() && m.is_leader())
    }

    /// Hands the leadership to member `to` (etcd's MoveLeader, sent to the leader) and
    /// waits until `to` reports it. Tests that freeze a member use it to keep the frozen
    /// one a follower: etcd before 3.4.31 and 3.5.13 lets a leader that hung and resumes
    /// revoke every lease it saw expire meanwhile, though the new leader kept them alive
    /// (etcd-io/etcd#15247, fixed by #17425), which is etcd's fault, not the client's.
    pub async fn move_leader(&self, to: usize) -> Result<(), String> {
        let target = self
            .members
            .get(to)
            .ok_or_else(|| format!("no member {to}"))?;
        let target_url = target.client_url();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if target.is_leader() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("member {to} did not become the leader"));
            }
            let Some(leader) = self.leader_now() else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let endpoint = format!("127.0.0.1:{}", self.members[leader].client_port);
            // Bounded: a member that stops answering must not hold the caller past the
            // deadline. A leader that lost its leadership meanwhile refuses; the loop asks
            // the new one.
            let moved = tokio::time::timeout(Duration::from_secs(5), async {
                let mut client = etcd_client::Client::connect([endpoint], None).await?;
                let members = client.member_list().await?;
                let Some(id) = members
                    .members()
                    .iter()
                    .find(|m| m.client_urls().contains(&target_url))
                    .map(etcd_client::Member::id)
                else {
                    return Ok(Err(format!("member {to} ({target_url}) is not listed")));
                };
                client.move_leader(id).await.map(|_| Ok(()))
            })
            .await;
            match moved {
                Ok(Ok(Err(unlisted))) => return Err(unlisted),
                Ok(Ok(Ok(()))) => {}
                Ok(Err(err)) => tracing::debug!(%err, "move leader refused; retrying"),
                Err(_) => tracing::debug!("move leader unanswered; retrying"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills member `index` (SIGKILL, as a crash or a lost machine), keeping its data.
    pub fn kill(&mut self, index: usize) {
        if let Some(member) = self.members.get_mut(index) {
            member.stop();
        }
    }

    /// Freezes member `index` (SIGSTOP, as a machine that hangs, a long GC pause or a
    /// network that drops packets): unlike a killed member, its connections stay open
    /// and requests sent to it are never answered. [`EtcdCluster::thaw`] resumes it;
    /// dropping the cluster kills it frozen or not.
    pub fn freeze(&mut self, index: usize) -> Result<(), String> {
        self.signal(index, "-STOP")
    }

    /// Freezes member `index` while it is a follower (see [`EtcdCluster::move_leader`] for
    /// why a test may need it so). The leadership is moved off it first if it leads; an
    /// election between that and the freeze could still make it the leader, so after the
    /// freeze the member that led must still say it leads (had `index` won an election, that
    /// one would have stepped down, and cannot lead again before an election timeout).
    /// Otherwise `index` is resumed and frozen again. Not airtight: a leader that has not
    /// heard of a newer term yet still says it leads, a window of one heartbeat.
    pub async fn freeze_follower(&mut self, index: usize) -> Result<(), String> {
        const ATTEMPTS: usize = 5;
        let count = self.members.len();
        for _ in 0..ATTEMPTS {
            let leader = match self.leader_now() {
                Some(leader) if leader != index => leader,
                _ => {
                    let to = (1..count)
                        .map(|step| (index + step) % count)
                        .find(|&m| self.members[m].child.is_some())
                        .ok_or_else(|| format!("no running member but {index} to lead"))?;
                    self.move_leader(to).await?;
                    to
                }
            };
            self.freeze(index)?;
            if self.members[leader].is_leader() {
                return Ok(());
            }
            self.thaw(index)?;
        }
        Err(format!(
            "member {index} could not be frozen as a follower in {ATTEMPTS} attempts"
        ))
    }

    /// Resumes member `index` after [`EtcdCluster::freeze`] (SIGCONT).
    pub fn thaw(&mut self, index: usize) -> Result<(), String> {
        self.signal(index, "-CONT")
    }

    /// Sends `signal` (as `kill` takes it) to member `index`'s process.
    fn signal(&mut self, index: usize, signal: &str) -> Result<(), String> {
        let pid = self
            .members
            .get(index)
            .and_then(|m| m.child.as_ref())
            .map(Child::id)
            .ok_or_else(|| format!("member {index} does not run"))?;
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .map_err(|e| format!("cannot run kill {signal} {pid}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill {signal} {pid} failed: {status}"))
        }
    }

    /// Starts member `index` again on its ports and data, and waits until it is healthy.
    pub fn restart(&mut self, index: usize) -> Result<(), String> {
        let member = self
            .members
            .get_mut(index)
            .ok_or_else(|| format!("no member {index}"))?;
        member.stop();
        member.spawn(&self.binary, &self.initial_cluster)?;
        wait_healthy(std::slice::from_mut(member))
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.members.iter_mut().for_each(Member::stop);
    }
}
