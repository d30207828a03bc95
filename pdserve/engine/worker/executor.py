"""How the scheduler runs a step: over one in-process rank (TP=1) or N tensor-parallel ranks.

``EngineCore`` owns the scheduler and hands each :class:`~pdserve.engine.step.BatchPlan`
to an :class:`Executor` made by ``create_executor`` (``engine/worker/executor_factory.py``, apart
so that this module and ``multiproc_executor`` do not import each other):

- :class:`LocalExecutor` (TP=1, here): the rank lives in this process; ``execute`` is the
  model runner's ``execute``, nothing else (same behaviour, same speed as before the split).
- ``MultiprocExecutor`` (TP=N, ``engine/worker/multiproc_executor.py``, imported only for N > 1):
  rank 0 in this process, ranks ``1..N-1`` spawned processes, the plan sent to them each
  step; a rank that dies or hangs fails the executor for good with
  :class:`RankFailedError` naming it.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.disagg.base import KVArgs, KVLayout
from pdserve.engine.step import BatchPlan, InFlightTokens, StepResult
from pdserve.engine.worker.rank_worker import RankContext
from pdserve.parallel import TPRank

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or failed mid-step; the message names the rank.  The
    executor cannot run steps any more (the group's collectives are out of step)."""


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in another rank's process (the
    ``__cause__`` of the exception :meth:`Executor.call_rank` re-raises)."""


@dataclass(frozen=True)
class RankGeometry:
    """What the engine thread knows of its ranks, the same on every rank: the ids it hands
    out must fit every rank's storage.

    page_size: tokens per page. num_pages: pages of every rank's storage (agreed at
    start-up). num_aux_slots: aux slots of every rank's storage. layout: the KV layout
    peers compare at bootstrap (rank 0's storage). vocab_size: the model's vocabulary.
    max_model_len: the context limit before the pages cap it. total_kv_heads: the model's
    KV heads over all ranks.
    """

    page_size: int
    num_pages: int
    num_aux_slots: int
    layout: KVLayout
    vocab_size: int
    max_model_len: int
    total_kv_heads: int


class Executor(ABC):
    """Runs the engine's steps over its ranks (see the module docstring).

    rank0: rank 0's context (its model, KV storage and runner live in this process).
    """

    rank0: RankContext

    @property
    def tp_size(self) -> int:
        return self.rank0.tp.size

    @property
    def geometry(self) -> RankGeometry:
        """The ranks' shared facts (:class:`RankGeometry`), read from rank 0."""
        r = self.rank0
        s, shapes = r.storage, r.model.shapes
        return RankGeometry(
            page_size=s.page_size,
            num_pages=s.num_pages,
            num_aux_slots=s.num_aux_slots,
            layout=s.layout,
            vocab_size=shapes.vocab,
            max_model_len=r.max_model_len,
            total_kv_heads=shapes.total_kv_heads,
        )

    def kv_args(self, gpu_id: int = 0) -> KVArgs:
        """Rank 0's KV addresses for a transfer manager in this process
        (``KVStorage.kv_args``; ranks > 0 give theirs through :meth:`call_rank`)."""
        return self.rank0.storage.kv_args(gpu_id=gpu_id)

    @abstractmethod
    def execute(self, plan: BatchPlan) -> StepResult:
        """Run one step on every rank; rank 0's sampled tokens and prompt logprobs.
        Raises RankFailedError when a rank is gone."""

    # Overlap scheduling (engine/core/overlap.py): only an in-process rank launches steps without
    # waiting for them; a TP step is a collective over every rank, run in sync.
    supports_overlap = False

    def can_launch(self, plan: BatchPlan, rows_checked: bool = False) -> bool:
        """Whether :meth:`launch_greedy` can run ``plan`` (``ModelRunner.can_launch``)."""
        return False

    def launch_greedy(self, plan: BatchPlan, prev: InFlightTokens | None) -> InFlightTokens:
        """Launch a plain-greedy decode step without waiting (``ModelRunner.launch_greedy``);
        NotImplementedError unless ``supports_overlap``."""
        raise NotImplementedError("this executor runs every step synchronously")

    @abstractmethod
    def call_rank(self, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(ctx, *args)`` in rank ``rank``'s process with its :class:`RankContext`
        between steps, in call order, and return its result (picklable for ranks > 0).

        ``fn`` must be a module-level function (it is pickled by reference); its exception
        is re-raised here, caused by a :class:`RemoteTraceback` holding the rank's
        traceback.  Raises ValueError naming ``rank`` when out of range, RankFailedError
        when that rank is gone or does not answer within ``ModelConfig.tp_timeout`` (the
        executor is then failed for good, as for a hung collective)."""

    @property
    def failure(self) -> str | None:
        """Why the executor cannot run steps any more (names the rank), or None."""
        return None

    def rank_pids(self) -> list[int]:
        """Process id of each rank, rank 0 first (this process)."""
        return [os.getpid()]

    def shutdown(self) -> None:  # noqa: B027 nothing to stop for an in-process rank
        """Stop and join the rank processes (idempotent)."""


class LocalExecutor(Executor):
    """TP=1: the one rank is in this process; ``execute`` is ``rank0.runner.execute``."""

    def __init__(self, rank0: RankContext) -> None:
        self.rank0 = rank0

    supports_overlap = True

    def execute(self, plan: BatchPlan) -> StepResult:
        return self.rank0.runner.execute(plan)

    def can_launch(self, plan: BatchPlan, rows_checked: bool = False) -> bool:
        return self.rank0.runner.can_launch(plan, rows_checked)

    def launch_greedy(self, plan: BatchPlan, prev: InFlightTokens | None) -> InFlightTokens:
        return self.rank0.runner.launch_greedy(plan, prev)

    def call_rank(self, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
        if rank != 0:
            raise ValueError(f"rank must be 0 with tensor_parallel_size 1, got {rank}")
        return fn(self.rank0, *args)


def check_tp_split(hf_config: PretrainedConfig, tp_size: int) -> None:
    """ValueError naming the field unless the model splits over ``tp_size`` ranks (query
    heads and MLP rows evenly, KV heads evenly or replicated: ``model/shapes.py``, checked
    for every rank before any rank process starts)."""
    from pdserve.model.shapes import ModelShapes

    for rank in range(tp_size):
        ModelShapes(hf_config, TPRank(rank, tp_size))
