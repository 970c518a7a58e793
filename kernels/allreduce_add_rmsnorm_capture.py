"""One-shot all-reduce + residual add + RMSNorm + capture over symmetric memory.

Under tensor parallelism the row-parallel projection ending each layer leaves
every rank with a *partial* sum of the hidden states. SGLang then runs an
all-reduce (NCCL, or a custom one-shot kernel for small T) followed by the next
layer's fused add+RMSNorm. For decode-sized T both are latency-bound; this
kernel does them in one launch:

    each rank has copied its partial [T, H] into its symmetric buffer
    barrier        every program signals its peers' programs of the same index
    per row t      h = sum over ranks 0..W-1 of buffer_rank[t]  (fp32, rounded once)
                   s = h + residual[t]                           (fp32, rounded once)
                   aux[t, slot] = s; residual_out[t] = s; normed[t] = rmsnorm(s) * w
    barrier        no rank may overwrite its buffer while a peer still reads it

Numerics: every rank sums the W partials in the same order (rank 0 first), so
all ranks hold bit-identical results -- what the tensor-parallel consistency
check demands. The sum is rounded once from fp32; NCCL's bf16 ring all-reduce
rounds at each step, so at W > 1 the result can differ from the NCCL path in
the last bit (at W = 1 it is identical).

Barrier: a program's signal slots are ``pad[block * W + rank]`` in each peer's
signal pad (uint32, zero at rest). Sending is a compare-and-swap 0 -> 1 that
spins while the slot is still 1 (the peer has not consumed the previous
signal); waiting is a compare-and-swap 1 -> 0 on the local pad. Every signal
is consumed exactly once, so the same slots serve the start and the end
barrier of every call. Triton executes a scalar atomic in one thread and
broadcasts its result; ``tl.debug_barrier()`` (bar.sync) orders the other
threads' loads after the acquire and their loads before the release. Peer rows
are loaded ``volatile`` so no stale L1 line survives between calls.

The grid is persistent: G = min(T, max_programs) programs walk rows t = pid,
pid + G, ...; all ranks launch the same G (T is the same on all ranks under
TP; max_programs is agreed across the group), and G is at most one program
per SM -- which fits whatever the register count (16 warps x 80 registers <
64K) -- so, on an otherwise idle GPU, every program of every rank is resident
and no program spinning in a barrier waits on a peer program that cannot be
scheduled. There is no spin limit: a rank that never launches (an exception
on one rank only, a different T) leaves its peers spinning, as with any
collective that one rank skips.

NVLink multicast is never used (no multimem instructions; see
eagle_capture.symm for the environment it sets).
"""

import triton
import triton.language as tl


@triton.jit
def _signal_peers(signal_pad_ptrs, block_id, rank, WORLD_SIZE: tl.constexpr):
    for peer in tl.static_range(WORLD_SIZE):
        pad = tl.load(signal_pad_ptrs + peer).to(tl.pointer_type(tl.uint32))
        slot = pad + block_id * WORLD_SIZE + rank
        while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
            pass


@triton.jit
def _wait_for_peers(signal_pad_ptrs, block_id, rank, WORLD_SIZE: tl.constexpr):
    pad = tl.load(signal_pad_ptrs + rank).to(tl.pointer_type(tl.uint32))
    for peer in tl.static_range(WORLD_SIZE):
        slot = pad + block_id * WORLD_SIZE + peer
        while tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys") != 1:
            pass


@triton.jit
def _barrier(signal_pad_ptrs, block_id, rank, WORLD_SIZE: tl.constexpr):
    tl.debug_barrier()   # this program's earlier loads/stores before the release
    _signal_peers(signal_pad_ptrs, block_id, rank, WORLD_SIZE)
    _wait_for_peers(signal_pad_ptrs, block_id, rank, WORLD_SIZE)
    tl.debug_barrier()   # every thread's later loads after the acquire


# `rank` is not specialised: rank 1 would compile as a constant and ranks 0/16 as
# multiples of 16 -- different binaries on different ranks of one group.
@triton.jit(do_not_specialize=["rank"])
def oneshot_allreduce_add_rmsnorm_capture_kernel(
    buffer_ptrs,          # int64[W]: each rank's symmetric buffer ([max_tokens, H], row-major)
    signal_pad_ptrs,      # int64[W]: each rank's signal pad (uint32)
    residual_ptr,
    weight_ptr,
    normed_out_ptr,
    residual_out_ptr,
    aux_ptr,
    num_tokens,
    hidden_size,
    eps,
    rank,
    stride_residual,
    stride_normed_out,
    stride_residual_out,
    stride_aux_row,
    aux_slot_offset,
    WORLD_SIZE: tl.constexpr,
    CAPTURE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    dtype = residual_ptr.dtype.element_ty

    _barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pid64 = pid.to(tl.int64)
    for row in range(pid, num_tokens, num_programs):
        row64 = pid64 + (row - pid)  # int64 row offsets (row is a plain int in the interpreter)
        for peer in tl.static_range(WORLD_SIZE):
            # Symmetric allocations are page-aligned: say so, or the loads of a
            # pointer made from an integer stay scalar (2-byte) instead of 16-byte.
            base = tl.multiple_of(tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype)), 16)
            part = tl.load(base + row64 * hidden_size + cols, mask=mask, other=0.0,
                           cache_modifier=".cv").to(tl.float32)
            if peer == 0:
                acc = part
            else:
                acc += part
        # The all-reduce result in the storage dtype, as the NCCL path hands it
        # to the add; then one fp32 add and one rounding, as torch's h + r.
        h = acc.to(dtype)
        r = tl.load(residual_ptr + row64 * stride_residual + cols, mask=mask, other=0.0)
        s = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if CAPTURE:
            tl.store(aux_ptr + row64 * stride_aux_row + aux_slot_offset + cols, s, mask=mask)
        tl.store(residual_out_ptr + row64 * stride_residual_out + cols, s, mask=mask)
        x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
        tl.store(normed_out_ptr + row64 * stride_normed_out + cols,
                 (x * rstd * w).to(normed_out_ptr.dtype.element_ty), mask=mask)
    _barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE)
