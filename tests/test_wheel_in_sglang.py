"""The built wheel serves SGLang's plugin: the wheel of a clean copy of the checkout,
unpacked into a folder (``pip install --target``) that comes first on the path of a fresh
interpreter, runs the real SGLang 0.5.23's plugin scenarios -- SGLang's own
``load_plugins()`` finds the wheel's entry point, its configure step installs the fused
capture in DeepSeek-V3 and in every other family's model code, compared with SGLang's own
capture (tests/sglang_real/plugin_scenarios.py). A wheel without a module the plugin
imports (``integrations/sglang/families/`` was once left out) fails here, as it failed in
every wheel install, while the editable install every other engine test runs passed.

Needs the SGLang overlay (tools/sglang_real_env.sh, PyPI once);
``EAGLE_CAPTURE_SKIP_SGLANG_REAL=1`` skips it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkout import build_dists, fresh_checkout
from engine_env import sglang_env, sglang_needs
from engine_jobs import Job

VERSION = "0.5.23"
SCENARIOS = ["plugin_deepseek_v3", "plugin_families"]

pytestmark = pytest.mark.skipif(
    os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1",
    reason="EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 (no PyPI here)",
)

# Run in a fresh interpreter (not forked from a server that imported the checkout's
# package): the package must come from the wheel, then the scenarios run as a module.
RUN = """
import runpy, sys
import eagle_capture
assert eagle_capture.__file__.startswith(sys.argv[1]), eagle_capture.__file__
sys.argv = ["scenarios", "--json", sys.argv[2], "--only", *sys.argv[3:]]
runpy.run_module("tests.sglang_real.scenarios", run_name="__main__")
"""


def _run(base: Path, jobs):
    work = base / "wheel_in_sglang"
    fresh_checkout(work / "src")
    wheel, _ = build_dists(work / "src", work / "dist")
    unpacked = work / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(unpacked),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    env = sglang_env(VERSION)
    # The wheel first; the checkout last, for the scenario modules under tests/ only.
    env["PYTHONPATH"] = os.pathsep.join([str(unpacked), env["PYTHONPATH"]])
    out, log = work / "scenarios.json", work / "scenarios.log"
    with open(log, "w") as f:
        process = jobs.track(
            subprocess.Popen(
                [sys.executable, "-c", RUN, str(unpacked), str(out), *SCENARIOS],
                cwd=work,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    text = log.read_text(errors="replace")
    return process.returncode, text, json.loads(out.read_text()) if out.exists() else None


def engine_jobs(item, base: Path, jobs) -> list:
    """The run the test needs (tests/engine_jobs.py)."""
    if os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1":
        return []
    return [Job(-20, "wheel in sglang", lambda: _run(base, jobs), needs=sglang_needs(VERSION))]


def test_the_built_wheel_serves_sglangs_plugin(engine_jobs):
    code, log, results = engine_jobs.result("wheel in sglang")
    assert code == 0 and results is not None, log[-5000:]
    for name in SCENARIOS:
        assert results[name]["ok"] is True, (name, results[name])
    # Every family's model code got the fused capture from the wheel's plugin.
    families = {k: v for k, v in results["plugin_families"].items() if k not in ("ok", "seconds")}
    assert families and all("fused EAGLE-3 capture ON" in str(v) for v in families.values()), (
        families
    )
