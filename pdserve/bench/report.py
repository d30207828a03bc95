"""Printing (``rich`` tables) and saving (JSON) the results of ``pdserve bench serve``.

Every ratio is **compare ÷ target** (latency ratio > 1: the compare URL is slower;
throughput ratio > 1: the compare URL is faster).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.bench.metrics import RunSummary, ratio
from pdserve.bench.openai_client import StreamResult
from pdserve.bench.runner import Series

# (row label, getter of a RunSummary, digits); latencies in ms.
_ROWS: tuple[tuple[str, Any, int], ...] = (
    ("completed", lambda s: s.completed, 0),
    ("failed", lambda s: s.failed, 0),
    ("duration (s)", lambda s: s.duration_s, 2),
    ("request throughput (req/s)", lambda s: s.request_throughput, 3),
    ("output throughput (tok/s)", lambda s: s.output_throughput, 1),
    (
        "mean input tokens",
        lambda s: s.total_input_tokens / s.completed if s.completed else math.nan,
        1,
    ),
    (
        "mean output tokens",
        lambda s: s.total_output_tokens / s.completed if s.completed else math.nan,
        1,
    ),
    ("cache hit rate", lambda s: s.cache_hit_rate, 3),
    ("KV bytes / request", lambda s: s.kv_bytes_per_request, 0),
    ("TTFT median (ms)", lambda s: s.ttft.median, 1),
    ("TTFT p90 (ms)", lambda s: s.ttft.p90, 1),
    ("TTFT p99 (ms)", lambda s: s.ttft.p99, 1),
    ("ITL median (ms)", lambda s: s.itl.median, 2),
    ("ITL p90 (ms)", lambda s: s.itl.p90, 2),
    ("ITL p99 (ms)", lambda s: s.itl.p99, 2),
    ("TPOT median (ms)", lambda s: s.tpot.median, 2),
    ("E2E median (ms)", lambda s: s.e2e.median, 1),
    ("E2E p90 (ms)", lambda s: s.e2e.p90, 1),
    ("E2E p99 (ms)", lambda s: s.e2e.p99, 1),
)


def _fmt(value: float, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if digits else f"{int(value)}"


def _load_title(s: Series) -> str:
    if math.isinf(s.request_rate):
        load = f"closed loop, concurrency {s.concurrency}"
    else:
        load = f"Poisson {s.request_rate:g} req/s" + (
            f", concurrency cap {s.concurrency}" if s.concurrency else ""
        )
    point = f" (load point {s.point + 1})" if s.point else ""
    return f"{s.stream} stream — {load}{point}"


def make_console() -> Console:
    """A console for tables: the terminal's width, or 140 columns when not a terminal
    (rich's 80 would squeeze the tables in logs and files)."""
    console = Console()
    return console if console.is_terminal else Console(width=140)


def series_table(group: Sequence[Series]) -> Table:
    """One table for the series of one (load point, stream): a column per target, and
    the compare ÷ target ratio when there are two."""
    table = Table(title=_load_title(group[0]))
    table.add_column("metric")
    for s in group:
        table.add_column(f"{s.target.name}\n{s.target.base_url}", justify="right")
    if len(group) == 2:
        table.add_column("compare ÷ target", justify="right")
    summaries = [s.summary() for s in group]
    for label, get, digits in _ROWS:
        values = [get(x) for x in summaries]
        cells = [_fmt(v, digits) for v in values]
        if len(group) == 2:
            cells.append(_fmt(ratio(float(values[1]), float(values[0])), 3))
        table.add_row(label, *cells)
    return table


def print_report(series: Sequence[Series], console: Console | None = None) -> None:
    """Print a table per (load point, stream), the first errors of each target, and a
    throughput-vs-rate table when several rates were run."""
    console = console or make_console()
    streams = list(dict.fromkeys(s.stream for s in series))
    key = lambda s: (s.point, streams.index(s.stream))  # noqa: E731
    for _, group in groupby(sorted(series, key=key), key=key):
        rows = list(group)
        console.print(series_table(rows))
        for s in rows:
            for err in s.summary().errors:
                console.print(
                    f"[red]{s.target.name} error:[/red] {err}", markup=True, highlight=False
                )
    points = sorted({(s.request_rate, s.point) for s in series if s.stream == "main"})
    if len(points) > 1:
        table = Table(title="throughput vs request rate")
        table.add_column("rate (req/s)", justify="right")
        names = list(dict.fromkeys(s.target.name for s in series))
        for name in names:
            table.add_column(f"{name} req/s", justify="right")
            table.add_column(f"{name} tok/s", justify="right")
        repeated = len({rate for rate, _ in points}) < len(points)
        for rate, point in points:
            row = [f"{rate:g}" + (f" (load point {point + 1})" if repeated else "")]
            for name in names:
                s = next(
                    x
                    for x in series
                    if x.target.name == name and x.request_rate == rate and x.point == point
                )
                summ = s.summary()
                row += [_fmt(summ.request_throughput, 3), _fmt(summ.output_throughput, 1)]
            table.add_row(*row)
        console.print(table)


def interference_headline(series: Sequence[Series]) -> dict[str, Any]:
    """Decode ITL p99 (ms) per target and the compare ÷ target ratio (``nan`` without compare)."""
    p99 = {s.target.name: s.summary().itl.p99 for s in series if s.stream == "decode"}
    out: dict[str, Any] = {"decode_itl_p99_ms": p99}
    names = list(p99)
    out["ratio_compare_over_target"] = (
        ratio(p99[names[1]], p99[names[0]]) if len(names) == 2 else math.nan
    )
    return out


def _result_record(i: int, r: StreamResult) -> dict[str, Any]:
    return {
        "index": i,
        "ok": r.ok,
        "error": r.error,
        "ttft_ms": None if r.ttft is None else r.ttft * 1000.0,
        "latency_ms": r.latency * 1000.0,
        "itl_ms": [round(x * 1000.0, 4) for x in r.itl],
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "finish_reason": r.finish_reason,
        "timing": r.timing,
        "start_unix": r.start_unix,
        "first_event_ms": None if r.first_event is None else r.first_event * 1000.0,
    }


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (nan, inf) replaced by ``None`` (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def series_record(s: Series) -> dict[str, Any]:
    """JSON-ready record of one series: load point, summary, and every request."""
    summary: RunSummary = s.summary()
    return {
        "target": s.target.name,
        "url": s.target.base_url,
        "model": s.target.model,
        "stream": s.stream,
        "request_rate": s.request_rate,  # null in JSON = closed loop
        "load_point": s.point,
        "concurrency": s.concurrency,
        "summary": summary.to_dict(),
        "requests": [_result_record(i, r) for i, r in enumerate(s.results)],
    }


def write_json(path: str, header: dict[str, Any], series: Sequence[Series]) -> None:
    """Write ``header`` (spec, targets, command) plus every series to ``path``."""
    doc = {
        **header,
        "ratio_definition": "compare / target",
        "series": [series_record(s) for s in series],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(doc), f, indent=1)
