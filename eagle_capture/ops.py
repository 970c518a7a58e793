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

Each op is described once, by an :class:`OpSpec` (its arguments, which are
tensors, which kernel pointer each tensor is bound to by role name, what it
mutates, its checker); the registered op's body, its CPU implementation and
the eager fast path (memo key, pointer template, launch plan) are all derived
from the spec. The kernel's arguments are bound by *parameter name*, read from
the kernel's signature, in one place (:func:`_kernel_arguments`,
:class:`~eagle_capture._launcher.KernelSignature`): no code here knows an
argument's position.

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
tensors take -- the registered ops' launch through ``wrap_triton`` (what
``launch_kernel(..., _wrap=wrap_triton)`` does), the memoised plan and its
pointer template on the eager path -- with the
kernel run by Triton's interpreter. Only the direct C launch of a cached
compiled kernel (and PDL) is GPU-only. The eager CUDA path is unchanged by it;
the registered ops read one flag.
"""

import contextlib
import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
from torch.library import triton_op, wrap_triton

from . import _checks
from ._launcher import CachedLauncher, KernelSignature, hooks_active, tuple_getter
from .kernels import HAS_PDL, add_rmsnorm_capture_kernel, launch_config
from .reference import rmsnorm_fp32

__all__ = [
    "add_capture",
    "add_rmsnorm_capture",
    "add_rmsnorm_into_slot",
    "add_rmsnorm_out",
    "kernel_on_cpu",
    "launch_kernel",
]


# ----------------------------------------------------------------------------
# The kernel's arguments, by name (CUDA, or CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------

_KERNEL = KernelSignature(add_rmsnorm_capture_kernel)
_KERNEL_PARAMS = _KERNEL.params


def _pointer_arguments(hidden, residual=None, weight=None, normed_out=None, residual_out=None,
                       aux=None) -> dict:
    """The kernel's pointer arguments by parameter name, from what each role is
    bound to (tensors for a launch; the op tensors' positions for the eager
    pointer template). An absent role (None) gets ``hidden`` -- a valid pointer,
    so the signature never changes; the constexpr flags compile its accesses
    away. The norm's output is absent without a weight."""
    return {
        "hidden_ptr": hidden,
        "residual_ptr": residual if residual is not None else hidden,
        "weight_ptr": weight if weight is not None else hidden,
        "normed_out_ptr": normed_out if weight is not None else hidden,
        "residual_out_ptr": residual_out if residual_out is not None else hidden,
        "aux_ptr": aux if aux is not None else hidden,
    }


# The pointer roles: the kernel's ``<role>_ptr`` parameters.
_POINTER_ROLES = tuple(inspect.signature(_pointer_arguments).parameters)
if {f"{role}_ptr" for role in _POINTER_ROLES} != {p for p in _KERNEL_PARAMS if p.endswith("_ptr")}:
    raise ImportError(f"eagle_capture: the kernel's pointer parameters "
                      f"{[p for p in _KERNEL_PARAMS if p.endswith('_ptr')]} are not the roles "
                      f"{_POINTER_ROLES} that eagle_capture.ops binds")


def _kernel_arguments(hidden, residual=None, weight=None, normed_out=None, residual_out=None,
                      aux=None, eps=0.0, slot=0, norm_fp32_sum=False, use_pdl=False):
    """(grid, {kernel parameter: value}, num_warps) for validated arguments,
    given by pointer role (``hidden`` ... ``aux``) and scalar name."""
    num_tokens, hidden_size = hidden.shape
    apply_norm = weight is not None
    # int(): under dynamic-shape tracing H may be a SymInt; the constexpr
    # BLOCK_H depends on it, so specialising on the model's hidden size is right.
    block_h, num_warps, col_blocks = launch_config(int(hidden_size), apply_norm)
    values = _pointer_arguments(hidden, residual, weight, normed_out, residual_out, aux)
    values.update(
        hidden_size=hidden_size,
        eps=float(eps),
        stride_hidden=hidden.stride(0),
        stride_residual=residual.stride(0) if residual is not None else 0,
        stride_normed_out=normed_out.stride(0) if apply_norm else 0,
        stride_residual_out=residual_out.stride(0) if residual_out is not None else 0,
        stride_aux_row=aux.stride(0) if aux is not None else 0,
        aux_slot_offset=slot * aux.stride(1) if aux is not None else 0,
        HAS_RESIDUAL=residual is not None,
        APPLY_NORM=apply_norm,
        STORE_RESIDUAL=residual_out is not None,
        CAPTURE=aux is not None,
        BLOCK_H=block_h,
        USE_PDL=use_pdl,
        NORM_FP32_SUM=bool(norm_fp32_sum) and apply_norm and residual is not None,
    )
    return (num_tokens, col_blocks), values, num_warps


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
    _launch(dict(hidden=hidden_states, residual=residual, weight=weight, normed_out=normed_out,
                 residual_out=residual_out, aux=aux, eps=eps, slot=slot,
                 norm_fp32_sum=norm_fp32_sum), _wrap)


def _launch(call: Mapping[str, Any], wrap=None) -> None:
    """:func:`launch_kernel` on a call given by role and scalar name."""
    hidden = call["hidden"]
    if hidden.shape[0] == 0:
        return  # a zero-size grid is not a valid launch
    use_pdl = wrap is None and hidden.is_cuda and pdl_enabled(hidden.device.index)
    grid, values, num_warps = _kernel_arguments(**call, use_pdl=use_pdl)
    args = _KERNEL.bind(values)
    kernel = add_rmsnorm_capture_kernel if wrap is None else wrap(add_rmsnorm_capture_kernel)
    # Triton launches on the *current* device: tensors on another GPU would be read at
    # illegal addresses. The registered ops (the dispatcher path) may be called so;
    # compiled code sets its own device guard.
    guard = (torch.cuda.device(hidden.device)
             if (hidden.is_cuda and not torch.compiler.is_compiling()
                 and hidden.device.index != torch.cuda.current_device())
             else contextlib.nullcontext())
    with guard:
        if use_pdl:
            kernel[grid](*args, num_warps=num_warps, launch_pdl=True)
        else:
            kernel[grid](*args, num_warps=num_warps)


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
    launch as ``launch_kernel(..., _wrap=wrap_triton)`` does; the eager functions memoise
    the same ``_EagerPlan`` and build the kernel arguments with its pointer
    template, launched through Triton's entry point (the direct C launch is
    GPU-only). PDL is off. Needs ``TRITON_INTERPRET=1`` set before
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

def _torch_impl(hidden, residual=None, weight=None, normed_out=None, residual_out=None, aux=None,
                eps=0.0, slot=0, norm_fp32_sum=False) -> None:
    """The kernel's effect in torch, on a call given by role and scalar name."""
    num_tokens = hidden.shape[0]
    # torch's same-dtype add rounds once, like the kernel: the captured value
    # is bit-identical to SGLang's eager hidden_states + residual.
    s = hidden + residual if residual is not None else hidden
    # Before any store: residual_out / normed_out may alias the inputs (in place).
    norm_input = (hidden.float() + residual.float()
                  if norm_fp32_sum and residual is not None and weight is not None else s)
    if aux is not None:
        aux[:num_tokens, slot].copy_(s)
    if residual_out is not None:
        residual_out.copy_(s)
    if weight is not None:
        # (x * rstd) * w in fp32, rounded once: the operation order of SGLang's
        # RMSNorm.forward_native, so the CPU path is bit-identical to it.
        normed_out.copy_(rmsnorm_fp32(norm_input, weight, eps))


# ----------------------------------------------------------------------------
# Argument checking per op (shared by the op bodies and the eager fast path);
# each takes the op's arguments in schema order
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


def _check_add_rmsnorm_capture(hidden_states, residual, weight, eps, aux, slot,
                               norm_fp32_sum=False) -> None:
    _check_norm(hidden_states, residual, weight, eps, aux, slot, residual_mutated=True)


def _check_add_rmsnorm_into_slot(hidden_states, residual, weight, eps, aux, slot,
                                 norm_fp32_sum=False) -> None:
    if aux is None:  # the schema's aux is a Tensor; an eager call would skip the capture
        raise TypeError("eagle_capture: aux must be a tensor for add_rmsnorm_into_slot")
    _check_norm(hidden_states, residual, weight, eps, aux, slot)


def _check_add_rmsnorm_out(hidden_states, residual, weight, eps, residual_out,
                           norm_fp32_sum=False) -> None:
    _check_norm(hidden_states, residual, weight, eps, None, 0)
    _checks.check_residual_out(residual_out, hidden_states)
    _checks.check_no_internal_overlap("residual_out", residual_out)


# ----------------------------------------------------------------------------
# The op specs
# ----------------------------------------------------------------------------

# The scalars a call passes to the kernel (by these names; see _kernel_arguments).
_KERNEL_SCALARS = ("eps", "slot", "norm_fp32_sum")


@dataclasses.dataclass(frozen=True, eq=False)
class OpSpec:
    """One op, from which every path derives its handling of a call.

    ``params`` are the op's arguments in schema order (the registered op's,
    the public function's and the hidden CPU op's); ``tensors`` the tensor
    ones (the eager memo key, the aliasing scan, the autograd refusal);
    ``pointers`` binds kernel pointer roles (``_POINTER_ROLES``) to arguments by
    name; the other arguments are kernel scalars (``_KERNEL_SCALARS``) of the
    same name. The kernel's flags follow from which roles are bound to a
    tensor (HAS_RESIDUAL, APPLY_NORM, STORE_RESIDUAL, CAPTURE) and from
    ``norm_fp32_sum`` (NORM_FP32_SUM). ``mutates`` is the schema's
    ``mutates_args``, and decides which aliasing the op refuses. ``check``
    validates a call (the op's arguments, positionally). ``cpu_op`` names the
    private CPU op that the registered op calls for CPU tensors (None: the
    torch implementation in line, which Inductor may regenerate).
    """

    name: str
    params: tuple
    tensors: tuple
    pointers: Mapping[str, str]
    mutates: tuple
    check: Callable[..., None]
    cpu_op: Optional[str] = None
    # Derived (getters over a call's argument tuple):
    tensors_of: Callable = dataclasses.field(init=False, repr=False)
    scalars_of: Callable = dataclasses.field(init=False, repr=False)
    positions: Mapping[str, int] = dataclasses.field(init=False, repr=False)
    _named: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        scalars = tuple(p for p in self.params if p not in self.tensors)
        problems = [f"tensor {t!r} is not an argument" for t in self.tensors
                    if t not in self.params]
        problems += [f"role {r!r} is not a kernel pointer" for r in self.pointers
                     if r not in _POINTER_ROLES]
        problems += [f"role {r!r} is bound to {a!r}, not a tensor argument"
                     for r, a in self.pointers.items() if a not in self.tensors]
        problems += [f"{a!r} is neither a tensor argument nor a kernel scalar" for a in scalars
                     if a not in _KERNEL_SCALARS]
        problems += [f"mutated {m!r} is not a tensor argument" for m in self.mutates
                     if m not in self.tensors]
        problems += ["no tensor is bound to the hidden role"] * ("hidden" not in self.pointers)
        problems += [f"tensor {t!r} is bound to no role" for t in self.tensors
                     if t not in self.pointers.values()]
        if problems:
            raise TypeError(f"eagle_capture: op spec {self.name}: " + "; ".join(problems))
        index = {p: i for i, p in enumerate(self.params)}
        set_ = functools.partial(object.__setattr__, self)
        set_("tensors_of", tuple_getter(index[t] for t in self.tensors))
        set_("scalars_of", tuple_getter(index[s] for s in scalars))
        # Each role's position in tensors_of(args): the eager pointer template.
        set_("positions", {role: self.tensors.index(arg) for role, arg in self.pointers.items()})
        roles = [(role, index[arg]) for role, arg in self.pointers.items()]
        set_("_named", tuple(roles + [(s, index[s]) for s in scalars]))

    def call(self, args: tuple) -> dict:
        """The call ``args`` (schema order) by pointer role and scalar name:
        what :func:`_kernel_arguments` and :func:`_torch_impl` take."""
        return {name: args[i] for name, i in self._named}


_NORM_PARAMS = ("hidden_states", "residual", "weight", "eps")
_NORM_POINTERS = dict(hidden="hidden_states", residual="residual", weight="weight",
                      normed_out="hidden_states")

ADD_CAPTURE = OpSpec(
    "add_capture", params=("hidden_states", "residual", "aux", "slot"),
    tensors=("hidden_states", "residual", "aux"),
    pointers=dict(hidden="hidden_states", residual="residual", aux="aux"),
    mutates=("aux",), check=_check_add_capture)

ADD_RMSNORM_CAPTURE = OpSpec(
    "add_rmsnorm_capture", params=_NORM_PARAMS + ("aux", "slot", "norm_fp32_sum"),
    tensors=("hidden_states", "residual", "weight", "aux"),
    pointers=dict(_NORM_POINTERS, residual_out="residual", aux="aux"),
    mutates=("hidden_states", "residual", "aux"), check=_check_add_rmsnorm_capture,
    cpu_op="_add_rmsnorm_capture_cpu")

ADD_RMSNORM_INTO_SLOT = OpSpec(
    "add_rmsnorm_into_slot", params=_NORM_PARAMS + ("aux", "slot", "norm_fp32_sum"),
    tensors=("hidden_states", "residual", "weight", "aux"),
    pointers=dict(_NORM_POINTERS, aux="aux"),
    mutates=("hidden_states", "aux"), check=_check_add_rmsnorm_into_slot,
    cpu_op="_add_rmsnorm_into_slot_cpu")

ADD_RMSNORM_OUT = OpSpec(
    "add_rmsnorm_out", params=_NORM_PARAMS + ("residual_out", "norm_fp32_sum"),
    tensors=("hidden_states", "residual", "weight", "residual_out"),
    pointers=dict(_NORM_POINTERS, residual_out="residual_out"),
    mutates=("hidden_states", "residual_out"), check=_check_add_rmsnorm_out,
    cpu_op="_add_rmsnorm_out_cpu")

SPECS = (ADD_CAPTURE, ADD_RMSNORM_CAPTURE, ADD_RMSNORM_INTO_SLOT, ADD_RMSNORM_OUT)


def _check_aliasing(spec: OpSpec, args: tuple) -> None:
    """Memory shared between the call's arguments that the op cannot allow
    (which depends on what it mutates)."""
    named = dict(zip(spec.params, args))
    _checks.check_aliasing(named["hidden_states"], named["residual"], named.get("aux"),
                           named.get("slot", 0), weight=named.get("weight"),
                           residual_mutated="residual" in spec.mutates,
                           hidden_mutated="hidden_states" in spec.mutates,
                           residual_out=named.get("residual_out"))


# ----------------------------------------------------------------------------
# Registered ops, and the CPU implementation's private ops
# ----------------------------------------------------------------------------
#
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

def _run_op(spec: OpSpec, args: tuple) -> None:
    """The body of every registered op: validate, then the torch implementation
    (CPU tensors) or the kernel through ``wrap_triton``."""
    spec.check(*args)
    _check_aliasing(spec, args)
    call = spec.call(args)
    if _torch_path(call["hidden"]):
        if spec.cpu_op is not None:
            getattr(torch.ops.eagle_capture, spec.cpu_op)(*args)
        else:
            _torch_impl(**call)
        return
    _launch(call, wrap=wrap_triton)


def _mutates_only(*args, **kwargs) -> None:
    """Fake implementation of the CPU ops: they only write their arguments."""
    return None


def _cpu_op(spec: OpSpec):
    return torch.library.custom_op(f"eagle_capture::{spec.cpu_op}", mutates_args=spec.mutates,
                                   device_types="cpu")


@_cpu_op(ADD_RMSNORM_CAPTURE)
def _add_rmsnorm_capture_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, eps: float, aux: Optional[torch.Tensor],
                             slot: int, norm_fp32_sum: bool) -> None:
    _torch_impl(**ADD_RMSNORM_CAPTURE.call((hidden_states, residual, weight, eps, aux, slot,
                                            norm_fp32_sum)))


@_cpu_op(ADD_RMSNORM_INTO_SLOT)
def _add_rmsnorm_into_slot_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float, aux: torch.Tensor,
                               slot: int, norm_fp32_sum: bool) -> None:
    _torch_impl(**ADD_RMSNORM_INTO_SLOT.call((hidden_states, residual, weight, eps, aux, slot,
                                              norm_fp32_sum)))


@_cpu_op(ADD_RMSNORM_OUT)
def _add_rmsnorm_out_cpu(hidden_states: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, eps: float, residual_out: torch.Tensor,
                         norm_fp32_sum: bool) -> None:
    _torch_impl(**ADD_RMSNORM_OUT.call((hidden_states, residual, weight, eps, residual_out,
                                        norm_fp32_sum)))


for _op in (_add_rmsnorm_capture_cpu, _add_rmsnorm_into_slot_cpu, _add_rmsnorm_out_cpu):
    _op.register_fake(_mutates_only)


@triton_op("eagle_capture::add_capture", mutates_args=ADD_CAPTURE.mutates)
def _add_capture_op(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                    aux: torch.Tensor, slot: int) -> None:
    _run_op(ADD_CAPTURE, (hidden_states, residual, aux, slot))


@triton_op("eagle_capture::add_rmsnorm_capture", mutates_args=ADD_RMSNORM_CAPTURE.mutates)
def _add_rmsnorm_capture_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                            weight: torch.Tensor, eps: float, aux: Optional[torch.Tensor],
                            slot: int, norm_fp32_sum: bool = False) -> None:
    _run_op(ADD_RMSNORM_CAPTURE, (hidden_states, residual, weight, eps, aux, slot, norm_fp32_sum))


@triton_op("eagle_capture::add_rmsnorm_into_slot", mutates_args=ADD_RMSNORM_INTO_SLOT.mutates)
def _add_rmsnorm_into_slot_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                              weight: torch.Tensor, eps: float, aux: torch.Tensor,
                              slot: int, norm_fp32_sum: bool = False) -> None:
    _run_op(ADD_RMSNORM_INTO_SLOT, (hidden_states, residual, weight, eps, aux, slot,
                                    norm_fp32_sum))


@triton_op("eagle_capture::add_rmsnorm_out", mutates_args=ADD_RMSNORM_OUT.mutates)
def _add_rmsnorm_out_op(hidden_states: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor, eps: float, residual_out: torch.Tensor,
                        norm_fp32_sum: bool = False) -> None:
    _run_op(ADD_RMSNORM_OUT, (hidden_states, residual, weight, eps, residual_out,
                              norm_fp32_sum))


# ----------------------------------------------------------------------------
# The eager fast path: a launch plan per validated call signature
# ----------------------------------------------------------------------------
#
# Eager calls skip the dispatcher (tens of us per call) and memoise validation:
# every check depends only on the arguments' shapes, strides, dtypes, devices,
# the slot and eps, so a call whose signature already passed the checks
# needs none again. The memo key is that signature; the aliasing check, which
# depends on storage, runs on every call.

_cached_launch = CachedLauncher(add_rmsnorm_capture_kernel)


class _EagerPlan(NamedTuple):
    """What a validated eager call signature launches with: everything but the
    tensors' addresses, computed once per signature. The kernel's positional
    arguments are ``(*head(pointers), *tail)``, where ``pointers`` are the call's
    tensors (or their addresses) in ``spec.tensors`` order."""
    grid: tuple
    head: Callable      # the pointer template (KernelSignature.template)
    tail: tuple
    num_warps: int
    device_index: Optional[int]  # None for CPU tensors (kernel_on_cpu)
    key: tuple          # the CachedLauncher key: what Triton specialises on
    use_pdl: bool


def _eager_plan(spec: OpSpec, args: tuple) -> _EagerPlan:
    call = spec.call(args)
    device_index = call["hidden"].device.index   # None for CPU tensors (kernel_on_cpu)
    use_pdl = call["hidden"].is_cuda and pdl_enabled(device_index)
    grid, values, num_warps = _kernel_arguments(**call, use_pdl=use_pdl)
    values = dict(zip(_KERNEL_PARAMS, _KERNEL.bind(values)))  # checked against the signature
    # The launch's pointer binding applied to positions: which of the call's
    # tensors each pointer argument is (an absent role resolves as in a launch).
    sources = _pointer_arguments(**{role: spec.positions[role] for role in spec.pointers
                                    if call[role] is not None})
    head, tail = _KERNEL.template(sources, values)
    # Triton specialises pointers on dtype (alignment: CachedLauncher's `aligned`)
    # and ints on value; it does not specialise floats (eps).
    key = (device_index, tuple(values[p].dtype for p in sources),
           tuple(v for p, v in values.items() if p not in sources and not isinstance(v, float)))
    return _EagerPlan(grid, head, tail, num_warps, device_index, key, use_pdl)


def _launch_planned(plan: _EagerPlan, tensors: tuple, aligned: bool):
    """Launch through the CachedLauncher (tensors as pointer arguments); returns
    its DirectLaunch for the plan's key when one is cached."""
    return _cached_launch(plan.grid, (*plan.head(tensors), *plan.tail), plan.key,
                          plan.num_warps, plan.device_index, aligned, plan.use_pdl)


_PLANS: dict = {}   # kernel_on_cpu() swaps in _PLANS_KERNEL_ON_CPU while it is active
_MAX_PLANS = 4096
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


def _eager_call(spec: OpSpec, args: tuple) -> None:
    """Validate (once per call signature), check aliasing (every call) and run.

    The memo key holds the op, its scalar arguments (with their types: ``1.0 ==
    1`` must not pass for an int slot) and the tensors' shapes, strides, dtypes
    and devices: everything ``spec.check`` depends on. Aliasing depends on
    addresses, so each call compares the tensors' byte ranges (their extents
    are part of the memoised entry) and runs the aliasing check -- which knows
    which overlaps the op allows -- only when two ranges do overlap.

    After the first launch of a signature, the entry holds the compiled
    kernel's DirectLaunch, and a call costs: the memo key, one ``data_ptr``
    per tensor, the overlap scan and the raw launch with integer addresses.
    """
    tensors = spec.tensors_of(args)
    scalars = spec.scalars_of(args)
    if torch.is_grad_enabled():
        _checks.check_no_autograd(spec.name, tensors)
    try:
        key = (spec, scalars, *map(type, scalars),
               *[(t.shape, t.stride(), t.dtype, t.device) if t is not None else None
                 for t in tensors])
    except AttributeError:  # a non-tensor argument: let the full check name it
        key = None
    entry = _PLANS.get(key) if key is not None else None
    if entry is None:
        spec.check(*args)
        _check_aliasing(spec, args)
        on_kernel = spec.call(args)["hidden"].is_cuda or _KERNEL_ON_CPU
        entry = _Entry(_eager_plan(spec, args) if on_kernel else None,
                       tuple(_checks.byte_extent(t) for t in tensors))
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = entry
        ptrs = [t.data_ptr() if t is not None else 0 for t in tensors]
    else:
        ptrs = [t.data_ptr() if t is not None else 0 for t in tensors]
        if _checks.spans_meet(ptrs, entry.extents):
            _check_aliasing(spec, args)  # raises, or allows (a residual from another slot)
    plan = entry.plan
    if plan is None:  # CPU tensors
        cpu_plan = entry.cpu_plan
        if cpu_plan is not None:  # kernel_on_cpu(): Triton's entry point (its interpreter)
            if cpu_plan.grid[0]:  # a zero-size grid is not a valid launch
                _launch_planned(cpu_plan, tensors, aligned=False)
        else:
            _torch_impl(**spec.call(args))
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
                      *plan.head(ptrs), *plan.tail)
    else:
        direct = _launch_planned(plan, tensors, aligned)
        if direct is not None:
            entry.direct = direct


# ----------------------------------------------------------------------------
# Public entry points: direct launch in eager mode, the op under torch.compile
# ----------------------------------------------------------------------------

def add_capture(hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                aux: torch.Tensor, slot: int) -> None:
    """``aux[:T, slot] = hidden_states + residual`` (or ``hidden_states`` when
    ``residual`` is None: layer 0, whose input is the embedding output)."""
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_capture(hidden_states, residual, aux, slot)
    else:
        _eager_call(ADD_CAPTURE, (hidden_states, residual, aux, slot))


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
    args = (hidden_states, residual, weight, eps, aux, slot, norm_fp32_sum)
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_capture(*args)
    else:
        _eager_call(ADD_RMSNORM_CAPTURE, args)


def add_rmsnorm_into_slot(hidden_states: torch.Tensor, residual: torch.Tensor,
                          weight: torch.Tensor, eps: float, aux: torch.Tensor,
                          slot: int, norm_fp32_sum: bool = False) -> None:
    """Fused add+RMSNorm whose residual output *is* ``aux[:T, slot]``: the capture
    costs no extra write. ``residual`` is left untouched; the next layer must read
    its residual from the slot and write the next one with :func:`add_rmsnorm_out`.
    ``norm_fp32_sum`` as in :func:`add_rmsnorm_capture`."""
    args = (hidden_states, residual, weight, eps, aux, slot, norm_fp32_sum)
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_into_slot(*args)
    else:
        _eager_call(ADD_RMSNORM_INTO_SLOT, args)


def add_rmsnorm_out(hidden_states: torch.Tensor, residual: torch.Tensor,
                    weight: torch.Tensor, eps: float, residual_out: torch.Tensor,
                    norm_fp32_sum: bool = False) -> None:
    """Fused add+RMSNorm with an out-of-place residual: ``residual_out = h + r``;
    ``hidden_states = rmsnorm(residual_out) * weight``; ``residual`` untouched.
    ``norm_fp32_sum`` as in :func:`add_rmsnorm_capture`."""
    args = (hidden_states, residual, weight, eps, residual_out, norm_fp32_sum)
    if torch.compiler.is_compiling():
        torch.ops.eagle_capture.add_rmsnorm_out(*args)
    else:
        _eager_call(ADD_RMSNORM_OUT, args)
