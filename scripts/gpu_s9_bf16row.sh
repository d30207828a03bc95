#!/usr/bin/env bash
# Issue 24, session 9, part bf16row of one H200 call (budget 150 s, one engine load): bf16
# random:llama-3.1-8b at 64 prompts (target >= 10,000 tok/s).
#   1. in the background from the start (niced: the engine draws its random weights on the
#      CPU): scripts/gpu_s9_bf16row.py sweep, no model: the decode attention of one step
#      (32 layers, one CUDA graph, page-major pool) at 64 x 130 / 200 / 256 / 512 / 1,024 and
#      48 x 200 for 8 configurations, interleaved rounds -> attn_sweep.json + the pick
#   2. scripts/gpu_s9_bf16row.py engine, one engine (waits for 1 before timing anything):
#      the 64-row step with the sweep's fastest attention configuration vs today's, and with
#      each skinny entry (qkv / o / down) switched back one at a time, interleaved span by
#      span; bench offline's 64-prompt run per variant (greedy outputs compared); the first
#      token of the 64 prompts x 3 with every step's time, and one profiled; the picks vs
#      today interleaved (bench offline's procedure, 3 repeats); two 256-prompt runs with
#      every step's time; the 64x200 step profile -> bf16row.json
# One file is left under $OUT: bf16row.json (the sweep inside it, key "sweep"). Run as:
#   OUT=$OUT/gpu_s9 PREFIX=s9_ bash scripts/gpu_call.sh bf16row:150
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s9_bf16row}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-150}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
rm -f "$OUT/attn_sweep.done" "$OUT/attn_sweep.json" "$OUT/bf16row.json"
echo "== 1. the attention sweep, in the background ($SECONDS s)"
(
    timeout -k 3 ${T_SWEEP:-80} nice -n 5 $PY scripts/gpu_s9_bf16row.py sweep --device "$DEVICE" \
        --build-deadline-s ${BUILD_S:-48} --deadline-s ${SWEEP_S:-66} --done "$OUT/attn_sweep.done" \
        ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
    echo "sweep exit $? (124: cut by its timeout)" >> "$OUT/sweep.log"
    touch "$OUT/attn_sweep.done"
) &
sweep_pid=$!
left=$((BUDGET - 12 - SECONDS))
echo "== 2. the engine ($SECONDS s; $left s for it)"
timeout -k 4 "$left" $PY scripts/gpu_s9_bf16row.py engine --model "$MODEL" --device "$DEVICE" \
    --deadline-s $((left - 7)) --sweep-json "$OUT/attn_sweep.json" --done "$OUT/attn_sweep.done" \
    ${ENGINE_ARGS:-} 2>&1 | grep --line-buffered -v "^USDT\|profiler_st\|_warn_once\|UserWarning"
echo "engine exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
kill "$sweep_pid" 2>/dev/null
wait "$sweep_pid" 2>/dev/null
echo "== the sweep's log"
grep -v "^USDT" "$OUT/sweep.log" | tail -16
echo "== merge and summary ($SECONDS s)"
timeout 6 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
r = load("bf16row.json") or {"errors": {"engine": "no bf16row.json"}}
r["sweep"] = load("attn_sweep.json")
(out / "bf16row.json").write_text(json.dumps(r, indent=1))
sw = r["sweep"] or {}
for key, s in (sw.get("shapes") or {}).items():
    v = s["variants"]
    top = sorted(((n, x["median_us"]) for n, x in v.items() if "median_us" in x), key=lambda t: t[1])[:3]
    print(f"{key:8s} current {v.get('current', {}).get('median_us', 0):.2f} us/layer; best " + ", ".join(f"{n} {u:.2f}" for n, u in top))
print("sweep pick:", sw.get("pick"), "rounds", sw.get("rounds_done"), "errors", sw.get("errors"))
print("engine parts", r.get("parts_done"), "skipped", r.get("skipped"), "errors", r.get("errors"))
PYEOF
rm -f "$OUT/attn_sweep.json" "$OUT/attn_sweep.done" "$OUT/sweep.log" "$OUT"/*.tmp
echo "== end at $SECONDS s"
