"""Makes the engine's :class:`~pdserve.engine.worker.executor.Executor`: :func:`create_executor`.

A module of its own because it names both kinds: ``LocalExecutor`` (``executor.py``) and,
for N > 1 only, ``MultiprocExecutor`` (``multiproc_executor.py``, which subclasses
``Executor``), so neither of those two modules imports the other's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.config import EngineConfig
from pdserve.engine.worker.executor import Executor, LocalExecutor, check_tp_split
from pdserve.engine.worker.rank_worker import build_rank

if TYPE_CHECKING:
    from pdserve.model.loader import ModelSource


def create_executor(
    config: EngineConfig,
    source: ModelSource,
    dtype: torch.dtype,
    attention_backend: str,
    generator: torch.Generator,
) -> Executor:
    """The executor of ``config.model.tensor_parallel_size`` ranks, rank 0 built here
    (``generator``: its draws of unseeded random rows).  ValueError naming the field for a
    model that does not split, or a bad device, context limit or pool size."""
    from pdserve.engine.worker.device import resolve_rank_device
    from pdserve.model.tp_group import TPGroup

    n = config.model.tensor_parallel_size
    if n == 1:
        device = resolve_rank_device(config.model, 0)
        ctx = build_rank(
            config,
            source,
            TPGroup.single(),
            device,
            dtype,
            attention_backend,
            lambda p: p,
            generator,
        )
        return LocalExecutor(ctx)
    check_tp_split(source.hf_config, n)
    from pdserve.engine.worker.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, source, dtype, attention_backend, generator)
