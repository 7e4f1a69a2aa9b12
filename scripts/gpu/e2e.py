#!/usr/bin/env python3
"""End to end on one GPU: the same stream of training jobs under three policies.

The stream: --jobs jobs (10-20 for the report) drawn with --seed from the mix in
gpubench/catalogue.py (E2E_MIX: model, submitted batch size m0, steps at m0), arriving
with exponential gaps of mean --mean-gap-s. Each job is scripts/gpu/train_job.py and
does a fixed amount of work: its steps x m0 samples (times --steps-scale).

Policies (--policies, default all three, one after the other):
  exclusive  one job at a time on the GPU, first come first served, at m0;
  packing    every job starts when it arrives, all on the GPU, at m0 ("all allowed");
  iadeep     `iadeep up` (NVML) and every job started with `iadeep run --batch-size m0
             --min-batch-size m0/4 --max-batch-size 4*m0 --lr-rule sqrt -- python
             train_job.py ...`: the placer decides when it starts, the tuner its batch
             size, the agent in the job applies it.
The baselines run the same job script without the agent (--no-agent): a job that
runs out of memory crashes (exit 3) and is restarted from the beginning at half its
batch size, as an unmanaged job would be; under iadeep the agent falls back instead,
and a job that still crashes is restarted the same way.

Recorded per policy, in OUT/POLICY/: jobs.csv (arrival, start, end, completion time,
restarts, out-of-memory events), each job's result JSON and log; for iadeep also the
store's history under /iadeep/v1/tasks/ (`iadeep state watch --from-revision 1`,
store-events.log), the tuner's assignments over time (assignments.csv) and what
`iadeep status --json` showed every 3 s (status.jsonl).
In OUT: stream.json, summary.csv and summary.json (average and median completion
time, makespan, out-of-memory crashes and events per policy), assignments.svg (the
batch size of each job over time under iadeep) and e2e-metadata.json. The summary
and the plot are rebuilt from every OUT/POLICY/ present, so policies may be run in
separate invocations (e.g. one per device command).

--dry-run: no GPU, no torch: the synthetic backend (jobs sleep the synthetic step
times of gpubench/synthetic.py, slowed by the other synthetic jobs running), and
`iadeep up --no-nvml --devices 1 --memory-mib 16384 --kind synthetic`. Everything is
named SYNTHETIC-* and is not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpubench import catalogue, outputs, synthetic, svg  # noqa: E402
from gpubench.device import GpuProbe  # noqa: E402
from gpubench.session import require_torch  # noqa: E402

HERE = Path(__file__).resolve().parent
POLICIES = ("exclusive", "packing", "iadeep")
EXIT_OOM = 3  # train_job.EXIT_OOM
JOB_COLUMNS = [
    "job", "model", "m0", "samples", "arrival_s", "start_s", "end_s", "completion_s", "wait_s", "status",
    "restarts", "oom_crashes", "oom_events", "final_batch_size", "batch_size_changes",
]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="SYNTHETIC backend, no GPU, no torch (see above)")
    parser.add_argument("--out", type=Path, help="output folder (default data/measured/KIND/e2e, or "
                        "target/gpu-dry-run/e2e with --dry-run)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=12, help="jobs in the stream (default 12)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stream (default 0)")
    parser.add_argument("--mean-gap-s", type=float, help="mean gap between arrivals (default 20; 0.3 dry run)")
    parser.add_argument("--steps-scale", type=float, help="multiplies every job's steps (default 1; 0.05 dry run)")
    parser.add_argument("--iadeep", default=os.environ.get("IADEEP_BIN") or shutil.which("iadeep") or "iadeep",
                        help="the iadeep binary (default $IADEEP_BIN, else iadeep on the PATH)")
    parser.add_argument("--etcd", help="the etcd binary for iadeep up (default: iadeep up's own choice: "
                        "$ETCD_BIN, etcd on the PATH, /usr/bin/etcd)")
    parser.add_argument("--python", default=sys.executable, help="Python for the jobs (needs torch and iadeep)")
    parser.add_argument("--kind", help="GPU kind for the output folder (default: from NVML, e.g. h100)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--memory-csv", type=Path, help="a memory-nvml.csv of measure_memory.py: tells "
                        "`iadeep run --gpu-mem-mib` each job's measured memory at m0 (optional)")
    parser.add_argument("--report-interval-s", type=float, help="agents' report interval (default 1; 0.2 dry run)")
    parser.add_argument("--policy-timeout-s", type=float, default=3000.0,
                        help="stop a policy's run after this long, killing its jobs (default 3000)")
    args = parser.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown or not args.policies:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if args.mean_gap_s is None:
        args.mean_gap_s = 0.3 if args.dry_run else 20.0
    if args.steps_scale is None:
        args.steps_scale = 0.05 if args.dry_run else 1.0
    if args.report_interval_s is None:
        args.report_interval_s = 0.2 if args.dry_run else 1.0
    if args.jobs < 1 or args.mean_gap_s < 0 or args.steps_scale <= 0:
        parser.error("--jobs must be >= 1, --mean-gap-s >= 0, --steps-scale > 0")
    return args


@dataclass
class StreamJob:
    index: int
    model: str
    m0: int
    samples: int
    arrival_s: float

    @property
    def name(self) -> str:
        return f"job{self.index:02d}-{self.model}"

    def task_id(self, attempt: int) -> str:
        """The task id of an attempt under iadeep (id characters only)."""
        return f"job{self.index:02d}-try{attempt}"


def make_stream(jobs: int, seed: int, mean_gap_s: float, steps_scale: float) -> List[StreamJob]:
    rng = random.Random(seed)
    stream, t = [], 0.0
    for i in range(jobs):
        model, m0, steps = rng.choice(catalogue.E2E_MIX)
        stream.append(StreamJob(i, model, m0, max(1, round(steps * steps_scale)) * m0, round(t, 3)))
        t += rng.expovariate(1.0 / mean_gap_s) if mean_gap_s > 0 else 0.0
    return stream


def read_memory_csv(path: Optional[Path]) -> Dict[tuple, float]:
    if path is None:
        return {}
    table = {}
    for line in path.read_text().splitlines()[1:]:
        model, b, mib = line.split(",")
        table[(model.removeprefix(synthetic.NAME_PREFIX), int(b))] = float(mib)
    return table


def stop_process(process: subprocess.Popen, sig: int, timeout_s: float) -> None:
    """Sends `sig` and waits; kills the process if it outlives `timeout_s`."""
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Cluster:
    """`iadeep up` on a folder, and a watch of its store's task keys."""

    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args = args
        self.folder = folder
        self.process: Optional[subprocess.Popen] = None
        self.watch: Optional[subprocess.Popen] = None
        self.status: Optional[subprocess.Popen] = None
        self.env: Dict[str, str] = {}
        self.cluster_dir = folder

    def start(self) -> "Cluster":
        a = self.args
        # etcd's data (tens of MiB of preallocated log) stays out of the output folder.
        self.cluster_dir = Path(tempfile.mkdtemp(prefix="iadeep-e2e-cluster-"))
        cmd = [a.iadeep, "up", "--dir", str(self.cluster_dir), "--etcd-port", "0", "--etcd-peer-port", "0",
               "--placer", "127.0.0.1:0", "--devices", "1"]
        if a.etcd:
            cmd += ["--etcd-bin", a.etcd]
        if a.dry_run:
            cmd += ["--no-nvml", "--memory-mib", str(synthetic.CAPACITY_MIB), "--kind", synthetic.DEVICE_KIND]
        env_file = self.cluster_dir / "cluster.env"
        log = open(self.folder / "iadeep-up.log", "ab")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 180
        while not env_file.exists():
            if self.process.poll() is not None:
                raise SystemExit(f"error: iadeep up exited with {self.process.returncode}; see "
                                 f"{self.folder / 'iadeep-up.log'}")
            if time.monotonic() > deadline:
                raise SystemExit("error: iadeep up did not write cluster.env within 180 s")
            time.sleep(0.1)
        for line in env_file.read_text().splitlines():
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                self.env[key] = value
        while not any(k.endswith("/info") for k in self.keys("/iadeep/v1/devices/")):
            if time.monotonic() > deadline:
                raise SystemExit("error: no tuner registered its GPU within 180 s")
            time.sleep(0.2)
        self.watch = self.watch_into("store-events.log", "state", "watch", "/iadeep/v1/tasks/", "--from-revision", "1")
        # What `iadeep status` showed while the jobs ran: placements, reservations,
        # batch sizes and the tuner's state, one JSON object per refresh.
        self.status = self.watch_into("status.jsonl", "status", "--json", "--watch", "3")
        return self

    def watch_into(self, file_name: str, *command: str) -> subprocess.Popen:
        """Starts `iadeep COMMAND --store STORE` writing into FOLDER/file_name until stopped."""
        with open(self.folder / file_name, "w") as out:
            return subprocess.Popen(
                [self.args.iadeep, *command, "--store", self.env["IADEEP_STORE"]],
                stdout=out, stderr=subprocess.DEVNULL, start_new_session=True,
            )

    def keys(self, prefix: str) -> List[str]:
        out = subprocess.run([self.args.iadeep, "state", "ls", prefix, "--store", self.env["IADEEP_STORE"]],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.split() if out.returncode == 0 else []

    def stop(self) -> None:
        for watch in (self.watch, self.status):
            if watch is not None:
                stop_process(watch, signal.SIGINT, 30)  # both watches stop on Ctrl-C
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM, 120)  # tuners, placer, then etcd
            etcd_log = self.cluster_dir / "etcd.log"
            if etcd_log.exists():
                shutil.copy(etcd_log, self.folder / "etcd.log")
            shutil.rmtree(self.cluster_dir, ignore_errors=True)


@dataclass
class Attempt:
    job: StreamJob
    number: int
    batch_size: int
    process: subprocess.Popen
    result_path: Path


@dataclass
class JobRecord:
    job: StreamJob
    start_s: Optional[float] = None
    end_s: Optional[float] = None
    status: str = "not started"
    restarts: int = 0
    oom_crashes: int = 0
    oom_events: int = 0
    final_batch_size: Optional[int] = None
    changes: int = 0
    results: List[Dict[str, Any]] = field(default_factory=list)


def launch(args: argparse.Namespace, policy: str, folder: Path, job: StreamJob, number: int, batch_size: int,
           cluster: Optional[Cluster], memory: Dict[tuple, float]) -> Attempt:
    result_path = folder / "jobs" / f"{job.name}-try{number}.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    job_cmd = [args.python, "-u", str(HERE / "train_job.py"), "--model", job.model, "--batch-size", str(batch_size),
               "--samples", str(job.samples), "--precision", args.precision, "--result", str(result_path),
               "--report-interval-s", str(args.report_interval_s)]
    if args.dry_run:
        job_cmd += ["--backend", "synthetic", "--synthetic-registry", str(folder / "synthetic-registry")]
    env = dict(os.environ)
    if policy == "iadeep":
        assert cluster is not None
        env.update(cluster.env)
        label = outputs.label(job.model, args.dry_run)
        cmd = [args.iadeep, "run", "--task-id", job.task_id(number), "--model", label,
               "--batch-size", str(batch_size), "--min-batch-size", str(max(1, batch_size // 4)),
               "--max-batch-size", str(batch_size * 4), "--lr-rule", "sqrt", "--total-samples", str(job.samples)]
        if (job.model, batch_size) in memory:
            cmd += ["--gpu-mem-mib", str(int(memory[(job.model, batch_size)] + 0.999))]
        cmd += ["--", *job_cmd]
    else:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = "0"
        cmd = [*job_cmd, "--no-agent"]
    log = open(folder / "jobs" / f"{job.name}-try{number}.log", "wb")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return Attempt(job, number, batch_size, process, result_path)


def run_policy(args: argparse.Namespace, policy: str, stream: List[StreamJob], out: Path) -> Dict[str, Any]:
    folder = out / policy
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    memory = read_memory_csv(args.memory_csv)
    cluster = Cluster(args, folder).start() if policy == "iadeep" else None
    records = {job.index: JobRecord(job) for job in stream}
    queue: List[tuple] = [(job, job.m0) for job in stream]  # (job, batch size), in arrival order
    running: List[Attempt] = []
    attempts: Dict[int, int] = {}
    t0 = time.monotonic()
    wall0 = time.time()
    print(f"{policy}: {len(stream)} jobs", flush=True)
    try:
        while queue or running:
            now = time.monotonic() - t0
            if now > args.policy_timeout_s:
                print(f"{policy}: timeout after {args.policy_timeout_s:.0f} s; stopping its jobs", file=sys.stderr)
                break
            for attempt in list(running):
                code = attempt.process.poll()
                if code is None:
                    continue
                running.remove(attempt)
                record = records[attempt.job.index]
                result = json.loads(attempt.result_path.read_text()) if attempt.result_path.exists() else {}
                record.results.append(result)
                record.oom_events += int(result.get("oom_events", 0))
                sizes = result.get("batch_sizes", [])
                record.changes += max(0, len(sizes) - 1)
                if sizes:
                    record.final_batch_size = int(sizes[-1][1])
                if code == 0:
                    record.status, record.end_s = "done", now
                elif code == EXIT_OOM and attempt.batch_size > 1:
                    record.oom_crashes += 1
                    record.restarts += 1
                    queue.insert(0 if policy == "exclusive" else len(queue), (attempt.job, max(1, attempt.batch_size // 2)))
                    print(f"{policy}: {attempt.job.name} ran out of memory at {attempt.batch_size}; restarting at "
                          f"{max(1, attempt.batch_size // 2)}", flush=True)
                else:
                    record.status, record.end_s = f"failed (exit {code})", now
                    print(f"{policy}: {attempt.job.name} failed with exit status {code}", file=sys.stderr, flush=True)
            startable = [item for item in queue if item[0].arrival_s <= now]
            if policy == "exclusive":
                startable = startable[:1] if not running else []
            for job, batch_size in startable:
                queue.remove((job, batch_size))
                attempts[job.index] = attempts.get(job.index, 0) + 1
                record = records[job.index]
                if record.start_s is None:
                    record.start_s = now
                running.append(launch(args, policy, folder, job, attempts[job.index], batch_size, cluster, memory))
            time.sleep(0.05)
    finally:
        for attempt in running:
            stop_process(attempt.process, signal.SIGTERM, 60)
            records[attempt.job.index].status = "killed at timeout"
        if cluster is not None:
            cluster.stop()
    rows = []
    for record in records.values():
        job = record.job
        started = [r.get("started_at") for r in record.results if r.get("started_at")]
        wait = (min(started) - wall0 - job.arrival_s) if started else None
        completion = None if record.end_s is None or record.status != "done" else record.end_s - job.arrival_s
        rows.append([job.name, outputs.label(job.model, args.dry_run), job.m0, job.samples, job.arrival_s,
                     _r(record.start_s), _r(record.end_s), _r(completion), _r(wait), record.status, record.restarts,
                     record.oom_crashes, record.oom_events, record.final_batch_size, record.changes])
    outputs.write_csv(folder / "jobs.csv", JOB_COLUMNS, rows)
    tasks = {job.task_id(n): job.name for job in stream for n in range(1, attempts.get(job.index, 0) + 1)}
    if policy == "iadeep":
        write_assignments(folder, wall0, tasks)
    run: Dict[str, Any] = {"policy": policy, "started_at": wall0, "tasks": tasks}
    if args.dry_run:
        run["note"] = outputs.SYNTHETIC_NOTE
    outputs.write_json(folder / "run.json", run)
    return summarise_policy(policy, folder)


def _r(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def write_assignments(folder: Path, wall0: float, tasks: Dict[str, str]) -> None:
    """The tuner's assignments from the store's history: assignments.csv (`tasks`
    maps each task id to its job)."""
    rows = []
    log = folder / "store-events.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        parts = line.split(" ", 3)
        if len(parts) != 4 or parts[0] != "PUT" or not parts[2].endswith("/assignment"):
            continue
        try:
            value = json.loads(parts[3])
        except json.JSONDecodeError:
            continue
        at_ms = int(value.get("assignedAtUnixMs", 0) or 0)
        task = str(value.get("taskId", ""))
        rows.append([round(at_ms / 1000.0 - wall0, 3), task, tasks.get(task, ""), int(value.get("batchSize", 0) or 0),
                     float(value.get("lrFactor", 1.0) or 1.0), int(value.get("round", 0) or 0), int(parts[1])])
    rows.sort()
    outputs.write_csv(folder / "assignments.csv", ["t_s", "task", "job", "batch_size", "lr_factor", "round", "revision"], rows)


def read_csv(path: Path) -> List[Dict[str, str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def summarise_policy(policy: str, folder: Path) -> Dict[str, Any]:
    rows = read_csv(folder / "jobs.csv")
    done = [float(r["completion_s"]) for r in rows if r["status"] == "done"]
    ends = [float(r["end_s"]) for r in rows if r["end_s"]]
    return {
        "policy": policy,
        "jobs": len(rows),
        "completed": len(done),
        # Completion times are over the jobs that completed: read them with `failed`.
        "failed": sum(1 for r in rows if r["status"] != "done"),
        "avg_completion_s": statistics.mean(done) if done else None,
        "p50_completion_s": statistics.median(done) if done else None,
        "max_completion_s": max(done) if done else None,
        "makespan_s": (max(ends) - min(float(r["arrival_s"]) for r in rows)) if ends and len(done) == len(rows) else None,
        "oom_crashes": sum(int(r["oom_crashes"]) for r in rows),
        "oom_events": sum(int(r["oom_events"]) for r in rows),
        "batch_size_changes": sum(int(r["batch_size_changes"]) for r in rows),
    }


def write_summary(args: argparse.Namespace, out: Path, kind: str, gpu: Dict[str, Any]) -> List[Dict[str, Any]]:
    summaries = [summarise_policy(p, out / p) for p in POLICIES if (out / p / "jobs.csv").exists()]
    name = lambda base: out / outputs.file_name(base, args.dry_run)  # noqa: E731
    columns = ["policy", "jobs", "completed", "failed", "avg_completion_s", "p50_completion_s", "max_completion_s",
               "makespan_s", "oom_crashes", "oom_events", "batch_size_changes"]
    outputs.write_csv(name("summary.csv"), columns,
                      [[_r(s[c]) if isinstance(s[c], float) else s[c] for c in columns] for s in summaries])
    body: Dict[str, Any] = {"policies": {s["policy"]: s for s in summaries}}
    if args.dry_run:
        body["note"] = outputs.SYNTHETIC_NOTE
    outputs.write_json(name("summary.json"), body)
    # The tuner's assignments over time under iadeep.
    series: Dict[str, List[tuple]] = {}
    ends: Dict[str, float] = {}
    if (out / "iadeep" / "assignments.csv").exists():
        jobs = {r["job"]: r for r in read_csv(out / "iadeep" / "jobs.csv")}
        for row in read_csv(out / "iadeep" / "assignments.csv"):
            attempt = row["task"].rsplit("-", 1)[-1]
            shown = (row["job"] or row["task"]) + ("" if attempt == "try1" else f" ({attempt})")
            series.setdefault(shown, []).append((float(row["t_s"]), float(row["batch_size"])))
            job = jobs.get(row["job"])
            if job is not None and job["end_s"]:
                ends[shown] = float(job["end_s"])
    title = "iadeep: the tuner's batch-size assignments over time"
    if args.dry_run:
        title = "SYNTHETIC (dry run, not measured) - " + title
    svg.step_plot(name("assignments.svg"), title, dict(sorted(series.items())), "seconds since the stream started",
                  "assigned batch size", log2_y=True, x_end=ends)
    outputs.write_json(name("e2e-metadata.json"), outputs.run_metadata("scripts/gpu/e2e.py", args.dry_run, {
        "gpu": gpu, "kind": kind, "jobs": args.jobs, "seed": args.seed, "mean_gap_s": args.mean_gap_s,
        "steps_scale": args.steps_scale, "precision": args.precision, "report_interval_s": args.report_interval_s,
        "mix": catalogue.E2E_MIX, "policies_present": [s["policy"] for s in summaries],
        "iadeep_flags": "--min-batch-size m0/4 --max-batch-size 4*m0 --lr-rule sqrt",
    }))
    return summaries


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        gpu: Dict[str, Any] = {"name": "synthetic GPU (no device)", "memory_total_mib": synthetic.CAPACITY_MIB,
                               "kind": synthetic.DEVICE_KIND, "source": "synthetic"}
        kind = synthetic.DEVICE_KIND
    else:
        require_torch()
        probe = GpuProbe.open(0)
        gpu = probe.info() if probe is not None else {}
        kind = args.kind or gpu.get("kind") or ""
        if not kind:
            raise SystemExit("error: cannot tell the GPU's kind without NVML: give --kind")
    out = args.out or outputs.default_out_dir("e2e", kind, args.dry_run)
    outputs.prepare_out_dir(out, args.dry_run)
    if shutil.which(args.iadeep) is None and not Path(args.iadeep).is_file():
        raise SystemExit(f"error: cannot find the iadeep binary {args.iadeep!r}; give --iadeep or set IADEEP_BIN")
    stream = make_stream(args.jobs, args.seed, args.mean_gap_s, args.steps_scale)
    outputs.write_json(out / outputs.file_name("stream.json", args.dry_run),
                       [job.__dict__ for job in stream])
    print(f"end-to-end run on {gpu.get('name')} into {out}"
          + (" -- SYNTHETIC backend, not measurements" if args.dry_run else ""), flush=True)
    for policy in args.policies:
        summary = run_policy(args, policy, stream, out)
        print(f"{policy}: {summary['completed']}/{summary['jobs']} done, average completion of those "
              f"{summary['avg_completion_s'] or float('nan'):.1f} s, makespan {summary['makespan_s'] or float('nan'):.1f} s, "
              f"{summary['oom_crashes']} OOM crashes, {summary['oom_events']} OOM events", flush=True)
    summaries = write_summary(args, out, kind, gpu)
    print(f"wrote {out / outputs.file_name('summary.csv', args.dry_run)} "
          f"({', '.join(s['policy'] for s in summaries)}) and {out / outputs.file_name('assignments.svg', args.dry_run)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
