"""Decode attention at many rows x short contexts, and the greedy pick: a timed sweep (issue 24).

Part 1, attention: Llama-3.1-8B shapes (32 layers, 32 query / 8 KV heads, head_dim 128),
bf16, a page-major pool ``[P, L, 2, Hkv, page, D]`` of 128-token pages, pages scattered.
For each case (rows x context) and each candidate
:class:`~pdserve.model.triton_backend.DecodeConfig`, the 32 layers' decode attention (split
kernel, and the merge with more than one split) is captured in one CUDA graph, as the
engine's decode graph runs it (each layer reads its own KV: nothing is reused from L2), and
replayed: µs a layer, GB/s of the bytes a layer must read (K and V of every context token
and KV head, queries and output) and the fraction of the read+write bandwidth of a 1 GiB
device copy measured in the same run. ``current`` marks what ``decode_config`` picks for
the replayed graph now. The last layer's output is checked against fp32 attention.

Part 2, greedy pick: ``argmax`` + ``log_softmax(...).gather`` + ``cat`` (what a decode
graph ran) against :func:`pdserve.model.triton_greedy.greedy_pick` variants, over ``[R,
128256]`` fp32 logits, 10 calls over 4 rotating buffers in one graph.

Run on the GPU machine from the repo root: ``python3 scripts/gpu_s6_attn_sweep.py
[--budget S] [--quick]``; writes ``$OUT/attn_sweep.json`` after every case (a timeout keeps
what was measured). ``--device cpu`` (with ``TRITON_INTERPRET=1``): two layers, tiny
contexts, each configuration run once and checked, no timing (a check of the script).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from pdserve.bench.roofline import copy_bandwidth
from pdserve.model import triton_backend as tb
from pdserve.model.attention import AttentionMetadata
from pdserve.model.triton_backend import DecodeConfig
from pdserve.model.triton_greedy import greedy_pick

HQ, HKV, D, PS = 32, 8, 128, 128
SCALE = D**-0.5
VOCAB = 128256

# Short-context candidates at B * Hkv >= 256 (splits, block_n, warps, stages, min_split)
SHORT = [
    (1, 64, 4, 3),  # main's pick for these rows
    (1, 64, 4, 2),
    (1, 32, 2, 3),
    (1, 32, 4, 3),
    (1, 64, 8, 3),
    (1, 128, 8, 2),
    (2, 64, 4, 2),
    (2, 32, 4, 3),
    (4, 32, 4, 3),
    # the next tile loaded before this one's math (DecodeConfig.prefetch; one stage: no
    # shared-memory pipeline then)
    (1, 32, 4, 1, 0, 0, True),
    (1, 32, 2, 1, 0, 0, True),
    (1, 64, 4, 1, 0, 0, True),
    (1, 64, 8, 1, 0, 0, True),
    (1, 128, 8, 1, 0, 0, True),
    (1, 16, 2, 1, 0, 0, True),
    (2, 32, 4, 1, 0, 0, True),
    (2, 64, 8, 1, 0, 0, True),
    (4, 32, 4, 1, 0, 0, True),
]
QUICK = [0, 3, 6, 9, 11, 15]
CASES = [  # (rows, context), most telling first: the budget may stop the later ones
    (64, 200),
    (256, 200),
    (64, 512),
    (32, 4096),
    (1, 4096),
    (128, 200),
    (256, 512),
    (64, 1024),
    (128, 512),
    (256, 1024),
    (32, 200),
    (32, 512),
]


class Case:
    """One case's page table, lengths, queries and per-layer K/V views over ``pool``."""

    def __init__(self, pool: torch.Tensor, rows: int, ctx: int, seed: int, dev) -> None:
        gen = torch.Generator(device=dev).manual_seed(seed)
        need = -(-ctx // pool.shape[4])
        perm = torch.randperm(pool.shape[0], device=dev, generator=gen)[: rows * need]
        self.table = perm.view(rows, need).to(torch.int32)
        self.lens = [ctx] * rows
        self.seq_lens = torch.full((rows,), ctx, dtype=torch.int64, device=dev)
        dtype = pool.dtype
        self.q = torch.randn(rows, HQ, D, device=dev, generator=gen).to(dtype)
        self.out = torch.empty_like(self.q)
        L = pool.shape[1]
        self.views = [
            (pool[:, i, 0].permute(0, 2, 1, 3), pool[:, i, 1].permute(0, 2, 1, 3)) for i in range(L)
        ]
        elt = pool.element_size()
        self.layer_bytes = elt * D * (2 * rows * ctx * HKV + 2 * rows * HQ)
        self.md = AttentionMetadata(
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=dev),
            seq_lens=self.seq_lens,
            page_table=self.table,
            slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=dev),
        )

    def reference(self) -> torch.Tensor:
        """fp32 attention of the last layer, ``[B, Hq, D]`` (one batched einsum: equal lengths)."""
        kc, vc = self.views[-1]
        B, ctx = len(self.lens), self.lens[0]
        k = kc[self.table.long()].reshape(B, -1, HKV, D)[:, :ctx].float()
        v = vc[self.table.long()].reshape(B, -1, HKV, D)[:, :ctx].float()
        k = k.repeat_interleave(HQ // HKV, 2)
        v = v.repeat_interleave(HQ // HKV, 2)
        w = torch.softmax(torch.einsum("bhd,bthd->bht", self.q.float(), k) * SCALE, -1)
        return torch.einsum("bht,bthd->bhd", w, v)


def launcher(case: Case, cfg: DecodeConfig) -> Callable[[], None]:
    """Every layer's decode attention with ``cfg`` through the backend, as a graph runs it."""
    backend = tb.TritonBackend()
    B = len(case.lens)
    plan = tb.TritonPlan(decode=True, max_seq_len=None, max_q_len=1, config=cfg)
    k = torch.empty(B, HKV, D, device=case.q.device, dtype=case.q.dtype)

    def run() -> None:
        for kc, vc in case.views:
            o = backend.forward(case.q, k, k, kc, vc, case.md, plan, SCALE, kv_stored=True)
        case.out.copy_(o.view(B, HQ, D))

    return run


def time_graph(run: Callable[[], None], per: int, replays: int = 8) -> float:
    """µs of one of the ``per`` units ``run`` does, captured in a CUDA graph, replayed."""
    run()  # compile
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    g.replay()
    times = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(replays):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / replays / per * 1e3)
    return sorted(times)[1]


def current_config(rows: int, ctx: int, dev) -> DecodeConfig:
    """The configuration the engine's replayed decode graph uses for this case now."""
    bound = tb.ONE_SPLIT_MAX_CONTEXT if ctx <= tb.ONE_SPLIT_MAX_CONTEXT else None
    picks = tb.device_picks(dev, HQ // HKV, D)  # the table's, if any
    return tb.decode_config(rows, HKV, PS, bound, None, picks)


def attention(report: dict, out_path: str | None, dev, quick: bool, budget: float, t0: float):
    layers = 32 if dev.type == "cuda" else 2
    cases = CASES if dev.type == "cuda" else [(4, 40), (2, 70)]
    ps = PS if dev.type == "cuda" else 16
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pages = max(r * -(-c // ps) for r, c in cases) + 8
    pool = torch.empty(pages, layers, 2, HKV, ps, D, device=dev, dtype=dtype).normal_()
    bw = report["copy_bandwidth_bytes_per_s"]
    cands = [SHORT[i] for i in QUICK] if quick else SHORT
    for i, (rows, ctx) in enumerate(cases):
        if time.time() - t0 > budget:
            print(f"budget spent: {rows}x{ctx} and later cases not run", flush=True)
            break
        case = Case(pool, rows, ctx, seed=i, dev=dev)
        ref = case.reference()
        cur = current_config(rows, ctx, dev)
        if dev.type != "cuda":  # the interpreter: the page is 16 tokens, tiles up to 16
            cur = DecodeConfig(1, 16, 4, 2)
        todo: dict[str, DecodeConfig] = {"current": cur}
        if dev.type == "cuda":
            todo["current+prefetch"] = replace(cur, prefetch=True)
        if ctx <= tb.ONE_SPLIT_MAX_CONTEXT and rows * HKV >= 256:
            for c in cands:
                todo.setdefault(f"{c}", DecodeConfig(*c))
        elif dev.type != "cuda":
            todo["(2, 16, 4, 2)"] = DecodeConfig(2, 16, 4, 2)
            todo["(2, 16, 4, 1, 0, 0, True)"] = DecodeConfig(2, 16, 4, 1, 0, 0, True)
        res = []
        for label, cfg in todo.items():
            if dev.type != "cuda" and cfg.block_n > ps:
                continue
            try:
                us = time_graph(launcher(case, cfg), layers)
            except Exception as exc:  # noqa: BLE001 (Triton raises several kinds; go on)
                print(f"  {rows}x{ctx} {label}: failed {str(exc)[:120]}", flush=True)
                res.append(dict(rows=rows, context=ctx, config=label, error=str(exc)[:300]))
                continue
            err = (case.out.float() - ref).abs().max().item()
            gbs = case.layer_bytes / (us * 1e-6) / 1e9 if us == us else float("nan")
            res.append(
                dict(
                    rows=rows,
                    context=ctx,
                    config=label,
                    splits=cfg.splits,
                    block_n=cfg.block_n,
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    min_split=cfg.min_split,
                    balance=cfg.balance,
                    prefetch=cfg.prefetch,
                    us_per_layer=us,
                    gb_s=gbs,
                    fraction=gbs * 1e9 / bw,
                    err=err,
                )
            )
        ok = [r for r in res if "error" not in r]
        ok.sort(key=lambda r: r["us_per_layer"] if r["us_per_layer"] == r["us_per_layer"] else 0)
        cur_us = next((r["us_per_layer"] for r in ok if r["config"] == "current"), float("nan"))
        print(
            f"== {rows} rows x {ctx} tokens: {case.layer_bytes / 1e6:.1f} MB a layer, "
            f"current {cur} {cur_us:.2f} us ({time.time() - t0:.0f} s)",
            flush=True,
        )
        for r in ok[:5]:
            print(
                f"   {r['us_per_layer']:7.2f} us {r['gb_s']:6.0f} GB/s {r['fraction']:.2f} "
                f"err {r['err']:.1e}  {r['config']}",
                flush=True,
            )
        report["attention"] += res
        if out_path:
            _write(out_path, report)
        del case


def greedy(report: dict, out_path: str | None, dev):
    rows_list = (64, 256, 1) if dev.type == "cuda" else (3, 5)
    vocab = VOCAB if dev.type == "cuda" else 3000
    variants = [(528, 2048, 8), (1056, 2048, 8), (264, 4096, 8), (1056, 1024, 4), (2112, 1024, 4)]
    if dev.type != "cuda":
        variants = [(8, 256, 4)]
    for R in rows_list:
        bufs = [torch.randn(R, vocab, device=dev) * 4 for _ in range(4)]
        outs = torch.empty(R, 2, dtype=torch.float64, device=dev)

        def torch_path(bufs=bufs, outs=outs):
            for x in bufs:
                ids = x.argmax(dim=-1, keepdim=True)
                chosen = torch.log_softmax(x, dim=-1).gather(1, ids)
                outs.copy_(torch.cat((ids.double(), chosen.double()), dim=1))

        ref_ids = bufs[-1].argmax(-1)
        ref_lp = torch.log_softmax(bufs[-1], -1).gather(1, ref_ids[:, None])[:, 0].double()
        res = [dict(rows=R, path="torch argmax+log_softmax", us=time_graph(torch_path, 4))]
        for target, bv, nw in variants:
            from pdserve.model.triton_greedy import greedy_splits

            S = greedy_splits(R, vocab, target, bv)

            def tri(S=S, bv=bv, nw=nw, bufs=bufs, outs=outs):
                for x in bufs:
                    greedy_pick(x, out=outs, splits=S, block_v=bv, num_warps=nw)

            try:
                us = time_graph(tri, 4)
            except Exception as exc:  # noqa: BLE001
                res.append(dict(rows=R, path=f"triton {target}/{bv}/{nw}", error=str(exc)[:300]))
                continue
            same = bool(torch.equal(outs[:, 0].long(), ref_ids))
            lp_err = (outs[:, 1] - ref_lp).abs().max().item()
            res.append(
                dict(
                    rows=R,
                    path=f"triton {target}/{bv}/{nw}",
                    target=target,
                    block_v=bv,
                    num_warps=nw,
                    splits=S,
                    us=us,
                    same_ids=same,
                    logprob_err=lp_err,
                )
            )
        print(f"== greedy pick {R} x {vocab}:", flush=True)
        for r in res:
            extra = (
                ""
                if "same_ids" not in r
                else f" same ids {r['same_ids']} lp err {r['logprob_err']:.1e}"
            )
            print(f"   {r.get('us', float('nan')):7.2f} us  {r['path']}{extra}", flush=True)
        report["greedy"] += res
        if out_path:
            _write(out_path, report)


def logits(report: dict, out_path: str | None, dev) -> None:
    """The lm_head of a decode graph: a bf16 GEMM then its cast into the fp32 logits buffer
    (what ``compute_logits(out=...)`` runs) against one GEMM writing fp32 (``out_dtype``),
    at 64 and 256 rows x 4,096 -> 128,256 (CUDA only)."""
    if dev.type != "cuda":
        return
    w = torch.randn(VOCAB, 4096, device=dev).to(torch.bfloat16)
    for R in (64, 256):
        h = [torch.randn(R, 4096, device=dev).to(torch.bfloat16) for _ in range(4)]
        buf = torch.empty(R, VOCAB, device=dev)

        def cast(h=h, buf=buf):
            for x in h:
                buf.copy_(x @ w.t())

        def direct(h=h, buf=buf):
            for x in h:
                torch.mm(x, w.t(), out_dtype=torch.float32, out=buf)

        res = [dict(rows=R, path="bf16 gemm + cast", us=time_graph(cast, 4))]
        try:
            res.append(dict(rows=R, path="gemm out_dtype fp32", us=time_graph(direct, 4)))
        except Exception as exc:  # noqa: BLE001 (an op this torch lacks: reported)
            res.append(dict(rows=R, path="gemm out_dtype fp32", error=str(exc)[:300]))
        print(
            f"== lm_head {R} rows: "
            + ", ".join(f"{r['path']} {r.get('us', float('nan')):.1f} us" for r in res),
            flush=True,
        )
        report["logits"] += res
        if out_path:
            _write(out_path, report)


def _write(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main() -> None:
    args = sys.argv[1:]
    dev = torch.device(args[args.index("--device") + 1] if "--device" in args else "cuda")
    budget = float(args[args.index("--budget") + 1]) if "--budget" in args else 1e9
    quick = "--quick" in args
    t0 = time.time()
    out = os.environ.get("OUT")
    out_path = os.path.join(out, "attn_sweep.json") if out else None
    bw = copy_bandwidth(dev)
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_bytes_per_s": bw,
        "shapes": dict(hq=HQ, hkv=HKV, head_dim=D, page=PS, layers=32, vocab=VOCAB),
        "config": "DecodeConfig fields (splits, block_n, num_warps, num_stages[, min_split, "
        "balance, prefetch])",
        "attention": [],
        "greedy": [],
        "logits": [],
    }
    print(f"copy bandwidth (read+write) {bw / 1e9:.0f} GB/s", flush=True)
    greedy(report, out_path, dev)
    logits(report, out_path, dev)
    attention(report, out_path, dev, quick, budget, t0)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
