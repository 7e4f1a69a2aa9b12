"""What every measuring script shares: its common options, the GPU it measures (or
the synthetic one), its output folder, its time budget and its raw log."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import outputs, synthetic
from .backend import PRECISIONS
from .device import GpuProbe


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true",
        help="run on the CPU without torch, with the SYNTHETIC backend: numbers from the documented "
        "formulas of gpubench/synthetic.py, not measurements; outputs are named SYNTHETIC-* and "
        "may not go under data/measured/",
    )
    parser.add_argument("--out", type=Path, help="output folder (default: data/measured/KIND/WHAT, or "
                        "target/gpu-dry-run/WHAT with --dry-run)")
    parser.add_argument("--device-index", type=int, default=0, help="NVML index of the GPU to use (default 0)")
    parser.add_argument("--kind", help="short GPU kind written to the outputs (default: from the GPU's name, "
                        "as iadeep up names it, e.g. h100)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32, or bf16 autocast (default fp32)")
    parser.add_argument("--budget-s", type=float, help="stop starting new measurements after this many seconds, "
                        "write the outputs from what was measured, and say how to resume")
    parser.add_argument("--resume", action="store_true", help="keep the measurements already in the output "
                        "folder's raw log and measure only what is missing")


@dataclass
class Session:
    synthetic: bool
    device_index: int
    precision: str
    #: The GPU as the driver describes it (name, driver_version, memory_total_mib, ...).
    gpu: Dict[str, Any]
    kind: str
    out: Path
    budget_s: Optional[float]
    started: float = field(default_factory=time.monotonic)

    @property
    def backend(self) -> str:
        return "synthetic" if self.synthetic else "torch"

    def path(self, base: str) -> Path:
        return self.out / outputs.file_name(base, self.synthetic)

    def label(self, model_name: str) -> str:
        return outputs.label(model_name, self.synthetic)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def over_budget(self) -> bool:
        return self.budget_s is not None and self.elapsed_s() > self.budget_s

    def open_raw_log(self, base: str, resume: bool) -> List[Dict[str, Any]]:
        """The raw log's records when resuming; refuses to start over an existing one,
        and creates it when starting, so a second run without --resume is refused even
        if the first one measured nothing."""
        raw = self.path(base)
        if raw.exists() and not resume:
            raise SystemExit(
                f"error: {raw} exists; pass --resume to continue it, or choose another --out "
                "(measurements are never overwritten)"
            )
        raw.touch()
        return outputs.read_jsonl(raw)


def require_torch() -> None:
    """Stops with a clear message where PyTorch is missing (without importing it)."""
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(
            "error: torch is not importable here: measure on a machine with PyTorch and a GPU, "
            "or pass --dry-run for the synthetic backend"
        )


def open_session(args: argparse.Namespace, what: str) -> Session:
    """The GPU, its kind and the output folder for a script measuring `what`."""
    if args.dry_run:
        gpu: Dict[str, Any] = {
            "name": "synthetic GPU (no device)",
            "driver_version": None,
            "memory_total_mib": synthetic.CAPACITY_MIB,
            "kind": synthetic.DEVICE_KIND,
            "source": "synthetic",
        }
        if args.kind and args.kind != synthetic.DEVICE_KIND:
            raise SystemExit(f"error: --dry-run outputs are always of kind {synthetic.DEVICE_KIND!r}")
        kind = synthetic.DEVICE_KIND
    else:
        require_torch()
        probe = GpuProbe.open(args.device_index)
        if probe is None:
            print("warning: neither pynvml nor nvidia-smi works here: no driver version, no NVML memory",
                  file=sys.stderr)
            gpu = {"name": None, "driver_version": None, "memory_total_mib": None, "kind": None, "source": None}
        else:
            gpu = probe.info()
        kind = args.kind or gpu.get("kind")
        if not kind:
            raise SystemExit("error: cannot tell the GPU's kind without NVML: give --kind (e.g. h100)")
    out = args.out or outputs.default_out_dir(what, kind, args.dry_run)
    outputs.prepare_out_dir(out, args.dry_run)
    return Session(args.dry_run, args.device_index, args.precision, gpu, kind, out, args.budget_s)


def parse_list(text: str, convert: Any = str) -> List[Any]:
    return [convert(item.strip()) for item in text.split(",") if item.strip()]
