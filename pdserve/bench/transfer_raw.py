"""The reference rows of ``bench transfer`` that do not go through pdserve's managers:
the *raw NIXL* WRITE (:class:`RawSide`: the same bytes between the same two processes, one
descriptor, NIXL alone, on each side's own agent) and the contiguous copy of the same
number of bytes in one process (:func:`contiguous_copy`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class RawSide:
    """One process's side of the raw-NIXL row: its own agent (the managers' settings:
    ``create_agent``) with one contiguous buffer of ``nbytes`` registered on the pool's
    device.  ``role``: ``prefill`` (initiator) or ``decode`` (target); ``spec``: the
    agent's :class:`~pdserve.disagg.transfer_config.NixlInitSpec` (the managers')."""

    def __init__(self, args: Any, role: str, nbytes: int, spec: Any) -> None:
        import torch

        from pdserve.disagg.nixl.agent.api import load_nixl_api
        from pdserve.disagg.nixl.agent.init import create_agent, device_type

        on_gpu = device_type(args) != "cpu"
        device = torch.device("cuda", args.gpu_id) if on_gpu else torch.device("cpu")
        if on_gpu:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        else:  # like the pools: on huge pages (disagg/hostmem.py)
            from pdserve.disagg.hostmem import empty_host

            self.buf = empty_host((nbytes,), torch.uint8).fill_(1)
        self.mem = "VRAM" if on_gpu else "DRAM"
        self.dev = args.gpu_id if on_gpu else 0
        self.agent = create_agent(load_nixl_api(), f"bench-raw-{role}", args, role, spec)
        self.reg = self.agent.register_memory(
            [(self.buf.data_ptr(), nbytes, self.dev, "")], self.mem
        )
        self.handle = None
        self.small = None
        self._lists: tuple = ()
        self._stop = threading.Event()
        self._server: threading.Thread | None = None

    def desc(self) -> tuple[int, int, int]:
        return (self.buf.data_ptr(), self.buf.numel(), self.dev)

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def connect(
        self, metadata: bytes, remote_desc: tuple[int, int, int], small_bytes: int = 0
    ) -> None:
        """Initiator: load the target and prepare the one-descriptor WRITE of the whole
        buffer, and of its first ``small_bytes`` (the one-page reference), once."""
        import numpy as np

        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        rows = lambda d: np.asarray([d], dtype=np.int64)  # noqa: E731 - (addr, len, dev)
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(self.desc()), self.mem)
        remote = self.agent.prep_xfer_dlist(name, rows(remote_desc), self.mem)
        self._lists = (local, remote)
        self.agent.make_connection(name)
        self.handle = self.agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
        if small_bytes:
            head = lambda d: (d[0], small_bytes, d[2])  # noqa: E731
            lists = (
                self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(head(self.desc())), self.mem),
                self.agent.prep_xfer_dlist(name, rows(head(remote_desc)), self.mem),
            )
            self._lists += lists
            self.small = self.agent.make_prepped_xfer("WRITE", lists[0], [0], lists[1], [0])

    def write(self, small: bool = False) -> float:
        """Post the WRITE (of the first ``small_bytes`` when ``small``) and busy-poll it to
        ``DONE``; seconds."""
        handle = self.small if small else self.handle
        t = time.perf_counter()
        self.agent.transfer(handle)
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            pass
        if state != "DONE":
            raise RuntimeError(f"raw NIXL WRITE ended in {state}")
        return time.perf_counter() - t

    def serve(self) -> None:
        """Target: progress the agent every millisecond (wire-up) on a thread of its own,
        until :meth:`close`."""

        def loop() -> None:
            while not self._stop.wait(0.001):
                self.agent.get_new_notifs()

        self._server = threading.Thread(target=loop, name="bench-raw-serve", daemon=True)
        self._server.start()

    def close(self) -> None:
        """Stop and join the serving thread, then release the handles, lists and memory.

        Why: a thread still inside NIXL when the interpreter exits is ended by
        ``pthread_exit`` while it unwinds through NIXL's C++ frames, and the process
        aborts with "terminate called without an active exception" (exit code 134)."""
        self._stop.set()
        if self._server is not None:
            self._server.join()
            self._server = None
        for h in (self.handle, self.small):
            if h is not None:
                self.agent.release_xfer_handle(h)
        self.handle = self.small = None
        for lst in self._lists:
            lst.release()
        self._lists = ()
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None


def contiguous_copy(device: Any, nbytes: int, seed: int) -> Callable[[], float]:
    """The copy row: a function that copies ``nbytes`` bytes (uint8) from one buffer into
    another on ``device`` (a ``torch.device``: numpy ``copyto`` on the host, ``torch``
    device-to-device ``copy_`` on CUDA, synchronized before and after) and returns the
    seconds it took."""
    import numpy as np
    import torch

    if device.type == "cuda":
        ref_src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
        ref_dst = torch.empty_like(ref_src)

        def copy() -> float:
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            ref_dst.copy_(ref_src)
            torch.cuda.synchronize(device)
            return time.perf_counter() - t
    else:
        host_src = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        host_dst = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults in the timing

        def copy() -> float:
            t = time.perf_counter()
            np.copyto(host_dst, host_src)
            return time.perf_counter() - t

    return copy
