//! One GP-LCB round (GP fit + acquisition) for 4 tasks × 32 batch sizes × 50 observations.
//!
//! The lattice has 32⁴ ≈ 10⁶ configurations, so the acquisition is the sampling plus
//! coordinate-descent path. "cold" fits without a previous fit's hyper-parameters; "warm" is
//! the steady state of the daemon: 49 observations were fitted last round, one arrives, refit
//! starting from the previous hyper-parameters.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use iadeep_tuner::{GpLcb, LcbParams, SearchSpace};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn surface(b: &[u32]) -> f64 {
    b.iter()
        .enumerate()
        .map(|(k, &v)| {
            (1.0 + 0.1 * k as f64) * (f64::from(v).log2() - 5.0 - 0.3 * k as f64).powi(2)
        })
        .sum::<f64>()
        + 4.0
}

fn searches() -> (GpLcb, GpLcb, Vec<usize>, f64) {
    let sizes: Vec<u32> = (1..=32).map(|i| i * 8).collect();
    let space = SearchSpace {
        sizes: vec![sizes; 4],
        start: vec![7; 4],
        memory: None,
    };
    let mut search = GpLcb::new(space, LcbParams::default(), 42).expect("valid space");
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for _ in 0..49 {
        let idx: Vec<usize> = (0..4).map(|_| rng.random_range(0..32)).collect();
        let v = surface(&search.space().batch_sizes(&idx));
        search.observe(&idx, Some(v)).expect("in space");
    }
    let cold = search.clone();
    search.model().expect("fits"); // the previous round's fit: its θ warm-starts the next
    let last: Vec<usize> = (0..4).map(|_| rng.random_range(0..32)).collect();
    let v = surface(&search.space().batch_sizes(&last));
    (cold, search, last, v)
}

fn round(c: &mut Criterion) {
    let (cold, warm, last, v) = searches();
    c.bench_function("gp_lcb_round_4x32_50obs_cold", |b| {
        b.iter_batched(
            || {
                let mut s = cold.clone();
                s.observe(&last, Some(v)).expect("in space");
                s
            },
            |mut s| s.suggest().expect("suggests"),
            BatchSize::SmallInput,
        )
    });
    c.bench_function("gp_lcb_round_4x32_50obs_warm", |b| {
        b.iter_batched(
            || {
                let mut s = warm.clone();
                s.observe(&last, Some(v)).expect("in space");
                s
            },
            |mut s| s.suggest().expect("suggests"),
            BatchSize::SmallInput,
        )
    });
}

fn round_fixed_hyper(c: &mut Criterion) {
    // Between hyper-parameter refits (`LcbParams::refit_every` > 1): condition + acquisition.
    let (_, warm, last, v) = searches();
    let mut between = warm.clone();
    between.set_refit_every(1_000).expect("valid");
    c.bench_function("gp_lcb_round_4x32_50obs_fixed_hyper", |b| {
        b.iter_batched(
            || {
                let mut s = between.clone();
                s.observe(&last, Some(v)).expect("in space");
                s
            },
            |mut s| s.suggest().expect("suggests"),
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, round, round_fixed_hyper);
criterion_main!(benches);
