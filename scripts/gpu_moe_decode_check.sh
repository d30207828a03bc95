#!/usr/bin/env bash
# The MoE decode step against its roofline on one H200 (issue 27), under 240 s: branch moe5's
# few-token experts path (routing in the gate/up GEMV, weights + top-k sum in the down GEMV),
# the router GEMM inside add + RMSNorm, Qwen3's q/k norms inside the RoPE kernel. Two steps,
# each under its own timeout:
#   1. scripts/gpu_moe_layer_ab.py (<= 50 s): one sparse layer at 1-64 tokens, few-token
#      path vs the grouped kernels (main's path) and a few tiles each, in CUDA graphs,
#      against the layer's roofline -> moe_layer_ab.json;
#   2. scripts/gpu_moe_decode_profile.py, one load of the model: bench offline --ours-only's
#      rows (its own code), random:qwen3-30b-a3b bf16, 1 and 64 prompts x 64 tokens, fused
#      experts, CUDA graphs, PDSERVE_MOE_ROUTING_STATS=1 (the roofline counts the experts
#      routed to) -> moe_decode.json (decode ms/step, roofline fraction); then, counters off
#      and graphs captured again, a 1-prompt x 200-token decode step under torch.profiler
#      (8 steps): GPU kernels per step and per layer, time per kernel name ->
#      moe_step_profile.json.
# Then moe_decode_summary.json. Run from the repository root on the GPU machine; OUT
# (default gpu_moe_decode) gets the JSON. Wheels/tokenizer: as scripts/gpu_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_moe_decode}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
MODEL=${MODEL:-random:qwen3-30b-a3b}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu MODEL=random:tiny-qwen3-moe DTYPE=float32: checks the script
DTYPE=${DTYPE:-bfloat16}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
echo "== 1. one sparse layer: few-token path vs grouped ($SECONDS s)"
[ "$DEVICE" = cuda ] && timeout 50 $PY scripts/gpu_moe_layer_ab.py 2>&1 | grep -v "^USDT" | tail -40
echo "== 2. bench offline 1 and 64 prompts x 64 tokens, then the kernels of a 1-prompt step ($SECONDS s)"
PDSERVE_MOE_EXPERTS=fused PDSERVE_MOE_ROUTING_STATS=1 timeout 170 $PY scripts/gpu_moe_decode_profile.py \
    --profile-rows 1 --profile-context 200 --profile-steps 8 -- --model "$MODEL" \
    --device "$DEVICE" --dtype "$DTYPE" --num-prompts 1,64 --max-tokens 64 --repeats 1 \
    2>&1 | grep -v "^USDT" | tail -40
$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
p = out / "moe_decode.json"
if p.is_file():
    for row in json.loads(p.read_text())["results"]:
        summary[f"{row['num_prompts']} prompts"] = {k: row.get(k) for k in (
            "ours_tok_s", "ours_decode_ms_per_step", "roofline_ms_per_step",
            "run_roofline_fraction", "ours_step_ms_all_decoding", "steady_roofline_ms",
            "roofline_fraction", "step_bytes")}
p = out / "moe_step_profile.json"
if p.is_file():
    r = json.loads(p.read_text())
    summary["profile 1 prompt"] = {k: r[k] for k in (
        "step_ms", "kernel_ms", "gap_ms", "kernels_per_step", "kernels_per_layer",
        "kernel_us_per_layer", "graph_launches_per_step")}
for key, row in summary.items():
    print(f"{key:>18}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in row.items()))
(out / "moe_decode_summary.json").write_text(json.dumps(summary, indent=1))
EOF
echo "== end at $SECONDS s"
