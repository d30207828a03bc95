"""Prefill's posting and completion of a room's WRITEs: one ``send`` of a room (a chunk of
its pages; the last one with the aux record) is one :class:`Job`.

Posting: a send of few descriptors (``INLINE_MAX_DESCS`` after merging adjacent pages; on
host memory also at most ``INLINE_MAX_HOST_BYTES``, since a CMA copy runs inside the
post) is posted on the calling thread (the engine's), so no thread hand-off sits in front
of the WRITE; a larger one is queued to the ``transfer-i`` threads, which post it there
(posting costs ~2.5 us a descriptor on VRAM: GPU.md). After an inline post of at most
``INLINE_SPIN_MAX_BYTES`` the handles are polled back to back for up to ``INLINE_SPIN_S``:
a one-page WRITE ends within it, and then the room ends on the calling thread too
(measured on an H200, one 2 MiB page: 0.21 ms from ``send`` to ``Success`` with a 200 us
spin, 0.28 ms with 30 us, 0.31 ms handing off at once). Otherwise a transfer thread
completes it: polled back to back (yielding the GIL) for ``SPIN_S``, then every
``BACKOFF_S``.

Completion notification (``XferDone``, carrying the aux record for the decode rank that
takes it): when a room's last send is the only one still in flight, it rides on that
send's KV WRITE of each destination (``make_prepped_xfer(..., notif_msg)``: UCX sends it
once that WRITE is complete, from the poll that sees it done), so a room is one prepared
transfer per destination and nothing is posted after it; when the sender made that
WRITE ahead (``NixlSender.expect_pages``) the job only posts it, the notification set at
post time (``transfer(handle, notif_msg)``), and releases it if never posted. Else (an earlier chunk still in
flight, or no pages left to write) it is sent on its own once every WRITE ended. The room
learns the outcome through ``NixlSender.chunk_finished`` / ``transfer_finished`` only when
NIXL no longer touches its pages (a WRITE still running at the deadline is cancelled;
until NIXL accepts the cancellation it keeps being polled).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.disagg.messages import encode_xfer_done
from pdserve.disagg.nixl.agent_init import select_device
from pdserve.disagg.nixl.transfer_engine import NixlTransferEngine

if TYPE_CHECKING:
    from pdserve.disagg.metrics import TransferMetrics
    from pdserve.disagg.nixl.sender import NixlSender

SPIN_S = 0.005  # a transfer thread busy-polls this long after posting (a 1 GiB WRITE on an H200)
BACKOFF_S = 0.0001
INLINE_MAX_DESCS = 16  # descriptors (merged, all destinations) a send may post inline
INLINE_MAX_HOST_BYTES = 4 << 20  # on host memory the post is the copy: keep it short there
INLINE_SPIN_S = 200e-6  # the calling thread polls an inline post this long before handing off
INLINE_SPIN_MAX_BYTES = 64 << 20  # larger WRITEs do not end within the spin: hand off at once


@dataclass
class Job:
    """One ``send`` of a room: ``src`` pages onto decode's ``dst`` pages (int32 arrays),
    ``last``: the room's last send; ``attach``: the room's ``XferDone`` rides on these
    KV WRITEs; ``premade``: those KV WRITEs made ahead (decode rank -> handle, posted
    with the notification set then); ``handles``/``error``/``t0`` once posted."""

    sender: NixlSender
    src: np.ndarray
    dst: np.ndarray
    last: bool
    attach: bool
    premade: dict[int, Any] | None = None
    handles: list[Any] = field(default_factory=list)
    error: str | None = None
    t0: float = 0.0


def merged_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Descriptor runs of a page list pair: pages consecutive on both sides are one."""
    if src.size <= 1:
        return int(src.size)
    return 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1)))


class TransferWorkers:
    """Posting and completion of prefill's WRITEs (module doc): the job queue and loop of
    the ``transfer-i`` threads of one prefill manager, and the inline path.

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
        self.on_host = engine.kv_mem == "DRAM"
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(
        self,
        sender: NixlSender,
        src: list[int],
        dst: list[int],
        last: bool,
        solo: bool,
        premade: dict[int, Any] | None = None,
    ) -> None:
        """One ``send`` of ``sender``: ``src`` pages onto decode's ``dst`` pages, the
        room's last when ``last``; ``solo``: no other send of the room is in flight;
        ``premade``: its KV WRITEs made ahead (by decode rank; only for a last, solo
        send), which the job posts or releases. Posted here or queued (module doc);
        never raises for a NIXL error (the room fails)."""
        s = np.asarray(src, dtype=np.int32)
        d = np.asarray(dst, dtype=np.int32)
        job = Job(sender, s, d, last, last and solo and s.size > 0, premade)
        targets = [peer.remote for _, peer in sender.targets() if peer.remote is not None]
        descs = merged_runs(s, d) * sum(r.num_rows for r in targets)
        nbytes = s.size * self.engine.page_bytes * len(targets)
        if descs > INLINE_MAX_DESCS or (self.on_host and nbytes > INLINE_MAX_HOST_BYTES):
            self._jobs.put(job)
            return
        self._post(job)
        spin = INLINE_SPIN_S if nbytes <= INLINE_SPIN_MAX_BYTES else 0.0
        if not self._poll(job, time.monotonic() + spin, spin_only=True):
            self._jobs.put(job)  # still running: a transfer thread completes it
            return
        self._finish(job)

    def loop(self, stop: threading.Event) -> None:
        """One transfer thread's body."""
        select_device(self.engine.kv_args)  # the current device is thread-local
        while not stop.is_set():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if not job.t0:
                self._post(job)
            self._poll(job, job.t0 + SPIN_S, spin_only=False)
            self._finish(job)

    # --- one job ------------------------------------------------------------------------
    def _payload(self, job: Job, peer) -> bytes:
        aux = job.sender.aux_bytes if job.last and job.sender.writes_aux(peer) else b""
        return encode_xfer_done(job.sender.room, self.instance_id, aux)

    def _post(self, job: Job) -> None:
        """Post the job's WRITEs (KV pages of every destination, with ``XferDone`` when
        ``job.attach``)."""
        job.t0 = time.monotonic()
        sender = job.sender
        premade, job.premade = job.premade or {}, None
        if sender.abort_request is not None or not job.src.size:
            for h in premade.values():  # never posted: nothing for NIXL to cancel
                self._try_release(h)
            job.attach = False
            return  # aborted before posting (nothing to undo), or no pages to WRITE
        try:
            for _, peer in sender.targets():
                assert peer.remote is not None  # a destination is attached only with its peer
                notif = self._payload(job, peer) if job.attach else b""
                h = premade.pop(peer.engine_rank, None)
                if h is None:
                    job.handles += self.engine.post_room_write(
                        peer.remote, job.src, job.dst, None, None, notif
                    )
                    continue
                try:
                    self.engine.post(h, notif)
                except Exception:
                    self._try_release(h)  # not posted: nothing for NIXL to cancel
                    raise
                job.handles.append(h)  # released in _finish
        except Exception as exc:  # noqa: BLE001 - a NIXL error fails the room, not the worker
            job.error = f"{type(exc).__name__}: {exc}"  # WRITEs posted already still end
            job.attach = False
        for h in premade.values():  # left over (a failed post): never posted
            self._try_release(h)

    def _poll(self, job: Job, spin_until: float, *, spin_only: bool) -> bool:
        """Poll the job's handles until none is running (True), or, with ``spin_only``,
        give up at ``spin_until`` (False). Past ``spin_until`` it backs off; past the
        deadline the WRITEs are cancelled."""
        deadline = job.t0 + self.timeout_s
        pending = list(job.handles)
        while pending:
            for h in list(pending):
                state = self.engine.state(h)
                if state == "DONE":
                    pending.remove(h)
                elif state == "ERR":
                    job.error = job.error or "NIXL reported ERR for a WRITE"
                    pending.remove(h)
            if not pending:
                break
            now = time.monotonic()
            if spin_only:
                if now > spin_until:
                    return False
                continue
            if now > deadline and job.error is None:
                job.error = f"WRITEs still in flight after {self.timeout_s:g} s"
            if job.error is not None:
                pending = [h for h in pending if not self._try_release(h)]
                time.sleep(0.01)
            else:  # spin (small rooms end in microseconds), then back off
                time.sleep(0 if now < spin_until else BACKOFF_S)
        return True

    def _finish(self, job: Job) -> None:
        """Every WRITE of the job ended: release the handles; the room learns it, and when
        this was its last outstanding send decode is told (unless told already)."""
        for h in job.handles:
            self._try_release(h)
        sender = job.sender
        if sender.chunk_finished(job.error):
            sender.transfer_finished(None if job.attach else self._notify(sender))
            if self.metrics is not None:
                self.metrics.record_completion(time.monotonic() - job.t0)

    def _notify(self, sender: NixlSender) -> str | None:
        """Tell every destination decode rank that each WRITE of the room is done (with
        the aux record to the rank that takes it); the error, or None."""
        for _, peer in sender.targets():
            assert peer.remote is not None  # a destination is attached only with its peer
            aux = sender.aux_bytes if sender.writes_aux(peer) else b""
            try:
                self.engine.send_notif(
                    peer.remote.agent_name, encode_xfer_done(sender.room, self.instance_id, aux)
                )
            except Exception as exc:  # noqa: BLE001
                return f"completion notification failed: {type(exc).__name__}: {exc}"
        return None

    def _try_release(self, handle) -> bool:
        """Release a transfer handle (cancels it if still running); False if NIXL refused."""
        try:
            self.engine.release(handle)
            return True
        except Exception:  # noqa: BLE001 - still running and not cancellable: keep polling
            return False
