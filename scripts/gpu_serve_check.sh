#!/usr/bin/env bash
# One-GPU serving check and figures: PD (prefill and decode both on GPU 0, behind the
# router) against one mixed worker on the same GPU, same model, same run:
#   1. greedy parity: the same prompts through the router and the mixed worker;
#   2. `pdserve bench serve` at several request rates, and the interference scenario.
# Usage (repository root): scripts/gpu_serve_check.sh [MODEL] [DEVICE]
#   MODEL default random:llama-3.1-8b, DEVICE default cuda (cpu + random:tiny for a dry run).
# Writes parity.json/serve.json/serve.png/interference.json under ${OUT:-gpu_serve}; logs to
# stdout. Start-up, parity and the workers' reports: scripts/gpu_serve_lib.sh.
# PHASES=1: bench serve with --phase-timing (TTFT by stage, the stage that grew most, the
# phases PNG next to serve.json); INTERFERENCE=0 skips the interference scenario. The
# missing packages and NIXL come from ${WHEELS:-.whl} (scripts/gpu_setup.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:llama-3.1-8b}
DEVICE=${2:-cuda}
OUT=${OUT:-gpu_serve}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
. scripts/gpu_setup.sh
. scripts/gpu_serve_lib.sh
KV=${KV_GIB:-16}
RATES=${RATES:-2,8}
NREQ=${NREQ:-64}
ILEN=${ILEN:-512}
OLEN=${OLEN:-128}
mkdir -p "$OUT"
RP=$(free_port)
MP=$(free_port)
DT=bfloat16; [ "$DEVICE" = cpu ] && DT=float32
common=(--model "$MODEL" --dtype $DT --device "$DEVICE" --kv-cache-memory "$KV")
LOGS=$(mktemp -d)
$PY -m pdserve up "${common[@]}" --port "$RP" --log-dir "$LOGS" > "$LOGS/up.out" 2>&1 &
UP=$!
$PY -m pdserve serve "${common[@]}" --port "$MP" > "$LOGS/mixed.log" 2>&1 &
MX=$!
cleanup() { kill -INT $UP 2>/dev/null; kill $MX 2>/dev/null; wait $UP $MX 2>/dev/null; }
trap cleanup EXIT
wait_ready "http://127.0.0.1:$RP" $UP 600 && wait_ready "http://127.0.0.1:$MP" $MX 600 \
  || { tail -n 20 "$LOGS/up.out" "$LOGS/mixed.log"; exit 1; }
tail -n 5 "$LOGS/up.out"
curl -s "http://127.0.0.1:$MP/get_server_info"; echo
echo "== greedy parity: router (PD) vs mixed"
PARITY_PROMPTS=5 parity "http://127.0.0.1:$RP" "http://127.0.0.1:$MP" "$OUT/parity.json"
echo "== bench serve: PD (target) vs mixed (compare)"
$PY -m pdserve bench serve --url "http://127.0.0.1:$RP" --compare "http://127.0.0.1:$MP" --no-progress \
  --dataset random --input-len $ILEN --output-len $OLEN --request-rate $RATES --num-requests $NREQ \
  --json "$OUT/serve.json" --plot "$OUT/serve.png" ${PHASES:+--phase-timing}
echo "== every worker's gc and Triton compiles"
worker_report "http://127.0.0.1:$RP" "http://127.0.0.1:$MP"
[ "${INTERFERENCE:-1}" = 1 ] || { echo "== done"; exit 0; }
echo "== bench serve interference: PD (target) vs mixed (compare)"
$PY -m pdserve bench serve --url "http://127.0.0.1:$RP" --compare "http://127.0.0.1:$MP" --no-progress \
  --scenario interference --num-requests ${INREQ:-32} --concurrency ${ICONC:-8} --input-len 64 --output-len $OLEN \
  --long-input-len ${LONG:-4096} --long-request-rate ${LRATE:-2} --json "$OUT/interference.json"
echo "== done"
