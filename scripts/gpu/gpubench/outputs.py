"""Output folders, metadata, and the file formats iadeep's commands read.

- memory CSV, ``model,batch_size,memory_mib`` (``iadeep memory eval``;
  eval/src/tuner/memory_eval.rs: that header exactly, no comments);
- Gavel throughput JSON (``iadeep sim --gavel FILE --worker-type T``;
  datasets/src/gavel.rs): ``{T: {"('JOB', 1)": {"null": solo steps/s,
  "('OTHER', 1)": [steps/s of JOB, steps/s of OTHER]}}}``, JOB = ``model (batch size b)``,
  ``[0, 0]`` for a pair that ran out of memory, both orders of each pair;
- predictor samples, JSON Lines (``iadeep predictor eval``; predictor/src/jsonl.rs):
  ``{"device", "task": {model, batch_size, solo_step_time_s, gpu_util, mem_util,
  gpu_mem_mib}, "corunners": [...], "slowdown"}``, extra fields ignored by the reader.

Synthetic outputs (``--dry-run``) are marked in their names and refused under
``data/measured/`` (:func:`prepare_out_dir`).
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import synthetic

#: The repository's root (scripts/gpu/gpubench/outputs.py is three levels down).
REPO = Path(__file__).resolve().parents[3]
#: Where measured data sets live; never written by the synthetic backend.
MEASURED_DIR = REPO / "data" / "measured"
#: Default home of dry-run outputs (ignored by git).
DRY_RUN_DIR = REPO / "target" / "gpu-dry-run"

SYNTHETIC_NOTE = (
    "SYNTHETIC: produced by the --dry-run backend from the formulas in "
    "scripts/gpu/gpubench/synthetic.py; these are NOT measurements"
)


def is_under(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def prepare_out_dir(out: Path, synthetic_backend: bool) -> Path:
    """Creates `out`; a synthetic run may not write under data/measured/."""
    if synthetic_backend and is_under(out, MEASURED_DIR):
        raise SystemExit(
            f"error: --dry-run writes synthetic numbers and may not write under {MEASURED_DIR} "
            f"(got --out {out}); pick another folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def default_out_dir(what: str, kind: Optional[str], synthetic_backend: bool) -> Path:
    """data/measured/KIND/WHAT for measurements, target/gpu-dry-run/WHAT for a dry run."""
    if synthetic_backend:
        return DRY_RUN_DIR / what
    return MEASURED_DIR / (kind or "unknown-gpu") / what


def file_name(base: str, synthetic_backend: bool) -> str:
    return f"SYNTHETIC-{base}" if synthetic_backend else base


def label(model_name: str, synthetic_backend: bool) -> str:
    """The model's name in outputs: synthetic ones are prefixed ``synthetic-``."""
    return synthetic.NAME_PREFIX + model_name if synthetic_backend else model_name


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_metadata(script: str, synthetic_backend: bool, extra: Mapping[str, Any]) -> Dict[str, Any]:
    """What every metadata JSON says: the backend, the command, the software."""
    meta: Dict[str, Any] = {
        "backend": "synthetic" if synthetic_backend else "torch",
        "script": script,
        "argv": sys.argv,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if synthetic_backend:
        meta["note"] = SYNTHETIC_NOTE
    meta.update(extra)
    return meta


def write_json(path: Path, value: Any) -> None:
    """Writes whole or not at all (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        for row in rows:
            writer.writerow(["" if v is None else v for v in row])
    os.replace(tmp, path)


def write_memory_csv(path: Path, rows: Iterable[Tuple[str, int, float]]) -> int:
    """The `model,batch_size,memory_mib` file of ``iadeep memory eval``; returns rows."""
    rows = [(m, b, f"{mib:.1f}") for m, b, mib in rows]
    for m, _, _ in rows:
        if "," in m or '"' in m:
            raise ValueError(f"model name {m!r} cannot go into the unquoted memory CSV")
    write_csv(path, ["model", "batch_size", "memory_mib"], rows)
    return len(rows)


def gavel_job(name: str, batch_size: int) -> str:
    """Gavel's job type, e.g. ``resnet50 (batch size 64)``."""
    return f"{name} (batch size {batch_size})"


def gavel_key(name: str, batch_size: int) -> str:
    """Gavel's key of a one-GPU job, e.g. ``('resnet50 (batch size 64)', 1)``."""
    return f"('{gavel_job(name, batch_size)}', 1)"


Job = Tuple[str, int]


def gavel_document(
    worker_type: str,
    solo: Mapping[Job, float],
    pairs: Mapping[Tuple[Job, Job], Optional[Tuple[float, float]]],
) -> Dict[str, Any]:
    """The Gavel layout of one worker type: `solo` steps/s per job, and per pair
    (first, second) the steps/s of each while sharing, None when it ran out of
    memory (written [0, 0]). Both orders are written; pairs of a job without a solo
    figure are left out (the reader keys job types on their solo entry)."""
    jobs: Dict[str, Dict[str, Any]] = {}
    for (name, b), rate in sorted(solo.items()):
        jobs[gavel_key(name, b)] = {"null": rate}
    for (first, second), rates in sorted(pairs.items()):
        if first not in solo or second not in solo:
            continue
        a, b = rates if rates is not None else (0.0, 0.0)
        jobs[gavel_key(*first)][gavel_key(*second)] = [a, b]
        jobs[gavel_key(*second)][gavel_key(*first)] = [b, a]
    return {worker_type: jobs}


def sample_task(
    name: str, batch_size: int, solo_step_s: float, gpu_mem_mib: Optional[float], util: Optional[Mapping[str, float]]
) -> Dict[str, Any]:
    """One task of a predictor sample line: its solo profile."""
    task: Dict[str, Any] = {"model": name, "batch_size": batch_size, "solo_step_time_s": solo_step_s}
    if util is not None:
        task["gpu_util"] = round(util["gpu_util"], 2)
        task["mem_util"] = round(util["mem_util"], 2)
    if gpu_mem_mib is not None:
        task["gpu_mem_mib"] = round(gpu_mem_mib, 1)
    return task


def write_jsonl(path: Path, lines: Iterable[Mapping[str, Any]]) -> int:
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """Every complete JSON line of `path` (a line cut short by a crash is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path}: skipped a damaged line: {line[:80]!r}", file=sys.stderr)
    return records


def append_jsonl(path: Path, record: Mapping[str, Any]) -> None:
    """Appends one record and flushes it to disk: a crash loses at most the record
    being written."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
