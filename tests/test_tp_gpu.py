"""Tensor parallelism end to end on GPUs: the SGLang-style DeepseekV3 loop at
TP = 2 over NCCL, each layer's MLP output split into random row-parallel
partials (the parts sum to the TP = 1 output), every layer boundary reduced by
:class:`eagle_capture.parallel.symm.SymmAllReduceCapture` through :class:`TPCapture` --
once forced onto the one-shot kernel, once onto NCCL + the fused op. The
buffer must equal the TP = 1 run within rounding, the consistency checker must
stay silent, and a planted unreduced partial must be named by layer. Needs two
GPUs; skipped with the reason otherwise."""

import pytest
import torch

from conftest import run_ranks

TIMEOUT_S = 300
WORLD = 2


def _scenarios(rank, world, device):
    from eagle_capture import AuxCaptureBuffer
    from eagle_capture.parallel.symm import PathTable, SymmAllReduceCapture
    from eagle_capture.parallel.tp import (
        CaptureConsistencyError,
        TPCapture,
        check_capture_consistency,
    )
    from eagle_capture.testing.reference_loop import SGLangDeepseekLoop
    from test_oracle import input_ids, tiny_deepseek
    from test_tp import CapturesBeforeReducing, _partial_split

    hidden_size, num_tokens, layers = 64, 9, [2, 4, 6]
    ids = input_ids(num_tokens, device=device)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        model = tiny_deepseek(8, dtype=dtype, device=device)  # same seed: same weights
        loop = SGLangDeepseekLoop(model)
        with torch.no_grad():
            _, reference = loop.forward(ids, layers)  # TP = 1
        for path, cap in (("one_shot", 64), ("nccl", 0)):
            ar = SymmAllReduceCapture(
                16, hidden_size, dtype, device=device, one_shot_max_tokens=cap, table=PathTable({})
            )
            assert ar.path_for(num_tokens) == path
            buf = AuxCaptureBuffer(16, hidden_size, layers, dtype=dtype, device=device)
            with torch.no_grad():
                _, got = loop.forward(
                    ids,
                    layers,
                    tp=TPCapture(buf, fused_allreduce=ar),
                    partial=_partial_split(world, rank),
                )
            torch.testing.assert_close(got.float(), reference.float(), rtol=tol, atol=tol)
            check_capture_consistency(buf, num_tokens, hidden_size)

        # A planted unreduced partial (captured before the all-reduce, as SGLang
        # <= 0.5.13 did with the deferred all-reduce): the checker names the layer.
        bad = AuxCaptureBuffer(16, hidden_size, layers, dtype=dtype, device=device)
        with torch.no_grad():
            loop.forward(
                ids, layers, tp=CapturesBeforeReducing(bad), partial=_partial_split(world, rank)
            )
        with pytest.raises(CaptureConsistencyError, match=r"layer 2 \(slot 0\).*unreduced"):
            check_capture_consistency(bad, num_tokens, hidden_size)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} GPUs (one per rank; torch's symmetric memory "
    f"refuses two ranks on one GPU)",
)
def test_tp2_reference_loop_over_nccl_and_one_shot(tmp_path):
    run_ranks(_scenarios, WORLD, tmp_path, TIMEOUT_S, "TP = 2 GPU test")
