#!/usr/bin/env bash
# Build, on a machine with a package index, what the H200 (no network; image torch
# 2.11.0+cu130, Triton 3.6, Python 3.12) needs to run vLLM's REAL CUDA engine for
# scripts/gpu_vllm_engine.sh: vLLM 0.32.0's own CUDA wheel, trimmed to what an offline
# LLM(...) on one Hopper GPU uses, and the light pure-Python dependencies the image lacks.
#
# Why this vLLM runs on that torch: from 0.29 every vLLM extension is built on LibTorch's
# stable C ABI with TORCH_TARGET_VERSION 2.11 (no mangled c10/at symbols), so 0.32.0's
# kernels load under the image's torch 2.11 although its metadata pins torch 2.13.
#
# Dropped, and why (none is on the path of an offline LLM(...) on an H200):
#   vllm-rs (the Rust HTTP frontend), fmha_sm100 / deep_gemm (Blackwell, FP8 GEMM),
#   _vllm_fa2_C (FlashAttention 2: FA3 serves Hopper), _qutlass_C, _flashkda_C,
#   _deepselect_C, _moe_C (MoE kernels: the engine runs here are dense), the RECORD.
# _C_stable_libtorch keeps only its sm_90 kernels (scripts/fatbin_sm90.py: 51.9 MiB of
# mostly other architectures; the ELF layout is unchanged).
#
# Output (ignored folders; carry both, ~55 MiB with the repository, under a call's 64 MiB):
#   .vllm_engine/vllm_C.tar.xz     _C_stable_libtorch, sm_90 only
#   .vllm_engine/vllm_rest.tar.xz  vLLM's Python tree, FA3 and the small extensions
#   .whl/                          pydantic, msgspec, pyzmq, openai, xgrammar, ... (--no-deps)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
say() { echo "make_vllm_engine_bundle: $*" >&2; }
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
for d in .vllm_engine .whl; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .vllm_engine .whl && mkdir -p .vllm_engine .whl
say "downloading vllm==$VLLM_VERSION (CUDA wheel, ~311 MiB)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$WORK" "vllm==$VLLM_VERSION" >&2
mkdir -p "$WORK/tree" && python3 -m zipfile -e "$WORK"/vllm-"$VLLM_VERSION"-*.whl "$WORK/tree"
cd "$WORK/tree"
rm -rf vllm/vllm-rs vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm \
       vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_qutlass_C.abi3.so vllm/_flashkda_C.abi3.so \
       vllm/_deepselect_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so \
       "vllm-$VLLM_VERSION.dist-info/RECORD"
find . -name __pycache__ -prune -exec rm -rf {} +
EXT=vllm/_C_stable_libtorch.abi3.so
python3 "$OLDPWD/scripts/fatbin_sm90.py" "$EXT" "$EXT.sm90" && mv "$EXT.sm90" "$EXT"
tar -cf - "$EXT" | xz -T0 -9e > "$OLDPWD/.vllm_engine/vllm_C.tar.xz"
tar -cf - --exclude="$EXT" vllm "vllm-$VLLM_VERSION.dist-info" | xz -T0 -9e > "$OLDPWD/.vllm_engine/vllm_rest.tar.xz"
cd "$OLDPWD"
# vLLM's own pins where its METADATA has them; the image already has numpy, numba,
# cuda-bindings, nvidia-ml-py, triton 3.6 and transformers 5.17 (in vLLM's range).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
    pydantic pydantic_core annotated_types typing_inspection msgspec pyzmq fastapi starlette \
    openai distro jiter sniffio cbor2 pybase64 partial_json_parser cachetools \
    "xgrammar==0.2.8" apache-tvm-ffi llguidance openai-harmony "compressed-tensors==0.17.0" \
    loguru httpx2 httpcore2 truststore opentelemetry-api >&2
du -sh .vllm_engine/* .whl >&2
du -cb .vllm_engine/* .whl/* | tail -1 | awk '{printf "make_vllm_engine_bundle: %.1f MiB to carry\n", $1/2^20}' >&2
