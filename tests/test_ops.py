"""The ops against the eager references, through both call paths, on each device:

* ``cpu``: CPU tensors, the ops' torch implementation (what CPU tensors run);
* ``cpu-kernel``: CPU tensors through the Triton kernel under Triton's
  interpreter (``eagle_capture.testing.kernel.kernel_on_cpu()``; TRITON_INTERPRET=1 is set
  by conftest.py without a GPU), by the launch code CUDA tensors take -- the
  registered ops' ``wrap_triton`` launch, the eager path's plan memo and its pointer
  template -- so CPU CI tests the op layer's kernel launch too. Small
  shapes (the interpreter takes ~5 ms per program). Its fp32 -> bf16 cast
  truncates instead of rounding (docs/engine_facts.md section 4): bf16 sums are
  expected truncated, still bit for bit, and the normed bf16 output gets one
  ulp more of tolerance;
* ``cuda``: the compiled kernel, on a GPU machine.

``call`` picks the public function (eager fast path: direct launch) or the
registered ``torch.ops.eagle_capture`` op (what torch.compile sees).

The data is chosen so that launch bugs show: every slot of a 3-slot aux buffer
(poisoned with NaN elsewhere, with spare rows past T, so that a write one slot or
row too far lands in the poison rather than outside the buffer), non-unit
weights, zero rows, residual rows with another row stride than hidden_states (a
swapped pointer or stride reads the wrong rows), and every other row tiny
(|x| ~ 1e-3), where eps = 1e-6 is a third of mean(s^2): an eps dropped or
misplaced changes the normed output by ~20%.
"""

import contextlib

import pytest
import torch

import eagle_capture as ec
from conftest import (
    DTYPES,
    HAS_CUDA,
    INTERPRETED,
    INTERPRETER_NORM_TOLERANCES,
    NORM_TOLERANCES,
    assert_bitwise_equal,
    assert_untouched,
    make_rows,
    poisoned_aux,
    truncate_to_bf16,
)
from eagle_capture import ops
from eagle_capture.ops import table
from eagle_capture.testing.kernel import kernel_on_cpu
from eagle_capture.testing.reference import add_rmsnorm_reference, sglang_eager_capture

DEVICES = ["cpu"] + (["cpu-kernel"] if INTERPRETED else []) + (["cuda"] if HAS_CUDA else [])
TOKENS = [0, 1, 3, 257]
HIDDEN = [1, 7, 1000, 7168]
SHAPES = [(t, h) for t in TOKENS for h in HIDDEN]
# The interpreter's shapes: zero rows, H = 1, a masked tail (7, 1000), and rows of
# several column blocks in the norm-free launch (7168 > COPY_BLOCK_H).
KERNEL_SHAPES = [(0, 7), (1, 1), (3, 7), (3, 1000), (2, 7168)]
SLOTS = (0, 1, 2)
EPS = 1e-6
R_PAD = 5  # residual rows: stride 2H + 5, hidden_states rows 2H + 3 (when strided)


def _cases(slots, shapes=SHAPES, kernel_shapes=KERNEL_SHAPES):
    """(device, num_tokens, hidden_size, slot) for every device. The kernel
    devices get every shape at every slot; the torch path (where the slot is
    plain indexing) every shape once per slot kind -- no aux (None) when listed,
    and one of the slots, spread over the shapes."""
    cases = []
    for device in DEVICES:
        if device == "cpu":
            real = [s for s in slots if s is not None]
            if None in slots:
                cases += [(device, t, h, None) for t, h in shapes]
            if real:
                cases += [
                    (device, t, h, real[(i + i // len(real)) % len(real)])
                    for i, (t, h) in enumerate(shapes)
                ]
        else:
            cases += [
                (device, t, h, s)
                for t, h in (kernel_shapes if device == "cpu-kernel" else shapes)
                for s in slots
            ]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}x{c[2]}-slot{c[3]}") for c in cases]


def _tensor_device(device: str) -> str:
    return "cpu" if device == "cpu-kernel" else device


def _mode(device: str):
    """CPU tensors run the kernel inside kernel_on_cpu() ("cpu-kernel")."""
    return kernel_on_cpu() if device == "cpu-kernel" else contextlib.nullcontext()


def _call(call: str, device: str, name: str, *args):
    fn = getattr(ec, name) if call == "public" else getattr(torch.ops.eagle_capture, name)
    with _mode(device):
        return fn(*args)


def _sum(device: str, h: torch.Tensor, r) -> torch.Tensor:
    """What the op stores for ``h + r``: torch's same-dtype add (the kernel's fp32
    add, rounded once), or for bf16 under the interpreter the truncated fp32 sum."""
    if r is None:
        return h.clone()
    if device == "cpu-kernel" and h.dtype == torch.bfloat16:
        return truncate_to_bf16(h.float() + r.float())
    return h + r


def _tolerance(device: str, dtype):
    return (INTERPRETER_NORM_TOLERANCES if device == "cpu-kernel" else NORM_TOLERANCES)[dtype]


def _rows(num_tokens, hidden_size, dtype, device, strided, pad=3):
    """Random rows, every other one (from row 0) scaled to ~1e-3, where eps matters."""
    x = make_rows(num_tokens, hidden_size, torch.float32, "cpu", strided=strided, pad=pad)
    x[0::2] *= 1e-3
    if strided:  # keep the row stride: scale and cast the underlying buffer
        base = x._base.to(dtype=dtype, device=_tensor_device(device))
        return base[:, 1 : hidden_size + 1]
    return x.to(dtype=dtype, device=_tensor_device(device))


@pytest.fixture(params=["public", "op"])
def call(request):
    return request.param


@pytest.mark.parametrize("device,num_tokens,hidden_size,slot", _cases(SLOTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_capture(call, device, dtype, hidden_size, num_tokens, slot, strided, with_residual):
    h = _rows(num_tokens, hidden_size, dtype, device, strided)
    r = _rows(num_tokens, hidden_size, dtype, device, strided, R_PAD) if with_residual else None
    h0, r0 = h.clone(), (r.clone() if r is not None else None)
    aux = poisoned_aux(num_tokens + 2, 3, hidden_size, dtype, _tensor_device(device))

    _call(call, device, "add_capture", h, r, aux, slot)

    assert_bitwise_equal(aux[:num_tokens, slot], _sum(device, h0, r0))  # SGLang's h + r, to the bit
    assert_untouched(aux, num_tokens, slot)
    assert_bitwise_equal(h, h0)
    if r is not None:
        assert_bitwise_equal(r, r0)


def _norm_case(device, dtype, hidden_size, num_tokens, strided):
    """h, r, w, the normed reference (float64) and the new residual."""
    h = _rows(num_tokens, hidden_size, dtype, device, strided)
    r = _rows(num_tokens, hidden_size, dtype, device, strided, R_PAD)
    w = (1.0 + 0.1 * torch.randn(hidden_size)).to(dtype=dtype, device=_tensor_device(device))
    residual_ref = _sum(device, h, r)
    # The norm of the value actually stored (bit-equal to residual_ref).
    normed_ref = add_rmsnorm_reference(residual_ref, torch.zeros_like(residual_ref), w, EPS)[0]
    return h, r, w, normed_ref, residual_ref


def _assert_normed(device, actual, normed_ref):
    torch.testing.assert_close(actual.double(), normed_ref, **_tolerance(device, actual.dtype))


@pytest.mark.parametrize("device,num_tokens,hidden_size,slot", _cases((None,) + SLOTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_add_rmsnorm_capture(call, device, dtype, hidden_size, num_tokens, slot, strided):
    """slot None: no aux (the plain fused_add_rmsnorm)."""
    h, r, w, normed_ref, residual_ref = _norm_case(device, dtype, hidden_size, num_tokens, strided)
    aux = (
        poisoned_aux(num_tokens + 2, 3, hidden_size, dtype, _tensor_device(device))
        if slot is not None
        else None
    )

    _call(call, device, "add_rmsnorm_capture", h, r, w, EPS, aux, slot or 0)

    assert_bitwise_equal(r, residual_ref)  # residual <- h + r, in place
    _assert_normed(device, h, normed_ref)  # hidden <- rmsnorm(residual) * w
    if aux is not None:
        assert_bitwise_equal(aux[:num_tokens, slot], residual_ref)
        assert_untouched(aux, num_tokens, slot)


@pytest.mark.parametrize("device,num_tokens,hidden_size,slot", _cases(SLOTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_add_rmsnorm_into_slot(call, device, dtype, hidden_size, num_tokens, slot, strided):
    h, r, w, normed_ref, residual_ref = _norm_case(device, dtype, hidden_size, num_tokens, strided)
    r0 = r.clone()
    aux = poisoned_aux(num_tokens + 1, 3, hidden_size, dtype, _tensor_device(device))

    base_h0 = h._base.clone() if strided else None

    _call(call, device, "add_rmsnorm_into_slot", h, r, w, EPS, aux, slot)

    if strided:  # the columns around a strided row view are not touched
        assert_bitwise_equal(h._base[:, 0], base_h0[:, 0])
        assert_bitwise_equal(h._base[:, hidden_size + 1 :], base_h0[:, hidden_size + 1 :])
    assert_bitwise_equal(aux[:num_tokens, slot], residual_ref)
    assert_untouched(aux, num_tokens, slot)
    assert_bitwise_equal(r, r0)  # the residual input is left alone
    _assert_normed(device, h, normed_ref)


@pytest.mark.parametrize(
    "device,num_tokens,hidden_size,slot",
    _cases((None,), shapes=[(t, h) for t in (0, 3, 257) for h in (7, 1000)]),
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_out(call, device, dtype, hidden_size, num_tokens, slot):
    h, r, w, normed_ref, residual_ref = _norm_case(device, dtype, hidden_size, num_tokens, True)
    r0 = r.clone()
    residual_out = torch.full_like(r0, float("nan"))

    _call(call, device, "add_rmsnorm_out", h, r, w, EPS, residual_out)

    assert_bitwise_equal(residual_out, residual_ref)
    assert_bitwise_equal(r, r0)
    _assert_normed(device, h, normed_ref)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize(
    "op",
    [
        "add_capture",
        "add_capture_no_residual",
        "add_rmsnorm_capture",
        "add_rmsnorm_capture_no_aux",
        "add_rmsnorm_into_slot",
        "add_rmsnorm_out",
    ],
)
def test_eager_memo_hit_launches_the_new_tensors(device, op):
    """The public functions' second call of a signature (the memoised plan,
    the pointer map applied to the new tensors) after a first one (the miss):
    each call's outputs are its own, in every slot."""
    dtype, num_tokens, hidden_size = torch.bfloat16, 3, 40
    aux = poisoned_aux(num_tokens + 1, 3, hidden_size, dtype, _tensor_device(device))
    for slot in SLOTS * 2:  # each slot twice: misses, then hits
        h, r, w, normed_ref, residual_ref = _norm_case(
            device, dtype, hidden_size, num_tokens, strided=True
        )
        h0, r0 = h.clone(), r.clone()
        with _mode(device):
            if op == "add_capture":
                ec.add_capture(h, r, aux, slot)
            elif op == "add_capture_no_residual":
                ec.add_capture(h, None, aux, slot)
                residual_ref = h0
            elif op == "add_rmsnorm_capture":
                ec.add_rmsnorm_capture(h, r, w, EPS, aux, slot)
            elif op == "add_rmsnorm_capture_no_aux":
                ec.add_rmsnorm_capture(h, r, w, EPS)
            elif op == "add_rmsnorm_into_slot":
                ec.add_rmsnorm_into_slot(h, r, w, EPS, aux, slot)
            else:
                residual_out = torch.full_like(r0, float("nan"))
                ec.add_rmsnorm_out(h, r, w, EPS, residual_out)
        if op.startswith("add_capture"):
            assert_bitwise_equal(h, h0)
        else:
            _assert_normed(device, h, normed_ref)
        if op != "add_capture_no_residual":
            expected_r = residual_ref if op.startswith("add_rmsnorm_capture") else r0
            assert_bitwise_equal(r, expected_r)
        if op == "add_rmsnorm_out":
            assert_bitwise_equal(residual_out, residual_ref)
        if op in ("add_rmsnorm_capture_no_aux", "add_rmsnorm_out"):
            assert torch.isnan(aux).all()
        else:
            assert_bitwise_equal(aux[:num_tokens, slot], residual_ref)
            assert_untouched(aux, num_tokens, slot)
            aux[:num_tokens, slot] = float("nan")  # re-poisoned for the next call


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("op", ["add_rmsnorm_capture", "add_rmsnorm_into_slot"])
def test_eager_memo_tells_norm_fp32_sum_apart(device, op):
    """Two calls that differ only in ``norm_fp32_sum`` (same tensors' shapes): the
    second runs its own variant, bit-equal to that variant's first call on an empty
    memo, not the memoised plan of the other flag."""
    dtype, num_tokens, hidden_size, slot = torch.bfloat16, 4, 40, 1
    fn = getattr(ec, op)

    def run(flag):
        torch.manual_seed(5)
        h, r, w, _, _ = _norm_case(device, dtype, hidden_size, num_tokens, strided=False)
        aux = poisoned_aux(num_tokens, 3, hidden_size, dtype, _tensor_device(device))
        fn(h, r, w, EPS, aux, slot, norm_fp32_sum=flag)
        return h.clone(), aux[:, slot].clone()

    outputs = {}
    with _mode(device):  # one block: kernel_on_cpu() empties the memo when it ends
        for first, second in ((False, True), (True, False)):
            table.LAUNCHER.forget()
            alone = run(second)  # its own plan, on an empty memo
            table.LAUNCHER.forget()
            run(first)  # the other flag's plan memoised
            assert table.LAUNCHER.plans, "no plan memoised: the test would prove nothing"
            after = run(second)  # the same signature but the flag
            assert_bitwise_equal(after[0], alone[0])
            assert_bitwise_equal(after[1], alone[1])
            outputs[second] = alone[0]
    assert not torch.equal(outputs[True], outputs[False]), "the inputs must tell the flags apart"


@pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")
@pytest.mark.parametrize("call", ["public", "op"])
def test_kernel_on_cpu_runs_the_kernel_then_the_torch_path_again(call):
    """Inside kernel_on_cpu() CPU tensors reach the kernel (bf16 sums come out
    truncated, the interpreter's cast); after it, the same call signature takes the
    torch path again (rounded to nearest: the memo of the block is not used)."""
    h = make_rows(4, 64, torch.bfloat16, "cpu")
    r = make_rows(4, 64, torch.bfloat16, "cpu")
    truncated, rounded = truncate_to_bf16(h.float() + r.float()), h + r
    assert not torch.equal(truncated, rounded)
    aux = poisoned_aux(4, 3, 64, torch.bfloat16, "cpu")
    _call(call, "cpu-kernel", "add_capture", h, r, aux, 1)
    assert_bitwise_equal(aux[:, 1], truncated)
    _call(call, "cpu", "add_capture", h, r, aux, 1)
    assert_bitwise_equal(aux[:, 1], rounded)
    with kernel_on_cpu(), kernel_on_cpu():  # nests
        pass
    assert "cpu" not in table.LAUNCHER.kernel_devices


def _sglang_layer_inputs(num_layers, num_tokens, hidden_size, dtype, device):
    torch.manual_seed(0)
    embed = make_rows(num_tokens, hidden_size, dtype, device)
    # Stand-ins for each layer's attention+MLP output (what the next layer adds).
    deltas = [make_rows(num_tokens, hidden_size, dtype, device) for _ in range(num_layers)]
    weights = [
        (1 + 0.1 * torch.randn(hidden_size)).to(dtype=dtype, device=device)
        for _ in range(num_layers)
    ]
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
    embed, deltas, weights = _sglang_layer_inputs(
        num_layers, num_tokens, hidden_size, dtype, _tensor_device(device)
    )

    eager_captures = []

    def run(into_slot: bool) -> torch.Tensor:
        buf = ec.AuxCaptureBuffer(
            16, hidden_size, capture_ids, dtype=dtype, device=_tensor_device(device)
        )
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
                ec.add_rmsnorm_out(
                    hidden, buf.slot_view(i - 1, num_tokens), weights[i], EPS, residual
                )
                residual_in_slot = False
            elif buf.captures_layer(i):
                # SGLang's aux.append(h + r) (truncated for bf16 under the interpreter)
                eager_captures.append(_sum(device, hidden, residual))
                buf.add_rmsnorm_capture(i, hidden, residual, weights[i], EPS)
            else:
                ec.add_rmsnorm_capture(hidden, residual, weights[i], EPS)
            hidden += deltas[i]
        return buf.result(num_tokens).clone()

    with _mode(device):
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
    buf = ec.AuxCaptureBuffer(
        8, hidden_size, [30, 2, 58], dtype=torch.bfloat16, device=_tensor_device(device)
    )
    assert buf.layer_ids == (2, 30, 58) and buf.slot_of(30) == 1
    captures = []
    for layer in (2, 30, 58):  # loop order
        h = make_rows(num_tokens, hidden_size, torch.bfloat16, _tensor_device(device))
        r = make_rows(num_tokens, hidden_size, torch.bfloat16, _tensor_device(device))
        with _mode(device):
            buf.capture(layer, h, r)
        captures.append((h, r))
    out = buf.result(num_tokens)
    assert out.shape == (num_tokens, 3 * hidden_size)
    assert out.data_ptr() == buf.aux.data_ptr()  # no copy
    if device == "cpu-kernel":  # SGLang's h + r, with the interpreter's bf16 truncation
        assert_bitwise_equal(out, torch.cat([_sum(device, h, r) for h, r in captures], -1))
    else:
        assert_bitwise_equal(out, sglang_eager_capture(captures))
    with pytest.raises(ValueError, match="do not fit"):
        buf.result(9)
    with pytest.raises(KeyError, match="layer 3 is not captured"):
        buf.slot_of(3)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([], "non-empty"),
        ([2, 2], "more than once"),
        ([-1, 2, 30], "negative index"),
        ([2, True], "sequence of integers"),
    ],
)
def test_buffer_rejects_bad_layer_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        ec.AuxCaptureBuffer(4, 8, ids)


def test_import_does_not_initialise_cuda():
    """Also meaningful without a GPU: torch's lazy CUDA initialisation is made to
    raise, so importing anything that would initialise CUDA (a device query, a
    current-device read) fails here too, not only where CUDA exists."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "def refuse(*a, **k): raise AssertionError('eagle_capture initialised CUDA at import')\n"
        "torch.cuda._lazy_init = refuse\n"
        "import eagle_capture, eagle_capture.parallel.symm, eagle_capture.parallel.tp, eagle_capture.integrations.sglang.dropin\n"
        "import eagle_capture.cli.doctor, eagle_capture.layer_ids.diagnosis, eagle_capture.layer_ids.plan, eagle_capture.testing.bench\n"
        "assert not torch.cuda.is_initialized(), 'import initialised CUDA'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    # The guard itself works: a CUDA query at import time would have raised.
    bad = code.replace(
        "import eagle_capture.cli.doctor",
        "torch.cuda.current_device()\nimport eagle_capture.cli.doctor",
    )
    result = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True)
    assert "eagle_capture initialised CUDA at import" in result.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
def test_weight_in_another_dtype(call, device, weight_dtype):
    """An fp32 (or fp16) norm weight with bf16 activations: the weight is read in
    its own dtype and the math stays fp32."""
    h, r, _, _, residual_ref = _norm_case(device, torch.bfloat16, 1000, 5, True)
    w = (1 + 0.1 * torch.randn(1000)).to(dtype=weight_dtype, device=_tensor_device(device))
    normed_ref = add_rmsnorm_reference(residual_ref, torch.zeros_like(residual_ref), w, EPS)[0]
    aux = poisoned_aux(6, 3, 1000, torch.bfloat16, _tensor_device(device))
    _call(call, device, "add_rmsnorm_capture", h, r, w, EPS, aux, 1)
    assert_bitwise_equal(r, residual_ref)
    assert_bitwise_equal(aux[:5, 1], residual_ref)
    assert_untouched(aux, 5, 1)
    _assert_normed(device, h, normed_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_fp32_sum", [False, True])
@pytest.mark.parametrize("op", ["add_rmsnorm_capture", "add_rmsnorm_into_slot", "add_rmsnorm_out"])
def test_norm_input_choice_per_op(call, device, dtype, norm_fp32_sum, op):
    """``norm_fp32_sum`` reaches the kernel / CPU body of each norm op through
    both call paths: the normed output agrees exactly with the matching float64
    reference (rounded once; truncated for bf16 under the interpreter) on nearly
    every element and visibly less with the other one; the stored residual /
    capture is the rounded sum either way, and what the op must not write is
    untouched."""
    gen = torch.Generator().manual_seed(11)
    dev = _tensor_device(device)
    h = (3 * torch.randn(16, 1000, generator=gen)).to(dtype).to(dev)
    r = torch.randn(16, 1000, generator=gen).to(dtype).to(dev)
    w = (1 + 0.1 * torch.randn(1000, generator=gen)).to(dtype).to(dev)

    def cast(ref):
        if device == "cpu-kernel" and dtype == torch.bfloat16:
            return truncate_to_bf16(ref.float())
        return ref.to(dtype)

    residual_ref = _sum(device, h, r)
    refs = {  # the norm of the stored residual, or of the exact sum
        False: cast(add_rmsnorm_reference(residual_ref, torch.zeros_like(residual_ref), w, EPS)[0]),
        True: cast(add_rmsnorm_reference(h, r, w, EPS, norm_fp32_sum=True)[0]),
    }
    r_before = r.clone()
    aux = poisoned_aux(17, 2, 1000, dtype, dev)
    out = torch.full_like(r, float("nan"))
    args = {
        "add_rmsnorm_capture": (h, r, w, EPS, aux, 1),
        "add_rmsnorm_into_slot": (h, r, w, EPS, aux, 1),
        "add_rmsnorm_out": (h, r, w, EPS, out),
    }[op]
    with _mode(device):
        if call == "public":
            getattr(ec, op)(*args, norm_fp32_sum=norm_fp32_sum)
        else:
            getattr(torch.ops.eagle_capture, op)(*args, norm_fp32_sum)
    if op == "add_rmsnorm_capture":
        assert_bitwise_equal(r, residual_ref)
    else:
        assert_bitwise_equal(r, r_before)
    if op == "add_rmsnorm_out":
        assert_bitwise_equal(out, residual_ref)
        assert_untouched(aux, 0, 1)
    else:
        assert_bitwise_equal(aux[:16, 1], residual_ref)
        assert_untouched(aux, 16, 1)
    assert (h == refs[norm_fp32_sum]).double().mean().item() >= 0.99
    assert (h == refs[not norm_fp32_sum]).double().mean().item() < 0.95


# ----------------------------------------------------------------------------
# The schemas and the kernel's arguments by name
# ----------------------------------------------------------------------------

OP_NAMES = ("add_capture", "add_rmsnorm_capture", "add_rmsnorm_into_slot", "add_rmsnorm_out")


@pytest.mark.parametrize("name", OP_NAMES)
def test_each_registered_op_matches_its_public_function_and_cpu_op(name):
    """The registered op's schema is the public function's parameters, and (norm
    ops) the private CPU op's schema, mutated arguments included."""
    import inspect

    schema = getattr(torch.ops.eagle_capture, name).default._schema
    params = tuple(a.name for a in schema.arguments)
    assert tuple(inspect.signature(getattr(ec, name)).parameters) == params
    if name != "add_capture":
        cpu = getattr(torch.ops.eagle_capture, f"_{name}_cpu").default._schema
        assert tuple(a.name for a in cpu.arguments) == params

        def mutated(s):
            return {
                a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write
            }

        assert mutated(cpu) == mutated(schema)


@pytest.mark.parametrize("name", OP_NAMES)
@pytest.mark.parametrize("absent", [None, "residual", "aux"])
def test_the_eager_template_binds_each_pointer_as_the_kernels_arguments_do(name, absent):
    """The eager plan's pointer template (positions in the call's five tensors)
    and kernel_arguments (the launch by name) bind every pointer to the same
    tensor, absent roles included; every parameter is bound once."""
    import inspect

    from eagle_capture.kernels import add_rmsnorm_capture_kernel

    names = tuple(inspect.signature(add_rmsnorm_capture_kernel.fn).parameters)
    h, r, w, ro = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), torch.randn(2, 8)
    aux = torch.zeros(3, 2, 8)
    norm = name != "add_capture"
    tensors = [
        h,
        r if absent != "residual" or norm else None,
        w if norm else None,
        aux if name != "add_rmsnorm_out" and absent != "aux" else None,
        ro if name == "add_rmsnorm_out" else None,
    ]
    in_place = name == "add_rmsnorm_capture"
    grid, values, _ = table._kernel_arguments(tensors, in_place, 1e-6, 1, False, False)
    assert set(values) == set(names)
    sources = table._pointer_sources(tensors, residual_in_place=in_place)
    assert {p: values[p] for p in sources} == {p: tensors[i] for p, i in sources.items()}
    head, tail = table.LAUNCHER.signature.template(
        sources, {k: v for k, v in values.items() if k not in sources}
    )
    assert (*head(tensors), *tail) == table.LAUNCHER.signature.bind(values)


def test_kernel_arguments_are_bound_by_the_kernels_parameter_names():
    import inspect

    from eagle_capture.kernels import add_rmsnorm_capture_kernel

    names = tuple(inspect.signature(add_rmsnorm_capture_kernel.fn).parameters)
    h, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    aux = torch.zeros(3, 2, 8)
    grid, values, _ = table._kernel_arguments((h, r, w, aux, None), True, 1e-6, 1, False, False)
    assert values["aux_ptr"] is aux and values["residual_out_ptr"] is r
    assert values["normed_out_ptr"] is h and values["weight_ptr"] is w
    assert values["aux_slot_offset"] == 8 and grid == (2, 1)
    # A parameter with a default may be left out; an unknown or missing one is refused.
    values.pop("NORM_FP32_SUM")
    assert table.LAUNCHER.signature.bind(values)[names.index("NORM_FP32_SUM")] is False
    with pytest.raises(TypeError, match=r"unknown \['bias_ptr'\]"):
        table.LAUNCHER.signature.bind(dict(values, bias_ptr=h))
    with pytest.raises(TypeError, match=r"missing \['eps'\]"):
        table.LAUNCHER.signature.bind({k: v for k, v in values.items() if k != "eps"})


def test_pointer_template_needs_the_pointers_to_lead():
    """head picks the leading pointer parameters from the call's tensors (or
    addresses) by position, tail is the rest with defaults filled in; a kernel
    whose pointers do not lead is refused when the plan is made."""
    KernelSignature = ops.KernelSignature

    def lead(a_ptr, b_ptr, n, FLAG=False): ...

    def mixed(n, a_ptr, FLAG, b_ptr): ...

    sources = {"a_ptr": 1, "b_ptr": 0}
    head, tail = KernelSignature(lead).template(sources, {"n": 7, "FLAG": True})
    assert (*head(["B", "A"]), *tail) == ("A", "B", 7, True)
    head, tail = KernelSignature(lead).template(sources, {"n": 7})
    assert (*head(["B", "A"]), *tail) == ("A", "B", 7, False)
    with pytest.raises(TypeError, match="must lead"):
        KernelSignature(mixed).template(sources, {"n": 7, "FLAG": True})
    head, tail = KernelSignature(lambda a_ptr, n: None).template({"a_ptr": 2}, {"n": 3})
    assert (*head(["x", "y", "z"]), *tail) == ("z", 3)
    with pytest.raises(TypeError, match=r"missing \['n'\]"):
        KernelSignature(lead).template(sources, {})
