"""Write ``pdserve/model/skinny_table.py`` from an H200 run of ``scripts/gpu_s8_mm64.sh``
(its ``mm64.json``): an entry of the run's skinny table is kept where the engine's 64x200
decode step with that entry alone (``one_shape_profile``) was faster than both baseline
profiles of the same process (``base_profile``, ``base_again_profile``) by at least
``--min-ms``; entries at 128 / 256 rows only where the run's all-entries profile at 256x200
beat both baselines as well (none of them is measured alone).

``python3 scripts/s8_skinny_table.py docs/figures/h200_s8/mm64.json [--min-ms 0.01] [--write]``
prints the decision per entry; ``--write`` rewrites the module (then ``ruff format`` it).
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib

TABLE_PY = pathlib.Path(__file__).resolve().parents[1] / "pdserve/model/skinny_table.py"


def decide(run: dict, min_ms: float) -> tuple[dict, list[str]]:
    base = [run.get(k, {}).get("64x200", {}).get("step_ms") for k in ("base_profile", "base_again_profile")]
    base = [b for b in base if b is not None]
    notes: list[str] = []
    keep: dict = {}
    if not base:
        return keep, ["no baseline 64x200 step: nothing kept"]
    ref = min(base)
    one = run.get("one_shape_profile", {})
    for key_s, entries in run.get("skinny_table", {}).items():
        key = ast.literal_eval(key_s)
        step = (one.get(key_s) or {}).get("64x200", {}).get("step_ms")
        if step is None:
            notes.append(f"{key}: not measured alone: dropped")
            continue
        won = step <= ref - min_ms
        notes.append(f"{key}: 64x200 {step:.3f} ms alone vs baseline {ref:.3f} ({'kept' if won else 'dropped'})")
        if won:
            rows = [(m, tuple(c) if c else None) for m, c in entries if m <= 64]
            keep[key] = tuple(rows)
    big = [run.get(k, {}).get("256x200", {}).get("step_ms") for k in ("base_profile", "base_again_profile")]
    sk = run.get("skinny_profile", {}).get("256x200", {}).get("step_ms")
    big_won = sk is not None and all(b is not None and sk <= b - min_ms for b in big)
    for key_s, entries in run.get("skinny_table", {}).items():
        key = ast.literal_eval(key_s)
        more = [(m, tuple(c) if c else None) for m, c in entries if m > 64]
        if more and big_won and key in keep:
            keep[key] = keep[key] + tuple(more)
        elif more:
            notes.append(f"{key}: rows > 64 dropped (256x200 all entries {sk} vs baselines {big})")
    return keep, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--min-ms", type=float, default=0.01)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    run = json.loads(pathlib.Path(args.json).read_text())
    keep, notes = decide(run, args.min_ms)
    print("\n".join(notes))
    print("table:", keep)
    if args.write:
        text = TABLE_PY.read_text()
        head = text[: text.index("TABLE: dict[")]
        head = head.replace(
            "Empty until an H200 measurement supports an entry",
            "Entries kept on an H200 measurement",
        )
        body = (
            "TABLE: dict[\n    tuple[str, str, int, int], tuple[tuple[int, tuple[int, int, int, int, int, int, int] | None], ...]\n] = "
            + repr(keep)
            + "\n"
        )
        TABLE_PY.write_text(head + body)
        print(f"wrote {TABLE_PY}")


if __name__ == "__main__":
    main()
