#!/usr/bin/env bash
# Issue 9 checks on one GPU (xfer): decode's completion lag behind prefill, and a clean
# exit of both bench processes. Usage (repository root, on the GPU machine, pdserve and
# NIXL importable as for scripts/gpu_transfer_check.sh):
#
#   scripts/transfer_notif_check.sh [GPU_ID]        # default 0; results in ${OUT:-gpu_check}/
#
# 1. `bench transfer` at Llama-3.1-8B bf16, 8,192 tokens, page_major, 128-token pages, with
#    the served page pattern and with every page apart (runs of 1): read the rows
#    "until prefill Success" vs "until decode's manager sees Success" and the fixed-cost
#    row (decode - prefill was 0.22 ms at main a8c6fea).
# 2. The same served run with prefill's notifier agent (nixl/notifier.py) created with the
#    UCX backend parameter ucx_error_handling_mode=none (patched in-process for this run
#    only): then UCX may send XferDone as a shared-memory active message (sysv) instead of
#    over TCP loopback, which on the 2-core CPU machine cut send_notif from ~14-20 us to
#    ~7 us and one notification's one-way latency from ~36-46 us to ~24 us.
# Every run's stderr is kept; the script fails if one prints std::terminate's line or
# exits non-zero, and prints the decode process's exit code and threads left at its exit.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=${1:-0}
OUT=${OUT:-gpu_check}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
BASE=(bench transfer --device cuda --gpu-id "$GPU" --model-shape llama-3.1-8b --dtype bfloat16
      --prompt-len 8192 --repeats 7 --kv-order page_major --page-size 128)
status=0
run() {  # name, then python -m pdserve arguments (or -c CODE ...)
  local name=$1; shift
  echo "== $name"
  $PY "$@" --json "$OUT/notif_$name.json" >"$OUT/notif_$name.txt" 2>"$OUT/notif_$name.err"
  local rc=$?
  grep -v "NIXL INFO" "$OUT/notif_$name.txt"
  grep -v "NIXL INFO" "$OUT/notif_$name.err" | tail -5
  echo "exit code $rc"
  if [ $rc -ne 0 ] || grep -q "terminate called" "$OUT/notif_$name.err" "$OUT/notif_$name.txt"; then
    echo "FAIL: $name exited $rc or printed 'terminate called'"; status=1
  fi
  $PY - "$OUT/notif_$name.json" <<'PYEOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
m, f = r["median_s"], r["fixed_cost_s"]
print(f"prefill {m['nixl']*1e3:.3f} ms, decode {m['nixl_decode']*1e3:.3f} ms (lag "
      f"{(m['nixl_decode']-m['nixl'])*1e3:.3f}); one page: prefill {f['prefill']*1e3:.3f}, decode "
      f"{f['decode']*1e3:.3f} (lag {(f['decode']-f['prefill'])*1e3:.3f}); ratio/copy {r['ratio']:.3f}; "
      f"decode exit {r.get('decode_exit_code')}, threads at exit {r.get('decode_threads_at_exit')}")
PYEOF
}
run served -m pdserve "${BASE[@]}" --pattern served
run runlen1 -m pdserve "${BASE[@]}" --pattern runs --run-len 1
NOTIF_NONE='
import sys
from dataclasses import replace
import pdserve.disagg.nixl.agent.notifier as notifier
_create = notifier.create_agent
def create_agent(api, name, kv_args, role, spec):
    params = {**spec.params, "ucx_error_handling_mode": "none"}
    return _create(api, name, kv_args, role, replace(spec, params=params))
notifier.create_agent = create_agent
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
'
run served_notifier_errmode_none -c "$NOTIF_NONE" "${BASE[@]}" --pattern served
exit $status
