"""Write ``pdserve/model/decode_attn_table.py`` from ``scripts/gpu_s6_attn_sweep.py``'s JSON.

Rules (each pick is the measured one, kept only where it wins by the 3 % rule used for the
other measured tables):

- ``SHORT``: for each measured row count ``R`` (with candidates: ``R * Hkv >= 256``), the
  configuration with the least summed µs a layer over the contexts measured at ``R`` (up to
  ``ONE_SPLIT_MAX_CONTEXT``; a configuration must have run at all of them, with output
  within 0.02 of fp32 attention), if that sum is at most 0.97 of the ``current`` one's, else
  the current configuration; entry bound ``R * Hkv``, least the smallest measured.
- ``LONG_PREFETCH``: ``current+prefetch`` at most 0.97 of ``current`` at the many-row long
  case (32 x 4,096) and at most 1.03 of it at every other long case.
- ``GREEDY``: the Triton variant with the least summed µs over the row counts measured, if
  its ids equalled torch's everywhere and it is at most 0.97 of torch's path at every row
  count.

``python3 scripts/attn_table_from_sweep.py attn_sweep.json [--write]``: prints the picks
with their figures; ``--write`` rewrites the table module (its data only; run ``ruff
format`` on it after).

``--s9 bf16row.json`` (``scripts/gpu_s9_bf16row.sh``'s JSON: its sweep under ``"sweep"``, the
engine's A/B beside it): one ``SHORT`` entry, the 64-row bucket's (bound ``64 * Hkv``),
replaced by the sweep's pick when both hold: the sweep's rule took it (``pick`` not None:
at most 0.97 of the current configuration's summed µs over 64 x 130 / 200 / 256, at most
1.03 of it at 512 and 1,024, the error within 2 x the current one's + 1e-3) and the
engine's 64-row step with it, interleaved with the current one's, was faster (the median
of the paired span differences below 0). Every other entry, the long-context prefetch and
the greedy pick stay as the module has them.
"""

from __future__ import annotations

import ast
import collections
import json
import pathlib
import sys

TABLE = pathlib.Path(__file__).resolve().parent.parent / "pdserve/model/decode_attn_table.py"
ONE_SPLIT_MAX_CONTEXT = 1024
HKV, G, D = 8, 4, 128


def _cfg(row: dict) -> tuple:
    return (
        row["splits"],
        row["block_n"],
        row["num_warps"],
        row["num_stages"],
        row["min_split"],
        row["balance"],
        bool(row.get("prefetch", False)),
    )


def picks(report: dict) -> tuple[dict, list[str]]:
    """The table's data for the sweep's device and the lines saying why."""
    rows = [r for r in report["attention"] if "error" not in r and r["err"] < 0.02]
    why: list[str] = []
    by_r: dict[int, dict[str, dict[int, dict]]] = collections.defaultdict(
        lambda: collections.defaultdict(dict)
    )
    for r in rows:
        if r["context"] <= ONE_SPLIT_MAX_CONTEXT and r["rows"] * HKV >= 256:
            by_r[r["rows"]][r["config"]][r["context"]] = r
    entries = []
    for R in sorted(by_r):
        confs = by_r[R]
        ctxs = sorted(confs["current"]) if "current" in confs else []
        if not ctxs:
            continue
        full = {k: v for k, v in confs.items() if all(c in v for c in ctxs)}
        total = {k: sum(v[c]["us_per_layer"] for c in ctxs) for k, v in full.items()}
        best = min(total, key=total.get)
        cur = total["current"]
        keep = best if total[best] <= 0.97 * cur else "current"
        pick = full[keep][ctxs[0]]
        figs = ", ".join(
            f"{c}: {full[keep][c]['us_per_layer']:.2f} vs {full['current'][c]['us_per_layer']:.2f}"
            f" us ({full[keep][c]['fraction']:.2f} vs {full['current'][c]['fraction']:.2f})"
            for c in ctxs
        )
        why.append(f"{R} rows: {_cfg(pick)} ({keep}) against current; {figs}")
        entries.append((R * HKV, _cfg(pick)))
    short = (entries[0][0], tuple(entries)) if entries else None
    long = [r for r in rows if r["context"] > ONE_SPLIT_MAX_CONTEXT]
    lc = collections.defaultdict(dict)
    for r in long:
        lc[(r["rows"], r["context"])][r["config"]] = r["us_per_layer"]
    prefetch = bool(lc) and all("current+prefetch" in v and "current" in v for v in lc.values())
    for (R, C), v in sorted(lc.items()):
        if "current+prefetch" not in v or "current" not in v:
            continue
        ratio = v["current+prefetch"] / v["current"]
        why.append(f"long {R}x{C}: prefetch {v['current+prefetch']:.2f} vs {v['current']:.2f} us")
        limit = 0.97 if R * HKV >= 256 else 1.03
        prefetch = prefetch and ratio <= limit
    greedy = None
    gr = [g for g in report["greedy"] if "error" not in g]
    torch_us = {g["rows"]: g["us"] for g in gr if g["path"].startswith("torch")}
    var = collections.defaultdict(dict)
    for g in gr:
        if g["path"].startswith("triton") and g["same_ids"]:
            var[(g["target"], g["block_v"], g["num_warps"])][g["rows"]] = g["us"]
    ok = {k: v for k, v in var.items() if set(v) == set(torch_us)}
    if ok:
        best = min(ok, key=lambda k: sum(ok[k].values()))
        figs = ", ".join(
            f"{R}: {ok[best][R]:.1f} vs {torch_us[R]:.1f} us" for R in sorted(ok[best])
        )
        win = all(ok[best][R] <= 0.97 * torch_us[R] for R in torch_us)
        why.append(f"greedy {'triton' if win else 'torch kept'} {best}: {figs}")
        greedy = best if win else None
    return dict(short=short, long_prefetch=prefetch, greedy=greedy), why


def write(device: str, data: dict) -> None:
    """Rewrite the data part of the table module (after its docstring and imports; the
    hand-set ``FP32_LOGITS`` kept)."""
    text = TABLE.read_text()
    head = text[: text.index("SHORT: dict")]
    key = (device, G, D)
    short = {key: data["short"]} if data["short"] else {}
    long = f"frozenset({{{key!r}}})" if data["long_prefetch"] else "frozenset()"
    greedy = {device: data["greedy"]} if data["greedy"] else {}
    body = (
        f"SHORT: dict[tuple[str, int, int], tuple[int, tuple[tuple[int, _Config], ...]]] = {short!r}\n\n"
        f"LONG_PREFETCH: frozenset[tuple[str, int, int]] = {long}\n\n"
        f"GREEDY: dict[str, tuple[int, int, int]] = {greedy!r}\n"
    )
    keep = text.find("\nFP32_LOGITS")  # set by hand: kept as it is
    if keep >= 0:
        body += text[keep:]
    ast.parse(head + body)
    TABLE.write_text(head + body)


def s9_entry(report: dict, rows: int = 64) -> tuple[tuple[int, tuple] | None, list[str]]:
    """The ``(bound, config)`` entry ``--s9`` writes from ``report``, or None, and why."""
    sweep = report.get("sweep") or {}
    pick = sweep.get("pick") or {}
    why = [f"sweep: {pick.get('why')} -> pick {pick.get('pick')}"]
    ab = ((report.get("attn_ab") or {}).get("variants") or {}).get("attn") or {}
    diff = ab.get("paired_diff_median_ms")
    fields = pick.get("fields")
    same = fields is not None and list(fields) == list(report.get("attn_fields") or [])
    why.append(f"engine: {list(report.get('attn_fields') or [])} step {diff} ms vs current")
    if pick.get("pick") is None or diff is None or diff >= 0 or not same:
        return None, why
    assert fields is not None
    return (rows * HKV, (*fields, 0, 0, False)), why


def write_entry(device: str, entry: tuple[int, tuple]) -> None:
    """The table module with ``entry`` in place of the entry of its bound (the rest as it is)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_table", TABLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    key = (device, G, D)
    least, entries = mod.SHORT[key]
    bound, cfg = entry
    if bound not in {n for n, _ in entries}:
        raise ValueError(f"no entry of bound {bound} in {entries}")
    new = tuple((n, cfg if n == bound else c) for n, c in entries)
    data = dict(
        short=(least, new),
        long_prefetch=key in mod.LONG_PREFETCH,
        greedy=mod.GREEDY.get(device),
    )
    write(device, data)


def main() -> None:
    if sys.argv[1] == "--s9":
        report = json.loads(pathlib.Path(sys.argv[2]).read_text())
        entry, why = s9_entry(report)
        print("\n".join(why))
        print("entry:", entry)
        if entry is not None and "--write" in sys.argv:
            write_entry(report["device"], entry)
            print(f"wrote {TABLE}")
        return
    report = json.loads(pathlib.Path(sys.argv[1]).read_text())
    data, why = picks(report)
    print(
        f"device {report['device']}, copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s"
    )
    for line in why:
        print(line)
    print(data)
    if "--write" in sys.argv:
        write(report["device"], data)
        print(f"wrote {TABLE}")


if __name__ == "__main__":
    main()
