"""eagle-capture: fused EAGLE-3 aux-hidden-state capture for LLM serving.

Importing this package registers the ``torch.ops.eagle_capture`` ops. It does
not initialise CUDA: no device is queried until a kernel is launched.
"""

from .buffer import AuxCaptureBuffer
from .ops import add_capture, add_rmsnorm_capture, add_rmsnorm_into_slot, add_rmsnorm_out
from .reference import add_rmsnorm_reference, sglang_eager_capture

__version__ = "0.1.0"

__all__ = [
    "AuxCaptureBuffer",
    "add_capture",
    "add_rmsnorm_capture",
    "add_rmsnorm_into_slot",
    "add_rmsnorm_out",
    "add_rmsnorm_reference",
    "sglang_eager_capture",
]
