//! The background reporter: registration, lease, reports, assignments.
//!
//! It runs on its own thread with its own single-threaded tokio runtime, so a
//! plain synchronous training loop needs no async runtime, and an async trainer's
//! runtime never runs the agent's store traffic. Every store operation has a
//! deadline; a failure is logged once per outage and retried with back-off, and
//! the training loop never waits for any of it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::SyncSender;
use std::time::Duration;

use iadeep_proto::{
    BatchSizeAssignment, DeviceInfo, LrScalingRule, Placement, TaskReport, TaskSpec,
};
use iadeep_state::{Expect, LeaseId, LeaseKeeper, StateError, StateStore, WatchEvent, keys, typed};
use tokio::sync::{Notify, watch};

use crate::config::{AgentConfig, StoreSource};
use crate::measure::StepTimer;
use crate::memory::PeakMemory;
use crate::shared::{BatchSizeChange, ChangeReason, Control, Outcome, Shared};
use iadeep_objective::lr_factor;

const BACKOFF_START: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Errors retrying cannot fix.
fn is_permanent(err: &StateError) -> bool {
    matches!(
        err,
        StateError::InvalidUrl { .. }
            | StateError::Embedded { .. }
            | StateError::InvalidId { .. }
            | StateError::InvalidTtl(_)
    )
}

enum SessionEnd {
    Stopped(Outcome),
    LeaseLost,
}

/// The spec the agent registers its task with (the placer's, when it wrote one first,
/// wins).
fn task_spec(c: &AgentConfig) -> TaskSpec {
    TaskSpec {
        task_id: c.task_id.clone(),
        model: c.model.clone(),
        initial_batch_size: c.initial_batch_size,
        min_batch_size: c.min_batch_size,
        max_batch_size: c.max_batch_size,
        gpu_mem_request_mib: c.gpu_mem_request_mib.unwrap_or(0),
        profile: None,
        lr_rule: c.lr_rule as i32,
        total_samples: c.total_samples,
        submitted_at_unix_ms: iadeep_proto::now_unix_ms(),
        allowed_batch_sizes: Vec::new(),
        priority_class: c.priority_class as i32,
        max_slowdown: c.max_slowdown,
        // Named by the placer's Kubernetes extender only.
        kubernetes_pod: None,
    }
}

pub(crate) struct Reporter {
    config: Arc<AgentConfig>,
    shared: Arc<Shared>,
    kick: Arc<Notify>,
    control: watch::Receiver<Control>,
    memory: PeakMemory,
    timer: StepTimer,
    store: Option<Arc<dyn StateStore>>,
    device_id: String,
    seq: u64,
    last_round: Option<u64>,
    /// Whether the task's placement existed when last seen (`None`: not looked yet).
    reserved: Option<bool>,
    /// The reservation (MiB) the task's placement was last seen written with.
    reserved_mib: Option<u64>,
    /// Whether the last report failed, so an outage is logged once, not every tick.
    failing: bool,
    first: Option<SyncSender<Result<(), StateError>>>,
}

impl Reporter {
    pub(crate) fn new(
        config: Arc<AgentConfig>,
        shared: Arc<Shared>,
        kick: Arc<Notify>,
        control: watch::Receiver<Control>,
        memory: PeakMemory,
        first: SyncSender<Result<(), StateError>>,
    ) -> Reporter {
        let store = match &config.store {
            StoreSource::Handle(store) => Some(store.clone()),
            StoreSource::Url(_) => None,
        };
        Reporter {
            timer: StepTimer::new(),
            device_id: config.device_id.clone().unwrap_or_default(),
            config,
            shared,
            kick,
            control,
            memory,
            store,
            seq: 0,
            last_round: None,
            reserved: None,
            reserved_mib: None,
            failing: false,
            first: Some(first),
        }
    }

    /// Tells `connect` how the first registration went (once).
    fn tell_first(&mut self, result: Result<(), StateError>) {
        if let Some(first) = self.first.take() {
            let _ = first.send(result);
        }
    }

    fn stop_requested(&self) -> Option<Control> {
        let control = *self.control.borrow();
        (control != Control::Run).then_some(control)
    }

    /// Runs until told to stop; returns whether the task was marked finished.
    pub(crate) async fn run(mut self) -> Outcome {
        let mut backoff = BACKOFF_START;
        loop {
            if let Some(mode) = self.stop_requested() {
                return Err(format!(
                    "no session with the store when asked to {}",
                    if mode == Control::Finish {
                        "finish"
                    } else {
                        "stop"
                    }
                ));
            }
            let result = match self.open_store().await {
                Ok(store) => self.session(&store).await,
                Err(err) => Err(err),
            };
            match result {
                Ok(SessionEnd::Stopped(outcome)) => return outcome,
                Ok(SessionEnd::LeaseLost) => {
                    tracing::warn!(task = %self.config.task_id, "lease lost; registering again");
                    backoff = BACKOFF_START;
                }
                Err(err) if is_permanent(&err) => {
                    tracing::error!(task = %self.config.task_id, %err, "state store unusable; the agent stops reporting");
                    self.tell_first(Err(err));
                    return Err("state store unusable".into());
                }
                Err(err) => {
                    tracing::warn!(task = %self.config.task_id, %err, retry_in = ?backoff,
                        "state store unreachable; training goes on, retrying");
                    self.tell_first(Err(err));
                    self.shared.registered.store(false, Ordering::Relaxed);
                    let mut control = self.control.clone();
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = control.changed() => {}
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    async fn open_store(&mut self) -> Result<Arc<dyn StateStore>, StateError> {
        if let Some(store) = &self.store {
            return Ok(store.clone());
        }
        let url = match &self.config.store {
            StoreSource::Handle(store) => return Ok(store.clone()),
            StoreSource::Url(url) => url,
        };
        let store = url.open().await?;
        tracing::info!(store = %store.describe(), "agent connected to the state store");
        self.store = Some(store.clone());
        Ok(store)
    }

    /// A store call with the agent's deadline; a timeout is a transient backend error.
    async fn timed<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, StateError>>,
    ) -> Result<T, StateError> {
        match tokio::time::timeout(self.config.op_timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(StateError::Backend {
                op,
                target: self.config.task_id.clone(),
                reason: format!("no answer within {:?}", self.config.op_timeout),
            }),
        }
    }

    /// One registration and everything until the lease is lost, the watch fails or a stop.
    async fn session(&mut self, store: &Arc<dyn StateStore>) -> Result<SessionEnd, StateError> {
        let task = self.config.task_id.clone();
        let s = store.as_ref();
        let lease = self
            .timed("grant lease", s.grant_lease(self.config.lease_ttl))
            .await?;
        match self.register(store, lease).await {
            Ok(watch) => self.serve(store, lease, watch).await,
            Err(err) => {
                // Best effort: do not leave a half-registered lease behind for its TTL.
                let _ = self.timed("revoke lease", s.revoke_lease(lease)).await;
                tracing::debug!(%task, %err, "registration failed");
                Err(err)
            }
        }
    }

    /// Range, then watch, by hand, not a `Follow`: a failed watch must end this lease's session.
    async fn register(
        &mut self,
        store: &Arc<dyn StateStore>,
        lease: LeaseId,
    ) -> Result<iadeep_state::WatchStream, StateError> {
        let c = Arc::clone(&self.config);
        let s = store.as_ref();
        let spec = task_spec(&c);
        // The placer may have written the spec already; then it is the truth.
        let spec_key = keys::task_spec(&c.task_id);
        let written = self
            .timed(
                "write spec",
                s.compare_and_swap(
                    &spec_key,
                    Expect::Absent,
                    prost::Message::encode_to_vec(&spec),
                    None,
                ),
            )
            .await?;
        tracing::debug!(key = %spec_key, written = written.swapped(), "task spec");
        if let iadeep_state::CasOutcome::Conflict { current: Some(kv) } = &written
            && c.model_replaces_placed
        {
            self.replace_placed_model(s, kv).await?;
        }
        let alive = format!("pid {}", std::process::id()).into_bytes();
        self.timed(
            "put alive",
            s.put(&keys::task_alive(&c.task_id), alive, Some(lease)),
        )
        .await?;
        self.read_earlier_state(s).await;
        // The task's keys: its assignment, and its placement (whether it still holds a
        // reservation), then every change to them from that snapshot on.
        let assignment_key = keys::task_assignment(&c.task_id);
        let placement_key = keys::task_placement(&c.task_id);
        let task_prefix = keys::task_prefix(&c.task_id);
        let snapshot = self.timed("read task", s.range(&task_prefix)).await?;
        for kv in snapshot.kvs.iter().filter(|kv| kv.key == assignment_key) {
            self.on_assignment_bytes(&kv.key, &kv.value);
        }
        let placement = snapshot.kvs.iter().find(|kv| kv.key == placement_key);
        if let Some(kv) = placement {
            self.on_placement_bytes(&kv.key, &kv.value);
        }
        self.on_placement(placement.is_some());
        let watch = self
            .timed(
                "watch task",
                s.watch(&task_prefix, Some(snapshot.revision + 1)),
            )
            .await?;
        tracing::info!(task = %c.task_id, %lease, store = %s.describe(), "agent registered");
        Ok(watch)
    }

    /// What the store already knows that registration picks up, each best-effort: the
    /// placement's device (unless configured), that device's memory, and the report
    /// sequence of an earlier agent of the same task.
    async fn read_earlier_state(&mut self, s: &dyn StateStore) {
        let c = Arc::clone(&self.config);
        if c.device_id.is_none() {
            match self
                .timed(
                    "read placement",
                    typed::get::<Placement>(s, &keys::task_placement(&c.task_id)),
                )
                .await
            {
                Ok(Some((placement, _))) => self.device_id = placement.device_id,
                Ok(None) => {}
                Err(err) => tracing::warn!(%err, "cannot read the task's placement"),
            }
        }
        if !self.device_id.is_empty() {
            // The card's memory, for the out-of-memory fall-back's margin.
            match self
                .timed(
                    "read device",
                    typed::get::<DeviceInfo>(s, &keys::device_info(&self.device_id)),
                )
                .await
            {
                Ok(Some((info, _))) => self.shared.set_capacity(info.memory_mib),
                Ok(None) => {}
                Err(err) => tracing::debug!(%err, "cannot read the device's record"),
            }
        }
        if self.seq == 0 {
            // Continue the sequence of an earlier agent of the same task (a restart).
            if let Ok(Some((old, _))) = self
                .timed(
                    "read report",
                    typed::get::<TaskReport>(s, &keys::task_report(&c.task_id)),
                )
                .await
            {
                self.seq = old.seq;
            }
        }
    }

    async fn serve(
        &mut self,
        store: &Arc<dyn StateStore>,
        lease: LeaseId,
        mut watch: iadeep_state::WatchStream,
    ) -> Result<SessionEnd, StateError> {
        let mut keeper = LeaseKeeper::spawn(Arc::clone(store), lease, self.config.lease_ttl);
        self.shared.registered.store(true, Ordering::Relaxed);
        self.tell_first(Ok(()));
        let assignment_key = keys::task_assignment(&self.config.task_id);
        let placement_key = keys::task_placement(&self.config.task_id);
        let sample_every = (self.config.report_interval / 4)
            .clamp(Duration::from_millis(20), Duration::from_millis(500));
        let mut sample_tick = tokio::time::interval(sample_every);
        let mut report_tick = tokio::time::interval(self.config.report_interval);
        for tick in [&mut sample_tick, &mut report_tick] {
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        let kick = Arc::clone(&self.kick);
        let mut control = self.control.clone();
        loop {
            tokio::select! {
                _ = sample_tick.tick() => {
                    if self.sample() {
                        // The first measurement of a new configuration: the tuner waits for it.
                        self.publish(store, false).await;
                    }
                }
                _ = report_tick.tick() => {
                    self.sample();
                    self.publish(store, false).await;
                }
                _ = kick.notified() => {
                    self.sample();
                    self.publish(store, false).await;
                }
                event = watch.next() => match event {
                    Some(Ok(WatchEvent::Put(kv))) if kv.key == assignment_key => {
                        self.on_assignment_bytes(&kv.key, &kv.value);
                    }
                    Some(Ok(event)) if event.key() == placement_key => {
                        if let WatchEvent::Put(kv) = &event {
                            self.on_placement_bytes(&kv.key, &kv.value);
                        }
                        self.on_placement(matches!(event, WatchEvent::Put(_)));
                    }
                    Some(Ok(_)) => {}
                    Some(Err(err)) => return Err(err),
                    None => return Err(StateError::Backend {
                        op: "watch",
                        target: assignment_key,
                        reason: "the store closed the watch".into(),
                    }),
                },
                _ = keeper.lost() => {
                    self.shared.registered.store(false, Ordering::Relaxed);
                    return Ok(SessionEnd::LeaseLost);
                }
                _ = control.changed() => {
                    let mode = *control.borrow();
                    if mode != Control::Run {
                        keeper.stop();
                        return Ok(SessionEnd::Stopped(self.stop(store, lease, mode).await));
                    }
                }
            }
        }
    }

    /// Final report and lease revocation.
    async fn stop(
        &mut self,
        store: &Arc<dyn StateStore>,
        lease: LeaseId,
        mode: Control,
    ) -> Outcome {
        self.sample();
        let finished = mode == Control::Finish;
        let reported = self.publish(store, finished).await;
        let revoked = self
            .timed("revoke lease", store.revoke_lease(lease))
            .await
            .map_err(|err| err.to_string());
        self.shared.registered.store(false, Ordering::Relaxed);
        match (reported, revoked) {
            (true, Ok(())) => {
                tracing::info!(task = %self.config.task_id, finished, "agent stopped; lease revoked");
                Ok(())
            }
            (false, _) => Err("the final report could not be written".into()),
            (true, Err(err)) => Err(format!("the lease could not be revoked: {err}")),
        }
    }

    /// Samples the step counters and the memory probes.
    fn sample(&mut self) -> bool {
        self.sample_memory();
        match self.shared.snapshot() {
            Some(snapshot) => self.timer.sample(snapshot),
            None => false,
        }
    }

    /// The peak memory of the configuration the loop trains under now, and its batch size.
    fn sample_memory(&mut self) -> Option<(u64, u32)> {
        let generation = self.shared.generation();
        let batch_size = self.shared.batch_size();
        let peak = self.memory.sample(
            self.shared.take_recorded_peak(),
            generation,
            batch_size,
            self.shared.stepped_in_generation(),
        );
        if let Some((mib, batch_size)) = peak {
            self.shared.record_fit_peak(batch_size, mib);
        }
        peak
    }

    fn report(&mut self, finished: bool) -> TaskReport {
        let peak = self.sample_memory();
        let measured = self.timer.measured();
        let last = self.timer.last();
        let grad_noise_scale = self.shared.noise_scale();
        self.seq += 1;
        TaskReport {
            task_id: self.config.task_id.clone(),
            device_id: self.device_id.clone(),
            batch_size: measured.map_or(self.shared.batch_size(), |m| m.batch_size),
            step_time_s: measured.map_or(0.0, |m| m.step_time_s),
            samples_per_s: measured
                .filter(|m| m.step_time_s > 0.0)
                .map_or(0.0, |m| f64::from(m.batch_size) / m.step_time_s),
            peak_mem_mib: peak.map(|(mib, _)| mib),
            peak_mem_batch_size: peak.map_or(0, |(_, batch_size)| batch_size),
            grad_noise_scale,
            samples_done: last.map_or(0, |s| s.samples),
            steps_done: last.map_or(0, |s| s.steps),
            oom_batch_size: self.shared.oom_batch_size(),
            finished,
            seq: self.seq,
            reported_at_unix_ms: iadeep_proto::now_unix_ms(),
            assignment_round: measured.map_or(0, |m| m.round),
        }
    }

    /// Writes a report; true when it was stored.
    async fn publish(&mut self, store: &Arc<dyn StateStore>, finished: bool) -> bool {
        let report = self.report(finished);
        let key = keys::task_report(&self.config.task_id);
        match self
            .timed(
                "put report",
                typed::put(store.as_ref(), &key, &report, None),
            )
            .await
        {
            Ok(_) => {
                if self.failing {
                    tracing::info!(task = %self.config.task_id, seq = report.seq, "reports resumed");
                    self.failing = false;
                }
                self.shared
                    .reports_published
                    .fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(err) => {
                if !self.failing {
                    tracing::warn!(task = %self.config.task_id, %err,
                        "cannot publish report; training goes on, will retry");
                    self.failing = true;
                }
                false
            }
        }
    }

    /// Writes the agent's model name into the spec the launcher wrote (which named the
    /// model after the script), keeping everything else the placer reserved for.
    async fn replace_placed_model(
        &self,
        s: &dyn StateStore,
        kv: &iadeep_state::KeyValue,
    ) -> Result<(), StateError> {
        let c = &self.config;
        let mut spec = typed::decode::<TaskSpec>(kv)?;
        if c.model.is_empty() || spec.model == c.model {
            return Ok(());
        }
        let placed = std::mem::replace(&mut spec.model, c.model.clone());
        let swapped = self
            .timed(
                "rename model",
                s.compare_and_swap(
                    &kv.key,
                    Expect::ModRevision(kv.mod_revision),
                    prost::Message::encode_to_vec(&spec),
                    None,
                ),
            )
            .await?
            .swapped();
        if swapped {
            tracing::info!(task = %c.task_id, model = %c.model, %placed,
                "the task spec names the script's model, not the launcher's default");
        } else {
            // Written meanwhile (the placer): the next registration tries again.
            tracing::debug!(task = %c.task_id, "task spec changed while renaming its model");
        }
        Ok(())
    }

    fn on_assignment_bytes(&mut self, key: &str, bytes: &[u8]) {
        match typed::decode_bytes::<BatchSizeAssignment>(key, bytes) {
            Ok(assignment) => self.on_assignment(assignment),
            Err(err) => tracing::warn!(%err, "ignoring an assignment that does not decode"),
        }
    }

    /// The placement as stored: the memory it reserved for the task.
    fn on_placement_bytes(&mut self, key: &str, bytes: &[u8]) {
        match typed::decode_bytes::<Placement>(key, bytes) {
            // Only news moves the limit: a re-registration reading the same placement
            // must not undo the bounds of the assignments applied since.
            Ok(placement) => {
                let reserved = placement.reserved_mem_mib;
                if self.reserved_mib.replace(reserved) != Some(reserved) {
                    self.shared.set_reserved(reserved);
                }
            }
            Err(err) => tracing::warn!(%err, "ignoring a placement that does not decode"),
        }
    }

    /// The task's placement exists (`placed`) or not, as just seen. Losing it while the
    /// task runs, or getting it back, is a change the training loop hears of through
    /// `poll_change()` (the batch size stays as it is). An agent that never had one
    /// (started without a placer) says nothing.
    fn on_placement(&mut self, placed: bool) {
        let was = self.reserved.replace(placed);
        let reason = match (was, placed) {
            (Some(true), false) => {
                tracing::warn!(task = %self.config.task_id, device = %self.device_id,
                    "the task's placement was deleted while it runs: its GPU memory is not reserved \
                     until the placer admits it again");
                ChangeReason::ReservationLost
            }
            (Some(false), true) => {
                tracing::info!(task = %self.config.task_id, device = %self.device_id,
                    "the task holds a reservation again");
                ChangeReason::ReservationRestored
            }
            _ => return,
        };
        self.shared.offer(BatchSizeChange {
            batch_size: self.shared.batch_size(),
            lr_factor: self.shared.lr_factor(),
            round: self.shared.round(),
            reason,
            memory_bound_mib: None,
        });
    }

    fn on_assignment(&mut self, a: BatchSizeAssignment) {
        let c = &self.config;
        // Before the round check: an eviction counts whatever round it carries.
        if a.evict {
            let reason = Some(a.evict_reason.trim())
                .filter(|r| !r.is_empty())
                .unwrap_or("evicted by the placer")
                .to_owned();
            if self.shared.set_evicted(reason.clone()) {
                tracing::warn!(task = %c.task_id, round = a.round, %reason,
                    "evicted: the training loop hears of it at its next poll_change(); \
                     it should checkpoint and leave");
            }
            return;
        }
        if self.shared.evicted().is_some() {
            tracing::debug!(round = a.round, "evicted; ignoring a later assignment");
            return;
        }
        if self.last_round.is_some_and(|seen| a.round <= seen) {
            tracing::debug!(round = a.round, "ignoring an assignment of an old round");
            return;
        }
        if a.batch_size == 0 {
            tracing::warn!(round = a.round, "ignoring an assignment with batch size 0");
            return;
        }
        self.last_round = Some(a.round);
        let batch_size = c.clamp(a.batch_size);
        let given = a.lr_factor.is_finite() && a.lr_factor > 0.0;
        let lr_factor = if given && batch_size == a.batch_size {
            a.lr_factor
        } else {
            // No factor from the tuner, or a size we had to clamp: use the rule.
            let rule = LrScalingRule::try_from(a.lr_rule)
                .ok()
                .filter(|r| *r != LrScalingRule::Unspecified)
                .unwrap_or(c.lr_rule);
            lr_factor(
                rule,
                c.initial_batch_size,
                batch_size,
                self.shared.noise_scale(),
            )
        };
        if batch_size != a.batch_size {
            tracing::warn!(
                assigned = a.batch_size,
                batch_size,
                min = c.min_batch_size,
                max = c.max_batch_size,
                "assignment outside the task's bounds; clamped"
            );
        }
        let change = BatchSizeChange {
            batch_size,
            lr_factor,
            round: a.round,
            reason: ChangeReason::Assignment,
            // The bound holds for the assigned size and below; a size clamped up has none.
            memory_bound_mib: a.memory_bound_mib.filter(|_| batch_size <= a.batch_size),
        };
        if self.shared.steps() == 0 {
            // Before the first step (the placer wrote the task's starting assignment, or
            // shrank it to make room): the loop must start at this size, not at m0, or its
            // first step could take more memory than the placement made room for. `connect`
            // returns after the registration that reads it, so the loop's first
            // `batch_size()` already sees it; it stays pending too, so a loop that builds
            // its data loader from `poll_change()` gets it once.
            self.shared.apply(&change);
            tracing::info!(task = %c.task_id, round = a.round, batch_size, lr_factor,
                "starting assignment applied before the first step");
        } else {
            tracing::info!(task = %c.task_id, round = a.round, batch_size, lr_factor,
                "assignment received; applied at the trainer's next poll_change()");
        }
        self.shared.offer(change);
    }
}
