"""Split-KV decode kernel sweep (issue 10): the decode attention of a whole step, as the
engine's CUDA graph runs it, for several launch configurations.

Llama-3.1-8B shapes (32 layers, 32 query / 8 KV heads, head_dim 128), bf16, a page-major pool
``[P, L, 2, Hkv, page_size, D]`` of 128-token pages (the CUDA default), pages scattered. For
each (batch, contexts) case and each :class:`~pdserve.model.triton_backend.DecodeConfig` the
32 layers' decode launches (split kernel, and merge when ``splits > 1``) are captured in one
CUDA graph and replayed: µs a layer, and GB/s of the K/V bytes the step must read
(``sum(contexts) * Hkv * D * 2 (K, V) * 2 bytes * 32``). The last layer's output is checked
against fp32 attention over the gathered K/V. ``backend`` is the configuration
:func:`~pdserve.model.triton_backend.decode_config` picks for the graph (``max_seq_len=None``).

Run on the GPU machine from the repo root: ``python3 scripts/gpu_decode_kernel_sweep.py``
(``--quick``: fewer configurations; ``--budget S``: stop starting cases after S seconds); writes ``$OUT/decode_sweep.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch

from pdserve.model import triton_backend as tb
from pdserve.model.triton_backend import DecodeConfig

L, HQ, HKV, D, PS = 32, 32, 8, 128, 128
SCALE = D**-0.5


def cases() -> list[tuple[str, list[int]]]:
    """(name, contexts) of each case: batch 1/16/64 at 200/2000/8000 tokens, the bench's
    spread (64 rows, 125-330 tokens) and one long row among short ones; most telling first."""
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randint(125, 331, (64,), generator=gen).tolist()
    out = [("bs64-mixed125-330", mixed), ("bs1-ctx200", [200]), ("bs64-ctx200", [200] * 64)]
    out += [("bs64-ctx2000", [2000] * 64), ("bs16-ctx200", [200] * 16)]
    out += [("bs16-ctx2000", [2000] * 16), ("bs1-ctx2000", [2000]), ("bs1-ctx8000", [8000])]
    out += [("bs16-ctx8000", [8000] * 16), ("bs64-63x200+1x8000", [200] * 63 + [8000])]
    return out + [("bs64-ctx8000", [8000] * 64)]


class Step:
    """One case's pool, page table, queries and output over ``pool`` (reused by every case)."""

    def __init__(self, pool: torch.Tensor, seq_lens: list[int], seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        B = len(seq_lens)
        need = [-(-s // PS) for s in seq_lens]
        width = max(need)
        perm = torch.randperm(pool.shape[0], device="cuda", generator=gen)[: sum(need)]
        table = torch.zeros(B, width, dtype=torch.int32, device="cuda")
        used = 0
        for b, n in enumerate(need):
            table[b, :n] = perm[used : used + n].to(torch.int32)
            used += n
        self.table, self.seq_lens_list = table, seq_lens
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device="cuda")
        self.q = torch.randn(B, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
        self.out = torch.empty_like(self.q)
        # per layer: K and V views [P, ps, Hkv, D] of the page-major pool (strided)
        self.views = [
            (pool[:, i, 0].permute(0, 2, 1, 3), pool[:, i, 1].permute(0, 2, 1, 3)) for i in range(L)
        ]
        self.kv_bytes = sum(seq_lens) * HKV * D * 2 * 2 * L

    def reference(self) -> torch.Tensor:
        """fp32 attention of the last layer, ``[B, Hq, D]``."""
        kc, vc = self.views[-1]
        outs = []
        for b, s in enumerate(self.seq_lens_list):
            pages = self.table[b, : -(-s // PS)].long()
            k = kc[pages].reshape(-1, HKV, D)[:s].float().repeat_interleave(HQ // HKV, 1)
            v = vc[pages].reshape(-1, HKV, D)[:s].float().repeat_interleave(HQ // HKV, 1)
            w = torch.softmax(torch.einsum("hd,thd->ht", self.q[b].float(), k) * SCALE, -1)
            outs.append(torch.einsum("ht,thd->hd", w, v))
        return torch.stack(outs)


def new_launcher(step: Step, cfg: DecodeConfig) -> Callable[[], None]:
    """The 32 layers' decode attention with ``cfg`` through the backend (as a graph runs it)."""
    backend = tb.TritonBackend()
    B = len(step.seq_lens_list)
    plan = tb.TritonPlan(decode=True, max_seq_len=None, max_q_len=1, config=cfg)
    md = tb.AttentionMetadata(
        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device="cuda"),
        seq_lens=step.seq_lens,
        page_table=step.table,
        slot_mapping=torch.full((B,), -1, dtype=torch.int64, device="cuda"),
    )
    k = torch.empty(B, HKV, D, device="cuda", dtype=torch.bfloat16)

    def run() -> None:
        for kc, vc in step.views:
            o = backend.forward(step.q, k, k, kc, vc, md, plan, SCALE, kv_stored=True)
        step.out.copy_(o.view(B, HQ, D))  # the last layer's, checked against the reference

    return run


def time_graph(run: Callable[[], None], replays: int = 10) -> float:
    """µs a layer of ``run`` (the 32 layers) captured in a CUDA graph and replayed."""
    run()  # compile
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for _ in range(3):
        g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(replays):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / replays / L * 1e3


TILES = ((32, 2), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8))  # (block_n, num_warps)


def configs(batch: int, quick: bool = False) -> list[DecodeConfig]:
    """Candidate configurations for ``batch`` rows of 8 KV heads: at 32 rows and more
    (``B * Hkv >= 256`` programs a split) 1 split with every tile and stage count, 2 splits
    with three tiles, 2-4 splits with a floor of 256 or 512 tokens; fewer rows: the split
    counts that bring the programs near a few per SM with three tiles, and two stage
    counts."""
    stages = (2,) if quick else (1, 2, 3)
    out: list[DecodeConfig] = []
    if batch * HKV >= 256:
        out += [DecodeConfig(1, bn, nw, st) for bn, nw in TILES for st in stages]
        out += [DecodeConfig(2, bn, nw, 2) for bn, nw in TILES[:3]]
        out += [DecodeConfig(s, 64, 4, st, f) for s in (2, 4) for st in (2, 3) for f in (256, 512)]
        return out
    for splits in (2, 4, 8, 16, 32):
        if batch * HKV * splits < 64 or batch * HKV * splits > 4096:
            continue
        out += [DecodeConfig(splits, bn, nw, 2) for bn, nw in TILES[::2]]
    out += [DecodeConfig(s, 64, 4, st) for s in (8, 32) for st in (1, 3)]
    return out


def sweep(
    case_list: list[tuple[str, list[int]]],
    quick: bool = False,
    extra: dict[str, Callable[[Step], Callable[[], None]]] | None = None,
    budget_s: float = 1e9,
) -> list[dict]:
    """Time every configuration (and every ``extra`` launcher) on every case, in order, until
    ``budget_s`` seconds have passed; returns rows."""
    t0 = time.time()
    pages = max(sum(-(-s // PS) for s in c) for _, c in case_list) + 8
    pool = torch.empty(pages, L, 2, HKV, PS, D, device="cuda", dtype=torch.bfloat16).normal_()
    rows = []
    for i, (name, ctx) in enumerate(case_list):
        if time.time() - t0 > budget_s:
            print(f"budget spent: {name} and later cases not run", flush=True)
            break
        step = Step(pool, ctx, seed=i)
        ref = step.reference()
        picked = tb.decode_config(len(ctx), HKV, PS, None)
        launchers = {f"{c}": (c, new_launcher(step, c)) for c in configs(len(ctx), quick)}
        launchers[f"backend {picked}"] = (picked, new_launcher(step, picked))
        for label, mk in (extra or {}).items():
            launchers[label] = (None, mk(step))
        res = []
        for label, (_cfg, run) in launchers.items():
            try:
                us = time_graph(run)
            except Exception as exc:  # noqa: BLE001 (Triton raises several kinds; keep going)
                print(f"  {name} {label}: failed {str(exc)[:100]}", flush=True)
                continue
            err = (step.out.float() - ref).abs().max().item()
            gbs = step.kv_bytes / L / (us * 1e-6) / 1e9
            res.append(dict(case=name, config=label, us_per_layer=us, gb_s=gbs, err=err))
        res.sort(key=lambda r: r["us_per_layer"])
        print(
            f"== {name}: {len(ctx)} rows, {sum(ctx)} tokens ({time.time() - t0:.0f} s)", flush=True
        )
        shown = res[:8] + [r for r in res[8:] if not r["config"].startswith("DecodeConfig")]
        for r in shown:
            print(
                f"  {r['us_per_layer']:7.2f} us/layer {r['gb_s']:6.0f} GB/s err {r['err']:.1e}"
                f"  {r['config']}",
                flush=True,
            )
        rows += res
        del step
    return rows


def main() -> None:
    quick = "--quick" in sys.argv
    budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 1e9
    rows = sweep(cases(), quick, budget_s=budget)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "decode_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
