#!/usr/bin/env python3
"""Peak GPU memory of training steps, per model and batch size.

For every model of the catalogue (scripts/gpu/gpubench/catalogue.py: torchvision and
timm CNNs and vision transformers, two transformer language models) and every batch
size of the ladder, a worker process trains WARMUP + STEPS steps on random data with
the model's usual optimiser (SGD with momentum for CNNs, AdamW otherwise) and reports:

- torch.cuda.max_memory_allocated and max_memory_reserved over those steps (peaks
  reset before each batch size);
- the memory NVML charges to the worker process after them (pynvml, else
  nvidia-smi --query-compute-apps), or, where NVML cannot see the process (another PID
  namespace), the growth of the whole GPU's used memory since the worker started
  (`nvml_source` says which: nvml-process or nvml-device-delta);
- the median step time.

Batch sizes run in ascending order; the first out-of-memory ends that model. By
default one worker process runs all batch sizes of a model, emptying PyTorch's cache
between them; --fresh-process starts one per point instead (slower, no allocator
history).

Outputs, in --out (default data/measured/KIND/memory):
  memory-reserved.csv, memory-allocated.csv, memory-nvml.csv
      `model,batch_size,memory_mib`, what `iadeep memory eval FILE --fit-upto N` reads;
  memory-full.csv   every point with every figure and its status (ok / oom / error);
  memory-raw.jsonl  the log the outputs are rebuilt from (--resume continues it);
  memory-metadata.json  GPU, driver, library versions, settings, command line;
  logs/             each worker's stderr.

With --dry-run the SYNTHETIC backend replaces PyTorch (no GPU, no torch): every file
is named SYNTHETIC-*, every model synthetic-*, and the numbers come from the
formulas of gpubench/synthetic.py. They exercise the pipeline; they are not data.

Example, on the GPU machine, then the evaluation against the cubic baseline:
  python3 scripts/gpu/measure_memory.py --budget-s 500
  iadeep memory eval data/measured/h100/memory/memory-reserved.csv --fit-upto 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpubench import catalogue, outputs  # noqa: E402
from gpubench.session import Session, add_common_arguments, open_session, parse_list  # noqa: E402
from gpubench.worker import WorkerError, WorkerHandle  # noqa: E402

RAW = "memory-raw.jsonl"
FULL_COLUMNS = [
    "model", "library", "family", "optimizer", "precision", "batch_size", "status",
    "allocated_mib", "reserved_mib", "nvml_mib", "nvml_source", "step_s", "error",
]
#: The three-column files and the figure each holds.
MEASURES = {"reserved": "reserved_mib", "allocated": "allocated_mib", "nvml": "nvml_mib"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--models", default=",".join(catalogue.MODELS),
                        help="comma-separated catalogue models (default: all %(default)s)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, catalogue.MEMORY_BATCH_SIZES)),
                        help="comma-separated batch sizes, run ascending (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps before the measured ones (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per point (default 5)")
    parser.add_argument("--fresh-process", action="store_true", help="one worker process per point")
    parser.add_argument("--point-timeout-s", type=float, default=600.0, help="longest a point may take")
    args = parser.parse_args(argv)
    try:
        args.models = [catalogue.model(m).name for m in parse_list(args.models)]
        args.batch_sizes = sorted(set(parse_list(args.batch_sizes, int)))
    except ValueError as error:
        parser.error(str(error))
    if not args.models or not args.batch_sizes or min(args.batch_sizes) <= 0:
        parser.error("need at least one model and positive batch sizes")
    if args.warmup_steps < 0 or args.steps < 1:
        parser.error("--warmup-steps must be >= 0 and --steps >= 1")
    return args


def measure_model(
    session: Session, args: argparse.Namespace, name: str, done: Dict[int, Dict[str, Any]]
) -> bool:
    """Measures the missing points of one model; False when the budget ran out."""
    worker: Optional[WorkerHandle] = None
    log = session.out / "logs" / f"memory-{name}.log"
    try:
        for b in args.batch_sizes:
            if b in done:
                if done[b]["status"] == "oom":
                    return True  # larger sizes cannot fit either
                continue
            if session.over_budget():
                return False
            if worker is None or not worker.alive:
                try:
                    worker = WorkerHandle(session.backend, name, session.precision, log, session.device_index)
                    session.gpu.setdefault("torch_describe", worker.describe)
                except WorkerError as error:
                    record = {"model": name, "batch_size": b, "status": "oom" if getattr(error, "oom", False)
                              else "error", "error": str(error)}
                    outputs.append_jsonl(session.path(RAW), record)
                    print(f"{name}: cannot start: {error}", file=sys.stderr)
                    return True
            started = time.monotonic()
            try:
                reply = worker.request(
                    {"cmd": "memory", "batch_size": b, "warmup_steps": args.warmup_steps, "steps": args.steps},
                    timeout_s=args.point_timeout_s,
                )
            except WorkerError as error:
                reply = {"ok": False, "error": str(error)}
                worker.close()
                worker = None
            status = "ok" if reply.get("ok") else ("oom" if reply.get("oom") else "error")
            record = {"model": name, "batch_size": b, "status": status, **{
                k: reply.get(k) for k in ("allocated_mib", "reserved_mib", "nvml_mib", "nvml_source", "step_s", "error")
            }}
            outputs.append_jsonl(session.path(RAW), record)
            shown = (f"reserved {record['reserved_mib']:.0f} MiB, allocated {record['allocated_mib']:.0f} MiB, "
                     f"nvml {record['nvml_mib'] if record['nvml_mib'] is None else round(record['nvml_mib'])} MiB"
                     if status == "ok" else record.get("error"))
            print(f"{session.label(name)} b={b}: {status} ({shown}) [{time.monotonic() - started:.1f} s]", flush=True)
            if status == "oom":
                return True
            if args.fresh_process and worker is not None:
                worker.close()
                worker = None
    finally:
        if worker is not None:
            worker.close()
    return True


def write_outputs(session: Session, args: argparse.Namespace, records: List[Dict[str, Any]]) -> Dict[str, int]:
    """Rebuilds every output file from the raw records (the last record of a point wins)."""
    latest: Dict[tuple, Dict[str, Any]] = {}
    for r in records:
        latest[(r["model"], r["batch_size"])] = r
    ordered = sorted(latest.values(), key=lambda r: (list(catalogue.MODELS).index(r["model"]), r["batch_size"]))
    full_rows = []
    for r in ordered:
        spec = catalogue.model(r["model"])
        full_rows.append([
            session.label(spec.name), spec.library, spec.family, spec.optimizer, session.precision,
            r["batch_size"], r["status"],
            *(None if r.get(k) is None else round(r[k], 1) for k in ("allocated_mib", "reserved_mib", "nvml_mib")),
            r.get("nvml_source"), None if r.get("step_s") is None else round(r["step_s"], 6), r.get("error"),
        ])
    outputs.write_csv(session.path("memory-full.csv"), FULL_COLUMNS, full_rows)
    counts = {}
    for measure, key in MEASURES.items():
        rows = [(session.label(r["model"]), r["batch_size"], r[key]) for r in ordered
                if r["status"] == "ok" and r.get(key) is not None and r[key] > 0]
        path = session.path(f"memory-{measure}.csv")
        counts[path.name] = outputs.write_memory_csv(path, rows)
    sources = sorted({r.get("nvml_source") for r in ordered if r.get("nvml_source")})
    outputs.write_json(session.path("memory-metadata.json"), outputs.run_metadata("scripts/gpu/measure_memory.py",
        session.synthetic, {
            "gpu": session.gpu,
            "kind": session.kind,
            "precision": session.precision,
            "models": {m: {"library": catalogue.model(m).library, "constructor": catalogue.model(m).constructor,
                           "family": catalogue.model(m).family, "optimizer": catalogue.model(m).optimizer}
                       for m in args.models},
            "batch_sizes": args.batch_sizes,
            "warmup_steps": args.warmup_steps,
            "steps": args.steps,
            "process_per": "point" if args.fresh_process else "model",
            "nvml_sources": sources,
            "points": {s: sum(1 for r in ordered if r["status"] == s) for s in ("ok", "oom", "error")},
            "files": counts,
        }))
    return counts


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    session = open_session(args, "memory")
    records = session.open_raw_log(RAW, args.resume)
    print(f"measuring memory on {session.gpu.get('name')} ({session.kind}) into {session.out}"
          + (" -- SYNTHETIC backend, not measurements" if session.synthetic else ""), flush=True)
    finished = True
    for name in args.models:
        done = {r["batch_size"]: r for r in records if r["model"] == name and r["status"] in ("ok", "oom")}
        if not measure_model(session, args, name, done):
            finished = False
            break
    records = outputs.read_jsonl(session.path(RAW))
    counts = write_outputs(session, args, records)
    for file, rows in counts.items():
        print(f"wrote {session.out / file} ({rows} rows)")
    if not finished:
        print(f"budget of {args.budget_s:.0f} s reached: run the same command with --resume to continue")
        return 0
    if len(args.batch_sizes) >= 3:
        print(f"next: iadeep memory eval {session.path('memory-reserved.csv')} --fit-upto {args.batch_sizes[-2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
