"""The worker's Prometheus metrics (own CollectorRegistry per app, no globals).

Request counts and latencies, TTFT, ITL, prompt/generation tokens are recorded by the
request handlers; running/waiting requests and free KV pages come from the engine
snapshot, transfer counters from ``KVManager.stats()``, both read at scrape time.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _flatten(prefix: str, value: Any, labels: tuple[tuple[str, str], ...] = ()) -> Iterable[tuple[str, tuple, float]]:
    """(metric name, labels, value) for every number in a nested stats dict; a dict whose
    keys are not identifiers (reasons, states) becomes a label of its parent."""
    if isinstance(value, bool):
        yield prefix, labels, float(value)
    elif isinstance(value, (int, float)):
        yield prefix, labels, float(value)
    elif isinstance(value, dict):
        for key, sub in value.items():
            key = str(key)
            if isinstance(sub, (int, float)) and not isinstance(sub, bool) and not key.isidentifier():
                yield prefix, labels + (("key", key),), float(sub)
            else:
                yield from _flatten(f"{prefix}_{_NAME.sub('_', key)}", sub, labels)


class _SnapshotCollector:
    """Gauges read at scrape time from callables returning nested dicts of numbers."""

    def __init__(self, sources: dict[str, Callable[[], dict | None]]) -> None:
        self._sources = sources

    def collect(self):
        for prefix, source in self._sources.items():
            try:
                data = source() or {}
            except Exception:
                continue
            families: dict[str, tuple[list[str], GaugeMetricFamily]] = {}
            for name, labels, number in _flatten(prefix, data):
                keys = [k for k, _ in labels]
                if name not in families:
                    families[name] = (keys, GaugeMetricFamily(name, f"{name} (from the {prefix} snapshot)",
                                                              labels=keys))
                if families[name][0] == keys:
                    families[name][1].add_metric([v for _, v in labels], number)
            for _, family in families.values():
                yield family


class ServerMetrics:
    """All metrics of one worker. ``sources``: prefix -> callable giving a stats dict,
    exported as gauges (e.g. ``pdserve_engine`` -> engine stats, ``pdserve_kv_transfer`` ->
    ``KVManager.stats()``)."""

    def __init__(self, sources: dict[str, Callable[[], dict | None]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "finished HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.e2e = Histogram("pdserve_request_latency_seconds", "end-to-end latency of a request",
                             ["endpoint"], buckets=_LATENCY, registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "arrival to first output token, per sample",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between output tokens of one sample",
                             buckets=_ITL, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "output tokens of finished requests",
                                         registry=r)
        self.failures = Counter("pdserve_request_failures", "requests that ended in an error, by cause",
                                ["cause"], registry=r)
        r.register(_SnapshotCollector(sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)
