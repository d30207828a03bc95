"""Contracts of the KV-transfer layer: what the engine's scheduler calls, what backends implement.

The engine never imports a backend; it gets a :class:`KVManager` from
:func:`pdserve.disagg.registry.create_kv_manager` and talks to it through these classes.

Page ownership rule (both sides): pages handed to ``KVSender.send`` or
``KVReceiver.init`` belong to the transfer layer until ``poll()`` has returned a terminal
state (``Success`` or ``Failed``) and, on decode, ``holds_pages()`` is False (a room whose
prefill may still WRITE stays quarantined: never freed on a timeout alone). ``abort()``
only *asks* for termination; the engine frees the pages after that, and calls
``close()`` exactly once, which releases the room id.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from enum import Enum, IntEnum
from typing import Any

from pdserve.parallel import TPRank, kv_head_range

# 2: RoomDest.skip_pages (decode holds a cached prefix), KVLayout.kv_order.
# 3: chunked sending (a room's pages in several send() batches, one XferDone), Ping.
# 4: tensor parallelism: RankInfo/Hello carry rank facts (TP size, rank, KV head range),
#    HealthInfo lists the registered ranks' instances; a room has one writer per head.
# 5: the aux record rides in XferDone (no aux WRITE), XferDone on the last KV WRITE;
#    since sent after the WRITEs by prefill's notifier agent (same bytes, no wire change).
PROTOCOL_VERSION = 5

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
    """

    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_order: str = PAGE_MAJOR
    speculative: str = ""

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
        return cls(**{f.name: data[f.name] for f in fields(cls)})


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
        pad = MAX_TOP_LOGPROBS - n
        return struct.pack(
            _AUX_FMT,
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


class KVSender(ABC):
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


class KVReceiver(ABC):
    """Decode side of one room."""

    @abstractmethod
    def init(self, dst_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        """Send the destination pages and aux slot to prefill.  ``skip_pages``: how many
        leading pages of the prompt decode already holds (its prefix cache); prefill
        writes only the rest, prompt pages ``skip_pages ..`` onto ``dst_pages`` in order.
        Only valid once ``poll() >= WaitingForInput`` (bootstrap done, layout checked)."""

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def failure_exception(self) -> Exception | None: ...

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

    @abstractmethod
    def abort(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class KVManager(ABC):
    """One per worker: owns the transfer engine, the bootstrap (prefill) or the peer cache
    and heartbeats (decode), and every live room."""

    role: Role  # PREFILL or DECODE

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

    @abstractmethod
    def num_live_rooms(self) -> int:
        """Rooms created and not yet closed (the engine's check that every room ended)."""

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
