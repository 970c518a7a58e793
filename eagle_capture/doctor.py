"""Capture doctor: what will SGLang feed this EAGLE-3 draft, and is it what the
draft was trained on?

    python -m eagle_capture.doctor --draft-config draft/config.json --num-layers 61
    python -m eagle_capture.doctor --draft-config draft/config.json --num-layers 61 --sglang-version 0.5.9

For each SGLang release line it prints the layers SGLang will capture for the
draft's ``eagle_aux_hidden_state_layer_ids``, each slot in both conventions, what
the draft expects there, and a verdict. Exit status: 0 when every line shown
feeds the draft what it was trained on; 1 on any mismatch, embedding capture,
failure at the first forward, or missing ids (unless ``--accept-defaults``);
2 when the config cannot be read.

The draft's ids are read the way SpecForge writes them: id X = the *output* of
decoder layer X (HF ``output_hidden_states[X + 1]``), so the draft expects the
capture SGLang takes at the start of layer X + 1.

The per-line rules (:data:`SGLANG_LINES`) were read from the wheels'
``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`` and ``DeepseekV2Model``
layer loop, and are checked in CI by running each wheel's own code
(``tests/test_sglang_real.py``, scenario ``layer_id_rules``): the
``layers_to_capture`` it sets and what its first forward does.

Acceptance figures quoted in verdicts are field reports, not laws: an embedding
capture added to a draft trained without it took acceptance from ~47% to ~19%
(the case this project started from); a draft without ids served with an
engine's defaults ran at 1.2% instead of 58.9% (vLLM issue 50170).
"""

import argparse
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Optional, Sequence

from .plan import CapturePlanError, default_capture_layers, load_draft_config, parse_version


WIDTH = 100   # output columns


def _wrap(text: str, first: str, rest: str) -> str:
    """Wrap at WIDTH without breaking inside ``[...]`` or ``(...)``."""
    keep = re.sub(r"[\[(][^\])]*[\])]", lambda m: m.group(0).replace(" ", "\0"), text)
    wrapped = textwrap.fill(keep, WIDTH, initial_indent=first, subsequent_indent=rest,
                            break_long_words=False, break_on_hyphens=False)
    return wrapped.replace("\0", " ")


@dataclass(frozen=True)
class SGLangLine:
    """How one SGLang release line maps draft ids to captures."""
    name: str
    read_versions: tuple[str, ...]   # wheels whose code this was read from and run
    first: tuple[int, int, int]      # first version of the line (inclusive)
    last: Optional[tuple[int, int, int]]   # last version (inclusive); None: open-ended
    shift_always: bool               # +1 to every id (<= 0.5.12); else +1 only when ids[0] == 1
    layer0: str                      # "crash" | "embedding": a capture at the start of layer 0
    missing_capture: str             # "dropped" | "error": a layer id no layer has (-1)

    def capture_layers(self, ids: Optional[Sequence[int]], num_layers: int) -> list[int]:
        if ids is None:
            return default_capture_layers(num_layers)
        shift = 1 if self.shift_always or (ids and ids[0] == 1) else 0
        return [i + shift for i in ids]

    def covers(self, version: tuple[int, ...]) -> bool:
        return self.first <= version and (self.last is None or version <= self.last)


SGLANG_LINES = (
    SGLangLine("0.5.9 - 0.5.12", ("0.5.9",), (0, 0, 0), (0, 5, 12), shift_always=True,
               layer0="crash", missing_capture="dropped"),
    SGLangLine("0.5.13 - 0.5.17", ("0.5.13",), (0, 5, 13), (0, 5, 17), shift_always=False,
               layer0="crash", missing_capture="dropped"),
    SGLangLine("0.5.18 - 0.5.23+", ("0.5.18", "0.5.20", "0.5.22", "0.5.23"), (0, 5, 18), None,
               shift_always=False, layer0="embedding", missing_capture="error"),
)


def line_of(version: str) -> SGLangLine:
    v = parse_version(version)
    for line in SGLANG_LINES:
        if line.covers(v):
            return line
    raise CapturePlanError(f"no rule known for SGLang {version}")


def _source(input_layer: int) -> str:
    """A capture at the start of ``input_layer`` in words, both conventions."""
    if input_layer == 0:
        return "embedding output (input to layer 0)"
    return f"output of layer {input_layer - 1} (input to layer {input_layer})"


@dataclass
class LineVerdict:
    line: SGLangLine
    capture_layers: list[int]
    ok: bool
    lines: list[str]


def diagnose_line(line: SGLangLine, ids: Optional[Sequence[int]], num_layers: int,
                  allow_embedding: bool = False) -> LineVerdict:
    """What ``line`` captures for ``ids`` and whether it matches the draft."""
    capture = line.capture_layers(ids, num_layers)
    # What the draft was trained on (SpecForge: id X = output of layer X); unknown
    # without ids.
    expected = None if ids is None else [i + 1 for i in ids]
    out, ok = [], True
    if any(layer == 0 for layer in capture) and line.layer0 == "crash":
        return LineVerdict(line, capture, False, [
            f"FAILS at the first forward: layer 0 is captured and this line's loop computes "
            f"hidden_states + residual there, with residual None (TypeError)"])
    invalid = [layer for layer in capture if not 0 <= layer < num_layers]
    if invalid:
        if line.missing_capture == "dropped":
            return LineVerdict(line, capture, False, [
                f"layer(s) {invalid} do not exist: SGLang never captures them and hands the draft "
                f"{len(capture) - len(invalid)} of {len(capture)} slots "
                f"([T, {len(capture) - len(invalid)}*H]) without an error: the draft's input is "
                f"wrong"])
        return LineVerdict(line, capture, False, [
            f"FAILS at the first forward: layer(s) {invalid} do not exist, the packer gets "
            f"{len(capture) - len(invalid)} of {len(capture)} captures (RuntimeError)"])
    order = sorted(range(len(capture)), key=lambda k: capture[k])
    for slot, k in enumerate(order):
        got = capture[k]
        text = f"slot {slot}: SGLang captures the {_source(got)}"
        if expected is None:
            out.append(text + "; the draft's layers are unknown (no ids)")
            continue
        want = expected[k]
        if got != want:
            ok = False
            out.append(text + f"; the draft expects the {_source(want)}: MISMATCH, expect "
                              f"acceptance to collapse")
        elif got == 0 and not allow_embedding:
            ok = False
            out.append(text + "; the draft asks for it (id -1), but no SpecForge draft is "
                              "trained on the embedding (field report: ~47% -> ~19% acceptance "
                              "when it was added); --allow-embedding only if yours was")
        else:
            out.append(text + ": matches")
    if ids is not None and sorted(capture) != [expected[k] for k in order]:
        ok = False
    return LineVerdict(line, capture, ok, out)


@dataclass
class Diagnosis:
    ids: Optional[list[int]]
    num_layers: int
    verdicts: list[LineVerdict]
    notes: list[str]
    ok: bool

    def format(self) -> str:
        ids = "none (field absent)" if self.ids is None else self.ids
        out = [f"draft ids (output convention, as SpecForge writes them): {ids}; "
               f"target: {self.num_layers} layers"]
        out += [_wrap(f"note: {n}", "", "      ") for n in self.notes]
        for v in self.verdicts:
            status = ("PROBLEM" if not v.ok else
                      "UNVERIFIED (the draft's layers are unknown)" if self.ids is None else "OK")
            out.append(f"SGLang {v.line.name} (read from {', '.join(v.line.read_versions)}):")
            out.append(f"  layers_to_capture = {v.capture_layers} -> {status}")
            out += [_wrap(text, "    ", "      ") for text in v.lines]
        if not self.ok:
            verdict = "problems above; do not serve this as is"
        elif self.ids is None:
            verdict = "accepted (--accept-defaults): the draft is taken to be trained on these"
        else:
            verdict = "every line shown feeds the draft what it was trained on"
        out.append("verdict: " + verdict)
        return "\n".join(out)


def diagnose(ids: Optional[Sequence[int]], num_layers: int, *,
             sglang_version: Optional[str] = None, accept_defaults: bool = False,
             allow_embedding: bool = False) -> Diagnosis:
    """Diagnose draft ``ids`` (None: the config names none) against every SGLang
    line, or only the one ``sglang_version`` belongs to."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 4:
        raise CapturePlanError(f"num_layers must be an int >= 4, got {num_layers!r}")
    if ids is not None:
        ids = list(ids)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CapturePlanError(f"eagle_aux_hidden_state_layer_ids must be a non-empty list "
                                   f"of integers, got {ids!r}")
    lines = [line_of(sglang_version)] if sglang_version else list(SGLANG_LINES)
    notes, ok = [], True
    if ids is None:
        defaults = default_capture_layers(num_layers)
        notes.append(
            f"the draft config names no eagle_aux_hidden_state_layer_ids: SGLang captures its "
            f"defaults {defaults} (outputs of layers {[i - 1 for i in defaults]}, SpecForge's "
            f"default too). A draft trained on other layers then fails silently (field report, "
            f"vLLM issue 50170: acceptance 1.2% instead of 58.9%). Write the ids the draft was "
            f"trained on into its config" + ("" if accept_defaults else
                                             ", or pass --accept-defaults if they are these"))
        ok = accept_defaults
    elif any(i < 0 for i in ids):
        notes.append(f"id {min(ids)} is the embedding output; SpecForge requires non-negative ids, "
                     f"so a SpecForge-trained draft never saw it: the config was probably edited "
                     f"(SpecForge's default for {num_layers} layers is "
                     f"[1, {num_layers // 2 - 1}, {num_layers - 4}])")
    verdicts = [diagnose_line(line, ids, num_layers, allow_embedding) for line in lines]
    ok = ok and all(v.ok for v in verdicts)
    return Diagnosis(ids, num_layers, verdicts, notes, ok)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle_capture.doctor",
        description="What SGLang will capture for an EAGLE-3 draft, per SGLang release line, "
                    "and whether it is what the draft was trained on.")
    p.add_argument("--draft-config", required=True, help="the draft model's config.json")
    p.add_argument("--num-layers", type=int, required=True,
                   help="the target's num_hidden_layers (Kimi-K2 / DeepSeek-V3: 61)")
    p.add_argument("--sglang-version", help="only this SGLang version's line (default: all lines)")
    p.add_argument("--accept-defaults", action="store_true",
                   help="a config without ids is fine: the draft was trained on SGLang's defaults")
    p.add_argument("--allow-embedding", action="store_true",
                   help="the draft really was trained on the embedding output (id -1)")
    args = p.parse_args(argv)
    try:
        config = load_draft_config(args.draft_config)
        from .plan import ids_from_draft_config
        diagnosis = diagnose(ids_from_draft_config(config), args.num_layers,
                             sglang_version=args.sglang_version,
                             accept_defaults=args.accept_defaults,
                             allow_embedding=args.allow_embedding)
    except (CapturePlanError, OSError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(diagnosis.format())
    return 0 if diagnosis.ok else 1


if __name__ == "__main__":
    sys.exit(main())
