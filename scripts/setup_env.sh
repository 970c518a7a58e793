#!/usr/bin/env bash
# Set up a Python that has torch, triton, this package and its test/bench extras;
# print that Python's path on stdout (everything else goes to stderr).
#
# * A python3 that already has torch and triton (the GPU machine: no network)
#   is used as it is: torch is never reinstalled, and only what is missing of
#   the extras is installed.
# * Otherwise a virtualenv .venv gets the CPU build of torch 2.13.0 (from the
#   local wheel cache where the machine has one, else PyPI) and triton, whose
#   interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors.
set -euo pipefail
cd "$(dirname "$0")/.."

if python3 -c "import torch, triton" >/dev/null 2>&1; then
    PY=python3
else
    [ -x .venv/bin/python ] || python3 -m venv .venv >&2
    PY=.venv/bin/python
    if ! $PY -c "import torch, triton" >/dev/null 2>&1; then
        # Pinned: an unpinned torch pulls a multi-GB CUDA build.
        $PY -m pip install -q torch==2.13.0 triton >&2
    fi
fi

# Extras: install only what is missing (pytest, hypothesis, numpy, transformers for tests;
# nvidia-ml-py, matplotlib, tqdm for the benchmark).
missing=$($PY - <<'PYEOF'
import importlib.util
need = {"pytest": "pytest", "hypothesis": "hypothesis", "numpy": "numpy",
        "transformers": "transformers",
        "pynvml": "nvidia-ml-py", "matplotlib": "matplotlib", "tqdm": "tqdm"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
    $PY -m pip install -q $missing >&2
fi

# The package itself, editable, without touching dependencies or the network.
if ! (cd / && $PY -c "import eagle_capture.kernels") >/dev/null 2>&1 || \
   [ "$(cd / && $PY -c 'import eagle_capture, os; print(os.path.realpath(eagle_capture.__file__))' 2>/dev/null)" != "$(realpath eagle_capture/__init__.py)" ]; then
    $PY -m pip install -q --no-deps --no-build-isolation -e . >&2
fi
echo "$PY"
