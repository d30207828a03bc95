"""The GPU's clocks, power and clock-slowdown reasons over one part of a device call.

Why: a compute-bound run (a prefill chunk, a 256-row decode step) takes longer when the card
lowers its SM clock under its power cap or heat, while a memory-bound one barely moves; runs
of the same command have differed by ~8 % (docs/benchmarks.md, S8-CONFIRM's 256 prompts) and
by ~13 % in the first token of 64 prompts, with nothing in pdserve to explain it. This
records what the card did while a part ran, so a slow run can be told from a slow card.

    nvidia-smi -i 0 --query-gpu=$(python3 scripts/gpu_clocks.py query) --format=csv,nounits \
        -lms 250 > CSV &                          # the readings, every 250 ms, until killed
    python3 scripts/gpu_clocks.py summary CSV     # one line, then "clk" lines of 10-s windows

``gpu_call.sh`` samples beside every part and appends the summary to its output.
The fields are nvidia-smi's ``--query-gpu`` names (``nvidia-smi --help-query-gpu``); the
slowdown reasons are its ``clocks_event_reasons.active`` bit mask (``clocks_throttle_reasons``
on older drivers), bits as NVML's ``nvmlClocksEventReason*`` constants.
"""

from __future__ import annotations

import csv
import statistics
import subprocess
import sys
from datetime import datetime

FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu"
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
# NVML clocks-event reason bits (nvml.h, nvmlClocksEventReason*)
REASONS = {
    0x1: "idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
WINDOW_S = 10.0


def query() -> str:
    """The --query-gpu list this driver accepts: FIELDS + the first reason field it knows."""
    for reason in REASON_FIELDS:
        probe = subprocess.run(
            ["nvidia-smi", f"--query-gpu={reason}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            return f"{FIELDS},{reason}"
    return FIELDS


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _reasons(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


def parse(lines: list[str]) -> list[dict]:
    """The readings of a ``sample`` CSV: dicts with ``t`` (seconds from the first reading),
    ``sm`` / ``mem`` (MHz), ``power`` (W), ``temp`` (°C), ``util`` (%), ``reasons`` (names);
    unparsable rows (a header repeated, a cut last line) are skipped."""
    rows = []
    start = None
    for rec in csv.reader(lines):
        if len(rec) < 6:
            continue
        try:
            when = datetime.strptime(rec[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
        except ValueError:
            continue
        start = start or when
        mask = rec[6].strip() if len(rec) > 6 else ""
        rows.append(
            {
                "t": (when - start).total_seconds(),
                "sm": _number(rec[1]),
                "mem": _number(rec[2]),
                "power": _number(rec[3]),
                "temp": _number(rec[4]),
                "util": _number(rec[5]),
                "reasons": _reasons(int(mask, 16)) if mask.startswith("0x") else [],
            }
        )
    return rows


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    ranked = sorted(values)
    p10 = ranked[len(ranked) // 10]
    return f"{ranked[0]:.0f}/{p10:.0f}/{statistics.median(ranked):.0f}/{ranked[-1]:.0f}"


def summary(rows: list[dict]) -> list[str]:
    """One line over every reading (SM clock min/p10/median/max MHz, power median/max W, the
    hottest °C, the share of readings under each slowdown reason), then ``clk`` lines of
    WINDOW_S-second windows (median SM clock, power, utilization, the reasons seen) for the
    readings where the GPU was busy (utilization > 0)."""
    if not rows:
        return ["clocks: no readings"]
    busy = [r for r in rows if (r["util"] or 0) > 0]
    counts: dict[str, int] = {}
    for r in busy:
        for name in r["reasons"]:
            counts[name] = counts.get(name, 0) + 1
    shares = (
        ", ".join(f"{k} {100 * v / len(busy):.0f}%" for k, v in sorted(counts.items()))
        if busy
        else ""
    )
    powers = [r["power"] for r in rows if r["power"] is not None]
    temps = [r["temp"] for r in rows if r["temp"] is not None]
    head = (
        f"clocks: {len(rows)} readings over {rows[-1]['t']:.0f} s, {len(busy)} busy; busy SM MHz "
        f"min/p10/median/max {_spread([r['sm'] for r in busy if r['sm'] is not None])}; power W median/max "
        f"{statistics.median(powers) if powers else 0:.0f}/{max(powers, default=0):.0f}; "
        f"temp max {max(temps, default=0):.0f} C; slowdown (share of busy readings): {shares or 'none'}"
    )
    out = [head]
    window: list[dict] = []
    edge = WINDOW_S
    for r in busy + [{"t": float("inf")}]:
        if r["t"] >= edge and window:
            reasons = sorted({n for w in window for n in w["reasons"]})
            out.append(
                f"clk {edge - WINDOW_S:4.0f}-{edge:4.0f} s: SM {statistics.median(w['sm'] or 0 for w in window):.0f} MHz, "
                f"{statistics.median(w['power'] or 0 for w in window):.0f} W, "
                f"util {statistics.median(w['util'] or 0 for w in window):.0f}%, {','.join(reasons) or '-'}"
            )
            window = []
        while r["t"] >= edge and r["t"] != float("inf"):
            edge += WINDOW_S
        window.append(r)
    return out


def main(argv: list[str]) -> int:
    if argv == ["query"]:
        print(query())
        return 0
    if len(argv) != 2 or argv[0] != "summary":
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with open(argv[1]) as f:
            lines = f.readlines()
    except OSError as exc:
        lines = []
        print(f"clocks: no readings ({exc})")
    print("\n".join(summary(parse(lines))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
