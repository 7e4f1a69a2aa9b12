"""PyTorch on top of the iadeep agent: what a training loop needs in a few lines.

- :class:`AdaptiveDataLoader` iterates a dataset at the agent's batch size and,
  between two steps, applies the tuner's changes: it rebuilds its batch sampler at the
  new size on the same dataset and at the same position in the epoch, rescales the
  optimizer's learning rates, and records each step's time with the agent.
- :meth:`AdaptiveDataLoader.catch_oom` turns ``torch.cuda.OutOfMemoryError`` into a
  report to the agent and a retry of the same samples at its fall-back batch size.
- :class:`MemoryFence` (on by default in the loader) caps this process's PyTorch CUDA
  caching allocator at the memory the placer and the tuner hold for the job, so a job
  that outgrows it fails its own allocation (and falls back) instead of taking its
  co-runners' memory.
- :class:`LRScaler` keeps an optimizer's learning rates at their base times the
  agent's factor (and composes with learning-rate schedulers).
- :class:`GradientNoiseScale` feeds the agent the gradient noise scale's inputs from
  gradient accumulation (a micro-batch's and the accumulated gradient's norms).
- :class:`IadeepCallback` does the same for PyTorch Lightning (``lightning`` or
  ``pytorch_lightning`` must be installed).
- Eviction: when the placer evicts the job (a production job on its GPU stayed above
  its slowdown cap), the loader calls its ``on_evict(reason)`` hook (write the
  checkpoint there) and then raises :class:`iadeep.Evicted` from the loop's next batch;
  :class:`IadeepCallback` saves a Lightning checkpoint to ``checkpoint_path`` and stops
  ``fit`` with :class:`iadeep.Evicted`. ``iadeep run`` places the job again and
  restarts it (``iadeep.requeued() > 0``), so it resumes from the checkpoint; a job
  without one starts over.

A loop::

    agent = iadeep.Agent.from_env(model="resnet18", initial_batch_size=128)
    loader = iadeep.torch.AdaptiveDataLoader(dataset, agent, shuffle=True,
                                             optimizer=optimizer, num_workers=2)
    for epoch in range(epochs):
        for inputs, targets in loader:
            with loader.catch_oom():
                optimizer.zero_grad()
                loss_fn(model(inputs), targets).backward()
                optimizer.step()
            agent.record_peak_memory(iadeep.torch.peak_memory_mib(device))
    agent.finish()

torch is needed only here: ``import iadeep`` never imports it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import Agent, BatchSizeChange, Evicted, requeued

__all__ = [
    "AdaptiveDataLoader",
    "GradientNoiseScale",
    "IadeepCallback",
    "LRScaler",
    "MemoryFence",
    "is_out_of_memory",
    "peak_memory_mib",
]

_log = logging.getLogger("iadeep.torch")

#: Set to ``0`` to turn the memory fence off without touching the code.
FENCE_ENV = "IADEEP_MEMORY_FENCE"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is PyTorch running out of GPU memory."""
    return isinstance(error, torch.cuda.OutOfMemoryError)


def peak_memory_mib(device: Union[str, "torch.device"]) -> int:
    """The job's peak memory on ``device`` in MiB, for :meth:`iadeep.Agent.record_peak_memory`.

    On a CUDA device: the most PyTorch's caching allocator has reserved
    (``torch.cuda.max_memory_reserved``; call ``torch.cuda.reset_peak_memory_stats``
    when the batch size changes, so the figure is the new size's). Elsewhere (training
    on the CPU, where ``max_memory_reserved`` is 0): the process's peak resident memory,
    which stands in for it; the tuner needs some memory figure before it grows a batch.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device)) // 2**20
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak) // (2**20 if sys.platform == "darwin" else 2**10)


class LRScaler:
    """Keeps the learning rates of ``optimizer``'s param groups at base × factor.

    The optimizer's learning rates are taken to be right for the submitted batch size
    (factor 1). :meth:`apply` rescales them by the ratio of the new factor to the one
    applied last, so a learning-rate scheduler that multiplies the rates meanwhile keeps
    its effect.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.factor = 1.0

    def apply(self, factor: float) -> None:
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"learning-rate factor {factor} is not a positive number")
        ratio = factor / self.factor
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * ratio
        self.factor = factor


class MemoryFence:
    """Caps this process's PyTorch CUDA caching allocator at the agent's memory fence
    (:attr:`iadeep.Agent.memory_fence_mib`: the memory the job is counted at, i.e. the
    placement's reservation, then the memory bound of each applied assignment or a
    reservation the placer rewrote, plus the memory margin's fraction of it, which the
    card keeps free for every task's run-to-run variation), with
    ``torch.cuda.set_per_process_memory_fraction(fence / device memory)``.

    A job that outgrows the memory iadeep holds for it then gets
    ``torch.cuda.OutOfMemoryError`` in its own process, which
    :meth:`AdaptiveDataLoader.catch_oom` turns into a fall-back, instead of taking memory
    its co-runners were promised. When the limit shrinks, the allocator's cached blocks
    are released (``torch.cuda.empty_cache()``) so the co-runners get the memory.

    What it cannot catch: memory outside PyTorch's caching allocator: the CUDA context
    (a few hundred MiB per process), cuDNN/cuBLAS workspaces and handles, NCCL buffers,
    and other libraries' CUDA allocations (CuPy, TensorRT, custom kernels calling
    ``cudaMalloc``). The cap is on the allocator only, so these come on top of it.

    It does nothing until the job uses CUDA (``torch.cuda.is_initialized()``), nor while
    the agent knows no limit (no placer). ``device``: the CUDA device to fence (default:
    the current one, which is the job's GPU under ``iadeep run``).
    """

    def __init__(self, agent: Agent, device: Union[None, int, "torch.device"] = None) -> None:
        self.agent = agent
        self.device = device
        #: The fence the cap was set from, MiB, and the fraction set (None: not yet).
        self.fence_mib: Optional[int] = None
        self.fraction: Optional[float] = None
        self._cuda: Optional[bool] = None  # torch.cuda.is_available(), asked once

    def update(self) -> Optional[float]:
        """Moves the cap to the agent's current limit; returns the fraction in force."""
        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        if not self._cuda:
            return None
        limit = self.agent.memory_fence_mib
        if limit is None or limit == self.fence_mib or not torch.cuda.is_initialized():
            return self.fraction  # no limit, no news, or the job does not use CUDA (yet)
        device = self.device if self.device is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = float(min(1.0, limit * 2**20 / total))
        shrinking = self.fraction is not None and fraction < self.fraction
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        if shrinking:
            torch.cuda.empty_cache()
        _log.info(
            "task %s: PyTorch's allocator capped at %d MiB (%.3f of device %s)",
            self.agent.task_id, limit, fraction, device,
        )
        self.fence_mib, self.fraction = limit, fraction
        return fraction


def _fence_enabled(requested: bool) -> bool:
    return requested and os.environ.get(FENCE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


#: Agents whose loaders Lightning drives (see IadeepCallback.setup): id -> fits.
_UNDER_LIGHTNING: Dict[int, int] = {}


class _BatchesFrom(Sampler[List[int]]):
    """Batches of ``order[start:]``, ``batch_size`` indices each."""

    def __init__(self, order: Sequence[int], start: int, batch_size: int, drop_last: bool) -> None:
        self.order = order
        self.start = start
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[List[int]]:
        for first in range(self.start, len(self.order), self.batch_size):
            batch = list(self.order[first : first + self.batch_size])
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch

    def __len__(self) -> int:
        left = max(0, len(self.order) - self.start)
        return left // self.batch_size if self.drop_last else -(-left // self.batch_size)


class AdaptiveDataLoader:
    """A data loader whose batch size follows the iadeep agent.

    Each ``iter()`` is one epoch over ``dataset`` (shuffled with ``seed + epoch`` when
    ``shuffle``). After every batch the loop has trained on, it records the step's
    time (fetching the batch included) and polls the agent; on a change it rebuilds
    its :class:`torch.utils.data.DataLoader` at the new batch size from the first
    sample not yet trained on, so every sample is still seen once per epoch, and
    rescales ``optimizer``'s learning rates. Batches a worker had prefetched at the old
    size are dropped and their samples served again at the new one.

    ``on_change(change)`` is called after each change that moved the batch size (an
    assignment that keeps it, such as the placer's starting assignment, is applied
    silently) and on ``reservation_lost`` / ``reservation_restored``.

    ``on_evict(reason)``: the checkpoint hook. When the placer evicts the job, the
    loader calls it after the step the loop just trained (the task still holds its
    reservation meanwhile), then ends the agent and raises :class:`iadeep.Evicted` from
    the loop's next batch. Save what resuming needs there (model, optimizer, and
    ``loader.epoch`` / ``loader.position`` if you resume mid-epoch); without a hook the
    job loses everything since its last checkpoint of its own.

    ``memory_fence`` (default on): caps PyTorch's CUDA caching allocator at the memory
    iadeep holds for the job and moves the cap with every assignment (see
    :class:`MemoryFence`; off with ``memory_fence=False`` or ``IADEEP_MEMORY_FENCE=0``).

    Other keyword arguments (``num_workers``, ``collate_fn``, ``pin_memory``, ...) go
    to each DataLoader; ``batch_size``, ``shuffle``, ``sampler`` and ``batch_sampler``
    are this loader's business.
    """

    def __init__(
        self,
        dataset: Dataset,
        agent: Agent,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        optimizer: Optional[torch.optim.Optimizer] = None,
        record_steps: bool = True,
        on_change: Optional[Callable[[BatchSizeChange], None]] = None,
        on_evict: Optional[Callable[[str], None]] = None,
        memory_fence: bool = True,
        **loader_kwargs: Any,
    ) -> None:
        taken = {"batch_size", "shuffle", "sampler", "batch_sampler"} & loader_kwargs.keys()
        if taken:
            raise TypeError(f"AdaptiveDataLoader sets {sorted(taken)} itself")
        self.dataset = dataset
        self.agent = agent
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.record_steps = record_steps
        self.on_change = on_change
        self.on_evict = on_evict
        self.loader_kwargs = loader_kwargs
        self.epoch = 0
        #: Samples of the current epoch the loop has trained on.
        self.position = 0
        #: The batch size batches are built at now.
        self.batch_size = agent.batch_size
        #: Samples in the batch handed out last.
        self.last_batch_size = 0
        #: The fence on PyTorch's allocator (None when turned off).
        self.fence: Optional[MemoryFence] = MemoryFence(agent) if _fence_enabled(memory_fence) else None
        self._scalers: List[LRScaler] = []
        self._retry = False
        # Under IadeepCallback the callback checkpoints and raises after the step: the
        # loader runs ahead of the step under Lightning, inside its data fetching.
        self._evict_in_callback = False
        # Sizes of the batches handed out and not yet taken by IadeepCallback (Lightning
        # fetches ahead, so last_batch_size may be the next batch's).
        self._handed_out: Deque[int] = deque(maxlen=16)
        if optimizer is not None:
            self.scale_optimizer(optimizer)

    def scale_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rescales ``optimizer``'s learning rates on every change from now on (and to the
        agent's current factor at once)."""
        scaler = LRScaler(optimizer)
        scaler.apply(self.agent.lr_factor)
        self._scalers.append(scaler)

    def __len__(self) -> int:
        """Batches in an epoch at the current batch size.

        Under PyTorch Lightning with :class:`IadeepCallback`, the loader has no length
        (``TypeError``), as an iterable dataset: Lightning would otherwise end every
        epoch after the number of batches it read at the start of ``fit``, skipping
        samples after the batch size shrinks.
        """
        if id(self.agent) in _UNDER_LIGHTNING:
            raise TypeError(
                "an AdaptiveDataLoader under IadeepCallback has no fixed length: its batch size follows the tuner"
            )
        return len(_BatchesFrom(range(len(self.dataset)), 0, self.batch_size, self.drop_last))

    def _order(self) -> Sequence[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return range(n)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def _apply(self, change: BatchSizeChange) -> bool:
        """Applies `change`; returns whether the batch size moved."""
        resized = change.batch_size != self.batch_size
        self.batch_size = change.batch_size
        for scaler in self._scalers:
            scaler.apply(change.lr_factor)
        if self.fence is not None:
            self.fence.update()
        if self.on_change is not None and (resized or change.reason != "assignment"):
            self.on_change(change)
        return resized

    def _evicted(self) -> None:
        """The placer evicted the job: the hook, then the agent ends and Evicted is raised."""
        if self._evict_in_callback:
            return
        reason = self.agent.evicted or ""
        if self.on_evict is not None:
            plan = "calling on_evict, then stopping"
        else:
            plan = "no on_evict hook, so nothing is saved: the job starts over if re-queued; stopping"
        _log.warning("task %s evicted (%s); %s", self.agent.task_id, reason, plan)
        if self.on_evict is not None:
            self.on_evict(reason)
        self.agent.poll_change()  # ends the agent and raises iadeep.Evicted
        raise Evicted(reason)  # not reached: poll_change raised

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        self.position = 0
        self._handed_out.clear()
        if self.fence is not None:
            self.fence.update()
        try:
            while self.position < len(order):
                sampler = _BatchesFrom(order, self.position, self.batch_size, self.drop_last)
                if len(sampler) == 0:
                    break
                batches = iter(DataLoader(self.dataset, batch_sampler=sampler, **self.loader_kwargs))
                rebuild = False
                while not rebuild:
                    started = time.perf_counter()
                    try:
                        batch = next(batches)
                    except StopIteration:
                        break
                    size = min(self.batch_size, len(order) - self.position)
                    self.last_batch_size = size
                    self._handed_out.append(size)
                    yield batch
                    # The loop trained on the batch (or caught its out-of-memory error).
                    if self._retry:
                        self._retry = False
                        rebuild = True
                        continue
                    if self.record_steps:
                        self.agent.record_step(size, time.perf_counter() - started)
                    self.position += size
                    if self.fence is not None and self.fence.fraction is None:
                        self.fence.update()  # not fenced yet: CUDA may have started with this step
                    change = self.agent.poll_change(raise_evicted=False)
                    if change is not None and change.reason == "evicted":
                        self._evicted()
                    elif change is not None:
                        # Same size (e.g. the starting assignment): keep the batches.
                        rebuild = self._apply(change)
                del batches
                if not rebuild:
                    break
        finally:
            self.epoch += 1

    @contextlib.contextmanager
    def catch_oom(self) -> Iterator[None]:
        """Wraps one training step: on ``torch.cuda.OutOfMemoryError`` it clears the
        gradients, frees PyTorch's cached memory, reports the error to the agent, and
        makes the next batch the same samples at the agent's fall-back size (with the
        learning rate to match). Re-raises when the batch cannot get smaller."""
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            failed = self.batch_size
            for scaler in self._scalers:
                scaler.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            change = self.agent.report_oom(failed)
            if change.batch_size >= failed:
                raise
            self._apply(change)
            self._retry = True


class GradientNoiseScale:
    """Feeds the agent the two gradient norms of the gradient-noise-scale estimator,
    from gradient accumulation: the gradient of the first micro-batch (b samples) and
    the accumulated gradient (B samples) of the same step.

    Call :meth:`after_first_micro_batch` right after the first micro-batch's
    ``backward()`` (gradients zeroed before it) and :meth:`after_accumulation` after the
    last one, before ``optimizer.step()``. Each micro-batch's loss is taken to be
    divided by the number of micro-batches, the usual way to accumulate a mean::

        optimizer.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            (loss_fn(model(x), y) / len(micro_batches)).backward()
            if i == 0:
                gns.after_first_micro_batch(len(x), len(micro_batches))
        gns.after_accumulation(total_samples)
        optimizer.step()
    """

    def __init__(self, agent: Agent, parameters: Iterable[torch.nn.Parameter]) -> None:
        self.agent = agent
        self.parameters = [p for p in parameters if p.requires_grad]
        self._small: Optional[tuple] = None

    def _squared_norm(self) -> float:
        grads = [p.grad.detach() for p in self.parameters if p.grad is not None]
        if not grads:
            return float("nan")
        return float(torch.stack([g.float().pow(2).sum() for g in grads]).sum().item())

    def after_first_micro_batch(self, micro_batch_size: int, micro_batches: int) -> None:
        # The loss was divided by micro_batches: undo it for the micro-batch's own mean.
        self._small = (micro_batch_size, self._squared_norm() * micro_batches**2)

    def after_accumulation(self, batch_size: int) -> None:
        small, self._small = self._small, None
        if small is None or small[0] >= batch_size:
            return
        self.agent.record_gradient_norms(small[0], small[1], batch_size, self._squared_norm())


def _lightning_callback_base() -> type:
    try:
        from lightning.pytorch import Callback  # type: ignore[import-not-found]
    except ImportError:
        try:
            from pytorch_lightning import Callback  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return object
    return Callback


def _find_adaptive(loaders: Any) -> Optional[AdaptiveDataLoader]:
    if isinstance(loaders, AdaptiveDataLoader):
        return loaders
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        for loader in loaders:
            found = _find_adaptive(loader)
            if found is not None:
                return found
    return None


class IadeepCallback(_lightning_callback_base()):  # type: ignore[misc]
    """PyTorch Lightning callback: return an :class:`AdaptiveDataLoader` from
    ``train_dataloader()`` and add ``IadeepCallback(agent)`` to the Trainer.

    It times each training step (``on_train_batch_start`` to ``on_train_batch_end``)
    for the agent, has the loader rescale the Trainer's optimizers on each batch-size
    change, and finishes the agent when ``fit`` ends (``finish_on_end``). Lightning
    fetches one batch ahead, so a change takes effect one batch later than in a plain
    loop. Out-of-memory recovery needs a plain loop (Lightning ends ``fit`` on the
    error).

    Eviction: after the step during which the agent learnt of it, the callback saves a
    checkpoint to ``checkpoint_path`` (``trainer.save_checkpoint``) if given, calls
    ``on_evict(reason)`` if given, and stops ``fit`` by raising :class:`iadeep.Evicted`
    (the agent ends first). When ``iadeep run`` restarts the job, :attr:`resume_path`
    is that checkpoint: ``trainer.fit(module, ckpt_path=callback.resume_path)``. Without
    ``checkpoint_path`` the restarted job starts over.

    During ``fit`` the agent's loaders have no length, as an iterable dataset has none:
    an epoch ends when its samples are used up, whatever the batch sizes were on the
    way, so every sample is seen once per epoch. Hence, as for any loader without a
    length: ``val_check_interval`` must be ``1.0``, an int or time-based, and a
    learning-rate schedule that needs the total number of steps needs ``max_steps``.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        finish_on_end: bool = True,
        checkpoint_path: Optional[Union[str, "os.PathLike[str]"]] = None,
        on_evict: Optional[Callable[[str], None]] = None,
    ) -> None:
        if _lightning_callback_base() is object:
            raise ImportError("IadeepCallback needs PyTorch Lightning: pip install lightning")
        super().__init__()
        self.agent = agent
        self.finish_on_end = finish_on_end
        self.checkpoint_path = None if checkpoint_path is None else os.fspath(checkpoint_path)
        self.on_evict = on_evict
        self._loader: Optional[AdaptiveDataLoader] = None
        self._started = 0.0
        self._size = 0
        self._warned = False
        self._registered = False

    @property
    def resume_path(self) -> Optional[str]:
        """The checkpoint to resume from: ``checkpoint_path`` when ``iadeep run`` restarted
        the job after an eviction (``iadeep.requeued() > 0``) and the file exists, else
        None (a fresh start)."""
        if self.checkpoint_path is None or requeued() == 0 or not os.path.exists(self.checkpoint_path):
            return None
        return self.checkpoint_path

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Before Lightning asks the train loader for its length (FitLoop.setup_data).
        if not self._registered:
            key = id(self.agent)
            _UNDER_LIGHTNING[key] = _UNDER_LIGHTNING.get(key, 0) + 1
            self._registered = True

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._registered:
            key = id(self.agent)
            left = _UNDER_LIGHTNING.pop(key, 1) - 1
            if left > 0:
                _UNDER_LIGHTNING[key] = left
            self._registered = False

    def _attach(self, trainer: Any) -> None:
        if self._loader is not None:
            return
        self._loader = _find_adaptive(trainer.train_dataloader)
        if self._loader is not None:
            # The callback times the steps: the loader would time the fetches.
            self._loader.record_steps = False
            self._loader._evict_in_callback = True
            for optimizer in trainer.optimizers:
                self._loader.scale_optimizer(optimizer)
        elif not self._warned:
            self._warned = True
            import warnings

            warnings.warn(
                "IadeepCallback: the train dataloader is not an iadeep.torch.AdaptiveDataLoader, "
                "so batch-size changes are not applied, and no step is recorded: the job reports "
                "neither step times nor a memory peak (a peak is reported once a step is), so it "
                "is never tuned and keeps the memory it was placed with",
                stacklevel=3,
            )

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._attach(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._attach(trainer)
        if self._loader is not None:
            handed_out = self._loader._handed_out
            self._size = handed_out.popleft() if handed_out else self._loader.last_batch_size
        self._started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._loader is not None:
            self.agent.record_step(self._size, time.perf_counter() - self._started)
        reason = self.agent.evicted
        if reason is not None:
            self._evicted(trainer, reason)

    def _evicted(self, trainer: Any, reason: str) -> None:
        """Checkpoint, the hook, then stop fit with Evicted (the agent ends first)."""
        steps = []
        if self.checkpoint_path is not None:
            steps.append(f"saving the checkpoint to {self.checkpoint_path}")
        if self.on_evict is not None:
            steps.append("calling on_evict")
        if steps:
            plan = " and ".join(steps) + ", then stopping fit"
        else:
            plan = "no checkpoint_path or on_evict, so nothing is saved: the job starts over if re-queued; stopping fit"
        _log.warning("task %s evicted (%s); %s", self.agent.task_id, reason, plan)
        if self.checkpoint_path is not None:
            trainer.save_checkpoint(self.checkpoint_path)
        if self.on_evict is not None:
            self.on_evict(reason)
        trainer.should_stop = True
        self.agent.poll_change()  # ends the agent and raises iadeep.Evicted
        raise Evicted(reason)  # not reached: poll_change raised

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.finish_on_end:
            self.agent.finish()
