#!/usr/bin/env bash
# Greedy parity of PD against a mixed worker when the two deployments do not fit the GPU
# together (issue 27: random:qwen3-30b-a3b is 61 GB a copy; prefill + decode + mixed would
# be three): `pdserve up` (prefill + decode + router on GPU 0, every request through
# prefill and the KV transfer: --pd-min-prefill-tokens 0) answers the prompts, is stopped,
# then one mixed worker with the same flags answers the same prompts, and the two are
# compared token for token (text and per-token log-probs).
# Usage (repository root): scripts/gpu_serve_parity_sequential.sh [MODEL] [DEVICE]
#   MODEL default random:qwen3-30b-a3b, DEVICE default cuda (cpu + random:tiny-qwen3-moe:
#   a dry run). KV_GIB (default 2) a worker's KV pool, MAX_RUNNING (default 8) its running
#   batch and largest CUDA graph (a short start-up), READY_S (default 900) the wait for each
#   deployment; PARITY_PROMPTS / PARITY_TOKENS: scripts/gpu_serve_lib.sh.
# Writes parity.json (the verdict and both sides' answers) under ${OUT:-gpu_parity}; missing
# wheels as scripts/gpu_serve_check.sh (${WHEELS:-.whl}).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:qwen3-30b-a3b}
DEVICE=${2:-cuda}
OUT=${OUT:-gpu_parity}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
. scripts/gpu_setup.sh
. scripts/gpu_serve_lib.sh
mkdir -p "$OUT"
DT=bfloat16; [ "$DEVICE" = cpu ] && DT=float32
common=(--model "$MODEL" --dtype $DT --device "$DEVICE" --kv-cache-memory "${KV_GIB:-2}"
        --max-running-requests "${MAX_RUNNING:-8}")
LOGS=$(mktemp -d)
UP=; MX=
cleanup() { [ -n "$UP" ] && stop "$UP"; [ -n "$MX" ] && stop "$MX" TERM; }
trap cleanup EXIT
trap 'exit 143' TERM INT  # a timeout: the EXIT trap stops what still runs
P=$(free_port)
$PY -m pdserve up "${common[@]}" --pd-min-prefill-tokens 0 --port "$P" --log-dir "$LOGS" > "$LOGS/up.out" 2>&1 &
UP=$!
echo "== pdserve up ($SECONDS s)"
T0=$SECONDS
if wait_ready "http://127.0.0.1:$P" $UP "${READY_S:-900}"; then
  PD_READY=$((SECONDS - T0))
  greedy_answers "http://127.0.0.1:$P" "$LOGS/pd.json"
else
  tail -n 20 "$LOGS"/*.log "$LOGS/up.out" 2>/dev/null | grep -v "^USDT" | tail -30
fi
stop $UP; UP=
echo "== PD stopped ($SECONDS s)"
M=$(free_port)
$PY -m pdserve serve "${common[@]}" --port "$M" > "$LOGS/mixed.log" 2>&1 &
MX=$!
echo "== mixed worker ($SECONDS s)"
T0=$SECONDS
if wait_ready "http://127.0.0.1:$M" $MX "${READY_S:-900}"; then
  MIXED_READY=$((SECONDS - T0))
  greedy_answers "http://127.0.0.1:$M" "$LOGS/mixed.json"
else
  tail -n 30 "$LOGS/mixed.log" | grep -v "^USDT"
fi
stop $MX TERM; MX=
if [ -f "$LOGS/pd.json" ] && [ -f "$LOGS/mixed.json" ]; then
  compare_answers "$LOGS/pd.json" "$LOGS/mixed.json" "$OUT/parity.json"
else
  echo "parity: not measured (a deployment did not answer)"
  echo '{"identical": null, "error": "a deployment did not answer"}' > "$OUT/parity.json"
fi
$PY - "$OUT/parity.json" "$MODEL" "${PD_READY:-}" "${MIXED_READY:-}" "${common[*]}" <<'PYEOF'
import json, sys
path, model, pd_s, mixed_s, flags = sys.argv[1:6]
d = json.load(open(path))
d.update(model=model, flags=flags, pd_ready_s=int(pd_s) if pd_s else None,
         mixed_ready_s=int(mixed_s) if mixed_s else None)
json.dump(d, open(path, "w"), indent=1)
print(f"ready after: PD {pd_s or '-'} s, mixed {mixed_s or '-'} s")
PYEOF
rm -rf "$LOGS"
echo "== end at $SECONDS s"
