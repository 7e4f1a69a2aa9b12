"""A real `iadeep up --no-nvml` cluster and Python jobs launched with `iadeep run`."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import iadeep
from conftest import DEADLINE_S, IADEEP, JOBS, Cluster, iadeep as run_iadeep, python_job, wait_for

SYNTHETIC = JOBS / "synthetic_job.py"
RUN_ARGS = ["--batch-size", "16", "--min-batch-size", "8", "--max-batch-size", "64", "--lr-rule", "sqrt"]


def started(out: Path) -> dict:
    """What the job wrote when it started (its task id, its environment)."""
    return json.loads(wait_for(f"the job to start ({out}.started)", lambda: _read(Path(f"{out}.started"))))


def _read(path: Path):
    return path.read_text() if path.exists() and path.stat().st_size > 0 else None


def test_a_job_applies_the_tuners_assignment_reports_finishes_and_is_released(cluster: Cluster, tmp_path: Path):
    out = tmp_path / "job.json"
    # The job gives up after 150 s without a change (the assertions below then say so).
    job = cluster.run_job(
        RUN_ARGS + ["--task-id", "adaptive-1"], python_job(SYNTHETIC, "--out", str(out), "--max-seconds", "150")
    )
    assert job.wait(timeout=DEADLINE_S) == 0
    result = json.loads(out.read_text())

    env = result["env"]
    assert env["IADEEP_TASK_ID"] == "adaptive-1"
    assert env["IADEEP_STORE"] == cluster.store
    assert env["CUDA_VISIBLE_DEVICES"] == "0", "the index of the only GPU"
    assert (env["IADEEP_BATCH_SIZE"], env["IADEEP_MAX_BATCH_SIZE"]) == ("16", "64")

    # The tuner moved the batch size, with the square-root rule's learning-rate factor.
    moved = [c for c in result["changes"] if c["batch_size"] != 16]
    assert moved, f"no assignment moved the batch size: {result['changes']}"
    for change in result["changes"]:
        assert change["reason"] == "assignment"
        assert change["lr_factor"] == pytest.approx(math.sqrt(change["batch_size"] / 16))
    # Steps after a change ran at its batch size and learning rate.
    first = moved[0]
    step_after = result["steps"][first["applied_at_step"]]
    assert step_after == [first["batch_size"], pytest.approx(0.1 * first["lr_factor"])]
    assert result["finished"] and result["reports"] > 0

    # The report in the store says finished; the placement is gone.
    report = cluster.get("/iadeep/v1/tasks/adaptive-1/report")
    assert report is not None and report["finished"] is True
    assert cluster.placement("adaptive-1") is None


def test_the_model_the_script_names_replaces_the_launchers_default(cluster: Cluster, tmp_path: Path):
    script = tmp_path / "train_script.py"
    script.write_text(
        "import iadeep\n"
        "agent = iadeep.Agent.from_env(model='explicit-model', initial_batch_size=8, use_nvml=False)\n"
        "agent.finish()\n"
    )
    # Without --model, `iadeep run` submits the task under the script's name; the
    # script's own name for its model wins.
    job = cluster.run_job(["--batch-size", "8", "--task-id", "named-1"], python_job(script))
    assert job.wait(timeout=DEADLINE_S) == 0
    assert cluster.get("/iadeep/v1/tasks/named-1/spec")["model"] == "explicit-model"
    # With --model, the user's name on the command line wins (what the placer was told).
    job = cluster.run_job(["--batch-size", "8", "--task-id", "named-2", "--model", "from-cli"], python_job(script))
    assert job.wait(timeout=DEADLINE_S) == 0
    assert cluster.get("/iadeep/v1/tasks/named-2/spec")["model"] == "from-cli"


def test_a_job_killed_with_its_launcher_is_released_after_the_grace_period(cluster: Cluster, tmp_path: Path):
    out = tmp_path / "job.json"
    # Its own process group, so one SIGKILL takes `iadeep run` and the job together:
    # nobody is left to release the placement but the placer's reaper.
    job = cluster.run_job(
        RUN_ARGS + ["--task-id", "killed-1"], python_job(SYNTHETIC, "--hang", "--out", str(out)),
        start_new_session=True,
    )
    try:
        started(out)
        wait_for("the job's alive key", lambda: cluster.get("/iadeep/v1/tasks/killed-1/alive") is not None)
        assert cluster.placement("killed-1") is not None
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=DEADLINE_S)
    wait_for("the placer to release the killed job", lambda: cluster.placement("killed-1") is None)
    report = cluster.get("/iadeep/v1/tasks/killed-1/report")
    assert report is not None and not report.get("finished", False), "a killed job never claims it finished"


def test_the_jobs_exit_code_comes_back_and_the_placement_is_released(cluster: Cluster):
    for task, code, script in [
        ("exit-3", 3, "import sys; sys.exit(3)"),
        ("sigkill", 128 + 9, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
    ]:
        job = cluster.run_job(["--batch-size", "8", "--task-id", task], [sys.executable, "-c", script])
        assert job.wait(timeout=DEADLINE_S) == code, task
        assert cluster.placement(task) is None, task


def test_sigterm_to_iadeep_run_reaches_the_job_which_finishes_cleanly(cluster: Cluster, tmp_path: Path):
    out = tmp_path / "job.json"
    job = cluster.run_job(RUN_ARGS + ["--task-id", "term-1"], python_job(SYNTHETIC, "--hang", "--out", str(out)))
    started(out)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=DEADLINE_S) == 0
    result = json.loads(out.read_text())
    assert result["terminated"] and result["finished"]
    assert cluster.placement("term-1") is None


def test_an_unreachable_store_does_not_stop_a_python_loop(cluster: Cluster):
    agent = iadeep.Agent(
        "outage-1", cluster.store, "synthetic", 32, 16, 64,
        report_interval_s=0.2, lease_ttl_s=2.0, connect_timeout_s=10.0, use_nvml=False,
    )
    assert agent.registered
    assert cluster.stop() == 0  # etcd goes away with the cluster
    steps = 0
    for _ in range(3000):
        bs = agent.batch_size
        time.sleep(0.0005)
        agent.record_step(bs, 0.0005)
        agent.poll_change()
        steps += 1
    assert steps == 3000 and agent.batch_size == 32
    with pytest.raises(iadeep.AgentError):
        agent.finish()  # the store cannot confirm; the lease expires by itself
    assert agent.finished


def test_a_store_that_never_answers_does_not_stop_the_loop_either():
    # A loopback port nobody listens on.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = iadeep.Agent(
        "nowhere-1", f"etcd://127.0.0.1:{port}", "m", 32, connect_timeout_s=0.5, use_nvml=False
    )
    assert not agent.registered
    for _ in range(1000):
        agent.record_step(agent.batch_size, 0.001)
        assert agent.poll_change() is None
    with agent:
        pass  # leaving the block does not raise even though the store never confirmed
    assert agent.finished


def test_a_second_up_resumes_the_stored_state_and_a_concurrent_one_is_refused(tmp_path: Path):
    directory = tmp_path / "cluster"
    first = Cluster(directory).start()
    try:
        job = first.run_job(["--batch-size", "8", "--task-id", "before-restart"], [sys.executable, "-c", "pass"])
        assert job.wait(timeout=DEADLINE_S) == 0
        spec = first.get("/iadeep/v1/tasks/before-restart/spec")
        assert spec is not None and spec["initialBatchSize"] == 8  # protobuf JSON: camelCase
        concurrent = run_iadeep(
            "up", "--no-nvml", "--devices", "1", "--memory-mib", "1000", "--dir", str(directory),
            "--etcd-port", "0", "--etcd-peer-port", "0", "--placer", "127.0.0.1:0", check=False,
        )
        assert concurrent.returncode != 0
        assert "another `iadeep up` runs on" in concurrent.stderr
    finally:
        assert first.stop() == 0
    assert not (directory / "cluster.env").exists(), "a stopped cluster leaves no stale cluster.env"

    second = Cluster(directory).start()
    try:
        assert second.get("/iadeep/v1/tasks/before-restart/spec") == spec
    finally:
        assert second.stop() == 0


def test_iadeep_run_says_what_is_missing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("IADEEP_")}
    result = subprocess.run(
        [str(IADEEP), "run", "--batch-size", "8", "--", "true"],
        env=env, capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert result.returncode != 0
    assert "IADEEP_PLACER" in result.stderr and "iadeep up" in result.stderr


def test_a_job_that_does_not_fit_waits_in_the_queue_saying_why(tmp_path: Path):
    small = Cluster(tmp_path / "cluster", memory_mib=2000).start()
    try:
        out = tmp_path / "holder.json"
        holder = small.run_job(
            ["--batch-size", "8", "--gpu-mem-mib", "1500", "--task-id", "holder"],
            python_job(SYNTHETIC, "--hang", "--out", str(out)),
        )
        started(out)
        # A second job needing as much cannot share the card: it waits, then gives up.
        gave_up = small.run_job(
            ["--batch-size", "8", "--gpu-mem-mib", "1500", "--task-id", "impatient", "--max-wait-s", "1"],
            [sys.executable, "-c", "pass"], stderr=subprocess.PIPE, text=True,
        )
        _, log = gave_up.communicate(timeout=DEADLINE_S)
        assert gave_up.returncode == 75, log
        assert "the placer says wait" in log and "giving up" in log
        assert "memory: the task needs" in log, "the GPU's own reason is said: " + log
        assert small.placement("impatient") is None

        waiting = small.run_job(
            ["--batch-size", "8", "--gpu-mem-mib", "1500", "--task-id", "patient"],
            [sys.executable, "-c", "pass"], stderr=subprocess.PIPE, text=True,
        )
        lines = []
        wait_for("the queued job to say why it waits", lambda: _line_with(waiting, "the placer says wait", lines))
        assert small.placement("patient") is None
        holder.send_signal(signal.SIGTERM)  # the holder finishes; its GPU frees
        assert holder.wait(timeout=DEADLINE_S) == 0
        _, rest = waiting.communicate(timeout=DEADLINE_S)
        assert waiting.returncode == 0, "".join(lines) + rest
        assert "placed; starting the job" in rest
    finally:
        small.stop()


def _line_with(process: subprocess.Popen, needle: str, lines: list):
    line = process.stderr.readline()
    lines.append(line)
    return needle in line or None
