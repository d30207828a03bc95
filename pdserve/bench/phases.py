"""``pdserve bench serve --phase-timing``: where the first token's time went, by phase.

Each request's timing block (pdserve's ``return_timing``: role -> ``{"phases": {name:
seconds}}``, ``server/phases.py``) is cut into TTFT stages with one vocabulary for a PD
router and a mixed worker, so the two can stand side by side:

- ``tokenize``, ``engine_inbox``, ``queue``, ``prefill``: the worker that computed the
  prompt (prefill, or the mixed worker);
- ``bootstrap``, ``kv_transfer``: PD only, prefill's (waiting for decode's destination;
  posting the last pages until the room's Success);
- ``kv_notice``: PD only, decode's notification lag (the notification arrived → its
  engine joined the request);
- ``decode_wait``: PD only, decode's time until the notification arrived beyond prefill's
  path (decode's tokenize + inbox + bootstrap + page wait + notification wait, minus
  prefill's path until its notification went out; both legs leave the router together):
  the notification's flight, negative when decode started later than prefill;
- ``first_token_out``: the worker that streams (decode, or mixed): from its engine
  appending the first token to its event loop holding it (the engine thread's hand-off);
- ``to_worker``: the request's way from the client to the streaming worker's app (the
  router, its pick, the HTTP hop; the worker's ``start_unix`` minus the client's send
  time: the clocks of the client's and the worker's hosts must agree, as on one host);
- ``stream_back``: the rest of the client's TTFT (the worker's SSE chunk, the router's
  relay, the way back); ``router_and_stream`` instead of the last two when the blocks
  carry no ``start_unix``.

``stream_back``'s parts (:func:`stream_back_parts`; reported beside it, not added to the
stages' sum) where the blocks carry their times: ``sse_write`` (the streaming worker's
event loop holding the first token → its first SSE chunk handed to its server:
``first_chunk_unix``), ``relay_in`` (→ the router's relay took that chunk: the HTTP hop),
``relay`` (→ the relay rendered it for the client: ``relay``'s times, router/relay.py),
``to_client`` (→ the client had it; from the worker's chunk when no router relayed it),
``text_wait`` (→ the first chunk with text, when the client's first event had none: the
worker stamps its first chunk, the client's TTFT counts the first text).

Times in ms in the tables and the PNG; seconds in the JSON's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from pdserve.bench.metrics import percentile
from pdserve.bench.openai_client import StreamResult

STAGES = (
    "tokenize",
    "engine_inbox",
    "bootstrap",
    "queue",
    "prefill",
    "kv_transfer",
    "decode_wait",
    "kv_notice",
    "first_token_out",
    "to_worker",
    "stream_back",
    "sse_write",
    "relay_in",
    "relay",
    "to_client",
    "text_wait",
    "router_and_stream",
)
_PREFILL_PATH = ("tokenize", "engine_inbox", "bootstrap", "queue", "prefill", "kv_transfer")
_DECODE_PATH = ("tokenize", "engine_inbox", "bootstrap", "kv_alloc_wait", "kv_transfer")
_MIXED_PATH = ("tokenize", "engine_inbox", "queue", "prefill")


def ttft_stages(r: StreamResult) -> dict[str, float] | None:
    """The TTFT stages of one request in seconds (module docstring), or None when it has
    no TTFT or no timing block of the roles it needs."""
    timing = r.timing or {}
    if r.ttft is None:
        return None

    def phases(role: str) -> dict[str, float] | None:
        block = timing.get(role)
        got = block.get("phases") if isinstance(block, dict) else None
        return got if isinstance(got, dict) else None

    mixed, prefill, decode = phases("mixed"), phases("prefill"), phases("decode")
    if mixed is not None:
        out = {name: float(mixed.get(name, 0.0)) for name in _MIXED_PATH}
    elif prefill is not None and decode is not None:
        out = {name: float(prefill.get(name, 0.0)) for name in _PREFILL_PATH}
        decode_path = sum(float(decode.get(name, 0.0)) for name in _DECODE_PATH)
        out["decode_wait"] = decode_path - sum(out.values())
        out["kv_notice"] = float(decode.get("kv_notice", 0.0))
    else:
        return None
    streamer = timing.get("mixed" if mixed is not None else "decode") or {}
    out["first_token_out"] = float(streamer.get("first_token_out", 0.0))
    if streamer.get("start_unix") and r.start_unix:
        out["to_worker"] = float(streamer["start_unix"]) - r.start_unix
        out["stream_back"] = r.ttft - sum(out.values())
    else:
        out["router_and_stream"] = r.ttft - sum(out.values())
    return out


def stream_back_parts(r: StreamResult) -> dict[str, float]:
    """``stream_back``'s parts of one request in seconds (module docstring): empty when
    its blocks lack the times (a worker or router of an older version, no stream)."""
    stages = ttft_stages(r)
    if not stages or "stream_back" not in stages or r.ttft is None:
        return {}
    timing = r.timing or {}
    streamer = timing.get("mixed") or timing.get("decode") or {}
    chunk = streamer.get("first_chunk_unix") if isinstance(streamer, dict) else None
    if not chunk:
        return {}
    first = r.ttft if r.first_event is None else min(r.first_event, r.ttft)
    client = r.start_unix + first  # the client's first chunk (its first event)
    held = r.start_unix + r.ttft - stages["stream_back"]  # the worker's loop held the first token
    out = {"sse_write": float(chunk) - held}
    relay = timing.get("relay") or {}
    t_in, t_out = relay.get("first_chunk_in_unix"), relay.get("first_chunk_out_unix")
    if t_in and t_out:
        out.update(
            relay_in=float(t_in) - float(chunk),
            relay=float(t_out) - float(t_in),
            to_client=client - float(t_out),
        )
    else:
        out["to_client"] = client - float(chunk)
    out["text_wait"] = r.ttft - first
    return out


def stage_stats(results: Sequence[StreamResult]) -> dict[str, dict[str, float]]:
    """Per stage, over the successful requests with a timing block: ``median_ms``,
    ``p99_ms`` and ``count``; empty when none had one."""
    rows = [
        {**s, **stream_back_parts(r)} for r in results if r.ok and (s := ttft_stages(r)) is not None
    ]
    out: dict[str, dict[str, float]] = {}
    for stage in STAGES:
        values = [row[stage] * 1000.0 for row in rows if stage in row]
        if values:
            out[stage] = {
                "median_ms": percentile(values, 50),
                "p99_ms": percentile(values, 99),
                "count": float(len(values)),
            }
    return out


def grew_most(
    target: dict[str, dict[str, float]], compare: dict[str, dict[str, float]]
) -> tuple[str, float] | None:
    """The stage whose median grew most from ``compare`` to ``target`` (a stage one of
    them lacks counts as 0 ms there) and by how many ms; None without stages."""
    stages = [s for s in STAGES if s in target or s in compare]
    if not stages:
        return None

    def median(stats: dict[str, dict[str, float]], stage: str) -> float:
        return stats.get(stage, {}).get("median_ms", 0.0)

    best = max(stages, key=lambda s: median(target, s) - median(compare, s))
    return best, median(target, best) - median(compare, best)


def stage_table(title: str, named: Sequence[tuple[str, dict[str, dict[str, float]]]]) -> Table:
    """A table of the stages' median / p99 (ms), a column per ``(name, stats)``."""
    table = Table(title=title)
    table.add_column("TTFT stage")
    for name, _ in named:
        table.add_column(f"{name}\nmedian / p99 ms", justify="right")
    for stage in STAGES:
        if not any(stage in stats for _, stats in named):
            continue
        cells = []
        for _, stats in named:
            got = stats.get(stage)
            cells.append("-" if got is None else f"{got['median_ms']:.2f} / {got['p99_ms']:.2f}")
        table.add_row(stage, *cells)
    return table


def plot_stages(named: Sequence[tuple[str, dict[str, dict[str, float]]]], path: str) -> None:
    """Write a PNG to ``path``: two panels (median, p99) of grouped bars, a bar per
    ``(name, stats)`` (e.g. PD and mixed) for each TTFT stage, in ms. Raises ``OSError``
    if ``path`` cannot be written."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stages = [s for s in STAGES if any(s in stats for _, stats in named)]
    fig = Figure(figsize=(12.0, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, squeeze=False)[0]
    x = np.arange(len(stages))
    width = 0.8 / max(len(named), 1)
    for ax, key, title in zip(axes, ("median_ms", "p99_ms"), ("median", "p99")):
        for i, (name, stats) in enumerate(named):
            values = [stats.get(s, {}).get(key, math.nan) for s in stages]
            ax.bar(x + (i - (len(named) - 1) / 2) * width, values, width, label=name)
        ax.set_xticks(x, stages, rotation=30, ha="right")
        ax.set_ylabel("ms")
        ax.set_title(f"where the first token's time went: {title}")
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def phase_png_path(json_path: str) -> str:
    """The PNG beside ``--json``: ``run.json`` -> ``run.phases.png``."""
    stem = json_path[: -len(".json")] if json_path.endswith(".json") else json_path
    return f"{stem}.phases.png"


def decode_only_count(results: Sequence[StreamResult]) -> int:
    """Answers the router sent whole to a decode worker (selective PD's ``decode_only``: a
    short or cached prompt, no prefill leg): their timing has no PD stages to split."""
    return sum(
        1
        for r in results
        if r.ok and ((r.timing or {}).get("router") or {}).get("pd_decision") == "decode_only"
    )


def report_stages(series: Sequence[Any]) -> list[dict[str, Any]]:
    """Per (load point, stream) of ``series`` (``runner.Series``; a repeated rate is a load
    point of its own, ``load_point`` its index): the stats of each target's stages and, with two targets, the stage that grew most (target vs compare).
    JSON-ready."""
    out: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((s.point, s.request_rate, s.stream) for s in series))
    for point, rate, stream in keys:
        group = [s for s in series if (s.point, s.request_rate, s.stream) == (point, rate, stream)]
        stats = [(s.target.name, stage_stats(s.results)) for s in group]
        entry: dict[str, Any] = {
            "request_rate": rate,
            "load_point": point,
            "stream": stream,
            "stages": dict(stats),
            "decode_only": {s.target.name: decode_only_count(s.results) for s in group},
            "label": group[0].label.split(" ", 1)[1],
        }
        if len(stats) == 2:
            grown = grew_most(stats[0][1], stats[1][1])
            entry["grew_most"] = (
                None if grown is None else {"stage": grown[0], "delta_median_ms": grown[1]}
            )
        out.append(entry)
    return out
