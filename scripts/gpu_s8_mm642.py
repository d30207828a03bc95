"""Issue 24, session 8, second round of part mm64 (the first's JSON did not come back): which
of the skinny GEMM's 64-row entries make the bf16 ``random:llama-3.1-8b`` decode step faster,
and do its greedy tokens diverge by rounding or by a fault.

One engine (as ``scripts/gpu_s8_mm64.py engine``: 256 running requests, graphs to 256 rows,
24 GiB of KV, a 4,096-token step budget). The tables are the configurations the first
round's micro sweep picked (``pdserve/model/triton_skinny.py``; first round: swiglu 61.9 us
vs F.linear + silu_mul 65.4 at 64 rows, qkv / o / down forced (slower alone)). Variants,
each with its own graphs (captured once, swapped after), in this order while
``--deadline-s`` allows:

1. ``base`` (table empty): the 64x200 step (``gpu_step_profile.profile_shapes``, median of
   three spans) and the 64-prompt bench-offline run (GSM8K chat prompts, 128 greedy tokens,
   tok/s, the output ids kept);
2. ``all`` (qkv, o, swiglu, down), ``swiglu`` alone, then ``base`` again (A/B/A), then
   ``swiglu_o_down``, ``swiglu_o``: the
   64x200 step and the 64-prompt run; per variant the greedy outputs against base: identical
   sequences, identical first decode tokens, the position of each sequence's first
   difference (rounding spreads them along the 128 tokens; a wrong kernel makes them all
   early);
3. the 128x200 step base vs ``swiglu`` (its 128-row entry).

Writes ``$OUT/mm642.json`` after each part and prints a compact JSON summary at the end (so
the figures come back in the output even if the file does not). ``--device cpu --model
random:tiny --toy`` checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.perf_counter()
QKV = ("linear", "bfloat16", 6144, 4096)
O = ("linear", "bfloat16", 4096, 4096)
SWIGLU = ("swiglu", "bfloat16", 28672, 4096)
DOWN = ("linear", "bfloat16", 4096, 14336)
ENTRIES = {  # the first round's picks (its output: the micro sweep's best per shape)
    QKV: ((48, None), (64, (64, 64, 128, 2, 4, 3, 4))),
    O: ((48, None), (64, (64, 64, 128, 2, 4, 4, 4))),
    SWIGLU: ((48, None), (64, (64, 128, 64, 1, 8, 4, 4)), (128, (128, 64, 64, 1, 8, 3, 4))),
    DOWN: ((48, None), (64, (64, 64, 128, 2, 4, 4, 4))),
}
VARIANTS = {
    "all": (QKV, O, SWIGLU, DOWN),
    "swiglu": (SWIGLU,),
    "swiglu_o_down": (O, SWIGLU, DOWN),
    "swiglu_o": (O, SWIGLU),
}


def toy_entries(model) -> dict:
    """The same four kinds for a tiny fp32 model (the CPU check)."""
    s = model.shapes
    cfg = ((8, None), (16, (16, 16, 32, 1, 4, 2, 0)))
    return {
        QKV: ("linear", "float32", (s.n_heads + 2 * s.n_kv_heads) * s.head_dim, s.hidden),
        O: ("linear", "float32", s.hidden, s.n_heads * s.head_dim),
        SWIGLU: ("swiglu", "float32", 2 * s.intermediate, s.hidden),
        DOWN: ("linear", "float32", s.hidden, s.intermediate),
    }, cfg


def elapsed() -> float:
    return time.perf_counter() - T0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--toy", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=85.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default="mm642.json")
    args = ap.parse_args()

    from gpu_step_profile import profile_shapes

    from pdserve.bench.offline import _time_ours, workload_prompts
    from pdserve.engine.llm import LLM
    from pdserve.model import skinny_table

    toy = args.toy
    n = 4 if toy else 64
    shape64, shape128 = ("4x20", "8x20") if toy else ("64x200", "128x200")
    steps = 4 if toy else 16
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {"parts_done": [], "skipped": {}, "errors": {}, "variants": {}}

    def save() -> None:
        res["elapsed_s"] = elapsed()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    skinny_table.TABLE = {}
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_running_requests=8 if toy else 256, kv_cache_memory=2 if toy else 24,
              max_num_batched_tokens=64 if toy else 4096)  # fmt: skip
    res["engine_start_s"] = time.perf_counter() - t0
    res["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"engine up in {res['engine_start_s']:.0f} s (at {elapsed():.0f} s)", flush=True)
    entries = ENTRIES
    if toy:
        model = llm.engine.executor.rank0.runner.model
        keys, cfg = toy_entries(model)
        entries = {keys[k]: cfg for k in ENTRIES}
        variants = {v: tuple(keys[k] for k in ks) for v, ks in VARIANTS.items()}
    else:
        variants = dict(VARIANTS)
    save()
    g = llm.engine.executor.rank0.runner.graphs
    sets: dict[str, tuple] = {}
    state = {"cur": "base"}

    def swap(name: str) -> float:
        if g is None:
            return 0.0
        sets[state["cur"]] = (g._graphs, g._logits, g._greedy, g._pool)
        state["cur"] = name
        if name in sets:
            g._graphs, g._logits, g._greedy, g._pool = sets[name]
            return 0.0
        g._graphs, g._logits, g._greedy, g._pool = {}, {}, {}, None
        torch.cuda.synchronize()
        g._rows.zero_()
        g._rows[2].fill_(-1)
        g._table.zero_()
        t = time.perf_counter()
        g.capture()
        return time.perf_counter() - t

    prompts = workload_prompts(llm, n, None, None)
    base_ids: list[list[int]] = []

    def step(shape: str) -> dict:
        r = profile_shapes(llm, [shape], steps, 10)[shape]
        return {k: r[k] for k in ("step_ms", "step_ms_spans", "kernel_ms", "kernels_per_step")} | {
            "top_kernels_ms": dict(list(r["top_kernels_ms"].items())[:10])
        }

    def run64(v: dict) -> list[list[int]]:
        _time_ours(llm, prompts, 1)
        secs, ids = _time_ours(llm, prompts, args.max_tokens)
        v["tok_s"] = n * args.max_tokens / secs
        return ids

    def compare(v: dict, ids: list[list[int]]) -> None:
        firsts = []
        for a, b in zip(ids, base_ids):
            d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            firsts.append(d)
        v["same_outputs"] = sum(d is None for d in firsts)
        v["same_token1"] = sum(
            len(a) > 1 and len(b) > 1 and a[1] == b[1] for a, b in zip(ids, base_ids)
        )
        v["first_diff_positions"] = firsts
        diffs = [d for d in firsts if d is not None]
        v["first_diff_median"] = statistics.median(diffs) if diffs else None

    def variant(name: str, keys: tuple, need: float, shape: str = "") -> None:
        if args.deadline_s - elapsed() < need:
            res["skipped"][name] = f"{args.deadline_s - elapsed():.0f} s left"
            print(f"== {name}: skipped", flush=True)
            return
        print(f"== {name} (at {elapsed():.0f} s)", flush=True)
        try:
            skinny_table.TABLE = {k: entries[k] for k in keys}
            v: dict[str, Any] = {"table": {str(k): entries[k] for k in keys}}
            v["capture_s"] = swap("base" if not keys else name)
            v[shape or shape64] = step(shape or shape64)
            if not shape:
                ids = run64(v)
                if not keys and not base_ids:
                    base_ids[:] = ids
                else:
                    compare(v, ids)
            res["variants"][name if name not in res["variants"] else name + "_again"] = v
            res["parts_done"].append(name)
            s = v[shape or shape64]["step_ms"]
            print(f"   {name}: {shape or shape64} step {s:.3f} ms, tok/s {v.get('tok_s', 0):.0f}, "
                  f"same {v.get('same_outputs')}, token1 {v.get('same_token1')}, "
                  f"first diff median {v.get('first_diff_median')}", flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 (a failed part must not lose the others)
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        save()

    try:
        variant("base", (), 6)
        variant("all", variants["all"], 10)
        variant("swiglu", variants["swiglu"], 7)
        variant("base", (), 5)
        variant("swiglu_o_down", variants["swiglu_o_down"], 6)
        variant("swiglu_o", variants["swiglu_o"], 6)
        variant("base_128", (), 4, shape128)
        variant("swiglu_128", variants["swiglu"], 4, shape128)
    finally:
        save()
        summary = {
            name: {
                "step": {s: round(x["step_ms"], 4) for s, x in v.items() if isinstance(x, dict) and "step_ms" in x},
                "spans": {s: [round(t, 3) for t in x["step_ms_spans"]] for s, x in v.items()
                          if isinstance(x, dict) and "step_ms_spans" in x},
                "tok_s": round(v.get("tok_s", 0)),
                "same": v.get("same_outputs"),
                "token1": v.get("same_token1"),
                "diff_pos": v.get("first_diff_positions"),
                "capture_s": round(v.get("capture_s", 0), 1),
            }
            for name, v in res["variants"].items()
        }  # fmt: skip
        print("SUMMARY_JSON " + json.dumps({"summary": summary, "skipped": res["skipped"],
                                            "errors": res["errors"]}, separators=(",", ":")), flush=True)  # fmt: skip
        llm.shutdown()
    print(f"== done at {elapsed():.0f} s", flush=True)


if __name__ == "__main__":
    main()
