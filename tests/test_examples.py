"""The examples run, and the docs show them verbatim: the layer-loop snippet in
docs/ops.md is the text of examples/layer_loop.py between the readme markers, the
doctor outputs in docs/doctor.md are what the doctor prints for the example configs,
and the README's doctor excerpt is lines of one of them. The README and the docs
pages link each other: every docs page it links, each page back to it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
# Pages older than the front page, not written as its subpages: no link back.
NOT_SUBPAGES = {"engine_facts.md", "test_runs.md"}


def _run(*argv):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the ops' torch path
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def _block(text: str, after: str) -> str:
    """The first fenced block following the line ``after`` in ``text``."""
    tail = text[text.index(after) :]
    match = re.search(r"```[a-z]*\n(.*?)```", tail, re.S)
    return match.group(1)


def _doc_block(page: str, after: str) -> str:
    """The first fenced block following the line ``after`` in docs/``page``."""
    return _block((DOCS / page).read_text(), after)


def test_layer_loop_example_runs_and_matches_training():
    result = _run("examples/layer_loop.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: the fused capture equals what the draft was trained on" in result.stdout


def test_docs_layer_loop_is_the_example():
    source = (ROOT / "examples/layer_loop.py").read_text()
    region = source.split("# [readme-start]\n")[1].split("# [readme-end]\n")[0]
    assert _doc_block("ops.md", "### Inside an SGLang-style layer loop") == region


def test_docs_doctor_output_is_the_doctors():
    """The doctor blocks of docs/doctor.md are what the doctor prints now."""
    for heading, want in (
        ("The seed's case", 1),
        ("Ids written at the top level", 1),
        ("The seed's draft served by vLLM", 1),
        ("A Llama-3-70B draft trained by SpecForge", 0),
    ):
        block = _doc_block("doctor.md", heading)
        command, _, shown = block.partition("\n")
        assert command.startswith("$ eagle-capture doctor ")
        result = _run("-m", "eagle_capture.layer_ids.doctor", *command.split()[3:])
        assert result.returncode == want, result.stderr
        assert shown == result.stdout, heading


def test_readme_doctor_excerpt_is_from_the_transcript():
    """The README's shortened doctor example: every line but the ``...`` gaps is a line
    of the Llama transcript in docs/doctor.md (which the test above checks is current)."""
    excerpt = _block(README, "an excerpt:")
    assert not excerpt.startswith("$ eagle-capture doctor")
    transcript = _doc_block("doctor.md", "A Llama-3-70B draft trained by SpecForge")
    shown = [line for line in excerpt.splitlines() if line != "..."]
    assert shown and len(excerpt.splitlines()) <= 25
    assert set(shown) <= set(transcript.splitlines())


def test_readme_and_docs_pages_link_each_other():
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert pages
    unlinked = [p for p in pages if f"](docs/{p})" not in README]
    assert not unlinked, f"README.md does not link {unlinked}"
    no_way_back = [
        p
        for p in pages
        if p not in NOT_SUBPAGES and "](../README.md)" not in (DOCS / p).read_text()
    ]
    assert not no_way_back, f"no link back to ../README.md in {no_way_back}"
