#!/usr/bin/env bash
# Issue 26's transfer target, session 15, part xfer of one H200 call (budget 120 s): `pdserve
# bench transfer` of one 8,192-token request with Llama-3.1-8B's KV shapes on CUDA memory
# (page-major, 128-token pages, the served page pattern), bf16 then e4m3, as session 14's
# gpu_s14_xfer.sh, each run A/B-ing the post of a WRITE made ahead in one process:
# `--ab-env PDSERVE_DISAGGREGATION_PLANNED_POST=0` runs the request and the one-page request
# again every repeat, in turn with the planned post (the default), on the path before session
# 15 (the send computes index arrays, inline decision and handle order again) -> the `ab`
# rows of transfer_bf16.json, transfer_e4m3.json; a second pair (_b) when the budget leaves
# room. The figures to read: the post stage (stages_s.*.post) planned vs not, for the request
# and the one-page request, and ratio (copy / NIXL until prefill Success) of e4m3 against
# bf16's, planned vs not.
#   OUT=$OUT/g15 PREFIX=s15_ bash scripts/gpu_call.sh xfer:120
# ~40-50 s a pair on the H200 (session 14: 15-20 s a run; the ab rows add 2 requests a repeat);
# CPU dry run (both pairs; 35 s on the 2-core machine at the commit that added it):
#   DEVICE=cpu SHAPE=smollm2-135m REPEATS=5 T_RUN=90 BUDGET=200 PYTHON=.venv/bin/python \
#   OUT=/tmp/s15_xfer bash scripts/gpu_s15_xfer.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s15_xfer}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-110}  # a second pair only if it ends by then: the part's limit is 120 s
T_RUN=${T_RUN:-40}  # one bench run: spawn + NIXL + 2 x 1 GiB pools a side, ~15-20 s on the H200
AB=${AB:-PDSERVE_DISAGGREGATION_PLANNED_POST=0}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
run() {  # dtype, file suffix
    echo "== bench transfer $1, A/B $AB ($SECONDS s)"
    timeout -k 3 "$T_RUN" $PY -m pdserve bench transfer --device "${DEVICE:-cuda}" --gpu-id 0 \
        --model-shape "${SHAPE:-llama-3.1-8b}" --prompt-len 8192 --page-size 128 \
        --kv-order page_major --pattern served --dtype "$1" --repeats "${REPEATS:-15}" \
        --ab-env "$AB" --json "$OUT/transfer_$2.json" 2>&1 | grep -v "^USDT\|NIXL INFO" | tail -16
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
$PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
us = lambda d: " ".join(f"{k} {v * 1e6:.0f}" for k, v in d.items())  # noqa: E731
for f in sorted(pathlib.Path(sys.argv[1]).glob("transfer_*.json")):
    r = json.loads(f.read_text())
    ab, fx, med = r["ab"], r["fixed_cost_s"], r["median_s"]
    print(f"{f.stem}: copy {med['copy'] * 1e3:.3f} ms, raw NIXL {med['raw_nixl'] * 1e3:.3f} ms, "
          f"raw one page {fx['raw_one_page'] * 1e3:.3f} ms; data checked {r['data_checked']}")
    rows = [("planned", med, r["ratio"], r["stages_s"])]
    if ab:
        rows.append((ab["env"], ab["median_s"], ab["ratio"], ab["stages_s"]))
    for label, m, ratio, st in rows:
        print(f"  {label}: ratio {ratio:.3f} (NIXL {m['nixl'] * 1e3:.3f} ms, decode "
              f"{m['nixl_decode'] * 1e3:.3f}); one page prefill {m['one_page'] * 1e3:.3f} / "
              f"decode {m['one_page_decode'] * 1e3:.3f} ms; post us: request "
              f"{st['nixl']['post'] * 1e6:.0f}, one page {st['one_page']['post'] * 1e6:.0f}")
        print(f"    stages us, request: {us(st['nixl'])}")
        print(f"    stages us, one page: {us(st['one_page'])}")
PYEOF
echo "done at $SECONDS s"
