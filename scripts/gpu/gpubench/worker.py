"""A worker process: one model on the GPU, driven by a measuring script.

Started as ``python -m gpubench.worker --backend B --model M`` (see
:class:`WorkerHandle`), it builds its trainer, prints one JSON line
``{"event": "ready", ...}`` (or ``{"event": "error", ...}`` and exits 1), then answers
each command line on stdin with one JSON line on stdout:

- ``{"cmd": "memory", "batch_size": b, "warmup_steps": w, "steps": n}``:
  peak memory and step time at b (:meth:`Trainer.memory_point`);
- ``{"cmd": "prepare", "batch_size": b, "steps": n}``: switch to b and train n steps
  (cuDNN's algorithm choice, the allocator's first reservations);
- ``{"cmd": "window", "start_at": t, "warmup_s": w, "measure_s": m, "corunners": [...]}``:
  the timed window of :meth:`Trainer.window`;
- ``{"cmd": "release"}``: give cached memory back; ``{"cmd": "exit"}``.

Answers have ``"ok": true``, or ``"ok": false`` with ``"oom": true`` when the GPU ran
out of memory (the worker stays usable) or ``"error"``. Library output that would go
to stdout goes to stderr, so stdout carries the protocol only.

Separate processes because that is how jobs share a GPU (time-sliced CUDA contexts),
and so that a crash or an out-of-memory error stays in the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, IO, List, Optional, Tuple

from .backend import BACKENDS, PRECISIONS, OutOfMemory, Trainer, build_trainer
from .catalogue import model

#: The folder holding the gpubench package (put on the worker's PYTHONPATH).
SCRIPTS_DIR = Path(__file__).resolve().parents[1]


def _answer(out: IO[str], message: Dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _handle(trainer: Trainer, command: Dict[str, Any]) -> Dict[str, Any]:
    cmd = command.get("cmd")
    if cmd == "memory":
        return {"ok": True, **trainer.memory_point(
            int(command["batch_size"]), int(command.get("warmup_steps", 3)), int(command.get("steps", 5))
        )}
    if cmd == "prepare":
        trainer.set_batch_size(int(command["batch_size"]))
        for _ in range(int(command.get("steps", 3))):
            trainer.step()
        return {"ok": True, "reserved_mib": trainer.peak_memory()["reserved_mib"]}
    if cmd == "window":
        corunners = [(str(name), int(b)) for name, b in command.get("corunners", [])]
        return {"ok": True, **trainer.window(
            float(command["start_at"]), float(command["warmup_s"]), float(command["measure_s"]), corunners
        )}
    if cmd == "release":
        trainer.release_cache()
        return {"ok": True}
    return {"ok": False, "error": f"unknown command {cmd!r}"}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="gpubench worker (started by the measuring scripts)")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--nvml-index", type=int, default=0, help="the GPU's NVML index")
    args = parser.parse_args(argv)
    protocol = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not corrupt the protocol
    try:
        trainer = build_trainer(args.backend, model(args.model), args.precision, args.nvml_index)
    except Exception as error:  # noqa: BLE001 - reported to the driver, then exit
        traceback.print_exc()
        _answer(protocol, {"event": "error", "error": f"{type(error).__name__}: {error}",
                           "oom": isinstance(error, OutOfMemory)})
        return 1
    _answer(protocol, {"event": "ready", "pid": os.getpid(), "describe": trainer.describe()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
        except json.JSONDecodeError as error:
            _answer(protocol, {"ok": False, "error": f"bad command: {error}"})
            continue
        if command.get("cmd") == "exit":
            break
        try:
            reply = _handle(trainer, command)
        except OutOfMemory as error:
            reply = {"ok": False, "oom": True, "error": str(error)}
        except Exception as error:  # noqa: BLE001 - the driver decides what a failure means
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        _answer(protocol, reply)
    return 0


class WorkerError(RuntimeError):
    """The worker died, hung past its deadline, or failed to start."""


class WorkerHandle:
    """The driver's side of one worker process."""

    def __init__(
        self,
        backend: str,
        model_name: str,
        precision: str,
        log_path: Path,
        device_index: int = 0,
        start_timeout_s: float = 600.0,
        python: str = sys.executable,
    ) -> None:
        self.model = model_name
        self.batch_size: Optional[int] = None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS_DIR), env.get("PYTHONPATH")]))
        # The worker's cuda:0 is NVML's GPU `device_index`, as `iadeep run` arranges it.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(device_index)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "a")
        self.process = subprocess.Popen(
            [python, "-u", "-m", "gpubench.worker", "--backend", backend, "--model", model_name,
             "--precision", precision, "--nvml-index", str(device_index)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._next(start_timeout_s)
        if hello.get("event") != "ready":
            self.close()
            error = WorkerError(f"worker {model_name} did not start: {hello.get('error')}")
            error.oom = bool(hello.get("oom"))  # type: ignore[attr-defined]
            raise error
        self.describe: Dict[str, Any] = hello.get("describe", {})
        self.pid = int(hello["pid"])

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout_s: float) -> Dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise WorkerError(f"worker {self.model} did not answer within {timeout_s:.0f} s") from None
        if line is None:
            code = self.process.wait()
            raise WorkerError(f"worker {self.model} exited with status {code} (see its log)")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise WorkerError(f"worker {self.model} wrote a line that is not JSON: {line!r}") from None

    def send(self, command: Dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise WorkerError(f"worker {self.model} is gone: {error}") from None

    def receive(self, timeout_s: float) -> Dict[str, Any]:
        return self._next(timeout_s)

    def request(self, command: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
        self.send(command)
        return self.receive(timeout_s)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Asks the worker to exit; kills it if it does not within 30 s."""
        if self.process.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.process.stdin.close()  # type: ignore[union-attr]
            except (WorkerError, OSError):
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class WorkerPool:
    """Workers kept alive between measurements, one job type (model, batch size)
    each, so a pair does not pay for starting PyTorch twice; at most `max_workers`
    live at once (the least recently used idle ones are closed first)."""

    def __init__(
        self, backend: str, precision: str, log_dir: Path, max_workers: int, prepare_steps: int, device_index: int = 0
    ) -> None:
        self.backend = backend
        self.device_index = device_index
        self.precision = precision
        self.log_dir = log_dir
        self.max_workers = max(1, max_workers)
        self.prepare_steps = prepare_steps
        self._workers: List[WorkerHandle] = []
        self._used: Dict[int, float] = {}
        self.describe: Dict[str, Any] = {}

    def acquire(self, jobs: List[Tuple[str, int]]) -> List[WorkerHandle]:
        """A distinct worker for each job, prepared at its batch size. Raises
        WorkerError (with `oom` set when a job cannot even start alone)."""
        chosen: List[WorkerHandle] = []
        for name, b in jobs:
            idle = [w for w in self._workers if w.model == name and w.batch_size == b and w not in chosen and w.alive]
            if idle:
                chosen.append(idle[0])
                continue
            self._make_room(keep=chosen, need=len(jobs) - len(chosen))
            worker = WorkerHandle(
                self.backend, name, self.precision, self.log_dir / f"worker-{name}-{b}.log", self.device_index
            )
            self.describe = self.describe or worker.describe
            reply = worker.request({"cmd": "prepare", "batch_size": b, "steps": self.prepare_steps}, timeout_s=600)
            if not reply.get("ok"):
                worker.close()
                error = WorkerError(f"{name} at batch size {b} cannot run alone: {reply.get('error')}")
                error.oom = bool(reply.get("oom"))  # type: ignore[attr-defined]
                raise error
            worker.batch_size = b
            self._workers.append(worker)
            chosen.append(worker)
        now = time.monotonic()
        for worker in chosen:
            self._used[id(worker)] = now
        return chosen

    def _make_room(self, keep: List[WorkerHandle], need: int) -> None:
        self._workers = [w for w in self._workers if w.alive]
        idle = sorted((w for w in self._workers if w not in keep), key=lambda w: self._used.get(id(w), 0.0))
        while idle and len(self._workers) + need > self.max_workers:
            victim = idle.pop(0)
            victim.close()
            self._workers.remove(victim)

    def discard(self, worker: WorkerHandle) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
        worker.close()

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
        self._workers = []


if __name__ == "__main__":
    sys.exit(main())
