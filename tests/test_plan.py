"""The capture-plan API (eagle_capture.layer_ids.plan; its CLI is the doctor now) and the two TP entry
points no other test calls: every public function, each refusal by its
message, the CLI's output and exit status. CPU only, no GPU, no network."""

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from eagle_capture import AuxCaptureBuffer
from eagle_capture.layer_ids.plan import (
    CapturePlanError,
    build_plan,
    ids_from_draft_config,
    main,
    plan_from_draft_config,
)

KIMI_IDS = [1, 29, 57]  # SpecForge's ids for a 61-layer target: outputs of these layers


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": KIMI_IDS}}, KIMI_IDS),
        # a top-level field: SGLang's target ignores it (the doctor reports it)
        ({"eagle_aux_hidden_state_layer_ids": [2, 30]}, None),
        ({"eagle_config": {}, "eagle_aux_hidden_state_layer_ids": [3]}, None),
        ({"eagle_config": None}, None),
        ({}, None),
    ],
)
def test_ids_from_draft_config(config, expected):
    assert ids_from_draft_config(config) == expected


def test_plan_slots_buffer_and_format():
    plan = build_plan(KIMI_IDS, 61)
    assert plan.layers_to_capture == [2, 30, 58] and plan.num_captures == 3
    assert [plan.slot_of(layer) for layer in (2, 30, 58)] == [0, 1, 2]
    with pytest.raises(KeyError, match="layer 3 is not captured"):
        plan.slot_of(3)
    buf = plan.make_buffer(16, 32, dtype=torch.float16)
    assert buf.aux.shape == (16, 3, 32) and buf.aux.dtype == torch.float16
    assert [buf.slot_of(layer) for layer in (2, 30, 58)] == [0, 1, 2]
    text = plan.format().splitlines()
    assert text[0] == (
        "capture plan: 61-layer target, ids [1, 29, 57], rule: ids are layer outputs (adds 1)"
    )
    assert text[1] == "  layers_to_capture = [2, 30, 58]"
    assert text[2] == (
        "  slot 0: id 1 -> capture at start of layer 2 = output of layer 1 = HF hidden_states[2]"
    )
    assert len(text) == 5 and not plan.warnings
    defaults = build_plan(None, 61)
    assert defaults.layers_to_capture == [2, 30, 58]
    assert "ids defaults" in defaults.format() and "slot 0: default" in defaults.format()


def test_plan_warnings():
    plan = build_plan([29, 1, 57], 61)  # not ascending, ids[0] != 1
    assert plan.layers_to_capture == [2, 30, 58]  # slots in ascending layer order
    assert any("not ascending" in w for w in plan.warnings)
    assert any("SGLang <= 0.5.12 would capture layers [30, 2, 58]" in w for w in plan.warnings)
    assert plan.format().count("  warning: ") == 2


@pytest.mark.parametrize(
    "ids, num_layers, kwargs, message",
    [
        (KIMI_IDS, 3, {}, "num_layers must be an int >= 4"),
        (KIMI_IDS, True, {}, "num_layers must be an int >= 4"),
        ([], 61, {}, "is empty"),
        ([1, 2.0, 3], 61, {}, "must be integers"),
        ([1, True], 61, {}, "must be integers"),
        ([1, 29, 29], 61, {}, "layer id 29 appears more than once"),
        (
            [1, 29, 60],
            61,
            {},
            "maps to capture layer 61, outside the 61-layer target; the last usable id is 59",
        ),
        ([1, 2, 3], 61, {"convention": "sideways"}, "convention must be one of"),
        (KIMI_IDS, 61, {"pp_layers": (0, 31)}, r"captures layer\(s\) \[58\]"),
    ],
)
def test_plan_refusals(ids, num_layers, kwargs, message):
    with pytest.raises(CapturePlanError, match=message):
        build_plan(ids, num_layers, **kwargs)


def test_plan_for_the_capturing_pipeline_stage():
    assert build_plan(KIMI_IDS, 61, pp_layers=(0, 61)).layers_to_capture == [2, 30, 58]
    assert build_plan([29, 57], 61, pp_layers=(30, 61)).layers_to_capture == [30, 58]


def test_plan_from_a_config_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": KIMI_IDS}})
    )
    for where in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        assert plan_from_draft_config(where, 61).layers_to_capture == [2, 30, 58]
    with pytest.raises(CapturePlanError, match="must be a dict or a path"):
        plan_from_draft_config(42, 61)


def test_cli_is_the_doctor(tmp_path, capsys):
    """python -m eagle_capture.layer_ids.plan runs the doctor: one CLI, one verdict; its exit
    codes are the doctor's (2: unusable input)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": KIMI_IDS}}))
    deepseek = ["--num-layers", "61", "--target-architecture", "DeepseekV3ForCausalLM"]
    assert main(["--draft-config", str(config), *deepseek, "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert out.count("captures [2, 30, 58]: OK") == 4
    # vLLM's V1 runner takes these nested ids one layer early (V2, its default, reads none).
    assert main(["--draft-config", str(config), *deepseek, "--vllm-runner", "v1"]) == 1
    assert "captures [1, 29, 57]: PROBLEM -> write [2, 30, 58]" in " ".join(
        capsys.readouterr().out.split()
    )
    assert (
        main(
            ["--draft-config", str(config), "--num-layers", "61", "--pp", "2", "--engine", "sglang"]
        )
        == 1
    )
    assert "run before the last PP stage: never captured" in " ".join(
        capsys.readouterr().out.split()
    )
    assert main(["--draft-config", str(tmp_path / "missing.json"), "--num-layers", "61"]) == 2
    assert "error:" in capsys.readouterr().err
    config.write_text("{not json")
    assert main(["--draft-config", str(config), "--num-layers", "61"]) == 2
    with pytest.raises(SystemExit):  # --target-config and --num-layers exclude each other
        main(["--draft-config", str(config), "--num-layers", "61", "--target-config", "x"])


def test_store_fused_allreduce_residual():
    """SGLang's fused all-reduce + add + RMSNorm hands back the reduced residual:
    TPCapture stores it into the layer's slot, and only there."""
    from eagle_capture.parallel.tp import TPCapture

    buf = AuxCaptureBuffer(8, 16, [2, 30, 58], dtype=torch.float32)
    buf.aux.fill_(float("nan"))
    residual_out = torch.randn(5, 16)
    TPCapture(buf).store_fused_allreduce_residual(30, residual_out)
    assert torch.equal(buf.slot_view(30, 5), residual_out)
    rest = torch.ones(8, 3, dtype=torch.bool)
    rest[:5, 1] = False
    assert torch.isnan(buf.aux[rest]).all()
    with pytest.raises(KeyError):
        TPCapture(buf).store_fused_allreduce_residual(31, residual_out)


def test_consistency_check_of_chosen_layers(tmp_path):
    """check_capture_consistency(layer_ids=...) checks those layers only (world 1:
    the fingerprints and the gather run; the cross-rank comparison is in test_tp)."""
    from eagle_capture.parallel.tp import CaptureConsistencyError, check_capture_consistency

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path}/store",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        buf = AuxCaptureBuffer(8, 16, [2, 30, 58], dtype=torch.float32)
        buf.aux.copy_(torch.randn(8, 3, 16))
        check_capture_consistency(buf, 5, 16, layer_ids=[30])
        check_capture_consistency(buf, 5, 16, layer_ids=[2, 58])
        with pytest.raises(KeyError):
            check_capture_consistency(buf, 5, 16, layer_ids=[31])
        with pytest.raises(CaptureConsistencyError, match="tensor-parallel shard"):
            check_capture_consistency(buf, 5, 32, layer_ids=[30])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "start, end, ok", [(30, 59, True), (30, 58, False), (31, 61, False), (30, 61, True)]
)
def test_pipeline_stage_bounds(start, end, ok):
    """Capture layers [30, 58] (input-convention ids): a stage
    [start, end) owns them only when start <= 30 and 58 < end -- at each bound,
    one below and one above (issue 21)."""
    kwargs = dict(convention="input", pp_layers=(start, end))
    if ok:
        assert build_plan([30, 58], 61, **kwargs).layers_to_capture == [30, 58]
    else:
        with pytest.raises(CapturePlanError, match="pipeline stage owns layers"):
            build_plan([30, 58], 61, **kwargs)


@pytest.mark.parametrize("start, end, ok", [(30, 59, True), (30, 58, False), (31, 61, False)])
def test_drop_in_refuses_layers_outside_the_stage(start, end, ok):
    """The drop-in's start-up check at the stage's bounds."""
    from eagle_capture.integrations.sglang.dropin import WrongCaptureLayers, check_capture_layers

    if ok:
        check_capture_layers([30, 58], start, end, allow_embedding=False)
    else:
        with pytest.raises(WrongCaptureLayers, match="this rank runs layers"):
            check_capture_layers([30, 58], start, end, allow_embedding=False)
