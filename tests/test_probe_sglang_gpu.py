"""The probe with its target in SGLang's real engine on a GPU (``--engine sglang``), against
the probe with its target in transformers on the same GPU: the tiny trained target and
drafts of tests/data/tiny_eagle3, SGLang's Triton attention, tensor parallel 1 (and 2 on a
machine of two GPUs).

Needs a CUDA device and SGLang importable (the GPU machine: tools/gpu/gpu_sglang_engine.sh
installs the engine bundle; tests/test_probe_sglang.py runs the same harness,
tests/sglang_real/probe_engine.py, in SGLang's CPU engine on every CI run). Skipped elsewhere.

* the probe's states equal SGLang's own EAGLE-3 capture of the same layers in the same
  forwards, bit for bit, on the GPU;
* bf16 and fp16 (SGLang's CUDA kernels take no float32: the probe refuses --dtype fp32
  there, tests/test_probe_sglang_inputs.py): every reading's hits within rounding of
  transformers' over the same tokens, the same verdicts -- CONFIRMED for the three trained
  drafts (one an MLA draft), MISMATCH naming [2, 4, 6] for the config that lies --, SGLang's
  line alone reported; the command line as a user runs it.
* TP 2 over NCCL, one GPU a rank (skipped below two GPUs, tests.probe_cli.TWO_GPUS): both
  ranks' states SGLang's own capture bit for bit, the transformers probe's answer over the
  same 12 prompts within rounding, layer 3's MLP all-reduce switched off refused.

``EAGLE_CAPTURE_RECORD=DIR`` keeps each run's JSON there.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="SGLang is not installed (the GPU machine: carry "
        "tools/gpu/make_sglang_engine_bundle.sh's .sglang_engine and .whl_sglang)",
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
# SGLang's kernels and transformers' round differently per layer in 16 bits: the agreement
# moves by rounding only (2% of a reading's tokens; the verdicts above stand).
MAX_FLIP_FRACTION = 0.02


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def engine_run(request, tmp_path_factory):
    """One run of tests/sglang_real/probe_engine.py in SGLang's engine on the GPU at
    ``dtype``: the command line (its own engine), then one engine for the four cases."""
    dtype = request.param
    work = tmp_path_factory.mktemp(f"probe_sglang_cuda_{dtype}")
    module = "tests.sglang_real.probe_engine"
    return dtype, run_engine_harness(module, work, dtype, f"probe_sglang_cuda_{dtype}.json"), work


def _transformers(draft: Path, prompts: Path, dtype: str, version: str) -> dict:
    return run_probe(
        str(DATA / "target"),
        str(draft),
        str(prompts),
        device="cuda",
        dtype=dtype,
        max_tokens=64,
        log=lambda s: None,
        progress=False,
        sglang_version=version,
    ).to_json()


def _hits(report: dict) -> dict:
    return {tuple(r["capture_layers"]): (r["hits"], r["tokens"]) for r in report["readings"]}


def test_capture_equals_sglangs_own_on_cuda(engine_run):
    """The probe's state at capture layers 1 - 7 is SGLang's own EAGLE-3 capture of the same
    forward on the GPU, bit for bit."""
    _, data, _ = engine_run
    own = data["own"]
    assert own["forwards_compared"] >= 5, own
    assert own["layers"] == [1, 2, 3, 4, 5, 6, 7] and own["ranks"] == [0]


def test_sglang_mode_on_cuda_equals_transformers_mode(engine_run):
    from tests.sglang_real.probe_engine import cases, prompts

    dtype, data, work = engine_run
    version = data["version"]
    calibration = prompts(work, 1)
    for case, draft in cases(work / "drafts").items():
        engine = data[case]
        reference = _transformers(draft, calibration, dtype, version)
        assert engine["verdict_text"].startswith(EXPECTED[case]), (case, engine["verdict_text"])
        for key in ("verdict", "fixes", "trainer", "ids"):
            assert engine[key] == reference[key], (case, key)
        # The SGLang mode answers for SGLang: the reference's line for this version alone.
        sglang_lines = [e for e in reference["engines"] if e.startswith("SGLang")]
        assert engine["engines"] == sglang_lines and len(sglang_lines) == 1, case
        assert engine["ok"] == (
            reference["verdict"] == "CONFIRMED" and sglang_lines[0].endswith(": OK")
        ), case
        mine, theirs = _hits(engine), _hits(reference)
        assert mine.keys() == theirs.keys()
        for layers, (hits, tokens) in mine.items():
            assert tokens == theirs[layers][1], (case, layers)
            allowed = int(MAX_FLIP_FRACTION * tokens)
            assert abs(hits - theirs[layers][0]) <= allowed, (case, layers, hits, theirs[layers])
        measured = engine["measured"]
        assert measured["engine"] == "sglang" and measured["tp"] == 1
        assert measured["sglang_version"] == version and measured["ranks_checked"] == 1


def test_command_line_in_sglangs_cuda_engine(engine_run):
    from tests.sglang_real.probe_engine import prompts

    dtype, data, work = engine_run
    cli = data["cli"]
    line = [e for e in cli["json"]["engines"] if e.startswith("SGLang")]
    assert len(line) == 1 and cli["json"]["engines"] == line
    assert cli["exit"] == (0 if line[0].endswith(": OK") else 1), cli["stderr"][-3000:]
    plan = cli["stderr"].index(f"the target in SGLang's engine at tensor parallel 1, dtype {dtype}")
    assert cli["stderr"].index("SGLang served the target in") > plan
    assert "trainer: SpecForge" in cli["stdout"] and EXPECTED["specforge"] in cli["stdout"]
    assert "note: measured in SGLang's engine at tensor parallel 1" in cli["stdout"]
    reference = _transformers(DATA / "draft_specforge", prompts(work, 1), dtype, data["version"])
    assert cli["json"]["verdict"] == reference["verdict"]


def test_fp32_is_refused_on_cuda(tmp_path):
    """--dtype fp32 on the GPU: one line, exit 2, before SGLang starts (its CUDA RMSNorm
    has no float32: an engine started anyway stops at its first forward)."""
    from tests.probe_cli import run_cli

    cli = run_cli(
        ["--engine", "sglang", "--target", str(DATA / "target")]
        + ["--draft", str(DATA / "draft_specforge"), "--dtype", "fp32", "--device", "cuda"],
        tmp_path / "record.json",
    )
    assert cli["exit"] == 2, cli["stderr"][-3000:]
    assert "--dtype fp32 with --engine sglang on a machine with a GPU" in cli["stderr"]
    assert len(cli["stderr"].strip().splitlines()) == 1 and cli["json"] is None


@pytest.fixture(scope="module")
def engine_run_tp2(tmp_path_factory):
    """TP 2 over NCCL, one GPU a rank (the tiny target's two heads split no further)."""
    work = tmp_path_factory.mktemp("probe_sglang_cuda_tp2")
    return run_engine_harness(
        "tests.sglang_real.probe_engine", work, "bf16", "probe_sglang_cuda_bf16_tp2.json", tp=2
    ), work


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=TWO_GPUS)
def test_tensor_parallel_2_over_nccl(engine_run_tp2):
    """TP 2 on two GPUs: both ranks' states equal SGLang's own capture on that rank, bit for
    bit; both ranks' states the full width and equal; the verdicts and hits of transformers'
    probe on the same prompts, within rounding; layer 3's MLP all-reduce switched off in
    every rank -> refused, naming partial sums from capture layer 4."""
    from tests.sglang_real.probe_engine import PROMPTS, cases, prompts

    data, work = engine_run_tp2
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    own = data["own"]
    assert own["forwards_compared"] >= 5, own
    assert own["layers"] == [1, 2, 3, 4, 5, 6, 7] and own["ranks"] == [0, 1]
    drafts = cases(work / "drafts")
    for case in ("specforge", "mla"):
        engine = data[case]
        measured = engine["measured"]
        assert measured["tp"] == 2 and measured["ranks_checked"] == 2, case
        assert measured["prompts"] == PROMPTS[2] and measured["max_rank_difference"] <= 1e-6, case
        reference = _transformers(drafts[case], prompts(work, 2), "bf16", data["version"])
        assert engine["verdict_text"].startswith(EXPECTED[case]), engine["verdict_text"]
        assert engine["verdict"] == reference["verdict"] and engine["ids"] == reference["ids"]
        mine, theirs = _hits(engine), _hits(reference)
        assert mine.keys() == theirs.keys(), case
        for layers, (hits, tokens) in mine.items():
            assert tokens == theirs[layers][1], (case, layers)
            assert abs(hits - theirs[layers][0]) <= int(MAX_FLIP_FRACTION * tokens), (case, layers)
    partial = data["partial_sums"]
    assert partial["refused"], partial
    assert "partial sums" in partial["error"] and "capture layer 4" in partial["error"]
