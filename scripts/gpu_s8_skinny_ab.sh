#!/usr/bin/env bash
# Session 8: bench offline bf16 64 / 256 prompts with the skinny GEMM table off, then on
# (pdserve/model/skinny_table.ON patched in the bench's own process), two repeats each:
# whether the 64-row picks gain in the whole run and whether the 256-prompt run moves.
#   OUT=$OUT/s8ab PREFIX=s8_ bash scripts/gpu_call.sh skinny_ab:310
# (each side: the engine start, graphs and two repeats of 64 + 256 prompts: over 90 s on the
# H200, the session-8 call with T_EACH=90 was cut on both sides and printed nothing)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_skinny_ab}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
for on in False True; do
    echo "== skinny_table.ON=$on ($SECONDS s)"
    timeout ${T_EACH:-150} $PY - "$on" "$OUT/offline_skinny_$on.json" <<'PYEOF' 2>&1 | grep -v "^USDT" | tail -5
import sys

from pdserve.cli import main
from pdserve.model import skinny_table

skinny_table.ON = sys.argv[1] == "True"
sys.exit(main(["bench", "offline", "--model", "random:llama-3.1-8b", "--device", "cuda",
               "--dtype", "bfloat16", "--ours-only", "--num-prompts", "64,256",
               "--max-tokens", "128", "--repeats", "2", "--json", sys.argv[2]]))
PYEOF
done
echo "== end at $SECONDS s"
