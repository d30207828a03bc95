#!/usr/bin/env bash
# The KV-order / page-size / page-pattern matrix of `pdserve bench transfer` on one GPU
# (two processes on GPU ${GPU:-0}, Llama-3.1-8B shapes, bf16, one 8,192-token request = 1 GiB),
# merged into one JSON: ${OUT:-gpu_check}/h200_transfer.json (docs/figures/ keeps a copy).
# Needs what scripts/gpu_transfer_check.sh needs (pdserve + NIXL importable).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=${GPU:-0}
OUT=${OUT:-gpu_check}
TMP=$(mktemp -d)
mkdir -p "$OUT"
run() {  # name, then extra flags
  local name=$1; shift
  echo "== $name: $*"
  python3 -m pdserve bench transfer --device cuda --gpu-id "$GPU" --model-shape llama-3.1-8b \
    --dtype bfloat16 --prompt-len 8192 --repeats 7 --json "$TMP/$name.json" "$@" 2>&1 | grep -v "NIXL INFO"
}
run page_major_ps16_served --kv-order page_major --page-size 16 --pattern served
run page_major_ps16_runlen1 --kv-order page_major --page-size 16 --pattern runs --run-len 1
run layer_major_ps16_served --kv-order layer_major --page-size 16 --pattern served
run layer_major_ps16_runlen1 --kv-order layer_major --page-size 16 --pattern runs --run-len 1
run page_major_ps128_served --kv-order page_major --page-size 128 --pattern served
run page_major_ps128_runlen1 --kv-order page_major --page-size 128 --pattern runs --run-len 1
run page_major_ps64_runlen1 --kv-order page_major --page-size 64 --pattern runs --run-len 1
python3 - "$TMP" "$OUT/h200_transfer.json" <<'PY'
import json, os, sys
tmp, dest = sys.argv[1:]
runs = {f[:-5]: json.load(open(os.path.join(tmp, f))) for f in sorted(os.listdir(tmp))}
json.dump({"command": "scripts/gpu_transfer_orders.sh", "runs": runs}, open(dest, "w"), indent=1)
print(f"{'run':<28} {'ratio/copy':>10} {'ratio/raw':>9} {'GB/s':>8} {'descs':>6} {'1-page ms':>9}")
for name, r in runs.items():
    print(f"{name:<28} {r['ratio']:>10.3f} {r['ratio_to_raw_nixl']:>9.3f} {r['gbps']['nixl']:>8.1f} "
          f"{r['descriptors_merged']:>6} {r['fixed_cost_s']['prefill'] * 1e3:>9.3f}")
PY
