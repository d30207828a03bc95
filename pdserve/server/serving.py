"""One client request inside the worker: validation against the model, fan-out of ``n``
samples into single-sample engine requests (each with its own bootstrap room in PD roles),
collection / streaming of their outputs, abort on cancel, and per-request metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.disagg.base import ROOM_LIMIT, DuplicateRoomError, Role, sample_room
from pdserve.engine.core.request import DisaggRequestInfo
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.http.aio import get_within
from pdserve.server.async_engine import AsyncEngine, EngineDeadError
from pdserve.server.metrics import ServerMetrics


class APIError(Exception):
    """An error answer: HTTP ``status`` and a message (``param`` names the field, ``code``
    is OpenAI's string for the error where it has one: ``http_errors.error_json``)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _sink(inbox: asyncio.Queue[tuple[int, Any]], index: int) -> Callable[[Any], None]:
    """The engine callback of sample ``index``: puts ``(index, item)`` into ``inbox``."""
    return lambda item: inbox.put_nowait((index, item))


@dataclass
class Job:
    """One validated client request: the prompt, the (possibly n > 1) sampling params and
    the disaggregation fields (``None`` on a mixed worker)."""

    prompt_ids: list[int]
    params: SamplingParams
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None  # the request's; rooms: disagg.base.sample_room
    prompt_index: int = 0  # which prompt of a /v1/completions batch this job is
    fake_transfer: bool = False  # /health_generate in PD roles
    prompt_field: str = "prompt"  # the request field errors about the prompt name
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.perf_counter)


def make_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams, with its ValueError turned into a 400 naming the field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc


class Serving:
    """Runs jobs on the engine of one worker (``role``: mixed, prefill or decode)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        role: str | Role,
        max_model_len: int,
        vocab_size: int,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.role = Role(role)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics

    # --- validation ---------------------------------------------------------------------
    def check(self, job: Job) -> None:
        """400 for an empty/over-long prompt, ids outside the vocabulary, or missing/invalid
        bootstrap fields in a PD role."""
        n_prompt = len(job.prompt_ids)
        if n_prompt == 0:
            raise APIError(400, "prompt must not be empty", job.prompt_field)
        if any(not 0 <= t < self.vocab_size for t in job.prompt_ids):
            raise APIError(
                400, f"prompt token ids must be in [0, {self.vocab_size})", job.prompt_field
            )
        bad_bias = [t for t, _ in job.params.logit_bias_items if t >= self.vocab_size]
        if bad_bias:
            raise APIError(
                400,
                f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad_bias[0]}",
                "logit_bias",
            )
        max_tokens = job.params.max_tokens or 1
        if n_prompt + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"this model's context limit is {self.max_model_len} tokens, but the request "
                f"needs {n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} of "
                f"max_tokens)",
                "max_tokens" if n_prompt < self.max_model_len else job.prompt_field,
                code="context_length_exceeded",
            )
        if self.role == Role.MIXED or job.fake_transfer:
            return
        for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            if getattr(job, name) in (None, ""):
                raise APIError(
                    400,
                    f"{name} is required on a {self.role} worker "
                    f"(send requests through the router)",
                    name,
                )
        room, n = job.bootstrap_room, job.params.n
        assert room is not None  # checked just above
        if sample_room(room, job.prompt_index, n, n - 1) >= ROOM_LIMIT:
            raise APIError(
                400,
                "bootstrap_room + n (times the prompts of a batch) must be <= 2**63 (sample i "
                "of prompt p uses room bootstrap_room + p * n + i)",
                "bootstrap_room",
            )

    def _disagg(self, job: Job, index: int) -> DisaggRequestInfo | None:
        if self.role == Role.MIXED:
            return None
        if job.fake_transfer:
            return DisaggRequestInfo(self.role, "127.0.0.1", 1, job.bootstrap_room or 0, fake=True)
        host, port, room = job.bootstrap_host, job.bootstrap_port, job.bootstrap_room
        assert host is not None and port is not None and room is not None  # check() ran first
        room = sample_room(room, job.prompt_index, job.params.n, index)
        return DisaggRequestInfo(self.role, host, port, room)

    # --- running --------------------------------------------------------------------------
    async def stream(self, job: Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Submit ``job`` and yield ``(sample index, output)`` as the engine produces them,
        until every sample finished. Raises APIError (400 bad input, 409 duplicate room,
        500 failed request / KV transfer, 503 engine down: a request the engine was running
        when it went down too, e.g. a tensor-parallel rank gone). Closing the iterator early (client
        gone, cancellation) aborts every unfinished sample, which frees its pages."""
        self.check(job)
        samples = job.params.fan_out(job.request_id)
        inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        live: dict[str, int] = {}
        last_token_time: dict[int, float] = {}
        try:
            for index, (rid, params) in enumerate(samples):
                live[rid] = index
                self.engine.add(
                    rid,
                    list(job.prompt_ids),
                    params,
                    self._disagg(job, index),
                    _sink(inbox, index),
                )
            while live:
                try:
                    index, item = await get_within(inbox, 1.0)
                except asyncio.TimeoutError:
                    if not self.engine.alive:
                        raise EngineDeadError(self.engine.error or "engine stopped") from None
                    continue
                if isinstance(item, Exception):
                    raise item
                if item.error is not None or any(o.finish_reason == "error" for o in item.outputs):
                    if not self.engine.alive:  # the engine cannot serve (a rank is gone):
                        raise EngineDeadError(item.error or self.engine.error or "engine stopped")
                    raise APIError(500, item.error or "request failed in the engine")
                self._observe(job, index, item, last_token_time)
                if item.finished:
                    live.pop(item.request_id, None)
                yield index, item
        except DuplicateRoomError as exc:
            self.metrics.failures.labels("duplicate_room").inc()
            raise APIError(409, str(exc), "bootstrap_room") from exc
        except ValueError as exc:
            self.metrics.failures.labels("invalid").inc()
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from exc
        except EngineDeadError as exc:
            self.metrics.failures.labels("engine_dead").inc()
            raise APIError(503, str(exc)) from exc
        except APIError:
            self.metrics.failures.labels(
                "kv_transfer" if self.role != Role.MIXED else "engine"
            ).inc()
            raise
        finally:
            for rid in live:
                self.engine.abort(rid)

    async def stream_all(
        self, jobs: Sequence[Job]
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run several jobs at once (a batch of prompts, each with the same ``n``) and yield
        ``(p * n + sample index, output)`` for job ``p``, interleaved as the engine produces
        them (vLLM's and SGLang's numbering of a batch's choices). Every job is checked
        before any starts; the first failure (an APIError as :meth:`stream`) ends them all,
        and so does closing the iterator (every unfinished sample is aborted)."""
        if len(jobs) == 1:
            async for item in self.stream(jobs[0]):
                yield item
            return
        for p, job in enumerate(jobs):
            try:
                self.check(job)
            except APIError as exc:  # a prompt of the batch: name it
                if exc.param not in ("prompt", "max_tokens"):
                    raise
                raise APIError(
                    exc.status, f"prompt[{p}]: {exc.message}", exc.param, exc.code
                ) from None
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(p: int, job: Job) -> None:
            try:
                async for index, out in self.stream(job):
                    queue.put_nowait((p * job.params.n + index, out))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
                queue.put_nowait((-1, exc))
                return
            queue.put_nowait((-1, None))  # job p is done

        tasks = [asyncio.ensure_future(pump(p, job)) for p, job in enumerate(jobs)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if index < 0:
                    if item is not None:
                        raise item
                    running -= 1
                    continue
                yield index, item
        finally:
            for task in tasks:
                task.cancel()  # each job's stream aborts its unfinished samples
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, job: Job | Sequence[Job]) -> list[RequestOutput]:
        """Run ``job`` (or a batch: :meth:`stream_all`) to the end; the final output of
        each sample, in index order."""
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.stream_all([job] if isinstance(job, Job) else job):
            if out.finished:
                finals[index] = out
        return [finals[i] for i in sorted(finals)]

    def _observe(self, job: Job, index: int, out: RequestOutput, last: dict[int, float]) -> None:
        now = time.perf_counter()
        new = sum(len(o.delta_token_ids) for o in out.outputs)
        if new:
            if index not in last:
                self.metrics.ttft.observe(now - job.arrival)
                new -= 1
                last[index] = now
            if new > 0:
                gap = (now - last[index]) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
                last[index] = now
        if out.finished:
            if index == 0:
                self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            self.metrics.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
