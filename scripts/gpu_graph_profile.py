"""The decode graph with and without each kernel lever of issue 10, in one process on the GPU.

Variants (command-line words, measured in order): ``base`` (the attention backend's own KV
store kernel, cuBLAS for every linear layer), ``fused`` (K/V stored by the RoPE kernel),
``gemv`` (fused + the measured ``gemv_table``, SwiGLU inside the down projection's GEMV),
``gemv-nosilu`` (the same with SwiGLU as its own kernel); a ``+attn1`` suffix also runs the
decode attention as one split (no merge) at rows x KV heads >= 256 (now the default for
contexts <= 1024 tokens), ``+tri64`` our GEMV for every linear layer at 64 rows, ``+pdl`` our
Triton kernels launched with programmatic dependent launch (``+`` words combine:
``gemv-nosilu+tri64+pdl``). For each: ``random:llama-3.1-8b`` bf16, the
captured graph's GPU time at batch 1 and 64 (200-token contexts; 20 replays timed with CUDA
events), its kernels (torch.profiler, top 12), then an engine decode step at 1 and 64
prompts ((time of 96 tokens - time of 32) / 64). One engine: its graphs are captured again
for each variant. Run from the repo root on the GPU machine:
``python3 scripts/gpu_graph_profile.py base fused gemv-nosilu gemv``; writes ``$OUT/graph_profile.json``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model import gemv_table, linear, pdl, triton_backend
from pdserve.model.triton_backend import DecodeConfig, TritonBackend

CTX = 200
MEASURED_TABLE = dict(gemv_table.TABLE)
DEFAULT_DECODE_CONFIG = triton_backend.decode_config


def graph_figures(g, bs: int) -> dict:
    ids = np.zeros(bs, dtype="int64") + 5
    pos = np.zeros(bs, dtype="int64") + CTX - 1
    tables = [list(range(i * 14, i * 14 + 13)) for i in range(bs)]
    for _ in range(3):
        g.replay(ids, pos, tables)
    torch.cuda.synchronize()
    pieces = [g._graphs[g._last_key]]  # the graph the replays above ran
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        for p in pieces:
            p.replay()
    e.record()
    torch.cuda.synchronize()
    gpu_ms = s.elapsed_time(e) / 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for p in pieces:
                p.replay()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    rows = sorted(ka, key=lambda a: -a.device_time_total)
    tot = sum(a.device_time_total for a in ka) / 5 / 1e3
    n = sum(a.count for a in ka) / 5
    print(
        f"  bs {bs}: graph {gpu_ms:.3f} ms GPU; kernels {tot:.3f} ms over {n:.0f}; gaps {gpu_ms - tot:.3f} ms"
    )
    for a in rows[:12]:
        print(f"  {a.device_time_total / 5 / 1e3:8.3f} ms {a.count // 5:5d}x  {a.key[:100]}")
    return dict(graph_ms=gpu_ms, kernel_ms=tot, kernels=n)


def engine_step_ms(llm, n: int) -> float:
    prompts = [[1 + (i * 7 + j) % 4000 for j in range(CTX - 64)] for i in range(n)]
    t = {}
    for mt in (32, 96, 32, 96):
        p = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, p)
        t[mt] = time.perf_counter() - t0
    return (t[96] - t[32]) / 64 * 1e3


def _one_split_at_large_batch(num_seqs: int, num_kv_heads: int, page_size: int, max_seq_len):
    """The ``+attn1`` lever: one split (no merge) once rows x KV heads >= 256, 3 stages."""
    if num_seqs * num_kv_heads >= 256:
        return DecodeConfig(1, 64, 4, 3)
    return DEFAULT_DECODE_CONFIG(num_seqs, num_kv_heads, page_size, max_seq_len)


# ``+tri64``: our GEMV for every linear layer at 64 rows, in the configurations of the PDL
# probe (scripts/gpu_pdl_probe.py): (N, K) -> config.
TRITON_AT_64 = {
    (6144, 4096): ("dot", 64, 128, 4, 4),
    (4096, 4096): ("dot", 32, 128, 4, 5),
    (28672, 4096): ("dot", 256, 64, 8, 4),
    (4096, 14336): ("splitk2", 64, 128, 4, 4),
}


def _with_triton_at_64(table: dict) -> dict:
    out = dict(table)
    for (n, k), cfg in TRITON_AT_64.items():
        rows = [r for r in table.get(("bfloat16", n, k), ()) if r[0] < 64]
        out[("bfloat16", n, k)] = (*rows, (64, cfg))
    return out


def set_variant(variant: str) -> None:
    """``variant`` optionally ends in ``+`` words: ``attn1`` (:func:`_one_split_at_large_batch`),
    ``tri64`` (:data:`TRITON_AT_64`), ``pdl`` (``PDSERVE_TRITON_PDL=1``: model/pdl.py)."""
    variant, *extras = variant.split("+")
    TritonBackend.accepts_stored_kv = variant != "base"
    table = MEASURED_TABLE if variant.startswith("gemv") else {}
    gemv_table.TABLE = _with_triton_at_64(table) if "tri64" in extras else table
    linear.FUSE_SILU_MUL = variant != "gemv-nosilu"
    triton_backend.decode_config = (
        _one_split_at_large_batch if "attn1" in extras else DEFAULT_DECODE_CONFIG
    )
    os.environ["PDSERVE_TRITON_PDL"] = "1" if "pdl" in extras else "0"
    pdl._options.cache_clear()


def main() -> None:
    out = os.environ.get("OUT", ".")
    res: dict = {}
    args = sys.argv[1:]
    max_batch = 64
    if "--max-batch" in args:  # fewer buckets: a shorter start (bs 64 then not measured)
        i = args.index("--max-batch")
        max_batch = int(args[i + 1])
        del args[i : i + 2]
    variants = args
    set_variant(variants[0])
    t0 = time.time()
    llm = LLM(
        "random:llama-3.1-8b",
        device="cuda",
        dtype="bfloat16",
        max_running_requests=max_batch,
        kv_cache_memory=16,
    )
    print(f"engine up in {time.time() - t0:.0f} s", flush=True)
    g = llm.engine.executor.rank0.runner.graphs
    for i, variant in enumerate(variants):
        if i:  # the same engine, its graphs captured again under this variant
            set_variant(variant)
            g._graphs.clear(), g._logits.clear(), g._greedy.clear()
            g._pool = None  # a fresh pool: the old one went with its graphs
            gc.collect()
            g.capture()
        print(f"== {variant} (table entries {len(gemv_table.TABLE)})", flush=True)
        sizes = [bs for bs in (1, 64) if bs <= max_batch]
        r = {f"bs{bs}": graph_figures(g, bs) for bs in sizes}
        for n in sizes:
            r[f"engine_step_ms_{n}"] = engine_step_ms(llm, n)
            print(
                f"  engine decode step, {n} prompts: {r[f'engine_step_ms_{n}']:.3f} ms", flush=True
            )
        res[variant] = r
    print("SUMMARY", json.dumps(res))
    with open(os.path.join(out, "graph_profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
