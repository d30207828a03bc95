#!/usr/bin/env bash
# Issue 27, session 7, one H200 call (<= 330 s): MoE decode kernels and the 30B serve parity.
#   b. scripts/gpu_s7_moe.py (<= 90 s): route_align's variants alone at 1/8/16/64 tokens,
#      then one sparse layer at 1/16/64 tokens (uniform and concentrated routing): the
#      committed plans against 32-row tiles; the picks written into
#      pdserve/model/moe_table.py here (so a, c and d run them);
#   c. scripts/gpu_serve_parity_sequential.sh: random:qwen3-30b-a3b through `pdserve up`
#      (PD on GPU 0, every request through prefill + NIXL), stopped, then one mixed worker:
#      6 prompts x 32 tokens greedy, token for token (the time left, ~215 s);
#   a. the gpu-marked MoE tests (pytest -m gpu tests/model/test_triton_moe.py, <= 75 s),
#      beside c's mixed worker start-up (they time nothing);
#   d. if >= 150 s are left: bench offline --num-prompts 1,64 --max-tokens 128 with the picks.
# Everything lands in one JSON, $OUT/moe_s7.json (sweep, tests' tail, parity, bench).
# Usage (repository root, GPU machine): OUT=... bash scripts/gpu_s7_moe.sh
# CPU dry run: DEVICE=cpu MODEL=random:tiny-qwen3-moe SMOKE=1 TRITON_INTERPRET=1 (toy sweep).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s7_moe}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
MODEL=${MODEL:-random:qwen3-30b-a3b}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-330}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp pdserve/model/moe_table.py "$WORK/moe_table_committed.py"
echo "== b. route_align variants + layer sweep ($SECONDS s)"
OUT="$WORK/sweep" BUDGET_S=${SWEEP_S:-40} timeout -k 5 ${SWEEP_T:-90} $PY scripts/gpu_s7_moe.py > "$WORK/sweep.log" 2>&1
echo "rc $? ($SECONDS s)"
grep -v "^USDT" "$WORK/sweep.log" | grep -E "route_align T|WRONG|table picks|sweep done|Error|error|compiled|T +(1|16|64) " | tail -42
if [ -f "$WORK/sweep/moe_s7.json" ]; then
  $PY scripts/gpu_s7_moe.py --write-table "$WORK/sweep/moe_s7.json" | tail -1
  diff "$WORK/moe_table_committed.py" pdserve/model/moe_table.py | grep "^[<>]" | head -12
fi
LEFT=$((BUDGET - SECONDS - 20))
echo "== c. serve parity PD then mixed, $MODEL ($SECONDS s, $LEFT s left)"
OUT="$WORK/parity" timeout -k 10 "$LEFT" bash scripts/gpu_serve_parity_sequential.sh "$MODEL" "$DEVICE" > "$WORK/parity.log" 2>&1 &
PARITY=$!
# a. the tests beside the mixed worker's start-up (one 61 GB copy then; with PD's two, the
# Mixtral-shaped test's ~9 GB might not fit)
while kill -0 $PARITY 2>/dev/null && ! grep -q "== PD stopped" "$WORK/parity.log"; do sleep 1; done
TESTS_LEFT=$((BUDGET - SECONDS - 25)); [ "$TESTS_LEFT" -gt "${TESTS_T:-75}" ] && TESTS_LEFT=${TESTS_T:-75}
echo "== a. pytest -m gpu tests/model/test_triton_moe.py beside the mixed worker's start-up ($SECONDS s, <= $TESTS_LEFT s)"
[ "$TESTS_LEFT" -ge 10 ] && ( timeout -k 5 "$TESTS_LEFT" $PY -m pytest -q -p no:cacheprovider -m "${MARK:-gpu}" tests/model/test_triton_moe.py \
    > "$WORK/tests.txt" 2>&1; echo "pytest exit $?" >> "$WORK/tests.txt" ) &
TESTS=$!
wait $PARITY
echo "rc $? ($SECONDS s)"
grep -v "^USDT" "$WORK/parity.log" | grep -E "==|ready|SAME|DIFF|parity|died|answers|Error|error|memory" | tail -16
wait $TESTS
echo "== a. the tests' end ($SECONDS s)"
grep -v "^USDT" "$WORK/tests.txt" | grep -E "passed|failed|error|Error|FAILED|exit" | tail -8
LEFT=$((BUDGET - SECONDS - 20))
if [ "$LEFT" -ge "${BENCH_MIN_S:-150}" ]; then
  echo "== d. bench offline 1, 64 prompts x 128 tokens ($SECONDS s, $LEFT s left)"
  DT=bfloat16; [ "$DEVICE" = cpu ] && DT=float32
  PDSERVE_MOE_ROUTING_STATS=1 timeout -k 10 "$LEFT" $PY -m pdserve bench offline --model "$MODEL" \
    --device "$DEVICE" --dtype $DT --num-prompts 1,64 --max-tokens ${BENCH_TOKENS:-128} --repeats 1 \
    --ours-only --json "$WORK/bench.json" > "$WORK/bench.log" 2>&1
  echo "rc $? ($SECONDS s)"
  grep -v "^USDT" "$WORK/bench.log" | tail -8
else
  echo "== d. bench offline skipped ($LEFT s left)"
fi
$PY - "$WORK" "$OUT/moe_s7.json" <<'PYEOF'
import json, pathlib, sys
work, out = pathlib.Path(sys.argv[1]), sys.argv[2]
def load(p):
    p = work / p
    try:
        return json.loads(p.read_text())
    except Exception as exc:  # noqa: BLE001
        return {"missing": f"{p.name}: {type(exc).__name__}"}
def tail(p, n):
    p = work / p
    return [l for l in p.read_text(errors="replace").splitlines() if not l.startswith("USDT")][-n:] if p.is_file() else None
res = {"sweep": load("sweep/moe_s7.json"), "tests_tail": tail("tests.txt", 25),
       "parity": load("parity/parity.json"), "parity_log_tail": tail("parity.log", 30),
       "sweep_log_tail": tail("sweep.log", 15)}
b = load("bench.json")
if "results" in b:
    res["bench"] = {k: b.get(k) for k in ("model", "copy_bandwidth_bytes_per_s", "kv_pages")}
    res["bench"]["results"] = [{k: r.get(k) for k in (
        "num_prompts", "ours_tok_s", "ours_decode_ms_per_step", "ours_step_ms_all_decoding",
        "steady_roofline_ms", "roofline_fraction", "run_roofline_fraction", "step_bytes")}
        for r in b["results"]]
    for r in res["bench"]["results"]:
        print(f"bench {r['num_prompts']:>3} prompts: {r['ours_tok_s']:.1f} tok/s, step "
              f"{r['ours_step_ms_all_decoding']} ms, roofline fraction {r['roofline_fraction']}")
else:
    res["bench"] = b
    res["bench_log_tail"] = tail("bench.log", 15)
json.dump(res, open(out, "w"), indent=1)
sw = res["sweep"]
for r in sw.get("route_align", []):
    c = r["candidates"]
    ok = sorted((v["us"], n) for n, v in c.items() if v.get("ok"))
    d = c.get(r["default"], {}).get("us")
    print(f"route_align T {r['tokens']:>2} {r['regime']:<7} committed {d and round(d, 2)} us, best "
          + (f"{ok[0][1]} {ok[0][0]:.2f} us" if ok else "-")
          + f"; wrong {sum(1 for v in c.values() if v.get('ok') is False)}")
for r in sw.get("layers", []):
    c = r["candidates"]
    ok = sorted((v["us"], n) for n, v in c.items() if v.get("ok"))
    d = c.get(r.get("committed"), {})
    print(f"layer T {r['tokens']:>2} {r['regime']:<7} {r['routed_experts']:>3} exp: committed "
          f"{d.get('us') and round(d['us'], 1)} us ({d.get('fraction') and round(d['fraction'], 2)}), best "
          + (f"{ok[0][0]:.1f} us ({r['roofline_us'] / ok[0][0]:.2f}) {ok[0][1]}" if ok else "-"))
p = res["parity"]
print(f"parity: {p.get('identical')}/{p.get('of')} (PD ready {p.get('pd_ready_s')} s, mixed {p.get('mixed_ready_s')} s)")
print(f"table picks: {res['sweep'].get('table')}")
PYEOF
echo "== end at $SECONDS s"
