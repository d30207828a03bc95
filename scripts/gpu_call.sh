#!/usr/bin/env bash
# One H200 call running the named parts in order, each under its own timeout:
#   OUT=$OUT/gpu_s8 PREFIX=s8_ bash scripts/gpu_call.sh NAME[:SECONDS] ...
# (on the device machine OUT must lie under the device's $OUT: only files there come back)
# runs scripts/gpu_${PREFIX}NAME.sh with OUT=$OUT/NAME (its stdout and stderr in
# $OUT/NAME/output.txt, the last 40 lines echoed), for at most SECONDS (default 240).
# A call brings back at most 8 files: each part keeps its JSON and deletes the rest. Beside
# each part nvidia-smi records the card's SM clock, power and slowdown reasons; their summary
# (scripts/gpu_clocks.py) ends the part's output.txt. BUDGET_<PREFIX><NAME> (e.g.
# BUDGET_s10_fp8kv2=190), where set, is that part's BUDGET (the parts read one name).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_call}
PREFIX=${PREFIX:-}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY=${PYTHON:-python3} WHEELS=${WHEELS:-.whl}
. scripts/gpu_setup.sh
echo "tree $(bash scripts/tree_hash.sh) (here: bash scripts/tree_hash.sh on the checkout that sent it)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
for part in "$@"; do
    name=${part%%:*}; secs=${part#*:}; [ "$secs" = "$part" ] && secs=240
    mkdir -p "$OUT/$name"
    echo "== $name (limit $secs s, at $SECONDS s)"
    clocks=""  # the card's clocks, power and slowdown reasons beside the part (gpu_clocks.py),
    # read into the call's folder: a part deletes what it does not bring back from its own
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi -i 0 --query-gpu="$($PY scripts/gpu_clocks.py query)" --format=csv,nounits \
            -lms 250 > "$OUT/.clocks.$name.csv" 2> /dev/null &
        clocks=$!
    fi
    bvar="BUDGET_${PREFIX}$name"
    OUT="$OUT/$name" BUDGET=${!bvar:-${BUDGET:-}} timeout -k 10 "$secs" bash "scripts/gpu_${PREFIX}$name.sh" > "$OUT/$name/output.txt" 2>&1
    echo "rc=$? after $SECONDS s" | tee -a "$OUT/$name/output.txt"
    if [ -n "$clocks" ]; then
        kill "$clocks" 2> /dev/null; wait "$clocks" 2> /dev/null
        $PY scripts/gpu_clocks.py summary "$OUT/.clocks.$name.csv" >> "$OUT/$name/output.txt"
        rm -f "$OUT/.clocks.$name.csv"
    fi
    grep -v "^USDT\|^clk " "$OUT/$name/output.txt" | tail -40
done
echo "== end at $SECONDS s"
