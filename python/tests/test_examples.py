"""The examples in examples/python, run as a user would: `iadeep run` on a cluster.

Each skips, saying so, where its framework is not importable.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import List

import pytest

from conftest import DEADLINE_S, EXAMPLES, REPO, Cluster, iadeep, python_job, wait_for


def run_example(cluster: Cluster, task: str, script: str, *args: str) -> str:
    job = cluster.run_job(
        ["--batch-size", "64", "--min-batch-size", "16", "--max-batch-size", "512", "--lr-rule", "sqrt",
         "--task-id", task],
        python_job(EXAMPLES / script, *args, "--report-interval-s", "0.5"),
        stdout=subprocess.PIPE, text=True,
    )
    out, _ = job.communicate(timeout=DEADLINE_S)
    assert job.returncode == 0, out
    report = cluster.get(f"/iadeep/v1/tasks/{task}/report")
    assert report is not None and report["finished"], report
    assert cluster.placement(task) is None
    return out


def test_the_numpy_example_trains_under_iadeep_run(cluster: Cluster):
    pytest.importorskip("numpy", reason="numpy is not importable: the numpy example did not run")
    out = run_example(cluster, "numpy-example", "train_numpy.py", "--epochs", "3", "--samples", "20000")
    assert "epoch 2: mean loss" in out


def test_the_pytorch_example_trains_under_iadeep_run(cluster: Cluster):
    pytest.importorskip("torch", reason="torch is not importable: the PyTorch example did not run")
    out = run_example(cluster, "torch-example", "train_mnist_like.py", "--epochs", "1", "--samples", "3000")
    assert "epoch 0: loss" in out


def test_ctrl_c_stops_the_pytorch_example_after_its_step(cluster: Cluster):
    # A terminal's Ctrl-C reaches the whole foreground process group: `iadeep run` waits,
    # the job ends its step and exits 0 (before, it died with a KeyboardInterrupt traceback).
    pytest.importorskip("torch", reason="torch is not importable: the PyTorch example did not run")
    task = "ctrl-c-example"
    job = cluster.run_job(
        ["--batch-size", "64", "--min-batch-size", "16", "--max-batch-size", "512", "--task-id", task],
        python_job(EXAMPLES / "train_mnist_like.py", "--epochs", "1000", "--report-interval-s", "0.5"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    assert job.stdout is not None
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith(f"task {task} on"):
            break
    else:
        raise AssertionError("the example never started:\n" + "".join(lines))
    os.killpg(job.pid, signal.SIGINT)
    out, _ = job.communicate(timeout=DEADLINE_S)
    out = "".join(lines) + out
    assert job.returncode == 0, out
    assert "stopped on SIGINT" in out and "Traceback" not in out, out
    assert cluster.placement(task) is None


class Lines:
    """A process's output lines, read as they come by a thread (a wait never hangs on a read)."""

    def __init__(self, job: subprocess.Popen) -> None:
        assert job.stdout is not None
        self.lines: List[str] = []
        self.thread = threading.Thread(target=self._read, args=(job.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def after(self, start: int, prefix: str) -> int:
        """Waits for a line from the `start`th on beginning with `prefix`; returns its index."""
        def found():
            ended = not self.thread.is_alive()  # before looking: a line read meanwhile is seen
            at = next((i for i, line in enumerate(self.lines[start:], start) if line.startswith(prefix)), None)
            if at is None and ended:
                raise AssertionError(f"the output ended with no line {prefix!r}:\n{self.text()}")
            return None if at is None else at + 1
        return wait_for(f"a line {prefix!r}", found) - 1

    def text(self) -> str:
        return "".join(self.lines)


def test_an_evicted_pytorch_example_saves_its_checkpoint_exits_3_and_resumes_when_requeued(
    cluster: Cluster, tmp_path: Path
):
    # A new-user trial: evicted, the example logged "checkpointing" but saved nothing, died
    # with an iadeep.Evicted traceback, and `iadeep run` restarted it from epoch 0.
    torch = pytest.importorskip("torch", reason="torch is not importable: the PyTorch example did not run")
    task, reason = "evicted-example", "prod-1 ran at PD 1.31 above its cap 1.10 for 3 rounds"
    checkpoint = tmp_path / "mnist-like.pt"
    job = cluster.run_job(
        ["--batch-size", "64", "--min-batch-size", "16", "--max-batch-size", "512", "--task-id", task],
        python_job(
            EXAMPLES / "train_mnist_like.py", "--epochs", "1000", "--samples", "1000",
            "--checkpoint", str(checkpoint), "--report-interval-s", "0.5",
        ),
        env={"RUST_LOG": "info"},  # iadeep run's "job exited" line, with the exit code
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    out = Lines(job)
    try:
        trained = out.after(0, "epoch 0: loss")
        # The placer's evict assignment: the last one, with evict set.
        key = f"/iadeep/v1/tasks/{task}/assignment"
        assignment = cluster.get(key) or {"taskId": task, "batchSize": 64, "lrFactor": 1.0, "round": "1"}
        assignment.update(evict=True, evictReason=reason)
        iadeep("state", "put", key, json.dumps(assignment), "--store", cluster.store)
        evicted = out.after(trained, "evicted (")
        resumed = out.after(evicted, "resumed from ")
        saved = re.fullmatch(
            rf"evicted \({re.escape(reason)}\); epoch (\d+) saved to {re.escape(str(checkpoint))}; "
            r"iadeep run re-queues the job to resume there\n",
            out.lines[evicted],
        )
        assert saved, out.text()
        epoch = int(saved.group(1))
        assert epoch >= 1 and out.lines[resumed] == f"resumed from {checkpoint} at epoch {epoch}\n", out.text()
        # The restarted run trains on from the saved epoch; then SIGTERM stops it as before.
        out.after(resumed, f"epoch {epoch}: loss")
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=DEADLINE_S)
        out.thread.join(timeout=DEADLINE_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = out.text()
    assert job.returncode == 0, text
    assert "Traceback" not in text, text
    assert f"evicted ({reason}); calling on_evict, then stopping" in text, "the library's log says so"
    assert not any(line.startswith("epoch 0:") for line in out.lines[resumed:]), "not started over"
    exits = [line for line in out.lines if "job exited" in line]
    assert len(exits) == 2 and "exit_code=3" in exits[0] and "exit_code=0" in exits[1], text
    assert "stopped on SIGTERM" in text, text
    state = torch.load(checkpoint, weights_only=True)
    assert state["epoch"] == epoch and {"model", "optimizer"} <= state.keys(), state.keys()
    report = cluster.get(f"/iadeep/v1/tasks/{task}/report")
    assert report is not None and report["finished"], report
    assert cluster.placement(task) is None


def _peak_memory_reports(source: str) -> list:
    """The expressions a piece of Python passes to `agent.record_peak_memory`."""
    return [
        ast.unparse(node.args[0])
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "record_peak_memory"
    ]


def test_the_readme_loop_reports_memory_as_the_example_does():
    # torch.cuda.max_memory_reserved() is 0 where no GPU is used: both report
    # iadeep.torch.peak_memory_mib(device), the process's peak on the CPU.
    readme = (REPO / "README.md").read_text()
    section = readme.split("## In a Python training loop", 1)[1].split("\n## ", 1)[0]
    loop = re.search(r"```python\n(.*?)```", section, re.S)
    assert loop, "the README's Python section has its loop"
    example = (EXAMPLES / "train_mnist_like.py").read_text()
    assert _peak_memory_reports(loop.group(1)) == ["iadeep.torch.peak_memory_mib(device)"]
    assert _peak_memory_reports(example) == ["iadeep.torch.peak_memory_mib(device)"]
