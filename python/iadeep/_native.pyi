# Type stubs of the Rust extension module (python/src/*.rs).
from types import TracebackType
from typing import Final, List, Literal, Optional, Type

__version__: Final[str]
LR_RULES: Final[List[str]]
PRIORITY_CLASSES: Final[List[str]]

def requeued() -> int:
    """How many times `iadeep run` started this job again after an eviction
    (IADEEP_REQUEUED; 0 on the first run): above 0, resume from the checkpoint."""

def evicted_reason() -> Optional[str]:
    """Why the previous run was evicted (IADEEP_EVICTED_REASON), or None."""

class AgentError(Exception):
    """The agent could not start or finish (bad configuration, a malformed store URL,
    a finish the store did not confirm). An unreachable store while training is never
    an error."""

class Evicted(Exception):
    """The placer evicted the job (a production job on its GPU stayed above its
    slowdown cap, and the measurements blame this job most). Raised by
    `Agent.poll_change()` once the agent has ended (a final report, not finished; the
    lease revoked). Work since the last checkpoint is lost; a job without one starts
    over when `iadeep run --requeue-on-evict` restarts it."""

    @property
    def reason(self) -> str:
        """Why: which production job, its measured slowdown and its cap."""

class BatchSizeChange:
    """A batch-size change to apply before the next step."""

    @property
    def batch_size(self) -> int: ...
    @property
    def lr_factor(self) -> float:
        """Multiply the learning rate at the submitted batch size by this."""
    @property
    def round(self) -> int: ...
    @property
    def reason(
        self,
    ) -> Literal["assignment", "out_of_memory", "reservation_lost", "reservation_restored", "evicted"]: ...
    @property
    def memory_bound_mib(self) -> Optional[float]:
        """The assignment's bound on the task's GPU memory at `batch_size`, MiB (None
        when the change brings none): the agent's memory limit from this change on."""

class Agent:
    """The agent of one training task (see the package documentation)."""

    def __init__(
        self,
        task_id: str,
        store: str,
        model: str,
        initial_batch_size: int,
        min_batch_size: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        lr_rule: Literal["none", "linear", "sqrt", "adascale"] = "sqrt",
        *,
        gpu_mem_request_mib: Optional[int] = None,
        total_samples: Optional[int] = None,
        report_interval_s: float = 2.0,
        lease_ttl_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        use_nvml: bool = True,
        priority_class: Optional[Literal["production", "opportunistic"]] = None,
        max_slowdown: Optional[float] = None,
    ) -> None: ...
    @classmethod
    def from_env(
        cls,
        model: Optional[str] = None,
        initial_batch_size: Optional[int] = None,
        min_batch_size: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        lr_rule: Optional[Literal["none", "linear", "sqrt", "adascale"]] = None,
        *,
        gpu_mem_request_mib: Optional[int] = None,
        total_samples: Optional[int] = None,
        report_interval_s: float = 2.0,
        lease_ttl_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        use_nvml: bool = True,
        priority_class: Optional[Literal["production", "opportunistic"]] = None,
        max_slowdown: Optional[float] = None,
    ) -> "Agent":
        """The agent of the task `iadeep run` launched (IADEEP_TASK_ID, IADEEP_STORE).

        What `iadeep run` was given (--model, --batch-size, --min/--max-batch-size,
        --lr-rule) takes precedence over the arguments, which are the defaults for what
        it was not given. `model` replaces the script's file name, under which `iadeep
        run` without --model submitted the task. The learning-rate rule is "sqrt" when
        neither names one. `priority_class` and `max_slowdown` (production only, a PD
        cap such as 1.1) likewise yield to --class and --max-slowdown."""
    @property
    def batch_size(self) -> int:
        """The batch size to train the next step at."""
    def record_step(self, batch_size: int, seconds: float) -> None:
        """Records one finished step: its batch size and wall time in seconds."""
    def poll_change(self, *, raise_evicted: bool = True) -> Optional[BatchSizeChange]:
        """A batch-size change to apply before the next step, or None.

        Raises Evicted once the placer evicted the task (after ending the agent); with
        raise_evicted=False it returns the change with reason "evicted" instead (once),
        so the loop can checkpoint first, then call poll_change() to raise."""
    @property
    def evicted(self) -> Optional[str]:
        """Why the placer evicted the task, or None. Never raises."""
    def record_gradient_norms(
        self, small_batch: int, small_sq_norm: float, big_batch: int, big_sq_norm: float
    ) -> None:
        """Squared gradient norms over two batch sizes of one step (small < big)."""
    def record_peak_memory(self, mib: int) -> None:
        """Peak GPU memory (MiB) the job measured itself; NVML's figure wins when NVML
        sees this process. Either is reported once a step at the current batch size was
        recorded."""
    def report_oom(self, batch_size: Optional[int] = None) -> BatchSizeChange:
        """Out of GPU memory at batch_size (default: the current one): the fall-back."""
    def report_now(self) -> None: ...
    @property
    def memory_limit_mib(self) -> Optional[int]:
        """The GPU memory this task may use now, MiB: the latest of its placement's
        reservation (as first seen, and whenever the placer rewrites it) and the memory
        bound of each applied change that carries one; None when neither is known."""
    @property
    def memory_fence_mib(self) -> Optional[int]:
        """What the job caps its own allocator at, MiB: memory_limit_mib plus the memory
        margin's fraction of it (a peak varies a few percent from run to run; the card
        keeps that fraction free for every task at once). iadeep.torch's fence uses it."""
    @property
    def lr_factor(self) -> float: ...
    @property
    def round(self) -> int: ...
    @property
    def task_id(self) -> str: ...
    @property
    def registered(self) -> bool: ...
    @property
    def reports_published(self) -> int: ...
    @property
    def finished(self) -> bool: ...
    def finish(self) -> None:
        """Marks the task finished and frees its GPU at once."""
    def leave(self) -> None:
        """Ends the agent without claiming the task finished (final report, lease
        revoked)."""
    def __enter__(self) -> "Agent": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...
