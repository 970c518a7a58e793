"""The ``eagle-capture`` command line itself (each command's own options are tested with
it: tests/test_doctor.py, tests/test_probe.py)."""

import subprocess
import sys
from importlib import metadata

import pytest

import eagle_capture
from eagle_capture import cli


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, err = _cli(capsys, "--version")
    assert (code, out, err) == (0, f"eagle-capture {eagle_capture.__version__}\n", "")
    assert _cli(capsys, "-V")[1] == out
    # The installed metadata's version is the package's (setup.py reads it from there).
    assert metadata.version("eagle-capture") == eagle_capture.__version__


def test_the_help_names_and_describes_every_command(capsys):
    code, out, err = _cli(capsys, "--help")
    assert code == 0 and err == ""
    for name, (_, text) in cli.COMMANDS.items():
        assert f"\n    {name} " in out, name
        assert " ".join(text.split()[:6]) in " ".join(out.split()), name
    assert "--version" in out and "'eagle-capture COMMAND --help'" in out
    # Nothing given: the same help, but exit 2 (a script that forgot its command fails).
    assert _cli(
        capsys,
    ) == (2, out, "")


@pytest.mark.parametrize(
    "argv, what",
    [
        (["plan"], "unknown command 'plan'"),
        (["--draft-config", "x"], "unknown option '--draft-config'"),
        (["Doctor"], "unknown command 'Doctor'"),
    ],
)
def test_a_bad_command_is_one_line_and_exit_2(capsys, argv, what):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and what in err and "commands: doctor, probe" in err


def test_python_dash_m_is_the_console_script():
    result = subprocess.run(
        [sys.executable, "-m", "eagle_capture", "--version"],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        result.returncode == 0 and result.stdout == f"eagle-capture {eagle_capture.__version__}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "eagle_capture", "nope"],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


def test_a_command_missing_its_dependency_says_so_in_one_line(capsys, monkeypatch):
    """The probe without torch (a doctor-only install): one line naming what is missing,
    exit 2; tests/test_packaging.py runs it where torch is really absent."""
    real = cli.importlib.import_module

    def without_torch(name, *args):
        if name == "eagle_capture.cli.probe":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", without_torch)
    code, out, err = _cli(capsys, "probe", "--help")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("eagle-capture probe: needs torch") and "eagle-capture[probe]" in err
