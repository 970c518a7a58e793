"""scripts/setup_env.sh: its stdout is exactly one line, the Python's path
(callers do PY=$(bash scripts/setup_env.sh)); progress and pip go to stderr."""

import functools
import http.server
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_env.sh"


def _run(cwd_root: Path, env=None, timeout=900):
    return subprocess.run(
        ["bash", str(cwd_root / "scripts" / "setup_env.sh")],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_set_up_environment_prints_one_line_and_nothing_else():
    # After scripts/test.sh everything is in place and the script is silent; run
    # directly, a first call may install what is missing, and a second must not.
    for _ in range(2):
        result = _run(ROOT)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("\n") == 1 and result.stdout.endswith("\n"), result.stdout
        if not result.stderr:
            break
    assert result.stderr == "", f"nothing to install, yet stderr says:\n{result.stderr}"
    py = result.stdout.strip()
    path = py if os.path.isabs(py) or "/" not in py else str(ROOT / py)
    assert shutil.which(path), f"{py!r} is not an executable"


# A stand-in for python3 and for every venv's python: the set-up script's calls (venv,
# pip, the torch check, the package check) are answered from a state directory, and
# everything else runs in this Python. It plays a plain Linux box: no torch anywhere; the
# configured index has no torch==2.13.0+cpu; PyTorch's CPU index (a folder the test
# serves over HTTP, as pip's simple API lays it out) has it when
# STUB_STATE/cpu-index-has-torch exists.
STUB = """#!{python}
import hashlib, os, shutil, subprocess, sys
state, me, args = os.environ["STUB_STATE"], os.path.abspath(sys.argv[0]), sys.argv[1:]
mark = lambda what: os.path.join(state, what + "-" + hashlib.md5(me.encode()).hexdigest())
if args == ["-c", "import torch, triton"]:
    sys.exit(0 if os.path.exists(mark("torch")) else 1)
if args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[-1], "bin"))
    shutil.copy(me, os.path.join(args[-1], "bin", "python"))
    open(os.path.join(args[-1], "bin", "activate"), "w").close()
    sys.exit(0)
if args[:3] == ["-m", "pip", "install"]:
    with open(os.path.join(state, "pip.log"), "a") as log:
        log.write(me + " " + " ".join(args[3:]) + "\\n")
    print("PIP " + " ".join(args[3:]), file=sys.stderr)
    if "-e" in args:
        open(mark("package"), "w").write(os.path.realpath("eagle_capture/__init__.py"))
    elif any(a.startswith("ruff==") for a in args):
        if os.path.exists(os.path.join(state, "offline")):
            print("ERROR: No matching distribution found for ruff==0.17.6", file=sys.stderr)
            sys.exit(1)
        open(mark("ruff"), "w").close()
    elif any(a.startswith("torch==") for a in args):
        index = args[args.index("--extra-index-url") + 1] if "--extra-index-url" in args else None
        if index != os.environ["EAGLE_CAPTURE_TORCH_CPU_INDEX"] or not os.path.exists(
                os.path.join(state, "cpu-index-has-torch")):
            print("ERROR: No matching distribution found for torch==2.13.0+cpu", file=sys.stderr)
            sys.exit(1)
        open(mark("torch"), "w").close()
    sys.exit(0)
if args == ["-"]:                                   # which test/bench extras are missing
    sys.exit(print(""))
if args == ["-m", "ruff", "--version"]:             # the lint's version, once installed
    sys.exit(print("ruff 0.17.6") if os.path.exists(mark("ruff")) else 1)
if args[:1] == ["-c"] and "eagle_capture" in args[1]:   # is the package installed here
    sys.exit(print(open(mark("package")).read()) if os.path.exists(mark("package")) else 1)
if args[:1] == ["-c"] and "sysconfig" in args[1]:
    sys.exit(print(os.path.dirname(me)))
sys.exit(subprocess.run([{python!r}, *args]).returncode)
"""


@pytest.fixture
def cpu_index(tmp_path):
    """PyTorch's CPU index as pip's simple API lays it out (one link per wheel), served
    over HTTP: the script reads the wheel's size from it (a HEAD request)."""
    wheel = "torch-2.13.0+cpu-cp%d%d-cp%d%d-manylinux_2_28_x86_64.whl" % (sys.version_info[:2] * 2)
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text(
        f'<a href="{wheel.replace("+", "%2B")}#sha256=0">{wheel}</a>\n'
    )
    with open(tmp_path / "index" / "torch" / wheel, "wb") as f:
        f.truncate(191_794_682)  # torch 2.13.0+cpu's cp311 wheel, sparse
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=tmp_path / "index")
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _plain_box(
    tmp_path, cpu_index, cpu_index_has_torch=True, virtual_env=None, offline_ruff=False, args=()
):
    """A checkout holding the script, a PATH whose python3 is the stand-in, a CPU index."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "eagle_capture").mkdir()
    (checkout / "eagle_capture" / "__init__.py").touch()
    shutil.copy(SCRIPT, checkout / "scripts" / "setup_env.sh")
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "python3").write_text(STUB.format(python=sys.executable))
    (bin_dir / "python3").chmod(0o755)
    if cpu_index_has_torch:
        (state / "cpu-index-has-torch").touch()
    if offline_ruff:
        (state / "offline").touch()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") and k not in ("VIRTUAL_ENV", "EAGLE_CAPTURE_TORCH")
    }
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        STUB_STATE=str(state),
        EAGLE_CAPTURE_TORCH="torch==2.13.0+cpu",  # the pin, on any platform
        EAGLE_CAPTURE_TORCH_CPU_INDEX=cpu_index,
    )
    if virtual_env:
        subprocess.run([bin_dir / "python3", "-m", "venv", virtual_env], env=env, check=True)
        env["VIRTUAL_ENV"] = str(virtual_env)
    result = subprocess.run(
        ["bash", str(checkout / "scripts" / "setup_env.sh"), *args],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    pip_log = (state / "pip.log").read_text().splitlines() if (state / "pip.log").exists() else []
    return checkout, result, pip_log


def test_a_plain_box_gets_torch_from_pytorchs_cpu_index_saying_so_and_its_size_first(
    tmp_path, cpu_index
):
    checkout, result, pip_log = _plain_box(tmp_path, cpu_index)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ".venv/bin/python\n"
    venv_python = str(checkout / ".venv" / "bin" / "python")
    torch_installs = [line for line in pip_log if "torch==2.13.0+cpu" in line]
    assert torch_installs == [
        f"{venv_python} torch==2.13.0+cpu triton",
        f"{venv_python} --extra-index-url {cpu_index} torch==2.13.0+cpu triton",
    ]
    err = result.stderr
    said = err.index("torch==2.13.0+cpu is not on the configured package index")
    assert "(192 MB)" in err[said : said + 400], err
    assert said < err.index("PIP --extra-index-url"), "the size must be said before downloading"
    # At the end: how to use it.
    assert f"ready: {venv_python} now has torch, triton" in err
    assert f"source {checkout / '.venv' / 'bin' / 'activate'}   then   eagle-capture --help" in err


def test_an_activated_virtualenv_is_used_not_replaced(tmp_path, cpu_index):
    mine = tmp_path / "my-env"
    checkout, result, pip_log = _plain_box(tmp_path, cpu_index, virtual_env=mine)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{mine / 'bin' / 'python'}\n"
    assert not (checkout / ".venv").exists()
    assert pip_log and all(line.startswith(f"{mine / 'bin' / 'python'} ") for line in pip_log)
    assert "-e ." in pip_log[-1]


def test_no_torch_anywhere_stops_with_a_hint(tmp_path, cpu_index):
    _, result, pip_log = _plain_box(tmp_path, cpu_index, cpu_index_has_torch=False)
    assert result.returncode == 1 and result.stdout == ""
    assert len(pip_log) == 2, pip_log  # the configured index, then PyTorch's CPU index
    assert "EAGLE_CAPTURE_TORCH=torch==2.13.0" in result.stderr
    assert "EAGLE_CAPTURE_TORCH_CPU_INDEX=URL" in result.stderr


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64",
    reason="the +cpu pin applies to Linux x86_64",
)
def test_real_pip_without_the_cpu_wheel_falls_back_then_fails_with_a_hint(tmp_path):
    """The same with the real python3 and pip, offline (no index, an empty find-links): pip's
    own message for a missing torch==2.13.0+cpu is the one the script recognises, so it
    tries PyTorch's CPU index (unreachable here), then stops with a hint rather than let
    pip take PyPI's CUDA build. A few seconds, no download."""
    if (
        subprocess.run(["python3", "-c", "import torch, triton"], capture_output=True).returncode
        == 0
    ):
        pytest.skip("python3 already has torch and triton: the script uses it as it is")
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "setup_env.sh")
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") and k not in ("EAGLE_CAPTURE_TORCH", "VIRTUAL_ENV")
    }
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(empty),
        EAGLE_CAPTURE_TORCH_CPU_INDEX=(tmp_path / "no-index").as_uri(),
    )
    result = _run(tmp_path, env=env, timeout=300)
    assert result.returncode != 0
    assert result.stdout == ""
    assert "installing torch 2.13.0 (CPU build)" in result.stderr
    assert "torch==2.13.0+cpu is not on the configured package index" in result.stderr
    assert "size not known" in result.stderr
    assert "EAGLE_CAPTURE_TORCH=torch==2.13.0" in result.stderr


def test_the_lint_is_installed_pinned_only_when_asked(tmp_path, cpu_index):
    """ruff (the first step of .ci/run) is installed at its pinned version with --lint,
    and a --lint that cannot install it fails; without --lint nothing is fetched for it
    (the GPU machine has no package index, and the tests do not need it)."""
    _, result, pip_log = _plain_box(tmp_path / "plain", cpu_index)
    assert result.returncode == 0, result.stderr
    assert not any("ruff" in line for line in pip_log), pip_log
    assert "ruff" not in result.stderr
    _, result, pip_log = _plain_box(tmp_path / "online", cpu_index, args=["--lint"])
    assert result.returncode == 0, result.stderr
    assert any(line.endswith("ruff==0.17.6") for line in pip_log), pip_log
    _, result, pip_log = _plain_box(
        tmp_path / "offline", cpu_index, offline_ruff=True, args=["--lint"]
    )
    assert result.returncode == 1
    assert "could not install ruff 0.17.6, which the lint needs" in result.stderr
