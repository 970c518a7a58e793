"""Special values, buffers past 2^31 elements, and graph/stream sharing.

Special values run on CPU (torch path) and through the kernel (GPU, or the
interpreter on CPU); the rest needs a GPU."""

import pytest
import torch

import eagle_capture as ec
from conftest import (
    HAS_CUDA,
    INTERPRETED,
    assert_bitwise_equal,
    requires_cuda,
    truncate_to_bf16,
)
from eagle_capture.testing.kernel import launch_kernel
from eagle_capture.testing.reference import add_rmsnorm_reference

KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def _special_rows(dtype, device):
    """Rows full of NaN, +-Inf, subnormals, signed zeros and huge values, in
    both operands, plus an all-zero row (RMSNorm of zero)."""
    info = torch.finfo(dtype)
    specials = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            info.tiny / 4,
            -info.tiny / 8,
            0.0,
            -0.0,
            info.max,
            -info.max,
            1.0,
            -2.5,
            info.tiny,
            3.0,
            -0.0,
            float("nan"),
            7.0,
        ],
        dtype=torch.float32,
    )
    h = specials.to(dtype).repeat(4, 1)
    r = specials.flip(0).to(dtype).repeat(4, 1)
    r[1] = specials[torch.randperm(16, generator=torch.Generator().manual_seed(0))].to(dtype)
    h[3] = 0.0
    r[3] = 0.0
    return h.to(device), r.to(device)


def _assert_same_values(actual, expected):
    """Equal, NaN where the reference is NaN (NaN payloads may differ), signed zeros equal."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), "NaN positions differ"
    assert torch.equal(actual[~nan], expected[~nan])
    assert torch.equal(torch.signbit(actual[~nan]), torch.signbit(expected[~nan]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("path", ["ops-cpu", "kernel"])
def test_special_values_propagate_like_eager(dtype, path):
    device = "cpu" if path == "ops-cpu" else KERNEL_DEVICE
    h, r = _special_rows(dtype, device)
    aux = torch.full((6, 2, 16), 5.0, dtype=dtype, device=device)
    if path == "ops-cpu":
        ec.add_capture(h, r, aux, 1)
    else:
        launch_kernel(h, r, aux=aux, slot=1)
    if path == "kernel" and INTERPRETED and dtype == torch.bfloat16:
        # The interpreter's bf16 emulation truncates its fp32 -> bf16 casts and
        # flushes bf16 subnormal inputs to (signed) zero; the GPU does neither.
        def ftz(x):
            x = x.float()
            return torch.where(x.abs() < torch.finfo(torch.bfloat16).tiny, x * 0, x)

        expected = truncate_to_bf16(ftz(h) + ftz(r))
    else:
        expected = h + r
    _assert_same_values(aux[:4, 1], expected)
    assert (aux[:4, 0] == 5).all() and (aux[4:] == 5).all()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_zero_and_non_finite_rows_through_rmsnorm(device):
    """A zero row normalises to zeros (rsqrt(0 + eps) is finite); a row holding
    Inf or NaN gives NaN everywhere, as the eager reference does."""
    dtype = torch.bfloat16
    h, r = _special_rows(dtype, device)
    w = torch.ones(16, dtype=dtype, device=device)
    normed_ref, s = add_rmsnorm_reference(h, r, w, 1e-6)
    ec.add_rmsnorm_capture(h, r, w, 1e-6)
    _assert_same_values(r, s)
    assert torch.equal(h[3], torch.zeros_like(h[3]))
    assert torch.equal(torch.isnan(h.double()), torch.isnan(normed_ref))


@requires_cuda
def test_buffer_past_2_31_elements():
    """rows * K * H = 100_000 * 3 * 7168 > 2^31: the last rows of the last slot
    are written where int32 offsets would wrap into another row."""
    T, K, H = 100_000, 3, 7168
    assert T * K * H > 2**31
    dtype, device = torch.bfloat16, "cuda"
    aux = torch.full((T, K, H), float("nan"), dtype=dtype, device=device)
    h = torch.randn(T, H, device=device, dtype=dtype)
    r = torch.randn(T, H, device=device, dtype=dtype)
    ec.add_capture(h, r, aux, K - 1)
    assert torch.equal(aux[:, K - 1], h + r)
    assert torch.isnan(aux[:, : K - 1]).all()
    w = torch.ones(H, device=device, dtype=dtype)
    expected = h + r
    ec.add_rmsnorm_into_slot(h, r, w, 1e-6, aux, 0)
    assert torch.equal(aux[-17:, 0], expected[-17:])
    assert torch.equal(aux[:, 0], expected)


@requires_cuda
def test_one_buffer_shared_by_graphs_of_several_batch_sizes():
    """SGLang's graph runner captures one graph per batch size over one shared aux
    buffer; replaying any of them, after new inputs are copied in, equals eager."""
    H, device, dtype = 7168, "cuda", torch.bfloat16
    sizes = [1, 8, 33, 160]
    buf = ec.AuxCaptureBuffer(max(sizes), H, [2, 30, 58], dtype=dtype, device=device)
    w = torch.ones(H, device=device, dtype=dtype)
    statics, graphs = {}, {}
    for T in sizes:
        h = torch.randn(T, H, device=device, dtype=dtype)
        r = torch.randn(T, H, device=device, dtype=dtype)
        statics[T] = (h, r)

        def step(h=h, r=r):
            buf.capture(2, h, r)
            buf.add_rmsnorm_capture(30, h, r, w, 1e-6)
            ec.add_rmsnorm_into_slot(h, r, w, 1e-6, buf.aux, buf.slot_of(58))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        graphs[T] = g
    for T in [33, 1, 160, 8, 33]:
        h_new = torch.randn(T, H, device=device, dtype=dtype)
        r_new = torch.randn(T, H, device=device, dtype=dtype)
        buf.aux.fill_(float("nan"))
        statics[T][0].copy_(h_new)
        statics[T][1].copy_(r_new)
        graphs[T].replay()
        s1 = h_new + r_new
        h_e, r_e = h_new.clone(), r_new.clone()
        ec.add_rmsnorm_capture(h_e, r_e, w, 1e-6)
        assert_bitwise_equal(buf.aux[:T, 0], s1)
        assert_bitwise_equal(buf.aux[:T, 1], s1)
        assert_bitwise_equal(buf.aux[:T, 2], h_e + r_e)
        assert torch.isnan(buf.aux[T:]).all()


@requires_cuda
def test_two_streams_capture_different_slots_of_one_buffer():
    H, device, dtype, T = 7168, "cuda", torch.bfloat16, 257
    aux = torch.full((T, 2, H), float("nan"), dtype=dtype, device=device)
    inputs = [
        (
            torch.randn(T, H, device=device, dtype=dtype),
            torch.randn(T, H, device=device, dtype=dtype),
        )
        for _ in range(2)
    ]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    start = torch.cuda.Event()
    start.record()
    for slot, (stream, (h, r)) in enumerate(zip(streams, inputs)):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            for _ in range(20):  # overlap the two streams' launches
                ec.add_capture(h, r, aux, slot)
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for slot, (h, r) in enumerate(inputs):
        assert_bitwise_equal(aux[:, slot], h + r)


@requires_cuda
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_dependent_chain_of_launches(mode):
    """Each launch reads what the launch just before it wrote: aux[:, k] =
    h + aux[:, k-1] (a residual read from the previous slot), then an add+RMSNorm chain in place. With programmatic
    dependent launch a missing or misplaced ``gdc_wait`` lets a kernel start
    while its predecessor runs and read stale (here NaN-poisoned) rows."""
    from eagle_capture import ops

    T, H, K, device, dtype = 4096, 7168, 12, "cuda", torch.bfloat16
    if torch.cuda.get_device_capability()[0] >= 9:
        assert ops.pdl_enabled(torch.cuda.current_device()) == ops.HAS_PDL
    h = torch.randn(T, H, device=device, dtype=dtype)
    r = torch.randn(T, H, device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(H, device=device)).to(dtype)
    aux = torch.full((T, K, H), float("nan"), device=device, dtype=dtype)
    hn, rn = h.clone(), r.clone()

    def chain():
        ec.add_capture(h, r, aux, 0)
        for k in range(1, K):
            ec.add_capture(h, aux[:T, k - 1], aux, k)
        for _ in range(6):
            ec.add_rmsnorm_capture(hn, rn, w, 1e-6)

    if mode == "eager":
        for _ in range(3):  # first call compiles, later ones take the direct launch
            aux.fill_(float("nan"))
            hn.copy_(h)
            rn.copy_(r)
            chain()
    else:
        chain()  # compile and memoise outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        aux.fill_(float("nan"))
        hn.copy_(h)
        rn.copy_(r)
        graph.replay()
    expected = h + r
    for k in range(K):
        assert_bitwise_equal(aux[:, k], expected)
        expected = h + expected
    # The norm chain against the same kernel one launch at a time, synchronised.
    he, re_ = h.clone(), r.clone()
    for _ in range(6):
        ec.add_rmsnorm_capture(he, re_, w, 1e-6)
        torch.cuda.synchronize()
    assert_bitwise_equal(rn, re_)
    assert_bitwise_equal(hn, he)
