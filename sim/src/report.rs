//! Results as a table, CSV files, the `--json` line and SVG plots.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::error::{Result, SimError};
use crate::metrics::{RunMetrics, Summary};

/// The human-readable table, one row per policy.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:>10} {:>10} {:>10} {:>11} {:>6} {:>6} {:>6} {:>7} {:>9} {:>9}",
        "policy",
        "avg CT h",
        "p50 CT h",
        "p99 CT h",
        "makespan h",
        "OOMs",
        "util",
        "work",
        "tuning",
        "place µs",
        "tune µs"
    );
    for s in summaries {
        let _ = writeln!(
            out,
            "{:<20} {:>10.2} {:>10.2} {:>10.2} {:>11.2} {:>6} {:>6.2} {:>6.2} {:>7} {:>9.1} {:>9.1}",
            s.policy,
            s.avg_ct_s / 3600.0,
            s.p50_ct_s / 3600.0,
            s.p99_ct_s / 3600.0,
            s.makespan_s / 3600.0,
            s.ooms,
            s.avg_util,
            s.avg_work_rate,
            s.tuning_rounds,
            s.decision_latency_us,
            s.tune_latency_us,
        );
    }
    out
}

/// The `--json` object: `{"policies": {"<name>": {avg_ct_s, p99_ct_s, makespan_s, ooms, avg_util, ...}}}`.
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

/// Writes `summary.csv`, `tasks.csv`, `utilisation.csv` and the two SVG plots under
/// `dir`; returns the files written.
pub fn write_all(dir: &Path, runs: &[RunMetrics], summaries: &[Summary]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|source| SimError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut written = Vec::new();

    let mut csv = String::from(
        "policy,tasks,avg_ct_s,p50_ct_s,p99_ct_s,makespan_s,ooms,avg_util,avg_work_rate,tuning_rounds,batch_changes,decision_latency_us,decision_latency_p99_us,tune_latency_us\n",
    );
    for s in summaries {
        let _ = writeln!(
            csv,
            "{},{},{:.3},{:.3},{:.3},{:.3},{},{:.5},{:.5},{},{},{:.3},{:.3},{:.3}",
            s.policy,
            s.tasks,
            s.avg_ct_s,
            s.p50_ct_s,
            s.p99_ct_s,
            s.makespan_s,
            s.ooms,
            s.avg_util,
            s.avg_work_rate,
            s.tuning_rounds,
            s.batch_changes,
            s.decision_latency_us,
            s.decision_latency_p99_us,
            s.tune_latency_us
        );
    }
    let path = dir.join("summary.csv");
    write(&path, &csv)?;
    written.push(path);

    let mut csv =
        String::from("policy,task,model,m0,submit_s,start_s,finish_s,completion_s,ooms\n");
    for run in runs {
        for t in &run.tasks {
            let _ = writeln!(
                csv,
                "{},{},{},{},{:.3},{:.3},{:.3},{:.3},{}",
                run.policy,
                t.id,
                t.model,
                t.m0,
                t.submit_s,
                t.start_s,
                t.finish_s,
                t.completion_s(),
                t.ooms
            );
        }
    }
    let path = dir.join("tasks.csv");
    write(&path, &csv)?;
    written.push(path);

    let mut csv = String::from("policy,time_s,busy_gpus,work_rate\n");
    for run in runs {
        for (t, busy, rate) in &run.util {
            let _ = writeln!(csv, "{},{t:.3},{busy},{rate:.5}", run.policy);
        }
    }
    let path = dir.join("utilisation.csv");
    write(&path, &csv)?;
    written.push(path);

    let path = dir.join("completion_cdf.svg");
    plot_cdf(&path, runs)?;
    written.push(path);
    let path = dir.join("utilisation.svg");
    plot_utilisation(&path, runs)?;
    written.push(path);
    Ok(written)
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

/// Completion-time CDF of every policy (hours, log-free linear axis).
fn plot_cdf(path: &Path, runs: &[RunMetrics]) -> Result<()> {
    let series = runs
        .iter()
        .map(|run| {
            let mut ct: Vec<f64> = run
                .tasks
                .iter()
                .map(|t| t.completion_s() / 3600.0)
                .collect();
            ct.sort_by(f64::total_cmp);
            let n = ct.len().max(1) as f64;
            let points = ct
                .into_iter()
                .enumerate()
                .map(|(i, v)| (v, (i + 1) as f64 / n))
                .collect();
            (run.policy.clone(), points)
        })
        .collect();
    let frame = Frame {
        caption: "Completion time CDF",
        x_desc: "completion time (h)",
        y_desc: "fraction of tasks",
        y_max: 1.0,
        legend: SeriesLabelPosition::LowerRight,
        stroke: 2,
    };
    line_plot(path, &frame, series)
}

/// Busy fraction of the GPUs over time, one line per policy (at most ~2,000 steps each),
/// drawn as steps: the fraction holds until the next event changes it.
fn plot_utilisation(path: &Path, runs: &[RunMetrics]) -> Result<()> {
    let series = runs
        .iter()
        .map(|run| {
            let gpus = run.gpus.max(1) as f64;
            let stride = (run.util.len() / 2000).max(1);
            let mut points: Vec<(f64, f64)> = Vec::new();
            for (t, busy, _) in run.util.iter().step_by(stride) {
                let (x, y) = (t / 3600.0, *busy as f64 / gpus);
                if let Some(&(_, previous)) = points.last() {
                    points.push((x, previous));
                }
                points.push((x, y));
            }
            (run.policy.clone(), points)
        })
        .collect();
    let frame = Frame {
        caption: "GPUs busy over time",
        x_desc: "time (h)",
        y_desc: "fraction of GPUs with a task",
        y_max: 1.05,
        legend: SeriesLabelPosition::UpperRight,
        stroke: 1,
    };
    line_plot(path, &frame, series)
}

/// What differs between the plots; everything else is drawn the same way.
struct Frame {
    caption: &'static str,
    x_desc: &'static str,
    y_desc: &'static str,
    y_max: f64,
    legend: SeriesLabelPosition,
    stroke: u32,
}

/// One SVG with a line per (policy, points), x from 0 to the largest x of any series.
fn line_plot(path: &Path, frame: &Frame, series: Vec<(String, Vec<(f64, f64)>)>) -> Result<()> {
    let max_x = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold(1e-3, f64::max);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(frame.caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..max_x * 1.02, 0.0..frame.y_max)
        .map_err(|e| plot_error(path, e))?;
    chart
        .configure_mesh()
        .x_desc(frame.x_desc)
        .y_desc(frame.y_desc)
        .draw()
        .map_err(|e| plot_error(path, e))?;
    for (index, (name, points)) in series.into_iter().enumerate() {
        let color = PALETTE[index % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(frame.stroke)))
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
        .position(frame.legend.clone())
        .draw()
        .map_err(|e| plot_error(path, e))?;
    root.present().map_err(|e| plot_error(path, e))
}
