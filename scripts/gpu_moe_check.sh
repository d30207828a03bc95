#!/usr/bin/env bash
# The mixture-of-experts check on one H200 (issue 27), ~6 min: the gpu-marked MoE kernel
# tests, then `pdserve bench offline` on random:qwen3-30b-a3b (bf16, 48 layers, 128 experts,
# 8 per token) twice in one run:
#   1. fused: the Triton grouped-GEMM experts, CUDA graphs on; 1 and 64 prompts x 128
#      output tokens and a prefill row of 8 x 2,048 tokens; the roofline counts the bytes of
#      the experts each batch routed to (PDSERVE_MOE_ROUTING_STATS=1: its counters run in
#      the timed steps, so the figures are a little pessimistic);
#   2. loop: the per-expert torch loop (PDSERVE_MOE_EXPERTS=loop; it syncs with the host,
#      so eager), fewer output tokens (LOOP_TOKENS, default 16) to stay in the budget: compare
#      decode ms/step and the prefill row, not tok/s of the whole run.
# Our side only (`--ours-only`, from branch gpu / issue 24): transformers' copy of a 61 GB
# model does not fit beside ours on one H200.
# Run from the repository root on the GPU machine; writes moe_fused.json, moe_loop.json and
# moe_summary.json under ${OUT:-gpu_moe}. Missing wheels/tokenizer: as scripts/gpu_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_moe}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
MODEL=${MODEL:-random:qwen3-30b-a3b}
LOOP_TOKENS=${LOOP_TOKENS:-16}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
if ! $PY -m pdserve bench offline --help | grep -q -- --ours-only; then
    echo "bench offline has no --ours-only here (merge branch gpu, issue 24, first)"; exit 2
fi
echo "== gpu-marked MoE tests"
timeout 210 $PY -m pytest -x -q --timeout=140 -m gpu tests/model/test_triton_moe.py \
    tests/model/test_moe.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
O=(--model "$MODEL" --device cuda --dtype bfloat16 --ours-only --prefill 8x2048)
echo "== bench offline, fused experts ($SECONDS s)"
PDSERVE_MOE_EXPERTS=fused PDSERVE_MOE_ROUTING_STATS=1 timeout 160 $PY -m pdserve bench offline \
    "${O[@]}" --num-prompts 1,64 --max-tokens 128 --repeats 2 --json "$OUT/moe_fused.json" 2>&1 | tail -8
echo "== bench offline, per-expert loop, eager ($SECONDS s)"
PDSERVE_MOE_EXPERTS=loop PDSERVE_MOE_ROUTING_STATS=1 timeout 130 $PY -m pdserve bench offline \
    "${O[@]}" --num-prompts 1,64 --max-tokens "$LOOP_TOKENS" --repeats 1 --enforce-eager \
    --json "$OUT/moe_loop.json" 2>&1 | tail -8
$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {k: json.loads((out / f"moe_{k}.json").read_text()) for k in ("fused", "loop")
        if (out / f"moe_{k}.json").is_file()}
summary = {}
for kind, r in runs.items():
    for row in r["results"]:
        key = f"{kind} {row['num_prompts']} prompts"
        summary[key] = {k: row.get(k) for k in ("ours_tok_s", "ours_decode_tok_s",
                        "ours_decode_ms_per_step", "roofline_ms_per_step", "roofline_fraction",
                        "step_bytes")}
    if r.get("prefill"):
        summary[f"{kind} prefill"] = {"prompt_tok_s": r["prefill"]["ours_tok_s"],
                                      "num_prompts": r["prefill"]["num_prompts"],
                                      "prompt_len": r["prefill"]["prompt_len"]}
for key, row in summary.items():
    print(f"{key:>20}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in row.items()))
(out / "moe_summary.json").write_text(json.dumps(summary, indent=1))
EOF
echo "== end at $SECONDS s"
