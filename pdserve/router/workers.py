"""The router's view of its workers: per-role pools, periodic health checks that eject and
restore workers, and policy-based picking."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from pdserve.advertise import WILDCARDS, is_loopback
from pdserve.disagg.base import Role
from pdserve.router.policies import Policy, WorkerState, create_policy

log = logging.getLogger("pdserve.router")


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
        self._background: dict[str, asyncio.Task] = {}  # drains that outlived their request

    # --- picking ---------------------------------------------------------------------
    def all(self) -> list[WorkerState]:
        return [w for ws in self.workers.values() for w in ws]

    def healthy(self, role: str) -> list[WorkerState]:
        """Workers of ``role`` that may take new requests: healthy and not draining."""
        return [w for w in self.workers.get(role, []) if w.healthy and w.url not in self.draining]

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
        # A request that picked this worker before it was marked has queued its legs
        # (which count themselves outstanding on their first step) ahead of this wake-up.
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
            log.info("removed %s worker %s", worker.role, worker.url)
        self.draining.discard(worker.url)

    def pick(self, role: str, key: str | None = None) -> WorkerState:
        """A healthy worker of ``role`` by the policy (``key``: the prompt as text, for
        ``cache_aware``); NoHealthyWorker if there is none."""
        candidates = self.healthy(role)
        if not candidates:
            total = len(self.workers.get(role, []))
            raise NoHealthyWorker(
                f"no healthy {role} worker (0 of {total} pass their health check)"
            )
        return self._policies[role].pick(candidates, key)

    def pick_pair(self, key: str | None = None) -> tuple[WorkerState, WorkerState]:
        """A (prefill, decode) pair by the policies, never one whose decode reports that
        prefill unhealthy (:func:`refuses`): the prefill is picked among those some
        decode accepts, then the decode among those that accept it.  NoHealthyWorker when
        a role has no healthy worker; NoHealthyPair when no pair is left (the router
        answers 503 rather than send a request that would wait on a peer its decode has
        pages quarantined for)."""
        prefills, decodes = self.healthy("prefill"), self.healthy("decode")
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
            worker.healthy = False
            log.warning("ejecting %s worker %s: %s", worker.role, worker.url, reason)

    def _record_success(self, worker: WorkerState) -> None:
        if not worker.healthy:
            log.info("%s worker %s is healthy", worker.role, worker.url)
        worker.healthy = True
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
