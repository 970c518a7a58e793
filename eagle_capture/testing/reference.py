"""Eager references the fused ops are tested and benchmarked against.

``sglang_eager_capture`` is the path being replaced (SGLang <= 0.5.13,
``DeepseekV2Model.forward`` + ``LogitsProcessor``): one ``h + r`` per captured
layer, appended to a list, ``torch.cat(aux, -1)`` at the end.
``add_rmsnorm_reference`` is a float64 fused add+RMSNorm with the kernel's
semantics: the residual rounded to the storage dtype once, the norm taken of
that rounded value. ``rmsnorm_fp32`` is a plain RMSNorm in fp32, in the
operation order of SGLang's ``RMSNorm.forward_native``: the CPU path of the ops
rounds it into its output, so the CPU ops are bit-identical to SGLang's
native norm; the float64 reference is the independent oracle.
"""

from typing import Optional, Sequence

import torch


def sglang_eager_capture(
    captures: Sequence[tuple[torch.Tensor, Optional[torch.Tensor]]],
) -> torch.Tensor:
    """``torch.cat([h + r for h, r in captures], -1)``; ``r is None`` captures ``h``."""
    aux = [h + r if r is not None else h.clone() for h, r in captures]
    return torch.cat(aux, dim=-1)


def add_rmsnorm_reference(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_fp32_sum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(normed, new_residual)``: ``new_residual = h + r`` in the input dtype
    (exactly what the ops store and capture); ``normed`` in float64 (compare with a
    dtype tolerance after the kernel's single rounding), taken of the rounded
    residual or, with ``norm_fp32_sum``, of the exact sum (FlashInfer's choice)."""
    new_residual = hidden_states + residual
    x = hidden_states.double() + residual.double() if norm_fp32_sum else new_residual.double()
    rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * rstd * weight.double(), new_residual


def rmsnorm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, unrounded: the operation
    order of SGLang's ``RMSNorm.forward_native`` (and of the ops' CPU path, which
    rounds this once into its output). Round with ``.to(dtype)`` or ``out.copy_``."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
