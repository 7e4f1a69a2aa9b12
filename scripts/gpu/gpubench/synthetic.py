"""The synthetic backend of ``--dry-run``: deterministic numbers from formulas.

**Nothing here is a measurement.** It exists so that the scripts' whole pipeline
(worker processes, the measuring loop, the output files, iadeep's readers) runs on a
machine without a GPU or PyTorch. Every file written with it is named
``SYNTHETIC-*``, its models are named ``synthetic-*``, its device kind is
``synthetic``, its metadata says ``"backend": "synthetic"``, and the scripts refuse
to write it under ``data/measured/``.

For a model with profile (F, A, t0, t1) (:class:`gpubench.catalogue.SyntheticProfile`)
at batch size b:

- allocated memory   M_a(b) = F + A * b * (1 + 0.05 * log2 b)       MiB
  (the log term makes the curve slightly super-linear, so the memory model is not
  tested on a straight line only);
- reserved memory    M_r(b) = 2 * ceil(1.07 * M_a(b) / 2)          MiB
  (allocator overhead, rounded to 2 MiB blocks);
- NVML process memory M_n(b) = M_r(b) + 520                        MiB (CUDA context);
- solo step time     T(b) = t0 + t1 * b                            seconds;
- busy share         u(b) = t1 * b / T(b);
- co-located slowdown of job k next to jobs J:
  S_k = 1 + sum over j in J of u_j * (0.5 + 0.5 * u_k);
- out of memory when the jobs' M_n add up to more than 16384 MiB (the synthetic card);
- utilisation alone: SM 30 + 65 * u percent, memory bandwidth 10 + 40 * u percent.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

from .catalogue import ModelSpec

#: Device kind of every synthetic output (worker type in the Gavel file).
DEVICE_KIND = "synthetic"
#: Memory of the synthetic card, MiB.
CAPACITY_MIB = 16384
#: The synthetic CUDA context, MiB.
CONTEXT_MIB = 520
#: Prefix of every model name in a synthetic output.
NAME_PREFIX = "synthetic-"


def allocated_mib(spec: ModelSpec, batch_size: int) -> float:
    p = spec.synthetic
    return p.fixed_mib + p.per_sample_mib * batch_size * (1.0 + 0.05 * math.log2(max(batch_size, 1)))


def reserved_mib(spec: ModelSpec, batch_size: int) -> float:
    return 2.0 * math.ceil(1.07 * allocated_mib(spec, batch_size) / 2.0)


def nvml_mib(spec: ModelSpec, batch_size: int) -> float:
    return reserved_mib(spec, batch_size) + CONTEXT_MIB


def step_s(spec: ModelSpec, batch_size: int) -> float:
    p = spec.synthetic
    return p.step_fixed_s + p.step_per_sample_s * batch_size


def busy_share(spec: ModelSpec, batch_size: int) -> float:
    return spec.synthetic.step_per_sample_s * batch_size / step_s(spec, batch_size)


def slowdown(job: Tuple[ModelSpec, int], corunners: Sequence[Tuple[ModelSpec, int]]) -> float:
    """S_k of the module docstring: how much slower `job` steps next to `corunners`."""
    own = busy_share(*job)
    return 1.0 + sum(busy_share(*other) * (0.5 + 0.5 * own) for other in corunners)


def fits(jobs: Sequence[Tuple[ModelSpec, int]]) -> bool:
    """Whether the jobs fit on the synthetic card together."""
    return sum(nvml_mib(spec, b) for spec, b in jobs) <= CAPACITY_MIB


def utilisation(spec: ModelSpec, batch_size: int) -> Dict[str, float]:
    u = busy_share(spec, batch_size)
    return {"gpu_util": 30.0 + 65.0 * u, "mem_util": 10.0 + 40.0 * u}
