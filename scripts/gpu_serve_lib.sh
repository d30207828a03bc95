# Sourced by the serving scripts (scripts/gpu_serve_parity_sequential.sh): start-up,
# greedy answers and teardown of pdserve deployments, with PY set.
#   free_port                  an unused TCP port of 127.0.0.1
#   wait_ready URL PID [SECS]  until URL/health answers 200 (~1 s polls, default 900 s);
#                              fails when PID exits first or the time runs out
#   greedy_answers URL FILE    the parity prompts (PARITY_PROMPTS: how many of the six,
#                              PARITY_TOKENS: tokens each, default 32) greedy with per-token
#                              log-probs through URL's /v1/completions -> FILE (JSON list)
#   compare_answers A B FILE   token-for-token verdict of two greedy_answers files -> FILE
#                              (JSON: identical, of, rows with same_text, max_abs_logprob_diff)
#   stop PID [SIG]             signal (default INT) and wait for the process
free_port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_ready() {
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "${3:-900}" ]; do
    [ "$(curl -s -m 10 -o /dev/null -w '%{http_code}' "$1/health")" = 200 ] && { echo "ready after $((SECONDS - t0))s"; return 0; }
    kill -0 "$2" 2>/dev/null || { echo "the deployment died"; return 1; }
    sleep 1
  done
  echo "not ready after ${3:-900}s"
  return 1
}
greedy_answers() {
  $PY - "$1" "$2" <<'PYEOF'
import json, os, sys, httpx
url, path = sys.argv[1:3]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "The quick brown fox", "Water boils at"][: int(os.environ.get("PARITY_PROMPTS", 6))]
tokens = int(os.environ.get("PARITY_TOKENS", 32))
model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
out = []
for p in prompts:
    body = {"model": model, "prompt": p, "max_tokens": tokens, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
    if "choices" not in r:
        out.append({"prompt": p, "error": str(r)[:300]})
        continue
    c = r["choices"][0]
    out.append({"prompt": p, "text": c["text"], "logprobs": c["logprobs"]["token_logprobs"]})
json.dump(out, open(path, "w"), indent=1)
print(f"{len(out)} answers from {url}")
PYEOF
}
compare_answers() {
  $PY - "$1" "$2" "$3" <<'PYEOF'
import json, sys
a_path, b_path, out = sys.argv[1:4]
pd, mx = (json.load(open(p)) for p in (a_path, b_path))
rows = []
for a, b in zip(pd, mx):
    if "text" not in a or "text" not in b:
        rows.append({"prompt": a["prompt"], "same_text": False, "error": a.get("error") or b.get("error")})
        continue
    rows.append({"prompt": a["prompt"], "same_text": a["text"] == b["text"],
                 "same_len": len(a["logprobs"]) == len(b["logprobs"]),
                 "max_abs_logprob_diff": max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))})
for r in rows:
    d = r.get("max_abs_logprob_diff")
    print(f"{'SAME' if r['same_text'] else 'DIFF'} max|dlogprob|={d if d is None else f'{d:.2e}'} {r['prompt']!r}")
same = sum(r["same_text"] for r in rows)
print(f"parity: {same}/{len(rows)} identical greedy outputs")
json.dump({"identical": same, "of": len(rows), "rows": rows, "a": pd, "b": mx}, open(out, "w"), indent=1)
PYEOF
}
stop() { kill -"${2:-INT}" "$1" 2>/dev/null; wait "$1" 2>/dev/null; }
