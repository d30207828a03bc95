"""The wire of the KV-transfer layer: typed msgspec messages, each carrying the protocol version.

Three channels use them:
- HTTP bootstrap (JSON): a prefill rank registers :class:`RankInfo`; decode fetches it;
  ``/health`` answers :class:`HealthInfo` (decode's heartbeat).
- ZMQ control (msgpack, decode DEALER <-> prefill ROUTER): :class:`Envelope` holding
  :class:`Hello`, :class:`RoomDest`, :class:`RoomAbort` (decode -> prefill) or
  :class:`RoomStatus` / :class:`Ping` (prefill -> decode).
- NIXL notification (msgpack): :class:`XferDone`, sent by prefill once a room's WRITEs
  completed (riding on the last KV WRITE, or on its own), with the aux record.
A message of another protocol version is rejected with :class:`WireError` naming both versions.

The ZMQ plumbing of the control channel lives here too (:class:`Outbox`, :func:`recv_all`):
the control thread is the only thread touching its sockets (ZMQ sockets are not
thread-safe), and other threads hand it messages through the outbox. Both sides' managers
use the messages and the plumbing together, so they are one module.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any, Union

import msgspec
import zmq

from pdserve.disagg.base import PROTOCOL_VERSION


class WireError(ValueError):
    """A message that does not decode, or was written by another protocol version."""


class BufferDescs(msgspec.Struct, frozen=True):
    """Registered memory of one side. ptrs/lens: bytes of each buffer; item_lens: bytes of
    one page (or one aux slot) in each; mem_type: ``DRAM`` or ``VRAM``; dev_id: NIXL device id."""

    ptrs: list[int]
    lens: list[int]
    item_lens: list[int]
    mem_type: str
    dev_id: int


class RankInfo(msgspec.Struct, frozen=True):
    """What a prefill rank registers at its worker's bootstrap server (agent_metadata is
    base64). ``layout``: the model facts (:class:`~pdserve.disagg.base.KVLayout`);
    ``tp_size``, ``engine_rank`` and ``kv_heads`` (``[start, end)`` of the model's KV
    heads in this rank's pool): the rank facts."""

    protocol_version: int
    instance_id: str
    engine_rank: int
    agent_name: str
    agent_metadata: str
    control_endpoint: str
    layout: dict[str, Any]
    kv: BufferDescs
    aux: BufferDescs
    tp_size: int
    kv_heads: list[int]


class HealthInfo(msgspec.Struct, frozen=True):
    """``GET /health`` of a bootstrap server: the status of the worker's rank 0 manager
    (``instance_id``) and ``ranks``, engine rank -> instance id of every rank registered
    now (a rank that died is removed, so decode knows it gone)."""

    status: str
    instance_id: str
    protocol_version: int
    ranks: dict[int, str] = {}


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Decode introduces itself to one prefill rank instance (once per pair): its NIXL
    agent, the memory prefill will WRITE into, and its rank facts (``tp_size``,
    ``engine_rank``, ``kv_heads``), from which prefill computes the heads it writes there
    (:mod:`pdserve.disagg.bootstrap`)."""

    prefill_instance: str
    decode_instance: str
    agent_name: str
    agent_metadata: bytes
    kv: BufferDescs
    aux: BufferDescs
    tp_size: int
    engine_rank: int
    kv_heads: list[int]


class RoomDest(msgspec.Struct, frozen=True, tag="dest"):
    """Where prefill must WRITE one room: decode's page ids (prompt order) and aux slot.
    ``skip_pages``: leading prompt pages decode already holds; prefill sends prompt pages
    ``skip_pages ..`` onto ``dst_pages`` (so ``len(dst_pages) + skip_pages`` is the
    prompt's page count)."""

    room: int
    prefill_instance: str
    decode_instance: str
    dst_pages: list[int]
    aux_slot: int
    skip_pages: int = 0


class RoomAbort(msgspec.Struct, frozen=True, tag="abort"):
    """Decode gave up on a room (abort, timeout, mismatch, injected failure). Prefill
    answers with a failed :class:`RoomStatus` once it will no longer touch decode's pages."""

    room: int
    prefill_instance: str
    decode_instance: str
    reason: str
    kind: str


class RoomStatus(msgspec.Struct, frozen=True, tag="status"):
    """Prefill's word on a room: ``ok=False`` means it failed there (or acknowledges an
    abort) and prefill will not WRITE into its pages any more."""

    room: int
    prefill_instance: str
    ok: bool
    reason: str
    kind: str


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Prefill -> decode, about once a second to each decode peer: ZMQ refuses to route
    it once that decode's connection is gone, which is how prefill forgets dead peers
    (their NIXL agent and prepared descriptor lists). Decode ignores it."""

    prefill_instance: str


ControlMessage = Union[Hello, RoomDest, RoomAbort, RoomStatus, Ping]  # noqa: UP007 (a runtime value)


class Envelope(msgspec.Struct, frozen=True):
    v: int
    msg: ControlMessage


class XferDone(msgspec.Struct, frozen=True):
    """NIXL notification payload: all KV WRITEs of ``room`` are complete. ``aux``: the
    room's packed :class:`~pdserve.disagg.base.AuxRecord` for the decode rank that takes it
    (rank 0; empty for the others), which decode stores in the room's aux slot."""

    v: int
    room: int
    prefill_instance: str
    aux: bytes = b""


class _Header(msgspec.Struct):
    v: int


_ENC = msgspec.msgpack.Encoder()
_HEADER = msgspec.msgpack.Decoder(_Header)
_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_XFER_DONE = msgspec.msgpack.Decoder(XferDone)


def _check_version(data: bytes) -> None:
    try:
        v = _HEADER.decode(data).v
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable message: {exc}") from exc
    if v != PROTOCOL_VERSION:
        raise WireError(f"protocol_version: ours {PROTOCOL_VERSION} vs theirs {v}")


def encode_control(msg: ControlMessage) -> bytes:
    return _ENC.encode(Envelope(PROTOCOL_VERSION, msg))


def decode_control(data: bytes) -> ControlMessage:
    """Decode a ZMQ control message. WireError on bad bytes or another protocol version."""
    _check_version(data)
    try:
        return _ENVELOPE.decode(data).msg
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable control message: {exc}") from exc


def encode_xfer_done(room: int, prefill_instance: str, aux: bytes = b"") -> bytes:
    return _ENC.encode(XferDone(PROTOCOL_VERSION, room, prefill_instance, aux))


def decode_xfer_done(data: bytes) -> XferDone:
    """Decode a NIXL notification. WireError on bad bytes or another protocol version."""
    _check_version(data)
    try:
        return _XFER_DONE.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable notification: {exc}") from exc


# --- ZMQ plumbing of the control channel ------------------------------------------

_ids = itertools.count()


class Outbox:
    """Items other threads hand to the control thread. ``put`` enqueues and wakes it
    through an inproc socket that the control thread polls (``wake_socket``)."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        addr = f"inproc://pdserve-outbox-{next(_ids)}"
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.wake_socket = ctx.socket(zmq.PULL)
        self.wake_socket.bind(addr)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is enough
        self._push.connect(addr)
        self._lock = threading.Lock()

    def put(self, item: Any) -> None:
        self._queue.put(item)
        with self._lock:
            try:
                self._push.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # Again (a wake-up is pending) or closed at shutdown
                pass

    def drain(self) -> list[Any]:
        """Everything queued so far (control thread only)."""
        while True:
            try:
                self.wake_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        items: list[Any] = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        self.wake_socket.close(linger=0)


def recv_all(sock: zmq.Socket[Any]) -> list[list[bytes]]:
    """Every message waiting on ``sock`` (multipart frames), without blocking."""
    out: list[list[bytes]] = []
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out
