//! `iadeep sim --audit`: iadeep's placement decisions next to the simulated truth,
//! written as JSON lines and summarised on stderr (see `iadeep_sim::AuditRecord`).

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use iadeep_placer::PlacerParams;
use iadeep_sim::{AuditRecord, AuditSummary, ErrorStats};

/// Writes `audit-<policy>.jsonl` under `out` and prints the summary on stderr.
pub fn write(out: &Path, policy: &str, records: &[AuditRecord]) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let path = out.join(format!("audit-{policy}.jsonl"));
    let file =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut file = std::io::BufWriter::new(file);
    for record in records {
        serde_json::to_writer(&mut file, record)
            .with_context(|| format!("writing {}", path.display()))?;
        file.write_all(b"\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    file.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    let s = AuditSummary::of(records, PlacerParams::default().min_throughput_gain);
    eprintln!("{}", summary_text(policy, &s));
    eprintln!("  decisions: {}", path.display());
    Ok(())
}

fn errors_text(name: &str, e: &ErrorStats) -> String {
    format!(
        "  {name:<34} n {:>6}  own MAPE {:.3}  own bias {:+.3}  ΣPD-increase bias {:+.3}  \
         throughput-gain bias {:+.3}",
        e.n, e.own_mape, e.own_bias, e.pd_increase_bias, e.gain_bias
    )
}

fn summary_text(policy: &str, s: &AuditSummary) -> String {
    [
        format!(
            "placement audit of {policy}: {} decisions: placed on an idle GPU {}, placed on a \
             shared GPU {}, queued {} (of which with an idle GPU free {}), held for a task \
             waiting ahead {}",
            s.decisions, s.placed_idle, s.placed_shared, s.queued, s.queued_with_idle, s.held
        ),
        errors_text("learned model (fitted) vs truth", &s.model_fitted),
        errors_text("heuristic on the same candidates", &s.heuristic_on_fitted),
        errors_text("model while cold (heuristic)", &s.model_cold),
        format!(
            "  shared placements: mean true throughput gain {:.3}; {} below the guard's minimum; \
             Σ PD increase of the chosen GPU {:.3} predicted, {:.3} true",
            s.shared_true_gain,
            s.shared_bad_gain,
            s.shared_pd_increase_pred,
            s.shared_pd_increase_true
        ),
        format!(
            "  ranking: best by truth chosen in {} of {} decisions with 2+ scored shared GPUs",
            s.ranked_best, s.ranked
        ),
        format!(
            "  queue: mean predicted W {:.0} s, real wait {:.0} s (bias {:+.1} %); placing would \
             have cost {:.0} s predicted, {:.0} s true; {} queue decisions regretted (placing \
             truly cheaper)",
            s.queue_wait_pred_s,
            s.queue_wait_real_s,
            100.0 * s.queue_wait_bias,
            s.queue_place_cost_pred_s,
            s.queue_place_cost_true_s,
            s.queue_regretted
        ),
        format!(
            "  W's error: the (q+1)-th busy device's residents truly finished after {:.0} s \
             (what W predicts), but it truly became empty after {:.0} s (tasks joined it \
             while still busy)",
            s.queue_residents_done_s, s.queue_drained_s
        ),
        format!(
            "  place: {} shared placements regretted (true cost of placing above W)",
            s.shared_regretted
        ),
    ]
    .join("\n")
}
