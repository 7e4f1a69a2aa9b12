"""Real processes for the tests: `iadeep up` clusters (etcd, placer, tuners) on loopback
ports and `iadeep run` jobs, driven through the `iadeep` binary.

Everything waits for conditions with generous deadlines and never asserts on how long
something took: the tests run on small, busy machines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
EXAMPLES = REPO / "examples" / "python"
#: The `iadeep` binary under test (scripts/test-python.sh builds it).
IADEEP = Path(os.environ.get("IADEEP_BIN", REPO / "target" / "debug" / "iadeep"))
#: Longest wait for anything (etcd starting, a tuner round, a job on a loaded machine).
DEADLINE_S = 180.0

T = TypeVar("T")

#: Live task keys, and where the Release moves a task's spec, report and assignment.
TASKS = "/iadeep/v1/tasks/"
ARCHIVE = "/iadeep/v1/archive/"
ARCHIVED = ("spec", "report", "assignment")


def wait_for(what: str, probe: Callable[[], Optional[T]], timeout: float = DEADLINE_S) -> T:
    """Polls `probe` until it returns something other than None/False."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def iadeep(*args: str, env: Optional[Dict[str, str]] = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(IADEEP), *args], env=env, capture_output=True, text=True, timeout=DEADLINE_S
    )
    if check and result.returncode != 0:
        raise AssertionError(f"iadeep {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


class Cluster:
    """An `iadeep up --no-nvml` cluster in `directory`."""

    def __init__(self, directory: Path, devices: int = 1, memory_mib: int = 16000, grace_s: int = 2) -> None:
        self.dir = directory
        self.devices = devices
        self.memory_mib = memory_mib
        self.grace_s = grace_s
        self.log_path = directory.parent / f"{directory.name}-up.log"
        self.process: Optional[subprocess.Popen] = None
        self.store = ""
        self.placer = ""

    def start(self) -> "Cluster":
        self.dir.mkdir(parents=True, exist_ok=True)
        env_file = self.dir / "cluster.env"
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                str(IADEEP), "up", "--no-nvml",
                "--devices", str(self.devices), "--memory-mib", str(self.memory_mib),
                "--dir", str(self.dir), "--etcd-port", "0", "--etcd-peer-port", "0",
                "--placer", "127.0.0.1:0", "--dead-task-grace-s", str(self.grace_s),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

        def ready() -> Optional[Dict[str, str]]:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"iadeep up exited with {self.process.returncode}:\n{self.log()}")
            if not env_file.exists():
                return None
            values = {}
            for line in env_file.read_text().splitlines():
                if line.startswith("export "):
                    name, _, value = line[len("export "):].partition("=")
                    values[name] = value
            return values

        values = wait_for("iadeep up to write cluster.env", ready)
        self.store = values["IADEEP_STORE"]
        self.placer = values["IADEEP_PLACER"]
        wait_for(
            f"{self.devices} tuner(s) to register their GPU",
            lambda: len([k for k in self.keys("/iadeep/v1/devices/") if k.endswith("/info")]) >= self.devices,
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def env(self, **extra: str) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(IADEEP_STORE=self.store, IADEEP_PLACER=self.placer, **extra)
        return env

    def keys(self, prefix: str) -> List[str]:
        out = iadeep("state", "ls", prefix, "--store", self.store).stdout
        return [line.split(" ", 1)[0] for line in out.splitlines() if line.strip()]

    def get(self, key: str) -> Optional[object]:
        """The value of `key` (JSON for iadeep's messages, else text), or None when absent.

        A task's spec, report and assignment move from `tasks/ID/` to `archive/ID/` when
        its job ends and `iadeep run` releases it, so for those a missing live key is
        looked up in the archive: the tests read what the store says about the task,
        running or ended."""
        value = self._get(key)
        if value is None and key.startswith(TASKS) and key.rsplit("/", 1)[-1] in ARCHIVED:
            value = self._get(ARCHIVE + key[len(TASKS):])
        return value

    def _get(self, key: str) -> Optional[object]:
        result = iadeep("state", "get", key, "--store", self.store, check=False)
        if result.returncode != 0:
            if "not found" in result.stderr:
                return None
            raise AssertionError(f"iadeep state get {key} failed:\n{result.stderr}")
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError:
            return result.stdout

    def placement(self, task_id: str) -> Optional[dict]:
        return self.get(f"/iadeep/v1/tasks/{task_id}/placement")

    def run_job(
        self, run_args: List[str], command: List[str], env: Optional[Dict[str, str]] = None, **popen: object
    ) -> subprocess.Popen:
        """Starts `iadeep run RUN_ARGS -- COMMAND` against this cluster (`env`: extra variables)."""
        return subprocess.Popen(
            [str(IADEEP), "run", *run_args, "--", *command], env=self.env(**(env or {})), **popen  # type: ignore[arg-type]
        )

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C would; returns iadeep up's exit status."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"iadeep up did not stop on SIGTERM:\n{self.log()}")
        self.process = None
        return code


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A fresh one-GPU cluster per test, so no job sees another test's."""
    running = Cluster(tmp_path / "cluster").start()
    try:
        yield running
    finally:
        running.stop()


def python_job(script: Path, *args: str) -> List[str]:
    """A command running `script` with this interpreter (the test venv's)."""
    return [sys.executable, "-u", str(script), *args]
