"""The ``fake`` transfer backend, in three modes, threads-free and in one process.

**Alone** (the registry's ``fake``): no peer, no bytes moved; ``/health_generate`` and
warm-up in PD roles use it, so a worker can run one request end to end alone. Rooms are
``WaitingForInput`` at once; a sender is ``Success`` on the last ``send``, a receiver
right after ``init``, with the aux record given to :meth:`FakeKVManager.provide_aux`
(else first token 0, logprob 0). Page contents are whatever they were.

**Loopback** (:func:`link` a prefill and a decode manager): a real transfer in process,
over the byte ranges NIXL would move (page ``p`` of buffer ``b`` is
``[p * item, (p + 1) * item)``). The receiver's ``init`` hands the destination to the
prefill room (which then is ``WaitingForInput``; a destination given before the sender
exists waits for it); each ``send`` copies its pages at once, the last one also the aux
record; then both sides are ``Success``. The engine's tests and the ``KVManager``
conformance suite run on it.

**Scripted** (``scripted=True``, never linked): the test plays the peer and the network.
Rooms start ``Bootstrapping`` and move only by :meth:`FakeHandle.advance` or
:meth:`FakeHandle.fail`; ``init`` and ``send`` record their arguments and move no bytes
(the last ``send`` writes the sender's own aux slot); ``abort()`` is recorded and leaves
the state (a real room ends ``Failed`` only later); the receiver reads its aux slot, which
the test fills with :meth:`FakeKVManager.write_aux`.

In every mode a handle records what the engine did to it (``num_pages``, ``chunks``,
``aux``; ``dst_pages``, ``skip_pages``; ``aux_slot``, ``aborted``, ``closes``),
:meth:`FakeHandle.raise_on` scripts an exception from ``poll``, ``init`` or ``send``, and
:meth:`FakeKVManager.handle` finds a room's handle among the last :data:`HISTORY`. The
contract's errors are raised as the real backend raises them (base.py).
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

from pdserve.disagg.base import (
    AUX_RECORD_BYTES,
    PEER_FAILED,
    TRANSFER_ERROR,
    AuxRecord,
    FailureInjector,
    KVArgs,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
    Role,
    RoomHandle,
    RoomTable,
    check_room,
    pd_role,
)
from pdserve.disagg.metrics import TransferMetrics

HISTORY = 256  # handles a manager remembers after close (tests read them; bounded for probes)
TERMINAL = (KVPoll.Success, KVPoll.Failed)
_SCRIPTABLE = ("poll", "init", "send")


def _copy_pages(src: KVArgs, src_pages: list[int], dst: KVArgs, dst_pages: list[int]) -> int:
    """Copy pages between two pools' registered buffers (same geometry); bytes copied."""
    n = 0
    for sp, item, dp in zip(src.kv_data_ptrs, src.kv_item_lens, dst.kv_data_ptrs):
        for s, d in zip(src_pages, dst_pages):
            ctypes.memmove(dp + d * item, sp + s * item, item)
            n += item
    return n


class FakeHandle(RoomHandle):
    """What senders and receivers of every mode share: the records and the scripting."""

    def __init__(self, room: int, manager: FakeKVManager) -> None:
        super().__init__(room, manager._rooms, manager._metrics, manager._injector)
        self._mgr = manager
        self.aux_slot: int | None = None
        self.aborted = False
        self.closes: list[KVPoll] = []  # the state at each close() call
        self.raised: list[str] = []  # methods that raised a scripted exception, in order
        self._raise: dict[str, BaseException] = {}

    def _pages_done(self) -> int:
        return 0

    def raise_on(self, method: str, exc: BaseException | None) -> None:
        """Make every later call of ``method`` (``poll``, ``init`` or ``send``) raise
        ``exc`` (``None`` stops it), as a broken backend would. ValueError for another
        method."""
        if method not in _SCRIPTABLE:
            raise ValueError(f"method must be one of {_SCRIPTABLE}, got {method!r}")
        if exc is None:
            self._raise.pop(method, None)
        else:
            self._raise[method] = exc

    def _scripted(self, method: str) -> None:
        exc = self._raise.get(method)
        if exc is not None:
            self.raised.append(method)
            raise exc

    def advance(self, state: KVPoll) -> None:
        """Scripted mode: the peer moved the room to ``state`` (``WaitingForInput``,
        ``Transferring`` or ``Success``; ``Failed`` is :meth:`fail`). RuntimeError on a
        manager that is not scripted or a terminal room; ValueError for another state."""
        if not self._mgr.scripted:
            raise RuntimeError("advance() is for a scripted manager's rooms")
        with self._lock:
            if self._state in TERMINAL:
                raise RuntimeError(f"room {self.room} is terminal ({self._state.name})")
            if state == KVPoll.Success:
                self._finish_success(0, self._pages_done(), 0.0)
            elif state in (KVPoll.WaitingForInput, KVPoll.Transferring):
                self._state = state
            else:
                raise ValueError(f"advance() to {state.name}: use fail() for Failed")

    def fail(self, reason: str, kind: str = PEER_FAILED) -> bool:
        """End the room ``Failed`` with ``reason`` (the peer or the network failed it),
        counted under failure ``kind``; False if it was terminal already."""
        return self._finish_failed(reason, kind)

    def poll(self) -> KVPoll:
        self._scripted("poll")
        return super().poll()

    def abort(self) -> None:
        """Recorded; ``Failed`` at once, except in scripted mode (the test says when)."""
        self.aborted = True
        if not self._mgr.scripted:
            super().abort()

    def close(self) -> None:
        self.closes.append(self._state)
        super().close()


class FakeSender(FakeHandle, KVSender):
    def __init__(self, room: int, manager: FakeKVManager) -> None:
        super().__init__(room, manager)
        alone = manager.peer is None and not manager.scripted
        self._state = KVPoll.WaitingForInput if alone else KVPoll.Bootstrapping
        self.num_pages: int | None = None  # declared by init()
        self.chunks: list[list[int]] = []  # page ids of each send() call
        self.aux: AuxRecord | None = None  # carried by the last send()
        self.dest: tuple[list[int], int, int] | None = None  # loopback: pages, slot, skip

    @property
    def pages_sent(self) -> list[int]:
        """Page ids of every send() so far, in prompt order."""
        return [p for chunk in self.chunks for p in chunk]

    def _pages_done(self) -> int:
        return len(self.pages_sent)

    def attach_dest(self, dst_pages: list[int], aux_slot: int, skip_pages: int) -> None:
        with self._lock:
            self.dest = (list(dst_pages), aux_slot, skip_pages)
            if self._state == KVPoll.Bootstrapping:
                self._state = KVPoll.WaitingForInput

    def init(self, num_pages: int, aux_slot: int) -> None:
        self._scripted("init")
        with self._lock:
            if self._state != KVPoll.WaitingForInput or self.num_pages is not None:
                raise RuntimeError(f"init() on room {self.room} in state {self._state.name}")
            self.num_pages, self.aux_slot = num_pages, aux_slot

    def send(self, page_ids: list[int], *, last: bool, aux: AuxRecord | None = None) -> None:
        self._scripted("send")
        if last and aux is None or not last and aux is not None:
            raise ValueError("aux is required with last=True and only then")
        if aux is not None and aux.room != self.room:
            raise ValueError(f"aux.room {aux.room} differs from the room {self.room}")
        with self._lock:
            if self._state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                raise RuntimeError(f"send() on room {self.room} in state {self._state.name}")
            if self.num_pages is None or self.aux is not None:
                raise RuntimeError(f"send() on room {self.room} before init() or after the last")
            first = len(self.pages_sent)
            total = first + len(page_ids)
            if total > self.num_pages or last and total != self.num_pages:
                raise ValueError(
                    f"room {self.room}: {total} pages sent of the {self.num_pages} declared"
                )
            self._state = KVPoll.Transferring
            self.chunks.append(list(page_ids))
            self.aux = aux
        nbytes = 0
        peer = self._mgr.peer
        if peer is not None and self.dest is not None:
            dst_pages, slot, skip = self.dest
            src = [p for i, p in enumerate(page_ids, first) if i >= skip]
            dst = dst_pages[max(first - skip, 0) : total - skip]
            if len(src) != len(dst):
                self._finish_failed(
                    f"room {self.room}: {len(src)} pages sent onto {len(dst)} of decode's",
                    TRANSFER_ERROR,
                )
                return
            nbytes = _copy_pages(self._mgr.args, src, peer.args, dst)
        if aux is None:
            return
        assert self.aux_slot is not None  # set by init(), checked above
        if self._mgr.scripted:
            self._mgr.write_aux(self.aux_slot, aux)  # the test says when it is a Success
            return
        receiver = peer.receiver_of(self.room) if peer is not None else None
        if peer is not None and self.dest is not None:  # alone, no memory is touched
            self._mgr.write_aux(self.aux_slot, aux)  # the transfer layer's write, its only one
            peer.write_aux(self.dest[1], aux)
        self._finish_success(nbytes, total, 0.0)
        if receiver is not None:
            receiver.done(nbytes, total)


class FakeReceiver(FakeHandle, KVReceiver):
    def __init__(self, room: int, manager: FakeKVManager, aux: AuxRecord) -> None:
        super().__init__(room, manager)
        self._state = KVPoll.Bootstrapping if manager.scripted else KVPoll.WaitingForInput
        self._aux = aux
        self.dst_pages: list[int] | None = None  # given by init()
        self.skip_pages = 0

    def _pages_done(self) -> int:
        return len(self.dst_pages or ())

    def init(self, dst_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        self._scripted("init")
        with self._lock:
            if self._state != KVPoll.WaitingForInput:
                raise RuntimeError(f"init() on room {self.room} in state {self._state.name}")
            self._state = KVPoll.Transferring
            self.dst_pages, self.aux_slot, self.skip_pages = list(dst_pages), aux_slot, skip_pages
        peer = self._mgr.peer
        if peer is not None:
            peer.give_dest(self.room, list(dst_pages), aux_slot, skip_pages)
        elif not self._mgr.scripted:
            self._finish_success(0, len(dst_pages), 0.0)

    def done(self, nbytes: int, npages: int) -> None:
        self._finish_success(nbytes, npages, 0.0)

    def aux_record(self) -> AuxRecord:
        if self._mgr.peer is None and not self._mgr.scripted:
            return self._aux
        if self._state != KVPoll.Success or self.aux_slot is None:
            raise KVTransferError(f"room {self.room} has no aux record in state {self._state.name}")
        rec = self._mgr.read_aux(self.aux_slot)
        if rec.room != self.room:
            raise KVTransferError(
                f"aux record guard: room {rec.room} found in the slot of room {self.room}"
            )
        return rec


class FakeKVManager(KVManager):
    """A manager of either role (see module doc); ``args`` is the memory it copies from or
    into when linked, and where aux records are read and written unless alone.
    ``scripted``: rooms move only as the test says. ValueError for an unknown role."""

    def __init__(self, args: KVArgs, role: str, *, scripted: bool = False) -> None:
        self.role = pd_role(role)
        self.args = args
        self.scripted = scripted
        self.peer: FakeKVManager | None = None
        self._rooms: RoomTable = RoomTable(self.role)
        self._metrics = TransferMetrics()
        self._injector = FailureInjector()  # never fails a room: health probes run on it
        self._aux: dict[int, AuxRecord] = {}
        self._dests: dict[int, tuple[list[int], int, int]] = {}  # before the sender exists
        self._history: OrderedDict[int, FakeSender | FakeReceiver] = OrderedDict()
        self._lock = threading.Lock()
        self._down = False

    # --- aux bytes (registered host memory, as NIXL sees it) ---------------------------
    def write_aux(self, slot: int, aux: AuxRecord) -> None:
        """Write ``aux`` into aux slot ``slot`` of this manager's memory."""
        a = self.args
        ctypes.memmove(a.aux_data_ptr + slot * a.aux_item_len, aux.pack(), AUX_RECORD_BYTES)

    def read_aux(self, slot: int) -> AuxRecord:
        a = self.args
        return AuxRecord.unpack(
            ctypes.string_at(a.aux_data_ptr + slot * a.aux_item_len, AUX_RECORD_BYTES)
        )

    def provide_aux(self, room: int, aux: AuxRecord) -> None:
        """The aux record the receiver of ``room`` will report (decode role, alone)."""
        with self._lock:
            self._aux[check_room(room)] = aux

    # --- what tests read ---------------------------------------------------------------
    def handle(self, room: int) -> FakeSender | FakeReceiver | None:
        """The last handle created for ``room`` (live or closed, among the last
        :data:`HISTORY`), else None."""
        with self._lock:
            return self._history.get(room)

    def handles(self) -> list[FakeSender | FakeReceiver]:
        """The last :data:`HISTORY` handles, oldest first."""
        with self._lock:
            return list(self._history.values())

    def _remember(self, room: int, handle: FakeSender | FakeReceiver) -> None:
        with self._lock:
            self._history.pop(room, None)
            self._history[room] = handle
            while len(self._history) > HISTORY:
                self._history.popitem(last=False)

    # --- loopback ------------------------------------------------------------------
    def give_dest(self, room: int, dst_pages: list[int], aux_slot: int, skip: int) -> None:
        handle = self._rooms.get(room)
        if isinstance(handle, FakeSender):
            handle.attach_dest(dst_pages, aux_slot, skip)
        else:
            with self._lock:
                self._dests[room] = (dst_pages, aux_slot, skip)

    def receiver_of(self, room: int) -> FakeReceiver | None:
        handle = self._rooms.get(room)
        return handle if isinstance(handle, FakeReceiver) else None

    # --- KVManager -----------------------------------------------------------------
    def create_sender(self, bootstrap_room: int) -> KVSender:
        if self.role != Role.PREFILL:
            raise RuntimeError("create_sender on a decode manager")
        room = check_room(bootstrap_room)
        sender = FakeSender(room, self)
        self._rooms.add(room, sender)
        self._remember(room, sender)
        with self._lock:
            dest = self._dests.pop(room, None)
        if dest is not None:
            sender.attach_dest(*dest)
        return sender

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int
    ) -> KVReceiver:
        if self.role != Role.DECODE:
            raise RuntimeError("create_receiver on a prefill manager")
        room = check_room(bootstrap_room)
        with self._lock:
            aux = self._aux.pop(room, None) or AuxRecord(room, 0, 0.0)
        receiver = FakeReceiver(room, self, aux)
        self._rooms.add(room, receiver)
        self._remember(room, receiver)
        return receiver

    def num_live_rooms(self) -> int:
        return len(self._rooms)

    def is_healthy(self) -> bool:
        return not self._down

    def stats(self) -> dict:
        return self._rooms.stats(self._metrics, "fake" if self.peer is None else "loopback")

    def shutdown(self) -> None:
        self._down = True


def link(prefill: FakeKVManager, decode: FakeKVManager) -> None:
    """Make the two managers a loopback pair (module doc). ValueError when the roles are
    not prefill and decode, one is scripted, or the pools' geometries differ."""
    if prefill.role != Role.PREFILL or decode.role != Role.DECODE:
        raise ValueError("link(prefill, decode): roles must be prefill and decode")
    if prefill.scripted or decode.scripted:
        raise ValueError("link(): a scripted manager has no peer (the test plays it)")
    if prefill.args.kv_item_lens != decode.args.kv_item_lens:
        raise ValueError(
            f"KV buffers differ: {prefill.args.kv_item_lens[:2]}... vs {decode.args.kv_item_lens[:2]}..."
        )
    diff = prefill.args.layout.first_difference(decode.args.layout)
    if diff is not None:
        raise ValueError(f"KV layout mismatch: {diff}")
    prefill.peer, decode.peer = decode, prefill
