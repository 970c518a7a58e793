"""Helpers for tests that need a fresh checkout or a fresh virtualenv (the README's
commands from a clone, the built wheel installed outside the checkout)."""

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fresh_checkout(dest: Path) -> None:
    """What ``git clone`` of this tree gives, in ``dest``: tracked files and new files not
    ignored (no .venv, no .cache, no build outputs)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        src, dst = ROOT / name, dest / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)


def _requirement_names(dist) -> list[str]:
    names = []
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        names.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
    return names


def seed_venv(venv: Path) -> Path:
    """A new virtualenv ``venv`` with this Python's torch and triton and what they require
    (their files linked into its site-packages), pip and its build tools, nothing else
    (as ``scripts/setup_env.sh`` leaves a new venv after installing torch: torch's own
    requirements, setuptools among them, at the versions its install took). Linked, not
    installed: seconds, no network; and unlike ``--system-site-packages`` (which exposes
    the base interpreter's packages, not a venv's) it works when this Python is a venv.
    Returns the venv's python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    target = Path(
        subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    todo, seen = ["torch", "triton", "pip", "setuptools", "wheel"], set()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this Python lacks
        todo += _requirement_names(dist)
        where = Path(dist.locate_file(""))  # its site-packages (a GPU machine's may differ)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {".."}:
            if (where / top).exists() and not (target / top).exists():
                (target / top).symlink_to(where / top)
    return venv / "bin" / "python"


def build_dists(src: Path, dist: Path) -> tuple[Path, Path]:
    """(wheel, sdist) of the tree ``src``, written to ``dist``, by the build backend's own
    PEP 517 hooks -- what ``python -m build --no-isolation`` does -- with this Python's
    setuptools: offline, seconds."""
    dist.mkdir(parents=True, exist_ok=True)
    # The hooks rewrite sys.argv (setuptools runs setup.py through it): the folder is read first.
    code = (
        "import sys, setuptools.build_meta as backend\n"
        "out = sys.argv[1]; backend.build_sdist(out); backend.build_wheel(out)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(dist)],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    return wheel, sdist
