#!/usr/bin/env bash
# Greedy parity of PD against a mixed worker when the two deployments do not fit the GPU
# together (issue 27: random:qwen3-30b-a3b is 61 GB a copy; prefill + decode + mixed would
# be three): `pdserve up` (prefill + decode + router on GPU 0) answers the prompts, is
# stopped, then one mixed worker answers the same prompts, and the two are compared token
# for token (text and per-token log-probs). ~4 min for the 30B model on one H200.
# Usage (repository root): scripts/gpu_serve_parity_sequential.sh [MODEL] [DEVICE]
#   MODEL default random:qwen3-30b-a3b, DEVICE default cuda (cpu + random:tiny: a dry run).
# Writes pd.json, mixed.json, parity.json under ${OUT:-gpu_parity}; missing wheels as
# scripts/gpu_serve_check.sh (${WHEELS:-.whl}).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:qwen3-30b-a3b}
DEVICE=${2:-cuda}
OUT=${OUT:-gpu_parity}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
. scripts/gpu_setup.sh
mkdir -p "$OUT"
DT=bfloat16; [ "$DEVICE" = cpu ] && DT=float32
common=(--model "$MODEL" --dtype $DT --device "$DEVICE" --kv-cache-memory "${KV_GIB:-4}")
LOGS=$(mktemp -d)
port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_ready() {  # URL PID
  for i in $(seq 1 900); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ] && { echo "ready after ${i}s"; return 0; }
    kill -0 "$2" 2>/dev/null || { echo "the deployment died"; return 1; }
    sleep 1
  done
  return 1
}
answer() {  # URL FILE: greedy answers with log-probs and token ids
  $PY - "$1" "$2" <<'PYEOF'
import json, sys, httpx
url, path = sys.argv[1:3]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "The quick brown fox", "Water boils at"]
model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
out = []
for p in prompts:
    body = {"model": model, "prompt": p, "max_tokens": 32, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    c = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0]
    out.append({"prompt": p, "text": c["text"], "logprobs": c["logprobs"]["token_logprobs"]})
json.dump(out, open(path, "w"), indent=1)
PYEOF
}
P=$(port)
$PY -m pdserve up "${common[@]}" --port "$P" --log-dir "$LOGS" > "$LOGS/up.out" 2>&1 &
UP=$!
echo "== pdserve up ($SECONDS s)"
wait_ready "http://127.0.0.1:$P" $UP && answer "http://127.0.0.1:$P" "$OUT/pd.json"
kill -INT $UP; wait $UP 2>/dev/null
M=$(port)
$PY -m pdserve serve "${common[@]}" --port "$M" > "$LOGS/mixed.log" 2>&1 &
MX=$!
echo "== mixed worker ($SECONDS s)"
wait_ready "http://127.0.0.1:$M" $MX && answer "http://127.0.0.1:$M" "$OUT/mixed.json"
kill $MX; wait $MX 2>/dev/null
$PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
pd, mx = (json.loads((out / f).read_text()) for f in ("pd.json", "mixed.json"))
rows = [{"prompt": a["prompt"], "same_text": a["text"] == b["text"],
         "max_abs_logprob_diff": max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))}
        for a, b in zip(pd, mx)]
for r in rows:
    print(f"{'SAME' if r['same_text'] else 'DIFF'} max|dlogprob|={r['max_abs_logprob_diff']:.2e} {r['prompt']!r}")
same = sum(r["same_text"] for r in rows)
print(f"parity: {same}/{len(rows)} identical greedy outputs")
(out / "parity.json").write_text(json.dumps({"identical": same, "of": len(rows), "rows": rows}, indent=1))
PYEOF
echo "== end at $SECONDS s"
