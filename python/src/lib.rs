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

pyo3::create_exception!(
    iadeep,
    Evicted,
    pyo3::exceptions::PyException,
    "The placer evicted the job: a production job on its GPU stayed above its slowdown cap \
     with this job at its smallest batch size, and the measurements blame this job most. \
     Raised by `Agent.poll_change()` (the agent has ended by then: a final report, not \
     finished, and its lease revoked); `reason` says why. Checkpoint before it (see \
     `Agent.evicted`, `iadeep.torch`), let it end the process, and \
     `iadeep run --requeue-on-evict` places the job again and restarts it with \
     IADEEP_REQUEUED set, so it resumes from the checkpoint. Work since the last \
     checkpoint is lost; a job without one starts over."
);

/// How many times `iadeep run` started this job again after an eviction (the
/// environment's IADEEP_REQUEUED; 0 on the first run): a job that sees more than 0
/// resumes from its checkpoint.
#[pyfunction]
fn requeued() -> PyResult<u32> {
    iadeep_agent::launch::requeue_from_env()
        .map(|(count, _)| count)
        .map_err(|err| AgentError::new_err(err.to_string()))
}

/// Why the job's previous run was evicted (IADEEP_EVICTED_REASON), or None.
#[pyfunction]
fn evicted_reason() -> PyResult<Option<String>> {
    iadeep_agent::launch::requeue_from_env()
        .map(|(_, reason)| reason)
        .map_err(|err| AgentError::new_err(err.to_string()))
}

/// The module the `iadeep` package imports.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<agent::Agent>()?;
    m.add_class::<change::BatchSizeChange>()?;
    m.add("AgentError", m.py().get_type::<AgentError>())?;
    m.add("Evicted", m.py().get_type::<Evicted>())?;
    m.add_function(wrap_pyfunction!(requeued, m)?)?;
    m.add_function(wrap_pyfunction!(evicted_reason, m)?)?;
    m.add(
        "PRIORITY_CLASSES",
        iadeep_proto::PRIORITY_CLASS_NAMES.to_vec(),
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("LR_RULES", iadeep_agent::launch::LR_RULE_NAMES.to_vec())?;
    Ok(())
}
