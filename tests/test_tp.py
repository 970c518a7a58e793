"""Tensor-parallel capture over torch.distributed (gloo on CPU), world sizes 2
and 4, in spawned processes with a bounded timeout.

Every rank runs the SGLang-style DeepseekV2 loop over the same tiny HF model;
each layer's output is split into random row-parallel partials (rank r gets
part r; the parts sum to the true output), so only a correct all-reduce
before the add gives the TP = 1 captures. The consistency checker must stay
silent on that run and catch each corruption class."""

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from eagle_capture import ops
from eagle_capture.parallel.tp import TPCapture

TIMEOUT_S = 240


def _partial_split(world, rank):
    """``partial(layer, full)``: this rank's random row-parallel share of ``full``
    (the shares of all ranks sum to it), the same on every rank for a layer."""

    def partial(layer, full):
        g = torch.Generator().manual_seed(1000 + layer)
        parts = [
            torch.randn(full.shape, generator=g).to(full.dtype).to(full.device)
            for _ in range(world - 1)
        ]
        last = full - sum(parts) if parts else full
        return (parts + [last])[rank]

    return partial


class CapturesBeforeReducing(TPCapture):
    """Captures the unreduced per-rank partial, as SGLang <= 0.5.13 did with the
    deferred all-reduce (the consistency checker must name it)."""

    def reduce_add_rmsnorm(self, layer_id, partial_hidden, residual, weight, eps):
        if self.buffer.captures_layer(layer_id):
            self.buffer.capture(layer_id, partial_hidden, residual)
        dist.all_reduce(partial_hidden)
        ops.add_rmsnorm_capture(partial_hidden, residual, weight, eps)


def _message(exc_type, fn, what: str) -> str:
    """The message of the ``exc_type`` that ``fn()`` must raise (``what`` names the
    case when it does not)."""
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{what} not caught")


def _scenarios(rank, world, device):
    from eagle_capture import AuxCaptureBuffer
    from eagle_capture.parallel.tp import CaptureConsistencyError, check_capture_consistency
    from eagle_capture.testing.reference_loop import SGLangDeepseekLoop
    from test_oracle import input_ids, tiny_deepseek

    hidden_size, num_tokens, layers = 64, 9, [2, 4, 6]
    model = tiny_deepseek(8)  # same seed: same weights on every rank
    ids = input_ids(num_tokens)
    loop = SGLangDeepseekLoop(model)
    _, reference = loop.forward(ids, layers)  # TP = 1

    # 1. Correct run: reduce, then add, then store. Equals TP = 1; checker silent.
    buf = AuxCaptureBuffer(16, hidden_size, layers, dtype=torch.float32)
    _, got = loop.forward(ids, layers, tp=TPCapture(buf), partial=_partial_split(world, rank))
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    check_capture_consistency(buf, num_tokens, hidden_size)

    # 2. An unreduced partial sum captured (SGLang <= 0.5.13 with the deferred
    #    all-reduce): every rank differs, the checker says so.
    bad = AuxCaptureBuffer(16, hidden_size, layers, dtype=torch.float32)
    loop.forward(ids, layers, tp=CapturesBeforeReducing(bad), partial=_partial_split(world, rank))
    msg = _message(
        CaptureConsistencyError,
        lambda: check_capture_consistency(bad, num_tokens, hidden_size),
        "unreduced capture",
    )
    assert "layer 2 (slot 0)" in msg and "unreduced" in msg, msg

    # 3. An H/tp-wide capture.
    narrow = AuxCaptureBuffer(16, hidden_size // world, layers, dtype=torch.float32)
    msg = _message(
        CaptureConsistencyError,
        lambda: check_capture_consistency(narrow, num_tokens, hidden_size),
        "TP-shard width",
    )
    assert "tensor-parallel shard" in msg, msg

    # 4. One rank diverging (here: the last rank's slot 1 off by one element).
    if rank == world - 1:
        buf.aux[3, 1, 5] += 1.0
    msg = _message(
        CaptureConsistencyError,
        lambda: check_capture_consistency(buf, num_tokens, hidden_size),
        "diverging rank",
    )
    assert "layer 4 (slot 1)" in msg and "layer 2" not in msg, msg
    if world > 2:
        assert f"rank(s) [{world - 1}] diverge" in msg, msg

    # 5. Token-scattered rows gathered over the attention-TP group equal the
    #    full-rows capture. With world 4: two attention-TP groups {0,1}, {2,3},
    #    each holding its own batch (DP attention); gathering over all 4 would mix them.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else [None]
    group_index = rank // 2 if world == 4 else 0
    attn_group = groups[group_index]
    attn_world, attn_rank = dist.get_world_size(attn_group), dist.get_rank(attn_group)
    #    Token counts at the group's boundary: one row of padding (7 over 2 ranks),
    #    none (8: divides exactly), and one more token than the rows can hold.
    rows = 4
    for tokens in (rows * attn_world - 1, rows * attn_world):
        g = torch.Generator().manual_seed(77 + group_index + tokens)
        h_full = torch.randn(tokens, hidden_size, generator=g)
        r_full = torch.randn(tokens, hidden_size, generator=g)
        w = 1 + 0.1 * torch.randn(hidden_size, generator=g)

        def pad(t, tokens=tokens):
            return torch.cat([t, t.new_zeros(rows * attn_world - tokens, hidden_size)])

        h_local = pad(h_full)[attn_rank * rows : (attn_rank + 1) * rows].clone()
        r_local = pad(r_full)[attn_rank * rows : (attn_rank + 1) * rows].clone()
        scattered = AuxCaptureBuffer(10, hidden_size, [3], dtype=torch.float32)
        scattered.aux.fill_(float("nan"))
        TPCapture(scattered, attn_tp_group=attn_group).add_rmsnorm_gather(
            3, h_local, r_local, w, 1e-6, tokens
        )
        full = AuxCaptureBuffer(10, hidden_size, [3], dtype=torch.float32)
        full.add_rmsnorm_capture(3, h_full.clone(), r_full.clone(), w, 1e-6)
        assert torch.equal(scattered.slot_view(3, tokens), full.slot_view(3, tokens)), tokens
        assert torch.isnan(scattered.aux[tokens:]).all(), "padding rows reached the buffer"
        check_capture_consistency(scattered, tokens, hidden_size, group=attn_group)
    too_many = rows * attn_world + 1
    msg = _message(
        ValueError,
        lambda: TPCapture(scattered, attn_tp_group=attn_group).add_rmsnorm_gather(
            3, h_local, r_local, w, 1e-6, too_many
        ),
        f"{too_many} tokens from {attn_world} x {rows} rows",
    )
    assert f"cannot hold {too_many} tokens" in msg, msg

    # 6. The TP group and the attention-TP group differ (DP attention: {0, 1} and
    #    {2, 3} at world 4, each rank alone at world 2): the layer boundary reduces
    #    over the whole TP group, so the captures still equal TP = 1.
    singles = [dist.new_group([r]) for r in range(world)] if world == 2 else None
    sub_group = attn_group if world == 4 else singles[rank]
    dp = AuxCaptureBuffer(16, hidden_size, layers, dtype=torch.float32)
    _, got = loop.forward(
        ids, layers, tp=TPCapture(dp, attn_tp_group=sub_group), partial=_partial_split(world, rank)
    )
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    check_capture_consistency(dp, num_tokens, hidden_size)

    # 7. Two equal groups of ranks holding two values (world 4: a reduction over
    #    the attention-TP halves): the checker names both groups.
    if world == 4:
        if rank >= 2:
            dp.aux[0, 0, 0] += 1.0
        msg = _message(
            CaptureConsistencyError,
            lambda: check_capture_consistency(dp, num_tokens, hidden_size),
            "a 2-2 split",
        )
        assert "[0, 1] vs [2, 3]" in msg and "every rank" not in msg, msg


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_capture_gloo(world, tmp_path):
    run_ranks(_scenarios, world, tmp_path, TIMEOUT_S, "tensor-parallel test", backend="gloo")
