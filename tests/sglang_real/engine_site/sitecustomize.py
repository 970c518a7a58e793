"""Imported at start-up by every Python process that has this directory on its path: the
test's probe process and the scheduler processes SGLang's Engine spawns (they inherit
PYTHONPATH). SGLang's import graph names GPU-only packages; tests/sglang_real/stubs.py
stubs the absent ones (a stub raises if called). vllm stays unstubbed: SGLang's CPU
engine tries ``import vllm`` and falls back when it fails (a stub would be called)."""

import os
import sys

os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "false")
# Hugging Face's kernels package (in the test venv, not in any SGLang line's) breaks the
# older transformers each line pins (tests/sglang_real/harness.py hides it too).
sys.modules.setdefault("kernels", None)

from tests.sglang_real import stubs  # noqa: E402

stubs.install(("torchada", "xgrammar", "tvm_ffi")).names.discard("vllm")
