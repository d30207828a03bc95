"""Prefill side of one room over NIXL: the room (:class:`NixlSender`, what it knows of its
decode peers) and the machinery that posts and completes its WRITEs
(:class:`TransferWorkers`); a room and its jobs call each other on every send.

States: ``Bootstrapping`` (not every destination yet; fails after the bootstrap timeout)
-> ``WaitingForInput`` (the destination of every decode rank this rank writes into is
known: one under equal TP, several when this rank's heads are split; they list the same
pages) -> ``Transferring`` (a first ``send`` posted or queued) -> ``Success`` (NIXL
reported every WRITE done; decode is notified right after, once) or ``Failed``. Each
``send`` is one :class:`Job` (a chunk of the prompt's pages, WRITTEN into every
destination); the last one packs the aux record, which ``XferDone`` takes from prefill
rank 0 to decode rank 0 only. A failure asked for while WRITEs are in flight takes
effect when they all end, so ``Failed`` is never reported while NIXL may still read the
pages.

Posting: a send of few descriptors (``INLINE_MAX_DESCS`` after merging adjacent pages; on
host memory also at most ``INLINE_MAX_HOST_BYTES``, since a CMA copy runs inside the
post) is posted on the calling thread, so no thread hand-off sits in front of the WRITE;
a larger one is queued to the ``transfer-i`` threads. After an inline post of at most
``INLINE_SPIN_MAX_BYTES`` the handles are polled back to back for up to
``INLINE_SPIN_S`` (a one-page WRITE ends within it). Otherwise a transfer thread
completes it: back to back for ``SPIN_S`` (``os.sched_yield`` between polls on VRAM,
since ``time.sleep(0)`` sleeps the timer slack; ``time.sleep(0)`` on host memory, where a
CPU does the copy), then every ``BACKOFF_S``; a poll releases the GIL inside NIXL.
Figures: docs/benchmarks.md, "Notes moved from disagg docstrings".

Completion: once every WRITE of a room ended, the room is a ``Success`` and its last
outstanding send tells each destination decode rank with ``XferDone``, sent by the
manager's notifier agent (:class:`~pdserve.disagg.nixl.agent.transfer_engine.NixlNotifier`,
whose module says why not the WRITEs' agent). When the sender made the WRITE ahead
(``NixlSender.expect_pages``) the job only posts it, and releases it if never posted; its
post is planned when it is made (:func:`plan_premade`: index arrays, inline or queued,
handles in target order), so that a send of exactly those pages computes nothing again
before the WRITE is posted (``PDSERVE_DISAGGREGATION_PLANNED_POST=0``: computed at the
send, the path before; for A/B). The
room learns the outcome (``chunk_finished`` / ``transfer_finished``) only when NIXL no
longer touches its pages (a WRITE still running at the deadline is cancelled, and polled
until NIXL accepts the cancellation).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.disagg.base import (
    BOOTSTRAP_TIMEOUT,
    PEER_FAILED,
    TRANSFER_ERROR,
    AuxRecord,
    FailureInjector,
    KVPoll,
    KVSender,
    RoomHandle,
    RoomTable,
)
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.nixl.agent.init import select_device
from pdserve.disagg.nixl.agent.transfer_engine import NixlNotifier, NixlTransferEngine, RemoteSide
from pdserve.disagg.transfer_config import planned_post
from pdserve.disagg.wire import RoomDest, encode_xfer_done
from pdserve.parallel import TPRank

log = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    """A decode rank instance that said Hello: its NIXL agent and memory (prepared for the
    heads this rank writes there), or why it is unusable; its rank and TP size."""

    instance_id: str
    identity: bytes
    remote: RemoteSide | None
    error: str | None = None
    engine_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True)
class SenderContext:
    """What a prefill room uses of its manager, fixed when the manager starts: the room
    table, counters and failure injection every room shares, the transfer engine, this
    rank, the bootstrap timeout, where a ``send`` goes (``TransferWorkers.submit``) and
    how decode is told that a room ended here (``room_failed``)."""

    rooms: RoomTable[NixlSender]
    metrics: TransferMetrics
    injector: FailureInjector
    engine: NixlTransferEngine
    rank: TPRank
    bootstrap_timeout_s: float
    submit: Callable[[NixlSender, list[int], list[int], bool, Premade | None], None]
    room_failed: Callable[[NixlSender, str, str], None]


class NixlSender(RoomHandle, KVSender):
    """See module doc. Created by ``NixlPrefillManager.create_sender``."""

    def __init__(self, room: int, ctx: SenderContext) -> None:
        super().__init__(room, ctx.rooms, ctx.metrics, ctx.injector)
        self._ctx = ctx
        self._created = time.monotonic()
        self.dest: RoomDest | None = None  # the first destination (all list the same pages)
        self.dests: dict[int, tuple[RoomDest, DecodePeer]] = {}  # by decode rank
        self.expected: frozenset[int] | None = None  # decode ranks whose destination counts
        self._reply: dict[bytes, None] = {}  # decode ZMQ identities to tell, in order
        self.num_pages: int | None = None
        self.aux_slot: int | None = None
        self.aux_bytes = b""  # the packed aux record, set by the last send
        self.pages: list[int] = []  # every page handed to send, prompt order
        self.sent_at = 0.0
        self.inflight = 0  # send() jobs queued to or posted by a transfer worker
        self.last_sent = False
        self.chunk_error: str | None = None
        self.abort_request: tuple[str, str] | None = None
        self.expected_pages: list[int] | None = None  # expect_pages' hint
        self.premade: Premade | None = None  # the WRITEs made ahead, once made
        self.planned_post = planned_post()  # an A/B knob, read per room (transfer_config)
        # time.perf_counter() of the last send's path (benchmarks read them: bench transfer's
        # stages): its WRITEs posted, seen done, decode notified
        self.posted_at = self.done_at = self.notified_at = 0.0

    # --- engine side ------------------------------------------------------------------
    def _tick(self) -> None:
        if (
            self._state == KVPoll.Bootstrapping
            and time.monotonic() - self._created > self._ctx.bootstrap_timeout_s
        ):
            self._fail(
                f"room {self.room}: decode's destination did not arrive within "
                f"{self._ctx.bootstrap_timeout_s:g} s (PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
                BOOTSTRAP_TIMEOUT,
            )

    def init(self, num_pages: int, aux_slot: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if not 0 <= aux_slot < self._ctx.engine.num_aux_slots:
            raise ValueError(
                f"aux_slot must be in [0, {self._ctx.engine.num_aux_slots}), got {aux_slot}"
            )
        with self._lock:
            self.num_pages, self.aux_slot = num_pages, aux_slot
            self._check_counts()

    def expect_pages(self, page_ids: list[int]) -> None:
        """The hint of :meth:`KVSender.expect_pages`: once decode's destination is known
        too, the KV WRITE of each destination is made ahead (``make_prepped_xfer``), so
        that a single last ``send`` of exactly these pages only posts it."""
        with self._lock:
            if self.is_terminal() or self.pages or self.expected_pages is not None:
                return
            self.expected_pages = list(page_ids)
            self._premake()

    def _premake(self) -> None:
        """Make the WRITEs of the expected pages into every destination (caller holds
        the lock); on any error none is kept and ``send`` takes the usual path."""
        if (
            self.premade is not None
            or self.expected_pages is None
            or self._state != KVPoll.WaitingForInput
            or self.pages
            or self.dest is None
        ):
            return
        src = self.expected_pages[self.dest.skip_pages :]
        if not src or len(src) != len(self.dest.dst_pages):
            return
        made: dict[int, object] = {}
        try:
            for rank, (_, peer) in sorted(self.dests.items()):
                assert peer.remote is not None  # a destination is attached only with its peer
                made[rank] = self._ctx.engine.make_room_write(peer.remote, src, self.dest.dst_pages)
        except Exception as exc:  # noqa: BLE001 - send() posts the usual way
            log.warning("room %d: WRITE not made ahead: %s", self.room, exc)
            self.premade = Premade(made)
            self._drop_premade()
            return
        self.premade = (
            plan_premade(made, src, self.dest.dst_pages, self.targets(), self._ctx.engine)
            if self.planned_post
            else Premade(made)
        )

    def _drop_premade(self) -> None:
        """Release the WRITEs made ahead and never posted (caller holds the lock)."""
        made, self.premade = self.premade, None
        for h in made.handles.values() if made is not None else ():
            try:
                self._ctx.engine.release(h)
            except Exception as exc:  # noqa: BLE001 - never posted: NIXL has nothing to cancel
                log.warning("room %d: releasing a WRITE made ahead: %s", self.room, exc)

    def send(self, page_ids: list[int], *, last: bool, aux: AuxRecord | None = None) -> None:
        if last and aux is None or not last and aux is not None:
            raise ValueError("aux is required with last=True and only then")
        if aux is not None and aux.room != self.room:
            raise ValueError(f"aux.room {aux.room} differs from the room {self.room}")
        with self._lock:
            if self.is_terminal():
                return  # failed meanwhile; the engine sees it at its next poll
            if (
                self._state not in (KVPoll.WaitingForInput, KVPoll.Transferring)
                or self.aux_slot is None
                or self.last_sent
            ):
                raise RuntimeError(
                    f"send() on room {self.room} in state {self._state.name}"
                    + (" after the last send" if self.last_sent else " (needs init first)")
                )
            first = len(self.pages)
            if self.num_pages is not None and first + len(page_ids) > self.num_pages:
                raise ValueError(
                    f"room {self.room}: {first + len(page_ids)} pages sent, "
                    f"{self.num_pages} declared in init"
                )
            if aux is not None:  # the last send
                self.num_pages = first + len(page_ids)
                if not self._check_counts():
                    return
                self.aux_bytes = aux.pack()
                self.last_sent = True
            assert self.dest is not None  # WaitingForInput: decode's destination arrived
            premade = None
            if (
                self.premade is not None
                and last
                and self.inflight == 0  # no earlier send still in flight
                and first == 0
                and self.expected_pages == list(page_ids)
            ):
                premade, self.premade = self.premade, None  # the job posts (and releases) them
                if premade.src is not None and len(premade.order) != len(self.dests):
                    premade = Premade(premade.handles)  # a destination came after the plan
            elif self.premade is not None:  # any other send: they are not these WRITEs
                self._drop_premade()
            src: list[int] = []
            dst: list[int] = []
            if premade is None or premade.src is None:  # a planned one has its arrays
                skip = self.dest.skip_pages
                # prompt page i goes to dst_pages[i - skip]; pages decode holds are not written
                src = list(page_ids[max(skip - first, 0) :])
                dst = list(self.dest.dst_pages[max(first - skip, 0) : first + len(page_ids) - skip])
            self.pages.extend(page_ids)
            if self._state == KVPoll.WaitingForInput:
                self._state = KVPoll.Transferring
                self.sent_at = time.monotonic()
            self.inflight += 1
        self._ctx.submit(self, src, dst, last, premade)

    def peers(self) -> list[DecodePeer]:
        """The decode rank peers of the destinations received so far."""
        return [peer for _, peer in self.dests.values()]

    def targets(self) -> list[tuple[RoomDest, DecodePeer]]:
        """Every destination with its peer (decode rank order)."""
        return [self.dests[r] for r in sorted(self.dests)]

    def writes_aux(self, peer: DecodePeer) -> bool:
        """The aux record goes from prefill rank 0 to decode rank 0 only (in ``XferDone``)."""
        return self._ctx.rank.rank == 0 and peer.engine_rank == 0

    def reply_identities(self) -> list[bytes]:
        """The decode ranks to tell when the room ends here."""
        with self._lock:
            return list(self._reply)

    def _check_counts(self) -> bool:
        """Fail the room when decode expects another number of pages (caller holds the lock):
        decode's pages plus the leading pages it holds (``skip_pages``) must be the prompt's,
        and at least one page is sent."""
        if self.dest is not None and self.num_pages is not None:
            skip = self.dest.skip_pages
            if len(self.dest.dst_pages) + skip != self.num_pages or not 0 <= skip < self.num_pages:
                self._fail(
                    f"room {self.room}: prefill has {self.num_pages} pages, decode allocated "
                    f"{len(self.dest.dst_pages)} and holds {skip}",
                    TRANSFER_ERROR,
                )
                return False
        return True

    def fail(self, reason: str, kind: str) -> None:
        """End the room as failed (``kind``: a failure kind of :mod:`pdserve.disagg.base`)
        and tell decode; while WRITEs are in flight it ends when they all have (module
        doc). Nothing once terminal. The manager's shutdown calls it."""
        self._fail(reason, kind)

    def _fail(self, reason: str, kind: str) -> None:  # RoomHandle's hook (abort, injection)
        with self._lock:
            self._drop_premade()
            if self.is_terminal():
                return
            if self.inflight:
                self.abort_request = self.abort_request or (reason, kind)
                return
            self._finish_failed(reason, kind)
        self._ctx.room_failed(self, reason, kind)

    # --- control thread / transfer workers ----------------------------------------------
    def attach_dest(
        self, dest: RoomDest, peer: DecodePeer, identity: bytes, expected: frozenset[int]
    ) -> None:
        """One decode rank's destination arrived (control thread); ``expected``: the decode
        ranks this rank writes into (from that rank's TP size)."""
        problem = None
        ready = False
        with self._lock:
            self._reply[identity] = None
            terminal = self.is_terminal()
            if not terminal and peer.engine_rank not in self.dests:
                first = self.dest
                if self.expected is not None and expected != self.expected:
                    problem = f"decode ranks {sorted(expected)} vs {sorted(self.expected)}"
                elif first is not None and (
                    dest.dst_pages != first.dst_pages
                    or dest.skip_pages != first.skip_pages
                    or dest.aux_slot != first.aux_slot
                ):
                    problem = f"decode rank {peer.engine_rank} lists other pages than the others"
                else:
                    self.expected = expected
                    self.dests[peer.engine_rank] = (dest, peer)
                    self.dest = first or dest
                    if self._state == KVPoll.Bootstrapping and set(self.dests) >= expected:
                        self._state = KVPoll.WaitingForInput
                        ready = True
                    if self._check_counts():
                        self._premake()
        if ready and self._state == KVPoll.WaitingForInput:
            self._table.wake()  # the engine may init and send the room now
        if problem is not None:
            self._fail(f"room {self.room}: destinations disagree: {problem}", PEER_FAILED)
        elif terminal and self._state == KVPoll.Failed:
            exc = self.failure_exception()
            self._ctx.room_failed(self, str(exc), PEER_FAILED)

    def peer_abort(self, reason: str, kind: str, identity: bytes) -> None:
        """Decode gave up on the room (control thread); answered once terminal."""
        with self._lock:
            self._reply[identity] = None
            already = self.is_terminal()
        if already:
            self._ctx.room_failed(self, f"room {self.room} had already ended on prefill", kind)
        else:
            self._fail(f"decode gave up on room {self.room}: {reason}", kind)

    def chunk_finished(self, error: str | None) -> bool:
        """One ``send``'s WRITEs ended (NIXL no longer touches those pages). True when the
        room's last WRITEs are all done without error: the caller then notifies decode
        (unless ``XferDone`` rode on them) and calls :meth:`transfer_finished`. Else, once
        nothing is in flight any more, the room ends here."""
        with self._lock:
            self.inflight -= 1
            self.chunk_error = self.chunk_error or error
            if self.inflight > 0:
                return False
            if self.chunk_error is None and self.abort_request is None and not self.last_sent:
                return False  # waiting for the next send()
            if self.chunk_error is None and self.abort_request is None:
                return True
            error = self.chunk_error
        self.transfer_finished(error)
        return False

    def transfer_finished(self, error: str | None) -> None:
        """Every WRITE of the room ended (and decode was notified unless ``error``)."""
        with self._lock:
            abort = self.abort_request
        if error is not None:
            self._fail(f"room {self.room}: KV transfer failed: {error}", TRANSFER_ERROR)
        elif abort is not None:
            self._fail(*abort)
        else:
            eng = self._ctx.engine
            start, end = eng.kv_heads  # computed once (KVArgs.kv_heads: ~10 us cold here)
            heads = sum(
                peer.remote.heads[1] - peer.remote.heads[0] for peer in self.peers() if peer.remote
            )
            # the pages written: decode's leading skip_pages (its prefix cache) are not
            written = len(self.pages) - (self.dest.skip_pages if self.dest is not None else 0)
            written = max(written, 0)
            self._finish_success(
                written * eng.page_bytes * heads // (end - start) + eng.kv_args.aux_item_len,
                written,
                time.monotonic() - self.sent_at,
            )


_SENT_LOCK = threading.Lock()
SPIN_S = 0.005  # a transfer thread busy-polls this long after posting (a 1 GiB WRITE on an H200)
BACKOFF_S = 0.0001
INLINE_MAX_DESCS = 16  # descriptors (merged, all destinations) a send may post inline
INLINE_MAX_HOST_BYTES = 4 << 20  # on host memory the post is the copy: keep it short there
INLINE_SPIN_S = 200e-6  # the calling thread polls an inline post this long before handing off
INLINE_SPIN_MAX_BYTES = 64 << 20  # larger WRITEs do not end within the spin: hand off at once


@dataclass
class Job:
    """One ``send`` of a room: ``src`` pages onto decode's ``dst`` pages (int32 arrays),
    ``last``: the room's last send; ``premade``: its KV WRITEs made ahead; ``handles``/
    ``error``/``t0`` once posted."""

    sender: NixlSender
    src: np.ndarray
    dst: np.ndarray
    last: bool
    premade: Premade | None = None
    handles: list[Any] = field(default_factory=list)
    error: str | None = None
    t0: float = 0.0


@dataclass
class Premade:
    """A room's KV WRITEs made ahead (``NixlSender.expect_pages``): ``handles``, decode
    rank -> handle. Planned (:func:`plan_premade`) it also holds what its post needs, fixed
    when the WRITEs were made: ``src``/``dst`` (int32 page ids written, decode's),
    ``order`` (the handles in the room's target order, one per destination),
    ``inline`` (posted on the calling thread, :func:`post_inline`) and ``spin`` (seconds
    the caller polls an inline post). Unplanned (``src`` None) the send computes them."""

    handles: dict[int, Any]
    src: np.ndarray | None = None
    dst: np.ndarray | None = None
    order: tuple[Any, ...] = ()
    inline: bool = False
    spin: float = 0.0


def post_inline(
    src: np.ndarray, dst: np.ndarray, targets: list[RemoteSide], page_bytes: int, on_host: bool
) -> tuple[bool, float]:
    """Whether a send of ``src`` onto ``dst`` (int32 page ids, equal sizes) into
    ``targets`` is posted on the calling thread (module doc: at most ``INLINE_MAX_DESCS``
    descriptors after merging, all destinations; on host memory at most
    ``INLINE_MAX_HOST_BYTES``, counting ``page_bytes`` a page and destination), and how
    long (seconds) the caller then polls it: ``INLINE_SPIN_S`` up to
    ``INLINE_SPIN_MAX_BYTES``, else 0 (also when queued)."""
    descs = merged_runs(src, dst) * sum(r.num_rows for r in targets)
    nbytes = src.size * page_bytes * len(targets)
    if descs > INLINE_MAX_DESCS or (on_host and nbytes > INLINE_MAX_HOST_BYTES):
        return False, 0.0
    return True, INLINE_SPIN_S if nbytes <= INLINE_SPIN_MAX_BYTES else 0.0


def plan_premade(
    made: dict[int, Any],
    src: list[int],
    dst: list[int],
    targets: list[tuple[RoomDest, DecodePeer]],
    engine: NixlTransferEngine,
) -> Premade:
    """``made`` (decode rank -> the WRITE of ``src`` onto decode's ``dst`` page ids, one
    per destination of ``targets``) with its post planned (:class:`Premade`): what a send
    of exactly these pages would compute, computed once here. Unplanned (``src`` None)
    when ``made`` does not cover every target."""
    peers = [peer for _, peer in targets]
    if sorted(made) != sorted(p.engine_rank for p in peers) or any(p.remote is None for p in peers):
        return Premade(made)
    s = np.asarray(src, dtype=np.int32)
    d = np.asarray(dst, dtype=np.int32)
    remotes = [p.remote for p in peers if p.remote is not None]
    inline, spin = post_inline(s, d, remotes, engine.page_bytes, engine.kv_mem == "DRAM")
    return Premade(made, s, d, tuple(made[p.engine_rank] for p in peers), inline, spin)


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
        self.notifs_sent = 0  # XferDone handed to the notifier without error (stats())

    def submit(
        self,
        sender: NixlSender,
        src: list[int],
        dst: list[int],
        last: bool,
        premade: Premade | None = None,
    ) -> None:
        """One ``send`` of ``sender``: ``src`` pages onto decode's ``dst`` pages, the
        room's last when ``last``; ``premade``: its KV WRITEs made ahead (only for a last
        send with no other in flight), which the job posts or releases; a planned one
        (:func:`plan_premade`) brings its pages, and ``src``/``dst`` are not read. Posted
        here or queued (module doc); never raises for a NIXL error (the room fails)."""
        if premade is not None and premade.src is not None and premade.dst is not None:
            job = Job(sender, premade.src, premade.dst, last, premade)
            inline, spin = premade.inline, premade.spin
        else:
            job = Job(
                sender,
                np.asarray(src, dtype=np.int32),
                np.asarray(dst, dtype=np.int32),
                last,
                premade,
            )
            targets = [peer.remote for _, peer in sender.targets() if peer.remote is not None]
            inline, spin = post_inline(
                job.src, job.dst, targets, self.engine.page_bytes, self.on_host
            )
        if not inline:
            self._jobs.put(job)
            return
        self._post(job)
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
        plan, job.premade = job.premade, None
        if plan is not None and plan.order and sender.abort_request is None and job.src.size:
            self._post_planned(job, plan.order)  # planned: one made WRITE per destination
            return
        premade = dict(plan.handles) if plan is not None else {}
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
        sender.posted_at = time.perf_counter()
        for h in premade.values():  # left over (a failed post): never posted
            self._try_release(h)

    def _post_planned(self, job: Job, order: tuple[Any, ...]) -> None:
        """Post a planned :class:`Premade`'s handles in order (``_post`` checked the
        abort); a refused post releases it and those not yet posted."""
        post = self.engine.post
        for i, h in enumerate(order):
            try:
                post(h)
            except Exception as exc:  # noqa: BLE001 - a NIXL error fails the room, not the worker
                job.error = f"{type(exc).__name__}: {exc}"  # WRITEs posted already still end
                for left in order[i:]:  # never posted: nothing for NIXL to cancel
                    self._try_release(left)
                break
            job.handles.append(h)  # released in _finish
        job.sender.posted_at = time.perf_counter()

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
        """Every WRITE of the job ended: the room learns it, and when this was its last
        outstanding send and the room is a ``Success`` here, decode is told (an abort that
        came meanwhile fails the room instead, and decode hears that in a ``RoomStatus``);
        then the handles are released. The room ends first: a notification costs a system
        call, and one that cannot be sent means decode is gone (its side fails the room).
        Every handle reported ``DONE`` (no error): releasing them waits until decode was
        told, since it is not on the path decode's engine waits for; after an error they
        are released first."""
        sender = job.sender
        sender.done_at = time.perf_counter()
        if job.error is not None:
            self._release(job)
        if sender.chunk_finished(job.error):
            sender.transfer_finished(None)
            if sender.poll_state() == KVPoll.Success:
                error = self._notify(sender)
                sender.notified_at = time.perf_counter()
                if error is not None:
                    log.warning("room %d: %s", sender.room, error)
            self.notifier.progress()  # completes the sends (UCX frees their buffers)
            if self.metrics is not None:
                self.metrics.record_completion(time.monotonic() - job.t0)
        if job.error is None:
            self._release(job)

    def _release(self, job: Job) -> None:
        for h in job.handles:
            self._try_release(h)

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
            with _SENT_LOCK:  # several threads finish rooms
                self.notifs_sent += 1
        return None

    def _try_release(self, handle) -> bool:
        """Release a transfer handle (cancels it if still running); False if NIXL refused."""
        try:
            self.engine.release(handle)
            return True
        except Exception:  # noqa: BLE001 - still running and not cancellable: keep polling
            return False
