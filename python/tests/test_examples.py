"""The examples in examples/python, run as a user would: `iadeep run` on a cluster.

Each skips, saying so, where its framework is not importable.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess

import pytest

from conftest import DEADLINE_S, EXAMPLES, REPO, Cluster, python_job


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
