#!/usr/bin/env bash
# Download (no install) the wheels scripts/gpu_transfer_check.sh needs on a GPU machine
# without internet: Python 3.12, manylinux x86_64. Writes to ${PDSERVE_WHEELS:-wheels}/.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${PDSERVE_WHEELS:-wheels}
PIP=${PIP:-python3 -m pip}
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$DEST" nixl-cu13==1.5.1 nixl==1.5.1 pyzmq msgspec fastapi uvicorn starlette pydantic pydantic-core \
  annotated-types typing-inspection anyio sniffio h11 click typing-extensions annotated-doc idna \
  opentelemetry-api importlib-metadata zipp
ls -la "$DEST"
