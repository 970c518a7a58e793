"""``eagle-capture probe --engine sglang``: what is decided before SGLang starts -- the bad
input refused with one line and exit 2 before anything is loaded, the line rule (which
SGLang the probe can drive for which target), the server arguments it sets per line -- and
the one meaning of ``--engine`` (an engine's run answers for that engine's lines).

An installed SGLang is stood in by its metadata alone (a ``sglang-X.dist-info`` and an
empty package on sys.path): the probe reads the version and imports nothing before the
engine starts, so nothing else of SGLang is involved here; the engine runs themselves are
tests/test_probe_sglang.py's.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from eagle_capture.cli.probe import main  # noqa: E402
from eagle_capture.probe import probe as probe_mod  # noqa: E402
from eagle_capture.probe.sglang_engine import engine_kwargs, fixed_arg, line_problem  # noqa: E402

DATA = Path(__file__).parent / "data" / "tiny_eagle3"
TARGET = DATA / "target"
PROMPTS = DATA / "prompts.jsonl"


def _exit_status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _installed(tmp_path, monkeypatch, version: str) -> None:
    """SGLang ``version`` as pip leaves it: its package and its dist-info on the path."""
    site = tmp_path / f"site-{version}"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    info = site / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()


def _nothing_loads(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("loaded before the input was checked")

    monkeypatch.setattr(probe_mod, "load_draft", loaded)
    for runner in probe_mod.RUNNERS.values():
        monkeypatch.setattr(runner, "start", loaded)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", loaded)


def _deepseek_target(tmp_path) -> Path:
    """The tiny target's config with DeepSeek-V3's class (the config alone is read)."""
    folder = tmp_path / "deepseek_target"
    shutil.copytree(TARGET, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _one_line_exit_2(capsys, argv, message):
    assert _exit_status(argv) == 2, argv
    err = capsys.readouterr().err
    assert message in err, (argv, err)
    assert len(err.strip().splitlines()) == 1, (argv, err)  # no plan, no traceback


BASE = [
    "--target",
    str(TARGET),
    "--draft",
    str(DATA / "draft_specforge"),
    "--prompts",
    str(PROMPTS),
    "--device",
    "cpu",
    "--engine",
    "sglang",
]


def test_sglang_not_installed(capsys, monkeypatch):
    """No SGLang in this Python: one line, exit 2, nothing loaded."""
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed in this Python")
    _nothing_loads(monkeypatch)
    _one_line_exit_2(capsys, BASE, "error: --engine sglang: SGLang is not installed in this Python")


def test_bad_sglang_input_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """A TP size the target's heads cannot split, a line older than the probe drives, a
    --sglang-version that is not the installed one, server arguments the probe sets: one
    line each, exit 2, before the draft, the tokenizer, the target or SGLang is loaded."""
    _nothing_loads(monkeypatch)
    _installed(tmp_path, monkeypatch, "0.5.13")
    for extra, message in [
        (
            ["--tp", "3"],
            "--tp 3: the target's 2 attention heads do not divide over 3 ranks (SGLang requires",
        ),
        (["--tp", "4"], "SGLang cannot serve the target at tensor parallel 4"),
        (
            ["--sglang-version", "0.5.23"],
            "--sglang-version 0.5.23: --engine sglang runs "
            "and reports the installed SGLang, 0.5.13",
        ),
        (
            ["--engine-arg", "forward_hooks=[]"],
            "--engine-arg forward_hooks (the probe's capture): set by the probe",
        ),
        (
            ["--engine-arg", "disable_cuda_graph=false"],
            "disable_cuda_graph (a CUDA graph replay skips the hooks)",
        ),
        (["--engine-arg", "cuda_graph_max_bs=8"], "cuda_graph_max_bs (a CUDA graph replay"),
        (
            ["--engine-arg", "chunked_prefill_size=512"],
            "chunked_prefill_size (one forward per prompt)",
        ),
        (["--engine-arg", "enable_dp_attention=true"], "enable_dp_attention"),
        (["--engine-arg", "pp_size=2"], "pp_size (the probe hooks one pipeline stage)"),
        (
            ["--engine-arg", "enforce_disable_flashinfer_allreduce_fusion=false"],
            "enforce_disable_flashinfer_allreduce_fusion",
        ),
    ]:
        _one_line_exit_2(capsys, BASE + extra, message)


def test_fp32_on_a_gpu_is_refused_before_sglang_starts(tmp_path, capsys, monkeypatch):
    """SGLang runs the target's RMSNorm in sgl_kernel wherever a GPU is visible (its kernels
    follow the host, not its device argument), and sgl_kernel's has no float32 (an H100 run
    of 2026-12-06 stopped at the first forward, SGLang 0.5.13): --dtype fp32 there is one
    line and exit 2 before anything loads, whatever --engine-arg device says, and the runner
    refuses it when built directly; bf16 / auto on a GPU and fp32 without one go ahead."""
    from eagle_capture.probe.runners import EngineError
    from eagle_capture.probe.sglang_engine import SglangTarget

    _installed(tmp_path, monkeypatch, "0.5.13")
    gpu = [True]
    monkeypatch.setattr("torch.cuda.is_available", lambda: gpu[0])
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    _nothing_loads(monkeypatch)
    message = "--dtype fp32 with --engine sglang on a machine with a GPU: SGLang runs"
    for extra in ([], ["--engine-arg", "device=cuda:1"], ["--engine-arg", "device=cpu"]):
        _one_line_exit_2(capsys, BASE + ["--dtype", "fp32"] + extra, message)
    with pytest.raises(EngineError, match="--dtype fp32 with --engine sglang"):
        SglangTarget(TARGET, 8, 64, range(9), dtype="fp32", version="0.5.13")
    for extra, visible in (
        (["--dtype", "bf16"], True),
        (["--dtype", "auto"], True),
        (["--dtype", "fp32"], False),
    ):
        gpu[0] = visible
        with pytest.raises(AssertionError, match="loaded before the input was checked"):
            main(BASE + extra)  # past every check: the first load is reached
        assert "--dtype fp32 with --engine sglang" not in capsys.readouterr().err


def test_a_line_the_probe_cannot_drive(tmp_path, capsys, monkeypatch):
    """SGLang older than 0.5.9: refused, naming the first line it drives."""
    _nothing_loads(monkeypatch)
    _installed(tmp_path, monkeypatch, "0.5.4")
    _one_line_exit_2(
        capsys,
        BASE,
        "--engine sglang: SGLang 0.5.4 is older than 0.5.9, the first line the probe drives",
    )


def test_0_5_9_cannot_turn_the_fusion_off_for_deepseek_at_tp_above_1(tmp_path, capsys, monkeypatch):
    """0.5.9 turns the FlashInfer all-reduce fusion on for DeepSeek-V3 / Kimi-K2.5 with no
    switch: refused at TP > 1 (no CUDA device here: it cannot tell the GPU, refuses), with
    the reason and what to do; at TP 1, or on 0.5.13, the input is accepted (it gets as far
    as the draft)."""
    _nothing_loads(monkeypatch)
    target = str(_deepseek_target(tmp_path))
    argv = ["--target", target] + BASE[2:]
    _installed(tmp_path, monkeypatch, "0.5.9")
    _one_line_exit_2(
        capsys,
        argv + ["--tp", "2"],
        "SGLang 0.5.9 turns the FlashInfer all-reduce + RMSNorm fusion on for "
        "DeepseekV3ForCausalLM on sm90 / sm100 GPUs",
    )
    with pytest.raises(AssertionError, match="loaded before"):
        main(argv)  # TP 1: accepted, the draft is loaded next

    assert line_problem("0.5.9", "KimiK25ForConditionalGeneration", 8, None)
    assert line_problem("0.5.9", "KimiK25ForConditionalGeneration", 8, (9, 0))
    assert line_problem("0.5.9", "KimiK25ForConditionalGeneration", 8, (8, 0)) is None
    assert line_problem("0.5.9", "LlamaForCausalLM", 8, (9, 0)) is None
    assert line_problem("0.5.12", "DeepseekV3ForCausalLM", 2, (10, 0))
    assert line_problem("0.5.13", "KimiK25ForConditionalGeneration", 8, (9, 0)) is None
    assert line_problem("0.5.23", "KimiK25ForConditionalGeneration", 8, (9, 0)) is None


def test_a_draft_the_probe_cannot_read_is_refused_before_sglang_starts(
    tmp_path, capsys, monkeypatch
):
    """A --draft the probe cannot run: an EAGLE-3 draft's config over weights without the
    draft's fc (a Llama checkpoint's): one line, exit 2, SGLang never started."""

    def started(*args, **kwargs):
        raise AssertionError("SGLang started")

    monkeypatch.setattr(probe_mod.RUNNERS["sglang"], "start", started)
    _installed(tmp_path, monkeypatch, "0.5.23")
    draft = tmp_path / "not_a_draft"
    draft.mkdir()
    shutil.copy(DATA / "draft_specforge" / "config.json", draft / "config.json")
    shutil.copy(TARGET / "model.safetensors", draft / "model.safetensors")
    argv = list(BASE)
    argv[argv.index("--draft") + 1] = str(draft)
    _one_line_exit_2(capsys, argv, "no fc.weight: not an EAGLE-3 draft")


def test_server_arguments_per_line():
    """What the probe asks of each line (read from each wheel's server arguments): the
    fusion forced off where the switch exists (0.5.13+), piecewise CUDA graphs off by their
    own switch in 0.5.13 (disable_cuda_graph covers them from 0.5.18, off by default in
    0.5.9), CUDA graphs, radix cache, chunked prefill off, one replica and stage."""
    common = dict(
        disable_cuda_graph=True,
        enable_torch_compile=False,
        disable_radix_cache=True,
        chunked_prefill_size=-1,
        dp_size=1,
        pp_size=1,
        enable_dp_attention=False,
        max_running_requests=1,
        skip_tokenizer_init=True,
        enable_flashinfer_allreduce_fusion=False,
    )
    for version in ("0.5.9", "0.5.13", "0.5.18", "0.5.20", "0.5.23"):
        kw = engine_kwargs(version, TARGET, 8, "auto", 512, ["spec"])
        for key, value in common.items():
            assert kw[key] == value, (version, key)
        assert kw["tp_size"] == 8 and kw["forward_hooks"] == ["spec"] and kw["dtype"] == "auto"
        assert kw.get("enforce_disable_flashinfer_allreduce_fusion") is (
            None if version == "0.5.9" else True
        ), version
        assert kw.get("disable_piecewise_cuda_graph") is (True if version == "0.5.13" else None), (
            version
        )
        assert kw.get("enable_piecewise_cuda_graph") is (False if version == "0.5.9" else None), (
            version
        )
    user = engine_kwargs("0.5.23", TARGET, 1, "bf16", 64, [], {"quantization": "fp8"})
    assert user["quantization"] == "fp8" and user["dtype"] == "bfloat16"
    assert fixed_arg("quantization") is None and fixed_arg("mem_fraction_static") is None


def test_the_engine_named_is_the_engine_answered_for():
    """``--engine sglang`` reports SGLang's line and decides the exit from it, ``--engine
    vllm`` vLLM's lines, transformers both: SpecForge's ids [1, 3, 5] on the tiny target,
    measured CONFIRMED -- SGLang captures them (OK), vLLM does not (PROBLEM)."""
    from eagle_capture.layer_ids.lines import read_draft_ids, read_target
    from eagle_capture.layer_ids.trainers import recognise
    from eagle_capture.probe.readings import Candidate
    from eagle_capture.probe.verdict import ProbeReport, judge

    ids = read_draft_ids(DATA / "draft_specforge" / "config.json")
    tmodel = read_target(TARGET / "config.json")
    provenance = recognise(ids, 8, tmodel.architecture, "auto")

    def report(engines):
        cands = [
            Candidate((2, 4, 6), ["config: output convention"], True, 900, 1000),
            Candidate((2, 4, 5), ["vLLM V2 captures"], False, 500, 1000),
        ]
        r = ProbeReport(8, cands, provenance, 0.0)
        judge(r, ids, tmodel.architecture, 0.03, "0.5.23", engines=engines)
        return r

    both, sglang, vllm = report(("sglang", "vllm")), report(("sglang",)), report(("vllm",))
    assert all(r.verdict.startswith("CONFIRMED") for r in (both, sglang, vllm))
    assert sglang.engines == ["SGLang 0.5.23 captures [2, 4, 6]: OK"] and sglang.ok
    assert vllm.engines and all(e.startswith("vLLM") and "PROBLEM" in e for e in vllm.engines)
    assert not vllm.ok and not both.ok
    assert both.engines == sglang.engines + vllm.engines
