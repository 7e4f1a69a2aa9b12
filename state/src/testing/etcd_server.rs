//! A real etcd server for tests.
//!
//! Tests must talk to the real thing: if `etcd` is missing, [`EtcdServer::start`]
//! fails loudly with how to install it, and never lets a test silently skip.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long etcd may take to become healthy (generous: CI machines are small and busy).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How many times a start is tried on fresh ports.
const START_ATTEMPTS: u32 = 3;

/// A running etcd on `127.0.0.1`, killed when dropped.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    data_dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    binary: PathBuf,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
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

impl EtcdServer {
    /// Starts etcd and waits until it reports healthy.
    ///
    /// Free ports are found by binding port 0 and releasing it, which can race with
    /// another test doing the same; a start that fails is therefore retried on fresh
    /// ports a few times before giving up with the last error and etcd's log.
    pub fn start() -> Result<EtcdServer, String> {
        let binary = etcd_binary()?;
        let mut last_error = String::new();
        for attempt in 1..=START_ATTEMPTS {
            let data_dir = tempfile::Builder::new()
                .prefix("iadeep-etcd-")
                .tempdir()
                .map_err(|e| format!("cannot create etcd data dir: {e}"))?;
            let client_port = free_port().map_err(|e| format!("no free port: {e}"))?;
            let peer_port = free_port().map_err(|e| format!("no free port: {e}"))?;
            let mut server = EtcdServer {
                child: None,
                data_dir,
                client_port,
                peer_port,
                binary: binary.clone(),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(err) => {
                    eprintln!("etcd start attempt {attempt}/{START_ATTEMPTS} failed: {err}");
                    last_error = err;
                }
            }
        }
        Err(last_error)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log_path = self.data_dir.path().join("etcd.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let log_err = log
            .try_clone()
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let child = Command::new(&self.binary)
            .arg("--name=iadeep-test")
            .arg(format!(
                "--data-dir={}",
                self.data_dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=iadeep-test={peer}"))
            // Short raft timings make the minimum lease TTL about one second.
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=500")
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        let healthy = self.wait_healthy(&log_path);
        if healthy.is_err() {
            self.stop();
        }
        healthy
    }

    fn wait_healthy(&mut self, log_path: &std::path::Path) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                let log = std::fs::read_to_string(log_path).unwrap_or_default();
                return Err(format!("etcd exited with {status} while starting:\n{log}"));
            }
            if self
                .http_get("/health")
                .is_some_and(|body| body.contains("\"health\":\"true\""))
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(log_path).unwrap_or_default();
        Err(format!(
            "etcd did not become healthy within {START_TIMEOUT:?}:\n{log}"
        ))
    }

    /// A plain HTTP GET on the client port (etcd serves /health and /version there).
    fn http_get(&self, path: &str) -> Option<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.client_port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
    }

    /// `127.0.0.1:PORT`, as [`crate::EtcdStore::connect`] takes it.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// `etcd://127.0.0.1:PORT`, as `--store` takes it.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoint())
    }

    /// Kills the server (as a crash would), keeping its data directory.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same ports and data.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.spawn()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
