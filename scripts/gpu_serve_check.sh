#!/usr/bin/env bash
# One-GPU serving check and figures: PD (prefill and decode both on GPU 0, behind the
# router) against one mixed worker on the same GPU, same model, same run:
#   1. greedy parity: the same prompts through the router and the mixed worker;
#   2. `pdserve bench serve` at several request rates, and the interference scenario.
# Usage (repository root): scripts/gpu_serve_check.sh [MODEL] [DEVICE]
#   MODEL default random:llama-3.1-8b, DEVICE default cuda (cpu + random:tiny for a dry run).
# Writes serve.json/serve.png/interference.json under ${OUT:-gpu_serve}; logs to stdout.
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
KV=${KV_GIB:-16}
RATES=${RATES:-2,8}
NREQ=${NREQ:-64}
ILEN=${ILEN:-512}
OLEN=${OLEN:-128}
mkdir -p "$OUT"
RP=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
MP=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
DT=bfloat16; [ "$DEVICE" = cpu ] && DT=float32
common=(--model "$MODEL" --dtype $DT --device "$DEVICE" --kv-cache-memory "$KV")
LOGS=$(mktemp -d)
$PY -m pdserve up "${common[@]}" --port "$RP" --log-dir "$LOGS" > "$LOGS/up.out" 2>&1 &
UP=$!
$PY -m pdserve serve "${common[@]}" --port "$MP" > "$LOGS/mixed.log" 2>&1 &
MX=$!
cleanup() { kill -INT $UP 2>/dev/null; kill $MX 2>/dev/null; wait $UP $MX 2>/dev/null; }
trap cleanup EXIT
for i in $(seq 1 600); do
  a=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$RP/health")
  b=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$MP/health")
  [ "$a" = 200 ] && [ "$b" = 200 ] && break
  if ! kill -0 $UP 2>/dev/null || ! kill -0 $MX 2>/dev/null; then echo "a process died"; break; fi
  sleep 1
done
echo "== ready after ${i}s (router $a, mixed $b)"
tail -n 5 "$LOGS/up.out"
curl -s "http://127.0.0.1:$MP/get_server_info"; echo
echo "== greedy parity: router (PD) vs mixed"
$PY - "$RP" "$MP" <<'PYEOF'
import sys, httpx
rp, mp = sys.argv[1:3]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "The quick brown fox"]
model = httpx.get(f"http://127.0.0.1:{mp}/v1/models").json()["data"][0]["id"]
same = 0
for p in prompts:
    body = {"model": model, "prompt": p, "max_tokens": 32, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    a = httpx.post(f"http://127.0.0.1:{rp}/v1/completions", json=body, timeout=300).json()
    b = httpx.post(f"http://127.0.0.1:{mp}/v1/completions", json=body, timeout=300).json()
    if "choices" not in a or "choices" not in b:
        print("ERROR", a, b); continue
    ta, tb = a["choices"][0]["text"], b["choices"][0]["text"]
    la = a["choices"][0]["logprobs"]["token_logprobs"]; lb = b["choices"][0]["logprobs"]["token_logprobs"]
    diff = max(abs(x - y) for x, y in zip(la, lb))
    same += ta == tb
    print(f"{'SAME' if ta == tb else 'DIFF'} max|dlogprob|={diff:.2e} {p!r} -> {ta[:60]!r}")
print(f"parity: {same}/{len(prompts)} identical greedy outputs")
PYEOF
echo "== bench serve: PD (target) vs mixed (compare)"
$PY -m pdserve bench serve --url "http://127.0.0.1:$RP" --compare "http://127.0.0.1:$MP" --no-progress \
  --dataset random --input-len $ILEN --output-len $OLEN --request-rate $RATES --num-requests $NREQ \
  --json "$OUT/serve.json" --plot "$OUT/serve.png" ${PHASES:+--phase-timing}
gc_report() {  # every worker's garbage collections (pdserve/gc_watch.py): were they the stalls?
  $PY - "$RP" "$MP" <<'PYEOF'
import json, sys, httpx
rp, mp = sys.argv[1:3]
urls = [w["url"] for w in httpx.get(f"http://127.0.0.1:{rp}/get_server_info").json().get("workers", [])]
for url in [*urls, f"http://127.0.0.1:{mp}"]:
    info = httpx.get(f"{url}/get_server_info").json()
    gc = info.get("gc") or {}
    print(f"gc {info.get('role')} {url}: collections {gc.get('collections')} max pause "
          f"{1e3 * gc.get('max_pause_seconds', 0):.1f} ms, pauses > 25 ms "
          f"{gc.get('pause_seconds', {}).get('count', 0) - gc.get('pause_seconds', {}).get('buckets', {}).get('0.025', 0)}"
          f", frozen {gc.get('frozen_objects')} (a full collection of them: "
          f"{1e3 * gc.get('startup_full_collection_seconds', 0):.0f} ms)")
    tr = info.get("triton") or {}  # pdserve/triton_watch.py: a compile after start-up stalls
    print(f"triton {info.get('role')} {url}: compiled at start-up "
          f"{tr.get('compilations_at_startup')}, after start-up "
          f"{tr.get('compilations_after_startup')} {tr.get('compilations_after_startup_by_kernel')}"
          f"; warm-up: {(info.get('warmup') or {}).get('steps')} steps, "
          f"{(info.get('warmup') or {}).get('backend_variants')} attention variants, "
          f"{(info.get('warmup') or {}).get('seconds', 0):.1f} s")
PYEOF
}
gc_report
[ "${INTERFERENCE:-1}" = 1 ] || { echo "== done"; exit 0; }
echo "== bench serve interference: PD (target) vs mixed (compare)"
$PY -m pdserve bench serve --url "http://127.0.0.1:$RP" --compare "http://127.0.0.1:$MP" --no-progress \
  --scenario interference --num-requests ${INREQ:-32} --concurrency ${ICONC:-8} --input-len 64 --output-len $OLEN \
  --long-input-len ${LONG:-4096} --long-request-rate ${LRATE:-2} --json "$OUT/interference.json"
echo "== done"
