"""The Triton kernel itself, every constexpr flag combination.

On a GPU it runs compiled and the stored residual/capture must equal torch's
``h + r`` bit for bit. Without a GPU it runs under ``TRITON_INTERPRET=1`` on
CPU tensors (small shapes: the interpreter is ~1 s per 64 x 7168 row block).
The interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest
even (docs/engine_facts.md section 4), so for bf16 there the expected value is the fp32
sum truncated to bf16 -- still compared bit for bit, so an indexing or
masking bug fails just as it would on the GPU. fp16 and fp32 casts are exact
in the interpreter and are compared against torch directly.
"""

import pytest
import torch

from conftest import (
    DTYPES,
    HAS_CUDA,
    INTERPRETED,
    INTERPRETER_NORM_TOLERANCES,
    NORM_TOLERANCES,
    assert_bitwise_equal,
    assert_untouched,
    make_rows,
    poisoned_aux,
    truncate_to_bf16,
)
from eagle_capture.testing.kernel import launch_kernel
from eagle_capture.testing.reference import add_rmsnorm_reference

DEVICE = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and not INTERPRETED:
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

# (T, H): the interpreter gets small shapes, the GPU the full set.
SHAPES = (
    [(0, 7), (1, 1), (3, 7), (17, 1000), (2, 7168)]
    if INTERPRETED
    else [(t, h) for t in (0, 1, 3, 257) for h in (1, 7, 1000, 7168)]
    # + a long grid, and one launch in each of one_wave_warps' bands (32 and 8 warps)
    + [(4099, 7168), (232, 7168), (600, 2880)]
)
EPS = 1e-6


def expected_sum(h: torch.Tensor, r) -> torch.Tensor:
    if r is None:
        return h.clone()
    if INTERPRETED and h.dtype == torch.bfloat16:
        return truncate_to_bf16(h.float() + r.float())
    return h + r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden_size", SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_capture_only(dtype, num_tokens, hidden_size, with_residual):
    h = make_rows(num_tokens, hidden_size, dtype, DEVICE, strided=True)
    r = make_rows(num_tokens, hidden_size, dtype, DEVICE) if with_residual else None
    aux = poisoned_aux(num_tokens + 3, 3, hidden_size, dtype, DEVICE)
    launch_kernel(h, r, aux=aux, slot=2)
    assert_bitwise_equal(aux[:num_tokens, 2], expected_sum(h, r))
    assert_untouched(aux, num_tokens, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden_size", SHAPES)
@pytest.mark.parametrize("capture", [True, False])
@pytest.mark.parametrize("store_residual", [True, False])
def test_add_rmsnorm(dtype, num_tokens, hidden_size, capture, store_residual):
    h = make_rows(num_tokens, hidden_size, dtype, DEVICE, strided=True)
    r = make_rows(num_tokens, hidden_size, dtype, DEVICE, strided=True)
    w = (1 + 0.1 * torch.randn(hidden_size)).to(dtype=dtype, device=DEVICE)
    s = expected_sum(h, r)
    # Reference normed from the value the kernel actually stored (bit-equal to s).
    normed_ref = add_rmsnorm_reference(s, torch.zeros_like(s), w, EPS)[0]
    aux = poisoned_aux(num_tokens + 1, 2, hidden_size, dtype, DEVICE) if capture else None
    residual_out = torch.full_like(s, float("nan")) if store_residual else None
    normed = torch.full_like(s, float("nan"))

    launch_kernel(
        h, r, weight=w, eps=EPS, normed_out=normed, residual_out=residual_out, aux=aux, slot=1
    )

    tol = (INTERPRETER_NORM_TOLERANCES if INTERPRETED else NORM_TOLERANCES)[dtype]
    torch.testing.assert_close(normed.double(), normed_ref, **tol)
    if store_residual:
        assert_bitwise_equal(residual_out, s)
    if capture:
        assert_bitwise_equal(aux[:num_tokens, 1], s)
        assert_untouched(aux, num_tokens, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place(dtype):
    """normed_out aliasing hidden and residual_out aliasing residual (the
    fused_add_rmsnorm form) read each row fully before writing it."""
    h = make_rows(5, 1000, dtype, DEVICE, strided=True)
    r = make_rows(5, 1000, dtype, DEVICE, strided=True)
    w = torch.ones(1000, dtype=dtype, device=DEVICE)
    s = expected_sum(h, r)
    normed_ref = add_rmsnorm_reference(s, torch.zeros_like(s), w, EPS)[0]
    launch_kernel(h, r, weight=w, eps=EPS, normed_out=h, residual_out=r)
    assert_bitwise_equal(r, s)
    tol = (INTERPRETER_NORM_TOLERANCES if INTERPRETED else NORM_TOLERANCES)[dtype]
    torch.testing.assert_close(h.double(), normed_ref, **tol)


@pytest.mark.parametrize("norm_fp32_sum", [False, True])
def test_norm_input_choice(norm_fp32_sum):
    """NORM_FP32_SUM normalises the unrounded fp32 sum (FlashInfer's
    fused_add_rmsnorm, SGLang's forward_native), the default the rounded
    residual. The two differ by < 1 ulp per element, so a tolerance cannot tell
    them apart: count exact agreement with each float64 reference rounded to
    fp16 instead (fp16 casts are exact in the interpreter). Measured: >= 99.9%
    with the matching reference, ~78% with the other."""
    gen = torch.Generator().manual_seed(7)
    h = (3 * torch.randn(16, 1000, generator=gen)).to(torch.float16).to(DEVICE)
    r = torch.randn(16, 1000, generator=gen).to(torch.float16).to(DEVICE)
    w = (1 + 0.1 * torch.randn(1000, generator=gen)).to(torch.float16).to(DEVICE)
    normed = torch.full_like(h, float("nan"))
    residual_out = torch.full_like(h, float("nan"))
    launch_kernel(
        h,
        r,
        weight=w,
        eps=EPS,
        normed_out=normed,
        residual_out=residual_out,
        norm_fp32_sum=norm_fp32_sum,
    )
    assert_bitwise_equal(residual_out, h + r)  # the residual is the rounded sum either way

    def agreement(fp32_sum):
        ref = add_rmsnorm_reference(h, r, w, EPS, norm_fp32_sum=fp32_sum)[0].to(torch.float16)
        return (normed == ref).double().mean().item()

    assert agreement(norm_fp32_sum) >= 0.995
    assert agreement(not norm_fp32_sum) < 0.95


def test_row_offsets_are_64_bit_in_the_generated_code():
    """``rows * stride`` passes 2^31 at T = 100k, K = 3, H = 7168: the kernels' Triton IR
    (built on this machine for a Hopper target, no GPU needed) may not multiply a stride or
    size in 32 bits, and widens every stride to i64. The GPU's large-T test
    (test_reliability.py) runs the real thing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "eagle_capture.testing.codegen"],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert len(report) == 5, report  # 4 fused variants + the all-reduce
    assert all(problems == [] for problems in report.values()), report


def test_launch_config_warps_per_row():
    """The norm's launch: 16 warps for BLOCK_H = 4096 (8 values a thread; H 2049 -
    4096: with 8 FlashInfer's norm beat the in-slot call by 8% at T = 512, H = 4096
    on the H100), the one-shot all-reduce kernel keeps the 8 it was measured with;
    the other sizes as before; the norm-free capture in column blocks."""
    from eagle_capture.kernels import launch_config

    assert launch_config(4096) == (4096, 16, 1) and launch_config(2880) == (4096, 16, 1)
    assert launch_config(4096, True, allreduce=True) == (4096, 8, 1)
    assert launch_config(2880, True, allreduce=True) == (4096, 8, 1)
    assert launch_config(7168) == launch_config(7168, True, allreduce=True) == (8192, 16, 1)
    assert launch_config(2048) == (2048, 8, 1) and launch_config(512) == (512, 4, 1)
    assert launch_config(4096, False) == (2048, 4, 2)


@pytest.mark.parametrize("sms", [132, 114, 78])
def test_one_wave_warps_bands(sms):
    """The T bands where the norm's warps leave the H-only choice, at a device's SM
    count: BLOCK_H 8192 takes 32 warps for 1.5 SMs < T <= 2 SMs, BLOCK_H 4096 8
    warps for 4 SMs < T <= 6 SMs; everything else (other T, other BLOCK_H, an
    explicit choice of warps) as launch_config says."""
    from eagle_capture.kernels import launch_config, one_wave_warps

    def warps(hidden_size, tokens):
        block_h, num_warps, _ = launch_config(hidden_size)
        return one_wave_warps(block_h, num_warps, tokens, sms)

    low, high = 3 * sms // 2, 2 * sms  # sms is even here: 1.5 SMs is a whole T
    for hidden_size in (5120, 7168, 8192):
        bounds = (1, sms + 1, low, low + 1, high, high + 1, 16384)
        assert [warps(hidden_size, t) for t in bounds] == [16, 16, 16, 32, 32, 16, 16]
    for hidden_size in (2880, 4096):
        bounds = (1, 4 * sms, 4 * sms + 1, 6 * sms, 6 * sms + 1, 16384)
        assert [warps(hidden_size, t) for t in bounds] == [16, 16, 8, 8, 16, 16]
    for hidden_size in (2048, 1024, 16384):  # no band measured: the H-only warps
        block_h, num_warps, _ = launch_config(hidden_size)
        for t in (3 * sms // 2 + 1, 2 * sms, 4 * sms + 1, 6 * sms):
            assert one_wave_warps(block_h, num_warps, t, sms) == num_warps
    # The all-reduce kernel's 8 warps at BLOCK_H 4096 are its own measurement.
    assert one_wave_warps(4096, 8, 5 * sms, sms) == 8


def test_kernel_arguments_take_the_bands_where_t_and_the_sms_are_known():
    """kernel_arguments applies the bands to a launch of a known T, counted with the
    given SMs; a CPU launch without SMs, a caller's block_h or num_warps and the
    norm-free capture (its column blocks take no band) keep what they had."""
    from eagle_capture.kernels import kernel_arguments

    h = torch.empty(200, 7168, dtype=torch.bfloat16)
    w = torch.empty(7168, dtype=torch.bfloat16)
    aux = torch.empty(200, 3, 7168, dtype=torch.bfloat16)
    assert kernel_arguments(h, h, w, h, None, aux, slot=1, sms=132)[2] == 32
    assert kernel_arguments(h, h, w, h, None, aux, slot=1, sms=99)[2] == 16  # T > 2 SMs
    assert kernel_arguments(h, h, w, h, None, aux, slot=1)[2] == 16  # CPU: no SM count
    assert kernel_arguments(h, h, w, h, None, aux, slot=1, sms=132, num_warps=4)[2] == 4
    assert kernel_arguments(h, h, w, h, None, aux, slot=1, sms=132, block_h=8192)[2] == 16
    grid, _, num_warps = kernel_arguments(h, h, None, None, None, aux, slot=1, sms=132)
    assert (grid, num_warps) == ((200, 4), 4)
    small = torch.empty(600, 2880, dtype=torch.bfloat16)
    assert kernel_arguments(small, small, w[:2880], small, sms=132)[2] == 8


def test_a_cuda_launch_counts_its_device_sms(monkeypatch):
    """The ops' launches pass no SMs: a CUDA tensor's come from band_sms (traced here
    as fake CUDA tensors), which answers for Hopper GPUs only and never on ROCm or
    a host without a GPU."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    import eagle_capture.kernels.add_rmsnorm_capture as module

    def launch_warps():
        with FakeTensorMode():
            h = torch.empty(232, 7168, dtype=torch.bfloat16, device="cuda")
            w = torch.empty(7168, dtype=torch.bfloat16, device="cuda")
            return module.kernel_arguments(h, h, w, h)[2]

    if not torch.cuda.is_available():
        assert launch_warps() == 16  # no GPU to count: the H-only choice
    with monkeypatch.context() as patch:
        patch.setattr(module, "band_sms", lambda device_index: 132)
        assert launch_warps() == 32
        patch.setattr(module, "band_sms", lambda device_index: None)
        assert launch_warps() == 16

    # band_sms itself, with the device's properties stood in.
    props = {
        0: SimpleNamespace(major=9, multi_processor_count=132),
        1: SimpleNamespace(major=8, multi_processor_count=108),
    }
    module.band_sms.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setattr(torch.cuda, "get_device_properties", lambda index: props[index])
            patch.setattr(torch.version, "hip", None)
            assert module.band_sms(0) == 132
            assert module.band_sms(1) is None  # not Hopper: not measured
            module.band_sms.cache_clear()
            patch.setattr(torch.version, "hip", "6.3")
            assert module.band_sms(0) is None  # ROCm
            module.band_sms.cache_clear()
            patch.setattr(torch.version, "hip", None)
            patch.setattr(torch.cuda, "is_available", lambda: False)
            assert module.band_sms(0) is None  # no GPU on this host
    finally:
        module.band_sms.cache_clear()
