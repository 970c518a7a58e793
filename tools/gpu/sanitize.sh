#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over every
# kernel flavour (tools/gpu/sanitizer_sweep.py). GPU machine only. Usage:
#   bash tools/gpu/sanitize.sh [--quick | --dtypes "fp16 fp32"] [TOOLS...]
# The first tool compiles the kernels (Triton's cache serves the rest).
set -uo pipefail
cd "$(dirname "$0")/../.."
quick=""
if [ "${1:-}" = "--quick" ]; then quick="--quick"; shift; fi
if [ "${1:-}" = "--dtypes" ]; then quick="--dtypes $2"; shift 2; fi
tools=${*:-memcheck racecheck initcheck synccheck}
# The Python with torch, Triton and this package importable (set up offline if needed).
PY=$(bash scripts/setup_env.sh) || { echo "sanitize: scripts/setup_env.sh failed" >&2; exit 1; }
compute-sanitizer --version | tail -1
status=0
for tool in $tools; do
    echo "== $tool"
    # Triton's own allocations and torch's caching allocator pool make
    # leak checking meaningless here; errors in kernels are what we look for.
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" tools/gpu/sanitizer_sweep.py $quick \
        2>&1 | grep -E "ERROR SUMMARY|all [0-9]+ cases ok|MISMATCH|Error|error" | head -20
    rc=${PIPESTATUS[0]}
    echo "$tool exit code: $rc"
    [ "$rc" -eq 0 ] || status=1
done
exit $status
