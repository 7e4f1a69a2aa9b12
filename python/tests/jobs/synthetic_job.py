"""A training job on a synthetic surface, launched by the tests with `iadeep run`.

Each step sleeps T(b) = 4 ms + 0.15 ms * b (throughput grows with the batch size, so
the tuner has a reason to grow it) and records a peak memory of 500 + 4 * b MiB. The
job applies every batch-size change between steps (batch size and learning rate) and
writes what happened to the JSON file named by --out: each applied change, the batch
sizes its steps ran at, and its learning rates. It stops after --steps-after-change
steps at a batch size other than the submitted one, after --max-seconds, or on SIGTERM
(then the JSON says "terminated"); with --hang, only on SIGTERM or --max-seconds.
"""

import argparse
import json
import os
import signal
import sys
import time

import iadeep

BASE_LR = 0.1


def step_seconds(batch_size: int) -> float:
    return 0.004 + 0.00015 * batch_size


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps-after-change", type=int, default=20)
    parser.add_argument("--max-seconds", type=float, default=240.0)
    parser.add_argument("--hang", action="store_true", help="ignore batch-size changes as a reason to stop")
    args = parser.parse_args()
    terminated = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))

    agent = iadeep.Agent.from_env(
        model="synthetic", initial_batch_size=16, report_interval_s=0.2, lease_ttl_s=2.0, use_nvml=False
    )
    m0 = agent.batch_size
    lr = BASE_LR
    changes = []
    steps = []
    started = time.monotonic()
    steps_after_change = 0
    result = {
        "pid": os.getpid(),
        "task_id": agent.task_id,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("IADEEP_", "CUDA_"))},
        "initial_batch_size": m0,
    }
    with open(args.out + ".started", "w") as f:
        json.dump(result, f)
    while time.monotonic() - started < args.max_seconds and not terminated:
        bs = agent.batch_size
        t0 = time.perf_counter()
        time.sleep(step_seconds(bs))
        agent.record_step(bs, time.perf_counter() - t0)
        agent.record_peak_memory(500 + 4 * bs)
        steps.append([bs, lr])
        change = agent.poll_change()
        if change is not None:
            lr = BASE_LR * change.lr_factor
            changes.append(
                {"batch_size": change.batch_size, "lr_factor": change.lr_factor, "round": change.round,
                 "reason": change.reason, "applied_at_step": len(steps)}
            )
        if not args.hang and agent.batch_size != m0:
            steps_after_change += 1
            if steps_after_change >= args.steps_after_change:
                break
    result.update(
        {"changes": changes, "steps": steps, "reports": agent.reports_published, "terminated": bool(terminated)}
    )
    agent.finish()
    result["finished"] = True
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
