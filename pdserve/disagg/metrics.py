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


class TransferMetrics:
    """Thread-safe counters: bytes and pages moved, transfer latency (sum, count and
    cumulative histogram buckets), failed rooms by reason kind.

    On prefill a "transfer" is one room's WRITEs from ``send`` until NIXL reports them done;
    on decode it is from ``init`` (destination sent) until the completion notification.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._pages = 0
        self._ok = 0
        self._lat_sum = 0.0
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # last one: +Inf
        self._failed: Counter[str] = Counter()

    def record_success(self, nbytes: int, npages: int, seconds: float) -> None:
        with self._lock:
            self._bytes += nbytes
            self._pages += npages
            self._ok += 1
            self._lat_sum += seconds
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self._buckets[i] += 1
                    break
            else:
                self._buckets[-1] += 1

    def record_failure(self, kind: str) -> None:
        with self._lock:
            self._failed[kind] += 1

    def snapshot(self) -> dict:
        """``{"bytes_transferred", "pages_transferred", "transfers_succeeded",
        "transfer_latency_seconds": {"sum", "count", "buckets": {"<le>": cumulative, "+Inf"}},
        "transfers_failed": {kind: n}, "transfers_failed_total"}``."""
        with self._lock:
            cumulative, buckets = 0, {}
            for bound, n in zip(LATENCY_BUCKETS, self._buckets):
                cumulative += n
                buckets[f"{bound:g}"] = cumulative
            buckets["+Inf"] = cumulative + self._buckets[-1]
            return {
                "bytes_transferred": self._bytes,
                "pages_transferred": self._pages,
                "transfers_succeeded": self._ok,
                "transfer_latency_seconds": {
                    "sum": self._lat_sum,
                    "count": self._ok,
                    "buckets": buckets,
                },
                "transfers_failed": dict(self._failed),
                "transfers_failed_total": sum(self._failed.values()),
            }
