"""Properties of the package as a whole, checked in a fresh interpreter."""

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The variables eagle_capture.parallel.symm handles; unset in the child so that an
# import-time setdefault would show.
MULTICAST_VARIABLES = (
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NCCL_NVLS_ENABLE",
    "NVSHMEM_DISABLE_NVLS",
)


def test_importing_the_package_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_VARIABLES}
    # torch._dynamo's import sets TORCHINDUCTOR_CACHE_DIR (torch 2.13): torch's
    # doing, so torch and Triton are imported before the snapshot.
    code = (
        "import os, torch, torch._dynamo, triton; before = dict(os.environ); "
        "import eagle_capture, eagle_capture.parallel.symm; "
        "changed = sorted(k for k in set(before) | set(os.environ) "
        "if before.get(k) != os.environ.get(k)); "
        "assert not changed, f'import changed os.environ: {changed}'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_checkout_hides_no_installed_package():
    """A checkout, ``python -m`` from it and an editable install put the repository root
    on sys.path, where a top-level package folder hides any installed distribution of
    its name. A top-level kernels/ folder hid Hugging Face's ``kernels`` (a dependency of
    transformers >= 5.25), and transformers' hub-kernels import then failed in every
    process that loaded a model from the checkout."""
    root = Path(__file__).resolve().parent.parent
    packages = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert packages == ["eagle_capture"], f"top-level packages besides eagle_capture: {packages}"
    modules = sorted(p.name for p in root.glob("*.py"))
    assert modules == ["setup.py"], f"top-level modules besides setup.py: {modules}"
    # The import that broke, from the root (nothing to check where transformers has no
    # hub-kernels module or Hugging Face's kernels is not installed).
    code = (
        "import importlib.util as u\n"
        "if u.find_spec('transformers') and u.find_spec('transformers.integrations.hub_kernels'):\n"
        "    import transformers.integrations.hub_kernels\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_one_name_per_thing():
    """No aliases for the pre-release layout (nothing under those names was ever
    published): each module and object imports under its one name only."""
    import eagle_capture

    for old in ("eagle_capture.symm", "eagle_capture.sglang", "eagle_capture.doctor"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    with pytest.raises(AttributeError, match="no attribute 'add_rmsnorm_reference'"):
        eagle_capture.add_rmsnorm_reference  # noqa: B018 - the access itself must raise


def test_one_ruff_version_everywhere():
    """The lint CI runs (.ci/run, with the ruff scripts/setup_env.sh installs), the
    pre-commit hook and the lint extra pin one ruff: two versions would disagree
    about the same tree."""
    import re

    root = Path(__file__).resolve().parents[1]
    pins = {
        "scripts/setup_env.sh": re.findall(
            r"^RUFF_VERSION=(\S+)$", (root / "scripts" / "setup_env.sh").read_text(), re.M
        ),
        ".pre-commit-config.yaml": re.findall(
            r"ruff-pre-commit\n\s+rev: v(\S+)", (root / ".pre-commit-config.yaml").read_text()
        ),
        "setup.py": re.findall(r'"ruff==([^"]+)"', (root / "setup.py").read_text()),
    }
    assert all(len(found) == 1 for found in pins.values()), pins
    assert len({found[0] for found in pins.values()}) == 1, pins
    assert "ruff check ." in (root / ".ci" / "run").read_text()


def _imported_modules(source: str, package: str) -> set:
    """Every module ``source`` (a module of ``package``) imports, relative imports
    resolved; ``from P import N`` counts as both P and P.N, since N may be a module."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_the_probe_and_the_plugins_import_the_doctors_library_not_its_command_line():
    """The probe and the plugins use the doctor's library (layer_ids/diagnosis.py);
    the command lines (eagle_capture/cli/: argument parsing, printing; and
    ``python -m eagle_capture.layer_ids.doctor``) are the commands' alone, so that
    changing what a command prints touches nothing they run."""
    import re

    root = Path(__file__).resolve().parents[1]
    command_lines = ("eagle_capture.layer_ids.doctor", "eagle_capture.cli")

    def a_command_line(modules):
        return [m for m in modules for cli in command_lines if m == cli or m.startswith(cli + ".")]

    offenders = []
    for folder in ("probe", "integrations"):
        for path in sorted((root / "eagle_capture" / folder).rglob("*.py")):
            source = path.read_text()
            package = ".".join(path.relative_to(root).parts[:-1])
            # (the text check: importlib.import_module("...") names a module in a string)
            if a_command_line(_imported_modules(source, package)) or re.search(
                r"[\"']eagle_capture\.(cli|layer_ids\.doctor)\b", source
            ):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
    # The check sees each way of writing the import.
    for line in (
        "from eagle_capture.layer_ids.doctor import fix_ids",
        "from eagle_capture.layer_ids import doctor",
        "from ..layer_ids import doctor",
        "from ..layer_ids.doctor import main",
        "import eagle_capture.layer_ids.doctor",
        "from eagle_capture.cli import doctor",
        "from ..cli.probe import main",
        "import eagle_capture.cli",
    ):
        assert a_command_line(_imported_modules(line, "eagle_capture.probe")), line
