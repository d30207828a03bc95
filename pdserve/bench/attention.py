"""``pdserve bench attention``: the ``triton`` backend's decode attention alone, against the
bytes it must read.

One layer's decode attention (the split kernel, and the merge when a configuration has more
than one split) over a paged KV pool of random values, for each batch size, context length
and length layout asked for, under each decode configuration asked for: the one an eager
step picks from its lengths (``eager``), the one of the CUDA graph the engine would replay
(``graph``: the bucket's bounded or unbounded graph), or one given as
``splits/block_n/warps/stages[/balance[/prefetch]]``. K/V are taken as stored (the store kernel is
not timed).

Bytes a call must read: the K and V of every context token of every KV head, plus the
queries and the output it writes. Time per call: on CUDA, ``--iters`` calls captured in one
CUDA graph, the median of five replays (launch gaps as in the engine's graphs); elsewhere a
plain loop (under ``TRITON_INTERPRET=1`` on CPU: a check that the command works, no speed).
``fraction`` = (bytes / time) / the read+write bandwidth of a device copy measured in the
same run (the figure ``bench offline``'s roofline uses). Every configuration's output is
checked against the ``torch_sdpa`` backend's (max abs difference in the JSON).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

from pdserve.bench.cli import add_json_flag, write_json
from pdserve.cli import int_list


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench attention``."""
    p = subparsers.add_parser(
        "attention", help="the triton decode attention kernel alone: time against its bytes"
    )
    p.add_argument("--batch", default="1,32,64,256", help="comma-separated batch sizes")
    p.add_argument("--context", default="4096", help="comma-separated context lengths (tokens)")
    p.add_argument(
        "--layout",
        default="uniform",
        help="comma-separated length layouts: uniform (every row --context tokens) or skewed "
        "(row 0 --context tokens, the others 1/32 of it)",
    )
    p.add_argument(
        "--configs",
        default="eager,graph",
        help="comma-separated decode configurations: eager (an eager step's choice), graph "
        "(the replayed graph's), or splits/block_n/warps/stages[/balance[/prefetch]], e.g. "
        "4/64/4/2 or 1/32/4/1/0/1 (prefetch 1: the next tile loaded before this one's math)",
    )
    p.add_argument("--num-heads", type=int, default=32, help="query heads (Llama-3.1-8B: 32)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (Llama-3.1-8B: 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument(
        "--page-size", type=int, default=None, help="tokens a page; unset: the device's default"
    )
    p.add_argument(
        "--kv-order",
        choices=("page_major", "layer_major"),
        default="page_major",
        help="the pool's order (engine/kv/layout.py): a head's page contiguous, or a token's heads",
    )
    p.add_argument("--dtype", default="bfloat16", help="KV and query dtype")
    p.add_argument(
        "--device",
        default="cuda",
        help="cuda (cpu only under TRITON_INTERPRET=1: a check, not a timing)",
    )
    p.add_argument("--iters", type=int, default=20, help="calls a timing covers")
    add_json_flag(p, "the rows")
    p.set_defaults(func=run_attention)


def parse_config(text: str):
    """``"eager"`` / ``"graph"`` stay strings; ``"S/BN/W/ST[/BAL[/PREFETCH]]"`` ->
    ``DecodeConfig`` (min_split 0; PREFETCH 0 or 1). ValueError naming ``configs``
    otherwise."""
    from pdserve.model.triton_backend import DecodeConfig

    if text in ("eager", "graph"):
        return text
    try:
        parts = [int(x) for x in text.split("/")]
        if len(parts) not in (4, 5, 6):
            raise ValueError("4 to 6 numbers")
        splits, block_n, warps, stages = parts[:4]
        balance = parts[4] if len(parts) >= 5 else 0
        prefetch = parts[5] if len(parts) == 6 else 0
        if prefetch not in (0, 1):
            raise ValueError(f"prefetch must be 0 or 1, got {prefetch}")
        return DecodeConfig(splits, block_n, warps, stages, 0, balance, bool(prefetch))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"configs: {text!r} is not eager, graph or "
            f"splits/block_n/warps/stages[/balance[/prefetch]] ({exc})"
        ) from None


def context_lengths(batch: int, context: int, layout: str) -> list[int]:
    """Per-row contexts: ``uniform`` all ``context``; ``skewed`` row 0 ``context`` and the
    others ``max(1, context // 32)``. ValueError naming ``layout`` otherwise."""
    if layout == "uniform":
        return [context] * batch
    if layout == "skewed":
        return [context] + [max(1, context // 32)] * (batch - 1)
    raise ValueError(f"layout must be uniform or skewed, got {layout!r}")


def decode_read_bytes(seq_lens: list[int], hq: int, hkv: int, head_dim: int, elt: int) -> int:
    """Bytes one decode attention call moves at least: K and V of every context token of
    every KV head (``2 * sum(seq_lens) * hkv * head_dim * elt``), the queries read and the
    output written (``2 * len(seq_lens) * hq * head_dim * elt``)."""
    return elt * head_dim * (2 * sum(seq_lens) * hkv + 2 * len(seq_lens) * hq)


def _pool(seq_lens, page_size, hkv, d, dtype, device, order, seed=0):
    """A K/V pool with scattered pages: (k_cache, v_cache ``[P, ps, Hkv, D]`` views, page
    tables)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(need) + 1
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n])
        used += n
    if order == "page_major":
        pool = torch.randn(num_pages, 2, hkv, page_size, d, device=device).to(dtype)
        k_cache, v_cache = (pool[:, i].permute(0, 2, 1, 3) for i in (0, 1))
    else:
        pool = torch.randn(2, num_pages, page_size, hkv, d, device=device).to(dtype)
        k_cache, v_cache = pool[0], pool[1]
    return k_cache, v_cache, tables


def _time_calls(fn, device, iters: int) -> float:
    """Seconds per call of ``fn``: on CUDA ``iters`` calls in one graph, median of 5 replays;
    elsewhere a loop of ``iters`` calls."""
    import torch

    fn()  # compiles, allocates the plan's scratch
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm on the side stream, as graph capture asks
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def measure(
    batch: int,
    seq_lens: list[int],
    config_spec: Any,
    *,
    hq: int,
    hkv: int,
    head_dim: int,
    page_size: int,
    dtype,
    device,
    order: str,
    iters: int,
) -> dict[str, Any]:
    """One row: the decode configuration ``config_spec`` (see :func:`parse_config`) over
    contexts ``seq_lens``; its time per call, bytes, and max abs difference from
    ``torch_sdpa``."""
    import torch

    from pdserve.engine.worker.cuda_graph import pick_graph
    from pdserve.model.attention import build_attention_metadata, get_attention_backend
    from pdserve.model.triton_backend import TritonPlan, decode_config, device_picks

    k_cache, v_cache, tables = _pool(seq_lens, page_size, hkv, head_dim, dtype, device, order)
    md = build_attention_metadata([1] * batch, seq_lens, tables, page_size, device=device)
    q = torch.randn(batch, hq, head_dim, device=device).to(dtype)
    kv_new = torch.empty(batch, hkv, head_dim, device=device, dtype=dtype)  # not read
    tri = get_attention_backend("triton")
    picks = device_picks(device, hq // hkv, head_dim)  # the engine's measured picks
    if config_spec == "eager":
        cfg = decode_config(batch, hkv, page_size, max(seq_lens), sum(seq_lens), picks)
    elif config_spec == "graph":
        bound = pick_graph(batch, tri.capture_context_bounds(batch, hkv), max(seq_lens))[1]
        cfg = decode_config(batch, hkv, page_size, bound, None, picks)
    else:
        cfg = config_spec
    plan = TritonPlan(decode=True, max_seq_len=max(seq_lens), max_q_len=1, config=cfg)
    scale = head_dim**-0.5

    def call():
        return tri.forward(q, kv_new, kv_new, k_cache, v_cache, md, plan, scale, kv_stored=True)

    out = call()
    sdpa = get_attention_backend("torch_sdpa")
    ref = sdpa.forward(
        q,
        kv_new,
        kv_new,
        k_cache.contiguous(),
        v_cache.contiguous(),
        md,
        sdpa.plan(md, page_size),
        scale,
        kv_stored=True,
    )
    err = (out.float() - ref.float()).abs().max().item()
    seconds = _time_calls(call, device, iters)
    nbytes = decode_read_bytes(seq_lens, hq, hkv, head_dim, q.element_size())
    return {
        "batch": batch,
        "seq_lens_sum": sum(seq_lens),
        "max_seq_len": max(seq_lens),
        "config_spec": config_spec if isinstance(config_spec, str) else "given",
        "splits": cfg.splits,
        "block_n": cfg.block_n,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "min_split": cfg.min_split,
        "balance": cfg.balance,
        "prefetch": cfg.prefetch,
        "us_per_call": seconds * 1e6,
        "bytes": nbytes,
        "bytes_per_s": nbytes / seconds,
        "max_abs_diff_vs_sdpa": err,
    }


def run_attention(args: argparse.Namespace) -> int:
    """Run the sweep, print a table, optionally write JSON; 2 on bad arguments."""
    import torch

    from pdserve.bench.roofline import copy_bandwidth
    from pdserve.engine.kv.layout import default_page_size

    try:
        batches = int_list(args.batch, 1, name="batch")
        contexts = int_list(args.context, 1, name="context")
        layouts = [x for x in args.layout.split(",") if x]
        for layout in layouts:
            context_lengths(1, 1, layout)
        configs = [parse_config(x) for x in args.configs.split(",") if x]
        if not configs:
            raise ValueError("configs: none given")
        if args.num_heads % args.num_kv_heads:
            raise ValueError("--num-heads must be a multiple of --num-kv-heads")
        if args.iters < 1:
            raise ValueError(f"--iters must be >= 1, got {args.iters}")
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: {args.dtype!r} is not a torch dtype")
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda is not available here")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"device: {device.type} cannot run it: the Triton decode kernel this times "
                "needs CUDA (a CPU runs it only under Triton's interpreter, "
                "TRITON_INTERPRET=1, as the tests do: correct, not a timing)"
            )
    except ValueError as exc:
        print(f"pdserve bench attention: {exc}", file=sys.stderr)
        return 2
    page_size = args.page_size or default_page_size(device)
    bandwidth = copy_bandwidth(device)
    print(
        f"device {device}  dtype {dtype}"
        f"  heads {args.num_heads}/{args.num_kv_heads}x{args.head_dim}"
        f"  page size {page_size}  kv order {args.kv_order}"
        f"  copy bandwidth (read+write) {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'batch':>5} {'context':>7} {'layout':>7} {'config':>6} {'splits':>6} {'bn/w/st':>8}"
        f" {'us/call':>9} {'MB':>8} {'GB/s':>7} {'fraction':>8} {'err':>8}"
    )
    rows = []
    for batch in batches:
        for context in contexts:
            for layout in layouts:
                lens = context_lengths(batch, context, layout)
                for spec in configs:
                    try:
                        row = measure(
                            batch,
                            lens,
                            spec,
                            hq=args.num_heads,
                            hkv=args.num_kv_heads,
                            head_dim=args.head_dim,
                            page_size=page_size,
                            dtype=dtype,
                            device=device,
                            order=args.kv_order,
                            iters=args.iters,
                        )
                    except Exception as exc:  # noqa: BLE001 - one failing shape: the sweep goes on
                        print(f"{batch:>5} {context:>7} {layout:>7} failed: {exc!r}")
                        rows.append({"batch": batch, "context": context, "error": repr(exc)})
                        continue
                    row["context"] = context
                    row["layout"] = layout
                    row["fraction"] = row["bytes_per_s"] / bandwidth
                    rows.append(row)
                    tiles = f"{row['block_n']}/{row['num_warps']}/{row['num_stages']}"
                    print(
                        f"{batch:>5} {context:>7} {layout:>7} {row['config_spec']:>6} "
                        f"{row['splits']:>6} {tiles:>8} {row['us_per_call']:>9.1f} "
                        f"{row['bytes'] / 1e6:>8.1f} {row['bytes_per_s'] / 1e9:>7.1f} "
                        f"{row['fraction']:>8.0%} {row['max_abs_diff_vs_sdpa']:>8.1e}"
                    )
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    if args.json:
        report = {
            "benchmark": "attention",
            "device": str(device),
            "dtype": str(dtype),
            "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads,
            "head_dim": args.head_dim,
            "page_size": page_size,
            "kv_order": args.kv_order,
            "iters": args.iters,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "bytes": "K and V of every context token and KV head + queries + output",
            "fraction": "(bytes / time per call) / copy bandwidth (read+write)",
            "rows": rows,
        }
        write_json(args.json, report)
    return 0 if all("error" not in r for r in rows) else 1
