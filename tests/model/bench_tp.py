"""Decode-step timing of the tensor-parallel model on CPU: TP sizes side by side (not a test).

``.venv/bin/python tests/model/bench_tp.py --model smollm2-135m-instruct --tp 1 3``
(SmolLM2-135M has 9 query heads: TP 1 or 3; ``random:qwen2.5-0.5b`` takes TP 2).
Every TP size runs in its own spawned gloo ranks, one torch thread each. Each of ``--batch``
prompts has ``--prompt`` tokens; we time ``--steps`` greedy decode steps (forward +
full-vocab logits + argmax, median) and the part of a step spent inside the collectives
(all_reduce of every row-parallel layer and the embedding, all_gather of the logits), which
includes waiting for the slowest rank. Model level only: no scheduler, no plan broadcast.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from tp_model_ranks import run_ranks

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.tp_group import TPGroup


class TimedGroup(TPGroup):
    """A TPGroup adding the seconds spent in its collectives to ``self.seconds``."""

    def __init__(self, inner: TPGroup) -> None:
        super().__init__(inner.tp, inner.group, inner.backend)
        self.seconds = 0.0
        self.calls = 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = super().all_reduce_(t)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t0 = time.perf_counter()
        out = super().all_gather(t, dim)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def rank_bench(
    group: TPGroup, model_id: str, dtype_name: str, batches: list[int], prompt: int, steps: int
) -> list[dict[str, Any]]:
    """This rank's decode timings for each batch size."""
    from pdserve.model.loader import load_model_source

    dtype = getattr(torch, dtype_name)
    timed = TimedGroup(group)
    src = load_model_source(model_id)
    m = LlamaForCausalLM(src.hf_config, dtype, "cpu", tp=timed if group.size > 1 else None)
    m.load_weights(src.weights(shard=m.weight_shard))
    s, page_size = m.shapes, 16
    out = []
    for batch in batches:
        pages = (prompt + steps + page_size) // page_size + 1
        lay = KVCacheLayout(
            "page_major", s.n_layers, s.n_kv_heads, s.head_dim, page_size, batch * pages, dtype
        )
        kv = lay.layer_views(lay.allocate("cpu"))
        tables = [list(range(b * pages, (b + 1) * pages)) for b in range(batch)]
        ids = torch.randint(
            100, 10000, (batch * prompt,), generator=torch.Generator().manual_seed(0)
        )
        md = build_attention_metadata([prompt] * batch, [prompt] * batch, tables, page_size)
        h = m(ids, torch.arange(prompt).repeat(batch), md, kv)
        tok = m.compute_logits(h.view(batch, prompt, -1)[:, -1]).argmax(-1)
        times, coll, calls = [], [], timed.calls
        for i in range(steps):
            group.barrier()  # every rank starts the step together
            c0, t0 = timed.seconds, time.perf_counter()
            n = prompt + i + 1
            md = build_attention_metadata([1] * batch, [n] * batch, tables, page_size)
            tok = m.compute_logits(m(tok, torch.full((batch,), n - 1), md, kv)).argmax(-1)
            tok.tolist()
            times.append(time.perf_counter() - t0)
            coll.append(timed.seconds - c0)
        order = sorted(range(steps), key=times.__getitem__)
        mid = order[steps // 2]
        calls = (timed.calls - calls) // steps
        out.append(
            {"batch": batch, "step_s": times[mid], "collective_s": coll[mid], "calls": calls}
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    print(
        f"{args.model} {args.dtype} on CPU, 1 thread per rank, prompt {args.prompt}, "
        f"{args.steps} decode steps (median)",
        flush=True,
    )
    for tp in args.tp:
        per_rank = run_ranks(
            tp,
            rank_bench,
            args.model,
            args.dtype,
            args.batch,
            args.prompt,
            args.steps,
            timeout_s=1800,
        )
        for i, batch in enumerate(args.batch):
            r0 = per_rank[0][i]
            step, coll = r0["step_s"], r0["collective_s"]
            print(
                f"TP {tp} batch {batch:3d}: {step * 1e3:7.2f} ms/step ({batch / step:7.1f} tok/s), "
                f"collectives {coll * 1e3:6.2f} ms ({100 * coll / step:4.1f}%, "
                f"{r0['calls']} calls), "
                f"compute {(step - coll) * 1e3:7.2f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
