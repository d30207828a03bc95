"""Prefill's transfer workers: each takes a room whose ``send`` was called, posts its
WRITEs (KV pages of every buffer, then the aux slot), polls NIXL until every WRITE ended,
and on success notifies decode with a NIXL notification (``XferDone``). The room learns
the outcome through ``NixlSender.transfer_finished`` only when NIXL no longer touches its
pages (a WRITE still running at the deadline is cancelled; until NIXL accepts the
cancellation it keeps being polled).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

from pdserve.disagg.messages import encode_xfer_done
from pdserve.disagg.nixl.agent_init import select_device
from pdserve.disagg.nixl.transfer_engine import NixlTransferEngine

if TYPE_CHECKING:
    from pdserve.disagg.nixl.sender import NixlSender


class TransferWorkers:
    """The job queue and loop shared by the ``transfer-i`` threads of one prefill manager.

    timeout_s: how long a room's WRITEs may run before they are cancelled and the room fails.
    """

    def __init__(self, engine: NixlTransferEngine, instance_id: str, timeout_s: float) -> None:
        self.engine = engine
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, sender: NixlSender) -> None:
        self._jobs.put(sender)

    def loop(self, stop: threading.Event) -> None:
        """One worker thread's body."""
        select_device(self.engine.kv_args)  # the current device is thread-local
        while not stop.is_set():
            try:
                sender = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            sender.transfer_finished(self._transfer(sender))

    def _transfer(self, sender: NixlSender) -> str | None:
        """Post and complete one room's WRITEs; the error, or None on success."""
        if sender.abort_request is not None:
            return None  # aborted before posting: nothing to undo
        dest, peer = sender.dest, sender.peer
        # A sender reaches this queue only once its destination and decode peer are known.
        assert dest is not None and peer is not None and peer.remote is not None
        assert sender.aux_slot is not None
        remote = peer.remote
        try:
            handles = self.engine.post_room_write(
                remote, sender.pages, dest.dst_pages, sender.aux_slot, dest.aux_slot
            )
        except Exception as exc:  # noqa: BLE001 - a NIXL error fails the room, not the worker
            return f"{type(exc).__name__}: {exc}"
        error = None
        deadline = time.monotonic() + self.timeout_s
        pending = list(handles)
        polls = 0
        while pending:
            polls += 1
            for h in list(pending):
                state = self.engine.state(h)
                if state == "DONE":
                    pending.remove(h)
                elif state == "ERR":
                    error = error or "NIXL reported ERR for a WRITE"
                    pending.remove(h)
            if pending and time.monotonic() > deadline and error is None:
                error = f"WRITEs still in flight after {self.timeout_s:g} s"
            if pending and error is not None:
                pending = [h for h in pending if not self._try_release(h)]
                time.sleep(0.01)
            elif pending:  # spin briefly (small rooms end in microseconds), then poll every 100 us
                time.sleep(0 if polls < 100 else 0.0001)
        for h in handles:
            self._try_release(h)
        if error is None and sender.abort_request is None:
            try:
                self.engine.send_notif(
                    remote.agent_name, encode_xfer_done(sender.room, self.instance_id)
                )
            except Exception as exc:  # noqa: BLE001
                error = f"completion notification failed: {type(exc).__name__}: {exc}"
        return error

    def _try_release(self, handle) -> bool:
        """Release a transfer handle (cancels it if still running); False if NIXL refused."""
        try:
            self.engine.release(handle)
            return True
        except Exception:  # noqa: BLE001 - still running and not cancellable: keep polling
            return False
