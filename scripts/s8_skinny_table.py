"""Write ``pdserve/model/skinny_table.py`` from the H200 runs of ``scripts/gpu_s8_mm642.sh``
(``mm642.json``, or its printed ``SUMMARY_JSON`` line saved as JSON): the variant (a set of
the skinny GEMM's 64-row entries, ``gpu_s8_mm642.VARIANTS``) whose 64x200 decode step was the
fastest is kept where it beat both baseline measurements of the same process (``base``,
``base_again``) by at least ``--min-ms``; the swiglu entry's 128-row configuration only
where the 128x200 step with it (``swiglu_128``) beat ``base_128`` by as much.

``python3 scripts/s8_skinny_table.py docs/figures/h200_s8/mm642.json [--min-ms 0.02] [--write]``
prints the decision; ``--write`` rewrites the module (then ``ruff format`` it).

``--s9 bf16row.json`` (``scripts/gpu_s9_bf16row.sh``: the 64-row step with each entry
switched back one at a time, interleaved with the table as it is): the entries whose removal
made the step faster by at least ``--min-ms`` (the median of the paired span differences,
``skinny_ab``) are dropped, if the step with all of them dropped (``picks``) was faster than
the table's too (``picks.ab``) and bench offline's 64-prompt procedure run interleaved gave
it at least the table's tok/s (``picks.offline``); every other entry stays as it is.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_s8_mm642 import ENTRIES, VARIANTS

TABLE_PY = pathlib.Path(__file__).resolve().parents[1] / "pdserve/model/skinny_table.py"


def steps(run: dict) -> dict[str, dict[str, float]]:
    """variant -> {shape: step ms}, from mm642.json or its SUMMARY_JSON."""
    if "summary" in run:
        return {v: s["step"] for v, s in run["summary"].items()}
    return {
        v: {k: x["step_ms"] for k, x in d.items() if isinstance(x, dict) and "step_ms" in x}
        for v, d in run["variants"].items()
    }


def decide(run: dict, min_ms: float) -> tuple[dict, list[str]]:
    st = steps(run)
    base = [st[v]["64x200"] for v in ("base", "base_again") if "64x200" in st.get(v, {})]
    if not base:
        return {}, ["no baseline 64x200 step: nothing kept"]
    ref = max(base)  # the variant must beat both
    cands = {v: st[v]["64x200"] for v in VARIANTS if "64x200" in st.get(v, {})}
    notes = [f"base 64x200 {base}"] + [f"{v}: {s:.4f} ms" for v, s in cands.items()]
    if not cands:
        return {}, notes + ["no variant measured"]
    best = min(cands, key=lambda v: cands[v])
    if cands[best] > min(base) - min_ms:
        return {}, notes + [f"best {best} not {min_ms} ms under both baselines: nothing kept"]
    keep = {}
    for key in VARIANTS[best]:
        rows = tuple(r for r in ENTRIES[key] if r[0] <= 64)
        keep[key] = rows
    b128 = st.get("base_128", {}).get("128x200")
    s128 = st.get("swiglu_128", {}).get("128x200")
    swiglu = ("swiglu", "bfloat16", 28672, 4096)
    if swiglu in keep and b128 is not None and s128 is not None and s128 <= b128 - min_ms:
        # only the 128-row bucket (measured there), not the buckets between 64 and 128
        keep[swiglu] = keep[swiglu] + ((112, None), ENTRIES[swiglu][-1])
        notes.append(f"swiglu at 128 rows kept: 128x200 {s128:.4f} vs {b128:.4f} ms")
    else:
        notes.append(f"swiglu at 128 rows not kept: 128x200 {s128} vs {b128} ms")
    notes.append(f"kept: {best} ({ref - cands[best]:.4f} ms under the slower baseline)")
    return keep, notes


S9_KEYS = {
    "no_qkv": ("linear", "bfloat16", 6144, 4096),
    "no_o": ("linear", "bfloat16", 4096, 4096),
    "no_down": ("linear", "bfloat16", 4096, 14336),
}


def decide_s9(run: dict, table: dict, min_ms: float) -> tuple[dict, list[str]]:
    """``table`` less the entries ``--s9``'s rule drops (module doc), and why."""
    ab = (run.get("skinny_ab") or {}).get("variants") or {}
    drop = []
    notes = []
    for name, key in S9_KEYS.items():
        d = (ab.get(name) or {}).get("paired_diff_median_ms")
        notes.append(f"{name}: step {d} ms against the table's")
        if d is not None and d <= -min_ms and key in table:
            drop.append(key)
    picks = run.get("picks") or {}
    both = ((picks.get("ab") or {}).get("variants") or {}).get("picks") or {}
    d = both.get("paired_diff_median_ms")
    off = picks.get("offline") or {}
    tok = {n: (off.get(n) or {}).get("tok_s") for n in ("base", "picks")}
    chosen = sorted(tuple(k) for k in picks.get("skinny_keys") or [])
    notes.append(f"all dropped: step {d} ms; bench offline 64 tok/s {tok}")
    if not drop:
        return dict(table), notes + ["nothing dropped"]
    if chosen != sorted(k for k in table if k not in drop):
        return dict(table), notes + ["the run's picks are not this set: nothing dropped"]
    if d is None or d >= 0 or tok["picks"] is None or tok["base"] is None:
        return dict(table), notes + ["the set without them not measured faster: nothing dropped"]
    if tok["picks"] < tok["base"]:
        return dict(table), notes + ["bench offline slower without them: nothing dropped"]
    notes.append(f"dropped: {drop}")
    return {k: v for k, v in table.items() if k not in drop}, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--min-ms", type=float, default=0.02)
    ap.add_argument("--s9", action="store_true", help="the JSON is gpu_s9_bf16row's")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    run = json.loads(pathlib.Path(args.json).read_text())
    if args.s9:
        from pdserve.model import skinny_table

        keep, notes = decide_s9(run, skinny_table.TABLE, args.min_ms)
    else:
        keep, notes = decide(run, args.min_ms)
    print("\n".join(notes))
    print("table:", keep)
    if args.write:
        text = TABLE_PY.read_text()
        head = text[: text.index("TABLE: dict[")]
        body = (
            "TABLE: dict[\n    tuple[str, str, int, int],\n"
            "    tuple[tuple[int, tuple[int, int, int, int, int, int, int] | None], ...],\n] = "
            + repr(keep)
            + "\n"
        )
        TABLE_PY.write_text(head + body)
        print(f"wrote {TABLE_PY}")


if __name__ == "__main__":
    main()
