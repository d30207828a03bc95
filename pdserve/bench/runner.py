"""Drives load at targets: fixed concurrency or Poisson arrivals, interleaved blocks.

With two targets (``--compare``) the workload is cut into blocks that alternate between
the targets in A B, B A, A B … order, so both see the same requests and the same drift
of a shared, noisy machine, without loading each other.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.metrics import RunSummary, summarize
from pdserve.bench.openai_client import StreamResult, stream_request
from pdserve.bench.workload import RequestSpec, WorkloadSpec


@dataclass(frozen=True)
class Target:
    """A server under test: ``name`` is ``target`` or ``compare``; ``base_url`` has no ``/v1``."""

    name: str
    base_url: str
    model: str


@dataclass
class Series:
    """The requests of one stream on one target at one load point.

    stream: ``main`` (the standard scenario), ``decode`` or ``long`` (interference).
    request_rate: Poisson rate in req/s, ``inf`` for closed loop at ``concurrency``.
    duration_s: wall time summed over the target's blocks.
    """

    target: Target
    stream: str
    request_rate: float
    concurrency: int | None
    results: list[StreamResult] = field(default_factory=list)
    duration_s: float = 0.0

    def summary(self) -> RunSummary:
        """The aggregate statistics of this series."""
        return summarize(self.results, self.duration_s)

    @property
    def label(self) -> str:
        """Short label for plots, e.g. ``target main @2 req/s``."""
        rate = "closed loop" if math.isinf(self.request_rate) else f"@{self.request_rate:g} req/s"
        return f"{self.target.name} {self.stream} {rate}"


def request_body(
    req: RequestSpec, model: str, spec: WorkloadSpec, max_tokens: int | None = None
) -> dict[str, Any]:
    """The JSON body of ``req`` for ``spec.resolved_endpoint`` (greedy unless the spec
    says otherwise). ``ignore_eos`` is sent only when true, since strict OpenAI-style
    servers reject unknown fields."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens if max_tokens is None else max_tokens,
        "temperature": spec.temperature,
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.resolved_endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def run_block(
    client: httpx.AsyncClient,
    target: Target,
    spec: WorkloadSpec,
    reqs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    concurrency: int | None,
    on_done: Callable[[StreamResult], None] = lambda r: None,
    max_tokens: int | None = None,
) -> tuple[list[StreamResult], float]:
    """Send ``reqs`` to ``target``, request i at ``arrivals[i]`` s after the start, with at
    most ``concurrency`` in flight (``None``: no cap). Returns (results in request
    order, wall seconds from the start to the last completion)."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    async def one(req: RequestSpec, at: float) -> StreamResult:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body = request_body(req, target.model, spec, max_tokens)
        if sem is None:
            result = await stream_request(client, target.base_url, spec.resolved_endpoint, body)
        else:
            async with sem:
                result = await stream_request(client, target.base_url, spec.resolved_endpoint, body)
        on_done(result)
        return result

    results = await asyncio.gather(*(one(r, a) for r, a in zip(reqs, arrivals)))
    return list(results), time.perf_counter() - t0


def split_blocks(n: int, num_blocks: int) -> list[range]:
    """Cut ``range(n)`` into ``min(num_blocks, n)`` contiguous, near-equal, non-empty ranges."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    k = min(num_blocks, n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def block_order(targets: Sequence[Target], block: int) -> list[Target]:
    """A B in even blocks, B A in odd ones (ABBA cancels a linear drift)."""
    return list(targets) if block % 2 == 0 else list(reversed(targets))


async def warm_up(
    client: httpx.AsyncClient,
    targets: Sequence[Target],
    spec: WorkloadSpec,
    reqs: Sequence[RequestSpec],
    num_warmups: int,
) -> None:
    """Send ``num_warmups`` requests (the workload's first ones) to each target, unmeasured,
    so one-off costs (first forward pass, connection set-up) stay out of the figures."""
    if num_warmups <= 0:
        return
    warm = [reqs[i % len(reqs)] for i in range(num_warmups)]
    for target in targets:
        await run_block(client, target, spec, warm, [0.0] * len(warm), None)


async def run_load_point(
    client: httpx.AsyncClient,
    targets: Sequence[Target],
    spec: WorkloadSpec,
    reqs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    request_rate: float,
    concurrency: int | None,
    num_blocks: int,
    on_done: Callable[[StreamResult], None],
) -> list[Series]:
    """Run the whole workload once on every target (blocks interleaved); one ``Series``
    per target, results in request order."""
    series = {t.name: Series(t, "main", request_rate, concurrency) for t in targets}
    for b, idx in enumerate(split_blocks(len(reqs), num_blocks)):
        block_reqs = [reqs[i] for i in idx]
        block_arrivals = [arrivals[i] - arrivals[idx[0]] for i in idx]
        for target in block_order(targets, b):
            results, duration = await run_block(
                client, target, spec, block_reqs, block_arrivals, concurrency, on_done
            )
            series[target.name].results.extend(results)
            series[target.name].duration_s += duration
    return [series[t.name] for t in targets]
