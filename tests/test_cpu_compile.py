"""torch.compile on CPU tensors (issue 13), and the tensor-parallel hint of the
norm weight's width check.

A function holding a single add+RMSNorm op used to crash Inductor's C++
backend (``InductorError: KeyError: 'buf0'``, pytorch/pytorch#196570) when the
op's torch implementation was decomposed into the graph; the CPU path now runs
as an opaque custom op (eagle_capture/ops.py). Compiled results are compared
with eager: the captures and the residual bit-exactly, the normed output
within one ulp of its dtype.
"""

import re
import subprocess
import sys

import pytest
import torch

import eagle_capture as ec
from conftest import DTYPES, assert_bitwise_equal

EPS = 1e-6
T, H, ROWS, SLOTS, SLOT = 5, 64, 8, 3, 1


def _inputs(dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    width = 2 * H + 3 if strided else H
    h = torch.randn(T, width, generator=g).to(dtype)[:, :H]
    r = torch.randn(T, width, generator=g).to(dtype)[:, :H]
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    aux = torch.randn(ROWS, SLOTS, H, generator=g).to(dtype)
    out = torch.randn(T, H, generator=g).to(dtype)
    return [h, r, w, aux, out]


def _capture(h, r, w, aux, out):
    ec.add_rmsnorm_capture(h, r, w, EPS, aux, SLOT)
    return h * 2


def _capture_fp32_sum(h, r, w, aux, out):
    ec.add_rmsnorm_capture(h, r, w, EPS, aux, SLOT, norm_fp32_sum=True)
    return h * 2


def _capture_no_aux(h, r, w, aux, out):
    ec.add_rmsnorm_capture(h, r, w, EPS)
    return h * 2


def _into_slot(h, r, w, aux, out):
    ec.add_rmsnorm_into_slot(h, r, w, EPS, aux, SLOT)
    return h * 2


def _out(h, r, w, aux, out):
    ec.add_rmsnorm_out(h, r, w, EPS, out)
    return h * 2


def _into_slot_then_out(h, r, w, aux, out):
    """The zero-write capture followed by the next layer reading its residual
    from the slot."""
    ec.add_rmsnorm_into_slot(h, r, w, EPS, aux, SLOT)
    h = h * 0.5
    ec.add_rmsnorm_out(h, aux[:T, SLOT], w, EPS, out)
    return h


# The failing pattern: one op, then a use of the normed output.
FUNCTIONS = [_capture, _capture_fp32_sum, _capture_no_aux, _into_slot, _out, _into_slot_then_out]


def assert_within_one_ulp(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    # ulp(x) <= eps * |x| for normal x; the floor covers values near zero.
    tol = (
        torch.finfo(expected.dtype).eps * expected.double().abs() + torch.finfo(expected.dtype).tiny
    )
    err = (actual.double() - expected.double()).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item():.3e} exceeds one ulp"


# (function, dynamic): every function static; the two capture ops also dynamic.
CASES = [(fn, False) for fn in FUNCTIONS] + [(_capture, True), (_into_slot, True)]


@pytest.mark.parametrize(
    "fn,dynamic",
    CASES,
    ids=[f"{fn.__name__.strip('_')}-{'dynamic' if d else 'static'}" for fn, d in CASES],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_cpu_matches_eager(dtype, fn, dynamic):
    torch._dynamo.reset()
    # The dynamic-shape cases also take strided rows (views of wider tensors).
    eager_args = _inputs(dtype, strided=dynamic)
    compiled_args = _inputs(dtype, strided=dynamic)
    expected = fn(*eager_args)
    actual = torch.compile(fn, fullgraph=True, dynamic=dynamic)(*compiled_args)
    h_c, r_c, _, aux_c, out_c = compiled_args
    h_e, r_e, _, aux_e, out_e = eager_args
    assert_bitwise_equal(r_c, r_e)  # the new residual (or untouched)
    assert_bitwise_equal(aux_c, aux_e)  # the capture, and every other slot
    assert_bitwise_equal(out_c, out_e)  # add_rmsnorm_out's residual_out
    assert_within_one_ulp(h_c, h_e)  # the normed output
    assert_within_one_ulp(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_capture_is_h_plus_r(dtype):
    """The captured slot under torch.compile is torch's own h + r, bit for bit."""
    torch._dynamo.reset()
    h, r, w, aux, out = _inputs(dtype)
    s = h + r
    torch.compile(_capture, fullgraph=True)(h, r, w, aux, out)
    assert_bitwise_equal(aux[:T, SLOT], s)
    assert_bitwise_equal(r, s)


@pytest.mark.parametrize(
    "name", ["_add_rmsnorm_capture_cpu", "_add_rmsnorm_into_slot_cpu", "_add_rmsnorm_out_cpu"]
)
def test_cpu_ops_opcheck(name):
    h, r, w, aux, out = _inputs(torch.bfloat16)
    args = {
        "_add_rmsnorm_capture_cpu": (h, r, w, EPS, aux, SLOT, False),
        "_add_rmsnorm_into_slot_cpu": (h, r, w, EPS, aux, SLOT, True),
        "_add_rmsnorm_out_cpu": (h, r, w, EPS, out, True),
    }[name]
    torch.library.opcheck(getattr(torch.ops.eagle_capture, name).default, args)


# The upstream repro in a child interpreter: Inductor's failure there never reaches this
# process, so pytest never renders its deep traceback (parsing Inductor's large sources
# under CPython 3.11.7 once crashed the whole run with "AST constructor recursion depth
# mismatch", an INTERNALERROR that hid every later result).
UPSTREAM_REPRO = """
import torch

def f(x, out):
    y = x * 2
    out.copy_(y)
    x.copy_(y * y.sum(-1, keepdim=True))

torch.compile(f)(torch.randn(5, 64), torch.randn(5, 64))
"""


def test_upstream_repro_plain_torch():
    """The upstream bug (pytorch/pytorch#196570: Inductor C++ outer-loop fusion,
    KeyError 'bufN') without eagle_capture. When this passes, a torch with the fix
    is installed and the CPU ops could be decomposed again."""
    run = subprocess.run(
        [sys.executable, "-c", UPSTREAM_REPRO], capture_output=True, text=True, timeout=600
    )
    if run.returncode == 0:
        return
    upstream = re.search(r"InductorError: KeyError: 'buf\d+'", run.stderr)
    if upstream:
        pytest.xfail(f"pytorch/pytorch#196570 still in torch {torch.__version__}: {upstream[0]}")
    # Plain torch failing another way (this machine's compiler, another torch) says nothing
    # of eagle_capture's ops (the tests above compile them): named, not hidden.
    errors = re.findall(r"^\w[\w.]*(?:Error|Exception): .*$", run.stderr, re.MULTILINE)
    last = errors[-1] if errors else run.stderr.strip()[-300:]
    pytest.xfail(f"the repro fails otherwise in torch {torch.__version__}: {last[:300]}")


# ----------------------------------------------------------------------------
# Weight width: the tensor-parallel hint
# ----------------------------------------------------------------------------

FULL_H = 7168
TP_HINT = (
    r"weight must have shape \[{w}\] \(hidden_size\), got \({full},\); "
    r".*tensor-parallel shard"
)


def _norm_call(op, call, h, r, w):
    fn = getattr(ec, op) if call == "public" else getattr(torch.ops.eagle_capture, op)
    if op == "add_rmsnorm_out":
        fn(h, r, w, EPS, torch.empty_like(r))
    else:
        aux = torch.zeros(4, 2, h.shape[1], dtype=h.dtype)
        fn(h, r, w, EPS, aux, 0)


@pytest.mark.parametrize("call", ["public", "op"])
@pytest.mark.parametrize("op", ["add_rmsnorm_capture", "add_rmsnorm_into_slot", "add_rmsnorm_out"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_full_weight_with_tp_shard_gets_tp_hint(tp, op, call):
    width = FULL_H // tp
    h = torch.randn(2, width, dtype=torch.bfloat16)
    r = torch.randn(2, width, dtype=torch.bfloat16)
    w = torch.ones(FULL_H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=TP_HINT.format(w=width, full=FULL_H)) as exc:
        _norm_call(op, call, h, r, w)
    assert f"{tp} x {width}" in str(exc.value)


@pytest.mark.parametrize("weight_len", [H + 1, H // 2, 3 * H // 2])
def test_other_weight_widths_get_no_tp_hint(weight_len):
    h, r, _, _, _ = _inputs(torch.bfloat16)
    w = torch.ones(weight_len, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"weight must have shape \[{H}\]") as exc:
        _norm_call("add_rmsnorm_capture", "public", h, r, w)
    assert "tensor-parallel" not in str(exc.value)


def test_tp_hint_at_trace_time():
    """Under torch.compile the checks run while tracing: the same hint."""
    torch._dynamo.reset()
    width = FULL_H // 8
    h = torch.randn(2, width, dtype=torch.bfloat16)
    r = torch.randn(2, width, dtype=torch.bfloat16)
    w = torch.ones(FULL_H, dtype=torch.bfloat16)
    aux = torch.zeros(4, 2, width, dtype=torch.bfloat16)

    def f(h, r, w, aux):
        ec.add_rmsnorm_capture(h, r, w, EPS, aux, 0)
        return h

    with pytest.raises(Exception, match="tensor-parallel shard"):
        torch.compile(f, fullgraph=True)(h, r, w, aux)
