"""A production or an opportunistic training job for the priority-class acceptance test,
launched with `iadeep run`.

Both sleep T(b) = 4 ms + 0.15 ms * b per step and record a peak memory of 500 + 4 * b MiB.

- production: its steps take --slowdown times longer while another task resides on its
  GPU (it reads the device's residents record with `iadeep state get` a few times a
  second): the emulated interference a co-runner causes, whatever its batch size. It stops
  once it was co-located and then ran --steps-alone steps alone again.
- opportunistic: trains until the placer evicts it (or --max-seconds); then it writes its
  progress to --checkpoint, `poll_change()` raises `iadeep.Evicted` and it exits 3.
  Restarted by `iadeep run` (`iadeep.requeued() > 0`), it resumes from the checkpoint and
  finishes after --samples more samples.

Each run writes what happened to `--out`.N.json (N: iadeep.requeued()).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import iadeep


def step_seconds(batch_size: int) -> float:
    return 0.004 + 0.00015 * batch_size


class Neighbours:
    """Whether another task resides on this job's GPU, polled from the store."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.present = False
        self.seen = False
        self.key = f"/iadeep/v1/devices/{os.environ['IADEEP_DEVICE_ID']}/residents"
        thread = threading.Thread(target=self._poll, daemon=True)
        thread.start()

    def _poll(self) -> None:
        while True:
            result = subprocess.run(
                [os.environ["IADEEP_BIN"], "state", "get", self.key, "--store", os.environ["IADEEP_STORE"]],
                capture_output=True, text=True,
            )
            if result.returncode == 0:
                record = json.loads(result.stdout)
                others = [r for r in record.get("reservations", []) if r.get("taskId") != self.task_id]
                self.present = bool(others)
                self.seen = self.seen or self.present
            time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--role", choices=["production", "opportunistic"], required=True)
    parser.add_argument("--slowdown", type=float, default=15.0)
    parser.add_argument("--steps-alone", type=int, default=200)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--checkpoint")
    parser.add_argument("--max-seconds", type=float, default=400.0)
    args = parser.parse_args()
    run = iadeep.requeued()
    agent = iadeep.Agent.from_env(
        model=f"class-{args.role}", initial_batch_size=16, report_interval_s=0.2, lease_ttl_s=2.0, use_nvml=False
    )
    result = {
        "run": run, "evicted_reason": iadeep.evicted_reason(), "task_id": agent.task_id,
        "env": {k: v for k, v in os.environ.items() if k.startswith("IADEEP_")},
        "batch_sizes": [], "steps": 0, "co_located_steps": 0,
    }
    samples = 0
    if args.role == "opportunistic" and run > 0:
        with open(args.checkpoint) as f:
            samples = json.load(f)["samples"]
    result["samples_at_start"] = samples
    neighbours = Neighbours(agent.task_id) if args.role == "production" else None
    alone_after = 0
    started = time.monotonic()
    code = 0
    try:
        while time.monotonic() - started < args.max_seconds:
            bs = agent.batch_size
            co_located = neighbours is not None and neighbours.present
            t0 = time.perf_counter()
            time.sleep(step_seconds(bs) * (args.slowdown if co_located else 1.0))
            agent.record_step(bs, time.perf_counter() - t0)
            agent.record_peak_memory(500 + 4 * bs)
            samples += bs
            result["steps"] += 1
            result["co_located_steps"] += int(co_located)
            if not result["batch_sizes"] or result["batch_sizes"][-1] != bs:
                result["batch_sizes"].append(bs)
            if agent.evicted is not None:
                with open(args.checkpoint, "w") as f:
                    json.dump({"samples": samples}, f)  # the checkpoint, before Evicted
                result["checkpointed_samples"] = samples
            agent.poll_change()  # raises iadeep.Evicted once the placer evicted the job
            if args.role == "opportunistic" and run > 0 and samples >= result["samples_at_start"] + args.samples:
                break
            if neighbours is not None and neighbours.seen and not co_located:
                alone_after += 1
                if alone_after >= args.steps_alone:
                    break
        agent.finish()
        result["finished"] = True
    except iadeep.Evicted as evicted:
        result["evicted"] = evicted.reason
        code = 3
    result["samples"] = samples
    with open(f"{args.out}.{run}.json", "w") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
