"""The mutation runner's data (tools/mutants.toml) and its anchors: a mutant is
found by the def / class / module-level name it lies in and its text, so code
that moves keeps its mutants, and one whose anchor no longer matches is an
error of the run, found here without running it."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location(
        "mutation_check", ROOT / "tools" / "mutation_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mc = _runner()


def test_every_mutant_still_matches_its_anchor():
    """Each mutant's text occurs exactly once inside its anchor, differs from its
    mutation, and its tests exist: a mutant whose code changed would otherwise
    only be found stale when the (long) mutation run happens."""
    mutants = mc.load_mutants()
    assert len(mutants) > 100
    assert mc.stale_mutants(mutants) == []


SOURCE = textwrap.dedent("""\
    LIMIT = 3


    class Launcher:
        def launch(self, n):
            if n > LIMIT:
                return n + 1
            return n

        @staticmethod
        def other(n):
            return n + 1
    """)


def _mutant(anchor, original="return n + 1", mutated="return n + 2"):
    return mc.Mutant("m", "pkg/mod.py", anchor, original, mutated, ["tests/test_x.py"])


def _write(tmp_path, text):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "mod.py").write_text(text)


def test_a_text_is_found_inside_its_anchor_only(tmp_path):
    _write(tmp_path, SOURCE)  # "return n + 1" twice in the file, once per method
    mutated = mc.mutated_text(_mutant("Launcher.launch"), tmp_path)
    assert "            return n + 2\n        return n\n" in mutated
    assert mutated.endswith("return n + 1\n")  # Launcher.other untouched
    mutated = mc.mutated_text(_mutant("Launcher.other"), tmp_path)
    assert mutated.endswith("return n + 2\n")
    assert mc.mutated_text(_mutant("LIMIT", "LIMIT = 3", "LIMIT = 4"), tmp_path).startswith(
        "LIMIT = 4\n"
    )
    with pytest.raises(mc.StaleMutant, match="occurs 2 times in <module>"):
        mc.locate(_mutant(mc.MODULE), tmp_path)


def test_code_that_moves_keeps_its_mutants(tmp_path):
    """The method moved below another and its class indented under a guard: the
    anchor still finds it."""
    moved = "import os\n\nif os.name:\n    def helper():\n        return 0\n\n" + textwrap.indent(
        SOURCE.replace("LIMIT = 3\n", ""), "    "
    )
    _write(tmp_path, moved)
    assert "return n + 2" in mc.mutated_text(_mutant("Launcher.launch"), tmp_path)


def test_an_anchor_that_no_longer_matches_is_an_error(tmp_path):
    _write(tmp_path, SOURCE.replace("def launch", "def start"))
    with pytest.raises(mc.StaleMutant, match="0 definitions named 'Launcher.launch'"):
        mc.locate(_mutant("Launcher.launch"), tmp_path)
    _write(tmp_path, SOURCE.replace("        return n\n\n", "        return n + 1\n\n"))
    with pytest.raises(mc.StaleMutant, match="occurs 2 times in Launcher.launch"):
        mc.locate(_mutant("Launcher.launch"), tmp_path)


def test_the_runner_reports_stale_mutants_and_runs_nothing(tmp_path):
    data = tmp_path / "mutants.toml"
    data.write_text(
        textwrap.dedent("""\
        [[mutant]]
        name = 'gone'
        file = 'eagle_capture/ops/launcher.py'
        anchor = 'FastLaunch.no_such_method'
        original = 'x'
        mutated = 'y'
        tests = ['tests/test_launcher.py']
        """)
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mutation_check.py"), "--mutants", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "STALE    gone: eagle_capture/ops/launcher.py: 0 definitions named "
        "'FastLaunch.no_such_method'" in result.stderr
    )
    assert "Traceback" not in result.stderr and "caught" not in result.stdout
