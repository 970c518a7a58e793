"""The SGLang drop-in against the real SGLang code, one process per SGLang line.

For each version, ``scripts/sglang_real_env.sh`` prepares (once, cached under
``.cache/sglang``) an overlay with that SGLang wheel and the transformers it
pins; ``tests/sglang_real/scenarios.py`` then runs in a child process with the
overlay first on the path (two SGLang versions cannot share one process) and
reports each scenario. What the scenarios check is in their docstrings; the
harness (``tests/sglang_real/harness.py``) says what is real and what is stood in.

The set-up needs PyPI. On a machine without it (the GPU machine) set
``EAGLE_CAPTURE_SKIP_SGLANG_REAL=1``; nothing else skips these tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every release line whose DeepseekV2 capture surface we read: classic loop +
# layer_communicator (0.5.9: ids always +1; 0.5.13: +1 only when ids[0] == 1),
# communicator + AuxHiddenStatePacker with append (0.5.18, 0.5.20),
# attn_boundary / layer_boundary (0.5.22; 0.5.23 adds packer.slot).
VERSIONS = ["0.5.9", "0.5.13", "0.5.18", "0.5.20", "0.5.22", "0.5.23"]
SCENARIOS = ["same_as_sglang_fp32", "same_as_sglang_bf16", "same_as_sglang_bf16_path_e",
             "residual_in_slot", "norm_paths", "names_and_weights",
             "install_before_torch_compiled", "install_after_torch_compiled",
             "piecewise_compiled", "layer_id_rules", "model_id_rules", "draft_config_reading",
             "graph_order", "drop_in_checks", "refusals",
             # the SGLang plugin through each wheel's own load_plugins() and configure step
             "plugin_deepseek_v3", "plugin_kimi_k25", "plugin_off_and_broken",
             "plugin_refuses_wrong_ids", "plugin_self_check", "plugin_overflow",
             "plugin_server_args", "plugin_checks_every_target"]

pytestmark = pytest.mark.skipif(os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1",
                                reason="EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 (no PyPI here)")

_RESULTS: dict = {}


def _results(version: str, tmp_dir: Path) -> dict:
    if version not in _RESULTS:
        env = dict(os.environ, PY=sys.executable)
        setup = subprocess.run(["bash", "scripts/sglang_real_env.sh", version], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=1200)
        assert setup.returncode == 0, f"set-up of sglang {version} failed:\n{setup.stderr[-3000:]}"
        overlay = setup.stdout.strip().splitlines()[-1]
        out = tmp_dir / f"sglang_{version}.json"
        env["PYTHONPATH"] = os.pathsep.join([overlay, str(ROOT)])
        env.pop("TRITON_INTERPRET", None)   # CPU tensors take the ops' torch path
        run = subprocess.run([sys.executable, "-m", "tests.sglang_real.scenarios",
                              "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=1200)
        assert run.returncode == 0 and out.exists(), \
            f"sglang {version} scenarios crashed:\n{run.stderr[-5000:]}"
        _RESULTS[version] = json.loads(out.read_text())
    return _RESULTS[version]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_real(version, scenario, tmp_path_factory):
    results = _results(version, tmp_path_factory.getbasetemp())
    assert results["version"] == version
    result = results.get(scenario)
    assert result is not None, f"scenario {scenario} did not run"
    assert result["ok"], f"{result['detail']}\n{result.get('traceback', '')}"
    if "skip" in result:  # only where SGLang's own code cannot run here (the reason says why)
        pytest.skip(result["skip"])


def test_gpu_scenarios_dry_run(tmp_path):
    """The H200 script's scenarios (tests/sglang_real/gpu_scenarios.py, run on the GPU by
    scripts/gpu_sglang_real.sh) kept runnable: the same checks on CPU at H = 64 through
    SGLang 0.5.23's CPU paths (no FlashInfer, no CUDA graphs)."""
    env = dict(os.environ, PY=sys.executable)
    setup = subprocess.run(["bash", "scripts/sglang_real_env.sh", "0.5.23"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1200)
    assert setup.returncode == 0, setup.stderr[-3000:]
    env["PYTHONPATH"] = os.pathsep.join([setup.stdout.strip().splitlines()[-1], str(ROOT)])
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "tests.sglang_real.gpu_scenarios", "--device",
                          "cpu", "--hidden", "64", "--no-fake-cuda", "--out",
                          str(tmp_path / "out.json")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text())["n_failed"] == 0
