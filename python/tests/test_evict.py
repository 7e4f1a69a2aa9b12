"""Eviction in the Python agent, on a real `iadeep up --no-nvml` cluster: the placer's
evict assignment (written here into its etcd, as the placer writes it) reaches the loop
as `iadeep.Evicted`, after the checkpoint hooks of `iadeep.torch` and the Lightning
callback ran while the task still held its reservation; the agent ends unfinished.
Also: the priority class and slowdown cap reach the spec the agent registers.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import iadeep
from conftest import Cluster, iadeep as run_iadeep, wait_for

REASON = "prod-1 ran at PD 1.31 above its cap 1.10 for 3 rounds"


def evict(cluster: Cluster, task: str, batch_size: int, round_: int = 1) -> None:
    """Writes the placer's eviction: the last assignment repeated, with evict set."""
    value = {
        "task_id": task, "batch_size": batch_size, "lr_factor": 1.0, "round": round_,
        "evict": True, "evict_reason": REASON,
    }
    run_iadeep("state", "put", f"/iadeep/v1/tasks/{task}/assignment", json.dumps(value), "--store", cluster.store)


def agent_of(cluster: Cluster, task: str, m0: int = 4, **kwargs) -> iadeep.Agent:
    return iadeep.Agent(task, cluster.store, "evict-test", m0, 2, 16, report_interval_s=0.2, use_nvml=False, **kwargs)


def assert_left_unfinished(cluster: Cluster, agent: iadeep.Agent) -> None:
    """The agent ended: a final report that does not say finished, the lease revoked."""
    assert agent.finished
    task = agent.task_id
    report = cluster.get(f"/iadeep/v1/tasks/{task}/report")
    assert report is not None and not report.get("finished", False), report
    assert cluster.get(f"/iadeep/v1/tasks/{task}/alive") is None, "the lease is revoked"


def test_poll_change_raises_evicted_with_the_reason_once_the_agent_has_left(cluster: Cluster):
    agent = agent_of(cluster, "evict-plain")
    agent.record_step(4, 0.01)
    assert agent.poll_change() is None and agent.evicted is None
    evict(cluster, "evict-plain", 4)
    assert wait_for("the eviction to reach the agent", lambda: agent.evicted) == REASON
    # Until the loop takes it, the task keeps its lease: the checkpoint is written while
    # its reservation is still counted.
    assert agent.registered and not agent.finished
    with pytest.raises(iadeep.Evicted) as raised:
        agent.poll_change()
    assert raised.value.reason == REASON and str(raised.value) == REASON
    assert_left_unfinished(cluster, agent)
    with pytest.raises(iadeep.Evicted):
        _ = agent.batch_size  # every later call says so too
    assert agent.evicted == REASON
    agent.finish()  # nothing left to finish: no error


def test_poll_change_can_return_the_eviction_so_the_loop_checkpoints_first(cluster: Cluster):
    agent = agent_of(cluster, "evict-told")
    evict(cluster, "evict-told", 4)
    change = wait_for("the eviction", lambda: agent.poll_change(raise_evicted=False))
    assert change.reason == "evicted" and change.batch_size == 4
    assert agent.poll_change(raise_evicted=False) is None, "returned once"
    assert agent.registered
    with pytest.raises(iadeep.Evicted):
        agent.poll_change()
    assert_left_unfinished(cluster, agent)


def test_the_class_and_the_cap_reach_the_spec_and_are_checked(cluster: Cluster, monkeypatch: pytest.MonkeyPatch):
    agent = agent_of(cluster, "prod-spec", priority_class="production", max_slowdown=1.25)
    spec = cluster.get("/iadeep/v1/tasks/prod-spec/spec")
    assert (spec["priorityClass"], spec["maxSlowdown"]) == ("PRIORITY_CLASS_PRODUCTION", 1.25)
    agent.finish()
    with pytest.raises(ValueError, match="urgent"):
        agent_of(cluster, "bad-1", priority_class="urgent")
    with pytest.raises(iadeep.AgentError, match="production jobs only"):
        agent_of(cluster, "bad-2", max_slowdown=1.2)
    with pytest.raises(iadeep.AgentError, match="not a slowdown cap"):
        agent_of(cluster, "bad-3", priority_class="production", max_slowdown=0.9)
    # `iadeep run --class` and `--max-slowdown` reach the agent through the environment,
    # and win over the script's arguments.
    for name, value in [
        ("IADEEP_TASK_ID", "prod-env"), ("IADEEP_STORE", cluster.store), ("IADEEP_PRIORITY_CLASS", "production"),
        ("IADEEP_MAX_SLOWDOWN", "1.5"), ("IADEEP_REQUEUED", "2"), ("IADEEP_EVICTED_REASON", REASON),
    ]:
        monkeypatch.setenv(name, value)
    agent = iadeep.Agent.from_env(
        initial_batch_size=4, priority_class="opportunistic", report_interval_s=0.2, use_nvml=False
    )
    spec = cluster.get("/iadeep/v1/tasks/prod-env/spec")
    assert (spec["priorityClass"], spec["maxSlowdown"]) == ("PRIORITY_CLASS_PRODUCTION", 1.5)
    assert (iadeep.requeued(), iadeep.evicted_reason()) == (2, REASON)
    agent.finish()


def evict_log(caplog: pytest.LogCaptureFixture) -> list:
    """What iadeep.torch logged about the eviction."""
    return [r.getMessage() for r in caplog.records if r.name == "iadeep.torch" and "evicted" in r.getMessage()]


def test_the_loaders_checkpoint_hook_runs_before_evicted_is_raised(cluster: Cluster, caplog: pytest.LogCaptureFixture):
    torch = pytest.importorskip("torch", reason="torch is not importable: the iadeep.torch eviction test did not run")
    import iadeep.torch as it
    from torch.utils.data import TensorDataset

    agent = agent_of(cluster, "evict-loader")
    hooked = []

    def checkpoint(reason: str) -> None:
        # The task still holds its lease (and so its reservation) while it checkpoints.
        hooked.append((reason, agent.registered, agent.finished, loader.position))

    loader = it.AdaptiveDataLoader(TensorDataset(torch.arange(40000).float()), agent, on_evict=checkpoint)
    trained = 0
    with pytest.raises(iadeep.Evicted) as raised:
        for _ in range(20):  # epochs, until the eviction arrives
            for (batch,) in loader:
                trained += len(batch)
                if trained == 12:
                    evict(cluster, "evict-loader", 4)
                time.sleep(0.002)  # a step; the assignment arrives meanwhile
    assert raised.value.reason == REASON
    assert hooked == [(REASON, True, False, trained)], "once, before Evicted, after the last trained step"
    assert_left_unfinished(cluster, agent)
    assert evict_log(caplog) == [f"task evict-loader evicted ({REASON}); calling on_evict, then stopping"]


def test_the_loader_without_a_hook_says_nothing_is_saved(cluster: Cluster, caplog: pytest.LogCaptureFixture):
    # Before, it said "checkpointing and stopping" with nothing to checkpoint.
    torch = pytest.importorskip("torch", reason="torch is not importable: the iadeep.torch eviction test did not run")
    import iadeep.torch as it
    from torch.utils.data import TensorDataset

    caplog.set_level(logging.WARNING, logger="iadeep.torch")
    agent = agent_of(cluster, "evict-no-hook")
    loader = it.AdaptiveDataLoader(TensorDataset(torch.arange(40000).float()), agent)
    evict(cluster, "evict-no-hook", 4)
    wait_for("the eviction to reach the agent", lambda: agent.evicted)
    with pytest.raises(iadeep.Evicted):
        for _ in loader:
            pass
    assert evict_log(caplog) == [
        f"task evict-no-hook evicted ({REASON}); no on_evict hook, so nothing is saved: "
        "the job starts over if re-queued; stopping"
    ]
    assert_left_unfinished(cluster, agent)


def test_the_lightning_callback_without_a_checkpoint_says_nothing_is_saved(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
):
    pytest.importorskip("lightning.pytorch", reason="lightning is not importable: its eviction test did not run")
    import iadeep.torch as it

    caplog.set_level(logging.WARNING, logger="iadeep.torch")
    agent = agent_of(cluster, "evict-lightning-bare")
    evict(cluster, "evict-lightning-bare", 4)
    reason = wait_for("the eviction to reach the agent", lambda: agent.evicted)
    trainer = SimpleNamespace(should_stop=False)  # no save_checkpoint: it must not be called
    with pytest.raises(iadeep.Evicted):
        it.IadeepCallback(agent)._evicted(trainer, reason)
    assert trainer.should_stop
    assert evict_log(caplog) == [
        f"task evict-lightning-bare evicted ({REASON}); no checkpoint_path or on_evict, so nothing is saved: "
        "the job starts over if re-queued; stopping fit"
    ]
    assert_left_unfinished(cluster, agent)


def test_the_lightning_callback_saves_a_checkpoint_and_stops_fit_with_evicted(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    torch = pytest.importorskip("torch", reason="torch is not importable: the Lightning eviction test did not run")
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not importable: its eviction test did not run")
    import iadeep.torch as it
    from torch.utils.data import TensorDataset

    agent = agent_of(cluster, "evict-lightning")
    checkpoint = tmp_path / "evicted.ckpt"
    hooked = []
    steps = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            (x,) = batch
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return it.AdaptiveDataLoader(TensorDataset(torch.randn(4000, 1)), agent)

    class EvictAfterThirdStep(pl.Callback):
        """The eviction arrives just after IadeepCallback looked at the third step: the
        loader sees it first (Lightning fetches the next batch before the next step)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if len(steps) == 3:
                evict(cluster, "evict-lightning", 4)
                wait_for("the eviction to reach the agent", lambda: agent.evicted)

    callback = it.IadeepCallback(
        agent, checkpoint_path=checkpoint, on_evict=lambda reason: hooked.append((reason, checkpoint.exists()))
    )
    trainer = pl.Trainer(
        max_epochs=5, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, EvictAfterThirdStep()],
    )
    with pytest.raises(iadeep.Evicted) as raised:
        trainer.fit(Module())
    assert raised.value.reason == REASON
    # The loader left it to the callback, which acted after the next step.
    assert len(steps) == 4, f"fit stopped after the step following the eviction: {steps}"
    assert hooked == [(REASON, True)], "the checkpoint is written before the hook and before Evicted"
    assert evict_log(caplog) == [
        f"task evict-lightning evicted ({REASON}); saving the checkpoint to {checkpoint} and calling on_evict, "
        "then stopping fit"
    ]
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["global_step"] == 4 and "state_dict" in saved
    assert_left_unfinished(cluster, agent)
    # A restarted job resumes from it (iadeep run sets IADEEP_REQUEUED); a fresh one does not.
    assert callback.resume_path is None
    monkeypatch.setenv("IADEEP_REQUEUED", "1")
    assert callback.resume_path == str(checkpoint)
