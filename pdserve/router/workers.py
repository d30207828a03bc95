"""The router's view of its workers: per-role pools, periodic health checks that eject and
restore workers, and policy-based picking (the load-balancing policies live here too).

Policies pick one worker of one role for the next request. ``cache_aware`` follows
SGLang's gateway: the router keeps, per worker, an approximate index of the prompts it
routed there, and sends a request to the worker whose index holds the longest prefix of its
prompt, unless the load is out of balance (then the least loaded worker).  The index is
built from routing decisions alone (no event channel from the workers, no tokenizer in the
router), so a burst of requests sharing a prompt sticks to one worker from its first
request on, and it works for mixed workers as for prefill ones.  It is approximate: the
worker may have evicted what the index still lists.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from pdserve.advertise import WILDCARDS, is_loopback
from pdserve.disagg.base import Role

log = logging.getLogger("pdserve.router")


@dataclass
class WorkerState:
    """What the router knows about one worker (mutated only on the router's event loop).

    outstanding: requests dispatched to it and not yet answered.
    server_info: the worker's last ``/get_server_info`` JSON (prefill: bootstrap port).
    ejected: set while it is out of picking (its health checks or a failed request took
    it out), so that a request waiting on it can stop waiting (``router/dispatch.py``:
    ``Dispatcher._until_ejected``).
    """

    url: str
    role: str  # "prefill", "decode" or "mixed"
    healthy: bool = False
    consecutive_failures: int = 0
    outstanding: int = 0
    last_error: str | None = None
    server_info: dict[str, Any] = field(default_factory=dict)
    ejected: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)


class Policy(ABC):
    """Picks one worker from a non-empty sequence of healthy workers."""

    @abstractmethod
    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        """Return one of ``workers`` (never empty).  ``key``: the request's prompt as text
        (:func:`routing_key`), used by ``cache_aware`` only; ``None`` when unknown."""

    def forget(self, url: str) -> None:
        """The worker at ``url`` left the pool: drop what the policy keeps about it (a
        worker added again at that URL starts afresh, its cache empty)."""
        return None  # only cache_aware keeps anything per worker


class RandomPolicy(Policy):
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        return self._rng.choice(list(workers))


class RoundRobinPolicy(Policy):
    """Cycles over the workers in URL order; skips ejected ones."""

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        chosen = workers[self._next % len(workers)]
        self._next += 1
        return chosen


class PowerOfTwoPolicy(Policy):
    """Two random picks, the one with fewer outstanding requests wins (Mitzenmacher's
    power of two choices)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.outstanding <= b.outstanding else b


def _block_keys(text: str, block_chars: int) -> list[bytes]:
    """Chained blake2b keys of ``text`` in blocks of ``block_chars`` characters (the last
    block may be shorter): key ``i`` names the whole prefix up to the end of block ``i``."""
    keys, parent = [], b""
    data = text.encode("utf-8", "surrogatepass")
    step = block_chars  # bytes, approximately characters for ASCII-heavy prompts
    for start in range(0, len(data), step):
        parent = hashlib.blake2b(parent + data[start : start + step], digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixIndex:
    """Per-worker LRU index of the prompts the router sent there, as chained block keys
    (:func:`_block_keys` of the prompt text, ``block_chars`` a block; at most
    ``max_blocks`` keys a worker, the least recently sent dropped first). An
    approximation of the worker's prefix cache: built from routing alone, it may list
    what the worker has evicted."""

    def __init__(self, *, block_chars: int = 64, max_blocks: int = 1 << 16) -> None:
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._index: dict[str, OrderedDict[bytes, None]] = {}

    def keys(self, text: str | None) -> list[bytes]:
        """The block keys of ``text`` (none for None or empty)."""
        return _block_keys(text, self.block_chars) if text else []

    def urls(self) -> set[str]:
        """URLs of the workers the index holds prompts of."""
        return set(self._index)

    def size(self, url: str) -> int:
        """Blocks held for the worker at ``url``."""
        return len(self._index.get(url, ()))

    def matched(self, url: str, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` the index of the worker at ``url`` holds."""
        index = self._index.get(url)
        n = 0
        while index is not None and n < len(keys) and keys[n] in index:
            n += 1
        return n

    def record(self, url: str, keys: Sequence[bytes]) -> None:
        """The prompt of ``keys`` was sent to the worker at ``url``."""
        index = self._index.setdefault(url, OrderedDict())
        for k in keys:
            index[k] = None
            index.move_to_end(k)
        while len(index) > self.max_blocks:
            index.popitem(last=False)

    def forget(self, url: str) -> None:
        """The worker at ``url`` left or failed: its cache is gone."""
        self._index.pop(url, None)


class CacheAwarePolicy(Policy):
    """SGLang-gateway-style cache-aware routing over an approximate per-worker prefix index.

    Per pick: when ``max_load - min_load > balance_abs_threshold`` and ``max_load >
    balance_rel_threshold * min_load`` (load = outstanding requests), the least loaded
    worker; otherwise, when the best worker's index holds more than ``cache_threshold`` of
    the prompt's blocks, that worker (ties: least loaded), else the worker with the
    smallest index (the most room for a new prefix; ties: least loaded).  The chosen
    worker's index then records the prompt's blocks (:class:`PrefixIndex`: LRU, at most
    ``max_blocks`` per worker).  Defaults are SGLang router's (cache_threshold 0.5,
    balance_abs_threshold 32, balance_rel_threshold 1.0001).
    """

    def __init__(
        self,
        rng: random.Random,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        block_chars: int = 64,
        max_blocks: int = 1 << 16,
    ) -> None:
        self._rng = rng
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._index = PrefixIndex(block_chars=block_chars, max_blocks=max_blocks)

    def forget(self, url: str) -> None:
        self._index.forget(url)

    def indexed_urls(self) -> set[str]:
        """URLs of the workers the index holds prompts of."""
        return self._index.urls()

    def matched_blocks(self, worker: WorkerState, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` the index of ``worker`` holds."""
        return self._index.matched(worker.url, keys)

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        workers = list(workers)
        least = min(workers, key=lambda w: w.outstanding)
        keys = self._index.keys(key)
        if len(workers) == 1 or key is None:
            chosen = least
        else:
            loads = [w.outstanding for w in workers]
            hi, lo = max(loads), min(loads)
            if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
                chosen = least
            else:
                matched = {w.url: self.matched_blocks(w, keys) for w in workers}
                best = max(matched.values())
                if keys and best / len(keys) > self.cache_threshold:
                    chosen = min(
                        (w for w in workers if matched[w.url] == best),
                        key=lambda w: w.outstanding,
                    )
                else:
                    chosen = min(
                        workers,
                        key=lambda w: (self._index.size(w.url), w.outstanding),
                    )
        self._index.record(chosen.url, keys)
        return chosen


def routing_key(endpoint: str, body: dict) -> str | None:
    """The prompt of a client request as text, for ``cache_aware``: ``/generate``'s
    ``text`` or ``input_ids``, ``/v1/completions``' ``prompt`` (the first one of a list),
    ``/v1/chat/completions``' ``messages`` (role and content of each, in order, so a
    growing conversation keeps its prefix).  ``None`` when absent or of another shape
    (the worker answers that with a 400)."""
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role')}>{_text_of(m.get('content'))}")
        return "\n".join(parts)
    prompt = (
        body.get("text", body.get("input_ids")) if endpoint == "/generate" else body.get("prompt")
    )
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    return _text_of(prompt) or None


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # token ids, or OpenAI content parts
        return " ".join(str(v.get("text", "")) if isinstance(v, dict) else str(v) for v in value)
    return ""


_POLICIES: dict[str, Callable[[random.Random], Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "cache_aware": CacheAwarePolicy,
}


def create_policy(name: str, rng: random.Random | None = None) -> Policy:
    """Build the policy called ``name``; ValueError naming ``policy`` if unknown."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(_POLICIES)}, got {name!r}") from None
    return cls(rng or random.Random())


class NoHealthyWorker(RuntimeError):
    """No healthy worker of the asked role; the message names the role."""


class NoHealthyPair(NoHealthyWorker):
    """Healthy prefill and decode workers exist, but every decode reports every prefill
    unhealthy (``unhealthy_prefill_peers``); the message names the pairs."""


class WorkerPool:
    """All workers of the router, grouped by role (``prefill``/``decode`` or ``mixed``).

    Health: a worker is healthy after a ``GET /health`` returned 200 and its
    ``/get_server_info`` names the expected role (and, for prefill, a bootstrap port); ``failure_threshold``
    consecutive failed probes (or failed dispatches) eject it; the next good probe
    restores it.

    Membership changes at run time (the router's admin API): :meth:`add` probes the new
    worker at once, so a healthy one takes requests right away; :meth:`drain` stops new
    requests to a worker and removes it once its outstanding requests have ended.
    """

    def __init__(
        self,
        urls_by_role: dict[str, Sequence[str]],
        *,
        policy: str,
        client: httpx.AsyncClient,
        check_interval: float,
        check_timeout: float,
        failure_threshold: int,
        rng: random.Random | None = None,
    ) -> None:
        rng = rng or random.Random()
        self.workers: dict[str, list[WorkerState]] = {
            role: [WorkerState(url.rstrip("/"), role) for url in urls]
            for role, urls in urls_by_role.items()
        }
        self._policies: dict[str, Policy] = {
            role: create_policy(policy, rng) for role in self.workers
        }
        self._client = client
        self._interval = check_interval
        self._timeout = check_timeout
        self._threshold = failure_threshold
        self._task: asyncio.Task | None = None
        self.draining: set[str] = set()  # URLs that get no new requests (being removed)
        # the prompts sent to each decode worker (PD or decode-only: decode keeps a PD
        # request's prompt pages in its prefix cache too), for selective PD's uncached part
        self.decode_prefixes = PrefixIndex()
        self._background: dict[str, asyncio.Task] = {}  # drains that outlived their request

    # --- picking ---------------------------------------------------------------------
    def all(self) -> list[WorkerState]:
        return [w for ws in self.workers.values() for w in ws]

    def healthy(self, role: str, avoid: Collection[str] = ()) -> list[WorkerState]:
        """Workers of ``role`` that may take new requests: healthy and not draining;
        those whose URL is in ``avoid`` only when no other is (a request sent again
        after a failure prefers other workers than the ones it failed on)."""
        ok = [w for w in self.workers.get(role, []) if w.healthy and w.url not in self.draining]
        return [w for w in ok if w.url not in avoid] or ok if avoid else ok

    def find(self, url: str) -> WorkerState | None:
        """The worker at ``url`` (trailing slash ignored), or None."""
        url = url.rstrip("/")
        return next((w for w in self.all() if w.url == url), None)

    # --- membership ------------------------------------------------------------------
    async def add(self, url: str, role: str) -> WorkerState:
        """Add a worker of ``role`` (one of the pool's roles) and probe it once now.
        ValueError naming the field for an unknown role, a bad URL or a URL already in
        the pool (any role)."""
        if role not in self.workers:
            raise ValueError(f"role must be one of {', '.join(self.workers)}, got {role!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not urlsplit(url).hostname:
            raise ValueError(f"url {url!r} names no host")
        if self.find(url) is not None:
            raise ValueError(f"url {url.rstrip('/')} is already a worker of this router")
        worker = WorkerState(url.rstrip("/"), role)
        self.workers[role].append(worker)
        log.info("added %s worker %s", role, worker.url)
        await self.check(worker)
        return worker

    async def drain(self, worker: WorkerState, timeout_s: float | None = None) -> bool:
        """Stop new requests to ``worker``; remove it from the pool once its outstanding
        requests have ended. Returns True when removed, False when ``timeout_s`` passed
        first (it stays draining and is removed later, when its last request ends)."""
        self.draining.add(worker.url)
        log.info(
            "draining %s worker %s (%d outstanding)", worker.role, worker.url, worker.outstanding
        )
        # A request that picked this worker before it was marked counts itself outstanding
        # from its pick on (router/legs.py: LegSender.counted / post_task, and a streamed
        # leg's counted_if_opened before its first await); one yield lets a pick made in
        # this loop iteration, before the mark, finish that step.
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while worker.outstanding > 0:
            if deadline is not None and loop.time() >= deadline:
                self._drain_later(worker)
                return False
            await asyncio.sleep(0.01)
        self._remove(worker)
        return True

    def _drain_later(self, worker: WorkerState) -> None:
        if worker.url in self._background:  # one waiter per worker is enough
            return
        task = asyncio.get_running_loop().create_task(self.drain(worker))
        self._background[worker.url] = task
        task.add_done_callback(lambda _: self._background.pop(worker.url, None))

    def _remove(self, worker: WorkerState) -> None:
        ws = self.workers.get(worker.role, [])
        if worker in ws:
            ws.remove(worker)
            self._policies[worker.role].forget(worker.url)
            self.decode_prefixes.forget(worker.url)
            log.info("removed %s worker %s", worker.role, worker.url)
        self.draining.discard(worker.url)

    def pick(self, role: str, key: str | None = None, avoid: Collection[str] = ()) -> WorkerState:
        """A healthy worker of ``role`` by the policy (``key``: the prompt as text, for
        ``cache_aware``; ``avoid``: as :meth:`healthy`); NoHealthyWorker if there is none."""
        candidates = self.healthy(role, avoid)
        if not candidates:
            total = len(self.workers.get(role, []))
            raise NoHealthyWorker(
                f"no healthy {role} worker (0 of {total} pass their health check)"
            )
        return self._policies[role].pick(candidates, key)

    def pick_pair(
        self, key: str | None = None, avoid: Collection[str] = ()
    ) -> tuple[WorkerState, WorkerState]:
        """A (prefill, decode) pair by the policies, never one whose decode reports that
        prefill unhealthy (:func:`refuses`): the prefill is picked among those some
        decode accepts, then the decode among those that accept it.  NoHealthyWorker when
        a role has no healthy worker; NoHealthyPair when no pair is left (the router
        answers 503 rather than send a request that would wait on a peer its decode has
        pages quarantined for). ``avoid``: as :meth:`healthy`."""
        prefills, decodes = self.healthy("prefill", avoid), self.healthy("decode", avoid)
        if not prefills or not decodes:
            self.pick("decode" if prefills else "prefill")  # raises, naming the role
        bad = avoided_pairs(prefills, decodes)
        if bad:
            prefills = [p for p in prefills if any((p.url, d.url) not in bad for d in decodes)]
            if not prefills:
                raise NoHealthyPair(
                    "no prefill/decode pair to serve with: every healthy decode worker reports "
                    "every healthy prefill worker unhealthy (KV pages quarantined longer than "
                    "PDSERVE_DISAGGREGATION_QUARANTINE_BOUND): "
                    + "; ".join(f"{d} reports {p}" for p, d in sorted(bad))
                )
        prefill = self._policies["prefill"].pick(prefills, key)
        decode = self._policies["decode"].pick(
            [d for d in decodes if (prefill.url, d.url) not in bad], key
        )
        return prefill, decode

    def is_ready(self) -> bool:
        """True when every role has at least one healthy worker."""
        return all(self.healthy(role) for role in self.workers)

    # --- health ----------------------------------------------------------------------
    def record_failure(self, worker: WorkerState, reason: str) -> None:
        """Count one failed probe or dispatch; eject at the threshold."""
        worker.consecutive_failures += 1
        worker.last_error = reason
        if worker.healthy and worker.consecutive_failures >= self._threshold:
            self._unhealthy(worker, reason)

    def eject(self, url: str, reason: str) -> None:
        """Take the worker at ``url`` out of picking now (its connection failed under a
        request); its next good health check brings it back."""
        worker = self.find(url)
        if worker is None:
            return
        worker.consecutive_failures = max(worker.consecutive_failures, self._threshold)
        worker.last_error = reason
        if worker.healthy:
            self._unhealthy(worker, reason)

    def _unhealthy(self, worker: WorkerState, reason: str) -> None:
        """Eject ``worker``; its prefix index is dropped (a worker that failed may come
        back restarted, its cache empty)."""
        worker.healthy = False
        worker.ejected.set()
        self.decode_prefixes.forget(worker.url)
        log.warning("ejecting %s worker %s: %s", worker.role, worker.url, reason)

    def _record_success(self, worker: WorkerState) -> None:
        if not worker.healthy:
            log.info("%s worker %s is healthy", worker.role, worker.url)
        worker.healthy = True
        worker.ejected.clear()
        worker.consecutive_failures = 0
        worker.last_error = None

    async def check(self, worker: WorkerState) -> None:
        """Probe one worker once and update its state."""
        try:
            resp = await self._client.get(f"{worker.url}/health", timeout=self._timeout)
            if resp.status_code != 200:
                raise RuntimeError(f"/health answered HTTP {resp.status_code}: {resp.text[:200]}")
            # Every check: a worker restarted on the same URL may have another role or (prefill)
            # another bootstrap port.
            info = (
                await self._client.get(f"{worker.url}/get_server_info", timeout=self._timeout)
            ).json()
            if info.get("role") != worker.role:
                raise RuntimeError(
                    f"it serves role {info.get('role')!r}, not {worker.role!r} "
                    f"(check the router's --prefill/--decode/--worker flags)"
                )
            if worker.role == Role.PREFILL and not isinstance(info.get("bootstrap_port"), int):
                raise RuntimeError("/get_server_info has no bootstrap_port")
            worker.server_info = info
        except Exception as exc:  # noqa: BLE001 any failure of the probe counts against the worker
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not worker.healthy:
                worker.consecutive_failures += 1
                worker.last_error = reason
            else:
                self.record_failure(worker, reason)
            return
        self._record_success(worker)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.all()))

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        """Start the periodic health checks on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        for task in list(self._background.values()):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


def bootstrap_address(worker: WorkerState) -> tuple[str, int]:
    """(host, port) of a prefill worker's bootstrap server, from its server info: the host
    it advertises, unless that is a loopback/wildcard address and the worker's URL names
    another host (then the URL's host, which the router reached it by)."""
    advertised = worker.server_info.get("bootstrap_host") or ""
    url_host = urlsplit(worker.url).hostname or ""
    local = lambda h: is_loopback(h) or h in WILDCARDS  # noqa: E731
    if not advertised or (local(advertised) and not local(url_host)):
        host = url_host
    else:
        host = advertised
    return host, int(worker.server_info["bootstrap_port"])


def unhealthy_prefill_peers(decode: WorkerState) -> dict[str, float]:
    """What a decode worker's last ``/get_server_info`` lists under
    ``transfer.unhealthy_prefill_peers``: ``"host:port"`` of a prefill's bootstrap server
    -> age in seconds of the oldest quarantine of its pages there (the NIXL decode
    manager, pdserve/disagg/nixl/decode/manager.py); ``{}`` when absent or of another shape."""
    transfer = decode.server_info.get("transfer")
    peers = transfer.get("unhealthy_prefill_peers") if isinstance(transfer, dict) else None
    return peers if isinstance(peers, dict) else {}


def refuses(decode: WorkerState, prefill: WorkerState) -> bool:
    """True when ``decode`` reports ``prefill`` unhealthy: it lists the bootstrap address
    the router hands out for that prefill (:func:`bootstrap_address`, as decode keys its
    peers by the address it was given)."""
    peers = unhealthy_prefill_peers(decode)
    if not peers or not isinstance(prefill.server_info.get("bootstrap_port"), int):
        return False
    host, port = bootstrap_address(prefill)
    return f"{host}:{port}" in peers


def avoided_pairs(
    prefills: Sequence[WorkerState], decodes: Sequence[WorkerState]
) -> set[tuple[str, str]]:
    """The (prefill URL, decode URL) pairs of these workers that :func:`refuses` rules out."""
    return {(p.url, d.url) for d in decodes for p in prefills if refuses(d, p)}
