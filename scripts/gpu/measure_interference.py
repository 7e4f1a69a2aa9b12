#!/usr/bin/env python3
"""Step rates of training jobs alone and sharing one GPU (time-sliced, no MPS).

A job type is a model of the catalogue at one batch size (default: six models at two
batch sizes each, see --jobs). Each job runs in its own worker process, as separate
training jobs do on a shared GPU, so the GPU time-slices their CUDA contexts. For
every job type alone, every pair of job types (a type with itself included) and
--triples sampled triples of different models, the workers are told one common
wall-clock start; each trains for WARMUP seconds, then counts the steps that end in
the next MEASURE seconds, and keeps training until its own step crosses the window's
end, so the jobs overlap for the whole window. Steps per second = (steps in the
window - 1) / (time between the first and the last of them). A configuration where
any job runs out of memory is recorded as failed, as Gavel records [0, 0].
Workers stay alive between configurations (at most --max-workers) and give their
cached memory back after each one. Alone, the GPU's SM and memory-bandwidth
utilisation are sampled through NVML during the window (predictor features).

Outputs, in --out (default data/measured/KIND/interference):
  gavel-KIND.json        Gavel's throughput layout, for
                         `iadeep sim --gavel FILE --worker-type KIND --gpu-mem-mib MIB`
                         (job types `MODEL (batch size B)`; pairs only: Gavel has no triples);
  samples-KIND.jsonl     one co-location sample per job of each configuration that ran
                         (pairs and triples), for `iadeep predictor eval FILE`;
  interference-runs.csv  every job of every configuration: rate, solo rate, slowdown, status;
  interference-triples.csv, interference-summary.json
                         each triple's measured slowdowns against the product of the
                         pairwise ones (the rule iadeep's predictor and simulator use for
                         three or more jobs), and the error summary;
  interference-raw.jsonl the log the outputs are rebuilt from (--resume continues it);
  interference-metadata.json  GPU, driver, library versions, settings, command line.

With --dry-run the SYNTHETIC backend replaces PyTorch: co-located rates come from
the formula in gpubench/synthetic.py, files are named SYNTHETIC-*, models synthetic-*,
the worker type is `synthetic` (a 16384 MiB card). They are not measurements.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpubench import catalogue, outputs  # noqa: E402
from gpubench.device import GpuProbe, UtilSampler  # noqa: E402
from gpubench.session import Session, add_common_arguments, open_session  # noqa: E402
from gpubench.worker import WorkerError, WorkerPool  # noqa: E402

RAW = "interference-raw.jsonl"
Job = Tuple[str, int]
Config = Tuple[Job, ...]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    default_jobs = ",".join(f"{m}:{'/'.join(map(str, bs))}" for m, bs in catalogue.INTERFERENCE_JOBS.items())
    parser.add_argument("--jobs", default=default_jobs, help="job types, MODEL:B1/B2,... (default %(default)s)")
    parser.add_argument("--triples", type=int, default=8, help="triples of different models to measure (default 8)")
    parser.add_argument("--no-pairs-with-self", action="store_true", help="skip pairs of a job type with itself")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds before each window (default 3)")
    parser.add_argument("--measure-s", type=float, default=6.0, help="seconds of each window (default 6)")
    parser.add_argument("--prepare-steps", type=int, default=3, help="steps a new worker trains first (default 3)")
    parser.add_argument("--max-workers", type=int, help="worker processes kept alive (default: one per job type "
                        "and one more, so no worker is started twice; each idle one holds its weights, optimiser "
                        "state and CUDA context on the GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the triples' choice (default 0)")
    args = parser.parse_args(argv)
    try:
        args.jobs = catalogue.parse_job_types(args.jobs)
    except ValueError as error:
        parser.error(str(error))
    if args.triples < 0 or args.warmup_s < 0 or args.measure_s <= 0:
        parser.error("--triples and --warmup-s must be >= 0, --measure-s > 0")
    if args.max_workers is None:
        args.max_workers = sum(len(sizes) for sizes in args.jobs.values()) + 1
    elif args.max_workers < 3:
        parser.error("--max-workers must be at least 3 (a triple)")
    return args


def plan(jobs: Dict[str, List[int]], triples: int, with_self: bool, seed: int) -> List[Config]:
    """Solos, then pairs (grouped by their first job so workers are reused), then
    `triples` triples of three different models, sampled with `seed`."""
    types: List[Job] = [(m, b) for m, sizes in jobs.items() for b in sizes]
    configs: List[Config] = [(t,) for t in types]
    for i, first in enumerate(types):
        for second in types[i if with_self else i + 1:]:
            configs.append((first, second))
    candidates = [c for c in itertools.combinations(types, 3) if len({m for m, _ in c}) == 3]
    configs.extend(random.Random(seed).sample(candidates, min(triples, len(candidates))))
    return configs


def key(config: Sequence[Sequence[Any]]) -> Tuple[Job, ...]:
    return tuple(sorted((str(m), int(b)) for m, b in config))


def measure(
    session: Session, args: argparse.Namespace, pool: WorkerPool, probe: Optional[GpuProbe], config: Config
) -> Dict[str, Any]:
    """Runs one configuration's window; the raw record."""
    record: Dict[str, Any] = {"jobs": [list(j) for j in config], "warmup_s": args.warmup_s, "measure_s": args.measure_s}
    try:
        workers = pool.acquire(list(config))
    except WorkerError as error:
        record.update(status="oom" if getattr(error, "oom", False) else "error", error=str(error), results=[])
        return record
    start_at = time.time() + 1.0
    sampler = UtilSampler(probe if len(config) == 1 else None).start(start_at + args.warmup_s)
    replies: List[Dict[str, Any]] = []
    try:
        for i, worker in enumerate(workers):
            corunners = [list(j) for n, j in enumerate(config) if n != i]
            worker.send({"cmd": "window", "start_at": start_at, "warmup_s": args.warmup_s,
                         "measure_s": args.measure_s, "corunners": corunners})
        for worker in workers:
            replies.append(worker.receive(timeout_s=args.warmup_s + args.measure_s + 600))
    except WorkerError as error:
        for worker in workers:
            pool.discard(worker)
        record.update(status="error", error=str(error), results=replies)
        return record
    finally:
        util = sampler.stop()
    for worker in workers:
        try:
            worker.request({"cmd": "release"}, timeout_s=120)
        except WorkerError:
            pool.discard(worker)
    record["results"] = replies
    if any(r.get("oom") for r in replies):
        record["status"] = "oom"
    elif not all(r.get("ok") for r in replies):
        record["status"] = "error"
        record["error"] = "; ".join(str(r.get("error")) for r in replies if not r.get("ok"))
    elif any(r.get("steps_per_s") is None for r in replies):
        record["status"] = "too-few-steps"
    else:
        record["status"] = "ok"
    if util is not None:
        record["util"] = util
    return record


def summarise(session: Session, records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Builds every output file from the raw records (the last record of a
    configuration wins); returns the summary."""
    latest: Dict[Tuple[Job, ...], Dict[str, Any]] = {}
    for r in records:
        latest[key(r["jobs"])] = r
    solo: Dict[Job, Dict[str, Any]] = {}
    for k, r in latest.items():
        if len(k) == 1 and r["status"] == "ok":
            result = r["results"][0]
            solo[k[0]] = {"rate": result["steps_per_s"], "mem": result.get("peak_reserved_mib"), "util": r.get("util")}
    lab = session.label

    def slowdowns(r: Dict[str, Any]) -> Optional[List[float]]:
        jobs = [tuple(j) for j in r["jobs"]]
        if r["status"] != "ok" or any(j not in solo for j in jobs):
            return None
        return [solo[j]["rate"] / res["steps_per_s"] for j, res in zip(jobs, r["results"])]

    # Gavel layout: solos and pairs.
    gavel_solo = {(lab(m), b): s["rate"] for (m, b), s in solo.items()}
    gavel_pairs: Dict[Tuple[Job, Job], Optional[Tuple[float, float]]] = {}
    for k, r in latest.items():
        if len(k) != 2 or r["status"] not in ("ok", "oom"):
            continue
        (m1, b1), (m2, b2) = [tuple(j) for j in r["jobs"]]
        rates = None if r["status"] == "oom" else (r["results"][0]["steps_per_s"], r["results"][1]["steps_per_s"])
        gavel_pairs[((lab(m1), b1), (lab(m2), b2))] = rates
    gavel = outputs.gavel_document(session.kind, gavel_solo, gavel_pairs)
    gavel_path = session.path(f"gavel-{session.kind}.json")
    outputs.write_json(gavel_path, gavel)

    # Predictor samples and the flat table.
    def profile(job: Job) -> Dict[str, Any]:
        s = solo[job]
        return outputs.sample_task(lab(job[0]), job[1], 1.0 / s["rate"], s["mem"], s["util"])

    samples = []
    runs = []
    for _, r in sorted(latest.items()):
        jobs = [tuple(j) for j in r["jobs"]]
        sd = slowdowns(r)
        for i, job in enumerate(jobs):
            res = r["results"][i] if i < len(r.get("results", [])) else {}
            runs.append([
                " + ".join(f"{lab(m)}:{b}" for m, b in jobs), len(jobs), lab(job[0]), job[1], r["status"],
                res.get("steps_per_s"), solo.get(job, {}).get("rate"), None if sd is None else round(sd[i], 4),
                res.get("steps"),
            ])
            if sd is not None and len(jobs) > 1:
                samples.append({
                    "device": session.kind,
                    "task": profile(job),
                    "corunners": [profile(other) for n, other in enumerate(jobs) if n != i],
                    "slowdown": sd[i],
                    "synthetic": session.synthetic,
                })
    samples_path = session.path(f"samples-{session.kind}.jsonl")
    outputs.write_jsonl(samples_path, samples)
    outputs.write_csv(session.path("interference-runs.csv"), [
        "configuration", "jobs", "model", "batch_size", "status", "steps_per_s", "solo_steps_per_s", "slowdown",
        "steps_in_window",
    ], runs)

    # Triples against the product of the pairwise slowdowns.
    def pair_slowdown(job: Job, other: Job) -> Optional[float]:
        r = latest.get(key([job, other]))
        sd = slowdowns(r) if r is not None else None
        if sd is None:
            return None
        jobs = [tuple(j) for j in r["jobs"]]  # type: ignore[index]
        return sd[jobs.index(job)]

    triple_rows = []
    errors = []
    for k, r in sorted(latest.items()):
        if len(k) != 3:
            continue
        jobs = [tuple(j) for j in r["jobs"]]
        sd = slowdowns(r)
        for i, job in enumerate(jobs):
            pairs = [pair_slowdown(job, other) for n, other in enumerate(jobs) if n != i]
            product = None if sd is None or None in pairs else pairs[0] * pairs[1]  # type: ignore[operator]
            rel = None if product is None else product / sd[i] - 1.0  # type: ignore[index]
            if rel is not None:
                errors.append(rel)
            triple_rows.append([
                " + ".join(f"{lab(m)}:{b}" for m, b in jobs), lab(job[0]), job[1], r["status"],
                None if sd is None else round(sd[i], 4), None if product is None else round(product, 4),
                None if rel is None else round(rel, 4),
            ])
    outputs.write_csv(session.path("interference-triples.csv"), [
        "configuration", "model", "batch_size", "status", "measured_slowdown", "product_of_pairs", "relative_error",
    ], triple_rows)
    statuses: Dict[str, Dict[str, int]] = {}
    for k, r in latest.items():
        size = {1: "solo", 2: "pairs", 3: "triples"}.get(len(k), f"{len(k)} jobs")
        statuses.setdefault(size, {}).setdefault(r["status"], 0)
        statuses[size][r["status"]] += 1
    summary = {
        "configurations": statuses,
        "samples": len(samples),
        "product_of_pairs_on_triples": {
            "jobs_compared": len(errors),
            "mean_abs_relative_error": statistics.mean(abs(e) for e in errors) if errors else None,
            "mean_relative_error": statistics.mean(errors) if errors else None,
            "max_abs_relative_error": max((abs(e) for e in errors), default=None),
            "definition": "relative_error = product of the job's two pairwise slowdowns / its slowdown "
                          "measured in the triple - 1 (positive: the rule over-predicts the slowdown)",
        },
        "files": {"gavel": gavel_path.name, "samples": samples_path.name},
    }
    if session.synthetic:
        summary["note"] = outputs.SYNTHETIC_NOTE
    outputs.write_json(session.path("interference-summary.json"), summary)
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    session = open_session(args, "interference")
    records = session.open_raw_log(RAW, args.resume)
    done = {key(r["jobs"]) for r in records if r.get("status") in ("ok", "oom")}
    configs = plan(args.jobs, args.triples, not args.no_pairs_with_self, args.seed)
    todo = [c for c in configs if key(c) not in done]
    print(f"measuring interference on {session.gpu.get('name')} ({session.kind}) into {session.out}: "
          f"{len(configs)} configurations, {len(todo)} to measure"
          + (" -- SYNTHETIC backend, not measurements" if session.synthetic else ""), flush=True)
    probe = None if session.synthetic else GpuProbe.open(session.device_index)
    pool = WorkerPool(session.backend, session.precision, session.out / "logs", args.max_workers,
                      args.prepare_steps, session.device_index)
    cannot_run_alone: set = set()
    finished = True
    try:
        for n, config in enumerate(todo, 1):
            if session.over_budget():
                finished = False
                break
            if any(job in cannot_run_alone for job in config) and len(config) > 1:
                continue
            started = time.monotonic()
            record = measure(session, args, pool, probe, config)
            record["measured_at"] = time.time()
            if len(config) == 1 and record["status"] != "ok":
                cannot_run_alone.add(config[0])
            outputs.append_jsonl(session.path(RAW), record)
            rates = ", ".join(f"{r.get('steps_per_s'):.3g}" if r.get("steps_per_s") else "-"
                              for r in record.get("results", []))
            print(f"[{n}/{len(todo)}] {' + '.join(f'{session.label(m)}:{b}' for m, b in config)}: "
                  f"{record['status']} (steps/s {rates}) [{time.monotonic() - started:.1f} s]", flush=True)
        session.gpu.setdefault("torch_describe", pool.describe)
    finally:
        pool.close()
    records = outputs.read_jsonl(session.path(RAW))
    summary = summarise(session, records)
    outputs.write_json(session.path("interference-metadata.json"), outputs.run_metadata(
        "scripts/gpu/measure_interference.py", session.synthetic, {
            "gpu": session.gpu, "kind": session.kind, "precision": session.precision,
            "sharing": "time-sliced (separate processes, no MPS)",
            "jobs": args.jobs, "triples": args.triples, "pairs_with_self": not args.no_pairs_with_self,
            "warmup_s": args.warmup_s, "measure_s": args.measure_s, "prepare_steps": args.prepare_steps,
            "max_workers": args.max_workers, "seed": args.seed,
            "models": {m: {"library": catalogue.model(m).library, "constructor": catalogue.model(m).constructor,
                           "optimizer": catalogue.model(m).optimizer} for m in args.jobs},
        }))
    print(f"configurations: {summary['configurations']}; {summary['samples']} predictor samples")
    pop = summary["product_of_pairs_on_triples"]
    if pop["jobs_compared"]:
        print(f"product of pairs on triples: mean |error| {pop['mean_abs_relative_error']:.3f}, "
              f"mean error {pop['mean_relative_error']:+.3f} over {pop['jobs_compared']} jobs")
    memory = session.gpu.get("memory_total_mib")
    print(f"next: iadeep sim --gavel {session.path(f'gavel-{session.kind}.json')} --worker-type {session.kind}"
          + (f" --gpu-mem-mib {memory}" if memory else " --gpu-mem-mib MIB"))
    print(f"      iadeep predictor eval {session.path(f'samples-{session.kind}.jsonl')}")
    if not finished:
        print(f"budget of {args.budget_s:.0f} s reached: run the same command with --resume to continue")
    return 0


if __name__ == "__main__":
    sys.exit(main())
