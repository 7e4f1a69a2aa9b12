//! Results as a table, CSV files, the `--json` line and SVG plots.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::error::{Result, SimError};
use crate::metrics::{BatchPoint, RunMetrics, Summary, UtilBin};

/// Rows per policy in `utilisation.csv`: time-weighted means over equal windows, so
/// the file stays small (a 10,000-job run has hundreds of thousands of changes).
pub const UTIL_CSV_BINS: usize = 1000;
/// Windows per policy in the utilisation plot (about two per horizontal pixel).
const UTIL_PLOT_BINS: usize = 400;

/// The span a run's utilisation covers: from 0 to its last change or task end.
fn run_end_s(run: &RunMetrics) -> f64 {
    let last_change = run.util.last().map_or(0.0, |p| p.0);
    run.tasks
        .iter()
        .map(|t| t.finish_s)
        .fold(last_change, f64::max)
}

fn util_bins(run: &RunMetrics, bins: usize) -> Vec<UtilBin> {
    run.util_bins(0.0, run_end_s(run), bins)
}

/// The human-readable table, one row per policy.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:>10} {:>10} {:>10} {:>11} {:>6} {:>7} {:>6} {:>6} {:>7} {:>9} {:>9}",
        "policy",
        "avg CT h",
        "p50 CT h",
        "p99 CT h",
        "makespan h",
        "OOMs",
        "fenced",
        "util",
        "work",
        "tuning",
        "place µs",
        "tune µs"
    );
    for s in summaries {
        let _ = writeln!(
            out,
            "{:<20} {:>10.2} {:>10.2} {:>10.2} {:>11.2} {:>6} {:>7} {:>6.2} {:>6.2} {:>7} {:>9.1} {:>9.1}",
            s.policy,
            s.avg_ct_s / 3600.0,
            s.p50_ct_s / 3600.0,
            s.p99_ct_s / 3600.0,
            s.makespan_s / 3600.0,
            s.ooms,
            s.fenced_ooms,
            s.avg_util,
            s.avg_work_rate,
            s.tuning_rounds,
            s.decision_latency_us,
            s.tune_latency_us,
        );
    }
    out
}

/// The per-class table, one row per policy and class: only when some run has production
/// jobs (`--production-fraction` above 0), since otherwise every job is opportunistic and
/// the main table says it all. Empty otherwise.
pub fn class_table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    if summaries.iter().all(|s| s.classes.production.tasks == 0) {
        return out;
    }
    let _ = writeln!(
        out,
        "{:<20} {:<14} {:>6} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "policy", "class", "jobs", "avg CT h", "p99 CT h", "above cap", "evictions", "lost work h"
    );
    for s in summaries {
        for (name, c) in [
            ("production", &s.classes.production),
            ("opportunistic", &s.classes.opportunistic),
        ] {
            let _ = writeln!(
                out,
                "{:<20} {:<14} {:>6} {:>10.2} {:>10.2} {:>9.2}% {:>10} {:>12.2}",
                s.policy,
                name,
                c.tasks,
                c.avg_ct_s / 3600.0,
                c.p99_ct_s / 3600.0,
                c.above_cap_frac * 100.0,
                c.evictions,
                c.evicted_work_s / 3600.0,
            );
        }
    }
    out
}

/// The `--json` object: `{"policies": {"<name>": {avg_ct_s, p99_ct_s, makespan_s, ooms,
/// fenced_ooms, avg_util, ...}}}`: `ooms` are the crashes of a card's memory running out
/// (they can hit any job on it), `fenced_ooms` the out-of-memory errors a fence kept to
/// their own job. `classes` holds `production` and `opportunistic`, each with `tasks`,
/// `avg_ct_s`, `p99_ct_s`, `above_cap_frac` (share of the class's running time with a
/// job's true PD above its cap; opportunistic jobs against the production default),
/// `evictions` and `evicted_work_s` (seconds of progress alone at m0 lost).
pub fn json(summaries: &[Summary]) -> serde_json::Value {
    let mut policies = serde_json::Map::new();
    for s in summaries {
        policies.insert(
            s.policy.clone(),
            serde_json::json!({
                "avg_ct_s": s.avg_ct_s,
                "p50_ct_s": s.p50_ct_s,
                "p99_ct_s": s.p99_ct_s,
                "makespan_s": s.makespan_s,
                "ooms": s.ooms,
                "fenced_ooms": s.fenced_ooms,
                "avg_util": s.avg_util,
                "avg_work_rate": s.avg_work_rate,
                "tuning_rounds": s.tuning_rounds,
                "classes": s.classes,
            }),
        );
    }
    serde_json::json!({ "policies": policies })
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| SimError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Writes `summary.csv`, `tasks.csv`, `utilisation.csv` (time-weighted means over
/// [`UTIL_CSV_BINS`] windows per policy) and the two SVG plots under `dir`; returns
/// the files written.
pub fn write_all(dir: &Path, runs: &[RunMetrics], summaries: &[Summary]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|source| SimError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut written = Vec::new();
    for (name, csv) in [
        ("summary.csv", summary_csv(summaries)),
        ("tasks.csv", tasks_csv(runs)),
        ("utilisation.csv", utilisation_csv(runs)),
    ] {
        let path = dir.join(name);
        write(&path, &csv)?;
        written.push(path);
    }

    let path = dir.join("completion_cdf.svg");
    plot_cdf(&path, runs)?;
    written.push(path);
    let path = dir.join("utilisation.svg");
    plot_utilisation(&path, runs)?;
    written.push(path);
    if let Some(run) = runs.iter().find(|r| r.policy == TUNER_PLOT_POLICY) {
        let path = dir.join("batch_trace.csv");
        write(&path, &batch_trace_csv(run))?;
        written.push(path);
        let path = dir.join(format!("tuner_{TUNER_PLOT_POLICY}.svg"));
        plot_tuner(&path, run)?;
        written.push(path);
    }
    Ok(written)
}

/// The policy whose batch sizes and PD over time are drawn and written: iadeep's tuner is
/// what users would rather look at than read its log.
pub const TUNER_PLOT_POLICY: &str = "iadeep";

/// `batch_trace.csv`: every (time, GPU, job, batch size, PD) of the run's trace.
fn batch_trace_csv(run: &RunMetrics) -> String {
    let mut csv = String::from("policy,time_s,device,task,batch_size,pd\n");
    for p in &run.batch_trace {
        let _ = writeln!(
            csv,
            "{},{:.3},{},{},{},{:.4}",
            run.policy, p.at_s, p.device, p.task, p.batch_size, p.pd
        );
    }
    csv
}

/// `summary.csv`: one row per policy.
fn summary_csv(summaries: &[Summary]) -> String {
    let mut csv = String::from(
        "policy,tasks,avg_ct_s,p50_ct_s,p99_ct_s,makespan_s,ooms,fenced_ooms,avg_util,avg_work_rate,tuning_rounds,batch_changes,decision_latency_us,decision_latency_p99_us,tune_latency_us\n",
    );
    for s in summaries {
        let _ = writeln!(
            csv,
            "{},{},{:.3},{:.3},{:.3},{:.3},{},{},{:.5},{:.5},{},{},{:.3},{:.3},{:.3}",
            s.policy,
            s.tasks,
            s.avg_ct_s,
            s.p50_ct_s,
            s.p99_ct_s,
            s.makespan_s,
            s.ooms,
            s.fenced_ooms,
            s.avg_util,
            s.avg_work_rate,
            s.tuning_rounds,
            s.batch_changes,
            s.decision_latency_us,
            s.decision_latency_p99_us,
            s.tune_latency_us
        );
    }
    csv
}

/// `tasks.csv`: one row per task of every run.
fn tasks_csv(runs: &[RunMetrics]) -> String {
    let mut csv = String::from(
        "policy,task,model,m0,submit_s,start_s,finish_s,completion_s,ooms,fenced_ooms,class,max_slowdown,running_s,above_cap_s,evictions,evicted_work_s,above_cap_below_m0_s,above_cap_above_m0_s,above_cap_shared_s\n",
    );
    for run in runs {
        for t in &run.tasks {
            let _ = writeln!(
                csv,
                "{},{},{},{},{:.3},{:.3},{:.3},{:.3},{},{},{},{},{:.3},{:.3},{},{:.3},{:.3},{:.3},{:.3}",
                run.policy,
                t.id,
                t.model,
                t.m0,
                t.submit_s,
                t.start_s,
                t.finish_s,
                t.completion_s(),
                t.ooms,
                t.fenced_ooms,
                if t.max_slowdown.is_some() {
                    "production"
                } else {
                    "opportunistic"
                },
                t.max_slowdown.map(|c| c.to_string()).unwrap_or_default(),
                t.running_s,
                t.above_cap_s,
                t.evictions,
                t.evicted_work_s,
                t.above_cap_where.below_m0_s,
                t.above_cap_where.above_m0_s,
                t.above_cap_where.shared_s,
            );
        }
    }
    csv
}

/// `utilisation.csv`: time-weighted means over [`UTIL_CSV_BINS`] windows per policy.
fn utilisation_csv(runs: &[RunMetrics]) -> String {
    let mut csv = String::from("policy,start_s,end_s,mean_busy_gpus,mean_work_rate\n");
    for run in runs {
        for bin in util_bins(run, UTIL_CSV_BINS) {
            let _ = writeln!(
                csv,
                "{},{:.3},{:.3},{:.4},{:.5}",
                run.policy, bin.start_s, bin.end_s, bin.busy_gpus, bin.work_rate
            );
        }
    }
    csv
}

fn plot_error(path: &Path, err: impl std::fmt::Display) -> SimError {
    SimError::Plot {
        path: path.display().to_string(),
        reason: err.to_string(),
    }
}

/// The colours of the policies that are not emphasised: Tableau 10 without its red, which
/// is iadeep's alone (nine colours a reader with common colour-vision deficiencies can
/// still tell apart with the dash patterns).
const PALETTE: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// A line's dash pattern: the second way (besides colour) curves are told apart, which
/// also survives printing in grey.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dash {
    Solid,
    Dashed,
    Dotted,
}

const DASHES: [Dash; 3] = [Dash::Solid, Dash::Dashed, Dash::Dotted];

/// How one policy's curve is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeriesStyle {
    pub color: RGBColor,
    pub dash: Dash,
    /// Stroke width, pixels: the emphasised policies' lines are thicker.
    pub width: u32,
}

/// iadeep: red, solid, thick: the curve the plots are about.
const IADEEP_STYLE: SeriesStyle = SeriesStyle {
    color: RGBColor(214, 39, 40),
    dash: Dash::Solid,
    width: 4,
};
/// The oracle: black, dashed, thick: the bound every other curve is read against.
const ORACLE_STYLE: SeriesStyle = SeriesStyle {
    color: RGBColor(0, 0, 0),
    dash: Dash::Dashed,
    width: 3,
};

/// The style of `policy` in every plot: iadeep and the oracle emphasised, every other
/// policy of [`POLICY_NAMES`](crate::POLICY_NAMES) a colour and dash of its own (nine colours
/// times three dashes: 27 policies), chosen by its place in that list so a policy looks the
/// same in every run whichever policies it ran with. A name outside the list (none today)
/// gets a style derived from its text, which may repeat another's.
pub fn policy_style(policy: &str) -> SeriesStyle {
    match policy {
        "iadeep" => return IADEEP_STYLE,
        "oracle" => return ORACLE_STYLE,
        _ => {}
    }
    let index = crate::POLICY_NAMES
        .iter()
        .filter(|name| !matches!(**name, "iadeep" | "oracle"))
        .position(|name| *name == policy)
        .unwrap_or_else(|| {
            // FNV-1a: stable across runs and platforms, unlike the std hasher.
            policy.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            }) as usize
        });
    SeriesStyle {
        color: PALETTE[index % PALETTE.len()],
        dash: DASHES[(index / PALETTE.len()) % DASHES.len()],
        width: 2,
    }
}

impl SeriesStyle {
    fn shape(&self) -> ShapeStyle {
        self.color.stroke_width(self.width)
    }
}

/// Draws `points` on `chart` in `style` and labels the series `label` in the legend.
macro_rules! draw_styled {
    ($chart:expr, $points:expr, $style:expr, $label:expr, $path:expr) => {{
        let style: SeriesStyle = $style;
        let shape = style.shape();
        // Dash and gap lengths, pixels; a dot is as long as the line is wide.
        let (dash, gap) = match style.dash {
            Dash::Solid => (0, 0),
            Dash::Dashed => (10, 6),
            Dash::Dotted => (style.width, style.width + 3),
        };
        let annotation = if style.dash == Dash::Solid {
            $chart.draw_series(LineSeries::new($points, shape))
        } else {
            $chart.draw_series(DashedLineSeries::new($points, dash, gap, shape))
        }
        .map_err(|e| plot_error($path, e))?;
        annotation.label($label).legend(move |(x, y)| {
            let line = vec![(x, y), (x + 24, y)];
            if dash == 0 {
                // One dash longer than the sample line: solid.
                DashedPathElement::new(line.into_iter(), 48, 1, shape)
            } else {
                DashedPathElement::new(line.into_iter(), dash, gap, shape)
            }
        });
    }};
}

/// Completion-time CDF of every policy on a logarithmic time axis: completion times
/// span minutes to days, and on a linear axis the policies' curves crowd together at
/// the left edge of a long run's plot.
fn plot_cdf(path: &Path, runs: &[RunMetrics]) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|run| {
            let mut ct: Vec<f64> = run
                .tasks
                .iter()
                .map(|t| (t.completion_s() / 3600.0).max(MIN_CDF_HOURS))
                .collect();
            ct.sort_by(f64::total_cmp);
            let n = ct.len().max(1) as f64;
            // At most ~2,000 points per curve: every k-th task and the last.
            let stride = (ct.len() / 2000).max(1);
            let last = ct.len().saturating_sub(1);
            let points = ct
                .into_iter()
                .enumerate()
                .filter(|(i, _)| i % stride == 0 || *i == last)
                .map(|(i, v)| (v, (i + 1) as f64 / n))
                .collect();
            (run.policy.clone(), points)
        })
        .collect();
    let (min_x, max_x) = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold((f64::INFINITY, MIN_CDF_HOURS), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
    let min_x = if min_x.is_finite() {
        min_x
    } else {
        MIN_CDF_HOURS
    };
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Completion time CDF", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((min_x * 0.9..max_x * 1.1).log_scale(), 0.0..1.0)
        .map_err(|e| plot_error(path, e))?;
    chart
        .configure_mesh()
        .x_desc("completion time (h, log scale)")
        .y_desc("fraction of tasks")
        .draw()
        .map_err(|e| plot_error(path, e))?;
    // The emphasised policies last, so no other curve hides them.
    let mut series = series;
    series.sort_by_key(|(name, _)| policy_style(name).width);
    for (name, points) in series {
        draw_styled!(chart, points, policy_style(&name), name, path);
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| plot_error(path, e))?;
    root.present().map_err(|e| plot_error(path, e))
}

/// Shortest completion time drawn on the log axis (36 s): keeps zero-length runs on it.
const MIN_CDF_HOURS: f64 = 0.01;

/// Busy fraction of the GPUs over time, one panel per policy (overlaid lines of eight
/// policies over a long run are a tangle), each a time-weighted mean over
/// [`UTIL_PLOT_BINS`] windows, with the policy's mean in the panel's title.
fn plot_utilisation(path: &Path, runs: &[RunMetrics]) -> Result<()> {
    let max_x = runs.iter().map(run_end_s).fold(1e-3, f64::max) / 3600.0;
    let columns = if runs.len() > 4 { 2 } else { 1 };
    let rows = runs.len().div_ceil(columns).max(1);
    let height = u32::try_from(rows * 170 + 60).unwrap_or(u32::MAX);
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(path, e))?;
    let root = root
        .titled("GPUs busy over time", ("sans-serif", 22))
        .map_err(|e| plot_error(path, e))?;
    let panels = root.split_evenly((rows, columns));
    for (run, panel) in runs.iter().zip(panels.iter()) {
        let color = policy_style(&run.policy).color;
        let gpus = run.gpus.max(1) as f64;
        let bins = util_bins(run, UTIL_PLOT_BINS);
        let mean =
            iadeep_objective::stats::mean(bins.iter().map(|b| b.busy_gpus)).unwrap_or(0.0) / gpus;
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!("{} (mean {:.0} % busy)", run.policy, mean * 100.0),
                ("sans-serif", 15),
            )
            .margin(6)
            .x_label_area_size(28)
            .y_label_area_size(40)
            .build_cartesian_2d(0.0..max_x * 1.02, 0.0..1.05)
            .map_err(|e| plot_error(path, e))?;
        chart
            .configure_mesh()
            .x_desc("time (h)")
            .y_desc("busy")
            .y_labels(3)
            .draw()
            .map_err(|e| plot_error(path, e))?;
        let points = bins
            .iter()
            .flat_map(|b| {
                let y = b.busy_gpus / gpus;
                [(b.start_s / 3600.0, y), (b.end_s / 3600.0, y)]
            })
            .collect::<Vec<_>>();
        chart
            .draw_series(AreaSeries::new(points, 0.0, color.mix(0.35)).border_style(color))
            .map_err(|e| plot_error(path, e))?;
    }
    root.present().map_err(|e| plot_error(path, e))
}

/// GPUs drawn in the tuner plot: the ones whose batch sizes changed most.
const TUNER_PLOT_GPUS: usize = 6;

/// Each job's points as a step function up to its end (`end_s`), in hours.
fn steps(
    points: &[&BatchPoint],
    end_s: f64,
    value: impl Fn(&BatchPoint) -> f64,
) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len() * 2);
    for (i, p) in points.iter().enumerate() {
        let until = points.get(i + 1).map_or(end_s, |next| next.at_s);
        out.push((p.at_s / 3600.0, value(p)));
        out.push((until.max(p.at_s) / 3600.0, value(p)));
    }
    out
}

/// The trace of one GPU: its jobs' points, by job, in time order.
fn device_jobs(run: &RunMetrics, device: usize) -> Vec<(usize, Vec<&BatchPoint>)> {
    let mut jobs: std::collections::BTreeMap<usize, Vec<&BatchPoint>> = Default::default();
    for p in run.batch_trace.iter().filter(|p| p.device == device) {
        jobs.entry(p.task).or_default().push(p);
    }
    jobs.into_iter().collect()
}

/// The GPUs with the most batch-size changes, busiest first, at most [`TUNER_PLOT_GPUS`].
fn tuner_plot_devices(run: &RunMetrics) -> Vec<usize> {
    let mut changes: Vec<(usize, usize)> = (0..run.gpus)
        .map(|d| {
            let n = device_jobs(run, d)
                .iter()
                .map(|(_, ps)| {
                    ps.windows(2)
                        .filter(|w| w[0].batch_size != w[1].batch_size)
                        .count()
                })
                .sum();
            (d, n)
        })
        .filter(|(d, _)| run.batch_trace.iter().any(|p| p.device == *d))
        .collect();
    changes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    changes
        .into_iter()
        .take(TUNER_PLOT_GPUS)
        .map(|(d, _)| d)
        .collect()
}

/// Batch size (log scale) and PD of every job over time, one pair of panels per GPU for the
/// GPUs whose batch sizes the tuner moved most; each job one colour in both panels.
fn plot_tuner(path: &Path, run: &RunMetrics) -> Result<()> {
    let devices = tuner_plot_devices(run);
    let height = u32::try_from(devices.len().max(1) * 300 + 60).unwrap_or(u32::MAX);
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(path, e))?;
    let root = root
        .titled(
            &format!(
                "{}: batch size and PD per job over time (the GPUs tuned most)",
                run.policy
            ),
            ("sans-serif", 20),
        )
        .map_err(|e| plot_error(path, e))?;
    let rows = root.split_evenly((devices.len().max(1), 1));
    for (device, row) in devices.iter().zip(rows.iter()) {
        tuner_panels(path, row, run, *device)?;
    }
    root.present().map_err(|e| plot_error(path, e))
}

/// One GPU's two panels of [`plot_tuner`]: batch sizes above, PD below.
fn tuner_panels<DB: DrawingBackend>(
    path: &Path,
    row: &DrawingArea<DB, plotters::coord::Shift>,
    run: &RunMetrics,
    device: usize,
) -> Result<()> {
    let max_x = run_end_s(run).max(1e-3) / 3600.0;
    let end_of = |task: usize| {
        run.tasks
            .iter()
            .find(|t| t.id == task)
            .map_or(max_x * 3600.0, |t| t.finish_s)
    };
    let jobs = device_jobs(run, device);
    let (top, bottom) = row.split_vertically(row.dim_in_pixel().1 / 2);
    let all = || jobs.iter().flat_map(|(_, ps)| ps.iter());
    let max_batch = all().map(|p| p.batch_size).max().unwrap_or(1);
    let pds = || all().map(|p| p.pd).filter(|p| p.is_finite());
    let (min_pd, max_pd) = (pds().fold(1.0, f64::min), pds().fold(1.0, f64::max));
    let mut chart = ChartBuilder::on(&top)
        .caption(format!("GPU {device}"), ("sans-serif", 15))
        .margin(6)
        .x_label_area_size(0)
        .y_label_area_size(50)
        .build_cartesian_2d(
            0.0..max_x * 1.02,
            (1.0..f64::from(max_batch) * 1.5).log_scale(),
        )
        .map_err(|e| plot_error(path, e))?;
    chart
        .configure_mesh()
        .y_desc("batch size")
        .y_labels(4)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| plot_error(path, e))?;
    for (task, points) in &jobs {
        let line = steps(points, end_of(*task), |p| f64::from(p.batch_size));
        let style = PALETTE[*task % PALETTE.len()].stroke_width(2);
        chart
            .draw_series(LineSeries::new(line, style))
            .map_err(|e| plot_error(path, e))?;
    }
    let mut chart = ChartBuilder::on(&bottom)
        .margin(6)
        .x_label_area_size(28)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..max_x * 1.02, min_pd * 0.95..max_pd * 1.05)
        .map_err(|e| plot_error(path, e))?;
    chart
        .configure_mesh()
        .x_desc("time (h)")
        .y_desc("PD")
        .y_labels(4)
        .draw()
        .map_err(|e| plot_error(path, e))?;
    for (task, points) in &jobs {
        let line = steps(points, end_of(*task), |p| p.pd);
        let style = PALETTE[*task % PALETTE.len()].stroke_width(2);
        chart
            .draw_series(LineSeries::new(line, style))
            .map_err(|e| plot_error(path, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// No two policies the simulator knows are drawn alike, and iadeep and the oracle are
    /// drawn thicker than every other (the demo's plot drew 11 policies in 10 colours).
    #[test]
    fn every_policy_has_a_style_of_its_own() {
        let mut seen: HashMap<(RGBColor, Dash), &str> = HashMap::new();
        for name in crate::POLICY_NAMES {
            let style = policy_style(name);
            if let Some(other) = seen.insert((style.color, style.dash), name) {
                panic!("{name} and {other} share colour and dash: {style:?}");
            }
            if !matches!(*name, "iadeep" | "oracle") {
                assert!(style.width < ORACLE_STYLE.width, "{name} is not emphasised");
            }
        }
        assert!(crate::POLICY_NAMES.contains(&"iadeep") && crate::POLICY_NAMES.contains(&"oracle"));
        assert!(policy_style("iadeep").width > policy_style("oracle").width);
        // Room for more: the assignment stays distinct for 27 policies besides the two.
        let others = crate::POLICY_NAMES.len() - 2;
        assert!(others <= PALETTE.len() * DASHES.len(), "{others} policies");
    }

    /// An iadeep run records each job's batch size and PD whenever its GPU changes, and the
    /// report draws them (`tuner_iadeep.svg`) and writes them (`batch_trace.csv`).
    #[test]
    fn the_iadeep_run_traces_batch_sizes_and_pd_per_gpu() {
        let gavel = iadeep_datasets::gavel::GavelThroughputs::bundled().expect("gavel");
        let trace = iadeep_datasets::philly::bundled().expect("philly");
        let mut params = crate::ExperimentParams::default();
        params.workload.tasks = 12;
        params.workload.seed = 3;
        params.workload.max_duration_s = 2.0 * 3600.0;
        params.engine.gpus = 2;
        let experiment = crate::Experiment::new(params, &gavel, &trace).expect("experiment");
        let mut policy = experiment.policy("iadeep").expect("policy");
        let run = experiment
            .run_policy(policy.as_mut(), &mut |_, _| {})
            .expect("run");
        assert!(!run.batch_trace.is_empty());
        for p in &run.batch_trace {
            assert!(p.device < 2 && p.task < 12, "{p:?}");
            assert!(p.pd.is_finite() && p.pd > 0.0, "{p:?}");
        }
        // Every job appears.
        let traced: std::collections::BTreeSet<usize> =
            run.batch_trace.iter().map(|p| p.task).collect();
        assert_eq!(traced.len(), 12);

        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let written = write_all(&dir, std::slice::from_ref(&run), &[run.summary()]).expect("write");
        let svg = dir.join("tuner_iadeep.svg");
        assert!(written.contains(&svg), "{written:?}");
        let text = std::fs::read_to_string(&svg).expect("svg");
        assert!(
            text.contains("GPU 0") || text.contains("GPU 1"),
            "a panel per GPU"
        );
        let csv = std::fs::read_to_string(dir.join("batch_trace.csv")).expect("csv");
        assert_eq!(csv.lines().count(), run.batch_trace.len() + 1);
    }

    /// A policy keeps its style whichever policies run with it.
    #[test]
    fn a_policys_style_does_not_depend_on_the_run() {
        assert_eq!(policy_style("packing"), policy_style("packing"));
        assert_eq!(policy_style("iadeep"), IADEEP_STYLE);
        assert_ne!(policy_style("packing"), policy_style("iadeep-no-predictor"));
        assert_ne!(policy_style("oracle"), policy_style("util"));
    }
}
