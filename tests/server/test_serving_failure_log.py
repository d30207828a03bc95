"""A request that fails in the engine (a KV transfer's room on a decode worker, or the
engine itself) is logged by the worker with why, under its request id, and counted by
cause: the client (usually the router, which sends it again) gets the message, and the
worker's own log and ``pdserve_request_failures_total`` keep it (the session-11 trial found
a decode worker's 500s in neither)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.engine.core.request import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.server.metrics import ServerMetrics
from pdserve.server.serving import APIError, Job, Serving


class FailingEngine:
    """Answers every sample with a failed output, as the engine does for a room whose KV
    transfer failed."""

    alive, error = True, None

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def add(self, rid, prompt_ids, params, disagg, sink) -> None:
        out = CompletionOutput(
            index=0, text="", token_ids=[], cumulative_logprob=0.0, finish_reason="error"
        )
        sink(RequestOutput(rid, list(prompt_ids), [out], True, error="room 7: heartbeat lost"))

    def abort(self, rid) -> None:
        self.aborted.append(rid)


@pytest.mark.parametrize("role, cause", [("mixed", "engine"), ("decode", "kv_transfer")])
def test_a_failed_request_is_logged_with_why_and_counted(role, cause, caplog):
    metrics = ServerMetrics({})
    serving = Serving(FailingEngine(), role=role, max_model_len=64, vocab_size=100, metrics=metrics)
    job = Job([1, 2, 3], SamplingParams(max_tokens=4), fake_transfer=role != "mixed")

    async def run() -> None:
        async for _ in serving.stream(job):
            pass

    with caplog.at_level(logging.WARNING, logger="pdserve.server"), pytest.raises(APIError) as info:
        asyncio.run(run())
    assert info.value.status == 500 and "heartbeat lost" in info.value.message
    logged = [r.getMessage() for r in caplog.records if r.name == "pdserve.server"]
    assert logged == [f"request failed ({cause}): HTTP 500: room 7: heartbeat lost"], logged
    counted = metrics.failures.labels(cause)._value.get()
    assert counted == 1, counted
