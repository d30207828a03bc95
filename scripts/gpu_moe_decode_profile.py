"""``bench offline --ours-only`` and a kernel profile of the decode step on one engine (one
load of the model): issue 27's MoE decode check.

1. The rows of ``pdserve bench offline`` (its own functions and flags: the command line
   after ``--`` is bench offline's, ``--ours-only`` implied): decode ms/step and the
   roofline fraction per prompt count, printed as bench prints them, written to
   ``$OUT/moe_decode.json``. Run with ``PDSERVE_MOE_ROUTING_STATS=1`` so the roofline counts
   the experts the batch routed to.
2. Then the routing counters are switched off in every sparse layer and the CUDA graphs
   captured again (the counters' kernels would count as the layer's), and
   ``scripts/gpu_step_profile.py``'s measurement runs at ``--profile-rows`` (a list:
   each) x ``--profile-context`` (default 1 x 200): step time, GPU kernel time and launches per
   step per kernel name (torch.profiler over ``--profile-steps`` steps), and per layer:
   the kernels that run once a sparse layer (count per step >= the layer count, divided
   by it) -> ``$OUT/moe_step_profile_rows{N}.json`` (the first also
   ``$OUT/moe_step_profile.json``).

Usage (repository root, GPU machine)::

    PDSERVE_MOE_ROUTING_STATS=1 python3 scripts/gpu_moe_decode_profile.py -- \\
        --model random:qwen3-30b-a3b --device cuda --dtype bfloat16 --num-prompts 1,64 \\
        --max-tokens 64 --repeats 1

``--device cpu --model random:tiny-qwen3-moe`` (``TRITON_INTERPRET=1``) checks the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_step_profile import _decode_steps

from pdserve.bench import offline


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--profile-rows", default="1", help="rows of the profiled step; a list profiles each"
    )
    ap.add_argument("--profile-context", type=int, default=200)
    ap.add_argument("--profile-steps", type=int, default=8)
    own = ap.parse_args(argv[:split])
    top = argparse.ArgumentParser()
    offline.add_parser(top.add_subparsers(dest="cmd"))
    out = os.environ.get("OUT", ".")
    bench_argv = argv[split + 1 :] + ["--ours-only", "--json", os.path.join(out, "moe_decode.json")]
    args = top.parse_args(["offline", *bench_argv])

    from pdserve.engine.llm import LLM

    t0 = time.time()
    counts = offline._parse_counts(args.num_prompts)
    fields = offline.llm_fields(args, counts)
    llm = LLM(max_running_requests=max(counts), **fields)
    print(f"engine up in {time.time() - t0:.0f} s", flush=True)
    try:
        rows = [(n, "gsm8k") for n in counts]
        prompt_sets = [offline.workload_prompts(llm, n, None, None) for n in counts]
        prefill = offline._parse_nxl(args.prefill) if args.prefill else None
        offline._run(args, llm, rows, prompt_sets, prefill)
        print(f"bench rows done at {time.time() - t0:.0f} s", flush=True)
        profile(llm, own, out, args.device == "cuda" or str(args.device).startswith("cuda"))
        print(f"profile done at {time.time() - t0:.0f} s", flush=True)
    finally:
        llm.shutdown()


def profile(llm, own: argparse.Namespace, out: str, cuda: bool) -> None:
    """Step 2 of the module docstring."""
    runner = llm.engine.executor.rank0.runner
    model = runner.model
    layers = list(model.decoder_layers())
    for layer in layers:
        if layer.moe is not None:
            layer.moe.routing_stats = None
    g = runner.graphs
    if g is not None:  # captured again without the counters' kernels
        g._graphs.clear(), g._logits.clear(), g._greedy.clear()
        g._pool = None
        gc.collect()
        g.capture()
    for i, rows in enumerate(int(r) for r in str(own.profile_rows).split(",")):
        _profile_rows(llm, rows, own, out, cuda, len(layers), first=i == 0)


def _profile_rows(llm, rows: int, own: argparse.Namespace, out: str, cuda: bool, n_layers: int,
                  first: bool) -> None:  # fmt: skip
    """One profiled step shape -> ``moe_step_profile_rows{rows}.json`` (and
    ``moe_step_profile.json`` for the first of ``--profile-rows``)."""
    ctx, n = own.profile_context, own.profile_steps
    _decode_steps(llm, rows, ctx, 4, 0, cuda)  # warm
    times, per, launches, count = _decode_steps(llm, rows, ctx, n, 1, cuda)
    layer_kernels = {k: c / n for k, c in count.items() if c / n >= n_layers - 0.5}
    r = {
        "rows": rows,
        "context": ctx,
        "layers": n_layers,
        "step_ms": statistics.median(times) * 1e3,
        "kernel_ms": sum(per.values()) / n / 1e3,
        "graph_launches_per_step": launches / n,
        "kernels_per_step": sum(count.values()) / n,
        "kernels_per_layer": sum(layer_kernels.values()) / n_layers,
        "kernel_us_per_layer": sum(per[k] for k in layer_kernels) / n / n_layers,
        "per_kernel": {
            k[:140]: {"per_step": count[k] / n, "us_per_step": per[k] / n}
            for k in sorted(count, key=lambda k: -per[k])
        },
    }
    r["gap_ms"] = r["step_ms"] - r["kernel_ms"]
    print(
        f"== profile {rows}x{ctx}: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms, "
        f"graph launches/step {r['graph_launches_per_step']:.2f}, kernels/step "
        f"{r['kernels_per_step']:.0f}; a layer: {r['kernels_per_layer']:.1f} kernels, "
        f"{r['kernel_us_per_layer']:.1f} us",
        flush=True,
    )
    for k, v in list(r["per_kernel"].items())[:24]:
        print(f"  {v['us_per_step']:9.1f} us {v['per_step']:6.1f}x  {k[:100]}", flush=True)
    names = [f"moe_step_profile_rows{rows}.json"] + (["moe_step_profile.json"] if first else [])
    for name in names:
        with open(os.path.join(out, name), "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
