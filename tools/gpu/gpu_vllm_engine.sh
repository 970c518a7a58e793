#!/usr/bin/env bash
# On the H200 (no network): vLLM's real CUDA engine with the eagle-capture plugin, from
# tools/gpu/make_vllm_engine_bundle.sh's folders (carry [".vllm_engine", ".whl"]).
#   bash tools/gpu/gpu_vllm_engine.sh [--vllm VERSION] smoke accept speed   # steps, in order
# VERSION (default 0.32.0) must be the bundle's (.vllm_engine/VERSION; 0.32.0 if absent).
# vLLM 0.34 has the V2 model runner only: accept runs V2, speed refuses (vllm_engine.py).
# Installs once per machine and version (/tmp/vllm_site, /tmp/vllm_site-VERSION for another
# version than 0.32.0), each part when it is
# there: a bundle over one call's carry limit (0.34.0's) travels in calls to the same
# warm machine, [".vllm_engine"] with no step, then [".whl", ".vllm_cutlass_0"], then
# [".vllm_cutlass_1"] with the steps (0.34.0's nvidia-cutlass-dsl libraries in two halves).
# Runs benchmarks/vllm_engine.py; results and log lines land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
VER=0.32.0
if [ "${1:-}" = "--vllm" ]; then VER=${2:?--vllm needs a version}; shift 2; fi
# 0.32.0 keeps its site folder of before (commands name PYTHONPATH=/tmp/vllm_site).
SITE=/tmp/vllm_site; [ "$VER" = 0.32.0 ] || SITE=/tmp/vllm_site-$VER
SITE=${VLLM_SITE:-$SITE}   # (another folder: the install's tests)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$SITE"
if ls .vllm_engine/*.tar.xz >/dev/null 2>&1; then
    BUNDLE=$(cat .vllm_engine/VERSION 2>/dev/null || echo 0.32.0)
    if [ "$BUNDLE" != "$VER" ]; then
        echo "gpu_vllm_engine: the bundle in .vllm_engine is vLLM $BUNDLE, not $VER" \
             "(bash tools/gpu/make_vllm_engine_bundle.sh $VER)"; exit 2
    fi
    if [ ! -f "$SITE/.engine_ok" ]; then
        for t in .vllm_engine/*.tar.xz; do
            tar -xJf "$t" -C "$SITE" || { echo "gpu_vllm_engine: $t did not unpack"; exit 2; }
        done
        touch "$SITE/.engine_ok"
    fi
fi
if [ ! -f "$SITE/.whl_ok" ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || { echo "gpu_vllm_engine: wheels did not install"; exit 2; }
    touch "$SITE/.whl_ok"
fi
# 0.34.0's cutlass halves: each copied aside when it arrives (a later call's carry may
# not hold it), unpacked when both are there and the wheels are installed (pip's --target
# install replaces a whole nvidia_cutlass_dsl/ folder: the libraries unpacked before it
# would be lost).
NEEDS_CUTLASS=0; [ "$VER" = 0.34.0 ] && NEEDS_CUTLASS=1
if [ $NEEDS_CUTLASS = 1 ] && [ ! -f "$SITE/.cutlass_ok" ]; then
    for i in 0 1; do
        [ -f ".vllm_cutlass_$i/part$i" ] && cp ".vllm_cutlass_$i/part$i" "$SITE/.cutlass_part$i"
    done
    if [ -f "$SITE/.cutlass_part0" ] && [ -f "$SITE/.cutlass_part1" ] && [ -f "$SITE/.whl_ok" ]; then
        cat "$SITE/.cutlass_part0" "$SITE/.cutlass_part1" | tar -xJf - -C "$SITE" \
            || { echo "gpu_vllm_engine: the cutlass libraries did not unpack"; exit 2; }
        rm -f "$SITE"/.cutlass_part? && touch "$SITE/.cutlass_ok"
    fi
fi
missing=""
[ -f "$SITE/.engine_ok" ] || missing="$missing .vllm_engine"
[ -f "$SITE/.whl_ok" ] || missing="$missing .whl"
if [ $NEEDS_CUTLASS = 1 ] && [ ! -f "$SITE/.cutlass_ok" ]; then
    [ -f "$SITE/.cutlass_part0" ] || missing="$missing .vllm_cutlass_0"
    [ -f "$SITE/.cutlass_part1" ] || missing="$missing .vllm_cutlass_1"
fi
if [ -n "$missing" ]; then
    echo "gpu_vllm_engine: vLLM $VER not installed yet on this machine: carry$missing"
    # With no step (a call that only carries a part) that is expected, unless the
    # caller needs vLLM now (REQUIRE_INSTALLED=1: tools/gpu/gpu_session.sh).
    [ $# = 0 ] && [ -z "${REQUIRE_INSTALLED:-}" ] && exit 0 || exit 2
fi
if [ ! -f "$SITE/.ok" ]; then
    # The plugin's entry point (vllm.general_plugins) comes from the package's metadata.
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null \
        || { echo "gpu_vllm_engine: the package did not install"; exit 2; }
    touch "$SITE/.ok"
fi
echo "gpu_vllm_engine: vLLM $VER installed in $SITE"
# vLLM's FlashInfer sampler is not carried (the torch sampler serves greedy decoding).
# nvidia-cutlass-dsl puts its packages on the path by a .pth file, which a PYTHONPATH
# folder does not run: its folder is named here.
CUTLASS_PATH=""; [ -d "$SITE/nvidia_cutlass_dsl/dsl_packages" ] && CUTLASS_PATH=":$SITE/nvidia_cutlass_dsl/dsl_packages"
export PYTHONPATH="$SITE$CUTLASS_PATH:$PWD" PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
rc=0
for step in "$@"; do
    # ACCEPT_ARGS / SPEED_ARGS: more options of that step (benchmarks/vllm_engine.py STEP --help)
    var=${step^^}_ARGS
    python3 benchmarks/vllm_engine.py "$step" --out "$OUT" ${!var:-} 2>&1 | tee "$OUT/$step.console" \
        | grep -E "^(SMOKE|ACCEPT|SPEED|accept_|speed_)|Error|error:|vllm_engine.py" | cut -c1-400
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit $rc
