"""Issue 26, session 14: the FP8 decode step's small-kernel levers, each A/B'd in one engine.

One engine (``random:llama-3.1-8b``, ``--quantization fp8``, ``--kv-cache-dtype fp8_e4m3``, 64
running requests, CUDA graphs of the 32- and 64-row buckets only). For each case
(``--cases``, ``ROWSxCONTEXT``: 32 x 4,096 replays the 32-row long-context graph, 64 x 200 the
64-row short one) the case's graph is captured again once per variant (:data:`VARIANTS`: module
flags set while it is captured, then restored), each into the engine's graph pool:

- ``off``: ``fp8.FUSE_MERGE_QUANT`` off (the split-KV merge writes the 16-bit attention
  output, ``quantize_rows`` quantizes it for o_proj's w8a8 kernel);
- ``on`` / ``on_w4`` / ``on_w16`` / ``on_w32``: on (``decode_merge_quant_kernel``: the merge
  writes the e4m3 rows and scales itself), one program a row, at
  ``triton_backend.MERGE_QUANT_WARPS`` 8 / 4 / 16 / 32; ``g4`` / ``g8``: on, 4 / 8 heads a
  program (``MERGE_QUANT_HEADS``: the row's last program to finish quantizes it), 4 warps;
- ``sk_off`` / ``sk``: ``fp8.FUSE_SPLITK_NORM`` off / on (a split-K w8a8 linear's reduce left to
  the next add + RMSNorm + quantization kernel), the merge flag on in both;

then per case: each variant's graph replayed once with padded rows under ``torch.profiler``
(its kernels by name and their count: the merge's and ``_quant_rows_kernel``'s launches); the
case's prompts (random tokens, ``ROWS`` x ``CONTEXT``) decoding, spans of ``--span-steps``
steps under each graph interleaved for ``--rounds`` rounds (the step after a switch untimed;
medians, each variant's rounds faster than ``off`` / ``sk_off`` paired with it); the graph key
each span replayed; then ``--greedy-tokens`` greedy tokens of the same prompts under each
variant (their K/V from the prefix cache: the same for all), compared token for token with
the first variant's (identical expected: the same bits).

``--device cpu`` (under ``TRITON_INTERPRET=1``, ``--model random:tiny``, small cases): no
graphs; a variant's flags are set while its spans and greedy tokens run eagerly (on CPU the
FP8 kernels' paths do not run: the flags change nothing). It checks the script itself: the
times mean nothing.
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

from pdserve.model import fp8
from pdserve.model import triton_backend as tb

T0 = time.perf_counter()

# variant -> {(module, attribute): value} set while its graph is captured (or its eager
# steps run); a flag a tree does not have is left out with a note in the JSON
_MODULES = {"fp8": fp8, "triton_backend": tb}
_MERGE, _HEADS, _WARPS = (
    ("fp8", "FUSE_MERGE_QUANT"),
    ("triton_backend", "MERGE_QUANT_HEADS"),
    (
        "triton_backend",
        "MERGE_QUANT_WARPS",
    ),
)
VARIANTS: dict[str, dict[tuple[str, str], Any]] = {
    "off": {_MERGE: False},
    "on": {_MERGE: True, _HEADS: 0, _WARPS: 8},  # one program a row
    "on_w4": {_MERGE: True, _HEADS: 0, _WARPS: 4},
    "on_w16": {_MERGE: True, _HEADS: 0, _WARPS: 16},
    "on_w32": {_MERGE: True, _HEADS: 0, _WARPS: 32},
    "g4": {_MERGE: True, _HEADS: 4, _WARPS: 4},  # 4 heads a program, the last one quantizes
    "g8": {_MERGE: True, _HEADS: 8, _WARPS: 4},
    "sk_off": {_MERGE: True, ("fp8", "FUSE_SPLITK_NORM"): False},
    "sk": {_MERGE: True, ("fp8", "FUSE_SPLITK_NORM"): True},
}
# each variant's paired reference (its rounds faster than it, its greedy tokens against it)
PAIRED = {
    "on": "off",
    "on_w4": "off",
    "on_w16": "off",
    "on_w32": "off",
    "g4": "off",
    "g8": "off",
    "sk": "sk_off",
}


def elapsed() -> float:
    return time.perf_counter() - T0


class Flags:
    """Sets a variant's module flags, restoring the values found at start (:meth:`reset`)."""

    def __init__(self) -> None:
        self.saved: dict[tuple[str, str], Any] = {}
        for flags in VARIANTS.values():
            for mod, name in flags:
                if hasattr(_MODULES[mod], name):
                    self.saved[(mod, name)] = getattr(_MODULES[mod], name)

    def apply(self, tag: str) -> list[str]:
        """Sets ``tag``'s flags (the others at their start values); returns the flags this
        tree does not have."""
        self.reset()
        missing = []
        for (mod, name), value in VARIANTS[tag].items():
            if (mod, name) in self.saved:
                setattr(_MODULES[mod], name, value)
            else:
                missing.append(f"{mod}.{name}")
        return missing

    def reset(self) -> None:
        for (mod, name), value in self.saved.items():
            setattr(_MODULES[mod], name, value)


def profile_replay(graph: Any, sync: Any) -> dict[str, Any]:
    """One replay of ``graph`` under torch.profiler: kernels by name (launches, µs) and their
    count; empty where the profiler sees no kernels inside a graph."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        sync()
    names: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            n = names.setdefault(ev.name[:80], [0, 0.0])
            n[0] += 1
            n[1] += ev.device_time_total
    kernels = sum(int(v[0]) for v in names.values())
    merge = {k: int(v[0]) for k, v in names.items() if "merge" in k or "quant_rows" in k}
    reduce = {k: int(v[0]) for k, v in names.items() if "reduce" in k or "norm" in k}
    return {"kernels": kernels, "merge_quant": merge, "reduce_norm": reduce, "by_name": names}


def run_case(args, llm, core, flags: Flags, case: str, res: dict[str, Any]) -> None:
    from pdserve.bench.offline import _random_prompts
    from pdserve.engine.sampling_params import SamplingParams

    rows, ctx = (int(x) for x in case.split("x"))
    tags = [t for t in args.variants.split(",") if t]
    out: dict[str, Any] = {"rows": rows, "context": ctx, "variants": {}, "errors": {}}
    res["cases"][case] = out
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    g = core.executor.rank0.runner.graphs
    key = None
    if g is not None:
        bounds = g._bounds.get(rows, ())
        key = (rows, bounds[0] if bounds and ctx <= bounds[0] else None)
        out["graph_key"] = list(key)
    sets: dict[str, Any] = {}
    for tag in tags:
        info: dict[str, Any] = {"missing_flags": flags.apply(tag)}
        out["variants"][tag] = info
        if g is None or key not in g._graphs:
            continue
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                g._rows[2].fill_(-1)  # padded rows: nothing stored, nothing read
                g._rows[3].zero_()
                g._run(key)  # compiles outside the capture
                sync()
                graph, (lg, gr) = g._capture_in_pool(
                    torch.cuda.Stream(),
                    lambda: g._run(key),  # type: ignore[no-untyped-call]
                )
                sync()
            sets[tag] = (graph, lg, gr)
            info["capture_s"] = time.perf_counter() - t0
            try:
                info["profile"] = profile_replay(graph, sync)
            except Exception as exc:  # noqa: BLE001 the profile is extra
                info["profile_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        except Exception as exc:  # noqa: BLE001 the other variants still run
            out["errors"][f"capture {tag}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            flags.reset()
    if g is not None and key in g._graphs:
        sets.setdefault("engine", (g._graphs[key], g._logits[key], g._greedy[key]))
    runnable = [t for t in tags if g is None or t in sets]
    print(f"{case}: variants {runnable} captured at {elapsed():.1f} s", flush=True)

    def use(tag: str) -> None:
        flags.apply(tag)  # eager steps (no graphs) run under the flags; graphs have them
        if tag in sets and key is not None:
            g._graphs[key], g._logits[key], g._greedy[key] = sets[tag]

    def restore() -> None:
        flags.reset()
        if "engine" in sets and key is not None:
            g._graphs[key], g._logits[key], g._greedy[key] = sets["engine"]

    prompts = _random_prompts(core.vocab_size, rows, ctx, seed=args.seed)
    span_tokens = args.rounds * len(runnable) * (args.span_steps + 1) + 8
    sp = SamplingParams(temperature=0, max_tokens=span_tokens, ignore_eos=True)
    rids = [f"{case}-{i}" for i in range(rows)]
    spans: dict[str, list[float]] = {t: [] for t in runnable}
    replayed: dict[str, list[Any]] = {t: [] for t in runnable}
    try:
        for rid, p in zip(rids, prompts):
            core.add_request(rid, list(p), sp)
        reqs = [core._requests[rid] for rid in rids]
        while any(len(r.output_token_ids) == 0 for r in reqs):
            core.step()
        for _ in range(2):
            core.step()
        for _ in range(args.rounds):
            for tag in runnable:
                if elapsed() > args.deadline_s - args.greedy_need_s or any(
                    r.finished for r in reqs
                ):
                    break
                use(tag)
                core.step()  # the first step after a switch is not timed
                sync()
                t0 = time.perf_counter()
                for _ in range(args.span_steps):
                    core.step()
                sync()
                spans[tag].append((time.perf_counter() - t0) / args.span_steps * 1e3)
                if g is not None:
                    replayed[tag].append(list(g._last_key))
        out["mean_context"] = (
            sum(len(p) for p in prompts) / rows + sum(len(r.output_token_ids) for r in reqs) / rows
        )
    except Exception as exc:  # noqa: BLE001 what was measured is kept
        import traceback

        traceback.print_exc()
        out["errors"]["spans"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        restore()
        for rid in rids:
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()
    out["spans_ms"] = spans
    out["replayed_keys"] = {t: v[:1] + ([v[-1]] if len(v) > 1 else []) for t, v in replayed.items()}
    med = {t: statistics.median(v) for t, v in spans.items() if v}
    out["step_ms"] = med
    for tag, ref in PAIRED.items():
        if tag in med and ref in med:
            a, b = spans[ref], spans[tag]
            out["variants"][tag]["over_" + ref] = med[tag] / med[ref]
            out["variants"][tag]["paired_faster_rounds"] = [
                sum(y < x for x, y in zip(a, b)),
                len(b),
            ]
            out["variants"][tag]["paired_median_diff_ms"] = statistics.median(
                y - x for x, y in zip(a, b)
            )
    print(f"{case}: steps (ms, median of spans) {med} at {elapsed():.1f} s", flush=True)
    # greedy tokens under each variant, compared with its pair's (else the first variant's)
    params = SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True)
    ids: dict[str, list[list[int]]] = {}
    try:
        for tag in runnable:
            if elapsed() > args.deadline_s - 3:
                out["errors"][f"greedy {tag}"] = "skipped: deadline"
                break
            use(tag)
            outs = llm.generate(prompts, params)
            ids[tag] = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        restore()
    for tag in ids:
        ref = PAIRED.get(tag, runnable[0])
        if tag == ref or ref not in ids:
            continue
        a, b = ids[ref], ids[tag]
        first = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra))
                 for ra, rb in zip(a, b)]  # fmt: skip
        out["variants"][tag]["greedy_vs_" + ref] = {
            "same_rows": [sum(ra == rb for ra, rb in zip(a, b)), len(a)],
            "same_tokens": [
                sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)),
                sum(len(r) for r in a),
            ],
            "first_diff_median": statistics.median(first),
        }
    print(f"{case}: greedy {({t: v.get('greedy_vs_off') or v.get('greedy_vs_sk_off') for t, v in out['variants'].items()})}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="fp8")
    ap.add_argument("--kv-dtype", default="fp8_e4m3")
    ap.add_argument("--kv-cache-memory", type=float, default=24)
    ap.add_argument("--cases", default="32x4096,64x200")
    ap.add_argument("--variants", default="off,on,on_w16,on_w4")
    ap.add_argument("--span-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--greedy-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, default=140.0)
    ap.add_argument("--greedy-need-s", type=float, default=15.0, help="left for the greedy runs")
    ap.add_argument("--json", default="fp8merge.json", help="file name under $OUT")
    args = ap.parse_args()
    from pdserve.engine.llm import LLM
    from pdserve.engine.worker import cuda_graph

    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {"cases": {}, "errors": {}, "args": vars(args)}

    def save() -> None:
        res["elapsed_s"] = elapsed()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    cases = [c for c in args.cases.split(",") if c]
    rows = sorted({int(c.split("x")[0]) for c in cases})
    cuda_graph.graph_batch_sizes = lambda max_batch: [r for r in rows if r <= max_batch]  # type: ignore[assignment]
    flags = Flags()
    res["flags_at_start"] = {f"{m}.{n}": v for (m, n), v in flags.saved.items()}
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=max(rows),
        kv_cache_memory=args.kv_cache_memory,
        quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_dtype,
    )
    core = llm.engine
    res["engine_start_s"] = elapsed()
    model = core.executor.rank0.model
    layer = next(model.decoder_layers())
    res["fp8_paths"] = {
        name: [(m, str(p)) for m, p in fp8.PATHS.get(tuple(w.weight.shape), ())]
        for name, w in layer.fp8.items()
    }
    print(f"engine up at {elapsed():.1f} s; KV {core.executor.rank0.storage.kv.dtype}", flush=True)
    save()
    try:
        for case in cases:
            if elapsed() > args.deadline_s - 20:
                res["errors"][case] = "skipped: deadline"
                continue
            run_case(args, llm, core, flags, case, res)
            save()
    except Exception as exc:  # noqa: BLE001 what was measured is kept
        import traceback

        traceback.print_exc()
        res["errors"]["run"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        flags.reset()
        save()
        llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
