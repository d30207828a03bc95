"""The ``fake`` transfer backend: no peer, no bytes moved. Used by ``/health_generate``
and warm-up in PD roles, so a worker can run one request end to end alone.

Sender: ``WaitingForInput`` at once, ``Success`` on ``send``. Receiver: ``WaitingForInput``
at once, ``Success`` right after ``init``; its aux record is the one handed to
:meth:`FakeKVManager.provide_aux` for the room, else first token 0 with logprob 0.
The pages' contents are whatever they were (fine for a health probe, never for answers).
"""

from __future__ import annotations

import threading

from pdserve.disagg.base import PD_ROLES, AuxRecord, KVArgs, KVManager, KVPoll, KVReceiver, KVSender
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.rooms import FailureInjector, RoomHandle, RoomTable, check_room


class FakeSender(RoomHandle, KVSender):
    def __init__(self, room, table, metrics, injector) -> None:
        super().__init__(room, table, metrics, injector)
        self._state = KVPoll.WaitingForInput
        self._num_pages = 0

    def init(self, num_pages: int, aux_slot: int) -> None:
        self._num_pages = num_pages

    def send(self, page_ids: list[int], aux: AuxRecord) -> None:
        with self._lock:
            if self._state != KVPoll.WaitingForInput:
                raise RuntimeError(f"send() on room {self.room} in state {self._state.name}")
            self._state = KVPoll.Transferring
        self._finish_success(0, len(page_ids), 0.0)


class FakeReceiver(RoomHandle, KVReceiver):
    def __init__(self, room, table, metrics, injector, aux: AuxRecord) -> None:
        super().__init__(room, table, metrics, injector)
        self._state = KVPoll.WaitingForInput
        self._aux = aux

    def init(self, dst_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        with self._lock:
            if self._state != KVPoll.WaitingForInput:
                raise RuntimeError(f"init() on room {self.room} in state {self._state.name}")
            self._state = KVPoll.Transferring
        self._finish_success(0, len(dst_pages), 0.0)

    def aux_record(self) -> AuxRecord:
        return self._aux


class FakeKVManager(KVManager):
    """A manager of either role that completes every room at once (see module doc)."""

    def __init__(self, args: KVArgs, role: str) -> None:
        if role not in PD_ROLES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role = role
        self._args = args
        self._rooms: RoomTable = RoomTable(role)
        self._metrics = TransferMetrics()
        self._injector = FailureInjector(prob=0.0)  # health probes must not fail by injection
        self._aux: dict[int, AuxRecord] = {}
        self._aux_lock = threading.Lock()
        self._down = False

    def provide_aux(self, room: int, aux: AuxRecord) -> None:
        """The aux record the receiver of ``room`` will report (decode role)."""
        with self._aux_lock:
            self._aux[check_room(room)] = aux

    def create_sender(self, bootstrap_room: int) -> KVSender:
        if self.role != "prefill":
            raise RuntimeError("create_sender on a decode manager")
        room = check_room(bootstrap_room)
        sender = FakeSender(room, self._rooms, self._metrics, self._injector)
        self._rooms.add(room, sender)
        return sender

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int
    ) -> KVReceiver:
        if self.role != "decode":
            raise RuntimeError("create_receiver on a prefill manager")
        room = check_room(bootstrap_room)
        with self._aux_lock:
            aux = self._aux.pop(room, None) or AuxRecord(room, 0, 0.0)
        receiver = FakeReceiver(room, self._rooms, self._metrics, self._injector, aux)
        self._rooms.add(room, receiver)
        return receiver

    def num_live_rooms(self) -> int:
        return len(self._rooms)

    def is_healthy(self) -> bool:
        return not self._down

    def stats(self) -> dict:
        return dict(
            self._metrics.snapshot(),
            backend="fake",
            role=self.role,
            rooms=self._rooms.count_by_state(),
            live_rooms=len(self._rooms),
        )

    def shutdown(self) -> None:
        self._down = True
