#!/usr/bin/env bash
# Set up a Python that has torch, triton, this package and its test/bench extras;
# print that Python's path on stdout -- one line, nothing else (callers do
# PY=$(bash scripts/setup_env.sh)). Progress goes to stderr: a line before each
# long step, and pip's own output while torch installs.
#
# * A python3 that already has torch and triton (the GPU machine: no network)
#   is used as it is: torch is never reinstalled, and only what is missing of
#   the extras is installed.
# * Otherwise a virtualenv .venv gets the CPU build of torch 2.13.0, whose
#   Triton interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors.
#   On Linux x86_64 the requirement is torch==2.13.0+cpu: PyPI's torch there is
#   the CUDA build (~0.5 GB plus several GB of cuda-toolkit / nvidia-*
#   dependencies), so only a CPU wheel may satisfy it -- the local wheel
#   (/opt/wheels) on the CI machine, or PyTorch's CPU index elsewhere:
#       PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup_env.sh
#   EAGLE_CAPTURE_TORCH overrides the requirement (e.g. EAGLE_CAPTURE_TORCH=torch==2.13.0
#   to accept PyPI's build). On other platforms PyPI's torch 2.13.0 is taken.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup_env: $*" >&2; }

TORCH_VERSION=2.13.0
if [ -n "${EAGLE_CAPTURE_TORCH:-}" ]; then
    TORCH_SPEC=$EAGLE_CAPTURE_TORCH
    TORCH_WHAT="$TORCH_SPEC"
elif [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
    TORCH_SPEC="torch==${TORCH_VERSION}+cpu"
    TORCH_WHAT="torch ${TORCH_VERSION} (CPU build)"
else
    TORCH_SPEC="torch==${TORCH_VERSION}"
    TORCH_WHAT="torch ${TORCH_VERSION}"
fi

if python3 -c "import torch, triton" >/dev/null 2>&1; then
    PY=python3
else
    if [ ! -x .venv/bin/python ]; then
        say "creating the virtualenv .venv"
        python3 -m venv .venv >&2
    fi
    PY=.venv/bin/python
    if ! $PY -c "import torch, triton" >/dev/null 2>&1; then
        # Pinned: an unpinned torch pulls a multi-GB CUDA build. No -q: pip's
        # progress (and a download's progress bar) is the feedback for the longest step.
        say "installing ${TORCH_WHAT} and triton into .venv (a few minutes) ..."
        if ! $PY -m pip install "$TORCH_SPEC" triton >&2; then
            say "pip could not install ${TORCH_SPEC} and triton. If it found no such torch: PyPI"
            say "has no CPU build for this platform; point pip at PyTorch's CPU index with"
            say "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, or set"
            say "EAGLE_CAPTURE_TORCH=torch==${TORCH_VERSION} to take PyPI's (CUDA, multi-GB) build."
            exit 1
        fi
    fi
fi

# Extras: install only what is missing (pytest, pytest-xdist, hypothesis, numpy, transformers
# for tests;
# nvidia-ml-py, matplotlib, tqdm for the benchmark).
missing=$($PY - <<'PYEOF'
import importlib.util
need = {"pytest": "pytest", "xdist": "pytest-xdist", "hypothesis": "hypothesis", "numpy": "numpy",
        "transformers": "transformers",
        "pynvml": "nvidia-ml-py", "matplotlib": "matplotlib", "tqdm": "tqdm"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
    say "installing test/bench extras: $missing ..."
    $PY -m pip install -q $missing >&2
fi

# The package itself, editable, without touching dependencies or the network.
# Checked from / (not the checkout, whose eagle_capture/ would always import),
# with the interpreter's absolute path: a relative .venv/bin/python does not
# exist there, and the check used to fail and reinstall on every call.
case $PY in /*) PY_ABS=$PY ;; */*) PY_ABS="$PWD/$PY" ;; *) PY_ABS=$PY ;; esac
# The SGLang plugin's entry point and the eagle-capture console script must be in
# the installed metadata too (an older install lacks them).
installed=$(cd / && "$PY_ABS" -c 'import os, eagle_capture.kernels as k, eagle_capture as e
from importlib.metadata import entry_points
assert any(p.value == "eagle_capture.integrations.sglang.plugin:register"
           for p in entry_points(group="sglang.srt.plugins"))
assert any(p.value == "eagle_capture.cli:console_main"
           for p in entry_points(group="console_scripts"))
print(os.path.realpath(e.__file__))' 2>/dev/null || true)
if [ "$installed" != "$(realpath eagle_capture/__init__.py)" ]; then
    say "installing eagle-capture (editable) into $PY ..."
    $PY -m pip install -q --no-deps --no-build-isolation -e . >&2
fi
echo "$PY"
