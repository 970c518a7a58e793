"""The doctor's engine facts (eagle_capture/layer_ids/data/engine_facts.json): rebuilt
from the real SGLang and vLLM wheels and compared with the committed file; checked
against the per-model rule table that CI runs on each wheel's own classes
(layer_ids/rules.py, scenario model_id_rules); and the facts the doctor's verdicts
rest on, as read."""

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from eagle_capture.layer_ids import engine_facts
from eagle_capture.layer_ids.rules import SGLANG_MODEL_RULES, WRAPPERS
from engine_jobs import Job

ROOT = Path(__file__).resolve().parents[1]
# Wheels are cached here (or where EAGLE_CAPTURE_ENGINE_WHEELS points) and fetched
# with pip when missing: vLLM's are ~300 MB each.
WHEELS = Path(os.environ.get("EAGLE_CAPTURE_ENGINE_WHEELS", ROOT / ".cache" / "engine_wheels"))


def _fetch(engine: str, version: str) -> str:
    """``pip download`` of one wheel: '' when it came, else why not."""
    try:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
            + [f"{engine}=={version}", "-d", str(WHEELS)],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        return f"fetching {engine}=={version} took over 15 minutes"
    if got.returncode != 0:
        why = got.stderr.strip().splitlines()[-1:] or "pip failed"
        return f"cannot fetch the {engine}=={version} wheel to read ({why})"
    return ""


def _fetch_wheels() -> dict:
    WHEELS.mkdir(parents=True, exist_ok=True)
    found = engine_facts.find_wheels(str(WHEELS))
    missing = [
        (engine, version)
        for engine, wanted in (
            ("sglang", engine_facts.SGLANG_RELEASES),
            ("vllm", engine_facts.VLLM_RELEASES),
        )
        for version in wanted
        if version not in found[engine]
    ]
    if missing and os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL"):  # no package index there
        engine, version = missing[0]
        pytest.skip(
            f"{engine}=={version}'s wheel is not cached and "
            f"EAGLE_CAPTURE_SKIP_SGLANG_REAL is set: the engines' wheels are "
            f"not fetched"
        )
    # A few at a time: each download waits on the index and the disk more than the CPU.
    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [why for why in pool.map(lambda ev: _fetch(*ev), missing) if why]
    if problems:
        pytest.skip(problems[0])
    return engine_facts.find_wheels(str(WHEELS))


# The wheels' download (about 1.2 GB, minutes on a cold CI machine) and the generator run in
# the background with the engine runs (tests/engine_jobs.py) from the session's start,
# while the other tests run; this module's tests go last with theirs.
GENERATE = "engine facts from the wheels"


def _generate_in_a_child() -> dict:
    """The generator's own command in a child process, never in a thread of this one:
    CPython 3.11 keeps the AST converter's recursion depth in state all threads share, so
    the wheels parsed beside this process's own parses (pytest rendering a failure,
    Triton's interpreter reading a kernel) made the other side raise "AST constructor
    recursion depth mismatch" (a CI run ended in an INTERNALERROR that way)."""
    _fetch_wheels()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine_facts.json"
        run = subprocess.run(
            [sys.executable, "-m", "eagle_capture.layer_ids.engine_facts"]
            + ["--wheel-dir", str(WHEELS), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert run.returncode == 0, f"the generator failed:\n{run.stderr[-3000:]}"
        return json.loads(out.read_text(encoding="utf-8"))


def _generate_job() -> Job:
    return Job(-450, GENERATE, _generate_in_a_child)


def engine_jobs(item, base, jobs) -> list:
    """The background run a selected test needs (tests/engine_jobs.py)."""
    return [_generate_job()] if "generated" in item.fixturenames else []


@pytest.fixture(scope="module")
def generated(engine_jobs):
    if engine_jobs is None:
        return _generate_job().run()
    return engine_jobs.result(GENERATE, _generate_job())


def test_the_committed_facts_are_what_the_wheels_say(generated):
    """The CI's drift check: regenerate from the wheels; any difference fails (adding an
    engine release is running the generator and reviewing this diff)."""
    diff = engine_facts.drift(generated, engine_facts.load())
    assert not diff, (
        "eagle_capture/layer_ids/data/engine_facts.json differs from the wheels "
        "(python -m eagle_capture.layer_ids.engine_facts --wheel-dir DIR):\n" + "\n".join(diff[:40])
    )
    # The file is written as the generator writes it (a regenerated file is a clean diff).
    assert engine_facts.dumps(generated) == Path(engine_facts.DATA).read_text()


def test_the_generator_checks_and_refuses_in_one_line(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle_capture.layer_ids.engine_facts",
            "--wheel-dir",
            str(tmp_path / "nowhere"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "not a folder" in run.stderr
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle_capture.layer_ids.engine_facts",
            "--wheel-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "sglang==0.5.9" in run.stderr and "vllm==0.34.0" in run.stderr


def test_drift_names_each_changed_architecture():
    committed = engine_facts.load()
    changed = json.loads(json.dumps(committed))
    changed["vllm"]["0.32.0"]["targets"]["BailingMoeV2ForCausalLM"]["capture"] = True
    del changed["sglang"]["0.5.23"]["targets"]["LlamaForCausalLM"]
    diff = engine_facts.drift(changed, committed)
    assert len(diff) == 2
    assert any(d.startswith("vllm 0.32.0 BailingMoeV2ForCausalLM") for d in diff)
    assert any(d.startswith("sglang 0.5.23 LlamaForCausalLM") for d in diff)


# ----------------------------------------------------------------------------
# The committed data against the rule table run in CI on each wheel's classes
# ----------------------------------------------------------------------------


def test_every_release_read_is_in_the_data():
    assert engine_facts.releases("sglang") == list(engine_facts.SGLANG_RELEASES)
    assert engine_facts.releases("vllm") == list(engine_facts.VLLM_RELEASES)


@pytest.mark.parametrize("version", sorted(SGLANG_MODEL_RULES))
def test_the_data_agrees_with_the_rule_table_run_on_each_wheel(version):
    for arch, (rule, owner) in SGLANG_MODEL_RULES[version].items():
        fact = engine_facts.target("sglang", version, arch)
        assert fact is not None, f"{arch} is not registered in SGLang {version}'s data"
        assert (fact.get("rule"), fact.get("owner")) == (rule, owner), (
            f"SGLang {version} {arch}: data {fact}, rule table {(rule, owner)}"
        )
        # The table runs the method; the data also asks whether the model's loop reads
        # what it sets (GLM-5's MTP draft class: its one-layer model never captures) and
        # captures the residual stream (Gemma 3 from 0.5.17: the branch output).
        assert fact["capture"] is True or any(
            w in fact["why"] for w in ("never reads", "not the residual stream")
        ), fact


@pytest.mark.parametrize("version", sorted(SGLANG_MODEL_RULES))
def test_a_wrapper_has_the_rule_of_the_class_it_forwards_to(version):
    for wrapper, inner in WRAPPERS.items():
        fact = engine_facts.target("sglang", version, wrapper)
        if version == "0.5.9":
            # Kimi-K2.5's wrapper has no set_eagle3_layers_to_capture before 0.5.10
            # (models/kimi_k25.py:841 there): the forwarding starts there.
            assert fact["capture"] is False
            continue
        want = engine_facts.target("sglang", version, inner)
        assert (fact["rule"], fact["owner"]) == (want["rule"], want["owner"])
        assert fact["via"][-1].endswith("." + inner)


# ----------------------------------------------------------------------------
# The facts the doctor's verdicts rest on, as read
# ----------------------------------------------------------------------------


def test_vllm_without_supports_eagle3_cannot_capture():
    """Ling-flash-2.0's target: vLLM's BailingMoeV2ForCausalLM subclasses
    BailingMoeForCausalLM(nn.Module, SupportsPP, SupportsLoRA) in every release read."""
    for version in engine_facts.VLLM_RELEASES:
        fact = engine_facts.target("vllm", version, "BailingMoeV2ForCausalLM")
        assert fact == {"class": "bailing_moe.BailingMoeV2ForCausalLM", "capture": False}
    assert engine_facts.target("vllm", "0.32.0", "LlamaForCausalLM") == {
        "class": "llama.LlamaForCausalLM",
        "capture": True,
        "owner": "llama.LlamaForCausalLM",
    }
    # Inherited: DeepseekV3 is a DeepseekV2ForCausalLM subclass.
    assert (
        engine_facts.target("vllm", "0.33.0", "DeepseekV3ForCausalLM")["owner"]
        == "deepseek_v2.DeepseekV2ForCausalLM"
    )


def test_vllm_transformers_backend_is_read_from_each_wheel():
    """What serves an architecture vLLM registers no class of its own for: its
    Transformers modeling backend (registry.py _TRANSFORMERS_BACKEND_MODELS), whose
    TransformersForCausalLM is SupportsEagle3 through transformers/base.py Base."""
    for version in engine_facts.VLLM_RELEASES:
        assert engine_facts.transformers_backend(version) == {
            "class": "transformers.TransformersForCausalLM",
            "capture": True,
            "owner": "transformers.base.Base",
        }
    assert engine_facts.vllm_fallback_releases("HunYuanDenseV1ForCausalLM") == list(
        engine_facts.VLLM_RELEASES
    )
    assert engine_facts.vllm_fallback_releases("LlamaForCausalLM") == []


def test_sglang_delegation_to_an_inner_language_model_is_followed():
    """Llama 4's multimodal class hands the ids to a Llama4ForCausalLM, which inherits
    LlamaForCausalLM's method (+1): models/mllama4.py, models/llama4.py."""
    fact = engine_facts.target("sglang", "0.5.23", "Llama4ForConditionalGeneration")
    assert fact == {
        "class": "mllama4.Llama4ForConditionalGeneration",
        "capture": True,
        "owner": "llama.LlamaForCausalLM",
        "rule": "+1",
        "via": ["mllama4.Llama4ForConditionalGeneration", "llama4.Llama4ForCausalLM"],
    }
    # A class handed in through __init__'s parameter (Qwen3.5's VL wrapper: its text
    # model's method stores the layers it is given; the wrapper adds 1).
    fact = engine_facts.target("sglang", "0.5.23", "Qwen3_5ForConditionalGeneration")
    assert (fact["rule"], fact["owner"]) == ("+1", "qwen3_vl.Qwen3VLForConditionalGeneration")


def test_sglang_ids_handed_to_a_model_that_never_reads_them_capture_nothing():
    """SGLang 0.5.13 - 0.5.20's Qwen3.5 wrappers: Qwen3VL's method stores the ids in the
    text model's layers_to_capture, but that model's loop captures only the layers
    flagged _is_layer_to_capture (set by set_dflash_layers_to_capture alone): nothing
    is captured. 0.5.22 calls the text model's own method, which sets the flags. The
    flag-based MoE loops flag their layers in the EAGLE-3 method too; the MTP / NextN
    draft classes inherit the method, but their one-layer models never capture."""
    for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        for version in ("0.5.13", "0.5.18", "0.5.20"):
            fact = engine_facts.target("sglang", version, arch)
            assert fact["capture"] is False, (version, fact)
            assert "which that model never reads" in fact["why"]
            assert "_is_layer_to_capture" in fact["why"]
        for version in ("0.5.22", "0.5.23"):
            assert engine_facts.target("sglang", version, arch)["capture"] is True
    for version in engine_facts.SGLANG_RELEASES:
        for arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"):
            assert engine_facts.target("sglang", version, arch)["capture"] is True
        assert (
            engine_facts.target("sglang", version, "DeepseekV3ForCausalLMNextN")["capture"] is False
        )
    assert engine_facts.target("sglang", "0.5.20", "Qwen3NextForCausalLM")["capture"] is True


def _toy_sglang(tmp_path, source) -> dict:
    """The reader's target facts for a wheel whose one model file is ``source`` (or
    whose model files are ``source``: {module: source})."""
    import zipfile

    from eagle_capture.layer_ids.engine_read import read_sglang

    files = source if isinstance(source, dict) else {"toy": source}
    wheel = tmp_path / "sglang-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/srt/models/__init__.py", "")
        for module, text in files.items():
            z.writestr(f"sglang/srt/models/{module}.py", text)
    return read_sglang(str(wheel))["targets"]


_WRAPPER = """
class Wrapper:
    def __init__(self, config):
        self.model = TextModel(config)

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        if layer_ids is None:
            n = self.config.num_hidden_layers
            layer_ids = [1, n // 2 - 1, n - 4]
        {body}

EntryClass = [Wrapper]
"""
_TEXT_MODEL = """
class TextModel:
    def __init__(self, config):
        self.layers_to_capture = []

    def set_eagle3_layers_to_capture(self, layers_to_capture):
        self.layers_to_capture = layers_to_capture
        for layer_id in self.layers_to_capture:
            setattr(self.layers[layer_id], "_is_layer_to_capture", True)

    def set_dflash_layers_to_capture(self, layers_to_capture):
        self.layers_to_capture = layers_to_capture
        for layer_id in self.layers_to_capture:
            setattr(self.layers[layer_id], "_is_layer_to_capture", True)

    def forward(self, x):
        aux = []
        for i, layer in enumerate(self.layers):
            {loop}
            x = layer(x)
        return x, aux
"""
_STORE = "self.model.layers_to_capture = [i + 1 for i in layer_ids]"
_CALL = "self.model.set_eagle3_layers_to_capture([i + 1 for i in layer_ids])"
_READS_FLAGS = 'if getattr(layer, "_is_layer_to_capture", False): aux.append(x)'
_READS_LIST = "if i in self.layers_to_capture: aux.append(x)"


@pytest.mark.parametrize(
    "body, loop, captures",
    [
        (_STORE, _READS_FLAGS, False),  # SGLang 0.5.13 - 0.5.20's Qwen3.5 wrappers
        (_CALL, _READS_FLAGS, True),  # 0.5.22: the text model's own method flags its layers
        (_STORE, _READS_LIST, True),  # Llama's loop reads the list
        (_STORE, "pass", False),  # a model that never captures (the NextN drafts)
    ],
)
def test_a_store_no_loop_reads_captures_nothing(tmp_path, body, loop, captures):
    """The reader follows the ids to the model that holds them and asks whether its
    code reads them (the list, or the flags where the method set them) anywhere but in
    its set-up methods."""
    source = _WRAPPER.format(body=body) + _TEXT_MODEL.format(loop=loop)
    fact = _toy_sglang(tmp_path, source)["Wrapper"]
    assert fact["capture"] is captures, fact
    if captures:
        assert fact["rule"] == "+1"
    else:
        assert "toy.TextModel.layers_to_capture, which that model never reads" in fact["why"]


_DEFERRED_LOOP = """
class TextModel:
    def __init__(self, config):
        self.layers_to_capture = []

    def forward(self, hidden_states):
        aux, residual = [], None
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                {capture}
            hidden_states, residual = layer(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, aux
"""


@pytest.mark.parametrize(
    "capture, captures",
    [
        # SGLang 0.5.18+'s Gemma 3: its layers defer the residual add to the next norm
        ("aux.append(hidden_states)", False),
        # Llama, Qwen, DeepSeek: the stream is the branch plus the pending residual
        ("aux.append(hidden_states + residual if residual is not None else hidden_states)", True),
        # no add pending before the first layer
        (
            "if residual is None:\n                    aux.append(hidden_states)\n"
            "                else:\n                    aux.append(hidden_states + residual)",
            True,
        ),
    ],
)
def test_a_loop_that_captures_the_branch_not_the_stream_cannot_feed_a_draft(
    tmp_path, capture, captures
):
    source = _WRAPPER.format(body=_STORE) + _DEFERRED_LOOP.format(capture=capture)
    fact = _toy_sglang(tmp_path, source)["Wrapper"]
    assert fact["capture"] is captures, fact
    assert fact["rule"] == "+1"
    if not captures:
        assert (
            "branch output, not the residual stream: toy.py TextModel.forward (line" in fact["why"]
        )


def test_gemma3_captures_the_branch_from_0_5_17():
    """SGLang 0.5.17+'s gemma3_causal.py: Gemma3DecoderLayer returns (hidden_states,
    residual) with the add deferred to the next norm, and Gemma3TextModel.forward appends
    the bare hidden_states. 0.5.12 - 0.5.16's layers add the residual themselves (0.5.12:
    the first with set_eagle3_layers_to_capture)."""
    for arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        assert engine_facts.target("sglang", "0.5.11", arch)["capture"] is False
        for version in ("0.5.12", "0.5.13", "0.5.14", "0.5.15", "0.5.16"):
            assert engine_facts.target("sglang", version, arch)["capture"] is True, version
        for version in ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"):
            fact = engine_facts.target("sglang", version, arch)
            assert fact["capture"] is False and "gemma3_causal.py" in fact["why"], fact
            assert fact["final_boundary"] is True  # the loop's, as read


_TEXT_MODEL_FINAL = """
class TextModel:
    def __init__(self, config):
        self.layers_to_capture = []

    def forward(self, hidden_states):
        aux = []
        num_layers = len(self.layers)
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(hidden_states)
            hidden_states = layer(hidden_states)
        {after}
        return hidden_states, aux
"""


@pytest.mark.parametrize(
    "after, boundary",
    [
        ("if num_layers in self.layers_to_capture: aux.append(hidden_states)", True),
        ("pass", False),
    ],
)
def test_the_final_boundary_of_a_text_model_in_another_module(tmp_path, after, boundary):
    """A multimodal class that stores the ids on a text model defined in another module
    (SGLang's gemma4_mm.py -> gemma4_causal.py), with no delegation to a method of it: the
    final-boundary capture is the text model's loop's, read there."""
    wrapper = "from sglang.srt.models.causal import TextModel\n" + _WRAPPER.format(body=_STORE)
    files = {"mm": wrapper, "causal": _TEXT_MODEL_FINAL.format(after=after)}
    fact = _toy_sglang(tmp_path, files)["Wrapper"]
    assert fact["capture"] is True and fact["rule"] == "+1", fact
    assert fact.get("final_boundary", False) is boundary, fact


def test_gemma4_multimodal_captures_the_final_boundary():
    """SGLang 0.5.13+'s Gemma4ForConditionalGeneration stores the ids (+1) on its
    language_model, a gemma4_causal.py Gemma4TextModel whose loop captures after its last
    layer (``if num_layers in self.layers_to_capture``): capture layer n is captured."""
    for version in ("0.5.13", "0.5.18", "0.5.20", "0.5.22", "0.5.23"):
        for arch in ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration"):
            fact = engine_facts.target("sglang", version, arch)
            assert fact["capture"] is True and fact["final_boundary"] is True, (version, fact)


def test_sglang_classes_without_the_method_cannot_capture():
    assert engine_facts.target("sglang", "0.5.23", "MixtralForCausalLM") == {
        "class": "mixtral.MixtralForCausalLM",
        "capture": False,
    }
    assert (
        engine_facts.target("sglang", "0.5.9", "KimiK25ForConditionalGeneration")["capture"]
        is False
    )


def test_code_that_cannot_be_read_mechanically_says_why():
    fact = engine_facts.target("sglang", "0.5.23", "MindSporeForCausalLM")
    assert fact["capture"] is None and "built at run time" in fact["why"]


def test_draft_registries():
    assert engine_facts.registers_draft("sglang", "0.5.9", "LlamaForCausalLMEagle3")
    assert not engine_facts.registers_draft("sglang", "0.5.11", "Eagle3DeepseekV2ForCausalLM")
    assert engine_facts.registers_draft("sglang", "0.5.12", "Eagle3DeepseekV2ForCausalLM")
    assert engine_facts.registers_draft("vllm", "0.32.0", "PEagleDraftModel")
    assert not engine_facts.registers_draft("vllm", "0.34.0", "PEagleDraftModel")
    assert "Eagle3Qwen3ForCausalLM" in engine_facts.eagle3_drafts()
    assert engine_facts.draft_class("sglang", "Eagle3DeepseekV2ForCausalLM") == (
        "0.5.12",
        "kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM",
    )
    assert engine_facts.registered_anywhere("DeepSeekMTPModel")  # vLLM, speculative
    assert not engine_facts.registered_anywhere("SomeEagle3Draft")


def test_the_final_boundary_is_read_from_each_loop():
    """Loops that capture after their last layer (capture layer num_layers): Gemma 3 / 4
    from 0.5.12 (``if num_layers in self.layers_to_capture``), GPT-OSS from 0.5.17 (0.5.17 -
    0.5.20: each layer's output, ``i + 1 in ...``; 0.5.21+: ``self.end_layer in ...``);
    Llama's and DeepseekV2's loops capture only before a layer."""
    from eagle_capture.layer_ids.engine_read import FINAL_BOUNDARY

    def boundary(version, arch):
        return bool(engine_facts.target("sglang", version, arch).get("final_boundary"))

    assert boundary("0.5.13", "Gemma3ForCausalLM") and boundary("0.5.23", "Gemma4ForCausalLM")
    assert boundary("0.5.23", "Gemma3ForConditionalGeneration")  # delegated to Gemma3's loop
    assert boundary("0.5.12", "Gemma3ForCausalLM") and boundary("0.5.12", "Gemma4ForCausalLM")
    assert not boundary("0.5.16", "GptOssForCausalLM")
    assert boundary("0.5.17", "GptOssForCausalLM") and boundary("0.5.21", "GptOssForCausalLM")
    for arch in ("LlamaForCausalLM", "DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert not any(boundary(v, arch) for v in engine_facts.SGLANG_RELEASES), arch
    for text, captured in [
        ("if self.end_layer in self.layers_to_capture:", True),
        ("if num_layers in self.layers_to_capture:", True),
        ("if i + 1 in self.layers_to_capture:", True),
        ("and self.end_layer - 1 in self.layers_to_capture", False),
        ("if i in self.layers_to_capture", False),
        ("x.num_layers in self.layers_to_capture", False),
    ]:
        assert bool(FINAL_BOUNDARY.search(text)) is captured, text


def test_the_capture_only_mode_as_read():
    """SGLang's --enable-return-aux-hidden-states (a server-argument field, read in each
    wheel): 0.5.23 only among the releases read; the doctor's capture-only line is built
    from it (older versions refused)."""
    from eagle_capture.layer_ids import capture_only
    from eagle_capture.layer_ids.lines import CapturePlanError

    assert engine_facts.capture_only_releases() == ["0.5.23"]
    assert capture_only.line_for(None).first == (0, 5, 23)
    assert capture_only.line_for("0.5.24").read_versions == ("0.5.23",)
    with pytest.raises(CapturePlanError, match="came in 0.5.23"):
        capture_only.line_for("0.5.22")


SENTINEL_SOURCE = "parsed_by_the_wheel_reader_test = 1"


def test_wheel_source_parse_retries_another_threads_clash(monkeypatch):
    """Some CPython 3.11 releases raise SystemError when two threads convert ASTs at once
    (the wheels are read in a background thread of the suite): the reader tries again."""
    import ast

    from eagle_capture.layer_ids import engine_read

    real, calls = ast.parse, []

    def clashing(source, *args, **kwargs):  # (anyone else's parse, pytest's too, as it is)
        if source == SENTINEL_SOURCE:
            calls.append(source)
            if len(calls) < 3:
                raise SystemError("AST constructor recursion depth mismatch (before=36, after=203)")
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", clashing)
    assert isinstance(engine_read.parse_source(SENTINEL_SOURCE).body[0], ast.Assign)
    assert len(calls) == 3


def test_wheel_source_parse_gives_up_on_a_lasting_error(monkeypatch):
    import ast

    from eagle_capture.layer_ids import engine_read

    real, calls = ast.parse, []

    def broken(source, *args, **kwargs):
        if source == SENTINEL_SOURCE:
            calls.append(source)
            raise SystemError("always")
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", broken)
    with pytest.raises(SystemError, match="always"):
        engine_read.parse_source(SENTINEL_SOURCE)
    assert len(calls) == engine_read.AST_TRIES


@pytest.mark.parametrize(
    "read, found",
    [
        ("if self.draft_runner.model.hot_token_id is not None: pass", True),
        ("x = self.draft_model_runner.model.hot_token_id", True),  # 0.5.9's v1 worker
        ('if getattr(self.draft_runner.model, "hot_token_id", None) is None: pass', False),
        ("x = self.target_worker.model.hot_token_id", False),
    ],
)
def test_what_the_eagle3_worker_reads_of_the_draft(tmp_path, read, found):
    """SGLang's EAGLE-3 worker reads the draft model's hot_token_id with no fallback; a
    getattr with a default, or another model's attribute, is not such a read."""
    import zipfile

    from eagle_capture.layer_ids.engine_read import sglang_eagle3_draft_attribute

    wheel = tmp_path / "sglang-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "sglang/srt/speculative/eagle_worker_v2.py",
            f"class EAGLEWorker:\n    def init_lm_head(self):\n        {read}\n",
        )
    got = sglang_eagle3_draft_attribute(str(wheel))
    if found:
        assert got == {"attribute": "hot_token_id", "where": "speculative/eagle_worker_v2.py:3"}
    else:
        assert got is None


def test_every_sglang_eagle3_worker_needs_hot_token_id():
    """Read in each wheel: the worker's unguarded read of the draft's hot_token_id, which
    only SGLang's EAGLE-3 draft classes set (llama_eagle3, kimi_k25_eagle3): a draft named
    as a target model (LlamaForCausalLM) fails there."""
    for version in engine_facts.SGLANG_RELEASES:
        needs = engine_facts.eagle3_draft_attribute(version)
        assert needs["attribute"] == "hot_token_id", (version, needs)
        assert needs["where"].startswith("speculative/eagle_worker"), needs


_VLLM_DRAFT = """
class Model:
    def __init__(self, config):
        self.config = config
        eagle_config = getattr(self.config, "eagle_config", None) or {}
        self.norm_before_fc = eagle_config.get("norm_before_fc", False)
        {body}
        self.fc_input_size = 64 * self.num_aux


class Eagle3ToyForCausalLM:
    def __init__(self, config):
        self.model = Model(config)
"""


@pytest.mark.parametrize(
    "body, reads",
    [
        # vLLM's Llama / DeepSeek drafts: the count, else eagle_config's ids, else 3
        (
            'self.num_aux = getattr(self.config, "num_aux_hidden_states", None)\n'
            "        if self.num_aux is None:\n"
            '            layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")\n'
            "            self.num_aux = len(layer_ids) if layer_ids else 3",
            ["num_aux_hidden_states", "eagle_config.eagle_aux_hidden_state_layer_ids"],
        ),
        # Qwen3's: the top-level ids too, before eagle_config's
        (
            'ids = getattr(self.config, "eagle_aux_hidden_state_layer_ids", None) or '
            'eagle_config.get("eagle_aux_hidden_state_layer_ids")\n'
            "        self.num_aux = len(ids) if ids else 3",
            ["eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids"],
        ),
    ],
)
def test_how_a_vllm_draft_class_sizes_its_fc(tmp_path, body, reads):
    """The keys read into the count (not the norm flags read beside them), in order, and
    the default; file:line of the default."""
    import zipfile

    from eagle_capture.layer_ids.engine_read import read_vllm

    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/model_executor/models/__init__.py", "")
        z.writestr(
            "vllm/model_executor/models/registry.py",
            '_SPECULATIVE_DECODING_MODELS = {"Eagle3ToyForCausalLM": '
            '("toy_eagle3", "Eagle3ToyForCausalLM")}\n',
        )
        z.writestr("vllm/model_executor/models/toy_eagle3.py", _VLLM_DRAFT.replace("{body}", body))
    fc = read_vllm(str(wheel))["eagle3_draft_fc"]["toy_eagle3.Eagle3ToyForCausalLM"]
    assert fc["reads"] == reads and fc["default"] == 3, fc
    assert fc["where"].startswith("toy_eagle3.py:"), fc


def test_vllm_draft_fc_width_per_release():
    """Read in each vLLM wheel: Llama's and DeepSeek's EAGLE-3 drafts size the fc from
    num_aux_hidden_states, else eagle_config's ids, never the top-level ids (where
    speculators' format puts them); Qwen3's reads those too. speculators' drafts get
    Eagle3LlamaForCausalLM (model_type llama, the default) or Eagle3Qwen3ForCausalLM."""
    nested_only = ["num_aux_hidden_states", "eagle_config.eagle_aux_hidden_state_layer_ids"]
    for release in engine_facts.VLLM_RELEASES:
        facts = engine_facts.load()["vllm"][release]["eagle3_draft_fc"]
        assert facts["llama_eagle3.Eagle3LlamaForCausalLM"]["reads"] == nested_only
        assert facts["deepseek_eagle3.Eagle3DeepseekV2ForCausalLM"]["reads"] == nested_only
        assert (
            "eagle_aux_hidden_state_layer_ids"
            in (facts["qwen3_eagle3.Eagle3Qwen3ForCausalLM"]["reads"])
        )
        assert engine_facts.vllm_speculators_eagle3(release) == {
            "archs": {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"},
            "model_type_default": "llama",
        }
        width = engine_facts.vllm_draft_fc(
            release,
            "Eagle3LlamaForCausalLM",
            {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}.get,
        )
        assert width[0] == 3, width  # the top-level ids are not read


def test_where_vllm_reads_a_models_layer_count():
    """Read in each vLLM wheel (model_arch_config_convertor.py): LongCat-Flash's layer count
    is its num_layers (its num_hidden_layers counts two sublayers a layer), also for a
    config that names no model type (config.py's _ARCHITECTURE_TO_MODEL_TYPE); other
    targets' is num_hidden_layers."""
    for release in engine_facts.VLLM_RELEASES:
        read = engine_facts.load()["vllm"][release]["layer_count"]
        assert read["fields"]["longcat_flash"] == "num_layers", read
        assert read["model_types"]["LongcatFlashForCausalLM"] == "longcat_flash", read
    assert engine_facts.layer_count_field("longcat_flash") == "num_layers"
    assert engine_facts.layer_count_field(None, "LongcatFlashForCausalLM") == "num_layers"
    assert engine_facts.layer_count_field("llama", "LlamaForCausalLM") is None
