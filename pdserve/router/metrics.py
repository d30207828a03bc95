"""The router's own Prometheus metrics (one CollectorRegistry per app, no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pdserve.router.workers import WorkerPool, avoided_pairs

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _WorkerCollector:
    """Worker health and outstanding requests, read from the pool at scrape time."""

    def __init__(self, pool: WorkerPool, live_rooms: set[int]) -> None:
        self._pool = pool
        self._rooms = live_rooms

    def collect(self):
        healthy = GaugeMetricFamily(
            "pdserve_router_worker_healthy",
            "1 if the worker passes its health checks",
            labels=["role", "url"],
        )
        outstanding = GaugeMetricFamily(
            "pdserve_router_worker_outstanding_requests",
            "requests dispatched to the worker and not yet answered",
            labels=["role", "url"],
        )
        avoided = GaugeMetricFamily(
            "pdserve_router_avoided_pd_pairs",
            "1 for a healthy (prefill, decode) pair the router does not use: the decode "
            "reports that prefill unhealthy (KV pages quarantined too long)",
            labels=["prefill", "decode"],
        )
        for w in self._pool.all():
            healthy.add_metric([w.role, w.url], 1.0 if w.healthy else 0.0)
            outstanding.add_metric([w.role, w.url], float(w.outstanding))
        pairs = avoided_pairs(self._pool.healthy("prefill"), self._pool.healthy("decode"))
        for prefill, decode in sorted(pairs):
            avoided.add_metric([prefill, decode], 1.0)
        yield healthy
        yield outstanding
        yield avoided
        yield GaugeMetricFamily(
            "pdserve_router_live_bootstrap_rooms",
            "bootstrap rooms of requests in flight",
            value=len(self._rooms),
        )


class RouterMetrics:
    """Counters and histograms of the router; ``render()`` gives the text exposition."""

    def __init__(self, pool: WorkerPool, live_rooms: set[int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests",
            "client requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "pdserve_router_request_latency_seconds",
            "end-to-end latency of client requests (streams: until the last byte)",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.leg_failures = Counter(
            "pdserve_router_leg_failures",
            "failed worker legs by role and reason (http_<status> for a 5xx, connect, stream, "
            "stream_error for a worker's own 5xx error event mid-stream; a worker's 4xx "
            "answer to a bad request is the client's, not counted here)",
            ["role", "reason"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "pdserve_router_migrations",
            "requests continued or sent again on another worker after theirs failed, by "
            "reason (stream_broken / stream_end: decode's stream broke or ended before "
            "[DONE]; worker_error: a worker's 5xx error event; prefill_failed; unhealthy: "
            "the worker failed its health checks mid-stream; reopen_failed / open_failed: "
            "the next or first leg could not be opened; retry_whole: a non-streamed "
            "request sent again)",
            ["reason"],
            registry=self.registry,
        )
        self.pd_decisions = Counter(
            "pdserve_router_pd_decisions",
            "selective PD (--pd-min-prefill-tokens): requests sent to a prefill/decode pair "
            "(pd) or whole to a decode worker (decode_only)",
            ["path"],
            registry=self.registry,
        )
        self.pd_fallbacks = Counter(
            "pdserve_router_pd_fallbacks",
            "PD requests served whole on a decode worker because no prefill/decode pair "
            "could take them, by reason (no_healthy_prefill: no prefill worker passes its "
            "health checks)",
            ["reason"],
            registry=self.registry,
        )
        self.registry.register(_WorkerCollector(pool, live_rooms))

    def render(self) -> bytes:
        return generate_latest(self.registry)
