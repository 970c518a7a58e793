"""The one-shot all-reduce kernel's cross-rank protocol on CPU, at world sizes
2 and 4: one process per rank, each running the kernel under Triton's
interpreter, over buffers and signal pads in shared memory.

Each process maps the shared tensors at its own addresses and builds its own
pointer tables from them -- exactly what symmetric memory gives each GPU --
and the interpreter's compare-and-swap is a real atomic on that memory, so
the barrier, the rank-ordered sum and the slot store run as they do across
GPUs (programs run one after another within a rank, in the same order on
every rank). Two calls in a row, with new partials written right after a
rank's first call returns: a kernel without barriers fails here. (A missing
*closing* barrier is a narrower race -- a peer still reading when the buffer is
rewritten -- that equal-speed processes rarely hit; making one rank slow with
``nice`` made the test take minutes on two cores.) Runs anywhere (the GPU machine too: the worker
processes select the interpreter themselves)."""

import os
import traceback

import pytest
import torch

from conftest import run_spawned, truncate_to_bf16

TIMEOUT_S = 240
T, H, K, SLOT, PROGRAMS, EPS = 5, 48, 3, 1, 3, 1e-6


def _expected(partials, residual):
    """What the interpreter computes: fp32 sum in rank order, then the add; its
    fp32 -> bf16 casts truncate."""
    h = truncate_to_bf16(torch.stack([p.float() for p in partials]).sum(0))
    return truncate_to_bf16(h.float() + residual.float())


def _rank(rank, world, shared, new_partials):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported in this process
    try:
        from eagle_capture.kernels.allreduce_add_rmsnorm_capture import (
            oneshot_allreduce_add_rmsnorm_capture_kernel as kernel)
        bufs, pads, residuals, outs, auxes, weight = shared
        buffer_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
        for call in range(2):
            if call == 1:
                # Right after this rank's first call returned: peers may still be
                # inside theirs unless the closing barrier held us back.
                bufs[rank].copy_(new_partials[rank])
            aux = auxes[rank][call]
            kernel[(PROGRAMS,)](
                buffer_ptrs, pad_ptrs, residuals[rank][call], weight, outs[rank][call],
                residuals[rank][call], aux, T, H, EPS, rank, H, H, H, aux.stride(0),
                SLOT * aux.stride(1), WORLD_SIZE=world, CAPTURE=True, BLOCK_H=64, num_warps=1)
    except Exception:
        traceback.print_exc()
        raise


@pytest.mark.parametrize("world", [2, 4])
def test_one_shot_protocol_across_processes(world):
    g = torch.Generator().manual_seed(world)
    partials = [torch.randn(T, H, generator=g).bfloat16() for _ in range(world)]
    new_partials = [torch.randn(T, H, generator=g).bfloat16() for _ in range(world)]
    residual = torch.randn(T, H, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16().share_memory_()
    bufs = [p.clone().share_memory_() for p in partials]
    # Room for PROGRAMS x world uint32 slots per rank, all zero at rest.
    pads = [torch.zeros(PROGRAMS * world, dtype=torch.int32).share_memory_()
            for _ in range(world)]
    residuals = [[residual.clone().share_memory_() for _ in range(2)] for _ in range(world)]
    outs = [[torch.empty(T, H, dtype=torch.bfloat16).share_memory_() for _ in range(2)]
            for _ in range(world)]
    auxes = [[torch.full((T + 2, K, H), float("nan"), dtype=torch.bfloat16).share_memory_()
              for _ in range(2)] for _ in range(world)]
    shared = (bufs, pads, residuals, outs, auxes, weight)
    run_spawned(_rank, (world, shared, new_partials), world, TIMEOUT_S,
                "the ranks (barrier hang?)")
    for call, parts in enumerate((partials, new_partials)):
        expected = _expected(parts, residual)
        for rank in range(world):
            got = residuals[rank][call]
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), \
                f"call {call} rank {rank}: residual differs from the rank-ordered sum + add"
            aux = auxes[rank][call]
            assert torch.equal(aux[:T, SLOT].view(torch.int16), expected.view(torch.int16))
            untouched = torch.ones(T + 2, K, dtype=torch.bool)
            untouched[:T, SLOT] = False
            assert torch.isnan(aux[untouched]).all(), "the kernel wrote outside its slot"
            x = expected.double()
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
            torch.testing.assert_close(outs[rank][call].double(), normed, rtol=2**-6, atol=1e-5)
        # Every rank holds the same bits (the TP consistency requirement).
        for rank in range(1, world):
            assert torch.equal(residuals[rank][call], residuals[0][call])
    for rank, pad in enumerate(pads):
        assert (pad == 0).all(), f"rank {rank}: signals left in the pad: {pad.tolist()}"
