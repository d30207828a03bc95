"""PNG plots of ``pdserve bench serve``: latency CDFs, and throughput vs request rate.

Uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from pdserve.bench.runner import Series

_METRICS = (
    ("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
    ("ITL", lambda r: r.itl),
    ("end-to-end latency", lambda r: [r.latency]),
)


def _ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray(values, dtype=np.float64))
    return x, np.arange(1, len(x) + 1) / len(x)


def plot_series(series: Sequence[Series], path: str) -> None:
    """Write a PNG to ``path``: one CDF panel per latency (TTFT, ITL, end-to-end; ms, log
    x-axis), a line per series, and a throughput-vs-rate panel when the main stream ran
    at several request rates. Raises ``OSError`` if ``path`` cannot be written."""
    rates = sorted(
        {s.request_rate for s in series if s.stream == "main" and not math.isinf(s.request_rate)}
    )
    panels = len(_METRICS) + (1 if len(rates) > 1 else 0)
    fig = Figure(figsize=(5.0 * panels, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax, (name, get) in zip(axes, _METRICS):
        for s in series:
            values = [v * 1000.0 for r in s.results if r.ok for v in get(r)]
            if values:
                x, y = _ecdf(values)
                ax.step(x, y, where="post", label=s.label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        if ax.has_data():
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.legend(fontsize="small")
        ax.grid(True, alpha=0.3)
    if len(rates) > 1:
        ax = axes[-1]
        for name in dict.fromkeys(s.target.name for s in series):
            pts = sorted(
                (s.request_rate, s.summary().output_throughput)
                for s in series
                if s.target.name == name and s.stream == "main"
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title("output throughput vs request rate")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("output tokens/s")
        ax.legend(fontsize="small")
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=110)
