"""One Triton kernel for every capture flavour: residual add, optional RMSNorm,
optional store of the new residual, optional store into an aux-buffer slot.

Per row ``t`` (a row of H = 7168 bf16 is 14 KiB; with the norm, one program
owns a whole row because the RMS needs all of it; without the norm, programs
tile the row in column blocks, ``grid = (T, cdiv(H, BLOCK_H))``, so more,
smaller programs keep every SM streaming to the end of the grid):

    s            = hidden[t] + residual[t]       (HAS_RESIDUAL; else s = hidden[t])
    aux[t, slot] = s                              (CAPTURE)
    res_out[t]   = s                              (STORE_RESIDUAL)
    normed[t]    = s * rsqrt(mean(s^2) + eps) * weight   (APPLY_NORM, fp32 math)

Numerics
--------
* ``s`` is computed in fp32 and rounded once to the storage dtype. That is
  exactly what torch does for a bf16/fp16 ``h + r`` (upcast, add, round to
  nearest even), so the captured value is bit-identical to SGLang's eager
  ``hidden_states + residual`` on the GPU. (Under ``TRITON_INTERPRET=1`` the
  fp32 -> bf16 cast truncates instead; the tests model that.)
* By default the norm is taken of the *rounded* ``s`` -- the value that is
  stored as the residual and captured -- so ``normed`` is a function of what
  the next layer and the draft model actually see, as in HF transformers'
  eager layers (and vLLM's fused_add_rms_norm, which re-reads the rounded
  residual). With ``NORM_FP32_SUM`` the variance and the normed output come
  from the unrounded fp32 sum instead: FlashInfer's ``FusedAddRMSNormKernel``
  (``norm.cuh``: ``x = float(input) + float(residual)``, ``sum_sq += x * x``,
  the fp32 ``x`` kept in shared memory for the output) and SGLang's
  ``RMSNorm.forward_native`` both do that, so the SGLang drop-in sets it and
  changes the model's normed outputs by nothing but rsqrt/reduction-order noise.
* Row offsets are int64: ``rows * K * H`` passes 2^31 for T = 100k, K = 3,
  H = 7168, and an int32 product would wrap into another request's rows.

Cache hints (tuning knobs, benchmarks/tune_kernel.py --sweep flashinfer)
----------------------------------------------------------------------
``AUX_CACHE`` / ``AUX_EVICT`` are the slot store's cache modifier and eviction
policy, ``RESIDUAL_EVICT`` the residual load's; with ``PDL_TRIGGER_LATE`` the
dependents are signalled after the stores instead of at the top. Hints change
where lines sit in L2, never a value: every setting stores the same bits.

Programmatic dependent launch (PDL, sm_90+)
-------------------------------------------
With ``USE_PDL`` (launched with ``launch_pdl=True``) a program first waits in
``gdc_wait`` until the previous kernel in the stream has finished and its
writes are visible, and only then reads anything -- the weight too: an
in-place weight update (RL weight sync) may be the kernel just before. It signals
``gdc_launch_dependents`` at once, so a PDL-launched kernel after it can be
scheduled while this one runs; that kernel's own ``gdc_wait`` still waits for
this one to complete: back-to-back launches at decode sizes overlap one
kernel's tail with the next one's launch (the measured gain is in
benchmarks/NOTES.md). Triton's interpreter has no PDL: CPU launches pass
``USE_PDL=False``.

In-place use is legal (``normed_out_ptr == hidden_ptr``, ``res_out_ptr ==
residual_ptr``): a program reads its whole row before it writes any of it, and
no two programs touch the same row.
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 (Hopper griddepcontrol intrinsics)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover - older Triton: USE_PDL must stay False
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False

# The largest hidden size handled by the one-pass kernel: the whole row lives
# in registers (BLOCK_H fp32 values spread over num_warps * 32 threads).
MAX_HIDDEN_SIZE = 65536
# Column block of the norm-free (pure capture) launch.
COPY_BLOCK_H = 2048
COPY_NUM_WARPS = 4


@triton.jit
def add_rmsnorm_capture_kernel(
    hidden_ptr,
    residual_ptr,
    weight_ptr,
    normed_out_ptr,
    residual_out_ptr,
    aux_ptr,
    hidden_size,
    eps,
    stride_hidden,
    stride_residual,
    stride_normed_out,
    stride_residual_out,
    stride_aux_row,
    aux_slot_offset,
    HAS_RESIDUAL: tl.constexpr,
    APPLY_NORM: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    CAPTURE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    NORM_FP32_SUM: tl.constexpr = False,
    AUX_EVICT: tl.constexpr = "",
    AUX_CACHE: tl.constexpr = "",
    RESIDUAL_EVICT: tl.constexpr = "",
    PDL_TRIGGER_LATE: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    # Without the norm, axis 1 walks column blocks; with it, the grid has one.
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    if USE_PDL:
        # Everything below may read what the previous kernel wrote.
        gdc_wait()
        if not PDL_TRIGGER_LATE:
            gdc_launch_dependents()
    if APPLY_NORM:
        # Issued first so its latency overlaps the row loads (decode sizes are
        # latency-bound: one DRAM round trip fewer per launch).
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)

    # Default cache policy: evict_first on these loads measured slower at large T
    # on the H200 (benchmarks/NOTES.md).
    h = tl.load(hidden_ptr + row * stride_hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + row * stride_residual + cols,
            mask=mask,
            other=0.0,
            eviction_policy=RESIDUAL_EVICT,
        )
    else:
        r = h
    if not APPLY_NORM:
        w = h
    add_rmsnorm_store_row(
        h,
        r,
        w,
        cols,
        mask,
        row,
        hidden_size,
        eps,
        normed_out_ptr,
        stride_normed_out,
        residual_out_ptr,
        stride_residual_out,
        aux_ptr,
        stride_aux_row,
        aux_slot_offset,
        HAS_RESIDUAL,
        APPLY_NORM,
        STORE_RESIDUAL,
        CAPTURE,
        NORM_FP32_SUM,
        AUX_EVICT,
        AUX_CACHE,
    )
    if USE_PDL and PDL_TRIGGER_LATE:
        gdc_launch_dependents()


@triton.jit
def add_rmsnorm_store_row(
    h,
    r,
    w,
    cols,
    mask,
    row,
    hidden_size,
    eps,
    normed_out_ptr,
    stride_normed_out,
    residual_out_ptr,
    stride_residual_out,
    aux_ptr,
    stride_aux_row,
    aux_slot_offset,
    HAS_RESIDUAL: tl.constexpr,
    APPLY_NORM: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    CAPTURE: tl.constexpr,
    NORM_FP32_SUM: tl.constexpr,
    AUX_EVICT: tl.constexpr,
    AUX_CACHE: tl.constexpr,
):
    """The row epilogue both kernels share (this one and the all-reduce kernel):
    ``s = h + r`` (HAS_RESIDUAL; else ``s = h``) in fp32 rounded once to h's
    dtype, stored into the aux slot (CAPTURE) and the residual output
    (STORE_RESIDUAL); ``rmsnorm(s) * w`` into the normed output (APPLY_NORM),
    of the unrounded sum with NORM_FP32_SUM. ``row`` is an int64 row index."""
    if HAS_RESIDUAL:
        # One fp32 add, one round-to-nearest-even: bit-identical to torch's h + r.
        s_fp32 = h.to(tl.float32) + r.to(tl.float32)
        s = s_fp32.to(h.dtype)
    else:
        s = h
    if CAPTURE:
        tl.store(
            aux_ptr + row * stride_aux_row + aux_slot_offset + cols,
            s,
            mask=mask,
            cache_modifier=AUX_CACHE,
            eviction_policy=AUX_EVICT,
        )
    if STORE_RESIDUAL:
        tl.store(residual_out_ptr + row * stride_residual_out + cols, s, mask=mask)
    if APPLY_NORM:
        if NORM_FP32_SUM and HAS_RESIDUAL:
            x = s_fp32  # FlashInfer / SGLang: normalise the unrounded sum
        else:
            x = s.to(tl.float32)
        mean_sq = tl.sum(x * x, axis=0) / hidden_size
        rstd = tl.rsqrt(mean_sq + eps)
        y = x * rstd * w.to(tl.float32)
        tl.store(
            normed_out_ptr + row * stride_normed_out + cols,
            y.to(normed_out_ptr.dtype.element_ty),
            mask=mask,
        )


@functools.lru_cache(maxsize=None)
def launch_config(
    hidden_size: int, apply_norm: bool = True, allreduce: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_H, num_warps, column blocks) for rows of ``hidden_size`` elements.

    With the norm: the whole row in one program, with enough warps that each
    thread holds <= 32 fp32 values up to H = 32768 (64 above; not profiled)
    and issues 16-byte accesses; BLOCK_H = 4096 (H 2049 - 4096) takes 16 warps,
    8 values a thread: with 8 warps FlashInfer's norm beat ours by 8% at T = 512,
    H = 4096 on the H100 (benchmarks/NOTES.md). A launch of T rows may take
    other warps in two bands of T: :func:`one_wave_warps`. ``allreduce``: the
    table the one-shot all-reduce kernel (parallel/symm.py, one program per SM)
    was measured with, 8 warps at BLOCK_H = 4096.
    Without the norm: column blocks of at most COPY_BLOCK_H elements (see
    benchmarks/NOTES.md for the sweep that chose it).
    """
    block_h = triton.next_power_of_2(max(int(hidden_size), 1))
    if not apply_norm and block_h > COPY_BLOCK_H:
        return COPY_BLOCK_H, COPY_NUM_WARPS, triton.cdiv(hidden_size, COPY_BLOCK_H)
    if block_h >= 32768:
        num_warps = 32
    elif block_h >= 8192 or (block_h == 4096 and not allreduce):
        num_warps = 16
    elif block_h >= 2048:
        num_warps = 8
    elif block_h >= 512:
        num_warps = 4
    else:
        num_warps = 1
    return block_h, num_warps, 1


@functools.lru_cache(maxsize=None)
def band_sms(device_index: int) -> Optional[int]:
    """The SMs :func:`one_wave_warps` counts with on CUDA device ``device_index``
    (read once: launches are hot), or None where its bands were not measured:
    anything but an NVIDIA Hopper GPU (on ROCm a wave of 64 lanes makes 32 warps
    2048 threads, past a block's limit; other NVIDIA generations hold other
    thread counts per SM), or no GPU at all (fake CUDA tensors traced on a host
    without one)."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count if props.major == 9 else None


def one_wave_warps(block_h: int, num_warps: int, num_tokens: int, sms: int) -> int:
    """``num_warps`` of a norm launch of ``num_tokens`` rows (one program each) on
    ``sms`` SMs: :func:`launch_config`'s choice for the hidden size, except in two
    bands of T where the grid's last wave serves that choice badly (set on the
    H100 against FlashInfer's norm and measured alike on the H200,
    benchmarks/NOTES.md; applied on Hopper only, :func:`band_sms`):

    * BLOCK_H 8192, 1.5 SMs < T <= 2 SMs: 32 warps. Most SMs hold two rows and
      set the time; 32 warps keep twice a row's loads in flight (0.94x
      FlashInfer's norm at T 232 - 264, where 16 warps took up to 1.03x). Past
      2 SMs, 1024-thread programs (two per SM) would need a second wave; below
      1.5 SMs the few SMs with two rows gain less than the warps cost.
    * BLOCK_H 4096, 4 SMs < T <= 6 SMs: 8 warps. Four 512-thread programs fill
      an SM's 2048 threads, so past 4 SMs 16 warps run a second wave (1.02 -
      1.03x at H 2880, T 594 - 600); 256-thread programs (40 registers a thread)
      fit six. At H 4096 just past 4 SMs the short second wave costs less than
      8 warps' longer rows (T 529: 0.995x against 0.93x), both below the peer.

    The norm's reduction tree follows the warps, so at a band's edge a row's
    normed output may differ in the last bit with the batch's size, as in the
    engines' own norms (vLLM's fused add + RMSNorm changes its block size at
    T = 256, docs/engine_facts.md)."""
    if block_h == 8192 and num_warps == 16 and 3 * sms < 2 * num_tokens <= 4 * sms:
        return 32
    if block_h == 4096 and num_warps == 16 and 4 * sms < num_tokens <= 6 * sms:
        return 8
    return num_warps


def kernel_arguments(
    hidden,
    residual=None,
    weight=None,
    normed_out=None,
    residual_out=None,
    aux=None,
    *,
    eps: float = 0.0,
    slot: int = 0,
    norm_fp32_sum: bool = False,
    use_pdl: bool = False,
    block_h: Optional[int] = None,
    num_warps: Optional[int] = None,
    sms: Optional[int] = None,
) -> tuple[tuple, dict, int]:
    """``(grid, {parameter: value}, num_warps)`` of one launch: the one place the
    kernel's arguments are spelled out. Features follow from the outputs given:
    ``aux`` -> capture into ``aux[:T, slot]``; ``residual_out`` -> store the new
    residual; ``weight`` + ``normed_out`` -> RMSNorm. An absent pointer is
    ``hidden`` (valid, so the signature never changes; the flags compile its
    accesses away). ``block_h`` / ``num_warps`` override :func:`launch_config`
    and :func:`one_wave_warps` (the tuning sweep); ``sms``: the SMs the bands
    count with (None: :func:`band_sms` of a CUDA tensor's device; a CPU launch
    keeps the H-only choice)."""
    num_tokens, hidden_size = hidden.shape
    apply_norm = weight is not None
    # int(): H may be a SymInt under dynamic shapes; BLOCK_H specialises on it.
    default_block, default_warps, col_blocks = launch_config(int(hidden_size), apply_norm)
    if sms is None and hidden.is_cuda:
        sms = band_sms(hidden.device.index)
    # A symbolic T (dynamic shapes) keeps the H-only choice rather than guard on it;
    # a block_h of the caller's keeps launch_config's warps for it.
    if sms is not None and isinstance(num_tokens, int) and block_h is None:
        default_warps = one_wave_warps(default_block, default_warps, num_tokens, sms)
    block_h = default_block if block_h is None else block_h
    col_blocks = col_blocks if block_h == default_block else triton.cdiv(hidden_size, block_h)
    values = dict(
        hidden_ptr=hidden,
        residual_ptr=residual if residual is not None else hidden,
        weight_ptr=weight if apply_norm else hidden,
        normed_out_ptr=normed_out if apply_norm else hidden,
        residual_out_ptr=residual_out if residual_out is not None else hidden,
        aux_ptr=aux if aux is not None else hidden,
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
        # No cache hint: none beat the default with cold inputs (benchmarks/NOTES.md).
        AUX_CACHE="",
        AUX_EVICT="",
        RESIDUAL_EVICT="",
        PDL_TRIGGER_LATE=False,
    )
    return (num_tokens, col_blocks), values, default_warps if num_warps is None else num_warps
