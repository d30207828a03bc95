"""Contracts of the KV-transfer layer and what every backend's rooms share.

This module owns (1) the contracts: what the engine's scheduler calls and what backends
implement; (2) room numbering, the one rule the router and the workers share; (3) the
room machinery every backend reuses: the live-room table, failure kinds, failure
injection, a room's terminal-state bookkeeping and a manager's service threads. They
live together because a backend needs all three and the router and server need only the
room rules, which import nothing above this module.

The engine never imports a backend; it gets a :class:`KVManager` from
:func:`pdserve.disagg.registry.create_kv_manager` and talks to it through these classes.

Page ownership rule (both sides): pages handed to ``KVSender.send`` or
``KVReceiver.init`` belong to the transfer layer until ``poll()`` has returned a terminal
state (``Success`` or ``Failed``) and, on decode, ``holds_pages()`` is False (a room whose
prefill may still WRITE stays quarantined: never freed on a timeout alone). ``abort()``
only *asks* for termination; the engine frees the pages after that, and calls
``close()`` exactly once, which releases the room id.

Room numbering: the router draws one ``bootstrap_room`` R per client request and sends it
to both legs. A request of ``P`` prompts with ``n`` samples each reserves the ``P * n``
rooms ``R .. R + P * n - 1``: sample ``i`` of prompt ``p`` uses room ``R + p * n + i`` on
both workers, so every sample has its own live room. Every room is an int in
``[0, ROOM_LIMIT)``, and a request uses at most ``MAX_ROOMS_PER_REQUEST`` of them.
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sized
from dataclasses import dataclass, fields
from enum import Enum, IntEnum
from typing import Any, Generic, TypeVar

from pdserve.disagg.metrics import TransferMetrics
from pdserve.parallel import TPRank, kv_head_range

log = logging.getLogger(__name__)

# 2: RoomDest.skip_pages (decode holds a cached prefix), KVLayout.kv_order.
# 3: chunked sending (a room's pages in several send() batches, one XferDone), Ping.
# 4: tensor parallelism: RankInfo/Hello carry rank facts (TP size, rank, KV head range),
#    HealthInfo lists the registered ranks' instances; a room has one writer per head.
# 5: the aux record rides in XferDone (no aux WRITE), XferDone on the last KV WRITE;
#    since sent after the WRITEs by prefill's notifier agent (same bytes, no wire change).
# 6: KVLayout.k_scales / v_scales (an FP8 pool's per-layer scales).
PROTOCOL_VERSION = 6

# Bootstrap rooms are 63-bit: a room is an int in [0, ROOM_LIMIT) (SGLang's range), the
# router draws them and the worker checks them.
ROOM_LIMIT = 2**63


class Role(str, Enum):
    """A worker's role: a mixed worker runs whole requests; prefill and decode workers
    split them.  A ``str``, so ``Role.PREFILL == "prefill"``; parse a string at the edge
    with ``Role(text)`` (ValueError for an unknown one)."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:  # f"{role}" is the value on every Python (3.11 changed it)
        return self.value


PD_ROLES = (Role.PREFILL, Role.DECODE)


def pd_role(value: str, field: str = "role") -> Role:
    """``value`` as a PD role (prefill or decode); ValueError naming ``field`` otherwise."""
    if value not in PD_ROLES:
        raise ValueError(f"{field} must be prefill or decode, got {value!r}")
    return Role(value)


# The KV pool's physical orders (pdserve.engine.kv.layout says what each one is); the name
# travels in KVLayout.kv_order, so both sides of a transfer compare it.
LAYER_MAJOR = "layer_major"
PAGE_MAJOR = "page_major"
KV_ORDERS = (LAYER_MAJOR, PAGE_MAJOR)


def check_order(order: str, field: str = "kv_order") -> str:
    """Return ``order``; ValueError naming ``field`` and the known orders otherwise."""
    if order not in KV_ORDERS:
        raise ValueError(f"{field}: {order!r} is not a KV order; known: {', '.join(KV_ORDERS)}")
    return order


# OpenAI allows at most 20 top_logprobs; the aux record has room for that many.
MAX_TOP_LOGPROBS = 20


class KVPoll(IntEnum):
    """State of one room's transfer; ``Failed`` and ``Success`` are terminal."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class KVTransferError(RuntimeError):
    """A room's transfer failed; the message says why (timeout, peer death, mismatch...)."""


class DuplicateRoomError(ValueError):
    """A room id that is still live on this worker was used again."""


@dataclass(frozen=True)
class KVLayout:
    """The model facts that must agree between prefill and decode for KV bytes to be
    copied as they are (whatever the TP sizes of the two sides).

    ``model`` is the weight source's fingerprint; ``dtype`` a torch dtype name such as
    ``float32``; ``page_size`` tokens per page; ``kv_order`` the pool's physical order
    (:data:`KV_ORDERS`, default page-major as the pools', see :mod:`pdserve.engine.kv.layout`); the rest are
    model shapes, ``num_kv_heads`` the model's TOTAL KV head count (a rank's pool holds
    the heads of :attr:`KVArgs.kv_heads`: the rank facts, which may differ between the
    sides).  Equal sizes with another order is a mismatch, named ``kv_order``.
    ``speculative`` is the engine's speculative-decoding configuration
    (``SchedulerConfig.speculative_key``; ``""``: off): prefill and decode must run the same
    one (a draft model's KV would travel with the target's), a difference is a mismatch
    named ``speculative`` on both sides.
    ``k_scales`` / ``v_scales``: per layer the per-tensor scales of an FP8 pool (``dtype``
    ``float8_e4m3fn``; its bytes are ``k / k_scale`` in e4m3), ``()`` for any other pool:
    two FP8 pools whose scales differ hold different numbers in the same bytes.
    """

    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_order: str = PAGE_MAJOR
    speculative: str = ""
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    def first_difference(self, other: KVLayout) -> str | None:
        """Return ``"field: ours vs theirs"`` for the first differing field, else ``None``."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                return f"{f.name}: {a!r} vs {b!r}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """The layout of :meth:`to_dict`'s output (lists, as JSON gives them, read back as
        tuples); KeyError for a missing field."""
        values: dict[str, Any] = {
            f.name: tuple(data[f.name]) if isinstance(data[f.name], list) else data[f.name]
            for f in fields(cls)
        }
        return cls(**values)


@dataclass(frozen=True)
class KVArgs:
    """The memory a worker exposes to NIXL.

    kv_data_ptrs/kv_data_lens: base address and length in bytes of each KV buffer, in
        descriptor order (``KVCacheLayout.regions``: one per (layer, K|V) for a
        layer-major pool, L0.K, L0.V, L1.K, ...; a single buffer for a page-major one).
    kv_item_lens: bytes of one page in each buffer (the page stride); page ``p`` of a
        buffer is bytes ``[p * item, (p + 1) * item)`` of it.
    aux_data_ptr/aux_data_len/aux_item_len: host buffer of aux records, one slot each
        ``aux_item_len`` (= :data:`AUX_RECORD_BYTES`) bytes.
    device: ``cpu`` or ``cuda`` (where the KV buffers live); gpu_id: CUDA index of this
        rank's device (ignored on CPU).
    engine_rank/tp_size: this rank of the worker's tensor-parallel group (the rank facts,
        with :attr:`kv_heads`); the pool holds the KV heads ``kv_heads`` of the model's
        ``layout.num_kv_heads``, split by :func:`pdserve.parallel.kv_head_range`.
    Raises ValueError naming ``tensor_parallel_size``/``tp_rank``/``num_key_value_heads``
    for a rank the split rules do not allow.
    """

    kv_data_ptrs: tuple[int, ...]
    kv_data_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    aux_data_ptr: int
    aux_data_len: int
    aux_item_len: int
    layout: KVLayout
    device: str = "cpu"
    gpu_id: int = 0
    engine_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        kv_head_range(self.layout.num_kv_heads, self.tp)  # raises for a split not allowed

    @property
    def tp(self) -> TPRank:
        return TPRank(self.engine_rank, self.tp_size)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """``[start, end)`` of the model's KV heads this rank's pool holds."""
        return kv_head_range(self.layout.num_kv_heads, self.tp)

    @property
    def num_pages(self) -> int:
        return self.kv_data_lens[0] // self.kv_item_lens[0]

    @property
    def num_aux_slots(self) -> int:
        return self.aux_data_len // self.aux_item_len


# room u64, first token i64, logprob f32, n_top i32, top ids i64[20], top logprobs f32[20]
_AUX_FMT = f"<QqfI{MAX_TOP_LOGPROBS}q{MAX_TOP_LOGPROBS}f"
AUX_RECORD_BYTES = struct.calcsize(_AUX_FMT)
_AUX_STRUCT = struct.Struct(_AUX_FMT)
_AUX_HEAD = struct.Struct(_AUX_FMT[:5])  # room, first token, logprob, n_top
_AUX_NO_TOP = bytes(AUX_RECORD_BYTES - _AUX_HEAD.size)  # top-k of none: zeros, as packed


@dataclass(frozen=True)
class AuxRecord:
    """Per-room metadata written next to the KV pages: the first output token sampled on
    prefill, its logprob, its top-k alternatives, and the room id as a guard."""

    room: int
    first_token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def pack(self) -> bytes:
        """Serialise to exactly :data:`AUX_RECORD_BYTES` bytes. ValueError if top-k > 20."""
        n = len(self.top_ids)
        if n > MAX_TOP_LOGPROBS or len(self.top_logprobs) != n:
            raise ValueError(f"top_ids/top_logprobs must have equal length <= {MAX_TOP_LOGPROBS}")
        if not n:  # the usual record (no top-k): the same bytes, without building the padding
            return _AUX_HEAD.pack(self.room, self.first_token_id, self.logprob, 0) + _AUX_NO_TOP
        pad = MAX_TOP_LOGPROBS - n
        return _AUX_STRUCT.pack(
            self.room,
            self.first_token_id,
            self.logprob,
            n,
            *self.top_ids,
            *([0] * pad),
            *self.top_logprobs,
            *([0.0] * pad),
        )

    @classmethod
    def unpack(cls, data: bytes) -> AuxRecord:
        vals = struct.unpack(_AUX_FMT, bytes(data[:AUX_RECORD_BYTES]))
        room, tok, lp, n = vals[:4]
        ids = vals[4 : 4 + MAX_TOP_LOGPROBS][:n]
        lps = vals[4 + MAX_TOP_LOGPROBS :][:n]
        return cls(room, tok, lp, tuple(ids), tuple(lps))


class KVRoom(ABC):
    """What both sides of one room answer: its state, why it failed, abort and close."""

    @abstractmethod
    def poll(self) -> KVPoll:
        """Current state; never blocks."""

    @abstractmethod
    def failure_exception(self) -> Exception | None:
        """Why the room failed (a :class:`KVTransferError`), or ``None``."""

    @abstractmethod
    def abort(self) -> None:
        """Ask for termination at any state; ``poll()`` later reports ``Failed``."""

    @abstractmethod
    def close(self) -> None:
        """Called once by the engine after it freed the pages; releases the room id."""


class KVSender(KVRoom):
    """Prefill side of one room."""

    @abstractmethod
    def init(self, num_pages: int, aux_slot: int) -> None:
        """Declare how many pages the prompt will send and which local aux slot to use."""

    def expect_pages(self, page_ids: list[int]) -> None:
        """Optional hint, before any ``send``: the prompt's pages (all of them, prompt
        order) as one last ``send`` will list them.  A backend may prepare that transfer
        ahead (NIXL: the WRITE handles, made once decode's destination is known too), so
        the ``send`` only posts it; any other ``send`` goes the usual way, and what was
        prepared is released on that send or when the room fails.  Default: nothing."""
        return None

    @abstractmethod
    def send(self, page_ids: list[int], *, last: bool, aux: AuxRecord | None = None) -> None:
        """Post the WRITE of the prompt's next ``page_ids`` (all layers, prompt order,
        following those of earlier calls), so the pages of a chunked prefill move while
        the next chunk is computed.  Before the last call only full pages may be sent;
        the call with ``last=True`` sends the rest (the partial page included; possibly no
        page) and carries ``aux``, which the transfer layer alone writes into the room's
        aux slot.  The pages of every call count toward ``init``'s ``num_pages``.
        Valid once ``poll() >= WaitingForInput``; ``Transferring`` after the first call,
        ``Success`` once every call's WRITEs and the aux record are in decode's memory.
        ValueError: ``aux`` missing on the last call (or given before it), its room
        differs, or more pages than declared; RuntimeError: called in another state or
        after the last call."""


class KVReceiver(KVRoom):
    """Decode side of one room."""

    @abstractmethod
    def init(self, dst_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        """Send the destination pages and aux slot to prefill.  ``skip_pages``: how many
        leading pages of the prompt decode already holds (its prefix cache); prefill
        writes only the rest, prompt pages ``skip_pages ..`` onto ``dst_pages`` in order.
        Only valid once ``poll() >= WaitingForInput`` (bootstrap done, layout checked)."""

    def holds_pages(self) -> bool:
        """True while a peer that may still WRITE into the room's pages cannot be ruled
        out (its prefill was declared dead by the heartbeat but not known gone): the
        engine keeps the pages out of use, even after a terminal poll, until this turns
        False; then it frees them and calls ``close()``. Backends whose peers cannot
        write late keep the default."""
        return False

    @abstractmethod
    def aux_record(self) -> AuxRecord:
        """The aux record after ``Success``; raises KVTransferError if its room guard differs."""


class KVManager(ABC):
    """One per worker: owns the transfer engine, the bootstrap (prefill) or the peer cache
    and heartbeats (decode), and every live room."""

    role: Role  # PREFILL or DECODE
    _rooms: Sized  # the live rooms (a RoomTable, or a facade's own map)

    @abstractmethod
    def create_sender(self, bootstrap_room: int) -> KVSender:
        """Prefill: a sender for ``bootstrap_room``. DuplicateRoomError if the room is live."""

    @abstractmethod
    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int
    ) -> KVReceiver:
        """Decode: a receiver pulling from the prefill at ``bootstrap_host:bootstrap_port``.
        DuplicateRoomError if the room is live."""

    @abstractmethod
    def is_healthy(self) -> bool:
        """False once any background thread (listener, bootstrap, heartbeat, transfer) died."""

    def num_live_rooms(self) -> int:
        """Rooms created and not yet closed (the engine's check that every room ended)."""
        return len(self._rooms)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> bool:
        """Have ``wakeup`` called (from a transfer-layer thread; it must not block) each
        time a room moves to a state the engine acts on (``WaitingForInput``, ``Success``,
        ``Failed``), so an engine waiting between polls steps at once. False when this
        manager cannot (its rooms live in other processes: the engine's poll finds them)."""
        rooms = getattr(self, "_rooms", None)
        if not isinstance(rooms, RoomTable):
            return False
        rooms.set_wakeup(wakeup)
        return True

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for metrics: bytes/pages transferred, transfer latency sum/count,
        failures by reason, rooms by state."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop threads, close sockets, deregister memory. Idempotent."""

    @property
    def bootstrap_port(self) -> int | None:
        """Prefill: the port its bootstrap server listens on (after start); else None."""
        return None


class KVBootstrapServer(ABC):
    """HTTP server on a prefill worker where its ranks register and decode looks them up."""

    @abstractmethod
    def start(self) -> int:
        """Start serving; returns the bound port."""

    @abstractmethod
    def stop(self) -> None: ...


# --- room numbering (the router, the server and the managers) ---------------------

# Cap on the rooms one request reserves through a PD router (workers reject
# n > protocol.MAX_N); documented in docs/reference.md's `n` row (launch/api_docs.py).
MAX_ROOMS_PER_REQUEST = 1024


def sample_room(room: int, prompt_index: int, n: int, sample_index: int) -> int:
    """The room of sample ``sample_index`` of prompt ``prompt_index`` of a request whose
    ``bootstrap_room`` is ``room`` and which has ``n`` samples per prompt."""
    return room + prompt_index * n + sample_index


def rooms_needed(num_prompts: int, n: int) -> int:
    """How many consecutive rooms a request of ``num_prompts`` prompts with ``n`` samples
    each reserves."""
    return num_prompts * n


# The fields a PD request's two legs carry (the router adds them; a client never does):
# the prefill worker's bootstrap server and the transfer's room.
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def check_room(value: object, field: str = "bootstrap_room") -> int:
    """``value`` if it is an int (not a bool) in ``[0, ROOM_LIMIT)``; else ValueError
    naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ROOM_LIMIT:
        bound = f"2**{ROOM_LIMIT.bit_length() - 1}"
        raise ValueError(f"{field} must be an integer in [0, {bound}), got {value!r}")
    return value


# --- what every backend's rooms share --------------------------------------------

# Failure kinds: the label of the "failed transfers by reason" metric.
BOOTSTRAP_TIMEOUT = "bootstrap_timeout"  # prefill: decode's destination never came
WAITING_TIMEOUT = "waiting_timeout"  # decode: the KV cache never came
HEARTBEAT_LOST = "heartbeat_lost"  # decode: the prefill peer stopped answering
PEER_RESTARTED = "peer_restarted"  # the peer came back as a new instance
PEER_FAILED = "peer_failed"  # the other side failed or aborted the room
LAYOUT_MISMATCH = "layout_mismatch"  # KVLayout fields differ
PROTOCOL_MISMATCH = "protocol_mismatch"  # PROTOCOL_VERSION differs
BOOTSTRAP_ERROR = "bootstrap_error"  # bootstrap server unreachable / bad answer
TRANSFER_ERROR = "transfer_error"  # NIXL reported an error
ABORTED = "aborted"  # abort() by the engine
INJECTED = "injected"  # PDSERVE_TEST_DISAGG_FAILURE_PROB
SHUTDOWN = "shutdown"  # the manager shut down

_TERMINAL = (KVPoll.Success, KVPoll.Failed)

H = TypeVar("H", bound="RoomHandle")


class FailureInjector:
    """Testing only: ``roll()`` is True with probability ``prob`` (a manager's
    ``TransferConfig.failure_prob``: ``PDSERVE_TEST_DISAGG_FAILURE_PROB``; 0 = never).

    ``poll()`` rolls once per non-terminal state it reports for the first time (so at most
    three times per room), not once per call: the engine polls every step, and a per-call
    probability would fail nearly every room whatever its value."""

    def __init__(self, prob: float = 0.0, seed: int | None = None) -> None:
        self.prob = prob
        if not 0.0 <= self.prob <= 1.0:
            raise ValueError(f"PDSERVE_TEST_DISAGG_FAILURE_PROB must be in [0, 1], got {self.prob}")
        self._rng = random.Random(seed)

    def roll(self) -> bool:
        return self.prob > 0.0 and self._rng.random() < self.prob


class RoomTable(Generic[H]):
    """Live rooms of one manager, by room id; a room stays live until ``close()``.

    ``wake()``: a room moved to a state its engine acts on (``WaitingForInput``,
    ``Success``, ``Failed``), called by the room's own thread after the change; it calls
    the callback :meth:`set_wakeup` installed (the engine thread's wake-up: an engine
    waiting between polls steps at once instead of at its next poll), nothing before."""

    def __init__(self, role: Role) -> None:
        self._role = role
        self._lock = threading.Lock()
        self._rooms: dict[int, H] = {}
        self._wakeup: Callable[[], None] | None = None

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Install (``None``: remove) the callback of :meth:`wake`; it must not block."""
        self._wakeup = wakeup

    def wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None:
            wakeup()

    def add(self, room: int, handle: H) -> None:
        with self._lock:
            if room in self._rooms:
                raise DuplicateRoomError(
                    f"bootstrap_room {room} is still live on this {self._role} worker"
                )
            self._rooms[room] = handle

    def get(self, room: int) -> H | None:
        with self._lock:
            return self._rooms.get(room)

    def discard(self, room: int, handle: H) -> None:
        with self._lock:
            if self._rooms.get(room) is handle:
                del self._rooms[room]

    def handles(self) -> list[H]:
        with self._lock:
            return list(self._rooms.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    def count_by_state(self) -> dict[str, int]:
        counts = Counter(h.poll_state().name for h in self.handles())
        return {s.name: counts.get(s.name, 0) for s in KVPoll}

    def stats(self, metrics: TransferMetrics, backend: str) -> dict[str, Any]:
        """The head every manager's ``stats()`` starts with: the transfer counters, the
        role and backend, live rooms by state and in all."""
        return dict(
            metrics.snapshot(),
            role=str(self._role),
            backend=backend,
            rooms=self.count_by_state(),
            live_rooms=len(self),
        )


class RoomHandle:
    """State of one room on one side. Subclasses move ``_state`` forward under ``_lock``
    and call :meth:`_finish_failed` / :meth:`_finish_success` to end it (exactly once)."""

    def __init__(
        self, room: int, table: RoomTable[Any], metrics: TransferMetrics, injector: FailureInjector
    ) -> None:
        self.room = room
        self._table = table
        self._metrics = metrics
        self._injector = injector
        self._lock = threading.RLock()
        self._state = KVPoll.Bootstrapping
        self._error: KVTransferError | None = None
        self._closed = False
        self._rolled: KVPoll | None = None  # last state failure injection rolled for
        # time.perf_counter() when the room turned terminal here (CLOCK_MONOTONIC: benchmarks
        # compare it across processes of one host)
        self.finished_at: float | None = None

    # --- subclass hooks -----------------------------------------------------------
    def _tick(self) -> None:
        """Check deadlines (called by ``poll``)."""

    def _fail(self, reason: str, kind: str) -> None:
        """Start failing the room; by default at once (no pages at the peer's disposal)."""
        self._finish_failed(reason, kind)

    # --- shared -------------------------------------------------------------------
    def poll_state(self) -> KVPoll:
        return self._state

    def is_terminal(self) -> bool:
        return self._state in _TERMINAL

    def poll(self) -> KVPoll:
        """Current state; never blocks. May inject a failure (same path as a real one)."""
        self._tick()
        state = self._state
        if state not in _TERMINAL and state != self._rolled:
            self._rolled = state
            if self._injector.roll():
                self._fail(
                    f"injected failure of room {self.room} (PDSERVE_TEST_DISAGG_FAILURE_PROB)",
                    INJECTED,
                )
        return self._state

    def failure_exception(self) -> Exception | None:
        return self._error if self._state == KVPoll.Failed else None

    def abort(self) -> None:
        """Ask for termination; ``poll()`` reports ``Failed`` once nothing can touch the pages."""
        with self._lock:
            if self._state not in _TERMINAL:
                self._fail(f"room {self.room} aborted", ABORTED)

    def close(self) -> None:
        """Release the room id (once, after a terminal poll). RuntimeError on a second call."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"close() called twice for room {self.room}")
            if self._state not in _TERMINAL:
                log.error("room %d closed before a terminal poll; aborting it", self.room)
                self._fail(f"room {self.room} closed before it ended", ABORTED)
            self._closed = True
        self._table.discard(self.room, self)

    def _finish_failed(self, reason: str, kind: str) -> bool:
        """Make the room terminal ``Failed``; False if it already was terminal."""
        with self._lock:
            if self._state in _TERMINAL:
                return False
            self.finished_at = time.perf_counter()
            self._state = KVPoll.Failed
            self._error = KVTransferError(reason)
        self._table.wake()
        self._metrics.record_failure(kind)
        log.debug("room %d failed (%s): %s", self.room, kind, reason)
        return True

    def _finish_success(self, nbytes: int, npages: int, seconds: float) -> bool:
        with self._lock:
            if self._state in _TERMINAL:
                return False
            self.finished_at = time.perf_counter()
            self._state = KVPoll.Success
        self._table.wake()
        self._metrics.record_success(nbytes, npages, seconds)
        return True


class ServiceThreads:
    """Named daemon background threads of one manager. A thread whose loop raises is
    logged and stays dead, which makes :meth:`healthy` False (the worker reports
    unhealthy instead of being silently broken)."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self.stop_event = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def start(self, name: str, loop: Callable[[threading.Event], None]) -> None:
        """Run ``loop(stop_event)`` on a new daemon thread named ``{owner}-{name}``."""

        def run() -> None:
            try:
                loop(self.stop_event)
            except BaseException as exc:
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                log.exception("%s background thread %s died", self._owner, name)

        thread = threading.Thread(target=run, name=f"{self._owner}-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def healthy(self) -> bool:
        return not self.errors and all(t.is_alive() for t in self._threads)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stop_event.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout_s)
