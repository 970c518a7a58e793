#!/usr/bin/env bash
# On the H200 (no network): SGLang 0.5.13's real engine with the eagle-capture plugin, from
# tools/gpu/make_sglang_engine_bundle.sh's folders (carry [".sglang_engine", ".whl_sglang"]).
#   bash tools/gpu/gpu_sglang_engine.sh smoke accept     # either or both, in that order
#   ACCEPT_ARGS="--modes graphs_bf16 --timeout 300" bash tools/gpu/gpu_sglang_engine.sh accept
# Installs once per machine (marker in /tmp/sglang_site), then runs
# benchmarks/sglang_engine.py; results and log lines land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; SITE=/tmp/sglang_site; mkdir -p "$OUT" "$SITE"
if [ ! -f "$SITE/.ok" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl_sglang/*.whl \
        || { echo "gpu_sglang_engine: wheels did not install"; exit 2; }
    tar -xJf .sglang_engine/sglang.tar.xz -C "$SITE" \
        || { echo "gpu_sglang_engine: the SGLang tree did not unpack"; exit 2; }
    # sgl_kernel's common_ops links libnuma; the carried copy serves only an image without one.
    if ! ldconfig -p | grep -q "libnuma.so.1 " && [ -f .sglang_engine/libnuma.so.1 ]; then
        mkdir -p "$SITE/.lib" && cp .sglang_engine/libnuma.so.1 "$SITE/.lib/"
    fi
    # The plugin's entry point (sglang.srt.plugins) comes from the package's metadata.
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null \
        || { echo "gpu_sglang_engine: the package did not install"; exit 2; }
    touch "$SITE/.ok"
fi
[ -d "$SITE/.lib" ] && export LD_LIBRARY_PATH="$SITE/.lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
rc=0
for step in "$@"; do
    extra=(); [ "$step" = accept ] && read -r -a extra <<< "${ACCEPT_ARGS:-}"
    python3 benchmarks/sglang_engine.py "$step" --out "$OUT" "${extra[@]}" 2>&1 \
        | tee "$OUT/$step.console" \
        | grep -E "^(SMOKE|ACCEPT|accept_)|eagle_capture|Error|error:" | cut -c1-400
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit $rc
