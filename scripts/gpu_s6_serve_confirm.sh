#!/usr/bin/env bash
# Issue 24's serve check on one GPU, as one call (≤ 3.5 min with an 8B model's start-up):
# PD (pdserve up: router + prefill + decode on GPU 0) against one mixed worker on the same
# GPU, same model; greedy parity (5 prompts, as gpu_serve_check.sh); then `bench serve
# --phase-timing` at 8 req/s, three runs of 64 requests (--request-rate 8,8,8: three load
# points, each with prompts of its own), 512-token prompts, 128 out; the verdict
# (scripts/serve_check_summary.py: PD median TTFT ≤ mixed + 5 ms, p99 ≤ 2× median on both
# sides, every run); each worker's gc / Triton report. While the models load (GPU and
# disk bound), the client's own lateness is measured on this host against stub servers
# at an H200's cadence (scripts/bench_client_lateness.py, socket then httpx client); and,
# if time is left, one more run with the old client (--stream-client httpx) on the same
# deployment: the A/B of what the client counted into TTFT.
# Usage (repository root): [OUT=dir] [DECODE_GPU=1] [MPS=1] bash scripts/gpu_s6_serve_confirm.sh [MODEL] [DEVICE]
#   MODEL default random:llama-3.1-8b, DEVICE default cuda; `random:tiny cpu` for a dry run
#   (then NREQ, ILEN, OLEN, RATES may be set smaller).
# Writes under $OUT: serve.json (+ .png, .phases.png), summary.json, client_lateness_*.json,
# serve_httpx.json, parity.json + .txt, gc.txt, logs/ (the servers' logs). Start-up, parity
# and the workers' reports: scripts/gpu_serve_lib.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:llama-3.1-8b}
DEVICE=${2:-cuda}
OUT=${OUT:-gpu_serve_confirm}
PY=${PYTHON:-${PY:-python3}}
WHEELS=${WHEELS:-.whl}
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
. scripts/gpu_serve_lib.sh
KV=${KV_GIB:-16}
RATES=${RATES:-8,8,8}
NREQ=${NREQ:-64}
ILEN=${ILEN:-512}
OLEN=${OLEN:-128}
AB_UNTIL=${AB_UNTIL:-165}   # the httpx A/B run only if it can start by this many seconds
mkdir -p "$OUT/logs"
OUT=$(realpath "$OUT")
LOGS=$OUT/logs
command -v setsid > /dev/null || setsid() { "$@"; }  # (then the processes are stopped by pid)
# MPS=1: every process of the check (PD's two workers, the mixed worker) a client of a CUDA
# MPS control daemon started here (its pipe directory under /tmp: a socket path has at most
# 107 bytes; its log under $OUT/mps; stopped at the end):
# prefill's and decode's kernels then share the card's SMs instead of time-slicing it, the
# shared card's cost of PD on one GPU (row AL). Nothing else changes: the device's settings
# (compute mode) stay as they are; without the daemon's binary the check runs without it.
MPS_ON=0
mps_stop() { [ "$MPS_ON" = 1 ] && echo quit | nvidia-cuda-mps-control && MPS_ON=0; }
if [ "${MPS:-0}" = 1 ]; then
  if command -v nvidia-cuda-mps-control > /dev/null; then
    CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/pdserve_mps.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$OUT/mps
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && MPS_ON=1
    echo "== MPS control daemon started: $MPS_ON (pipe $CUDA_MPS_PIPE_DIRECTORY)"
  else
    echo "== MPS=1 but no nvidia-cuda-mps-control here: the check runs without MPS"
  fi
fi
RP=$(free_port); MP=$(free_port)
DT=bfloat16; [ "$DEVICE" = cpu ] && DT=float32
common=(--model "$MODEL" --dtype $DT --device "$DEVICE" --kv-cache-memory "$KV")
echo "== $(git log --oneline -1 2>/dev/null) model $MODEL on $DEVICE; router :$RP, mixed :$MP"
# PREFILL_GPU / DECODE_GPU (default 0: one shared card) place PD's workers; DECODE_GPU=1 on a
# two-GPU machine gives the check without the shared card's time-slicing (mixed stays on GPU 0)
pd_gpus=(--prefill-gpu-ids "${PREFILL_GPU:-0}" --decode-gpu-ids "${DECODE_GPU:-0}")
[ "$DEVICE" = cpu ] && pd_gpus=()
setsid $PY -m pdserve up "${common[@]}" "${pd_gpus[@]}" --port "$RP" --log-dir "$LOGS" > "$LOGS/up.out" 2>&1 &
UP=$!
setsid $PY -m pdserve serve "${common[@]}" --port "$MP" > "$LOGS/mixed.log" 2>&1 &
MX=$!
LAT=
cleanup() {
  [ -n "$LAT" ] && { kill -- -"$LAT" 2>/dev/null || kill "$LAT" 2>/dev/null; }
  kill -INT -- -"$UP" 2>/dev/null || kill -INT "$UP" 2>/dev/null
  kill -TERM -- -"$MX" 2>/dev/null || kill -TERM "$MX" 2>/dev/null
  for i in $(seq 1 20); do kill -0 $UP 2>/dev/null || kill -0 $MX 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- -"$UP" -"$MX" 2>/dev/null; kill -KILL "$UP" "$MX" 2>/dev/null; wait 2>/dev/null
  mps_stop
}
trap cleanup EXIT
trap 'exit 143' TERM INT
# the client's lateness on this host, CPU only, while the models load
setsid bash -c "timeout 45 $PY scripts/bench_client_lateness.py --num-requests 40 --json $OUT/client_lateness_socket.json > $OUT/client_lateness.txt 2>&1;
  timeout 45 $PY scripts/bench_client_lateness.py --num-requests 40 --json $OUT/client_lateness_httpx.json -- --stream-client httpx >> $OUT/client_lateness.txt 2>&1" &
LAT=$!
a=; b=
for i in $(seq 1 150); do
  a=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$RP/health")
  b=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$MP/health")
  [ "$a" = 200 ] && [ "$b" = 200 ] && break
  if ! kill -0 $UP 2>/dev/null || ! kill -0 $MX 2>/dev/null; then echo "a process died"; break; fi
  sleep 1
done
echo "== ready after ${SECONDS}s (router $a, mixed $b)"
if [ "$a" != 200 ] || [ "$b" != 200 ]; then
  tail -n 20 "$LOGS/up.out" "$LOGS/mixed.log"; exit 1
fi
for i in $(seq 1 40); do kill -0 "$LAT" 2>/dev/null || break; sleep 1; done
kill -- -"$LAT" 2>/dev/null; LAT=
echo "== client lateness on this host (stub servers, 8 req/s, 9.4 ms steps; to_client = server's write of the first chunk -> the client has it)"
grep -E "to_client|load average" "$OUT/client_lateness.txt"
echo "== greedy parity: router (PD) vs mixed"
PARITY_PROMPTS=5 PARITY_TIMEOUT=60 parity "http://127.0.0.1:$RP" "http://127.0.0.1:$MP" "$OUT/parity.json" \
  | tee "$OUT/parity.txt"
echo "== bench serve --phase-timing: PD (target) vs mixed (compare), rates $RATES, $NREQ requests each (at ${SECONDS}s)"
timeout 150 $PY -m pdserve bench serve --url "http://127.0.0.1:$RP" --compare "http://127.0.0.1:$MP" --no-progress \
  --dataset random --input-len $ILEN --output-len $OLEN --request-rate $RATES --num-requests $NREQ \
  --phase-timing --json "$OUT/serve.json" --plot "$OUT/serve.png" > "$OUT/serve.txt" 2>&1
echo "rc=$? at ${SECONDS}s"
grep -E "stage that grew most|wrote|error" "$OUT/serve.txt" | head -12
files=("$OUT/serve.json")
if [ "$SECONDS" -le "$AB_UNTIL" ]; then
  echo "== A/B: one more run with the old client (--stream-client httpx), same deployment (at ${SECONDS}s)"
  timeout 40 $PY -m pdserve bench serve --url "http://127.0.0.1:$RP" --compare "http://127.0.0.1:$MP" --no-progress \
    --dataset random --input-len $ILEN --output-len $OLEN --request-rate 8 --num-requests $NREQ --seed 7 \
    --stream-client httpx --phase-timing --json "$OUT/serve_httpx.json" > "$OUT/serve_httpx.txt" 2>&1
  echo "rc=$? at ${SECONDS}s"
  [ -f "$OUT/serve_httpx.json" ] && files+=("$OUT/serve_httpx.json")
else
  echo "== A/B with the httpx client skipped (at ${SECONDS}s, over ${AB_UNTIL}s)"
fi
echo "== verdict"
timeout 20 $PY scripts/serve_check_summary.py "${files[@]}" --json "$OUT/summary.json"
echo "== every worker's gc and Triton compiles"
worker_report "http://127.0.0.1:$RP" "http://127.0.0.1:$MP" | tee "$OUT/gc.txt"
echo "== done at ${SECONDS}s"
