"""The probe with its target in SGLang's own engine (``eagle-capture probe --engine
sglang``), against the probe with its target in transformers, on the tiny trained target
and drafts of tests/data/tiny_eagle3 -- SGLang's real ``Engine`` on CPU (its CPU engine,
torch-native attention; tests/sglang_real/probe_engine.py runs it in a child process):

* TP 1 (SGLang 0.5.23): the command line as a user runs it, and every reading's hits (the
  same tokens) equal the transformers probe's, the same verdicts, SGLang's line alone
  reported -- the two trained drafts and a config that lies (MISMATCH);
* the probe's states equal SGLang's own EAGLE-3 capture of the same layers in the same
  forwards, bit for bit, at TP 1 (0.5.23) and TP 2 over gloo (0.5.20, on both ranks);
* TP 2: both ranks' states full-width and equal, the answer equal to transformers' up to
  float noise; one layer's all-reduce switched off in every rank -> refused (partial sums);
* the command line on the older lines, 0.5.9 and 0.5.13, equal to transformers too.

The runs go in the background with the other engine tests (tests/engine_jobs.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_capture.probe.probe import run_probe
from engine_env import BASE_ENV, _overlay, sglang_needs
from engine_jobs import PIP_LOCK, Job, once, run_to_json

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
# What SGLang's Engine imports beyond the overlay's and the shared light deps (its
# entrypoint imports uvloop; its scheduler processes setproctitle).
ENGINE_DEPS = ("uvloop", "setproctitle")

pytestmark = pytest.mark.skipif(
    os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1",
    reason="EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 (no PyPI here)",
)


def _engine_deps() -> str:
    def build():
        target = ROOT / ".cache" / "sglang" / "engine-deps"
        mark = target / ".ok"
        if not mark.exists() or mark.read_text() != " ".join(ENGINE_DEPS):
            with PIP_LOCK:
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "install",
                        "-q",
                        "--no-deps",
                        "--target",
                        str(target),
                        *ENGINE_DEPS,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
            assert done.returncode == 0, done.stderr[-3000:]
            mark.write_text(" ".join(ENGINE_DEPS))
        return str(target)

    return once("sglang engine deps", build)


def _env(version: str, tp: int) -> dict:
    env = dict(
        BASE_ENV,
        PYTHONPATH=os.pathsep.join(
            [
                str(ROOT / "tests" / "sglang_real" / "engine_site"),
                _overlay("tools/sglang_real_env.sh", version),
                _engine_deps(),
                str(ROOT),
            ]
        ),
    )
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU engine (no AMX here: torch ops)
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    env["PYTHONPYCACHEPREFIX"] = str(ROOT / ".cache" / "pycache")
    for key in ("TRITON_INTERPRET", "EAGLE_CAPTURE", "PYTHONDONTWRITEBYTECODE"):
        env.pop(key, None)
    return env


def _run(base: Path, jobs, version: str, tp: int, cli_only: bool):
    work = base / f"probe_sglang_{version}_tp{tp}"
    work.mkdir(parents=True, exist_ok=True)
    out, log = work / "probe.json", work / "probe.log"
    args = ["--work", str(work), "--json", str(out), "--tp", str(tp)]
    args += ["--cli-only"] if cli_only else []
    return run_to_json(
        jobs, "tests.sglang_real.probe_engine", args, _env(version, tp), log, out, 1500
    )


# key: (version, tp, command line only, weight, priority)
RUNS = {
    "sglang probe 0.5.23 tp1": ("0.5.23", 1, False, 1, -400),
    "sglang probe 0.5.20 tp2": ("0.5.20", 2, False, 2, -300),
    "sglang probe 0.5.9 cli": ("0.5.9", 1, True, 1, -150),
    "sglang probe 0.5.13 cli": ("0.5.13", 1, True, 1, -150),
}


def _key(item) -> str:
    name = item.name
    if "tp2" in name or "tensor_parallel" in name:
        return "sglang probe 0.5.20 tp2"
    for version in ("0.5.9", "0.5.13"):
        if f"[{version}]" in name:
            return f"sglang probe {version} cli"
    return "sglang probe 0.5.23 tp1"


def engine_jobs(item, base: Path, jobs) -> list:
    """The engine run a selected test needs (tests/engine_jobs.py)."""
    if os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1":
        return []
    key = _key(item)
    version, tp, cli_only, weight, priority = RUNS[key]
    return [
        Job(
            priority,
            key,
            lambda: _run(base, jobs, version, tp, cli_only),
            weight=weight,
            needs=sglang_needs(version),
        )
    ]


def _result(engine_jobs, key):
    code, log, data = engine_jobs.result(key)
    assert code == 0 and data is not None, f"the engine run failed (exit {code}):\n{log[-6000:]}"
    return data


def _transformers(draft: Path, prompts: Path, version: str) -> dict:
    return run_probe(
        str(DATA / "target"),
        str(draft),
        str(prompts),
        device="cpu",
        dtype="fp32",
        max_tokens=64,
        log=lambda s: None,
        progress=False,
        sglang_version=version,
    ).to_json()


def _prompts(tmp_path: Path, tp: int) -> Path:
    from tests.sglang_real.probe_engine import prompts

    return prompts(tmp_path, tp)


def _assert_same_answer(engine: dict, reference: dict, max_token_flips: int) -> None:
    """Every reading's hits within ``max_token_flips`` of the reference's over the same
    tokens; the same verdict, ids and fixes; the engine lines: the reference's SGLang
    line alone, and ``ok`` decided by it."""
    ref = {tuple(r["capture_layers"]): r for r in reference["readings"]}
    assert {tuple(r["capture_layers"]) for r in engine["readings"]} == set(ref)
    for r in engine["readings"]:
        other = ref[tuple(r["capture_layers"])]
        assert r["tokens"] == other["tokens"]
        assert abs(r["hits"] - other["hits"]) <= max_token_flips, (r, other)
    for key in ("verdict", "fixes", "trainer", "ids"):
        assert engine[key] == reference[key], key
    sglang_lines = [e for e in reference["engines"] if e.startswith("SGLang")]
    assert engine["engines"] == sglang_lines and len(sglang_lines) == 1
    assert engine["ok"] == (
        reference["verdict"] == "CONFIRMED" and sglang_lines[0].endswith(": OK")
    )


@pytest.mark.parametrize("case", ["specforge", "speculators", "converted"])
def test_sglang_mode_equals_transformers_mode(engine_jobs, case, tmp_path):
    """TP 1, fp32, SGLang 0.5.23: the same hits for every reading (no token flips), the
    same verdicts -- CONFIRMED for the two trained drafts, MISMATCH naming [2, 4, 6] for the
    converted config that lies -- and SGLang's line alone."""
    from tests.sglang_real.probe_engine import cases

    data = _result(engine_jobs, "sglang probe 0.5.23 tp1")
    engine = data[case]
    reference = _transformers(cases(tmp_path)[case], _prompts(tmp_path, 1), "0.5.23")
    _assert_same_answer(engine, reference, max_token_flips=0)
    measured = engine["measured"]
    assert measured["engine"] == "sglang" and measured["tp"] == 1
    assert measured["sglang_version"] == "0.5.23" and measured["ranks_checked"] == 1
    assert measured["engine_token_differs"] == 0
    expected = {"specforge": "CONFIRMED", "speculators": "CONFIRMED", "converted": "MISMATCH"}
    assert engine["verdict"] == expected[case]
    if case == "converted":
        assert engine["verdict_text"].startswith("MISMATCH: capture layers [2, 4, 6]")


def test_command_line_in_sglangs_engine(engine_jobs, tmp_path):
    """``eagle-capture probe --engine sglang`` end to end: the plan (memory, the settings
    the capture needs) before SGLang starts, the report and --json as the transformers
    mode writes them with SGLang's line alone, exit 0 (SGLang 0.5.23 captures SpecForge's
    ids right; vLLM's lines, wrong for them, are not this engine's)."""
    data = _result(engine_jobs, "sglang probe 0.5.23 tp1")
    cli = data["cli"]
    assert cli["exit"] == 0, cli["stderr"][-3000:]
    err = cli["stderr"]
    plan = err.index("the target in SGLang's engine at tensor parallel 1, dtype fp32")
    settings = err.index(
        "SGLang 0.5.23 runs with the settings the capture needs: CUDA graphs "
        "off, torch.compile off, radix cache off, chunked prefill off, "
        "FlashInfer all-reduce fusion off"
    )
    assert plan < settings < err.index("SGLang served the target in")
    assert "KV cache pool of 1088 tokens" in err[plan:settings]
    assert "trainer: SpecForge" in cli["stdout"] and "CONFIRMED" in cli["stdout"]
    assert "SGLang 0.5.23 captures [2, 4, 6]: OK" in cli["stdout"]
    assert "vLLM" not in cli["stdout"].split("CONFIRMED", 1)[1].split("note:", 1)[0]
    assert "note: measured in SGLang's engine at tensor parallel 1" in cli["stdout"]
    reference = _transformers(DATA / "draft_specforge", _prompts(tmp_path, 1), "0.5.23")
    _assert_same_answer(cli["json"], reference, max_token_flips=0)


def test_capture_equals_sglangs_own_tp1(engine_jobs):
    """TP 1: the probe's state at capture layers 1 - 7 is SGLang's own EAGLE-3 capture of
    the same forward, bit for bit (at least 5 prompts)."""
    own = _result(engine_jobs, "sglang probe 0.5.23 tp1")["own"]
    assert own["forwards_compared"] >= 5, own
    assert own["layers"] == [1, 2, 3, 4, 5, 6, 7] and own["ranks"] == [0]


def test_capture_equals_sglangs_own_tp2(engine_jobs):
    """TP 2 over gloo (SGLang 0.5.20, two scheduler processes): rank 0's states and both
    ranks' digests equal SGLang's own capture on that rank, bit for bit."""
    data = _result(engine_jobs, "sglang probe 0.5.20 tp2")
    assert data["version"] == "0.5.20"
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    own = data["own"]
    assert own["forwards_compared"] >= 5, own
    assert own["layers"] == [1, 2, 3, 4, 5, 6, 7] and own["ranks"] == [0, 1]


def test_tensor_parallel_2_captures_full_reduced_states(engine_jobs, tmp_path):
    """TP 2: both ranks' states the full width and equal (digests), the answer equal to
    transformers' up to float noise (another reduction order); layer 3's MLP all-reduce
    switched off in every rank -> refused, naming partial sums."""
    data = _result(engine_jobs, "sglang probe 0.5.20 tp2")
    engine = data["specforge"]
    measured = engine["measured"]
    assert measured["tp"] == 2 and measured["ranks_checked"] == 2
    assert measured["hidden_size"] == 64 and measured["prompts"] == 12
    assert measured["max_rank_difference"] <= 1e-6
    _assert_same_answer(
        engine,
        _transformers(DATA / "draft_specforge", _prompts(tmp_path, 2), "0.5.20"),
        max_token_flips=2,
    )
    partial = data["partial_sums"]
    assert partial["refused"], partial
    assert "partial sums" in partial["error"] and "capture layer 4" in partial["error"]


@pytest.mark.parametrize("version", ["0.5.9", "0.5.13"])
def test_command_line_on_older_lines(engine_jobs, version, tmp_path):
    """The command line on SGLang 0.5.9 and 0.5.13 (their forward_hooks, server arguments
    and norm calls): the same hits as transformers, SGLang's line for that version."""
    cli = _result(engine_jobs, f"sglang probe {version} cli")["cli"]
    assert cli["exit"] == 0, cli["stderr"][-3000:]
    assert f"SGLang {version} runs with the settings the capture needs" in cli["stderr"]
    reference = _transformers(DATA / "draft_specforge", _prompts(tmp_path, 1), version)
    _assert_same_answer(cli["json"], reference, max_token_flips=0)
