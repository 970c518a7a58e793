"""The package as a user gets it: a wheel and an sdist built from a clean copy of the
checkout, the wheel installed (not editable) into a fresh virtualenv and used from a
directory outside the checkout, so that nothing of the source tree can stand in for a
file the wheel lacks. (Every other test runs the editable install, which reads the
source tree: a wheel without ``integrations/sglang/families/`` once passed them all, and
SGLang's plugin then failed with ModuleNotFoundError in every wheel install.)

Built with the build backend's own PEP 517 hooks, as ``python -m build --no-isolation``
does, with the setuptools this Python has: offline, a few seconds. ``EAGLE_CAPTURE_DIST=DIR``
tests the sdist and wheel in DIR instead (``scripts/release.sh`` passes what it built).
"""

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from checkout import ROOT, build_dists, fresh_checkout, seed_venv

# Modules that import a serving engine at their top: checked only where the engine imports
# (the fresh venv has torch and Triton, no engine); the real-engine tests import them.
ENGINE_MODULES = {
    f"eagle_capture.integrations.vllm.{name}": "vllm" for name in ("install", "model", "norms")
}
# Run, not imported: importing a package's __main__ runs its command line.
NOT_IMPORTED = {"eagle_capture.__main__"}

EXAMPLE = [
    "doctor",
    "--draft-config",
    str(ROOT / "examples" / "llama3_70b_specforge_draft_config.json"),
    "--target-config",
    str(ROOT / "examples" / "llama3_70b_target_config.json"),
]


def _package_files(tree: Path) -> dict[str, bytes]:
    """Every file of the package in a source tree, by its path in a wheel."""
    return {
        p.relative_to(tree).as_posix(): p.read_bytes()
        for p in sorted((tree / "eagle_capture").rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _module_names(tree: Path) -> list[str]:
    names = []
    for p in sorted((tree / "eagle_capture").rglob("*.py")):
        parts = p.relative_to(tree).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _clean_env() -> dict:
    """This process's environment without what would put the checkout on sys.path, and
    without the tests' Triton interpreter (it needs numpy, which the venv lacks; importing
    the kernels needs no interpreter)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")
    }
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(argv, cwd, timeout=300):
    return subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _install(wheel: Path, venv_python: Path, cwd: Path) -> None:
    # This Python's pip installs into the venv (--python): the venv needs no pip of its own.
    result = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            venv_python,
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            wheel,
        ],
        cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source tree, wheel, sdist), built from what ``git clone`` of this tree gives."""
    if (
        subprocess.run(
            [sys.executable, "-c", "import setuptools.build_meta"], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("setuptools is not installed: nothing to build the wheel with")
    base = tmp_path_factory.mktemp("packaging")
    src, dist = base / "src", base / "dist"
    fresh_checkout(src)
    if os.environ.get("EAGLE_CAPTURE_DIST"):
        dist = Path(os.environ["EAGLE_CAPTURE_DIST"]).resolve()
        (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
        return src, wheel, sdist
    wheel, sdist = build_dists(src, dist)
    return src, wheel, sdist


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """A fresh venv (torch and Triton linked in, nothing of the checkout) with the wheel."""
    base = tmp_path_factory.mktemp("installed")
    python = seed_venv(base / "venv")
    _install(built[1], python, base)
    return python, base


def test_the_wheel_and_the_sdist_carry_every_file_of_the_package(built):
    src, wheel, sdist = built
    expected = _package_files(src)
    assert "eagle_capture/integrations/sglang/families/__init__.py" in expected
    assert "eagle_capture/probe/prompts.jsonl" in expected
    with zipfile.ZipFile(wheel) as z:
        shipped = {n: z.read(n) for n in z.namelist() if n.startswith("eagle_capture/")}
    assert sorted(set(expected) - set(shipped)) == [], "files the wheel lacks"
    assert sorted(set(shipped) - set(expected)) == [], "files the wheel has that the tree lacks"
    assert shipped == expected, "a file differs between the wheel and the tree"
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    wanted = set(expected) | {
        "setup.py",
        "pyproject.toml",
        "MANIFEST.in",
        "README.md",
        "LICENSE",
        "CHANGELOG.md",
        "examples/llama3_70b_specforge_draft_config.json",
    }
    assert sorted(wanted - in_sdist) == [], f"files the sdist {top} lacks"


def test_the_version_has_a_changelog_section(built):
    """The one version (eagle_capture.__version__, which setup.py reads) is what the wheel
    is called, and CHANGELOG.md describes it."""
    import eagle_capture

    assert built[1].name.startswith(f"eagle_capture-{eagle_capture.__version__}-")
    assert f"\n## {eagle_capture.__version__} " in (ROOT / "CHANGELOG.md").read_text()


def test_the_installed_wheel_imports_every_module_and_registers_its_plugins(built, installed):
    src, _, _ = built
    python, cwd = installed
    modules = [m for m in _module_names(src) if m not in NOT_IMPORTED]
    code = """
import importlib, json, sys
from importlib import metadata
modules, engines = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {"file": importlib.import_module("eagle_capture").__file__, "skipped": {}, "failed": {}}
for name in modules:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if engines.get(name) != (e.name or "").split(".")[0]:
            out["failed"][name] = repr(e)
        else:
            out["skipped"][name] = e.name
    except Exception as e:
        out["failed"][name] = repr(e)
out["entry_points"] = {}
for group in ("sglang.srt.plugins", "vllm.general_plugins", "console_scripts"):
    for ep in metadata.entry_points(group=group):
        if ep.dist.name == "eagle-capture":
            fn = ep.load()
            out["entry_points"][group + ":" + ep.name] = fn.__module__ + ":" + fn.__qualname__
print(json.dumps(out))
"""
    result = _run([python, "-c", code, json.dumps(modules), json.dumps(ENGINE_MODULES)], cwd)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.splitlines()[-1])
    site = Path(python).parent.parent
    assert Path(out["file"]).resolve().is_relative_to(site.resolve()), out["file"]
    assert out["failed"] == {}, out["failed"]
    # Only the engine modules may be skipped, and only for their engine.
    assert set(out["skipped"]) <= set(ENGINE_MODULES), out["skipped"]
    print(
        f"modules imported from the wheel: {len(modules) - len(out['skipped'])} of "
        f"{len(modules)}; skipped (engine not installed): {out['skipped'] or 'none'}"
    )
    assert out["entry_points"] == {
        "sglang.srt.plugins:eagle_capture": "eagle_capture.integrations.sglang.plugin:register",
        "vllm.general_plugins:eagle_capture": "eagle_capture.integrations.vllm.plugin:register",
        "console_scripts:eagle-capture": "eagle_capture.cli:console_main",
    }


def test_the_installed_console_script_runs_the_doctor(installed):
    python, cwd = installed
    result = _run([Path(python).parent / "eagle-capture", *EXAMPLE], cwd)
    # 0: the example's draft is fed right by SGLang and by vLLM's default runner (the README's
    # excerpt); its V1 runner's problem is shown without deciding.
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.startswith("summary: SGLang: OK; vLLM: OK")
    assert "trainer: SpecForge" in result.stdout and "verdict (vLLM)" in result.stdout
    assert result.stderr == "", result.stderr[-3000:]


@pytest.fixture(scope="module")
def without_torch(built, tmp_path_factory):
    """A fresh venv holding only the wheel (``--no-deps``): no torch, no Triton."""
    base = tmp_path_factory.mktemp("no_torch")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", base / "venv"], check=True)
    python = base / "venv" / "bin" / "python"
    _install(built[1], python, base)
    return python, base


def test_the_doctor_runs_without_torch_or_triton(without_torch):
    python, cwd = without_torch
    assert _run([python, "-c", "import torch"], cwd).returncode != 0, "the venv has torch"
    script = Path(python).parent / "eagle-capture"
    for argv in (
        [script, "--help"],
        [script, "doctor", "--help"],
        [python, "-m", "eagle_capture", "--help"],
    ):
        result = _run(argv, cwd)
        assert result.returncode == 0 and result.stderr == "", (argv, result.stderr[-3000:])
    result = _run([script, *EXAMPLE], cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "verdict (vLLM)" in result.stdout and result.stderr == "", result.stderr[-3000:]
    result = _run([script, "--version"], cwd)
    assert result.returncode == 0 and result.stdout.startswith("eagle-capture "), result.stderr
    # The probe runs the models: without torch it says so in one line.
    result = _run([script, "probe", "--help"], cwd)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert "needs torch" in result.stderr
    # The package itself imports; an op, used, says what is missing.
    code = (
        "import sys, eagle_capture\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules\n"
        "try:\n"
        "    eagle_capture.add_capture\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name)\n"
    )
    result = _run([python, "-c", code], cwd)
    assert result.returncode == 0 and result.stdout.strip() == "torch", result.stderr[-3000:]
