#!/usr/bin/env bash
# Issue 24, session 10, part bf16x of one H200 call (budget 130 s, one engine load): bf16
# random:llama-3.1-8b at 64 prompts x 128 (target >= 10,000 tok/s).
#   1. in the background from the start (niced: the engine draws its random weights on the
#      CPU): scripts/gpu_s10_bf16x.py sweep, no model: the extend (prefill) attention at
#      32 / 64 prompts of ~125 tokens for 8 tile configurations (BLOCK_N kept: the same
#      bits), interleaved rounds -> extend_sweep.json, the bit-identical ones ranked
#   2. scripts/gpu_s10_bf16x.py engine, one engine: the first token of the 64 prompts timed
#      and profiled (the GPU's idle gaps and what the host did in them); the sweep's best
#      extend tiles A/B in the engine's first token (greedy outputs compared); the step
#      budget 4,096 vs 8,192 by bench offline's procedure; the 64x200 step's per-kernel
#      incremental times; the picks vs base (bench offline's procedure); the 64-row
#      bucket with PDL off (A/B and each kernel's own time) -> bf16x.json
# One file is left under $OUT: bf16x.json (the sweep inside it, key "sweep"). Run as:
#   OUT=$OUT/gpu_s10 PREFIX=s10_ bash scripts/gpu_call.sh bf16x:130
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s10_bf16x}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-130}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
rm -f "$OUT/extend_sweep.done" "$OUT/extend_sweep.json" "$OUT/bf16x.json"
echo "== 1. the extend attention sweep, in the background ($SECONDS s)"
(
    timeout -k 3 ${T_SWEEP:-60} nice -n 5 $PY scripts/gpu_s10_bf16x.py sweep --device "$DEVICE" \
        --build-deadline-s ${BUILD_S:-35} --deadline-s ${SWEEP_S:-50} --done "$OUT/extend_sweep.done" \
        ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
    echo "sweep exit $? (124: cut by its timeout)" >> "$OUT/sweep.log"
    touch "$OUT/extend_sweep.done"
) &
sweep_pid=$!
left=$((BUDGET - 10 - SECONDS))
echo "== 2. the engine ($SECONDS s; $left s for it)"
timeout -k 4 "$left" $PY scripts/gpu_s10_bf16x.py engine --model "$MODEL" --device "$DEVICE" \
    --deadline-s $((left - 6)) --sweep-json "$OUT/extend_sweep.json" --done "$OUT/extend_sweep.done" \
    ${ENGINE_ARGS:-} 2>&1 | grep --line-buffered -v "^USDT\|profiler_st\|_warn_once\|UserWarning"
echo "engine exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
kill "$sweep_pid" 2>/dev/null
wait "$sweep_pid" 2>/dev/null
echo "== the sweep's log"
grep -v "^USDT" "$OUT/sweep.log" | tail -14
echo "== merge ($SECONDS s)"
timeout 6 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
r = load("bf16x.json") or {"errors": {"engine": "no bf16x.json"}}
r["sweep"] = load("extend_sweep.json")
(out / "bf16x.json").write_text(json.dumps(r, indent=1))
sw = r["sweep"] or {}
for key, s in (sw.get("shapes") or {}).items():
    print(key, ", ".join(f"{n} {v.get('median_us', 0):.2f} us ({'same' if v.get('same_bits') else 'differs' if v.get('same_bits') is False else '-'})" for n, v in s["variants"].items()))
print("sweep ranked:", sw.get("ranked"), "rounds", sw.get("rounds_done"), "errors", sw.get("errors"))
print("engine parts", r.get("parts_done"), "skipped", r.get("skipped"), "errors", r.get("errors"))
PYEOF
rm -f "$OUT/extend_sweep.json" "$OUT/extend_sweep.done" "$OUT/sweep.log" "$OUT"/*.tmp
echo "== end at $SECONDS s"
