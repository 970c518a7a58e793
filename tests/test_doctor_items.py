"""The doctor on what published drafts do: converted drafts, slot order, drafts
without aux states, formats an engine cannot load, verdict words and exit status,
--json / --write-config, and bad input (one line, exit 2, no traceback)."""

import json
import os
import re
import subprocess
import sys

import pytest

from eagle_capture.cli import doctor
from eagle_capture.integrations.sglang import plugin
from eagle_capture.layer_ids import startup

HERE = os.path.dirname(__file__)
PUBLISHED = os.path.join(HERE, "data", "published_configs")
SPECULATORS = os.path.join(
    HERE,
    "data",
    "trainer_configs",
    "speculators",
    "Eagle3SpeculatorConfig_61layer_ids_2_30_58.config.json",
)


def _doctor(capsys, *argv, explain=True):
    """The doctor in this process; ``explain``: its full reasoning (--explain), which
    these cases check."""
    argv = [str(a) for a in argv] + (["--explain"] if explain and "--json" not in argv else [])
    code = doctor.main(argv)
    out = capsys.readouterr()
    return code, " ".join(out.out.split()), out.err


def _specforge(tmp_path, ids, name="draft.json", **eagle):
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": dict(
                    {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}, **eagle
                ),
            }
        )
    )
    return path


# Item 2 ------------------------------------------------------------------------------------


def test_a_converted_specforge_draft_is_never_a_silent_ok(tmp_path, capsys):
    """speculators' converter copies a SpecForge draft's ids verbatim: [1, 29, 57] at the
    top level of a speculators config is SpecForge's default list, trained on capture
    layers [2, 30, 58], which vLLM would take one layer early. Both readings, the probe
    recommended, exit 1 (it used to be OK on vLLM)."""
    config = json.load(open(SPECULATORS))
    config["eagle_aux_hidden_state_layer_ids"] = [1, 29, 57]
    path = tmp_path / "converted.json"
    path.write_text(json.dumps(config))
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--engine",
        "vllm",
    )
    assert code == 1
    assert "summary: vLLM: AMBIGUOUS (exit 1)" in out
    assert "SpecForge's and TorchSpec's default list" in out and "eagle-capture probe" in out
    assert "trained on capture layers [2, 30, 58]" in out
    assert "trained on capture layers [1, 29, 57]" in out
    # Its own convention's ids (not a default list) keep one reading.
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        SPECULATORS,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--engine",
        "vllm",
    )
    assert code == 0 and "AMBIGUOUS" not in out


# Item 4 ------------------------------------------------------------------------------------


def test_unsorted_ids_swap_slots_in_the_doctor(tmp_path, capsys):
    """The engines capture in ascending order; SpecForge's HF target concatenates in the
    config's order. [57, 1, 29] on Llama (+1 to every id) used to be sorted and called a
    match."""
    path = _specforge(tmp_path, [57, 1, 29])
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "LlamaForCausalLM",
    )
    assert code == 1
    assert "summary: SGLang: PROBLEM; vLLM: PROBLEM (exit 1)" in out
    assert "ids [57, 1, 29] are not in ascending order" in out and "slots [0, 1, 2]" in out
    assert "write the ids sorted, [1, 29, 57]" in out


def test_unsorted_ids_are_refused_at_start_up_by_both_plugins(tmp_path):
    """The same rule (startup.slot_order_problem) in the start-up check that SGLang's
    plugin (id_problems) and vLLM's (checked.py) run: a problem, so the server refuses."""
    config = json.loads(_specforge(tmp_path, [57, 1, 29]).read_text())
    check = startup.check("vLLM", [2, 30, 58], 61, config, "LlamaForCausalLM")
    assert check.status == "problem" and "not in ascending order" in check.text
    problems = plugin.id_problems(
        [2, 30, 58], 61, config, [57, 1, 29], "LlamaForCausalLM", "0.5.23"
    )
    assert len(problems) == 1 and "not in ascending order" in problems[0]
    # Without the config in view, SGLang's own ids (in the config's order) say the same.
    assert plugin.id_problems([2, 30, 58], 61, None, [57, 1, 29], "LlamaForCausalLM", "0.5.23")
    assert startup.slot_order_problem([1, 29, 57]) is None


def test_vllms_plugin_refuses_unsorted_ids(tmp_path):
    """vLLM's plugin (checked.check_draft_ids, run where vLLM sets its aux layers) reads
    the draft's own config.json and refuses the server, in the doctor's words."""
    from types import SimpleNamespace

    from eagle_capture.integrations.vllm import checked

    draft = tmp_path / "draft"
    draft.mkdir()
    _specforge(draft, [57, 1, 29], name="config.json")
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=61))
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(
            draft_model_config=SimpleNamespace(model=str(draft), revision=None, hf_config=None)
        ),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])),
    )
    with pytest.raises(checked.WrongCaptureLayers, match="not in ascending order"):
        checked.check_draft_ids(model, [2, 30, 58], vllm_config, env={})
    _specforge(draft, [1, 29, 57], name="config.json")
    checked.check_draft_ids(model, [2, 30, 58], vllm_config, env={})  # sorted: starts


# Item 5 ------------------------------------------------------------------------------------


def test_use_aux_hidden_state_false(tmp_path, capsys):
    """Both engines then feed the draft the last hidden state and capture nothing
    (SGLang's spec_aux_hidden_state.py, vLLM's llm_base_proposer.py): the doctor says
    so instead of judging ids that are never used."""
    path = _specforge(tmp_path, [1, 29, 57], use_aux_hidden_state=False)
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
    )
    assert code == 0, out
    assert out.count("SGLang feeds the draft the target's last hidden state") == 4  # each line
    assert "vLLM feeds the draft the target's last hidden state" in out
    assert "layers_to_capture = [] -> OK" in out and "fix for this line" not in out
    # No ids and no trainer known (the ids would not be read): still OK, not UNVERIFIED.
    path.write_text(
        json.dumps(
            {"architectures": ["SomeDraftModel"], "eagle_config": {"use_aux_hidden_state": False}}
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
    )
    assert code == 0 and "summary: SGLang: OK; vLLM: OK (exit 0)" in out, out


def test_an_empty_id_list(tmp_path, capsys):
    """[] used to be refused as bad input (exit 2); it is a config both engines read:
    SGLang captures nothing, vLLM its defaults."""
    path = _specforge(tmp_path, [])
    code, out, err = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
    )
    assert code == 1 and err == ""
    assert "summary: SGLang: PROBLEM; vLLM: PROBLEM (exit 1)" in out
    assert "the draft config's id list is empty" in out


# Item 3 ------------------------------------------------------------------------------------


def test_a_format_sglang_cannot_load(capsys):
    """speculators' Eagle3Speculator: SGLang has no class for it. No eagle_config fix is
    offered for a file SGLang cannot load; vLLM loads it."""
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        SPECULATORS,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
    )
    assert code == 1 and "summary: SGLang: CANNOT LOAD; vLLM: OK (exit 1)" in out
    assert "SGLang cannot load this draft format" in out and "Serve it with vLLM" in out
    assert "Write eagle_config" not in out and "fix for this line" not in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        SPECULATORS,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--engine",
        "vllm",
    )
    assert code == 0


def _kimi_mla_draft(tmp_path):
    """A draft config in Kimi-K2.5's EAGLE-3 format (Eagle3DeepseekV2ForCausalLM, Model
    Optimizer's and TorchSpec's), SpecForge's default ids for 61 layers."""
    path = tmp_path / "kimi.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                "num_hidden_layers": 1,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
            }
        )
    )
    return path


def test_sglangs_registry_per_line(tmp_path, capsys):
    """SGLang's Kimi-K2.5 EAGLE-3 class (Eagle3DeepseekV2ForCausalLM, Model Optimizer's and
    TorchSpec's Kimi format) is in the 0.5.12 wheel and later, not in 0.5.9 - 0.5.11: the
    0.5.9 - 0.5.12 line cannot load the draft (0.5.12 alone can), the later ones judge its
    ids."""
    path = _kimi_mla_draft(tmp_path)
    # (DeepSeek-V3's class captures on every line; Kimi-K2.5's from 0.5.13, below)
    argv = [
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--engine",
        "sglang",
        "--id-convention",
        "output",
    ]
    code, out, _ = _doctor(capsys, *argv)
    assert code == 1 and "summary: SGLang: PROBLEM (exit 1)" in out
    assert (
        "0.5.12 (read from 0.5.9, 0.5.10, 0.5.11, 0.5.12): layers_to_capture: not reached "
        "(the draft does not load) -> CANNOT LOAD" in out
    )
    assert "registered from 0.5.12 on (not in 0.5.9, 0.5.10, 0.5.11)" in out
    assert out.count("layers_to_capture = [2, 30, 58] -> OK") == 3
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.12")
    assert code == 0 and "CANNOT LOAD" not in out
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.11")
    assert code == 1 and "registered from 0.5.12 on (not in 0.5.11)" in out


def test_a_target_class_that_cannot_capture_on_a_line(tmp_path, capsys):
    """SGLang 0.5.9's KimiK25ForConditionalGeneration has no set_eagle3_layers_to_capture
    (models/kimi_k25.py; the model runner calls it when EAGLE-3 is on): that line cannot
    serve any EAGLE-3 draft for Kimi-K2.5, whatever the ids or the draft's class. Both
    causes are said, the draft's first (no target or ids serve a draft the line cannot
    load); the remedy names where it can."""
    path = _kimi_mla_draft(tmp_path)
    argv = [
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
        "--engine",
        "sglang",
        "--id-convention",
        "output",
    ]
    code, out, _ = _doctor(capsys, *argv)
    assert code == 1 and "summary: SGLang: PROBLEM (exit 1)" in out
    # (0.5.10 - 0.5.12's class forwards the ids, models/kimi_k25.py:841 in 0.5.10; the
    # draft's class is registered from 0.5.12: the line cannot load it as a whole)
    assert (
        "0.5.12 (read from 0.5.9, 0.5.10, 0.5.11, 0.5.12): layers_to_capture: not reached "
        "(the draft does not load) -> CANNOT LOAD" in out
    )
    assert "registered from 0.5.12 on (not in 0.5.9, 0.5.10, 0.5.11)" in out  # the draft's
    assert out.index("registered from 0.5.12 on") < out.index(
        "SGLang 0.5.9: the target's class kimi_k25.KimiK25ForConditionalGeneration has no "
        "set_eagle3_layers_to_capture"
    )  # the target's, after
    assert "it can on SGLang 0.5.12; SGLang 0.5.13 - 0.5.23; vLLM 0.32.0, 0.33.0, 0.34.0" in out, (
        out
    )
    assert out.count("-> OK") == 3
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.9", explain=False)
    assert code == 1 and "summary: SGLang: CANNOT LOAD (exit 1)" in out
    assert "verdict (SGLang): CANNOT LOAD" in out
    assert "-> it loads, and the target captures, on SGLang 0.5.12; SGLang 0.5.13" in out, out
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.12")
    assert code == 0 and "CANNOT" not in out
    # --write-config: no ids fix it, said in one line
    code, _, err = _doctor(
        capsys, *argv, "--sglang-version", "0.5.9", "--write-config", tmp_path / "x.json"
    )
    assert code == 2 and "no id list fixes this draft" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_vllm_target_class_without_supports_eagle3(tmp_path, capsys):
    """vLLM 0.32 / 0.33's BailingMoeV2ForCausalLM (Ling-flash-2.0, models/bailing_moe.py) is
    not SupportsEagle3: the server raises at start-up; SGLang's class captures."""
    path = os.path.join(PUBLISHED, "specforge_ling_flash_2_0.config.json")
    argv = ["--num-layers", 32, "--target-architecture", "BailingMoeV2ForCausalLM"]
    code, out, _ = _doctor(capsys, "--draft-config", path, *argv, explain=False)
    assert code == 1 and "summary: SGLang: OK; vLLM: CANNOT CAPTURE (exit 1)" in out
    assert (
        "CANNOT CAPTURE (bailing_moe.BailingMoeV2ForCausalLM is not SupportsEagle3) -> it "
        "can on SGLang 0.5.9 - 0.5.23" in out
    )
    code, out, _ = _doctor(capsys, "--draft-config", path, *argv, "--engine", "vllm", "--json")
    line = json.loads(out)["engines"]["vllm"]["readings"][0]["lines"][0]
    assert line["status"] == "CANNOT CAPTURE"
    assert "Model does not support EAGLE3 interface" in line["detail"][0]
    # A draft that takes no aux states never asks the target to capture.
    config = json.load(open(path))
    config["eagle_config"] = {"use_aux_hidden_state": False}
    (tmp_path / "noaux.json").write_text(json.dumps(config))
    code, out, _ = _doctor(
        capsys, "--draft-config", tmp_path / "noaux.json", *argv, "--engine", "vllm"
    )
    assert code == 0 and "CANNOT" not in out


def test_a_delegating_class_gets_the_rule_it_delegates_to(tmp_path, capsys):
    """SGLang 0.5.23's Llama4ForConditionalGeneration (models/mllama4.py) hands the ids to
    a Llama4ForCausalLM, which inherits LlamaForCausalLM's +1: its rule, not ASSUMED."""
    path = tmp_path / "d.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 23, 44]},
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        48,
        "--target-architecture",
        "Llama4ForConditionalGeneration",
        "--engine",
        "sglang",
        "--sglang-version",
        "0.5.23",
        "--id-convention",
        "output",
    )
    assert code == 0 and "summary: SGLang: OK (exit 0)" in out and "ASSUME" not in out
    assert (
        "models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture (via "
        "Llama4ForCausalLM)" in out
    )
    assert "layers_to_capture = [2, 24, 45] -> OK" in out


# Item 6 ------------------------------------------------------------------------------------


def test_unverified_is_not_do_not_serve(tmp_path, capsys):
    """An unrecognised draft with no ids: UNVERIFIED, pointing at the probe; 'do not
    serve' is kept for PROBLEM."""
    path = tmp_path / "mystery.json"
    path.write_text(json.dumps({"architectures": ["SomeDraftModel"], "num_hidden_layers": 1}))
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
    )
    assert code == 1 and "summary: SGLang: UNVERIFIED; vLLM: UNVERIFIED (exit 1)" in out
    assert "eagle-capture probe" in out and "do not serve" not in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--accept-defaults",
    )
    assert code == 0 and "accepted (--accept-defaults)" in out


def test_a_deployment_problem_under_a_no_id_draft_is_a_problem(tmp_path, capsys):
    """A draft with no ids (its layers unknown: UNVERIFIED on its own) served where the
    deployment itself breaks the capture -- DP attention with DeepEP on SGLang 0.5.9 (its
    loop gathers the captures over the whole TP group) or a PP stage that does not hold
    the captured layers: PROBLEM, 'do not serve', whatever the draft was trained on;
    --accept-defaults does not make it OK."""
    path = tmp_path / "mystery.json"
    path.write_text(json.dumps({"architectures": ["SomeDraftModel"], "num_hidden_layers": 1}))
    base = [
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--engine",
        "sglang",
    ]
    for deploy in (
        [
            "--tp",
            8,
            "--dp-attention",
            "--moe-a2a",
            "deepep",
            "--sglang-version",
            "0.5.9",
            "--allreduce-fusion",
            "off",
        ],
        ["--pp", 2, "--sglang-version", "0.5.23"],
    ):
        for accept in ([], ["--accept-defaults"]):
            code, out, _ = _doctor(capsys, *base, *deploy, *accept)
            assert code == 1 and "summary: SGLang: PROBLEM (exit 1)" in out, (deploy, out)
            assert "verdict (SGLang): problems above; do not serve this as is" in out
    # The same draft, deployment fine: UNVERIFIED (the draft's layers are unknown).
    code, out, _ = _doctor(capsys, *base, "--tp", 8, "--sglang-version", "0.5.23")
    assert code == 1 and "summary: SGLang: UNVERIFIED (exit 1)" in out, out


def test_release_boundaries_are_inclusive(tmp_path, capsys):
    """gpt_oss keeps ids whose max is num_layers from 0.5.17 (the wheel read at exactly
    that version, models/gpt_oss.py:1335-1343); 0.5.16 still adds 1 and names a layer that
    does not exist."""
    path = _specforge(tmp_path, [1, 12, 24])
    argv = [
        "--draft-config",
        path,
        "--num-layers",
        24,
        "--target-architecture",
        "GptOssForCausalLM",
        "--engine",
        "sglang",
        "--id-convention",
        "input",
    ]
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.17")
    assert code == 0 and "layers_to_capture = [1, 12, 24] -> OK" in out
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.16")
    assert code == 1 and "layers_to_capture = [2, 13, 25] -> PROBLEM" in out


# Item 7 ------------------------------------------------------------------------------------


def test_json(capsys):
    path = os.path.join(PUBLISHED, "specforge_gpt_oss_20b.config.json")
    code = doctor.main(
        [
            "--draft-config",
            path,
            "--num-layers",
            "24",
            "--target-architecture",
            "GptOssForCausalLM",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == out["exit"] == 1
    assert out["trainer"] == "SpecForge" and out["ids"] == [1, 11, 21]
    assert out["engines"]["sglang"]["verdict"] == "OK"
    assert out["engines"]["vllm"]["verdict"] == "PROBLEM"
    v2, v1 = out["engines"]["vllm"]["readings"][0]["lines"]
    assert (v2["capture_layers"], v2["fix"], v2["decides"]) == ([2, 12, 21], [2, 12, 22], True)
    assert v1["decides"] is False


def test_write_config_applies_the_fix_where_the_engine_reads(tmp_path, capsys):
    """vLLM: the top-level key, nothing else changed; the written file then passes."""
    path = os.path.join(PUBLISHED, "specforge_gpt_oss_20b.config.json")
    out_path = tmp_path / "fixed.json"
    base = ["--num-layers", "24", "--target-architecture", "GptOssForCausalLM"]
    code, out, _ = _doctor(
        capsys, "--draft-config", path, *base, "--engine", "vllm", "--write-config", out_path
    )
    assert (
        code == 1
        and f"wrote {out_path} for vLLM: top-level eagle_aux_hidden_state_layer_ids = [2, 12, 22]"
        in out
    )
    original, written = json.load(open(path)), json.load(open(out_path))
    assert written.pop("eagle_aux_hidden_state_layer_ids") == [2, 12, 22]
    record = written.pop("eagle_capture")
    assert record["trained_capture_layers"] == [2, 12, 22]
    assert record["ids_written_for"].startswith("vLLM ")
    assert written == original
    code, out, _ = _doctor(capsys, "--draft-config", out_path, *base)
    assert code == 0 and "summary: SGLang: OK; vLLM: OK (exit 0)" in out


def test_write_config_for_sglang(tmp_path, capsys):
    """SGLang: eagle_config's key, its other keys kept (Kimi-K2.5's SpecForge draft
    from its 0.5.6 days, served by SGLang 0.5.23: [3, 31, 59])."""
    path = os.path.join(PUBLISHED, "specforge_kimi_k25.config.json")
    out_path = tmp_path / "fixed.json"
    base = [
        "--num-layers",
        "61",
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
        "--id-convention",
        "output",
        "--engine",
        "sglang",
    ]
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        *base,
        "--sglang-version",
        "0.5.23",
        "--write-config",
        out_path,
    )
    assert code == 1 and "eagle_config.eagle_aux_hidden_state_layer_ids = [3, 31, 59]" in out
    written = json.load(open(out_path))
    assert written["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [3, 31, 59],
        "use_aux_hidden_state": True,
    }
    assert written["eagle_capture"]["trained_capture_layers"] == [3, 31, 59]
    # The file now holds SGLang's ids for those layers, not SpecForge's, while SpecForge's
    # markers stay: checked again as a user would (no --id-convention), the recorded layers
    # decide, and the doctor's own fix is OK -- not AMBIGUOUS with a second shift proposed.
    again = [a for a in base if a not in ("--id-convention", "output")]
    code, out, _ = _doctor(capsys, "--draft-config", out_path, *again, "--sglang-version", "0.5.23")
    assert code == 0 and "summary: SGLang: OK (exit 0)" in out, out
    assert "trained on capture layers [3, 31, 59]" in out and "AMBIGUOUS" not in out
    # --write-config again on the fixed file: nothing to fix, nothing shifted twice.
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        out_path,
        *again,
        "--sglang-version",
        "0.5.23",
        "--write-config",
        tmp_path / "again.json",
    )
    assert code == 0 and "nothing to fix" in out
    assert json.load(open(tmp_path / "again.json")) == written


@pytest.mark.parametrize("ids", [[1, 1, 29], [2, 2, 30], [0, 0, 28]])
@pytest.mark.parametrize("convention", ["output", "input"])
def test_write_config_never_writes_duplicate_ids(tmp_path, capsys, ids, convention):
    """A draft whose ids name a layer twice: every engine captures a layer once, so no
    list feeds it; the doctor refuses to write one (it once wrote [1, 1, 29] and
    [29, 1, 1], right after saying duplicates starve a slot)."""
    out_path = tmp_path / "fixed.json"
    code, out, err = _doctor(
        capsys,
        "--draft-config",
        _specforge(tmp_path, ids),
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--engine",
        "sglang",
        "--sglang-version",
        "0.5.23",
        "--id-convention",
        convention,
        "--write-config",
        out_path,
    )
    assert code == 2 and "twice" in err and len(err.splitlines()) == 1, err
    assert not out_path.exists()


def test_an_edited_record_is_refused(tmp_path, capsys):
    path = tmp_path / "draft.json"
    for record in (
        {"trained_capture_layers": [3, 3, 59]},
        {"trained_capture_layers": "3"},
        {"trained_capture_layers": [-1, 3, 59]},
        [3, 31, 59],
    ):
        path.write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLMEagle3"],
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]},
                    "eagle_capture": record,
                }
            )
        )
        code, _, err = _doctor(capsys, "--draft-config", path, "--num-layers", 61)
        assert code == 2 and "eagle_capture.trained_capture_layers must be" in err, err


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--write-config needs one engine"),
        # (DeepSeek-V3: Kimi-K2.5's class cannot capture on 0.5.9, no ids fix that)
        (
            ["--engine", "sglang", "--target-architecture", "DeepseekV3ForCausalLM"],
            "the sglang lines need different ids",
        ),
        (
            ["--engine", "sglang", "--sglang-version", "0.5.23", "--id-convention", "auto"],
            "the verdict is AMBIGUOUS",
        ),
    ],
)
def test_write_config_refuses_what_it_cannot_decide(tmp_path, capsys, extra, message):
    path = os.path.join(PUBLISHED, "specforge_kimi_k25.config.json")
    argv = [
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
        "--write-config",
        tmp_path / "x.json",
        "--id-convention",
        "output",
        *extra,
    ]
    code, out, err = _doctor(capsys, *argv)
    assert code == 2 and message.lower() in err.lower() and len(err.splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


# Bad input (issue 47 item 5) -----------------------------------------------------------------


def _cli(*argv):
    """The doctor as a user runs it: a separate process (a traceback would show)."""
    return subprocess.run(
        [sys.executable, "-m", "eagle_capture.layer_ids.doctor", *map(str, argv)],
        capture_output=True,
        text=True,
    )


def test_bad_inputs_are_one_line_exit_2(tmp_path):
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x80\x81\xfe\xff" * 64)
    latin = tmp_path / "latin1.json"
    latin.write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    target = tmp_path / "target.json"
    target.write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096}
        )
    )
    draft = os.path.join(PUBLISHED, "specforge_llama3_70b.config.json")
    cases = [
        (["--draft-config", binary, "--num-layers", 32], "is not a text file (not UTF-8)"),
        (["--draft-config", latin, "--num-layers", 32], "is not a text file (not UTF-8)"),
        (
            ["--draft-config", "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B", "--num-layers", 32],
            "huggingface-cli download lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B config.json",
        ),
        (["--draft-config", target, "--num-layers", 32], "is a target model's config"),
        (["--draft-config", draft, "--target-config", draft], "pass it as --draft-config"),
        (
            ["--draft-config", draft, "--target-config", "meta-llama/Llama-3.3-70B-Instruct"],
            "huggingface-cli download meta-llama/Llama-3.3-70B-Instruct config.json",
        ),
    ]
    # Ids that name no layer of the target (a typo, not a deployment): one line, not a
    # 110-line analysis that calls -2 the embedding output.
    for ids, shown in [
        ([-2, 30, 58], "names -2,"),
        ([2, 30, 99], "names 99,"),
        ([2, 30, 10**30], "names 100000...(31 digits),"),
    ]:
        bad = tmp_path / f"bad{ids[-1] % 97}{ids[0]}.json"
        bad.write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLMEagle3"],
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
                }
            )
        )
        cases.append(
            (
                ["--draft-config", bad, "--num-layers", 61],
                f"{shown} not a layer of a 61-layer target",
            )
        )
    for argv, message in cases:
        run = _cli(*argv)
        assert run.returncode == 2, (argv, run.stdout, run.stderr)
        assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert "Traceback" not in run.stderr and run.stdout == ""


def test_a_file_or_its_folder_either_way(tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(
        open(os.path.join(PUBLISHED, "specforge_llama3_70b.config.json")).read()
    )
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80, "hidden_size": 8192}
        )
    )
    for d in (folder, folder / "config.json"):
        for t in (target, target / "config.json"):
            run = _cli("--draft-config", d, "--target-config", t)
            assert run.returncode == 0, run.stderr


# Item 8 ------------------------------------------------------------------------------------


def test_deepspec_top_level_target_layer_ids(tmp_path, capsys):
    """DeepSpec writes its ids as a top-level target_layer_ids (its build_draft_config)
    and trains on each named layer's output (run_target_forward_with_hooks). vLLM's V2
    runner reads them + 1 (right); SGLang's EAGLE-3 target and vLLM's V1 runner read
    none (their 3 defaults for a 5-layer draft)."""
    path = tmp_path / "deepspec.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["Qwen3DSparkModel"],
                "model_type": "qwen3",
                "num_hidden_layers": 5,
                "num_target_layers": 36,
                "hidden_size": 4096,
                "target_layer_ids": [1, 9, 17, 25, 33],
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        36,
        "--target-architecture",
        "Qwen3ForCausalLM",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 1 and "summary: SGLang: PROBLEM; vLLM: OK (exit 1)" in out
    assert "trainer: DeepSpec (recognised from top-level target_layer_ids" in out
    assert "trained on capture layers [2, 10, 18, 26, 34]" in out
    assert "aux_hidden_state_layers = [2, 10, 18, 26, 34] -> OK" in out
    assert "vLLM's V1 runner reads no target_layer_ids" in out
    assert (
        "fix for this line: eagle_config.eagle_aux_hidden_state_layer_ids = [1, 9, 17, 25, 33]"
        in out
    )


def test_torchspec_export_is_credited_to_torchspec(tmp_path, capsys):
    """A TorchSpec export (its convert_to_hf adds _torchspec_version) is TorchSpec's, and
    with no ids it trains on its default, the engines' default layers: OK."""
    config = json.load(open(os.path.join(PUBLISHED, "torchspec_kimi_k25.config.json")))
    config["_torchspec_version"] = "0.1.0"
    path = tmp_path / "exported.json"
    path.write_text(json.dumps(config))
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 0 and "trainer: TorchSpec (recognised from _torchspec_version)" in out
    assert (
        "TorchSpec's get_default_eagle3_aux_layer_ids takes the outputs of layers "
        "[1, 29, 57]" in out
    )


def test_a_reader_that_stops_early_gets_no_traceback():
    """`eagle-capture doctor ... | head -1`: the pipe closes under the doctor."""
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle_capture.layer_ids.doctor",
            "--draft-config",
            os.path.join(PUBLISHED, "specforge_kimi_k25.config.json"),
            "--num-layers",
            "61",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert run.stdout.readline().startswith(b"summary: ")
    run.stdout.close()
    assert run.wait(timeout=120) == 1 and b"Traceback" not in run.stderr.read()


def test_every_doctor_transcript_in_the_docs_is_current(capsys):
    """Each `$ eagle-capture doctor ...` block of docs/doctor.md is what the doctor prints
    now, with the exit status its verdict line says (tools/update_readme_examples.py
    rewrites them)."""
    import re

    text = open(os.path.join(HERE, "..", "docs", "doctor.md")).read()
    blocks = re.findall(r"```\n\$ eagle-capture doctor ([^\n]*)\n(.*?)```", text, re.S)
    assert len(blocks) >= 12
    cwd = os.getcwd()
    os.chdir(os.path.join(HERE, ".."))
    try:
        for argv, shown in blocks:
            code = doctor.main(argv.split())
            out = capsys.readouterr().out
            assert out == shown, argv
            assert f"(exit {code})" in out.splitlines()[0], argv
    finally:
        os.chdir(cwd)


def test_a_deployment_that_runs_eagle_capture(capsys):
    """The seed's deployment: Kimi-K2.5 at TP 8 on SGLang 0.5.9 - 0.5.13 with the FlashInfer
    all-reduce fusion on (auto on Hopper), the right ids. SGLang's own capture holds per-rank
    partial sums there: PROBLEM, exit 1 -- unless the server runs eagle-capture's capture
    (--capture eagle-capture, or its alias --eagle-capture), which captures the reduced value:
    OK, exit 0. Every line naming eagle-capture's capture says how it is switched on. A problem
    eagle-capture's capture shares (Kimi-K2.5 cannot capture on 0.5.9 at all) stays one."""
    base = [
        "--draft-config",
        os.path.join(PUBLISHED, "specforge_kimi_k25.config.json"),
        "--num-layers",
        61,
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
        "--id-convention",
        "input",
        "--engine",
        "sglang",
        "--tp",
        8,
    ]
    code, out, _ = _doctor(capsys, *base, "--sglang-version", "0.5.13", explain=False)
    assert code == 1 and "PROBLEM: per-rank partial sums under the all-reduce fusion" in out
    assert "or eagle-capture's capture (EAGLE_CAPTURE=1)" in out
    for how in (["--capture", "eagle-capture"], ["--eagle-capture"]):
        code, out, _ = _doctor(capsys, *base, "--sglang-version", "0.5.13", *how, explain=False)
        flat = " ".join(out.split())
        assert code == 0 and "summary: SGLang: OK (exit 0)" in out, out
        assert (
            "OK with eagle-capture's capture (switched on by EAGLE_CAPTURE=1 in the "
            "server's environment, the package installed) (SGLang's own capture alone: "
            "per-rank partial sums" in flat
        ), out
        assert (
            "with eagle-capture's capture switched on (EAGLE_CAPTURE=1 in the server's "
            "environment)" in flat
        ), out
        for explain in (False, True):
            code, out, _ = _doctor(
                capsys, *base, "--sglang-version", "0.5.13", *how, explain=explain
            )
            named = re.findall(r"eagle-capture's (?:capture|vLLM plugin)(.{0,40})", out)
            assert named and all(
                re.match(
                    r" \(switched on by EAGLE_CAPTURE=1|: EAGLE_CAPTURE=1|"
                    r" \(EAGLE_CAPTURE=1| switched on \(EAGLE_CAPTURE=1",
                    after,
                )
                for after in named
            ), named
            assert "drop-in" not in out
    code, out, _ = _doctor(
        capsys, *base, "--sglang-version", "0.5.9", "--eagle-capture", explain=False
    )
    assert code == 1 and "CANNOT CAPTURE" in out and "has no set_eagle3_layers_to_capture" in out
    # 0.5.9 - 0.5.12 have no plugin system: the words say the manual install there.
    code, out, _ = _doctor(
        capsys,
        *base[:-2],
        "--sglang-version",
        "0.5.9",
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--tp",
        8,
        "--capture",
        "eagle-capture",
    )
    assert "calling eagle_capture's install_eagle3_capture in your launcher" in " ".join(
        out.split()
    ), out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--capture", "vllm", "--engine", "sglang"], "--capture vllm is vllm's capture"),
        (["--capture", "return-aux", "--engine", "vllm"], "--capture return-aux is sglang's"),
        (["--capture", "nonsense"], "expected engine, sglang, vllm, eagle-capture or return-aux"),
        (["--capture", "sglang", "--eagle-capture"], "not allowed with argument"),
        (["--return-aux-hidden-state-layer-ids", "1", "2"], "pass --capture return-aux with it"),
        (
            ["--capture", "return-aux", "--sglang-version", "0.5.22"],
            "SGLang 0.5.22 has no --enable-return-aux",
        ),
    ],
)
def test_capture_refusals(capsys, argv, message):
    try:
        code, out, err = _doctor(
            capsys,
            "--draft-config",
            os.path.join(PUBLISHED, "specforge_kimi_k25.config.json"),
            "--num-layers",
            61,
            *argv,
        )
    except SystemExit as e:  # argparse's own refusal: usage and one error line
        code, err = e.code, capsys.readouterr().err
    assert code == 2 and message.lower() in err.lower(), err
    assert "Traceback" not in err


def test_sglang_capture_only_mode(tmp_path, capsys):
    """SGLang 0.5.23's --enable-return-aux-hidden-states (--capture return-aux): no draft is
    loaded; the ids of --return-aux-hidden-state-layer-ids go through the target class's own
    set_eagle3_layers_to_capture (absent: its defaults), judged against the layers the draft
    config says it was trained on; SGLang's start-up refusals said as such; the fix is the
    command-line ids, never a config to write."""
    kimi = os.path.join(PUBLISHED, "specforge_kimi_k25.config.json")  # trained on [3, 31, 59]
    base = [
        "--draft-config",
        kimi,
        "--num-layers",
        61,
        "--id-convention",
        "output",
        "--capture",
        "return-aux",
    ]
    deepseek = base + ["--target-architecture", "KimiK25ForConditionalGeneration"]
    # DeepseekV2's rule (0.5.23: +1 only when ids[0] == 1): 3 31 59 captures [3, 31, 59].
    code, out, _ = _doctor(
        capsys, *deepseek, "--return-aux-hidden-state-layer-ids", 3, 31, 59, explain=False
    )
    assert code == 0 and "summary: SGLang: OK (exit 0)" in out, out
    assert "captures [3, 31, 59]: OK" in out and "vLLM" not in out
    assert (
        "reads --return-aux-hidden-state-layer-ids from its command line: [3, 31, 59], "
        "never the draft config" in " ".join(out.split())
    )
    # The draft's own ids [2, 30, 58] passed as is: one layer early; the fix is the flag.
    code, out, _ = _doctor(
        capsys, *deepseek, "--return-aux-hidden-state-layer-ids", 2, 30, 58, explain=False
    )
    assert (
        code == 1
        and "captures [2, 30, 58]: PROBLEM -> --return-aux-hidden-state-layer-ids 3 31 59"
        in " ".join(out.split())
    ), out
    # Absent: the model's defaults [2, 30, 58].
    code, out, _ = _doctor(capsys, *deepseek, explain=False)
    assert code == 1 and "absent (the model's defaults)" in out and "captures [2, 30, 58]" in out
    # Llama's rule (+1 to every id): 2 30 58 captures [3, 31, 59].
    llama = base + ["--target-architecture", "LlamaForCausalLM"]
    code, out, _ = _doctor(
        capsys, *llama, "--return-aux-hidden-state-layer-ids", 2, 30, 58, explain=False
    )
    assert code == 0 and "captures [3, 31, 59]: OK" in out, out
    # SGLang's refusals: repeat, negative, >= the layer count, PP > 1.
    for ids, said in (
        ([2, 2, 58], "must not repeat a layer, got [2, 2, 58]"),
        ([-1, 30, 58], "must be non-negative"),
        ([2, 30, 61], "[61] out of range for a target with 61 layers"),
    ):
        code, out, _ = _doctor(
            capsys, *llama, "--return-aux-hidden-state-layer-ids", *ids, explain=False
        )
        flat = " ".join(out.split())
        assert (
            code == 1
            and f"PROBLEM (SGLang refuses to start: --return-aux-hidden-state-layer-ids {said}"
            in flat
        ), out
        assert "-> --return-aux-hidden-state-layer-ids 2 30 58" in flat, out
    code, out, _ = _doctor(
        capsys, *llama, "--return-aux-hidden-state-layer-ids", 2, 30, 58, "--pp", 2, explain=False
    )
    assert code == 1 and "only supports pp_size == 1" in out, out
    # A target class without the method cannot capture in this mode either.
    code, out, _ = _doctor(
        capsys, *base, "--target-architecture", "BaichuanForCausalLM", explain=False
    )
    assert code == 1 and "summary: SGLang: CANNOT CAPTURE (exit 1)" in out, out
    # No config to write: the ids are SGLang's command line.
    code, _, err = _doctor(capsys, *llama, "--write-config", tmp_path / "x.json")
    assert code == 2 and "reads its ids from SGLang's command line" in err
    # --json says how the server captures.
    code, out, _ = _doctor(
        capsys, *llama, "--return-aux-hidden-state-layer-ids", 2, 30, 58, "--json"
    )
    answer = json.loads(out)
    assert answer["capture"] == "return-aux" and list(answer["engines"]) == ["sglang"]
    assert answer["engines"]["sglang"]["readings"][0]["lines"][0]["capture_layers"] == [3, 31, 59]


def test_a_draft_class_no_engine_registers_cannot_load(tmp_path, capsys):
    """An EAGLE-3 draft architecture that no release read of either engine registers
    (the engine facts: SGLang's EntryClass, vLLM's registry) is not passed as loadable."""
    path = tmp_path / "draft.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["Eagle3Qwen3MoeForCausalLM"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 23, 44]},
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        48,
        "--target-architecture",
        "Qwen3MoeForCausalLM",
    )
    assert code == 1 and "summary: SGLang: CANNOT LOAD; vLLM: CANNOT LOAD (exit 1)" in out
    assert "no SGLang model class is registered as Eagle3Qwen3MoeForCausalLM" in out
    assert "no vLLM EAGLE-3 model is registered as Eagle3Qwen3MoeForCausalLM" in out
    # (four SGLang lines; vLLM's two runners, which read these nested ids differently)
    assert out.count("No release read of either engine registers it") == 6
    # A registered one, on both engines:
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 23, 44]},
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        48,
        "--target-architecture",
        "Qwen3MoeForCausalLM",
    )
    assert "CANNOT LOAD" not in out


def test_a_class_some_releases_of_a_line_lack(tmp_path, capsys):
    """SGLang registers Qwen3_5ForCausalLM from 0.5.17 (models/qwen3_5_text.py), with a
    set_eagle3_layers_to_capture from 0.5.22: earlier lines serve it, if at all, through
    the Transformers fallback (no method): CANNOT CAPTURE; the 0.5.17 - 0.5.23 line is a
    PROBLEM on its first five releases; --sglang-version picks the release."""
    path = tmp_path / "d.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 23, 44]},
            }
        )
    )
    argv = [
        "--draft-config",
        path,
        "--num-layers",
        48,
        "--target-architecture",
        "Qwen3_5ForCausalLM",
        "--engine",
        "sglang",
        "--id-convention",
        "output",
    ]
    code, out, _ = _doctor(capsys, *argv, explain=False)
    assert (
        code == 1
        and out.count(
            "CANNOT CAPTURE (Qwen3_5ForCausalLM is registered from "
            "0.5.17 on) -> it can on SGLang 0.5.22, 0.5.23"
        )
        == 3
    )
    assert (
        "captures [2, 24, 45]: PROBLEM (qwen3_5_text.Qwen3_5ForCausalLM has no "
        "set_eagle3_layers_to_capture on 0.5.17, 0.5.18, 0.5.19, 0.5.20, 0.5.21; 0.5.22, "
        "0.5.23 capture)" in out
    )
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.20", explain=False)
    assert code == 1 and "summary: SGLang: CANNOT CAPTURE (exit 1)" in out
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.22")
    assert code == 0 and "layers_to_capture = [2, 24, 45] -> OK" in out


def test_a_loop_that_captures_the_final_boundary(tmp_path, capsys):
    """SpecForge ids ending at the last layer's output (output convention: [1, 12, 25] of
    26 layers -> capture layers [2, 13, 26]). Gemma 3's SGLang loop captures after its last
    layer (the engine facts): OK on 0.5.12 - 0.5.16; from 0.5.17 its loop captures each
    layer's branch output, not the residual stream: CANNOT CAPTURE. Gemma 4's multimodal
    class hands the ids to its text model, whose loop captures layer 26 too: OK. Llama's
    does not capture layer 26: it never happens and SGLang's first forward fails."""
    path = _specforge(tmp_path, [1, 12, 25])
    base = ["--draft-config", path, "--num-layers", 26, "--engine", "sglang"]
    base += ["--id-convention", "output", "--sglang-version"]
    said = {
        (arch, version): _doctor(
            capsys, *base, version, "--target-architecture", arch, explain=False
        )[:2]
        for arch, version in (
            ("Gemma3ForCausalLM", "0.5.13"),
            ("Gemma3ForCausalLM", "0.5.23"),
            ("LlamaForCausalLM", "0.5.23"),
            # Gemma 4's multimodal class: the ids go to its text model in another module
            ("Gemma4ForConditionalGeneration", "0.5.13"),
            ("Gemma4ForConditionalGeneration", "0.5.23"),
        )
    }
    for version in ("0.5.13", "0.5.23"):
        code, out = said["Gemma4ForConditionalGeneration", version]
        assert code == 0 and "captures [2, 13, 26]: OK" in out, out
    code, out = said["Gemma3ForCausalLM", "0.5.13"]
    assert code == 0 and "captures [2, 13, 26]: OK" in out, out
    code, out = said["Gemma3ForCausalLM", "0.5.23"]
    assert code == 1 and "captures a layer's branch output, not the residual stream" in out, out
    # Read in the code, and measured running it (data/capture_tensors.json): --explain
    # says both.
    code, out, _ = _doctor(
        capsys, *base, "0.5.23", "--target-architecture", "Gemma3ForCausalLM", explain=True
    )
    assert "(measured in 0.5.23's own model code against transformers' hidden_states: " in out
    assert "the draft receives the pre-residual output)" in " ".join(out.split()), out
    code, out = said["LlamaForCausalLM", "0.5.23"]
    assert code == 1 and "captures [2, 13, 26]: PROBLEM (FAILS at the first forward" in out, out


def test_a_line_measured_to_capture_another_tensor(tmp_path, capsys, monkeypatch):
    """Right ids, wrong tensor: a line whose capture was measured (its model code on CPU
    against transformers' hidden_states, data/capture_tensors.json) to hold another tensor
    than the residual stream is a PROBLEM that names the tensor and says no id fixes it;
    --write-config refuses. (Measured so: Gemma 3 from SGLang 0.5.18, which the engine facts
    already call CANNOT CAPTURE; here a Llama line is made to say it.)"""
    from eagle_capture.layer_ids import tensors

    path = _specforge(tmp_path, [1, 23, 44])
    argv = [
        "--draft-config",
        path,
        "--num-layers",
        48,
        "--target-architecture",
        "LlamaForCausalLM",
        "--engine",
        "sglang",
        "--id-convention",
        "output",
    ]
    measured = tensors.load()
    assert measured["sglang"]["0.5.23"]["LlamaForCausalLM"] == tensors.RESIDUAL
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.23", explain=False)
    assert code == 0 and "WRONG TENSOR" not in out, out
    wrong = json.loads(json.dumps(measured))
    wrong["sglang"]["0.5.23"]["LlamaForCausalLM"] = "normed input"
    monkeypatch.setattr(tensors, "load", lambda path=tensors.DATA: wrong)
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.23", explain=False)
    assert (
        code == 1
        and "captures [2, 24, 45]: PROBLEM (captures the normed input, not the "
        "residual stream; no id fixes it: serve with SGLang 0.5.9, 0.5.13, "
        "0.5.18, 0.5.20, 0.5.22 (measured"
        in out
    ), out
    assert "write [" not in out
    code, out, _ = _doctor(capsys, *argv, "--sglang-version", "0.5.23")
    assert "WRONG TENSOR: SGLang 0.5.23: the normed input" in out, out
    # Without --sglang-version only the line holding 0.5.23 says it.
    code, out, _ = _doctor(capsys, *argv, explain=False)
    assert code == 1 and out.count("captures the normed input") == 1, out
    code, _, err = _doctor(
        capsys, *argv, "--sglang-version", "0.5.23", "--write-config", tmp_path / "x.json"
    )
    assert code == 2 and len(err.splitlines()) == 1, err
    assert (
        "no id list fixes this draft on SGLang (0.5.17 - 0.5.23: captures the normed input, "
        "not the residual stream; no id fixes it" in err
    ), err
    # vLLM's lines the same way (its measured releases: 0.32.0, 0.34.0).
    assert measured["vllm"]["0.34.0"]["LlamaForCausalLM"] == tensors.RESIDUAL
    wrong["vllm"]["0.34.0"]["LlamaForCausalLM"] = "pre-residual output"
    code, out, _ = _doctor(
        capsys, *argv[:-4], "--engine", "vllm", "--id-convention", "input", explain=False
    )
    assert (
        code == 1
        and "captures the pre-residual output, not the residual stream; no id "
        "fixes it: serve with vLLM 0.32.0"
        in out
    ), out


# vLLM's Transformers modeling backend --------------------------------------------------------


def test_vllm_without_a_class_of_its_own_says_its_transformers_backend_serves_it(tmp_path, capsys):
    """A target vLLM registers no class for (Hunyuan's dense model, which SGLang registers
    without set_eagle3_layers_to_capture): vLLM serves it through its Transformers modeling
    backend, SupportsEagle3 with vLLM's own id rule (read from each wheel). The vLLM
    verdict says so, and SGLang's CANNOT CAPTURE points there instead of saying no engine
    can. A class vLLM registers gets no such note; a name no engine registers is flagged."""
    path = tmp_path / "draft.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    said = {}
    for arch in ("HunYuanDenseV1ForCausalLM", "Qwen3ForCausalLM", "FooBarForCausalLM"):
        argv = ["--draft-config", path, "--num-layers", 32, "--target-architecture", arch]
        said[arch] = _doctor(capsys, *argv)[1]
    assert (
        "vLLM 0.32.0, 0.33.0, 0.34.0 register no model class of their own as "
        "HunYuanDenseV1ForCausalLM: vLLM serves it, if at all, through its Transformers "
        "modeling backend (transformers.TransformersForCausalLM, SupportsEagle3 through "
        "transformers.base.Base" in said["HunYuanDenseV1ForCausalLM"]
    )
    hunyuan = said["HunYuanDenseV1ForCausalLM"]
    assert "it can on vLLM 0.32.0, 0.33.0, 0.34.0 through its Transformers modeling" in hunyuan
    assert "no SGLang or vLLM release read can" not in hunyuan
    assert "check it" not in hunyuan  # SGLang registers the name
    assert "Transformers modeling backend" not in said["Qwen3ForCausalLM"]
    assert (
        "as FooBarForCausalLM (no engine registers the name: check it)" in said["FooBarForCausalLM"]
    )


def _speculators(tmp_path, ids, model_type="llama", **layer):
    """A speculators-format draft (its layout: the ids at the top level, the draft's
    layer in transformer_layer_config), as speculators' issue 1065 posted one."""
    path = tmp_path / f"speculators_{model_type}_{len(ids)}.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["Eagle3DraftModel"],
                "speculators_model_type": "eagle3",
                "speculators_version": "0.8.0.dev0",
                "speculators_config": {"algorithm": "eagle3"},
                "eagle_aux_hidden_state_layer_ids": ids,
                "transformer_layer_config": {
                    "model_type": model_type,
                    "hidden_size": 4096,
                    **layer,
                },
            }
        )
    )
    return path


def test_vllm_cannot_load_a_draft_whose_fc_it_sizes_otherwise(tmp_path, capsys):
    """A speculators Llama draft trained on 4 states (ids at the top level): vLLM's
    Eagle3LlamaForCausalLM sizes its fc from num_aux_hidden_states, else eagle_config's
    ids, else 3 (read in each wheel), so the checkpoint's fc does not load: CANNOT LOAD,
    fix the count in transformer_layer_config. It said OK (exit 0). With the count, or
    as a Qwen3 draft (whose class reads the top-level ids), it loads."""
    base = ["--num-layers", 94, "--target-architecture", "Qwen3MoeForCausalLM"]
    base += ["--engine", "vllm"]
    path = _speculators(tmp_path, [2, 46, 91, 93])
    code, out, _ = _doctor(capsys, "--draft-config", path, *base)
    assert code == 1 and "summary: vLLM: CANNOT LOAD (exit 1)" in out, out
    assert (
        "vLLM cannot load this draft, its fc trained on 4 hidden states ([2, 46, 91, 93]) "
        "and vLLM's Eagle3LlamaForCausalLM sized for 3: models/llama_eagle3.py:216 (0.34.0) "
        "takes the count from num_aux_hidden_states, else "
        "eagle_config.eagle_aux_hidden_state_layer_ids, else 3" in out
    ), out
    assert 'Fix: add "num_aux_hidden_states": 4 in transformer_layer_config' in out
    # The header says the ids vLLM reads even where the draft does not load.
    assert "vLLM reads the top-level eagle_aux_hidden_state_layer_ids: [2, 46, 91, 93]" in out
    for fixed in (
        _speculators(tmp_path, [2, 46, 91, 93], num_aux_hidden_states=4),
        _speculators(tmp_path, [2, 46, 91, 93], model_type="qwen3"),
    ):
        code, out, _ = _doctor(capsys, "--draft-config", fixed, *base)
        assert code == 0 and "CANNOT LOAD" not in out, out
    # SGLang's format with 4 ids in eagle_config: vLLM's class reads them.
    code, out, _ = _doctor(capsys, "--draft-config", _specforge(tmp_path, [1, 45, 90, 92]), *base)
    assert "CANNOT LOAD" not in out, out


def test_longcat_flash_counts_its_layers_in_num_layers(tmp_path, capsys):
    """LongCat-Flash's config names num_layers (28) and no num_hidden_layers; both engines
    read num_layers (the engine facts). The doctor read only num_hidden_layers and refused
    the config (exit 2). SpecForge's LongCat template (no ids, trained through SGLang's
    defaults) is then OK on SGLang: [2, 14, 25]."""
    draft = os.path.join(
        os.path.dirname(__file__),
        "data",
        "published_configs",
        "specforge_longcat_flash.config.json",
    )
    fields = {"architectures": ["LongcatFlashForCausalLM"], "hidden_size": 6144, "num_layers": 28}
    for model_type in ({"model_type": "longcat_flash"}, {}):  # its own copy names none
        target = tmp_path / "target.json"
        target.write_text(json.dumps({**fields, **model_type}))
        code, out, _ = _doctor(
            capsys, "--draft-config", draft, "--target-config", target, "--engine", "sglang"
        )
        assert code == 0 and "(LongcatFlashForCausalLM, 28 layers, hidden size 6144)" in out, out
        assert "layers_to_capture = [2, 14, 25] -> OK" in out, out


@pytest.mark.parametrize(
    "config, target",
    [
        # an empty id list, no trainer's markers
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [], "norm_before_fc": True}}, {}),
        # counts and ids of the wrong type where vLLM sizes the fc
        (
            {
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 16, 28]},
                "num_aux_hidden_states": "three",
            },
            {},
        ),
        (
            {
                "speculators_config": {"algorithm": "eagle3"},
                "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
                "transformer_layer_config": {"model_type": ["llama"]},
            },
            {},
        ),
        # a target whose model_type is not a name
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}},
            {"model_type": ["llama"]},
        ),
    ],
)
def test_odd_values_get_an_answer_not_a_traceback(tmp_path, capsys, config, target):
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **config}))
    target_path = tmp_path / "target.json"
    target_path.write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, **target})
    )
    code, out, err = _doctor(capsys, "--draft-config", draft, "--target-config", target_path)
    assert code in (0, 1, 2) and "Traceback" not in out + err, (out, err)
    assert out or err.startswith("error: "), err


def test_vllm_fc_fix_names_the_count_its_class_reads_first(tmp_path, capsys):
    """The count is read before the ids (so 3 beats 4 ids), and the fix sets the count
    the draft's class reads first: Llama's num_aux_hidden_states (there already: set);
    Qwen3's num_aux_layers. A draft with no aux states builds no fc: nothing to load."""
    base = ["--num-layers", 32, "--target-architecture", "LlamaForCausalLM", "--engine", "vllm"]
    counted = tmp_path / "counted.json"
    eagle = {"eagle_aux_hidden_state_layer_ids": [1, 8, 16, 28]}
    counted.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": eagle,
                "num_aux_hidden_states": 3,
            }
        )
    )
    code, out, _ = _doctor(capsys, "--draft-config", counted, *base)
    assert code == 1 and "Eagle3LlamaForCausalLM sized for 3" in out, out
    assert 'Fix: set "num_aux_hidden_states": 4 in the draft config' in out, out
    qwen3 = _speculators(tmp_path, [2, 9, 17, 29], model_type="qwen3", num_aux_hidden_states=3)
    code, out, _ = _doctor(capsys, "--draft-config", qwen3, *base)
    assert "Eagle3Qwen3ForCausalLM sized for 3" in out, out
    assert 'Fix: add "num_aux_layers": 4 in transformer_layer_config' in out, out
    no_aux = tmp_path / "no_aux.json"
    no_aux.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {**eagle, "use_aux_hidden_state": False},
            }
        )
    )
    code, out, _ = _doctor(capsys, "--draft-config", no_aux, *base)
    assert "CANNOT LOAD" not in out, out


def test_a_draft_no_engine_loads_is_cannot_load_whatever_the_target(tmp_path, capsys):
    """A draft class no release read registers (SpecForge's Qwen3MoeForCausalLMEagle3
    template) for a target that cannot capture on some SGLang lines (Qwen3.5's, before
    0.5.22): every line says CANNOT LOAD, on both engines and for any --sglang-version,
    and nothing sends the user to a release where the draft does not load."""
    path = tmp_path / "moe_draft.json"
    path.write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLMEagle3"]}))
    argv = ["--draft-config", path, "--num-layers", 48]
    argv += ["--target-architecture", "Qwen3_5MoeForConditionalGeneration"]
    code, out, _ = _doctor(capsys, *argv)
    assert code == 1 and "summary: SGLang: CANNOT LOAD; vLLM: CANNOT LOAD (exit 1)" in out, out
    # where the target captures is said, with the draft loading on none of them
    assert (
        "it can on SGLang 0.5.22, 0.5.23; vLLM 0.32.0, 0.33.0, 0.34.0 (of the releases "
        "read), none of which loads this draft" in out
    ), out
    assert "it loads" not in out
    for version in ("0.5.9", "0.5.13", "0.5.23"):
        code, out, _ = _doctor(
            capsys, *argv, "--engine", "sglang", "--sglang-version", version, explain=False
        )
        assert code == 1 and "summary: SGLang: CANNOT LOAD (exit 1)" in out, (version, out)


def test_the_remedy_names_only_releases_that_load_the_draft(tmp_path, capsys):
    """A speculators draft (vLLM loads it, SGLang does not) for Qwen3.5: SGLang's lines
    cannot load it; where the target captures and the draft loads is vLLM only."""
    config = json.load(open(SPECULATORS))
    config["eagle_aux_hidden_state_layer_ids"] = [2, 24, 45]
    path = tmp_path / "speculators.json"
    path.write_text(json.dumps(config))
    argv = ["--draft-config", path, "--num-layers", 48]
    argv += ["--target-architecture", "Qwen3_5MoeForConditionalGeneration"]
    code, out, _ = _doctor(capsys, *argv, "--engine", "sglang", explain=False)
    assert code == 1 and "summary: SGLang: CANNOT LOAD (exit 1)" in out, out
    assert "-> it loads, and the target captures, on vLLM 0.32.0, 0.33.0, 0.34.0" in out, out
    assert "SGLang 0.5.22" not in out


def test_write_config_applies_a_load_edit(tmp_path, capsys):
    """Where only the config stands between the engine and the draft, --write-config
    writes the edit the fix names, and the written file passes: SGLang, a SafeAILab
    EAGLE-3 config (architectures LlamaForCausalLM, SGLang's target class) renamed to
    LlamaForCausalLMEagle3; vLLM, a speculators draft with 4 ids, the count its class
    reads written into transformer_layer_config (vLLM's own class built from such a
    file: tests/test_vllm_real.py)."""
    safeailab = tmp_path / "safeailab.json"
    one_layer = {"num_hidden_layers": 1, "draft_vocab_size": 32000, "hidden_size": 4096}
    safeailab.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **one_layer}))
    fixed = tmp_path / "fixed.json"
    argv = ["--num-layers", 32, "--target-architecture", "LlamaForCausalLM"]
    code, out, _ = _doctor(
        capsys, "--draft-config", safeailab, *argv, "--engine", "sglang", "--write-config", fixed
    )
    assert code == 1 and 'architectures = ["LlamaForCausalLMEagle3"]' in out, out
    written = json.load(open(fixed))
    assert written.pop("architectures") == ["LlamaForCausalLMEagle3"]
    assert written.pop("eagle_capture")["trained_capture_layers"] == [2, 16, 29]
    assert written == {**one_layer}
    code, out, _ = _doctor(capsys, "--draft-config", fixed, *argv)
    assert code == 0 and "summary: SGLang: OK; vLLM: OK (exit 0)" in out, out

    config = json.load(open(SPECULATORS))
    config["eagle_aux_hidden_state_layer_ids"] = [2, 30, 45, 58]
    four = tmp_path / "four.json"
    four.write_text(json.dumps(config))
    argv = ["--num-layers", 61, "--target-architecture", "DeepseekV3ForCausalLM"]
    code, out, _ = _doctor(
        capsys, "--draft-config", four, *argv, "--engine", "vllm", "--write-config", fixed
    )
    assert code == 1 and "transformer_layer_config.num_aux_hidden_states = 4" in out, out
    written = json.load(open(fixed))
    assert written["transformer_layer_config"].pop("num_aux_hidden_states") == 4
    assert written.pop("eagle_capture")["trained_capture_layers"] == [2, 30, 45, 58]
    assert written == config
    code, out, _ = _doctor(capsys, "--draft-config", fixed, *argv, "--engine", "vllm")
    assert code == 0 and "summary: vLLM: OK (exit 0)" in out, out
    # A draft no config edit serves (no engine registers its class): refused, one line.
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLMEagle3"]}))
    code, _, err = _doctor(
        capsys, "--draft-config", moe, *argv, "--engine", "vllm", "--write-config", fixed
    )
    assert code == 2 and "no id list fixes this draft" in err and len(err.splitlines()) == 1


def test_ids_naming_the_embedding_point_at_the_probe(tmp_path, capsys):
    """The field's case: Kimi-K2.5's draft config edited to [-1, 2, 30] (id -1: the
    embedding output, which its training never saw). The short answer says the ids
    probably were edited and names the probe; --write-config writes no embedding
    capture without --allow-embedding, and then only for the lines that can take it."""
    examples = os.path.join(HERE, "..", "examples")
    argv = [
        "--draft-config",
        os.path.join(examples, "kimi_k25_draft_config.json"),
        "--target-config",
        os.path.join(examples, "kimi_k25_target_config.json"),
        "--engine",
        "sglang",
    ]
    hint = "id -1 names the embedding output, which drafts are rarely trained on"
    code, out, _ = _doctor(capsys, *argv, explain=False)
    assert code == 1 and hint in out and "`eagle-capture probe` measures" in out, out
    code, out, _ = _doctor(capsys, *argv, "--allow-embedding", explain=False)
    assert hint not in out, out
    assert "0.5.14 - 0.5.16: captures [-1, 2, 30]: PROBLEM" in out and "-> write [0, 3, 31]" in out

    written = tmp_path / "fixed.json"
    code, _, err = _doctor(capsys, *argv, "--write-config", written)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "the draft's ids name the embedding output (capture layer 0)" in err, err
    assert "eagle-capture probe" in err and "--allow-embedding only if" in err, err
    assert not written.exists()
    # Allowed: 0.5.9 - 0.5.12 cannot load it and 0.5.13's loop cannot capture layer 0,
    # so one list for every line is refused, naming them; one release is written.
    code, _, err = _doctor(capsys, *argv, "--allow-embedding", "--write-config", written)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "(0.5.9 - 0.5.12: CANNOT LOAD; 0.5.13: no ids make it capture" in err, err
    assert "pass --sglang-version to write the ids for a release" in err, err
    assert not written.exists()
    code, _, _ = _doctor(
        capsys, *argv, "--allow-embedding", "--sglang-version", "0.5.20", "--write-config", written
    )
    config = json.loads(written.read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 31]
