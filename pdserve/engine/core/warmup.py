"""Start-up warm-up of a worker's engine: the eager step shapes run once before serving.

Triton compiles a kernel variant the first time a launch needs it (~0.3-1.5 s on an H200),
inside whichever request's step that is; graph capture compiles the decode graphs' only.
:func:`warm_up` runs, before the worker says it is ready, the steps that serving runs
eagerly: a prefill step (two prompts, one of them a first chunk that does not sample), a
mixed step (a decode row leading, then the second prompt's next chunk over its cached
prefix: ``TritonBackend``'s decode-and-extend path), and on every rank the attention
backend's own variants (``AttentionBackend.warm_up``: the triton backend's fixed set of
eager decode configurations). The pages come from the engine's allocator and all go back
to it; none is indexed in the prefix cache, no request is created, the engine's counters
do not move. Compilations after start-up are counted by ``pdserve.triton_watch``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from pdserve.engine.step import BatchPlan, ScheduledSeq

if TYPE_CHECKING:
    from pdserve.engine.core.engine import EngineCore
    from pdserve.engine.worker.rank_worker import RankContext

logger = logging.getLogger(__name__)


def warm_up_rank(ctx: RankContext) -> int:
    """The attention backend's warm-up on this rank (``AttentionBackend.warm_up`` over
    layer 0's cache); returns the variants it ran."""
    k_cache, v_cache = ctx.storage.layer_caches[0]
    model = ctx.model
    return int(model.backend.warm_up(k_cache, v_cache, model.shapes.n_heads, model.dtype))


def warm_up(core: EngineCore) -> dict[str, Any]:
    """Run the eager step shapes once on ``core``'s executor (module docstring). Returns
    ``{"steps", "backend_variants", "seconds"}``. Every page it takes is released before
    it returns, also when a step raises (the error is then raised). Raises ``ValueError``
    naming ``--num-pages`` when the pool is smaller than the warm-up's two requests."""
    t0 = time.perf_counter()
    kv = core.kv
    ps = kv.page_size
    # A: a prompt of two pages and a bit, then one decode token; B: one page as a first
    # chunk, then a chunk of a page and a bit over that cached prefix.
    n_a = min(2 * ps + 3, core.max_model_len - 1)
    n_b0, n_b1 = min(ps, n_a), min(ps + 5, core.max_model_len - min(ps, n_a))
    needed = kv.pages_needed(n_a + 1) + kv.pages_needed(n_b0 + n_b1)
    if needed > kv.num_available_pages:
        raise ValueError(
            f"--num-pages / --kv-cache-memory: the KV pool holds {kv.num_pages} pages of {ps} "
            f"tokens, {kv.num_available_pages} available; the start-up warm-up needs {needed} "
            f"(give --num-pages {needed} or more, or a larger --kv-cache-memory)"
        )
    pages_a = kv.allocate(kv.pages_needed(n_a + 1))
    pages_b: list[int] = []
    try:
        pages_b = kv.allocate(kv.pages_needed(n_b0 + n_b1))
        tok = [i % max(1, core.vocab_size) for i in range(1, 1 + max(n_a, n_b1))]
        prefill = BatchPlan(
            seqs=(
                ScheduledSeq.greedy("warmup-a", tok[:n_a], 0, pages_a),
                ScheduledSeq.greedy("warmup-b", tok[:n_b0], 0, pages_b, sample=False),
            )
        )
        mixed = BatchPlan(
            seqs=(
                ScheduledSeq.greedy("warmup-a", tok[:1], n_a, pages_a),
                ScheduledSeq.greedy("warmup-b", tok[:n_b1], n_b0, pages_b),
            )
        )
        steps = 0
        for plan in (prefill, mixed):
            core.executor.execute(plan)
            steps += 1
        variants = sum(
            core.executor.call_rank(r, warm_up_rank) for r in range(core.executor.tp_size)
        )
    finally:
        kv.release(pages_a + pages_b)
    out = {"steps": steps, "backend_variants": variants, "seconds": time.perf_counter() - t0}
    logger.info(
        "warm-up: %d eager steps and %d attention variants in %.1f s",
        steps,
        variants,
        out["seconds"],
    )
    return out
