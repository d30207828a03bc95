"""The ``fake`` transfer backend, in two modes, threads-free and in one process.

**Alone** (the registry's ``fake``): no peer, no bytes moved. Used by ``/health_generate``
and warm-up in PD roles, so a worker can run one request end to end alone. Sender:
``WaitingForInput`` at once, ``Success`` on the last ``send``. Receiver:
``WaitingForInput`` at once, ``Success`` right after ``init``; its aux record is the one
handed to :meth:`FakeKVManager.provide_aux` for the room, else first token 0 with
logprob 0. The pages' contents are whatever they were (fine for a health probe, never
for answers).

**Loopback** (:func:`link` a prefill and a decode manager): a real transfer in process,
over the very byte ranges NIXL would move (``KVArgs``: page ``p`` of buffer ``b`` is
``[p * item, (p + 1) * item)``). The receiver is ``WaitingForInput`` at once; its
``init`` hands the destination (and ``skip_pages``) to the prefill room, which becomes
``WaitingForInput``; each ``send`` copies its pages at once (``memmove`` per page and
buffer), the last one also the aux record (the sender writes it into its own slot, then
into decode's); after the last both sides are ``Success``. A destination given before
the sender exists waits for it. The tests of the engine and the ``KVManager``
conformance suite (tests/disagg/test_kv_manager_conformance.py) run on it.
"""

from __future__ import annotations

import ctypes
import threading

from pdserve.disagg.base import (
    AUX_RECORD_BYTES,
    PD_ROLES,
    AuxRecord,
    KVArgs,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
)
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.rooms import TRANSFER_ERROR, FailureInjector, RoomHandle, RoomTable, check_room


def _copy_pages(src: KVArgs, src_pages: list[int], dst: KVArgs, dst_pages: list[int]) -> int:
    """Copy pages between two pools' registered buffers (same geometry); bytes copied."""
    n = 0
    for sp, lp, item, dp in zip(
        src.kv_data_ptrs, src.kv_data_lens, src.kv_item_lens, dst.kv_data_ptrs
    ):
        del lp
        for s, d in zip(src_pages, dst_pages):
            ctypes.memmove(dp + d * item, sp + s * item, item)
            n += item
    return n


class FakeSender(RoomHandle, KVSender):
    def __init__(self, room: int, manager: FakeKVManager) -> None:
        super().__init__(room, manager._rooms, manager._metrics, manager._injector)
        self._mgr = manager
        self._state = KVPoll.WaitingForInput if manager.peer is None else KVPoll.Bootstrapping
        self._num_pages = 0
        self._aux_slot = 0
        self._sent = 0
        self.dest: tuple[list[int], int, int] | None = None  # loopback: pages, slot, skip

    def attach_dest(self, dst_pages: list[int], aux_slot: int, skip_pages: int) -> None:
        with self._lock:
            self.dest = (list(dst_pages), aux_slot, skip_pages)
            if self._state == KVPoll.Bootstrapping:
                self._state = KVPoll.WaitingForInput

    def init(self, num_pages: int, aux_slot: int) -> None:
        self._num_pages, self._aux_slot = num_pages, aux_slot

    def send(self, page_ids: list[int], *, last: bool, aux: AuxRecord | None = None) -> None:
        if last and aux is None or not last and aux is not None:
            raise ValueError("aux is required with last=True and only then")
        with self._lock:
            if self._state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                raise RuntimeError(f"send() on room {self.room} in state {self._state.name}")
            self._state = KVPoll.Transferring
            first, self._sent = self._sent, self._sent + len(page_ids)
        nbytes = 0
        peer = self._mgr.peer
        if peer is not None and self.dest is not None:
            dst_pages, slot, skip = self.dest
            src = [p for i, p in enumerate(page_ids, first) if i >= skip]
            dst = dst_pages[max(first - skip, 0) : first + len(page_ids) - skip]
            if len(src) != len(dst):
                self._finish_failed(
                    f"room {self.room}: {len(src)} pages sent onto {len(dst)} of decode's",
                    TRANSFER_ERROR,
                )
                return
            nbytes = _copy_pages(self._mgr.args, src, peer.args, dst)
        if aux is None:
            return
        if aux.room != self.room:
            raise ValueError(f"aux.room {aux.room} differs from the room {self.room}")
        receiver = peer.receiver_of(self.room) if peer is not None else None
        if peer is not None and self.dest is not None:  # alone, no memory is touched
            self._mgr.write_aux(self._aux_slot, aux)  # the transfer layer's write, its only one
            peer.write_aux(self.dest[1], aux)
        self._finish_success(nbytes, self._sent, 0.0)
        if receiver is not None:
            receiver.done(nbytes, self._sent)


class FakeReceiver(RoomHandle, KVReceiver):
    def __init__(self, room: int, manager: FakeKVManager, aux: AuxRecord) -> None:
        super().__init__(room, manager._rooms, manager._metrics, manager._injector)
        self._mgr = manager
        self._state = KVPoll.WaitingForInput
        self._aux = aux
        self._slot: int | None = None

    def init(self, dst_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        with self._lock:
            if self._state != KVPoll.WaitingForInput:
                raise RuntimeError(f"init() on room {self.room} in state {self._state.name}")
            self._state = KVPoll.Transferring
            self._slot = aux_slot
        peer = self._mgr.peer
        if peer is None:
            self._finish_success(0, len(dst_pages), 0.0)
        else:
            peer.give_dest(self.room, list(dst_pages), aux_slot, skip_pages)

    def done(self, nbytes: int, npages: int) -> None:
        self._finish_success(nbytes, npages, 0.0)

    def aux_record(self) -> AuxRecord:
        if self._mgr.peer is None:
            return self._aux
        if self._state != KVPoll.Success or self._slot is None:
            raise KVTransferError(f"room {self.room} has no aux record in state {self._state.name}")
        rec = self._mgr.read_aux(self._slot)
        if rec.room != self.room:
            raise KVTransferError(
                f"aux record guard: room {rec.room} found in the slot of room {self.room}"
            )
        return rec


class FakeKVManager(KVManager):
    """A manager of either role (see module doc); ``args`` is the memory it copies from or
    into when linked. ValueError for an unknown role."""

    def __init__(self, args: KVArgs, role: str) -> None:
        if role not in PD_ROLES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role = role
        self.args = args
        self.peer: FakeKVManager | None = None
        self._rooms: RoomTable = RoomTable(role)
        self._metrics = TransferMetrics()
        self._injector = FailureInjector(prob=0.0)  # health probes must not fail by injection
        self._aux: dict[int, AuxRecord] = {}
        self._dests: dict[int, tuple[list[int], int, int]] = {}  # before the sender exists
        self._lock = threading.Lock()
        self._down = False

    # --- aux bytes (registered host memory, as NIXL sees it) ---------------------------
    def write_aux(self, slot: int, aux: AuxRecord) -> None:
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
        if self.role != "prefill":
            raise RuntimeError("create_sender on a decode manager")
        room = check_room(bootstrap_room)
        sender = FakeSender(room, self)
        self._rooms.add(room, sender)
        with self._lock:
            dest = self._dests.pop(room, None)
        if dest is not None:
            sender.attach_dest(*dest)
        return sender

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int
    ) -> KVReceiver:
        if self.role != "decode":
            raise RuntimeError("create_receiver on a prefill manager")
        room = check_room(bootstrap_room)
        with self._lock:
            aux = self._aux.pop(room, None) or AuxRecord(room, 0, 0.0)
        receiver = FakeReceiver(room, self, aux)
        self._rooms.add(room, receiver)
        return receiver

    def num_live_rooms(self) -> int:
        return len(self._rooms)

    def is_healthy(self) -> bool:
        return not self._down

    def stats(self) -> dict:
        return dict(
            self._metrics.snapshot(),
            backend="fake" if self.peer is None else "loopback",
            role=self.role,
            rooms=self._rooms.count_by_state(),
            live_rooms=len(self._rooms),
        )

    def shutdown(self) -> None:
        self._down = True


def link(prefill: FakeKVManager, decode: FakeKVManager) -> None:
    """Make the two managers a loopback pair (module doc). ValueError when the roles are
    not prefill and decode or the pools' geometries differ."""
    if prefill.role != "prefill" or decode.role != "decode":
        raise ValueError("link(prefill, decode): roles must be prefill and decode")
    if prefill.args.kv_item_lens != decode.args.kv_item_lens:
        raise ValueError(
            f"KV buffers differ: {prefill.args.kv_item_lens[:2]}... vs {decode.args.kv_item_lens[:2]}..."
        )
    diff = prefill.args.layout.first_difference(decode.args.layout)
    if diff is not None:
        raise ValueError(f"KV layout mismatch: {diff}")
    prefill.peer, decode.peer = decode, prefill
