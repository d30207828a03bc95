#!/usr/bin/env bash
# Issue 24's H200 figures in one call (about 7-8 minutes expected; the steps' timeouts add
# up to 9.5 minutes at worst; every step has its own and the script goes on when one fails). Run from the repository root on the GPU machine, with
# the wheels in ${WHEELS:-.whl} as for gpu_check.sh. Writes JSON and logs under ${OUT:-gpu24}
# and ends with a summary table (read back from the JSON).
#
#   1. offline.json: `pdserve bench offline`, random llama-3.1-8b, bf16, our engine only
#      (--ours-only), 128 output tokens, at 1, 64 and 256 prompts (GSM8K prompts), the
#      long-context row 32 x 4,096-token prompts and the prefill row 8 x 2,048; roofline =
#      max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in the run.
#      max_running_requests = 256 (graphs up to 256). Targets: 64 >= 10,000 tok/s,
#      256 >= 20,000, 1 >= 215, long-context decode step >= 0.8 of its roofline,
#      prefill >= 35,000 tok/s.
#   2. attention.json / attention_tiles.json: `pdserve bench attention`, the decode kernel
#      alone against its bytes: batch 1, 32, 64, 256 x 4,096-token contexts, uniform and
#      skewed (one row 4,096, the others 128), under the eager choice, the replayed graph's
#      (the new balanced split rule for contexts past 1,024) and the configurations the
#      graphs used before it (32, 4, 2, 1 splits of 64-token tiles); then the tiles, warps
#      and stages at 32 x 4,096 (the long-context row's shape).
#   3. gpu_tests.txt: the CUDA-graph tests (graphs == eager token for token, the page table
#      written by difference; every graph's logits in the one shared buffer).
#   4. offline_1024.json: bench offline at 1,024 prompts (graphs up to 1,024; their
#      logits now share one buffer, before they needed 67 GB).
# DRY_RUN=1: the same steps on CPU with random:tiny at toy shapes (Triton's interpreter),
# to check the script itself on a machine without a GPU (about 3 minutes).
set -x
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu24}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
. scripts/gpu_setup.sh
if [ "${DRY_RUN:-0}" = 1 ]; then
    export TRITON_INTERPRET=1
    M=(--model random:tiny --device cpu --dtype float32)
    A=(--device cpu --dtype float32 --num-heads 8 --num-kv-heads 2 --head-dim 16 --page-size 16 --iters 1)
    N=1,2 LONG=2x40 PRE=2x16 OUTLEN=4 BATCHES=1,2 CTX=64 BIG=3 TILE_B=2 T=5
    GPU_TESTS=0
else
    M=(--model random:llama-3.1-8b --device cuda --dtype bfloat16)
    A=(--device cuda --dtype bfloat16)
    N=1,64,256 LONG=32x4096 PRE=8x2048 OUTLEN=128 BATCHES=1,32,64,256 CTX=4096 BIG=1024 TILE_B=32 T=1
    GPU_TESTS=1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
fi
git log --oneline -1 2>/dev/null | tee "$OUT/commit.txt"

echo "== 1. bench offline $N + $LONG + prefill $PRE ($SECONDS s)"
timeout $((210 * T)) $PY -m pdserve bench offline "${M[@]}" --ours-only --num-prompts $N \
    --max-tokens $OUTLEN --repeats 2 --long-context $LONG --prefill $PRE \
    --json "$OUT/offline.json" 2>&1 | tail -20 | tee "$OUT/offline.txt"

echo "== 2. bench attention ($SECONDS s)"
timeout $((70 * T)) $PY -m pdserve bench attention "${A[@]}" --batch $BATCHES \
    --context $CTX --layout uniform,skewed \
    --configs eager,graph,32/64/4/2,4/64/4/2,2/64/4/2,1/64/4/2 \
    --json "$OUT/attention.json" 2>&1 | tail -52 | tee "$OUT/attention.txt"
timeout $((40 * T)) $PY -m pdserve bench attention "${A[@]}" --batch $TILE_B \
    --context $CTX --layout uniform \
    --configs 4/64/4/2,4/64/4/3,4/64/8/2,4/128/4/2,4/128/8/2,4/128/8/3,4/32/4/3,4/32/4/4,8/64/4/2,8/64/8/3 \
    --json "$OUT/attention_tiles.json" 2>&1 | tail -14 | tee "$OUT/attention_tiles.txt"

echo "== 3. gpu tests: graphs and kernels ($SECONDS s)"
if [ "$GPU_TESTS" = 1 ]; then
    # (the kernels' outputs on the GPU are checked against torch_sdpa by every row of step 2)
    timeout 80 $PY -m pytest -x -q --timeout=75 -m gpu tests/engine/test_cuda_graphs.py \
        -k "graphs_match_eager or short_context_graphs" -p no:cacheprovider 2>&1 | tail -8 \
        | tee "$OUT/gpu_tests.txt"
fi

echo "== 4. bench offline $BIG prompts ($SECONDS s)"
timeout $((150 * T)) $PY -m pdserve bench offline "${M[@]}" --ours-only --num-prompts $BIG \
    --max-tokens $OUTLEN --repeats 1 --json "$OUT/offline_1024.json" 2>&1 | tail -8 \
    | tee "$OUT/offline_1024.txt"

echo "== summary ($SECONDS s)"
$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError) as exc:
        print(f"{name}: missing ({exc.__class__.__name__})")
        return None
print(f"{'shape':>26} {'tok/s':>9} {'decode tok/s':>12} {'decode ms':>9} {'roof ms':>8} {'bound':>7} {'fraction':>8}")
for name in ("offline.json", "offline_1024.json"):
    rep = load(name)
    for r in (rep or {}).get("results", []):
        shape = f"{r['num_prompts']} x {r['mean_prompt_len']:.0f} in"
        dec = r.get("ours_decode_ms_per_step")
        dts = r.get("ours_decode_tok_s")
        print(f"{shape:>26} {r['ours_tok_s']:>9.0f} {dts or 0:>12.0f} {dec or 0:>9.2f} "
              f"{r['roofline_ms_per_step']:>8.2f} {r['roofline_bound']:>7} {r['roofline_fraction']:>8.2f}")
    if rep and rep.get("prefill"):
        p = rep["prefill"]
        print(f"{'prefill %d x %d' % (p['num_prompts'], p['prompt_len']):>26} {p['ours_tok_s']:>9.0f} prompt tok/s")
    if rep:
        print(f"  copy {rep['copy_bandwidth_bytes_per_s']/1e9:.1f} GB/s (read+write), "
              f"matmul {rep['matmul_flop_per_s']/1e12:.1f} TFLOP/s ({rep['dtype']})")
for name in ("attention.json", "attention_tiles.json"):
    rep = load(name)
    for r in (rep or {}).get("rows", []):
        if "error" in r:
            print(f"  attention {r['batch']} x {r['context']}: {r['error']}")
            continue
        cfg = f"{r['splits']}/{r['block_n']}/{r['num_warps']}/{r['num_stages']}"
        print(f"  attention {r['batch']:>4} x {r['context']} {r['layout']:>7} {r['config_spec']:>5} {cfg:>10}"
              f" {r['us_per_call']:>8.1f} us {r['fraction']:>5.2f} of copy  err {r['max_abs_diff_vs_sdpa']:.1e}")
print((out / "gpu_tests.txt").read_text() if (out / "gpu_tests.txt").exists() else "no gpu tests")
EOF
echo "== end at $SECONDS s"
