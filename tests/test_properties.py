"""Property-based tests (hypothesis): every op against its reference on random
shapes, strides, dtypes, slots and aux presence; and the bad-input contract --
any invalid combination raises before the buffer is touched.

Runs on CPU (the ops' torch implementation) everywhere, and on the GPU's Triton
kernel where there is one."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eagle_capture as ec
from conftest import HAS_CUDA, NORM_TOLERANCES, assert_bitwise_equal, assert_untouched
from eagle_capture.testing.reference import add_rmsnorm_reference

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    num_tokens = draw(st.integers(0, 40))
    hidden_size = draw(st.integers(1, 300))
    return dict(
        num_tokens=num_tokens,
        hidden_size=hidden_size,
        extra_rows=draw(st.integers(0, 3)),
        num_slots=draw(st.integers(1, 4)),
        slot_seed=draw(st.integers(0, 3)),
        dtype=draw(st.sampled_from(DTYPES)),
        pad_h=draw(st.integers(0, 9)),
        pad_r=draw(st.integers(0, 9)),
        offset_h=draw(st.integers(0, 3)),
        op=draw(
            st.sampled_from(
                [
                    "add_capture",
                    "add_capture_no_residual",
                    "add_rmsnorm_capture",
                    "add_rmsnorm_no_aux",
                    "add_rmsnorm_into_slot",
                    "add_rmsnorm_out",
                ]
            )
        ),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _rows(num_tokens, hidden_size, pad, offset, dtype, device, g):
    base = torch.randn(num_tokens, hidden_size + pad + offset, generator=g)
    return base.to(dtype=dtype, device=device)[:, offset : offset + hidden_size]


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(case=cases())
def test_ops_match_reference(device, case):
    g = torch.Generator().manual_seed(case["seed"])
    T, H, dtype = case["num_tokens"], case["hidden_size"], case["dtype"]
    h = _rows(T, H, case["pad_h"], case["offset_h"], dtype, device, g)
    r = _rows(T, H, case["pad_r"], 0, dtype, device, g)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype=dtype, device=device)
    K = case["num_slots"]
    slot = case["slot_seed"] % K
    aux = torch.full((T + case["extra_rows"], K, H), float("nan"), dtype=dtype, device=device)
    h0, r0 = h.clone(), r.clone()
    s = h0 + r0
    op = case["op"]
    if op == "add_capture":
        ec.add_capture(h, r, aux, slot)
        assert_bitwise_equal(aux[:T, slot], s)
    elif op == "add_capture_no_residual":
        ec.add_capture(h, None, aux, slot)
        assert_bitwise_equal(aux[:T, slot], h0)
    else:
        normed_ref = add_rmsnorm_reference(h0, r0, w, 1e-6)[0]
        if op == "add_rmsnorm_capture":
            ec.add_rmsnorm_capture(h, r, w, 1e-6, aux, slot)
            assert_bitwise_equal(r, s)
            assert_bitwise_equal(aux[:T, slot], s)
        elif op == "add_rmsnorm_no_aux":
            ec.add_rmsnorm_capture(h, r, w, 1e-6)
            assert_bitwise_equal(r, s)
        elif op == "add_rmsnorm_into_slot":
            ec.add_rmsnorm_into_slot(h, r, w, 1e-6, aux, slot)
            assert_bitwise_equal(r, r0)
            assert_bitwise_equal(aux[:T, slot], s)
        else:
            out = torch.full_like(r0, float("nan"))
            ec.add_rmsnorm_out(h, r, w, 1e-6, out)
            assert_bitwise_equal(out, s)
            assert_bitwise_equal(r, r0)
        torch.testing.assert_close(h.double(), normed_ref, **NORM_TOLERANCES[dtype])
    if op in ("add_rmsnorm_no_aux", "add_rmsnorm_out"):
        assert torch.isnan(aux).all()
    else:
        assert_untouched(aux, T, slot)


# Each fault and what its message must say (the argument and what was expected).
INVALID = {
    "slot_high": r"slot \d+ is out of range for aux with \d+ capture slots",
    "slot_negative": r"slot -\d+ is out of range for aux",
    "width": r"hidden_states has width \d+ but aux slots are|weight must have shape",
    "residual_dtype": r"residual dtype .* does not match hidden_states dtype",
    "aux_dtype": r"aux dtype .* does not match hidden_states dtype",
    "residual_rows": r"residual shape \(\d+, \d+\) does not match hidden_states shape",
    "too_many_tokens": r"hidden_states has \d+ tokens but aux has only \d+ rows",
    "strided_columns": r"hidden_states must have a contiguous last dimension",
    "weight_length": r"weight must have shape \[\d+\] \(hidden_size\)",
    "three_d": r"hidden_states must be 2-D",
    "eps_negative": r"eps must be a non-negative float",
}


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(case=cases(), fault=st.sampled_from(sorted(INVALID)))
def test_invalid_input_raises_before_touching_the_buffer(device, case, fault):
    g = torch.Generator().manual_seed(case["seed"])
    T, H, dtype = max(case["num_tokens"], 1), max(case["hidden_size"], 2), case["dtype"]
    K = case["num_slots"]
    slot = case["slot_seed"] % K
    rows = T + case["extra_rows"]
    h = _rows(T, H, case["pad_h"], 0, dtype, device, g)
    r = _rows(T, H, case["pad_r"], 0, dtype, device, g)
    w = torch.ones(H, dtype=dtype, device=device)
    aux = torch.randn(rows, K, H, generator=g).to(dtype=dtype, device=device)
    eps = 1e-6
    other = torch.float32 if dtype != torch.float32 else torch.float16
    if fault == "slot_high":
        slot = K + case["slot_seed"]
    elif fault == "slot_negative":
        slot = -1 - case["slot_seed"]
    elif fault == "width":
        h, r = h[:, : H - 1], r[:, : H - 1]
    elif fault == "residual_dtype":
        r = r.to(other)
    elif fault == "aux_dtype":
        aux = aux.to(other)
    elif fault == "residual_rows":
        r = torch.cat([r, r[:1]])
    elif fault == "too_many_tokens":
        extra = rows + 1 - T
        h = torch.cat([h, h[:1].expand(extra, H)])
        r = torch.cat([r, r[:1].expand(extra, H)])
    elif fault == "strided_columns":
        h = torch.randn(T, 2 * H, generator=g).to(dtype=dtype, device=device)[:, ::2]
    elif fault == "weight_length":
        w = torch.ones(H + 1, dtype=dtype, device=device)
    elif fault == "three_d":
        h = h.unsqueeze(0)
    elif fault == "eps_negative":
        eps = -1e-6
    before = aux.clone()
    use_norm = fault in ("weight_length", "eps_negative") or case["seed"] % 2
    with pytest.raises(ValueError, match=INVALID[fault]):
        if use_norm:
            ec.add_rmsnorm_capture(h, r, w, eps, aux, slot)
        else:
            ec.add_capture(h, r, aux, slot)
    assert_bitwise_equal(aux, before)
