"""The worker's Prometheus metrics (own CollectorRegistry per app, no globals).

Request counts and latencies, TTFT, ITL, prompt/generation tokens are recorded by the
request handlers; running/waiting requests and free KV pages come from the engine
snapshot, transfer counters from ``KVManager.stats()``, both read at scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from pdserve.server.metric_help import COUNTER, GAUGE, HELP, SKIPPED

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_NAME = re.compile(r"[^a-zA-Z0-9_]")


_LABELS = {
    "rooms": "state",
    "transfers_failed": "reason",
    "collections": "generation",
    "compilations_after_startup_by_kernel": "kernel",
}  # label name of a nested {name: number} dict


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bools too: healthy -> 1/0


def _families(prefix: str, data: dict) -> Iterable[Any]:
    """Metric families for a stats dict: numbers -> gauges, or counters (sample
    ``<name>_total``) where ``metric_help`` says so; ``{sum, count, buckets}`` ->
    a histogram (cumulative buckets keyed by upper bound); a nested ``{name: number}``
    dict -> one gauge (a counter where ``metric_help`` says so) with a label (``state``,
    ``reason`` or ``key``); strings are skipped. Help texts and types: ``metric_help``."""
    for key, value in data.items():
        if key in SKIPPED:
            continue
        name = f"{prefix}_{_NAME.sub('_', str(key))}"
        doc, kind = HELP.get(str(key), (str(key), GAUGE))
        if _is_number(value):
            make = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            yield make(name, doc, value=float(value))
        elif isinstance(value, dict) and {"sum", "count", "buckets"} <= set(value):
            buckets = [(str(le), float(n)) for le, n in value["buckets"].items()]
            if not buckets or buckets[-1][0] != "+Inf":
                buckets.append(("+Inf", float(value["count"])))
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(value["sum"]))
        elif isinstance(value, dict) and value and all(_is_number(v) for v in value.values()):
            make = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            family = make(name, doc, labels=[_LABELS.get(str(key), "key")])
            for label, number in value.items():
                family.add_metric([str(label)], float(number))
            yield family
        elif isinstance(value, dict):
            yield from _families(name, value)


class _SnapshotCollector:
    """Metrics read at scrape time from callables returning stats dicts."""

    def __init__(self, sources: dict[str, Callable[[], dict | None]]) -> None:
        self._sources = sources

    def collect(self):
        for prefix, source in self._sources.items():
            try:
                data = source() or {}
            except Exception:  # noqa: BLE001 a failing source must not break /metrics
                continue
            yield from _families(prefix, data)


class ServerMetrics:
    """All metrics of one worker. ``sources``: prefix -> callable giving a stats dict,
    exported as gauges (e.g. ``pdserve_engine`` -> engine stats, ``pdserve_kv_transfer`` ->
    ``KVManager.stats()``)."""

    def __init__(self, sources: dict[str, Callable[[], dict | None]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests",
            "finished HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_request_latency_seconds",
            "end-to-end latency of a request",
            ["endpoint"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "arrival to first output token, per sample",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "time between output tokens of one sample",
            buckets=_ITL,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "output tokens of finished requests", registry=r
        )
        self.failures = Counter(
            "pdserve_request_failures",
            "requests that ended in an error, by cause",
            ["cause"],
            registry=r,
        )
        self.ignored_fields = Counter(
            "pdserve_ignored_request_fields",
            "unknown request fields accepted and ignored, by field (server/field_policy.py)",
            ["field"],
            registry=r,
        )
        r.register(_SnapshotCollector(sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)
