"""iadeep.torch with a real agent on a real cluster (assignments written into its etcd).

Skipped, saying so, where torch is not importable; scripts/test-python.sh prints
whether these tests ran.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the iadeep.torch tests did not run")

import iadeep  # noqa: E402
import iadeep.torch as it  # noqa: E402
from conftest import Cluster, iadeep as run_iadeep, wait_for  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402


def make_agent(cluster: Cluster, task: str, m0: int, low: int, high: int, rule: str = "sqrt") -> iadeep.Agent:
    return iadeep.Agent(task, cluster.store, "torch-test", m0, low, high, rule, report_interval_s=0.2, use_nvml=False)


def assign(cluster: Cluster, task: str, batch_size: int, lr_factor: float, round_: int) -> None:
    """Writes an assignment as a tuner does."""
    value = {"task_id": task, "batch_size": batch_size, "lr_factor": lr_factor, "round": round_}
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
    for _ in range(5):  # epochs, until the change has happened inside one
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
        "the out-of-memory report", lambda: (cluster.get("/iadeep/v1/tasks/oom-1/report") or {}).get("oom_batch_size")
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
        lambda: (cluster.get("/iadeep/v1/tasks/gns-1/report") or {}).get("grad_noise_scale"),
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
    assert report["finished"] and report["steps_done"] == len(sizes)
