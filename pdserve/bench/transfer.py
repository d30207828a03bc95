"""``pdserve bench transfer``: one request's KV cache, prefill -> decode over NIXL in two
processes through the real KV managers, against a contiguous copy of the same bytes in
one process (numpy ``copyto`` on CPU, ``torch`` device-to-device ``copy_`` on CUDA).

The pools are laid out like the engine's, by the same :class:`~pdserve.engine.kv_layout.KVCacheLayout`
(``--kv-order``: ``layer_major`` or ``page_major``); the request's
pages are scattered over the pool (runs of ``--run-len`` consecutive pages, shuffled) on
both sides. The transfer time is ``send()`` until the sender polls ``Success`` (NIXL
reports every WRITE done in decode's memory). The two sides run interleaved,
``--repeats`` times after a warm-up; medians, GB/s (1e9 bytes/s) and their ratio are
reported (BENCHMARKS.md). Decode's pages are checked byte for byte (a hash) at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

# (num_layers, num_kv_heads, head_dim) of public model configs.
MODEL_SHAPES = {
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (80, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "qwen3-8b": (36, 8, 128),
    "smollm2-135m": (30, 3, 64),
}
_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class TransferBenchConfig:
    """One benchmark run; ValueError naming the field when invalid."""

    model_shape: str = "llama-3.1-8b"
    prompt_len: int = 1024
    page_size: int = 16
    dtype: str = "bfloat16"
    device: str = "cpu"
    gpu_id: int = 0
    repeats: int = 7
    run_len: int = 1
    pool_factor: int = 2
    seed: int = 0
    hugepages: bool = True
    kv_order: str = "page_major"

    def __post_init__(self) -> None:
        if self.model_shape not in MODEL_SHAPES:
            raise ValueError(
                f"model_shape must be one of {sorted(MODEL_SHAPES)}, got {self.model_shape!r}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        for name in ("prompt_len", "page_size", "repeats", "run_len", "pool_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_id < 0:
            raise ValueError(f"gpu_id must be >= 0, got {self.gpu_id}")
        from pdserve.engine.kv_layout import check_order

        check_order(self.kv_order)

    @property
    def num_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.num_pages * self.pool_factor


def _layout(cfg: TransferBenchConfig):
    """The :class:`~pdserve.engine.kv_layout.KVCacheLayout` of both sides' pools."""
    import torch

    from pdserve.engine.kv_layout import KVCacheLayout

    layers, heads, dim = MODEL_SHAPES[cfg.model_shape]
    return KVCacheLayout(
        cfg.kv_order, layers, heads, dim, cfg.page_size, cfg.pool_pages, getattr(torch, cfg.dtype)
    )


def _pool(cfg: TransferBenchConfig):
    """``(kv, aux uint8[4, AUX], KVArgs)`` on the configured device, laid out by :func:`_layout`."""
    import torch

    from pdserve.disagg.base import AUX_RECORD_BYTES, KVArgs

    lay = _layout(cfg)
    device = torch.device(cfg.device, cfg.gpu_id) if cfg.device == "cuda" else torch.device("cpu")
    if cfg.device == "cpu" and not cfg.hugepages:
        kv = torch.zeros(lay.shape, dtype=lay.dtype)
    else:
        kv = lay.allocate(device)
    aux = torch.zeros(4, AUX_RECORD_BYTES, dtype=torch.uint8)
    regions = lay.regions(kv)
    args = KVArgs(
        tuple(r[0] for r in regions),
        tuple(r[1] for r in regions),
        tuple(r[2] for r in regions),
        aux.data_ptr(),
        aux.numel(),
        AUX_RECORD_BYTES,
        lay.fingerprint(f"bench:{cfg.model_shape}"),
        device=cfg.device,
        gpu_id=cfg.gpu_id,
    )
    return kv, aux, args


def scattered_pages(num_pages: int, pool_pages: int, run_len: int, seed: int) -> list[int]:
    """``num_pages`` distinct page ids of a ``pool_pages`` pool: runs of ``run_len``
    consecutive ids at shuffled, non-adjacent places."""
    import random

    starts = list(range(0, pool_pages - run_len + 1, run_len + 1)) or [0]
    random.Random(seed).shuffle(starts)
    pages: list[int] = []
    for s in starts:
        pages.extend(range(s, min(s + run_len, pool_pages)))
        if len(pages) >= num_pages:
            return pages[:num_pages]
    raise ValueError(f"pool_factor too small for {num_pages} pages in runs of {run_len}")


def _digest(cfg: TransferBenchConfig, kv, pages: list[int]) -> str:
    data = _layout(cfg).pages(kv, pages).contiguous().view(-1).view(__import__("torch").uint8)
    data = data.cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def _decode_main(conn, cfg: TransferBenchConfig, pages: list[int], host: str, port: int) -> None:
    """Decode process: one receiver per room asked for, onto ``pages``."""
    from pdserve.disagg.base import KVPoll
    from pdserve.disagg.registry import create_kv_manager

    try:
        kv, aux, args = _pool(cfg)
        mgr = create_kv_manager("nixl", args, "decode")
        conn.send(("ok", None))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        cmd, arg = conn.recv()
        if cmd == "room":
            r = mgr.create_receiver(host, port, arg)
            while r.poll() < KVPoll.WaitingForInput and r.poll() != KVPoll.Failed:
                time.sleep(0.0005)
            if r.poll() != KVPoll.Failed:
                r.init(pages, 0)
            while r.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0005)
            conn.send((r.poll().name, str(r.failure_exception() or "")))
            r.close()
        elif cmd == "digest":
            conn.send(_digest(cfg, kv, pages))
        else:
            mgr.shutdown()
            conn.send("bye")
            return


def run_transfer_bench(cfg: TransferBenchConfig, log=print) -> dict:
    """Run the benchmark; returns the results dict (also what ``--json`` writes).
    RuntimeError when a transfer fails or decode's bytes differ."""
    import numpy as np
    import torch

    from pdserve.disagg.base import AuxRecord, KVPoll
    from pdserve.disagg.registry import create_kv_manager

    kv, aux, args = _pool(cfg)
    kv.view(torch.uint8).random_(generator=torch.Generator(kv.device).manual_seed(cfg.seed))
    src = scattered_pages(cfg.num_pages, cfg.pool_pages, cfg.run_len, cfg.seed + 1)
    dst = scattered_pages(cfg.num_pages, cfg.pool_pages, cfg.run_len, cfg.seed + 2)
    nbytes = cfg.num_pages * sum(args.kv_item_lens)
    prefill = create_kv_manager(
        "nixl", args, "prefill", bootstrap_host="127.0.0.1", bootstrap_port=0
    )
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(
        target=_decode_main,
        args=(child_conn, cfg, dst, "127.0.0.1", prefill.bootstrap_port),
        daemon=True,
    )
    child.start()
    if cfg.device == "cuda":
        ref_src = torch.empty(nbytes, dtype=torch.uint8, device=kv.device).random_()
        ref_dst = torch.empty_like(ref_src)

        def copy() -> float:
            torch.cuda.synchronize(kv.device)
            t = time.perf_counter()
            ref_dst.copy_(ref_src)
            torch.cuda.synchronize(kv.device)
            return time.perf_counter() - t
    else:
        host_src = np.random.default_rng(cfg.seed).integers(0, 256, nbytes, dtype=np.uint8)
        host_dst = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults in the timing

        def copy() -> float:
            t = time.perf_counter()
            np.copyto(host_dst, host_src)
            return time.perf_counter() - t

    def transfer(room: int) -> float:
        conn.send(("room", room))
        s = prefill.create_sender(room)
        while s.poll() == KVPoll.Bootstrapping:
            time.sleep(0.0005)
        if s.poll() == KVPoll.WaitingForInput:
            s.init(len(src), 0)
            t = time.perf_counter()
            s.send(src, AuxRecord(room, 1, -0.5))
            while s.poll() == KVPoll.Transferring:
                time.sleep(0.0001)
            elapsed = time.perf_counter() - t
        state, error = s.poll(), s.failure_exception()
        s.close()
        d_state, d_error = conn.recv()
        if state != KVPoll.Success or d_state != "Success":
            raise RuntimeError(
                f"transfer of room {room} failed: prefill {state.name} {error or ''}; "
                f"decode {d_state} {d_error}"
            )
        return elapsed

    try:
        status, detail = (
            conn.recv() if conn.poll(120) else ("error", "decode did not start within 120 s")
        )
        if status != "ok":
            raise RuntimeError(f"decode process: {detail}")
        transfer(1)  # warm-up: connection, registration caches
        copy()
        times: dict[str, list[float]] = {"nixl": [], "copy": []}
        for i in range(cfg.repeats):
            order = (("nixl", lambda i=i: transfer(100 + i)), ("copy", copy))
            for name, fn in order if i % 2 == 0 else order[::-1]:
                times[name].append(fn())
        conn.send(("digest", None))
        ok = conn.recv() == _digest(cfg, kv, src)
        conn.send(("quit", None))
        conn.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        prefill.shutdown()
    if not ok:
        raise RuntimeError("decode's pages differ from prefill's after the transfer")
    med = {k: statistics.median(v) for k, v in times.items()}
    runs = sum(1 for i, p in enumerate(src) if i == 0 or p != src[i - 1] + 1)
    result = {
        "config": asdict(cfg),
        "bytes": nbytes,
        "pages": cfg.num_pages,
        "buffers": len(args.kv_data_ptrs),
        "page_bytes_per_buffer": args.kv_item_lens[0],
        "source_page_runs": runs,
        "data_checked": ok,
        "median_s": med,
        "gbps": {k: nbytes / v / 1e9 for k, v in med.items()},
        "ratio": med["copy"] / med["nixl"],
        "times_s": times,
        "host": platform.node(),
        "env": {
            k: v
            for k, v in __import__("os").environ.items()
            if k.startswith(("PDSERVE_", "UCX_", "NIXL_"))
        },
    }
    return result


def _print(result: dict) -> None:
    c = result["config"]
    layers, heads, dim = MODEL_SHAPES[c["model_shape"]]
    print(
        f"KV transfer: {c['model_shape']} (L={layers}, Hkv={heads}, D={dim}), {c['dtype']}, prompt "
        f"{c['prompt_len']} tokens, page {c['page_size']} -> {result['pages']} pages x {result['buffers']} buffers "
        f"of {result['page_bytes_per_buffer']} B ({c['kv_order']}) = {result['bytes'] / 2**20:.1f} MiB on {c['device']}; "
        f"pages scattered in runs of {c['run_len']} ({result['source_page_runs']} runs); "
        f"{'huge' if c['hugepages'] and c['device'] == 'cpu' else 'default'} host pages; "
        f"{c['repeats']} interleaved repeats, medians"
    )
    for name, label in (
        ("nixl", "NIXL WRITE, prefill -> decode (2 processes)"),
        ("copy", "contiguous copy, 1 process (reference)"),
    ):
        print(
            f"  {label:<46} {result['median_s'][name] * 1e3:9.2f} ms {result['gbps'][name]:8.2f} GB/s"
        )
    print(f"  ratio NIXL / copy: {result['ratio']:.2f}   data checked: {result['data_checked']}")


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = TransferBenchConfig(
            args.model_shape,
            args.prompt_len,
            args.page_size,
            args.dtype,
            args.device,
            args.gpu_id,
            args.repeats,
            args.run_len,
            args.pool_factor,
            args.seed,
            args.hugepages,
            args.kv_order,
        )
    except ValueError as exc:
        print(f"pdserve bench transfer: error: {exc}", file=sys.stderr)
        return 2
    result = run_transfer_bench(cfg)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench transfer``."""
    d = TransferBenchConfig()
    p = subparsers.add_parser(
        "transfer",
        help="KV transfer over NIXL vs an in-process copy: GB/s and ratio",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model-shape", default=d.model_shape, choices=sorted(MODEL_SHAPES))
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="tokens of the request")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    p.add_argument("--dtype", default=d.dtype, choices=_DTYPES)
    p.add_argument("--device", default=d.device, choices=("cpu", "cuda"))
    p.add_argument(
        "--gpu-id", type=int, default=d.gpu_id, help="CUDA index of both processes' pools"
    )
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument(
        "--run-len",
        type=int,
        default=d.run_len,
        help="consecutive pages per run of the scattered page list (1 = every page apart)",
    )
    p.add_argument(
        "--pool-factor", type=int, default=d.pool_factor, help="pool pages / request pages"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--hugepages",
        action=argparse.BooleanOptionalAction,
        default=d.hugepages,
        help="CPU pools on transparent huge pages (pdserve.disagg.hostmem)",
    )
    p.add_argument(
        "--kv-order",
        default=d.kv_order,
        help="physical order of both pools: layer_major or page_major (pdserve.engine.kv_layout)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    p.set_defaults(func=_run)
