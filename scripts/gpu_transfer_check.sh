#!/usr/bin/env bash
# One real KV transfer VRAM -> VRAM between two processes on one GPU, data checked, plus
# the transfer benchmark on CUDA. Usage (from the repository root, on the GPU machine):
#
#   scripts/gpu_transfer_check.sh [GPU_ID]          # default GPU 0; results in ${OUT:-gpu_check}/
#
# Needs python with torch (CUDA) plus: nixl (nixl-cu13 1.5.1 + nixl 1.5.1), pyzmq, msgspec,
# fastapi, uvicorn, httpx. Missing ones are installed from ${PDSERVE_WHEELS:-wheels}/ (no
# network needed) into ./site; fetch them on a machine with internet with
# scripts/fetch_gpu_wheels.sh (cp312, manylinux x86_64).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=${1:-0}
OUT=${OUT:-gpu_check}
PY=${PYTHON:-python3}
WHEELS=${PDSERVE_WHEELS:-wheels}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/site${PYTHONPATH:+:$PYTHONPATH}"

missing=$($PY - <<'PYEOF'
import importlib
need = {"nixl": "nixl", "zmq": "pyzmq", "msgspec": "msgspec", "fastapi": "fastapi", "uvicorn": "uvicorn",
        "httpx": "httpx"}
out = []
for mod, pkg in need.items():
    try:
        importlib.import_module(mod if mod != "nixl" else "nixl._api")
    except Exception:
        out.append(pkg)
print(" ".join(out))
PYEOF
)
if [ -n "$missing" ]; then
  echo "missing python packages: $missing"
  if [ -d "$WHEELS" ]; then
    $PY -m pip install --no-index --no-deps --target site "$WHEELS"/*.whl
  else
    echo "no wheel folder $WHEELS: run scripts/fetch_gpu_wheels.sh where there is internet" >&2
    exit 2
  fi
fi

echo "== device"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader -i "$GPU" || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name($GPU))"

echo "== pdserve doctor (NIXL on cuda:$GPU)"
$PY -m pdserve doctor --device cuda --gpu-id "$GPU" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/doctor.txt"

# The bench is the check: prefill (this process) WRITEs one request's KV pages from its
# VRAM pool into the decode process's VRAM pool through the real managers, then decode's
# pages are hashed against prefill's; any difference or failed room exits non-zero.
for RUN in 1 1000000; do
  echo "== bench transfer on cuda:$GPU, llama-3.1-8b bf16, 8192 tokens, pages in runs of $RUN"
  $PY -m pdserve bench transfer --device cuda --gpu-id "$GPU" --model-shape llama-3.1-8b \
      --dtype bfloat16 --prompt-len 8192 --page-size 16 --run-len "$RUN" --repeats 7 \
      --json "$OUT/transfer_cuda_run$RUN.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/transfer_cuda_run$RUN.txt"
done
echo "== 1 GiB contiguous (NIXL.md reference size)"
$PY -m pdserve bench transfer --device cuda --gpu-id "$GPU" --model-shape llama-3.1-8b --dtype bfloat16 \
    --prompt-len 8192 --page-size 1024 --run-len 1000000 --repeats 7 --json "$OUT/transfer_cuda_1gib.json" \
    2>&1 | grep -v "NIXL INFO" | tee "$OUT/transfer_cuda_1gib.txt"
echo "OK: VRAM transfers between two processes on cuda:$GPU checked; results in $OUT/"
