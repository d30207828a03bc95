#!/usr/bin/env bash
# Session 6, after the decode picks (model/decode_attn_table.py) are committed: confirm them
# in the engine (issue 24). About 2-2.5 minutes (one 8B model load). Run from the repository
# root on the GPU machine with the wheels in ${WHEELS:-.whl}. Writes under ${OUT}:
#   greedy_test.txt: the gpu-marked greedy-pick tests (ids = torch.argmax, logprobs =
#     log_softmax at Llama-3's vocabulary, 1/64/256 rows) and the fp32-logits GEMM's
#     (tests/model/test_logits_fp32.py);
#   step_profile.json / step_profile.txt: scripts/gpu_step_profile.py 64x200 256x200
#     32x4096: random:llama-3.1-8b bf16, graphs up to 256; per shape the engine step's wall
#     time, its kernels' GPU time per name (decode_split_kernel; greedy_partial_kernel and
#     greedy_merge_kernel where cunn_SoftMaxForward + argmax were; no bf16->fp32 cast after
#     the lm_head GEMM), to set against docs/figures/h200_s4/step_profile.json (64x200:
#     5.39 ms a step, decode_split_kernel 0.749 ms, softmax 0.038 + argmax 0.039).
# DRY_RUN=1: the same on CPU (random:tiny, toy shapes) to check the script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s6_attn_confirm}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}  # pdserve from this tree
. scripts/gpu_setup.sh
if [ "${DRY_RUN:-0}" = 1 ]; then
    export TRITON_INTERPRET=1
    P=(--device cpu --model random:tiny --dtype float32 --kv-cache-memory 0.1 --max-running-requests 4 --steps 2 4x20)
    MARK="not gpu"
else
    P=(64x200 256x200 32x4096)
    MARK=gpu
fi
timeout 25 $PY -m pytest -q -p no:cacheprovider -m "$MARK" tests/model/test_triton_greedy.py tests/model/test_logits_fp32.py 2>&1 | tail -3 | tee "$OUT/greedy_test.txt"
timeout 150 $PY scripts/gpu_step_profile.py --json step_profile.json "${P[@]}" 2>&1 | tee "$OUT/step_profile.txt" | tail -40
echo "step profile rc=${PIPESTATUS[0]}"
ls -la "$OUT"
