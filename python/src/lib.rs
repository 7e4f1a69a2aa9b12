//! `iadeep._native`: the iadeep agent (`iadeep-agent`) for Python training loops.
//!
//! The Python package `iadeep` (in `python/iadeep/`) re-exports these types; its
//! `iadeep.torch` part builds the PyTorch conveniences on top of them in Python.
//!
//! GIL discipline: the per-step calls (`batch_size`, `record_step`, `poll_change`
//! with nothing pending, `record_peak_memory`) hold the GIL for a few atomic
//! operations and allocate nothing; every call that waits on the state store
//! (`Agent(...)`, `Agent.from_env`, `finish`, leaving a `with` block) releases it,
//! so other Python threads (data loading) run meanwhile.
//!
//! - `agent`: the `Agent` class;
//! - `change`: `BatchSizeChange`, what `poll_change` and `report_oom` return;
//! - `logging`: the agent's log lines on stderr.

mod agent;
mod change;
mod logging;

use pyo3::prelude::*;

pyo3::create_exception!(
    iadeep,
    AgentError,
    pyo3::exceptions::PyException,
    "The agent could not start or finish: bad configuration, a malformed store URL, or a \
     finish the store did not confirm. An unreachable store while training is never an error."
);

/// The module the `iadeep` package imports.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<agent::Agent>()?;
    m.add_class::<change::BatchSizeChange>()?;
    m.add("AgentError", m.py().get_type::<AgentError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("LR_RULES", iadeep_agent::launch::LR_RULE_NAMES.to_vec())?;
    Ok(())
}
