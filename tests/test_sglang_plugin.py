"""The SGLang plugin's own logic on CPU, without SGLang: sizing rule, draft-config
checks, the switch, and what register() does when it cannot hook. The plugin inside
the real SGLang wheels (load_plugins, the hooked configure step, Kimi-K2.5, the
self-check, overflow) is tests/sglang_real/plugin_scenarios.py."""

import json
import logging

import pytest

from eagle_capture.integrations.sglang import plugin
from eagle_capture.integrations.sglang.sizing import (
    DEFAULT_MAX_TOKENS,
    MAX_TOKENS_ENV,
    ServingLimits,
    read_limits,
    size_buffer_for,
)

# ------------------------------------------------------------------- sizing


def test_h200_defaults_prefill_chunk_dominates():
    # SGLang's defaults on an H200 with EAGLE-3: chunk 8192, 48 requests, N = 4,
    # verify graphs up to 48 requests.
    limits = ServingLimits(
        chunked_prefill_size=8192,
        max_prefill_tokens=16384,
        max_running_requests=48,
        num_draft_tokens=4,
        decode_graph_max_bs=48,
        prefill_graph_max_tokens=2048,
    )
    size = size_buffer_for(limits, {})
    assert size.max_tokens == 8192 and size.graph_tokens == 2048  # prefill graphs
    assert "chunked_prefill_size = 8192" in size.reason


def test_verify_dominates_and_chunking_off():
    busy = ServingLimits(chunked_prefill_size=2048, max_running_requests=1024, num_draft_tokens=8)
    assert size_buffer_for(busy, {}).max_tokens == 8192
    unchunked = ServingLimits(
        chunked_prefill_size=-1,
        max_prefill_tokens=16384,
        max_running_requests=48,
        num_draft_tokens=4,
    )
    size = size_buffer_for(unchunked, {})
    assert size.max_tokens == 16384 and "chunking off" in size.reason


def test_graphs_are_a_floor_for_the_override():
    limits = ServingLimits(
        chunked_prefill_size=8192,
        max_running_requests=64,
        num_draft_tokens=4,
        decode_graph_max_bs=64,
    )
    assert size_buffer_for(limits, {MAX_TOKENS_ENV: "300"}).max_tokens == 300
    with pytest.raises(ValueError, match=f"{MAX_TOKENS_ENV}=100 is below the 256 tokens"):
        size_buffer_for(limits, {MAX_TOKENS_ENV: "100"})
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ValueError, match="expected a positive number"):
            size_buffer_for(limits, {MAX_TOKENS_ENV: bad})


def test_nothing_readable_gives_the_default():
    size = size_buffer_for(ServingLimits(), {})
    assert size.max_tokens == DEFAULT_MAX_TOKENS and "default" in size.reason


def test_read_limits_from_resolved_server_args():
    """0.5.13's ServerArgs (resolved in place) and the runner's per-rank request pool;
    the graph batch is capped by the pool, as SGLang captures it."""

    class Args:
        chunked_prefill_size = 4096
        max_prefill_tokens = 16384
        max_running_requests = 48
        speculative_num_draft_tokens = 4
        cuda_graph_max_bs = 256
        piecewise_cuda_graph_max_tokens = 2048
        disable_piecewise_cuda_graph = False
        disable_cuda_graph = False

    class Runner:
        max_running_requests = 40

    limits = read_limits(Args(), Runner())
    assert limits == ServingLimits(4096, 16384, 40, 4, 40, 2048)
    Args.disable_cuda_graph = True
    assert read_limits(Args(), Runner()).decode_graph_max_bs is None


# ------------------------------------------------------------ draft config


def test_draft_config_matching_and_not_visible():
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 7168,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
    }
    assert plugin.draft_config_problems(cfg, [2, 30, 58], 7168) == []
    assert plugin.draft_config_problems(None, [2, 30, 58], 7168) == []


def test_top_level_ids_are_judged_by_the_layers_sglang_captures():
    """SGLang's target ignores top-level ids and captures its defaults [2, 30, 58]: right
    for a speculators draft trained on those inputs (not refused), wrong for a SpecForge-style
    draft trained on other layers (refused by the id check, with the eagle_config fix)."""
    speculators = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "hidden_size": 7168,
        "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
    }
    assert plugin.draft_config_problems(speculators, [2, 30, 58], 7168) == []
    assert (
        plugin.id_problems([2, 30, 58], 61, speculators, None, "DeepseekV3ForCausalLM", "0.5.23")
        == []
    )
    other = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 7168,
        "eagle_aux_hidden_state_layer_ids": [1, 20, 40],
    }
    assert plugin.draft_config_problems(other, [2, 30, 58], 7168) == []
    problems = plugin.id_problems([2, 30, 58], 61, other, None, "DeepseekV3ForCausalLM", "0.5.23")
    assert len(problems) == 1 and "eagle_config.eagle_aux_hidden_state_layer_ids" in problems[0]
    assert "[2, 21, 41]" in problems[0], problems[0]


def test_width_mismatches():
    four = {
        "hidden_size": 7168,
        "num_aux_hidden_states": 4,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    }
    assert "expects 4 x 7168" in plugin.draft_config_problems(four, [2, 3, 4], 7168)[0]
    other_target = {
        "hidden_size": 4096,
        "target_hidden_size": 5120,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
    }
    assert "3 x 5120" in plugin.draft_config_problems(other_target, [2, 30, 58], 7168)[0]
    # Kimi-K2.5's draft sizes its fc from the top-level key too: two ids -> 2 x H,
    # while the target (nested key only) captures its three defaults.
    kimi = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "hidden_size": 7168,
        "eagle_aux_hidden_state_layer_ids": [1, 29],
    }
    problems = plugin.draft_config_problems(kimi, [2, 30, 58], 7168)
    assert len(problems) == 1 and "expects 2 x 7168" in problems[0]


def test_read_draft_config(tmp_path, caplog):
    class Args:
        speculative_draft_model_path = str(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert plugin.read_draft_config(Args()) == {"hidden_size": 8}
    (tmp_path / "config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="eagle_capture"):
        assert plugin.read_draft_config(Args()) is None
    assert str(tmp_path / "config.json") in caplog.text
    Args.speculative_draft_model_path = None
    assert plugin.read_draft_config(Args()) is None


# ------------------------------------------------------------------ switch


@pytest.mark.parametrize(
    "value,on",
    [("", False), ("0", False), ("off", False), ("1", True), ("on", True), ("TRUE", True)],
)
def test_switch(value, on):
    assert plugin._switch_on({plugin.SWITCH: value}) is on


def test_switch_rejects_other_values():
    with pytest.raises(plugin.PluginError, match="EAGLE_CAPTURE='2'"):
        plugin._switch_on({plugin.SWITCH: "2"})


def test_register_logs_instead_of_raising(monkeypatch, caplog):
    """SGLang's load_plugins() only logs what a plugin raises: register() says
    itself, in one line, that it is off or could not hook."""
    monkeypatch.delenv(plugin.SWITCH, raising=False)
    with caplog.at_level(logging.INFO, logger="eagle_capture"):
        plugin.register()
    assert "off (EAGLE_CAPTURE=1 turns on" in caplog.text
    caplog.clear()
    monkeypatch.setenv(plugin.SWITCH, "1")
    monkeypatch.setitem(__import__("sys").modules, "sglang", None)  # no SGLang here
    with caplog.at_level(logging.INFO, logger="eagle_capture"):
        plugin.register()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "could not register" in errors[0].getMessage()


@pytest.mark.parametrize("value, on", [("", False), ("0", False), ("1", True), ("on", True)])
def test_fused_allreduce_switch(value, on):
    from eagle_capture.integrations.settings import FUSED_ALLREDUCE, fused_allreduce

    assert fused_allreduce({FUSED_ALLREDUCE: value}) is on
    assert fused_allreduce({}) is False  # off unless asked for
    with pytest.raises(plugin.PluginError, match="EAGLE_CAPTURE_FUSED_ALLREDUCE='one'"):
        fused_allreduce({FUSED_ALLREDUCE: "one"})


class _OneShotStandIn:
    """What CapturedLayerAllReduce asks of a SymmAllReduceCapture: its own path
    per T (its buffer caps the one-shot rows)."""

    def __init__(self, cap):
        self.cap = cap

    def path_for(self, num_tokens):
        return "one_shot" if num_tokens <= self.cap else "nccl"


@pytest.mark.parametrize(
    "world, table, one_shot_cap, expect",
    [
        # The default rule (W = 2: one-shot up to 1024): above it SGLang's fusion stays.
        (
            2,
            None,
            1024,
            {1: "one_shot", 1024: "one_shot", 1025: "engine_fusion", 2048: "engine_fusion"},
        ),
        (8, None, 64, {1: "one_shot", 64: "one_shot", 65: "engine_fusion"}),
        # No kernel here (CPU, or no symmetric memory): one-shot rows take SGLang's
        # all-reduce + the fused op, never SGLang's fusion silently.
        (2, None, None, {1: "nccl", 1024: "nccl", 1025: "engine_fusion"}),
        # A measured table decides, every path by name; another W: the default rule.
        (
            4,
            {"4": [[8, "one_shot"], [64, "nccl"], [2048, "engine_fusion"]]},
            8,
            {1: "one_shot", 8: "one_shot", 9: "nccl", 64: "nccl", 65: "engine_fusion"},
        ),
        (2, {"4": [[8, "nccl"]]}, 1024, {1: "one_shot", 1025: "engine_fusion"}),
        # A table's one-shot row above the kernel's buffer: SGLang's all-reduce.
        (2, {"2": [[512, "one_shot"]]}, 256, {256: "one_shot", 257: "nccl", 512: "nccl"}),
    ],
)
def test_captured_layer_allreduce_paths(world, table, one_shot_cap, expect):
    from eagle_capture.integrations.sglang.allreduce import CapturedLayerAllReduce
    from eagle_capture.parallel.paths import PathTable

    ar = CapturedLayerAllReduce(
        world,
        reduce=None,
        table=PathTable(table) if table is not None else None,
        one_shot=_OneShotStandIn(one_shot_cap) if one_shot_cap is not None else None,
    )
    assert {t: ar.path_for(t) for t in expect} == expect
    assert "T=1: " in ar.describe()


def test_captured_layer_allreduce_takes_only_its_dtype_and_width():
    import torch

    from eagle_capture.integrations.sglang.allreduce import CapturedLayerAllReduce

    ar = CapturedLayerAllReduce(2, reduce=None, dtype=torch.bfloat16, hidden_size=64)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert ar.takes(x)
    assert not ar.takes(x.float())  # a float32 call: SGLang's fusion
    assert not ar.takes(x[:, :32])


def test_fallback_reduces_per_sglang_function(monkeypatch):
    """Whether SGLang's fusion reduces before its fallback norm is read off its
    function's code (0.5.22+ call deferred_post_experts_all_reduce there)."""
    import sys
    import types

    from eagle_capture.integrations.sglang import allreduce

    def reducing(x):
        return deferred_post_experts_all_reduce(x)  # noqa: F821 - only its name is read

    def not_reducing(x):
        return x

    for fn, want in ((reducing, True), (not_reducing, False)):
        module = types.ModuleType("sglang.srt.layers.layernorm")
        module._forward_with_allreduce_fusion = fn
        monkeypatch.setitem(sys.modules, "sglang.srt.layers.layernorm", module)
        assert allreduce.fallback_reduces() is want
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.layernorm", types.ModuleType("x"))
    assert allreduce.fallback_reduces() is False  # 0.5.9: no shared function
