"""Prefill's posting and completion of a room's WRITEs: one ``send`` of a room (a chunk of
its pages; the last one with the aux record) is one :class:`Job`.

Posting: a send of few descriptors (``INLINE_MAX_DESCS`` after merging adjacent pages; on
host memory also at most ``INLINE_MAX_HOST_BYTES``, since a CMA copy runs inside the
post) is posted on the calling thread (the engine's), so no thread hand-off sits in front
of the WRITE; a larger one is queued to the ``transfer-i`` threads, which post it there
(posting costs ~2.5 us a descriptor on VRAM: GPU.md). After an inline post of at most
``INLINE_SPIN_MAX_BYTES`` the handles are polled back to back for up to ``INLINE_SPIN_S``:
a one-page WRITE ends within it, and then the room ends on the calling thread too, sooner
than after a hand-off (figures: docs/benchmarks.md, "Notes moved from disagg docstrings").
Otherwise a transfer thread
completes it: polled back to back for ``SPIN_S`` (on VRAM ``os.sched_yield`` between polls,
not ``time.sleep(0)``, which sleeps ~60 us: the timer slack; on host memory, where a CPU
does the copy, ``time.sleep(0)``), then every ``BACKOFF_S``. A
poll (``check_xfer_state``) releases the GIL inside NIXL, so other threads run meanwhile.

Completion (``XferDone``, carrying the aux record for the decode rank that takes it):
once every WRITE of a room ended (NIXL reports them ``DONE``: in decode's memory), the
room is a ``Success`` and its last outstanding send tells each destination decode rank,
with a NIXL notification sent by the manager's *notifier* (:mod:`~pdserve.disagg.nixl.agent.notifier`), a second
agent, never by the agent that WRITEs: on UCX a notification makes the next flush of its
endpoint, which ends every WRITE, wait for the peer's progress. So a room is one prepared
transfer per destination and one notification, and its ``DONE`` waits for nothing of
decode's (figures: docs/benchmarks.md). When the sender made the
WRITE ahead (``NixlSender.expect_pages``) the job only posts it, and releases it if never
posted. The room learns the outcome through ``NixlSender.chunk_finished`` /
``transfer_finished`` only when NIXL no longer touches its pages (a WRITE still running at
the deadline is cancelled; until NIXL accepts the cancellation it keeps being polled).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.disagg.base import KVPoll
from pdserve.disagg.nixl.agent.init import select_device
from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
from pdserve.disagg.wire import encode_xfer_done

if TYPE_CHECKING:
    from pdserve.disagg.metrics import TransferMetrics
    from pdserve.disagg.nixl.agent.notifier import NixlNotifier
    from pdserve.disagg.nixl.prefill.sender import NixlSender

log = logging.getLogger(__name__)

SPIN_S = 0.005  # a transfer thread busy-polls this long after posting (a 1 GiB WRITE on an H200)
BACKOFF_S = 0.0001
INLINE_MAX_DESCS = 16  # descriptors (merged, all destinations) a send may post inline
INLINE_MAX_HOST_BYTES = 4 << 20  # on host memory the post is the copy: keep it short there
INLINE_SPIN_S = 200e-6  # the calling thread polls an inline post this long before handing off
INLINE_SPIN_MAX_BYTES = 64 << 20  # larger WRITEs do not end within the spin: hand off at once


@dataclass
class Job:
    """One ``send`` of a room: ``src`` pages onto decode's ``dst`` pages (int32 arrays),
    ``last``: the room's last send; ``premade``: its KV WRITEs made ahead (decode rank ->
    handle); ``handles``/``error``/``t0`` once posted."""

    sender: NixlSender
    src: np.ndarray
    dst: np.ndarray
    last: bool
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

    timeout_s: how long a room's WRITEs may run before they are cancelled and the room
    fails; notifier: the agent that sends ``XferDone`` (``send_notif``, ``progress``).
    """

    def __init__(
        self,
        engine: NixlTransferEngine,
        instance_id: str,
        timeout_s: float,
        notifier: NixlNotifier,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        self.notifier = notifier
        self.metrics = metrics
        self.on_host = engine.kv_mem == "DRAM"
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(
        self,
        sender: NixlSender,
        src: list[int],
        dst: list[int],
        last: bool,
        premade: dict[int, Any] | None = None,
    ) -> None:
        """One ``send`` of ``sender``: ``src`` pages onto decode's ``dst`` pages, the
        room's last when ``last``; ``premade``: its KV WRITEs made ahead (by decode rank;
        only for a last send with no other in flight), which the job posts or releases.
        Posted here or queued (module doc); never raises for a NIXL error (the room
        fails)."""
        s = np.asarray(src, dtype=np.int32)
        d = np.asarray(dst, dtype=np.int32)
        job = Job(sender, s, d, last, premade)
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
    def _post(self, job: Job) -> None:
        """Post the job's WRITEs (KV pages of every destination)."""
        job.t0 = time.monotonic()
        sender = job.sender
        premade, job.premade = job.premade or {}, None
        if sender.abort_request is not None or not job.src.size:
            for h in premade.values():  # never posted: nothing for NIXL to cancel
                self._try_release(h)
            return  # aborted before posting (nothing to undo), or no pages to WRITE
        try:
            for _, peer in sender.targets():
                assert peer.remote is not None  # a destination is attached only with its peer
                h = premade.pop(peer.engine_rank, None)
                if h is None:
                    job.handles += self.engine.post_room_write(peer.remote, job.src, job.dst)
                    continue
                try:
                    self.engine.post(h)
                except Exception:
                    self._try_release(h)  # not posted: nothing for NIXL to cancel
                    raise
                job.handles.append(h)  # released in _finish
        except Exception as exc:  # noqa: BLE001 - a NIXL error fails the room, not the worker
            job.error = f"{type(exc).__name__}: {exc}"  # WRITEs posted already still end
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
            elif now < spin_until:  # spin (small rooms end in microseconds) ...
                # On VRAM the copy engines move the bytes and the CPU idles: yield only. On
                # host memory a CPU moves them (UCX CMA, milliseconds a room), so the poll
                # sleeps (~60 us) rather than keep a core of a small machine busy.
                if self.on_host:
                    time.sleep(0)
                else:
                    os.sched_yield()
            else:  # ... then back off
                time.sleep(BACKOFF_S)
        return True

    def _finish(self, job: Job) -> None:
        """Every WRITE of the job ended: release the handles; the room learns it, and when
        this was its last outstanding send and the room is a ``Success`` here, decode is
        told (an abort that came meanwhile fails the room instead, and decode hears that
        in a ``RoomStatus``). The room ends first: a notification costs a system call,
        and one that cannot be sent means decode is gone (its side fails the room)."""
        for h in job.handles:
            self._try_release(h)
        sender = job.sender
        if sender.chunk_finished(job.error):
            sender.transfer_finished(None)
            if sender.poll_state() == KVPoll.Success:
                error = self._notify(sender)
                if error is not None:
                    log.warning("room %d: %s", sender.room, error)
            self.notifier.progress()  # completes the sends (UCX frees their buffers)
            if self.metrics is not None:
                self.metrics.record_completion(time.monotonic() - job.t0)

    def _notify(self, sender: NixlSender) -> str | None:
        """Tell every destination decode rank that each WRITE of the room is done (with
        the aux record to the rank that takes it), through the notifier; the error, or
        None."""
        for _, peer in sender.targets():
            assert peer.remote is not None  # a destination is attached only with its peer
            aux = sender.aux_bytes if sender.writes_aux(peer) else b""
            try:
                self.notifier.send_notif(
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
