"""``eagle-capture probe`` run in this process as a user runs it, for the engine harnesses
(tests/vllm_real/probe_engine.py, tests/sglang_real/probe_engine.py)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

# The skip reason of the GPU tests at tensor parallel 2 (tools/gpu/gpu_session.sh expects it
# on a machine of one GPU).
TWO_GPUS = "needs two GPUs (tensor parallel 2 over NCCL)"


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


def run_engine_harness(module: str, work: Path, dtype: str, record_name: str, tp: int = 1) -> dict:
    """One run of an engine harness (``module``: tests.vllm_real.probe_engine or
    tests.sglang_real.probe_engine) in a child process on the GPU at ``dtype`` and tensor
    parallel ``tp`` (one GPU a rank), its files under ``work``: the JSON it wrote. The serving plugin stays out of
    the probe's engine; ``EAGLE_CAPTURE_RECORD=DIR`` keeps the JSON as DIR/record_name."""
    import os
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = work / "probe.json"
    path = os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", ""), str(root)] if p)
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("EAGLE_CAPTURE", None)
    cmd = [sys.executable, "-m", module, "--work", str(work), "--json", str(out)]
    cmd += ["--tp", str(tp), "--device", "cuda", "--dtype", dtype]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), (
        f"the engine run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    )
    record = os.environ.get("EAGLE_CAPTURE_RECORD")
    if record:
        Path(record).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(record) / record_name)
    return json.loads(out.read_text())
