//! Evaluation of the co-location predictor (`iadeep-predictor`).
//!
//! - [`gavel`]: co-location samples from Gavel's measured throughputs;
//! - [`prequential`], [`unseen`]: the two splits, predict-then-learn over a
//!   shuffled stream and model families never seen, each scoring ours against
//!   the two baselines (`reference`: a forest on one-hot job names;
//!   `plain_forest`: a plain forest on our profile features).

pub mod gavel;
mod plain_forest;
pub mod prequential;
mod reference;
pub mod unseen;
