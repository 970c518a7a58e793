"""One-shot all-reduce + residual add + RMSNorm + capture, Lamport style.

Under tensor parallelism the row-parallel projection ending each layer leaves
every rank with a *partial* sum of the hidden states. SGLang then runs an
all-reduce (NCCL, or a custom one-shot kernel for small T) followed by the next
layer's fused add+RMSNorm. At decode sizes both are latency-bound; this kernel
does them in one launch, with no barrier:

    push    each program stores its rows of this rank's partial into every
            rank's symmetric buffer, in the sender slab ``[epoch % 3][rank]``
    clear   it fills its share of *this* rank's slabs of the previous call
            (``[(epoch - 1) % 3]``, T_prev rows per sender) with -0.0
    poll    per row t and sender r (rank order), it re-reads the row from the
            local slab ``[epoch % 3][r]`` until no element is -0.0
    reduce  h = sum over r of the rows (fp32, rounded once)
            s = h + residual[t]  (fp32, rounded once)
            aux[t, slot] = s; residual_out[t] = s; normed[t] = rmsnorm(s) * w
    arrive  the last program of the launch to finish bumps the epoch

Protocol (the data carries its own ready flag)
----------------------------------------------
Every buffer element is -0.0 at rest. A pushed partial has its -0.0 turned
into +0.0 (the sum can then differ from NCCL's only in the sign of an exact
zero), so an element is "arrived" exactly when it is not -0.0; each element
is written by one store, so a row read while the peer is still writing it
shows sentinels and is re-read. No flag, no fence, no barrier: one NVLink
write per element and a local poll.

Three buffers make reuse safe without a closing barrier. At call n a rank
writes into its peers' slabs n % 3 and clears its own slabs (n - 1) % 3,
which every peer finished writing in call n - 1 (this rank saw all of their
elements) and which no peer can write again before call n + 2 -- for that a
peer needs this rank's call-(n + 1) push, issued after this kernel ends. A
fast peer in call n + 1 writes slabs (n + 1) % 3: neither the slabs being
read (n % 3) nor those being cleared. The epoch lives in device memory (the
``state`` tensor: epoch, arrivals, T_prev, watchdog flag, ticket count), so a CUDA graph
holding any number of calls replays correctly; a host-side parity would be
frozen into the graph.

Numerics: every rank sums the W rows in rank order (rank 0 first), so all
ranks hold bit-identical results -- what the tensor-parallel consistency check
demands. The sum is rounded once from fp32 (NCCL's bf16 ring rounds at each
step: at W > 2 the paths can differ in the last bit). With ``NORM_FP32_SUM``
the norm is of the unrounded fp32 ``h + residual``, as in the single-GPU
kernel (FlashInfer / SGLang forward_native).

Scheduling: the grid is G = min(T, max_programs), the same on every rank (T
is the same under TP; max_programs is agreed across the group). Program i
handles rows i, i + G, ... and waits only for the same rows of its peers,
after it has pushed its own. With G at most one program per SM all programs
are co-resident on an idle GPU; when fewer SMs are available (MPS limits,
green contexts, a persistent kernel beside it) the programs that do run are
served by the same-index programs on the peers as long as each GPU
dispatches programs in index order, which CUDA does in practice but does not
promise.

``ROWS_BY_TICKET`` removes that assumption: each program takes the next
ticket (one relaxed atomic on ``state``) as it starts and handles rows
ticket, ticket + G, ...; the last program to arrive resets the counter. The
programs *started* on a rank then hold tickets 0 .. c-1 (c = that rank's count)
whatever order the GPU dispatched them in, and each pushes its rows before it
waits. Take the rank with the smallest count c: every peer has started tickets
0 .. c-1, which have pushed their rows, so every row this rank's started
programs wait for has arrived and they finish; a rank with tickets left and
no room starts a program once one finishes. So no deadlock with any dispatch
order and any number >= 1 of co-resident programs per GPU. The atomic's round
trip sits on the critical path (benchmarks/NOTES.md has the measured cost), so
it is opt-in. For a rank that never arrives, the opt-in watchdog bounds every
poll.

Watchdog (``timeout_ns`` > 0): a poll that has waited longer than timeout_ns
(``%globaltimer`` on the GPU; one poll ~ 1 us on the interpreter) sets the
flag at ``ptr_table[W]`` (a host-visible int32, read by the host without a
sync) and its device copy ``state[3]``, and gives up; later polls of any
launch that find the device copy set give up at once. The outputs are then
garbage and the caller must raise. With timeout_ns = 0 the check is one
integer compare per poll.

``DEBUG_SPIN`` (tests only): the rank ``debug_rank`` waits about DEBUG_SPIN
us (GPU; DEBUG_SPIN volatile loads on the interpreter) between its push and its
clear, making it the slow rank on demand: the reuse race becomes certain.
``DEBUG_REVERSE_DISPATCH`` (tests only): on rank ``debug_rank`` the program
ids are reversed -- what a GPU dispatching the highest index first would look
like (Triton's interpreter runs programs in index order). The kernel must not
depend on them for progress; with ``ROWS_BY_TICKET`` it does not.

NVLink multicast is never used (no multimem instructions).
"""

import triton
import triton.language as tl

from .add_rmsnorm_capture import add_rmsnorm_store_row

NUM_BUFFERS = 3  # see the reuse argument in the module docstring
STATE_INTS = 5  # epoch (mod NUM_BUFFERS), arrivals, T_prev, watchdog tripped, tickets taken
# The same values as constexprs: a jit function may only read constexpr globals.
_NUM_BUFFERS = tl.constexpr(NUM_BUFFERS)
_EPOCH, _ARRIVED, _PREV_TOKENS, _TRIPPED, _TICKETS = (tl.constexpr(i) for i in range(STATE_INTS))


@triton.jit
def _globaltimer_ns():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _is_sentinel(x):
    """Elements equal to -0.0 (the "not arrived" mark), by bits."""
    if x.dtype.primitive_bitwidth == 16:
        bits = x.to(tl.int16, bitcast=True)
        return bits == -32768
    else:
        bits = x.to(tl.int32, bitcast=True)
        return bits == -2147483648


@triton.jit
def _neg_zeros(BLOCK_H: tl.constexpr, dtype: tl.constexpr):
    """-0.0 built from its bits (a float -0.0 literal may be folded into +0.0)."""
    if dtype.primitive_bitwidth == 16:
        return tl.full([BLOCK_H], -32768, tl.int16).to(dtype, bitcast=True)
    else:
        return tl.full([BLOCK_H], -2147483648, tl.int32).to(dtype, bitcast=True)


@triton.jit
def _poll_row(ptr, mask, timeout_ns, error_ptr, tripped_ptr, USE_GLOBALTIMER: tl.constexpr):
    """Re-read a row until none of its elements is -0.0; returns it (fp32)."""
    x = tl.load(ptr, mask=mask, other=0.0, volatile=True)
    pending = tl.sum(_is_sentinel(x).to(tl.int32), axis=0)
    if pending != 0:
        if timeout_ns > 0:
            # An earlier poll gave up: the call is lost anyway; do not wait out the
            # bound again for every row. The device-memory copy of the flag: reads
            # of the host-memory flag serialise across programs (benchmarks/NOTES.md).
            if tl.load(tripped_ptr, volatile=True) != 0:
                pending = 0
        spins = 0
        if USE_GLOBALTIMER:
            start = _globaltimer_ns()
        while pending != 0:
            x = tl.load(ptr, mask=mask, other=0.0, volatile=True)
            pending = tl.sum(_is_sentinel(x).to(tl.int32), axis=0)
            if timeout_ns > 0:
                spins += 1
                if USE_GLOBALTIMER:
                    waited = _globaltimer_ns() - start
                else:
                    waited = spins * 1000
                if waited > timeout_ns:
                    tl.atomic_xchg(tripped_ptr, 1, sem="relaxed", scope="gpu")
                    tl.atomic_xchg(error_ptr, 1, sem="relaxed", scope="sys")
                    pending = 0
    return x.to(tl.float32)


@triton.jit
def _debug_delay(state_ptr, error_ptr, DEBUG_SPIN: tl.constexpr, USE_GLOBALTIMER: tl.constexpr):
    """About DEBUG_SPIN us on the GPU; DEBUG_SPIN volatile loads on the interpreter.
    The loads' sum feeds a store that never happens, so no compiler drops them."""
    if USE_GLOBALTIMER:
        start = _globaltimer_ns()
        while _globaltimer_ns() - start < DEBUG_SPIN * 1000:
            pass
    else:
        total = 0
        for _ in range(DEBUG_SPIN):
            total += tl.load(state_ptr + _EPOCH, volatile=True)
        if total < 0:
            tl.store(error_ptr, 2)


# `rank` and `debug_rank` are not specialised: rank 1 would compile as a constant
# and ranks 0/16 as multiples of 16 -- different binaries on different ranks.
# max_tokens must stay a runtime int64-convertible value (a 1 would be a constexpr).
@triton.jit(do_not_specialize=["rank", "debug_rank", "num_tokens", "max_tokens", "timeout_ns"])
def lamport_allreduce_add_rmsnorm_capture_kernel(
    partial_ptr,  # the call's tensors lead (the eager launch's argument template)
    residual_ptr,
    weight_ptr,
    normed_out_ptr,
    residual_out_ptr,
    aux_ptr,
    ptr_table,  # int64[W + 1]: each rank's symmetric buffer, then the watchdog flag
    state_ptr,  # int32[STATE_INTS], this rank's, device memory
    num_tokens,
    hidden_size,
    max_tokens,  # rows per sender slab of the symmetric buffer
    eps,
    rank,
    stride_partial,
    stride_residual,
    stride_normed_out,
    stride_residual_out,
    stride_aux_row,
    aux_slot_offset,
    timeout_ns,
    debug_rank,
    WORLD_SIZE: tl.constexpr,
    CAPTURE: tl.constexpr,
    NORM_FP32_SUM: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
    DEBUG_SPIN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS_BY_TICKET: tl.constexpr = False,
    DEBUG_REVERSE_DISPATCH: tl.constexpr = False,
):
    num_programs = tl.num_programs(0)
    pid = tl.program_id(0)
    if DEBUG_REVERSE_DISPATCH:
        if rank == debug_rank:
            pid = num_programs - 1 - pid
    # This program's share of the rows: by program id, or by start order (see
    # "Scheduling").
    if ROWS_BY_TICKET:
        first_row = tl.atomic_add(state_ptr + _TICKETS, 1, sem="relaxed", scope="gpu")
    else:
        first_row = pid
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    dtype = residual_ptr.dtype.element_ty
    epoch = tl.load(state_ptr + _EPOCH, volatile=True)
    prev_tokens = tl.load(state_ptr + _PREV_TOKENS, volatile=True)
    cur = epoch % _NUM_BUFFERS
    prev = (epoch + _NUM_BUFFERS - 1) % _NUM_BUFFERS
    error_ptr = tl.load(ptr_table + WORLD_SIZE).to(tl.pointer_type(tl.int32))
    # Symmetric allocations are page-aligned: say so, or the loads and stores of a
    # pointer made from an integer stay scalar (2-byte) instead of 16-byte.
    local = tl.multiple_of(tl.load(ptr_table + rank).to(tl.pointer_type(dtype)), 16)
    slab = max_tokens.to(tl.int64) * hidden_size  # elements per (buffer, sender)
    work64 = first_row.to(tl.int64)

    # The row loops are `while` loops: Triton 3.6's interpreter cannot take its
    # program id as a `range` bound under NumPy 2.5 (1-element arrays are not
    # 0-d), and compiled code is the same either way.
    # Push: this rank's rows into slab [cur][rank] of every rank's buffer.
    row64 = work64
    while row64 < num_tokens:
        x = tl.load(partial_ptr + row64 * stride_partial + cols, mask=mask, other=0.0)
        x = tl.where(_is_sentinel(x), 0.0, x).to(dtype)  # -0.0 is the "not arrived" mark
        for peer in tl.static_range(WORLD_SIZE):
            base = tl.multiple_of(tl.load(ptr_table + peer).to(tl.pointer_type(dtype)), 16)
            tl.store(
                base + (cur * WORLD_SIZE + rank) * slab + row64 * hidden_size + cols, x, mask=mask
            )
        row64 += num_programs

    if DEBUG_SPIN > 0:
        if rank == debug_rank:
            _debug_delay(state_ptr, error_ptr, DEBUG_SPIN, USE_GLOBALTIMER)

    # Clear: this program's share of the previous call's rows, every sender.
    neg_zero = _neg_zeros(BLOCK_H, dtype)
    i = first_row
    while i < prev_tokens * WORLD_SIZE:
        sender = i // prev_tokens
        row64 = (i - sender * prev_tokens).to(tl.int64)
        tl.store(
            local + (prev * WORLD_SIZE + sender) * slab + row64 * hidden_size + cols,
            neg_zero,
            mask=mask,
        )
        i += num_programs

    # Poll, reduce in rank order, then the add+RMSNorm+capture epilogue.
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    row64 = work64
    while row64 < num_tokens:
        for sender in tl.static_range(WORLD_SIZE):
            part = _poll_row(
                local + (cur * WORLD_SIZE + sender) * slab + row64 * hidden_size + cols,
                mask,
                timeout_ns,
                error_ptr,
                state_ptr + _TRIPPED,
                USE_GLOBALTIMER,
            )
            if sender == 0:
                acc = part
            else:
                acc += part
        # The all-reduce result in the storage dtype, as the NCCL path hands it
        # to the add; then the single-GPU kernel's epilogue (one fp32 add, one
        # rounding, the stores, the norm).
        h = acc.to(dtype)
        r = tl.load(residual_ptr + row64 * stride_residual + cols, mask=mask, other=0.0)
        # The cache hints (the last two, none) passed explicitly: Triton 3.6 failed to
        # compile the call that left them to their defaults (its interpreter accepted it).
        add_rmsnorm_store_row(
            h,
            r,
            w,
            cols,
            mask,
            row64,
            hidden_size,
            eps,
            normed_out_ptr,
            stride_normed_out,
            residual_out_ptr,
            stride_residual_out,
            aux_ptr,
            stride_aux_row,
            aux_slot_offset,
            True,
            True,
            True,
            CAPTURE,
            NORM_FP32_SUM,
            "",
            "",
        )
        row64 += num_programs

    # Arrive: the last program bumps the epoch for the next launch (which starts
    # after this one has finished, so every program here has read the old one).
    arrived = tl.atomic_add(state_ptr + _ARRIVED, 1, sem="acq_rel", scope="gpu")
    if arrived == num_programs - 1:
        tl.store(state_ptr + _ARRIVED, 0)
        if ROWS_BY_TICKET:
            tl.store(state_ptr + _TICKETS, 0)  # every program took its ticket before arriving
        tl.store(state_ptr + _PREV_TOKENS, num_tokens)
        tl.store(state_ptr + _EPOCH, (epoch + 1) % _NUM_BUFFERS)  # never overflows
