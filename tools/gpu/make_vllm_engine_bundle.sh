#!/usr/bin/env bash
# Build, on a machine with a package index, what the H200 (no network; image torch
# 2.11.0+cu130, Triton 3.6, Python 3.12) needs to run vLLM's REAL CUDA engine for
# tools/gpu/gpu_vllm_engine.sh: vLLM's own CUDA wheel, trimmed to what an offline
# LLM(...) on one Hopper GPU uses, and the light pure-Python dependencies the image lacks.
#
#   bash tools/gpu/make_vllm_engine_bundle.sh [VERSION]     # 0.32.0 (default) or 0.34.0
#
# Why this vLLM runs on that torch: from 0.29 every vLLM extension is built on LibTorch's
# stable C ABI with TORCH_TARGET_VERSION 2.11 (no mangled c10/at symbols), so the kernels
# load under the image's torch 2.11 although the metadata pins torch 2.13 (0.32.0) or 2.14
# (0.34.0). Checked here on the kept extensions (tools/gpu/torch_abi_check.py: no LibTorch C++
# symbol; with TORCH_ABI_WHEEL=/path/torch-2.11.0-...whl also every stable C ABI symbol
# defined by that torch).
#
# Dropped, and why (none is on the path of an offline LLM(...) on an H200):
#   vllm-rs (the Rust HTTP frontend), fmha_sm100 / deep_gemm (Blackwell, FP8 GEMM),
#   _vllm_fa2_C (FlashAttention 2: FA3 serves Hopper), _qutlass_C, _flashkda_C,
#   _deepselect_C, _moe_C (MoE kernels: the engine runs here are dense), the RECORD.
# _C_stable_libtorch keeps only its sm_90 kernels (tools/gpu/fatbin_sm90.py: 51.9 MiB of
# mostly other architectures; the ELF layout is unchanged).
#
# 0.34.0 also drops vllm/third_party/tml_fa4 (FlashAttention 4, Blackwell) and
# _flashmla_C / _flashmla_extension_C (FlashMLA: the engine runs here are dense, no MLA).
#
# Output (ignored folders; carry both, ~55 MiB with the repository, under a call's 64 MiB):
#   .vllm_engine/vllm_C.tar.xz     _C_stable_libtorch, sm_90 only
#   .vllm_engine/vllm_rest.tar.xz  vLLM's Python tree, FA3 and the small extensions
#   .vllm_engine/VERSION           the vLLM version (tools/gpu/gpu_vllm_engine.sh checks it)
#   .whl/                          pydantic, msgspec, pyzmq, openai, xgrammar, ... (--no-deps)
#   .vllm_cutlass_0/, .vllm_cutlass_1/   (0.34.0) nvidia-cutlass-dsl's cu13 libraries, an
#                                  xz tar in two halves: a third and a fourth call's carry
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=${1:-0.32.0}
CUTLASS_LIBS=""
say() { echo "make_vllm_engine_bundle: $*" >&2; }
# Per version: what else is dropped, and vLLM's own pins (its METADATA) of the wheels below.
case "$VLLM_VERSION" in
    0.32.0) EXTRA_DROP=""
            PINS="xgrammar==0.2.8 apache-tvm-ffi llguidance compressed-tensors==0.17.0" ;;
    # (0.34.0 also pins llguidance >=1.7,<1.8, not offered for cp312 manylinux_2_28: the
    # index's newest, as for 0.32.0; only structured outputs use it, not these runs.)
    # 0.34.0 requires nvidia-cutlass-dsl[cu13] 4.8.0: vLLM's kernel warm-up imports its
    # CuTe-DSL kernels (MiniMax-M3's) on every CUDA start, whatever the model. Its cu13
    # library wheel (92 MB) is repacked as xz (66 MB) and split over two carry folders.
    # The `cutlass` package's Python files come from libs-core (libs-base's requirement):
    # without it `cutlass` is an empty namespace and the warm-up's import fails.
    0.34.0) EXTRA_DROP="vllm/third_party/tml_fa4 vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so"
            PINS="xgrammar==0.2.8 apache-tvm-ffi==0.1.11 llguidance compressed-tensors==0.17.0
                  quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0
                  nvidia-cutlass-dsl-libs-core==4.8.0"
            CUTLASS_LIBS="nvidia-cutlass-dsl-libs-cu13==4.8.0" ;;
    *) echo "make_vllm_engine_bundle: vLLM $VLLM_VERSION is not prepared here (0.32.0, 0.34.0)" >&2
       exit 2 ;;
esac
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
for d in .vllm_engine .whl .vllm_cutlass_0 .vllm_cutlass_1; do   # ignored (the device tool carries ignored folders only)
    git check-ignore -q "$d/" || echo "/$d/" >> "$(git rev-parse --git-path info/exclude)"
done
rm -rf .vllm_engine .whl .vllm_cutlass_0 .vllm_cutlass_1 && mkdir -p .vllm_engine .whl
say "downloading vllm==$VLLM_VERSION (CUDA wheel, 230 - 320 MiB)"
# VLLM_WHEEL_DIR=/dir: a wheel already downloaded there is used.
FIND_LINKS=(); if [ -n "${VLLM_WHEEL_DIR:-}" ]; then FIND_LINKS=(--find-links "$VLLM_WHEEL_DIR"); fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 "${FIND_LINKS[@]}" -d "$WORK" "vllm==$VLLM_VERSION" >&2
mkdir -p "$WORK/tree" && python3 -m zipfile -e "$WORK"/vllm-"$VLLM_VERSION"-*.whl "$WORK/tree"
cd "$WORK/tree"
rm -rf vllm/vllm-rs vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm \
       vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_qutlass_C.abi3.so vllm/_flashkda_C.abi3.so \
       vllm/_deepselect_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so \
       "vllm-$VLLM_VERSION.dist-info/RECORD" $EXTRA_DROP
find . -name __pycache__ -prune -exec rm -rf {} +
EXT=vllm/_C_stable_libtorch.abi3.so
# Every kept extension must load under the image's torch 2.11 (see above).
python3 "$OLDPWD/tools/gpu/torch_abi_check.py" $(find vllm -name '*.so') \
    ${TORCH_ABI_WHEEL:+--torch-wheel "$TORCH_ABI_WHEEL"} >&2
python3 "$OLDPWD/tools/gpu/fatbin_sm90.py" "$EXT" "$EXT.sm90" && mv "$EXT.sm90" "$EXT"
tar -cf - "$EXT" | xz -T0 -9e > "$OLDPWD/.vllm_engine/vllm_C.tar.xz"
tar -cf - --exclude="$EXT" vllm "vllm-$VLLM_VERSION.dist-info" | xz -T0 -9e > "$OLDPWD/.vllm_engine/vllm_rest.tar.xz"
cd "$OLDPWD"
echo "$VLLM_VERSION" > .vllm_engine/VERSION
# vLLM's own pins where its METADATA has them; the image already has numpy, numba,
# cuda-bindings, nvidia-ml-py, triton 3.6 and transformers 5.17 (in vLLM's range).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
    pydantic pydantic_core annotated_types typing_inspection msgspec pyzmq fastapi starlette \
    openai distro jiter sniffio cbor2 pybase64 partial_json_parser cachetools \
    $PINS openai-harmony loguru httpx2 httpcore2 truststore opentelemetry-api >&2
if [ -n "$CUTLASS_LIBS" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$WORK/cutlass" "$CUTLASS_LIBS" >&2
    mkdir -p "$WORK/cutlass/tree" .vllm_cutlass_0 .vllm_cutlass_1
    python3 -m zipfile -e "$WORK"/cutlass/*.whl "$WORK/cutlass/tree"
    # Unpacked into the site folder as pip would (the wheel's files and its dist-info).
    tar -C "$WORK/cutlass/tree" -cf - . | xz -T0 -6 > "$WORK/cutlass/libs.tar.xz"
    half=$(( ($(stat -c %s "$WORK/cutlass/libs.tar.xz") + 1) / 2 ))
    split -b "$half" -d -a 1 "$WORK/cutlass/libs.tar.xz" "$WORK/cutlass/part"
    mv "$WORK/cutlass/part0" .vllm_cutlass_0/ && mv "$WORK/cutlass/part1" .vllm_cutlass_1/
fi
du -sh .vllm_engine/* .whl .vllm_cutlass_* 2>/dev/null >&2
du -cb .vllm_engine/* .whl/* .vllm_cutlass_*/* 2>/dev/null | tail -1 | awk '{printf "make_vllm_engine_bundle: %.1f MiB to carry\n", $1/2^20}' >&2
