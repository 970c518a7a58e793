"""The capture ops: the Python side of ``eagle_capture/kernels/add_rmsnorm_capture.py``.

Four destination-passing ops over the one kernel. Each takes the whole aux
buffer ``[max_tokens, K, H]`` and a slot index, never a view of it (mutated
views of graph inputs alias badly under torch.compile). ``s = h + r``, rounded
once to the storage dtype (bit-identical to torch's ``h + r``):

    add_capture            aux[:T, slot] = s              (s = h when r is None)
    add_rmsnorm_capture    r = s; h = rmsnorm(s) * w; aux[:T, slot] = s when aux is given
    add_rmsnorm_into_slot  aux[:T, slot] = s; h = rmsnorm(s) * w; r untouched
    add_rmsnorm_out        residual_out = s; h = rmsnorm(s) * w; r untouched

Every call is checked before anything launches; a failure names the argument.
Each op is a ``torch.library.triton_op``: torch.compile sees the kernel (no
graph break), and CPU tensors run a torch implementation with the kernel's
numerics. Eager calls skip the dispatcher: checks memoised per call signature,
a byte-range pre-check for aliasing, the compiled kernel launched directly.

The concerns, one module each: :mod:`~eagle_capture.ops.checks` (argument and
aliasing checks), :mod:`~eagle_capture.ops.launcher` (the eager fast path of a
Triton kernel, shared with the all-reduce object) and
:mod:`~eagle_capture.ops.table` (the four ops, each declared once).
"""

import torch  # noqa: F401 -- before the kernels' triton: without torch, torch is what is missing

from eagle_capture.kernels import HAS_PDL
from eagle_capture.ops.checks import (
    SUPPORTED_DTYPES,
    byte_extent,
    check_add_inputs,
    check_aliasing,
    check_aux,
    check_no_autograd,
    check_no_internal_overlap,
    check_norm_inputs,
    overlaps_other_elements,
    ranges_overlap,
    spans_meet,
)
from eagle_capture.ops.launcher import (
    DIRECT_LAUNCH,
    DirectLaunch,
    FastLaunch,
    KernelSignature,
    Plan,
    direct_launch_of,
    hooks_active,
    pdl_enabled,
)
from eagle_capture.ops.table import (
    KERNEL_DEVICE_TYPES,
    add_capture,
    add_rmsnorm_capture,
    add_rmsnorm_into_slot,
    add_rmsnorm_out,
)

# The ops are the public API; the other names are imported from here by the
# package, the benchmarks and the plugins.
__all__ = ["add_capture", "add_rmsnorm_capture", "add_rmsnorm_into_slot", "add_rmsnorm_out"]
