"""Helpers of the tensor-parallel model tests: a greedy paged-KV scenario, and running a
function in N spawned gloo ranks (results and exceptions come back to the test).

Module-level functions only: ranks are ``spawn`` processes, which import them by name.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.tp_group import (
    TPGroup,
    destroy_local_group,
    init_local_group,
    open_local_store,
)

PACKED_ENV = "PDSERVE_CPU_PACKED_LINEAR"
RANK_TIMEOUT_S = 60.0  # gloo collectives; a rank whose peer died raises after this


def greedy_paged(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    decode_steps: int,
    page_size: int = 3,
    kv_order: str = "page_major",
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill ``prompts`` in one step, then ``decode_steps`` batched greedy decode steps,
    over a pool of ``model.shapes.n_kv_heads`` (rank-local) heads with scattered pages.

    Returns (the greedy tokens per sequence, ``1 + decode_steps`` entries each; the fp32
    logits ``[B, V]`` of each step's last row per sequence).
    """
    s = model.shapes
    B = len(prompts)
    totals = [len(p) + decode_steps for p in prompts]
    num_pages = sum(math.ceil(n / page_size) for n in totals) + 4
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(7)).tolist()
    tables, used = [], 0
    for n in totals:
        need = math.ceil(n / page_size)
        tables.append(perm[used : used + need])
        used += need
    lay = KVCacheLayout(
        kv_order, s.n_layers, s.n_kv_heads, s.head_dim, page_size, num_pages, model.dtype
    )
    caches = lay.layer_views(lay.allocate("cpu"))
    tokens: list[list[int]] = [[] for _ in prompts]
    step_logits: list[torch.Tensor] = []
    done = [0] * B
    qlens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    for _ in range(1 + decode_steps):
        seq_lens = [d + q for d, q in zip(done, qlens)]
        md = build_attention_metadata(qlens, seq_lens, tables, page_size)
        pos = torch.cat([torch.arange(done[b], seq_lens[b]) for b in range(B)])
        hidden = model(ids, pos, md, caches)
        last = torch.tensor([sum(qlens[: b + 1]) - 1 for b in range(B)])
        logits = model.compute_logits(hidden.index_select(0, last))  # [B, V]
        step_logits.append(logits)
        nxt = logits.argmax(-1).tolist()
        for b in range(B):
            tokens[b].append(nxt[b])
        done, qlens, ids = seq_lens, [1] * B, torch.tensor(nxt)
    return tokens, step_logits


def _rank_entry(
    rank: int,
    size: int,
    address: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    torch.set_num_threads(1)  # 2 cores shared by every rank and every other test
    try:
        group = init_local_group(rank, size, address, timeout_s=RANK_TIMEOUT_S)
        try:
            out = fn(group, *args)
        finally:
            destroy_local_group(group)
        # Plain pickle bytes: torch's queue reductions would pass tensors as shared-memory
        # handles that die with this process.
        results.put((rank, "ok", pickle.dumps(out)))
    except Exception:  # noqa: BLE001 (any failure goes back to the test as a traceback)
        results.put((rank, "error", traceback.format_exc()))
    # Flush the result, then leave without interpreter teardown: gloo's C++ threads can
    # still be joinable when static destructors run, which aborts the process
    # ("terminate called without an active exception", exit -6) after a correct run.
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Run ``fn(group: TPGroup, *args)`` in ``size`` spawned gloo ranks; returns each rank's
    result in rank order. Raises ``AssertionError`` with the rank's traceback when a rank
    raised, died or sent nothing within ``timeout_s``; every process is joined (killed
    past the deadline) before returning or raising."""
    ctx = mp.get_context("spawn")
    store, address = open_local_store(RANK_TIMEOUT_S)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_entry, args=(r, size, address, fn, args, results), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(got) + len(errors) < size:
            try:
                rank, status, out = results.get(timeout=timeout_s)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                errors.append(f"no result within {timeout_s}s (ranks exited non-zero: {dead})")
                break
            if status == "ok":
                got[rank] = pickle.loads(out)
            else:
                errors.append(f"rank {rank} raised:\n{out}")
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store
    assert not errors, "\n".join(errors)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * size, f"rank exit codes {codes}"
    return [got[r] for r in range(size)]


# ------------------------------------------------------------------ functions run in ranks
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 77], [11]]  # mixed lengths, a 1-token prompt
DECODE_STEPS = 4


def rank_greedy(
    group: TPGroup, folder: str, sliced: bool, packed: str | None = None
) -> tuple[list[list[int]], list[torch.Tensor], dict[str, Any]]:
    """Load the model in ``folder`` as this rank (reading only its slices when ``sliced``;
    ``PDSERVE_CPU_PACKED_LINEAR=packed`` while loading when given), run
    :func:`greedy_paged`; returns (tokens, logits, the rank's shape facts)."""
    from pdserve.model.loader import load_model_source

    src = load_model_source(folder)
    model = LlamaForCausalLM(src.hf_config, torch.float32, "cpu", tp=group)
    before = os.environ.get(PACKED_ENV)
    if packed is not None:
        os.environ[PACKED_ENV] = packed
    try:
        model.load_weights(src.weights(shard=model.weight_shard if sliced else None))
    finally:
        if before is None:
            os.environ.pop(PACKED_ENV, None)
        else:
            os.environ[PACKED_ENV] = before
    s = model.shapes
    facts = {
        "n_heads": s.n_heads,
        "n_kv_heads": s.n_kv_heads,
        "kv_head_range": s.kv_head_range,
        "total_kv_heads": s.total_kv_heads,
        "embed_rows": model.embed_tokens.shape[0],
        "packed": sorted(next(model.decoder_layers()).packed),
    }
    tokens, logits = greedy_paged(model, PROMPTS, DECODE_STEPS)
    facts["empty_logits"] = tuple(model.compute_logits(torch.empty(0, s.hidden)).shape)
    return tokens, logits, facts


def rank_collectives(group: TPGroup) -> tuple[list[float], list[list[float]], list[list[float]]]:
    """``all_reduce_`` and ``all_gather`` along both dims of small rank-stamped tensors."""
    r = float(group.rank)
    summed = group.all_reduce_(torch.full((3,), r + 1.0)).tolist()
    cols = group.all_gather(torch.full((2, 1), r), dim=-1).tolist()
    rows = group.all_gather(torch.full((1, 2), r), dim=0).tolist()
    return summed, cols, rows


def rank_raise(group: TPGroup) -> int:
    """Rank 1 raises after a barrier (rank 0 then finishes): the harness must report it."""
    # The barrier first: a rank can return from init_local_group while its peer's gloo
    # mesh set-up is still finishing; exiting then broke the peer's init (seen under load).
    group.barrier()
    if group.rank == 1:
        raise ValueError("boom from rank 1")
    return group.rank


def rank_many(group: TPGroup, jobs: list[tuple[str, bool, str | None]]) -> list[Any]:
    """Every ``(folder, sliced, packed)`` job through :func:`rank_greedy` in turn (one spawn
    for several models), then :func:`rank_collectives` as the last entry."""
    return [rank_greedy(group, *job) for job in jobs] + [rank_collectives(group)]


__all__ = [
    "PROMPTS",
    "TPGroup",
    "greedy_paged",
    "rank_collectives",
    "rank_greedy",
    "rank_many",
    "run_ranks",
]
