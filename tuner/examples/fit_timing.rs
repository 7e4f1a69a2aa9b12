//! Times the pieces of one GP-LCB round (4 tasks × 32 sizes × 50 observations); used to find
//! where the round's time goes. `cargo run --release -p iadeep-tuner --example fit_timing`
use std::time::Instant;

use iadeep_tuner::gp::{GaussianProcess, GpParams};
use nalgebra::DMatrix;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn main() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let x = DMatrix::from_fn(50, 4, |_, _| rng.random_range(3.0..8.0));
    let y: Vec<f64> = (0..50)
        .map(|i| x.row(i).iter().map(|v| (v - 5.5) * (v - 5.5)).sum())
        .collect();
    for iters in [1u64, 5, 10, 30] {
        let params = GpParams {
            restarts: 0,
            max_iters: iters,
            ..GpParams::default()
        };
        let start = Instant::now();
        let gp = GaussianProcess::fit(x.clone(), &y, params, None, &mut rng).expect("fits");
        println!(
            "max_iters {iters}: {:?} (nlml {:.3})",
            start.elapsed(),
            gp.neg_log_marginal()
        );
    }
    let gp =
        GaussianProcess::fit(x.clone(), &y, GpParams::default(), None, &mut rng).expect("fits");
    let start = Instant::now();
    for i in 0..1000 {
        let _ = gp.predict(&[3.0 + f64::from(i % 50) * 0.1, 4.0, 5.0, 6.0]);
    }
    println!("1000 predictions: {:?}", start.elapsed());
}
