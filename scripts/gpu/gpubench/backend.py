"""What runs a training step: PyTorch on a GPU (:class:`TorchTrainer`), or the
synthetic formulas of ``--dry-run`` (:class:`SyntheticTrainer`, see
:mod:`gpubench.synthetic`). Both answer the same calls, so the measuring loops and
the output files are the same code for both.

torch, torchvision and timm are imported only when a :class:`TorchTrainer` is built.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import synthetic
from .catalogue import LM_SHAPES, ModelSpec, model
from .device import GpuProbe

BACKENDS = ("torch", "synthetic")
PRECISIONS = ("fp32", "bf16")
IMAGE_SIZE = 224
IMAGE_CLASSES = 1000


class OutOfMemory(Exception):
    """The step ran out of GPU memory (the trainer has freed what it could)."""


class Trainer:
    """One model training at one batch size at a time."""

    backend = ""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.batch_size = 0

    # Implemented by each backend.
    def set_batch_size(self, batch_size: int) -> None:
        raise NotImplementedError

    def step(self) -> float:
        """One training step at the current batch size; its seconds."""
        raise NotImplementedError

    def peak_memory(self) -> Dict[str, float]:
        """{"allocated_mib", "reserved_mib"}: peaks since :meth:`reset_peaks`."""
        raise NotImplementedError

    def reset_peaks(self) -> None:
        raise NotImplementedError

    def release_cache(self) -> None:
        """Gives cached but unused GPU memory back to the driver."""

    def process_memory(self) -> Tuple[Optional[float], str]:
        """The GPU memory the driver charges to this process now (MiB), and how it
        was read ("nvml-process", "nvml-device-delta", "synthetic" or "none")."""
        raise NotImplementedError

    def scale_lr(self, factor: float) -> None:
        """Multiplies the optimizer's learning rates by `factor`."""

    def describe(self) -> Dict[str, Any]:
        return {"backend": self.backend}

    def window(
        self, start_at: float, warmup_s: float, measure_s: float, corunners: Sequence[Tuple[str, int]]
    ) -> Dict[str, Any]:
        """Trains from wall-clock time `start_at` (time.time()) until the first step
        that ends after start_at + warmup_s + measure_s, and reports the steps that
        ended inside [start_at + warmup_s, start_at + warmup_s + measure_s]: steps per
        second between the first and the last of them, and their median duration.
        Co-located workers given the same times overlap for the whole window, each
        running until its own step crosses the window's end. `corunners` is used by
        the synthetic backend only (a real GPU does its own interfering)."""
        raise NotImplementedError

    # Shared by both backends.
    def memory_point(self, batch_size: int, warmup_steps: int, steps: int) -> Dict[str, Any]:
        """Peak memory and median step time of `steps` steps at `batch_size` after
        `warmup_steps` (the process memory is read at the end, before the cache is
        released: the allocator still holds its peak reservation)."""
        self.release_cache()
        self.set_batch_size(batch_size)
        self.reset_peaks()
        durations = [self.step() for _ in range(warmup_steps + steps)][warmup_steps:]
        peaks = self.peak_memory()
        nvml, source = self.process_memory()
        return {
            "allocated_mib": peaks["allocated_mib"],
            "reserved_mib": peaks["reserved_mib"],
            "nvml_mib": nvml,
            "nvml_source": source,
            "step_s": statistics.median(durations) if durations else None,
        }


class SyntheticTrainer(Trainer):
    """The formulas of :mod:`gpubench.synthetic`; never sleeps unless `sleep` is set
    (the end-to-end dry run's jobs do, so their durations are real)."""

    backend = "synthetic"

    def __init__(self, spec: ModelSpec, sleep: bool = False) -> None:
        super().__init__(spec)
        self.sleep = sleep
        self._peak_b = 0
        #: Extra slowdown the caller sets (the end-to-end dry run's co-runners).
        self.slowdown = 1.0

    def set_batch_size(self, batch_size: int) -> None:
        if not synthetic.fits([(self.spec, batch_size)]):
            raise OutOfMemory(f"synthetic card of {synthetic.CAPACITY_MIB} MiB exceeded")
        self.batch_size = batch_size
        self._peak_b = max(self._peak_b, batch_size)

    def step(self) -> float:
        seconds = synthetic.step_s(self.spec, self.batch_size) * self.slowdown
        if self.sleep:
            time.sleep(seconds)
        return seconds

    def peak_memory(self) -> Dict[str, float]:
        return {
            "allocated_mib": synthetic.allocated_mib(self.spec, self._peak_b),
            "reserved_mib": synthetic.reserved_mib(self.spec, self._peak_b),
        }

    def reset_peaks(self) -> None:
        self._peak_b = self.batch_size

    def process_memory(self) -> Tuple[Optional[float], str]:
        return synthetic.nvml_mib(self.spec, self._peak_b), "synthetic"

    def describe(self) -> Dict[str, Any]:
        return {
            "backend": self.backend,
            "note": "SYNTHETIC: numbers from the formulas of scripts/gpu/gpubench/synthetic.py, not measurements",
        }

    def window(
        self, start_at: float, warmup_s: float, measure_s: float, corunners: Sequence[Tuple[str, int]]
    ) -> Dict[str, Any]:
        others = [(model(name), b) for name, b in corunners]
        me = (self.spec, self.batch_size)
        if not synthetic.fits([me, *others]):
            raise OutOfMemory(f"synthetic card of {synthetic.CAPACITY_MIB} MiB exceeded")
        seconds = synthetic.step_s(*me) * synthetic.slowdown(me, others)
        return {
            "steps_per_s": 1.0 / seconds,
            "steps": None,
            "median_step_s": seconds,
            "peak_reserved_mib": synthetic.reserved_mib(*me),
        }


class TorchTrainer(Trainer):
    """A catalogue model on a CUDA device with random data of its input's shape."""

    backend = "torch"

    def __init__(self, spec: ModelSpec, precision: str = "fp32", nvml_index: int = 0) -> None:
        super().__init__(spec)
        # NVML's figure before this process touches CUDA: the device-delta fallback.
        self.probe = GpuProbe.open(nvml_index)
        try:
            self._baseline_used_mib = self.probe.used_mib() if self.probe is not None else None
        except Exception:  # noqa: BLE001 - then the device-delta fallback is off
            self._baseline_used_mib = None
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device (use --dry-run on a machine without a GPU)")
        self.torch = torch
        self.device = torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES picks the GPU
        torch.cuda.set_device(self.device)
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
        self.precision = precision
        torch.manual_seed(0)
        self.net = self._build().to(self.device)
        self.net.train()
        params = self.net.parameters()
        if spec.optimizer == "sgd-momentum":
            self.optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.05)
        self.inputs: Optional[Any] = None
        self.targets: Optional[Any] = None

    def _build(self) -> Any:
        spec = self.spec
        if spec.library == "torchvision":
            import torchvision

            constructor = getattr(torchvision.models, spec.constructor)
            try:
                return constructor(weights=None)
            except TypeError:  # torchvision before 0.13 names it `pretrained`
                return constructor(pretrained=False)
        if spec.library == "timm":
            import timm

            return timm.create_model(spec.constructor, pretrained=False)
        if spec.library == "builtin":
            return _decoder_lm(*LM_SHAPES[spec.constructor])
        raise ValueError(f"{spec.name}: unknown library {spec.library!r}")

    def set_batch_size(self, batch_size: int) -> None:
        torch = self.torch
        self.inputs = self.targets = None
        self.batch_size = batch_size
        message: Optional[str] = None
        try:
            if self.spec.family == "lm":
                _, _, _, vocab, seq = LM_SHAPES[self.spec.constructor]
                tokens = torch.randint(0, vocab, (batch_size, seq + 1), device=self.device)
                self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
            else:
                self.inputs = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, device=self.device)
                self.targets = torch.randint(0, IMAGE_CLASSES, (batch_size,), device=self.device)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an OOM
            if not self._is_oom(error):
                raise
            message = str(error).splitlines()[0] if str(error) else "CUDA out of memory"
        if message is not None:
            self.inputs = self.targets = None
            self._free_after_oom()
            raise OutOfMemory(message)

    def _is_oom(self, error: BaseException) -> bool:
        oom_type = getattr(self.torch.cuda, "OutOfMemoryError", None)
        if oom_type is not None and isinstance(error, oom_type):
            return True
        return isinstance(error, RuntimeError) and "out of memory" in str(error)

    def _free_after_oom(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        self.torch.cuda.empty_cache()

    def _forward_backward(self) -> None:
        """One step; its tensors die with this frame (see :meth:`step`)."""
        torch = self.torch
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            out = self.net(self.inputs)
            if self.spec.family == "lm":
                loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), self.targets.reshape(-1))
            else:
                loss = torch.nn.functional.cross_entropy(out, self.targets)
        loss.backward()
        self.optimizer.step()
        torch.cuda.synchronize(self.device)

    def step(self) -> float:
        started = time.perf_counter()
        message: Optional[str] = None
        try:
            self._forward_backward()
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an OOM
            if not self._is_oom(error):
                raise
            message = str(error).splitlines()[0] if str(error) else "CUDA out of memory"
        if message is not None:
            # Outside the except block: Python has dropped `error`, its traceback and
            # the step's frame with its activations, so emptying the cache frees them.
            self._free_after_oom()
            raise OutOfMemory(message)
        return time.perf_counter() - started

    def peak_memory(self) -> Dict[str, float]:
        cuda = self.torch.cuda
        return {
            "allocated_mib": cuda.max_memory_allocated(self.device) / 2**20,
            "reserved_mib": cuda.max_memory_reserved(self.device) / 2**20,
        }

    def reset_peaks(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def release_cache(self) -> None:
        gc.collect()
        self.torch.cuda.empty_cache()

    def process_memory(self) -> Tuple[Optional[float], str]:
        if self.probe is None:
            return None, "none"
        try:
            mine = self.probe.process_used_mib(os.getpid())
            if mine is not None:
                return mine, "nvml-process"
            if self._baseline_used_mib is not None:
                # Valid only while this process is the only one to change the GPU's
                # memory (the memory script runs one worker at a time).
                return self.probe.used_mib() - self._baseline_used_mib, "nvml-device-delta"
        except Exception as error:  # noqa: BLE001 - NVML's figure is optional; PyTorch's stay
            print(f"NVML memory reading failed: {error}", file=sys.stderr)
        return None, "none"

    def scale_lr(self, factor: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor

    def describe(self) -> Dict[str, Any]:
        torch = self.torch
        props = torch.cuda.get_device_properties(self.device)
        versions: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
        try:
            versions["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001 - informative only
            versions["cudnn"] = None
        for name in ("torchvision", "timm"):
            try:
                versions[name] = __import__(name).__version__
            except ImportError:
                versions[name] = None
        return {
            "backend": self.backend,
            "device_name": torch.cuda.get_device_name(self.device),
            "device_capability": list(torch.cuda.get_device_capability(self.device)),
            "device_total_mib": props.total_memory // 2**20,
            "precision": self.precision,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "versions": versions,
        }

    def window(
        self, start_at: float, warmup_s: float, measure_s: float, corunners: Sequence[Tuple[str, int]]
    ) -> Dict[str, Any]:
        window_start = start_at + warmup_s
        window_end = window_start + measure_s
        while time.time() < start_at:
            time.sleep(min(0.002, max(0.0, start_at - time.time())))
        self.reset_peaks()
        ends: List[float] = []
        durations: List[float] = []
        while True:
            began = time.time()
            self.step()
            ended = time.time()
            if window_start < ended <= window_end:
                ends.append(ended)
                durations.append(ended - began)
            if ended > window_end:
                break
        steps_per_s = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) >= 2 and ends[-1] > ends[0] else None
        return {
            "steps_per_s": steps_per_s,
            "steps": len(ends),
            "median_step_s": statistics.median(durations) if durations else None,
            "peak_reserved_mib": self.peak_memory()["reserved_mib"],
        }


def _decoder_lm(layers: int, width: int, heads: int, vocab: int, seq: int) -> Any:
    """A GPT-style decoder-only language model from torch.nn (pre-norm blocks, GELU,
    learned positions, causal mask, untied output layer)."""
    import torch
    from torch import nn

    class DecoderLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(seq, width)
            block = nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
            )
            try:
                self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            except TypeError:  # torch before 1.13 has no enable_nested_tensor
                self.blocks = nn.TransformerEncoder(block, layers)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            causal = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
            self.register_buffer("causal", causal, persistent=False)

        def forward(self, tokens: Any) -> Any:
            length = tokens.shape[1]
            positions = torch.arange(length, device=tokens.device)
            x = self.tokens(tokens) + self.positions(positions)
            x = self.blocks(x, mask=self.causal[:length, :length])
            return self.head(self.norm(x))

    return DecoderLM()


def build_trainer(
    backend: str, spec: ModelSpec, precision: str = "fp32", nvml_index: int = 0, sleep: bool = False
) -> Trainer:
    """The trainer of `backend` ("torch" or "synthetic") for `spec`; `nvml_index` is
    the GPU's NVML index (the process sees it as cuda:0 through CUDA_VISIBLE_DEVICES)."""
    if backend == "synthetic":
        return SyntheticTrainer(spec, sleep=sleep)
    if backend == "torch":
        return TorchTrainer(spec, precision, nvml_index)
    raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
