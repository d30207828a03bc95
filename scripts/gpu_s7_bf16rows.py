"""Issue 24, session 7 (bf16 at 64 and 256 prompts): everything measured on one engine load.

One engine (``random:llama-3.1-8b`` bf16 on CUDA, 256 running requests, graphs up to 256
rows, ``--kv-cache-memory`` 24 GiB, a 4,096-token step budget as bench offline gives the
1/64/256 rows), then in order, the JSON (``$OUT/bf16rows.json``) written after each part
and every part skipped once ``--deadline-s`` is near:

1. ``profile``: ``scripts/gpu_step_profile.py``'s per-kernel profile of the all-decoding
   step at ``64x200`` and ``256x200`` (current code, PDL off).
2. ``offline``: bench offline's workload (GSM8K chat prompts, greedy, 128 tokens, EOS
   ignored, the prefix cache emptied before each run) at 64 and 256 prompts under step
   budgets 4,096 / 8,192 / 16,384 tokens (the scheduler's budget swapped on the live
   engine): the first-token time (a 1-token run, median of ``--ttft-repeats``), one full
   run (tok/s = prompts x 128 / its seconds) and the decode ms per step
   ((full - first) / 127). 64 prompts (~8,016 prompt tokens) run at 16,384 as at 8,192: skipped.
   ``prefill``: one prefill step of N random 128-token prompts (N = 32 / 64 / 128, the
   budget N x 128: one step each) under ``torch.profiler``: wall and kernel ms, its
   TFLOP/s against 2 x 7e9 x tokens, the top kernels.
3. ``mm``: reads ``$OUT/mm_sweep.json`` (``scripts/gpu_s7_mm_sweep.py``, run beside the
   model load) and records which configurations beat ``F.linear`` by >= 3 % (on the H200:
   none; the engine has no such table, so nothing further runs here).
4. ``pdl``: ``PDSERVE_TRITON_PDL=1`` (``pdl``'s cached choice cleared, the graphs captured
   again with PDL launches) vs off: the step at ``64x200`` / ``256x200`` and the 64 / 256
   rows at 4,096, then off again (the first graphs swapped back) for the step: A, B, A.
5. ``splitk``: ``fused_splitk_norm.FUSE`` on (the 64-row down projection's split-K reduce
   folded into the next add + RMSNorm, the graphs captured again): the ``64x200`` step
   profile and the 64-prompt row at 4,096, then the baseline's ``64x200`` again.

Run by ``scripts/gpu_s7_bf16rows.sh``; ``--device cpu --model random:tiny --toy`` checks it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_s7_mm_sweep import table_entries
from gpu_step_profile import profile_shapes

from pdserve.bench.offline import _random_prompts, _time_ours, workload_prompts
from pdserve.engine.llm import LLM
from pdserve.model import fused_splitk_norm, pdl

T0 = time.perf_counter()
LAST_IDS: list[list[int]] = []  # the output ids of offline_row's last full run
FLOP_PER_TOKEN = 2 * 7e9  # the task's Llama-3.1-8B linear FLOP per prompt token (attention aside)


def elapsed() -> float:
    return time.perf_counter() - T0


class Run:
    def __init__(self, args) -> None:
        self.args = args
        self.out = os.path.join(os.environ.get("OUT", "."), args.json)
        self.res: dict[str, Any] = {"parts_done": [], "skipped": {}, "errors": {}}
        self.graph_sets: dict[str, tuple] = {}

    def save(self) -> None:
        self.res["elapsed_s"] = elapsed()
        with open(self.out, "w") as f:
            json.dump(self.res, f, indent=1)

    def left(self) -> float:
        return self.args.deadline_s - elapsed()

    def part(self, name: str, need_s: float, fn) -> None:
        """Run part ``name`` if ``need_s`` seconds are left; an exception is recorded, not raised."""
        if self.left() < need_s:
            self.res["skipped"][name] = f"{self.left():.0f} s left, needs ~{need_s:.0f}"
            print(f"== {name}: skipped ({self.left():.0f} s left)", flush=True)
            self.save()
            return
        print(f"== {name} (at {elapsed():.0f} s)", flush=True)
        try:
            fn()
            self.res["parts_done"].append(name)
        except Exception as exc:  # noqa: BLE001 (a failed part must not lose the others)
            import traceback

            traceback.print_exc()
            self.res["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"
        self.save()


def set_budget(llm: LLM, tokens: int) -> None:
    sch = llm.engine.scheduler
    sch.config = dataclasses.replace(sch.config, max_num_batched_tokens=tokens)


def use_variant(run: Run, llm: LLM, name: str, pdl_on: bool, fuse: bool) -> float:
    """Switch the engine to variant ``name``: PDL on/off, the split-K reduce folded into the
    norm (``fused_splitk_norm.FUSE``); its decode graphs captured on first use (kept:
    switching back swaps them in). Returns the seconds the capture took (0 when swapped)."""
    os.environ["PDSERVE_TRITON_PDL"] = "1" if pdl_on else "0"
    pdl._options.cache_clear()
    fused_splitk_norm.FUSE = fuse
    g = llm.engine.executor.rank0.runner.graphs
    if g is None:
        return 0.0
    cur = getattr(run, "_current", "base")
    run.graph_sets[cur] = (g._graphs, g._logits, g._greedy, g._pool)
    run._current = name  # type: ignore[attr-defined]
    if name in run.graph_sets:
        g._graphs, g._logits, g._greedy, g._pool = run.graph_sets[name]
        return 0.0
    g._graphs, g._logits, g._greedy, g._pool = {}, {}, {}, None
    # the inputs as the first capture saw them (padded rows only: no slot written, no page
    # read); every replay rewrites the rows and the table rows it uses
    torch.cuda.synchronize()
    g._rows.zero_()
    g._rows[2].fill_(-1)
    g._table.zero_()
    t0 = time.perf_counter()
    g.capture()
    return time.perf_counter() - t0


def offline_row(
    llm: LLM, n: int, budget: int, max_tokens: int, reps: int, full: bool = True
) -> dict:
    """bench offline's row of ``n`` GSM8K prompts at step budget ``budget``."""
    set_budget(llm, budget)
    prompts = workload_prompts(llm, n, None, None)
    _time_ours(llm, prompts, 1)  # warm: this budget's prefill shapes
    firsts = [_time_ours(llm, prompts, 1)[0] for _ in range(reps)]
    row: dict[str, Any] = {
        "num_prompts": n,
        "budget": budget,
        "prompt_tokens": sum(len(p) for p in prompts),
        "first_token_s": statistics.median(firsts),
        "first_token_runs_s": firsts,
    }
    if full:
        secs, ids = _time_ours(llm, prompts, max_tokens)
        LAST_IDS[:] = ids
        row["full_s"] = secs
        row["tok_s"] = n * max_tokens / secs
        row["decode_ms_per_step"] = (secs - row["first_token_s"]) / (max_tokens - 1) * 1e3
    print(
        f"   {n:4d} prompts, budget {budget:6d}: first token {row['first_token_s'] * 1e3:7.1f} ms"
        + (
            f", {row['tok_s']:8.0f} tok/s, decode {row['decode_ms_per_step']:.2f} ms/step"
            if full
            else ""
        ),
        flush=True,
    )
    return row


def prefill_profile(llm: LLM, n: int, length: int, top: int = 8) -> dict:
    """One prefill step of ``n`` random prompts of ``length`` tokens (budget n x length)."""
    cuda = llm.engine.device.type == "cuda"
    set_budget(llm, n * length)
    vocab = llm.engine.vocab_size
    _time_ours(llm, _random_prompts(vocab, n, length, seed=11), 1)  # warm
    walls = [
        _time_ours(llm, _random_prompts(vocab, n, length, seed=12 + r), 1)[0] for r in range(2)
    ]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _time_ours(llm, _random_prompts(vocab, n, length, seed=20), 1)
        if cuda:
            torch.cuda.synchronize()
    per: dict[str, float] = {}
    for a in prof.key_averages():
        if cuda and a.device_type == DeviceType.CUDA:
            per[a.key[:100]] = per.get(a.key[:100], 0.0) + a.device_time_total / 1e3
    kernel_ms = sum(per.values())
    tokens = n * length
    wall_ms = min(walls) * 1e3
    r = {
        "prompts": n,
        "length": length,
        "tokens": tokens,
        "wall_ms": wall_ms,
        "wall_ms_runs": [w * 1e3 for w in walls],
        "kernel_ms": kernel_ms,
        "tok_s": tokens / min(walls),
        "tflops_wall": FLOP_PER_TOKEN * tokens / (wall_ms * 1e-3) / 1e12,
        "tflops_kernels": FLOP_PER_TOKEN * tokens / (kernel_ms * 1e-3) / 1e12
        if kernel_ms
        else None,
        "top_kernels_ms": dict(sorted(per.items(), key=lambda kv: -kv[1])[:top]),
    }
    print(
        f"   prefill {n} x {length} = {tokens} tokens: wall {wall_ms:.1f} ms ({r['tok_s']:.0f} tok/s, "
        f"{r['tflops_wall']:.0f} TFLOP/s), kernels {kernel_ms:.1f} ms",
        flush=True,
    )
    for k, v in list(r["top_kernels_ms"].items())[:5]:
        print(f"      {v:8.2f} ms  {k[:90]}", flush=True)
    return r


def brief(prof: dict) -> dict:
    """The step profile's figures without the per-kernel counts (the JSON stays small)."""
    return {
        shape: {k: r[k] for k in ("step_ms", "step_ms_spans", "kernel_ms", "gap_ms",
                                  "graph_launches_per_step", "kernels_per_step")}
        | {"top_kernels_ms": dict(list(r["top_kernels_ms"].items())[:12])}
        for shape, r in prof.items()
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--toy", action="store_true", help="small counts and shapes (CPU check)")
    ap.add_argument("--deadline-s", type=float, default=240.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ttft-repeats", type=int, default=2)
    ap.add_argument("--sweep-wait-s", type=float, default=30.0)
    ap.add_argument("--json", default="bf16rows.json", help="file name under $OUT")
    ap.add_argument(
        "--parts", default="profile,offline,prefill,mm,pdl,splitk", help="which parts, in order"
    )
    args = ap.parse_args()
    toy = args.toy
    counts = [4, 8] if toy else [64, 256]
    shapes = ["4x20", "8x20"] if toy else ["64x200", "256x200"]
    budgets = [64, 128, 256] if toy else [4096, 8192, 16384]
    pre = [(2, 16), (4, 16)] if toy else [(32, 128), (64, 128), (128, 128)]
    steps = 4 if toy else 24
    run = Run(args)
    out_dir = os.environ.get("OUT", ".")
    # the baseline of this run: the split-K fold off (as on main before it; part splitk
    # turns it on); the engine captures its first graphs with it off
    fused_splitk_norm.FUSE = False
    t0 = time.perf_counter()
    run.res["engine_load_wall"] = [time.time()]  # wall clock: compared with the sweep's rows
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=max(counts) if toy else 256,
        kv_cache_memory=2 if toy else 24,
        max_num_batched_tokens=budgets[0],
    )
    run.res["engine_start_s"] = time.perf_counter() - t0
    run.res["engine_load_wall"].append(time.time())
    run.res["model"] = args.model
    run.res["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"engine up in {run.res['engine_start_s']:.0f} s (at {elapsed():.0f} s)", flush=True)
    run.save()

    def p_profile() -> None:
        run.res["profile"] = profile_shapes(llm, shapes, steps, 14)

    def p_offline() -> None:
        rows = run.res.setdefault("offline", [])
        tokens = {n: sum(len(p) for p in workload_prompts(llm, n, None, None)) for n in counts}
        for i, budget in enumerate(budgets):
            for n in counts:
                if i and budgets[i - 1] >= tokens[n] + n:
                    continue  # its prompts fit the smaller budget in one step: the same run
                rows.append(offline_row(llm, n, budget, args.max_tokens, args.ttft_repeats))
                run.save()
        set_budget(llm, budgets[0])

    def p_prefill() -> None:
        rows = run.res.setdefault("prefill", [])
        for n, length in pre:
            rows.append(prefill_profile(llm, n, length))
            run.save()
        set_budget(llm, budgets[0])

    def p_mm() -> None:
        path = os.path.join(out_dir, "mm_sweep.json")
        done = os.path.join(out_dir, "mm_sweep.done")
        t_wait = time.perf_counter()
        while not os.path.exists(done) and time.perf_counter() - t_wait < args.sweep_wait_s:
            time.sleep(1)
        with open(path) as f:
            sweep = json.load(f)
        table = {k: v for k, v in table_entries(sweep).items() if any(c for _, c in v)}
        run.res["mm_table"] = {str(k): v for k, v in table.items()}
        print(f"   configurations >= 3 % faster than F.linear: {run.res['mm_table']}", flush=True)

    def p_splitk() -> None:
        small = [s for s in shapes if s.startswith(f"{min(counts)}x")]
        cap = use_variant(run, llm, "splitk", False, True)
        run.res["splitk_capture_s"] = cap
        run.res["splitk_profile"] = brief(profile_shapes(llm, small, steps, 14))
        run.save()
        run.res["splitk_offline"] = [
            offline_row(llm, min(counts), budgets[0], args.max_tokens, args.ttft_repeats)
        ]
        fused_ids = list(LAST_IDS)
        use_variant(run, llm, "base", False, False)
        run.res["splitk_base_again"] = brief(profile_shapes(llm, small, steps, 14))
        # the same greedy tokens with the reduce folded (the same bits by construction)?
        prompts = workload_prompts(llm, min(counts), None, None)
        base_ids = _time_ours(llm, prompts, args.max_tokens)[1]
        same = sum(a == b for a, b in zip(fused_ids, base_ids))
        run.res["splitk_same_outputs"] = [same, len(base_ids)]
        print(f"   split-K folded vs not: {same} of {len(base_ids)} outputs identical", flush=True)

    def p_pdl() -> None:
        cap = use_variant(run, llm, "pdl", True, False)
        run.res["pdl_capture_s"] = cap
        run.res["pdl_profile"] = brief(profile_shapes(llm, shapes, steps, 14))
        run.save()
        run.res["pdl_offline"] = [
            offline_row(llm, n, budgets[0], args.max_tokens, args.ttft_repeats) for n in counts
        ]
        run.save()
        use_variant(run, llm, "base", False, False)
        run.res["pdl_off_again"] = brief(profile_shapes(llm, shapes, steps, 14))

    try:
        parts = {
            "profile": (15, p_profile),
            "offline": (30, p_offline),
            "prefill": (8, p_prefill),
            "mm": (1, p_mm),
            "splitk": (25, p_splitk),
            "pdl": (40, p_pdl),
        }
        for name in args.parts.split(","):
            run.part(name, *parts[name])
    finally:
        if "profile" in run.res:  # keep the JSON small: the top kernels, not every count
            run.res["profile"] = {
                s: r
                | {"kernel_counts_per_step": dict(list(r["kernel_counts_per_step"].items())[:40])}
                for s, r in run.res["profile"].items()
            }
        run.save()
        llm.shutdown()
    print(f"== done at {elapsed():.0f} s", flush=True)


if __name__ == "__main__":
    main()
