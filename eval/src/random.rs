//! The one normal sampler of the evaluation code (the simulator's noise, the Gavel
//! benchmark's noisy surface). `rand` 0.9 has no normal distribution without
//! `rand_distr`, and Box–Muller on two uniforms is all these need; keeping the one
//! formula here keeps every seeded figure reproducible across them.

use rand::Rng;

/// One standard-normal draw (Box–Muller) from two uniforms of `rng`.
pub fn standard_normal<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;

    #[test]
    fn draws_have_the_standard_moments() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let draws: Vec<f64> = (0..20_000).map(|_| standard_normal(&mut rng)).collect();
        let mean = iadeep_objective::stats::mean(draws.iter().copied()).unwrap_or(f64::NAN);
        let var = iadeep_objective::stats::mean(draws.iter().map(|d| (d - mean).powi(2)))
            .unwrap_or(f64::NAN);
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "variance {var}");
    }
}
