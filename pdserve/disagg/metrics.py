"""Transfer counters of one KV manager, read by the server's metrics at scrape time."""

from __future__ import annotations

import threading
from collections import Counter

# Upper bounds (seconds) of the latency histogram: 1 ms .. 5 min (the bootstrap timeout).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


# Upper bounds (seconds) of the completion-latency histogram: 10 us .. 1 s.
COMPLETION_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    0.1,
    1.0,
)


def _observe(buckets: list[int], bounds: tuple[float, ...], seconds: float) -> None:
    for i, bound in enumerate(bounds):
        if seconds <= bound:
            buckets[i] += 1
            return
    buckets[-1] += 1


def _cumulative(buckets: list[int], bounds: tuple[float, ...]) -> dict[str, int]:
    cumulative, out = 0, {}
    for bound, n in zip(bounds, buckets):
        cumulative += n
        out[f"{bound:g}"] = cumulative
    out["+Inf"] = cumulative + buckets[-1]
    return out


class TransferMetrics:
    """Thread-safe counters: bytes and pages moved, transfer latency (sum, count and
    cumulative histogram buckets), failed rooms by reason kind.

    On prefill a "transfer" is one room's WRITEs from ``send`` until NIXL reports them done;
    on decode it is from ``init`` (destination sent) until the completion notification.
    The completion latency (prefill) is the last ``send``'s WRITEs from the worker taking
    them to every one done and decode notified: the fixed cost a request pays.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._pages = 0
        self._ok = 0
        self._lat_sum = 0.0
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # last one: +Inf
        self._failed: Counter[str] = Counter()
        self._done = [0] * (len(COMPLETION_BUCKETS) + 1)
        self._done_sum = 0.0

    def record_completion(self, seconds: float) -> None:
        with self._lock:
            self._done_sum += seconds
            _observe(self._done, COMPLETION_BUCKETS, seconds)

    def record_success(self, nbytes: int, npages: int, seconds: float) -> None:
        with self._lock:
            self._bytes += nbytes
            self._pages += npages
            self._ok += 1
            self._lat_sum += seconds
            _observe(self._buckets, LATENCY_BUCKETS, seconds)

    def record_failure(self, kind: str) -> None:
        with self._lock:
            self._failed[kind] += 1

    def snapshot(self) -> dict:
        """``{"bytes_transferred", "pages_transferred", "transfers_succeeded",
        "transfer_latency_seconds": {"sum", "count", "buckets": {"<le>": cumulative, "+Inf"}},
        "completion_latency_seconds": {"sum", "count", "buckets"},
        "transfers_failed": {kind: n}, "transfers_failed_total"}``."""
        with self._lock:
            buckets = _cumulative(self._buckets, LATENCY_BUCKETS)
            done = _cumulative(self._done, COMPLETION_BUCKETS)
            return {
                "bytes_transferred": self._bytes,
                "pages_transferred": self._pages,
                "transfers_succeeded": self._ok,
                "transfer_latency_seconds": {
                    "sum": self._lat_sum,
                    "count": self._ok,
                    "buckets": buckets,
                },
                "completion_latency_seconds": {
                    "sum": self._done_sum,
                    "count": done["+Inf"],
                    "buckets": done,
                },
                "transfers_failed": dict(self._failed),
                "transfers_failed_total": sum(self._failed.values()),
            }
