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
"""

from ._native import LR_RULES, Agent, AgentError, BatchSizeChange, __version__

__all__ = ["Agent", "AgentError", "BatchSizeChange", "LR_RULES", "__version__"]
