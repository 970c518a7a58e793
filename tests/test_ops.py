"""The ops against the eager references, through both call paths.

On CPU the ops run their torch implementation; on a GPU the Triton kernel.
``call`` picks the public function (eager fast path: direct launch) or the
registered ``torch.ops.eagle_capture`` op (what torch.compile sees).
"""

import pytest
import torch

import eagle_capture as ec
from conftest import (DTYPES, HAS_CUDA, NORM_TOLERANCES, assert_bitwise_equal,
                      assert_untouched, make_rows, poisoned_aux)

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
TOKENS = [0, 1, 3, 257]
HIDDEN = [1, 7, 1000, 7168]
EPS = 1e-6


def _call(call: str, name: str, *args):
    fn = getattr(ec, name) if call == "public" else getattr(torch.ops.eagle_capture, name)
    return fn(*args)


@pytest.fixture(params=["public", "op"])
def call(request):
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_capture(call, device, dtype, hidden_size, num_tokens, strided, with_residual):
    h = make_rows(num_tokens, hidden_size, dtype, device, strided=strided)
    r = make_rows(num_tokens, hidden_size, dtype, device, strided=strided) if with_residual else None
    h0, r0 = h.clone(), (r.clone() if r is not None else None)
    slots, slot = 3, 1
    aux = poisoned_aux(num_tokens + 5, slots, hidden_size, dtype, device)

    _call(call, "add_capture", h, r, aux, slot)

    expected = h0 + r0 if with_residual else h0
    assert_bitwise_equal(aux[:num_tokens, slot], expected)  # SGLang's eager h + r, to the bit
    assert_untouched(aux, num_tokens, slot)
    assert_bitwise_equal(h, h0)
    if r is not None:
        assert_bitwise_equal(r, r0)


def _norm_case(device, dtype, hidden_size, num_tokens, strided):
    h = make_rows(num_tokens, hidden_size, dtype, device, strided=strided)
    r = make_rows(num_tokens, hidden_size, dtype, device, strided=strided)
    w = (1.0 + 0.1 * torch.randn(hidden_size)).to(dtype=dtype, device=device)
    normed_ref, residual_ref = ec.add_rmsnorm_reference(h, r, w, EPS)
    return h, r, w, normed_ref, residual_ref


def _assert_normed(actual, normed_ref):
    torch.testing.assert_close(actual.double(), normed_ref, **NORM_TOLERANCES[actual.dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("capture", [True, False])
def test_add_rmsnorm_capture(call, device, dtype, hidden_size, num_tokens, strided, capture):
    h, r, w, normed_ref, residual_ref = _norm_case(device, dtype, hidden_size, num_tokens, strided)
    slot = 2
    aux = poisoned_aux(num_tokens + 2, 3, hidden_size, dtype, device) if capture else None

    _call(call, "add_rmsnorm_capture", h, r, w, EPS, aux, slot)

    assert_bitwise_equal(r, residual_ref)            # residual <- h + r, in place
    _assert_normed(h, normed_ref)                    # hidden <- rmsnorm(residual) * w
    if capture:
        assert_bitwise_equal(aux[:num_tokens, slot], residual_ref)
        assert_untouched(aux, num_tokens, slot)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("strided", [False, True])
def test_add_rmsnorm_into_slot(call, device, dtype, hidden_size, num_tokens, strided):
    h, r, w, normed_ref, residual_ref = _norm_case(device, dtype, hidden_size, num_tokens, strided)
    r0 = r.clone()
    aux = poisoned_aux(num_tokens + 1, 2, hidden_size, dtype, device)

    base_h0 = h._base.clone() if strided else None

    _call(call, "add_rmsnorm_into_slot", h, r, w, EPS, aux, 0)

    if strided:  # the columns around a strided row view are not touched
        assert_bitwise_equal(h._base[:, 0], base_h0[:, 0])
        assert_bitwise_equal(h._base[:, hidden_size + 1:], base_h0[:, hidden_size + 1:])
    assert_bitwise_equal(aux[:num_tokens, 0], residual_ref)
    assert_untouched(aux, num_tokens, 0)
    assert_bitwise_equal(r, r0)                      # the residual input is left alone
    _assert_normed(h, normed_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [7, 1000])
@pytest.mark.parametrize("num_tokens", [0, 3, 257])
def test_add_rmsnorm_out(call, device, dtype, hidden_size, num_tokens):
    h, r, w, normed_ref, residual_ref = _norm_case(device, dtype, hidden_size, num_tokens, True)
    r0 = r.clone()
    residual_out = torch.full_like(r0, float("nan"))

    _call(call, "add_rmsnorm_out", h, r, w, EPS, residual_out)

    assert_bitwise_equal(residual_out, residual_ref)
    assert_bitwise_equal(r, r0)
    _assert_normed(h, normed_ref)


def _sglang_layer_inputs(num_layers, num_tokens, hidden_size, dtype, device):
    torch.manual_seed(0)
    embed = make_rows(num_tokens, hidden_size, dtype, device)
    # Stand-ins for each layer's attention+MLP output (what the next layer adds).
    deltas = [make_rows(num_tokens, hidden_size, dtype, device) for _ in range(num_layers)]
    weights = [(1 + 0.1 * torch.randn(hidden_size)).to(dtype=dtype, device=device)
               for _ in range(num_layers)]
    return embed, deltas, weights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_loop_into_slot_matches_in_place_capture(device, dtype):
    """Two fused forms of a layer loop store what SGLang's eager loop captures
    (``hidden_states + residual`` at the start of each captured layer), to the bit:
    the in-place add+RMSNorm with a capture store, and the zero-extra-write form
    (residual -> slot; the following layer reads it from the slot and writes the
    next residual out of place)."""
    num_layers, num_tokens, hidden_size, capture_ids = 6, 9, 64, (1, 2, 4)
    embed, deltas, weights = _sglang_layer_inputs(num_layers, num_tokens, hidden_size,
                                                  dtype, device)

    eager_captures = []

    def run(into_slot: bool) -> torch.Tensor:
        buf = ec.AuxCaptureBuffer(16, hidden_size, capture_ids, dtype=dtype, device=device)
        buf.aux.fill_(float("nan"))
        hidden = embed.clone()
        residual = embed.clone()
        ec.add_rmsnorm_out(hidden, torch.zeros_like(hidden), weights[0], EPS, residual)
        hidden += deltas[0]
        residual_in_slot = False
        for i in range(1, num_layers):
            if into_slot and buf.captures_layer(i):
                src = buf.slot_view(i - 1, num_tokens) if residual_in_slot else residual
                ec.add_rmsnorm_into_slot(hidden, src, weights[i], EPS, buf.aux, buf.slot_of(i))
                residual_in_slot = True
            elif residual_in_slot:
                ec.add_rmsnorm_out(hidden, buf.slot_view(i - 1, num_tokens), weights[i], EPS,
                                   residual)
                residual_in_slot = False
            elif buf.captures_layer(i):
                eager_captures.append(hidden + residual)  # SGLang's aux.append(h + r)
                buf.add_rmsnorm_capture(i, hidden, residual, weights[i], EPS)
            else:
                ec.add_rmsnorm_capture(hidden, residual, weights[i], EPS)
            hidden += deltas[i]
        return buf.result(num_tokens).clone()

    in_place, zero_write = run(False), run(True)
    assert_bitwise_equal(in_place, torch.cat(eager_captures, -1))
    assert_bitwise_equal(zero_write, in_place)


def test_in_place_update_of_a_slot_is_refused():
    aux = poisoned_aux(4, 2, 8, torch.float32, "cpu")
    h = torch.randn(3, 8)
    with pytest.raises(ValueError, match="view of the aux buffer"):
        ec.add_rmsnorm_capture(h, aux[:3, 0], torch.ones(8), EPS, aux, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_buffer_result_is_a_view_in_ascending_layer_order(device):
    hidden_size, num_tokens = 16, 5
    buf = ec.AuxCaptureBuffer(8, hidden_size, [30, 2, 58], dtype=torch.bfloat16, device=device)
    assert buf.layer_ids == (2, 30, 58) and buf.slot_of(30) == 1
    captures = []
    for layer in (2, 30, 58):  # loop order
        h = make_rows(num_tokens, hidden_size, torch.bfloat16, device)
        r = make_rows(num_tokens, hidden_size, torch.bfloat16, device)
        buf.capture(layer, h, r)
        captures.append((h, r))
    out = buf.result(num_tokens)
    assert out.shape == (num_tokens, 3 * hidden_size)
    assert out.data_ptr() == buf.aux.data_ptr()      # no copy
    assert_bitwise_equal(out, ec.sglang_eager_capture(captures))
    with pytest.raises(ValueError, match="do not fit"):
        buf.result(9)
    with pytest.raises(KeyError, match="layer 3 is not captured"):
        buf.slot_of(3)


@pytest.mark.parametrize("ids, match", [
    ([], "at least one"), ([2, 2], "duplicates"), ([-1, 2, 30], "negative"),
])
def test_buffer_rejects_bad_layer_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        ec.AuxCaptureBuffer(4, 8, ids)


def test_import_does_not_initialise_cuda():
    import subprocess
    import sys
    code = ("import torch, eagle_capture; "
            "assert not torch.cuda.is_initialized(), 'import initialised CUDA'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
def test_weight_in_another_dtype(call, device, weight_dtype):
    """An fp32 (or fp16) norm weight with bf16 activations: the weight is read in
    its own dtype and the math stays fp32."""
    h, r, _, _, residual_ref = _norm_case(device, torch.bfloat16, 1000, 9, True)
    w = (1 + 0.1 * torch.randn(1000)).to(dtype=weight_dtype, device=device)
    normed_ref = ec.add_rmsnorm_reference(h, r, w, EPS)[0]
    aux = poisoned_aux(9, 2, 1000, torch.bfloat16, device)
    _call(call, "add_rmsnorm_capture", h, r, w, EPS, aux, 1)
    assert_bitwise_equal(r, residual_ref)
    assert_bitwise_equal(aux[:, 1], residual_ref)
    _assert_normed(h, normed_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_fp32_sum", [False, True])
def test_add_rmsnorm_capture_norm_input(call, device, dtype, norm_fp32_sum):
    """``norm_fp32_sum`` reaches the kernel / CPU body through both call paths:
    the normed output agrees exactly with the matching float64 reference (rounded
    once) on nearly every element and visibly less with the other one; the
    residual and the capture are the rounded sum either way."""
    gen = torch.Generator().manual_seed(11)
    h = (3 * torch.randn(16, 1000, generator=gen)).to(dtype).to(device)
    r = torch.randn(16, 1000, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(1000, generator=gen)).to(dtype).to(device)
    refs = {flag: ec.add_rmsnorm_reference(h, r, w, EPS, norm_fp32_sum=flag)[0].to(dtype)
            for flag in (False, True)}
    residual_ref = h + r
    aux = poisoned_aux(17, 2, 1000, dtype, device)
    if call == "public":
        ec.add_rmsnorm_capture(h, r, w, EPS, aux, 1, norm_fp32_sum=norm_fp32_sum)
    else:
        torch.ops.eagle_capture.add_rmsnorm_capture(h, r, w, EPS, aux, 1, norm_fp32_sum)
    assert_bitwise_equal(r, residual_ref)
    assert_bitwise_equal(aux[:16, 1], residual_ref)
    assert_untouched(aux, 16, 1)
    assert (h == refs[norm_fp32_sum]).double().mean().item() >= 0.99
    assert (h == refs[not norm_fp32_sum]).double().mean().item() < 0.95
