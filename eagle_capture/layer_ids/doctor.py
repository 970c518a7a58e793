"""The layer-id doctor: what will SGLang feed this EAGLE-3 draft, per release
line and deployment, and is it what the draft was trained on?

    eagle-capture doctor --draft-config <draft folder> --target-config <target folder>
    eagle-capture doctor --draft-config draft/config.json --num-layers 61 --tp 8 \\
        --sglang-version 0.5.23
    python -m eagle_capture.layer_ids.doctor ...          (the same)

For each SGLang line (or the one ``--sglang-version`` is in) it prints the
layers SGLang captures for the draft config's ids -- read exactly as SGLang's
target reads them -- each slot in both conventions, what the draft expects
there, a verdict, and for a PROBLEM the ids that would fix it on that line; then
what the deployment (``--tp``, ``--allreduce-fusion``, ``--dp-attention``,
``--pp``, ``--cuda-graph``, ``--torch-compile``) does to the captured rows, for
SGLang's own capture and for the fused drop-in, each verdict naming the code it
rests on and the test that runs that wheel.

``--engine vllm``: vLLM's rule instead (ids read top-level first, id k = the
input of layer k, no shift; :class:`~eagle_capture.layer_ids.lines.VLLMLine`),
with ``--id-convention`` saying how the draft's ids name layers, and vLLM's
deployment verdicts.

Exit status: 0 the draft receives what it was trained on on every line shown;
1 it does not, or it cannot be known (no ids without ``--accept-defaults``);
2 unusable input (unreadable or malformed config, a target config passed as the
draft's, a version older than every line read).

Acceptance figures quoted in verdicts are field reports, not laws: an embedding
capture added to a draft trained without it took acceptance from ~47% to ~19%
(the case this project started from); a draft without ids served with an
engine's defaults ran at 1.2% instead of 58.9% (vLLM issue 50170).
"""

import argparse
import itertools
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from eagle_capture.layer_ids import deployment
from eagle_capture.layer_ids.deployment import WIDTH, wrap as _wrap
from eagle_capture.layer_ids.lines import (SGLANG_LINES, VLLM_LINE, CapturePlanError, DraftIds,
                                           SGLangLine, VLLMLine, assumed_note,
                                           default_capture_layers, line_of, parse_version,
                                           read_draft_ids, read_target, specforge_default_ids)
from eagle_capture.layer_ids.rules import (SGLANG_MODEL_RULES, SHIFT_ALWAYS, ModelRule,
                                           sglang_model_rule)

__all__ = ["Diagnosis", "LineVerdict", "SGLANG_LINES", "SGLangLine", "diagnose",
           "diagnose_line", "fix_ids", "line_of", "main"]

def _source(input_layer: int, num_layers: int = 0) -> str:
    """A capture at the start of ``input_layer`` in words, both conventions."""
    if input_layer == 0:
        return "embedding output (input to layer 0, HF hidden_states[0])"
    if input_layer == num_layers:
        return f"output of layer {input_layer - 1} (the last layer, before the final norm)"
    return (f"output of layer {input_layer - 1} (input to layer {input_layer}, "
            f"HF hidden_states[{input_layer}])")


def _capturable(line, num_layers: int) -> int:
    """One past the largest capture layer ``line`` can take (vLLM: the last
    layer's output too)."""
    return num_layers + (1 if getattr(line, "last_layer_capturable", False) else 0)


def fix_ids(line: SGLangLine, want: Sequence[int], num_layers: int,
            allow_embedding: bool = False) -> Optional[list[int]]:
    """Draft-config ids for which ``line`` captures exactly the layers ``want``
    (SGLang's capture layers, slots in ascending order), or None if none can:
    the output-convention ids, else the input-convention ones, in ascending
    order first (``ids[0]`` decides 0.5.13+'s +1, so the order matters)."""
    want = sorted(want)
    if any(not 0 <= w < _capturable(line, num_layers) for w in want) \
            or (0 in want and not allow_embedding):
        return None
    if 0 in want and line.layer0 == "crash":
        return None
    for base in ([w - 1 for w in want], list(want)):
        for ids in itertools.permutations(base):
            ids = list(ids)
            if sorted(line.capture_layers(ids, num_layers)) == want:
                return ids
    return None


@dataclass
class LineVerdict:
    line: SGLangLine
    capture_layers: list[int]
    ok: bool
    lines: list[str]
    fix: Optional[str] = None


def diagnose_line(line: SGLangLine, ids: Optional[Sequence[int]], num_layers: int,
                  allow_embedding: bool = False,
                  trained: Optional[Sequence[int]] = None,
                  convention: str = "output") -> LineVerdict:
    """What ``line`` captures for the target-read ``ids`` (None: absent) and
    whether it matches what the draft was trained on (``trained``, in
    ``convention``; default: ``ids``; None and no ids: unknown)."""
    trained = ids if trained is None else trained
    capture = line.capture_layers(ids, num_layers)
    # SpecForge (output convention): id X = output of layer X = the capture at the
    # start of layer X + 1; input convention: id X = the input of layer X.
    shift = 1 if convention == "output" else 0
    expected = None if trained is None else sorted(i + shift for i in trained)
    verdict = LineVerdict(line, capture, True, [])

    def problem(text: str) -> LineVerdict:
        verdict.ok = False
        verdict.lines.append(text)
        return verdict

    if expected is not None and not (0 in expected and not allow_embedding):
        fixed = fix_ids(line, expected, num_layers, allow_embedding)
        key = ("eagle_aux_hidden_state_layer_ids at the config's top level (vLLM's runners read "
               "it first; its default GPU runner reads no other key)" if line.engine == "vLLM"
               else "eagle_config.eagle_aux_hidden_state_layer_ids")
        verdict.fix = (f"{key} = {fixed}" if fixed
                       else "no ids make this line capture those layers")
    if 0 in capture and line.layer0 == "crash":
        return problem("FAILS at the first forward: layer 0 is captured and this line's loop "
                       "computes hidden_states + residual there, with residual None (TypeError)")
    invalid = [layer for layer in capture if not 0 <= layer < _capturable(line, num_layers)]
    duplicates = sorted({layer for layer in capture if capture.count(layer) > 1})
    taken = len(set(capture) - set(invalid))
    if invalid or duplicates:
        what = (f"layer(s) {invalid} do not exist" if invalid else
                f"layer(s) {duplicates} are named twice (duplicate ids)")
        if line.missing_capture == "dropped":
            return problem(f"{what}: the loop captures each existing layer once and hands the "
                           f"draft {taken} of {len(capture)} slots ([T, {taken}*H]) without an "
                           f"error: the draft's input is wrong")
        if line.engine == "vLLM":
            return problem(f"FAILS at the first forward: {what}, the loop captures each "
                           f"existing layer once and the draft's fc, sized for {len(capture)}, "
                           f"gets {taken} (RuntimeError)")
        return problem(f"FAILS at the first forward: {what}, the packer gets {taken} of "
                       f"{len(capture)} captures (RuntimeError)")
    for slot, got in enumerate(sorted(capture)):
        text = f"slot {slot}: {line.engine} captures the {_source(got, num_layers)}"
        if expected is None:
            verdict.lines.append(text + "; the draft's layers are unknown (no ids)")
            continue
        want = expected[slot] if slot < len(expected) else None
        if want is None:
            problem(text + "; the draft has no slot for it: MISMATCH")
        elif got != want:
            problem(text + f"; the draft expects the {_source(want, num_layers)}: MISMATCH, "
                           f"expect acceptance to collapse")
        elif got == 0 and not allow_embedding:
            problem(text + "; the draft asks for it (id -1), but no SpecForge draft is trained "
                           "on the embedding (field report: ~47% -> ~19% acceptance when it was "
                           "added); --allow-embedding only if yours was")
        else:
            verdict.lines.append(text + ": matches")
    if expected is not None and len(expected) != len(capture):
        problem(f"the draft was trained on {len(expected)} layers, {line.engine} captures "
                f"{len(capture)}: its fc expects another width")
    return verdict


@dataclass
class Diagnosis:
    draft: Optional[DraftIds]
    ids: Optional[list[int]]          # what SGLang's target reads
    num_layers: int
    verdicts: list[LineVerdict]
    notes: list[str]
    ok: bool
    deployment: list[str] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    engine: str = "sglang"
    convention: str = "output"

    def format(self) -> str:
        ids = "none (field absent)" if self.ids is None else self.ids
        out = [_wrap(h, "", "  ") for h in self.header]
        convention = ("output convention as SpecForge writes them" if self.convention == "output"
                      else "input convention: id X = the input of layer X")
        where = ("vLLM's model runner (the top-level eagle_aux_hidden_state_layer_ids, else "
                 "eagle_config's" if self.engine == "vllm" else
                 "SGLang's target (eagle_config.eagle_aux_hidden_state_layer_ids")
        out.append(_wrap(f"draft ids read by {where}, {convention}): {ids}; "
                         f"target: {self.num_layers} layers", "", "  "))
        out += [_wrap(f"note: {n}", "", "      ") for n in self.notes]
        for v in self.verdicts:
            status = ("PROBLEM" if not v.ok else
                      "UNVERIFIED (the draft's layers are unknown)"
                      if self.ids is None and self.draft_trained is None else "OK")
            out.append(f"{v.line.engine} {v.line.name} (read from "
                       f"{', '.join(v.line.read_versions)}):")
            name = ("aux_hidden_state_layers" if v.line.engine == "vLLM"
                    else "layers_to_capture")
            out.append(f"  {name} = {v.capture_layers} -> {status}")
            out += [_wrap(text, "    ", "      ") for text in v.lines]
            if not v.ok and v.fix:
                out.append(_wrap(f"fix for this line: {v.fix}", "    ", "      "))
        out += self.deployment
        if not self.ok:
            verdict = "problems above; do not serve this as is"
        elif self.ids is None and self.draft_trained is None:
            verdict = "accepted (--accept-defaults): the draft is taken to be trained on these"
        else:
            verdict = "every line shown feeds the draft what it was trained on"
        out.append("verdict: " + verdict)
        return "\n".join(out)

    @property
    def draft_trained(self) -> Optional[list[int]]:
        return self.draft.trained if self.draft is not None else self.ids


def diagnose(ids: Optional[Sequence[int]], num_layers: int, *,
             sglang_version: Optional[str] = None, accept_defaults: bool = False,
             allow_embedding: bool = False, draft: Optional[DraftIds] = None,
             deploy: Optional["deployment.Deployment"] = None, engine: str = "sglang",
             convention: str = "output", architecture: str = "") -> Diagnosis:
    """Diagnose the draft ids SGLang's target reads (``ids``; None: absent)
    against every SGLang line, or only the one ``sglang_version`` belongs to;
    ``engine="vllm"``: the ids vLLM's runner reads, against vLLM's rule.
    ``draft`` (from :func:`read_draft_ids`) adds what the config says beyond
    them (a top-level key the target ignores); ``deploy`` the deployment;
    ``convention``: how the draft's ids name layers ("output": SpecForge's id X =
    the output of layer X; "input": id X = the input of layer X); ``architecture``:
    the target's (its model class's own id rule, :mod:`eagle_capture.layer_ids.rules`;
    empty: DeepseekV2's, said in a note)."""
    if engine not in ("sglang", "vllm"):
        raise CapturePlanError(f"engine must be sglang or vllm, got {engine!r}")
    if convention not in ("output", "input"):
        raise CapturePlanError(f"convention must be output or input, got {convention!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 4:
        raise CapturePlanError(f"num_layers must be an int >= 4, got {num_layers!r}")
    if ids is not None:
        ids = list(ids)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CapturePlanError(f"eagle_aux_hidden_state_layer_ids must be a non-empty list "
                                   f"of integers, got {ids!r}")
    notes, ok = [], True
    if engine == "vllm":
        lines = [VLLM_LINE]
    else:
        lines = [line_of(sglang_version)] if sglang_version else list(SGLANG_LINES)
        lines, model_notes = _model_lines(lines, architecture, sglang_version)
        notes += model_notes
    if engine == "sglang" and sglang_version and assumed_note(sglang_version):
        notes.append(assumed_note(sglang_version))
    trained = ids
    if engine == "vllm":
        notes += _vllm_notes(draft, ids, num_layers, convention)
    elif draft is not None and draft.nested is None and draft.top_level is not None:
        trained = draft.top_level
        notes.append(
            f"{draft.source} names eagle_aux_hidden_state_layer_ids {draft.top_level} at its top "
            f"level, outside eagle_config: every SGLang line's target IGNORES it (the model "
            f"runner reads only eagle_config[...]) and captures its defaults "
            f"{default_capture_layers(num_layers)}, while a draft class that reads either key "
            f"(SGLang's own Kimi-K2.5 EAGLE-3 draft does) was set up for these ids. Move them "
            f"into \"eagle_config\"")
    elif draft is not None and draft.top_level is not None and draft.top_level != draft.nested \
            and engine == "sglang":
        notes.append(f"{draft.source} also names ids {draft.top_level} at its top level: the "
                     f"target reads only eagle_config's {draft.nested}; remove the other")
    if ids is None and trained is None:
        defaults = default_capture_layers(num_layers)
        notes.append(
            f"the draft config names no eagle_aux_hidden_state_layer_ids: "
            f"{lines[0].engine} captures its "
            f"defaults {defaults} (outputs of layers {[i - 1 for i in defaults]}, SpecForge's "
            f"default too). A draft trained on other layers then fails silently (field report, "
            f"vLLM issue 50170: acceptance 1.2% instead of 58.9%). Write the ids the draft was "
            f"trained on into its config" + ("" if accept_defaults else
                                             ", or pass --accept-defaults if they are these"))
        ok = accept_defaults
    elif trained is not None and any(i < 0 for i in trained) and convention == "output":
        notes.append(f"id {min(trained)} is the embedding output; SpecForge requires "
                     f"non-negative ids, so a SpecForge-trained draft never saw it: the config "
                     f"was probably edited (SpecForge's default for {num_layers} layers is "
                     f"{specforge_default_ids(num_layers)})")
    if trained is not None and len(set(trained)) != len(trained):
        notes.append(f"ids {trained} name a layer twice: the draft expects {len(trained)} "
                     f"distinct captures")
    verdicts = [diagnose_line(line, ids, num_layers, allow_embedding, trained, convention)
                for line in lines]
    ok = ok and all(v.ok for v in verdicts)
    deploy_lines: list[str] = []
    if deploy is not None:
        if engine == "vllm":
            report = deployment.assess_vllm(deploy, verdicts[0].capture_layers, num_layers)
        else:
            report = deployment.assess(deploy, lines, [v.capture_layers for v in verdicts],
                                       num_layers, trained)
        deploy_lines = report.format(WIDTH)
        ok = ok and report.ok
    return Diagnosis(draft, ids, num_layers, verdicts, notes, ok, deploy_lines,
                     engine=engine, convention=convention)


def _model_lines(lines: list, architecture: str, sglang_version: Optional[str]):
    """Each SGLang line with the target model's own id rule, and the notes that
    say which rule applies (or that the model was not read and what is assumed)."""
    if not architecture:
        return lines, ["the target's architecture is not given: DeepseekV2's id rule is "
                       "assumed (other models have their own; pass --target-config or "
                       "--target-architecture)"]
    out, notes, said = [], [], set()
    for line in lines:
        version = (parse_version(sglang_version) if sglang_version
                   else parse_version(line.read_versions[-1]))
        rule = sglang_model_rule(version, architecture)
        if rule is None:
            read = sorted({a for rows in SGLANG_MODEL_RULES.values() for a in rows})
            rule = ModelRule(architecture, SHIFT_ALWAYS, "not read (assumed)",
                             line.read_versions[-1])
            text = (f"SGLang {line.name}: the model class for {architecture} was not read; "
                    f"the doctor ASSUMES it adds 1 to every id (the rule of most models). "
                    f"Check its set_eagle3_layers_to_capture (models read: {len(read)} "
                    f"architectures, e.g. LlamaForCausalLM, Qwen3MoeForCausalLM, "
                    f"GptOssForCausalLM)")
        else:
            text = f"SGLang {line.name}'s rule for {rule.describe()}"
        if text not in said:
            said.add(text)
            notes.append(text)
        out.append(line.for_model(rule))
    return out, notes


def _vllm_notes(draft: Optional[DraftIds], ids, num_layers: int, convention: str) -> list[str]:
    """What vLLM's reading of the draft config and its id rule mean for this draft."""
    notes = []
    if draft is not None and draft.top_level is not None and draft.nested is not None \
            and draft.top_level != draft.nested:
        notes.append(f"{draft.source} names ids {draft.top_level} at its top level and "
                     f"{draft.nested} in eagle_config: vLLM's runner reads the top-level ones, "
                     f"SGLang's target eagle_config's; remove the other")
    if ids is not None and convention == "output":
        notes.append(
            f"vLLM captures id k as the input of layer k (the output of layer k - 1), without "
            f"SGLang's +1: a draft trained by SpecForge (id X = the output of layer X) gets "
            f"every capture one layer early (a field report of the same off-by-one on another "
            f"model: acceptance ~45% -> ~10%). If the ids were written for vLLM's rule (the "
            f"draft trained on vLLM's own captures), pass --id-convention input")
    return notes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eagle-capture doctor",
        description="What SGLang will capture for an EAGLE-3 draft, per SGLang release line and "
                    "deployment, and whether it is what the draft was trained on.")
    p.add_argument("--draft-config", required=True,
                   help="the draft's config.json, or its model folder")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-config",
                        help="the target's config.json or model folder (layer count, hidden "
                             "size, architecture; Kimi-K2.5: its text_config)")
    target.add_argument("--num-layers", type=int,
                        help="the target's num_hidden_layers (Kimi-K2 / DeepSeek-V3: 61)")
    p.add_argument("--target-architecture",
                   help="the target's architecture (e.g. LlamaForCausalLM), when it is given "
                        "by --num-layers: its model's own id rule applies (default: from "
                        "--target-config; none: DeepseekV2's, said in a note)")
    p.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                   help="the serving engine whose id rule applies (default: sglang)")
    p.add_argument("--id-convention", choices=("output", "input"), default="output",
                   help="how the draft's ids name layers: output (SpecForge: id X = the output "
                        "of layer X; default) or input (id X = the input of layer X, vLLM's "
                        "own rule)")
    p.add_argument("--sglang-version", help="only this SGLang version's line (default: all)")
    p.add_argument("--accept-defaults", action="store_true",
                   help="a config without ids is fine: the draft was trained on SGLang's defaults")
    p.add_argument("--allow-embedding", action="store_true",
                   help="the draft really was trained on the embedding output (id -1)")
    deployment.add_arguments(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        draft = read_draft_ids(args.draft_config)
        header = [f"draft: {draft.source} ({draft.architecture or 'architecture not named'})"]
        architecture = ""
        if args.target_config is not None:
            target = read_target(args.target_config)
            num_layers, architecture = target.num_layers, target.architecture
            named = target.architecture or "architecture not named"
            header.append(f"target: {target.source} ({named}, {target.num_layers} layers, "
                          f"hidden size {target.hidden_size})")
        else:
            num_layers = args.num_layers
        if args.target_architecture:
            if architecture and architecture != args.target_architecture:
                raise CapturePlanError(f"--target-architecture {args.target_architecture} "
                                       f"contradicts the target config's {architecture}")
            architecture = args.target_architecture
        if args.engine == "vllm" and args.sglang_version:
            raise CapturePlanError("--sglang-version does not apply to --engine vllm")
        ids = VLLMLine.read_ids(draft) if args.engine == "vllm" else draft.read_by_target
        diagnosis = diagnose(ids, num_layers, sglang_version=args.sglang_version,
                             accept_defaults=args.accept_defaults,
                             allow_embedding=args.allow_embedding, draft=draft,
                             deploy=deployment.from_arguments(args, architecture),
                             engine=args.engine, convention=args.id_convention,
                             architecture=architecture)
    except CapturePlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    diagnosis.header = header
    print(diagnosis.format())
    return 0 if diagnosis.ok else 1


def console_main() -> None:
    """``eagle-capture``: ``eagle-capture doctor ...`` (the one sub-command)."""
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: eagle-capture doctor [--help] --draft-config ... (--target-config ... | "
              "--num-layers N) [deployment options]")
        raise SystemExit(0 if argv else 2)
    if argv[0] != "doctor":
        print(f"eagle-capture: unknown command {argv[0]!r} (commands: doctor)", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
