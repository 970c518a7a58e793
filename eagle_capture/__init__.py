"""eagle-capture: fused EAGLE-3 aux-hidden-state capture for LLM serving.

The core -- the ops (:mod:`eagle_capture.ops`, over the Triton kernels in
``kernels/``) and the aux buffer -- is what every other part builds on:

* ``parallel/``: tensor-parallel capture and the all-reduce fused with it;
* ``integrations/sglang/``: the drop-in for SGLang's model loops (one adapter per
  family), its plugin; ``integrations/vllm/``: vLLM's DeepseekV2 classes, its plugin;
* ``layer_ids/``: which layers a draft gets, per SGLang release (the doctor);
* ``testing/``: references, the reference loop, benchmark timers -- never
  imported by the product.

Importing this package registers the ``torch.ops.eagle_capture`` ops. It does
not initialise CUDA: no device is queried until a kernel is launched.
"""

from . import _moved
from .buffer import AuxCaptureBuffer
from .ops import add_capture, add_rmsnorm_capture, add_rmsnorm_into_slot, add_rmsnorm_out

__version__ = "0.2.0"

__all__ = [
    "AuxCaptureBuffer",
    "add_capture",
    "add_rmsnorm_capture",
    "add_rmsnorm_into_slot",
    "add_rmsnorm_out",
]

__getattr__ = _moved.moved_attribute  # names of 0.1 that moved (deprecated)
