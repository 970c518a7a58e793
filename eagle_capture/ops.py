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
numerics. Eager calls skip the dispatcher through :class:`FastLaunch` -- checks
memoised per call signature, a byte-range pre-check for aliasing, the compiled
kernel launched directly -- which the all-reduce object (parallel/symm.py)
shares.
"""

import contextlib
import functools
import inspect
import itertools
import operator
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import triton
from torch.library import triton_op, wrap_triton

from eagle_capture.kernels import HAS_PDL, add_rmsnorm_capture_kernel, kernel_arguments
from eagle_capture.kernels.add_rmsnorm_capture import MAX_HIDDEN_SIZE

__all__ = ["add_capture", "add_rmsnorm_capture", "add_rmsnorm_into_slot", "add_rmsnorm_out"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------
# Argument checks: shapes, strides, dtypes, devices only (no host sync, legal
# under CUDA-graph capture and in fake tensors at trace time)
# ----------------------------------------------------------------------------

def _fail(message: str) -> None:
    raise ValueError(f"eagle_capture: {message}")


def _check_row_major_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"eagle_capture: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        _fail(f"{name} must be 2-D [tokens, hidden_size], got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        _fail(f"{name} must have a contiguous last dimension (stride 1), got strides "
              f"{tuple(t.stride())}; rows may be strided, columns may not")


def _check_like_hidden(name: str, t: torch.Tensor, hidden_states: torch.Tensor) -> None:
    _check_row_major_2d(name, t)
    if t.shape != hidden_states.shape:
        _fail(f"{name} shape {tuple(t.shape)} does not match hidden_states shape "
              f"{tuple(hidden_states.shape)}")
    if t.dtype != hidden_states.dtype:
        _fail(f"{name} dtype {t.dtype} does not match hidden_states dtype {hidden_states.dtype}")
    if t.device != hidden_states.device:
        _fail(f"{name} is on {t.device} but hidden_states is on {hidden_states.device}")


def check_add_inputs(hidden_states: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    _check_row_major_2d("hidden_states", hidden_states)
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        _fail(f"hidden_states dtype must be one of bfloat16, float16, float32, "
              f"got {hidden_states.dtype}")
    if hidden_states.shape[1] > MAX_HIDDEN_SIZE:
        _fail(f"hidden_size {hidden_states.shape[1]} is larger than the supported maximum "
              f"{MAX_HIDDEN_SIZE} (one row is held in registers)")
    if hidden_states.device.type not in ("cpu", "cuda"):
        _fail(f"hidden_states must be on a CPU or CUDA device, got {hidden_states.device}")
    if residual is not None:
        _check_like_hidden("residual", residual, hidden_states)


def check_norm_inputs(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    hidden_size = hidden_states.shape[1]
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"eagle_capture: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 1 or weight.shape[0] != hidden_size:
        message = f"weight must have shape [{hidden_size}] (hidden_size), got {tuple(weight.shape)}"
        if (weight.dim() == 1 and 0 < hidden_size < weight.shape[0]
                and weight.shape[0] % hidden_size == 0):
            # The full-width weight against H/tp-wide rows: a TP shard reached the norm.
            message += (f"; the weight is {weight.shape[0] // hidden_size} x {hidden_size} wide: "
                        f"hidden states of width hidden_size / tp_size mean a tensor-parallel "
                        f"shard reached the capture point (normalise and capture only full, "
                        f"reduced hidden states)")
        _fail(message)
    if hidden_size > 1 and weight.stride(0) != 1:
        _fail("weight must be contiguous")
    if weight.dtype not in SUPPORTED_DTYPES:
        _fail(f"weight dtype must be one of bfloat16, float16, float32, got {weight.dtype}")
    if weight.device != hidden_states.device:
        _fail(f"weight is on {weight.device} but hidden_states is on {hidden_states.device}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0.0:
        _fail(f"eps must be a non-negative float, got {eps!r}")


def check_aux(aux: torch.Tensor, slot: int, num_tokens: int, hidden_size: int,
              dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(aux, torch.Tensor):
        raise TypeError(f"eagle_capture: aux must be a torch.Tensor, got {type(aux).__name__}")
    if aux.dim() != 3:
        _fail(f"aux must be the 3-D buffer [max_tokens, num_captures, hidden_size], "
              f"got shape {tuple(aux.shape)}")
    rows, num_slots, aux_hidden = aux.shape
    if aux_hidden > 1 and aux.stride(2) != 1:
        _fail(f"aux must have a contiguous last dimension, got strides {tuple(aux.stride())}")
    if isinstance(slot, bool) or not isinstance(slot, (int, torch.SymInt)):
        raise TypeError(f"eagle_capture: slot must be an int, got {type(slot).__name__}")
    if not 0 <= slot < num_slots:
        _fail(f"slot {slot} is out of range for aux with {num_slots} capture slots "
              f"(expected 0 <= slot < {num_slots})")
    if aux_hidden != hidden_size:
        _fail(f"hidden_states has width {hidden_size} but aux slots are {aux_hidden} wide; "
              f"a width of hidden_size / tp_size means a tensor-parallel shard reached the "
              f"capture point (capture only full, reduced hidden states)")
    if num_tokens > rows:
        _fail(f"hidden_states has {num_tokens} tokens but aux has only {rows} rows "
              f"(allocate the buffer for the largest batch the server runs)")
    if aux.dtype != dtype:
        _fail(f"aux dtype {aux.dtype} does not match hidden_states dtype {dtype}")
    check_no_internal_overlap("aux", aux)
    # Rows outermost, slots inside a row: result(T) is a [T, K*H] view, and the
    # aliasing check can tell which slot a [T, H] view lies in.
    if ((num_slots > 1 and aux.stride(1) < aux_hidden)
            or (rows > 1 and aux.stride(0) < num_slots * max(aux.stride(1), aux_hidden))):
        _fail(f"aux must be laid out [max_tokens, num_captures, hidden_size] with rows "
              f"outermost (strides >= ({num_slots} * {aux_hidden}, {aux_hidden}, 1)), got strides "
              f"{tuple(aux.stride())}; a slot-major buffer such as "
              f"torch.empty(K, rows, H).permute(1, 0, 2) is not supported")
    if aux.device != device:
        _fail(f"aux is on {aux.device} but hidden_states is on {device}")


def check_no_internal_overlap(name: str, t: torch.Tensor) -> None:
    """An output must not map two elements to one address (expanded rows or
    slots): programs would race. With a contiguous last dimension it suffices
    that, ordered by stride, each stride spans the dimensions inside it."""
    extent = t.shape[-1]
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape[:-1], t.stride()[:-1])
                               if sz > 1):
        if stride < extent:
            _fail(f"{name} has overlapping rows or slots (shape {tuple(t.shape)}, strides "
                  f"{tuple(t.stride())}); outputs need every element at its own address")
        extent = stride * size


def check_no_autograd(op: str, tensors) -> None:
    """The ops have no backward and write in place through raw pointers; called
    only while grad mode is on (never in serving)."""
    if any(getattr(t, "requires_grad", False) for t in tensors):
        raise RuntimeError(
            f"eagle_capture: {op} got a tensor that requires grad while grad mode is on; the "
            f"ops have no backward and write in place. Call them under torch.no_grad() or "
            f"torch.inference_mode() (as serving does), or detach the inputs")


# ----------------------------------------------------------------------------
# Aliasing: byte ranges by data_ptr and strides (real tensors only)
# ----------------------------------------------------------------------------

def byte_extent(t: Optional[torch.Tensor]) -> int:
    """Bytes from ``t``'s first element to just past its last (0 when empty or None)."""
    if t is None or t.numel() == 0:
        return 0
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) \
        * t.element_size()


_PAIRS = {n: tuple(itertools.combinations(range(n), 2)) for n in range(2, 9)}


def spans_meet(starts, extents) -> bool:
    """Whether two of the ranges ``[starts[i], starts[i] + extents[i])`` (up to 8)
    intersect; empty ones meet nothing. The eager paths' per-call pre-check: only
    a call whose ranges meet gets the full aliasing check."""
    for i, j in _PAIRS[len(starts)]:
        if (starts[i] < starts[j] + extents[j] and starts[j] < starts[i] + extents[i]
                and extents[i] and extents[j]):
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
    return _overlap(out, src) and not (out.data_ptr() == src.data_ptr()
                                       and out.stride() == src.stride())


def _slot_touched(view: torch.Tensor, aux: torch.Tensor) -> Optional[int]:
    """The aux slot a ``[T, H]`` view of aux lies in, or None if it is not a slot view."""
    offset = (view.data_ptr() - aux.data_ptr()) // aux.element_size()
    if (offset < 0 or view.dim() != 2 or aux.dim() != 3 or view.stride(0) != aux.stride(0)
            or aux.stride(1) == 0):
        return None
    slot, col = divmod(offset % aux.stride(0), aux.stride(1))
    return slot if col == 0 and slot < aux.shape[1] else None


def check_aliasing(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                   aux: Optional[torch.Tensor], slot: int, *, residual_mutated: bool,
                   hidden_mutated: bool, residual_out: Optional[torch.Tensor] = None,
                   weight: Optional[torch.Tensor] = None) -> None:
    """Memory shared between arguments that would corrupt a capture."""
    for name, out in (("aux", aux), ("residual_out", residual_out),
                      ("hidden_states", hidden_states if hidden_mutated else None),
                      ("residual", residual if residual_mutated else None)):
        if weight is not None and _overlap(weight, out):
            _fail(f"weight shares memory with {name}, which this op writes")
    if aux is not None and _overlap(hidden_states, aux):
        _fail("hidden_states lies inside the aux buffer; the captures would be overwritten "
              "or read back as inputs")
    if residual is not None and aux is not None and _overlap(residual, aux):
        if residual_mutated:
            _fail("residual is a view of the aux buffer (the slot written by "
                  "add_rmsnorm_into_slot); updating it in place would overwrite that capture. "
                  "Use add_rmsnorm_out(..., residual_out=<a residual tensor>) for the layer "
                  "that follows an into-slot capture")
        touched = _slot_touched(residual, aux)
        if touched is None or touched == slot:
            _fail(f"residual overlaps aux slot {slot}, the slot being written: that slot's "
                  f"capture would be overwritten by this layer's residual")
    if hidden_mutated and residual is not None and _overlap(hidden_states, residual):
        _fail("hidden_states and residual share memory; the normed output would overwrite "
              "the residual")
    if residual_out is not None:
        if _overlap(residual_out, hidden_states):
            _fail("residual_out shares memory with hidden_states; the normed output would "
                  "overwrite the new residual")
        if residual is not None and overlaps_other_elements(residual_out, residual):
            _fail("residual_out partially overlaps residual")


# ----------------------------------------------------------------------------
# The eager fast path, shared with parallel/symm.py
# ----------------------------------------------------------------------------
#
# kernel[grid](...) re-binds and re-specialises every argument (~17 us of host
# time per launch on the H200 host); the raw launcher of the compiled kernel
# takes ~4 us with integer addresses (benchmarks/NOTES.md). A plan holds what a
# validated call signature launches with, everything but the addresses; its
# first aligned launch goes through Triton's entry point, which returns the
# compiled kernel, and later ones call that kernel's launcher directly. That is
# sound because the memo key (shapes, strides, dtypes, devices, scalars) fixes
# every argument Triton specialises on except pointer alignment, and only
# all-16-byte-aligned calls launch directly.

def _triton_release() -> Optional[tuple[int, int]]:
    try:
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return None


try:  # Triton >= 3.4 keeps the launch hooks in knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no direct launches
    _knobs = None

# CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
# enter_hook, exit_hook, *args) is JITFunction.run's own call in Triton 3.3 - 3.9.
_RELEASE = _triton_release()
DIRECT_LAUNCH = _RELEASE is not None and _RELEASE[0] == 3 and _RELEASE[1] >= 3 and _knobs is not None


def _hook_active(hook) -> bool:
    # Triton 3.6+ keeps an always-present HookChain, active once a profiler adds a call.
    return hook is not None and bool(getattr(hook, "calls", True))


def hooks_active() -> bool:
    """A profiler's launch hooks are installed: launch through Triton's entry so it sees them."""
    return (_hook_active(_knobs.runtime.launch_enter_hook)
            or _hook_active(_knobs.runtime.launch_exit_hook))


class DirectLaunch(NamedTuple):
    """``launch(gx, gy, gz, stream, *mid, *kernel_args)`` launches one compiled kernel;
    pointer arguments may be ints (device addresses)."""
    launch: Callable
    mid: tuple
    compiled: Any = None  # keeps the CompiledKernel (and its module) alive


# Triton 3.6's CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args)
# only forwards to its C ``launch`` with the cooperative and PDL flags and two
# scratch buffers (None when both sizes are 0; read in 3.6.0's driver.py); calling
# ``launch`` itself saves ~1.5 us. Other releases forward differently (no PDL flag
# before, launch metadata by name in 3.9): they take CompiledKernel.run.
_RAW_FORWARDING = _RELEASE == (3, 6)
_RAW_FORWARDING_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")


def _forwards_to_raw_launch(run) -> bool:
    if not _RAW_FORWARDING:
        return False
    try:
        params = inspect.signature(type(run).__call__).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (tuple(params) == _RAW_FORWARDING_CALL
            and params["args"].kind is inspect.Parameter.VAR_POSITIONAL
            and callable(getattr(run, "launch", None))
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")
            and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0)


def direct_launch_of(compiled) -> DirectLaunch:
    run = compiled.run
    if _forwards_to_raw_launch(run):
        return DirectLaunch(run.launch, (compiled.function, run.launch_cooperative_grid,
                                         run.launch_pdl, None, None, compiled.packed_metadata,
                                         None, None, None), compiled)
    return DirectLaunch(run, (compiled.function, compiled.packed_metadata, None, None, None),
                        compiled)


def tuple_getter(indices) -> Callable[[Sequence], tuple]:
    """A tuple of the items at ``indices`` (a tuple even for one index)."""
    indices = tuple(indices)
    if len(indices) == 1:
        (i,) = indices
        return lambda items: (items[i],)
    return operator.itemgetter(*indices)


class KernelSignature:
    """A ``triton.jit`` kernel's parameters by name: the one place where a call's
    arguments, given by name, become the positional list Triton's launchers take."""

    def __init__(self, kernel) -> None:
        parameters = inspect.signature(getattr(kernel, "fn", kernel)).parameters
        self.params = tuple(parameters)
        self.defaults = {n: p.default for n, p in parameters.items()
                         if p.default is not inspect.Parameter.empty}

    def bind(self, values: dict) -> tuple:
        """``values`` in parameter order, defaults filled in; TypeError naming
        unknown and missing parameters."""
        unknown = sorted(values.keys() - set(self.params))
        missing = [p for p in self.params if p not in values and p not in self.defaults]
        if unknown or missing:
            raise TypeError(f"eagle_capture: kernel arguments do not match the kernel's "
                            f"signature (unknown {unknown}, missing {missing})")
        return tuple(values[p] if p in values else self.defaults[p] for p in self.params)

    def template(self, sources: dict, values: dict) -> tuple[Callable, tuple]:
        """``(head, tail)``: ``(*head(pointers), *tail)`` is the argument list of a call
        whose leading pointer parameters take ``pointers[sources[p]]`` (tensors or
        addresses) and every other parameter its entry in ``values``."""
        lead = self.params[:len(sources)]
        if set(lead) != set(sources):
            raise TypeError(f"eagle_capture: the call's pointer parameters {sorted(sources)} "
                            f"must lead the kernel's signature {self.params}")
        bound = self.bind({**values, **dict.fromkeys(sources)})
        return tuple_getter(sources[p] for p in lead), bound[len(sources):]


class Plan:
    """One validated call signature: its launch but for the tensors' addresses,
    the byte extents of its tensors and the addresses last found free of
    overlaps (the aliasing pre-check), and the compiled kernel's DirectLaunch
    once there is one."""
    __slots__ = ("grid", "head", "tail", "tail_entry", "num_warps", "device_index", "use_pdl",
                 "extents", "checked", "direct", "extra")

    def __init__(self, grid, head, tail_entry, num_warps, device_index, use_pdl, extents,
                 extra=None):
        self.grid, self.head, self.num_warps = grid, head, num_warps
        # Fixed tensor arguments (symm's state) go to Triton's entry as tensors,
        # to the direct launch as addresses.
        self.tail_entry = tail_entry
        self.tail = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in tail_entry)
        self.device_index, self.use_pdl, self.extents = device_index, use_pdl, extents
        self.checked = None
        self.direct: Optional[DirectLaunch] = None
        self.extra = extra  # the caller's own decision for this signature (symm: its path)


class FastLaunch:
    """The eager fast path of one Triton kernel: a memo of validated call
    signatures (``key -> Plan``, cleared when full) and the launch of a plan."""

    MAX_PLANS = 4096

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.signature = KernelSignature(kernel)
        self.plans: dict = {}

    def remember(self, key, plan: Plan) -> Plan:
        if key is not None:
            if len(self.plans) >= self.MAX_PLANS:
                self.plans.clear()
            self.plans[key] = plan
        return plan

    def plan(self, grid, values: dict, sources: dict, num_warps: int,
             device_index: Optional[int], use_pdl: bool, extents: tuple, extra=None) -> Plan:
        head, tail = self.signature.template(sources, values)
        return Plan(grid, head, tail, num_warps, device_index, use_pdl, extents, extra)

    def launch(self, plan: Plan, tensors: Sequence, ptrs: Sequence[int]) -> None:
        """Launch ``plan`` on the call's ``tensors`` (``ptrs``: their addresses, 0 for None)."""
        direct = plan.direct
        aligned = not functools.reduce(operator.or_, ptrs) & 15
        if direct is not None and aligned and not hooks_active():
            direct.launch(plan.grid[0], plan.grid[1], 1,
                          torch._C._cuda_getCurrentRawStream(plan.device_index), *direct.mid,
                          *plan.head(ptrs), *plan.tail)
            return
        kwargs = {"num_warps": plan.num_warps}
        if plan.use_pdl:
            kwargs["launch_pdl"] = True
        compiled = self.kernel[plan.grid](*plan.head(tensors), *plan.tail_entry, **kwargs)
        if (DIRECT_LAUNCH and aligned and plan.device_index is not None and not hooks_active()
                and compiled is not None and not hasattr(compiled, "result")):  # not a future
            plan.direct = direct_launch_of(compiled)


# ----------------------------------------------------------------------------
# The kernel's arguments for a call given by pointer role
# ----------------------------------------------------------------------------

_KERNEL = FastLaunch(add_rmsnorm_capture_kernel)

# The call's tensors, in this order, in every op: (hidden_states, residual,
# weight, aux, residual_out), None where the op has none.
_H, _R, _W, _AUX, _OUT = range(5)


def _pointer_sources(tensors: Sequence, residual_in_place: bool) -> dict:
    """Which of the call's five tensors each kernel pointer takes, by position (the
    eager plan's template): the binding of ``kernel_arguments``, absent roles at
    hidden_states as there."""
    has = [t is not None for t in tensors]
    return {"hidden_ptr": _H,
            "residual_ptr": _R if has[_R] else _H,
            "weight_ptr": _W if has[_W] else _H,
            "normed_out_ptr": _H,
            "residual_out_ptr": _R if residual_in_place else (_OUT if has[_OUT] else _H),
            "aux_ptr": _AUX if has[_AUX] else _H}


def _kernel_arguments(tensors: Sequence, residual_in_place: bool, eps: float, slot: int,
                      norm_fp32_sum: bool, use_pdl: bool) -> tuple[tuple, dict, int]:
    """(grid, the kernel's arguments by name, num_warps) of a call's five tensors."""
    hidden, residual, weight, aux, residual_out = tensors
    return kernel_arguments(hidden, residual, weight, hidden if weight is not None else None,
                            residual if residual_in_place else residual_out, aux, eps=eps,
                            slot=slot, norm_fp32_sum=norm_fp32_sum, use_pdl=use_pdl)


@functools.lru_cache(maxsize=None)
def pdl_enabled(device_index: int) -> bool:
    """Eager launches use programmatic dependent launch on Hopper or newer with a
    Triton that has it, unless ``EAGLE_CAPTURE_PDL=0`` (``wrap_triton``, used by
    the registered ops, has no PDL launch option)."""
    if not HAS_PDL or os.environ.get("EAGLE_CAPTURE_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# The device types whose tensors the kernel runs on; the others take the torch
# implementation. (eagle_capture.testing.kernel adds "cpu" under Triton's
# interpreter, so that CPU CI runs the kernel through these same ops.)
KERNEL_DEVICE_TYPES = {"cuda"}


def _launch_wrapped(tensors: Sequence, residual_in_place: bool, eps, slot, norm_fp32_sum):
    """The registered ops' launch, through ``wrap_triton`` (what torch.compile traces)."""
    hidden = tensors[_H]
    if hidden.shape[0] == 0:
        return  # a zero-size grid is not a valid launch
    grid, values, num_warps = _kernel_arguments(tensors, residual_in_place, eps, slot,
                                                norm_fp32_sum, use_pdl=False)
    # Triton launches on the current device; the dispatcher may be called with
    # tensors elsewhere (compiled code sets its own guard).
    guard = (torch.cuda.device(hidden.device)
             if (hidden.is_cuda and not torch.compiler.is_compiling()
                 and hidden.device.index != torch.cuda.current_device())
             else contextlib.nullcontext())
    with guard:
        wrap_triton(add_rmsnorm_capture_kernel)[grid](*_KERNEL.signature.bind(values),
                                                     num_warps=num_warps)


# ----------------------------------------------------------------------------
# The torch implementation (CPU tensors): the kernel's numerics
# ----------------------------------------------------------------------------

def _torch_impl(tensors: Sequence, residual_in_place: bool, eps, slot, norm_fp32_sum) -> None:
    hidden, residual, weight, aux, residual_out = tensors
    if residual_in_place:
        residual_out = residual
    # torch's same-dtype add rounds once, like the kernel.
    s = hidden + residual if residual is not None else hidden
    # Before any store: the outputs may alias the inputs (in place).
    norm_input = (hidden.float() + residual.float()
                  if norm_fp32_sum and residual is not None and weight is not None else s)
    if aux is not None:
        aux[:hidden.shape[0], slot].copy_(s)
    if residual_out is not None:
        residual_out.copy_(s)
    if weight is not None:
        # (x * rstd) * w in fp32, rounded once: SGLang's RMSNorm.forward_native order.
        x = norm_input.float()
        hidden.copy_(x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float())


# torch 2.13's C++ Inductor backend crashes on the regenerated in-place norm
# graph (InductorError: KeyError: 'bufN', pytorch/pytorch#196570; plain torch
# code such as r.copy_(h + r); h.copy_(norm(r)) does it too), so for CPU tensors
# the add+RMSNorm ops call an opaque CPU op (same schema) that Inductor calls
# as it is: compiled CPU results are bit-identical to eager.
def _cpu_op(name: str, mutates: tuple):
    def register(fn):
        op = torch.library.custom_op(f"eagle_capture::{name}", fn, mutates_args=mutates,
                                     device_types="cpu")
        op.register_fake(lambda *args: None)
        return op
    return register


# ----------------------------------------------------------------------------
# The ops: each a check, an aliasing rule and its CPU path, shared by the
# registered op and the eager path; the call's tensors always in the order
# (hidden_states, residual, weight, aux, residual_out)
# ----------------------------------------------------------------------------

class _Op:
    """What tells the four ops over the one kernel apart."""
    __slots__ = ("name", "norm", "residual_in_place", "aux_required", "residual_out_required",
                 "cpu")

    def __init__(self, name: str, *, norm: bool, residual_in_place: bool = False,
                 aux_required: bool = False, residual_out_required: bool = False,
                 cpu: Optional[Callable] = None) -> None:
        self.name, self.norm, self.residual_in_place = name, norm, residual_in_place
        self.aux_required, self.residual_out_required = aux_required, residual_out_required
        # (tensors, eps, slot, norm_fp32_sum) -> the opaque CPU op; None: the torch
        # implementation in line (a copy, which Inductor may regenerate).
        self.cpu = cpu

    def check(self, tensors, eps, slot) -> None:
        hidden, residual, weight, aux, residual_out = tensors
        if not self.norm:
            check_add_inputs(hidden, residual)
            check_aux(aux, slot, hidden.shape[0], hidden.shape[1], hidden.dtype, hidden.device)
            return
        if residual is None:
            raise TypeError("eagle_capture: residual must be a tensor for the add+RMSNorm ops")
        if self.aux_required and aux is None:  # the schema's aux is a Tensor
            raise TypeError(f"eagle_capture: aux must be a tensor for {self.name}")
        check_add_inputs(hidden, residual)
        check_norm_inputs(hidden, weight, eps)
        check_no_internal_overlap("hidden_states", hidden)  # the normed output
        if self.residual_in_place:
            check_no_internal_overlap("residual", residual)
        if aux is not None:
            check_aux(aux, slot, hidden.shape[0], hidden.shape[1], hidden.dtype, hidden.device)
        if self.residual_out_required:
            _check_like_hidden("residual_out", residual_out, hidden)
            check_no_internal_overlap("residual_out", residual_out)

    def aliasing(self, tensors, slot) -> None:
        hidden, residual, weight, aux, residual_out = tensors
        check_aliasing(hidden, residual, aux, slot, weight=weight, residual_out=residual_out,
                       residual_mutated=self.residual_in_place, hidden_mutated=self.norm)


def _run_registered(op: _Op, tensors, eps=0.0, slot=0, norm_fp32_sum=False) -> None:
    """The body of every registered op: check, then the kernel or the CPU path."""
    op.check(tensors, eps, slot)
    op.aliasing(tensors, slot)
    if tensors[_H].device.type in KERNEL_DEVICE_TYPES:
        _launch_wrapped(tensors, op.residual_in_place, eps, slot, norm_fp32_sum)
    elif op.cpu is not None:
        op.cpu(tensors, eps, slot, norm_fp32_sum)
    else:
        _torch_impl(tensors, op.residual_in_place, eps, slot, norm_fp32_sum)


# The raw getter: torch.cuda.current_device() adds a lazy-init check (0.2 - 0.6 us);
# CUDA is initialised once a CUDA plan exists.
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _eager(op: _Op, tensors: tuple, eps=0.0, slot=0, norm_fp32_sum=False) -> None:
    """An eager call: checked once per call signature, aliasing pre-checked on
    every call (it depends on addresses), then the memoised plan's launch."""
    if torch.is_grad_enabled():
        check_no_autograd(op.name, tensors)
    try:  # everything the checks depend on but addresses; with types: 1.0 == 1
        key = (op, eps, slot, norm_fp32_sum, type(eps), type(slot),
               *[(t.shape, t.stride(), t.dtype, t.device) if t is not None else None
                 for t in tensors])
    except AttributeError:  # a non-tensor argument: the full check names it
        key = None
    plan = _KERNEL.plans.get(key) if key is not None else None
    if plan is None:
        op.check(tensors, eps, slot)
        op.aliasing(tensors, slot)
        plan = _KERNEL.remember(key, _plan(op, tensors, eps, slot, norm_fp32_sum))
        plan.checked = [t.data_ptr() if t is not None else 0 for t in tensors]
        ptrs = plan.checked
    else:
        ptrs = [t.data_ptr() if t is not None else 0 for t in tensors]
        if ptrs != plan.checked:
            if spans_meet(ptrs, plan.extents):
                op.aliasing(tensors, slot)  # raises, or allows (a residual from another slot)
            plan.checked = ptrs
    if plan.grid is None:  # the torch implementation
        _torch_impl(tensors, op.residual_in_place, eps, slot, norm_fp32_sum)
        return
    if plan.grid[0] == 0:
        return  # a zero-size grid is not a valid launch
    if plan.device_index is not None and plan.device_index != _current_device():
        # Triton launches on the current device: elsewhere is an illegal address.
        raise ValueError(f"eagle_capture: hidden_states is on cuda:{plan.device_index} but "
                         f"the current CUDA device is cuda:{torch.cuda.current_device()}; "
                         f"call torch.cuda.set_device({plan.device_index}) first")
    _KERNEL.launch(plan, tensors, ptrs)


def _plan(op: _Op, tensors, eps, slot, norm_fp32_sum) -> Plan:
    hidden = tensors[_H]
    extents = tuple(byte_extent(t) for t in tensors)
    if hidden.device.type not in KERNEL_DEVICE_TYPES:
        return Plan(None, None, (), 0, None, False, extents)
    use_pdl = hidden.is_cuda and pdl_enabled(hidden.device.index)
    grid, values, num_warps = _kernel_arguments(tensors, op.residual_in_place, eps, slot,
                                                norm_fp32_sum, use_pdl)
    sources = _pointer_sources(tensors, op.residual_in_place)
    for pointer in sources:  # bound to the call's tensors by position, per call
        del values[pointer]
    return _KERNEL.plan(grid, values, sources, num_warps, hidden.device.index if hidden.is_cuda else None, use_pdl,
                        extents)


# ---- add_capture: no norm, nothing but the slot written ---------------------

_ADD_CAPTURE = _Op("add_capture", norm=False, aux_required=True)


@triton_op("eagle_capture::add_capture", mutates_args=("aux",))
def _add_capture_op(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                    aux: torch.Tensor, slot: int) -> None:
    _run_registered(_ADD_CAPTURE, (hidden_states, residual, None, aux, None), slot=slot)


def add_capture(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                aux: torch.Tensor, slot: int) -> None:
    """``aux[:T, slot] = hidden_states + residual`` (or ``hidden_states`` when
    ``residual`` is None: layer 0, whose input is the embedding output)."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_capture(hidden_states, residual, aux, slot)
    else:
        _eager(_ADD_CAPTURE, (hidden_states, residual, None, aux, None), slot=slot)


# ---- add_rmsnorm_capture: SGLang's fused_add_rmsnorm in place + the slot ----

@_cpu_op("_add_rmsnorm_capture_cpu", ("hidden_states", "residual", "aux"))
def _add_rmsnorm_capture_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, eps: float, aux: Optional[torch.Tensor],
                             slot: int, norm_fp32_sum: bool) -> None:
    _torch_impl((hidden_states, residual, weight, aux, None), True, eps, slot, norm_fp32_sum)


_ADD_RMSNORM_CAPTURE = _Op(
    "add_rmsnorm_capture", norm=True, residual_in_place=True,
    cpu=lambda t, eps, slot, f: _add_rmsnorm_capture_cpu(t[_H], t[_R], t[_W], eps, t[_AUX],
                                                         slot, f))


@triton_op("eagle_capture::add_rmsnorm_capture",
           mutates_args=("hidden_states", "residual", "aux"))
def _add_rmsnorm_capture_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                            weight: torch.Tensor, eps: float, aux: Optional[torch.Tensor],
                            slot: int, norm_fp32_sum: bool = False) -> None:
    _run_registered(_ADD_RMSNORM_CAPTURE, (hidden_states, residual, weight, aux, None), eps,
                    slot, norm_fp32_sum)


def add_rmsnorm_capture(hidden_states: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor, eps: float,
                        aux: Optional[torch.Tensor] = None, slot: int = 0,
                        norm_fp32_sum: bool = False) -> None:
    """SGLang/FlashInfer ``fused_add_rmsnorm`` in place -- ``residual += hidden_states``;
    ``hidden_states = rmsnorm(residual) * weight`` -- and, when ``aux`` is given,
    the new residual also stored in ``aux[:T, slot]``.

    ``norm_fp32_sum=True`` normalises the unrounded fp32 sum (FlashInfer's kernel,
    SGLang's ``forward_native``); the default the rounded residual (HF
    transformers, vLLM). The residual and the capture are the rounded sum either way."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_capture(hidden_states, residual, weight, eps, aux,
                                                    slot, norm_fp32_sum)
    else:
        _eager(_ADD_RMSNORM_CAPTURE, (hidden_states, residual, weight, aux, None), eps, slot,
               norm_fp32_sum)


# ---- add_rmsnorm_into_slot: the new residual written into the slot only -----

@_cpu_op("_add_rmsnorm_into_slot_cpu", ("hidden_states", "aux"))
def _add_rmsnorm_into_slot_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float, aux: torch.Tensor,
                               slot: int, norm_fp32_sum: bool) -> None:
    _torch_impl((hidden_states, residual, weight, aux, None), False, eps, slot, norm_fp32_sum)


_ADD_RMSNORM_INTO_SLOT = _Op(
    "add_rmsnorm_into_slot", norm=True, aux_required=True,
    cpu=lambda t, eps, slot, f: _add_rmsnorm_into_slot_cpu(t[_H], t[_R], t[_W], eps, t[_AUX],
                                                           slot, f))


@triton_op("eagle_capture::add_rmsnorm_into_slot", mutates_args=("hidden_states", "aux"))
def _add_rmsnorm_into_slot_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                              weight: torch.Tensor, eps: float, aux: torch.Tensor,
                              slot: int, norm_fp32_sum: bool = False) -> None:
    _run_registered(_ADD_RMSNORM_INTO_SLOT, (hidden_states, residual, weight, aux, None), eps,
                    slot, norm_fp32_sum)


def add_rmsnorm_into_slot(hidden_states: torch.Tensor, residual: torch.Tensor,
                          weight: torch.Tensor, eps: float, aux: torch.Tensor,
                          slot: int, norm_fp32_sum: bool = False) -> None:
    """Fused add+RMSNorm whose residual output *is* ``aux[:T, slot]``: the capture
    costs no extra write. ``residual`` is left untouched; the next layer reads its
    residual from the slot and writes the next one with :func:`add_rmsnorm_out`
    (an in-place update would overwrite the capture, and is refused)."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_into_slot(hidden_states, residual, weight, eps, aux,
                                                      slot, norm_fp32_sum)
    else:
        _eager(_ADD_RMSNORM_INTO_SLOT, (hidden_states, residual, weight, aux, None), eps, slot,
               norm_fp32_sum)


# ---- add_rmsnorm_out: the new residual out of place -------------------------

@_cpu_op("_add_rmsnorm_out_cpu", ("hidden_states", "residual_out"))
def _add_rmsnorm_out_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, eps: float, residual_out: torch.Tensor,
                         norm_fp32_sum: bool) -> None:
    _torch_impl((hidden_states, residual, weight, None, residual_out), False, eps, 0,
                norm_fp32_sum)


_ADD_RMSNORM_OUT = _Op(
    "add_rmsnorm_out", norm=True, residual_out_required=True,
    cpu=lambda t, eps, slot, f: _add_rmsnorm_out_cpu(t[_H], t[_R], t[_W], eps, t[_OUT], f))


@triton_op("eagle_capture::add_rmsnorm_out", mutates_args=("hidden_states", "residual_out"))
def _add_rmsnorm_out_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor, eps: float, residual_out: torch.Tensor,
                        norm_fp32_sum: bool = False) -> None:
    _run_registered(_ADD_RMSNORM_OUT, (hidden_states, residual, weight, None, residual_out),
                    eps, 0, norm_fp32_sum)


def add_rmsnorm_out(hidden_states: torch.Tensor, residual: torch.Tensor,
                    weight: torch.Tensor, eps: float, residual_out: torch.Tensor,
                    norm_fp32_sum: bool = False) -> None:
    """Fused add+RMSNorm with an out-of-place residual: ``residual_out = h + r``;
    ``hidden_states = rmsnorm(residual_out) * weight``; ``residual`` untouched."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_out(hidden_states, residual, weight, eps,
                                                residual_out, norm_fp32_sum)
    else:
        _eager(_ADD_RMSNORM_OUT, (hidden_states, residual, weight, None, residual_out), eps, 0,
               norm_fp32_sum)
