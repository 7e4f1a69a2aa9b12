//! Benchmark of GP-LCB on Gavel's measured co-location throughputs.
//!
//! For every pair of job families with at least three measured batch sizes (a family with
//! itself included), the true Σ PD surface over (b1, b2) is built from the measurements:
//! m0 = the family's middle batch size, PD_k = (m0 · solo(m0)) / (b_k · co-located steps/s),
//! E = 1 (Gavel has no gradient statistics), failed pairs are out of memory. GP-LCB and
//! random search (uniform, without replacement) then run against it, both starting at the
//! submitted configuration (m0, m0) as the daemon does, each observing the true value times
//! (1 + 1% Gaussian noise), and we count the rounds (every measurement, out-of-memory ones
//! included) until a configuration within 2% of the exhaustive optimum has been measured.
//! Both know what the tuner daemon knows about memory after an out-of-memory report: every
//! configuration at or above the failed one, in both batch sizes, fails too (memory grows
//! with the batch size), so neither runs one ([`at_or_above_an_oom`]). Gavel records no
//! memory figures, so that is all the memory knowledge either gets.

use iadeep_datasets::gavel::{JobType, PairOutcome, WorkerThroughputs};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use iadeep_objective::PdInput;
use iadeep_objective::stats::{mean, quantile};
use iadeep_tuner::{Evaluator, GpLcb, LcbParams, SearchSpace, at_or_above_an_oom};
use iadeep_tuner::{Result, TunerError};

/// One two-task problem: the true Σ PD over the lattice of measured batch sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct PairProblem {
    pub families: (String, String),
    pub sizes: [Vec<u32>; 2],
    /// Index of m0 in each task's sizes.
    pub m0_index: [usize; 2],
    /// `values[i][j]`: Σ PD at `(sizes[0][i], sizes[1][j])`; `None` = failed (out of memory) or
    /// not measured.
    pub values: Vec<Vec<Option<f64>>>,
}

impl PairProblem {
    /// The optimum, or an error for a problem with no feasible configuration.
    pub fn required_optimum(&self) -> Result<f64> {
        self.optimum().ok_or_else(|| {
            TunerError::InvalidInput("problem has no feasible configuration".to_owned())
        })
    }

    /// The exhaustive optimum over the feasible configurations.
    pub fn optimum(&self) -> Option<f64> {
        self.values
            .iter()
            .flatten()
            .flatten()
            .copied()
            .reduce(f64::min)
    }

    /// Number of configurations (feasible or not).
    pub fn cardinality(&self) -> usize {
        self.sizes[0].len() * self.sizes[1].len()
    }

    fn value_at(&self, batch_sizes: &[u32]) -> Result<Option<f64>> {
        let find = |t: usize| {
            self.sizes[t]
                .iter()
                .position(|&s| Some(&s) == batch_sizes.get(t))
                .ok_or_else(|| {
                    TunerError::InvalidInput(format!(
                        "batch sizes {batch_sizes:?} are not on the lattice"
                    ))
                })
        };
        Ok(self.values[find(0)?][find(1)?])
    }
}

/// Builds every pair problem of one worker type. Problems with no feasible configuration or
/// without the solo throughput at m0 are skipped (and logged).
pub fn pair_problems(worker: &WorkerThroughputs) -> Vec<PairProblem> {
    let families: Vec<(String, Vec<u32>)> = worker
        .families()
        .into_iter()
        .filter(|(_, sizes)| sizes.len() >= 3)
        .collect();
    let mut problems = Vec::new();
    for (a, (fa, sa)) in families.iter().enumerate() {
        for (fb, sb) in families.iter().skip(a) {
            let m0_index = [sa.len() / 2, sb.len() / 2];
            let job = |f: &str, b: u32| JobType {
                family: f.to_owned(),
                batch_size: Some(b),
            };
            let solo_a = worker.solo_steps_per_s(&job(fa, sa[m0_index[0]]));
            let solo_b = worker.solo_steps_per_s(&job(fb, sb[m0_index[1]]));
            let (Some(solo_a), Some(solo_b)) = (solo_a, solo_b) else {
                tracing::warn!(fa, fb, "no solo throughput at m0; pair skipped");
                continue;
            };
            // PD of one task of the pair (E = 1: Gavel has no gradient statistics).
            let pd = |m0: u32, solo_steps_per_s: f64, m: u32, co_steps_per_s: f64| {
                PdInput {
                    m0: f64::from(m0),
                    solo_step_s_m0: 1.0 / solo_steps_per_s,
                    m: f64::from(m),
                    co_step_s: 1.0 / co_steps_per_s,
                    noise_scale: None,
                }
                .pd()
                .ok()
            };
            let (m0_a, m0_b) = (sa[m0_index[0]], sb[m0_index[1]]);
            let values: Vec<Vec<Option<f64>>> = sa
                .iter()
                .map(|&ba| {
                    sb.iter()
                        .map(|&bb| match worker.pair(&job(fa, ba), &job(fb, bb)) {
                            Some(PairOutcome::Ran { first, second })
                                if first > 0.0 && second > 0.0 =>
                            {
                                Some(pd(m0_a, solo_a, ba, first)? + pd(m0_b, solo_b, bb, second)?)
                            }
                            _ => None,
                        })
                        .collect()
                })
                .collect();
            let problem = PairProblem {
                families: (fa.clone(), fb.clone()),
                sizes: [sa.clone(), sb.clone()],
                m0_index,
                values,
            };
            if problem.optimum().is_some() {
                problems.push(problem);
            } else {
                tracing::warn!(fa, fb, "no feasible configuration; pair skipped");
            }
        }
    }
    problems
}

/// The measured surface as a world: returns the true value with multiplicative noise.
#[derive(Debug)]
pub struct NoisySurface<'a> {
    problem: &'a PairProblem,
    noise: f64,
    rng: ChaCha8Rng,
}

impl<'a> NoisySurface<'a> {
    /// `noise` is the relative standard deviation (e.g. 0.01).
    pub fn new(problem: &'a PairProblem, noise: f64, seed: u64) -> NoisySurface<'a> {
        NoisySurface {
            problem,
            noise,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    fn gaussian(&mut self) -> f64 {
        crate::random::standard_normal(&mut self.rng)
    }
}

impl Evaluator for NoisySurface<'_> {
    fn evaluate(&mut self, batch_sizes: &[u32]) -> Result<Option<f64>> {
        let truth = self.problem.value_at(batch_sizes)?;
        Ok(truth.map(|v| v * (1.0 + self.noise * self.gaussian())))
    }
}

/// Benchmark settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BenchParams {
    pub seeds: u64,
    /// Seeds run are `first_seed..first_seed + seeds`: tune on one range, report another.
    pub first_seed: u64,
    /// Relative measurement noise.
    pub noise: f64,
    /// A configuration within this relative gap of the optimum counts as found.
    pub tolerance: f64,
    /// Round cap per run, as a multiple of the lattice size (a run that never gets there is
    /// counted at the cap, and reported as unreached).
    pub cap_factor: usize,
    pub lcb: LcbParams,
}

impl Default for BenchParams {
    /// 20 seeds, 1% noise, within 2%, cap 3 × |D|: the benchmark's fixed protocol, the
    /// same for every search it compares.
    fn default() -> Self {
        BenchParams {
            seeds: 20,
            first_seed: 0,
            noise: 0.01,
            tolerance: 0.02,
            cap_factor: 3,
            lcb: LcbParams::default(),
        }
    }
}

/// Rounds-to-target statistics of one strategy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoundStats {
    pub median_rounds: f64,
    pub p90_rounds: f64,
    pub mean_rounds: f64,
    /// Runs that hit the round cap without reaching the target.
    pub unreached: usize,
    pub runs: usize,
}

/// The benchmark's result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchReport {
    pub problems: usize,
    pub seeds: u64,
    pub first_seed: u64,
    pub gp_lcb: RoundStats,
    pub random: RoundStats,
}

fn summarise(rounds: &[(usize, bool)]) -> RoundStats {
    let values: Vec<f64> = rounds.iter().map(|(r, _)| *r as f64).collect();
    RoundStats {
        median_rounds: quantile(&values, 0.5).unwrap_or(f64::NAN),
        p90_rounds: quantile(&values, 0.9).unwrap_or(f64::NAN),
        mean_rounds: mean(values.iter().copied()).unwrap_or(0.0),
        unreached: rounds.iter().filter(|(_, reached)| !reached).count(),
        runs: rounds.len(),
    }
}

/// Rounds GP-LCB needs on `problem` with `seed`; (rounds, reached).
pub fn gp_lcb_rounds(
    problem: &PairProblem,
    params: &BenchParams,
    seed: u64,
) -> Result<(usize, bool)> {
    let optimum = problem.required_optimum()?;
    let space = SearchSpace {
        sizes: problem.sizes.to_vec(),
        start: problem.m0_index.to_vec(),
        memory: None,
    };
    let mut search = GpLcb::new(space, params.lcb, seed)?;
    let mut world = NoisySurface::new(problem, params.noise, seed ^ 0x9e37_79b9);
    let cap = params.cap_factor * problem.cardinality();
    for round in 1..=cap {
        let (idx, _) = search.step(&mut world)?;
        if let Some(v) = problem.values[idx[0]][idx[1]]
            && v <= optimum * (1.0 + params.tolerance)
        {
            return Ok((round, true));
        }
    }
    Ok((cap, false))
}

/// Rounds uniform random search without replacement needs; (rounds, reached).
///
/// A fair baseline gets the same world knowledge as GP-LCB: the same start (the submitted m0
/// configuration), then every other configuration once in a uniformly random order, except
/// that a configuration at or above (in both batch sizes) one already measured out of memory
/// is skipped without being run — the rule [`GpLcb`] applies through
/// [`at_or_above_an_oom`]. Every configuration actually run counts as a round, out-of-memory
/// ones included, as for GP-LCB. (Random search never looks at the measured values, so the
/// measurement noise does not affect it.)
pub fn random_rounds(
    problem: &PairProblem,
    params: &BenchParams,
    seed: u64,
) -> Result<(usize, bool)> {
    let optimum = problem.required_optimum()?;
    let start = problem.m0_index.to_vec();
    let mut rest: Vec<Vec<usize>> = (0..problem.sizes[0].len())
        .flat_map(|i| (0..problem.sizes[1].len()).map(move |j| vec![i, j]))
        .filter(|c| *c != start)
        .collect();
    rest.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut out_of_memory: Vec<Vec<usize>> = Vec::new();
    let mut rounds = 0;
    for idx in std::iter::once(start).chain(rest) {
        if at_or_above_an_oom(&out_of_memory, &idx) {
            continue;
        }
        rounds += 1;
        match problem.values[idx[0]][idx[1]] {
            Some(v) if v <= optimum * (1.0 + params.tolerance) => return Ok((rounds, true)),
            Some(_) => {}
            None => out_of_memory.push(idx),
        }
    }
    // Only possible if a feasible target lies above a failed configuration.
    Ok((rounds, false))
}

/// Runs both strategies on every problem and seed.
pub fn run(problems: &[PairProblem], params: &BenchParams) -> Result<BenchReport> {
    if problems.is_empty() {
        return Err(TunerError::InvalidInput(
            "no pair of job families with at least three measured batch sizes".to_owned(),
        ));
    }
    let (mut gp, mut random) = (Vec::new(), Vec::new());
    for problem in problems {
        for seed in params.first_seed..params.first_seed.saturating_add(params.seeds) {
            gp.push(gp_lcb_rounds(problem, params, seed)?);
            random.push(random_rounds(problem, params, seed)?);
        }
        tracing::debug!(families = ?problem.families, "benchmarked");
    }
    Ok(BenchReport {
        problems: problems.len(),
        seeds: params.seeds,
        first_seed: params.first_seed,
        gp_lcb: summarise(&gp),
        random: summarise(&random),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_datasets::gavel::GavelThroughputs;

    #[test]
    fn bundled_k80_problems_are_consistent() {
        let data = GavelThroughputs::bundled().expect("bundled file parses");
        let problems = pair_problems(data.worker("k80").expect("k80 present"));
        assert!(!problems.is_empty());
        for p in &problems {
            // At (m0, m0) alone PD would be 1 each; co-located it can only be worse or near.
            let opt = p.optimum().expect("kept only feasible problems");
            assert!(opt.is_finite() && opt > 0.0);
            assert!(p.sizes[0].len() >= 3 && p.sizes[1].len() >= 3);
        }
    }

    #[test]
    fn the_oom_rule_never_hides_a_target_in_the_bundled_data() {
        // Both searches treat every configuration at or above a failed one as failed. In
        // Gavel's data that holds except at three K80 failures with the smallest co-runner
        // size ((LM, Transformer) and (ResNet-18, Transformer) at (smallest, 256),
        // (Recommendation, ResNet-50) at (8192, 16)) while larger co-runners ran: "failed"
        // there is not out of memory. The rule then skips a few configurations that ran, for
        // both searches alike; it must never skip one within the 2% target, or the benchmark
        // would measure the rule rather than the search.
        let data = GavelThroughputs::bundled().expect("bundled file parses");
        let tolerance = BenchParams::default().tolerance;
        let mut hidden_but_ran = 0;
        for worker in ["k80", "p100"] {
            for p in pair_problems(data.worker(worker).expect("worker present")) {
                let target = p.optimum().expect("feasible") * (1.0 + tolerance);
                let failed: Vec<Vec<usize>> = (0..p.sizes[0].len())
                    .flat_map(|i| (0..p.sizes[1].len()).map(move |j| vec![i, j]))
                    .filter(|c| p.values[c[0]][c[1]].is_none())
                    .collect();
                for (i, row) in p.values.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        let Some(v) = v else { continue };
                        if at_or_above_an_oom(&failed, &[i, j]) {
                            hidden_but_ran += 1;
                            assert!(
                                *v > target,
                                "{worker} {:?}: target ({i}, {j}) is above a failure",
                                p.families
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(
            hidden_but_ran, 7,
            "the data changed: re-check the comment above"
        );
    }

    #[test]
    fn random_search_skips_what_an_oom_rules_out() {
        // Only (0, 0) is within 2%; m0 = (1, 1) and everything above it fails.
        let p = PairProblem {
            families: ("a".into(), "b".into()),
            sizes: [vec![1, 2, 4], vec![1, 2, 4]],
            m0_index: [1, 1],
            values: vec![
                vec![Some(2.0), Some(3.0), Some(3.0)],
                vec![Some(3.0), None, None],
                vec![Some(3.0), None, None],
            ],
        };
        let params = BenchParams::default();
        for seed in 0..40 {
            let (r, reached) = random_rounds(&p, &params, seed).expect("runs");
            assert!(reached);
            // m0 fails and rules out the three failures above it: m0 + at most the five
            // feasible configurations. Without the rule, a seed that orders (0, 0) among the
            // last three of the eight others (3 in 8 do) would need 7 to 9 rounds.
            assert!((2..=6).contains(&r), "seed {seed}: {r} rounds");
        }
    }

    #[test]
    fn both_searches_start_at_m0() {
        // m0 is the optimum: both strategies find it in round 1, whatever the seed.
        let p = PairProblem {
            families: ("a".into(), "b".into()),
            sizes: [vec![1, 2, 4], vec![1, 2, 4]],
            m0_index: [1, 1],
            values: vec![
                vec![Some(3.0), Some(2.5), Some(2.9)],
                vec![Some(2.2), Some(2.0), Some(2.6)],
                vec![Some(3.1), Some(2.7), None],
            ],
        };
        let params = BenchParams::default();
        for seed in 0..5 {
            assert_eq!(random_rounds(&p, &params, seed).expect("runs"), (1, true));
            assert_eq!(gp_lcb_rounds(&p, &params, seed).expect("runs"), (1, true));
        }
    }

    #[test]
    fn random_search_finds_the_target_within_the_lattice() {
        let p = PairProblem {
            families: ("a".into(), "b".into()),
            sizes: [vec![1, 2, 4], vec![1, 2, 4]],
            m0_index: [1, 1],
            values: vec![
                vec![Some(3.0), Some(2.5), None],
                vec![Some(2.2), Some(2.0), None],
                vec![None, None, None],
            ],
        };
        let params = BenchParams::default();
        for seed in 0..5 {
            let (r, reached) = random_rounds(&p, &params, seed).expect("runs");
            assert!(reached && (1..=9).contains(&r));
            let (r, reached) = gp_lcb_rounds(&p, &params, seed).expect("runs");
            assert!(reached && r <= 27, "{r}");
        }
    }
}
