"""The capture doctor and the plan CLI on the cases users hit. The per-line
rules themselves are checked against each SGLang wheel's own code in
tests/test_sglang_real.py (scenario layer_id_rules)."""

import json

import pytest

from eagle_capture import doctor, plan
from eagle_capture.plan import CapturePlanError, build_plan, plan_from_draft_config


def _config(tmp_path, ids, nested=True):
    body = {"architectures": ["LlamaForCausalLMEagle3"]}
    if ids is not None:
        if nested:
            body["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        else:
            body["eagle_aux_hidden_state_layer_ids"] = ids
    path = tmp_path / "config.json"
    path.write_text(json.dumps(body))
    return path


def _doctor(capsys, *argv):
    """(exit code, stdout with its line wrapping undone, stderr)."""
    code = doctor.main([str(a) for a in argv])
    out = capsys.readouterr()
    assert all(len(line) <= doctor.WIDTH for line in out.out.splitlines())
    return code, " ".join(out.out.split()), out.err


def test_the_users_config_minus_one(tmp_path, capsys):
    """[-1, 29, 57] at 61 layers: every line fails, each in its own way."""
    code, out, _ = _doctor(capsys, "--draft-config", _config(tmp_path, [-1, 29, 57]),
                           "--num-layers", 61)
    assert code == 1
    assert "layers_to_capture = [0, 30, 58]" in out            # 0.5.9: always +1
    assert "residual None (TypeError)" in out
    assert "2 of 3 slots ([T, 2*H]) without an error" in out  # 0.5.13 drops -1 silently
    assert "the packer gets 2 of 3 captures (RuntimeError)" in out  # 0.5.18+
    assert "SpecForge requires non-negative ids" in out and "[1, 29, 57]" in out
    assert out.count("PROBLEM") == 3


def test_specforge_default_ids_are_fine_everywhere(tmp_path, capsys):
    code, out, _ = _doctor(capsys, "--draft-config", _config(tmp_path, [1, 29, 57]),
                           "--num-layers", 61)
    assert code == 0
    assert out.count("layers_to_capture = [2, 30, 58] -> OK") == 3
    assert "PROBLEM" not in out


def test_missing_ids_warn_and_fail_unless_accepted(tmp_path, capsys):
    path = _config(tmp_path, None)
    code, out, _ = _doctor(capsys, "--draft-config", path, "--num-layers", 61)
    assert code == 1
    assert "names no eagle_aux_hidden_state_layer_ids" in out and "1.2%" in out
    assert "UNVERIFIED" in out and "--accept-defaults" in out
    code, out, _ = _doctor(capsys, "--draft-config", path, "--num-layers", 61, "--accept-defaults")
    assert code == 0 and "accepted (--accept-defaults)" in out


def test_input_convention_ids_shift_differently_per_line(tmp_path, capsys):
    """[2, 29, 57]: ids[0] != 1, so only <= 0.5.12 adds 1 (sglang issue 25454)."""
    code, out, _ = _doctor(capsys, "--draft-config", _config(tmp_path, [2, 29, 57], nested=False),
                           "--num-layers", 61)
    assert code == 1
    assert "layers_to_capture = [3, 30, 58] -> OK" in out
    assert out.count("layers_to_capture = [2, 29, 57] -> PROBLEM") == 2
    assert "the draft expects the output of layer 2 (input to layer 3): MISMATCH" in out


def test_one_version(tmp_path, capsys):
    code, out, _ = _doctor(capsys, "--draft-config", _config(tmp_path, [2, 29, 57]),
                           "--num-layers", 61, "--sglang-version", "0.5.9")
    assert code == 0 and out.count("layers_to_capture =") == 1 and "0.5.9 - 0.5.12" in out
    assert doctor.line_of("0.5.20").name == "0.5.18 - 0.5.23+"
    assert doctor.line_of("0.5.15").layer0 == "crash"


def test_embedding_capture_needs_the_escape_hatch(tmp_path, capsys):
    """A draft id of -1 asks for the embedding output: 0.5.9 crashes on it
    regardless; a line that captures it is flagged unless allow_embedding."""
    verdict = doctor.diagnose_line(doctor.SGLANG_LINES[0], [-1, 29, 57], 61, allow_embedding=True)
    assert not verdict.ok and "TypeError" in verdict.lines[0]
    # A line that captures layer 0 without crashing: flagged unless allowed.
    line = doctor.SGLangLine("test", ("x",), (0, 0, 0), None, shift_always=True,
                             layer0="embedding", missing_capture="error")
    assert not doctor.diagnose_line(line, [-1, 29, 57], 61).ok
    assert doctor.diagnose_line(line, [-1, 29, 57], 61, allow_embedding=True).ok


def test_unreadable_config_exits_2(tmp_path, capsys):
    code, _, err = _doctor(capsys, "--draft-config", tmp_path / "missing.json", "--num-layers", 61)
    assert code == 2 and "error:" in err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    code, _, err = _doctor(capsys, "--draft-config", bad, "--num-layers", 61)
    assert code == 2 and "JSON object" in err


def test_plan_from_a_path_or_folder(tmp_path):
    path = _config(tmp_path, [1, 29, 57])
    for source in (path, str(path), tmp_path, json.loads(path.read_text())):
        assert plan_from_draft_config(source, 61).layers_to_capture == [2, 30, 58]


def test_plan_minus_one_names_the_escape_hatch(tmp_path, capsys):
    with pytest.raises(CapturePlanError, match="--allow-embedding.*doctor"):
        build_plan([-1, 29, 57], 61)
    # Read as an output id, -1 is the embedding: accepted on request (capture layer 0).
    assert build_plan([-1, 29, 57], 61, allow_embedding=True).layers_to_capture == [0, 30, 58]
    with pytest.raises(CapturePlanError, match="-2"):
        build_plan([-2, 29, 57], 61, allow_embedding=True)
    with pytest.raises(CapturePlanError, match="0.5.9 - 0.5.17 fail.*--allow-embedding"):
        build_plan([0, 29, 57], 61, convention="input")
    code = plan.main(["--draft-config", str(_config(tmp_path, [-1, 29, 57])), "--num-layers", "61",
                      "--allow-embedding"])
    assert code == 0 and "embedding output" in capsys.readouterr().out
