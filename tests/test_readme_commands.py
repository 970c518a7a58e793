"""The README's two commands, run from a fresh checkout as a newcomer runs them, so that a
set-up step they miss fails CI instead of the next newcomer.

The checkout is what ``git clone`` of this tree gives (tracked files and new files not
ignored; no .venv, no .cache, no build outputs). Its ``.venv`` is seeded with this test
Python's torch and Triton (linked, with the packages they need, and nothing else): the
one step skipped is the torch wheel's install, which ``tests/test_setup_env.py`` covers.
Everything else is the script's own work: the test and benchmark extras from the package
index, the package itself, then the command. The test command runs a small selection
(the whole suite would run this test again); the benchmark command runs as written.

Runs in the background from the session's start (tests/engine_jobs.py). Skipped where
``python3`` itself has torch (a GPU machine): the scripts use that Python as it is, and
installing this checkout into it would change the machine's environment.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkout import fresh_checkout, seed_venv
from engine_jobs import Job

ROOT = Path(__file__).resolve().parents[1]
SELECTION = ["-m", "not engines", "-k", "test_trainers or test_kernel", "-p", "no:cacheprovider"]


def readme_commands() -> list[str]:
    """The commands of the README's "Two commands" block (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [
        line.split("#", 1)[0].strip()
        for line in block.splitlines()
        if line.split("#", 1)[0].strip()
    ]


def _python3_has_torch() -> bool:
    return (
        subprocess.run(["python3", "-c", "import torch, triton"], capture_output=True).returncode
        == 0
    )


def _readme_run(base: Path, jobs):
    checkout = base / "fresh_checkout"
    if checkout.exists():
        shutil.rmtree(checkout)
    fresh_checkout(checkout)
    seed_venv(checkout / ".venv")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "VIRTUAL_ENV", "PYTHONPATH")
    }
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    out = {}
    for command in readme_commands():
        argv = command.split() + (SELECTION if command.endswith("test.sh") else [])
        log = base / f"fresh_checkout_{Path(argv[1]).stem}.log"
        with open(log, "w") as f:
            proc = jobs.track(
                subprocess.Popen(argv, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT)
            )
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out[command] = (proc.returncode, log.read_text(errors="replace"))
    return checkout, out


def engine_jobs(item, base: Path, jobs) -> list:
    """The fresh-checkout run (tests/engine_jobs.py) for the test that needs it."""
    if item.originalname != "test_readme_commands_from_a_fresh_checkout" or _python3_has_torch():
        return []
    return [Job(-90, "readme commands", lambda: _readme_run(base, jobs))]


def test_readme_names_the_two_commands_and_ci_runs_one():
    assert readme_commands() == ["bash scripts/bench.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_commands_from_a_fresh_checkout(engine_jobs):
    if _python3_has_torch():
        pytest.skip(
            "python3 already has torch and triton: the README's commands would install "
            "this checkout into it"
        )
    checkout, out = engine_jobs.result("readme commands")
    code, log = out["bash scripts/bench.sh"]
    assert code == 0, log[-4000:]
    assert "installing test/bench extras" in log, log[-4000:]  # the set-up ran, not skipped
    assert (checkout / "benchmarks" / "out" / "capture_latency_cpu_H7168.json").exists(), log[
        -3000:
    ]
    code, log = out["bash scripts/test.sh"]
    assert code == 0, log[-4000:]
    assert re.search(r"\d+ passed", log) and " failed" not in log, log[-4000:]
    installed = subprocess.run(
        [
            str(checkout / ".venv" / "bin" / "python"),
            "-c",
            "import eagle_capture; print(eagle_capture.__file__)",
        ],
        cwd="/",
        capture_output=True,
        text=True,
    )
    assert installed.stdout.strip() == str(checkout / "eagle_capture" / "__init__.py"), (
        installed.stderr[-2000:]
    )


def test_test_sh_runs_the_file_it_is_given_and_else_the_suite(tmp_path):
    """``bash scripts/test.sh tests/FILE.py`` runs that file only (it once always added
    ``tests`` and ran the whole suite); no path: pyproject.toml's testpaths; options pass
    through. Run on a two-file suite with this checkout's test.sh and pyproject.toml."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "scripts" / "setup_env.sh").write_text(f"echo {sys.executable}\n")
    for name in ("a", "b"):
        (tmp_path / "tests" / f"test_{name}.py").write_text(f"def test_{name}():\n    pass\n")

    def run(*args):
        result = subprocess.run(
            ["bash", "scripts/test.sh", "-p", "no:cacheprovider", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return re.search(r"(\d+) passed", result.stdout).group(1)

    assert run("tests/test_a.py") == "1"
    assert run("tests/test_b.py::test_b") == "1"
    assert run() == "2"
    assert run("-k", "test_b") == "1"
