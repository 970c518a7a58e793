"""The live self-check's tolerance (``EAGLE_CAPTURE_VERIFY``), one rule for both
engines: the capture (the residual) must be bit-exact; the normed output may differ
from the engine's own norm kernel by rsqrt / reduction-order rounding (FlashInfer vs
ours: 1 ulp on ~6e-6 of the elements at T = 4096, H200; vLLM's native norm rounds
x * rstd to bf16 before the weight multiply, ours rounds once), so a few ulps per
dtype are allowed, relative to the engine's value with the same floor."""

import torch

__all__ = ["VERIFY_NORM_RTOL", "beyond_rounding", "norm_rtol"]

VERIFY_NORM_RTOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 2.0**-20}


def norm_rtol(dtype: torch.dtype) -> float:
    """The normed output's relative tolerance for ``dtype`` (2**-6 for a dtype not
    in the table)."""
    return VERIFY_NORM_RTOL.get(dtype, 2.0**-6)


def beyond_rounding(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether some element of ``got`` is further from the engine's ``ref`` than
    rounding explains: ``|got - ref| > rtol * (1 + |ref|)``; a NaN on either side
    is beyond it."""
    rtol = norm_rtol(got.dtype)
    return not torch.allclose(got.float(), ref.float(), rtol=rtol, atol=rtol)
