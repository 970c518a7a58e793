"""The doctor reads each trainer's ids in that trainer's own convention, on the
configs the trainers' own exporters wrote (tests/data/trainer_configs, README
there), and answers for both engines by default. Ambiguous provenance: the verdict
under each reading, exit 1, and no fix outside the reading it belongs to."""

import json
import os

import pytest

from eagle_capture.cli import doctor
from eagle_capture.layer_ids.deployment import WIDTH
from eagle_capture.layer_ids.lines import read_draft_ids
from eagle_capture.layer_ids.trainers import recognise

DATA = os.path.join(os.path.dirname(__file__), "data", "trainer_configs")


def _path(folder, name):
    return os.path.join(DATA, folder, name)


def _doctor(capsys, *argv):
    argv = [str(a) for a in argv]
    code = doctor.main(argv + ([] if "--json" in argv else ["--explain"]))
    out = capsys.readouterr()
    assert all(
        len(line) <= WIDTH
        for line in out.out.splitlines()
        if not line.startswith(("draft:", "target:")) and DATA not in line
    )
    return code, " ".join(out.out.split()), out.err


def _target(tmp_path, arch, layers):
    path = tmp_path / f"{arch}.json"
    path.write_text(
        json.dumps({"architectures": [arch], "num_hidden_layers": layers, "hidden_size": 64})
    )
    return path


EXPORTED = sorted(
    (folder, name)
    for folder in os.listdir(DATA)
    if os.path.isdir(os.path.join(DATA, folder))
    for name in os.listdir(os.path.join(DATA, folder))
)
TRAINER = {
    "specforge": "SpecForge",
    "speculators": "speculators",
    "modelopt": "NVIDIA Model Optimizer",
    "torchspec": "TorchSpec",
    "angelslim": "AngelSlim",
}


@pytest.mark.parametrize("folder,name", EXPORTED)
def test_every_exported_config_is_recognised(folder, name):
    p = recognise(read_draft_ids(_path(folder, name)), 61, "DeepseekV3ForCausalLM")
    # (a template with no ids and no marker: SpecForge's and TorchSpec's look alike)
    assert (
        p.trainer == TRAINER[folder]
        or p.trainer == "SpecForge or TorchSpec" == f"{TRAINER[folder]} or TorchSpec"
    ), (name, p)
    assert p.evidence


def test_speculators_ids_are_vllms_input_convention(capsys):
    """A speculators draft (top-level [2, 30, 58], vLLM's own convention) on a 61-layer
    DeepSeek-V3 target: right on both engines (it used to get MISMATCH and a fix to
    [3, 31, 59] that would break it)."""
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _path("speculators", "Eagle3SpeculatorConfig_61layer_ids_2_30_58.config.json"),
        "--num-layers",
        61,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
    )
    # vLLM reads them right; SGLang has no class for speculators' format (item 3).
    assert code == 1, out
    assert "trainer: speculators (recognised from speculators_model_type" in out
    assert "read as input convention" in out and "[3, 31, 59]" not in out
    assert "summary: SGLang: CANNOT LOAD; vLLM: OK (exit 1)" in out
    assert "verdict (vLLM): every line" in out and "fix for this line" not in out


def test_torchspec_vllm_conversion_is_ambiguous_and_never_gets_a_bare_fix(capsys):
    """TorchSpec's --vllm conversion of its Kimi-K2.5 template ([2, 30, 58]): input
    convention after conversion, or output convention natively; the converter
    leaves no marker. Both verdicts, exit 1, each fix inside its reading;
    --id-convention input decides (right everywhere)."""
    path = _path("torchspec", "convert_to_hf_kimi_k25_vllm_flag.config.json")
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
    )
    assert code == 1
    assert "trainer: TorchSpec (recognised from _torchspec_version)" in out
    assert "AMBIGUOUS" in out and "--id-convention output|input decides" in out
    for engine in ("SGLang", "vLLM"):
        section = out.split(f"verdict ({engine})")[0].rsplit("verdict (", 1)[-1]
        first_reading = section.index("if the draft was trained in the input convention")
        assert "fix for this line" not in section[:first_reading]
        assert "if the draft was trained in the output convention" in section
    assert "verdict (SGLang): AMBIGUOUS" in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
        "--id-convention",
        "input",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 0, out  # (SGLang 0.5.9 - 0.5.12 adds 1 to them: wrong there)
    # The native export (the output-convention default) is not ambiguous.
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _path("torchspec", "convert_to_hf_kimi_k25_native_sglang.config.json"),
        "--num-layers",
        61,
        "--engine",
        "sglang",
        "--sglang-version",
        "0.5.13",
        "--target-architecture",
        "KimiK25ForConditionalGeneration",
    )
    assert code == 0 and "AMBIGUOUS" not in out and "TorchSpec's native export" in out


def test_model_optimizer_dumps_differ(capsys):
    """Model Optimizer: HF dump (output convention) or its vLLM dump (ids unshifted):
    ambiguous whatever the ids."""
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _path("modelopt", "EagleExporter_tiny_llama_8l_default_ids.config.json"),
        "--num-layers",
        8,
        "--target-architecture",
        "LlamaForCausalLM",
    )
    assert code == 1
    assert "NVIDIA Model Optimizer (recognised from eagle_config keys next_layer_regular" in out
    assert "data from its Hugging Face dump" in out and "data from its vLLM dump" in out


def test_angelslim_ids_are_in_a_key_no_engine_reads(tmp_path, capsys):
    """AngelSlim's aux_hidden_states_layer_ids: both engines capture their defaults;
    right only when the ids are its defaults; otherwise each engine's fix, in each
    engine's key and rule (Llama: SGLang adds 1, vLLM does not)."""
    path = _path(
        "angelslim",
        "Eagle3LlamaForCausalLM_save_pretrained_template_with_aux_ids_1_3_4.config.json",
    )
    target = _target(tmp_path, "LlamaForCausalLM", 8)
    code, out, _ = _doctor(
        capsys, "--draft-config", path, "--target-config", target, "--engine", "vllm"
    )
    assert code == 0, out
    assert "aux_hidden_states_layer_ids is read by no engine" in out
    config = json.load(open(path))
    config["aux_hidden_states_layer_ids"] = [2, 4, 6]
    other = tmp_path / "angelslim.json"
    other.write_text(json.dumps(config))
    code, out, _ = _doctor(capsys, "--draft-config", other, "--target-config", target)
    assert code == 1
    # SGLang registers no Eagle3LlamaForCausalLM: no id fix is offered there (item 3).
    assert "SGLang cannot load this draft format" in out and "verdict (SGLang): CANNOT LOAD" in out
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [2, 4, 6]" not in out
    assert (
        "top level (vLLM's runners read it first; its default GPU runner reads no other "
        "key) = [3, 5, 7]" in out
    )


def test_specforge_reads_what_its_sglang_captured(capsys, tmp_path):
    """SpecForge 0.2.0 captures its data with SGLang 0.5.14's target model: on a
    Llama target that is the output convention (one reading); on DeepSeek-V3 with
    ids[0] != 1 (its own Kimi-K2.5 template: [2, 30, 58]) SGLang kept the ids while
    its earlier HF backend took hidden_states[X + 1]: ambiguous."""
    draft = tmp_path / "specforge.json"
    draft.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {
                    "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
                    "use_aux_hidden_state": True,
                },
            }
        )
    )
    llama = recognise(read_draft_ids(draft), 61, "LlamaForCausalLM")
    assert not llama.ambiguous and llama.readings[0].expected == (3, 31, 59)
    kimi = recognise(read_draft_ids(draft), 61, "KimiK25ForConditionalGeneration")
    assert kimi.ambiguous
    assert {r.expected for r in kimi.readings} == {(3, 31, 59), (2, 30, 58)}
    assert recognise(
        read_draft_ids(draft), 61, "KimiK25ForConditionalGeneration", "input"
    ).readings[0].expected == (2, 30, 58)


def test_specforge_history_without_the_target_architecture(capsys, tmp_path):
    """The doctor run with the layer count alone (no --target-config or
    --target-architecture) assumes DeepseekV2's id rule for SGLang's lines; SpecForge's
    history must be read with the same rule: its Kimi-K2.5 template [2, 30, 58] is then
    ambiguous exactly as on DeepSeek-V3 (its HF backend and early pins: output
    convention; its SGLang 0.5.14 pin: input convention). Read with another model's
    rule (Llama's +1 everywhere) it would be one confident reading, wrong under the
    rule the lines below it apply."""
    draft = tmp_path / "specforge.json"
    draft.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {
                    "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
                    "use_aux_hidden_state": True,
                },
            }
        )
    )
    ids = read_draft_ids(draft)
    assumed = recognise(ids, 61)
    deepseek = recognise(ids, 61, "DeepseekV3ForCausalLM")
    assert assumed.ambiguous and [r.expected for r in assumed.readings] == [
        r.expected for r in deepseek.readings
    ] == [(3, 31, 59), (2, 30, 58)]
    assert all("with DeepseekV2 (assumed)'s rule" in r.why for r in assumed.readings)
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        draft,
        "--num-layers",
        61,
        "--engine",
        "sglang",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 1 and "summary: SGLang: AMBIGUOUS (exit 1)" in out, out
    assert "DeepseekV2's id rule is assumed" in out


def test_safeailab_and_unrecognised_configs(tmp_path, capsys):
    """SafeAILab EAGLE: no ids, layers hard-coded = the engines' defaults: OK with no
    --accept-defaults on vLLM (which loads LlamaForCausalLM as Eagle3LlamaForCausalLM);
    SGLang builds its target Llama for that name, which has no hot_token_id: CANNOT
    LOAD, with the architecture to write. An unrecognised config whose ids are the
    input-convention default is ambiguous; other ids are read in the output convention,
    said as assumed."""
    path = tmp_path / "safeailab.json"

    def draft(architecture):
        one_layer = {"num_hidden_layers": 1, "draft_vocab_size": 32000, "hidden_size": 4096}
        path.write_text(json.dumps({"architectures": [architecture], **one_layer}))

    args = ["--draft-config", path, "--num-layers", 32]
    draft("LlamaForCausalLM")
    code, out, _ = _doctor(capsys, *args, "--target-architecture", "LlamaForCausalLM")
    assert code == 1 and "summary: SGLang: CANNOT LOAD; vLLM: OK (exit 1)" in out, out
    assert "SafeAILab EAGLE" in out and "hard-coded" in out
    assert "aux_hidden_state_layers = [2, 16, 29] -> OK" in out
    assert (
        "(it reads the draft's hot_token_id, speculative/eagle_worker_v2.py:366 in 0.5.23): "
        "AttributeError at start-up" in " ".join(out.split())
    ), out
    assert "Fix: set the draft config's architectures to LlamaForCausalLMEagle3" in " ".join(
        out.split()
    )
    code, out, _ = _doctor(capsys, *args, "--engine", "vllm")
    assert code == 0, out
    # The same shape came out of speculators' 2025 research pipeline (hidden_states[3],
    # [L // 2 + 1], [-3]): said in the short answer too, the reason in the note.
    doctor.main([str(a) for a in args] + ["--engine", "vllm"])  # the short answer
    out = " ".join(capsys.readouterr().out.split())
    assert "or [3, 17, 30] if speculators' 2025 research pipeline trained it" in out, out
    p = recognise(read_draft_ids(path), 32, "LlamaForCausalLM")
    assert any("capture layers [3, 17, 30], one layer past [2, 16, 29]" in n for n in p.notes)
    draft("LlamaForCausalLMEagle3")  # SGLang's own draft format, the same weights: loads
    code, out, _ = _doctor(capsys, *args, "--engine", "sglang", "--accept-defaults")
    assert "CANNOT LOAD" not in out, out
    unknown = tmp_path / "unknown.json"
    unknown.write_text(
        json.dumps(
            {
                "architectures": ["SomeDraftModel"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29], "extra": 1},
            }
        )
    )
    p = recognise(read_draft_ids(unknown), 32, "LlamaForCausalLM")
    assert p.trainer == "" and p.ambiguous
    unknown.write_text(
        json.dumps(
            {
                "architectures": ["SomeDraftModel"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "extra": 1},
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        unknown,
        "--num-layers",
        32,
        "--target-architecture",
        "LlamaForCausalLM",
        "--engine",
        "sglang",
    )
    assert "not recognised from the config's keys" in out and "(ASSUMED)" in out and code == 0


def test_one_run_answers_for_both_engines(tmp_path, capsys):
    """A SpecForge Llama-3 draft (80 layers, its default ids [1, 39, 76]) moved from
    SGLang to vLLM: right on SGLang; on vLLM the default runner (V2) never reads
    eagle_config's ids and its defaults happen to be the same layers, the V1 runner
    takes them one layer early; the fix is the top-level [2, 40, 77]."""
    target = _target(tmp_path, "LlamaForCausalLM", 80)
    draft = tmp_path / "draft.json"
    draft.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {
                    "eagle_aux_hidden_state_layer_ids": [1, 39, 76],
                    "use_aux_hidden_state": True,
                },
            }
        )
    )
    code, out, _ = _doctor(
        capsys, "--draft-config", draft, "--target-config", target, "--sglang-version", "0.5.23"
    )
    # The V1 runner's problem is shown; V2, vLLM's default, decides (item 6).
    assert code == 0, out
    assert "verdict (SGLang): every line shown feeds the draft what it was trained on" in out
    assert (
        "(not vLLM's default runner: shown, and decides the verdict only for a server run "
        "with it: --vllm-runner v1)" in out
    )
    assert (
        "model runner V2 (vLLM's default) (read from 0.32.0 (run), 0.33.0, 0.34.0): "
        "aux_hidden_state_layers = [2, 40, 77] -> OK" in out
    )
    assert "aux_hidden_state_layers = [1, 39, 76] -> PROBLEM" in out
    assert "default GPU runner reads no other key) = [2, 40, 77]" in out
    code, out, _ = _doctor(
        capsys, "--draft-config", draft, "--target-config", target, "--vllm-runner", "v1"
    )
    assert code == 1 and "summary: SGLang: OK; vLLM: PROBLEM (exit 1)" in out
    assert "model runner V2 (vLLM's default) (read from" not in out
    code, out, _ = _doctor(
        capsys, "--draft-config", draft, "--target-config", target, "--engine", "sglang"
    )
    assert code == 0 and "verdict (vLLM)" not in out
    with pytest.raises(SystemExit) as exit_:
        doctor.main(
            [
                "--draft-config",
                str(draft),
                "--target-config",
                str(target),
                "--engine",
                "sglang,trtllm",
            ]
        )
    assert (
        exit_.value.code == 2 and "expected sglang, vllm or sglang,vllm" in capsys.readouterr().err
    )


def test_a_misspelt_key_is_named_as_ignored(tmp_path, capsys):
    draft = tmp_path / "typo.json"
    draft.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {
                    "eagle_aux_hidden_states_layer_ids": [1, 19, 36],
                    "use_aux_hidden_state": True,
                },
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        draft,
        "--num-layers",
        40,
        "--target-architecture",
        "LlamaForCausalLM",
        "--engine",
        "sglang",
    )
    assert (
        "eagle_config.eagle_aux_hidden_states_layer_ids = [1, 19, 36] is read by no engine" in out
        and "a misspelling?" in out
    )
    assert code == 1  # no ids the engines read: their defaults, unverified


def test_a_reading_that_names_a_missing_layer_is_dropped(tmp_path, capsys):
    """Ids ending at the layer count ([24, 30, 36] of GPT-OSS-120B's 36 layers, NVIDIA's
    published Eagle3-v3 head): as output-convention ids they would name capture layer 37,
    past the last layer's output; only the input reading (36: the final boundary) names
    layers that exist. An unrecognised config is read so (not ASSUMED output), a Model
    Optimizer one is no longer AMBIGUOUS; SGLang 0.5.18+'s GPT-OSS keeps such ids as given:
    OK there."""
    from eagle_capture.layer_ids.lines import read_draft_ids

    path = tmp_path / "draft.json"
    modelopt = {"norm_before_fc": True, "next_layer_regular": True, "use_aux_hidden_state": True}
    for extra, trainer in (({"norm_before_fc": True}, ""), (modelopt, "NVIDIA Model Optimizer")):
        eagle = {"eagle_aux_hidden_state_layer_ids": [24, 30, 36], **extra}
        path.write_text(
            json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": eagle})
        )
        p = recognise(read_draft_ids(path), 36, "GptOssForCausalLM")
        assert p.trainer == trainer, p
        assert [r.expected for r in p.readings] == [(24, 30, 36)], p
        assert any(
            "it would name capture layer(s) [37], outside the embedding (0) to the output" in n
            for n in p.notes
        )
    assert p.decided_by == "markers"
    target = ["--num-layers", 36, "--target-architecture", "GptOssForCausalLM"]
    line = ["--engine", "sglang", "--sglang-version", "0.5.23"]
    code, out, _ = _doctor(capsys, "--draft-config", path, *target, *line)
    assert code == 0 and "layers_to_capture = [24, 30, 36] -> OK" in out, out
    # Past the layer count whichever way they are read: the assumed reading stays, and
    # the verdict says the layers do not exist.
    eagle = {"eagle_aux_hidden_state_layer_ids": [2, 40, 50], "norm_before_fc": True}
    path.write_text(
        json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": eagle})
    )
    p = recognise(read_draft_ids(path), 36, "GptOssForCausalLM")
    assert p.decided_by == "assumed" and [r.expected for r in p.readings] == [(3, 41, 51)], p


def test_an_embedding_id_is_never_read_as_capture_layer_minus_one(tmp_path):
    """Ids [-1, 16, 32] of 32 layers: as output-convention ids -1 is the embedding
    (capture layer 0) and 32 names a 33rd layer; as input-convention ids -1 names
    nothing. Neither reading names only existing layers: the assumed one stays, and no
    reading of capture layer -1 is offered."""
    path = tmp_path / "draft.json"
    eagle = {"eagle_aux_hidden_state_layer_ids": [-1, 16, 32], "norm_before_fc": True}
    path.write_text(
        json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": eagle})
    )
    p = recognise(read_draft_ids(path), 32, "LlamaForCausalLM")
    assert [r.expected for r in p.readings] == [(0, 17, 33)] and p.decided_by == "assumed", p


def test_a_speculators_draft_without_ids_is_read_both_ways(capsys):
    """speculators writes no ids in two histories one layer apart: its own trainer of
    0.3.0 - 0.4.0.1 took each named layer's output (capture layers [3, L // 2 + 1, L - 2],
    as its 2025 research pipeline), its converter given no ids leaves a SafeAILab or
    SpecForge draft trained on the defaults (this file: the converter's own output for an
    id-less SpecForge export). AMBIGUOUS on vLLM, with the fix under the reading it belongs
    to; --accept-defaults decides for the defaults. (It was UNVERIFIED, with a note that
    blamed only the converter.)"""
    path = _path("speculators", "Eagle3Converter_from_specforge_no_ids_arg.config.json")
    argv = ["--draft-config", path, "--num-layers", 61, "--target-architecture"]
    argv += ["DeepseekV3ForCausalLM", "--engine", "vllm"]
    code, out, _ = _doctor(capsys, *argv)
    assert code == 1 and "summary: vLLM: AMBIGUOUS (exit 1)" in out, out
    p = recognise(read_draft_ids(path), 61, "DeepseekV3ForCausalLM")
    assert [r.expected for r in p.readings] == [(3, 31, 59), (2, 30, 58)]
    assert "custom_worker.py" in p.readings[0].why and "eagle3_converter.py" in p.readings[1].why
    assert "aux_hidden_state_layers = [2, 30, 58]" in out and "= [3, 31, 59]" in out
    assert "--accept-defaults if it was trained on the engines' defaults" in out
    code, out, _ = _doctor(capsys, *argv, "--accept-defaults")
    assert code == 0 and "summary: vLLM: OK (exit 0)" in out, out
    assert "as --accept-defaults says" in out
    doctor.main([str(a) for a in argv] + ["--json", "--accept-defaults"])
    answer = json.loads(capsys.readouterr().out)
    assert [r["trained_capture_layers"] for r in answer["readings"]] == [[2, 30, 58]]


@pytest.mark.parametrize("version", range(4))
def test_the_research_pipelines_templates_are_recognised(version, tmp_path, capsys):
    """speculators' 2025 research pipeline copied its train/*.json into every draft it
    trained: each version read is recognised as shipped, read as the layers its data
    generation took (hidden_states[3], [L // 2 + 1], [-3]); vLLM's defaults are one layer
    early in every slot (it was OK, exit 0, read as SafeAILab's). The same config edited
    is SafeAILab's shape again, with the note (the first version, with target_vocab_size
    for draft_vocab_size, no one's)."""
    from eagle_capture.layer_ids.trainers import _templates

    template = _templates()["speculators research pipeline"]["templates"][version]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(template["config"]))
    n = 32 if "llama" in template["file"] else 36
    code, out, _ = _doctor(capsys, "--draft-config", path, "--num-layers", n, "--engine", "vllm")
    want = [3, n // 2 + 1, n - 2]
    assert code == 1 and "trainer: speculators research pipeline" in out, out
    assert "MISMATCH" in out and f"its default GPU runner reads no other key) = {want}" in out
    edited = dict(template["config"], max_position_embeddings=4096)
    path.write_text(json.dumps(edited))
    p = recognise(read_draft_ids(path), n, "LlamaForCausalLM")
    if "draft_vocab_size" in edited:
        assert p.trainer == "SafeAILab EAGLE" and p.caveat
    else:
        assert p.trainer == ""


def test_specforge_without_ids_names_its_seven_weeks(capsys):
    """SpecForge's online trainer took [1, L // 2, L - 4] for a config without ids from
    2025-09-01 to 2025-10-20 (the fix: bdbea66b): a draft trained then has its middle slot
    a layer past the engines' default. The config cannot say when it was trained: the
    reading stays the default (every other path), the short answer says the other, the
    note says why and points at the probe."""
    path = os.path.join(os.path.dirname(DATA), "published_configs", "specforge_phi4.config.json")
    draft = read_draft_ids(path)
    assert draft.read_by_target is None  # (SpecForge's phi-4 template names no ids)
    p = recognise(draft, 40, "Phi3ForCausalLM")
    assert [r.expected for r in p.readings] == [(2, 20, 37)]
    assert "or [2, 21, 37] if SpecForge's online trainer of 2025-09-01 - 2025-10-20" in p.caveat
    assert any("94d67101 - bdbea66b" in n and "eagle-capture probe" in n for n in p.notes)
    named = os.path.join(os.path.dirname(path), "specforge_kimi_k25.config.json")
    assert not recognise(read_draft_ids(named), 61).caveat  # trained on the ids it names
