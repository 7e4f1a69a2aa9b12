//! `iadeep status` as text (at most [`WIDTH`] columns unless wide) and as JSON.

use serde_json::{Value, json};

use super::read::{DeviceRow, JobRow, Snapshot};

/// Widest line of the text output: fits a terminal split in two, and a CI log.
pub const WIDTH: usize = 100;

/// `text` cut to `width` characters, with `…` where it was cut.
fn cut(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        text.to_owned()
    } else {
        let mut out: String = text.chars().take(width.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

/// A task id cut to `width` characters in its middle: ids of one script differ at their
/// end (`iadeep run` names a task `SCRIPT-UNIXTIME-PID`), so cutting the end would show
/// two jobs of `train.py` as the same `train-17956…`.
fn cut_id(id: &str, width: usize) -> String {
    let count = id.chars().count();
    if count <= width || width < 3 {
        return cut(id, width);
    }
    let tail = width / 2;
    let head = width - tail - 1;
    let mut out: String = id.chars().take(head).collect();
    out.push('…');
    out.extend(id.chars().skip(count - tail));
    out
}

/// How the text view fits its lines: cut to [`WIDTH`] columns (the default), or `wide`:
/// nothing cut, and the id columns as wide as their longest id, so every task id can be
/// copied into another command (`iadeep state get`, a release).
#[derive(Clone, Copy, Debug, Default)]
pub struct Layout {
    pub wide: bool,
}

impl Layout {
    fn cut(self, text: &str, width: usize) -> String {
        if self.wide {
            text.to_owned()
        } else {
            cut(text, width)
        }
    }

    fn cut_id(self, id: &str, width: usize) -> String {
        if self.wide {
            id.to_owned()
        } else {
            cut_id(id, width)
        }
    }

    /// The width of a column of `ids`: `fitted` when fitted, else as wide as the longest.
    fn column<'a>(self, fitted: usize, ids: impl Iterator<Item = &'a str>) -> usize {
        if self.wide {
            longest(ids).max(fitted)
        } else {
            fitted
        }
    }
}

/// Characters of the longest of `ids` (0 for none).
fn longest<'a>(ids: impl Iterator<Item = &'a str>) -> usize {
    ids.map(|id| id.chars().count()).max().unwrap_or(0)
}

/// Fitted widths of the id columns: a GPU's in its table, a job's and its GPU's in theirs.
const DEVICE_ID_W: usize = 16;
const JOB_ID_W: usize = 16;
const JOB_GPU_W: usize = 12;

/// Whether a job's PD is measured against a solo time estimated next to co-runners.
fn pd_estimated(job: &JobRow) -> bool {
    job.pd_basis == Some("estimated")
}

/// Seconds as `4s`, `3m`, `2h`, `5d`: how long ago, in the fewest characters.
fn age(seconds: f64) -> String {
    let s = seconds.max(0.0);
    match s {
        s if s < 120.0 => format!("{s:.0}s"),
        s if s < 7200.0 => format!("{:.0}m", s / 60.0),
        s if s < 172_800.0 => format!("{:.0}h", s / 3600.0),
        s => format!("{:.0}d", s / 86_400.0),
    }
}

fn opt<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn age_since(now_ms: i64, at_ms: i64) -> f64 {
    (now_ms - at_ms) as f64 / 1000.0
}

/// The text view: GPUs, then jobs, then what is missing or damaged.
pub fn text(snapshot: &Snapshot, layout: Layout) -> Vec<String> {
    let mut lines = vec![format!(
        "{} at revision {}",
        layout.cut(&snapshot.store, 60),
        snapshot.revision
    )];
    lines.push(String::new());
    if snapshot.devices.is_empty() {
        lines.push(
            "No GPUs registered: no tuner runs against this store (start one with `iadeep up`"
                .to_owned(),
        );
        lines.push("or `iadeep tuner --device ID`), or --store names another cluster.".to_owned());
    } else {
        lines.extend(device_lines(snapshot, layout));
    }
    lines.push(String::new());
    if snapshot.jobs.is_empty() {
        lines.push("No jobs placed.".to_owned());
    } else {
        lines.extend(job_lines(snapshot, layout));
    }
    if !snapshot.unplaced.is_empty() {
        let ids = snapshot.unplaced.join(", ");
        lines.push(layout.cut(&format!("Running without a reservation: {ids}"), WIDTH));
        lines.push(
            "(their agents run, but nothing placed them: one started without `iadeep run` is"
                .to_owned(),
        );
        lines.push(
            "never tuned; one whose placement was released while it ran is placed again)"
                .to_owned(),
        );
    }
    if snapshot.released > 0 {
        let more = if snapshot.released_more { "+" } else { "" };
        lines.push(format!(
            "{}{more} released job(s) kept for reading (`iadeep state ls {}`).",
            snapshot.released,
            iadeep_state::keys::ARCHIVE
        ));
    }
    lines.push(
        "Queued jobs are not in the store: `iadeep run` and orchestrators wait for the placer."
            .to_owned(),
    );
    for problem in &snapshot.problems {
        lines.push(layout.cut(&format!("unreadable: {problem}"), WIDTH));
    }
    lines
}

fn device_lines(snapshot: &Snapshot, layout: Layout) -> Vec<String> {
    let id_w = layout.column(DEVICE_ID_W, snapshot.devices.iter().map(|d| d.id.as_str()));
    let kind_w = layout.column(
        7,
        snapshot
            .devices
            .iter()
            .filter_map(|d| Some(d.info.as_ref()?.kind.as_str())),
    );
    let row = |cells: [&str; 11]| {
        let [
            id,
            kind,
            total,
            reserved,
            measured,
            free,
            jobs,
            round,
            tried,
            best,
            updated,
        ] = cells;
        format!(
            "{id:<id_w$} {kind:<kind_w$} {total:>7} {reserved:>8} {measured:>8} {free:>7} {jobs:>4} \
             {round:>5} {tried:>5} {best:>8} {updated:>7}"
        )
    };
    let mut lines = vec![row([
        "GPU",
        "KIND",
        "MiB",
        "RESERVED",
        "MEASURED",
        "FREE",
        "JOBS",
        "ROUND",
        "TRIED",
        "BEST ΣPD",
        "UPDATED",
    ])];
    for d in &snapshot.devices {
        let (kind, total) = match &d.info {
            Some(info) => (layout.cut(&info.kind, 7), info.memory_mib.to_string()),
            // The record is leased by the device's tuner: without it, the tuner stopped.
            None => ("gone".to_owned(), "-".to_owned()),
        };
        let tuner = d.tuner.as_ref();
        let line = row([
            &layout.cut(&d.id, DEVICE_ID_W),
            &kind,
            &total,
            &d.reserved_mib.to_string(),
            &opt(d.measured_mib),
            &opt(d.free_mib),
            &d.residents.len().to_string(),
            &opt(tuner.map(|t| t.round)),
            &opt(tuner.map(|t| t.measured)),
            &opt(tuner.and_then(|t| t.best_sum_pd).map(|b| format!("{b:.2}"))),
            &opt(tuner.map(|t| age(age_since(snapshot.now_unix_ms, t.updated_at_unix_ms)))),
        ]);
        lines.push(layout.cut(&line, WIDTH));
    }
    lines.push(
        "RESERVED: the placer's reservations; MEASURED: the jobs' last reported peaks; FREE: MiB"
            .to_owned(),
    );
    lines.push(
        "less the larger of the two; TRIED: configurations its tuner measured (Σ PD known)."
            .to_owned(),
    );
    lines.extend(untuned_line(snapshot, layout));
    lines.extend(breach_lines(snapshot, layout));
    lines
}

/// The production jobs whose measured PD is above their cap; a job alone on its GPU is
/// marked, since no co-runner is to blame there: its PD is its own (the tuner's batch
/// size, or step times that vary against its solo ones, as on a busy CPU).
fn above_cap_lines(snapshot: &Snapshot, layout: Layout) -> Vec<String> {
    let alone = |j: &JobRow| {
        !j.device.is_empty()
            && !snapshot
                .jobs
                .iter()
                .any(|other| other.device == j.device && other.id != j.id)
    };
    let above: Vec<(String, bool)> = snapshot
        .jobs
        .iter()
        .filter(|j| j.above_cap == Some(true))
        .filter_map(|j| {
            let alone = alone(j);
            let mark = if alone { ", alone" } else { "" };
            Some((
                format!("{} ({:.2} > {:.2}{mark})", j.id, j.pd?, j.cap?),
                alone,
            ))
        })
        .collect();
    let mut lines = Vec::new();
    if above.is_empty() {
        return lines;
    }
    let names: Vec<&str> = above.iter().map(|(line, _)| line.as_str()).collect();
    lines.push(layout.cut(&format!("ABOVE CAP: {}", names.join(", ")), WIDTH));
    if above.iter().any(|(_, alone)| *alone) {
        lines.push(layout.cut(
            "alone: no co-runner on its GPU, so nobody is evicted for it; its PD is its own \
             (its batch size, or step times that vary against its solo ones, e.g. on a busy \
             CPU)",
            WIDTH,
        ));
    }
    lines
}

/// The line naming the GPUs whose record no running tuner holds, if any.
fn untuned_line(snapshot: &Snapshot, layout: Layout) -> Option<String> {
    let untuned: Vec<&str> = snapshot
        .devices
        .iter()
        .filter(|d| d.info.is_some() && !d.tuner_running)
        .map(|d| d.id.as_str())
        .collect();
    (!untuned.is_empty()).then(|| {
        layout.cut(
            &format!(
                "NO TUNER: {} (a record no running tuner holds, e.g. written by hand: jobs are \
                 placed there and never tuned; `iadeep state del` it, or start its tuner)",
                untuned.join(", ")
            ),
            WIDTH,
        )
    })
}

/// One line per device whose tuner recorded a cap breach: the placer's next eviction.
fn breach_lines(snapshot: &Snapshot, layout: Layout) -> Vec<String> {
    snapshot
        .devices
        .iter()
        .filter_map(|d| {
            let b = d.breach.as_ref()?;
            let ago = age(age_since(snapshot.now_unix_ms, b.at_unix_ms));
            let line = format!(
                "BREACH on {} ({ago} ago): {} PD {:.2} > cap {:.2} for {} rounds; to evict \
                 one of: {}",
                d.id,
                b.task_id,
                b.measured_pd,
                b.max_slowdown,
                b.rounds_above,
                b.opportunistic_task_ids.join(", ")
            );
            Some(layout.cut(&line, WIDTH))
        })
        .collect()
}

fn job_lines(snapshot: &Snapshot, layout: Layout) -> Vec<String> {
    let id_w = layout.column(JOB_ID_W, snapshot.jobs.iter().map(|j| j.id.as_str()));
    let gpu_w = layout.column(JOB_GPU_W, snapshot.jobs.iter().map(|j| j.device.as_str()));
    let row = |cells: [&str; 11]| {
        let [id, gpu, batch, m0, bounds, lr, cap, pd, mib, seen, state] = cells;
        format!(
            "{id:<id_w$} {gpu:<gpu_w$} {batch:>5} {m0:>5} {bounds:>9} {lr:>4} {cap:>4} {pd:>5} \
             {mib:>5} {seen:>4} {state}"
        )
    };
    let mut lines = vec![row([
        "JOB", "GPU", "BATCH", "M0", "BOUNDS", "LR×", "CAP", "PD", "MiB", "SEEN", "TUNER",
    ])];
    for j in &snapshot.jobs {
        let seen = j.reported_at_unix_ms.map_or_else(
            || "-".to_owned(),
            |at| age(age_since(snapshot.now_unix_ms, at)),
        );
        let mib = j.peak_mem_mib.or(j.reserved_mib);
        // A production job measured above its cap is marked where its PD is read, and so is
        // a PD against an estimated solo time (the job never ran alone).
        let above = if j.above_cap == Some(true) { "!" } else { "" };
        let estimated = if pd_estimated(j) { "~" } else { "" };
        let mark = format!("{above}{estimated}");
        let line = row([
            &layout.cut_id(&j.id, JOB_ID_W),
            &layout.cut(&j.device, JOB_GPU_W),
            &batch_cell(j),
            &j.m0.to_string(),
            &format!("{}-{}", j.min_batch_size, j.max_batch_size),
            &j.lr_factor
                .map_or_else(|| "-".to_owned(), |f| format!("{f:.2}")),
            &j.cap.map_or_else(|| "-".to_owned(), |c| format!("{c:.2}")),
            &j.pd
                .map_or_else(|| "-".to_owned(), |p| format!("{p:.2}{mark}")),
            &opt(mib),
            &seen,
            &job_state(j, snapshot.now_unix_ms),
        ]);
        lines.push(layout.cut(&line, WIDTH));
    }
    // Job ids in the JOB column, GPU ids in the GPU columns of both tables.
    let ids_cut = !layout.wide
        && (longest(snapshot.jobs.iter().map(|j| j.id.as_str())) > id_w
            || longest(snapshot.jobs.iter().map(|j| j.device.as_str())) > gpu_w
            || longest(snapshot.devices.iter().map(|d| d.id.as_str())) > DEVICE_ID_W);
    lines.extend(job_notes(snapshot, ids_cut));
    lines.extend(above_cap_lines(snapshot, layout));
    for j in snapshot.jobs.iter() {
        if let Some(reason) = &j.evicted {
            let reason = if reason.is_empty() {
                "no reason given"
            } else {
                reason
            };
            lines.push(layout.cut(&format!("EVICTED {}: {reason}", j.id), WIDTH));
        }
    }
    lines.extend(phase_lines(snapshot, layout));
    lines
}

/// What the jobs' table needs said under it: its columns, and its marks where shown.
fn job_notes(snapshot: &Snapshot, ids_cut: bool) -> Vec<String> {
    let mut lines = Vec::new();
    lines.push(
        "MiB: the last reported peak, else the reservation; SEEN: since the last report."
            .to_owned(),
    );
    lines.push(
        "CAP: a production job's slowdown cap (- for opportunistic); PD!: measured above it."
            .to_owned(),
    );
    if snapshot
        .jobs
        .iter()
        .any(|j| j.pd.is_some() && pd_estimated(j))
    {
        lines.push(
            "PD~: against a solo step time estimated next to co-runners (never ran alone)."
                .to_owned(),
        );
    }
    if snapshot
        .jobs
        .iter()
        .any(|j| agent_overdue(j, snapshot.now_unix_ms).is_some())
    {
        lines.push(
            "no agent T: placed T ago, never reported: is its process up, with an iadeep Agent \
             in its loop?"
                .to_owned(),
        );
    }
    if ids_cut {
        lines.push("Ids cut (…): `iadeep status --wide` shows them whole.".to_owned());
    }
    if snapshot.jobs.iter().any(moving) {
        lines.push(
            "BATCH*: its assignment names another size, not reported yet (LR× is the assignment's)."
                .to_owned(),
        );
    }
    lines
}

/// Whether the job's assignment names a batch size other than the one it last reported:
/// the table's LR× is the assignment's, so the BATCH it is read against is marked.
fn moving(job: &JobRow) -> bool {
    job.assigned_batch_size
        .is_some_and(|assigned| assigned != job.batch_size)
}

/// The BATCH cell: the size the job last reported, `*` when it is being moved.
fn batch_cell(job: &JobRow) -> String {
    let mark = if moving(job) { "*" } else { "" };
    format!("{}{mark}", job.batch_size)
}

/// How long ago a job was placed whose agent never reported, once that is longer than
/// [`crate::run_cmd::AGENT_START_PATIENCE`] (as long as `iadeep run` waits before it warns).
fn agent_overdue(job: &JobRow, now_ms: i64) -> Option<f64> {
    if job.running || job.finished || job.reported_at_unix_ms.is_some() {
        return None;
    }
    let waited = age_since(now_ms, job.placed_at_unix_ms?);
    (waited > crate::run_cmd::AGENT_START_PATIENCE.as_secs_f64()).then_some(waited)
}

/// The job's last column: the tuner's phase (or that the placer evicted it), and
/// whether its agent is gone, not started yet, or overdue.
fn job_state(job: &JobRow, now_ms: i64) -> String {
    let phase = if job.evicted.is_some() {
        "evicted"
    } else {
        job.tuning.phase
    };
    if !job.running && !job.finished {
        // A job placed moments ago whose agent has not started (the interpreter is still
        // importing) has never reported; one that has, and holds no alive key, is gone.
        let agent = if job.reported_at_unix_ms.is_some() {
            "agent gone".to_owned()
        } else if let Some(waited) = agent_overdue(job, now_ms) {
            format!("no agent {}", age(waited))
        } else {
            "no agent yet".to_owned()
        };
        format!("{phase} ({agent})")
    } else {
        phase.to_owned()
    }
}

/// One line per (phase, why) shown, naming its jobs: the table has no room for the why.
fn phase_lines(snapshot: &Snapshot, layout: Layout) -> Vec<String> {
    let mut phases: Vec<(&str, &str, Vec<&str>)> = Vec::new();
    for j in &snapshot.jobs {
        let (phase, why) = (j.tuning.phase, j.tuning.why.as_str());
        match phases.iter_mut().find(|(p, w, _)| *p == phase && *w == why) {
            Some((_, _, ids)) => ids.push(&j.id),
            None => phases.push((phase, why, vec![&j.id])),
        }
    }
    phases
        .into_iter()
        .map(|(phase, why, ids)| {
            // Ids as the JOB column shows them, so that two of one script stay apart.
            let ids: Vec<String> = ids.iter().map(|id| layout.cut_id(id, JOB_ID_W)).collect();
            layout.cut(&format!("{phase}: {why} ({})", ids.join(", ")), WIDTH)
        })
        .collect()
}

/// The JSON view: one object, every figure unrounded, absent values as null.
pub fn json(snapshot: &Snapshot) -> Value {
    json!({
        "store": snapshot.store,
        "revision": snapshot.revision,
        "now_unix_ms": snapshot.now_unix_ms,
        "devices": snapshot.devices.iter().map(device_json).collect::<Vec<_>>(),
        "jobs": snapshot.jobs.iter().map(|j| job_json(j, snapshot.now_unix_ms)).collect::<Vec<_>>(),
        "released_jobs": snapshot.released,
        "released_jobs_more": snapshot.released_more,
        "unplaced_tasks": snapshot.unplaced,
        "problems": snapshot.problems,
    })
}

fn device_json(d: &DeviceRow) -> Value {
    json!({
        "id": d.id,
        "registered": d.info.is_some(),
        "tuner_running": d.tuner_running,
        "node": d.info.as_ref().map(|i| i.node.clone()),
        "name": d.info.as_ref().map(|i| i.name.clone()),
        "kind": d.info.as_ref().map(|i| i.kind.clone()),
        "memory_mib": d.info.as_ref().map(|i| i.memory_mib),
        "reserved_mib": d.reserved_mib,
        "measured_mib": d.measured_mib,
        "free_mib": d.free_mib,
        "residents": d.residents,
        "breach": d.breach.as_ref().map(|b| json!({
            "task_id": b.task_id,
            "measured_pd": b.measured_pd,
            "max_slowdown": b.max_slowdown,
            "rounds_above": b.rounds_above,
            "opportunistic_task_ids": b.opportunistic_task_ids,
            "round": b.round,
            "at_unix_ms": b.at_unix_ms,
        })),
        "tuner": d.tuner.as_ref().map(|t| json!({
            "round": t.round,
            "task_ids": t.task_ids,
            "configurations_measured": t.measured,
            "configurations_out_of_memory": t.out_of_memory,
            "best_sum_pd": t.best_sum_pd,
            "updated_at_unix_ms": t.updated_at_unix_ms,
        })),
    })
}

fn job_json(j: &JobRow, now_ms: i64) -> Value {
    json!({
        "id": j.id,
        "model": j.model,
        "device": j.device,
        "running": j.running,
        "finished": j.finished,
        "batch_size": j.batch_size,
        "assigned_batch_size": j.assigned_batch_size,
        "m0": j.m0,
        "min_batch_size": j.min_batch_size,
        "max_batch_size": j.max_batch_size,
        "lr_factor": j.lr_factor,
        "lr_rule": j.lr_rule,
        "reserved_mib": j.reserved_mib,
        "provisional": j.provisional,
        "peak_mem_mib": j.peak_mem_mib,
        "step_time_s": j.step_time_s,
        "pd": j.pd,
        "pd_basis": j.pd_basis,
        "reported_at_unix_ms": j.reported_at_unix_ms,
        "report_age_s": j.reported_at_unix_ms.map(|at| age_since(now_ms, at)),
        "placed_at_unix_ms": j.placed_at_unix_ms,
        "tuner": {"phase": j.tuning.phase, "why": j.tuning.why, "derived": true},
        "class": j.class,
        "max_slowdown": j.cap,
        "above_cap": j.above_cap,
        "evict": j.evicted.is_some(),
        "evict_reason": j.evicted,
    })
}
