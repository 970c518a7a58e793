"""The op table: the four capture ops over the one kernel, each declared once.

A declaration is the public function: its signature is the op's schema, its
body says what the call means to the kernel -- the call's five tensors
``(hidden_states, residual, weight, aux, residual_out)`` (None where the op has
none), ``eps``, ``slot`` and ``norm_fp32_sum``. :func:`capture_op` derives the
rest from it: the ``torch.library.triton_op`` (torch.compile sees the kernel),
the opaque CPU op with its fake, and the eager path (memo, checks and launch of
:class:`~eagle_capture.ops.launcher.FastLaunch`).
"""

import functools
import inspect
from typing import Optional, Sequence

import torch
from torch.library import triton_op

from eagle_capture.kernels import add_rmsnorm_capture_kernel, kernel_arguments
from eagle_capture.ops.checks import (
    _check_like_hidden,
    byte_extent,
    check_add_inputs,
    check_aliasing,
    check_aux,
    check_no_autograd,
    check_no_internal_overlap,
    check_norm_inputs,
)
from eagle_capture.ops.launcher import FastLaunch, Plan, pdl_enabled

__all__ = ["add_capture", "add_rmsnorm_capture", "add_rmsnorm_into_slot", "add_rmsnorm_out"]

# The device types whose tensors the capture kernel runs on; the others take the
# torch implementation.
KERNEL_DEVICE_TYPES = frozenset({"cuda"})

LAUNCHER = FastLaunch(add_rmsnorm_capture_kernel, kernel_devices=KERNEL_DEVICE_TYPES)

# The call's tensors, in this order, in every op: (hidden_states, residual,
# weight, aux, residual_out), None where the op has none.
_H, _R, _W, _AUX, _OUT = range(5)

# What a declaration returns: (the five tensors, eps, slot, norm_fp32_sum).
Call = tuple


class CaptureOp:
    """What tells the four ops over the one kernel apart."""

    __slots__ = (
        "name",
        "norm",
        "residual_in_place",
        "aux_required",
        "residual_out_required",
        "cpu",
    )

    def __init__(
        self,
        name: str,
        *,
        norm: bool,
        residual_in_place: bool = False,
        aux_required: bool = False,
        residual_out_required: bool = False,
    ) -> None:
        self.name, self.norm, self.residual_in_place = name, norm, residual_in_place
        self.aux_required, self.residual_out_required = aux_required, residual_out_required
        self.cpu = None  # the opaque CPU op, where there is one

    def __repr__(self) -> str:
        return f"CaptureOp({self.name!r})"


# ----------------------------------------------------------------------------
# Checks and the kernel's arguments, by the call's five tensors
# ----------------------------------------------------------------------------


def _check(op: CaptureOp, tensors, eps, slot, norm_fp32_sum=False) -> None:
    """Everything but aliasing."""
    hidden, residual, weight, aux, residual_out = tensors
    if not op.norm:
        check_add_inputs(hidden, residual)
        check_aux(aux, slot, hidden.shape[0], hidden.shape[1], hidden.dtype, hidden.device)
        return
    if residual is None:
        raise TypeError("eagle_capture: residual must be a tensor for the add+RMSNorm ops")
    if op.aux_required and aux is None:  # the schema's aux is a Tensor
        raise TypeError(f"eagle_capture: aux must be a tensor for {op.name}")
    check_add_inputs(hidden, residual)
    check_norm_inputs(hidden, weight, eps)
    check_no_internal_overlap("hidden_states", hidden)  # the normed output
    if op.residual_in_place:
        check_no_internal_overlap("residual", residual)
    if aux is not None:
        check_aux(aux, slot, hidden.shape[0], hidden.shape[1], hidden.dtype, hidden.device)
    if op.residual_out_required:
        _check_like_hidden("residual_out", residual_out, hidden)
        check_no_internal_overlap("residual_out", residual_out)


def _check_aliasing(op: CaptureOp, tensors, eps, slot, norm_fp32_sum=False) -> None:
    hidden, residual, weight, aux, residual_out = tensors
    check_aliasing(
        hidden,
        residual,
        aux,
        slot,
        weight=weight,
        residual_out=residual_out,
        residual_mutated=op.residual_in_place,
        hidden_mutated=op.norm,
    )


def _check_all(op: CaptureOp, tensors, eps, slot, norm_fp32_sum=False) -> None:
    _check(op, tensors, eps, slot)
    _check_aliasing(op, tensors, eps, slot)


def _pointer_sources(tensors: Sequence, residual_in_place: bool) -> dict:
    """Which of the call's five tensors each kernel pointer takes, by position (the
    eager plan's template): the binding of ``kernel_arguments``, absent roles at
    hidden_states as there."""
    has = [t is not None for t in tensors]
    return {
        "hidden_ptr": _H,
        "residual_ptr": _R if has[_R] else _H,
        "weight_ptr": _W if has[_W] else _H,
        "normed_out_ptr": _H,
        "residual_out_ptr": _R if residual_in_place else (_OUT if has[_OUT] else _H),
        "aux_ptr": _AUX if has[_AUX] else _H,
    }


def _kernel_arguments(
    tensors: Sequence,
    residual_in_place: bool,
    eps: float,
    slot: int,
    norm_fp32_sum: bool,
    use_pdl: bool,
) -> tuple[tuple, dict, int]:
    """(grid, the kernel's arguments by name, num_warps) of a call's five tensors."""
    hidden, residual, weight, aux, residual_out = tensors
    return kernel_arguments(
        hidden,
        residual,
        weight,
        hidden if weight is not None else None,
        residual if residual_in_place else residual_out,
        aux,
        eps=eps,
        slot=slot,
        norm_fp32_sum=norm_fp32_sum,
        use_pdl=use_pdl,
    )


def _plan(op: CaptureOp, tensors, eps, slot, norm_fp32_sum) -> Plan:
    """The eager launch of a checked call signature (``grid`` None: the torch path)."""
    hidden = tensors[_H]
    extents = tuple(byte_extent(t) for t in tensors)
    if not LAUNCHER.runs_kernel(hidden.device):
        return Plan(None, None, (), 0, None, False, extents)
    use_pdl = hidden.is_cuda and pdl_enabled(hidden.device.index)
    grid, values, num_warps = _kernel_arguments(
        tensors, op.residual_in_place, eps, slot, norm_fp32_sum, use_pdl
    )
    sources = _pointer_sources(tensors, op.residual_in_place)
    for pointer in sources:  # bound to the call's tensors by position, per call
        del values[pointer]
    return LAUNCHER.plan(
        grid,
        values,
        sources,
        num_warps,
        hidden.device.index if hidden.is_cuda else None,
        use_pdl,
        extents,
    )


# ----------------------------------------------------------------------------
# The torch implementation (CPU tensors): the kernel's numerics
# ----------------------------------------------------------------------------


def _torch_impl(op: CaptureOp, tensors: Sequence, eps, slot, norm_fp32_sum) -> None:
    hidden, residual, weight, aux, residual_out = tensors
    if op.residual_in_place:
        residual_out = residual
    # torch's same-dtype add rounds once, like the kernel.
    s = hidden + residual if residual is not None else hidden
    # Before any store: the outputs may alias the inputs (in place).
    norm_input = (
        hidden.float() + residual.float()
        if norm_fp32_sum and residual is not None and weight is not None
        else s
    )
    if aux is not None:
        aux[: hidden.shape[0], slot].copy_(s)
    if residual_out is not None:
        residual_out.copy_(s)
    if weight is not None:
        # (x * rstd) * w in fp32, rounded once: SGLang's RMSNorm.forward_native order.
        x = norm_input.float()
        hidden.copy_(x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float())


# ----------------------------------------------------------------------------
# The paths of a call: registered (dispatcher, torch.compile) and eager
# ----------------------------------------------------------------------------


def _registered(op: CaptureOp, args, kwargs, tensors, eps, slot, norm_fp32_sum) -> None:
    """The body of every registered op: check, then the kernel or the CPU path."""
    _check_all(op, tensors, eps, slot)
    hidden = tensors[_H]
    if LAUNCHER.runs_kernel(hidden.device):
        grid, values, num_warps = _kernel_arguments(
            tensors, op.residual_in_place, eps, slot, norm_fp32_sum, use_pdl=False
        )
        LAUNCHER.launch_traced(grid, values, num_warps, hidden.device)
    elif op.cpu is not None:
        op.cpu(*args, **kwargs)
    else:
        _torch_impl(op, tensors, eps, slot, norm_fp32_sum)


# The raw getter: torch.cuda.current_device() adds a lazy-init check (0.2 - 0.6 us);
# CUDA is initialised once a CUDA plan exists.
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _eager(op: CaptureOp, tensors: tuple, eps, slot, norm_fp32_sum) -> None:
    """An eager call: checked once per call signature, aliasing pre-checked on
    every call (it depends on addresses), then the memoised plan's launch."""
    if torch.is_grad_enabled():
        check_no_autograd(op.name, tensors)
    try:  # everything the checks depend on but addresses; with types: 1.0 == 1
        key = (
            op,
            eps,
            slot,
            norm_fp32_sum,
            type(eps),
            type(slot),
            *[(t.shape, t.stride(), t.dtype, t.device) if t is not None else None for t in tensors],
        )
    except AttributeError:  # a non-tensor argument: the full check names it
        key = None
    plan, ptrs = LAUNCHER.eager_plan(
        key, tensors, (op, tensors, eps, slot, norm_fp32_sum), _check_all, _check_aliasing, _plan
    )
    if plan.grid is None:  # the torch implementation
        _torch_impl(op, tensors, eps, slot, norm_fp32_sum)
        return
    if plan.grid[0] and plan.device_index is not None and plan.device_index != _current_device():
        # Triton launches on the current device: elsewhere is an illegal address.
        raise ValueError(
            f"eagle_capture: hidden_states is on cuda:{plan.device_index} but "
            f"the current CUDA device is cuda:{torch.cuda.current_device()}; "
            f"call torch.cuda.set_device({plan.device_index}) first"
        )
    LAUNCHER.launch(plan, tensors, ptrs)


def _with_signature(fn, signature: inspect.Signature, name: str):
    fn.__signature__, fn.__name__, fn.__qualname__ = signature, name, name
    return fn


def _schema_signature(signature: inspect.Signature, mutates_args: tuple) -> inspect.Signature:
    """The op's schema: the public signature without defaults up to the last mutated
    argument. torch 2.11's dispatcher drops trailing arguments equal to their default
    before its in-place bookkeeping, which then indexes a mutated one that is gone
    (IndexError); torch 2.13 keeps them, so only a torch-2.11 machine shows it."""
    params = list(signature.parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in mutates_args)
    return signature.replace(
        parameters=[
            p.replace(default=inspect.Parameter.empty) if i <= last else p
            for i, p in enumerate(params)
        ]
    )


def capture_op(
    *,
    mutates_args: tuple,
    norm: bool,
    residual_in_place: bool = False,
    aux_required: bool = False,
    residual_out_required: bool = False,
    cpu_op: bool = False,
):
    """Declare one op from its public function (see the module docstring):
    registers ``torch.ops.eagle_capture.<name>`` and, with ``cpu_op``, the
    opaque CPU op ``torch.ops.eagle_capture._<name>_cpu`` and its fake; returns
    the public function -- the registered op under torch.compile, the eager
    path otherwise (the dispatcher costs tens of microseconds per call)."""

    def declare(describe):
        name = describe.__name__
        op = CaptureOp(
            name,
            norm=norm,
            residual_in_place=residual_in_place,
            aux_required=aux_required,
            residual_out_required=residual_out_required,
        )
        signature = inspect.signature(describe).replace(return_annotation=None)
        schema = _schema_signature(signature, mutates_args)
        names = tuple(signature.parameters)
        defaults = {
            n: p.default
            for n, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty
        }

        def registered(*args, **kwargs):
            _registered(op, args, kwargs, *describe(*args, **kwargs))

        triton_op(
            f"eagle_capture::{name}",
            _with_signature(registered, schema, name),
            mutates_args=mutates_args,
        )
        if cpu_op:

            def on_cpu(*args, **kwargs):
                _torch_impl(op, *describe(*args, **kwargs))

            op.cpu = torch.library.custom_op(
                f"eagle_capture::_{name}_cpu",
                _with_signature(on_cpu, schema, name),
                mutates_args=mutates_args,
                device_types="cpu",
            )
            op.cpu.register_fake(lambda *args, **kwargs: None)
        compiled = getattr(torch.ops.eagle_capture, name)

        @functools.wraps(describe)
        def public(*args, **kwargs) -> None:
            if torch.compiler.is_compiling():
                # Every argument given, as the schema has no defaults up to its last mutated
                # one; plain tuples and dicts (inspect's binding breaks dynamo's graph).
                compiled(
                    *args, *(kwargs[n] if n in kwargs else defaults[n] for n in names[len(args) :])
                )
            else:
                _eager(op, *describe(*args, **kwargs))

        public.__signature__ = signature
        public.capture_op = op
        return public

    return declare


# ----------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------
#
# torch 2.13's C++ Inductor backend crashes on the regenerated in-place norm
# graph (InductorError: KeyError: 'bufN', pytorch/pytorch#196570; plain torch
# code such as r.copy_(h + r); h.copy_(norm(r)) does it too), so for CPU tensors
# the add+RMSNorm ops call an opaque CPU op (same schema) that Inductor calls
# as it is (cpu_op=True): compiled CPU results are bit-identical to eager.


@capture_op(mutates_args=("aux",), norm=False, aux_required=True)
def add_capture(
    hidden_states: torch.Tensor, residual: Optional[torch.Tensor], aux: torch.Tensor, slot: int
) -> Call:
    """Capture ``hidden_states + residual`` into one slot of the aux buffer.

    ``aux[:T, slot] = hidden_states + residual``, rounded once to the storage
    dtype (bit-identical to torch's ``h + r``); nothing else is written.

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``[T, H]``, bfloat16, float16 or float32; rows may be strided, the last
        dimension must be contiguous. Read only.
    residual : torch.Tensor or None
        ``[T, H]``, the dtype and device of ``hidden_states``; None stores
        ``hidden_states`` itself (layer 0, whose input is the embedding output).
        Read only.
    aux : torch.Tensor
        The whole capture buffer ``[max_tokens, K, H]`` (rows outermost,
        ``max_tokens >= T``), never a view of one slot. Written: ``aux[:T, slot]``.
    slot : int
        The capture slot, ``0 <= slot < K``.

    Returns
    -------
    None
        The result is in ``aux``. Bad arguments or unsafe aliasing raise
        ``ValueError`` / ``TypeError`` naming the argument before anything is
        written.
    """
    return (hidden_states, residual, None, aux, None), 0.0, slot, False


@capture_op(
    mutates_args=("hidden_states", "residual", "aux"),
    norm=True,
    residual_in_place=True,
    cpu_op=True,
)
def add_rmsnorm_capture(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    aux: Optional[torch.Tensor] = None,
    slot: int = 0,
    norm_fp32_sum: bool = False,
) -> Call:
    """Fused add + RMSNorm in place, and the new residual captured into a slot.

    SGLang/FlashInfer ``fused_add_rmsnorm``: ``residual = hidden_states +
    residual`` (rounded once), ``hidden_states = rmsnorm(residual) * weight``
    (fp32 math, rounded once); when ``aux`` is given, the new residual is also
    stored in ``aux[:T, slot]``.

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``[T, H]``, bfloat16, float16 or float32, last dimension contiguous.
        Overwritten with the normed output.
    residual : torch.Tensor
        ``[T, H]``, the dtype and device of ``hidden_states``. Overwritten with
        the sum.
    weight : torch.Tensor
        ``[H]``, contiguous, any supported dtype, on the same device.
    eps : float
        The RMSNorm epsilon, ``>= 0``.
    aux : torch.Tensor, optional
        The whole capture buffer ``[max_tokens, K, H]`` in the dtype of
        ``hidden_states``; None (default) captures nothing. Written:
        ``aux[:T, slot]``.
    slot : int, optional
        The capture slot, ``0 <= slot < K`` (default 0).
    norm_fp32_sum : bool, optional
        True normalises the unrounded fp32 sum (FlashInfer's kernel, SGLang's
        ``forward_native``); False (default) the rounded residual (HF
        transformers, vLLM). The residual and the capture are the rounded sum
        either way.

    Returns
    -------
    None
        The results are in ``hidden_states``, ``residual`` and ``aux``. Bad
        arguments or unsafe aliasing raise ``ValueError`` / ``TypeError``
        naming the argument before anything is written.
    """
    return (hidden_states, residual, weight, aux, None), eps, slot, norm_fp32_sum


@capture_op(mutates_args=("hidden_states", "aux"), norm=True, aux_required=True, cpu_op=True)
def add_rmsnorm_into_slot(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    aux: torch.Tensor,
    slot: int,
    norm_fp32_sum: bool = False,
) -> Call:
    """Fused add + RMSNorm whose residual output *is* ``aux[:T, slot]``.

    ``aux[:T, slot] = hidden_states + residual``; ``hidden_states =
    rmsnorm(aux[:T, slot]) * weight``; ``residual`` is left untouched. The
    capture costs no extra write: the next layer reads its residual from the
    slot and writes the next one with :func:`add_rmsnorm_out` (an in-place
    update would overwrite the capture, and is refused).

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``[T, H]``, bfloat16, float16 or float32, last dimension contiguous.
        Overwritten with the normed output.
    residual : torch.Tensor
        ``[T, H]``, the dtype and device of ``hidden_states``. Read only.
    weight : torch.Tensor
        ``[H]``, contiguous, on the same device.
    eps : float
        The RMSNorm epsilon, ``>= 0``.
    aux : torch.Tensor
        The whole capture buffer ``[max_tokens, K, H]``. Written: ``aux[:T, slot]``.
    slot : int
        The capture slot, ``0 <= slot < K``.
    norm_fp32_sum : bool, optional
        As in :func:`add_rmsnorm_capture` (default False).

    Returns
    -------
    None
        The results are in ``hidden_states`` and ``aux``; errors as in
        :func:`add_rmsnorm_capture`.
    """
    return (hidden_states, residual, weight, aux, None), eps, slot, norm_fp32_sum


@capture_op(
    mutates_args=("hidden_states", "residual_out"),
    norm=True,
    residual_out_required=True,
    cpu_op=True,
)
def add_rmsnorm_out(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor,
    norm_fp32_sum: bool = False,
) -> Call:
    """Fused add + RMSNorm with the new residual written out of place.

    ``residual_out = hidden_states + residual``; ``hidden_states =
    rmsnorm(residual_out) * weight``; ``residual`` is left untouched (the layer
    after :func:`add_rmsnorm_into_slot` reads its residual from the slot).

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``[T, H]``, bfloat16, float16 or float32, last dimension contiguous.
        Overwritten with the normed output.
    residual : torch.Tensor
        ``[T, H]``, the dtype and device of ``hidden_states``. Read only (it may
        be a slot of the aux buffer).
    weight : torch.Tensor
        ``[H]``, contiguous, on the same device.
    eps : float
        The RMSNorm epsilon, ``>= 0``.
    residual_out : torch.Tensor
        ``[T, H]``, the dtype and device of ``hidden_states``, sharing no memory
        with it; may be ``residual`` itself. Overwritten with the sum.
    norm_fp32_sum : bool, optional
        As in :func:`add_rmsnorm_capture` (default False).

    Returns
    -------
    None
        The results are in ``hidden_states`` and ``residual_out``; errors as in
        :func:`add_rmsnorm_capture`.
    """
    return (hidden_states, residual, weight, None, residual_out), eps, 0, norm_fp32_sum
