"""Issue 24, session 9, second round of part bf16row: does a garbage collection land inside
bench offline's timed runs (the 256-prompt bf16 run moves +-8 % between calls)?

One ``pdserve bench offline`` process (its own engine: the flags after ``--``), every
garbage collection timed (``gc.callbacks``: when, which generation, how long) and every
run of ``_time_ours`` bracketed (when, prompts, tokens, seconds, its engine steps and the
three longest), so each collection is placed in the run (and a stall in the step) it
stopped:

1. bench offline's rows as it runs them, with its start-up freeze switched off (the
   process as it was before ``8162d63``): its JSON ``--json``;
2. on the same engine after those rows (``run_offline``'s ``after``): the tracked objects
   and the time of a full collection (twice), then ``GcWatch.freeze()`` (bench offline's
   freeze now) and the 256 / 64-prompt rows again (``_decode_row``: the same procedure),
   with their collections.

Writes ``$OUT/bf16row2.json`` (``--json-out``): ``runs`` (each timed run with the
collections inside it), ``collections`` (all), ``full_collection_ms``, ``frozen`` (the
rows of part 2), and bench offline's JSON of part 1 under ``offline``. ``--deadline-s``:
part 2's rows are skipped when past it. On CPU: ``--device cpu --model random:tiny``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from typing import Any

T0 = time.perf_counter()


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out", default="bf16row2.json", help="file name under $OUT")
    ap.add_argument("--deadline-s", type=float, default=100.0)
    ap.add_argument("--frozen-rows", default="256,64")
    own = ap.parse_args(argv[:split])

    from pdserve.bench import offline
    from pdserve.cli import build_parser
    from pdserve.gc_watch import GcWatch

    args = build_parser().parse_args(["bench", "offline", *argv[split + 1 :]])
    out_path = os.path.join(os.environ.get("OUT", "."), own.json_out)
    res: dict[str, Any] = {"runs": [], "collections": [], "errors": {}, "phase": "unfrozen"}

    def now_ms() -> float:
        return round((time.perf_counter() - T0) * 1e3, 2)

    def save() -> None:
        res["elapsed_s"] = round(time.perf_counter() - T0, 2)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    start: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            start[:] = [time.perf_counter()]
            return
        if not start:
            return
        pause = (time.perf_counter() - start[0]) * 1e3
        if info.get("generation", 0) >= 1 or pause >= 1.0:  # gen-0 ones: only the long
            res["collections"].append(
                {
                    "t_ms": now_ms(),
                    "gen": info.get("generation"),
                    "ms": round(pause, 3),
                    "collected": info.get("collected"),
                    "phase": res["phase"],
                }  # fmt: skip
            )
        start.clear()

    gc.callbacks.append(on_gc)
    real_time_ours = offline._time_ours

    def timed(llm, prompts, max_tokens):
        core = llm.engine
        orig = type(core).step
        durs: list[float] = []

        def step():  # every engine step's duration (the longest are kept)
            t = time.perf_counter()
            out = orig(core)
            durs.append((time.perf_counter() - t) * 1e3)
            return out

        t0 = now_ms()
        n_before = len(res["collections"])
        core.step = step
        try:
            secs, ids = real_time_ours(llm, prompts, max_tokens)
        finally:
            del core.step
        inside = res["collections"][n_before:]
        top = sorted(range(len(durs)), key=lambda j: -durs[j])[:3]
        res["runs"].append(
            {
                "t0_ms": t0,
                "s": secs,
                "prompts": len(prompts),
                "max_tokens": max_tokens,
                "phase": res["phase"],
                "gc_ms": round(sum(c["ms"] for c in inside), 3),
                "gc": [(c["gen"], c["ms"]) for c in inside if c["ms"] >= 1 or c["gen"] == 2],
                "steps": len(durs),
                "longest_steps": [(j, round(durs[j], 2)) for j in top],
            }  # fmt: skip
        )
        if max_tokens > 1 or inside:
            r = res["runs"][-1]
            print(f"   [{now_ms() / 1e3:6.1f} s] {r['phase']} run of {len(prompts)} x {max_tokens}: "
                  f"{secs * 1e3:.1f} ms, longest steps {r['longest_steps']}, collections "
                  f"{r['gc']}", flush=True)  # fmt: skip
        save()
        return secs, ids

    offline._time_ours = timed

    class NoFreeze(GcWatch):
        """bench offline's watch with its freeze switched off (part 1)."""

        def freeze(self) -> int:
            return 0

    watch = NoFreeze()
    offline.process_watch = lambda: watch  # type: ignore[assignment]

    def after(llm) -> None:
        save()
        res["phase"] = "probe"
        res["tracked_objects"] = len(gc.get_objects())
        res["gc_count"] = list(gc.get_count())
        full = []
        for _ in range(2):
            t = time.perf_counter()
            gc.collect()
            full.append((time.perf_counter() - t) * 1e3)
        res["full_collection_ms"] = full
        print(f"== {res['tracked_objects']} tracked objects; a full collection "
              f"{full[0]:.1f} / {full[1]:.1f} ms", flush=True)  # fmt: skip
        frozen = GcWatch().freeze()
        t = time.perf_counter()
        gc.collect()
        res["frozen_objects"] = frozen
        res["full_collection_frozen_ms"] = (time.perf_counter() - t) * 1e3
        print(f"   frozen {frozen}; a full collection then "
              f"{res['full_collection_frozen_ms']:.2f} ms", flush=True)  # fmt: skip
        res["phase"] = "frozen"
        save()
        engine = llm.engine
        pad_id = engine.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids, default=0)
        try:  # the rates bench offline measured (its JSON): not measured again
            with open(args.json) as f:
                rep = json.load(f)
            rates = {"bandwidth": rep["copy_bandwidth_bytes_per_s"],
                     "flop_rate": rep["matmul_flop_per_s"]}  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            rates = {
                "bandwidth": offline.copy_bandwidth(engine.device),
                "flop_rate": offline.matmul_rate(engine.device, engine.dtype),
            }
        res["frozen"] = []
        for n in [int(x) for x in own.frozen_rows.split(",") if x]:
            if time.perf_counter() - T0 > own.deadline_s:
                res["errors"][f"frozen {n}"] = "skipped: deadline"
                continue
            prompts = offline.workload_prompts(llm, n, args.input_len, args.input_source)
            row = offline._decode_row(args, llm, None, prompts, pad_id, rates)
            keep = ("num_prompts", "ours_tok_s", "ours_runs", "ours_first_token_s",
                    "ours_decode_ms_per_step", "ours_step_ms_all_decoding")  # fmt: skip
            res["frozen"].append({k: row.get(k) for k in keep})
            print(f"   frozen {n}: {row['ours_tok_s']:.0f} tok/s (runs "
                  f"{[round(x) for x in row['ours_runs']]}), decode "
                  f"{row['ours_decode_ms_per_step']} ms/step", flush=True)  # fmt: skip
            save()
        gc.unfreeze()

    def on_term(signum, frame):  # the call's timeout: end through the finally below
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, on_term)
    try:
        rc = offline.run_offline(args, after)
    finally:
        if args.json and os.path.exists(args.json):
            with open(args.json) as f:
                res["offline"] = json.load(f)
        save()
        gen2 = [c for c in res["collections"] if c["gen"] == 2]
        print("SUMMARY_JSON " + json.dumps({
            "full_ms": res.get("full_collection_ms"), "objects": res.get("tracked_objects"),
            "gen2": [(c["phase"], c["ms"]) for c in gen2],
            "runs_with_gc_over_5ms": [(r["phase"], r["prompts"], r["max_tokens"], round(r["s"] * 1e3, 1), r["gc_ms"])
                                      for r in res["runs"] if r["gc_ms"] >= 5],
            "frozen": [(r["num_prompts"], round(r["ours_tok_s"])) for r in res.get("frozen", [])],
        }, separators=(",", ":")), flush=True)  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
