"""The doctor on real published EAGLE-3 draft configs (tests/data/published_configs:
each file verbatim from its trainer's repository, with a sidecar naming the source
commit and the ground truth read in the trainer's and engines' code; one or more per cause:
a target class that cannot capture on a line, a draft class no engine registers, the final
boundary, a class that delegates its capture, Kimi MLA drafts). Verdict per
engine, exit status and fix must be right on every one, and the plugins' start-up
check (eagle_capture.layer_ids.startup) must give the same answer as the doctor."""

import json
import os

import pytest

from eagle_capture.cli import doctor
from eagle_capture.layer_ids import startup
from eagle_capture.layer_ids.lines import SGLANG_LINES, VLLM_V2, read_draft_ids
from eagle_capture.layer_ids.rules import sglang_model_rule
from eagle_capture.layer_ids.trainers import recognise

DATA = os.path.join(os.path.dirname(__file__), "data", "published_configs")
NAMES = sorted(f[: -len(".config.json")] for f in os.listdir(DATA) if f.endswith(".config.json"))


def _case(name):
    with open(os.path.join(DATA, f"{name}.source.json")) as f:
        case = json.load(f)
    return os.path.join(DATA, f"{name}.config.json"), case


def _json(capsys, path, case, *extra):
    target = case["target"]
    code = doctor.main(
        [
            "--draft-config",
            path,
            "--num-layers",
            str(target["num_layers"]),
            "--target-architecture",
            target["architecture"],
            "--json",
            *extra,
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["exit"] == code
    return code, out


def test_every_config_has_its_sidecar():
    assert len(NAMES) >= 18
    for name in NAMES:
        _, case = _case(name)
        assert case["source"]["repo"] and len(case["source"]["commit"]) == 40, name
        assert case["ground_truth"]["basis"] and case["ground_truth"]["trained_capture_layers"]


@pytest.mark.parametrize("name", NAMES)
def test_verdict_exit_and_fix(name, capsys):
    path, case = _case(name)
    want = case["expected"]
    code, out = _json(capsys, path, case)
    assert code == want["exit"], out
    assert out["engines"]["sglang"]["verdict"] == want["sglang"], out["engines"]["sglang"]
    assert out["engines"]["vllm"]["verdict"] == want["vllm"], out["engines"]["vllm"]
    # The ground truth is the reading (or one of the readings) the doctor gives.
    readings = [r["trained_capture_layers"] for r in out["readings"]]
    assert any(t in readings for t in case["ground_truth"]["trained_capture_layers"]), readings
    if "readings" in want:
        assert sorted(readings) == sorted(want["readings"])
    if "fix_vllm" in want:
        fixes = {
            tuple(line["fix"])
            for reading in out["engines"]["vllm"]["readings"]
            for line in reading["lines"]
            if line["decides"] and line["fix"]
        }
        assert fixes == {tuple(want["fix_vllm"])}
    if "trainer_said" in want:
        assert out["trainer"] == want["trainer_said"]
    else:
        assert out["trainer"] == case["ground_truth"]["trainer"]


@pytest.mark.parametrize(
    "name", [n for n in NAMES if "sglang_by_release" in _case(n)[1]["expected"]]
)
def test_sglang_verdict_on_each_release(name, capsys):
    """Where a line's releases differ (a target class that captures on some only), the
    user who names the release gets that release's verdict."""
    path, case = _case(name)
    for version, want in case["expected"]["sglang_by_release"].items():
        code, out = _json(capsys, path, case, "--engine", "sglang", "--sglang-version", version)
        assert out["engines"]["sglang"]["verdict"] == want, (version, out["engines"]["sglang"])
        assert code == (0 if want == "OK" else 1), version


@pytest.mark.parametrize("name", [n for n in NAMES if "vllm_runner_v1" in _case(n)[1]["expected"]])
def test_served_with_vllms_v1_runner(name, capsys):
    """The V1 runner reads eagle_config's ids as capture layers: one layer early for
    SpecForge's; it decides only when the user says it serves with it."""
    path, case = _case(name)
    want = case["expected"]["vllm_runner_v1"]
    code, out = _json(capsys, path, case, "--engine", "vllm", "--vllm-runner", "v1")
    assert code == want["exit"] and out["engines"]["vllm"]["verdict"] == want["vllm"]
    lines = out["engines"]["vllm"]["readings"][0]["lines"]
    assert [line["fix"] for line in lines] == [want["fix"]]


def test_kimi_k25_when_the_user_knows_the_run(capsys):
    """SpecForge's Kimi-K2.5 draft from its sglang==0.5.6 days: --id-convention output
    (HF backend / 0.5.6: capture layers [3, 31, 59]) gives one fix per engine."""
    path, case = _case("specforge_kimi_k25")
    code, out = _json(capsys, path, case, "--id-convention", "output", "--sglang-version", "0.5.23")
    assert code == 1
    want = case["expected"]["with_output_convention"]
    sglang = out["engines"]["sglang"]["readings"][0]["lines"]
    assert [line["fix"] for line in sglang] == [want["sglang_fix_0_5_23"]]
    vllm = out["engines"]["vllm"]["readings"][0]["lines"]
    assert {tuple(line["fix"]) for line in vllm if line["fix"]} == {tuple(want["vllm_fix"])}


@pytest.mark.parametrize("name", NAMES)
def test_plugins_start_up_check_agrees_with_the_doctor(name, capsys):
    """One source of truth: for the layers each engine really sets (SGLang 0.5.23's
    model rule; vLLM's V2 runner), the start-up check both plugins run answers as the
    doctor's verdict does."""
    path, case = _case(name)
    _, out = _json(capsys, path, case, "--sglang-version", "0.5.23")
    arch, n = case["target"]["architecture"], case["target"]["num_layers"]
    draft = read_draft_ids(path)
    status = {"OK": "ok", "PROBLEM": "problem", "AMBIGUOUS": "ambiguous", "UNVERIFIED": "unknown"}
    sglang_line = SGLANG_LINES[-1].for_model(sglang_model_rule((0, 5, 23), arch))
    for engine, captured in (
        ("sglang", sglang_line.capture_layers(draft.nested, n)),
        ("vllm", VLLM_V2.capture_layers(VLLM_V2.read_ids(draft), n)),
    ):
        verdict = out["engines"][engine]["verdict"]
        if verdict in ("CANNOT LOAD", "CANNOT CAPTURE"):
            continue  # the engine never starts: no start-up check runs
        check = startup.check(
            "SGLang" if engine == "sglang" else "vLLM", captured, n, draft.raw, arch, env={}
        )
        assert check.status == status[verdict], (engine, check.text)


def test_readings_come_from_the_trainers_history():
    """SpecForge's SGLang pins are data: the Kimi-K2.5 template's two readings name the
    runs they come from."""
    path, case = _case("specforge_kimi_k25")
    p = recognise(read_draft_ids(path), 61, "KimiK25ForConditionalGeneration")
    why = {r.expected: r.why for r in p.readings}
    assert "SGLang 0.5.1 - 0.5.9 as pinned from 2025-09-01" in why[(3, 31, 59)]
    assert "Hugging Face target" in why[(3, 31, 59)]
    assert "SGLang 0.5.14 as pinned from 2026-06-26" in why[(2, 30, 58)]
