#!/usr/bin/env bash
# Set up (scripts/setup_env.sh) and run the capture-latency benchmark: on the
# GPU when there is one, else the CPU path on small sizes. Extra arguments go
# to benchmarks/capture_latency.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup_env.sh)
exec $PY benchmarks/capture_latency.py "$@"
