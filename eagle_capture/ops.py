"""The ``eagle_capture`` torch.library ops and their Python entry points.

Four destination-passing ops, all thin shells over the one Triton kernel in
``eagle_capture.kernels.add_rmsnorm_capture``. They take the whole aux buffer
plus a slot index, never a view of it (mutated views of graph inputs alias
badly under torch.compile: pytorch issues 131192, 139628).

============================  =====================================================  ==================
op                            effect (T = hidden_states.shape[0], s = h + r)          mutates
============================  =====================================================  ==================
add_capture                   aux[:T, slot] = s   (s = h when residual is None)       aux
add_rmsnorm_capture           r = s; h = rmsnorm(s) * w; aux[:T, slot] = s if aux     h, residual, aux
add_rmsnorm_into_slot         aux[:T, slot] = s; h = rmsnorm(s) * w (r untouched)     h, aux
add_rmsnorm_out               residual_out = s; h = rmsnorm(s) * w (r untouched)      h, residual_out
============================  =====================================================  ==================

``add_rmsnorm_into_slot`` is the zero-extra-write capture: the new residual
is written only into the slot, and the following layer reads its residual
from ``aux[:T, slot]`` and writes the next one elsewhere with
``add_rmsnorm_out`` (an in-place update would overwrite the capture, and is
refused).

Each op is a ``torch.library.triton_op``: torch.compile sees the Triton
kernel (Inductor can schedule it; no graph break), and the same body runs a
torch implementation for CPU tensors (SGLang's CPU backend, CI) -- for the
add+RMSNorm ops through a private CPU op that Inductor calls as it is rather
than regenerating (torch 2.13's C++ backend crashes on the regenerated graph;
see "CPU implementation" below). In eager
mode the public functions below skip the dispatcher and launch directly --
the op layer costs tens of microseconds per call (docs/engine_facts.md section 5) --
while under torch.compile they call the registered op.

Tests can run the kernel on CPU tensors through the ops themselves: inside
``with eagle_capture.ops.kernel_on_cpu():`` (needs ``TRITON_INTERPRET=1`` before
``eagle_capture`` is imported) CPU tensors take the launch code that CUDA
tensors take -- ``launch_kernel(..., _wrap=wrap_triton)`` in the registered ops,
the memoised plan and ``_PTRS_*`` pointer maps on the eager path -- with the
kernel run by Triton's interpreter. Only the direct C launch of a cached
compiled kernel (and PDL) is GPU-only. The eager CUDA path is unchanged by it;
the registered ops read one flag.
"""

import contextlib
import functools
import itertools
import operator
import os
from typing import NamedTuple, Optional

import torch
from torch.library import triton_op, wrap_triton

from . import _checks
from ._launcher import CachedLauncher, hooks_active
from .kernels import HAS_PDL, add_rmsnorm_capture_kernel, launch_config

__all__ = [
    "add_capture",
    "add_rmsnorm_capture",
    "add_rmsnorm_into_slot",
    "add_rmsnorm_out",
    "kernel_on_cpu",
    "launch_kernel",
]


# ----------------------------------------------------------------------------
# Kernel launch (CUDA, or CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------

def _launch_args(hidden_states, residual, weight, eps, normed_out, residual_out, aux, slot,
                 use_pdl=False, norm_fp32_sum=False):
    """(grid, positional kernel arguments, num_warps) for validated arguments.

    Unused pointers get a valid tensor (hidden_states) so the signature never
    changes; the constexpr flags compile their accesses away.
    """
    num_tokens, hidden_size = hidden_states.shape
    apply_norm = weight is not None
    # int(): under dynamic-shape tracing H may be a SymInt; the constexpr
    # BLOCK_H depends on it, so specialising on the model's hidden size is right.
    block_h, num_warps, col_blocks = launch_config(int(hidden_size), apply_norm)
    args = (
        hidden_states,
        residual if residual is not None else hidden_states,
        weight if apply_norm else hidden_states,
        normed_out if apply_norm else hidden_states,
        residual_out if residual_out is not None else hidden_states,
        aux if aux is not None else hidden_states,
        hidden_size,
        float(eps),
        hidden_states.stride(0),
        residual.stride(0) if residual is not None else 0,
        normed_out.stride(0) if apply_norm else 0,
        residual_out.stride(0) if residual_out is not None else 0,
        aux.stride(0) if aux is not None else 0,
        slot * aux.stride(1) if aux is not None else 0,
        residual is not None,       # HAS_RESIDUAL
        apply_norm,                 # APPLY_NORM
        residual_out is not None,   # STORE_RESIDUAL
        aux is not None,            # CAPTURE
        block_h,                    # BLOCK_H
        use_pdl,                    # USE_PDL
        bool(norm_fp32_sum) and apply_norm and residual is not None,  # NORM_FP32_SUM
    )
    return (num_tokens, col_blocks), args, num_warps


@functools.lru_cache(maxsize=None)
def pdl_enabled(device_index: int) -> bool:
    """Whether eager launches on this CUDA device use programmatic dependent
    launch: Hopper or newer, a Triton with the intrinsics, not the interpreter,
    and not switched off with ``EAGLE_CAPTURE_PDL=0``. (Launches from inside
    the registered ops -- torch.compile, the dispatcher -- never use it:
    ``wrap_triton`` has no PDL launch option.)"""
    if not HAS_PDL or os.environ.get("EAGLE_CAPTURE_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_kernel(
    hidden_states: torch.Tensor,
    residual: Optional[torch.Tensor],
    *,
    weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    normed_out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    aux: Optional[torch.Tensor] = None,
    slot: int = 0,
    norm_fp32_sum: bool = False,
    _wrap=None,
) -> None:
    """Launch the fused kernel on already-validated arguments, through Triton's
    normal entry point (or ``wrap_triton`` inside the registered ops).

    Features switch on by which outputs are given: ``aux`` -> capture into
    ``aux[:T, slot]``; ``residual_out`` -> store the new residual;
    ``weight`` + ``normed_out`` -> RMSNorm (of the unrounded fp32 sum with
    ``norm_fp32_sum``, FlashInfer's choice; else of the rounded residual). Public so that tests can run the
    kernel itself under the Triton interpreter on CPU tensors.
    """
    if hidden_states.shape[0] == 0:
        return  # a zero-size grid is not a valid launch
    use_pdl = (_wrap is None and hidden_states.is_cuda
               and pdl_enabled(hidden_states.device.index))
    grid, args, num_warps = _launch_args(hidden_states, residual, weight, eps, normed_out,
                                         residual_out, aux, slot, use_pdl, norm_fp32_sum)
    kernel = add_rmsnorm_capture_kernel if _wrap is None else _wrap(add_rmsnorm_capture_kernel)
    # Triton launches on the *current* device: tensors on another GPU would be read at
    # illegal addresses. The registered ops (the dispatcher path) may be called so;
    # compiled code sets its own device guard.
    guard = (torch.cuda.device(hidden_states.device)
             if (hidden_states.is_cuda and not torch.compiler.is_compiling()
                 and hidden_states.device.index != torch.cuda.current_device())
             else contextlib.nullcontext())
    with guard:
        if use_pdl:
            kernel[grid](*args, num_warps=num_warps, launch_pdl=True)
        else:
            kernel[grid](*args, num_warps=num_warps)


_cached_launch = CachedLauncher(add_rmsnorm_capture_kernel)


class _EagerPlan(NamedTuple):
    """What a validated eager CUDA call signature launches with: everything but
    the tensors' addresses, computed once per signature."""
    grid: tuple
    scalars: tuple      # kernel arguments after the six pointers (eps included)
    num_warps: int
    device_index: int
    dtypes: tuple       # pointer dtypes that Triton specialises on
    use_pdl: bool


def _make_plan(hidden_states, residual, weight, eps, normed_out, residual_out, aux, slot,
               norm_fp32_sum=False):
    device_index = hidden_states.device.index   # None for CPU tensors (kernel_on_cpu)
    use_pdl = hidden_states.is_cuda and pdl_enabled(device_index)
    grid, args, num_warps = _launch_args(hidden_states, residual, weight, eps, normed_out,
                                         residual_out, aux, slot, use_pdl, norm_fp32_sum)
    return _EagerPlan(grid, args[6:], num_warps, device_index,
                      (hidden_states.dtype, args[2].dtype), use_pdl)


def _launch_planned(plan: _EagerPlan, pointers: tuple, aligned: bool):
    """Launch through the CachedLauncher (tensors as pointer arguments); returns
    its DirectLaunch for the plan's key when one is cached."""
    # eps (scalars[1]) is a float: Triton does not specialise on it.
    key = (plan.device_index, plan.dtypes, plan.scalars[0], plan.scalars[2:])
    return _cached_launch(plan.grid, pointers + plan.scalars, key, plan.num_warps,
                          plan.device_index, aligned, plan.use_pdl)


def _launch_planned_on_cpu(plan: _EagerPlan, pointers: tuple) -> None:
    """The eager launch of CPU tensors under :func:`kernel_on_cpu`: the CUDA
    path's arguments (pointer map + plan scalars) through the CachedLauncher's
    non-direct branch, i.e. Triton's own entry point (here its interpreter)."""
    if plan.grid[0] == 0:
        return  # a zero-size grid is not a valid launch
    _launch_planned(plan, pointers, aligned=False)


# ----------------------------------------------------------------------------
# The kernel on CPU tensors, for tests (Triton interpreter)
# ----------------------------------------------------------------------------

_KERNEL_ON_CPU = False          # read by the registered ops and on an eager memo miss
_PLANS_KERNEL_ON_CPU: dict = {}  # the eager memo while kernel_on_cpu() is active


def _kernel_interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    return isinstance(add_rmsnorm_capture_kernel, InterpretedFunction)


@contextlib.contextmanager
def kernel_on_cpu():
    """Test-facing: within this block, the public ops and ``torch.ops.eagle_capture``
    run CPU tensors through the Triton kernel (Triton's interpreter) instead of
    the torch implementation, by the CUDA tensors' launch code: the registered ops
    call ``launch_kernel(..., _wrap=wrap_triton)``; the eager functions memoise
    the same ``_EagerPlan`` and build the kernel arguments from the ``_PTRS_*``
    pointer map + plan scalars, launched through Triton's entry point (the direct
    C launch is GPU-only). PDL is off. Needs ``TRITON_INTERPRET=1`` set before
    ``eagle_capture`` is imported (tests/conftest.py does so without a GPU).

    The interpreter truncates fp32 -> bf16 (docs/engine_facts.md section 4): bf16
    captures and residuals are then the truncated fp32 sum. Eager mode only; not
    thread-safe (it switches module state); nests. CUDA tensors are unaffected,
    and the CUDA fast path pays nothing for it: the eager memo is swapped for a
    separate one while the block runs, so no key or check is added.
    """
    global _KERNEL_ON_CPU, _PLANS
    if not _kernel_interpreted():
        raise RuntimeError("eagle_capture.ops.kernel_on_cpu() needs Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before eagle_capture is imported")
    if _KERNEL_ON_CPU:  # nested
        yield
        return
    saved = _PLANS
    _KERNEL_ON_CPU, _PLANS = True, _PLANS_KERNEL_ON_CPU
    try:
        yield
    finally:
        _KERNEL_ON_CPU, _PLANS = False, saved


def _torch_path(hidden_states) -> bool:
    """CPU tensors run the torch implementation, except under kernel_on_cpu()."""
    return hidden_states.device.type == "cpu" and not _KERNEL_ON_CPU


# ----------------------------------------------------------------------------
# CPU implementation (torch), the same numerics as the kernel
# ----------------------------------------------------------------------------

def _rmsnorm_into(normed_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    # (x * rstd) * w in fp32, rounded once: the operation order of SGLang's
    # RMSNorm.forward_native, so the CPU path is bit-identical to it.
    x = x.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed_out.copy_(x * rstd * weight.float())


def _torch_impl(hidden_states, residual, *, weight=None, eps=0.0, normed_out=None,
                residual_out=None, aux=None, slot=0, norm_fp32_sum=False) -> None:
    num_tokens = hidden_states.shape[0]
    # torch's same-dtype add rounds once, like the kernel: the captured value
    # is bit-identical to SGLang's eager hidden_states + residual.
    s = hidden_states + residual if residual is not None else hidden_states
    # Before any store: residual_out / normed_out may alias the inputs (in place).
    norm_input = (hidden_states.float() + residual.float()
                  if norm_fp32_sum and residual is not None and weight is not None else s)
    if aux is not None:
        aux[:num_tokens, slot].copy_(s)
    if residual_out is not None:
        residual_out.copy_(s)
    if weight is not None:
        _rmsnorm_into(normed_out, norm_input, weight, eps)


# The add+RMSNorm ops' CPU path under torch.compile: an opaque custom op per
# registered op (same schema, same mutated arguments) whose CPU kernel is
# _torch_impl. A triton_op's body is decomposed into the graph when traced,
# so Inductor used to regenerate _torch_impl for CPU tensors, and torch 2.13's
# C++ backend crashes on that graph (InductorError: KeyError: 'buf0'): the
# residual (or captured) sum reads hidden_states, which the op overwrites with
# the norm, and the outer-loop fusion of that sum with the row reduction tries
# to promote the in-place write's mutation buffer to a local buffer whose
# users load another buffer name. Upstream: pytorch/pytorch#196570 (also
# #188228; fix proposed in #196639), and no eagle_capture is needed for it:
#
#     def f(x, out):                  # x, out: torch.randn(5, 64), CPU
#         y = x * 2
#         out.copy_(y)
#         x.copy_(y * y.sum(-1, keepdim=True))
#     torch.compile(f)(x, out)        # InductorError: KeyError: 'buf1'
#
# No rewrite of _torch_impl avoids it (copy_, out=, functional + copy and
# F.rms_norm all functionalise to the same graph), so the CPU kernel is hidden
# from Inductor instead: the compiled graph calls it as an extern kernel, and
# compiled CPU results are bit-identical to eager. add_capture (no reduction)
# stays decomposed, which compiles fine and lets Inductor fuse the copy.

@torch.library.custom_op("eagle_capture::_add_rmsnorm_capture_cpu",
                         mutates_args=("hidden_states", "residual", "aux"), device_types="cpu")
def _add_rmsnorm_capture_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, eps: float, aux: Optional[torch.Tensor],
                             slot: int, norm_fp32_sum: bool) -> None:
    _torch_impl(hidden_states, residual, weight=weight, eps=eps, normed_out=hidden_states,
                residual_out=residual, aux=aux, slot=slot, norm_fp32_sum=norm_fp32_sum)


@torch.library.custom_op("eagle_capture::_add_rmsnorm_into_slot_cpu",
                         mutates_args=("hidden_states", "aux"), device_types="cpu")
def _add_rmsnorm_into_slot_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float, aux: torch.Tensor,
                               slot: int) -> None:
    _torch_impl(hidden_states, residual, weight=weight, eps=eps, normed_out=hidden_states,
                aux=aux, slot=slot)


@torch.library.custom_op("eagle_capture::_add_rmsnorm_out_cpu",
                         mutates_args=("hidden_states", "residual_out"), device_types="cpu")
def _add_rmsnorm_out_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, eps: float, residual_out: torch.Tensor) -> None:
    _torch_impl(hidden_states, residual, weight=weight, eps=eps, normed_out=hidden_states,
                residual_out=residual_out)


def _mutates_only(*args, **kwargs) -> None:
    """Fake implementation of the CPU ops: they only write their arguments."""
    return None


for _cpu_op in (_add_rmsnorm_capture_cpu, _add_rmsnorm_into_slot_cpu, _add_rmsnorm_out_cpu):
    _cpu_op.register_fake(_mutates_only)


def _dispatch(hidden_states, residual, *, wrap, **kwargs) -> None:
    if _torch_path(hidden_states):
        _torch_impl(hidden_states, residual, **kwargs)
    else:
        launch_kernel(hidden_states, residual, _wrap=wrap, **kwargs)


# ----------------------------------------------------------------------------
# Argument checking per op (shared by the op bodies and the eager fast path)
# ----------------------------------------------------------------------------

def _check_add_capture(hidden_states, residual, aux, slot) -> None:
    _checks.check_add_inputs(hidden_states, residual)
    _checks.check_aux(aux, slot, hidden_states.shape[0], hidden_states.shape[1],
                      hidden_states.dtype, hidden_states.device)


def _check_norm(hidden_states, residual, weight, eps, aux, slot,
                residual_mutated: bool = False) -> None:
    if residual is None:
        raise TypeError("eagle_capture: residual must be a tensor for the add+RMSNorm ops")
    _checks.check_add_inputs(hidden_states, residual)
    _checks.check_norm_inputs(hidden_states, weight, eps)
    _checks.check_no_internal_overlap("hidden_states", hidden_states)  # the normed output
    if residual_mutated:
        _checks.check_no_internal_overlap("residual", residual)
    if aux is not None:
        _checks.check_aux(aux, slot, hidden_states.shape[0], hidden_states.shape[1],
                          hidden_states.dtype, hidden_states.device)


def _check_norm_out(hidden_states, residual, weight, eps, residual_out) -> None:
    _check_norm(hidden_states, residual, weight, eps, None, 0)
    _checks.check_residual_out(residual_out, hidden_states)
    _checks.check_no_internal_overlap("residual_out", residual_out)


# ----------------------------------------------------------------------------
# Registered ops
# ----------------------------------------------------------------------------

@triton_op("eagle_capture::add_capture", mutates_args={"aux"})
def _add_capture_op(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                    aux: torch.Tensor, slot: int) -> None:
    _check_add_capture(hidden_states, residual, aux, slot)
    _checks.check_aliasing(hidden_states, residual, aux, slot, residual_mutated=False,
                           hidden_mutated=False)
    _dispatch(hidden_states, residual, wrap=wrap_triton, aux=aux, slot=slot)


@triton_op("eagle_capture::add_rmsnorm_capture",
           mutates_args={"hidden_states", "residual", "aux"})
def _add_rmsnorm_capture_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                            weight: torch.Tensor, eps: float, aux: Optional[torch.Tensor],
                            slot: int, norm_fp32_sum: bool = False) -> None:
    _check_norm(hidden_states, residual, weight, eps, aux, slot, residual_mutated=True)
    _checks.check_aliasing(hidden_states, residual, aux, slot, weight=weight,
                           residual_mutated=True, hidden_mutated=True)
    if _torch_path(hidden_states):
        torch.ops.eagle_capture._add_rmsnorm_capture_cpu(hidden_states, residual, weight, eps,
                                                         aux, slot, norm_fp32_sum)
        return
    launch_kernel(hidden_states, residual, _wrap=wrap_triton, weight=weight, eps=eps,
                  normed_out=hidden_states, residual_out=residual, aux=aux, slot=slot,
                  norm_fp32_sum=norm_fp32_sum)


@triton_op("eagle_capture::add_rmsnorm_into_slot", mutates_args={"hidden_states", "aux"})
def _add_rmsnorm_into_slot_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                              weight: torch.Tensor, eps: float, aux: torch.Tensor,
                              slot: int) -> None:
    _check_norm(hidden_states, residual, weight, eps, aux, slot)
    _checks.check_aliasing(hidden_states, residual, aux, slot, weight=weight,
                           residual_mutated=False, hidden_mutated=True)
    if _torch_path(hidden_states):
        torch.ops.eagle_capture._add_rmsnorm_into_slot_cpu(hidden_states, residual, weight, eps,
                                                           aux, slot)
        return
    launch_kernel(hidden_states, residual, _wrap=wrap_triton, weight=weight, eps=eps,
                  normed_out=hidden_states, aux=aux, slot=slot)


@triton_op("eagle_capture::add_rmsnorm_out", mutates_args={"hidden_states", "residual_out"})
def _add_rmsnorm_out_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor, eps: float, residual_out: torch.Tensor) -> None:
    _check_norm_out(hidden_states, residual, weight, eps, residual_out)
    _checks.check_aliasing(hidden_states, residual, None, 0, weight=weight,
                           residual_mutated=False, hidden_mutated=True, residual_out=residual_out)
    if _torch_path(hidden_states):
        torch.ops.eagle_capture._add_rmsnorm_out_cpu(hidden_states, residual, weight, eps,
                                                     residual_out)
        return
    launch_kernel(hidden_states, residual, _wrap=wrap_triton, weight=weight, eps=eps,
                  normed_out=hidden_states, residual_out=residual_out)


# ----------------------------------------------------------------------------
# Public entry points: direct launch in eager mode, the op under torch.compile
# ----------------------------------------------------------------------------
#
# Eager calls skip the dispatcher (tens of us per call) and memoise validation:
# every check depends only on the arguments' shapes, strides, dtypes, devices,
# the slot and eps, so a call whose signature already passed the checks
# needs none again. The memo key is that signature; the aliasing check, which
# depends on storage, runs on every call.

_PLANS: dict = {}   # kernel_on_cpu() swaps in _PLANS_KERNEL_ON_CPU while it is active
_MAX_PLANS = 4096
_PAIRS = {n: tuple(itertools.combinations(range(n), 2)) for n in range(2, 5)}
# The raw getter: torch.cuda.current_device() (0.24 - 0.56 us per call measured on
# the H200 host) adds a lazy-init check; CUDA is initialised once a CUDA plan exists.
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


class _Entry:
    """Memo of one validated call signature."""
    __slots__ = ("plan", "extents", "direct", "cpu_plan")

    def __init__(self, plan, extents):
        on_cpu = plan is not None and plan.device_index is None
        self.plan = None if on_cpu else plan  # _EagerPlan, or None for CPU tensors
        self.extents = extents    # byte extent of each key tensor (0 for None / empty)
        self.direct = None        # DirectLaunch once the kernel is compiled for this plan
        # kernel_on_cpu(): the CPU tensors' _EagerPlan (kept out of .plan, so that
        # the CUDA path below needs no test for it).
        self.cpu_plan = plan if on_cpu else None


# The kernel's six pointer arguments (hidden, residual, weight, normed_out,
# residual_out, aux) as indices into each op's key tensors; an absent one
# repeats hidden_states (index 0), as in _launch_args.
_PTRS_CAPTURE = operator.itemgetter(0, 1, 0, 0, 0, 2)             # (h, r, aux)
_PTRS_CAPTURE_NO_RESIDUAL = operator.itemgetter(0, 0, 0, 0, 0, 2)
_PTRS_NORM_CAPTURE = operator.itemgetter(0, 1, 2, 0, 1, 3)        # (h, r, w, aux)
_PTRS_NORM_NO_AUX = operator.itemgetter(0, 1, 2, 0, 1, 0)
_PTRS_INTO_SLOT = operator.itemgetter(0, 1, 2, 0, 0, 3)           # (h, r, w, aux)
_PTRS_NORM_OUT = operator.itemgetter(0, 1, 2, 0, 3, 0)            # (h, r, w, residual_out)


def _eager_call(check, alias_check, key_tensors: tuple, key_scalars: tuple, pointer_map,
                hidden_states, residual, weight=None, eps=0.0, normed_out=None,
                residual_out=None, aux=None, slot=0, norm_fp32_sum=False) -> None:
    """Validate (once per call signature), check aliasing (every call) and run.

    ``key_scalars`` starts with the op's name and holds every non-tensor
    argument the checks look at (with its type: ``1.0 == 1`` must not pass
    for an int slot); with the tensors' shapes, strides, dtypes and devices
    it is everything ``check`` depends on. Aliasing depends on addresses, so
    each call compares the tensors' byte ranges (their extents are part of the
    memoised entry) and runs ``alias_check`` -- which knows which overlaps the
    op allows -- only when two ranges do overlap.

    After the first launch of a signature, the entry holds the compiled
    kernel's DirectLaunch, and a call costs: the memo key, one ``data_ptr``
    per tensor, the overlap scan and the raw launch with integer addresses.
    """
    try:
        key = (key_scalars,) + tuple(
            (t.shape, t.stride(), t.dtype, t.device) if t is not None else None
            for t in key_tensors)
    except AttributeError:  # a non-tensor argument: let the full check name it
        key = None
    else:
        # The fast path writes through raw pointers: autograd would neither record
        # the op nor see the in-place update. (Under no_grad / inference_mode, as in
        # serving, parameters that require grad are fine.)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in key_tensors):
            _checks.refuse_autograd(key_scalars[0], key_tensors)
    entry = _PLANS.get(key) if key is not None else None
    if entry is None:
        check()
        alias_check()
        entry = _Entry(_make_plan(hidden_states, residual, weight, eps, normed_out, residual_out,
                                  aux, slot, norm_fp32_sum)
                       if hidden_states.is_cuda or _KERNEL_ON_CPU else None,
                       tuple(_checks.byte_extent(t) for t in key_tensors))
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = entry
        ptrs = [t.data_ptr() if t is not None else 0 for t in key_tensors]
    else:
        ptrs = [t.data_ptr() if t is not None else 0 for t in key_tensors]
        ext = entry.extents
        for i, j in _PAIRS[len(ptrs)]:
            # Byte ranges [p, p + extent) intersect: the full check decides (an
            # empty tensor inside another's range lands here too, and is allowed).
            if ptrs[i] < ptrs[j] + ext[j] and ptrs[j] < ptrs[i] + ext[i]:
                alias_check()  # raises, or allows (e.g. a residual read from another slot)
                break
    plan = entry.plan
    if plan is None:  # CPU tensors
        if entry.cpu_plan is not None:  # kernel_on_cpu()
            _launch_planned_on_cpu(entry.cpu_plan, pointer_map(key_tensors))
        else:
            _torch_impl(hidden_states, residual, weight=weight, eps=eps, normed_out=normed_out,
                        residual_out=residual_out, aux=aux, slot=slot,
                        norm_fp32_sum=norm_fp32_sum)
        return
    if plan.grid[0] == 0:
        return  # a zero-size grid is not a valid launch
    if plan.device_index != _current_device():
        # Triton launches on the *current* device: a tensor elsewhere would be
        # an illegal address, not an error.
        raise ValueError(f"eagle_capture: hidden_states is on cuda:{plan.device_index} but "
                         f"the current CUDA device is cuda:{torch.cuda.current_device()}; "
                         f"call torch.cuda.set_device({plan.device_index}) first")
    aligned = not any(p & 15 for p in ptrs)
    direct = entry.direct
    if direct is not None and aligned and not hooks_active():
        # The entry's key implies the CachedLauncher key the kernel was compiled
        # for (dtypes, int arguments, constexprs; all pointers 16-byte aligned).
        direct.launch(plan.grid[0], plan.grid[1], 1,
                      torch._C._cuda_getCurrentRawStream(plan.device_index), *direct.mid,
                      *pointer_map(ptrs), *plan.scalars)
    else:
        direct = _launch_planned(plan, pointer_map(key_tensors), aligned)
        if direct is not None:
            entry.direct = direct


def add_capture(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                aux: torch.Tensor, slot: int) -> None:
    """``aux[:T, slot] = hidden_states + residual`` (or ``hidden_states`` when
    ``residual`` is None: layer 0, whose input is the embedding output)."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_capture(hidden_states, residual, aux, slot)
        return
    _eager_call(lambda: _check_add_capture(hidden_states, residual, aux, slot),
                lambda: _checks.check_aliasing(hidden_states, residual, aux, slot,
                                               residual_mutated=False, hidden_mutated=False),
                (hidden_states, residual, aux), ("add_capture", type(slot), slot),
                _PTRS_CAPTURE if residual is not None else _PTRS_CAPTURE_NO_RESIDUAL,
                hidden_states, residual, aux=aux, slot=slot)


def add_rmsnorm_capture(hidden_states: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor, eps: float,
                        aux: Optional[torch.Tensor] = None, slot: int = 0,
                        norm_fp32_sum: bool = False) -> None:
    """SGLang/FlashInfer ``fused_add_rmsnorm`` in place -- ``residual += hidden_states``;
    ``hidden_states = rmsnorm(residual) * weight`` -- and, when ``aux`` is given,
    the new residual also stored in ``aux[:T, slot]``.

    ``norm_fp32_sum=True`` normalises the unrounded fp32 sum, as FlashInfer's
    kernel and SGLang's ``forward_native`` do; the default normalises the
    rounded residual (HF transformers, vLLM). The residual and the capture are
    the rounded sum either way."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_capture(hidden_states, residual, weight, eps,
                                                    aux, slot, norm_fp32_sum)
        return
    _eager_call(lambda: _check_norm(hidden_states, residual, weight, eps, aux, slot, True),
                lambda: _checks.check_aliasing(hidden_states, residual, aux, slot, weight=weight,
                                               residual_mutated=True, hidden_mutated=True),
                (hidden_states, residual, weight, aux),
                ("add_rmsnorm_capture", type(slot), slot, type(eps), eps, bool(norm_fp32_sum)),
                _PTRS_NORM_CAPTURE if aux is not None else _PTRS_NORM_NO_AUX,
                hidden_states, residual, weight=weight, eps=eps, normed_out=hidden_states,
                residual_out=residual, aux=aux, slot=slot, norm_fp32_sum=norm_fp32_sum)


def add_rmsnorm_into_slot(hidden_states: torch.Tensor, residual: torch.Tensor,
                          weight: torch.Tensor, eps: float, aux: torch.Tensor,
                          slot: int) -> None:
    """Fused add+RMSNorm whose residual output *is* ``aux[:T, slot]``: the capture
    costs no extra write. ``residual`` is left untouched; the next layer must read
    its residual from the slot and write the next one with :func:`add_rmsnorm_out`."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_into_slot(hidden_states, residual, weight, eps,
                                                      aux, slot)
        return
    if aux is None:
        raise TypeError("eagle_capture: aux must be a tensor for add_rmsnorm_into_slot")
    _eager_call(lambda: _check_norm(hidden_states, residual, weight, eps, aux, slot),
                lambda: _checks.check_aliasing(hidden_states, residual, aux, slot, weight=weight,
                                               residual_mutated=False, hidden_mutated=True),
                (hidden_states, residual, weight, aux),
                ("add_rmsnorm_into_slot", type(slot), slot, type(eps), eps),
                _PTRS_INTO_SLOT,
                hidden_states, residual, weight=weight, eps=eps, normed_out=hidden_states,
                aux=aux, slot=slot)


def add_rmsnorm_out(hidden_states: torch.Tensor, residual: torch.Tensor,
                    weight: torch.Tensor, eps: float, residual_out: torch.Tensor) -> None:
    """Fused add+RMSNorm with an out-of-place residual: ``residual_out = h + r``;
    ``hidden_states = rmsnorm(residual_out) * weight``; ``residual`` untouched."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_out(hidden_states, residual, weight, eps,
                                                residual_out)
        return
    _eager_call(lambda: _check_norm_out(hidden_states, residual, weight, eps, residual_out),
                lambda: _checks.check_aliasing(hidden_states, residual, None, 0, weight=weight,
                                               residual_mutated=False, hidden_mutated=True,
                                               residual_out=residual_out),
                (hidden_states, residual, weight, residual_out),
                ("add_rmsnorm_out", type(eps), eps),
                _PTRS_NORM_OUT,
                hidden_states, residual, weight=weight, eps=eps, normed_out=hidden_states,
                residual_out=residual_out)
