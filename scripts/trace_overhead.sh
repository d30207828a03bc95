#!/usr/bin/env bash
# What tracing and the phase timings cost, and where PD's first-token time goes (issue 28).
# Three `pdserve up` deployments (1 prefill + 1 decode + router) of the same model, run one
# after another under `pdserve bench serve --compare` (interleaved blocks, same requests):
#   ref:   REF's tree (default: main, exported with `git archive`), today's code;
#   off:   this tree, tracing off (the phase histograms and request ids are always on);
#   on:    this tree with --otlp-traces-endpoint pointing at a local OTLP/HTTP sink that
#          accepts and drops every export (the SDK's batching and protobuf export included).
# Runs, each RUNS times: off vs ref, then on vs off; then PD (this tree, tracing off) vs one
# mixed worker with --phase-timing (the TTFT stages, the stage that grew most, the PNG).
# Usage (repository root): scripts/trace_overhead.sh [MODEL] [DEVICE]
#   MODEL default random:tiny, DEVICE default cpu; on the H200:
#   KV_GIB=2 REF=none scripts/trace_overhead.sh random:llama-3.1-8b cuda
#   (REF=none skips the ref deployment: 5 workers of 16 GB weights share GPU 0 then, 7 with it).
# Writes off_vs_ref_<i>.json, on_vs_off_<i>.json, pd_vs_mixed.json and pd_vs_mixed.phases.png
# under ${OUT:-trace_overhead}, then prints one summary line per run (ratios compare ÷ target
# inverted to "this ÷ reference": throughput and TTFT median).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:tiny}
DEVICE=${2:-cpu}
OUT=${OUT:-trace_overhead}
PY=${PYTHON:-$(pwd)/.venv/bin/python}
[ -x "$PY" ] || PY=python3
REF=${REF:-main}
RUNS=${RUNS:-3}
NREQ=${NREQ:-128}
ILEN=${ILEN:-128}
OLEN=${OLEN:-32}
CONC=${CONC:-4}
KV=${KV_GIB:-0.25}  # GiB of KV per worker (set 16 on the H200)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
[ "$REF" = none ] || git archive "$REF" | tar -x -C "$TMP" --one-top-level=ref
port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
DT=float32; [ "$DEVICE" != cpu ] && DT=bfloat16
common=(--model "$MODEL" --dtype $DT --device "$DEVICE" --kv-cache-memory "$KV")
PIDS=()
# SIGTERM: a background job of a script ignores SIGINT; `pdserve up` stops its children on it
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
SINK=$(port)
$PY - "$SINK" <<'PYEOF' > "$TMP/sink.log" 2>&1 &
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PYEOF
PIDS+=($!)
start() {  # port name dir extra-args...: starts `pdserve up` from dir (in this shell: PIDS)
  local p=$1 name=$2 dir=$3; shift 3
  (cd "$dir" && exec $PY -m pdserve up "${common[@]}" --port "$p" --log-dir "$TMP/$name" "$@") \
    > "$TMP/$name.out" 2>&1 &
  PIDS+=($!)
}
wait_ready() {
  for _ in $(seq 1 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/health")" = 200 ] && return 0
    sleep 1
  done
  echo "not ready: port $1"; return 1
}
REFP=$(port); OFFP=$(port); ONP=$(port); MIXP=$(port)
[ "$REF" = none ] || start "$REFP" ref "$TMP/ref"
start "$OFFP" off "$(pwd)"
start "$ONP" on "$(pwd)" --otlp-traces-endpoint "http://127.0.0.1:$SINK"
$PY -m pdserve serve "${common[@]}" --port "$MIXP" > "$TMP/mixed.log" 2>&1 &
PIDS+=($!)
READY="$OFFP $ONP $MIXP"; [ "$REF" = none ] || READY="$REFP $READY"
for p in $READY; do wait_ready "$p" || exit 1; done
bench() {  # target compare json [extra]
  $PY -m pdserve bench serve --url "http://127.0.0.1:$1" --compare "http://127.0.0.1:$2" \
    --no-progress --dataset random --input-len "$ILEN" --output-len "$OLEN" \
    --num-requests "$NREQ" --concurrency "$CONC" --blocks 4 --timeout "${TIMEOUT:-120}" \
    --json "$3" "${@:4}"
}
summary() {  # json label
  $PY - "$1" "$2" <<'PYEOF'
import json, sys
doc = json.load(open(sys.argv[1]))
t, c = (s["summary"] for s in doc["series"][:2])
print(f"{sys.argv[2]}: throughput {t['output_throughput']:.1f} vs {c['output_throughput']:.1f} tok/s "
      f"(x{t['output_throughput'] / c['output_throughput']:.3f}), TTFT median {t['ttft']['median']:.1f} "
      f"vs {c['ttft']['median']:.1f} ms (x{t['ttft']['median'] / c['ttft']['median']:.3f}), "
      f"failed {t['failed']} / {c['failed']}")
PYEOF
}
for i in $(seq 1 "$RUNS"); do
  [ "$REF" = none ] || bench "$OFFP" "$REFP" "$OUT/off_vs_ref_$i.json" > "$OUT/off_vs_ref_$i.txt"
  bench "$ONP" "$OFFP" "$OUT/on_vs_off_$i.json" > "$OUT/on_vs_off_$i.txt"
done
bench "$OFFP" "$MIXP" "$OUT/pd_vs_mixed.json" --phase-timing > "$OUT/pd_vs_mixed.txt"
echo "== $MODEL on $DEVICE, $NREQ requests of $ILEN/$OLEN tokens, concurrency $CONC, $RUNS runs"
for i in $(seq 1 "$RUNS"); do
  [ "$REF" = none ] || summary "$OUT/off_vs_ref_$i.json" "tracing off ÷ $REF, run $i"
  summary "$OUT/on_vs_off_$i.json" "tracing on ÷ off, run $i"
done
grep -A 14 "TTFT by stage" "$OUT/pd_vs_mixed.txt"
grep "stage that grew most" "$OUT/pd_vs_mixed.txt"
