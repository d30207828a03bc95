#!/usr/bin/env bash
# The MoE decode step against its roofline on one H200 (issue 27), under 240 s: branch moe5's
# few-token experts path (routing in the gate/up GEMV, weights + top-k sum in the down GEMV)
# and Qwen3's q/k norms inside the RoPE kernel. Three steps, each under its own timeout:
#   1. scripts/gpu_moe_layer_ab.py (~40 s): one sparse layer at 1-64 tokens, few-token
#      path vs the grouped kernels (main's path) and a few tiles each, in CUDA graphs,
#      against the layer's roofline -> moe_layer_ab.json;
#   2. bench offline --ours-only, random:qwen3-30b-a3b bf16, 1 and 64 prompts x 64 tokens,
#      fused experts, CUDA graphs, PDSERVE_MOE_ROUTING_STATS=1 (the roofline counts the
#      experts routed to) -> moe_decode.json (decode ms/step, roofline fraction);
#   3. scripts/gpu_step_profile.py at 1 prompt x 200 tokens: GPU kernels per step and their
#      time (torch.profiler over 8 decode steps), per kernel name -> moe_step_profile.json;
#      kernels per layer = (kernels per step - those outside the layers) / 48.
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
[ "$DEVICE" = cuda ] && timeout 45 $PY scripts/gpu_moe_layer_ab.py 2>&1 | grep -v "^USDT" | tail -40
echo "== 2. bench offline, 1 and 64 prompts x 64 tokens ($SECONDS s)"
PDSERVE_MOE_EXPERTS=fused PDSERVE_MOE_ROUTING_STATS=1 timeout 110 $PY -m pdserve bench offline \
    --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --ours-only --num-prompts 1,64 \
    --max-tokens 64 --repeats 1 --json "$OUT/moe_decode.json" 2>&1 | grep -v "^USDT" | tail -8
echo "== 3. kernels of a 1-prompt decode step ($SECONDS s)"
PDSERVE_MOE_EXPERTS=fused timeout 75 $PY scripts/gpu_step_profile.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    --max-running-requests 4 --kv-cache-memory 8 --steps 8 --top 40 \
    --json moe_step_profile.json 1x200 2>&1 | grep -v "^USDT" | tail -45
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
    r = json.loads(p.read_text())["1x200"]
    counts = r["kernel_counts_per_step"]
    # a layer's kernels run 48 times a step; the rest (embedding, final norm, LM head,
    # sampling) a few times
    per_layer = sum(c for c in counts.values() if c >= 47.5) / 48
    summary["profile 1 prompt"] = {
        "step_ms": r["step_ms"], "kernel_ms": r["kernel_ms"], "gap_ms": r["gap_ms"],
        "kernels_per_step": r["kernels_per_step"], "kernels_per_layer": per_layer,
        "kernel_us_per_layer": 1e3 * sum(v for k, v in r["top_kernels_ms"].items()
                                         if counts.get(k, 0) >= 47.5) / 48,
        "graph_launches_per_step": r["graph_launches_per_step"]}
for key, row in summary.items():
    print(f"{key:>18}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in row.items()))
(out / "moe_decode_summary.json").write_text(json.dumps(summary, indent=1))
EOF
echo "== end at $SECONDS s"
