#!/usr/bin/env bash
# Issue 26's transfer target, session 14, part xfer of one H200 call (budget 90 s): `pdserve
# bench transfer` of one 8,192-token request with Llama-3.1-8B's KV shapes on CUDA memory
# (page-major, 128-token pages, the served page pattern), bf16 then e4m3, each with the
# one-page row (the fixed cost) and the path stage by stage (`stages_s`: send -> WRITEs posted
# -> seen done -> prefill Success -> XferDone sent -> read by decode -> decode Success ->
# decode's harness woken by the manager's set_wakeup) -> transfer_bf16.json,
# transfer_e4m3.json; a second pair (_b) when the budget leaves room. The figures to read:
# ratio (copy / NIXL until prefill Success) of e4m3 against bf16's, fixed_cost_s, stages_s.
#   OUT=$OUT/g14 PREFIX=s14_ bash scripts/gpu_call.sh xfer:90
# CPU dry run (71 s on the loaded 2-core machine, both pairs; run at the commit that added it):
#   DEVICE=cpu SHAPE=smollm2-135m REPEATS=5 T_RUN=90 BUDGET=200 PYTHON=.venv/bin/python \
#   OUT=/tmp/s14_xfer bash scripts/gpu_s14_xfer.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s14_xfer}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-90}
T_RUN=${T_RUN:-38}  # one bench run: spawn + NIXL + 2 x 1 GiB pools a side, ~15-20 s on the H200
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
run() {  # dtype, file suffix
    echo "== bench transfer $1 ($SECONDS s)"
    timeout -k 3 "$T_RUN" $PY -m pdserve bench transfer --device "${DEVICE:-cuda}" --gpu-id 0 \
        --model-shape "${SHAPE:-llama-3.1-8b}" --prompt-len 8192 --page-size 128 \
        --kv-order page_major --pattern served --dtype "$1" --repeats "${REPEATS:-15}" \
        --json "$OUT/transfer_$2.json" 2>&1 | grep -v "^USDT\|NIXL INFO" | tail -12
}
start=$SECONDS
for pair in "" _b; do
    if [ -n "$pair" ] && [ $((2 * SECONDS - start + 5)) -gt "$BUDGET" ]; then
        echo "no time left for a second pair ($SECONDS s)"  # the first pair's time again
        break
    fi
    run bfloat16 "bf16$pair"
    run float8_e4m3fn "e4m3$pair"
done
$PY - "$OUT" <<'EOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("transfer_*.json")):
    r = json.loads(f.read_text())
    fx, st = r["fixed_cost_s"], r["stages_s"]
    us = lambda d: " ".join(f"{k} {v * 1e6:.0f}" for k, v in d.items())  # noqa: E731
    print(f"{f.stem}: ratio {r['ratio']:.3f} (NIXL {r['median_s']['nixl'] * 1e3:.3f} ms, decode "
          f"{r['median_s']['nixl_decode'] * 1e3:.3f}, copy {r['median_s']['copy'] * 1e3:.3f}); one page "
          f"prefill {fx['prefill'] * 1e3:.3f} / decode {fx['decode'] * 1e3:.3f} / woken "
          f"{fx['decode_polled'] * 1e3:.3f} ms (raw {fx['raw_one_page'] * 1e3:.3f})")
    print(f"  stages us, request: {us(st['nixl'])}")
    print(f"  stages us, one page: {us(st['one_page'])}")
EOF
echo "done at $SECONDS s"
