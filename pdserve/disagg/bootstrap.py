"""The prefill worker's HTTP bootstrap server (FastAPI under uvicorn, on a thread) and
decode's client for it (httpx).

Routes: ``PUT /route/{engine_rank}`` (a prefill rank registers its :class:`RankInfo`),
``GET /route/{engine_rank}`` (decode looks it up; 404 until registered), ``GET /health``
(:class:`HealthInfo` with every registered rank's instance; 503 while the prefill
manager is unhealthy) — decode's heartbeat.
Bodies are JSON of the msgspec types in :mod:`pdserve.disagg.wire`; a bad body is a
400 with a JSON ``{"error": ...}``.

The head map lives here too: which prefill rank writes which KV heads into which decode
rank (tensor parallelism). A prefill worker of TP size ``p`` and a decode worker of TP
size ``d`` hold the same model's KV heads split by :func:`pdserve.parallel.kv_head_range`.
Every head a decode rank holds gets exactly one writer: the lowest prefill rank holding it
(prefill ranks past ``num_kv_heads`` hold replicas; the others stay idle for that head).
Both sides compute the map with these functions at bootstrap, so it is never sent over
the wire; that is why it sits next to the bootstrap server and client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.disagg.base import PROTOCOL_VERSION, KVBootstrapServer
from pdserve.disagg.wire import HealthInfo, RankInfo
from pdserve.http.netutil import PortInUseError, ThreadedServer
from pdserve.parallel import TPRank, kv_head_range


class BootstrapError(RuntimeError):
    """The bootstrap server could not be reached or gave an unusable answer."""


def build_app(ranks: dict[int, RankInfo], health: Callable[[], HealthInfo], lock: threading.Lock):
    """The FastAPI app over ``ranks`` (engine rank -> registered info); ``/health`` adds
    the registered ranks' instance ids to ``health()``."""
    app = FastAPI(title="pdserve bootstrap", docs_url=None, redoc_url=None, openapi_url=None)

    @app.put("/route/{engine_rank}")
    async def register(engine_rank: int, request: Request):
        try:
            info = msgspec.json.decode(await request.body(), type=RankInfo)
        except msgspec.DecodeError as exc:
            return JSONResponse({"error": f"invalid rank info: {exc}"}, status_code=400)
        if info.protocol_version != PROTOCOL_VERSION:
            return JSONResponse(
                {
                    "error": f"protocol_version: ours {PROTOCOL_VERSION} vs theirs "
                    f"{info.protocol_version}"
                },
                status_code=400,
            )
        if info.engine_rank != engine_rank:
            return JSONResponse(
                {"error": f"engine_rank {info.engine_rank} registered at /route/{engine_rank}"},
                status_code=400,
            )
        with lock:
            ranks[engine_rank] = info
        return {"ok": True}

    @app.get("/route/{engine_rank}")
    async def lookup(engine_rank: int):
        with lock:
            info = ranks.get(engine_rank)
        if info is None:
            return JSONResponse(
                {"error": f"engine_rank {engine_rank} is not registered"}, status_code=404
            )
        return Response(msgspec.json.encode(info), media_type="application/json")

    @app.get("/health")
    async def get_health():
        with lock:
            listed = {r: i.instance_id for r, i in sorted(ranks.items())}
        info = msgspec.structs.replace(health(), ranks=listed)
        return Response(
            msgspec.json.encode(info),
            media_type="application/json",
            status_code=200 if info.status == "ok" else 503,
        )

    return app


class BootstrapServer(KVBootstrapServer):
    """uvicorn serving :func:`build_app` on a daemon thread (``http.netutil.ThreadedServer``),
    bound to ``host:port`` (0 = a free port). ``start`` raises OSError naming the port when
    it is taken."""

    def __init__(self, host: str, port: int, health: Callable[[], HealthInfo]) -> None:
        self.host, self.port = host, port
        self._ranks: dict[int, RankInfo] = {}
        self._lock = threading.Lock()
        self._health = health
        self._server: ThreadedServer | None = None

    @property
    def error(self) -> BaseException | None:
        """What ended the server thread, if it failed."""
        return self._server.error if self._server is not None else None

    def start(self) -> int:
        server = ThreadedServer(
            build_app(self._ranks, self._health, self._lock),
            self.host,
            self.port,
            name="pdserve-bootstrap-http",
            lifespan="off",
            timeout_keep_alive=60,
        )
        try:
            self.port = server.start()
        except PortInUseError as exc:
            raise PortInUseError(f"bootstrap_port: {exc}") from exc
        except OSError as exc:
            raise OSError(f"bootstrap server: {exc}") from exc
        self._server = server
        return self.port

    def deregister(self, engine_rank: int) -> None:
        """Forget a rank (its process died): ``/health`` stops listing it, so decode
        knows its instance gone, and lookups of it answer 404."""
        with self._lock:
            self._ranks.pop(engine_rank, None)

    def is_alive(self) -> bool:
        return self._server is not None and self._server.is_alive()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(10.0)


def _url(host: str, port: int, path: str) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}{path}"


class BootstrapClient:
    """Decode's view of prefill bootstrap servers. One per thread (httpx client inside)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._client = httpx.Client(timeout=timeout_s)

    def register(self, host: str, port: int, info: RankInfo) -> None:
        """PUT a rank's info. BootstrapError on failure."""
        try:
            r = self._client.put(
                _url(host, port, f"/route/{info.engine_rank}"), content=msgspec.json.encode(info)
            )
        except httpx.HTTPError as exc:
            raise BootstrapError(f"bootstrap server {host}:{port} unreachable: {exc}") from exc
        if r.status_code != 200:
            raise BootstrapError(
                f"bootstrap server {host}:{port} refused the registration: {r.text}"
            )

    def fetch_rank(self, host: str, port: int, engine_rank: int = 0) -> RankInfo:
        """The registered info of a prefill rank. BootstrapError when unreachable, not
        registered, or undecodable (the protocol version is checked by the caller)."""
        try:
            r = self._client.get(_url(host, port, f"/route/{engine_rank}"))
        except httpx.HTTPError as exc:
            raise BootstrapError(
                f"bootstrap server {host}:{port} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        if r.status_code != 200:
            raise BootstrapError(
                f"bootstrap server {host}:{port} answered {r.status_code}: {r.text[:200]}"
            )
        try:
            return msgspec.json.decode(r.content, type=RankInfo)
        except msgspec.DecodeError as exc:
            raise BootstrapError(
                f"bootstrap server {host}:{port} sent an unreadable rank info: {exc}"
            ) from exc

    def health(self, host: str, port: int, timeout_s: float) -> HealthInfo:
        """One heartbeat. BootstrapError when unreachable, unhealthy or undecodable."""
        try:
            r = self._client.get(_url(host, port, "/health"), timeout=timeout_s)
            info = msgspec.json.decode(r.content, type=HealthInfo)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            raise BootstrapError(
                f"heartbeat to {host}:{port} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if r.status_code != 200:
            raise BootstrapError(f"prefill {host}:{port} reports {info.status}")
        return info

    def close(self) -> None:
        self._client.close()


# --- the head map (tensor parallelism) ----------------------------------------------


@dataclass(frozen=True)
class HeadSlice:
    """Model KV heads ``[start, end)`` that prefill rank ``src_rank`` writes into decode
    rank ``dst_rank`` (global head ids; each side subtracts its own range's start)."""

    src_rank: int
    dst_rank: int
    start: int
    end: int


def writer_of(num_kv_heads: int, prefill_tp_size: int, head: int) -> int:
    """The prefill rank that writes ``head``: the lowest one holding it."""
    for r in range(prefill_tp_size):
        start, end = kv_head_range(num_kv_heads, TPRank(r, prefill_tp_size))
        if start <= head < end:
            return r
    raise ValueError(f"head {head} is outside num_key_value_heads={num_kv_heads}")


def writes_into(num_kv_heads: int, prefill_tp_size: int, decode: TPRank) -> list[HeadSlice]:
    """The slices decode rank ``decode`` receives, one per writer, in head order.

    Raises ValueError (from :func:`kv_head_range`) for a TP size the split rules refuse."""
    ds, de = kv_head_range(num_kv_heads, decode)
    out: list[HeadSlice] = []
    for h in range(ds, de):
        r = writer_of(num_kv_heads, prefill_tp_size, h)
        if out and out[-1].src_rank == r and out[-1].end == h:
            out[-1] = HeadSlice(r, decode.rank, out[-1].start, h + 1)
        else:
            out.append(HeadSlice(r, decode.rank, h, h + 1))
    return out


def reads_from(num_kv_heads: int, prefill: TPRank, decode_tp_size: int) -> list[HeadSlice]:
    """The slices prefill rank ``prefill`` writes, over every decode rank (decode rank
    order); empty for a replica that writes nothing."""
    return [
        s
        for d in range(decode_tp_size)
        for s in writes_into(num_kv_heads, prefill.size, TPRank(d, decode_tp_size))
        if s.src_rank == prefill.rank
    ]


def is_writer(num_kv_heads: int, prefill: TPRank) -> bool:
    """Whether prefill rank ``prefill`` writes any head (whatever the decode TP size):
    True unless a lower rank holds the same heads (a replica)."""
    start, _ = kv_head_range(num_kv_heads, prefill)
    return writer_of(num_kv_heads, prefill.size, start) == prefill.rank
