#!/usr/bin/env python3
"""One training job of the end-to-end run (scripts/gpu/e2e.py): a catalogue model
trained on random data for a fixed amount of work, --samples samples.

Under `iadeep run` (the iadeep policy) it embeds iadeep's agent: before each step it
takes the agent's batch size, after it records the step's time and PyTorch's peak
reserved memory, applies the tuner's changes between steps (learning rate scaled by
the change's factor), and on running out of GPU memory reports it and continues at
the agent's fall-back size. With the torch backend it also fences PyTorch's allocator
at the agent's memory fence (`iadeep.torch.MemoryFence`, as `AdaptiveDataLoader` does
for a user's loop) and records the fences set. With --no-agent (the exclusive and
packing baselines) it trains at --batch-size throughout, and running out of memory
ends it with exit status 3, as a crash would end an unmanaged job (e2e.py then
restarts it at half the size).

--backend synthetic (e2e.py --dry-run) trains nothing: each step sleeps the synthetic
step time of gpubench/synthetic.py, slowed by the other synthetic jobs registered in
--synthetic-registry, and runs out of memory when it starts or changes its batch size
while the registered jobs' synthetic memory would exceed the synthetic card.

Writes a JSON result to --result: times, steps, batch sizes and memory fences over
time, out-of-memory events.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpubench import catalogue, outputs, synthetic  # noqa: E402
from gpubench.backend import BACKENDS, PRECISIONS, OutOfMemory, SyntheticTrainer, Trainer, build_trainer  # noqa: E402

#: Exit status of a job that ran out of GPU memory and could not recover.
EXIT_OOM = 3


class SyntheticRegistry:
    """The synthetic jobs running now: one small JSON file per job in a folder."""

    def __init__(self, folder: Path, spec: catalogue.ModelSpec) -> None:
        self.folder = folder
        self.spec = spec
        self.path = folder / f"{os.getpid()}.json"
        folder.mkdir(parents=True, exist_ok=True)

    def others(self) -> List[tuple]:
        jobs = []
        for entry in self.folder.glob("*.json"):
            if entry == self.path:
                continue
            try:
                data = json.loads(entry.read_text())
                jobs.append((catalogue.model(data["model"]), int(data["batch_size"])))
            except (OSError, ValueError, KeyError):
                continue  # a file being written or removed right now
        return jobs

    def allocate(self, batch_size: int) -> None:
        """Registers `batch_size`; raises OutOfMemory when it does not fit next to the others."""
        if not synthetic.fits([(self.spec, batch_size), *self.others()]):
            raise OutOfMemory(f"synthetic card of {synthetic.CAPACITY_MIB} MiB exceeded")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": self.spec.name, "batch_size": batch_size}))
        os.replace(tmp, self.path)

    def slowdown(self, batch_size: int) -> float:
        return synthetic.slowdown((self.spec, batch_size), self.others())

    def leave(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="catalogue model")
    parser.add_argument("--batch-size", type=int, required=True, help="submitted batch size m0")
    parser.add_argument("--samples", type=int, required=True, help="work: samples to train")
    parser.add_argument("--backend", choices=BACKENDS, default="torch")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--no-agent", action="store_true", help="fixed batch size, no iadeep agent")
    parser.add_argument("--result", type=Path, required=True, help="JSON result file")
    parser.add_argument("--report-interval-s", type=float, default=1.0, help="agent's report interval")
    parser.add_argument("--synthetic-registry", type=Path, help="folder of the running synthetic jobs")
    args = parser.parse_args(argv)
    if args.batch_size <= 0 or args.samples <= 0:
        parser.error("--batch-size and --samples must be positive")
    if args.backend == "synthetic" and args.synthetic_registry is None:
        parser.error("--backend synthetic needs --synthetic-registry")
    return args


def nvml_index() -> int:
    """The NVML index `iadeep run` (or e2e.py) put in CUDA_VISIBLE_DEVICES."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(value) if value.isdigit() else 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    stop: List[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    spec = catalogue.model(args.model)
    synthetic_backend = args.backend == "synthetic"
    name = outputs.label(spec.name, synthetic_backend)
    result: Dict[str, Any] = {"model": name, "m0": args.batch_size, "samples": args.samples,
                              "pid": os.getpid(), "started_at": time.time(), "oom_events": 0}
    agent = None
    if not args.no_agent:
        import iadeep

        agent = iadeep.Agent.from_env(
            model=name, initial_batch_size=args.batch_size, report_interval_s=args.report_interval_s,
            use_nvml=not synthetic_backend,
        )
        result["task_id"] = agent.task_id
    trainer: Trainer = build_trainer(args.backend, spec, args.precision, nvml_index(), sleep=True)
    fence = None
    if agent is not None and not synthetic_backend:
        import iadeep.torch

        fence = iadeep.torch.MemoryFence(agent)
    fences: List[List[float]] = []
    registry = SyntheticRegistry(args.synthetic_registry, spec) if synthetic_backend else None
    timeline: List[List[float]] = []
    samples_done = steps = 0
    current = 0
    lr_factor = 1.0
    status = "ok"
    try:
        while samples_done < args.samples and not stop:
            bs = agent.batch_size if agent is not None else args.batch_size
            if fence is not None:
                fence.update()
                if fence.fence_mib is not None and (not fences or fences[-1][1] != fence.fence_mib):
                    fences.append([time.time(), fence.fence_mib])
            try:
                if bs != current:
                    if registry is not None:
                        registry.allocate(bs)
                    trainer.set_batch_size(bs)
                    trainer.reset_peaks()
                    current = bs
                    timeline.append([time.time(), bs])
                if registry is not None:
                    assert isinstance(trainer, SyntheticTrainer)
                    trainer.slowdown = registry.slowdown(bs)
                seconds = trainer.step()
            except OutOfMemory as error:
                result["oom_events"] += 1
                print(f"{name}: out of memory at batch size {bs}: {error}", file=sys.stderr, flush=True)
                if agent is None:
                    status = "oom-crash"
                    break
                change = agent.report_oom(bs)
                if change.batch_size >= bs:
                    status = "oom-crash"
                    break
                trainer.scale_lr(change.lr_factor / lr_factor)
                lr_factor = change.lr_factor
                current = 0  # allocate again at the fall-back size
                continue
            steps += 1
            samples_done += bs
            if agent is not None:
                agent.record_step(bs, seconds)
                agent.record_peak_memory(int(trainer.peak_memory()["reserved_mib"]))
                change = agent.poll_change()
                if change is not None:
                    trainer.scale_lr(change.lr_factor / lr_factor)
                    lr_factor = change.lr_factor
    finally:
        if registry is not None:
            registry.leave()
        if agent is not None and status == "ok":
            agent.finish()
    result.update(ended_at=time.time(), steps=steps, samples_done=samples_done, status=status,
                  terminated=bool(stop), batch_sizes=timeline, memory_fences_mib=fences)
    tmp = args.result.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.result)
    print(f"{name}: {status}, {steps} steps, {samples_done} samples in {result['ended_at'] - result['started_at']:.1f} s",
          flush=True)
    return EXIT_OOM if status == "oom-crash" else (1 if stop else 0)


if __name__ == "__main__":
    sys.exit(main())
