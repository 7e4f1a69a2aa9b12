//! iadeep's objective, in one place for every crate that needs it.
//!
//! - [`pd`]: performance degradation PD = IF·DT/E (docs/design.md, "The objective"),
//!   what the tuner minimises and the simulator reports;
//! - [`gns`]: the gradient noise scale φ from two gradient norms at two batch
//!   sizes, which the agent measures and E(m) needs;
//! - [`lr`]: the learning-rate factor that comes with a batch-size change, which
//!   the tuner writes into assignments and the agent applies on its own fall-backs;
//! - [`margin`]: the one memory margin of a card, kept free by the placer, the tuner
//!   and the agent's fall-back alike;
//! - [`stats`]: the mean, median and quantiles everything else takes.
//!
//! Why a crate of its own: the agent SDK is linked into users' training loops and
//! must stay light, so it cannot depend on the tuner (GP, linear algebra); both
//! depend on this small crate instead of keeping copies. It depends on no other iadeep
//! crate (the wire's learning-rate enum converts into [`LrScalingRule`]), so it pulls in
//! no protobuf or RPC runtime.

pub mod gns;
pub mod lr;
pub mod margin;
pub mod pd;
pub mod stats;

pub use gns::{GnsEstimator, GnsSampleError};
pub use lr::{LrScalingRule, lr_factor};
pub use margin::MemoryMargin;
pub use pd::PdInput;

/// A value outside its domain; the message names it.
#[derive(Debug, thiserror::Error)]
pub enum ObjectiveError {
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

/// Shorthand used throughout the crate.
pub type Result<T, E = ObjectiveError> = std::result::Result<T, E>;
