# Sourced by the serving scripts (gpu_serve_check.sh, gpu_s6_serve_confirm.sh,
# gpu_serve_parity_sequential.sh): start-up, greedy answers, the workers' reports and
# teardown of pdserve deployments, with PY set.
#   free_port                  an unused TCP port of 127.0.0.1
#   wait_ready URL PID [SECS]  until URL/health answers 200 (~1 s polls, default 900 s);
#                              fails when PID exits first or the time runs out
#   greedy_answers URL FILE    the parity prompts (PARITY_PROMPTS: how many of the six,
#                              PARITY_TOKENS: tokens each, default 32) greedy with per-token
#                              log-probs through URL's /v1/completions -> FILE (JSON list);
#                              PARITY_TIMEOUT: seconds a request may take (default 600)
#   compare_answers A B FILE   token-for-token verdict of two greedy_answers files -> FILE
#                              (JSON: identical, of, rows with same_text, max_abs_logprob_diff)
#   parity A B FILE            greedy_answers of URL A and of URL B, compare_answers -> FILE
#   worker_report ROUTER MIXED every worker's gc (pdserve/gc_watch.py) and Triton compiles
#                              after start-up (pdserve/triton_watch.py: a compile stalls):
#                              the router's workers, then the mixed worker at URL MIXED
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
    r = httpx.post(f"{url}/v1/completions", json=body,
                   timeout=float(os.environ.get("PARITY_TIMEOUT", 600))).json()
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
parity() {
  local d rc
  d=$(mktemp -d)
  greedy_answers "$1" "$d/a.json" && greedy_answers "$2" "$d/b.json" \
    && compare_answers "$d/a.json" "$d/b.json" "$3"
  rc=$?
  rm -rf "$d"
  return $rc
}
worker_report() {
  $PY - "$1" "$2" <<'PYEOF'
import sys, httpx
router, mixed = sys.argv[1:3]
urls = [w["url"] for w in httpx.get(f"{router}/get_server_info", timeout=20).json().get("workers", [])]
for url in [*urls, mixed]:
    info = httpx.get(f"{url}/get_server_info", timeout=20).json()
    gc, tr, wu = info.get("gc") or {}, info.get("triton") or {}, info.get("warmup") or {}
    pauses = gc.get("pause_seconds", {})
    print(f"{info.get('role')} {url}: gc collections {gc.get('collections')}, longest pause "
          f"{1e3 * gc.get('max_pause_seconds', 0):.1f} ms, pauses > 25 ms "
          f"{pauses.get('count', 0) - pauses.get('buckets', {}).get('0.025', 0)}, frozen "
          f"{gc.get('frozen_objects')}; Triton compiled at start-up {tr.get('compilations_at_startup')}, "
          f"after {tr.get('compilations_after_startup')} {tr.get('compilations_after_startup_by_kernel') or ''}"
          f"; warm-up {wu.get('steps')} steps, {wu.get('seconds', 0):.1f} s")
PYEOF
}
stop() { kill -"${2:-INT}" "$1" 2>/dev/null; wait "$1" 2>/dev/null; }
