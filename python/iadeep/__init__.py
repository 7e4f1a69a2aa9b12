"""iadeep's agent for Python training loops.

The agent tells the loop which batch size to train at (the GPU's tuner may change it
between steps, with a learning-rate factor), hears how long each step took, and
reports to iadeep's state store from a background thread; an unreachable store never
stops the loop. It wraps the Rust agent (``iadeep-agent``)::

    import time
    import iadeep

    with iadeep.Agent.from_env(model="resnet50", initial_batch_size=256) as agent:
        for step in range(10_000):
            bs = agent.batch_size
            start = time.perf_counter()
            ...  # one training step at batch size bs
            agent.record_step(bs, time.perf_counter() - start)
            change = agent.poll_change()
            if change is not None:
                ...  # rebuild the data loader; lr = lr0 * change.lr_factor

``iadeep.torch`` does the loader, learning rate and out-of-memory handling for
PyTorch in a few lines. Start the job with ``iadeep run -- python train.py`` on a
cluster started by ``iadeep up``.

Eviction: an opportunistic job that the placer evicts (a production job on its GPU
stayed above its slowdown cap) sees ``agent.evicted`` set; ``agent.poll_change()`` then
raises :class:`Evicted` after ending the agent. Write a checkpoint before it::

    if agent.evicted:
        save_checkpoint(path)
    change = agent.poll_change()   # raises iadeep.Evicted

``iadeep run`` (``--requeue-on-evict``, the default for opportunistic jobs) places the
job again and restarts it with ``iadeep.requeued() > 0``, so it resumes from ``path``.
What the job did since its last checkpoint is lost; a job without one starts over.
"""

from ._native import (
    LR_RULES,
    PRIORITY_CLASSES,
    Agent,
    AgentError,
    BatchSizeChange,
    Evicted,
    __version__,
    evicted_reason,
    requeued,
)

Evicted.reason = property(  # type: ignore[attr-defined]
    lambda self: str(self.args[0]) if self.args else "",
    doc="Why the placer evicted the job: which production job, its measured slowdown and its cap.",
)

__all__ = [
    "Agent",
    "AgentError",
    "BatchSizeChange",
    "Evicted",
    "LR_RULES",
    "PRIORITY_CLASSES",
    "__version__",
    "evicted_reason",
    "requeued",
]
