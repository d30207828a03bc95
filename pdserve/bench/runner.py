"""Drives load at targets: fixed concurrency or Poisson arrivals, interleaved blocks.

With two targets (``--compare``) the workload is cut into blocks that alternate between
the targets in A B, B A, A B … order, so both see the same requests and the same drift
of a shared, noisy machine, without loading each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.kv_probe import kv_bytes_sent, prefill_urls
from pdserve.bench.metrics import RunSummary, summarize
from pdserve.bench.openai_client import StreamResult, stream_request
from pdserve.bench.prompts import random_prompt
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
    kv_bytes: KV bytes the target's prefill workers sent during its blocks (PD routers
        only; ``None`` when unknown).
    point: index of the load point in the run (``--request-rate 8,8,8``: 0, 1, 2), so
        repeated rates are reported apart; 0 for the interference scenario.
    """

    target: Target
    stream: str
    request_rate: float
    concurrency: int | None
    results: list[StreamResult] = field(default_factory=list)
    duration_s: float = 0.0
    kv_bytes: int | None = None
    point: int = 0

    def summary(self) -> RunSummary:
        """The aggregate statistics of this series."""
        return summarize(self.results, self.duration_s, self.kv_bytes)

    @property
    def label(self) -> str:
        """Short label for plots, e.g. ``target main @2 req/s`` (``... (load point 2)``
        from the second load point on)."""
        rate = "closed loop" if math.isinf(self.request_rate) else f"@{self.request_rate:g} req/s"
        run = f" (load point {self.point + 1})" if self.point else ""
        return f"{self.target.name} {self.stream} {rate}{run}"


def request_body(
    req: RequestSpec,
    model: str,
    spec: WorkloadSpec,
    max_tokens: int | None = None,
    history: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    """The JSON body of ``req`` for ``spec.resolved_endpoint`` (greedy unless the spec
    says otherwise). ``ignore_eos`` is sent only when true, since strict OpenAI-style
    servers reject unknown fields.  ``req.system`` comes first (a system message, or
    before the prompt); ``history``: earlier chat messages of a multi-turn conversation."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens if max_tokens is None else max_tokens,
        "temperature": spec.temperature,
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.phase_timing:
        body["return_timing"] = True
    if spec.resolved_endpoint == "chat":
        system = [{"role": "system", "content": req.system}] if req.system else []
        body["messages"] = system + list(history) + [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = f"{req.system}\n\n{req.prompt}" if req.system else req.prompt
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
        async with sem or contextlib.nullcontext():
            result = await stream_request(client, target.base_url, spec.resolved_endpoint, body)
        on_done(result)
        return result

    if spec.dataset == "multi-turn":
        return await _run_conversations(client, target, spec, reqs, arrivals, sem, on_done, t0)
    results = await asyncio.gather(*(one(r, a) for r, a in zip(reqs, arrivals)))
    return list(results), time.perf_counter() - t0


async def _run_conversations(
    client: httpx.AsyncClient,
    target: Target,
    spec: WorkloadSpec,
    reqs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    sem: asyncio.Semaphore | None,
    on_done: Callable[[StreamResult], None],
    t0: float,
) -> tuple[list[StreamResult], float]:
    """Multi-turn: each conversation starts at its first turn's arrival and sends its turns
    one after the other, each with the history so far (user messages and the answers the
    server gave); ``sem`` caps the conversations in flight.  Results in request order."""
    by_conv: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        by_conv.setdefault(r.conversation or 0, []).append(i)
    results: list[StreamResult | None] = [None] * len(reqs)

    async def conversation(idx: list[int]) -> None:
        delay = t0 + arrivals[idx[0]] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        history: list[dict[str, str]] = []
        for i in sorted(idx, key=lambda j: reqs[j].turn or 0):
            body = request_body(reqs[i], target.model, spec, history=history)
            result = await stream_request(client, target.base_url, "chat", body)
            results[i] = result
            on_done(result)
            history += [body["messages"][-1], {"role": "assistant", "content": result.text}]

    async def capped(idx: list[int]) -> None:
        async with sem or contextlib.nullcontext():
            await conversation(idx)

    await asyncio.gather(*(capped(idx) for idx in by_conv.values()))
    return [r for r in results if r is not None], time.perf_counter() - t0


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
    """Send ``num_warmups`` requests to each target, unmeasured, so one-off costs (first
    forward pass, connection set-up) stay out of the figures: prompts of their own at the
    workload's length (GSM8K: its first questions)."""
    if num_warmups <= 0:
        return
    warm = [reqs[i % len(reqs)] for i in range(num_warmups)]
    if spec.dataset in ("random", "shared-prefix", "multi-turn"):
        # prompts of their own, so the warm-up does not fill the prefix cache being measured
        # (nor share a seed with a rate's prompts: bench serve seeds rate i with seed + i)
        rng = random.Random(f"warm-up {spec.seed}")
        warm = [
            RequestSpec(-1 - i, random_prompt(rng, spec.input_len), spec.output_len)
            for i in range(num_warmups)
        ]
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
    point: int = 0,
    between_blocks: Callable[[], None] = lambda: None,
) -> list[Series]:
    """Run the whole workload once on every target (blocks interleaved); one ``Series``
    per target, results in request order; ``point``: the load point's index;
    ``between_blocks``: run after each block, when no stream is read (``bench serve``'s
    garbage collection, off under load)."""
    series = {t.name: Series(t, "main", request_rate, concurrency, point=point) for t in targets}
    probes = {t.name: await prefill_urls(client, t.base_url) for t in targets}
    blocks = split_blocks(len(reqs), num_blocks)
    if spec.dataset == "multi-turn":  # a conversation is never cut between blocks
        blocks = _conversation_blocks(reqs, num_blocks)
    for b, idx in enumerate(blocks):
        block_reqs = [reqs[i] for i in idx]
        block_arrivals = [arrivals[i] - arrivals[idx[0]] for i in idx]
        for target in block_order(targets, b):
            before = await kv_bytes_sent(client, probes[target.name])
            results, duration = await run_block(
                client, target, spec, block_reqs, block_arrivals, concurrency, on_done
            )
            after = await kv_bytes_sent(client, probes[target.name])
            between_blocks()
            s = series[target.name]
            s.results.extend(results)
            s.duration_s += duration
            if before is not None and after is not None:
                s.kv_bytes = (s.kv_bytes or 0) + after - before
    return [series[t.name] for t in targets]


def _conversation_blocks(reqs: Sequence[RequestSpec], num_blocks: int) -> list[range]:
    """Blocks of whole conversations (requests of one conversation are consecutive)."""
    starts = [i for i, r in enumerate(reqs) if i == 0 or r.conversation != reqs[i - 1].conversation]
    cut = split_blocks(len(starts), num_blocks)
    ends = starts[1:] + [len(reqs)]
    return [range(starts[c[0]], ends[c[-1]]) for c in cut]
