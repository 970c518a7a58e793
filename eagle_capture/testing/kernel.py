"""The capture kernel outside the ops' eager fast path, for tests.

:func:`launch_kernel` launches the kernel alone, every feature combination by
argument name, through Triton's entry point (CUDA, or CPU tensors under
Triton's interpreter): the kernel's own tests, independent of the ops.

:func:`kernel_on_cpu`: inside ``with kernel_on_cpu():`` CPU tensors take the code path CUDA tensors
take -- the registered ops' ``wrap_triton`` launch, the eager memo and its
pointer template -- with the kernel run by Triton's interpreter. Only the
direct launch of a compiled kernel (and PDL) stays GPU-only. Needs
``TRITON_INTERPRET=1`` before ``eagle_capture`` is imported (tests/conftest.py
sets it without a GPU). The interpreter truncates fp32 -> bf16 instead of
rounding (docs/engine_facts.md section 4). Not thread-safe; nests.
"""

import contextlib
from typing import Optional

import torch

from eagle_capture.kernels import add_rmsnorm_capture_kernel, kernel_arguments
from eagle_capture.ops import table


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
) -> None:
    """The kernel on unchecked arguments: ``aux`` -> capture into ``aux[:T, slot]``;
    ``residual_out`` -> store the new residual; ``weight`` + ``normed_out`` -> RMSNorm."""
    if hidden_states.shape[0] == 0:
        return  # a zero-size grid is not a valid launch
    grid, values, num_warps = kernel_arguments(
        hidden_states,
        residual,
        weight,
        normed_out,
        residual_out,
        aux,
        eps=eps,
        slot=slot,
        norm_fp32_sum=norm_fp32_sum,
    )
    add_rmsnorm_capture_kernel[grid](**values, num_warps=num_warps)


def kernel_interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    return isinstance(add_rmsnorm_capture_kernel, InterpretedFunction)


@contextlib.contextmanager
def kernel_on_cpu():
    if not kernel_interpreted():
        raise RuntimeError(
            "eagle_capture.testing.kernel.kernel_on_cpu() needs Triton's "
            "interpreter: set TRITON_INTERPRET=1 before eagle_capture is imported"
        )
    launcher = table.LAUNCHER
    if "cpu" in launcher.kernel_devices:  # nested
        yield
        return
    # Plans made for CPU tensors outside the block run the torch implementation.
    launcher.forget()
    devices, launcher.kernel_devices = launcher.kernel_devices, launcher.kernel_devices | {"cpu"}
    try:
        yield
    finally:
        launcher.kernel_devices = devices
        launcher.forget()
