"""iadeep.torch with a real agent on a real cluster (assignments written into its etcd).

Skipped, saying so, where torch is not importable; scripts/test-python.sh prints
whether these tests ran.
"""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace
from typing import List, Optional, Tuple

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the iadeep.torch tests did not run")

import iadeep  # noqa: E402
import iadeep.torch as it  # noqa: E402
from conftest import Cluster, iadeep as run_iadeep, wait_for  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402


def make_agent(cluster: Cluster, task: str, m0: int, low: int, high: int, rule: str = "sqrt") -> iadeep.Agent:
    return iadeep.Agent(task, cluster.store, "torch-test", m0, low, high, rule, report_interval_s=0.2, use_nvml=False)


def assign(
    cluster: Cluster, task: str, batch_size: int, lr_factor: float, round_: int, bound_mib: Optional[float] = None
) -> None:
    """Writes an assignment as a tuner (or the placer, for a starting one) does."""
    value = {"task_id": task, "batch_size": batch_size, "lr_factor": lr_factor, "round": round_}
    if bound_mib is not None:
        value["memory_bound_mib"] = bound_mib
    run_iadeep("state", "put", f"/iadeep/v1/tasks/{task}/assignment", json.dumps(value), "--store", cluster.store)


def numbered_loader(agent: iadeep.Agent, samples: int):
    """A loader over the samples 0..samples-1 (as floats) and an SGD optimizer at lr 0.1."""
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    dataset = TensorDataset(torch.arange(samples).float().unsqueeze(1))
    return it.AdaptiveDataLoader(dataset, agent, optimizer=optimizer), optimizer


def test_the_loader_switches_batch_size_mid_epoch_without_losing_its_place(cluster: Cluster):
    agent = make_agent(cluster, "loader-1", 4, 2, 16)
    loader, optimizer = numbered_loader(agent, 2000)
    changes = []
    loader.on_change = changes.append
    assigned = False
    # Epochs until the change has happened inside one: bounded by a deadline for a broken
    # build, not by an epoch count, which a slow watch on a loaded machine can use up.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen, sizes = [], []
        for (batch,) in loader:
            seen.extend(int(x) for x in batch.squeeze(1))
            sizes.append(len(batch))
            if not assigned and len(seen) >= 8:
                assign(cluster, "loader-1", 8, 2.0, 1)
                assigned = True
            torch.tensor(0.0).add_(1)  # a (tiny) step; the assignment arrives meanwhile
        if changes:
            break
    assert changes and changes[0].batch_size == 8
    assert seen == list(range(2000)), "every sample once, in order, across the switch"
    switch = sizes.index(8)
    assert set(sizes[:switch]) == {4} and set(sizes[switch:]) == {8}
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert loader.batch_size == agent.batch_size == 8
    agent.finish()


def test_out_of_memory_is_reported_and_the_same_samples_retried_smaller(cluster: Cluster):
    agent = make_agent(cluster, "oom-1", 8, 2, 16)
    loader, optimizer = numbered_loader(agent, 40)
    trained, failed = [], []
    for (batch,) in loader:
        with loader.catch_oom():
            if len(batch) == 8 and not failed:
                failed.extend(int(x) for x in batch.squeeze(1))
                # What CUDA raises when a step does not fit (no GPU here to run out).
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            trained.append([int(x) for x in batch.squeeze(1)])
    assert failed == list(range(8))
    assert trained[0] == [0, 1, 2, 3] and trained[1] == [4, 5, 6, 7], "the failed samples, retried at 4"
    assert sum(trained, []) == list(range(40))
    assert agent.batch_size == 4
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * math.sqrt(4 / 8))
    report = wait_for(
        "the out-of-memory report", lambda: (cluster.get("/iadeep/v1/tasks/oom-1/report") or {}).get("oomBatchSize")
    )
    assert report == 8
    agent.finish()


def test_out_of_memory_at_the_smallest_size_is_raised(cluster: Cluster):
    agent = make_agent(cluster, "oom-2", 4, 4, 16)
    loader = it.AdaptiveDataLoader(TensorDataset(torch.zeros(8, 1)), agent)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        for _ in loader:
            with loader.catch_oom():
                raise torch.cuda.OutOfMemoryError("does not fit at all")
    agent.finish()


def test_gradient_accumulation_feeds_the_noise_scale(cluster: Cluster):
    agent = make_agent(cluster, "gns-1", 32, 8, 64)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gns = it.GradientNoiseScale(agent, model.parameters())
    x = torch.randn(4096, 8)
    y = x @ torch.randn(8, 1) + 0.5 * torch.randn(4096, 1)
    loader = it.AdaptiveDataLoader(TensorDataset(x, y), agent, optimizer=optimizer, shuffle=True)
    for inputs, targets in loader:
        optimizer.zero_grad()
        micro = list(zip(inputs.split(8), targets.split(8)))
        for i, (xs, ys) in enumerate(micro):
            (torch.nn.functional.mse_loss(model(xs), ys) / len(micro)).backward()
            if i == 0:
                gns.after_first_micro_batch(len(xs), len(micro))
        gns.after_accumulation(len(inputs))
        optimizer.step()
    agent.report_now()
    phi = wait_for(
        "a report with the gradient noise scale",
        lambda: (cluster.get("/iadeep/v1/tasks/gns-1/report") or {}).get("gradNoiseScale"),
    )
    assert math.isfinite(phi) and phi > 0
    agent.finish()


def test_the_lightning_callback_times_steps_and_scales_the_optimizer(cluster: Cluster):
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not importable: its callback test did not run")
    agent = make_agent(cluster, "lightning-1", 4, 2, 16, rule="linear")
    assign(cluster, "lightning-1", 8, 2.0, 1)
    change = wait_for("the assignment to reach the agent", agent.poll_change)
    assert (change.batch_size, agent.lr_factor) == (8, 2.0)
    sizes = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            sizes.append(len(x))
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return it.AdaptiveDataLoader(TensorDataset(torch.randn(64, 1)), agent)

    module = Module()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[it.IadeepCallback(agent)],
    )
    trainer.fit(module)
    assert sizes and set(sizes) == {8}, "the agent's batch size from the first batch on"
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2)
    assert agent.finished, "fit's end finishes the agent"
    report = cluster.get("/iadeep/v1/tasks/lightning-1/report")
    assert report["finished"] and int(report["stepsDone"]) == len(sizes)  # protobuf JSON: camelCase


def test_the_starting_assignment_at_the_submitted_size_is_no_change(cluster: Cluster):
    # The placer writes every newcomer's starting assignment, usually at m0.
    assign(cluster, "same-1", 4, 1.0, 1)
    agent = make_agent(cluster, "same-1", 4, 2, 16)
    loader, _ = numbered_loader(agent, 400)
    changes = []
    loader.on_change = changes.append
    sizes = []
    assigned = False
    deadline = time.monotonic() + 60  # epochs until the change arrives; see above
    while time.monotonic() < deadline:
        for (batch,) in loader:
            sizes.append(len(batch))
            if not assigned and len(sizes) == 3:
                assign(cluster, "same-1", 8, 2.0, 2)
                assigned = True
            time.sleep(0.005)
        if 8 in sizes:
            break
    assert [c.batch_size for c in changes] == [8], f"one change, 4 -> 8: {changes}"
    agent.finish()


class FakeCuda:
    """torch.cuda of a 16 GiB GPU in use by this process, recording the allocator cap."""

    TOTAL = 16384 * 2**20

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fractions: List[Tuple[float, object]] = []
        self.emptied = 0
        self.initialized = True
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def properties(self, device):
        assert device == 0
        return SimpleNamespace(name="Fake GPU", total_memory=self.TOTAL)

    def set_fraction(self, fraction, device=None) -> None:
        assert isinstance(fraction, float) and 0 < fraction <= 1, fraction
        self.fractions.append((fraction, device))

    def empty_cache(self) -> None:
        self.emptied += 1


def test_the_memory_fence_caps_the_allocator_at_the_reservation_and_moves_with_assignments(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
):
    cuda = FakeCuda(monkeypatch)
    # The placer's starting assignment carries the reservation as its bound: 4 GiB of 16.
    # The fence is the bound plus the memory margin's 5 %: 4096 * 1.05 = 4300 MiB.
    assign(cluster, "fence-1", 4, 1.0, 1, bound_mib=4096.0)
    agent = make_agent(cluster, "fence-1", 4, 2, 16)
    assert (agent.memory_limit_mib, agent.memory_fence_mib) == (4096, 4300)
    loader, _ = numbered_loader(agent, 2000)
    phase, step, when_grown = "start", 0, None
    for _ in range(20):  # epochs, until both assignments have been applied
        for _batch in loader:
            step += 1
            if step == 1:
                assert cuda.fractions == [(4300 / 16384, 0)], "capped at the reservation before the first step"
            if phase == "start" and step == 3:
                assign(cluster, "fence-1", 8, 2.0, 2, bound_mib=6144.0)  # grow: 6 GiB
                phase = "grow"
            elif phase == "grow" and loader.batch_size == 8:
                when_grown = list(cuda.fractions)
                assign(cluster, "fence-1", 2, 0.5, 3, bound_mib=2048.0)  # shrink: 2 GiB
                phase = "shrink"
            elif phase == "shrink" and loader.batch_size == 2:
                phase = "done"
                break
            time.sleep(0.002)  # a step; the assignment arrives meanwhile
        if phase == "done":
            break
    assert phase == "done", f"the assignments did not both arrive (at {phase})"
    # 6144 * 1.05 = 6451 MiB, then 2048 * 1.05 = 2150 MiB.
    assert when_grown == [(4300 / 16384, 0), (6451 / 16384, 0)], "the cap grew with the bound"
    assert cuda.fractions == [(4300 / 16384, 0), (6451 / 16384, 0), (2150 / 16384, 0)]
    assert cuda.emptied == 1, "a shrinking cap hands the cached memory back"
    assert (agent.memory_limit_mib, agent.memory_fence_mib) == (2048, 2150)
    agent.finish()


def test_the_fence_starts_when_the_job_starts_using_cuda(cluster: Cluster, monkeypatch: pytest.MonkeyPatch):
    cuda = FakeCuda(monkeypatch)
    cuda.initialized = False
    assign(cluster, "late-1", 4, 1.0, 1, bound_mib=8192.0)
    agent = make_agent(cluster, "late-1", 4, 2, 16)
    loader = it.AdaptiveDataLoader(TensorDataset(torch.zeros(16, 1)), agent)
    for step, _batch in enumerate(loader):
        if step == 0:
            assert cuda.fractions == []
            cuda.initialized = True  # the model moved to the GPU during the first step
        else:
            assert cuda.fractions == [(8601 / 16384, 0)]  # 8192 MiB and the margin's 5 %
    assert step == 3
    agent.finish()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_memory_fence_can_be_turned_off(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, how: str):
    cuda = FakeCuda(monkeypatch)
    task = f"nofence-{how}"
    assign(cluster, task, 4, 1.0, 1, bound_mib=4096.0)
    agent = make_agent(cluster, task, 4, 2, 16)
    if how == "environment":
        monkeypatch.setenv("IADEEP_MEMORY_FENCE", "0")
        loader = it.AdaptiveDataLoader(TensorDataset(torch.zeros(16, 1)), agent)
    else:
        loader = it.AdaptiveDataLoader(TensorDataset(torch.zeros(16, 1)), agent, memory_fence=False)
    assert sum(len(x) for (x,) in loader) == 16
    assert loader.fence is None and cuda.fractions == []
    agent.finish()


def test_no_fence_on_the_cpu(cluster: Cluster):
    assign(cluster, "cpu-1", 4, 1.0, 1, bound_mib=4096.0)
    agent = make_agent(cluster, "cpu-1", 4, 2, 16)
    loader = it.AdaptiveDataLoader(TensorDataset(torch.zeros(16, 1)), agent)
    assert sum(len(x) for (x,) in loader) == 16
    assert loader.fence is not None and loader.fence.fraction is None, "torch.cuda is not in use here"
    agent.finish()


def test_peak_memory_is_the_allocators_on_cuda_and_the_processs_on_the_cpu(monkeypatch: pytest.MonkeyPatch):
    import resource

    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    assert it.peak_memory_mib("cpu") >= rss_mib > 0
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 3 * 2**30)
    assert it.peak_memory_mib(torch.device("cuda", 0)) == 3072


def place(cluster: Cluster, task: str, reserved_mib: int) -> None:
    """Writes the task's placement as the placer does, reserving `reserved_mib`."""
    value = {"task_id": task, "device_id": "gpu0", "reserved_mem_mib": reserved_mib}
    run_iadeep("state", "put", f"/iadeep/v1/tasks/{task}/placement", json.dumps(value), "--store", cluster.store)


def test_lightning_sees_every_sample_when_the_batch_size_shrinks_mid_epoch(cluster: Cluster):
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not importable: its callback test did not run")
    # Placed before it starts, so that a rewritten reservation later is news to the agent
    # (its memory limit moves) and no change for the loop.
    place(cluster, "lightning-shrink", 1000)
    agent = make_agent(cluster, "lightning-shrink", 512, 64, 512)
    seen: List[int] = []
    sizes: List[int] = []
    epochs_seen: List[List[int]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            seen.extend(int(v) for v in x.squeeze(1))
            sizes.append(len(x))
            if len(sizes) == 10:
                assign(cluster, "lightning-shrink", 128, 0.5, 1)
                # The agent has the assignment once it has the placement written after it
                # (one watch, in order): the loader applies it at its next batch, however
                # slow the watch, where a fixed wait per batch let it land late.
                place(cluster, "lightning-shrink", 1001)
                wait_for("the assignment to reach the agent", lambda: agent.memory_limit_mib == 1001)
            return self.layer(x).pow(2).mean()

        def on_train_epoch_end(self) -> None:
            epochs_seen.append(sorted(seen))
            seen.clear()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return it.AdaptiveDataLoader(TensorDataset(torch.arange(16384).float().unsqueeze(1)), agent)

    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[it.IadeepCallback(agent)],
    )
    trainer.fit(Module())
    switch = sizes.index(128)
    assert 10 <= switch < 32, f"the shrink landed inside the first epoch: {sizes}"
    assert epochs_seen[0] == list(range(16384)), f"epoch 0 saw {len(epochs_seen[0])} of 16384 samples"
    assert epochs_seen[1] == list(range(16384)), f"epoch 1 saw {len(epochs_seen[1])} of 16384 samples"
    assert set(sizes[switch:]) == {128}
    report = cluster.get("/iadeep/v1/tasks/lightning-shrink/report")
    assert report["finished"] and int(report["stepsDone"]) == len(sizes)  # protobuf JSON: camelCase
