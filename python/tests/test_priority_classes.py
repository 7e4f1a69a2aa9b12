"""The priority classes end to end, with real processes (issue 27's acceptance): `iadeep
up --no-nvml`, a production job and an opportunistic Python job launched with `iadeep
run` on the one GPU. The production job's steps take 15 times longer while another task
resides on its GPU (the emulated interference of python/tests/jobs/class_job.py), so its
measured slowdown is far above its cap (10, the loosest, so that the cold predictor lets
the two share the GPU at all). The tuner shrinks the opportunistic job to its smallest
batch size, then reports the breach; the placer evicts it; it checkpoints and exits;
`iadeep run` places it again (once the production job is done: the two are kept apart)
and restarts it, and it resumes from its checkpoint and finishes. Nothing is placed
twice, nothing is lost.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Dict, List

from conftest import IADEEP, JOBS, Cluster, python_job, wait_for

CLASS_JOB = JOBS / "class_job.py"
#: The whole dance: the production job measured alone, the co-runner placed, shrunk over a
#: few tuner rounds, a breach after three more, the eviction, the restart.
LONG_DEADLINE_S = 480.0


def residents(cluster: Cluster) -> Dict[str, List[str]]:
    """The task ids each device's residents record holds, repeated as often as reserved."""
    out = {}
    for key in cluster.keys("/iadeep/v1/devices/"):
        if key.endswith("/residents"):
            record = cluster.get(key) or {}
            out[key] = [r.get("taskId") for r in record.get("reservations", [])]
    return out


def test_a_production_job_above_its_cap_has_its_co_runner_shrunk_evicted_and_restarted(
    cluster: Cluster, tmp_path: Path
):
    env = {"IADEEP_BIN": str(IADEEP), "RUST_LOG": "info"}
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("prod", "opp")}
    prod = cluster.run_job(
        ["--task-id", "prod-1", "--class", "production", "--max-slowdown", "10", "--batch-size", "16"],
        python_job(CLASS_JOB, "--out", str(tmp_path / "prod"), "--role", "production", "--slowdown", "15"),
        env=env, stdout=logs["prod"], stderr=subprocess.STDOUT,
    )

    def report(task: str) -> dict:
        return cluster.get(f"/iadeep/v1/tasks/{task}/report") or {}

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    # The tuner has the production job's step time alone before a co-runner arrives.
    wait_for("the production job's first steps", lambda: int(report("prod-1").get("stepsDone", "0")) >= 100)
    opp = cluster.run_job(
        ["--task-id", "opp-1", "--batch-size", "64", "--min-batch-size", "16", "--max-batch-size", "64"],
        python_job(
            CLASS_JOB, "--out", str(tmp_path / "opp"), "--role", "opportunistic",
            "--checkpoint", str(tmp_path / "opp.ckpt"), "--samples", "2000",
        ),
        env=env, stdout=logs["opp"], stderr=subprocess.STDOUT,
    )

    # Until both end: never a task twice on a device, never a task on two devices.
    co_located = False
    deadline = time.monotonic() + LONG_DEADLINE_S
    while prod.poll() is None or opp.poll() is None:
        seen = residents(cluster)
        placed = [task for tasks in seen.values() for task in tasks]
        assert len(placed) == len(set(placed)), f"a task placed twice: {seen}"
        co_located = co_located or {"prod-1", "opp-1"} <= set(placed)
        if time.monotonic() > deadline:
            prod.kill()
            opp.kill()
            raise AssertionError(
                f"the jobs did not both end:\nprod:\n{log('prod')}\nopp:\n{log('opp')}\nup:\n{cluster.log()}"
            )
        time.sleep(0.2)
    assert (prod.returncode, opp.returncode) == (0, 0), f"prod:\n{log('prod')}\nopp:\n{log('opp')}"
    assert co_located, "the two shared the GPU"

    production = json.loads((tmp_path / "prod.0.json").read_text())
    first = json.loads((tmp_path / "opp.0.json").read_text())
    again = json.loads((tmp_path / "opp.1.json").read_text())
    assert production.get("finished") and production["co_located_steps"] > 0, production
    assert not (tmp_path / "opp.2.json").exists(), "restarted once"
    # Shrunk to its smallest size first, then evicted, naming the production job.
    assert first["batch_sizes"][0] == 64 and first["batch_sizes"][-1] == 16, first["batch_sizes"]
    assert "prod-1" in first["evicted"], first
    # Restarted by `iadeep run`, told why, from the checkpoint: nothing it did was lost.
    assert (again["run"], again["evicted_reason"]) == (1, first["evicted"])
    assert first["checkpointed_samples"] == first["samples"] == again["samples_at_start"] > 0
    assert again.get("finished") and again["samples"] >= again["samples_at_start"] + 2000
    # Both ended finished; nothing is placed; the placer kept the two apart afterwards.
    for task in ("prod-1", "opp-1"):
        assert report(task).get("finished") is True, task
        assert cluster.placement(task) is None, task
    assert all(not tasks for tasks in residents(cluster).values()), residents(cluster)
    assert any(key.endswith("/prod-1/opp-1") for key in cluster.keys("/iadeep/v1/avoid/"))
