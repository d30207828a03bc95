"""Where one worker request's time went, phase by phase: from the engine thread's phase
boundaries (``engine/core/request.py:PhaseTimes``, plain floats) to Prometheus
histograms, the response's opt-in timing block (``return_timing``) and, with tracing on,
one child span per phase under the request's span (``pdserve/tracing.py``). All of it runs
on the event loop when a sample finishes; the engine thread only stores floats.

Phases, in time order (each ends where the next reached one starts; seconds):

- every role: ``tokenize`` (HTTP handler entry → the job is built: body, chat template,
  tokenizer), ``engine_inbox`` (→ the engine thread took it);
- mixed: ``queue`` (→ first scheduled), ``prefill`` (→ first token), ``decode``
  (→ finished), ``respond`` (→ the serving layer has the last output);
- prefill: ``bootstrap`` (→ decode's destination known), ``queue`` (→ scheduled),
  ``prefill`` (→ the first token sampled, the last pages posted), ``kv_transfer``
  (→ the transfer layer's ``Success``: WRITEs done, notification sent), ``kv_notice``
  (→ the engine saw it), ``respond``;
- decode: ``bootstrap`` (→ the bootstrap with prefill done), ``kv_alloc_wait`` (→ pages
  reserved, sent to prefill), ``kv_transfer`` (→ the notification with the first token
  arrived: decode's wait for prefill's queue, compute and WRITE), ``kv_notice`` (→ the
  engine saw it: decode's notification lag), ``decode_queue`` (→ its first decode step),
  ``decode`` (→ finished), ``stream_end``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from pdserve import tracing
from pdserve.disagg.base import Role
from pdserve.engine.core.request import PhaseTimes, RequestOutput

_PHASE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)
_GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 400)
MAX_TOKEN_EVENTS = 256  # token events per sample on its span (a long answer's first ones)


def phase_bounds(
    role: Role, request_start: float, arrival: float, t: PhaseTimes
) -> list[tuple[str, float]]:
    """``[(phase, start), ...]`` of ``role`` in time order (a 0.0 start: not reached)."""
    head = [("tokenize", request_start), ("engine_inbox", arrival)]
    if role is Role.PREFILL:
        # The prompt is computed while decode's destination is on its way: "bootstrap" is
        # the wait for it that is left once the prompt is computed (none if it came first).
        # A request the compute-ahead cap kept (--pd-compute-ahead-fraction) is scheduled
        # only once its destination came: its wait is in "queue", "bootstrap" is ~0.  One
        # that gave its computed pages back (--pd-compute-ahead-timeout) keeps its first
        # "computed": "bootstrap" holds the rest of its wait and its prompt's recompute.
        return head + [
            ("queue", t.queued),
            ("prefill", t.scheduled),
            ("bootstrap", t.computed),
            ("kv_transfer", t.transfer_posted),
            ("kv_notice", t.transfer_finished),
            ("respond", t.transfer_done or t.finished),
        ]
    if role is Role.DECODE:
        return head + [
            ("bootstrap", t.queued),
            ("kv_alloc_wait", t.peer_ready),
            ("kv_transfer", t.transfer_posted),
            ("kv_notice", t.transfer_finished),
            ("decode_queue", t.transfer_done),
            ("decode", t.scheduled),
            ("stream_end", t.finished),
        ]
    return head + [
        ("queue", t.queued),
        ("prefill", t.scheduled),
        ("decode", t.first_token),
        ("respond", t.finished),
    ]


class PhaseMetrics:
    """The per-phase histograms of one worker, in its ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.phase = Histogram(
            "pdserve_request_phase_seconds",
            "time one sample spent in each phase on this worker (server/phases.py: "
            "tokenize, engine_inbox, bootstrap, queue, prefill, kv_alloc_wait, kv_transfer, "
            "kv_notice, decode_queue, decode, respond, stream_end), by role",
            ["role", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=registry,
        )
        self.ttft_engine = Histogram(
            "pdserve_request_engine_ttft_seconds",
            "engine took the request -> first token on this worker (decode: prefill's token "
            "arrived with the KV; prefill: the token was sampled and posted), by role",
            ["role"],
            buckets=_PHASE_BUCKETS,
            registry=registry,
        )
        self.bootstrap = Histogram(
            "pdserve_request_kv_bootstrap_seconds",
            "PD: engine took the request -> its room's peer is known (prefill: decode's "
            "destination arrived; decode: the bootstrap with prefill is done), by role",
            ["role"],
            buckets=_PHASE_BUCKETS,
            registry=registry,
        )
        self.transfer = Histogram(
            "pdserve_request_kv_transfer_seconds",
            "PD, per request: pages posted -> the transfer layer's Success (prefill: the "
            "WRITEs and the notification; decode: waiting for prefill's notification after "
            "sending its page ids), by role",
            ["role"],
            buckets=_PHASE_BUCKETS,
            registry=registry,
        )
        self.notice = Histogram(
            "pdserve_request_kv_notice_lag_seconds",
            "PD, per request: the transfer layer's Success -> the engine saw it (decode: "
            "the notification with the first token arrived -> the engine joined it), by role",
            ["role"],
            buckets=_PHASE_BUCKETS,
            registry=registry,
        )
        self.gbps = Histogram(
            "pdserve_request_kv_transfer_gbps",
            "PD prefill, per request: the prompt's KV bytes (pages decode already held "
            "included: prefill does not know them) / (last pages posted -> the transfer "
            "layer's Success), GB/s",
            buckets=_GBPS_BUCKETS,
            registry=registry,
        )


class PhaseRecorder:
    """Turns a finished sample's phase boundaries into histograms, the timing block
    (``RequestOutput.timing``) and, when the request has a span, phase spans.

    page_bytes: KV bytes of one page of this worker's pool (every rank's together), for
        the transfer's bytes and GB/s; 0 when unknown.
    transfer_backend: the PD transfer backend's name (a span attribute), or None.
    ucx: the UCX transport report (``UcxTransportLog.snapshot``: ``{"endpoints": [...]}``)
        or None; read at most every ``UCX_EVERY_S`` seconds, only for spans: the
        transports UCX chose for remote writes, the ``kv.ucx_transports`` attribute.
    """

    UCX_EVERY_S = 5.0

    def __init__(
        self,
        role: Role,
        metrics: PhaseMetrics,
        *,
        page_bytes: int = 0,
        transfer_backend: str | None = None,
        ucx: Callable[[], dict | None] | None = None,
    ) -> None:
        self.role = role
        self.metrics = metrics
        self.page_bytes = page_bytes
        self.transfer_backend = transfer_backend
        self._ucx = ucx
        self._ucx_at = -math.inf
        self._ucx_transports = ""

    def ucx_transports(self) -> str:
        """The transports of UCX's remote-write protocol tables seen so far, e.g.
        ``"cma/memory, posix/memory"`` ("" when none or no report); cached for
        ``UCX_EVERY_S`` seconds."""
        now = time.monotonic()
        if self._ucx is not None and now - self._ucx_at >= self.UCX_EVERY_S:
            self._ucx_at = now
            try:
                report = self._ucx() or {}
            except Exception:  # noqa: BLE001 - an attribute, never a failed request
                report = {}
            found = {
                t
                for e in report.get("endpoints") or []
                if "write" in str(e.get("operation", ""))
                for t in e.get("transports") or []
            }
            self._ucx_transports = ", ".join(sorted(found))
        return self._ucx_transports

    def finished(
        self,
        out: RequestOutput,
        *,
        arrival: float,
        room: int | None = None,
        peer: str | None = None,
        tokens: list[tuple[float, int]] | None = None,
        first_out: float = 0.0,
        first_chunk: float = 0.0,
    ) -> None:
        """Record sample ``out`` (finished): sets ``out.timing`` to ``{role: {"phases":
        {name: seconds}, "start_unix", "first_token_out", "kv_pages", "kv_bytes",
        "transfer_gbps"}}`` (PD fields only on PD roles; ``start_unix``: when the request
        entered this worker's app, Unix seconds; ``first_token_out``: seconds from the
        engine appending the first token to the event loop holding it, from
        ``first_out``, when both are known; ``first_chunk_unix``: when the stream's first
        SSE chunk went to the server, Unix seconds, from ``first_chunk`` (perf_counter),
        when given: a stream whose first chunk was not out before the sample finished,
        such as a one-token answer, has none), observes the histograms, and adds the phase spans under the
        current request's span (``tokens``: ``(perf_counter time, new tokens)`` per
        output, events of the ``decode`` phase)."""
        t = out.times
        if t is None:
            return
        now = time.perf_counter()
        start = tracing.REQUEST_START.get() or arrival
        phases = tracing.contiguous(phase_bounds(self.role, start, arrival, t), now)
        role = str(self.role)
        block: dict[str, Any] = {
            "phases": {name: b - a for name, a, b in phases},
            "start_unix": tracing.epoch_ns(start) / 1e9,
        }
        m = self.metrics
        for name, a, b in phases:
            m.phase.labels(role, name).observe(b - a)
        first = t.transfer_posted if self.role is Role.PREFILL else t.first_token
        if first and t.queued:
            m.ttft_engine.labels(role).observe(max(first - t.queued, 0.0))
        if first_out and t.first_token:
            block["first_token_out"] = max(first_out - t.first_token, 0.0)
        if first_chunk:
            block["first_chunk_unix"] = tracing.epoch_ns(first_chunk) / 1e9
        attrs: dict[str, Any] = {
            "pdserve.role": role,
            "pdserve.engine_request_id": out.request_id,
            "pdserve.prompt_tokens": len(out.prompt_token_ids),
            "pdserve.output_tokens": len(out.outputs[0].token_ids),
            "pdserve.cached_tokens": out.num_cached_tokens,
            "pdserve.finish_reason": str(out.outputs[0].finish_reason),
        }
        if self.role is not Role.MIXED:
            nbytes = t.kv_pages * self.page_bytes
            block.update(kv_pages=t.kv_pages, kv_bytes=nbytes)
            attrs.update(
                {
                    "kv.pages": t.kv_pages,
                    "kv.bytes": nbytes,
                    "kv.backend": str(self.transfer_backend),
                }
            )
            if room is not None:
                attrs["pdserve.room"] = room
            if peer is not None:
                attrs["pdserve.peer"] = peer
            if t.peer_ready and t.queued:
                m.bootstrap.labels(role).observe(max(t.peer_ready - t.queued, 0.0))
            if t.transfer_finished and t.transfer_done:
                m.notice.labels(role).observe(max(t.transfer_done - t.transfer_finished, 0.0))
            end = t.transfer_finished or t.transfer_done
            if t.transfer_posted and end:
                seconds = max(end - t.transfer_posted, 1e-9)
                m.transfer.labels(role).observe(seconds)
                if self.role is Role.PREFILL and nbytes:
                    block["transfer_gbps"] = nbytes / seconds / 1e9
                    m.gbps.observe(block["transfer_gbps"])
        out.timing = {role: block}
        current = tracing.CURRENT_SPAN.get()
        if current is None:
            return
        if self.role is not Role.MIXED and self._ucx is not None:
            attrs["kv.ucx_transports"] = self.ucx_transports()
        events = {"decode": tokens[:MAX_TOKEN_EVENTS]} if tokens else None
        marks = {"first_token": first, "first_token_out": first_out}
        # the last phase (respond / stream_end) lasts until the response's last byte is sent
        tracing.add_phases(
            current, phases, attrs, error=out.error, events=events, marks=marks, open_last=True
        )
