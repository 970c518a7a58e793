"""``eagle-capture probe`` run in this process as a user runs it, for the engine harnesses
(tests/vllm_real/probe_engine.py, tests/sglang_real/probe_engine.py)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path


def run_cli(argv: list[str], record: Path) -> dict:
    """The probe's command line with ``argv`` and ``--json record``: its exit status,
    stdout, stderr (also echoed to this process's stderr, the run's log) and the record."""
    from eagle_capture.cli.probe import main as probe

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = probe([*argv, "--json", str(record)])
    print(stderr.getvalue(), file=sys.stderr)
    return {
        "exit": code,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
        "json": json.loads(record.read_text()) if record.exists() else None,
    }
