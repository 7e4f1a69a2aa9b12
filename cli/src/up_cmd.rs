//! `iadeep up`: a whole cluster on one machine, in the foreground: etcd (a child
//! process), the placer and one tuner per GPU (tasks of this process).
//!
//! The placer and the tuners run as tasks of this process rather than as child
//! `iadeep` processes: they share one etcd client, their logs come out as one
//! stream, a failure of any of them is an error value here (not an exit status to
//! interpret), and Ctrl-C stops them in order (tuners delete their device records,
//! the placer drains, then etcd flushes) with nothing left behind. etcd is another
//! program, so it is a child process; its data folder makes a later `iadeep up` on
//! the same `--dir` resume the stored state.

mod etcd;
mod ports;

use std::fs::File;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use iadeep_placer::{Daemon as PlacerDaemon, DaemonConfig, ModelledMemory};
use iadeep_proto::DeviceInfo;
use iadeep_state::{StateStore, StoreUrl};
use iadeep_tuner::daemon::{self as tuner, DaemonParams, DeviceFlags};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::placer_cmd::{GraceArgs, PolicyArgs};
use etcd::{EtcdLaunch, LocalEtcd};

/// Start a local iadeep cluster in the foreground: etcd, the placer and one batch-size
/// tuner per GPU.
///
/// Prints the store URL and placer address and writes them to
/// DIR/cluster.env (`source DIR/cluster.env`, then `iadeep run --batch-size N -- python
/// train.py`). Ctrl-C or SIGTERM stops everything; `iadeep up` again on the same --dir
/// resumes the stored state (placements, tuner observations, predictor samples).
#[derive(Debug, Args)]
pub struct UpArgs {
    /// The cluster's folder: etcd's data, its log, cluster.env. Default: iadeep's folder
    /// in your data directory, e.g. ~/.local/share/iadeep/cluster.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// etcd's client port on 127.0.0.1 (0: the folder's last one while free, else any free
    /// one). Not etcd's usual 2379, which Debian's etcd-server service takes.
    #[arg(long, value_name = "PORT", default_value_t = 23790)]
    etcd_port: u16,
    /// etcd's peer port on 127.0.0.1 (0: the folder's last one while free, else any free
    /// one).
    #[arg(long, value_name = "PORT", default_value_t = 23800)]
    etcd_peer_port: u16,
    /// The etcd program. Default: $ETCD_BIN, else `etcd` on the PATH, else /usr/bin/etcd.
    #[arg(long, value_name = "PATH")]
    etcd_bin: Option<PathBuf>,
    /// The placer's gRPC address (port 0: the folder's last one while free, else any free
    /// one).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50061")]
    placer: SocketAddr,
    /// Do not use NVML: describe the GPUs with --devices and --memory-mib (machines
    /// without an NVIDIA GPU, tests).
    #[arg(long, requires_all = ["devices", "memory_mib"])]
    no_nvml: bool,
    /// Number of GPUs. With NVML: the first N (default: all it finds).
    #[arg(long, value_name = "N")]
    devices: Option<u32>,
    /// Memory of each GPU, MiB. With NVML: overrides what it reports.
    #[arg(long, value_name = "MIB")]
    memory_mib: Option<u64>,
    /// Short GPU kind for the predictor (e.g. a100). Default: from NVML's name, or
    /// "unknown".
    #[arg(long, value_name = "K")]
    kind: Option<String>,
    #[command(flatten)]
    graces: GraceArgs,
    #[command(flatten)]
    policy: PolicyArgs,
}

/// What the cluster writes for its users to `source`.
const CLUSTER_ENV: &str = "cluster.env";
/// The lock one `iadeep up` at a time holds on its folder.
const LOCK_FILE: &str = "up.lock";

/// The cluster's folder, held by one `iadeep up` at a time.
#[derive(Debug)]
struct ClusterDir {
    path: PathBuf,
    /// The outermost folder this `iadeep up` created for `path` (`path` itself, or an
    /// ancestor), if it created one: removed again when the cluster fails to start, so a
    /// mistyped `--dir` or a busy port leaves nothing behind.
    created: Option<PathBuf>,
    /// Whether the folder held etcd's data before this start: a start that fails on a
    /// folder without it removes the data its etcd began (tens of MB, no cluster's).
    had_etcd_data: bool,
    /// Holds the lock; released when the process ends, however it ends.
    _lock: File,
}

impl ClusterDir {
    fn open(path: PathBuf) -> Result<ClusterDir> {
        let created = path
            .ancestors()
            .take_while(|p| !p.as_os_str().is_empty() && !p.exists())
            .last()
            .map(PathBuf::from);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let lock_path = path.join(LOCK_FILE);
        let mut lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .with_context(|| format!("cannot open {}", lock_path.display()))?;
        if lock.try_lock().is_err() {
            let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
            bail!(
                "another `iadeep up` runs on {} ({}); stop it first, or use another --dir",
                path.display(),
                holder.trim()
            );
        }
        lock.set_len(0)?;
        write!(lock, "pid {}", std::process::id())?;
        Ok(ClusterDir {
            had_etcd_data: path.join(etcd::DATA_DIR).exists(),
            path,
            created,
            _lock: lock,
        })
    }

    /// After a failed start: removes what this start wrote into a folder it created, then
    /// the folder and the ancestors it created while they are empty (never recursively:
    /// another `iadeep up` may have begun a folder beside it meanwhile). A folder that
    /// existed before is kept, less the etcd data this start began there.
    fn discard_if_new(&self) {
        let remove_data = || {
            let data = self.path.join(etcd::DATA_DIR);
            if data.exists()
                && let Err(err) = std::fs::remove_dir_all(&data)
            {
                tracing::warn!(dir = %data.display(), %err, "cannot remove the etcd data this start began");
            }
        };
        let Some(created) = &self.created else {
            if !self.had_etcd_data {
                remove_data();
            }
            return;
        };
        remove_data();
        for file in [
            CLUSTER_ENV,
            etcd::LOG_FILE,
            etcd::PID_FILE,
            ports::LastPorts::FILE,
        ] {
            let _ = std::fs::remove_file(self.path.join(file));
        }
        let _ = std::fs::remove_file(self.path.join(format!("{CLUSTER_ENV}.tmp")));
        // Last: once it is gone another `iadeep up` may lock the folder and begin.
        let _ = std::fs::remove_file(self.path.join(LOCK_FILE));
        for dir in self.path.ancestors() {
            if let Err(err) = std::fs::remove_dir(dir) {
                tracing::info!(dir = %dir.display(), %err, "kept a folder this start created: not empty");
                return;
            }
            if dir == created.as_path() {
                tracing::info!(dir = %created.display(), "removed the folder this start created");
                return;
            }
        }
    }

    fn env_path(&self) -> PathBuf {
        self.path.join(CLUSTER_ENV)
    }

    /// Writes cluster.env whole (a reader never sees half of it).
    fn write_env(&self, store: &StoreUrl, placer: &str) -> Result<()> {
        let text = format!(
            "# Written by `iadeep up` (pid {}); removed when it stops.\n\
             export IADEEP_STORE={store}\n\
             export IADEEP_PLACER={placer}\n",
            std::process::id()
        );
        let tmp = self.path.join(format!("{CLUSTER_ENV}.tmp"));
        std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, self.env_path())
            .with_context(|| format!("cannot write {}", self.env_path().display()))
    }
}

/// The GPUs to tune: from NVML, or from the flags with --no-nvml.
fn describe_devices(args: &UpArgs, node: &str) -> Result<Vec<DeviceInfo>> {
    let flags = |index: u32| DeviceFlags {
        device_id: crate::local::device_id(node, index),
        index,
        memory_mib: args.memory_mib,
        kind: args.kind.clone(),
        node: Some(node.to_owned()),
        no_nvml: args.no_nvml,
    };
    let count = if args.no_nvml {
        args.devices.unwrap_or(0)
    } else {
        let nvml = nvml_wrapper::Nvml::init().context(
            "NVML is not available (no NVIDIA driver?): describe the GPUs with \
             --no-nvml --devices N --memory-mib M",
        )?;
        let found = nvml.device_count().context("NVML cannot count the GPUs")?;
        match args.devices {
            Some(n) if n > found => bail!("--devices {n}, but NVML finds only {found} GPUs"),
            Some(n) => n,
            None => found,
        }
    };
    if count == 0 {
        bail!("no GPU to run a tuner for (--devices must be at least 1)");
    }
    (0..count)
        .map(|index| {
            let flags = flags(index);
            let nvml = if args.no_nvml {
                None
            } else {
                tuner::device::query_nvml(index)?
            };
            Ok(tuner::device::describe(&flags, nvml)?)
        })
        .collect()
}

/// The ports the cluster needs, each with the flag that moves it.
fn wanted_ports(args: &UpArgs) -> [ports::Wanted<'static>; 3] {
    let loopback = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    [
        ports::Wanted {
            what: "etcd's client port",
            addr: loopback(args.etcd_port),
            flag: "--etcd-port PORT",
        },
        ports::Wanted {
            what: "etcd's peer port",
            addr: loopback(args.etcd_peer_port),
            flag: "--etcd-peer-port PORT",
        },
        ports::Wanted {
            what: "the placer's address",
            addr: args.placer,
            flag: "--placer 127.0.0.1:PORT",
        },
    ]
}

pub async fn run(args: UpArgs) -> Result<ExitCode> {
    // Caught from here on: a Ctrl-C while the cluster starts abandons the start, rather
    // than ending this process and leaving etcd and the folder behind.
    let mut shutdown = crate::signals::Shutdown::install().context("cannot catch signals")?;
    let etcd_bin = match &args.etcd_bin {
        Some(path) => path.clone(),
        None => iadeep_state::etcd_program::find().with_context(|| {
            format!(
                "etcd not found: {}",
                iadeep_state::etcd_program::INSTALL_HINT
            )
        })?,
    };
    let node = crate::local::node_name();
    ports::ensure_distinct(&wanted_ports(&args))?;
    let devices = describe_devices(&args, &node)?;
    let placer = args.policy.placer(&args.graces)?;
    let dir = ClusterDir::open(
        args.dir
            .clone()
            .unwrap_or_else(|| iadeep_state::embedded_data_dir().join("cluster")),
    )?;
    // Before the last ports are looked at: an orphan etcd of this folder holds them.
    etcd::stop_orphan(&dir.path, &etcd_bin, etcd::Whose::Earlier).await;
    let last = ports::LastPorts::read(&dir.path);
    // The start may take minutes (etcd's attempts): a signal meanwhile abandons it, and
    // what it started stops with it (etcd is killed on drop).
    let started = tokio::select! {
        started = start(&args, &dir, &etcd_bin, last, placer, devices) => Some(started),
        () = shutdown.wait() => None,
    };
    let mut running = match started {
        Some(Ok(running)) => running,
        Some(Err(err)) => {
            dir.discard_if_new();
            return Err(err);
        }
        None => {
            // The start's etcd was killed as the start was dropped: wait until it is
            // gone (and its pid file with it) before its folder is cleared.
            etcd::stop_orphan(&dir.path, &etcd_bin, etcd::Whose::ThisStart).await;
            dir.discard_if_new();
            tracing::info!("interrupted while starting; stopped");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let outcome = tokio::select! {
        () = shutdown.wait() => {
            tracing::info!("stopping the cluster");
            Ok(ExitCode::SUCCESS)
        }
        failure = running.failed() => Err(failure),
    };
    let _ = std::fs::remove_file(dir.env_path());
    running.stop().await;
    outcome
}

/// Starts etcd, the placer and the tuners on `dir`, writes cluster.env and says so: the
/// cluster is up when this returns `Ok`.
async fn start(
    args: &UpArgs,
    dir: &ClusterDir,
    etcd_bin: &std::path::Path,
    last: ports::LastPorts,
    placer: iadeep_placer::Placer,
    devices: Vec<DeviceInfo>,
) -> Result<Running> {
    // Fail now, naming the port and its flag, if another cluster (or anything else)
    // holds one: a second `iadeep up` on the default ports must not run next to the
    // first one's etcd (see also LocalEtcd::start).
    ports::ensure_free(&wanted_ports(args))?;
    let placer_preference =
        last.placer_preference(args.placer, &[args.etcd_port, args.etcd_peer_port]);

    let (etcd, store) = LocalEtcd::start(EtcdLaunch {
        binary: etcd_bin,
        dir: &dir.path,
        client_port: args.etcd_port,
        peer_port: args.etcd_peer_port,
        keep_free: placer_preference.map_or(args.placer.port(), |addr| addr.port()),
        last: (last.etcd_client, last.etcd_peer),
    })
    .await?;
    let store_url = etcd.url();
    let etcd_ports = etcd.ports();
    tracing::info!(store = %store_url, dir = %dir.path.display(), "etcd ready");
    let running = Running::start(etcd, store, placer, args, placer_preference, devices).await;
    let running = match running {
        Ok(running) => running,
        Err((etcd, err)) => {
            etcd.stop().await;
            return Err(err);
        }
    };
    let placer_url = format!("http://{}", running.placer.grpc_addr());
    if let Err(err) = dir.write_env(&store_url, &placer_url) {
        running.stop().await;
        return Err(err);
    }
    ports::LastPorts {
        etcd_client: etcd_ports.0,
        etcd_peer: etcd_ports.1,
        placer: running.placer.grpc_addr().port(),
    }
    .write(&dir.path);
    println!(
        "iadeep cluster up: {} GPU(s) ({}), store {store_url}, placer {placer_url}",
        running.device_ids.len(),
        running.device_ids.join(", ")
    );
    println!("export IADEEP_STORE={store_url}");
    println!("export IADEEP_PLACER={placer_url}");
    println!(
        "(also in {}: `source` it, then `iadeep run --batch-size N -- python train.py`; Ctrl-C stops the cluster)",
        dir.env_path().display()
    );

    Ok(running)
}

/// Starts the placer on `args.placer`, or on `preference` (the folder's last port, when
/// any free port was asked for) while that is free: a preference taken by now is said
/// and given up for any free port rather than failing the start.
async fn start_placer(
    store: &Arc<dyn StateStore>,
    placer: iadeep_placer::Placer,
    args: &UpArgs,
    preference: Option<SocketAddr>,
) -> Result<PlacerDaemon> {
    // Checked as late as can be: etcd's start took seconds, in which another program may
    // have taken it. Only a port found taken gives the preference up; any other failure
    // to start is the placer's, and said as such.
    let grpc = match preference {
        Some(preferred) if std::net::TcpListener::bind(preferred).is_ok() => preferred,
        Some(preferred) => {
            ports::last_port_taken("placer", preferred.port());
            args.placer
        }
        None => args.placer,
    };
    let (dead_task_grace, unstarted_task_grace) = args.graces.durations();
    let config = DaemonConfig {
        grpc,
        extender: None,
        metrics: None,
        dead_task_grace,
        unstarted_task_grace,
        tls: None,
    };
    PlacerDaemon::start(store.clone(), placer, Arc::new(ModelledMemory), config)
        .await
        .context("cannot start the placer")
}

/// The placer and the tuners, on the cluster's etcd.
struct Running {
    etcd: LocalEtcd,
    /// The store on `etcd`.
    store: Arc<dyn StateStore>,
    placer: PlacerDaemon,
    tuners: JoinSet<(String, iadeep_tuner::Result<()>)>,
    device_ids: Vec<String>,
    stop_tuners: watch::Sender<bool>,
}

impl Running {
    /// Names the jobs whose agents still run as the cluster stops: they go on at their
    /// last batch sizes, untuned, their agents retrying the store's address, and find the
    /// cluster again when `iadeep up` starts on the same folder (whose ports it takes
    /// again where they are free, also after port 0).
    async fn say_running_jobs(&self) {
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            self.store.range(iadeep_state::keys::TASKS),
        );
        let tasks = match read.await {
            Ok(Ok(tasks)) => tasks,
            Ok(Err(err)) => {
                tracing::warn!(%err, "cannot tell which jobs still run");
                return;
            }
            Err(_) => {
                tracing::warn!("cannot tell which jobs still run: the store did not answer");
                return;
            }
        };
        let running: Vec<String> = tasks
            .kvs
            .iter()
            .filter_map(|kv| match iadeep_state::keys::KeyKind::parse(&kv.key) {
                iadeep_state::keys::KeyKind::TaskAlive { task } => Some(task),
                _ => None,
            })
            .collect();
        if !running.is_empty() {
            tracing::warn!(jobs = running.len(), ids = %running.join(", "),
                "jobs still run: they go on untuned at their last batch sizes until \
                 `iadeep up` starts again on this --dir, whose ports it takes again");
        }
    }

    /// Starts the placer and a tuner per device; on failure hands etcd back to stop.
    async fn start(
        etcd: LocalEtcd,
        store: Arc<dyn StateStore>,
        placer: iadeep_placer::Placer,
        args: &UpArgs,
        placer_preference: Option<SocketAddr>,
        devices: Vec<DeviceInfo>,
    ) -> std::result::Result<Running, (LocalEtcd, anyhow::Error)> {
        let placer = match start_placer(&store, placer, args, placer_preference).await {
            Ok(placer) => placer,
            Err(err) => return Err((etcd, err)),
        };
        let (stop_tuners, stop_rx) = watch::channel(false);
        let mut tuners = JoinSet::new();
        let mut device_ids = Vec::new();
        for info in devices {
            let daemon =
                match tuner::Daemon::new(store.clone(), info.clone(), DaemonParams::default()) {
                    Ok(daemon) => daemon,
                    Err(err) => {
                        placer.shutdown().await;
                        return Err((
                            etcd,
                            anyhow::Error::new(err).context("cannot start a tuner"),
                        ));
                    }
                };
            tracing::info!(device = %info.device_id, memory_mib = info.memory_mib, kind = %info.kind,
                from_nvml = info.from_nvml, "tuner starting");
            let mut stop = stop_rx.clone();
            let device = info.device_id.clone();
            device_ids.push(device.clone());
            tuners.spawn(async move {
                let shutdown = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                (device, daemon.run(shutdown).await)
            });
        }
        Ok(Running {
            etcd,
            store,
            placer,
            tuners,
            device_ids,
            stop_tuners,
        })
    }

    /// Resolves when a part stops on its own: etcd, the placer or a tuner.
    async fn failed(&mut self) -> anyhow::Error {
        tokio::select! {
            status = self.etcd.exited() => match status {
                Ok(status) => anyhow::anyhow!("etcd {}", crate::ended::Ended(status)),
                Err(err) => anyhow::anyhow!("cannot watch etcd: {err}"),
            },
            err = self.placer.failed() => anyhow::Error::new(err).context("the placer stopped"),
            Some(joined) = self.tuners.join_next() => match joined {
                Ok((device, Ok(()))) => anyhow::anyhow!("the tuner of {device} stopped"),
                Ok((device, Err(err))) => {
                    anyhow::Error::new(err).context(format!("the tuner of {device} failed"))
                }
                Err(err) => anyhow::anyhow!("a tuner panicked: {err}"),
            },
        }
    }

    /// Tuners first (they delete their device records), then the placer, then etcd.
    async fn stop(mut self) {
        self.say_running_jobs().await;
        let _ = self.stop_tuners.send(true);
        while let Some(joined) = self.tuners.join_next().await {
            match joined {
                Ok((device, Ok(()))) => tracing::info!(%device, "tuner stopped"),
                Ok((device, Err(err))) => {
                    tracing::warn!(%device, %err, "tuner ended with an error")
                }
                Err(err) => tracing::warn!(%err, "tuner task failed"),
            }
        }
        self.placer.shutdown().await;
        self.etcd.stop().await;
    }
}
