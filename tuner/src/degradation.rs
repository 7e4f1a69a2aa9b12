//! The tuner's objective: performance degradation PD = IF·DT/E.
//!
//! The formulas live in `iadeep-objective` (shared with the agent SDK and the
//! simulator, so there is exactly one definition of PD in the code); this module
//! re-exports them under the tuner's name for them.

pub use iadeep_objective::pd::{
    PdInput, interference, pd_from_factors, statistical_efficiency, throughput_drop,
};
pub use iadeep_objective::{GnsEstimator, lr_factor};
