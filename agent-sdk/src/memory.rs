//! Peak GPU memory of the training process.
//!
//! With an NVIDIA GPU, NVML's list of running compute processes gives the memory
//! our pid holds on each device; the peak is the largest total seen so far.
//! Without NVML (no driver, a CPU job, another vendor) the trainer may supply its
//! own probe (e.g. `torch.cuda.max_memory_allocated` through FFI, or a model).
//! A missing NVML is a logged fact, never an error: the report then carries no
//! memory figure rather than a made-up one.

use std::fmt;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

/// Something that can say how much GPU memory the process uses, in MiB.
pub trait MemoryProbe: Send {
    /// Memory in use now (or the peak since start, if that is what the source
    /// knows); `None` when it cannot be measured at the moment.
    fn current_mib(&mut self) -> Option<u64>;
}

/// A caller-supplied closure as a probe.
impl<F> MemoryProbe for F
where
    F: FnMut() -> Option<u64> + Send,
{
    fn current_mib(&mut self) -> Option<u64> {
        self()
    }
}

/// NVML per-process memory of one pid, summed over devices.
pub struct NvmlProbe {
    nvml: Nvml,
    pid: u32,
}

impl fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlProbe")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl NvmlProbe {
    /// Loads NVML; `None` (with an info log saying why) when it is not there.
    pub fn try_new(pid: u32) -> Option<NvmlProbe> {
        match Nvml::init() {
            Ok(nvml) => {
                let devices = nvml.device_count().unwrap_or(0);
                tracing::info!(
                    pid,
                    devices,
                    "NVML available: peak memory from per-process usage"
                );
                Some(NvmlProbe { nvml, pid })
            }
            Err(err) => {
                tracing::info!(%err, "NVML not available: GPU memory comes from the caller's probe, if any");
                None
            }
        }
    }
}

impl MemoryProbe for NvmlProbe {
    fn current_mib(&mut self) -> Option<u64> {
        let count = self.nvml.device_count().ok()?;
        let mut total: Option<u64> = None;
        for index in 0..count {
            let Ok(device) = self.nvml.device_by_index(index) else {
                continue;
            };
            let Ok(processes) = device.running_compute_processes() else {
                continue;
            };
            for process in processes.iter().filter(|p| p.pid == self.pid) {
                if let UsedGpuMemory::Used(bytes) = process.used_gpu_memory {
                    *total.get_or_insert(0) += bytes / (1024 * 1024);
                }
            }
        }
        total
    }
}

/// The probes in order of preference, and the peak they have shown under the current
/// batch-size generation.
///
/// Why per generation: a peak since the start belongs to the largest batch size the task
/// ever ran, so a task that only shrinks would never teach the tuner its memory at the
/// smaller size, and the fixed part (weights, optimiser state, context) would never be
/// learned. With NVML and a caching allocator the process keeps what it reserved at the
/// larger size, so the figure after a shrink stays high: an over-estimate, which is the
/// safe error.
pub(crate) struct PeakMemory {
    nvml: Option<NvmlProbe>,
    caller: Option<Box<dyn MemoryProbe>>,
    peak: Option<u64>,
    /// The generation and batch size the peak belongs to.
    generation: Option<u64>,
    batch_size: u32,
    /// The last peak given, with its batch size: what is given under a generation that
    /// has no step yet.
    last_given: Option<(u64, u32)>,
}

impl fmt::Debug for PeakMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeakMemory")
            .field("nvml", &self.nvml.is_some())
            .field("caller", &self.caller.is_some())
            .field("peak", &self.peak)
            .field("batch_size", &self.batch_size)
            .finish()
    }
}

impl PeakMemory {
    pub(crate) fn new(nvml: Option<NvmlProbe>, caller: Option<Box<dyn MemoryProbe>>) -> Self {
        PeakMemory {
            nvml,
            caller,
            peak: None,
            generation: None,
            batch_size: 0,
            last_given: None,
        }
    }

    /// Samples the probes while the loop trains at `batch_size` under `generation`, and
    /// returns the peak of that generation so far with its batch size (a new generation
    /// starts a new peak). NVML comes first: it sees the whole process, including the
    /// framework's caching allocator and the CUDA context; then what the trainer
    /// `recorded` itself (`Agent::record_peak_memory`), then the caller's probe.
    ///
    /// `stepped` says whether a step has ended under the generation. Until one has, the
    /// generation's peak is not given: before the first step the process holds its CUDA
    /// context and weights but not a step's activations and optimiser state. On a real
    /// GPU that figure (the CUDA context, about 500 MiB) was reported as the peak, and
    /// the placer settled the job's reservation at it while the job went on to use
    /// several GiB (`data/measured/h200/README.md`). Meanwhile the last peak given is
    /// given again, labelled with its own batch size, so that a report after a change
    /// still tells the placer what the process held (it counts a resident at its
    /// reported peak); nothing is given before the first step of all.
    pub(crate) fn sample(
        &mut self,
        recorded: Option<u64>,
        generation: u64,
        batch_size: u32,
        stepped: bool,
    ) -> Option<(u64, u32)> {
        if self.generation != Some(generation) {
            self.generation = Some(generation);
            self.batch_size = batch_size;
            self.peak = None;
        }
        let now = self
            .nvml
            .as_mut()
            .and_then(NvmlProbe::current_mib)
            .or(recorded)
            .or_else(|| self.caller.as_mut().and_then(|p| p.current_mib()));
        if let Some(now) = now {
            self.peak = Some(self.peak.map_or(now, |p| p.max(now)));
        }
        if !stepped {
            return self.last_given;
        }
        let given = self.peak.map(|p| (p, self.batch_size));
        if given.is_some() {
            self.last_given = given;
        }
        given
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_is_the_largest_value_a_probe_showed() {
        let mut values = vec![Some(300), None, Some(900), Some(500)].into_iter();
        let mut peak = PeakMemory::new(None, Some(Box::new(move || values.next().flatten())));
        assert_eq!(peak.sample(None, 0, 32, true), Some((300, 32)));
        assert_eq!(peak.sample(None, 0, 32, true), Some((300, 32)));
        assert_eq!(peak.sample(None, 0, 32, true), Some((900, 32)));
        assert_eq!(peak.sample(None, 0, 32, true), Some((900, 32)));
    }

    /// What the process holds before its first step (the CUDA context, on a real GPU)
    /// is not the peak of a training step: nothing is given until a step ended, and
    /// then the largest figure seen, the one before the step included.
    #[test]
    fn no_peak_is_given_before_a_step_of_its_generation_ended() {
        let mut values = vec![Some(518), Some(520), Some(6400)].into_iter();
        let mut peak = PeakMemory::new(None, Some(Box::new(move || values.next().flatten())));
        assert_eq!(peak.sample(None, 0, 64, false), None);
        assert_eq!(peak.sample(None, 0, 64, false), None);
        assert_eq!(peak.sample(None, 0, 64, true), Some((6400, 64)));
    }

    /// After a shrink the peak starts again, at the new size, once a step ran at it.
    #[test]
    fn a_new_generation_starts_a_new_peak_at_its_batch_size() {
        let mut values = vec![Some(6000), Some(4500), Some(4400)].into_iter();
        let mut peak = PeakMemory::new(None, Some(Box::new(move || values.next().flatten())));
        assert_eq!(peak.sample(None, 0, 64, true), Some((6000, 64)));
        assert_eq!(
            peak.sample(None, 1, 32, false),
            Some((6000, 64)),
            "no step at 32 yet: the last peak given, at its own size"
        );
        assert_eq!(peak.sample(None, 1, 32, true), Some((4500, 32)));
    }

    #[test]
    fn a_recorded_peak_comes_before_the_callers_probe() {
        let mut peak = PeakMemory::new(None, Some(Box::new(|| Some(100))));
        assert_eq!(peak.sample(Some(700), 0, 8, true), Some((700, 8)));
        assert_eq!(
            peak.sample(None, 0, 8, true),
            Some((700, 8)),
            "the peak stays"
        );
        let mut recorded_only = PeakMemory::new(None, None);
        assert_eq!(recorded_only.sample(Some(400), 0, 8, true), Some((400, 8)));
    }

    #[test]
    fn no_probe_reports_nothing() {
        assert_eq!(PeakMemory::new(None, None).sample(None, 0, 8, true), None);
    }
}
