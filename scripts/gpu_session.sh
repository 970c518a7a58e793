#!/usr/bin/env bash
# One device-tool call: GPU tests, the benchmark and the host-overhead breakdown, logs to $OUT
# (benchmarks/tune_kernel.py is the launch-parameter sweep, run separately).
set -uo pipefail
export PYTHONUNBUFFERED=1
# The GPU machine has no PyPI: the real-SGLang tests (CPU-only anyway) run in CI.
export EAGLE_CAPTURE_SKIP_SGLANG_REAL=1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv > "$OUT/smi.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/smi.txt"
bash scripts/test.sh -rs -p no:logging -p no:cacheprovider > "$OUT/tests.log" 2>&1; echo "tests rc=$?" >> "$OUT/tests.log"
tail -5 "$OUT/tests.log"
bash scripts/bench.sh --out "$OUT" "$@" > "$OUT/bench.log" 2>"$OUT/bench.err"; echo "bench rc=$?"
python3 benchmarks/host_overhead.py > "$OUT/host.log" 2>&1; echo "host rc=$?"
cat "$OUT/smi.txt" "$OUT/bench.log"; head -8 "$OUT/host.log"; tail -3 "$OUT/bench.err"
