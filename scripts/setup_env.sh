#!/usr/bin/env bash
# Set up a Python that has torch, triton, this package and its test/bench extras;
# print that Python's path on stdout -- one line, nothing else (callers do
# PY=$(bash scripts/setup_env.sh)). Progress goes to stderr: a line before each
# long step, pip's own output while torch installs, and at the end (when it
# installed something) how to use what it installed.
#
# Which Python:
# * an activated virtualenv ($VIRTUAL_ENV) is used, never replaced: what it lacks
#   is installed into it;
# * else a python3 that already has torch and triton (the GPU machine: no network)
#   is used as it is: torch is never reinstalled;
# * else a virtualenv .venv in the checkout.
# A Python without torch gets the CPU build of torch 2.13.0, whose Triton
# interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors. On Linux x86_64
# the requirement is torch==2.13.0+cpu: PyPI's torch there is the CUDA build (~0.5 GB
# plus several GB of cuda-toolkit / nvidia-* dependencies), so only a CPU wheel may
# satisfy it. When the configured index (PyPI, a local wheel directory) has none,
# it comes from PyTorch's own CPU wheel index (the download's size is said first);
# EAGLE_CAPTURE_TORCH_CPU_INDEX names another such index (a mirror).
# EAGLE_CAPTURE_TORCH overrides the requirement (e.g. EAGLE_CAPTURE_TORCH=torch==2.13.0
# to accept PyPI's build). On other platforms PyPI's torch 2.13.0 is taken.
# --lint: also the lint (ruff, pinned), which .ci/run runs first; the tests do not
# need it, so without --lint nothing is fetched for it (the GPU machine has no index).
set -euo pipefail
LINT=0
case "${1:-}" in
    --lint) LINT=1 ;;
    "") ;;
    *) echo "usage: bash scripts/setup_env.sh [--lint]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."

say() { echo "setup_env: $*" >&2; }

TORCH_VERSION=2.13.0
CPU_INDEX=${EAGLE_CAPTURE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
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

# wheel_size SPEC: the size of the wheel PyTorch's CPU index has for SPEC and this
# Python, e.g. "192 MB"; empty when the index does not say (offline, no such wheel).
wheel_size() {
    "$PY" - "$CPU_INDEX" "$1" <<'PYEOF' 2>/dev/null || true
import re, sys, urllib.parse, urllib.request
index, spec = sys.argv[1].rstrip("/") + "/torch/", sys.argv[2]
prefix = "torch-%s-cp%d%d-" % ((spec.split("==", 1) + [""])[1], *sys.version_info[:2])
page = urllib.request.urlopen(index, timeout=20).read().decode()
for href in re.findall(r'href="([^"]+)"', page):
    url = urllib.parse.urljoin(index, href.split("#")[0])
    name = urllib.parse.unquote(url.rsplit("/", 1)[-1])
    if name.startswith(prefix) and "linux" in name and name.endswith("_x86_64.whl"):
        head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=20)
        print(f"{int(head.headers['Content-Length']) / 1e6:.0f} MB")
        break
PYEOF
}

# install_torch: the torch requirement and triton, from the configured index; when that
# has no such torch, from PyTorch's CPU index. No -q: pip's progress (and a download's
# progress bar) is the feedback for the longest step.
install_torch() {
    local log
    log=$(mktemp)
    say "installing ${TORCH_WHAT} and triton into $PY (a few minutes) ..."
    if $PY -m pip install "$TORCH_SPEC" triton 2>&1 | tee "$log" >&2; then
        rm -f "$log"
        return 0
    fi
    if grep -qE "No matching distribution found for torch|Could not find a version that satisfies the requirement torch" "$log" \
            && [[ $TORCH_SPEC == *+cpu ]]; then
        rm -f "$log"
        local size
        size=$(wheel_size "$TORCH_SPEC")
        say "${TORCH_SPEC} is not on the configured package index; downloading it from PyTorch's"
        say "CPU wheel index ${CPU_INDEX} (${size:-size not known: the index did not say}) ..."
        if $PY -m pip install --extra-index-url "$CPU_INDEX" "$TORCH_SPEC" triton >&2; then
            return 0
        fi
    fi
    rm -f "$log"
    say "pip could not install ${TORCH_SPEC} and triton (its message is above). To take PyPI's"
    say "build instead (on Linux x86_64 the CUDA one, several GB): EAGLE_CAPTURE_TORCH=torch==${TORCH_VERSION};"
    say "another CPU wheel index: EAGLE_CAPTURE_TORCH_CPU_INDEX=URL."
    exit 1
}

INSTALLED=""
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PY=$VIRTUAL_ENV/bin/python              # the user's own environment: used, not replaced
elif python3 -c "import torch, triton" >/dev/null 2>&1; then
    PY=python3
else
    if [ ! -x .venv/bin/python ]; then
        say "creating the virtualenv .venv"
        python3 -m venv .venv >&2
    fi
    PY=.venv/bin/python
fi
if ! $PY -c "import torch, triton" >/dev/null 2>&1; then
    install_torch
    INSTALLED="torch, triton"
fi

# Extras: install only what is missing (pytest, pytest-xdist, hypothesis, numpy, transformers
# for tests, tomli before Python 3.11 for the mutation check's data;
# nvidia-ml-py, matplotlib, tqdm for the benchmark).
missing=$($PY - <<'PYEOF'
import importlib.util, sys
need = {"pytest": "pytest", "xdist": "pytest-xdist", "hypothesis": "hypothesis", "numpy": "numpy",
        "transformers": "transformers",
        "pynvml": "nvidia-ml-py", "matplotlib": "matplotlib", "tqdm": "tqdm"}
if sys.version_info < (3, 11):
    need["tomli"] = "tomli"
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
    say "installing test/bench extras: $missing ..."
    $PY -m pip install -q $missing >&2
    INSTALLED="${INSTALLED:+$INSTALLED, }the test/bench extras"
fi

# The lint (ruff, the first step of .ci/run), pinned: one version lints every checkout
# alike. Asked for (--lint), it must install: the lint cannot run without it.
RUFF_VERSION=0.17.6
if [ $LINT = 1 ] && [ "$($PY -m ruff --version 2>/dev/null || true)" != "ruff $RUFF_VERSION" ]; then
    say "installing ruff $RUFF_VERSION (the lint) ..."
    if ! $PY -m pip install -q --retries 0 --timeout 15 "ruff==$RUFF_VERSION" >&2; then
        say "could not install ruff $RUFF_VERSION, which the lint needs (pip's message above)"
        exit 1
    fi
    INSTALLED="${INSTALLED:+$INSTALLED, }ruff"
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
    INSTALLED="${INSTALLED:+$INSTALLED, }eagle-capture (editable)"
fi

# How to use it, once something was installed (a run with nothing to do stays silent).
if [ -n "$INSTALLED" ]; then
    BIN=$("$PY_ABS" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    say "ready: $PY_ABS now has $INSTALLED. To use it:"
    if [ "$(command -v eagle-capture 2>/dev/null)" = "$BIN/eagle-capture" ]; then
        say "  eagle-capture --help                 (on your PATH)"
    elif [ -f "$BIN/activate" ]; then
        say "  source $BIN/activate   then   eagle-capture --help"
    else
        say "  $BIN/eagle-capture --help"
    fi
    say "  bash scripts/test.sh [tests/FILE.py]   bash scripts/bench.sh   (README: Two commands)"
fi
echo "$PY"
