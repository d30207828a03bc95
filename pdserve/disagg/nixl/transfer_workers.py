"""Prefill's transfer workers: each takes one ``send`` of a room (a chunk of its pages; the
last one with the aux slot), posts its WRITEs (KV pages of every buffer, the aux slot),
busy-polls NIXL until every WRITE ended, and when that was the room's last outstanding
``send`` notifies decode once with a NIXL notification (``XferDone``). The room learns
the outcome through ``NixlSender.chunk_finished`` / ``transfer_finished`` only when NIXL
no longer touches its pages (a WRITE still running at the deadline is cancelled; until
NIXL accepts the cancellation it keeps being polled).

Polling: right after posting, the handles are polled back to back (yielding the GIL
between polls) for ``SPIN_S``; a one-page WRITE ends in microseconds, and a sleep there
is the fixed cost of every request. Past that, every ``BACKOFF_S``.
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
    from pdserve.disagg.metrics import TransferMetrics
    from pdserve.disagg.nixl.sender import NixlSender

SPIN_S = 0.005  # busy-poll this long after posting (covers a 1 GiB WRITE on an H200)
BACKOFF_S = 0.0001


class TransferWorkers:
    """The job queue and loop shared by the ``transfer-i`` threads of one prefill manager.

    timeout_s: how long a room's WRITEs may run before they are cancelled and the room fails.
    """

    def __init__(
        self,
        engine: NixlTransferEngine,
        instance_id: str,
        timeout_s: float,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, sender: NixlSender, src: list[int], dst: list[int], last: bool) -> None:
        """Queue one ``send`` of ``sender``: ``src`` pages onto decode's ``dst`` pages,
        and the aux slot when ``last``."""
        self._jobs.put((sender, src, dst, last))

    def loop(self, stop: threading.Event) -> None:
        """One worker thread's body."""
        select_device(self.engine.kv_args)  # the current device is thread-local
        while not stop.is_set():
            try:
                sender, src, dst, last = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            t0 = time.perf_counter()
            if sender.chunk_finished(self._transfer(sender, src, dst, last)):
                sender.transfer_finished(self._notify(sender))
                if self.metrics is not None:
                    self.metrics.record_completion(time.perf_counter() - t0)

    def _notify(self, sender: NixlSender) -> str | None:
        """Tell every destination decode rank that each WRITE of the room is done; the
        error, or None."""
        for _, peer in sender.targets():
            assert peer.remote is not None  # a destination is attached only with its peer
            try:
                self.engine.send_notif(
                    peer.remote.agent_name, encode_xfer_done(sender.room, self.instance_id)
                )
            except Exception as exc:  # noqa: BLE001
                return f"completion notification failed: {type(exc).__name__}: {exc}"
        return None

    def _transfer(
        self, sender: NixlSender, src: list[int], dst: list[int], last: bool
    ) -> str | None:
        """Post and complete one ``send``'s WRITEs; the error, or None on success."""
        if sender.abort_request is not None:
            return None  # aborted before posting: nothing to undo
        # A sender reaches this queue only once its destinations and decode peers are known.
        assert sender.aux_slot is not None
        handles: list = []
        error = None
        try:
            for dest, peer in sender.targets():
                assert peer.remote is not None
                aux = last and sender.writes_aux(peer)
                handles += self.engine.post_room_write(
                    peer.remote,
                    src,
                    dst,
                    sender.aux_slot if aux else None,
                    dest.aux_slot if aux else None,
                )
        except Exception as exc:  # noqa: BLE001 - a NIXL error fails the room, not the worker
            error = f"{type(exc).__name__}: {exc}"  # WRITEs posted already still end below
        start = time.monotonic()
        deadline = start + self.timeout_s
        pending = list(handles)
        while pending:
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
            elif pending:  # spin (small rooms end in microseconds), then back off
                time.sleep(0 if time.monotonic() - start < SPIN_S else BACKOFF_S)
        for h in handles:
            self._try_release(h)
        return error

    def _try_release(self, handle) -> bool:
        """Release a transfer handle (cancels it if still running); False if NIXL refused."""
        try:
            self.engine.release(handle)
            return True
        except Exception:  # noqa: BLE001 - still running and not cancellable: keep polling
            return False
