#!/usr/bin/env bash
# Build, on a machine with a package index, what the H200 (no network; image torch
# 2.11.0+cu130, Triton 3.6, nvcc 13, Python 3.12) needs to run SGLang's REAL engine for
# tools/gpu/gpu_sglang_engine.sh: SGLang 0.5.13 with its own kernel package sglang-kernel
# 0.4.3, trimmed to what an offline sglang.Engine(...) on one Hopper GPU uses with
# SGLang's Triton attention backend, and the light pure-Python dependencies the image lacks.
#
# Why this line: SGLang 0.5.13 pins torch 2.11.0, and sglang-kernel 0.4.3 is built against
# it (C++ ABI); 0.5.20+ kernels need torch 2.13/2.14 symbols and do not load on the image.
#
# Dropped, and why (none is on the path of an offline Engine(...) with the Triton attention
# backend and the PyTorch sampler on one H200):
#   sgl_kernel/flash_ops (FlashAttention 3, 1022 MiB: SGLang's default attention on Hopper;
#     too big to carry, so the engine runs attention_backend="triton", SGLang's own Triton
#     kernels), flashmla_ops (MLA), sm100/ (Blackwell), mscclpp (custom all-reduce for
#     TP > 1), triton_kernels (gpt-oss MoE);
#   flashinfer/data/cutlass and cccl (most of its 63 MiB of JIT sources; its csrc and include
#     stay: sgl_kernel 0.4.3's rmsnorm JIT-compiles FlashInfer's norm.cu on first use);
#   sglang/multimodal_gen (diffusion serving), sglang/srt/grpc/_core (the gRPC server),
#     jit_kernel/tests and jit_kernel/benchmark, __pycache__, the RECORDs.
# sm90/common_ops keeps only its sm_90 kernels (tools/gpu/fatbin_sm90.py: sm_80/89/100/103/120
# copies dropped; the ELF layout is unchanged). SGLang's jit_kernel (norm, rope, activation)
# compiles with nvcc through apache-tvm-ffi on first use: its sources stay.
# libnuma.so.1 (sgl_kernel's common_ops needs it) travels for an image that lacks it.
#
# Output (ignored folders; carry both with the repository, under a call's 64 MiB):
#   .sglang_engine/sglang.tar.xz   SGLang's Python tree, sgl_kernel (sm_90 only), flashinfer
#                                  (JIT sources without cutlass / cccl), their dist-info (SGLang checks versions)
#   .sglang_engine/libnuma.so.1
#   .whl_sglang/                   transformers 5.8.1, tvm-ffi, pydantic, pyzmq, ... (--no-deps)
set -euo pipefail
cd "$(dirname "$0")/../.."
SGLANG_VERSION=0.5.13 KERNEL_VERSION=0.4.3 FLASHINFER_VERSION=0.6.12
say() { echo "make_sglang_engine_bundle: $*" >&2; }
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
for d in .sglang_engine .whl_sglang; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .sglang_engine .whl_sglang && mkdir -p .sglang_engine .whl_sglang
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
     --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
     --platform manylinux1_x86_64 --platform any)
say "downloading sglang==$SGLANG_VERSION, sglang-kernel==$KERNEL_VERSION (~308 MiB)," \
    "flashinfer-python==$FLASHINFER_VERSION"
"${PIP[@]}" -d "$WORK" "sglang==$SGLANG_VERSION" "sglang-kernel==$KERNEL_VERSION" \
    "flashinfer-python==$FLASHINFER_VERSION" >&2
T="$WORK/tree"; mkdir -p "$T"
python3 -m zipfile -e "$WORK"/sglang-"$SGLANG_VERSION"-*.whl "$T"
python3 -m zipfile -e "$WORK"/flashinfer_python-"$FLASHINFER_VERSION"-*.whl "$T"
# sglang-kernel: only its Python files, the sm_90 common_ops and the small spatial_ops
# (flash_ops alone is 1 GiB unpacked: never extracted).
python3 - "$WORK"/sglang_kernel-"$KERNEL_VERSION"-*.whl "$T" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("sglang_kernel-") or (name.startswith("sgl_kernel/") and (
                name.endswith(".py") or name in ("sgl_kernel/sm90/common_ops.abi3.so",
                                                 "sgl_kernel/spatial_ops.abi3.so"))):
            z.extract(name, dest)
EOF
cd "$T"
rm -rf flashinfer/data/cutlass flashinfer/data/cccl sglang/multimodal_gen sglang/srt/grpc/_core.*.so \
       sglang/jit_kernel/tests sglang/jit_kernel/benchmark sglang-*.dist-info/RECORD \
       flashinfer_python-*.dist-info/RECORD sglang_kernel-*.dist-info/RECORD
find . -name __pycache__ -prune -exec rm -rf {} +
EXT=sgl_kernel/sm90/common_ops.abi3.so
python3 "$OLDPWD/tools/gpu/fatbin_sm90.py" "$EXT" "$EXT.sm90" && mv "$EXT.sm90" "$EXT"
tar -cf - sglang sgl_kernel flashinfer sglang-*.dist-info sglang_kernel-*.dist-info \
    flashinfer_python-*.dist-info | xz -T0 -9e > "$OLDPWD/.sglang_engine/sglang.tar.xz"
cd "$OLDPWD"
# libnuma.so.1 from Debian's package (libc only): used on the GPU only if its image has none.
( cd "$WORK" && apt-get download -q libnuma1 >/dev/null 2>&1 && dpkg-deb -x libnuma1_*.deb numa ) \
    && cp -L "$WORK"/numa/usr/lib/x86_64-linux-gnu/libnuma.so.1 .sglang_engine/ \
    || say "libnuma1 not downloaded: the GPU image must have libnuma.so.1"
# What an offline Engine's import chain needs and the image lacks (read with an import walk
# of the engine, scheduler, model runner and EAGLE worker on a CPU machine; SGLang's METADATA
# pins where it has them). transformers: SGLang 0.5.13 pins 5.8.1 and fails on the image's
# 5.17 (its configs register "qwen3_asr", which 5.17 already has); 5.8.1 wants tokenizers
# <= 0.23.0 (the image has 0.23.2). IPython (sglang.utils imports IPython.display) with its
# own dependencies; loguru (compressed-tensors); dill. The image already has numpy, scipy,
# pillow, psutil, aiohttp, uvloop, requests, prometheus-client, einops, sentencepiece,
# safetensors, regex, pyyaml, typer, huggingface-hub 1.33, torchvision, nvidia-ml-py,
# cuda-bindings (flashinfer.comm), ninja, nvcc and triton 3.6.
# Pinned to the versions that import walk ran with.
"${PIP[@]}" -d .whl_sglang \
    transformers==5.8.1 tokenizers==0.22.2 apache-tvm-ffi==0.1.9 pydantic==2.14.4 \
    pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 msgspec==0.23.0 \
    pyzmq==27.3.0 orjson==3.13.0 pybase64==1.5.1 setproctitle==1.3.8 fastapi==0.165.0 opentelemetry-api \
    starlette==1.10.0 uvicorn==0.55.0 python-multipart==0.0.34 openai==2.6.1 distro==1.9.0 \
    jiter==0.19.0 sniffio==1.3.1 partial_json_parser==0.2.1.1.post7 interegular==0.3.3 \
    easydict==1.14 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 dill==0.4.1 \
    ipython==9.18.1 traitlets==5.16.1 decorator==5.3.1 jedi==0.20.1 parso==0.8.7 \
    matplotlib-inline==0.2.2 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack_data==0.6.3 \
    executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 pexpect==4.9.0 ptyprocess==0.7.0 \
    ipython_pygments_lexers==1.1.1 >&2
du -sh .sglang_engine/* .whl_sglang >&2
du -cb .sglang_engine/* .whl_sglang/* | tail -1 \
    | awk '{printf "make_sglang_engine_bundle: %.1f MiB to carry\n", $1/2^20}' >&2
