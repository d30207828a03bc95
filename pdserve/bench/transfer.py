"""``pdserve bench transfer``: one request's KV cache, prefill -> decode over NIXL in two
processes through the real KV managers, against a contiguous copy of the same bytes in
one process (numpy ``copyto`` on CPU, ``torch`` ``copy_`` on CUDA).

Rows, interleaved ``--repeats`` times after a warm-up (medians, GB/s and their ratio):
the request through the managers, a *raw NIXL* WRITE of the same bytes between the same
two processes, the contiguous copy, and a one-page request beside a raw one-page WRITE
(their difference: the transfer layer's *fixed cost* per request). The pools are laid out
like the engine's (:class:`~pdserve.engine.kv.layout.KVCacheLayout`, ``--kv-order``), the
request's pages scattered over them (``--run-len``, or ``--pattern served``). The
transfer time runs from ``send()`` until the room is a ``Success`` on prefill (the
manager's ``transfer_latency_seconds``) and until decode's manager made it one (its
``finished_at``), and until decode's harness, waiting as an idle engine does (woken by
the manager's ``set_wakeup``, else every ``POLL_S``), saw it: the ``*_polled`` rows. The
WRITE is made ahead (``KVSender.expect_pages``), so the timed ``send`` only posts it.
``stages_s``: medians of each step of a request's path, ``send`` -> WRITEs posted -> seen
done on prefill -> prefill ``Success`` -> ``XferDone`` sent -> read by decode's
notification thread -> decode ``Success`` -> its harness woken (the rooms' own
timestamps, ``perf_counter`` in both processes). Decode's pages are checked byte for
byte (a hash) at the end. ``--ab-env NAME=VALUE``: every repeat also runs the request and
the one-page request with ``NAME=VALUE`` in this (prefill's) process's environment while
each room's sender is created (a setting a room reads then, e.g.
``PDSERVE_DISAGGREGATION_PLANNED_POST``), each right beside its plain row, which of the
two first flipping every second repeat: the ``ab`` rows.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from pdserve.bench.cli import write_json
from pdserve.bench.transfer_decode import POLL_S, decode_main
from pdserve.bench.transfer_pool import (
    DTYPES,
    MODEL_SHAPES,
    TransferBenchConfig,
    make_pool,
    pages_digest,
    pool_layout,
)
from pdserve.cli import Flag, add_flags, flag_values

BOOTSTRAP_WAIT_S = 120.0
# a request's path, stage by stage (each from the end of the one before): send() until its
# WRITEs are posted, until prefill saw them done, prefill's room a Success, XferDone sent,
# read by decode's notification thread, decode's room a Success, decode's harness woken
STAGES = ("post", "write", "success", "notify", "notif_read", "decode_success", "wake")


def wait_bootstrapped(sender, room: int, wait_s: float = BOOTSTRAP_WAIT_S) -> None:
    """Poll ``sender`` (a :class:`~pdserve.disagg.base.KVSender`) while it is
    ``Bootstrapping``; after ``wait_s`` seconds abort it and raise RuntimeError naming the room."""
    from pdserve.disagg.base import KVPoll

    deadline = time.monotonic() + wait_s
    while sender.poll() == KVPoll.Bootstrapping:
        if time.monotonic() > deadline:
            sender.abort()
            raise RuntimeError(f"room {room}: decode did not bootstrap within {wait_s:g} s")
        time.sleep(0.0005)


@contextlib.contextmanager
def env_set(assignment: str | None):
    """``NAME=VALUE`` set in ``os.environ`` inside the block (nothing for None), restored
    after."""
    if not assignment:
        yield
        return
    name, _, value = assignment.partition("=")
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def in_turn(*steps: Callable[[], None]) -> Callable[[], None]:
    """One step that runs ``steps`` in order."""

    def run() -> None:
        for step in steps:
            step()

    return run


def run_transfer_bench(cfg: TransferBenchConfig, log=print) -> dict:
    """Run the benchmark; returns the results dict (also what ``--json`` writes).
    RuntimeError when a transfer fails or decode's bytes differ."""
    import torch

    from pdserve.bench.transfer_pages import page_lists
    from pdserve.bench.transfer_raw import RawSide, contiguous_copy
    from pdserve.disagg.base import AuxRecord, KVPoll, Role
    from pdserve.disagg.registry import create_kv_manager
    from pdserve.disagg.transfer_config import TransferConfig
    from pdserve.engine.kv.cache import paired_runs

    kv, aux, args = make_pool(cfg)
    lay = pool_layout(cfg)
    kv.view(torch.uint8).random_(generator=torch.Generator(kv.device).manual_seed(cfg.seed))
    src, dst, one_src, one_dst = page_lists(
        cfg.pattern, cfg.num_pages, cfg.pool_pages, cfg.run_len, cfg.seed
    )
    nbytes = cfg.num_pages * lay.page_bytes
    # this process's edge: the managers' settings from the environment, as a worker's
    transfer_cfg = TransferConfig.from_env(Role.PREFILL, bootstrap_host="127.0.0.1")
    prefill = create_kv_manager("nixl", args, Role.PREFILL, transfer_cfg)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(
        target=decode_main,
        args=(child_conn, cfg, "127.0.0.1", prefill.bootstrap_port),
        daemon=True,
    )
    child.start()
    copy = contiguous_copy(kv.device, nbytes, cfg.seed)

    def latency() -> tuple[float, int]:
        lat = prefill.stats()["transfer_latency_seconds"]
        return lat["sum"], lat["count"]

    def transfer(
        room: int, src: list[int] = src, dst: list[int] = dst, env: str | None = None
    ) -> tuple[float, float, float, dict[str, float]]:
        """One room through the managers: seconds from ``send`` until the room is a
        ``Success`` on prefill (the manager's own latency record of the room, so the
        harness's polling adds nothing), until decode's manager made it ``Success``
        (its ``finished_at``), and until decode's harness saw it (woken, or its
        ``POLL_S`` poll); and each stage's seconds (:data:`STAGES`). ``env``: a
        ``NAME=VALUE`` set while the sender is created."""
        conn.send(("room", (room, dst)))
        with env_set(env):
            s = prefill.create_sender(room)
        wait_bootstrapped(s, room)
        t = time.perf_counter()
        before = latency()
        if s.poll() == KVPoll.WaitingForInput:
            s.init(len(src), 0)
            s.expect_pages(src)  # the WRITE is made here, before the timed send
            t = time.perf_counter()
            s.send(src, last=True, aux=AuxRecord(room, 1, -0.5))
            while s.poll() == KVPoll.Transferring:
                time.sleep(POLL_S)  # no spin: see POLL_S
        after = latency()
        elapsed = after[0] - before[0] if after[1] == before[1] + 1 else time.perf_counter() - t
        state, error = s.poll(), s.failure_exception()
        s.close()
        d_state, d_error, d_done, d_polled, d_read = conn.recv()
        if state != KVPoll.Success or d_state != "Success":
            raise RuntimeError(
                f"transfer of room {room} failed: prefill {state.name} {error or ''}; "
                f"decode {d_state} {d_error}"
            )
        ours = [getattr(s, k) for k in ("posted_at", "done_at", "finished_at", "notified_at")]
        marks = (t, *ours, d_read, d_done, d_polled)  # a NixlSender's; perf_counter
        stages = {k: b - a for k, a, b in zip(STAGES, marks, marks[1:])}
        return elapsed, d_done - t, d_polled - t, stages

    raw = None
    try:
        status, detail = (
            conn.recv() if conn.poll(120) else ("error", "decode did not start within 120 s")
        )
        if status != "ok":
            raise RuntimeError(f"decode process: {detail}")
        conn.send(("raw", nbytes))
        raw = RawSide(args, Role.PREFILL, nbytes, transfer_cfg.agent)
        metadata, remote_desc = conn.recv()
        raw.connect(metadata, remote_desc, lay.page_bytes)
        transfer(1)  # warm-up: connection, registration caches
        transfer(2, one_src, one_dst)
        raw.write()
        raw.write(small=True)
        copy()
        names = (
            "nixl",
            "nixl_decode",
            "raw_nixl",
            "copy",
            "one_page",
            "one_page_decode",
            "raw_one_page",
            "nixl_decode_polled",
            "one_page_decode_polled",
        )
        times: dict[str, list[float]] = {k: [] for k in names}
        if cfg.ab_env:
            transfer(3, env=cfg.ab_env)  # its warm-up
            transfer(4, one_src, one_dst, env=cfg.ab_env)
        stages: dict[str, dict[str, list[float]]] = {
            k: {s: [] for s in STAGES} for k in ("nixl", "one_page")
        }
        ab_names = ("nixl", "nixl_decode", "one_page", "one_page_decode")
        ab_times: dict[str, list[float]] = {k: [] for k in ab_names}
        ab_stages: dict[str, dict[str, list[float]]] = {
            k: {s: [] for s in STAGES} for k in ("nixl", "one_page")
        }
        for i in range(cfg.repeats):

            def request(i=i) -> None:
                p, d, dp, st = transfer(100 + i)
                times["nixl"].append(p)
                times["nixl_decode"].append(d)
                times["nixl_decode_polled"].append(dp)
                for k, v in st.items():
                    stages["nixl"][k].append(v)

            def one(i=i) -> None:
                p, d, dp, st = transfer(10_000 + i, one_src, one_dst)
                times["one_page"].append(p)
                times["one_page_decode"].append(d)
                times["one_page_decode_polled"].append(dp)
                times["raw_one_page"].append(raw.write(small=True))
                for k, v in st.items():
                    stages["one_page"][k].append(v)

            def ab(row: str, room: int, pages: tuple[list[int], list[int]]) -> Callable[[], None]:
                def run() -> None:
                    p, d, _, st = transfer(room, *pages, env=cfg.ab_env)
                    ab_times[row].append(p)
                    ab_times[f"{row}_decode"].append(d)
                    for k, v in st.items():
                        ab_stages[row][k].append(v)

                return run

            order: list[Callable[[], None]] = [
                request,
                lambda: times["raw_nixl"].append(raw.write()),
                lambda: times["copy"].append(copy()),
                one,
            ]
            if cfg.ab_env:
                # each right beside its own row, as one step of the order; which of the two
                # goes first flips every second repeat (the order itself every repeat), so
                # each comes first, and second, after each neighbour equally often (on CPU
                # the second finds the page in the cache)
                first = (i // 2) % 2 == 0
                pairs = ((0, "nixl", (src, dst)), (3, "one_page", (one_src, one_dst)))
                for at, row, pages in pairs:
                    a, b = order[at], ab(row, 20_000 + 10_000 * at + i, pages)
                    order[at] = in_turn(a, b) if first else in_turn(b, a)
            for fn in order if i % 2 == 0 else order[::-1]:
                fn()
        conn.send(("digest", dst))
        ok = conn.recv() == pages_digest(cfg, kv, src)
        conn.send(("quit", None))
        _, decode_threads = conn.recv()
        raw.close()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(10)
        prefill.shutdown()
    if not ok:
        raise RuntimeError("decode's pages differ from prefill's after the transfer")
    med = {k: statistics.median(v) for k, v in times.items()}
    runs = sum(1 for i, p in enumerate(src) if i == 0 or p != src[i - 1] + 1)
    big = ("nixl", "nixl_decode", "raw_nixl", "copy")
    result = {
        "config": asdict(cfg),
        "bytes": nbytes,
        "pages": cfg.num_pages,
        "buffers": len(args.kv_data_ptrs),
        "page_bytes_per_buffer": args.kv_item_lens[0],
        "source_page_runs": runs,
        "dest_page_runs": sum(1 for i, p in enumerate(dst) if i == 0 or p != dst[i - 1] + 1),
        # descriptors one request posts: page ids x buffers, and after NIXL merges the
        # runs that are consecutive on both sides
        "descriptors_posted": cfg.num_pages * lay.descs_per_page,
        "descriptors_merged": paired_runs(src, dst) * lay.descs_per_page,
        "data_checked": ok,
        # the decode process's end: threads of its own still alive after its managers and
        # raw agent were shut down (none: nothing is inside NIXL at exit), its exit code
        "decode_threads_at_exit": decode_threads,
        "decode_exit_code": child.exitcode,
        "median_s": med,
        "gbps": {k: nbytes / med[k] / 1e9 for k in big},
        "ratio": med["copy"] / med["nixl"],
        "ratio_to_raw_nixl": med["raw_nixl"] / med["nixl"],
        # a one-page request through the managers, the raw one-page WRITE, and what the
        # transfer layer adds to it (until prefill / decode see Success)
        "fixed_cost_s": {
            "prefill": med["one_page"],
            "decode": med["one_page_decode"],
            "raw_one_page": med["raw_one_page"],
            "layer_prefill": med["one_page"] - med["raw_one_page"],
            "layer_decode": med["one_page_decode"] - med["raw_one_page"],
            "decode_polled": med["one_page_decode_polled"],  # + the harness woken (set_wakeup)
        },
        # each stage of a request's path (STAGES), medians: the big request and the one-page one
        "stages_s": {
            k: {s: statistics.median(v) for s, v in per.items()} for k, per in stages.items()
        },
        "times_s": times,
        # --ab-env: the same request and one-page request with NAME=VALUE, in turn with them
        "ab": (
            {
                "env": cfg.ab_env,
                "median_s": {k: statistics.median(v) for k, v in ab_times.items()},
                "ratio": med["copy"] / statistics.median(ab_times["nixl"]),
                "stages_s": {
                    k: {s: statistics.median(v) for s, v in per.items()}
                    for k, per in ab_stages.items()
                },
                "times_s": ab_times,
            }
            if cfg.ab_env
            else None
        ),
        "host": platform.node(),
        "env": {
            k: v
            for k, v in __import__("os").environ.items()
            if k.startswith(("PDSERVE_", "UCX_", "NIXL_"))
        },
    }
    return result


def _print_stages(stages: dict[str, dict[str, float]], indent: str) -> None:
    """One line per row (the request, the one-page request): each stage's median, in us."""
    for k, label in (("nixl", "request"), ("one_page", "one-page")):
        st = stages[k]
        print(
            f"{indent}{label} stages (us, medians): "
            + ", ".join(f"{s} {st[s] * 1e6:.0f}" for s in STAGES)
        )


def _print(result: dict) -> None:
    c = result["config"]
    layers, heads, dim = MODEL_SHAPES[c["model_shape"]]
    print(
        f"KV transfer: {c['model_shape']} (L={layers}, Hkv={heads}, D={dim}), {c['dtype']}, prompt "
        f"{c['prompt_len']} tokens, page {c['page_size']} -> {result['pages']} pages x {result['buffers']} buffers "
        f"of {result['page_bytes_per_buffer']} B ({c['kv_order']}) = {result['bytes'] / 2**20:.1f} MiB on {c['device']}; "
        f"page pattern {c['pattern'] if c['pattern'] == 'served' else 'runs of ' + str(c['run_len'])}; "
        f"{'huge' if c['hugepages'] and c['device'] == 'cpu' else 'default'} host pages; "
        f"{c['repeats']} interleaved repeats, medians"
    )
    for name, label in (
        ("nixl", "NIXL WRITE via the managers, until prefill Success"),
        ("nixl_decode", "  ... until decode's manager sees Success"),
        ("raw_nixl", "raw NIXL WRITE, same bytes, one descriptor"),
        ("copy", "contiguous copy, 1 process (reference)"),
    ):
        print(
            f"  {label:<52} {result['median_s'][name] * 1e3:9.3f} ms "
            f"{result['gbps'][name]:8.2f} GB/s"
        )
    fixed = result["fixed_cost_s"]
    print(
        f"  one-page request ({result['page_bytes_per_buffer'] * result['buffers'] / 2**20:.2f} MiB): "
        f"prefill {fixed['prefill'] * 1e3:.3f} ms, decode {fixed['decode'] * 1e3:.3f} ms; "
        f"raw NIXL WRITE of one page {fixed['raw_one_page'] * 1e3:.3f} ms"
    )
    print(
        f"  fixed cost of a request in the transfer layer (one-page request - raw): "
        f"prefill {fixed['layer_prefill'] * 1e3:.3f} ms, decode {fixed['layer_decode'] * 1e3:.3f} ms"
    )
    _print_stages(result["stages_s"], "  ")
    print(
        f"  descriptors: {result['descriptors_posted']} posted, {result['descriptors_merged']} "
        f"after merging adjacent pages ({result['source_page_runs']} source / "
        f"{result['dest_page_runs']} destination runs)"
    )
    ab = result["ab"]
    if ab is not None:
        m = ab["median_s"]
        print(
            f"  with {ab['env']}: request {m['nixl'] * 1e3:.3f} ms (ratio to copy "
            f"{ab['ratio']:.3f}), decode {m['nixl_decode'] * 1e3:.3f} ms; one page prefill "
            f"{m['one_page'] * 1e3:.3f} ms, decode {m['one_page_decode'] * 1e3:.3f} ms"
        )
        _print_stages(ab["stages_s"], "    ")
    print(
        f"  ratio NIXL / copy: {result['ratio']:.3f}   NIXL / raw NIXL: "
        f"{result['ratio_to_raw_nixl']:.3f}   data checked: {result['data_checked']}"
    )
    if result["decode_exit_code"] != 0 or result["decode_threads_at_exit"]:
        print(
            f"  WARNING: the decode process exited with code {result['decode_exit_code']}, "
            f"threads still alive at its exit: {result['decode_threads_at_exit']}"
        )


# Every flag but --json sets the TransferBenchConfig field of its name (and has its default).
TRANSFER_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--model-shape",
        "layers, KV heads and head size of the KV pools",
        cls=TransferBenchConfig,
        choices=sorted(MODEL_SHAPES),
    ),
    Flag("--prompt-len", "tokens of the request", int, cls=TransferBenchConfig),
    Flag("--page-size", "tokens per KV page", int, cls=TransferBenchConfig),
    Flag("--dtype", "KV cache dtype", cls=TransferBenchConfig, choices=DTYPES),
    Flag("--device", "where both pools live", cls=TransferBenchConfig, choices=("cpu", "cuda")),
    Flag("--gpu-id", "CUDA index of both processes' pools", int, cls=TransferBenchConfig),
    Flag("--repeats", "interleaved timed runs (medians)", int, cls=TransferBenchConfig),
    Flag(
        "--run-len",
        "consecutive pages per run of the scattered page list (1 = every page apart)",
        int,
        cls=TransferBenchConfig,
    ),
    Flag("--pool-factor", "pool pages / request pages", int, cls=TransferBenchConfig),
    Flag("--seed", "seed of the page lists and the KV bytes", int, cls=TransferBenchConfig),
    Flag(
        "--hugepages",
        "CPU pools on transparent huge pages (pdserve.disagg.hostmem)",
        bool,
        cls=TransferBenchConfig,
    ),
    Flag(
        "--kv-order",
        "physical order of both pools: layer_major or page_major (pdserve.engine.kv.layout)",
        cls=TransferBenchConfig,
    ),
    Flag(
        "--pattern",
        "page lists: served = the real allocator's after a churn of mixed-length "
        "requests; runs = runs of --run-len consecutive pages, shuffled",
        cls=TransferBenchConfig,
        choices=("served", "runs"),
    ),
    Flag(
        "--ab-env",
        "PDSERVE_NAME=VALUE: every repeat also runs the request and the one-page request "
        "with it set while each room is created (the ab rows); unset: no ab rows",
        cls=TransferBenchConfig,
        metavar="NAME=VALUE",
    ),
    Flag("--json", "write the results here; unset: not written", metavar="FILE"),
)


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = TransferBenchConfig(**flag_values(args, TRANSFER_FLAGS))
    except ValueError as exc:
        print(f"pdserve bench transfer: error: {exc}", file=sys.stderr)
        return 2
    result = run_transfer_bench(cfg)
    _print(result)
    if args.json:
        write_json(args.json, result, indent=1)
        print(f"wrote {args.json}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench transfer``."""
    p = subparsers.add_parser(
        "transfer",
        help="KV transfer over NIXL vs an in-process copy: GB/s and ratio",
        description=__doc__.split("\n\n")[0],
    )
    add_flags(p, TRANSFER_FLAGS)
    p.set_defaults(func=_run)
