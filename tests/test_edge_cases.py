"""Edge cases a review found: a slot-major aux buffer, tensors that require grad
on the eager fast path, and the dispatcher path with tensors on a non-current GPU."""

import pytest
import torch

import eagle_capture as ec
from conftest import HAS_CUDA, make_rows

EPS = 1e-6


def _slot_major_aux(rows, slots, hidden):
    return torch.zeros(slots, rows, hidden).permute(1, 0, 2)  # strides (H, rows*H, 1)


@pytest.mark.parametrize("call", ["public", "op"])
def test_slot_major_aux_is_refused_before_it_corrupts_a_residual(call):
    """A slot-major aux used to pass, and then a residual read from slot 2 was taken
    for another slot and overwritten by an op that declares residual unmutated."""
    aux = _slot_major_aux(8, 3, 16)
    h = make_rows(4, 16, torch.float32, "cpu")
    residual = aux[:4, 2]
    residual.copy_(make_rows(4, 16, torch.float32, "cpu"))
    before = aux.clone()
    w = torch.ones(16)
    fn = (
        ec.add_rmsnorm_into_slot
        if call == "public"
        else torch.ops.eagle_capture.add_rmsnorm_into_slot
    )
    with pytest.raises(ValueError, match="rows outermost.*permute"):
        fn(h, residual, w, EPS, aux, 2)
    assert torch.equal(aux, before)
    with pytest.raises(ValueError, match="rows outermost"):
        ec.add_capture(h, None, aux, 0)


def test_row_major_aux_views_still_pass():
    """Rows outermost with padding between rows and slots is fine."""
    base = torch.zeros(8, 3, 20)
    aux = base[:, :, :16]  # strides (60, 20, 1)
    h = make_rows(4, 16, torch.float32, "cpu")
    ec.add_capture(h, None, aux, 1)
    assert torch.equal(aux[:4, 1], h)


@pytest.mark.parametrize("op", ["add_capture", "add_rmsnorm_capture"])
def test_requires_grad_in_grad_mode_is_refused(op):
    h = make_rows(3, 16, torch.float32, "cpu").requires_grad_()
    r = make_rows(3, 16, torch.float32, "cpu")
    aux = torch.zeros(4, 2, 16)
    w = torch.ones(16)
    args = (h, r, aux, 1) if op == "add_capture" else (h, r, w, EPS, aux, 1)
    with pytest.raises(RuntimeError, match=f"{op} got a tensor that requires grad.*no_grad"):
        getattr(ec, op)(*args)
    assert not aux.any()


def test_parameters_that_require_grad_are_fine_under_no_grad():
    """Serving runs under no_grad / inference_mode with nn.Parameter weights."""
    norm = torch.nn.Parameter(1 + 0.1 * torch.randn(16))
    h, r = make_rows(3, 16, torch.float32, "cpu"), make_rows(3, 16, torch.float32, "cpu")
    aux = torch.zeros(4, 2, 16)
    expected = h + r
    with torch.no_grad():
        ec.add_rmsnorm_capture(h, r, norm, EPS, aux, 1)
    assert torch.equal(aux[:3, 1], expected)
    with torch.inference_mode():
        h2, r2 = make_rows(3, 16, torch.float32, "cpu"), make_rows(3, 16, torch.float32, "cpu")
        ec.add_rmsnorm_capture(h2, r2, norm, EPS, aux, 0)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("op_name", ["add_capture", "add_rmsnorm_capture"])
def test_dispatcher_path_on_a_non_current_gpu(op_name):
    """torch.ops.eagle_capture.* with cuda:1 tensors while cuda:0 is current: the
    kernel runs on cuda:1 (a device guard), with the right result."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    h, r = make_rows(5, 1000, torch.bfloat16, dev), make_rows(5, 1000, torch.bfloat16, dev)
    aux = torch.full((8, 3, 1000), float("nan"), dtype=torch.bfloat16, device=dev)
    expected = h + r
    op = getattr(torch.ops.eagle_capture, op_name)
    if op_name == "add_capture":
        op(h, r, aux, 2)
    else:
        op(h, r, torch.ones(1000, dtype=torch.bfloat16, device=dev), EPS, aux, 2)
    torch.cuda.synchronize(dev)
    assert torch.equal(aux[:5, 2], expected)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("where", ["aux slot", "residual"])
def test_parameter_weight_inside_a_written_tensor_is_refused(where):
    """A norm's weight is an nn.Parameter: the aliasing checks must read its
    address (they skipped every tensor subclass, Parameter included)."""
    aux = torch.zeros(4, 3, 64)
    residual = make_rows(4, 64, torch.float32, "cpu")
    inside = aux[0, 1] if where == "aux slot" else residual[1]
    weight = torch.nn.Parameter(inside, requires_grad=False)
    h = make_rows(4, 64, torch.float32, "cpu")
    before = aux.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="weight shares memory with"):
        ec.add_rmsnorm_capture(h, residual, weight, EPS, aux, 0)
    assert torch.equal(aux, before)
