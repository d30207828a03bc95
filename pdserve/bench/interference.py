"""The interference scenario: steady short decodes while long prompts keep arriving.

A closed loop of ``concurrency`` decode requests (short prompt, long output) runs the
workload's requests; meanwhile a second stream sends long-prompt, 1-token requests with
Poisson arrivals at ``long_request_rate`` until the decode stream is done. On a mixed
worker each long prefill stalls the running decodes; on a PD pair it runs elsewhere.
The figure is the decode stream's ITL p99 (per target, and their ratio).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

import httpx

from pdserve.bench.openai_client import StreamResult
from pdserve.bench.prompts import random_prompt
from pdserve.bench.runner import Series, Target, block_order, run_block, split_blocks
from pdserve.bench.workload import InterferenceSpec, RequestSpec, WorkloadSpec


async def long_prompt_stream(
    client: httpx.AsyncClient,
    target: Target,
    spec: WorkloadSpec,
    ispec: InterferenceSpec,
    seed: int,
    stop: asyncio.Event,
    results: list[StreamResult],
) -> None:
    """Send long-prompt, ``max_tokens=1`` requests to ``target`` at Poisson times (seeded,
    so every target sees the same prompts at the same offsets) until ``stop`` is set;
    then wait for those in flight, appending each result to ``results``."""
    rng = random.Random(seed)
    in_flight: list[asyncio.Task[None]] = []

    async def one(req: RequestSpec) -> None:
        res, _ = await run_block(client, target, spec, [req], [0.0], None, max_tokens=1)
        results.extend(res)

    index = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=rng.expovariate(ispec.long_request_rate))
            break
        except asyncio.TimeoutError:
            pass
        req = RequestSpec(index, random_prompt(rng, ispec.long_input_len), 1, ispec.long_input_len)
        in_flight.append(asyncio.create_task(one(req)))
        index += 1
    if in_flight:
        await asyncio.gather(*in_flight)


async def run_interference(
    client: httpx.AsyncClient,
    targets: Sequence[Target],
    spec: WorkloadSpec,
    ispec: InterferenceSpec,
    reqs: Sequence[RequestSpec],
    concurrency: int,
    num_blocks: int,
    on_done: Callable[[StreamResult], None],
) -> list[Series]:
    """Run the scenario on every target (blocks interleaved A B, B A …).

    Returns, per target in order, its ``decode`` series then its ``long`` series. The
    long stream's duration is the decode stream's (it runs alongside it).
    """
    decode = {t.name: Series(t, "decode", float("inf"), concurrency) for t in targets}
    long = {t.name: Series(t, "long", ispec.long_request_rate, None) for t in targets}
    for b, idx in enumerate(split_blocks(len(reqs), num_blocks)):
        block_reqs = [reqs[i] for i in idx]
        for target in block_order(targets, b):
            stop = asyncio.Event()
            long_results: list[StreamResult] = []
            feeder = asyncio.create_task(
                long_prompt_stream(
                    client, target, spec, ispec, spec.seed * 1000 + b + 1, stop, long_results
                )
            )
            try:
                results, duration = await run_block(
                    client, target, spec, block_reqs, [0.0] * len(block_reqs), concurrency, on_done
                )
            finally:
                stop.set()
                await feeder
            decode[target.name].results.extend(results)
            decode[target.name].duration_s += duration
            long[target.name].results.extend(long_results)
            long[target.name].duration_s += duration
    out: list[Series] = []
    for t in targets:
        out += [decode[t.name], long[t.name]]
    return out
