#!/usr/bin/env bash
# Issue 24 items 3 / 5, session 11, part hostwork (budget 60 s, no GPU work: rides in any
# call): the engine's host (Python) time on the H200 machine's own CPU, by
# `pdserve bench host --executor stub` (the real scheduler, page allocator, staging,
# attention plan, sampler and graph-runner buffer filling around a forward that costs
# nothing; random:tiny on the CPU, 128-token pages, a 4,096-token step, the triton plan):
# 64 and 256 prompts of 125 tokens (the first token's intake and prefill steps, the decode
# step), then 64 prompts of 3,968 tokens (contexts to 4,096). The same command measured on
# the CPU machine is docs/benchmarks.md row S11-HOST: the ratio of the two rows converts
# the CPU's per-phase figures into this host's (S10-BF16X measured ~10 ms of GPU idle in
# the 64 prompts' first token, 4.75 ms of it before the first device op).
# -> hostwork.json (one object: a run per shape, each bench host's JSON). Run as
#   OUT=$OUT/gpu_s11 PREFIX=s11_ bash scripts/gpu_call.sh hostwork:60
# CPU check (~15 s): OUT=/tmp/s11_hostwork PYTHON=.venv/bin/python BUDGET=200 bash scripts/gpu_s11_hostwork.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s11_hostwork}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-60}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
run() {  # name, seconds, bench host arguments
    local name=$1 t=$2
    shift 2
    left=$((BUDGET - 6 - SECONDS))
    [ "$left" -lt "$t" ] && t=$left
    if [ "$t" -lt 5 ]; then echo "== $name skipped: $left s left"; return; fi
    echo "== $name ($SECONDS s, $t s for it)"
    timeout -k 2 "$t" $PY -m pdserve bench host --executor stub --graphs --backend triton \
        --page-size 128 --budget 4096 --clock cpu --json "$OUT/$name.json" "$@" 2>&1 | tail -3
}
run host_64x125 15 --num-prompts 64 --prompt-len 125 --max-tokens 16 --repeats 3
run host_256x125 20 --num-prompts 256 --prompt-len 125 --max-tokens 16 --repeats 3
run host_64x3968 25 --num-prompts 64 --prompt-len 3968 --max-tokens 80 --repeats 2
echo "== merge ($SECONDS s)"
timeout 6 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
res = {}
for name in ("host_64x125", "host_256x125", "host_64x3968"):
    f = out / f"{name}.json"
    try:
        res[name] = json.loads(f.read_text())
    except (OSError, ValueError):
        res[name] = None
    f.unlink(missing_ok=True)
(out / "hostwork.json").write_text(json.dumps(res, indent=1))
for name, r in res.items():
    row = (r or {}).get("results", [{}])[0]
    print(name, {k: round(row[k]) for k in ("intake_us", "prefill_us", "first_us", "host_us") if k in row})
PYEOF
