"""The capture at TENSOR PARALLEL 2 inside the real SGLang code, on CPU: per
SGLang version, two TP rank processes on gloo plus the TP 1 run they compare with.

For each version, ``tools/sglang_real_env.sh`` prepares (cached) the overlay
with that SGLang wheel, as for ``tests/test_sglang_real.py``; then two child
processes run ``tests/sglang_real/tp_scenarios.py`` with the overlay first on
the path: ranks 0 and 1 of a world of 2 (SGLang's own distributed init on
gloo, tcp://127.0.0.1:<free port>). The TP 1 run they compare with (world 1)
is a third process, forked by rank 0 after its imports and before any
distributed init (SGLang imported twice per version, not three times). Each
writes its results to JSON; every scenario must be ok on BOTH ranks. What is
real and what is stood in: the docstring of ``tp_scenarios.py`` (and the
harness's).

The children write bytecode to ``.cache/pycache`` (PYTHONPYCACHEPREFIX; the
source tree gets no ``__pycache__``): six SGLang lines x two processes
otherwise recompile SGLang from source each time.

The set-up needs PyPI. On a machine without it (the GPU machine) set
``EAGLE_CAPTURE_SKIP_SGLANG_REAL=1``; nothing else skips these tests.
"""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from engine_env import sglang_needs, start_sglang
from engine_jobs import Job

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ["0.5.9", "0.5.13", "0.5.18", "0.5.20", "0.5.22", "0.5.23"]
SCENARIOS = [
    "tp2_setup",
    "tp2_equals_tp1",
    "plugin_tp2",
    "verify_tp2",
    "planted_divergence_tp2",
    "verify_switch_back_tp2",
    "plugin_kimi_k25_tp2",
    "plugin_llama_tp2",
    "plugin_qwen3_moe_tp2",
    "tp2_fusion",
    "tp2_fused_allreduce",
    "tp2_fusion_declines",
    "verify_fused_allreduce_tp2",
]
WORLD = 2
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1",
    reason="EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 (no PyPI here)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(jobs, procs: dict, deadline: float) -> dict:
    """Each process's exit status, log tail and JSON (``procs``: name -> (process, log
    path, JSON path)); any still running at ``deadline`` is killed."""
    results = {}
    for proc, _, _ in procs.values():
        jobs.track(proc)
    try:
        for proc, _, _ in procs.values():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for name, (proc, log, json_path) in procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            results[name] = {
                "returncode": proc.returncode,
                "log_tail": log.read_text(errors="replace")[-4000:],
                "json": json.loads(json_path.read_text()) if json_path.exists() else None,
            }
    return results


def summary(run: dict) -> str:
    """What went wrong in a run, process by process: the exit status, a failed set-up or
    the first failed scenario with its detail (the name of what broke, not the log's
    import warnings), and the log's last lines when neither says."""
    lines = []
    for name, result in run.items():
        if not isinstance(result, dict) or "returncode" not in result:
            continue
        data = result["json"] or {}
        failed = [(k, v) for k, v in data.items() if isinstance(v, dict) and not v.get("ok", True)]
        what = (
            f"{failed[0][0]} failed: {failed[0][1].get('detail')}"
            if failed
            else "wrote no results"
            if result["json"] is None
            else "all its scenarios ok"
        )
        lines.append(f"{name}: exit {result['returncode']}, {what}")
        if failed and failed[0][1].get("traceback"):
            lines.append(failed[0][1]["traceback"][-1500:])
        elif result["returncode"] not in (0, None) and not failed:
            tail = [
                ln
                for ln in result["log_tail"].splitlines()
                if ln.strip() and "warn" not in ln.lower()
            ]
            lines.append("\n".join(tail[-15:]))
    return "\n".join(lines)


def _tp_job(version: str, base: Path, jobs) -> Job:
    """One version's processes: ranks 0 and 1, and the TP 1 run rank 0 forks."""

    def run():
        started = time.monotonic()
        out_dir = base / f"sglang_tp_{version}"
        out_dir.mkdir(parents=True, exist_ok=True)
        ref = out_dir / "tp1.pt"
        ref.unlink(missing_ok=True)
        Path(str(ref) + ".failed").unlink(missing_ok=True)
        init = f"tcp://127.0.0.1:{_free_port()}"
        module_args = ["--ref", str(ref)]
        runs = {
            f"rank{r}": module_args
            + ["--world", str(WORLD), "--rank", str(r), "--init-method", init]
            for r in range(WORLD)
        }
        # The TP 1 run: a process forked by rank 0 after its imports, before any
        # distributed init (its own world 1; no second import of SGLang).
        tp1_json = out_dir / "tp1.json"
        tp1_json.unlink(missing_ok=True)
        runs["rank0"] += ["--tp1-json", str(tp1_json)]
        procs = {}
        for name, args in runs.items():
            json_path = out_dir / f"{name}.json"
            json_path.unlink(missing_ok=True)
            log = out_dir / f"{name}.log"
            procs[name] = (
                start_sglang(
                    version,
                    "tests.sglang_real.tp_scenarios",
                    args + ["--json", str(json_path)],
                    log,
                ),
                log,
                json_path,
            )
        results = collect(jobs, procs, time.monotonic() + TIMEOUT_S)
        results["tp1"] = {
            "returncode": results["rank0"]["returncode"],  # rank 0 reaps it
            "log_tail": results["rank0"]["log_tail"],
            "json": json.loads(tp1_json.read_text()) if tp1_json.exists() else None,
        }
        results["seconds"] = time.monotonic() - started
        return results

    return Job(-100, f"sglang {version} tp2", run, weight=WORLD, needs=sglang_needs(version))


def engine_jobs(item, base: Path, jobs) -> list:
    """The run a selected test needs (tests/engine_jobs.py)."""
    if os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1":
        return []
    return [_tp_job(item.callspec.params["version"], base, jobs)]


def _rank_result(run: dict, name: str, scenario: str) -> dict:
    data = run[name]["json"]
    assert data is not None, (
        f"{name} wrote no results (exit {run[name]['returncode']}):\n"
        f"{summary(run)}\n{run[name]['log_tail']}"
    )
    if "setup" in data:
        pytest.fail(
            f"{name}: world-{WORLD if name != 'tp1' else 1} set-up failed: "
            f"{data['setup']['detail']}\n{data['setup'].get('traceback', '')}"
        )
    result = data.get(scenario)
    assert result is not None, (
        f"{name}: scenario {scenario} did not run (exit "
        f"{run[name]['returncode']}; an earlier failure stops a rank):\n"
        f"{summary(run)}"
    )
    assert result["ok"], f"{name}: {result['detail']}\n{result.get('traceback', '')}"
    return result


@pytest.mark.parametrize("version", VERSIONS)
def test_tp1_reference(version, engine_jobs):
    run = engine_jobs.result(f"sglang {version} tp2")
    assert run["tp1"]["json"] is not None and run["tp1"]["json"].get("version") == version, (
        f"the TP 1 run wrote no results:\n{summary(run)}"
    )
    _rank_result(run, "tp1", "reference_tp1")
    assert run["tp1"]["returncode"] == 0, summary(run)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_real_tp2(version, scenario, engine_jobs):
    run = engine_jobs.result(f"sglang {version} tp2")
    per_rank = [_rank_result(run, f"rank{r}", scenario) for r in range(WORLD)]
    for r in range(WORLD):
        assert run[f"rank{r}"]["json"]["version"] == version
        assert run[f"rank{r}"]["json"]["rank"] == r
    skips = {res.get("skip") for res in per_rank}
    assert len(skips) == 1, f"the ranks disagree on skipping: {skips}"
    # Whatever the ranks captured, they captured the same bits (also checked
    # in-process over the TP group).
    for key in ("aux_fingerprints", "cases"):
        if key in per_rank[0]:
            assert all(res[key] == per_rank[0][key] for res in per_rank), key
    if scenario == "tp2_equals_tp1":
        tp1 = run["tp1"]["json"]["reference_tp1"]["aux_fingerprints"]
        assert [c["case"] for c in per_rank[0]["cases"]] == list(tp1)
    skip = skips.pop()
    if skip:  # only where SGLang's own code cannot run the case (the reason says why)
        pytest.skip(skip)


@pytest.mark.parametrize("version", VERSIONS)
def test_ranks_exit_cleanly(version, engine_jobs):
    run = engine_jobs.result(f"sglang {version} tp2")
    for r in range(WORLD):
        assert run[f"rank{r}"]["returncode"] == 0, summary(run)
