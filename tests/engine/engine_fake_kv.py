"""In-test KV transfer managers implementing the disagg ABCs, with no threads.

A prefill and a decode :class:`FakeManager` can be linked as a loopback: the receiver is
bootstrapped at once, ``receiver.init`` makes the room's sender ``WaitingForInput``, and
``sender.send`` copies the pages and the aux record between the two engines' pools and
makes both sides ``Success`` — a real transfer of the KV cache, in process.  With
``auto=False`` the test drives every state by hand.
"""

from __future__ import annotations

from pdserve.disagg.base import (
    AuxRecord,
    DuplicateRoomError,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
)


class _Handle:
    def __init__(self, manager: FakeManager, room: int) -> None:
        self.manager, self.room = manager, room
        self.state = KVPoll.Bootstrapping
        self.error: str | None = None
        self.closed = 0
        self.aborted = False
        self.poll_raises = False
        self.init_raises = False

    def poll(self) -> KVPoll:
        if self.poll_raises:
            raise RuntimeError("backend exploded")
        return self.state

    def failure_exception(self):
        return KVTransferError(self.error) if self.state == KVPoll.Failed else None

    def fail(self, message: str) -> None:
        self.state, self.error = KVPoll.Failed, message

    def abort(self) -> None:
        self.aborted = True
        if self.manager.auto and self.state not in (KVPoll.Success, KVPoll.Failed):
            self.fail("aborted")

    def close(self) -> None:
        assert self.state in (KVPoll.Success, KVPoll.Failed) or (
            self.poll_raises and self.aborted
        ), "closed before a terminal poll"
        self.closed += 1
        assert self.closed == 1, "closed twice"
        self.manager.live.pop(self.room, None)


class FakeSender(_Handle, KVSender):
    def __init__(self, manager, room):
        super().__init__(manager, room)
        self.init_args = None
        self.sent = None
        self.chunks: list[list[int]] = []  # page ids of each send() call
        peer = manager.peer.live.get(room) if manager.peer else None
        if manager.auto and peer is not None and peer.init_args is not None:
            self.state = KVPoll.WaitingForInput

    def init(self, num_pages: int, aux_slot: int) -> None:
        assert self.state >= KVPoll.WaitingForInput and self.init_args is None
        if self.init_raises:
            raise RuntimeError("init refused")
        self.init_args = (num_pages, aux_slot)

    def send(self, page_ids, *, last: bool, aux: AuxRecord | None = None) -> None:
        assert self.state in (KVPoll.WaitingForInput, KVPoll.Transferring)
        assert self.init_args is not None and (aux is not None) == last
        self.chunks.append(list(page_ids))
        self.state = KVPoll.Transferring
        if not last:
            return
        pages = [p for chunk in self.chunks for p in chunk]
        assert len(pages) == self.init_args[0]
        self.manager.pool.write_aux(self.init_args[1], aux.pack())  # the transfer layer's write
        self.sent = (pages, aux)
        receiver = self.manager.peer.live.get(self.room) if self.manager.peer else None
        if self.manager.auto and receiver is not None:
            dst_pages, slot = receiver.init_args
            sent = pages[receiver.skip_pages :]  # decode holds the leading pages
            assert len(sent) == len(dst_pages) and sent
            dst, src = self.manager.peer.pool, self.manager.pool
            lay = src.kv_layout
            lay.write_pages(dst.kv, dst_pages, lay.pages(src.kv, sent))
            dst.write_aux(slot, aux.pack())
            self.state = receiver.state = KVPoll.Success


class FakeReceiver(_Handle, KVReceiver):
    def __init__(self, manager, room):
        super().__init__(manager, room)
        self.init_args = None
        self.skip_pages = 0
        if manager.auto:
            self.state = KVPoll.WaitingForInput

    def init(self, dst_pages, aux_slot: int, skip_pages: int = 0) -> None:
        assert self.state >= KVPoll.WaitingForInput and self.init_args is None
        if self.init_raises:
            raise RuntimeError("init refused")
        self.init_args = (list(dst_pages), aux_slot)
        self.skip_pages = skip_pages
        sender = self.manager.peer.live.get(self.room) if self.manager.peer else None
        if self.manager.auto and sender is not None:
            sender.state = KVPoll.WaitingForInput

    def aux_record(self) -> AuxRecord:
        rec = AuxRecord.unpack(self.manager.pool.read_aux(self.init_args[1]))
        if rec.room != self.room:
            raise KVTransferError(f"aux record of room {rec.room} read for room {self.room}")
        return rec


class FakeManager(KVManager):
    """``role`` "prefill" or "decode"; ``pool`` is set once the engine exists."""

    def __init__(self, role: str, auto: bool = True) -> None:
        self.role = role
        self.auto = auto
        self.peer: FakeManager | None = None
        self.pool = None
        self.live: dict[int, _Handle] = {}
        self.created: list[_Handle] = []

    def _create(self, cls, room):
        if room in self.live:
            raise DuplicateRoomError(f"bootstrap_room {room} is live")
        handle = cls(self, room)
        self.live[room] = handle
        self.created.append(handle)
        return handle

    def create_sender(self, bootstrap_room: int) -> KVSender:
        return self._create(FakeSender, bootstrap_room)

    def create_receiver(self, bootstrap_host, bootstrap_port, bootstrap_room) -> KVReceiver:
        return self._create(FakeReceiver, bootstrap_room)

    def is_healthy(self) -> bool:
        return True

    def stats(self) -> dict:
        return {"live": len(self.live)}

    def shutdown(self) -> None:
        self.live.clear()
