#!/usr/bin/env bash
# Issue 27, session 6, confirm (<= 3 min on one H200): the MoE decode step of
# random:qwen3-30b-a3b (bf16, fused experts, CUDA graphs) with the committed tile table
# (pdserve/model/moe_table.py) and GEMV table, in one load of the model
# (scripts/gpu_moe_decode_profile.py): bench offline --ours-only at 1 and 64 prompts x 128
# tokens with PDSERVE_MOE_ROUTING_STATS=1 (the roofline counts the experts routed to), the
# prefill row 8 x 2,048, then the kernels of a 1- and a 64-row step under torch.profiler
# -> moe_decode.json, moe_step_profile_rows{1,64}.json, moe_confirm_summary.json.
# Run from the repository root on the GPU machine; OUT (default gpu_s6_moe_confirm).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s6_moe_confirm}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
MODEL=${MODEL:-random:qwen3-30b-a3b}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu MODEL=random:tiny-qwen3-moe DTYPE=float32 PREFILL=2x16: checks the script
DTYPE=${DTYPE:-bfloat16}
PREFILL=${PREFILL:-8x2048}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
echo "== bench offline 1 and 64 prompts x 128 tokens, prefill $PREFILL, the kernels of 1- and 64-row steps ($SECONDS s)"
PDSERVE_MOE_EXPERTS=fused PDSERVE_MOE_ROUTING_STATS=1 timeout 175 $PY scripts/gpu_moe_decode_profile.py \
    --profile-rows 1,64 --profile-context 200 --profile-steps 8 -- --model "$MODEL" \
    --device "$DEVICE" --dtype "$DTYPE" --num-prompts 1,64 --max-tokens 128 --repeats 1 \
    --prefill "$PREFILL" 2>&1 | grep -v "^USDT" | tail -45
$PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
p = out / "moe_decode.json"
if p.is_file():
    d = json.loads(p.read_text())
    for row in d["results"]:
        summary[f"{row['num_prompts']} prompts"] = {k: row.get(k) for k in (
            "ours_tok_s", "ours_decode_ms_per_step", "ours_step_ms_all_decoding",
            "steady_roofline_ms", "roofline_fraction", "run_roofline_fraction", "step_bytes")}
    if d.get("prefill"):
        summary["prefill"] = {k: d["prefill"].get(k) for k in ("num_prompts", "prompt_len", "ours_tok_s")}
for rows in (1, 64):
    p = out / f"moe_step_profile_rows{rows}.json"
    if p.is_file():
        r = json.loads(p.read_text())
        summary[f"profile {rows} rows"] = {k: r[k] for k in (
            "step_ms", "kernel_ms", "gap_ms", "kernels_per_step", "kernels_per_layer",
            "kernel_us_per_layer", "graph_launches_per_step")}
for key, row in summary.items():
    print(f"{key:>18}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in row.items()))
(out / "moe_confirm_summary.json").write_text(json.dumps(summary, indent=1))
PYEOF
echo "== end at $SECONDS s"
