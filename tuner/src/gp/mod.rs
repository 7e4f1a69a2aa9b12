//! Gaussian-process surrogate of a device's objective over its joint batch-size vector.
//!
//! Split like egobox: [`kernel`] (Matérn-5/2 with per-dimension length scales), [`mean`]
//! (constant mean and output scaling) and [`model`] (fitting by maximum marginal likelihood
//! with argmin L-BFGS on log-parameters, prediction through a jittered Cholesky factor).
//! Inputs are log2 batch sizes, so "twice as large" is the same distance everywhere.

pub mod kernel;
pub mod linalg;
pub mod mean;
pub mod model;

pub use kernel::{LinearTrend, Matern52};
pub use mean::ConstantMean;
pub use model::{GaussianProcess, GpParams, Prediction, Predictor};
