"""The capture at TENSOR PARALLEL 2 inside the real SGLang code, on CPU: per
SGLang version, two TP rank processes on gloo plus the TP 1 run they compare with.

For each version, ``scripts/sglang_real_env.sh`` prepares (cached) the overlay
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
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ["0.5.9", "0.5.13", "0.5.18", "0.5.20", "0.5.22", "0.5.23"]
SCENARIOS = ["tp2_setup", "tp2_equals_tp1", "plugin_tp2", "verify_tp2",
             "planted_divergence_tp2", "verify_switch_back_tp2", "plugin_kimi_k25_tp2",
             "tp2_fusion", "tp2_fused_allreduce", "tp2_fusion_declines",
             "verify_fused_allreduce_tp2"]
WORLD = 2
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1",
                                reason="EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 (no PyPI here)")

_RESULTS: dict = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overlay(version: str, env: dict) -> str:
    setup = subprocess.run(["bash", "scripts/sglang_real_env.sh", version], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=1200)
    assert setup.returncode == 0, f"set-up of sglang {version} failed:\n{setup.stderr[-3000:]}"
    return setup.stdout.strip().splitlines()[-1]


class _Run:
    """One version's processes: ranks 0 and 1, and the TP 1 run rank 0 forks."""

    def __init__(self, version: str, out_dir: Path) -> None:
        self.started = time.monotonic()
        env = dict(os.environ, PY=sys.executable)
        overlay = _overlay(version, env)
        env["PYTHONPATH"] = os.pathsep.join([overlay, str(ROOT)])
        env.pop("TRITON_INTERPRET", None)       # CPU tensors take the ops' torch path
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(ROOT / ".cache" / "pycache")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        ref = out_dir / "tp1.pt"
        ref.unlink(missing_ok=True)
        Path(str(ref) + ".failed").unlink(missing_ok=True)
        init = f"tcp://127.0.0.1:{_free_port()}"
        module = [sys.executable, "-m", "tests.sglang_real.tp_scenarios", "--ref", str(ref)]
        runs = {f"rank{r}": module + ["--world", str(WORLD), "--rank", str(r),
                                      "--init-method", init] for r in range(WORLD)}
        # The TP 1 run: a process forked by rank 0 after its imports, before any
        # distributed init (its own world 1; no second import of SGLang).
        self.tp1_json = out_dir / "tp1.json"
        self.tp1_json.unlink(missing_ok=True)
        runs["rank0"] += ["--tp1-json", str(self.tp1_json)]
        self.procs = {}
        for name, cmd in runs.items():
            json_path = out_dir / f"{name}.json"
            json_path.unlink(missing_ok=True)
            log = open(out_dir / f"{name}.log", "w")
            proc = subprocess.Popen(cmd + ["--json", str(json_path)], cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
            self.procs[name] = (proc, log, json_path)
        self.deadline = time.monotonic() + TIMEOUT_S

    def collect(self) -> dict:
        results = {}
        try:
            for proc, _, _ in self.procs.values():
                try:
                    proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for name, (proc, log, json_path) in self.procs.items():
                if proc.poll() is None:      # one of ours, by its own handle
                    proc.kill()
                    proc.wait()
                log.close()
                tail = (self.out_dir / f"{name}.log").read_text(errors="replace")[-4000:]
                results[name] = {"returncode": proc.returncode, "log_tail": tail,
                                 "json": json.loads(json_path.read_text())
                                 if json_path.exists() else None}
        results["tp1"] = {"returncode": results["rank0"]["returncode"],   # rank 0 reaps it
                          "log_tail": results["rank0"]["log_tail"],
                          "json": json.loads(self.tp1_json.read_text())
                          if self.tp1_json.exists() else None}
        results["seconds"] = time.monotonic() - self.started
        return results


_STARTED: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _no_rank_outlives_the_tests():
    """A version started ahead and never collected (a failure stopped the session)
    is killed, not left writing after pytest has gone."""
    yield
    for run in _STARTED.values():
        for proc, log, _ in run.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    _STARTED.clear()


def _results(version: str, tmp_dir: Path) -> dict:
    """This version's results; the next version's processes start meanwhile (two
    versions at a time keep both cores busy: a rank often waits on its peer)."""
    if version not in _RESULTS:
        at = VERSIONS.index(version)
        for v in VERSIONS[at:at + 2]:
            if v not in _STARTED and v not in _RESULTS:
                _STARTED[v] = _Run(v, tmp_dir / f"sglang_tp_{v}")
        _RESULTS[version] = _STARTED.pop(version).collect()
    return _RESULTS[version]


def _rank_result(run: dict, name: str, scenario: str) -> dict:
    data = run[name]["json"]
    assert data is not None, (f"{name} wrote no results (exit {run[name]['returncode']}):\n"
                              f"{run[name]['log_tail']}")
    if "setup" in data:
        pytest.fail(f"{name}: world-{WORLD} set-up failed: {data['setup']['detail']}\n"
                    f"{data['setup'].get('traceback', '')}")
    result = data.get(scenario)
    assert result is not None, (f"{name}: scenario {scenario} did not run (exit "
                                f"{run[name]['returncode']}; an earlier failure stops a rank):\n"
                                f"{run[name]['log_tail']}")
    assert result["ok"], f"{name}: {result['detail']}\n{result.get('traceback', '')}"
    return result


@pytest.mark.parametrize("version", VERSIONS)
def test_tp1_reference(version, tmp_path_factory):
    run = _results(version, tmp_path_factory.getbasetemp())
    assert run["tp1"]["json"] is not None and run["tp1"]["json"].get("version") == version, \
        run["tp1"]["log_tail"]
    _rank_result(run, "tp1", "reference_tp1")
    assert run["tp1"]["returncode"] == 0, run["tp1"]["log_tail"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_real_tp2(version, scenario, tmp_path_factory):
    run = _results(version, tmp_path_factory.getbasetemp())
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
    if skip:   # only where SGLang's own code cannot run the case (the reason says why)
        pytest.skip(skip)


@pytest.mark.parametrize("version", VERSIONS)
def test_ranks_exit_cleanly(version, tmp_path_factory):
    run = _results(version, tmp_path_factory.getbasetemp())
    for r in range(WORLD):
        assert run[f"rank{r}"]["returncode"] == 0, run[f"rank{r}"]["log_tail"]
