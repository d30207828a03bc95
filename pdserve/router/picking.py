"""Where one attempt of a request goes: a :class:`Route` to one worker or to a (prefill,
decode) pair, chosen by :class:`Picker` from the pool's healthy workers.

The picker holds the router's routing decisions above the per-role policies of
:mod:`pdserve.router.workers`: regular mode's mixed worker; PD mode's pair
(``WorkerPool.pick_pair``); selective PD, which sends a prompt the decode workers mostly
hold to one decode worker alone; and the fallback that runs a PD request whole on a decode
worker while no prefill worker is healthy. It sends nothing: the flows
(:mod:`pdserve.router.one_worker`, :mod:`pdserve.router.pd_pair`) run a route, the
dispatcher picks again after a failure (:meth:`Picker.pick` with ``wait``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pdserve.router.metrics import RouterMetrics
from pdserve.router.request_facts import prompt_tokens_estimate
from pdserve.router.workers import (
    NoHealthyPair,
    NoHealthyWorker,
    WorkerPool,
    WorkerState,
    routing_key,
)

log = logging.getLogger("pdserve.router")

# seconds between two looks at the pool while a pick waits for a healthy worker
_WAIT_POLL_S = 0.1


@dataclass
class Route:
    """Where one attempt of a request goes: ``target``, one worker or a (prefill, decode)
    pair; ``info``, selective PD's decision (:meth:`Picker.pick_now`; None when selective
    PD is off), which goes to the trace and to the answer's timing blocks."""

    target: WorkerState | tuple[WorkerState, WorkerState]
    info: dict | None = None
    # records the prompt in the decode workers' prefix index; run once the request ended
    # well (a failed or abandoned one may never have computed its prompt there)
    held: Callable[[], None] | None = None

    @property
    def pair(self) -> tuple[WorkerState, WorkerState] | None:
        """The (prefill, decode) pair; None for one worker."""
        return self.target if isinstance(self.target, tuple) else None

    @property
    def worker(self) -> WorkerState:
        """The one worker (``pair`` is None)."""
        assert not isinstance(self.target, tuple)
        return self.target

    def workers(self) -> tuple[WorkerState, ...]:
        """The attempt's workers: the pair's two, or the one."""
        return self.target if isinstance(self.target, tuple) else (self.target,)

    def urls(self) -> set[str]:
        """The URLs of the attempt's workers."""
        return {w.url for w in self.workers()}

    def attributes(self) -> dict:
        """The trace attributes of the route (the ``route`` phase and the request span):
        the decision's, and the worker's URL for one worker."""
        attrs: dict = {}
        if self.info is not None:
            attrs = {f"pdserve.{k}": v for k, v in self.info.items() if v is not None}
        if self.pair is None:
            return {"pdserve.worker": self.worker.url, **attrs}
        return attrs


class Picker:
    """Picks routes from ``pool`` (``pd_mode``: pairs, else mixed workers); counts its PD
    decisions and fallbacks in ``metrics``. ``pd_min_prefill_tokens``: selective PD's
    threshold (0 = off); ``wait_s``: how long :meth:`pick` waits for a healthy worker
    (``--migration-wait``)."""

    def __init__(
        self,
        pool: WorkerPool,
        metrics: RouterMetrics,
        *,
        pd_mode: bool,
        pd_min_prefill_tokens: int = 0,
        wait_s: float = 30.0,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.pd_mode = pd_mode
        self.pd_min_prefill_tokens = pd_min_prefill_tokens
        self.wait_s = wait_s
        # [reason, requests] of the outage now served without prefill (None: none)
        self._fallback: list | None = None

    async def pick(
        self,
        endpoint: str,
        body: dict,
        avoid: Collection[str],
        *,
        wait: bool,
        deadline: float,
    ) -> Route:
        """:meth:`pick_now`; with ``wait``, waiting for a healthy worker (pair) when the
        pool has none now (a worker that failed under a request was ejected; its restart
        or next good probe brings it back), at most ``wait_s`` seconds and not past
        ``deadline`` (loop time); NoHealthyWorker after that. Without ``wait`` it returns
        in the caller's loop step (the caller counts the route's workers from there)."""
        if not wait:
            return self.pick_now(endpoint, body, avoid)
        loop = asyncio.get_running_loop()
        until = min(deadline, loop.time() + self.wait_s)
        while True:
            try:
                return self.pick_now(endpoint, body, avoid)
            except NoHealthyWorker:
                if loop.time() + _WAIT_POLL_S >= until:
                    raise
                await asyncio.sleep(_WAIT_POLL_S)

    def pick_now(self, endpoint: str, body: dict, avoid: Collection[str] = ()) -> Route:
        """Where the request goes now: one worker (regular mode; a decode worker for a
        request PD does not pay for) or a (prefill, decode) pair; workers in ``avoid`` only
        when there is no other (``WorkerPool.healthy``).

        Selective PD (``pd_min_prefill_tokens`` > 0): the prompt's uncached part is its
        length (:func:`~pdserve.router.request_facts.prompt_tokens_estimate`) times the
        share of its leading blocks that the decode workers' prefix index
        (``WorkerPool.decode_prefixes``: the prompts sent to each decode worker) does not
        hold, for the decode worker holding the most; under the threshold the request runs
        on that decode worker alone (on the policy's pick when none holds any), else on a
        pair. The decision is counted, set on the trace and returned in ``Route.info``.

        A PD request with no pair to go to (no healthy prefill worker, e.g. while
        ``pdserve up`` restarts a dead one) runs whole on a decode worker
        (:meth:`_without_prefill`; ``Route.info`` says ``decode_fallback``) rather than
        get 503; NoHealthyWorker only when no decode worker is healthy either."""
        key = routing_key(endpoint, body)
        if not self.pd_mode:
            return Route(self.pool.pick("mixed", key, avoid))
        index = self.pool.decode_prefixes
        keys = index.keys(key)
        info = None
        if self.pd_min_prefill_tokens:
            estimate = prompt_tokens_estimate(endpoint, body)
            best, held = None, 0
            for d in self.pool.healthy("decode", avoid):  # the one holding the most
                n = index.matched(d.url, keys)
                if n and (
                    best is None or n > held or (n == held and d.outstanding < best.outstanding)
                ):
                    best, held = d, n
            share = held / len(keys) if keys else 0.0
            uncached = None if estimate is None else round(estimate * (1.0 - share))
            whole = uncached is not None and uncached < self.pd_min_prefill_tokens
            decision = "decode_only" if whole else "pd"
            info = {
                "pd_decision": decision,
                "prompt_tokens_estimate": estimate,
                "decode_cached_share": round(share, 3),
                "uncached_tokens_estimate": uncached,
                "pd_min_prefill_tokens": self.pd_min_prefill_tokens,
            }
            if whole:
                decode = best if best is not None else self.pool.pick("decode", key, avoid)
                self.metrics.pd_decisions.labels(decision).inc()  # once picked: not a poll
                return Route(decode, info, functools.partial(index.record, decode.url, keys))
        try:
            pair = self.pool.pick_pair(key, avoid)
        except NoHealthyWorker as exc:
            decode, reason = self._without_prefill(key, avoid, exc)
            info = {**(info or {}), "pd_decision": "decode_fallback", "pd_fallback": reason}
            return Route(decode, info, functools.partial(index.record, decode.url, keys))
        if self._fallback is not None:
            log.warning(
                "a prefill/decode pair is usable again: PD requests go through pairs again "
                "(%d served whole on decode workers meanwhile)",
                self._fallback[1],
            )
            self._fallback = None
        if info is not None:
            self.metrics.pd_decisions.labels(info["pd_decision"]).inc()
        return Route(pair, info, functools.partial(index.record, pair[1].url, keys))

    def _without_prefill(
        self, key: str | None, avoid: Collection[str], exc: NoHealthyWorker
    ) -> tuple[WorkerState, str]:
        """The decode worker that serves a PD request whole when no pair can (``exc``, from
        ``pick_pair``), and why (the counter's ``reason``): ``no_healthy_prefill``, no
        prefill worker passes its health checks (dead, restarting, drained). A decode
        worker runs a request whole as a mixed worker does (selective PD's path), so the
        output is the same; it only pays the prefill itself. Re-raises ``exc`` when no
        decode worker is healthy either (the client's 503), and for NoHealthyPair (healthy
        prefills that every decode reports unhealthy: a 503 naming the reports, the
        quarantine's own signal). Counted, and warned about once an outage (until a pair
        is picked again)."""
        if isinstance(exc, NoHealthyPair) or not self.pool.healthy("decode", avoid):
            raise exc
        reason = "no_healthy_prefill"
        decode = self.pool.pick("decode", key, avoid)
        self.metrics.pd_fallbacks.labels(reason).inc()
        if self._fallback is None:
            self._fallback = [reason, 0]
            log.warning(
                "%s: serving PD requests whole on decode workers until a prefill worker is "
                "healthy again (counted in pdserve_router_pd_fallbacks_total)",
                exc,
            )
        self._fallback[1] += 1
        return decode, reason
