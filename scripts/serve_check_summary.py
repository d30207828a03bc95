#!/usr/bin/env python3
"""Issue 24's serve check, judged from ``pdserve bench serve --phase-timing`` JSON (PD as
``--url``, the mixed worker as ``--compare``; every load point a run):

- PD's median TTFT ≤ mixed's + 5 ms, in every run;
- no stall: TTFT p99 ≤ 2 × the median, on both sides, in every run.

Prints a line per run (medians, p99, p99 ÷ median, the stages' to_client and prefill
medians) and the verdict; writes the same as JSON with ``--json``. Beside the TTFT (the
client's first chunk with text) it judges the time to the **first event** (the first
token's chunk, text or not; ``first_event_ms`` of each request, when recorded): with the
``random:`` presets, whose vocabulary is larger than the shared SmolLM2 tokenizer's 49,152
ids, ~62 % of the sampled ids decode to no text (``pdserve/model/presets.py``), so a
request's first text can come several decode steps after its first token. Usage:

    python3 scripts/serve_check_summary.py serve.json [more.json ...] [--json summary.json]
"""

from __future__ import annotations

import argparse
import json
import sys


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values``, linearly interpolated (numpy's default)."""
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def judge(doc: dict) -> list[dict]:
    """One row per load point of a bench serve JSON."""
    rows = []
    stages = {e.get("load_point", i): e for i, e in enumerate(doc.get("ttft_stages") or [])}
    points: dict[int, dict[str, dict]] = {}
    for i, s in enumerate(doc["series"]):
        if s["stream"] != "main":
            continue
        point = s.get("load_point", i // 2)
        points.setdefault(point, {})[s["target"]] = s
    stream_client = (doc.get("arguments") or {}).get("stream_client", "httpx (old bench)")
    for point, by in sorted(points.items()):
        pd, mixed = by.get("target"), by.get("compare")
        if pd is None or mixed is None:
            continue
        row: dict = {
            "load_point": point,
            "rate": pd["request_rate"],
            "stream_client": stream_client,
        }
        for name, s in (("pd", pd), ("mixed", mixed)):
            summ = s["summary"]
            ttft = summ["ttft"]
            row[f"{name}_completed"] = summ["completed"]
            row[f"{name}_ttft_median_ms"] = ttft["median"]
            row[f"{name}_ttft_p99_ms"] = ttft["p99"]
            row[f"{name}_p99_over_median"] = (
                ttft["p99"] / ttft["median"] if ttft["median"] else None
            )
            row[f"{name}_itl_median_ms"] = summ["itl"]["median"]
            st = (
                (stages.get(point) or {})
                .get("stages", {})
                .get("target" if name == "pd" else "compare", {})
            )
            for stage in ("to_client", "text_wait", "prefill", "stream_back", "to_worker"):
                if stage in st:
                    row[f"{name}_{stage}_median_ms"] = st[stage]["median_ms"]
        for name, s in (("pd", pd), ("mixed", mixed)):
            first = sorted(
                r["first_event_ms"]
                for r in s.get("requests") or []
                if r.get("ok") and r.get("first_event_ms") is not None
            )
            if first:
                med = _quantile(first, 0.5)
                row[f"{name}_first_event_median_ms"] = med
                row[f"{name}_first_event_p99_over_median"] = _quantile(first, 0.99) / med
        if "pd_first_event_median_ms" in row and "mixed_first_event_median_ms" in row:
            row["first_event_gap_ms"] = (
                row["pd_first_event_median_ms"] - row["mixed_first_event_median_ms"]
            )
        row["median_gap_ms"] = row["pd_ttft_median_ms"] - row["mixed_ttft_median_ms"]
        row["median_ok"] = row["median_gap_ms"] <= 5.0
        row["no_stall_ok"] = all(
            row[f"{n}_p99_over_median"] is not None and row[f"{n}_p99_over_median"] <= 2.0
            for n in ("pd", "mixed")
        )
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+")
    p.add_argument("--json")
    args = p.parse_args()
    out = {}
    for path in args.files:
        with open(path) as f:
            doc = json.load(f)
        rows = judge(doc)
        gc = doc.get("client_gc") or {}
        proc = doc.get("client_process") or {}
        out[path] = {
            "runs": rows,
            "client_gc_max_pause_ms": 1e3 * gc.get("max_pause_seconds", 0.0),
            "client_process": proc,
        }
        print(
            f"== {path} (stream client {rows[0]['stream_client'] if rows else '?'}; client gc "
            f"max pause {out[path]['client_gc_max_pause_ms']:.1f} ms; client CPU "
            f"{proc.get('cpu_seconds', float('nan')):.2f} s, involuntary context switches "
            f"{proc.get('involuntary_context_switches', '?')}, load {proc.get('load_average_1m', '?')})"
        )
        for r in rows:

            def g(key: str, r: dict = r) -> str:
                v = r.get(key)
                return "-" if v is None else f"{v:.2f}"

            print(
                f"run {r['load_point'] + 1} @{r['rate']:g} req/s: TTFT median PD {g('pd_ttft_median_ms')} / "
                f"mixed {g('mixed_ttft_median_ms')} ms (gap {g('median_gap_ms')}, "
                f"{'OK' if r['median_ok'] else 'NOT MET'} ≤ 5); p99 PD {g('pd_ttft_p99_ms')} "
                f"({g('pd_p99_over_median')}×) / mixed {g('mixed_ttft_p99_ms')} "
                f"({g('mixed_p99_over_median')}×) {'OK' if r['no_stall_ok'] else 'NOT MET'} ≤ 2×; "
                f"to_client PD {g('pd_to_client_median_ms')} / mixed {g('mixed_to_client_median_ms')}; "
                f"text_wait PD {g('pd_text_wait_median_ms')} / mixed {g('mixed_text_wait_median_ms')}; "
                f"prefill PD {g('pd_prefill_median_ms')} / mixed {g('mixed_prefill_median_ms')}; "
                f"ITL median {g('pd_itl_median_ms')} / {g('mixed_itl_median_ms')}; "
                f"done {r['pd_completed']}/{r['mixed_completed']}"
            )
            if "first_event_gap_ms" in r:
                print(
                    f"      first event (first token, text or not): median PD "
                    f"{g('pd_first_event_median_ms')} / mixed {g('mixed_first_event_median_ms')} ms "
                    f"(gap {g('first_event_gap_ms')}, "
                    f"{'OK' if r['first_event_gap_ms'] <= 5.0 else 'NOT MET'} ≤ 5); p99 ÷ median "
                    f"PD {g('pd_first_event_p99_over_median')} / mixed "
                    f"{g('mixed_first_event_p99_over_median')}"
                )
        if rows:
            met = all(r["median_ok"] and r["no_stall_ok"] for r in rows)
            out[path]["target_met"] = met
            print(f"serve check target ({len(rows)} runs): {'MET' if met else 'NOT MET'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
