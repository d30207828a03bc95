"""A prefill or decode KV manager in its own process, driven like the engine drives it.

``Peer.start(role, env)`` spawns a process that creates the manager over a small CPU KV
pool (laid out by the engine's ``KVCacheLayout``, in the order ``kv_order`` of the layout
overrides, default page-major; plus aux slots) and then
runs commands sent from the test. ``run`` drives a set of rooms the way the engine does:
create the sender/receiver, poll, take scattered pages when ``WaitingForInput``, ``init``
(and on prefill fill the pages with the room's pattern and ``send``), free the pages after
a terminal poll and ``close()`` once. Decode checks every page byte for byte against the
room's pattern and the aux record; both sides report free pages and live rooms at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
import traceback

import numpy as np
import torch

from pdserve.disagg.base import AUX_RECORD_BYTES, AuxRecord, KVLayout, KVPoll
from pdserve.engine.kv.layout import KVCacheLayout

LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 4, 4, 2, 16  # float32: page_bytes = 4*2*16*4 = 512


def layout(**over) -> KVLayout:
    base = dict(
        model="test-model",
        dtype="float32",
        page_size=PAGE_SIZE,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        kv_order="page_major",
    )
    base.update(over)
    return KVLayout(**base)


def pattern(room: int, index: int, shape) -> np.ndarray:
    """The bytes page ``index`` of ``room`` holds (every layer, K and V), ``uint8`` of ``shape``."""
    return np.random.default_rng([room, index]).integers(0, 256, size=shape, dtype=np.uint8)


def aux_for(room: int) -> AuxRecord:
    return AuxRecord(room, room % 50_000, -0.25, (1, 2, 3), (-0.125, -0.5, -1.0))


class Pool:
    """KV pages + aux slots with the engine's ownership checks (double free raises)."""

    def __init__(self, num_pages: int, num_slots: int, lay: KVLayout, seed: int) -> None:
        self.wakeups = 0  # calls of its manager's set_wakeup callback (an engine's wake-ups)
        dtype = getattr(torch, lay.dtype)
        self.layout = KVCacheLayout(
            lay.kv_order, lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size,
            num_pages, dtype,
        )  # fmt: skip
        self.kv = self.layout.allocate("cpu")
        self.kv_bytes = self.kv.view(torch.uint8)  # the same memory, byte by byte
        self.aux = np.zeros((num_slots, AUX_RECORD_BYTES), dtype=np.uint8)
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages))
        random.Random(seed).shuffle(self.free_pages)  # scattered page ids
        self.free_slots = list(range(num_slots))
        self.quarantined: list = []  # (handle, pages, slot) of failed rooms a peer may write
        self.kept: dict = {}  # room -> (pages, slot) of successful rooms kept for a recheck
        self.kept_skip = 0
        self.args = self.layout.kv_args(self.kv, self.aux.ctypes.data, self.aux.nbytes, lay)

    def page(self, p: int) -> np.ndarray:
        """The bytes of page ``p`` (a copy)."""
        return self.layout.pages(self.kv_bytes, [p]).numpy()

    def fill(self, p: int, data: np.ndarray) -> None:
        self.layout.write_pages(self.kv_bytes, [p], torch.from_numpy(data))

    def take(self, n: int) -> tuple[list[int], int] | None:
        if len(self.free_pages) < n or not self.free_slots:
            return None
        pages = [self.free_pages.pop() for _ in range(n)]
        return pages, self.free_slots.pop()

    def settle(self) -> None:
        """Free the pages of terminal rooms whose quarantine ended (``holds_pages``)."""
        for item in list(self.quarantined):
            h, pages, slot = item
            if not getattr(h, "holds_pages", lambda: False)():
                self.quarantined.remove(item)
                self.give(pages, slot)
                h.close()

    def recheck(self) -> bool:
        """Re-verify the bytes of every kept room, then free them."""
        ok = all(
            np.array_equal(self.page(p), pattern(room, i, self.page(p).shape))
            for room, (pages, _) in self.kept.items()
            for i, p in enumerate(pages, self.kept_skip)
        )
        for pages, slot in self.kept.values():
            self.give(pages, slot)
        self.kept.clear()
        return ok

    def give(self, pages: list[int], slot: int) -> None:
        assert not set(pages) & set(self.free_pages), "double free of a page"
        assert slot not in self.free_slots, "double free of an aux slot"
        self.free_pages.extend(pages)
        self.free_slots.append(slot)


def _drive(
    mgr,
    pool: Pool,
    role: str,
    rooms: dict,
    host: str | None,
    port: int | None,
    send_delay: float,
    limit: float,
    abort_after: dict,
    chunk: int = 0,
    skip: int = 0,
    keep: bool = False,
    expect: bool = False,
) -> dict:
    """Drive ``rooms`` ({room: num_pages}) to terminal states; returns per-room results.
    Prefill: ``chunk`` > 0 sends the pages ``chunk`` at a time (``send(last=False)``, then
    the rest with ``last=True``). Decode: ``skip`` leading pages are declared held
    (``init(..., skip_pages=skip)``) and not checked; ``keep``: successful rooms keep their
    pages for ``Pool.recheck``; ``expect``: prefill hints each room's pages
    (``expect_pages``) right after ``init``. A terminal room whose pages the manager still holds
    (``holds_pages``) goes to ``Pool.quarantined`` instead of being freed."""
    handles, held, results, started = {}, {}, {}, {}
    t0 = time.monotonic()
    for room in rooms:
        handles[room] = (
            mgr.create_sender(room) if role == "prefill" else mgr.create_receiver(host, port, room)
        )
        started[room] = time.monotonic()
    ready_at: dict[int, float] = {}
    while len(results) < len(handles) and time.monotonic() - t0 < limit:
        pool.settle()
        for room, h in handles.items():
            if room in results:
                continue
            if room in abort_after and time.monotonic() - started[room] > abort_after[room]:
                h.abort()
                abort_after.pop(room)
            state = h.poll()
            if state in (KVPoll.Success, KVPoll.Failed):
                res = {
                    "state": state.name,
                    "error": str(h.failure_exception() or ""),
                    "t": time.monotonic() - t0,
                }
                if role == "decode" and state == KVPoll.Success:
                    pages = held[room][0][skip:]
                    res["bytes_ok"] = all(
                        np.array_equal(pool.page(p), pattern(room, i, pool.page(p).shape))
                        for i, p in enumerate(pages, skip)
                    )
                    res["aux_ok"] = h.aux_record() == aux_for(room)
                if room in held and getattr(h, "holds_pages", lambda: False)():
                    pool.quarantined.append((h, *held.pop(room)))
                    res["quarantined"] = True
                elif room in held and keep and state == KVPoll.Success:
                    pool.kept[room], pool.kept_skip = held.pop(room), skip
                    h.close()
                else:
                    if room in held:
                        pool.give(*held.pop(room))
                    h.close()
                results[room] = res
            elif state >= KVPoll.WaitingForInput and room not in held:
                got = pool.take(rooms[room])
                if got is None:
                    continue
                held[room] = got
                pages, slot = got
                if role == "prefill":
                    h.init(len(pages), slot)
                    if expect:
                        h.expect_pages(pages)
                    for i, p in enumerate(pages):
                        pool.fill(p, pattern(room, i, pool.page(p).shape))
                    ready_at[room] = time.monotonic() + send_delay
                else:
                    h.init(pages[skip:], slot, skip_pages=skip)
            if (
                role == "prefill"
                and room in ready_at
                and time.monotonic() >= ready_at[room]
                and h.poll() == KVPoll.WaitingForInput
            ):
                pages, slot = held[room]
                ready_at.pop(room)
                n = 0
                while chunk and len(pages) - n > chunk:
                    h.send(pages[n : n + chunk], last=False)
                    n += chunk
                    time.sleep(0.001)  # the next chunk's "compute"
                h.send(pages[n:], last=True, aux=aux_for(room))
        time.sleep(0.002)
    return results


def _make(
    role: str, env: dict, num_pages: int, num_slots: int, lay_over: dict, seed: int, bport: int = 0
):
    from pdserve.disagg.registry import create_kv_manager
    from pdserve.disagg.transfer_config import TransferConfig

    for key, value in env.items():
        os.environ[key] = value
    pool = Pool(num_pages, num_slots, layout(**lay_over), seed)
    cfg = TransferConfig.from_env(role, bootstrap_port=bport)  # this process's edge
    mgr = create_kv_manager("nixl", pool.args, role, cfg)

    def wakeup() -> None:
        pool.wakeups += 1

    mgr.set_wakeup(wakeup)
    return pool, mgr


def _child(
    conn,
    role: str,
    env: dict,
    num_pages: int,
    num_slots: int,
    lay_over: dict,
    seed: int,
    bport: int,
) -> None:
    try:
        pool, mgr = _make(role, env, num_pages, num_slots, lay_over, seed, bport)
        conn.send(("ok", mgr.bootstrap_port))
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
        return
    runner: dict = {}

    def run(kw: dict) -> None:
        try:
            runner["out"] = ("ok", _drive(mgr, pool, role, **kw))
        except Exception:  # noqa: BLE001
            runner["out"] = ("error", traceback.format_exc())

    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "run":  # driven on a thread so that "state" can be asked meanwhile
                runner.clear()
                runner["thread"] = threading.Thread(target=run, args=(kw,))
                runner["thread"].start()
                out = None
            elif cmd == "result":
                runner["thread"].join()
                conn.send(runner["out"])
                continue
            elif cmd == "state":
                pool.settle()
                out = {
                    "quarantined": len(pool.quarantined),
                    "free_pages": len(pool.free_pages),
                    "num_pages": pool.num_pages,
                    "free_slots": len(pool.free_slots),
                    "live_rooms": mgr.num_live_rooms(),
                    "healthy": mgr.is_healthy(),
                    "stats": mgr.stats(),
                    "wakeups": pool.wakeups,
                }
            elif cmd == "recheck":
                out = pool.recheck()
            elif cmd == "reset":  # a new manager (new env) in this process: no re-import cost
                mgr.shutdown()
                for key in kw.pop("unset", ()):
                    os.environ.pop(key, None)
                pool, mgr = _make(role, **kw)
                out = mgr.bootstrap_port
            elif cmd == "duplicate":
                h = (
                    mgr.create_sender(7)
                    if role == "prefill"
                    else mgr.create_receiver("127.0.0.1", 1, 7)
                )
                try:
                    (
                        mgr.create_sender(7)
                        if role == "prefill"
                        else mgr.create_receiver("127.0.0.1", 1, 7)
                    )
                    out = "no error"
                except Exception as exc:  # noqa: BLE001
                    out = f"{type(exc).__name__}: {exc}"
                h.abort()
                while h.poll().name not in ("Success", "Failed"):
                    time.sleep(0.01)
                h.close()
            elif cmd == "stray_notif":  # decode: an XferDone for a room it does not have
                from pdserve.disagg.wire import encode_xfer_done

                mgr._on_notif(encode_xfer_done(kw["room"], "no-such-prefill", b""))
                out = mgr.stats()
            elif cmd == "break_thread":  # the control thread's next step raises

                def boom(*a, **k):
                    raise RuntimeError("injected crash of a background thread")

                mgr.engine.new_notifs = boom if role == "decode" else mgr.engine.new_notifs
                if role == "prefill":
                    mgr._prune = boom
                out = None
            elif cmd == "quit":
                mgr.shutdown()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(cmd)
            conn.send(("ok", out))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class Peer:
    """Parent-side handle of one manager process."""

    def __init__(
        self,
        role: str,
        env: dict | None = None,
        *,
        num_pages: int = 256,
        num_slots: int = 64,
        layout_over: dict | None = None,
        seed: int = 0,
        wait: bool = True,
        bootstrap_port: int = 0,
    ) -> None:
        self.role = role
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child,
            args=(
                child,
                role,
                dict(env or {}),
                num_pages,
                num_slots,
                layout_over or {},
                seed,
                bootstrap_port,
            ),
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.num_pages, self.num_slots, self.seed = num_pages, num_slots, seed
        self.port = None
        if wait:
            self.wait()

    def wait(self, timeout: float = 90.0) -> Peer:
        """Wait until the manager is up (its bootstrap port is then in ``port``)."""
        self.port = self._reply(timeout)
        return self

    def reset(
        self, env: dict | None = None, *, unset: tuple = (), layout_over: dict | None = None
    ) -> int:
        """Replace the manager (same process) after setting ``env``; returns its bootstrap port."""
        self.port = self.call(
            "reset",
            env=dict(env or {}),
            unset=tuple(unset),
            num_pages=self.num_pages,
            num_slots=self.num_slots,
            lay_over=layout_over or {},
            seed=self.seed,
        )
        return self.port

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} peer did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.role} peer failed:\n{value}")
        return value

    def send(self, cmd: str, **kw) -> None:
        self.conn.send((cmd, kw))

    def call(self, cmd: str, timeout: float = 60.0, **kw):
        self.send(cmd, **kw)
        return self._reply(timeout)

    def run(
        self,
        rooms: dict,
        *,
        host: str | None = "127.0.0.1",
        port: int | None = None,
        send_delay: float = 0.0,
        timeout: float = 30.0,
        abort_after: dict | None = None,
        chunk: int = 0,
        skip: int = 0,
        keep: bool = False,
        expect: bool = False,
    ) -> None:
        """Start driving ``rooms`` ({room: num_pages}); collect with :meth:`result`.
        ``chunk``/``skip``/``keep``/``expect``: see ``_drive``."""
        self.call(
            "run",
            rooms=rooms,
            host=host,
            port=port,
            send_delay=send_delay,
            limit=timeout,
            abort_after=abort_after or {},
            chunk=chunk,
            skip=skip,
            keep=keep,
            expect=expect,
        )

    def result(self, timeout: float = 60.0) -> dict:
        """{room: {"state", "error", "t" (s since start), decode: "bytes_ok", "aux_ok"}}."""
        return self.call("result", timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("quit", timeout=20)
            except Exception:  # noqa: BLE001
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
