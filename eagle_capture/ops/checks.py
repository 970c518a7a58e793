"""The capture ops' argument checks: shapes, strides, dtypes and devices
(no host sync: legal under CUDA-graph capture and on fake tensors at trace
time), and aliasing by byte ranges (real tensors only). Every failure names
the argument. Shared by the single-GPU ops and the all-reduce object
(:mod:`eagle_capture.parallel.symm`).
"""

import itertools
from typing import Optional

import torch

from eagle_capture.kernels.add_rmsnorm_capture import MAX_HIDDEN_SIZE

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"eagle_capture: {message}")


def _check_row_major_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"eagle_capture: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        _fail(f"{name} must be 2-D [tokens, hidden_size], got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        _fail(
            f"{name} must have a contiguous last dimension (stride 1), got strides "
            f"{tuple(t.stride())}; rows may be strided, columns may not"
        )


def _check_like_hidden(name: str, t: torch.Tensor, hidden_states: torch.Tensor) -> None:
    _check_row_major_2d(name, t)
    if t.shape != hidden_states.shape:
        _fail(
            f"{name} shape {tuple(t.shape)} does not match hidden_states shape "
            f"{tuple(hidden_states.shape)}"
        )
    if t.dtype != hidden_states.dtype:
        _fail(f"{name} dtype {t.dtype} does not match hidden_states dtype {hidden_states.dtype}")
    if t.device != hidden_states.device:
        _fail(f"{name} is on {t.device} but hidden_states is on {hidden_states.device}")


def check_add_inputs(hidden_states: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    _check_row_major_2d("hidden_states", hidden_states)
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        _fail(
            f"hidden_states dtype must be one of bfloat16, float16, float32, "
            f"got {hidden_states.dtype}"
        )
    if hidden_states.shape[1] > MAX_HIDDEN_SIZE:
        _fail(
            f"hidden_size {hidden_states.shape[1]} is larger than the supported maximum "
            f"{MAX_HIDDEN_SIZE} (one row is held in registers)"
        )
    if hidden_states.device.type not in ("cpu", "cuda"):
        _fail(f"hidden_states must be on a CPU or CUDA device, got {hidden_states.device}")
    if residual is not None:
        _check_like_hidden("residual", residual, hidden_states)


def check_norm_inputs(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    hidden_size = hidden_states.shape[1]
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"eagle_capture: weight must be a torch.Tensor, got {type(weight).__name__}"
        )
    if weight.dim() != 1 or weight.shape[0] != hidden_size:
        message = f"weight must have shape [{hidden_size}] (hidden_size), got {tuple(weight.shape)}"
        if (
            weight.dim() == 1
            and 0 < hidden_size < weight.shape[0]
            and weight.shape[0] % hidden_size == 0
        ):
            # The full-width weight against H/tp-wide rows: a TP shard reached the norm.
            message += (
                f"; the weight is {weight.shape[0] // hidden_size} x {hidden_size} wide: "
                f"hidden states of width hidden_size / tp_size mean a tensor-parallel "
                f"shard reached the capture point (normalise and capture only full, "
                f"reduced hidden states)"
            )
        _fail(message)
    if hidden_size > 1 and weight.stride(0) != 1:
        _fail("weight must be contiguous")
    if weight.dtype not in SUPPORTED_DTYPES:
        _fail(f"weight dtype must be one of bfloat16, float16, float32, got {weight.dtype}")
    if weight.device != hidden_states.device:
        _fail(f"weight is on {weight.device} but hidden_states is on {hidden_states.device}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0.0:
        _fail(f"eps must be a non-negative float, got {eps!r}")


def check_aux(
    aux: torch.Tensor,
    slot: int,
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if not isinstance(aux, torch.Tensor):
        raise TypeError(f"eagle_capture: aux must be a torch.Tensor, got {type(aux).__name__}")
    if aux.dim() != 3:
        _fail(
            f"aux must be the 3-D buffer [max_tokens, num_captures, hidden_size], "
            f"got shape {tuple(aux.shape)}"
        )
    rows, num_slots, aux_hidden = aux.shape
    if aux_hidden > 1 and aux.stride(2) != 1:
        _fail(f"aux must have a contiguous last dimension, got strides {tuple(aux.stride())}")
    if isinstance(slot, bool) or not isinstance(slot, (int, torch.SymInt)):
        raise TypeError(f"eagle_capture: slot must be an int, got {type(slot).__name__}")
    if not 0 <= slot < num_slots:
        _fail(
            f"slot {slot} is out of range for aux with {num_slots} capture slots "
            f"(expected 0 <= slot < {num_slots})"
        )
    if aux_hidden != hidden_size:
        _fail(
            f"hidden_states has width {hidden_size} but aux slots are {aux_hidden} wide; "
            f"a width of hidden_size / tp_size means a tensor-parallel shard reached the "
            f"capture point (capture only full, reduced hidden states)"
        )
    if num_tokens > rows:
        _fail(
            f"hidden_states has {num_tokens} tokens but aux has only {rows} rows "
            f"(allocate the buffer for the largest batch the server runs)"
        )
    if aux.dtype != dtype:
        _fail(f"aux dtype {aux.dtype} does not match hidden_states dtype {dtype}")
    check_no_internal_overlap("aux", aux)
    # Rows outermost, slots inside a row: result(T) is a [T, K*H] view, and the
    # aliasing check can tell which slot a [T, H] view lies in.
    if (num_slots > 1 and aux.stride(1) < aux_hidden) or (
        rows > 1 and aux.stride(0) < num_slots * max(aux.stride(1), aux_hidden)
    ):
        _fail(
            f"aux must be laid out [max_tokens, num_captures, hidden_size] with rows "
            f"outermost (strides >= ({num_slots} * {aux_hidden}, {aux_hidden}, 1)), got strides "
            f"{tuple(aux.stride())}; a slot-major buffer such as "
            f"torch.empty(K, rows, H).permute(1, 0, 2) is not supported"
        )
    if aux.device != device:
        _fail(f"aux is on {aux.device} but hidden_states is on {device}")


def check_no_internal_overlap(name: str, t: torch.Tensor) -> None:
    """An output must not map two elements to one address (expanded rows or
    slots): programs would race. With a contiguous last dimension it suffices
    that, ordered by stride, each stride spans the dimensions inside it."""
    extent = t.shape[-1]
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape[:-1], t.stride()[:-1]) if sz > 1):
        if stride < extent:
            _fail(
                f"{name} has overlapping rows or slots (shape {tuple(t.shape)}, strides "
                f"{tuple(t.stride())}); outputs need every element at its own address"
            )
        extent = stride * size


def check_no_autograd(op: str, tensors) -> None:
    """The ops have no backward and write in place through raw pointers; called
    only while grad mode is on (never in serving)."""
    if any(getattr(t, "requires_grad", False) for t in tensors):
        raise RuntimeError(
            f"eagle_capture: {op} got a tensor that requires grad while grad mode is on; the "
            f"ops have no backward and write in place. Call them under torch.no_grad() or "
            f"torch.inference_mode() (as serving does), or detach the inputs"
        )


# ----------------------------------------------------------------------------
# Aliasing: byte ranges by data_ptr and strides (real tensors only)
# ----------------------------------------------------------------------------


def byte_extent(t: Optional[torch.Tensor]) -> int:
    """Bytes from ``t``'s first element to just past its last (0 when empty or None)."""
    if t is None or t.numel() == 0:
        return 0
    return (
        sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    ) * t.element_size()


_PAIRS = {n: tuple(itertools.combinations(range(n), 2)) for n in range(2, 9)}


def spans_meet(starts, extents) -> bool:
    """Whether two of the ranges ``[starts[i], starts[i] + extents[i])`` (up to 8)
    intersect; empty ones meet nothing. The eager paths' per-call pre-check: only
    a call whose ranges meet gets the full aliasing check."""
    for i, j in _PAIRS[len(starts)]:
        if (
            starts[i] < starts[j] + extents[j]
            and starts[j] < starts[i] + extents[i]
            and extents[i]
            and extents[j]
        ):
            return True
    return False


def ranges_overlap(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether the byte ranges ``a`` and ``b`` can touch intersect (two
    interleaved views of one buffer do). False when either is None or empty."""
    ea, eb = byte_extent(a), byte_extent(b)
    return bool(ea and eb) and a.data_ptr() < b.data_ptr() + eb and b.data_ptr() < a.data_ptr() + ea


# Fake and functional tensors (opcheck, tracing) have no addresses; the eager
# call on real tensors checks aliasing. A norm's weight is an nn.Parameter.
_ADDRESSED = (torch.Tensor, torch.nn.Parameter)


def _overlap(a, b) -> bool:
    return type(a) in _ADDRESSED and type(b) in _ADDRESSED and ranges_overlap(a, b)


def overlaps_other_elements(out: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``out`` shares bytes with ``src`` other than as the very same
    elements: writing an input's own elements in place is safe (each program
    reads its row before writing it); any other overlap is not."""
    return _overlap(out, src) and not (
        out.data_ptr() == src.data_ptr() and out.stride() == src.stride()
    )


def _slot_touched(view: torch.Tensor, aux: torch.Tensor) -> Optional[int]:
    """The aux slot a ``[T, H]`` view of aux lies in, or None if it is not a slot view."""
    offset = (view.data_ptr() - aux.data_ptr()) // aux.element_size()
    if (
        offset < 0
        or view.dim() != 2
        or aux.dim() != 3
        or view.stride(0) != aux.stride(0)
        or aux.stride(1) == 0
    ):
        return None
    slot, col = divmod(offset % aux.stride(0), aux.stride(1))
    return slot if col == 0 and slot < aux.shape[1] else None


def check_aliasing(
    hidden_states: torch.Tensor,
    residual: Optional[torch.Tensor],
    aux: Optional[torch.Tensor],
    slot: int,
    *,
    residual_mutated: bool,
    hidden_mutated: bool,
    residual_out: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
) -> None:
    """Memory shared between arguments that would corrupt a capture."""
    for name, out in (
        ("aux", aux),
        ("residual_out", residual_out),
        ("hidden_states", hidden_states if hidden_mutated else None),
        ("residual", residual if residual_mutated else None),
    ):
        if weight is not None and _overlap(weight, out):
            _fail(f"weight shares memory with {name}, which this op writes")
    if aux is not None and _overlap(hidden_states, aux):
        _fail(
            "hidden_states lies inside the aux buffer; the captures would be overwritten "
            "or read back as inputs"
        )
    if residual is not None and aux is not None and _overlap(residual, aux):
        if residual_mutated:
            _fail(
                "residual is a view of the aux buffer (the slot written by "
                "add_rmsnorm_into_slot); updating it in place would overwrite that capture. "
                "Use add_rmsnorm_out(..., residual_out=<a residual tensor>) for the layer "
                "that follows an into-slot capture"
            )
        touched = _slot_touched(residual, aux)
        if touched is None or touched == slot:
            _fail(
                f"residual overlaps aux slot {slot}, the slot being written: that slot's "
                f"capture would be overwritten by this layer's residual"
            )
    if hidden_mutated and residual is not None and _overlap(hidden_states, residual):
        _fail(
            "hidden_states and residual share memory; the normed output would overwrite "
            "the residual"
        )
    if residual_out is not None:
        if _overlap(residual_out, hidden_states):
            _fail(
                "residual_out shares memory with hidden_states; the normed output would "
                "overwrite the new residual"
            )
        if residual is not None and overlaps_other_elements(residual_out, residual):
            _fail("residual_out partially overlaps residual")
