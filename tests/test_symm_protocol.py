"""The one-shot (Lamport) all-reduce kernel's cross-rank protocol on CPU, at
world sizes 2 and 4: one process per rank, each running the kernel under
Triton's interpreter, over buffers, states and watchdog flags in shared memory.

Each process maps the shared tensors at its own addresses and builds its own
pointer table from them -- exactly what symmetric memory gives each GPU -- so
the push into peers' buffers, the -0.0 polling, the rank-ordered sum, the
clearing of the previous buffer and the device-side epoch run as they do
across GPUs (programs run one after another within a rank, in index order --
or, in the reverse-dispatch case, rank 1's in reverse: rows assigned by start
order, ROWS_BY_TICKET, must not care).

Seven calls in a row with a new partial per rank and call and a changing T
(every buffer of the three is used at least twice, after calls with more and
with fewer rows): a stale row (no clearing, clearing the wrong rows or the
wrong buffer, a host-side epoch) shows as a wrong sum. Rank 1 is made slow
*inside* the kernel on every call (``DEBUG_SPIN`` between its push and its
clear), so a fast peer's next push lands while it is still reading: with one
or two buffers instead of three that overwrites rows not yet read (a wrong
sum) or rows cleared after the push (a lost row: the poll waits forever). The
watchdog bounds every poll, so a protocol that loses a row fails in seconds
with the flag set instead of hanging. tools/mutation_check.py checks that
each of these mutants fails here. Runs anywhere, the GPU machine too: the
ranks are spawned with ``TRITON_INTERPRET=1`` in their environment, because a
spawned process imports this module -- and through conftest the package, whose
``@triton.jit`` helpers are compiled or interpreted as the variable says *at
import* -- before the rank function runs; each rank checks that every Triton
function it reaches is interpreted."""

import traceback

import pytest
import torch

from conftest import run_spawned, truncate_to_bf16

TIMEOUT_S = 300
H, K, SLOT, PROGRAMS, ROWS, EPS = 48, 3, 1, 3, 6, 1e-6
CALL_TOKENS = [5, 2, 1, 6, 6, 3, 5]  # per call; ROWS rows per sender slab
SLOW_RANK, SLOW_SPIN = 1, 400  # volatile loads between push and clear
TIMEOUT_SPINS = 40 * SLOW_SPIN  # watchdog: polls (~1 us each by the kernel's count)


def _expected(partials, residual):
    """What the interpreter computes: fp32 sum in rank order, then the add; its
    fp32 -> bf16 casts truncate. -0.0 partials count as +0.0."""
    parts = [torch.where(p == 0, torch.zeros_like(p), p) for p in partials]
    h = truncate_to_bf16(torch.stack([p.float() for p in parts]).sum(0))
    return truncate_to_bf16(h.float() + residual.float())


def _check_interpreted(module) -> None:
    """Every Triton function ``module`` holds (its kernel and the helpers it calls,
    imported ones too) must be interpreted: one compiled for the GPU raises
    "Cannot call @triton.jit'd outside of the scope of a kernel" when the
    interpreted kernel calls it."""
    from triton.runtime.jit import JITFunction  # the compiled kind (InterpretedFunction is not one)

    compiled = [name for name, value in vars(module).items() if isinstance(value, JITFunction)]
    if compiled:
        raise RuntimeError(
            f"compiled, not interpreted, in this rank: {compiled} (was the "
            "package imported before TRITON_INTERPRET=1 was set?)"
        )


def _rank(rank, world, by_ticket, reverse_dispatch, shared):
    # One thread: the interpreter's tensors are tiny, and a rank spinning on its polls with
    # every core's threads starves the peer it waits for (the pytest workers share the CPUs).
    torch.set_num_threads(1)
    try:
        import eagle_capture.kernels.allreduce_add_rmsnorm_capture as module

        _check_interpreted(module)
        kernel = module.lamport_allreduce_add_rmsnorm_capture_kernel
        bufs, states, flags, partials, residuals, outs, auxes, weight = shared
        ptr_table = torch.tensor(
            [b.data_ptr() for b in bufs] + [flags[rank].data_ptr()], dtype=torch.int64
        )
        for call, tokens in enumerate(CALL_TOKENS):
            aux, partial = auxes[rank][call], partials[call][rank]
            kernel[(min(tokens, PROGRAMS),)](
                partial_ptr=partial,
                residual_ptr=residuals[rank][call],
                weight_ptr=weight,
                normed_out_ptr=outs[rank][call],
                residual_out_ptr=residuals[rank][call],
                aux_ptr=aux,
                ptr_table=ptr_table,
                state_ptr=states[rank],
                num_tokens=tokens,
                hidden_size=H,
                max_tokens=ROWS,
                eps=EPS,
                rank=rank,
                stride_partial=partial.stride(0),
                stride_residual=H,
                stride_normed_out=H,
                stride_residual_out=H,
                stride_aux_row=aux.stride(0),
                aux_slot_offset=SLOT * aux.stride(1),
                timeout_ns=TIMEOUT_SPINS * 1000,
                debug_rank=SLOW_RANK,
                WORLD_SIZE=world,
                CAPTURE=True,
                NORM_FP32_SUM=False,
                USE_GLOBALTIMER=False,
                DEBUG_SPIN=SLOW_SPIN,
                BLOCK_H=64,
                ROWS_BY_TICKET=by_ticket,
                DEBUG_REVERSE_DISPATCH=reverse_dispatch,
                num_warps=1,
            )
            if flags[rank].item():
                raise RuntimeError(f"rank {rank} call {call}: the watchdog gave up on a row")
    except Exception:
        traceback.print_exc()
        raise


@pytest.mark.parametrize(
    "world, by_ticket, reverse_dispatch",
    [(2, False, False), (4, False, False), (2, True, False), (2, True, True)],
    ids=["2", "4", "2-by-ticket", "2-by-ticket-reverse-dispatch"],
)
def test_one_shot_protocol_across_processes(world, by_ticket, reverse_dispatch, monkeypatch):
    """by_ticket: rows by start order (ROWS_BY_TICKET). reverse_dispatch: rank 1
    runs its programs as if its GPU dispatched the highest program id first;
    rows by program id would then wait on a peer program that runs only after
    the waiting one (the watchdog fires). With tickets the program id is not
    used, so the shipped code runs this case as "2-by-ticket": it is the case
    that fails when rows follow the program id (tools/mutation_check.py)."""
    from eagle_capture.kernels.allreduce_add_rmsnorm_capture import NUM_BUFFERS, STATE_INTS

    g = torch.Generator().manual_seed(world)
    calls = len(CALL_TOKENS)
    partials = [
        [torch.randn(t, H, generator=g).bfloat16().share_memory_() for _ in range(world)]
        for t in CALL_TOKENS
    ]
    partials[0][0][0, :4] = -0.0  # a -0.0 in a partial must not read as "not arrived"
    residual_in = [torch.randn(t, H, generator=g).bfloat16() for t in CALL_TOKENS]
    weight = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16().share_memory_()
    bufs = [
        torch.full((NUM_BUFFERS * world * ROWS * H,), -0.0, dtype=torch.bfloat16).share_memory_()
        for _ in range(world)
    ]
    states = [torch.zeros(STATE_INTS, dtype=torch.int32).share_memory_() for _ in range(world)]
    flags = [torch.zeros(1, dtype=torch.int32).share_memory_() for _ in range(world)]
    residuals = [[r.clone().share_memory_() for r in residual_in] for _ in range(world)]
    outs = [
        [torch.empty(t, H, dtype=torch.bfloat16).share_memory_() for t in CALL_TOKENS]
        for _ in range(world)
    ]
    auxes = [
        [
            torch.full((t + 2, K, H), float("nan"), dtype=torch.bfloat16).share_memory_()
            for t in CALL_TOKENS
        ]
        for _ in range(world)
    ]
    shared = (bufs, states, flags, partials, residuals, outs, auxes, weight)
    # Inherited by the spawned ranks before they import anything (see the module docstring).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_spawned(
        _rank,
        (world, by_ticket, reverse_dispatch, shared),
        world,
        TIMEOUT_S,
        "the ranks (lost row? hang?)",
    )
    for call, tokens in enumerate(CALL_TOKENS):
        expected = _expected(partials[call], residual_in[call])
        for rank in range(world):
            got = residuals[rank][call]
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (
                f"call {call} rank {rank}: residual differs from the rank-ordered sum + add"
            )
            aux = auxes[rank][call]
            assert torch.equal(aux[:tokens, SLOT].view(torch.int16), expected.view(torch.int16))
            untouched = torch.ones(tokens + 2, K, dtype=torch.bool)
            untouched[:tokens, SLOT] = False
            assert torch.isnan(aux[untouched]).all(), "the kernel wrote outside its slot"
            x = expected.double()
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
            torch.testing.assert_close(outs[rank][call].double(), normed, rtol=2**-6, atol=1e-5)
        for rank in range(1, world):  # every rank holds the same bits (TP consistency)
            assert torch.equal(residuals[rank][call], residuals[0][call])
    for rank in range(world):
        assert flags[rank].item() == 0
        # Device-side epoch: advanced once per call (mod 3), arrivals reset, T_prev kept,
        # watchdog not tripped, the ticket counter reset.
        assert states[rank].tolist() == [calls % NUM_BUFFERS, 0, CALL_TOKENS[-1], 0, 0]
        # At rest only the last call's slabs hold data; the previous two are -0.0 again
        # (the one before the last call was cleared by it; the older one by its successor).
        slabs = bufs[rank].view(NUM_BUFFERS, world, ROWS, H)
        last = (calls - 1) % NUM_BUFFERS
        for b in range(NUM_BUFFERS):
            if b != last:
                assert (slabs[b].view(torch.int16) == -32768).all(), (
                    f"rank {rank}: buffer {b} not cleared back to -0.0"
                )
