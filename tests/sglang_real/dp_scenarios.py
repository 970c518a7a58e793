"""The capture under DP ATTENTION inside the real SGLang code, on CPU: per SGLang
version, rank processes on gloo: ``--world 2`` (``--tp-size 2 --dp-size 2
--enable-dp-attention``: each rank its own attention-TP group of one rank, the
MLP / MoE over both) or ``--world 4`` (TP 4, DP 2: attention-TP pairs); with
``--moe-a2a-backend deepep`` (DeepEP's package stubbed, its MoE stood in). With
``--dp-size 1`` (plain TP 2) and DeepEP or ``--moe-dense-tp-size 1``: rows
token-scattered over the attention-TP group (scenarios ``SCATTERED``).

Real, besides what harness.py lists: SGLang's own DP-attention set-up
(``initialize_model_parallel`` with the attention-DP width, ``initialize_dp_attention``,
the published DP rank), each rank's own batch (its own requests and token count,
an idle rank included), the scheduler's token-count sync done as it does (an
all-gather over the TP CPU group) and then SGLang's own
``prepare_mlp_sync_batch`` / ``post_forward_mlp_sync_batch`` (padding mode, DP
buffers, padded rows, the trim back), and on the forward SGLang's own DP gather
and scatter around every MLP / MoE (``dp_gather_partial`` / ``dp_scatter`` /
``dp_reduce_scatter_tensor``, over the TP group). The stand-ins shard over the
group the replaced real module's projection shards over (attention: its own
attention-TP group of one rank; the MLP / MoE: the TP group). What runs on CPU
only because the tensors are CPU ones: ``harness._dp_attention_on_cpu``.

Each rank compares the drop-in with SGLang's own capture on the same rank
(bit-exact in fp32: what the rank's draft receives, SGLang's LogitsProcessor
output after the trim), the plugin's self-check across ranks that hold
different requests, and a capture taken over the wrong group (TP instead of
attention-TP) being caught.

    PYTHONPATH=$(tools/sglang_real_env.sh 0.5.23):. python -m tests.sglang_real.dp_scenarios \\
        --rank R --init-method tcp://127.0.0.1:PORT --json out_R.json   # every rank R
"""

from __future__ import annotations

import argparse
import logging
import traceback

import torch

from tests.sglang_real import harness, tp_scenarios

HIDDEN = tp_scenarios.HIDDEN
# (mode, tokens on rank 0, tokens on rank 1): unequal batches (extend: SGLang's
# SUM_LEN padding, an all-reduce gather; decode: MAX_LEN, rank 1 padded to rank
# 0's rows and trimmed back), an idle rank, equal ones.
CASES = (("extend", 5, 3), ("decode", 3, 1), ("extend", 4, 0), ("decode", 2, 2), ("extend", 11, 6))

_ARGS: argparse.Namespace | None = None


def _dp() -> bool:
    """DP attention (``--dp-size 2``); else plain TP 2 with an all-to-all MoE,
    where the two ranks share one batch and hold half its rows each after a
    sparse layer."""
    return _ARGS.dp_size > 1


def _world() -> int:
    return _ARGS.world


def _attn_tp() -> int:
    """Ranks of an attention-TP group (they hold the same rows)."""
    return _world() // _ARGS.dp_size


def _dp_rank() -> int:
    return _ARGS.rank // _attn_tp()


def _tokens(case) -> int:
    return case[1 + _dp_rank()] if _dp() else case[1]


def _run(model, mode, num_tokens, seed):
    """(final hidden states handed to SGLang's LogitsProcessor, what this rank's
    draft receives), for this rank's own batch; a collective."""
    call = harness.run(model, harness.make_dp_batch(model, num_tokens, mode, seed=seed))
    aux = harness.draft_input(call)
    return call.hidden_states.clone(), None if aux is None else aux.clone()


def _seed(case) -> int:
    """Under DP attention each rank's own requests (different tokens on each
    rank); else the one batch both ranks run."""
    return (100 * _dp_rank() if _dp() else 0) + _tokens(case)


def _build(set_capture=True):
    return harness.build_model(
        num_layers=tp_scenarios.NUM_LAYERS,
        hidden_size=HIDDEN,
        dtype=torch.float32,
        capture_ids=tp_scenarios.DRAFT_IDS,
        seed=tp_scenarios.SEED,
        set_capture=set_capture,
        standin="row_parallel",
    )


def _verifying_install(forwards: int):
    """The plugin's install (0.5.9: by hand) with EAGLE_CAPTURE_VERIFY=forwards on a
    model built as SGLang's reference is: (model, state, install log, how)."""
    ours = _build(set_capture=False)
    state, log, how = tp_scenarios._install_capture(
        ours,
        {
            "EAGLE_CAPTURE": "1",
            "EAGLE_CAPTURE_MAX_TOKENS": "16",
            "EAGLE_CAPTURE_VERIFY": str(forwards),
        },
    )
    tp_scenarios._detach_log(log)
    return ours, state, log, how


# ------------------------------------------------------------------ scenarios


def dp_setup():
    """SGLang's own DP-attention topology, and the stand-ins' groups read off the
    real modules: attention on its one-rank attention-TP group, the MLP / MoE on
    the TP group."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group
    from sglang.srt.layers import dp_attention

    assert dp_attention.is_dp_attention_enabled(), "DP attention is not enabled"
    attn, tp = get_attn_tp_group(), get_tp_group()
    assert (attn.world_size, tp.world_size) == (_attn_tp(), _world()), (
        attn.world_size,
        tp.world_size,
    )
    model = _build()
    layers = harness.text_lm(model).model.layers
    shards = {"attn": layers[3].self_attn.cols, "mlp": layers[1].mlp.cols}  # layer 1: dense
    a, w = HIDDEN // _attn_tp(), HIDDEN // _world()
    r = _ARGS.rank % _attn_tp()
    assert shards["attn"] == (r * a, (r + 1) * a), f"attention not on its own group: {shards}"
    assert shards["mlp"] == (_ARGS.rank * w, (_ARGS.rank + 1) * w), shards
    modes = {}
    for i, layer in enumerate(harness.text_lm(model).model.layers):
        scatter = getattr(getattr(layer, "layer_communicator", None), "layer_scatter_modes", None)
        if scatter is not None:  # <= 0.5.20: the layout SGLang derived for the layer
            modes[i] = f"mlp {scatter.mlp_mode.name}, output {scatter.layer_output_mode.name}"
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return {
        "attn_tp": attn.world_size,
        "tp": tp.world_size,
        "shards": shards,
        "moe_a2a_backend": str(get_moe_a2a_backend()),
        "layer_modes": modes,
        "init_calls": harness._STATE["init_calls"],
    }


def dp_equals_sglang():
    """The drop-in (installed by hand, defaults) vs SGLang's own capture on this
    rank, over CASES: what the draft receives and the final hidden states,
    bit-exact (fp32: SGLang sizes the DP gather buffers for the model's dtype at
    set-up, one per process); the fused kernel made every capture, on path e
    (path f is not taken under DP attention)."""
    from eagle_capture.integrations.sglang.dropin import install_eagle3_capture

    ref, ours = _build(), _build()
    install_eagle3_capture(ours, 16)
    state = harness.text_lm(ours)._eagle_capture
    assert not state.residual_in_slot_enabled, "path f taken under DP attention"
    out = []
    sglang_fails = None
    for case in CASES:
        mode, t = case[0], _tokens(case)
        fused, gathered_before = state.fused_calls, state.gathered_calls
        try:
            final_ref, aux_ref = _run(ref, mode, t, _seed(case))
        except (IndexError, RuntimeError) as e:
            # SGLang 0.5.13's own capture of a dense layer's output under
            # moe_dense_tp_size 1 keeps this rank's slice ungathered; its
            # LogitsProcessor then indexes past it, or cats mismatched rows (every
            # rank alike).
            if not _sglang_gathers_no_dense_rows():
                raise
            sglang_fails, final_ref, aux_ref = f"{type(e).__name__}: {e}", None, None
        final, aux = _run(ours, mode, t, _seed(case))
        assert aux.shape == (t, 3 * HIDDEN), (case, aux.shape)
        if aux_ref is None:  # no reference on this rank: both ranks hold the same rows
            tp_scenarios._same_on_all_ranks(aux, f"{case}: the gathered capture")
        else:
            assert torch.equal(aux, aux_ref), f"{case}: the draft's input differs from SGLang's own"
            assert torch.equal(final, final_ref), f"{case}: final hidden states differ"
        n = state.fused_calls - fused
        gathered = state.gathered_calls - gathered_before
        want = len(state.scattered_layers) if t else 0
        assert gathered == want and n == (3 - want if t else 0), (
            f"{case}: {n} fused captures, {gathered} gathered"
        )
        assert state.slot_residual_calls == 0
        out.append(f"{mode} {case[1]}/{case[2]}: rank {_ARGS.rank} {t} rows equal")
    assert state.fallback_calls == state.gathered_calls and state.overflow_forwards == 0
    return {
        "cases": out,
        "scattered_layers": sorted(state.scattered_layers),
        "sglang_own_capture_fails": sglang_fails,
    }


def _sglang_gathers_no_dense_rows() -> bool:
    """SGLang 0.5.13 under moe_dense_tp_size 1 with an attention-TP group of two:
    its own capture of the dense layers' (scattered) outputs is not gathered."""
    return harness.sglang_version() == "0.5.13" and _ARGS.moe_dense_tp_size == 1


def dp_plugin_verify():
    """The plugin (0.5.9: by hand) with EAGLE_CAPTURE_VERIFY=4 under DP attention:
    its self-check compares each rank with SGLang's own, never two ranks that
    hold different requests (the attention-TP group, one rank here), takes the
    same decision on every rank, and an idle rank joins its collectives (no
    hang); the ON line names DP attention."""
    from tests.sglang_real import plugin_scenarios as ps

    if _sglang_gathers_no_dense_rows():
        return {"not_run": "SGLang 0.5.13's own capture fails here (scattered_equals_sglang)"}
    ref = tp_scenarios._sglang_reference()
    ours, state, log, how = _verifying_install(4)
    assert state.verify_group is tp_scenarios._group().cpu_group
    if _dp() and _attn_tp() == 1:
        assert state.verify_rows_group is None, "the self-check would compare different requests"
    elif _dp():  # the attention-TP group's ranks hold the same rows: compared
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        assert state.verify_rows_group is get_attn_tp_group().cpu_group
    else:  # both ranks hold the same rows: compared
        assert state.verify_rows_group is state.verify_group
    records = ps._Records()
    logging.getLogger("eagle_capture").addHandler(records)
    try:
        for case in CASES[:4]:
            final_ref, aux_ref = _run(ref, case[0], _tokens(case), _seed(case))
            final, aux = _run(ours, case[0], _tokens(case), _seed(case))
            assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref), case
    finally:
        tp_scenarios._detach_log(records)
    lines = [m for _, m in records.lines if m.startswith("eagle_capture verify")]
    assert not records.text(logging.ERROR) and not state.disabled, records.text()
    assert len(lines) == 5 and "self-check off" in lines[-1], lines
    same = (
        "each holds its own requests' rows"
        if _dp() and _attn_tp() == 1
        else f"identical on all {_attn_tp()} attention-TP ranks"
        if _dp()
        else f"identical on all {_world()} TP ranks"
    )
    assert all(same in m or "T=0" in m and "(idle)" in m for m in lines[:4]), lines
    on = [m for _, m in log.lines if "ON" in m]
    if on and _dp():  # the plugin's ON line (0.5.13+)
        assert f"DP attention (attention-TP {_attn_tp()}" in on[0], on[0]
    return {"how": how, "lines": lines[:2], "on": on[:1]}


def _captured_over_the_tp_group():
    """A capture gathered over the TP group instead of the attention-TP group (the
    field's bug): each captured slot's rows replaced by the first rows of every
    rank's rows all-gathered over the TP group -- rank 0's rows, on rank 1."""
    import torch.distributed as dist

    from tests.sglang_real import plugin_scenarios as ps

    group = tp_scenarios._group().cpu_group

    def over_tp(rows):
        every = [torch.empty_like(rows) for _ in range(_world())]
        dist.all_gather(every, rows.contiguous(), group=group)
        rows.copy_(torch.cat(every)[: rows.shape[0]])

    return ps.planted_capture_fault(None, over_tp)


def dp_wrong_group_caught():
    """A capture taken over the TP group instead of the attention-TP group: rank 1
    would hand its draft rank 0's rows. Its self-check finds every captured layer
    different from SGLang's own, serves SGLang's values and switches back, with
    rank 0; and the cross-rank consistency check over the TP group (the wrong
    group for comparing DP ranks) reports different captures where the right
    one (each rank alone) has nothing to compare."""
    from eagle_capture.parallel.tp import CaptureConsistencyError, check_capture_consistency
    from tests.sglang_real import plugin_scenarios as ps

    ref = tp_scenarios._sglang_reference()
    ours, state, log, how = _verifying_install(2)
    case = ("decode", 4, 4)  # equal counts: the planted all-gather needs them
    records = ps._Records()
    logging.getLogger("eagle_capture").addHandler(records)
    try:
        final_ref, aux_ref = _run(ref, case[0], 4, _seed(case))
        with _captured_over_the_tp_group():
            final, aux = _run(ours, case[0], 4, _seed(case))
    finally:
        tp_scenarios._detach_log(records)
    assert torch.equal(aux, aux_ref), "the self-check did not serve SGLang's values"
    errors = records.text(logging.ERROR)
    if _dp_rank() != 0:  # handed DP rank 0's rows
        planted = [i for i in (2, 4, 6) if i not in state.scattered_layers]  # fused ones
        assert "MISMATCH" in errors and all(f"layer {i} (slot" in errors for i in planted), errors
    else:
        assert "another TP rank" in errors, errors
    assert state.disabled, "not switched back on this rank"
    # The comparison group: over the TP group two DP ranks' captures differ.
    from eagle_capture import AuxCaptureBuffer

    mine = AuxCaptureBuffer(4, HIDDEN, [2, 4, 6], dtype=torch.float32)
    mine.aux.copy_(aux_ref.view(4, 3, HIDDEN))
    try:
        check_capture_consistency(mine, 4, HIDDEN, tp_scenarios._group().cpu_group)
    except CaptureConsistencyError as e:
        message = str(e)
    else:
        raise AssertionError("two DP ranks' different requests compared equal over the TP group")
    return {
        "how": how,
        "self_check": errors.splitlines()[0][:240],
        "over_the_tp_group": message.splitlines()[0][:200],
    }


def scattered_setup():
    """Plain TP 2 with an all-to-all MoE: the attention-TP group has both ranks and
    after each sparse layer a rank holds its slice of the rows; SGLang's own
    layout says which captured layers start scattered (the first sparse layer is
    layer 2 here, so layers 4 and 6; with moe_dense_tp_size 1 also the dense
    layers' outputs: layer 2), and the install gathers exactly those."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    from eagle_capture.integrations.sglang.dropin import install_eagle3_capture

    assert get_attn_tp_group().world_size == _world()
    model = _build()
    install_eagle3_capture(model, 16)
    state = harness.text_lm(model)._eagle_capture
    # After a sparse layer under the all-to-all backend, after a dense one with
    # moe_dense_tp_size 1 (layers 0 and 1 are dense here).
    want = ({4, 6} if _ARGS.moe_a2a_backend else set()) | (
        {2} if _ARGS.moe_dense_tp_size == 1 else set()
    )
    assert state.scattered_layers == want, (sorted(state.scattered_layers), sorted(want))
    assert not state.residual_in_slot_enabled, "path f taken with token-scattered rows"
    return {"scattered_layers": sorted(state.scattered_layers)}


SCENARIOS = {
    "dp_setup": dp_setup,
    "dp_equals_sglang": dp_equals_sglang,
    "dp_plugin_verify": dp_plugin_verify,
    "dp_wrong_group_caught": dp_wrong_group_caught,
}
# Plain TP 2, an all-to-all MoE: the captures of scattered rows.
SCATTERED = {
    "scattered_setup": scattered_setup,
    "scattered_equals_sglang": dp_equals_sglang,
    "scattered_plugin_verify": dp_plugin_verify,
}


def main(argv=None) -> None:
    global _ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument(
        "--world",
        type=int,
        choices=(2, 4),
        default=2,
        help="4 with --dp-size 2: attention-TP groups of two ranks",
    )
    parser.add_argument("--init-method", required=True, help="tcp://127.0.0.1:PORT")
    parser.add_argument("--json", required=True)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--dist-timeout", type=int, default=120)
    parser.add_argument("--moe-a2a-backend", default=None)
    parser.add_argument("--moe-dense-tp-size", type=int, default=None)
    parser.add_argument(
        "--dp-size",
        type=int,
        choices=(1, 2),
        default=2,
        help="1: plain TP 2 (with --moe-a2a-backend: scattered rows)",
    )
    _ARGS = tp_scenarios._ARGS = args = parser.parse_args(argv)
    results = {"world": args.world, "dp": args.dp_size, "rank": args.rank}
    write = tp_scenarios._writer(args.json, results)
    try:
        harness.setup(
            tp_size=args.world,
            rank=args.rank,
            init_method=args.init_method,
            dist_timeout=args.dist_timeout,
            dp_size=args.dp_size,
            moe_a2a_backend=args.moe_a2a_backend,
            moe_dense_tp_size=args.moe_dense_tp_size,
        )
        results["version"] = harness.sglang_version()
    except Exception as e:  # noqa: BLE001
        results["setup"] = {
            "ok": False,
            "detail": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
        write()
        tp_scenarios._exit(1)
    scenarios = SCENARIOS if args.dp_size > 1 else SCATTERED
    tp_scenarios._exit(tp_scenarios.run_each(scenarios, args.only, results, write, args.world))


if __name__ == "__main__":
    main()
