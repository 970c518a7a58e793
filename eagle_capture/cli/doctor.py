"""The layer-id doctor: what will SGLang and vLLM feed this EAGLE-3 draft, per
release line, runner and deployment, and is it what the draft was trained on?

    eagle-capture doctor --draft-config <draft folder> --target-config <target folder>
    eagle-capture doctor ... --engine vllm --write-config fixed/config.json   (the fix applied)
    eagle-capture doctor --draft-config draft/config.json --num-layers 61 --tp 8 \\
        --sglang-version 0.5.23 --engine sglang
    python -m eagle_capture.layer_ids.doctor ...          (the same)

First it names who exported the draft (SpecForge, speculators, NVIDIA Model
Optimizer, TorchSpec, AngelSlim, SafeAILab EAGLE: :mod:`eagle_capture.layer_ids.trainers`, from the
config's own keys) and the layers its ids were trained on, in that trainer's
convention. Then, for each engine (``--engine sglang,vllm``, both by default):
each SGLang line (or the one ``--sglang-version`` is in), with the target model's
own id rule (:mod:`eagle_capture.layer_ids.rules`), and vLLM's runners (V2 and V1 read the ids in
different places: :class:`~eagle_capture.layer_ids.lines.VLLMLine`) -- the layers
captured, each slot in both conventions, what the draft expects there, a
verdict, and for a PROBLEM the ids that fix it there; then what the deployment
(``--tp``, ``--allreduce-fusion``, ``--dp-attention``, ``--pp``, ``--cuda-graph``,
``--torch-compile``) does to the captured rows, each verdict naming the code it
rests on and the test that runs that wheel. ``--capture`` says how the server
captures: the engine's own capture (default), eagle-capture's (``EAGLE_CAPTURE=1``:
the engine-capture problems it does not have decide nothing), or SGLang 0.5.23's
capture-only mode (:mod:`eagle_capture.layer_ids.capture_only`: the ids of its command line, judged against
the layers the draft config was trained on). A line measured to capture another
tensor than the residual stream (:mod:`eagle_capture.layer_ids.tensors`) is a PROBLEM no id fixes.

Where the trainer's markers cannot decide how the ids were meant (Model
Optimizer's two dumps, TorchSpec's ``--vllm`` conversion, an unrecognised config
whose ids are the input-convention default), every reading gets its verdict, no
fix is printed outside the reading it belongs to, and the exit status is 1 until
``--id-convention output|input`` decides.

The first line is one verdict per engine (:attr:`eagle_capture.layer_ids.diagnosis.Diagnosis.verdict_class`): OK,
PROBLEM, CANNOT CAPTURE (the target's class cannot feed an EAGLE-3 draft on
those lines, whatever the ids: the engine facts generated from the wheels,
:mod:`eagle_capture.layer_ids.engine_facts`), CANNOT LOAD (no class for the draft's format in that
engine), AMBIGUOUS
(right under one reading of the ids, wrong under another), UNVERIFIED (no ids and
no trainer default known) or ASSUMED (right under a rule that was not read).
vLLM's V1 runner, when its default V2 reads other ids, is shown and decides only
with ``--vllm-runner v1``.

Exit status: 0 OK on every engine asked; 1 any other verdict; 2 unusable input
(an unreadable, binary or malformed config, a hub id where a path is expected, a
target config passed as the draft's or the reverse, a version older than every
line read, a --write-config no single id list can satisfy).

Acceptance figures quoted in verdicts are field reports, not laws: an embedding
capture added to a draft trained without it took acceptance from ~47% to ~19%
(the case this project started from); a draft without ids served with an
engine's defaults ran at 1.2% instead of 58.9% (vLLM issue 50170).
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Callable, Optional, Sequence

from eagle_capture.layer_ids import capture_only, deployment
from eagle_capture.layer_ids.deployment import wrap as _wrap
from eagle_capture.layer_ids.diagnosis import (
    ConfigEdit,
    Diagnosis,
    LineVerdict,
    diagnose,
    load_edit,
)
from eagle_capture.layer_ids.lines import (
    IDS_KEY,
    CapturePlanError,
    DraftIds,
    VLLMLine,
    check_id_range,
    read_draft_ids,
    read_target,
)
from eagle_capture.layer_ids.trainers import (
    CONVENTIONS,
    RECORD_KEY,
    RECORD_LAYERS,
    Provenance,
    defaults_accepted,
    recognise,
)

__all__ = ["as_json", "build_parser", "load_edits", "main", "single_fix", "write_config"]


def _engines(text: str) -> tuple[str, ...]:
    engines = tuple(dict.fromkeys(e.strip().lower() for e in text.split(",") if e.strip()))
    if not engines or any(e not in ("sglang", "vllm") for e in engines):
        raise argparse.ArgumentTypeError(f"expected sglang, vllm or sglang,vllm, got {text!r}")
    return engines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eagle-capture doctor",
        description="What SGLang and vLLM will capture for an EAGLE-3 draft, per release line, "
        "runner and deployment, and whether it is what the draft was trained on "
        "(read in its trainer's convention).",
    )
    p.add_argument(
        "--draft-config", required=True, help="the draft's config.json, or its model folder"
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--target-config",
        help="the target's config.json or model folder (layer count, hidden "
        "size, architecture; Kimi-K2.5: its text_config)",
    )
    target.add_argument(
        "--num-layers", type=int, help="the target's num_hidden_layers (Kimi-K2 / DeepSeek-V3: 61)"
    )
    p.add_argument(
        "--target-architecture",
        help="the target's architecture (e.g. LlamaForCausalLM), when it is given "
        "by --num-layers: its model's own id rule applies (default: from "
        "--target-config; none: DeepseekV2's, said in a note)",
    )
    p.add_argument(
        "--engine",
        type=_engines,
        default=None,
        help="the serving engines to answer for: sglang, vllm or sglang,vllm "
        "(default: both, or the one --capture names)",
    )
    p.add_argument(
        "--id-convention",
        choices=CONVENTIONS,
        default="auto",
        help="how the draft's ids name layers: auto (from the trainer's markers in "
        "the config; default), output (id X = the output of layer X, as "
        "SpecForge writes them) or input (id X = the input of layer X, vLLM's "
        "own rule)",
    )
    p.add_argument("--sglang-version", help="only this SGLang version's line (default: all)")
    p.add_argument(
        "--accept-defaults",
        action="store_true",
        help="a config without ids is fine: the draft was trained on SGLang's defaults",
    )
    p.add_argument(
        "--allow-embedding",
        action="store_true",
        help="the draft really was trained on the embedding output (id -1)",
    )
    p.add_argument(
        "--vllm-runner",
        choices=("v1", "v2"),
        help="the vLLM model runner you serve with (default: V2, vLLM's own default "
        "and 0.34's only one; the V1 runner of 0.32 - 0.33 is then shown "
        "without deciding the verdict)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="the reasoning behind each answer: the id rule read per line, every "
        "slot, the deployment's rows and what each rests on (default: the "
        "short answer)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the answer as one JSON object (verdict per engine, lines, fixes)",
    )
    p.add_argument(
        "--write-config",
        metavar="PATH",
        help="with one --engine: write the draft config to PATH with the fix applied: "
        "the ids in the field that engine reads, and the edit that lets it load the "
        "draft where the config is what stops it (nothing else changed)",
    )
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
            header.append(
                f"target: {target.source} ({named}, {target.num_layers} layers, "
                f"hidden size {target.hidden_size})"
            )
        else:
            num_layers = args.num_layers
        if args.target_architecture:
            if architecture and architecture != args.target_architecture:
                raise CapturePlanError(
                    f"--target-architecture {args.target_architecture} "
                    f"contradicts the target config's {architecture}"
                )
            architecture = args.target_architecture
        capture, named = deployment.CAPTURES[args.capture or "engine"]
        engines = args.engine or ((named,) if named else ("sglang", "vllm"))
        if named and engines != (named,):
            raise CapturePlanError(
                f"--capture {args.capture} is {named}'s capture: it does not "
                f"apply to --engine {','.join(engines)}"
            )
        if args.return_aux_ids is not None and capture != "return-aux":
            raise CapturePlanError(
                "--return-aux-hidden-state-layer-ids is the capture-only "
                "mode's: pass --capture return-aux with it"
            )
        if capture == "return-aux" and args.write_config:
            raise CapturePlanError(
                f"--write-config: the capture-only mode reads its ids from "
                f"SGLang's command line ({capture_only.IDS_FLAG}), not the "
                f"draft config: pass the ids the answer names there"
            )
        if args.sglang_version and "sglang" not in engines:
            raise CapturePlanError("--sglang-version does not apply to --engine vllm")
        if args.vllm_runner and "vllm" not in engines:
            raise CapturePlanError("--vllm-runner does not apply to --engine sglang")
        if args.write_config and len(engines) != 1:
            raise CapturePlanError(
                "--write-config needs one engine: --engine sglang or "
                "--engine vllm (each reads the ids in its own field)"
            )
        check_id_range(draft, num_layers)
        provenance = recognise(draft, num_layers, architecture, args.id_convention)
        if args.accept_defaults:
            provenance = defaults_accepted(provenance, num_layers)

        def judge(engine: str, draft: DraftIds, provenance: Optional[Provenance]) -> Diagnosis:
            return diagnose(
                VLLMLine().read_ids(draft)
                if engine == "vllm"
                else args.return_aux_ids
                if capture == "return-aux"
                else draft.read_by_target,
                num_layers,
                sglang_version=args.sglang_version,
                accept_defaults=args.accept_defaults,
                allow_embedding=args.allow_embedding,
                draft=draft,
                deploy=deployment.from_arguments(args, architecture),
                engine=engine,
                convention=args.id_convention,
                architecture=architecture,
                provenance=provenance,
                vllm_runner=args.vllm_runner if engine == "vllm" else None,
                capture=capture,
            )

        diagnoses = [judge(engine, draft, provenance) for engine in engines]
        code = 0 if all(d.exit_ok for d in diagnoses) else 1
        written = (
            write_config(
                draft,
                diagnoses[0],
                args.write_config,
                # the edited config judged again, read as the draft was trained (its provenance)
                lambda edited: judge(engines[0], edited, provenance),
            )
            if args.write_config
            else None
        )
    except CapturePlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        return _emit(
            json.dumps(as_json(draft, provenance, diagnoses, code, written), indent=2), code
        )
    out = ["summary: " + "; ".join(d.summary() for d in diagnoses) + f" (exit {code})"]
    out += [_wrap(h, "", "  ") for h in header]
    if args.explain:
        out.append(_wrap(provenance.describe(), "", "  "))
        for diagnosis in diagnoses:
            out += ["", diagnosis.format(with_provenance=False)]
    else:
        embedding = (
            f"; id {min(provenance.ids)} names the embedding output, which drafts are rarely "
            f"trained on (the ids were probably edited): `eagle-capture probe` measures the "
            f"layers it was trained on"
            if provenance.names_embedding and not args.allow_embedding
            else ""
        )
        out.append(_wrap(provenance.brief() + embedding, "", "  "))
        for diagnosis in diagnoses:
            out += [diagnosis.brief()]
        out.append("(why, slot by slot, and what each answer rests on: --explain)")
    if written:
        out += ["", _wrap(written, "", "  ")]
    return _emit("\n".join(out), code)


def _emit(text: str, code: int) -> int:
    """Print the answer; a reader that stops early (``| head``) ends it quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def single_fix(diagnosis: Diagnosis) -> Optional[list[int]]:
    """The one id list that fixes every decisive line of ``diagnosis``; None when
    nothing needs fixing. Refused (CapturePlanError) when no single list can."""
    kind = diagnosis.verdict_class
    if kind in ("OK", "ASSUMED"):
        return None
    if kind in ("AMBIGUOUS", "UNVERIFIED"):
        raise CapturePlanError(
            f"--write-config: the verdict is {kind}: which layers the draft "
            f"was trained on is not known (measure them with `eagle-capture "
            f"probe`, or pass --id-convention), so no fix can be written"
        )
    # The written ids must serve every line that decides, the right ones included.
    fixes = {tuple(v.fix_ids) if v.fix_ids else None for v in diagnosis.verdicts if v.decides}
    trained = diagnosis.provenance.readings[0].expected if diagnosis.provenance else None
    twice = sorted({c for c in trained or () if list(trained).count(c) > 1})
    if None in fixes and twice:
        raise CapturePlanError(
            f"--write-config: the draft's ids name capture layer(s) {twice} "
            f"twice; every engine captures a layer once, so the draft would "
            f"get fewer states than its fc expects whatever ids are written. "
            f"It needs {len(trained)} distinct layers: the ones it was "
            f"trained on (`eagle-capture probe` measures them)"
        )
    if None in fixes:
        raise CapturePlanError(_no_id_fix(diagnosis, trained, fixes - {None}))
    if len(fixes) > 1:
        raise CapturePlanError(
            f"--write-config: the {diagnosis.engine_name} lines need different "
            f"ids ({', '.join(str(list(f)) for f in sorted(fixes))}); pass "
            f"--sglang-version to choose the release you serve with"
        )
    return list(fixes.pop())


def _no_id_fix(diagnosis: Diagnosis, trained, fixable: set) -> str:
    """Why no id list can be written: the draft's layers include the embedding (its
    ids are the likelier error), or which lines no ids fix, and why."""
    stuck = [v for v in diagnosis.verdicts if v.decides and not v.fix_ids]
    if trained and 0 in trained and any(v.fix is None and not v.status for v in stuck):
        # diagnose_line writes no fix for a draft read as trained on the embedding
        # unless --allow-embedding says it was.
        return (
            "--write-config: the draft's ids name the embedding output (capture layer 0), "
            "which drafts are rarely trained on (the ids were probably edited): measure "
            "the layers it was trained on with `eagle-capture probe`; pass "
            "--allow-embedding only if it was trained on the embedding"
        )
    why = "; ".join(
        f"{v.line.title}: "
        f"{v.status or v.brief or 'no ids make it capture the layers the draft was trained on'}"
        for v in stuck
    )
    also = (
        "; pass --sglang-version to write the ids for a release whose line they fix"
        if fixable and diagnosis.engine == "sglang"
        else ""
    )
    return f"--write-config: no id list fixes this draft on {diagnosis.engine_name} ({why}){also}"


def load_edits(draft: DraftIds, diagnosis: Diagnosis) -> list[ConfigEdit]:
    """The config edits (not ids) that let the lines that cannot load the draft load it:
    one edit shared by every such line that decides, else none (nothing to apply)."""
    failing = [v for v in diagnosis.verdicts if v.decides and v.status == "CANNOT LOAD"]
    edits = [load_edit(diagnosis.engine, draft, v.line) for v in failing]
    if not edits or None in edits or len(set(map(repr, edits))) > 1:
        return []
    return [edits[0]]


def write_config(
    draft: DraftIds,
    diagnosis: Diagnosis,
    path: str,
    judge: Optional[Callable[[DraftIds], Diagnosis]] = None,
) -> str:
    """Write the draft's config with the fix: the config edit that lets the engine load
    it (:func:`load_edits`; the edited config then ``judge``-d again), and the ids in the
    field ``diagnosis``'s engine reads (SGLang: eagle_config's; vLLM: the top-level key);
    what was done, in words."""
    config = json.loads(json.dumps(draft.raw))
    done = []
    edits = load_edits(draft, diagnosis) if judge is not None else []
    for edit in edits:
        holder = config
        for key in edit.keys[:-1]:
            holder = holder.setdefault(key, {})
        holder[edit.keys[-1]] = edit.value
        done.append(f"{'.'.join(edit.keys)} = {json.dumps(edit.value)}")
    if edits:
        edited = read_draft_ids(config)
        diagnosis = judge(replace(edited, source=draft.source))
    ids = single_fix(diagnosis)
    reading = diagnosis.provenance.readings[0]
    if ids is not None:
        if diagnosis.engine == "vllm":
            config[IDS_KEY] = ids
            done.append(f"top-level {IDS_KEY} = {ids}")
        else:
            eagle = config.get("eagle_config")
            config["eagle_config"] = dict(eagle or {}, **{IDS_KEY: ids})
            done.append(f"eagle_config.{IDS_KEY} = {ids}")
    if (ids is not None or edits) and reading.expected is not None:
        # The new ids follow one engine line's rule, and an edited config may no longer
        # carry the trainer's markers: record what they were written for, so that the
        # doctor (and the probe) read this file back the same way.
        lines = [v.line.title for v in diagnosis.verdicts if v.decides]
        config[RECORD_KEY] = {
            RECORD_LAYERS: list(reading.expected),
            "read_as": reading.label,
            "ids_written_for": f"{diagnosis.engine_name} {', '.join(lines)}",
        }
        done.append(f"{RECORD_KEY}.{RECORD_LAYERS} = {list(reading.expected)} recorded")
    what = "; ".join(done) or "nothing to fix: the config is written unchanged"
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise CapturePlanError(f"--write-config: cannot write {path}: {e.strerror or e}") from None
    return f"wrote {path} for {diagnosis.engine_name}: {what}"


def as_json(
    draft: DraftIds, provenance: Provenance, diagnoses: list, code: int, written: Optional[str]
) -> dict:
    """The answer as data (``--json``)."""

    def line(v: LineVerdict) -> dict:
        return {
            "line": v.line.title,
            "ids_read": v.ids,
            "capture_layers": v.capture_layers,
            "status": v.status or ("OK" if v.ok else "PROBLEM"),
            "decides": v.decides,
            "detail": v.lines,
            "fix": v.fix_ids if not v.ok else None,
        }

    return {
        "exit": code,
        "draft": draft.source,
        "capture": diagnoses[0].capture if diagnoses else "engine",
        "trainer": provenance.trainer or None,
        "ids": provenance.ids,
        "readings": [
            {
                "label": r.label,
                "why": r.why,
                "trained_capture_layers": None if r.expected is None else list(r.expected),
            }
            for r in provenance.readings
        ],
        "engines": {
            d.engine: {
                "verdict": d.verdict_class,
                "text": d._verdict(),
                "notes": d.notes,
                "readings": [
                    {"reading": r.label if r else None, "lines": [line(v) for v in vs]}
                    for r, vs in (d.by_reading or [(None, d.verdicts)])
                ],
                "deployment": d.deployment,
            }
            for d in diagnoses
        },
        "written": written,
    }


if __name__ == "__main__":
    sys.exit(main())
