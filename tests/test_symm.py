"""The one-shot all-reduce + add + RMSNorm + capture (eagle_capture.symm) in
spawned processes, world size 1 and 2 (one GPU per rank; gloo for the process
group, so the NCCL-free fallback path runs too). GPU only; the multicast guard
and its place in construction run anywhere."""

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import HAS_CUDA, run_spawned

TIMEOUT_S = int(os.environ.get("EAGLE_CAPTURE_SYMM_TEST_TIMEOUT", "180"))
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")


# The documented multicast-off values (README, eagle_capture/symm.py).
MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def _unset_multicast_variables(monkeypatch):
    for name in MULTICAST_OFF:
        monkeypatch.setenv(name, "")  # records the original value for the undo
        monkeypatch.delenv(name)


def test_multicast_guard(monkeypatch):
    from eagle_capture import symm
    _unset_multicast_variables(monkeypatch)
    with pytest.raises(RuntimeError, match="must stay off"):
        symm.check_multicast_disabled()  # unset is not off
    symm.ensure_multicast_disabled()  # sets the safe defaults
    assert {name: os.environ[name] for name in MULTICAST_OFF} == MULTICAST_OFF
    symm.check_multicast_disabled()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE"):
        symm.check_multicast_disabled()
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE"):
        symm.ensure_multicast_disabled()  # a user's value is refused, never overridden
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"


def test_construction_sets_the_multicast_defaults_before_anything_else(monkeypatch):
    """Runs anywhere: the environment is handled before the arguments are
    checked and before any symmetric-memory allocation."""
    from eagle_capture import symm
    _unset_multicast_variables(monkeypatch)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        symm.SymmAllReduceCapture(0, 64, torch.bfloat16)
    assert {name: os.environ[name] for name in MULTICAST_OFF} == MULTICAST_OFF
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    with pytest.raises(RuntimeError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        symm.SymmAllReduceCapture(0, 64, torch.bfloat16)


def _reference(partials, residual, weight, eps):
    """Sum in rank order in fp32, round once; then the single-GPU op's add+RMSNorm."""
    from eagle_capture.reference import add_rmsnorm_reference
    h = torch.stack([p.float() for p in partials]).sum(0).to(residual.dtype)
    return add_rmsnorm_reference(h, residual, weight, eps)


def _scenarios(rank, world, device):
    from conftest import assert_bitwise_equal
    from eagle_capture.symm import SymmAllReduceCapture
    from eagle_capture.tp import check_capture_consistency
    from eagle_capture import AuxCaptureBuffer

    dtype, eps = torch.bfloat16, 1e-6
    for H in (7168, 100):
        ar = SymmAllReduceCapture(300, H, dtype, device=device, one_shot_max_tokens=260)
        g = torch.Generator(device="cpu").manual_seed(H)
        weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(device)
        for T in (1, 5, 133, 257, 0):
            for with_aux in (True, False):
                # Same residual on every rank (it is replicated under TP); partials differ.
                g = torch.Generator(device="cpu").manual_seed(T)
                residual = torch.randn(T, H, generator=g).to(dtype).to(device)
                partials = [torch.randn(T, H, generator=g).to(dtype).to(device)
                            for _ in range(world)]
                normed_ref, res_ref = _reference(partials, residual, weight, eps)
                buf = AuxCaptureBuffer(300, H, [2, 30, 58], dtype=dtype, device=device)
                buf.aux.fill_(float("nan"))
                mine, r = partials[rank].clone(), residual.clone()
                out = ar.reduce_add_rmsnorm(mine, r, weight, eps,
                                            buf.aux if with_aux else None, 1)
                assert out is mine
                assert_bitwise_equal(r, res_ref)
                torch.testing.assert_close(out.double(), normed_ref, rtol=2**-7, atol=1e-5)
                if with_aux:
                    assert_bitwise_equal(buf.aux[:T, 1], res_ref)
                    assert torch.isnan(buf.aux[:T, [0, 2]]).all()
                    assert torch.isnan(buf.aux[T:]).all()
                    buf.aux[:T, 0] = res_ref
                    buf.aux[:T, 2] = res_ref
                    check_capture_consistency(buf, T, H)
                else:
                    assert torch.isnan(buf.aux).all()
        # Many calls in a row reuse the barrier slots: no hang, no stale rows.
        # Each call adds 1 (1/world from each rank) to the residual: exact in bf16
        # up to 256, so any call that read a stale or missing partial shows.
        T = 64
        r = torch.zeros(T, H, dtype=dtype, device=device)
        for i in range(200):
            mine = torch.full((T, H), 1.0 / world, dtype=dtype, device=device)
            ar.reduce_add_rmsnorm(mine, r, weight, eps)
        torch.cuda.synchronize()
        assert (r.float() == 200).all(), "a call read another call's partials"
        # Zero copy: the projection wrote into input_buffer(T); the normed output
        # goes to a new tensor (peers may still read the buffer).
        T = 7
        g = torch.Generator(device="cpu").manual_seed(7)
        residual = torch.randn(T, H, generator=g).to(dtype).to(device)
        partials = [torch.randn(T, H, generator=g).to(dtype).to(device) for _ in range(world)]
        normed_ref, res_ref = _reference(partials, residual, weight, eps)
        staged = ar.input_buffer(T)
        staged.copy_(partials[rank])
        r = residual.clone()
        out = ar.reduce_add_rmsnorm(staged, r, weight, eps)
        assert out.data_ptr() != staged.data_ptr()
        assert_bitwise_equal(r, res_ref)
        torch.testing.assert_close(out.double(), normed_ref, rtol=2**-7, atol=1e-5)
        # Through TPCapture: the captured layer's slot gets the reduced residual.
        from eagle_capture.tp import TPCapture
        buf = AuxCaptureBuffer(300, H, [2, 30, 58], dtype=dtype, device=device)
        buf.aux.fill_(float("nan"))
        r = residual.clone()
        TPCapture(buf, fused_allreduce=ar).reduce_add_rmsnorm(30, partials[rank].clone(), r,
                                                             weight, eps)
        assert_bitwise_equal(buf.slot_view(30, T), res_ref)
        assert_bitwise_equal(r, res_ref)
        # Above the one-shot limit: all-reduce (the process group's) + the fused op.
        T = 280
        g = torch.Generator(device="cpu").manual_seed(280)
        residual = torch.randn(T, H, generator=g).to(dtype).to(device)
        partials = [torch.randn(T, H, generator=g).to(dtype).to(device) for _ in range(world)]
        normed_ref, res_ref = _reference(partials, residual, weight, eps)
        r = residual.clone()
        out = ar.reduce_add_rmsnorm(partials[rank].clone(), r, weight, eps)
        if world == 1:
            assert_bitwise_equal(r, res_ref)
        else:  # the backend's all-reduce rounds its own way
            torch.testing.assert_close(r.float(), res_ref.float(), rtol=2**-6, atol=2**-6)
        # Bad inputs raise before any launch or collective.
        with pytest.raises(ValueError, match="partial must be"):
            ar.reduce_add_rmsnorm(torch.zeros(2, H + 1, dtype=dtype, device=device),
                                  residual[:2].clone(), weight, eps)
        with pytest.raises(ValueError, match="symmetric buffer"):
            ar.reduce_add_rmsnorm(partials[rank][:2].clone(), residual[:2].clone(), weight, eps,
                                  out=ar.input_buffer(2))
        with pytest.raises(ValueError, match="residual must be"):  # read as the buffer's dtype
            ar.reduce_add_rmsnorm(partials[rank][:2].clone(), residual[:2].float(), weight, eps)
        with pytest.raises(ValueError, match="must not be the symmetric"):
            TPCapture(buf, fused_allreduce=ar).reduce_add_rmsnorm(30, ar.input_buffer(2),
                                                                 residual[:2].clone(), weight, eps)
    # CUDA graph: capture one call, replay with new partials copied in.
    H, T = 7168, 16
    ar = SymmAllReduceCapture(32, H, dtype, device=device)
    weight = torch.ones(H, dtype=dtype, device=device)
    static_p = torch.zeros(T, H, dtype=dtype, device=device)
    static_r = torch.zeros(T, H, dtype=dtype, device=device)
    ar.reduce_add_rmsnorm(static_p.clone(), static_r.clone(), weight, eps)  # compile
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ar.reduce_add_rmsnorm(static_p, static_r, weight, eps)
    for step in range(5):
        g = torch.Generator(device="cpu").manual_seed(100 + step)
        residual = torch.randn(T, H, generator=g).to(dtype).to(device)
        partials = [torch.randn(T, H, generator=g).to(dtype).to(device) for _ in range(world)]
        static_p.copy_(partials[rank])
        static_r.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        _, res_ref = _reference(partials, residual, weight, eps)
        assert_bitwise_equal(static_r, res_ref)


def _worker(rank, world, store_dir):
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        _scenarios(rank, world, device)
        dist.barrier()
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


@requires_cuda
@pytest.mark.parametrize("world", [1, 2])
def test_one_shot_allreduce_add_rmsnorm_capture(world, tmp_path):
    if torch.cuda.device_count() < world:
        # Measured on the H200 machine: torch's CUDA symmetric memory refuses two
        # ranks on one device ("detected allocations from overlapping devices").
        pytest.skip(f"needs {world} GPUs")
    run_spawned(_worker, (world, str(tmp_path)), world, TIMEOUT_S, "symmetric-memory test")
