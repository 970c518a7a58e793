"""The SGLang drop-in against the real SGLang code, one process per SGLang line.

For each version, ``tools/sglang_real_env.sh`` prepares (once, cached under
``.cache/sglang``) an overlay with that SGLang wheel and the transformers it
pins; ``tests/sglang_real/scenarios.py`` then runs in a child process with the
overlay first on the path (two SGLang versions cannot share one process), forked
from that line's fork server (tests/forkserver.py) and started in the background
when the session starts (tests/engine_jobs.py), and reports each scenario. What the scenarios check is in their docstrings; the
harness (``tests/sglang_real/harness.py``) says what is real and what is stood in.

The set-up needs PyPI. On a machine without it (the GPU machine) set
``EAGLE_CAPTURE_SKIP_SGLANG_REAL=1``; nothing else skips these tests.
"""

import json
import os
from pathlib import Path

import pytest

from engine_env import sglang_needs, start_sglang
from engine_jobs import Job

ROOT = Path(__file__).resolve().parents[1]
# Every release line whose DeepseekV2 capture surface we read: classic loop +
# layer_communicator (0.5.9: ids always +1; 0.5.13: +1 only when ids[0] == 1),
# communicator + AuxHiddenStatePacker with append (0.5.18, 0.5.20),
# attn_boundary / layer_boundary (0.5.22; 0.5.23 adds packer.slot).
VERSIONS = ["0.5.9", "0.5.13", "0.5.18", "0.5.20", "0.5.22", "0.5.23"]
SCENARIOS = [
    "same_as_sglang_fp32",
    "same_as_sglang_bf16",
    "same_as_sglang_bf16_path_e",
    "residual_in_slot",
    "norm_paths",
    "names_and_weights",
    "install_before_torch_compiled",
    "install_after_torch_compiled",
    "piecewise_compiled",
    "layer_id_rules",
    "model_id_rules",
    "draft_config_reading",
    "graph_order",
    "drop_in_checks",
    "refusals",
    "eagle3_draft_step",
    # the SGLang plugin through each wheel's own load_plugins() and configure step
    "plugin_deepseek_v3",
    "plugin_kimi_k25",
    "plugin_families",
    "plugin_off_and_broken",
    "plugin_refuses_wrong_ids",
    "plugin_self_check",
    "plugin_overflow",
    "plugin_server_args",
    "plugin_return_modes",
    "plugin_checks_every_target",
]

# The other families' loops (tests/sglang_real/family_scenarios.py), in the same process.
FAMILY_SCENARIOS = ["final_boundary", "switch_back", "fp8_input_quant", "refusals"] + [
    f"{family}_{case}"
    for family in (
        "llama",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "gpt_oss",
        "glm4_moe",
        "minimax_m2",
    )
    for case in ("fp32_f", "fp32_e", "bf16_f")
]
# The families compiled (~9 s each on CI's cores): on one line per loop style of theirs
# (0.5.13 classic, 0.5.20 packer with append, 0.5.23 boundaries with packer.slot).
FAMILY_COMPILED = [f"{family}_compiled" for family in ("llama", "qwen3_moe", "gpt_oss")]
FAMILY_COMPILED_VERSIONS = ["0.5.13", "0.5.20", "0.5.23"]

pytestmark = pytest.mark.skipif(
    os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1",
    reason="EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 (no PyPI here)",
)
TIMEOUT_S = 1200


def run_to_end(jobs, process, log: Path, timeout_s: float, what: str) -> str:
    """Wait for ``process`` (killed past ``timeout_s``); its log. Fails with the log's
    tail when it did not exit 0."""
    import subprocess

    jobs.track(process)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(
            f"{what} did not finish within {timeout_s} s:\n"
            f"{log.read_text(errors='replace')[-5000:]}"
        ) from None
    text = log.read_text(errors="replace")
    assert process.returncode == 0, f"{what} crashed (exit {process.returncode}):\n{text[-5000:]}"
    return text


def _scenarios_job(version: str, base: Path, jobs) -> Job:
    def run():
        out = base / f"sglang_{version}.json"
        log = base / f"sglang_{version}.log"
        skip = (
            []
            if version in FAMILY_COMPILED_VERSIONS
            else ["--skip"] + [f"family_{name}" for name in FAMILY_COMPILED]
        )
        process = start_sglang(
            version, "tests.sglang_real.scenarios", ["--json", str(out)] + skip, log
        )
        run_to_end(jobs, process, log, TIMEOUT_S, f"sglang {version} scenarios")
        return json.loads(out.read_text())

    return Job(-60, f"sglang {version} scenarios", run, needs=sglang_needs(version))


def _gpu_dry_run_job(base: Path, jobs) -> Job:
    def run():
        out = base / "sglang_gpu_scenarios_dry_run.json"
        log = base / "sglang_gpu_scenarios_dry_run.log"
        process = start_sglang(
            "0.5.23",
            "tests.sglang_real.gpu_scenarios",
            ["--device", "cpu", "--hidden", "64", "--no-fake-cuda", "--out", str(out)],
            log,
        )
        run_to_end(jobs, process, log, 600, "the GPU scenarios' dry run")
        return json.loads(out.read_text())

    return Job(-15, "sglang 0.5.23 gpu scenarios dry run", run, needs=sglang_needs("0.5.23"))


def engine_jobs(item, base: Path, jobs) -> list:
    """The run a selected test needs (tests/engine_jobs.py)."""
    if os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1":
        return []
    if item.originalname == "test_gpu_scenarios_dry_run":
        return [_gpu_dry_run_job(base, jobs)]
    return [_scenarios_job(item.callspec.params["version"], base, jobs)]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_real(version, scenario, engine_jobs):
    results = engine_jobs.result(f"sglang {version} scenarios")
    assert results["version"] == version
    result = results.get(scenario)
    assert result is not None, f"scenario {scenario} did not run"
    assert result["ok"], f"{result['detail']}\n{result.get('traceback', '')}"
    if "skip" in result:  # only where SGLang's own code cannot run here (the reason says why)
        pytest.skip(result["skip"])


@pytest.mark.parametrize("scenario", FAMILY_SCENARIOS)
@pytest.mark.parametrize("version", VERSIONS)
def test_family_capture(version, scenario, engine_jobs):
    """Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / GPT-OSS / GLM-4 MoE / MiniMax-M2:
    what the draft receives with the fused capture == SGLang's own, in each wheel's code."""
    test_sglang_real(version, f"family_{scenario}", engine_jobs)


@pytest.mark.parametrize("scenario", FAMILY_COMPILED)
@pytest.mark.parametrize("version", FAMILY_COMPILED_VERSIONS)
def test_family_capture_compiled(version, scenario, engine_jobs):
    """The families through SGLang's torch.compile path: equal to SGLang's own, compiled."""
    test_sglang_real(version, f"family_{scenario}", engine_jobs)


# Which tensor SGLang's own capture holds, against transformers' hidden_states for the same
# weights (tests/sglang_real/hf_tensor.py), per family and line.
HF_TENSOR_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k25",
    "gemma3",
    "gemma4",
    "gemma4_mm",
)


@pytest.mark.parametrize("family", HF_TENSOR_FAMILIES)
@pytest.mark.parametrize("version", VERSIONS)
def test_capture_holds_the_residual_stream(version, family, engine_jobs):
    """SGLang's capture of each family on each line holds transformers' hidden_states[k]
    (the residual stream the draft was trained on), not the normed input nor the
    pre-residual output -- except where the engine facts, read from the line's code,
    say its loop captures each layer's branch (Gemma 3 from 0.5.18): there the
    measurement must find that other tensor, the two derivations agreeing. The doctor's
    data (layer_ids/data/capture_tensors.json) records exactly what was measured."""
    from eagle_capture.layer_ids import engine_facts, tensors

    results = engine_jobs.result(f"sglang {version} scenarios")
    result = results.get(f"family_hf_tensor_{family}")
    assert result is not None and result["ok"], result
    arch = result["architecture"]
    fact = engine_facts.target("sglang", version, arch)
    if result["tensor"] is None:  # not on this line, or no method: the engine facts say so
        assert fact is None or fact["capture"] is False, (result, fact)
        assert tensors.measured("sglang", version, arch) is None
        return
    if "branch output" in fact.get("why", ""):
        assert result["tensor"] == tensors.PRE_RESIDUAL, result
    else:
        assert fact["capture"] is True, fact
        assert result["tensor"] == tensors.RESIDUAL, result
    assert tensors.measured("sglang", version, arch) == result["tensor"]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_draft_named_as_the_target_has_no_hot_token_id(version, engine_jobs):
    """SGLang builds its target Llama for a draft whose architectures says
    LlamaForCausalLM (the original EAGLE-3 checkpoints), and that model has no
    hot_token_id -- which the line's EAGLE-3 worker reads (engine facts): the doctor's
    CANNOT LOAD for such drafts rests on both."""
    from eagle_capture.layer_ids import engine_facts

    result = engine_jobs.result(f"sglang {version} scenarios").get("family_draft_named_as_target")
    assert result is not None and result["ok"], result
    assert result["class"] == "sglang.srt.models.llama.LlamaForCausalLM", result
    assert result["hot_token_id"] is False, result
    assert engine_facts.eagle3_draft_attribute(version)["attribute"] == "hot_token_id"


def test_gpu_scenarios_dry_run(engine_jobs):
    """The H200 script's scenarios (tests/sglang_real/gpu_scenarios.py, run on the GPU by
    tools/gpu/gpu_sglang_real.sh) kept runnable: the same checks on CPU at H = 64 through
    SGLang 0.5.23's CPU paths (no FlashInfer, no CUDA graphs)."""
    assert engine_jobs.result("sglang 0.5.23 gpu scenarios dry run")["n_failed"] == 0
