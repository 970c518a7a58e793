"""pytest --record and tools/test_record.py: the run record the README's
reliability table cites counts each test once, by file and outcome."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_record_counts_each_outcome_per_file(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "test_a.py").write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert False\n"
        "@pytest.mark.skip(reason='x')\ndef test_skip(): pass\n"
        "@pytest.mark.xfail\ndef test_xfail(): assert False\n"
        "@pytest.fixture\ndef broken(): raise RuntimeError\n"
        "def test_error(broken): pass\n"
    )
    (tests / "test_b.py").write_text("def test_one(): pass\ndef test_two(): pass\n")
    record = tmp_path / "run.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tests),
            "--record",
            str(record),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(record.read_text())
    files = {Path(k).name: v for k, v in data["files"].items()}
    assert files == {
        "test_a.py": {"passed": 1, "failed": 1, "error": 1, "skipped": 1, "xfailed": 1},
        "test_b.py": {"passed": 2},
    }
    assert data["exit_status"] == 1 and data["torch"] and data["device"]
    table = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "test_record.py"), str(record)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "1 passed, 1 failed, 1 error, 1 skipped, 1 xfailed" in table
    assert "3 passed, 1 failed, 1 error, 1 skipped, 1 xfailed in" in table
