"""The plugins' start-up id check (eagle_capture.layer_ids.startup) on CPU: the
layers an engine set against the draft's trainer convention. Run inside the real
engines' code by tests/test_sglang_real.py (plugin_checks_every_target) and
tests/test_vllm_real.py (id_check)."""

import json

import pytest

from eagle_capture.integrations.sglang import plugin
from eagle_capture.layer_ids import startup

SPECFORGE = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 19, 36], "use_aux_hidden_state": True},
}
SPECULATORS = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "eagle_aux_hidden_state_layer_ids": [2, 20, 37],
}
MODELOPT = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 19, 36], "next_layer_regular": True},
}


def test_right_wrong_ambiguous_unknown():
    ok = startup.check("vLLM", [37, 2, 20], 40, SPECFORGE, "LlamaForCausalLM")
    assert ok.status == "ok" and "what the draft was trained on" in ok.text
    wrong = startup.check(
        "vLLM", [1, 19, 36], 40, SPECFORGE, "LlamaForCausalLM", fix=lambda e: f"top-level ids = {e}"
    )
    assert wrong.status == "problem" and "top-level ids = [2, 20, 37]" in wrong.text
    assert startup.check("vLLM", [2, 20, 37], 40, SPECULATORS).status == "ok"
    ambiguous = startup.check("vLLM", [1, 19, 36], 40, MODELOPT, fix=lambda e: f"ids = {e}")
    assert ambiguous.status == "ambiguous" and "ids = [2, 20, 37]" in ambiguous.text
    assert "EAGLE_CAPTURE_ID_CONVENTION" in ambiguous.text
    # Wrong under both readings: a problem.
    assert startup.check("vLLM", [5, 10, 15], 40, MODELOPT).status == "problem"
    assert startup.check("vLLM", [2, 20, 37], 40, None).status == "unknown"
    assert "more than once" in startup.check("vLLM", [2, 2, 37], 40, SPECULATORS).text
    embedding = startup.check("SGLang", [0, 20, 37], 40, SPECFORGE)
    assert embedding.status == "problem" and "embedding" in embedding.text
    # SpecForge with no ids trains on its default, the engines' default layers (item 1):
    # the same answer as the doctor's.
    none = {"architectures": ["LlamaForCausalLMEagle3"]}
    assert startup.check("SGLang", [2, 20, 37], 40, none).status == "ok"
    assert startup.check("SGLang", [2, 21, 37], 40, none).status == "problem"
    assert startup.check("SGLang", [2, 20, 37], 40, {"architectures": ["X"]}).status == "unknown"


def test_the_user_decides_with_the_environment():
    told = startup.check("SGLang", [2, 20, 37], 40, MODELOPT, env={startup.ID_CONVENTION: "output"})
    assert told.status == "ok"
    told = startup.check("SGLang", [2, 20, 37], 40, MODELOPT, env={startup.ID_CONVENTION: "input"})
    assert told.status == "problem"
    with pytest.raises(ValueError, match="EAGLE_CAPTURE_ID_CONVENTION='middle'"):
        startup.check("SGLang", [2, 20, 37], 40, MODELOPT, env={startup.ID_CONVENTION: "middle"})


def test_sglang_id_problems_name_the_models_own_fix(caplog):
    """SGLang's Llama adds 1 to every id: a speculators draft's input-convention ids
    (ignored at the top level: SGLang captures its defaults) need [4, 9, 14] in
    eagle_config; a table that predicts other layers than SGLang set is said."""
    config = dict(SPECULATORS, eagle_aux_hidden_state_layer_ids=[5, 10, 15])
    problems = plugin.id_problems([2, 20, 37], 40, config, None, "LlamaForCausalLM", "0.5.23")
    assert len(problems) == 1
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [4, 9, 14]" in problems[0]
    with caplog.at_level("WARNING", logger="eagle_capture"):
        assert (
            plugin.id_problems(
                [2, 20, 37], 40, SPECFORGE, [1, 19, 36], "LlamaForCausalLM", "0.5.23"
            )
            == []
        )
        assert "predicts" not in caplog.text
        plugin.id_problems([1, 19, 36], 40, SPECFORGE, [1, 19, 36], "LlamaForCausalLM", "0.5.23")
    assert "predicts layers [2, 20, 37] for ids [1, 19, 36], SGLang set [1, 19, 36]" in caplog.text


def test_find_draft_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SPECFORGE))
    assert startup.find_draft_config(str(tmp_path)) == SPECFORGE
    assert startup.find_draft_config(None) is None
    assert startup.find_draft_config(str(tmp_path / "missing")) is None
