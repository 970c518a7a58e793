"""Triton kernels of eagle-capture (imported as ``eagle_capture.kernels``).

Only kernels and their launch-parameter helpers live here; argument checking,
op registration and dispatch live in :mod:`eagle_capture`.  The folder is
shipped under the ``eagle_capture`` namespace (see ``setup.py``) because a
top-level ``kernels`` package already exists on PyPI (Hugging Face's).
"""

from .add_rmsnorm_capture import HAS_PDL, add_rmsnorm_capture_kernel, kernel_arguments, launch_config

__all__ = ["HAS_PDL", "add_rmsnorm_capture_kernel", "kernel_arguments", "launch_config"]
