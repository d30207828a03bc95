"""Session 14: RoPE (+ q/k norm) and the KV store inside the split-KV decode kernel
(``triton_backend.DECODE_ROPE``) against the RoPE + KV store kernel before it, in one engine
per model, the decode graphs captured both ways.

Engines in turn, as many as ``BUDGET_S`` allows: ``fp8``: ``random:llama-3.1-8b``,
``--quantization fp8``, ``--kv-cache-dtype fp8_e4m3`` (graph buckets 1 and 32 only), shapes
1 x 200 and 32 x 4,096; ``moe``: ``random:qwen3-30b-a3b`` bf16 (bucket 1), 1 x 200 (run
with ``PDSERVE_MOE_ROUTING_STATS=1``, as the MoE scripts run it). Each engine starts with
the flag as the tree has it and captures its graphs; every graph of its buckets is then
captured again, into a pool of its own, with the flag flipped (``sets``: ``off`` / ``on``).
Per shape: the all-decoding step of ``ROWSxCONTEXT`` random prompts, spans of ``SPAN``
steps under each set interleaved for ``ROUNDS`` rounds (order swapped every other round,
the step after each switch untimed): medians, the paired ratios on / off and their median,
rounds in which on was faster; then 8 greedy tokens of the same prompts under each set,
compared token for token (the same bits expected for Llama: the same arithmetic; Qwen3's
q/k norm sums may be reduced in another order). ``$OUT/ropeattn.json`` after each item.

CPU dry run (``DEVICE=cpu``, ``TRITON_INTERPRET=1``: tiny models, fp32, no graphs: each
set is the flag itself, read by every eager forward; the model is forced onto the CUDA
path's fused ops and the triton backend so that the flag acts): the script's own check, the
times mean nothing.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

T0 = time.time()
BUDGET_S = float(os.environ.get("BUDGET_S", "160"))
OUT_DIR = os.environ.get("OUT", "gpu_s14_ropeattn")
DEVICE = os.environ.get("DEVICE", "cuda")
ROUNDS = int(os.environ.get("ROUNDS", "5"))
SPAN = int(os.environ.get("SPAN", "8"))
GREEDY = int(os.environ.get("GREEDY", "8"))
CPU = DEVICE == "cpu"
# name -> (model, LLM fields, [(rows, context)], seconds the engine needs at least)
ENGINES: dict[str, tuple[str, dict[str, Any], list[tuple[int, int]], float]] = {
    "fp8": (
        os.environ.get("MODEL_FP8", "random:llama-3.1-8b"),
        dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", kv_cache_memory=24),
        [(1, 200), (32, 4096)],
        60,
    ),
    "moe": (
        os.environ.get("MODEL_MOE", "random:qwen3-30b-a3b"),
        dict(kv_cache_memory=16),
        [(1, 200)],
        45,
    ),
}
if CPU:  # tiny shapes
    ENGINES = {
        "fp8": (ENGINES["fp8"][0], dict(kv_cache_dtype="fp8_e4m3"), [(1, 20), (3, 40)], 0),
        "moe": (ENGINES["moe"][0], {}, [(1, 20)], 0),
    }


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def run_engine(name: str, res: dict[str, Any], save) -> None:
    from pdserve.bench.offline import _random_prompts
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.worker import cuda_graph
    from pdserve.model import llama
    from pdserve.model import triton_backend as tb

    model, fields, shapes, _ = ENGINES[name]
    out: dict[str, Any] = res["engines"].setdefault(name, {"model": model, "shapes": {}})
    buckets = sorted({r for r, _ in shapes})
    cuda_graph.graph_batch_sizes = lambda max_batch: [b for b in buckets if b <= max_batch]  # type: ignore[assignment]
    base = tb.DECODE_ROPE
    out["flag_at_start"] = base
    if CPU:
        llama.use_fused_ops = lambda ids: True  # type: ignore[assignment]
        fields = dict(fields, attention_backend="triton")
    t = time.time()
    llm = LLM(model, device=DEVICE, dtype="float32" if CPU else "bfloat16",
              max_running_requests=max(buckets), **fields)  # fmt: skip
    out["engine_start_s"] = round(time.time() - t, 1)
    core = llm.engine
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    out["kv_dtype"] = str(core.executor.rank0.storage.kv.dtype)
    log(f"{name}: engine up in {out['engine_start_s']} s (KV {out['kv_dtype']})")
    g = core.executor.rank0.runner.graphs
    sets: dict[str, Any] = {}
    try:
        if g is not None:
            keys = list(g.keys())
            out["keys"] = keys
            sets["off" if not base else "on"] = {
                k: (g._graphs[k], g._logits[k], g._greedy[k]) for k in keys
            }
            t = time.time()
            pool = g._pool
            try:  # the other side of the flag, into a pool of its own
                tb.DECODE_ROPE = not base
                with torch.inference_mode():
                    g._rows.zero_()  # padded rows only: nothing written to the KV pool
                    g._rows[2].fill_(-1)
                    g._table.zero_()
                    g._pool = None
                    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                    made = {}
                    for k in keys:
                        g._run(k)  # compiles the variant outside the capture
                        sync()
                        made[k] = (g._capture(k, stream), g._logits[k], g._greedy[k])
                        sync()
                sets["on" if not base else "off"] = made
            finally:
                tb.DECODE_ROPE = base
                g._pool = pool
            out["capture_other_s"] = round(time.time() - t, 1)
            log(f"{name}: the other side captured in {out['capture_other_s']} s")
        else:
            sets = {"off": None, "on": None}  # eager: the flag itself, read every forward

        def install(tag: str) -> None:
            if g is None:
                tb.DECODE_ROPE = tag == "on"
                return
            for k, (gr, lo, gd) in sets[tag].items():
                g._graphs[k], g._logits[k], g._greedy[k] = gr, lo, gd

        save()
        for rows, ctx in shapes:
            if left() < (25 if rows > 1 else 12):
                out["shapes"][f"{rows}x{ctx}"] = {"skipped": f"{left():.0f} s left"}
                continue
            r = out["shapes"].setdefault(f"{rows}x{ctx}", {})
            prompts = _random_prompts(core.vocab_size, rows, ctx, seed=5)
            total = ROUNDS * 2 * (SPAN + 1) + 8
            sp = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
            rids = [f"ab{rows}-{i}" for i in range(rows)]
            for rid, p in zip(rids, prompts):
                core.add_request(rid, list(p), sp)
            reqs = [core._requests[rid] for rid in rids]
            while any(len(q.output_token_ids) == 0 for q in reqs):
                core.step()
            for tag in ("off", "on"):  # each set once before timing
                install(tag)
                core.step()
            spans: dict[str, list[float]] = {"off": [], "on": []}
            for i in range(ROUNDS):
                for tag in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    if left() < 4 or any(q.finished for q in reqs):
                        break
                    install(tag)
                    core.step()  # the first step after a switch: not timed
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(SPAN):
                        core.step()
                    sync()
                    spans[tag].append((time.perf_counter() - t0) / SPAN * 1e3)
            install("off")
            for rid in rids:
                core.abort_request(rid)
            while core.has_unfinished_requests():
                core.step()
            n = min(len(spans["off"]), len(spans["on"]))
            ratios = [b / a for a, b in zip(spans["off"][:n], spans["on"][:n])]
            r.update(
                spans_ms=spans,
                off_step_ms=statistics.median(spans["off"]) if spans["off"] else None,
                on_step_ms=statistics.median(spans["on"]) if spans["on"] else None,
                on_over_off_paired_median=statistics.median(ratios) if ratios else None,
                on_faster_rounds=[sum(x < 1 for x in ratios), n],
            )
            log(f"{name} {rows}x{ctx}: off {r['off_step_ms']} ms, on {r['on_step_ms']} ms, "
                f"paired on/off {r['on_over_off_paired_median']}, {r['on_faster_rounds']}")  # fmt: skip
            save()
            if left() < (15 if rows > 1 else 6):
                r["greedy"] = f"skipped: {left():.0f} s left"
                continue
            ids = {}
            params = SamplingParams(temperature=0, max_tokens=GREEDY, ignore_eos=True)
            for tag in ("off", "on"):
                install(tag)
                outs = llm.generate(prompts, params)
                ids[tag] = [list(o.outputs[0].token_ids) for o in outs]
            install("off")
            a, b = ids["off"], ids["on"]
            first = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra))
                     for ra, rb in zip(a, b)]  # fmt: skip
            r["greedy_same_rows"] = [sum(ra == rb for ra, rb in zip(a, b)), len(a)]
            r["greedy_first_diff_median"] = statistics.median(first)
            log(f"{name} {rows}x{ctx}: greedy rows identical {r['greedy_same_rows']}")
            save()
    finally:
        tb.DECODE_ROPE = base
        if g is not None and sets.get("off"):
            install("off" if not base else "on")
        llm.shutdown()


def main() -> None:
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, "ropeattn.json")
    res: dict[str, Any] = {"budget_s": BUDGET_S, "engines": {}, "errors": {}, "skipped": {}}
    if torch.cuda.is_available():
        res["device"] = torch.cuda.get_device_name(0)

    def save() -> None:
        res["elapsed_s"] = round(time.time() - T0, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    for name, (_, _, _, need) in ENGINES.items():
        if left() < need:
            res["skipped"][name] = f"{left():.0f} s left, needs ~{need:.0f}"
            log(f"{name}: skipped ({left():.0f} s left)")
            continue
        try:
            run_engine(name, res, save)
        except Exception as exc:  # noqa: BLE001 (what was measured is kept)
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"
        gc.collect()  # the engine's memory back before the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save()
    save()


if __name__ == "__main__":
    sys.exit(main())
