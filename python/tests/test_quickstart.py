"""The README's quick start, literally, on a machine without a GPU: `iadeep up --no-nvml
--devices 1 --memory-mib 16384`, then two PyTorch jobs started as the README shows
(`iadeep run --batch-size 64 --min-batch-size 16 --max-batch-size 512 --lr-rule sqrt --
python examples/python/train_mnist_like.py`), with no memory figure and no profile.

What it must show: both share the one GPU within 30 s of the second's
submission, each receives a batch-size change while they share it, both exit 0 and
both placements are released. Skipped where torch is not importable.

The jobs train until both were tuned while sharing, then stop on SIGTERM (forwarded by
`iadeep run`; the example stops after its step and exits 0): a fixed training time would
make the tuner race the clock on a loaded machine.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from conftest import DEADLINE_S, EXAMPLES, Cluster, python_job, wait_for

pytest.importorskip("torch", reason="torch is not importable: the quick-start test did not run")

QUICK_START = ["--batch-size", "64", "--min-batch-size", "16", "--max-batch-size", "512", "--lr-rule", "sqrt"]
#: The longest each job trains if the test never stops it.
TRAIN_S = 2 * DEADLINE_S
#: The acceptance's bound from the second's submission to both running on the GPU.
SHARE_WITHIN_S = 30
#: What the example prints for each batch-size change the tuner sends.
CHANGE = re.compile(r": assignment \(round (\d+)\): batch size -> (\d+)")
TASK = re.compile(r"^task (\S+) on ")


class Job:
    """`iadeep run ... -- python train_mnist_like.py`, its output read line by line with
    the time each line arrived."""

    def __init__(self, cluster: Cluster) -> None:
        command = python_job(
            EXAMPLES / "train_mnist_like.py",
            "--epochs", "1000", "--samples", "4000", "--max-seconds", str(TRAIN_S), "--report-interval-s", "0.5",
        )
        self.submitted = time.time()
        # One core each: two jobs on a 2-core machine, next to etcd, the placer and the tuner.
        self.process = cluster.run_job(
            QUICK_START, command, env={"OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: List[Tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
        self.process.wait()

    def task_id(self) -> Optional[str]:
        for _, line in list(self.lines):
            found = TASK.match(line)
            if found:
                return found.group(1)
        return None

    def training(self) -> Optional[str]:
        """The task id once the job trains; raises if it exited before."""
        task = self.task_id()
        if task is None and self.process.poll() is not None:
            raise AssertionError(f"the job exited with {self.process.returncode} before training:\n{self.output()}")
        return task

    def changes(self, start: float, end: float) -> List[Tuple[int, int]]:
        """(round, batch size) of the changes applied between `start` and `end`."""
        return [
            (int(m.group(1)), int(m.group(2)))
            for t, line in list(self.lines)
            if start <= t <= end and (m := CHANGE.search(line))
        ]

    def output(self, last: int = 60) -> str:
        return "\n".join(line for _, line in self.lines[-last:])

    def wait(self) -> int:
        code = self.process.wait(timeout=DEADLINE_S + TRAIN_S)
        self._reader.join(timeout=DEADLINE_S)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # iadeep run forwards it; the job finishes its task
            try:
                self.process.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()


def placements(cluster: Cluster) -> Dict[str, dict]:
    """Task id -> placement, of every placed task."""
    found = {}
    for key in cluster.keys("/iadeep/v1/tasks/"):
        if key.endswith("/placement"):
            placement = cluster.get(key)
            if isinstance(placement, dict):
                found[key.split("/")[-2]] = placement
    return found


def test_the_readme_quick_start_shares_the_gpu_and_tunes_both_jobs(tmp_path: Path):
    cluster = Cluster(tmp_path / "cluster", devices=1, memory_mib=16384).start()
    jobs: List[Job] = []
    try:
        first = Job(cluster)
        jobs.append(first)
        wait_for("the first job to start training", first.training)
        time.sleep(3)  # "a few seconds" later
        second = Job(cluster)
        jobs.append(second)

        deadline = second.submitted + SHARE_WITHIN_S
        placed: Dict[str, dict] = {}
        while len(placed) < 2 and time.time() < deadline:
            placed = placements(cluster)
            time.sleep(0.2)
        assert len(placed) == 2, (
            f"the two jobs did not run on the GPU together within {SHARE_WITHIN_S} s of the second's "
            f"submission (placed: {sorted(placed)}); the second's output:\n{second.output()}"
        )
        assert len({p["deviceId"] for p in placed.values()}) == 1, placed
        # From the later placement on, the two share the GPU (protobuf JSON: int64 as a string).
        shared_from = max(int(p["placedAtUnixMs"]) for p in placed.values()) / 1000

        def both_tuned_while_sharing() -> bool:
            for job in jobs:
                if job.process.poll() is not None:
                    raise AssertionError(
                        f"job {job.task_id()} exited with {job.process.returncode} before both were tuned "
                        f"while sharing the GPU:\n{job.output()}"
                    )
            return all(job.changes(shared_from, time.time()) for job in jobs)

        try:
            wait_for("a batch-size change for each job while the two share the GPU", both_tuned_while_sharing)
        except AssertionError as err:
            outputs = "\n".join(f"--- job {job.task_id()}:\n{job.output()}" for job in jobs)
            raise AssertionError(f"{err}\n{outputs}") from None
        for job in jobs:
            job.process.terminate()  # iadeep run forwards it; the example stops after its step
        codes = [job.wait() for job in jobs]
        for job, code in zip(jobs, codes):
            assert code == 0, f"job {job.task_id()} exited with {code}:\n{job.output()}"
            assert any("stopped on SIGTERM" in line for _, line in job.lines), job.output()

        assert sorted(placed) == sorted(job.task_id() for job in jobs)
        assert placements(cluster) == {}, "both placements are released when the jobs exit"
    finally:
        for job in jobs:
            job.stop()
        cluster.stop()
