#!/usr/bin/env bash
# What prefill computing the prompt before decode's destination arrives buys (issue 24):
# two `pdserve up` deployments (1 prefill + 1 decode + router) of the same model, one with
# the default --pd-compute-ahead-fraction (0.25: compute ahead) and one with 0 (every
# prompt waits for its destination first: the order before compute-ahead), then
# `pdserve bench serve --compare` (interleaved blocks, the same requests) with
# --phase-timing, one fresh --seed per run (a repeated seed repeats the prompts: prefix-cache
# hits), the order of the two swapped every other run. Prints each run's PD TTFT median
# for both and the load average before it.
# Usage (repository root): scripts/compute_ahead_ab.sh [MODEL] [DEVICE]
#   MODEL default random:tiny, DEVICE default cpu (1 torch thread per worker); on a GPU:
#   KV_GIB=8 scripts/compute_ahead_ab.sh random:llama-3.1-8b cuda  (PYTHON: the interpreter with
#   pdserve, default python3; here PYTHON=.venv/bin/python)
# Env: RUNS (8), ILEN (512), OLEN (4), NREQ (64), RATE (unset: concurrency 1),
# OUT (compute_ahead): <OUT>/run_<seed>.json, .phases.png.
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:tiny}
DEVICE=${2:-cpu}
OUT=${OUT:-compute_ahead}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
[ "$DEVICE" = cpu ] || . scripts/gpu_setup.sh  # the GPU machine's missing wheels and NIXL
RUNS=${RUNS:-8}
ILEN=${ILEN:-512}
OLEN=${OLEN:-4}
NREQ=${NREQ:-64}
mkdir -p "$OUT"
port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
AP=$(port); OP=$(port)
common=(--model "$MODEL" --device "$DEVICE")
[ "$DEVICE" = cpu ] && common+=(--num-threads 1)
[ -n "${KV_GIB:-}" ] && common+=(--kv-cache-memory "$KV_GIB")
LOGS=$(mktemp -d)
$PY -m pdserve up "${common[@]}" --port "$AP" --log-dir "$LOGS/ahead" > "$LOGS/ahead.out" 2>&1 &
A=$!
$PY -m pdserve up "${common[@]}" --port "$OP" --log-dir "$LOGS/off" --pd-compute-ahead-fraction 0 \
  > "$LOGS/off.out" 2>&1 &
O=$!
cleanup() { kill -INT $A $O 2>/dev/null; wait $A $O 2>/dev/null; }
trap cleanup EXIT
for i in $(seq 1 600); do
  a=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$AP/health")
  b=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$OP/health")
  [ "$a" = 200 ] && [ "$b" = 200 ] && break
  if ! kill -0 $A 2>/dev/null || ! kill -0 $O 2>/dev/null; then echo "a deployment died"; exit 1; fi
  sleep 1
done
echo "== ready after ${i}s (compute-ahead :$AP, off :$OP); logs in $LOGS"
load=(--concurrency 1); [ -n "${RATE:-}" ] && load=(--request-rate "$RATE")
for run in $(seq 1 "$RUNS"); do
  seed=$((100 + run))
  if [ $((run % 2)) = 1 ]; then url=$AP; cmp=$OP; else url=$OP; cmp=$AP; fi
  echo "== run $run seed $seed, load $(cut -d' ' -f1-3 /proc/loadavg), target :$url compare :$cmp"
  $PY -m pdserve bench serve --url "http://127.0.0.1:$url" --compare "http://127.0.0.1:$cmp" \
    --no-progress --dataset random --input-len "$ILEN" --output-len "$OLEN" --num-requests "$NREQ" \
    --blocks 4 --seed $seed "${load[@]}" --phase-timing --json "$OUT/run_$seed.json" \
    | grep -E "TTFT (median|p90)|│ (bootstrap|queue|prefill) "
done
