#!/usr/bin/env bash
# Prepare everything needed to import the REAL SGLang wheel VERSION with the
# test venv's python on a CPU-only machine, for tests/sglang_real/.
#
#   tools/sglang_real_env.sh VERSION      # e.g. 0.5.13; prints the overlay dir
#
# * Shared light, pure-Python-ish dependencies of sglang's import graph are
#   installed once into the test python (normal pip resolution; none of them
#   depends on torch, so torch is never touched). Marker: <sys.prefix>/.sglang-real-shared-ok
# * Per version, an overlay dir .cache/sglang/VERSION gets `sglang==VERSION`
#   and the transformers that version pins (plus, for the 4.x pin, the
#   huggingface_hub / tokenizers it accepts), all with --no-deps, so nothing
#   heavy (torch, flashinfer, sgl-kernel, ...) is ever pulled. The overlay goes
#   first on PYTHONPATH / sys.path; GPU-only modules are stubbed at import time
#   by tests/sglang_real/stubs.py. Marker: .cache/sglang/VERSION/.ok
# * A second run is a no-op (marker files). pip's normal cache is used, so a
#   re-created overlay does not download again.
# * SGLANG_WHEEL_DIR=/dir adds a --find-links for locally downloaded wheels.
# * PY=/path/to/python overrides the interpreter (default: .venv/bin/python,
#   else what scripts/setup_env.sh prints).
# * SGLANG_REAL_CACHE=/dir overrides the overlay root (default .cache/sglang).
#
# Everything but the overlay path goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

VER="${1:?usage: $0 SGLANG_VERSION}"

if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(bash scripts/setup_env.sh); fi
fi

CACHE="${SGLANG_REAL_CACHE:-.cache/sglang}"
OVERLAY="$CACHE/$VER"
mkdir -p "$CACHE"

case "$VER" in
    # transformers checks huggingface-hub / tokenizers ranges at import time;
    # the overlay carries versions inside them (the venv's may be newer).
    0.5.9)         TF=4.57.1; EXTRA="huggingface_hub>=0.34,<1.0 tokenizers>=0.22,<=0.23.0" ;;
    0.5.13|0.5.14) TF=5.8.1;  EXTRA="huggingface_hub>=1.5,<2.0 tokenizers>=0.22,<=0.23.0" ;;
    0.5.17|0.5.18|0.5.20) TF=5.12.1; EXTRA="huggingface_hub>=1.5,<2.0 tokenizers>=0.22,<=0.23.0" ;;
    0.5.22|0.5.23) TF=5.19.0; EXTRA="huggingface_hub>=1.31,<3.0 tokenizers>=0.23.1,<0.24" ;;
    *) echo "sglang_real_env.sh: no transformers pin known for sglang $VER" >&2; exit 2 ;;
esac

FIND_LINKS=()
if [ -n "${SGLANG_WHEEL_DIR:-}" ]; then FIND_LINKS=(--find-links "$SGLANG_WHEEL_DIR"); fi

# Light deps of sglang's import graph, as far as building and running
# DeepseekV2ForCausalLM needs them (server_args, the OpenAI protocol models,
# distributed utils, model config import these at module level; checked per
# version 0.5.9 - 0.5.23 with sys.modules after a smoke run). Pure Python or
# small manylinux wheels; none requires torch. httpx: transformers 5.x's hub.
SHARED_DEPS=(
    orjson psutil pydantic msgspec pyzmq pybase64 aiohttp fastapi uvicorn
    partial_json_parser pillow sentencepiece scipy python-multipart dill openai
    einops requests tqdm httpx
)
# The marker lives in the environment it describes (a new venv redoes it).
SHARED_MARK="$("$PY" -c 'import sys; print(sys.prefix)')/.sglang-real-shared-ok"
SHARED_KEY="${SHARED_DEPS[*]}"
if [ ! -f "$SHARED_MARK" ] || [ "$(cat "$SHARED_MARK")" != "$SHARED_KEY" ]; then
    echo "sglang_real_env: installing shared light deps into $PY" >&2
    "$PY" -m pip install -q "${SHARED_DEPS[@]}" >&2
    # torch must still be the CPU build it was.
    "$PY" -c "import torch; assert '+cpu' in torch.__version__ or torch.cuda.is_available(), torch.__version__" >&2
    echo "$SHARED_KEY" > "$SHARED_MARK"
fi

MARK="$OVERLAY/.ok"
KEY="sglang==$VER transformers==$TF $EXTRA"
if [ ! -f "$MARK" ] || [ "$(cat "$MARK")" != "$KEY" ]; then
    echo "sglang_real_env: building overlay $OVERLAY ($KEY)" >&2
    rm -rf "$OVERLAY"
    read -r -a EXTRA_ARR <<< "$EXTRA"
    "$PY" -m pip install -q --no-deps --no-compile --target "$OVERLAY" \
        "${FIND_LINKS[@]}" "sglang==$VER" "transformers==$TF" "${EXTRA_ARR[@]}" >&2
    echo "$KEY" > "$MARK"
fi
realpath "$OVERLAY"
