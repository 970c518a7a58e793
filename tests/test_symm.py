"""The all-reduce + add + RMSNorm + capture (eagle_capture.parallel.symm) in spawned
processes, world size 1 and 2 (one GPU per rank, NCCL): the one-shot Lamport
kernel against a float reference, bit-identical ranks, both norm numerics,
-0.0 partials, the reuse guard under a rank slowed inside the kernel, a rank
late on the host, a rank that never arrives (watchdog), 100,000 calls with
changing T checked by exact checksums, CUDA graphs holding an odd number of
calls, torch.compile(fullgraph) through the custom op, the NCCL path above the
one-shot limit, and bad inputs. GPU only; the multicast guard, the path
table and the construction order run anywhere."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from conftest import HAS_CUDA, run_ranks
from eagle_capture.parallel.paths import PathTable

TIMEOUT_S = int(os.environ.get("EAGLE_CAPTURE_SYMM_TEST_TIMEOUT", "180"))
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")


# The documented multicast-off values (README, eagle_capture/parallel/symm.py).
MULTICAST_OFF = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _unset_multicast_variables(monkeypatch):
    for name in MULTICAST_OFF:
        monkeypatch.setenv(name, "")  # records the original value for the undo
        monkeypatch.delenv(name)


def test_multicast_guard(monkeypatch):
    from eagle_capture.parallel import symm

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
    from eagle_capture.parallel import symm

    _unset_multicast_variables(monkeypatch)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        symm.SymmAllReduceCapture(0, 64, torch.bfloat16)
    assert {name: os.environ[name] for name in MULTICAST_OFF} == MULTICAST_OFF
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    with pytest.raises(RuntimeError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        symm.SymmAllReduceCapture(0, 64, torch.bfloat16)


def test_path_table(tmp_path):
    """Runs anywhere: the table's lookup rule and its refusals."""
    from eagle_capture.parallel.symm import TABLE_FORMAT, PathTable, default_one_shot_max_tokens

    table = {
        "format": TABLE_FORMAT,
        "hidden_size": 7168,
        "dtype": "bfloat16",
        "paths": {"2": [[1, "one_shot"], [64, "one_shot"], [128, "nccl"], [512, "one_shot"]]},
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    t = PathTable.load(str(path))
    assert [t.path(2, n) for n in (1, 2, 64, 65, 128, 129, 512, 4096)] == [
        "one_shot",
        "one_shot",
        "one_shot",
        "nccl",
        "nccl",
        "one_shot",
        "one_shot",
        "one_shot",
    ]
    assert t.path(8, 1) is None  # not measured: the default rule applies
    with pytest.raises(ValueError, match="not a path table"):
        PathTable.load({"paths": {}})
    with pytest.raises(ValueError, match="path in"):
        PathTable.load(dict(table, paths={"2": [[1, "two_shot"]]}))
    assert default_one_shot_max_tokens(1) == 0  # world 1: the no-op all-reduce + fused op
    assert default_one_shot_max_tokens(3) == default_one_shot_max_tokens(2)
    assert default_one_shot_max_tokens(16) == default_one_shot_max_tokens(8)


def test_measured_table_round_trip(tmp_path):
    """Runs anywhere: the table the package builds from timings and writes is the one
    it reads, in the documented format; the faster path per T, one_shot on a tie."""
    from eagle_capture.parallel.paths import TABLE_FORMAT, measured_table, write_table

    timings = [
        (1, 5.0, 9.0),
        (2, 7.0, 7.0),
        (64, 12.0, 10.0),
        (128, None, 20.0),
        (256, 30.0, None),
        (512, None, None),
    ]
    table = measured_table(2, timings, 7168, "bfloat16", "H200", date="2026-12-06")
    assert table == {
        "format": TABLE_FORMAT,
        "hidden_size": 7168,
        "dtype": "bfloat16",
        "device": "H200",
        "date": "2026-12-06",
        "paths": {
            "2": [[1, "one_shot"], [2, "one_shot"], [64, "nccl"], [128, "nccl"], [256, "one_shot"]]
        },
    }
    path = tmp_path / "t.json"
    written = write_table(table, path)
    assert json.loads(path.read_text()) == table
    loaded = PathTable.load(str(path))
    assert (
        loaded.paths
        == written.paths
        == {2: [(1, "one_shot"), (2, "one_shot"), (64, "nccl"), (128, "nccl"), (256, "one_shot")]}
    )
    assert [loaded.path(2, n) for n in (1, 3, 64, 100, 200, 4096)] == [
        "one_shot",
        "nccl",
        "nccl",
        "nccl",
        "one_shot",
        "one_shot",
    ]
    assert len(measured_table(4, timings, 7168, "bfloat16", "H200")["date"]) == 10


def test_write_table_refuses_what_the_reader_refuses(tmp_path):
    """Runs anywhere: nothing measured (every row None) is an error, not an empty file."""
    from eagle_capture.parallel.paths import measured_table, write_table

    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match="world size 2 needs"):
        write_table(measured_table(2, [(1, None, None)], 64, "bfloat16", "cpu"), path)
    assert not path.exists()
    with pytest.raises(ValueError, match="not a path table"):
        write_table({"paths": {"2": [[1, "nccl"]]}}, path)
    assert not path.exists()


def test_eager_range_scan(monkeypatch):
    """Runs anywhere: the per-call overlap scan of the eager memo (addresses
    change between calls with one signature), without symmetric memory: the
    plan's byte ranges are the five tensors' (out's none when it is partial)
    and this rank's symmetric buffer."""
    ar, _ = _cpu_stand_in(monkeypatch)
    ar._buffer_addr, ar._buffer_bytes = 1 << 20, 4096
    H, dt = ar.hidden_size, torch.bfloat16
    p, r, out = (torch.zeros(2, H, dtype=dt) for _ in range(3))  # 256 bytes each
    w, aux = torch.ones(H, dtype=dt), torch.zeros(3, 2, H, dtype=dt)  # 128, 768 bytes
    plan = ar._eager_plan(p, r, w, 1e-6, aux, 0, out, False)
    into_partial = ar._eager_plan(p, r, w, 1e-6, aux, 0, p, False)
    assert plan.extents == (256, 256, 128, 256, 768, 4096)
    apart = [0, 1024, 2048, 4096, 8192]  # partial, residual, weight, out, aux
    assert not plan.meets(apart)
    assert not into_partial.meets([0, 1024, 2048, 0, 8192])
    assert plan.meets([0, 1024, 2048, 0, 8192])
    assert plan.meets([0, 1024, 2048, 4096, 4096 + 100])
    assert plan.meets([0, 1024, 2048, (1 << 20) + 4000, 8192])
    assert into_partial.meets([(1 << 20) - 255, 1024, 2048, 4096, 8192])
    assert not into_partial.meets([(1 << 20) - 256, 1024, 2048, 4096, 8192])
    no_aux = ar._eager_plan(p, r, w, 1e-6, None, 0, out, False)
    assert not no_aux.meets([0, 1024, 2048, 4096, 0])


class _RecordingKernel:
    """A stand-in for the Triton kernel: Triton's entry is recorded and returns a
    compiled kernel whose launcher records the direct launches."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def entry(*args, **kwargs):
            self.calls.append(("triton", grid, args))
            calls = self.calls

            class Compiled:
                function, packed_metadata = "function", "metadata"

                def run(self, *args):
                    calls.append(("direct", args))

            return Compiled()

        return entry


def _fast_path_stand_in(ar, symm):
    from eagle_capture import ops

    kernel = _RecordingKernel()
    ar._launcher = ops.FastLaunch(
        symm.lamport_allreduce_add_rmsnorm_capture_kernel, direct_launch=True
    )  # whatever the environment says
    ar._launcher.kernel = kernel
    return kernel.calls


def test_eager_memo_direct_launch_arguments(monkeypatch):
    """Runs anywhere: a memo hit launches the cached kernel with this call's
    addresses in the kernel's pointer order and the first call's scalars -- the
    argument list Triton's own launch got, with tensors as addresses. (The
    kernel and the CUDA stream are stand-ins; the GPU tests run the real ones.)"""
    import eagle_capture.parallel.symm as symm
    from eagle_capture import ops

    if not ops.DIRECT_LAUNCH:
        pytest.skip("this Triton has no direct-launch support")
    ar = object.__new__(symm.SymmAllReduceCapture)
    H, dtype = 64, torch.bfloat16
    ar.hidden_size, ar.dtype, ar.world_size, ar.rank = H, dtype, 2, 1
    ar.device = torch.device("cuda", 0)  # the plan's device; the tensors stay on the CPU
    ar.max_programs, ar._rows, ar._block_h, ar._num_warps = 4, 8, 64, 1
    ar.one_shot_max_tokens, ar.table, ar._timeout_ns = 8, None, 0
    ar.rows_by_ticket = False
    ar.state, ar._ptr_table = torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    ar._buffer_addr, ar._buffer_bytes = 16, 16  # nowhere near the tensors
    calls = _fast_path_stand_in(ar, symm)
    monkeypatch.setattr(ar, "_validate", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 777, raising=False)
    w = torch.ones(H, dtype=dtype)
    aux = torch.zeros(8, 3, H, dtype=dtype)
    p1, r1 = torch.randn(3, H).to(dtype), torch.randn(3, H).to(dtype)
    ar.reduce_add_rmsnorm(p1, r1, w, 1e-6, aux, 2)
    p2, r2 = torch.randn(3, H).to(dtype), torch.randn(3, H).to(dtype)
    ar.reduce_add_rmsnorm(p2, r2, w, 1e-6, aux, 2)
    (kind1, grid, first), (kind2, second) = calls
    assert kind1 == "triton" and kind2 == "direct" and grid == (3, 1)
    names = ops.KernelSignature(symm.lamport_allreduce_add_rmsnorm_capture_kernel).params
    by_name = dict(zip(names, first))
    assert {
        n: by_name[n]
        for n in (
            "partial_ptr",
            "residual_ptr",
            "weight_ptr",
            "normed_out_ptr",
            "residual_out_ptr",
            "aux_ptr",
            "ptr_table",
            "state_ptr",
        )
    } == dict(
        partial_ptr=p1,
        residual_ptr=r1,
        weight_ptr=w,
        normed_out_ptr=p1,
        residual_out_ptr=r1,
        aux_ptr=aux,
        ptr_table=ar._ptr_table,
        state_ptr=ar.state,
    )
    assert (by_name["num_tokens"], by_name["rank"], by_name["aux_slot_offset"]) == (3, 1, 2 * H)
    # The first launch's arguments with the second call's tensors, as addresses.
    swap = {id(p1): p2, id(r1): r2}
    expected = tuple(
        swap.get(id(a), a).data_ptr() if isinstance(a, torch.Tensor) else a for a in first
    )
    assert second == (3, 1, 1, 777, "function", "metadata", None, None, None) + expected


def test_grad_requiring_tensors_are_refused(monkeypatch):
    """Runs anywhere: the kernel writes through raw pointers, so a tensor that
    requires grad in grad mode is refused before any launch (as the ops do)."""
    import eagle_capture.parallel.symm as symm

    ar = object.__new__(symm.SymmAllReduceCapture)
    H = 64
    ar.hidden_size, ar.dtype, ar.device = H, torch.bfloat16, torch.device("cpu")
    ar._timeout_ns, ar._buffer_addr, ar._buffer_bytes = 0, 16, 16
    ar.buffer = torch.empty(0, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # CPU stand-in
    calls = _fast_path_stand_in(ar, symm)
    p = torch.randn(2, H).bfloat16().requires_grad_()
    r = torch.randn(2, H).bfloat16()
    with pytest.raises(RuntimeError, match="requires grad while grad mode is on"):
        ar.reduce_add_rmsnorm(
            p,
            r,
            torch.ones(H, dtype=torch.bfloat16),
            1e-6,
            out=torch.empty(2, H, dtype=torch.bfloat16),
        )
    assert calls == []  # nothing launched


def _cpu_stand_in(monkeypatch, H=64):
    """A SymmAllReduceCapture on CPU tensors whose launches are recorded, not run:
    the eager path's validation and memo without a GPU."""
    import eagle_capture.parallel.symm as symm

    ar = object.__new__(symm.SymmAllReduceCapture)
    ar.hidden_size, ar.dtype, ar.device, ar.world_size, ar.rank = (
        H,
        torch.bfloat16,
        torch.device("cpu"),
        2,
        0,
    )
    ar.max_programs, ar._rows, ar._block_h, ar._num_warps = 4, 8, 64, 1
    ar.one_shot_max_tokens, ar.table, ar._timeout_ns = 8, None, 0
    ar.rows_by_ticket = False
    ar.state, ar._ptr_table = torch.zeros(5, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    ar.buffer = torch.empty(0, dtype=torch.bfloat16)
    ar._buffer_addr, ar._buffer_bytes = 16, 16  # nowhere near the tensors
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # CPU stand-in
    return ar, _fast_path_stand_in(ar, symm)


def test_grad_requiring_tensors_are_refused_on_a_memo_hit_too(monkeypatch):
    """The first call (plain tensors, grad mode on) fills the memo; the same
    signature with a weight that requires grad must still be refused."""
    ar, launches = _cpu_stand_in(monkeypatch)
    H, dt = ar.hidden_size, torch.bfloat16
    w = torch.ones(H, dtype=dt)
    ar.reduce_add_rmsnorm(torch.randn(2, H).to(dt), torch.randn(2, H).to(dt), w, 1e-6)
    assert len(launches) == 1 and len(ar._launcher.plans) == 1
    with pytest.raises(RuntimeError, match="requires grad while grad mode is on"):
        ar.reduce_add_rmsnorm(
            torch.randn(2, H).to(dt), torch.randn(2, H).to(dt), w.clone().requires_grad_(), 1e-6
        )
    with torch.no_grad():  # serving: fine
        ar.reduce_add_rmsnorm(
            torch.randn(2, H).to(dt), torch.randn(2, H).to(dt), w.clone().requires_grad_(), 1e-6
        )
    assert len(launches) == 2


def test_out_overlapping_partial_with_other_strides_is_refused(monkeypatch):
    """out may be partial's own rows (same address and strides); an out that
    starts at partial's address with another row stride would overwrite rows
    other programs have not pushed yet -- refused, on a memo miss and a hit."""
    ar, launches = _cpu_stand_in(monkeypatch)
    H, dt = ar.hidden_size, torch.bfloat16
    w = torch.ones(H, dtype=dt)
    big = torch.randn(8, H).to(dt)
    with pytest.raises(ValueError, match="out must be partial itself"):
        ar.reduce_add_rmsnorm(big[:4], torch.randn(4, H).to(dt), w, 1e-6, out=big[::2])
    ar.reduce_add_rmsnorm(big[:4], torch.randn(4, H).to(dt), w, 1e-6, out=big[:4])  # same rows
    other = torch.randn(8, H).to(dt)  # fill the memo with a harmless out of the same strides
    ar.reduce_add_rmsnorm(big[:4], torch.randn(4, H).to(dt), w, 1e-6, out=other[::2])
    with pytest.raises(ValueError, match="out must be partial itself"):
        ar.reduce_add_rmsnorm(big[:4], torch.randn(4, H).to(dt), w, 1e-6, out=big[::2])
    assert len(launches) == 2


def _reference(partials, residual, weight, eps, norm_fp32_sum=False):
    """Sum in rank order in fp32 (a -0.0 partial counts as +0.0), round once;
    then the single-GPU op's add+RMSNorm."""
    from eagle_capture.testing.reference import add_rmsnorm_reference

    h = torch.stack([p.float() + 0.0 for p in partials]).sum(0).to(residual.dtype)
    return add_rmsnorm_reference(h, residual, weight, eps, norm_fp32_sum)


def _rand(g, *shape, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _check_one_shot_numerics(ar, rank, world, device):
    from conftest import assert_bitwise_equal
    from eagle_capture import AuxCaptureBuffer
    from eagle_capture.parallel.tp import check_capture_consistency

    dtype, eps, H = ar.dtype, 1e-6, ar.hidden_size
    g = torch.Generator().manual_seed(H)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(device)
    for T in (1, 5, 133, 257, 0):
        for with_aux, fp32_sum in ((True, False), (False, False), (True, True)):
            # Same residual on every rank (it is replicated under TP); partials differ.
            g = torch.Generator().manual_seed(T)
            residual = _rand(g, T, H, device=device)
            partials = [_rand(g, T, H, device=device) for _ in range(world)]
            if T:
                partials[0][0, :8] = -0.0  # the sentinel value as data
                residual[0, :4] = -0.0
            normed_ref, res_ref = _reference(partials, residual, weight, eps, fp32_sum)
            buf = AuxCaptureBuffer(300, H, [2, 30, 58], dtype=dtype, device=device)
            buf.aux.fill_(float("nan"))
            mine, r = partials[rank].clone(), residual.clone()
            assert ar.path_for(T) == "one_shot"
            out = ar.reduce_add_rmsnorm(
                mine, r, weight, eps, buf.aux if with_aux else None, 1, norm_fp32_sum=fp32_sum
            )
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
    # An explicit out leaves the partial alone; strided residual/out rows.
    T = 9
    g = torch.Generator().manual_seed(9)
    residual = _rand(g, T, H, device=device)
    partials = [_rand(g, T, H, device=device) for _ in range(world)]
    normed_ref, res_ref = _reference(partials, residual, weight, eps)
    wide_r = torch.full((T, H + 16), 7.0, dtype=dtype, device=device)
    wide_r[:, :H] = residual
    wide_o = torch.full((T, H + 16), 7.0, dtype=dtype, device=device)
    mine = partials[rank].clone()
    ar.reduce_add_rmsnorm(mine, wide_r[:, :H], weight, eps, out=wide_o[:, :H])
    assert_bitwise_equal(mine, partials[rank])
    assert_bitwise_equal(wide_r[:, :H], res_ref)
    assert (wide_r[:, H:] == 7).all() and (wide_o[:, H:] == 7).all()
    torch.testing.assert_close(wide_o[:, :H].double(), normed_ref, rtol=2**-7, atol=1e-5)


def _check_reuse_guard(ar, rank, world, device):
    """A slow rank (spinning inside the kernel between its push and its clear),
    new partials every call, T changing: every call must see its own partials.
    Without three buffers a fast peer's next push overwrites unread rows."""
    from conftest import assert_bitwise_equal

    H, eps, dtype = ar.hidden_size, 1e-6, ar.dtype
    weight = torch.ones(H, dtype=dtype, device=device)
    for call, T in enumerate((4, 1, 7, 7, 2, 5, 3)):
        g = torch.Generator().manual_seed(500 + call)
        residual = _rand(g, T, H, device=device)
        partials = [_rand(g, T, H, device=device) for _ in range(world)]
        _, res_ref = _reference(partials, residual, weight, eps)
        r = residual.clone()
        ar._launch_one_shot(
            partials[rank].clone(),
            r,
            weight,
            eps,
            None,
            0,
            torch.empty_like(r),
            ar.state,
            False,
            debug_spin=2000,
            debug_rank=call % world,
        )  # ~2 ms
        torch.cuda.synchronize()
        assert_bitwise_equal(r, res_ref)


def _check_many_calls(ar, rank, world, device, graphs_replays):
    """100 calls with changing T in one CUDA graph, replayed; integer-valued data
    makes every sum exact, so an int64 checksum per call, accumulated on the GPU
    over all replays, equals replays x the NCCL-reduced reference exactly."""
    H, eps, dtype = ar.hidden_size, 1e-6, ar.dtype
    weight = torch.ones(H, dtype=dtype, device=device)
    sizes = [(1, 3, 64, 7, 128, 2, 33, 1, 16, 100)[i % 10] for i in range(100)]
    g = torch.Generator().manual_seed(1234 + rank)
    partials = [torch.randint(-8, 9, (T, H), generator=g).to(dtype).to(device) for T in sizes]
    g = torch.Generator().manual_seed(99)  # residuals replicated
    pristine = [torch.randint(-8, 9, (T, H), generator=g).to(dtype).to(device) for T in sizes]
    residuals = [p.clone() for p in pristine]
    outs = [torch.empty_like(p) for p in pristine]
    checksum = torch.zeros(len(sizes), dtype=torch.int64, device=device)
    expected = torch.empty_like(checksum)
    for i, p in enumerate(partials):  # the NCCL reference
        reduced = p.clone()
        dist.all_reduce(reduced)
        expected[i] = (reduced.to(torch.int64) + pristine[i].to(torch.int64)).sum()

    def step():
        for i in range(len(sizes)):
            residuals[i].copy_(pristine[i])
            ar.reduce_add_rmsnorm(partials[i], residuals[i], weight, eps, out=outs[i])
            checksum[i] += residuals[i].to(torch.int64).sum()

    step()
    torch.cuda.synchronize()
    checksum.zero_()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(graphs_replays):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(checksum, expected * graphs_replays), (
        (checksum - expected * graphs_replays).nonzero().flatten().tolist()
    )


def _scenarios(rank, world, device):
    from conftest import assert_bitwise_equal
    from eagle_capture import AuxCaptureBuffer
    from eagle_capture.parallel.symm import PathTable, SymmAllReduceCapture
    from eagle_capture.parallel.tp import TPCapture

    dtype, eps = torch.bfloat16, 1e-6
    for H in (7168, 100):
        ar = SymmAllReduceCapture(
            300, H, dtype, device=device, one_shot_max_tokens=260, table=PathTable({})
        )
        _check_one_shot_numerics(ar, rank, world, device)
        weight = torch.ones(H, dtype=dtype, device=device)
        # Through TPCapture: the captured layer's slot gets the reduced residual.
        T = 7
        g = torch.Generator().manual_seed(7)
        residual = _rand(g, T, H, device=device)
        partials = [_rand(g, T, H, device=device) for _ in range(world)]
        _, res_ref = _reference(partials, residual, weight, eps)
        buf = AuxCaptureBuffer(300, H, [2, 30, 58], dtype=dtype, device=device)
        buf.aux.fill_(float("nan"))
        r = residual.clone()
        TPCapture(buf, fused_allreduce=ar).reduce_add_rmsnorm(
            30, partials[rank].clone(), r, weight, eps
        )
        assert_bitwise_equal(buf.slot_view(30, T), res_ref)
        assert_bitwise_equal(r, res_ref)
        # Above the one-shot limit: NCCL all-reduce + the fused op.
        T = 280
        assert ar.path_for(T) == "nccl"
        g = torch.Generator().manual_seed(280)
        residual = _rand(g, T, H, device=device)
        partials = [_rand(g, T, H, device=device) for _ in range(world)]
        _, res_ref = _reference(partials, residual, weight, eps)
        r = residual.clone()
        ar.reduce_add_rmsnorm(partials[rank].clone(), r, weight, eps)
        if world == 1:
            assert_bitwise_equal(r, res_ref)
        else:  # NCCL rounds its own way
            torch.testing.assert_close(r.float(), res_ref.float(), rtol=2**-6, atol=2**-6)
        # Bad inputs raise before any launch or collective.
        with pytest.raises(ValueError, match="partial must be"):
            ar.reduce_add_rmsnorm(
                torch.zeros(2, H + 1, dtype=dtype, device=device), residual[:2].clone(), weight, eps
            )
        # The same call signature validated before (a memo hit): the per-call range
        # scan must still catch an out inside the symmetric buffer.
        ar.reduce_add_rmsnorm(
            partials[rank][:2].clone(),
            residual[:2].clone(),
            weight,
            eps,
            out=torch.empty(2, H, dtype=dtype, device=device),
        )
        with pytest.raises(ValueError, match="symmetric buffer"):
            ar.reduce_add_rmsnorm(
                partials[rank][:2].clone(),
                residual[:2].clone(),
                weight,
                eps,
                out=ar.buffer[: 2 * H].view(2, H),
            )
        with pytest.raises(ValueError, match="residual must be"):  # written as the buffer's dtype
            ar.reduce_add_rmsnorm(partials[rank][:2].clone(), residual[:2].float(), weight, eps)
        with pytest.raises(ValueError, match="partial must not overlap"):
            x = residual[:2].clone()
            ar.reduce_add_rmsnorm(x, x, weight, eps, out=torch.empty_like(x))
    # The reuse guard under a rank slowed inside the kernel.
    ar = SymmAllReduceCapture(
        16, 7168, dtype, device=device, one_shot_max_tokens=16, table=PathTable({})
    )
    _check_reuse_guard(ar, rank, world, device)
    # A rank late on the host: the other waits in the kernel, results still exact.
    g = torch.Generator().manual_seed(11)
    weight = torch.ones(7168, dtype=dtype, device=device)
    residual = _rand(g, 3, 7168, device=device)
    partials = [_rand(g, 3, 7168, device=device) for _ in range(world)]
    _, res_ref = _reference(partials, residual, weight, eps)
    if rank == world - 1:
        time.sleep(0.5)
    r = residual.clone()
    ar.reduce_add_rmsnorm(partials[rank].clone(), r, weight, eps)
    torch.cuda.synchronize()
    assert_bitwise_equal(r, res_ref)
    # 100 calls with changing T per graph, 1000 replays: 100,000 calls.
    _check_many_calls(
        SymmAllReduceCapture(
            128, 7168, dtype, device=device, one_shot_max_tokens=128, table=PathTable({})
        ),
        rank,
        world,
        device,
        1000,
    )
    # Rows by ticket (opt-in): the same numerics; the ticket counter reset across
    # 10,000 graph-replayed calls with changing T.
    _check_one_shot_numerics(
        SymmAllReduceCapture(
            300,
            7168,
            dtype,
            device=device,
            one_shot_max_tokens=260,
            table=PathTable({}),
            rows_by_ticket=True,
        ),
        rank,
        world,
        device,
    )
    _check_many_calls(
        SymmAllReduceCapture(
            128,
            7168,
            dtype,
            device=device,
            one_shot_max_tokens=128,
            table=PathTable({}),
            rows_by_ticket=True,
        ),
        rank,
        world,
        device,
        100,
    )
    # torch.compile(fullgraph): the one-shot path is one custom op, no graph break.
    ar = SymmAllReduceCapture(
        32, 256, dtype, device=device, one_shot_max_tokens=32, table=PathTable({})
    )
    weight = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype).to(device)
    aux = torch.full((32, 3, 256), float("nan"), dtype=dtype, device=device)

    def layer_boundary(p, r):
        out = ar.reduce_add_rmsnorm(p, r, weight, eps, aux, 2, norm_fp32_sum=True)
        return out * 2

    compiled = torch.compile(layer_boundary, fullgraph=True)
    for T in (4, 9):
        residual = _rand(g, T, 256, device=device)
        partials = [_rand(g, T, 256, device=device) for _ in range(world)]
        normed_ref, res_ref = _reference(partials, residual, weight, eps, True)
        r = residual.clone()
        got = compiled(partials[rank].clone(), r)
        assert_bitwise_equal(r, res_ref)
        assert_bitwise_equal(aux[:T, 2], res_ref)
        torch.testing.assert_close(got.double(), 2 * normed_ref, rtol=2**-7, atol=1e-5)
    if world > 1:
        _check_watchdog(rank, world, device)


def _check_watchdog(rank, world, device):
    """The last rank skips one call: the others give up after the watchdog's
    bound instead of hanging, and every later call on them raises."""
    from eagle_capture.parallel.symm import SymmAllReduceCapture

    ar = SymmAllReduceCapture(
        8, 7168, torch.bfloat16, device=device, watchdog_s=0.3, one_shot_max_tokens=8
    )
    x = torch.randn(2, 7168, dtype=torch.bfloat16, device=device)
    w = torch.ones(7168, dtype=torch.bfloat16, device=device)
    ar.reduce_add_rmsnorm(x.clone(), x.clone(), w, 1e-6)  # everyone: fine
    torch.cuda.synchronize()
    assert not ar.watchdog_tripped()
    if rank != world - 1:
        t0 = time.monotonic()
        ar.reduce_add_rmsnorm(x.clone(), x.clone(), w, 1e-6)  # the peer never comes
        torch.cuda.synchronize()
        waited = time.monotonic() - t0
        assert ar.watchdog_tripped() and 0.25 < waited < 10, waited
        with pytest.raises(RuntimeError, match="gave up"):
            ar.reduce_add_rmsnorm(x.clone(), x.clone(), w, 1e-6)
    dist.barrier()


@requires_cuda
@pytest.mark.parametrize("world", [1, 2])
def test_allreduce_add_rmsnorm_capture(world, tmp_path):
    if torch.cuda.device_count() < world:
        # Measured on the H200 machine: torch's CUDA symmetric memory refuses two
        # ranks on one device ("detected allocations from overlapping devices").
        pytest.skip(f"needs {world} GPUs")
    run_ranks(_scenarios, world, tmp_path, TIMEOUT_S, "symmetric-memory test")


@pytest.mark.parametrize(
    "world, table, cap",
    [
        (2, None, 1024),  # the default rule
        (2, {"2": [[1, "one_shot"], [64, "one_shot"], [512, "nccl"]]}, 64),  # largest one_shot row
        (4, {"2": [[8, "one_shot"]]}, 256),  # another world: the rule
        (2, {"2": [[16, "nccl"], [32, "one_shot"], [64, "nccl"]]}, 32),
    ],
)
def test_path_choice_at_the_cap(world, table, cap):
    """The path per T at the one-shot cap, one below and one above it; the cap
    read from a measured table is its largest one-shot row (issue 21: boundaries
    as parameters). Pure Python: the instance's GPU set-up is skipped."""
    import eagle_capture.parallel.symm as symm

    ar = object.__new__(symm.SymmAllReduceCapture)
    ar.world_size = world
    ar.table = PathTable(table) if table is not None else None
    assert ar._one_shot_limit_from_rule() == cap
    ar.one_shot_max_tokens = cap
    assert ar.path_for(cap + 1) == "nccl"
    expect_at_cap = (
        ar.table.path(world, cap) if ar.table and world in ar.table.paths else "one_shot"
    )
    assert ar.path_for(cap) == expect_at_cap == "one_shot"
    if cap > 1:
        below = (
            ar.table.path(world, cap - 1) if ar.table and world in ar.table.paths else "one_shot"
        )
        assert ar.path_for(cap - 1) == below


def test_engine_fusion_rows_run_nccl_standalone():
    """A table's engine_fusion rows (the serving engine's own fusion, which a
    standalone SymmAllReduceCapture does not have) take NCCL + the fused op."""
    import eagle_capture.parallel.symm as symm

    ar = object.__new__(symm.SymmAllReduceCapture)
    ar.world_size = 2
    ar.table = PathTable({"2": [[4, "engine_fusion"], [64, "one_shot"], [128, "engine_fusion"]]})
    ar.one_shot_max_tokens = ar._one_shot_limit_from_rule()
    assert ar.one_shot_max_tokens == 64
    assert [ar.path_for(t) for t in (1, 4, 5, 64, 65, 128)] == [
        "nccl",
        "nccl",
        "one_shot",
        "one_shot",
        "nccl",
        "nccl",
    ]
