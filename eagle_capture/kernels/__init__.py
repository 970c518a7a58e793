"""Triton kernels of eagle-capture (imported as ``eagle_capture.kernels``).

Only kernels and their launch-parameter helpers live here; argument checking,
op registration and dispatch live in :mod:`eagle_capture`.  Never a top-level
folder: a top-level ``kernels`` in a checkout hides Hugging Face's ``kernels``
package (docs/layout.md).
"""

from .add_rmsnorm_capture import (
    HAS_PDL,
    add_rmsnorm_capture_kernel,
    band_sms,
    kernel_arguments,
    launch_config,
    one_wave_warps,
)

__all__ = [
    "HAS_PDL",
    "add_rmsnorm_capture_kernel",
    "band_sms",
    "kernel_arguments",
    "launch_config",
    "one_wave_warps",
]
