"""The Python API of the agent, against an embedded store file (no server needed)."""

from __future__ import annotations

import ast
import math
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

import iadeep


def agent(tmp_path: Path, task: str = "job-1", **kwargs) -> iadeep.Agent:
    kwargs.setdefault("use_nvml", False)
    return iadeep.Agent(task, str(tmp_path / "state.redb"), "test-model", 64, 16, 256, **kwargs)


def test_import_does_not_need_torch():
    code = "import sys, iadeep; assert 'torch' not in sys.modules, 'import iadeep imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_loop_api(tmp_path: Path):
    a = agent(tmp_path, lr_rule="linear")
    assert a.registered and a.task_id == "job-1"
    assert (a.batch_size, a.lr_factor, a.round) == (64, 1.0, 0)
    a.record_step(64, 0.01)
    a.record_gradient_norms(16, 2.0, 64, 1.25)
    a.record_peak_memory(2048)
    assert a.poll_change() is None
    a.record_step(96, 0.01)  # 96 completed a step: it fits
    change = a.report_oom(128)
    assert (change.batch_size, change.reason, change.round) == (96, "out_of_memory", 0)
    assert change.lr_factor == pytest.approx(96 / 64)  # the linear rule
    assert a.batch_size == 96
    assert "out_of_memory" in repr(change)
    # Without an argument, report_oom means the current batch size.
    assert a.report_oom().batch_size == 48
    a.finish()


def test_with_block_finishes_and_the_agent_is_then_closed(tmp_path: Path):
    with agent(tmp_path) as a:
        assert not a.finished
    assert a.finished
    with pytest.raises(RuntimeError, match="finished"):
        a.batch_size
    a.finish()  # a second finish does nothing
    assert "finished" in repr(a)


def test_leaving_a_with_block_by_an_exception_abandons_the_task(tmp_path: Path):
    with pytest.raises(KeyError):
        with agent(tmp_path) as a:
            raise KeyError("boom")
    assert a.finished


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        ({"lr_rule": "cubic"}, ValueError, "not one of none, linear, sqrt, adascale"),
        ({"report_interval_s": 0.0}, ValueError, "report_interval_s"),
        ({"lease_ttl_s": float("nan")}, ValueError, "lease_ttl_s"),
        ({"min_batch_size": 128}, iadeep.AgentError, "outside the bounds"),
    ],
)
def test_bad_arguments_say_what_is_wrong(tmp_path: Path, kwargs, error, needle):
    args = dict(task_id="t", store=str(tmp_path / "s.redb"), model="m", initial_batch_size=64, use_nvml=False)
    args.update(kwargs)
    with pytest.raises(error, match=needle):
        iadeep.Agent(**args)


def test_a_malformed_store_url_is_an_agent_error():
    with pytest.raises(iadeep.AgentError, match="unknown scheme"):
        iadeep.Agent("t", "http://localhost:1", "m", 8)


def test_a_negative_step_time_is_refused(tmp_path: Path):
    a = agent(tmp_path)
    with pytest.raises(ValueError, match="not a duration"):
        a.record_step(64, -1.0)
    a.finish()


def test_from_env_prefers_what_iadeep_run_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("IADEEP_TASK_ID", "env-job")
    monkeypatch.setenv("IADEEP_STORE", str(tmp_path / "state.redb"))
    monkeypatch.setenv("IADEEP_BATCH_SIZE", "32")
    monkeypatch.setenv("IADEEP_MIN_BATCH_SIZE", "8")
    monkeypatch.setenv("IADEEP_MAX_BATCH_SIZE", "128")
    monkeypatch.setenv("IADEEP_LR_RULE", "linear")
    a = iadeep.Agent.from_env(model="m", initial_batch_size=16, use_nvml=False)
    assert (a.task_id, a.batch_size) == ("env-job", 32)
    a.record_step(32, 0.01)
    assert a.report_oom(32).lr_factor == pytest.approx(16 / 32)  # the launcher's linear rule, m0 = 32
    a.finish()


def test_the_learning_rate_rule_defaults_to_sqrt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # `iadeep run` without --lr-rule sets no IADEEP_LR_RULE: the rule is sqrt, as in
    # the constructor (and `iadeep run --help`).
    monkeypatch.setenv("IADEEP_TASK_ID", "default-rule")
    monkeypatch.setenv("IADEEP_STORE", str(tmp_path / "state.redb"))
    monkeypatch.delenv("IADEEP_LR_RULE", raising=False)
    monkeypatch.delenv("IADEEP_MODEL", raising=False)
    for a in (
        iadeep.Agent.from_env(model="m", initial_batch_size=64, min_batch_size=16, use_nvml=False),
        iadeep.Agent("t", str(tmp_path / "other.redb"), "m", 64, 16, use_nvml=False),
    ):
        a.record_step(16, 0.01)
        assert a.report_oom(64).lr_factor == pytest.approx(math.sqrt(16 / 64))
        a.finish()


def test_from_env_without_a_launcher_says_how_to_start_the_job(monkeypatch: pytest.MonkeyPatch):
    for name in ("IADEEP_TASK_ID", "IADEEP_STORE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(iadeep.AgentError, match="IADEEP_TASK_ID is not set.*iadeep run"):
        iadeep.Agent.from_env(initial_batch_size=8)


def test_per_step_calls_allocate_nothing(tmp_path: Path):
    a = agent(tmp_path)
    seconds = 0.01

    def steps(n: int) -> None:
        for _ in range(n):
            bs = a.batch_size
            a.record_step(bs, seconds)
            a.poll_change()

    steps(1000)  # warm up
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    steps(100_000)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename") if stat.size_diff > 0)
    assert grown < 4096, f"{grown} bytes still allocated after 100000 steps"
    a.finish()


def test_connecting_releases_the_gil():
    # A server that accepts connections and never answers: connecting waits for the
    # whole connect timeout, which other Python threads must be able to use.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        port = server.getsockname()[1]
        counted = [0]
        stop = threading.Event()

        def count() -> None:
            while not stop.is_set():
                counted[0] += 1

        thread = threading.Thread(target=count)
        thread.start()
        try:
            # How far the thread counts in 0.2 s while this one sleeps (GIL free).
            before = counted[0]
            time.sleep(0.2)
            free_running = counted[0] - before
            before = counted[0]
            a = iadeep.Agent("gil", f"etcd://127.0.0.1:{port}", "m", 8, connect_timeout_s=1.0, use_nvml=False)
            during = counted[0] - before
        finally:
            stop.set()
            thread.join()
        assert not a.registered
        # The connect waits 1 s. Holding the GIL meanwhile would let the thread count
        # for one switch interval (5 ms) at most, a fortieth of what it counts in 0.2 s of
        # sleep; released, it counts about five times that. A quarter leaves room for a
        # loaded machine's scheduler on both sides.
        assert during > free_running / 4, f"counted {during} during the 1 s connect, {free_running} in 0.2 s"


def _stub_members(stub: Path, class_name: str) -> set:
    tree = ast.parse(stub.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
    raise AssertionError(f"{class_name} missing from {stub}")


@pytest.mark.parametrize("cls", [iadeep.Agent, iadeep.BatchSizeChange])
def test_the_type_stubs_match_the_extension(cls):
    package = Path(iadeep.__file__).parent
    assert (package / "py.typed").exists()
    stubbed = _stub_members(package / "_native.pyi", cls.__name__)
    public = {name for name in dir(cls) if not name.startswith("_")}
    assert public <= stubbed, f"not in the stubs: {sorted(public - stubbed)}"
    assert {n for n in stubbed if not n.startswith("_")} <= public, "stubs name members that do not exist"


def test_lr_rules_are_the_agents():
    assert iadeep.LR_RULES == ["none", "linear", "sqrt", "adascale"]
