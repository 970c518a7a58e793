"""The examples run, and the README shows them verbatim: its layer-loop snippet is
the text of examples/layer_loop.py between the readme markers, and its doctor
doctor outputs are what the doctor prints for the example configs."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _run(*argv):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the ops' torch path
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _readme_block(after: str) -> str:
    """The first fenced block following the line ``after`` in README.md."""
    tail = README[README.index(after):]
    match = re.search(r"```[a-z]*\n(.*?)```", tail, re.S)
    return match.group(1)


def test_layer_loop_example_runs_and_matches_training():
    result = _run("examples/layer_loop.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: the fused capture equals what the draft was trained on" in result.stdout


def test_readme_layer_loop_is_the_example():
    source = (ROOT / "examples/layer_loop.py").read_text()
    region = source.split("# [readme-start]\n")[1].split("# [readme-end]\n")[0]
    assert _readme_block("### Inside an SGLang-style layer loop") == region


def test_readme_doctor_output_is_the_doctors():
    """The README's doctor blocks are what the doctor prints now."""
    for heading, want in (("The seed's case", 1), ("Ids written at the top level", 1),
                          ("The seed's draft served by vLLM", 1),
                          ("A Llama-3-70B draft trained by SpecForge", 1)):
        block = _readme_block(heading)
        command, _, shown = block.partition("\n")
        assert command.startswith("$ eagle-capture doctor ")
        result = _run("-m", "eagle_capture.layer_ids.doctor", *command.split()[3:])
        assert result.returncode == want, result.stderr
        assert shown == result.stdout, heading
