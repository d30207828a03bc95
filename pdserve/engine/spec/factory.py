"""The drafter a scheduler config asks for (``SchedulerConfig.speculative_algorithm``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pdserve.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    default_max_running_requests,
)
from pdserve.engine.spec.drafter import Drafter, NgramDrafter

if TYPE_CHECKING:
    import torch

    from pdserve.model.loader import ModelSource


def make_drafter(
    config: EngineConfig,
    target: ModelSource,
    dtype: torch.dtype,
    attention_backend: str,
    max_model_len: int,
    num_pages: int,
    page_size: int,
) -> Drafter | None:
    """The drafter of ``config.scheduler``, or ``None`` when speculation is off.

    ``draft``: the draft model ``speculative_model`` is loaded on the target's device with
    its dtype and attention backend, a KV pool of ``num_pages`` pages of ``page_size``
    tokens and the context limit ``max_model_len``.  ValueError naming
    ``speculative_model`` when its tokenizer or vocabulary differs from ``target``'s, or
    under tensor parallelism (the draft model runs on rank 0's device, TP = 1 only)."""
    sc: SchedulerConfig = config.scheduler
    algo = sc.speculative_algorithm
    if algo is None:
        return None
    if algo == "ngram":
        return NgramDrafter(
            sc.num_speculative_tokens, sc.speculative_ngram_min, sc.speculative_ngram_max
        )
    import torch

    from pdserve.engine.spec.draft_model import DraftModelDrafter
    from pdserve.engine.worker.executor_factory import create_executor
    from pdserve.model.loader import load_model_source

    assert sc.speculative_model is not None  # SchedulerConfig checks it
    if config.model.tensor_parallel_size != 1:
        raise ValueError("speculative_model: a draft model runs with tensor_parallel_size 1 only")
    draft = load_model_source(sc.speculative_model, seed=config.model.seed + 1)
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"speculative_model {sc.speculative_model!r}: its tokenizer differs from the "
            f"target model's ({config.model.model!r}); a draft model must share it"
        )
    if draft.hf_config.vocab_size != target.hf_config.vocab_size:
        raise ValueError(
            f"speculative_model {sc.speculative_model!r}: vocabulary of "
            f"{draft.hf_config.vocab_size} ids, the target's has {target.hf_config.vocab_size}"
        )
    draft_cfg = EngineConfig(
        model=replace(config.model, model=sc.speculative_model, max_model_len=max_model_len),
        cache=CacheConfig(page_size=page_size, num_pages=num_pages, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_running_requests=sc.max_running_requests
            or default_max_running_requests(dtype_device(config).type)
        ),
    )
    gen = torch.Generator(device=dtype_device(config))
    executor = create_executor(draft_cfg, draft, dtype, attention_backend, gen)
    return DraftModelDrafter(executor, sc.num_speculative_tokens)


def dtype_device(config: EngineConfig) -> torch.device:
    """Rank 0's device of ``config`` (where the draft model runs)."""
    from pdserve.engine.worker.device import resolve_rank_device

    return resolve_rank_device(config.model, 0)
