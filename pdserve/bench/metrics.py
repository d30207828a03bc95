"""Summary statistics of a benchmark run: percentiles, latency stats, throughput."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pdserve.bench.openai_client import StreamResult

MAX_ERRORS_KEPT = 3


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ``values`` with linear interpolation between
    order statistics (numpy's default, the "type 7" of Hyndman & Fan 1996).

    Returns ``nan`` for no values; raises ``ValueError`` for q outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, p90, p99 of a latency in milliseconds, over ``count`` samples."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values_s: Iterable[float]) -> LatencyStats:
        """Stats of latencies given in seconds (reported in ms); all ``nan`` when empty."""
        ms = [v * 1000.0 for v in values_s]
        mean = float(np.mean(ms)) if ms else math.nan
        return cls(len(ms), mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class RunSummary:
    """Aggregate of one target's requests in one run.

    duration_s: wall time the target was under load (sum of its blocks).
    request_throughput: completed requests / duration (req/s);
    output_throughput: output tokens of completed requests / duration (tok/s).
    tpot: per request, (latency − TTFT) / (output tokens − 1), for outputs of > 1 token.
    errors: the first distinct error messages (at most ``MAX_ERRORS_KEPT``).
    total_cached_tokens / cache_hit_rate: prompt tokens the server reported cached, and
        their share of the prompt tokens (``nan`` when it reported none).
    kv_bytes_per_request: KV bytes prefill workers sent per completed request (PD router
        targets only, ``nan`` otherwise).
    """

    num_requests: int
    completed: int
    failed: int
    errors: tuple[str, ...]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    ttft: LatencyStats
    itl: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    total_cached_tokens: int = 0
    cache_hit_rate: float = math.nan
    kv_bytes_per_request: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict copy (nan kept; ``report.json_safe`` turns it into null)."""
        return asdict(self)


def summarize(
    results: Sequence[StreamResult], duration_s: float, kv_bytes: int | None = None
) -> RunSummary:
    """Summarise ``results`` of one target measured over ``duration_s`` seconds
    (``kv_bytes``: KV bytes transferred meanwhile, if known)."""
    done = [r for r in results if r.ok]
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error and r.error not in errors and len(errors) < MAX_ERRORS_KEPT:
            errors.append(r.error)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in done
        if r.ttft is not None and r.output_tokens > 1
    ]
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    return RunSummary(
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        errors=tuple(errors),
        duration_s=duration_s,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=rate(len(done)),
        output_throughput=rate(out_tokens),
        ttft=LatencyStats.of_seconds(r.ttft for r in done if r.ttft is not None),
        itl=LatencyStats.of_seconds(x for r in done for x in r.itl),
        tpot=LatencyStats.of_seconds(tpot),
        e2e=LatencyStats.of_seconds(r.latency for r in done),
        total_cached_tokens=sum(r.cached_tokens or 0 for r in done),
        cache_hit_rate=(
            sum(r.cached_tokens or 0 for r in done) / in_tokens
            if in_tokens and any(r.cached_tokens is not None for r in done)
            else math.nan
        ),
        kv_bytes_per_request=kv_bytes / len(done) if kv_bytes is not None and done else math.nan,
    )


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, ``nan`` when either is nan or the denominator is 0."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator
