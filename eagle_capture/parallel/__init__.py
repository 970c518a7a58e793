"""Tensor-parallel capture: reduce first, then add, then store.

:class:`TPCapture` (reduce over the TP group, then the fused op) and the
cross-rank :func:`check_capture_consistency`; :class:`SymmAllReduceCapture`,
the all-reduce fused with the next layer's add+RMSNorm and the capture store,
with its measured :class:`PathTable`.
"""

from .paths import PathTable
from .symm import SymmAllReduceCapture, ensure_multicast_disabled
from .tp import CaptureConsistencyError, TPCapture, check_capture_consistency

__all__ = [
    "CaptureConsistencyError",
    "PathTable",
    "SymmAllReduceCapture",
    "TPCapture",
    "check_capture_consistency",
    "ensure_multicast_disabled",
]
