"""scripts/setup_env.sh: its stdout is exactly one line, the Python's path
(callers do PY=$(bash scripts/setup_env.sh)); progress and pip go to stderr."""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_env.sh"


def _run(cwd_root: Path, env=None, timeout=900):
    return subprocess.run(["bash", str(cwd_root / "scripts" / "setup_env.sh")], cwd="/",
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_set_up_environment_prints_one_line_and_nothing_else():
    # After scripts/test.sh everything is in place and the script is silent; run
    # directly, a first call may install what is missing, and a second must not.
    for attempt in range(2):
        result = _run(ROOT)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("\n") == 1 and result.stdout.endswith("\n"), result.stdout
        if not result.stderr:
            break
    assert result.stderr == "", f"nothing to install, yet stderr says:\n{result.stderr}"
    py = result.stdout.strip()
    path = py if os.path.isabs(py) or "/" not in py else str(ROOT / py)
    assert shutil.which(path), f"{py!r} is not an executable"


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="the +cpu pin applies to Linux x86_64")
def test_no_cpu_wheel_fails_with_a_hint_instead_of_a_cuda_torch(tmp_path):
    """Without a local CPU wheel the torch requirement (torch==2.13.0+cpu) has no
    candidate: the script stops with a hint rather than let pip take PyPI's CUDA
    build. Offline (no index, an empty find-links): a few seconds, no download."""
    if subprocess.run(["python3", "-c", "import torch, triton"],
                      capture_output=True).returncode == 0:
        pytest.skip("python3 already has torch and triton: the script uses it as it is")
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "setup_env.sh")
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k != "EAGLE_CAPTURE_TORCH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty))
    result = _run(tmp_path, env=env, timeout=300)
    assert result.returncode != 0
    assert result.stdout == ""
    assert "installing torch 2.13.0 (CPU build)" in result.stderr
    assert "torch==2.13.0+cpu" in result.stderr
    assert "https://download.pytorch.org/whl/cpu" in result.stderr
