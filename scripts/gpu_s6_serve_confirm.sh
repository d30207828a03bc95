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
# Usage (repository root): [OUT=dir] [DECODE_GPU=1] bash scripts/gpu_s6_serve_confirm.sh [MODEL] [DEVICE]
#   MODEL default random:llama-3.1-8b, DEVICE default cuda; `random:tiny cpu` for a dry run
#   (then NREQ, ILEN, OLEN, RATES may be set smaller).
# Writes under $OUT: serve.json (+ .png, .phases.png), summary.json, client_lateness_*.json,
# serve_httpx.json, parity.txt, gc.txt, logs/ (the servers' logs).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:llama-3.1-8b}
DEVICE=${2:-cuda}
OUT=${OUT:-gpu_serve_confirm}
PY=${PYTHON:-${PY:-python3}}
WHEELS=${WHEELS:-.whl}
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
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
port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
RP=$(port); MP=$(port)
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
timeout 60 $PY - "$RP" "$MP" <<'PYEOF' | tee "$OUT/parity.txt"
import sys, httpx
rp, mp = sys.argv[1:3]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "The quick brown fox"]
model = httpx.get(f"http://127.0.0.1:{mp}/v1/models").json()["data"][0]["id"]
same = 0
for p in prompts:
    body = {"model": model, "prompt": p, "max_tokens": 32, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    a = httpx.post(f"http://127.0.0.1:{rp}/v1/completions", json=body, timeout=60).json()
    b = httpx.post(f"http://127.0.0.1:{mp}/v1/completions", json=body, timeout=60).json()
    if "choices" not in a or "choices" not in b:
        print("ERROR", a, b); continue
    ta, tb = a["choices"][0]["text"], b["choices"][0]["text"]
    la = a["choices"][0]["logprobs"]["token_logprobs"]; lb = b["choices"][0]["logprobs"]["token_logprobs"]
    diff = max(abs(x - y) for x, y in zip(la, lb))
    same += ta == tb
    print(f"{'SAME' if ta == tb else 'DIFF'} max|dlogprob|={diff:.2e} {p!r} -> {ta[:60]!r}")
print(f"parity: {same}/{len(prompts)} identical greedy outputs")
PYEOF
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
timeout 20 $PY - "$RP" "$MP" <<'PYEOF' | tee "$OUT/gc.txt"
import sys, httpx
rp, mp = sys.argv[1:3]
urls = [w["url"] for w in httpx.get(f"http://127.0.0.1:{rp}/get_server_info").json().get("workers", [])]
for url in [*urls, f"http://127.0.0.1:{mp}"]:
    info = httpx.get(f"{url}/get_server_info").json()
    gc = info.get("gc") or {}
    tr = info.get("triton") or {}
    print(f"{info.get('role')} {url}: gc collections {gc.get('collections')} max pause "
          f"{1e3 * gc.get('max_pause_seconds', 0):.1f} ms; triton compiled after start-up "
          f"{tr.get('compilations_after_startup')}")
PYEOF
echo "== done at ${SECONDS}s"
