"""The decode process of ``bench transfer`` (spawned by :func:`~.transfer.run_transfer_bench`):
its own pool and decode KV manager, a receiver per room the parent asks for, the raw-NIXL
target (:class:`~.transfer_raw.RawSide`), and digests of its pages; and how often either
process polls a room (:data:`POLL_S`).
"""

from __future__ import annotations

import threading
import time

from pdserve.bench.transfer_pool import TransferBenchConfig, make_pool, pages_digest

# How often the harness polls a room (both processes). Not a spin, and not often: on a
# 2-core machine each wake-up costs CPU the copy needs (CMA copies run inside prefill's
# post): a spinning harness cost the managed row 0.70-0.75 of raw NIXL, and a
# time.sleep(1e-4) costs ~13 us CPU a wake-up. The rows are the managers' own records,
# so the harness's cadence adds nothing to them. Decode's harness waits as an idle
# engine does (pdserve/server/serving.py): woken by the manager (``set_wakeup``) when
# the room ends, else after POLL_S.
POLL_S = 1e-3


def decode_main(conn, cfg: TransferBenchConfig, host: str, port: int) -> None:
    """Decode process: a receiver per room asked for (onto the pages given), the raw
    NIXL target, digests of pages."""
    from pdserve.bench.transfer_raw import RawSide
    from pdserve.disagg.base import KVPoll, Role
    from pdserve.disagg.registry import create_kv_manager
    from pdserve.disagg.transfer_config import TransferConfig

    try:
        kv, aux, args = make_pool(cfg)
        transfer_cfg = TransferConfig.from_env(Role.DECODE)  # this process's edge
        mgr = create_kv_manager("nixl", args, Role.DECODE, transfer_cfg)
        woken = threading.Event()
        mgr.set_wakeup(woken.set)
        conn.send(("ok", None))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    raw = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "room":
            room, pages = arg
            r = mgr.create_receiver(host, port, room)
            while r.poll() < KVPoll.WaitingForInput and r.poll() != KVPoll.Failed:
                time.sleep(0.0005)
            if r.poll() != KVPoll.Failed:
                r.init(pages, 0)
            while True:
                woken.clear()  # before the look: a room ending after it keeps it set
                if r.poll() in (KVPoll.Success, KVPoll.Failed):
                    break
                woken.wait(POLL_S)  # no spin: see POLL_S
            polled_at = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            done_at = getattr(r, "finished_at", None) or polled_at  # the manager's own record
            read_at = getattr(r, "notif_read_at", 0.0) or done_at
            state, error = r.poll().name, str(r.failure_exception() or "")
            conn.send((state, error, done_at, polled_at, read_at))
            r.close()
        elif cmd == "raw":
            raw = RawSide(args, Role.DECODE, arg, transfer_cfg.agent)
            raw.serve()  # the target progresses
            conn.send((raw.metadata(), raw.desc()))
        elif cmd == "digest":
            conn.send(pages_digest(cfg, kv, arg))
        else:  # quit: every thread of ours joined, so none is inside NIXL at exit
            if raw is not None:
                raw.close()
            mgr.shutdown()
            others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            conn.send(("bye", others))
            return
