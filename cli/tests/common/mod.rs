//! Helpers shared by the CLI test binaries (each `cli/tests/*.rs` is its own crate
//! and includes this module with `mod common;`).
// Each test binary uses a different part of it.
#![allow(dead_code)]

use std::process::{Command, Output};

/// Runs the `iadeep` binary under test with `args`, logging only warnings.
pub fn iadeep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iadeep"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run iadeep")
}

/// `iadeep state put --store STORE ARGS...`, which must succeed (its stderr shown if not).
pub fn state_put(store: &str, args: &[&str]) {
    let mut all = vec!["state", "put", "--store", store];
    all.extend_from_slice(args);
    let put = iadeep(&all);
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
}

/// Asserts that `out` succeeded (showing its stderr if not) and parses the last
/// line of its stdout, where every `--json` command prints its result.
pub fn succeeded_json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().expect("some output");
    serde_json::from_str(line).expect("last line is JSON")
}

/// GET http://addr/path with a bare HTTP/1.0 request; `None` while nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).ok()?;
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .ok()?;
    let mut body = String::new();
    conn.read_to_string(&mut body).ok()?;
    Some(body)
}

/// A loopback address with a port that was free a moment ago.
pub fn free_loopback_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    let [port] = free_ports();
    port
}

/// `N` different ports that were free a moment ago on 127.0.0.1 (see
/// [`iadeep_state::testing::free_ports`]).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let ports = iadeep_state::testing::free_ports(N).expect("free ports");
    <[u16; N]>::try_from(ports).expect("as many ports as asked")
}

/// An `iadeep up --no-nvml` cluster (one 16 GiB GPU) in its own folder, on ports
/// picked free by the test, never the defaults (a user's `iadeep up` may hold them).
/// Stopped with SIGTERM, as Ctrl-C would, when dropped.
pub struct LocalCluster {
    pub dir: std::path::PathBuf,
    pub etcd_port: u16,
    pub etcd_peer_port: u16,
    pub placer_port: u16,
    /// IADEEP_STORE and IADEEP_PLACER, from cluster.env.
    pub store: String,
    pub placer: String,
    child: Option<std::process::Child>,
}

/// The longest wait for anything in these tests (etcd starting on a busy machine).
pub const DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

impl LocalCluster {
    /// The `iadeep up` command for a cluster in `dir` on these ports, not started.
    pub fn command(
        dir: &std::path::Path,
        etcd_port: u16,
        etcd_peer_port: u16,
        placer_port: u16,
    ) -> Command {
        let mut up = Command::new(env!("CARGO_BIN_EXE_iadeep"));
        up.args(["up", "--no-nvml", "--devices", "1", "--memory-mib", "16384"])
            .arg("--dir")
            .arg(dir)
            .args(["--etcd-port", &etcd_port.to_string()])
            .args(["--etcd-peer-port", &etcd_peer_port.to_string()])
            .args(["--placer", &format!("127.0.0.1:{placer_port}")])
            .args(["--dead-task-grace-s", "2"])
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null());
        up
    }

    /// Starts a cluster in `dir` and waits for its cluster.env and its GPU's tuner; its
    /// output goes to `dir`.out and `dir`.err.
    ///
    /// The ports are free when picked, but another process may take one before `iadeep up`
    /// binds it; then `iadeep up` fails at once, naming it, and the cluster is started
    /// again on other ports (a few times at most).
    pub fn start(dir: std::path::PathBuf) -> LocalCluster {
        let mut attempt = 1;
        loop {
            match LocalCluster::try_start(dir.clone()) {
                Ok(cluster) => return cluster,
                Err(log) if attempt < 3 && log.contains("already in use") => {
                    eprintln!("a port picked for the cluster was taken meanwhile:\n{log}");
                    attempt += 1;
                }
                Err(log) => panic!("iadeep up failed:\n{log}"),
            }
        }
    }

    /// Starts a cluster in `dir` on ports picked now; what `iadeep up` printed if it exits
    /// before its GPU's tuner registers.
    fn try_start(dir: std::path::PathBuf) -> Result<LocalCluster, String> {
        LocalCluster::try_start_on(dir, free_ports())
    }

    /// A cluster in `dir` whose every port is asked as 0 (`iadeep up` picks them, or takes
    /// the folder's last ones again); `etcd_port` and `placer_port` are read back from its
    /// cluster.env, `etcd_peer_port` stays 0.
    pub fn start_on_any_ports(dir: std::path::PathBuf) -> LocalCluster {
        let mut cluster = LocalCluster::try_start_on(dir, [0, 0, 0])
            .unwrap_or_else(|log| panic!("iadeep up failed:\n{log}"));
        let port = |url: &str| -> u16 {
            let port = url.rsplit(':').next().unwrap_or_default();
            port.trim_end_matches('/')
                .parse()
                .expect("a port in the URL")
        };
        cluster.etcd_port = port(&cluster.store);
        cluster.placer_port = port(&cluster.placer);
        cluster
    }

    /// Starts a cluster in `dir` on these ports (0: any free one).
    fn try_start_on(
        dir: std::path::PathBuf,
        [etcd_port, etcd_peer_port, placer_port]: [u16; 3],
    ) -> Result<LocalCluster, String> {
        let log = |ext: &str| {
            std::fs::File::create(dir.with_extension(ext)).expect("create the log of iadeep up")
        };
        let child = LocalCluster::command(&dir, etcd_port, etcd_peer_port, placer_port)
            .stdout(log("out"))
            .stderr(log("err"))
            .spawn()
            .expect("spawn iadeep up");
        let mut cluster = LocalCluster {
            dir,
            etcd_port,
            etcd_peer_port,
            placer_port,
            store: String::new(),
            placer: String::new(),
            child: Some(child),
        };
        let env_file = cluster.dir.join("cluster.env");
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = cluster.child.as_mut().and_then(|c| c.try_wait().ok()?) {
                cluster.child = None;
                return Err(format!("exited with {status}:\n{}", cluster.log()));
            }
            if let Ok(text) = std::fs::read_to_string(&env_file) {
                for line in text.lines() {
                    if let Some(value) = line.strip_prefix("export IADEEP_STORE=") {
                        cluster.store = value.to_owned();
                    }
                    if let Some(value) = line.strip_prefix("export IADEEP_PLACER=") {
                        cluster.placer = value.to_owned();
                    }
                }
                if !cluster.store.is_empty() && !cluster.placer.is_empty() {
                    break;
                }
            }
            assert!(
                started.elapsed() < DEADLINE,
                "iadeep up wrote no cluster.env within {DEADLINE:?}:\n{}",
                cluster.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        while cluster.device_infos().is_empty() {
            if let Some(status) = cluster.child.as_mut().and_then(|c| c.try_wait().ok()?) {
                cluster.child = None;
                return Err(format!("exited with {status}:\n{}", cluster.log()));
            }
            assert!(
                started.elapsed() < DEADLINE,
                "no tuner registered its GPU within {DEADLINE:?}:\n{}",
                cluster.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Ok(cluster)
    }

    /// What `iadeep up` wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        let read =
            |ext: &str| std::fs::read_to_string(self.dir.with_extension(ext)).unwrap_or_default();
        format!("{}{}", read("out"), read("err"))
    }

    /// Whether `iadeep up` still runs.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The device records' keys (`.../devices/ID/info`) in the cluster's store.
    pub fn device_infos(&self) -> Vec<String> {
        let out = iadeep(&["state", "ls", "/iadeep/v1/devices/", "--store", &self.store]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .filter(|key| key.ends_with("/info"))
            .map(str::to_owned)
            .collect()
    }

    /// The JSON of `key` in the cluster's store, or `None` when absent.
    pub fn get(&self, key: &str) -> Option<serde_json::Value> {
        let out = iadeep(&["state", "get", key, "--store", &self.store]);
        if !out.status.success() {
            return None;
        }
        Some(serde_json::from_slice(&out.stdout).expect("iadeep state get prints JSON"))
    }

    /// `iadeep run ARGS` against this cluster (IADEEP_STORE and IADEEP_PLACER set).
    pub fn run(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_iadeep"))
            .arg("run")
            .args(args)
            .env("IADEEP_STORE", &self.store)
            .env("IADEEP_PLACER", &self.placer)
            .env("RUST_LOG", "info")
            .output()
            .expect("run iadeep run")
    }

    /// SIGTERM and the exit status (etcd stops with it: nothing is left behind). The
    /// cluster shares the test's process group, so an interrupted test run stops it too.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let started = std::time::Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if started.elapsed() > DEADLINE {
                // Its etcd outlives a SIGKILL; the next `iadeep up` on the folder stops it.
                let _ = child.kill();
                return child.wait().ok();
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.stop();
    }
}
