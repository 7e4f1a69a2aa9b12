//! Results as a table, CSV files, the `--json` line and SVG plots.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::error::{Result, SimError};
use crate::metrics::{RunMetrics, Summary, UtilBin};

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

/// The `--json` object: `{"policies": {"<name>": {avg_ct_s, p99_ct_s, makespan_s, ooms,
/// fenced_ooms, avg_util, ...}}}`: `ooms` are the crashes of a card's memory running out
/// (they can hit any job on it), `fenced_ooms` the out-of-memory errors a fence kept to
/// their own job.
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
    Ok(written)
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
        "policy,task,model,m0,submit_s,start_s,finish_s,completion_s,ooms,fenced_ooms\n",
    );
    for run in runs {
        for t in &run.tasks {
            let _ = writeln!(
                csv,
                "{},{},{},{},{:.3},{:.3},{:.3},{:.3},{},{}",
                run.policy,
                t.id,
                t.model,
                t.m0,
                t.submit_s,
                t.start_s,
                t.finish_s,
                t.completion_s(),
                t.ooms,
                t.fenced_ooms
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

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

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
    for (index, (name, points)) in series.into_iter().enumerate() {
        let color = PALETTE[index % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| plot_error(path, e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
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
    for (index, (run, panel)) in runs.iter().zip(panels.iter()).enumerate() {
        let color = PALETTE[index % PALETTE.len()];
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
