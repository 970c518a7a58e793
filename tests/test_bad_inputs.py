"""Bad input gets a clear Python error naming the argument -- raised before any
launch, with the aux buffer left exactly as it was. Both call paths."""

import pytest
import torch

import eagle_capture as ec
from conftest import HAS_CUDA, assert_bitwise_equal

T, H, K, ROWS = 4, 16, 3, 8
BF16 = torch.bfloat16
DEVICE = "cuda" if HAS_CUDA else "cpu"


def good(device=DEVICE):
    return dict(
        hidden_states=torch.randn(T, H, dtype=BF16, device=device),
        residual=torch.randn(T, H, dtype=BF16, device=device),
        aux=torch.full((ROWS, K, H), float("nan"), dtype=BF16, device=device),
        slot=1,
    )


def _with(**changes):
    def make():
        args = good()
        for key, value in changes.items():
            args[key] = value(args) if callable(value) else value
        return args

    return make


# (id, args factory, exception, message fragment)
CAPTURE_CASES = [
    ("slot-too-large", _with(slot=K), ValueError, "slot 3 is out of range"),
    ("slot-negative", _with(slot=-1), ValueError, "slot -1 is out of range"),
    ("slot-not-int", _with(slot=1.0), TypeError, "slot must be an int"),
    (
        "tp-shard-width",
        _with(
            hidden_states=lambda a: torch.randn(T, H // 8, dtype=BF16, device=DEVICE),
            residual=lambda a: torch.randn(T, H // 8, dtype=BF16, device=DEVICE),
        ),
        ValueError,
        "tensor-parallel shard",
    ),
    (
        "residual-dtype",
        _with(residual=lambda a: a["residual"].half()),
        ValueError,
        "residual dtype torch.float16 does not match",
    ),
    (
        "aux-dtype",
        _with(aux=lambda a: a["aux"].float()),
        ValueError,
        "aux dtype torch.float32 does not match",
    ),
    (
        "residual-shape",
        _with(residual=lambda a: torch.randn(T + 1, H, dtype=BF16, device=DEVICE)),
        ValueError,
        "residual shape",
    ),
    (
        "too-many-tokens",
        _with(
            hidden_states=lambda a: torch.randn(ROWS + 1, H, dtype=BF16, device=DEVICE),
            residual=lambda a: torch.randn(ROWS + 1, H, dtype=BF16, device=DEVICE),
        ),
        ValueError,
        "only 8 rows",
    ),
    (
        "hidden-last-dim-strided",
        _with(hidden_states=lambda a: torch.randn(T, 2 * H, dtype=BF16, device=DEVICE)[:, ::2]),
        ValueError,
        "hidden_states must have a contiguous last dimension",
    ),
    (
        "residual-last-dim-strided",
        _with(residual=lambda a: torch.randn(H, T, dtype=BF16, device=DEVICE).t()),
        ValueError,
        "residual must have a contiguous last dimension",
    ),
    (
        "hidden-3d",
        _with(hidden_states=lambda a: a["hidden_states"].view(2, 2, H)),
        ValueError,
        "hidden_states must be 2-D",
    ),
    (
        "aux-2d",
        _with(aux=lambda a: a["aux"].view(ROWS, K * H)),
        ValueError,
        "aux must be the 3-D buffer",
    ),
    (
        "hidden-int",
        _with(hidden_states=lambda a: torch.ones(T, H, dtype=torch.int32, device=DEVICE)),
        ValueError,
        "hidden_states dtype must be one of",
    ),
    (
        "hidden-not-tensor",
        _with(hidden_states=[[0.0] * H] * T),
        TypeError,
        "hidden_states must be a torch.Tensor",
    ),
]
if HAS_CUDA:
    CAPTURE_CASES.append(
        (
            "residual-on-cpu",
            _with(residual=lambda a: a["residual"].cpu()),
            ValueError,
            "residual is on cpu",
        )
    )
    CAPTURE_CASES.append(
        ("aux-on-cpu", _with(aux=lambda a: a["aux"].cpu()), ValueError, "aux is on cpu")
    )
else:
    CAPTURE_CASES.append(
        (
            "residual-on-meta",
            _with(residual=lambda a: a["residual"].to("meta")),
            ValueError,
            "residual is on meta",
        )
    )


def _capture(call, args):
    fn = ec.add_capture if call == "public" else torch.ops.eagle_capture.add_capture
    fn(args["hidden_states"], args["residual"], args["aux"], args["slot"])


@pytest.mark.parametrize("call", ["public", "op"])
@pytest.mark.parametrize("case", CAPTURE_CASES, ids=[c[0] for c in CAPTURE_CASES])
def test_add_capture_rejects(call, case):
    _, make, exc, fragment = case
    _capture(call, good())  # a valid call first: the eager validation memo must not hide errors
    args = make()
    aux = args["aux"]
    before = aux.clone() if isinstance(aux, torch.Tensor) else None
    if call == "op" and exc is TypeError:
        # The dispatcher type-checks the schema first; its message names the argument.
        exc, fragment = (TypeError, RuntimeError), "slot|hidden_states"
    with pytest.raises(exc, match=fragment):
        _capture(call, args)
    if before is not None:
        assert_bitwise_equal(aux, before)


@pytest.mark.parametrize("call", ["public", "op"])
@pytest.mark.parametrize("num_tokens", [ROWS - 1, ROWS, ROWS + 1])
def test_token_count_at_the_buffer_rows(call, num_tokens):
    """The rows bound at the value, one below and one above: up to ``ROWS`` tokens
    are stored (the rows past them untouched), ``ROWS + 1`` is refused with aux as
    it was."""
    args = good()
    args["hidden_states"] = torch.randn(num_tokens, H, dtype=BF16, device=DEVICE)
    args["residual"] = torch.randn(num_tokens, H, dtype=BF16, device=DEVICE)
    aux = args["aux"]
    before = aux.clone()
    if num_tokens > ROWS:
        with pytest.raises(ValueError, match=f"only {ROWS} rows"):
            _capture(call, args)
        assert_bitwise_equal(aux, before)
        return
    _capture(call, args)
    expected = before.clone()
    expected[:num_tokens, 1] = args["hidden_states"] + args["residual"]
    assert_bitwise_equal(aux, expected)


@pytest.mark.parametrize("num_tokens", [ROWS - 1, ROWS, ROWS + 1])
def test_buffer_views_at_max_tokens(num_tokens):
    """AuxCaptureBuffer's views and result at ``max_tokens`` and one either side."""
    buf = ec.AuxCaptureBuffer(ROWS, H, [1, 3, 5], dtype=BF16, device=DEVICE)
    if num_tokens > ROWS:
        for view in (lambda: buf.slot_view(3, num_tokens), lambda: buf.result(num_tokens)):
            with pytest.raises(ValueError, match=f"{num_tokens} tokens do not fit"):
                view()
        return
    assert buf.slot_view(3, num_tokens).shape == (num_tokens, H)
    assert buf.result(num_tokens).data_ptr() == buf.aux.data_ptr()
    assert buf.result(num_tokens).shape == (num_tokens, K * H)


NORM_CASES = [
    (
        "weight-wrong-length",
        dict(weight=lambda: torch.ones(H + 1, dtype=BF16, device=DEVICE)),
        ValueError,
        r"weight must have shape \[16\]",
    ),
    (
        "weight-2d",
        dict(weight=lambda: torch.ones(1, H, dtype=BF16, device=DEVICE)),
        ValueError,
        r"weight must have shape \[16\]",
    ),
    ("eps-negative", dict(eps=-1.0), ValueError, "eps must be a non-negative float"),
    ("residual-none", dict(residual=None), TypeError, "residual must be a tensor"),
    ("slot-out-of-range", dict(slot=7), ValueError, "slot 7 is out of range"),
]


@pytest.mark.parametrize("call", ["public", "op"])
@pytest.mark.parametrize("case", NORM_CASES, ids=[c[0] for c in NORM_CASES])
@pytest.mark.parametrize("op", ["add_rmsnorm_capture", "add_rmsnorm_into_slot"])
def test_norm_ops_reject(call, case, op):
    _, changes, exc, fragment = case
    args = good()
    weight = torch.ones(H, dtype=BF16, device=DEVICE)
    eps = 1e-6
    if "weight" in changes:
        weight = changes["weight"]()
    eps = changes.get("eps", eps)
    residual = changes["residual"] if "residual" in changes else args["residual"]
    slot = changes.get("slot", args["slot"])
    before = [t.clone() for t in (args["hidden_states"], args["residual"], args["aux"])]
    fn = getattr(ec, op) if call == "public" else getattr(torch.ops.eagle_capture, op)
    with pytest.raises(exc, match=fragment):
        fn(args["hidden_states"], residual, weight, eps, args["aux"], slot)
    for t, b in zip((args["hidden_states"], args["residual"], args["aux"]), before):
        assert_bitwise_equal(t, b)


@pytest.mark.parametrize("call", ["public", "op"])
def test_add_rmsnorm_out_rejects_mismatched_residual_out(call):
    args = good()
    fn = ec.add_rmsnorm_out if call == "public" else torch.ops.eagle_capture.add_rmsnorm_out
    w = torch.ones(H, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="residual_out shape"):
        fn(
            args["hidden_states"],
            args["residual"],
            w,
            1e-6,
            torch.empty(T, H + 1, dtype=BF16, device=DEVICE),
        )
    with pytest.raises(ValueError, match="residual_out dtype"):
        fn(
            args["hidden_states"],
            args["residual"],
            w,
            1e-6,
            torch.empty(T, H, dtype=torch.float32, device=DEVICE),
        )


def test_add_rmsnorm_into_slot_needs_an_aux_buffer():
    """aux is not Optional for the into-slot op, but the dispatcher lets None through
    for a Tensor argument: without the check both paths would skip the capture that
    is the op's residual output (the registered op used to, silently)."""
    args = good()
    w = torch.ones(H, dtype=BF16, device=DEVICE)
    ec.add_rmsnorm_into_slot(args["hidden_states"], args["residual"], w, 1e-6, args["aux"], 1)
    before = args["hidden_states"].clone()
    with pytest.raises(TypeError, match="aux must be a tensor for add_rmsnorm_into_slot"):
        ec.add_rmsnorm_into_slot(args["hidden_states"], args["residual"], w, 1e-6, None, 1)
    assert_bitwise_equal(args["hidden_states"], before)
    with pytest.raises(TypeError, match="aux must be a tensor for add_rmsnorm_into_slot"):
        torch.ops.eagle_capture.add_rmsnorm_into_slot(
            args["hidden_states"], args["residual"], w, 1e-6, None, 1
        )
    assert_bitwise_equal(args["hidden_states"], before)


# ----------------------------------------------------------------------------
# Memory shared between arguments, and outputs that overlap themselves
# ----------------------------------------------------------------------------


def test_ranges_overlap():
    """The byte-range test behind the aliasing checks and SymmAllReduceCapture."""
    from eagle_capture.ops import ranges_overlap

    buf = torch.zeros(ROWS, K, H, dtype=BF16, device=DEVICE)
    rows = buf.view(ROWS, K * H)
    assert ranges_overlap(buf, buf[2:3, 1])
    assert ranges_overlap(buf[:, 0], buf[:, 2])  # interleaved slots share a range
    assert not ranges_overlap(rows[:2], rows[2:])  # adjacent, not overlapping
    assert ranges_overlap(rows[:3], rows[2:])
    assert not ranges_overlap(buf, buf[:0]) and not ranges_overlap(buf[:0], buf)
    assert not ranges_overlap(buf, None) and not ranges_overlap(None, None)
    assert not ranges_overlap(buf, torch.zeros_like(buf))


def test_spans_meet_against_every_pair():
    """The eager paths' per-call pre-check (addresses only) agrees with a brute
    pairwise test on random layouts of 2-8 ranges, empty ones included."""
    import random

    from eagle_capture.ops import spans_meet

    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(2, 8)
        starts = [rng.randrange(0, 200) for _ in range(n)]
        extents = [rng.choice((0, rng.randrange(1, 40))) for _ in range(n)]
        brute = any(
            extents[i]
            and extents[j]
            and starts[i] < starts[j] + extents[j]
            and starts[j] < starts[i] + extents[i]
            for i in range(n)
            for j in range(i + 1, n)
        )
        assert spans_meet(starts, extents) == brute, (starts, extents)
    assert not spans_meet((0, 16), (16, 16))  # adjacent
    assert spans_meet((0, 15), (16, 16))
    assert not spans_meet((4, 0), (0, 16))  # an empty range inside another


def _aliasing_cases():
    """(id, factory -> (guarded tensor, op, args), message). Cross-tensor cases are
    also run after a valid call of the same signature (memoised validation), with
    every tensor argument replaced by an unaliased copy of identical strides."""

    def base():
        return (
            torch.randn(T, H, dtype=BF16, device=DEVICE),
            torch.randn(T, H, dtype=BF16, device=DEVICE),
            torch.ones(H, dtype=BF16, device=DEVICE),
            torch.full((ROWS, K, H), float("nan"), dtype=BF16, device=DEVICE),
        )

    def into_slot_reads_its_own_slot():
        h, r, w, aux = base()
        aux[:T, 1] = r
        return aux, ec.add_rmsnorm_into_slot, (h, aux[:T, 1], w, 1e-6, aux, 1)

    def hidden_inside_aux():
        h, r, w, aux = base()
        return aux, ec.add_rmsnorm_into_slot, (aux[:T, 1], r, w, 1e-6, aux, 1)

    def residual_out_is_hidden():
        h, r, w, aux = base()
        return h, ec.add_rmsnorm_out, (h, r, w, 1e-6, h)

    def hidden_is_residual():
        h, r, w, aux = base()
        return aux, ec.add_rmsnorm_capture, (h, h, w, 1e-6, aux, 0)

    def weight_inside_hidden():
        h, r, w, aux = base()
        return aux, ec.add_rmsnorm_capture, (h, r, h[0], 1e-6, aux, 0)

    def expanded_aux_slots():
        h, r, w, _ = base()
        aux = torch.zeros(ROWS, 1, H, dtype=BF16, device=DEVICE).expand(ROWS, K, H)
        return aux, ec.add_capture, (h, r, aux, 1)

    def expanded_hidden_rows_normed():
        _, r, w, aux = base()
        h = torch.randn(1, H, dtype=BF16, device=DEVICE).expand(T, H)
        return aux, ec.add_rmsnorm_capture, (h, r, w, 1e-6, aux, 0)

    return [
        ("into-slot-reads-its-own-slot", into_slot_reads_its_own_slot, "slot being written", True),
        ("hidden-inside-aux", hidden_inside_aux, "hidden_states lies inside the aux buffer", True),
        ("residual-out-is-hidden", residual_out_is_hidden, "residual_out shares memory", True),
        ("hidden-is-residual", hidden_is_residual, "share memory", True),
        ("weight-inside-hidden", weight_inside_hidden, "weight shares memory", True),
        ("expanded-aux-slots", expanded_aux_slots, "aux has overlapping rows or slots", False),
        (
            "expanded-hidden-rows",
            expanded_hidden_rows_normed,
            "hidden_states has overlapping",
            False,
        ),
    ]


def _unaliased_copy(x):
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device).copy_(x)


@pytest.mark.parametrize("case", _aliasing_cases(), ids=[c[0] for c in _aliasing_cases()])
@pytest.mark.parametrize("after_valid_call", [False, True])
def test_aliasing_is_refused_before_launch(case, after_valid_call):
    _, make, fragment, cross_tensor = case
    if after_valid_call and not cross_tensor:
        pytest.skip("self-overlap is a property of the strides alone")
    guarded, op, args = make()
    if after_valid_call:
        op(*[_unaliased_copy(a) for a in args])  # the same signature, memoised as valid
    before = guarded.clone()
    with pytest.raises(ValueError, match=fragment):
        op(*args)
    assert_bitwise_equal(guarded, before)


def test_a_residual_read_from_another_slot_is_allowed():
    """The documented chain: after an into-slot capture the next layer reads its
    residual from that slot and writes elsewhere."""
    h = torch.randn(T, H, dtype=BF16, device=DEVICE)
    aux = torch.randn(ROWS, K, H, dtype=BF16, device=DEVICE)
    w = torch.ones(H, dtype=BF16, device=DEVICE)
    expected = h + aux[:T, 0]
    ec.add_capture(h, aux[:T, 0], aux, 2)
    assert_bitwise_equal(aux[:T, 2], expected)
    out = torch.empty(T, H, dtype=BF16, device=DEVICE)
    ec.add_rmsnorm_out(h, aux[:T, 0], w, 1e-6, out)
    assert_bitwise_equal(out, expected)


def test_residual_touching_aux_by_one_element_is_refused():
    """A residual whose last element is aux's first (one element of overlap, the
    byte extent's bound): refused before anything is written (issue 21)."""
    T, H, K = 4, 64, 3
    flat = torch.zeros(T * H + 8 * K * H, dtype=torch.bfloat16)
    residual = flat[: T * H].view(T, H)
    aux = flat[T * H - 1 : T * H - 1 + 8 * K * H].view(8, K, H)
    h, w = torch.randn(T, H, dtype=torch.bfloat16), torch.ones(H, dtype=torch.bfloat16)
    before = flat.clone()
    with pytest.raises(ValueError, match="residual overlaps aux slot"):
        ec.add_rmsnorm_into_slot(h, residual, w, 1e-6, aux, 1)
    assert torch.equal(flat, before)
    # One element further, they do not touch: accepted.
    aux_apart = flat[T * H : T * H + 7 * K * H].view(7, K, H)
    ec.add_rmsnorm_into_slot(h.clone(), residual, w, 1e-6, aux_apart, 1)


@pytest.mark.parametrize("written_slot", [0, 1, 2])
def test_residual_straddling_two_slots_is_refused(written_slot):
    """A residual view straddling slots 0 and 1 (half of each row in each) is not
    a slot view: refused whichever slot is written, since the write could land
    in it (issue 21). A residual that is exactly another slot is accepted."""
    T, H, K = 4, 64, 3
    aux = torch.zeros(8, K, H, dtype=torch.bfloat16)
    straddling = aux.view(8, K * H)[:T, H // 2 : H // 2 + H]
    h, w = torch.randn(T, H, dtype=torch.bfloat16), torch.ones(H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual overlaps aux slot"):
        ec.add_rmsnorm_into_slot(h, straddling, w, 1e-6, aux, written_slot)
    other = aux[:T, (written_slot + 1) % K]
    ec.add_rmsnorm_into_slot(h.clone(), other, w, 1e-6, aux, written_slot)
