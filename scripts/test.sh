#!/usr/bin/env bash
# Set up (scripts/setup_env.sh) and run the test suite. Without a GPU the
# Triton kernels run under the interpreter (tests/conftest.py sets it); on a
# GPU machine the GPU tests run too. Extra arguments go to pytest: a file or a test
# id runs only that (bash scripts/test.sh tests/test_doctor.py); without one, pytest
# collects pyproject.toml's testpaths (tests/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup_env.sh)
# --durations: the slowest tests in every run's output (CI's too), so that the cost stays visible.
exec $PY -m pytest -q --durations=25 "$@"
