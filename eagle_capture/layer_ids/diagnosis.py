"""The layer-id doctor's library: what SGLang and vLLM feed an EAGLE-3 draft, per
release line, runner and deployment, and whether it is what the draft was trained on.

:func:`diagnose` answers for one engine (a :class:`Diagnosis`: a verdict per line,
the deployment's rows, notes); :func:`diagnose_line` for one line; :func:`fix_ids` the
ids that make a line capture the layers the draft wants; :func:`cannot_load`,
:func:`target_cannot_capture` and :func:`model_lines` the per-model facts (from the
engine facts generated from the wheels, :mod:`.engine_facts`). The probe and the
plugins import this module; the doctor's command line (arguments, printing,
``--write-config``, ``--json``) is :mod:`.doctor`.
"""

import itertools
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from eagle_capture.layer_ids import capture_only, deployment, engine_facts, tensors
from eagle_capture.layer_ids.deployment import WIDTH
from eagle_capture.layer_ids.deployment import wrap as _wrap
from eagle_capture.layer_ids.lines import (
    SGLANG_LINES,
    VLLM_LINE,
    CapturePlanError,
    DraftIds,
    SGLangLine,
    assumed_note,
    default_capture_layers,
    draft_architectures,
    line_of,
    parse_version,
    specforge_default_ids,
    vllm_lines,
)
from eagle_capture.layer_ids.rules import SHIFT_ALWAYS, ModelRule, model_rule_of
from eagle_capture.layer_ids.startup import slot_order_problem
from eagle_capture.layer_ids.trainers import (
    CONVENTIONS,
    Provenance,
    Reading,
    defaults_accepted,
    recognise,
)

__all__ = [
    "CannotCapture",
    "Diagnosis",
    "LineVerdict",
    "cannot_load",
    "diagnose",
    "diagnose_line",
    "fix_ids",
    "model_lines",
    "target_cannot_capture",
    "wrong_tensor",
]


def _source(input_layer: int, num_layers: int = 0) -> str:
    """A capture at the start of ``input_layer`` in words, both conventions."""
    if input_layer == 0:
        return "embedding output (input to layer 0, HF hidden_states[0])"
    if input_layer == num_layers:
        return f"output of layer {input_layer - 1} (the last layer, before the final norm)"
    return (
        f"output of layer {input_layer - 1} (input to layer {input_layer}, "
        f"HF hidden_states[{input_layer}])"
    )


def _capturable(line, num_layers: int) -> int:
    """One past the largest capture layer ``line`` can take (vLLM: the last
    layer's output too)."""
    return num_layers + (1 if getattr(line, "last_layer_capturable", False) else 0)


def fix_ids(
    line: SGLangLine, want: Sequence[int], num_layers: int, allow_embedding: bool = False
) -> Optional[list[int]]:
    """Draft-config ids for which ``line`` captures exactly the layers ``want``
    (SGLang's capture layers, slots in ascending order), or None if none can:
    the output-convention ids, else the input-convention ones, in ascending
    order first (``ids[0]`` decides 0.5.13+'s +1, so the order matters)."""
    want = sorted(want)
    # A layer wanted twice: every line captures a layer once, so no ids fill both slots.
    if (
        len(set(want)) != len(want)
        or any(not 0 <= w < _capturable(line, num_layers) for w in want)
        or (0 in want and not allow_embedding)
    ):
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
    ids: Optional[list[int]] = None  # the ids this line reads
    fix_ids: Optional[list[int]] = None  # the ids the fix writes
    status: str = ""  # not decided by the slots (CANNOT LOAD, CANNOT CAPTURE)
    decides: bool = True  # False: a non-default runner, shown only
    brief: str = ""  # the cause in a few words, for the short answer


_FROM_TRAINED = object()


def diagnose_line(
    line: SGLangLine,
    ids: Optional[Sequence[int]],
    num_layers: int,
    allow_embedding: bool = False,
    trained: Optional[Sequence[int]] = None,
    convention: str = "output",
    expected=_FROM_TRAINED,
) -> LineVerdict:
    """What ``line`` captures for the ``ids`` it reads (None: absent) and whether
    it matches what the draft was trained on: ``expected`` capture layers (None:
    unknown), else ``trained`` ids in ``convention`` (default: ``ids``)."""
    capture = line.capture_layers(ids, num_layers)
    if expected is _FROM_TRAINED:
        trained = ids if trained is None else trained
        # Output convention (SpecForge): id X = output of layer X = the capture at
        # the start of layer X + 1; input convention: id X = the input of layer X.
        shift = 1 if convention == "output" else 0
        expected = None if trained is None else sorted(i + shift for i in trained)
    else:
        expected = None if expected is None else sorted(expected)
    verdict = LineVerdict(line, capture, True, [], ids=None if ids is None else list(ids))

    def problem(text: str) -> LineVerdict:
        verdict.ok = False
        verdict.lines.append(text)
        return verdict

    if expected is not None and not (0 in expected and not allow_embedding):
        fixed = fix_ids(line, expected, num_layers, allow_embedding)
        key = (
            "eagle_aux_hidden_state_layer_ids at the config's top level (vLLM's runners read "
            "it first; its default GPU runner reads no other key)"
            if line.engine == "vLLM"
            else "eagle_config.eagle_aux_hidden_state_layer_ids"
        )
        verdict.fix = f"{key} = {fixed}" if fixed else "no ids make this line capture those layers"
        verdict.fix_ids = fixed
    if 0 in capture and line.layer0 == "crash":
        return problem(
            "FAILS at the first forward: layer 0 is captured and this line's loop "
            "computes hidden_states + residual there, with residual None (TypeError)"
        )
    invalid = [layer for layer in capture if not 0 <= layer < _capturable(line, num_layers)]
    duplicates = sorted({layer for layer in capture if capture.count(layer) > 1})
    taken = len(set(capture) - set(invalid))
    if invalid or duplicates:
        what = (
            f"layer(s) {invalid} do not exist"
            if invalid
            else f"layer(s) {duplicates} are named twice (duplicate ids)"
        )
        if line.missing_capture == "dropped":
            return problem(
                f"{what}: the loop captures each existing layer once, without an error, "
                f"and hands the draft {taken} of {len(capture)} slots ([T, {taken}*H]); "
                f"the draft's fc, sized for {len(capture)}, FAILS at its first forward "
                f"(RuntimeError)"
            )
        if line.engine == "vLLM":
            return problem(
                f"FAILS at the first forward: {what}, the loop captures each "
                f"existing layer once and the draft's fc, sized for {len(capture)}, "
                f"gets {taken} (RuntimeError)"
            )
        return problem(
            f"FAILS at the first forward: {what}, the packer gets {taken} of "
            f"{len(capture)} captures (RuntimeError)"
        )
    for slot, got in enumerate(sorted(capture)):
        text = f"slot {slot}: {line.engine} captures the {_source(got, num_layers)}"
        if expected is None:
            verdict.lines.append(text + "; the draft's layers are unknown (no ids)")
            continue
        want = expected[slot] if slot < len(expected) else None
        if want is None:
            problem(text + "; the draft has no slot for it: MISMATCH")
        elif got != want:
            problem(
                text + f"; the draft expects the {_source(want, num_layers)}: MISMATCH, "
                f"expect acceptance to collapse"
            )
        elif got == 0 and not allow_embedding:
            problem(
                text + "; the draft asks for it (id -1), but no SpecForge draft is trained "
                "on the embedding (field report: ~47% -> ~19% acceptance when it was "
                "added); --allow-embedding only if yours was"
            )
        else:
            verdict.lines.append(text + ": matches")
    if expected is not None and len(expected) != len(capture):
        problem(
            f"the draft was trained on {len(expected)} layers, {line.engine} captures "
            f"{len(capture)}: its fc expects another width"
        )
    return verdict


@dataclass
class Diagnosis:
    draft: Optional[DraftIds]
    ids: Optional[list[int]]  # what the engine reads (vLLM: its first runner)
    num_layers: int
    verdicts: list[LineVerdict]  # under the first reading
    notes: list[str]
    ok: bool
    deployment: list[str] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    engine: str = "sglang"
    convention: str = "output"
    provenance: Optional[Provenance] = None
    # every reading of the draft's ids with its verdicts (more than one: ambiguous)
    by_reading: list = field(default_factory=list)
    assumed: bool = False  # a rule the answer rests on was not read
    accepted: bool = False  # --accept-defaults
    deployment_ok: bool = True  # no PROBLEM row in the deployment's report
    deployment_brief: list = field(default_factory=list)  # its PROBLEM rows, one line each
    capture: str = "engine"  # how the server captures (deployment.CAPTURES)

    @property
    def unknown(self) -> bool:
        """The draft's layers are not known (no ids, no trainer default)."""
        if self.by_reading:
            return all(r is not None and r.expected is None for r, _ in self.by_reading)
        return self.ids is None

    @property
    def verdict_class(self) -> str:
        """One word per engine: OK, PROBLEM, CANNOT CAPTURE, CANNOT LOAD, AMBIGUOUS,
        UNVERIFIED or ASSUMED (exit 0 only for OK)."""
        decisive = [
            v for _, vs in (self.by_reading or [(None, self.verdicts)]) for v in vs if v.decides
        ]
        if decisive and all(v.status == "CANNOT CAPTURE" for v in decisive):
            return "CANNOT CAPTURE"  # the target's class, on every line (some only: PROBLEM)
        if decisive and all(v.status == "CANNOT LOAD" for v in decisive):
            return "CANNOT LOAD"  # (on some lines only: a PROBLEM there, below)
        if self.ok:
            return "ASSUMED" if self.assumed else "OK"
        if len(self.by_reading) > 1 and any(v.ok for v in self.by_reading_decisive()):
            return "AMBIGUOUS"
        if self.unknown and all(v.ok for v in decisive) and self.deployment_ok:
            return "UNVERIFIED"
        return "PROBLEM"

    def by_reading_decisive(self):
        return [v for _, vs in self.by_reading for v in vs if v.decides]

    @property
    def exit_ok(self) -> bool:
        return self.verdict_class == "OK"

    @property
    def engine_name(self) -> str:
        return "vLLM" if self.engine == "vllm" else "SGLang"

    def format(self, with_provenance: bool = True) -> str:
        out = [_wrap(h, "", "  ") for h in self.header]
        if with_provenance and self.provenance is not None:
            out.append(_wrap(self.provenance.describe(), "", "  "))
        out.append(_wrap(self._reads(), "", "  "))
        out += [_wrap(f"note: {n}", "", "      ") for n in self.notes]
        readings = self.by_reading or [(None, self.verdicts)]
        for reading, verdicts in readings:
            indent = ""
            if len(readings) > 1:
                out.append(
                    _wrap(
                        f"if the draft was trained in the {reading.label} ({reading.why}):"
                        if reading.why
                        else f"if the draft was trained in the {reading.label}:",
                        "",
                        "  ",
                    )
                )
                indent = "  "
            for v in verdicts:
                out += self._line(v, indent)
        out += self.deployment
        out.append(_wrap(f"verdict ({self.engine_name}): " + self._verdict(), "", "  "))
        return "\n".join(out)

    def brief(self) -> str:
        """The short answer: per line, what it captures and whether that is what the
        draft was trained on (per reading where ambiguous), the fix; the deployment's
        problems; the verdict. ``format`` holds the reasoning (``--explain``)."""
        out = [_wrap(self._reads(), "", "  ")]
        readings = self.by_reading or [(None, self.verdicts)]
        for i, v in enumerate(readings[0][1]):
            title = v.line.title
            answers = [self._brief_answer(vs[i]) for _, vs in readings]
            if len(readings) > 1 and len(set(answers)) > 1:
                answer = "; ".join(
                    f"if {_short_label(r)}: {a}" for (r, _), a in zip(readings, answers)
                )
            else:
                answer = answers[0]
            shown = "" if v.decides else " (shown; decides with --vllm-runner v1)"
            captures = (
                ""
                if v.status in ("CANNOT CAPTURE", "CANNOT LOAD")
                else f" captures {v.capture_layers}:"
            )
            out.append(_wrap(f"{title}{shown}:{captures} {answer}", "  ", "    "))
        if self.deployment_brief:
            out += self.deployment_brief
        out.append(_wrap(f"verdict ({self.engine_name}): " + self._verdict(), "", "  "))
        return "\n".join(out)

    def _brief_answer(self, v: LineVerdict) -> str:
        status = v.status or ("PROBLEM" if not v.ok else "UNVERIFIED" if self.unknown else "OK")
        if v.ok:
            return status
        if v.brief:
            remedy = (
                f" -> {v.fix}"
                if v.status in ("CANNOT CAPTURE", "CANNOT LOAD")
                or (self.capture == "return-aux" and v.fix_ids)
                else ""
            )
            return f"{status} ({v.brief}){remedy}"
        problems = [t for t in v.lines if not t.endswith((": matches", "(no ids)"))]
        why = problems[0] if problems else ""
        if any("MISMATCH" in t for t in problems):
            why = ""  # wrong slots: the ids to write say it all
        elif len(why) > 90:
            why = why[: why.find(":", 20) if ":" in why[20:] else 90].rstrip(" ,;")
        fix = (
            f" -> {v.fix}"
            if v.status == "CANNOT LOAD" and v.fix
            else ""
            if not v.fix_ids
            else (f" -> {v.fix}" if self.capture == "return-aux" else f" -> write {v.fix_ids}")
        )
        return f"{status}{f' ({why})' if why else ''}{fix}"

    def _reads(self) -> str:
        target = f"target: {self.num_layers} layers"
        if self.capture == "return-aux":
            given = "absent (the model's defaults)" if self.ids is None else str(self.ids)
            return (
                f"SGLang's capture-only mode ({capture_only.FLAG}) reads "
                f"{capture_only.IDS_FLAG} from its command line: {given}, never the draft "
                f"config; {target}"
            )
        if self.engine == "vllm":
            lines = self.verdicts
            if len(lines) == 1:
                return f"vLLM reads {lines[0].line.reads()}: {self._ids(lines[0].ids)}; {target}"
            return (
                "vLLM's runners read different ids here: "
                + "; ".join(
                    f"{v.line.runner} ({v.line.reads()}): {self._ids(v.ids)}" for v in lines
                )
                + f"; {target}"
            )
        return (
            f"SGLang's target reads eagle_config.eagle_aux_hidden_state_layer_ids: "
            f"{self._ids(self.ids)}; {target}"
        )

    @staticmethod
    def _ids(ids) -> str:
        return "none (field absent)" if ids is None else str(ids)

    def _line(self, v: LineVerdict, indent: str) -> list[str]:
        status = v.status or (
            "PROBLEM"
            if not v.ok
            else "UNVERIFIED (the draft's layers are unknown)"
            if self.unknown
            else "OK"
        )
        title = v.line.title
        out = [
            _wrap(
                f"{v.line.engine} {title} (read from {', '.join(v.line.read_versions)}):",
                indent,
                indent + "  ",
            )
        ]
        name = "aux_hidden_state_layers" if v.line.engine == "vLLM" else "layers_to_capture"
        if v.status == "CANNOT LOAD":  # the capture is never set up: nothing to show
            out.append(f"{indent}  {name}: not reached (the draft does not load) -> {status}")
        else:
            out.append(f"{indent}  {name} = {v.capture_layers} -> {status}")
        if not v.decides:
            out.append(
                _wrap(
                    "(not vLLM's default runner: shown, and decides the verdict only "
                    "for a server run with it: --vllm-runner v1)",
                    indent + "    ",
                    indent + "      ",
                )
            )
        out += [_wrap(text, indent + "    ", indent + "      ") for text in v.lines]
        # (a line that cannot capture or load says its remedy in its text)
        if not v.ok and v.fix and v.status not in ("CANNOT CAPTURE", "CANNOT LOAD"):
            out.append(_wrap(f"fix for this line: {v.fix}", indent + "    ", indent + "      "))
        return out

    def _verdict(self) -> str:
        kind = self.verdict_class
        if kind == "CANNOT CAPTURE":
            remedy = next(
                v.fix for _, vs in self.by_reading for v in vs if v.status == "CANNOT CAPTURE"
            )
            return (
                f"CANNOT CAPTURE: {self.engine_name}'s class for this target cannot feed an "
                f"EAGLE-3 draft on the lines shown, whatever the ids; {remedy}"
            )
        if kind == "CANNOT LOAD":
            return f"CANNOT LOAD: {self.engine_name} cannot load this draft (above)"
        if kind == "AMBIGUOUS" and self.provenance is not None and self.provenance.ids is None:
            return (
                "AMBIGUOUS: the config names no ids, and the runs that write none trained on "
                "different layers (each reading above); measure them with `eagle-capture "
                "probe`, or pass --accept-defaults if it was trained on the engines' defaults "
                "(exit 1 until then)"
            )
        if kind == "AMBIGUOUS":
            return (
                "AMBIGUOUS: what the draft receives is right or wrong depending on how "
                "its ids were meant (each reading above); measure it with `eagle-capture "
                "probe`, or pass --id-convention output|input if you know (exit 1 until then)"
            )
        if kind == "UNVERIFIED":
            return (
                "UNVERIFIED: the draft's layers cannot be known from its config; measure "
                "them with `eagle-capture probe`, or pass --accept-defaults if it was "
                "trained on the layers above"
            )
        if kind == "PROBLEM":
            return "problems above; do not serve this as is"
        said = (
            "accepted (--accept-defaults): the draft is taken to be trained on these"
            if self.unknown and self.accepted
            else "every line shown feeds the draft what it was trained on"
        )
        if self.capture == "eagle-capture":
            manual = any(
                v.line.engine == "SGLang" and v.line.first < (0, 5, 13) for v in self.verdicts
            )
            said += (
                " with eagle-capture's capture switched on (EAGLE_CAPTURE=1 in the "
                "server's environment"
                + (
                    "; SGLang 0.5.9 - 0.5.12: install_eagle3_capture called in your launcher)"
                    if manual
                    else ")"
                )
            )
        elif self.capture == "return-aux":
            said += f" in SGLang's capture-only mode ({capture_only.FLAG})"
        if any(not v.ok and not v.decides for _, vs in self.by_reading for v in vs):
            said = (
                "vLLM's default runner (V2) feeds the draft what it was trained on; the V1 "
                "runner of 0.32 - 0.33 would not (above): pass --vllm-runner v1 if you serve "
                "with it"
            )
        if kind == "ASSUMED":
            return (
                f"ASSUMED: {said}, under the assumption in the notes (a rule not read for "
                f"this target or release); exit 1 until --target-config or "
                f"--target-architecture names a model whose rule was read"
            )
        return said

    def summary(self) -> str:
        """One line: the engine and its verdict word."""
        return f"{self.engine_name}: {self.verdict_class}"

    @property
    def draft_trained(self) -> Optional[list[int]]:
        if self.provenance is not None:
            return self.provenance.ids
        return self.draft.trained if self.draft is not None else self.ids


def diagnose(
    ids: Optional[Sequence[int]],
    num_layers: int,
    *,
    sglang_version: Optional[str] = None,
    accept_defaults: bool = False,
    allow_embedding: bool = False,
    draft: Optional[DraftIds] = None,
    deploy: Optional["deployment.Deployment"] = None,
    engine: str = "sglang",
    convention: str = "output",
    architecture: str = "",
    provenance: Optional[Provenance] = None,
    vllm_runner: Optional[str] = None,
    capture: str = "engine",
) -> Diagnosis:
    """Diagnose a draft against every SGLang line (or only the one
    ``sglang_version`` belongs to), or ``engine="vllm"``: vLLM's runners.
    ``ids``: what the engine reads (None: absent); ``draft`` (from
    :func:`read_draft_ids`): the whole config, read per line where that line
    reads and recognised for its trainer; ``deploy`` the deployment;
    ``convention``: how the draft's ids name layers ("output": id X = the output of
    layer X, SpecForge's; "input": id X = the input of layer X; "auto": from the
    trainer's markers, :mod:`eagle_capture.layer_ids.trainers`); ``provenance``
    overrides the reading; ``architecture``: the target's (its model class's own
    id rule, :mod:`eagle_capture.layer_ids.rules`; empty: DeepseekV2's, said);
    ``capture``: "return-aux" for SGLang's capture-only mode (:mod:`.capture_only`),
    ``ids`` then its command line's ids, the draft's layers still its config's."""
    if engine not in ("sglang", "vllm"):
        raise CapturePlanError(f"engine must be sglang or vllm, got {engine!r}")
    if convention not in CONVENTIONS:
        raise CapturePlanError(f"convention must be output or input (or auto), got {convention!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 4:
        raise CapturePlanError(f"num_layers must be an int >= 4, got {num_layers!r}")
    if ids is not None:
        ids = list(ids)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CapturePlanError(
                f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}"
            )
    notes, ok = [], True
    assumed = False
    if engine == "vllm":
        lines = vllm_lines(draft)
        if vllm_runner:  # the runner the user serves with: only that one
            lines = [line for line in lines if line.runner in (vllm_runner.upper(), "V1 and V2")]
        fallback = vllm_fallback_note(architecture)
        if fallback:
            notes.append(fallback)
    else:
        if capture == "return-aux":
            lines = [capture_only.line_for(sglang_version)]
        else:
            lines = [line_of(sglang_version)] if sglang_version else list(SGLANG_LINES)
        lines, model_notes = model_lines(lines, architecture, sglang_version)
        notes += model_notes
        assumed = not architecture or any("ASSUMES" in n for n in model_notes)
    if engine == "sglang" and sglang_version and assumed_note(sglang_version):
        notes.append(assumed_note(sglang_version))
        assumed = True
    aux_only = capture == "return-aux"
    if aux_only and engine != "sglang":
        raise CapturePlanError(
            f"--capture return-aux is SGLang's capture-only mode "
            f"({capture_only.FLAG}, 0.5.23 on): vLLM has none"
        )
    line_ids = [
        (line.read_ids(draft) if engine == "vllm" and draft is not None else ids) for line in lines
    ]
    if provenance is None:
        bare = draft if draft is not None else DraftIds(ids, None, "", "the ids given")
        provenance = recognise(bare, num_layers, architecture, convention)
    if accept_defaults:
        provenance = defaults_accepted(provenance, num_layers)
    notes += list(provenance.notes)
    trained = provenance.ids
    if (
        engine == "vllm"
        and not architecture
        and provenance.trainer == "SpecForge"
        and trained
        and provenance.decided_by == "markers"
    ):
        assumed = True  # SpecForge's history was read with DeepseekV2's rule
    config_problems = []
    if trained == [] or ids == []:
        config_problems.append(
            "the draft config's id list is empty: SGLang then captures no layer (the draft "
            "gets no aux states), vLLM its defaults; no trainer trains on an empty list "
            "(SpecForge refuses fewer than three ids). Write the ids the draft was trained on"
        )
        provenance = replace(provenance, readings=(Reading("", None),))
    unsorted = slot_order_problem(trained)
    if unsorted:
        config_problems.append(unsorted)
    # Per line (SGLang's registry grew); every line: no id notes either.
    # (the capture-only mode loads no draft)
    cannot_on = [
        None if aux_only else cannot_load(engine, draft, line, sglang_version=sglang_version)
        for line in lines
    ]
    cannot = cannot_on[0] if all(cannot_on) else None
    if cannot:
        pass  # no note on ids for a file this engine cannot load
    elif aux_only:
        notes.append(
            f"SGLang's capture-only mode loads no draft and reads no draft config: it "
            f"hands {capture_only.IDS_FLAG} (absent: None, the model's defaults) to the "
            f"target's set_eagle3_layers_to_capture, the rule a draft's ids get; the "
            f"draft config says only which layers the draft was trained on"
        )
    elif engine == "vllm":
        notes += _vllm_notes(draft, ids, provenance)
    elif draft is not None and draft.nested is None and draft.top_level is not None:
        notes.append(
            f"{draft.source} names eagle_aux_hidden_state_layer_ids {draft.top_level} at its top "
            f"level, outside eagle_config: every SGLang line's target IGNORES it (the model "
            f"runner reads only eagle_config[...]) and captures its defaults "
            f"{default_capture_layers(num_layers)}, while a draft class that reads either key "
            f"(SGLang's own Kimi-K2.5 EAGLE-3 draft does) was set up for these ids. "
            + _nested_fix(lines, provenance, num_layers, allow_embedding)
        )
    elif draft is not None and draft.top_level is not None and draft.top_level != draft.nested:
        notes.append(
            f"{draft.source} also names ids {draft.top_level} at its top level: the "
            f"target reads only eagle_config's {draft.nested}; remove the other"
        )
    # (the ids are then never read; the capture-only mode reads no draft config)
    no_aux = draft is not None and not draft.use_aux and not aux_only
    unknown = all(r.expected is None for r in provenance.readings)
    if unknown and all(i is None for i in line_ids) and not (no_aux or cannot):
        defaults = default_capture_layers(num_layers)
        notes.append(
            f"neither {capture_only.IDS_FLAG} nor the draft config names ids: "
            if aux_only
            else f"the draft config names no eagle_aux_hidden_state_layer_ids: "
            f"{lines[0].engine} captures its "
            f"defaults {defaults} (outputs of layers {[i - 1 for i in defaults]}, SpecForge's "
            f"default too). A draft trained on other layers then fails silently (field report, "
            f"vLLM issue 50170: acceptance 1.2% instead of 58.9%). "
            + (
                f"Pass {capture_only.IDS_FLAG} for the layers the draft was trained on, and write "
                f"them into its config"
                if aux_only
                else "Write the ids the draft was trained on into its config"
            )
            + ("" if accept_defaults else ", or pass --accept-defaults if they are these")
        )
        ok = accept_defaults
    elif (
        trained is not None
        and any(i < 0 for i in trained)
        and any(r.convention == "output" for r in provenance.readings)
    ):
        notes.append(
            f"id {min(trained)} is the embedding output; SpecForge requires "
            f"non-negative ids, so a SpecForge-trained draft never saw it: the config "
            f"was probably edited (SpecForge's default for {num_layers} layers is "
            f"{specforge_default_ids(num_layers)})"
        )
    if trained is not None and len(set(trained)) != len(trained):
        notes.append(
            f"ids {trained} name a layer twice: the draft expects {len(trained)} distinct captures"
        )
    by_reading = []
    for reading in provenance.readings:
        # A reading with no ids and a config that names none: unknown, or the
        # defaults when the user accepts them.
        expected = reading.expected
        by_reading.append(
            (
                reading,
                [
                    diagnose_line(line, lids, num_layers, allow_embedding, expected=expected)
                    for line, lids in zip(lines, line_ids)
                ],
            )
        )
    if cannot:
        config_problems = []
        by_reading = [
            (
                by_reading[0][0],
                [
                    LineVerdict(
                        line,
                        [],
                        False,
                        [text],
                        fix=_load_remedy(engine, draft, line, architecture),
                        ids=lids,
                        status="CANNOT LOAD",
                    )
                    for line, text, lids in zip(lines, cannot_on, line_ids)
                ],
            )
        ]
    elif no_aux:
        config_problems = []
        text = (
            "no aux hidden states: eagle_config.use_aux_hidden_state is false, so "
            f"{lines[0].engine} feeds the draft the target's last hidden state and captures "
            "no layer (its ids are not used); right for a draft trained so (a single-state "
            "head)"
        )
        by_reading = [
            (by_reading[0][0], [LineVerdict(line, [], True, [text], status="OK") for line in lines])
        ]
    elif any(cannot_on):
        by_reading = [
            (
                reading,
                [
                    LineVerdict(
                        v.line,
                        [],
                        False,
                        [text],
                        fix=_load_remedy(engine, draft, v.line, architecture),
                        ids=v.ids,
                        status="CANNOT LOAD",
                    )
                    if text
                    else v
                    for v, text in zip(vs, cannot_on)
                ],
            )
            for reading, vs in by_reading
        ]
    # The target's class itself cannot capture (no draft, no ids change that); a draft
    # that takes no aux states never asks it to.
    capture_on = [
        None if no_aux else target_cannot_capture(engine, line, architecture, sglang_version, draft)
        for line in lines
    ]
    if any(capture_on):
        by_reading = [
            (reading, [_cannot_capture(v, c) for v, c in zip(vs, capture_on)])
            for reading, vs in by_reading
        ]
    # A line measured to capture another tensor than the residual stream: no id fixes it.
    if architecture and not no_aux:
        for line in lines:
            text = wrong_tensor(engine, line, architecture, sglang_version)
            if text is None:
                continue
            for _, vs in by_reading:
                for v in vs:
                    if v.line is line and v.status != "CANNOT CAPTURE":
                        v.ok, v.fix, v.fix_ids = False, text[1], None
                        v.lines.insert(0, text[0])
                        v.brief = text[2]
    for _, vs in by_reading:
        for v in vs:
            if config_problems and v.status != "CANNOT CAPTURE":
                v.ok = False
                v.lines[:0] = config_problems
            # vLLM's V1 runner when V2 (its default) is also shown: reported, not decisive
            v.decides = not (
                engine == "vllm" and not vllm_runner and len(lines) > 1 and v.line.runner == "V1"
            )
            if aux_only and v.status != "CANNOT CAPTURE":
                _capture_only_verdict(v, ids, num_layers, deploy)
    verdicts = by_reading[0][1]
    ok = ok and all(v.ok for _, vs in by_reading for v in vs if v.decides)
    deploy_lines: list[str] = []
    deploy_brief: list[str] = []
    deploy_ok = True
    if deploy is not None:
        # A line where the target's class cannot capture at all, or the draft does not load,
        # has no deployment to assess (its CANNOT CAPTURE / CANNOT LOAD above says so).
        live = [
            (line, v.capture_layers)
            for line, v in zip(lines, verdicts)
            if v.status not in ("CANNOT CAPTURE", "CANNOT LOAD")
        ]
        if engine == "vllm":
            report = deployment.assess_vllm(deploy, live[0][1] if live else [], num_layers)
            if not live:
                report.lines.clear()
        else:
            report = deployment.assess(
                deploy, [line for line, _ in live], [c for _, c in live], num_layers, trained
            )
        deploy_lines = report.format(WIDTH)
        deploy_brief = report.brief()
        deploy_ok = report.ok
        ok = ok and report.ok
    return Diagnosis(
        draft,
        line_ids[0],
        num_layers,
        verdicts,
        notes,
        ok,
        deploy_lines,
        engine=engine,
        convention=provenance.readings[0].convention,
        provenance=provenance,
        by_reading=by_reading,
        assumed=assumed,
        accepted=accept_defaults,
        deployment_ok=deploy_ok,
        deployment_brief=deploy_brief,
        capture=capture,
    )


def wrong_tensor(
    engine: str, line, architecture: str, sglang_version: Optional[str] = None
) -> Optional[tuple[str, str, str]]:
    """(the problem, the remedy, a few words) when ``line``'s capture for ``architecture``
    was measured to hold another tensor than the residual stream (:mod:`.tensors`)."""
    releases = _vllm_releases(line) if engine == "vllm" else _sglang_releases(line, sglang_version)
    bad = tensors.wrong(engine, releases, architecture)
    if not bad:
        return None
    name = "vLLM" if engine == "vllm" else "SGLang"
    held = "; ".join(f"{name} {r}: the {t}" for r, t in bad)
    right = [r for r in tensors.right_releases(engine, architecture)]
    remedy = (
        "no id fixes it: serve with "
        + (
            f"{name} {', '.join(right)} (measured to capture the residual stream)"
            if right
            else "another engine line"
        )
        + ", or with eagle-capture's capture (EAGLE_CAPTURE=1), which stores the residual "
        "stream itself"
    )
    text = (
        f"WRONG TENSOR: {held} -- what this line's capture holds for {architecture}, "
        f"measured against transformers' hidden_states for the same weights; the draft "
        f"was trained on the residual stream entering each layer. The ids are not the "
        f"problem: {remedy}"
    )
    return text, remedy, f"captures the {bad[0][1]}, not the residual stream; {remedy}"


def _capture_only_verdict(v: LineVerdict, ids, num_layers: int, deploy) -> None:
    """``v`` for SGLang's capture-only mode: its start-up refusals, and the fix as the
    command-line ids it accepts."""
    if v.fix_ids is not None and not capture_only.usable(v.fix_ids, num_layers):
        v.fix_ids = None
    if v.fix_ids is not None:
        v.fix = capture_only.flag(v.fix_ids)
    elif v.fix is not None:
        v.fix = "no ids make this mode capture those layers"
    refused = capture_only.refusal(ids, num_layers, deploy.pp if deploy is not None else 1)
    if refused:
        v.ok = False
        v.lines = [
            f'SGLang refuses to start: "{refused}" (arg_groups/validation_hook.py, '
            f"spec_aux_hidden_state.py)"
        ]
        v.brief = f"SGLang refuses to start: {refused}"


def _cannot_capture(v: LineVerdict, cannot: Optional["CannotCapture"]) -> LineVerdict:
    """``v`` for a target class that cannot capture on (part of) its line."""
    if cannot is None:
        return v
    if v.status == "CANNOT LOAD":
        # The draft's format decides first: no target, ids or release of this line serves
        # it. The target's own failure there is said after.
        return replace(v, lines=v.lines + [cannot.text])
    if cannot.whole:
        return LineVerdict(
            v.line,
            [],
            False,
            [cannot.text],
            fix=cannot.remedy,
            ids=v.ids,
            status="CANNOT CAPTURE",
            brief=cannot.short,
        )
    return replace(v, ok=False, lines=[cannot.text] + v.lines, brief=cannot.short)


@dataclass(frozen=True)
class ConfigEdit:
    """A change to the draft config, not to its ids, that lets an engine load it
    (``--write-config`` applies it): ``value`` at the key path ``keys``."""

    keys: tuple[str, ...]
    value: object
    said: str  # the change in words, as the fix says it


def load_edit(engine: str, draft: Optional[DraftIds], line=None) -> Optional[ConfigEdit]:
    """The config edit that lets ``engine`` (its ``line``) load ``draft`` where only the
    config stands in the way (a draft named as its target for SGLang, an fc count vLLM
    does not read), or None."""
    if draft is None or not draft.architecture:
        return None
    if engine == "sglang":
        if draft.architecture == "LlamaForCausalLM" and _sglang_loads_as_target(
            draft.architecture, line
        ):
            return ConfigEdit(
                ("architectures",),
                ["LlamaForCausalLMEagle3"],
                "set the draft config's architectures to LlamaForCausalLMEagle3 (SGLang's "
                "EAGLE-3 Llama draft, the same weights)",
            )
        return None
    found = _vllm_fc_sizing(draft, _vllm_releases(line if line is not None else VLLM_LINE))
    return found[1] if found else None


def _sglang_loads_as_target(arch: str, line=None, releases=None) -> Optional[str]:
    """Why SGLang cannot serve an EAGLE-3 draft written in the original EAGLE format,
    its architecture the target's (``LlamaForCausalLM``: vLLM loads it as
    ``Eagle3LlamaForCausalLM``), or None. SGLang has no such renaming: it builds the
    model class it registers for the name, and its EAGLE-3 worker then reads the
    draft's ``hot_token_id`` (engine facts: ``eagle3_draft_attribute``), which only its
    EAGLE-3 draft classes set."""
    if releases is None:
        releases = (
            _sglang_releases(line, None) if line is not None else engine_facts.releases("sglang")
        )
    drafts = {a for r in releases for a in engine_facts.load()["sglang"][r]["eagle3_drafts"]}
    # An EAGLE-3 draft architecture in the original format: vLLM registers Eagle3 + it.
    if arch in drafts or f"Eagle3{arch}" not in draft_architectures():
        return None
    hits = [
        (r, needs)
        for r in releases
        if engine_facts.target("sglang", r, arch) is not None
        and (needs := engine_facts.eagle3_draft_attribute(r)) is not None
    ]
    if not hits:
        return None
    release, needs = hits[-1]
    fix = (
        "set the draft config's architectures to LlamaForCausalLMEagle3 (SGLang's "
        "EAGLE-3 Llama draft, the same weights)"
        if arch == "LlamaForCausalLM"
        else f"serve it with vLLM, or export it in one of SGLang's EAGLE-3 draft formats "
        f"({', '.join(sorted(drafts))}) where its layers are theirs"
    )
    return (
        f"SGLang cannot load this draft, {arch} being a target model's name, not one of its "
        f"EAGLE-3 drafts ({', '.join(sorted(drafts))}): SGLang builds the model it registers "
        f"for {arch}, and its EAGLE-3 worker sets the draft up with what only those classes "
        f"have (it reads the draft's {needs['attribute']}, {needs['where']} in {release}): "
        f"AttributeError at start-up. Fix: {fix}; vLLM loads {arch} as its Eagle3{arch}"
    )


def cannot_load(
    engine: str,
    draft: Optional[DraftIds],
    line=None,
    releases=None,
    sglang_version: Optional[str] = None,
) -> Optional[str]:
    """Why ``engine`` (its release ``line``, or the ``releases`` read named, where the
    registry changed) cannot load the draft (its class is not registered there: the
    engine facts), or None."""
    if draft is None or not draft.architecture:
        return None
    arch = draft.architecture
    if engine == "sglang":
        as_target = _sglang_loads_as_target(arch, line, releases)
        if as_target is not None:
            return as_target
    # Judged: the EAGLE-3 draft formats some release read registers, and EAGLE-3 names
    # that no release of either engine registers at all. (Other names are not judged,
    # beyond SGLang's target classes above.)
    unknown = "eagle3" in arch.lower() and not engine_facts.registered_anywhere(arch)
    if not (arch in draft_architectures() or unknown):
        return None
    nowhere = (
        " No release read of either engine registers it (SGLang 0.5.9 - 0.5.23, "
        "vLLM 0.32 - 0.34): check the config's architectures"
        if unknown
        else ""
    )
    if engine == "sglang":
        if releases is None:
            releases = (
                _sglang_releases(line, sglang_version)
                if line is not None
                else engine_facts.releases("sglang")
            )
        # Every release of the line must register it (a line whose later releases do, e.g.
        # Eagle3DeepseekV2ForCausalLM in 0.5.12 of 0.5.9 - 0.5.12, names those that do not;
        # --sglang-version picks one release).
        lacking = [r for r in releases if not engine_facts.registers_draft("sglang", r, arch)]
        if not lacking:
            return None
        since = engine_facts.draft_class("sglang", arch)
        if since is not None:
            return (
                f"SGLang cannot load this draft format on this line: {arch} "
                f"(models/{since[1].split('.')[0]}.py) is registered from {since[0]} on "
                f"(not in {', '.join(lacking)}). Serve it with a later SGLang, or with vLLM"
            )
        newest = engine_facts.releases("sglang")[-1]
        speculators = arch == "Eagle3Speculator" or "speculators_config" in draft.raw
        return (
            f"SGLang cannot load this draft format: no SGLang model class is registered as "
            f"{arch} (its EAGLE-3 drafts: "
            f"{', '.join(engine_facts.load()['sglang'][newest]['eagle3_drafts'])}; read in "
            f"SGLang 0.5.9 - {newest})"
            + (
                ", and nothing in SGLang reads speculators' speculators_config. Serve it with "
                "vLLM, which loads speculators' format, or convert it back to "
                "LlamaForCausalLMEagle3 with the ids in eagle_config"
                if speculators
                else "." + nowhere + "."
                if unknown
                else ". Serve it with vLLM, which registers it, or export the draft as "
                "LlamaForCausalLMEagle3 (its trainer's SGLang export)"
            )
        )
    # vLLM names an EAGLE-3 draft's class "Eagle3" + its architecture unless the name
    # already starts or ends with Eagle3 (transformers_utils/configs/eagle.py).
    loaded = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
    if releases is None:
        releases = _vllm_releases(line if line is not None else VLLM_LINE)
    if (
        engine == "vllm"
        and "speculators_config" not in draft.raw
        and not any(engine_facts.registers_draft("vllm", r, loaded) for r in releases)
    ):
        return (
            f"vLLM cannot load this draft format: no vLLM EAGLE-3 model is registered as "
            f"{loaded} (model_executor/models/registry.py, read in {', '.join(releases)})."
            + (
                nowhere + "."
                if unknown
                else " Serve it with SGLang if it registers it, or convert it to a vLLM format "
                "(speculators' converter)"
            )
        )
    if engine == "vllm":
        return _vllm_fc_mismatch(draft, releases)
    return None


def _vllm_fc_mismatch(draft: DraftIds, releases) -> Optional[str]:
    """Why vLLM cannot load the draft's fc (:func:`_vllm_fc_sizing`), or None."""
    found = _vllm_fc_sizing(draft, releases)
    return found[0] if found else None


def _vllm_fc_sizing(draft: DraftIds, releases) -> Optional[tuple[str, Optional[ConfigEdit]]]:
    """Why vLLM cannot load a draft whose fc was trained on another number of hidden
    states than its EAGLE-3 class sizes the fc for (engine facts: ``eagle3_draft_fc``,
    read per release), and the count to write; None when it fits. The draft's fc takes
    as many states as it has ids (none: the three defaults); a speculators-format
    draft's config as vLLM sees it is its transformer_layer_config plus the top-level
    ids (``speculators_eagle3``)."""
    trained = draft.trained
    if not trained or not draft.use_aux:  # no aux states: the draft builds no fc
        return None
    raw = draft.raw
    speculators_format = raw.get("speculators_config") is not None
    if speculators_format and (
        raw.get("speculators_model_type", "eagle3") != "eagle3"
        or not isinstance(raw.get("transformer_layer_config"), dict)
    ):
        return None  # another speculators algorithm, or a config vLLM refuses itself
    for release in reversed(releases):
        speculators = engine_facts.vllm_speculators_eagle3(release)
        if speculators_format:
            if speculators is None:
                continue
            view = dict(raw["transformer_layer_config"])
            if raw.get("eagle_aux_hidden_state_layer_ids"):
                view["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
            model_type = view.get("model_type", speculators["model_type_default"])
            loaded = speculators["archs"].get(model_type) if isinstance(model_type, str) else None
            where = "transformer_layer_config, which vLLM builds the draft's config from"
            at: tuple[str, ...] = ("transformer_layer_config",)
        else:
            view, where, at = raw, "the draft config", ()
            arch = draft.architecture or ""
            loaded = (
                arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
            )

        def read(key, view=view):
            if key.startswith("eagle_config."):
                nested = view.get("eagle_config")
                return nested.get(key.split(".", 1)[1]) if isinstance(nested, dict) else None
            return view.get(key)

        sized = engine_facts.vllm_draft_fc(release, loaded or "", read)
        if sized is None:
            continue
        width, cls, rule = sized
        if width == len(trained):
            return None
        # The count the class reads first decides (Qwen3's: num_aux_layers).
        count_key = next(
            (k for k in rule["reads"] if not k.endswith("_ids") and "." not in k), None
        )
        fix = (
            f'{"set" if count_key in view else "add"} "{count_key}": {len(trained)} in {where}'
            if count_key
            else f"write the ids where {cls} reads them"
        )
        reads = ", else ".join(rule["reads"])
        return (
            f"vLLM cannot load this draft, its fc trained on {len(trained)} hidden states "
            f"({trained}) and vLLM's {cls.split('.')[-1]} sized for {width}: "
            f"models/{rule['where']} ({release}) takes the count from {reads}, else "
            f"{rule['default']}, and the checkpoint's fc weight does not fit (a shape "
            f"assertion while loading). Fix: {fix}",
            ConfigEdit(at + (count_key,), len(trained), fix) if count_key else None,
        )
    return None


def _nested_fix(lines, provenance: Provenance, num_layers: int, allow_embedding: bool) -> str:
    """Where to write ids SGLang will read, and which (its rule differs per model:
    the same ids moved into eagle_config can name other layers)."""
    expected = {r.expected for r in provenance.readings}
    if len(expected) != 1 or None in expected:
        return (
            'Name them in "eagle_config" once it is known which layers the draft was '
            "trained on (the fix lines below, per reading)"
        )
    fixes = {
        str(fix_ids(line, list(next(iter(expected))), num_layers, allow_embedding))
        for line in lines
    }
    if len(fixes) == 1:
        return f"Write eagle_config.eagle_aux_hidden_state_layer_ids = {fixes.pop()}"
    return 'Write them into "eagle_config" as each line\'s rule needs (fix lines below)'


def model_lines(lines: list, architecture: str, sglang_version: Optional[str]):
    """Each SGLang line with the target model's own id rule (from the engine facts
    generated from the wheels), and the notes that say which rule applies (or why
    none is known and what is assumed). A line whose class cannot capture at all is
    returned as is: :func:`target_cannot_capture` says so."""
    if not architecture:
        return lines, [
            "the target's architecture is not given: DeepseekV2's id rule is "
            "assumed (other models have their own; pass --target-config or "
            "--target-architecture)"
        ]
    out, notes, said = [], [], set()
    for line in lines:
        facts = [
            (r, engine_facts.target("sglang", r, architecture))
            for r in _sglang_releases(line, sglang_version)
        ]
        capturing = [(r, f) for r, f in facts if f and f["capture"]]
        if facts and all(_cannot_here("sglang", architecture, f) for _, f in facts):
            out.append(line)
            continue
        others = [(r, f) for r, f in facts if not _cannot_here("sglang", architecture, f)]
        release, fact = (capturing or others or [(line.read_versions[-1], None)])[-1]
        rule = model_rule_of(architecture, fact, release)
        if rule is None:
            rule = ModelRule(architecture, SHIFT_ALWAYS, "not read (assumed)", release)
            read = ", ".join(r for r, _ in facts) or release
            if fact is None:
                why = (
                    f"no model class is registered as {architecture} in SGLang {read} "
                    f"(check the config's architecture name)"
                )
            elif fact["capture"] is None:
                why = f"its class's capture could not be read from the code ({fact['why']})"
            else:
                why = (
                    f"its set_eagle3_layers_to_capture ({fact['owner']}) follows none of the "
                    f"known rules ({fact['why']})"
                )
            text = (
                f"SGLang {line.name}: {why}; the doctor ASSUMES it adds 1 to every id "
                f"(the rule of most models). Check its set_eagle3_layers_to_capture"
            )
        else:
            text = f"SGLang {line.name}'s rule for {rule.describe()}"
        if text not in said:
            said.add(text)
            notes.append(text)
        out.append(line.for_model(rule))
    return out, notes


def _sglang_releases(line, sglang_version: Optional[str]) -> list[str]:
    """The SGLang releases read that ``line`` (or ``sglang_version``) stands for."""
    if sglang_version:
        release = engine_facts.read_release("sglang", parse_version(sglang_version))
        return [release] if release else []
    return [r for r in engine_facts.releases("sglang") if line.covers(parse_version(r))]


def _vllm_releases(line) -> list[str]:
    return [v.split()[0] for v in line.read_versions]


def vllm_fallback_note(architecture: Optional[str]) -> Optional[str]:
    """What serves ``architecture`` on the vLLM releases read that register no class of
    their own for it (their Transformers modeling backend, as read), or None."""
    if not architecture:
        return None
    fallback = engine_facts.vllm_fallback_releases(architecture)
    if not fallback:
        return None
    backend = engine_facts.transformers_backend(fallback[-1])
    typo = (
        ""
        if engine_facts.registered_anywhere(architecture)
        else " (no engine registers the name: check it)"
    )
    return (
        f"vLLM {', '.join(fallback)} register no model class of their own as {architecture}"
        f"{typo}: vLLM serves it, if at all, through its Transformers modeling backend "
        f"({backend['class']}, SupportsEagle3 through {backend['owner']}: capture layer k "
        f"is the input of layer k, as for vLLM's own classes; read). Whether that backend "
        f"runs this model was not read"
    )


def _lines_that_capture(architecture: str, draft: Optional[DraftIds] = None) -> str:
    """Where a target class can feed an EAGLE-3 draft, among the releases read, and
    (given the ``draft``) where that engine release also loads the draft."""
    anywhere = _capturing(architecture, None)
    if not anywhere:
        return (
            f"no SGLang or vLLM release read can (SGLang {engine_facts.SGLANG_RELEASES[0]} - "
            f"{engine_facts.SGLANG_RELEASES[-1]}, vLLM {VLLM_LINE.name}): serve it without "
            f"EAGLE-3, or with a draft for another target"
        )
    loading = _capturing(architecture, draft)
    if loading:
        return "it can on " + "; ".join(loading) + " (of the releases read)"
    return (
        f"it can on {'; '.join(anywhere)} (of the releases read), none of which loads this "
        f"draft (above): export it in a format one of them loads"
    )


def _load_remedy(engine: str, draft: DraftIds, line, architecture: str) -> str:
    """What serves a draft that ``engine``'s ``line`` cannot load: the config edit
    where one does, else the releases read that load it (and capture for the target)."""
    edit = load_edit(engine, draft, line)
    if edit is not None:
        return edit.said
    parts = _capturing(architecture, draft)
    if not parts:
        return ""
    return (
        ("it loads, and the target captures, on " if architecture else "it loads on ")
        + "; ".join(parts)
        + " (of the releases read)"
    )


def _capturing(architecture: str, draft: Optional[DraftIds]) -> list[str]:
    """The engine releases read whose class for ``architecture`` can capture (and that
    load ``draft``, where given), a phrase each: whole SGLang lines as ranges."""
    if architecture:
        where = engine_facts.capturing_releases(architecture)
        fallback = engine_facts.vllm_fallback_releases(architecture)
    else:  # no target named: every release read, for where the draft loads
        where = {engine: engine_facts.releases(engine) for engine in ("sglang", "vllm")}
        fallback = []
    if draft is not None:

        def loads(engine: str, found: list[str]) -> list[str]:
            return [r for r in found if not cannot_load(engine, draft, None, [r])]

        where = {engine: loads(engine, found) for engine, found in where.items()}
        fallback = loads("vllm", fallback)
    parts, run = [], []  # run: consecutive lines that capture on every release read

    def close():
        if run:
            parts.append(f"SGLang {run[0].name.split(' - ')[0]} - {run[-1].name.split(' - ')[-1]}")
            run.clear()

    for line in SGLANG_LINES:
        covered = [r for r in engine_facts.releases("sglang") if line.covers(parse_version(r))]
        can = [r for r in covered if r in where["sglang"]]
        if can and can == covered:
            run.append(line)
            continue
        close()
        if can:
            parts.append(f"SGLang {', '.join(can)}")
    close()
    if where["vllm"]:
        parts.append("vLLM " + ", ".join(where["vllm"]))
    if fallback:
        parts.append(
            f"vLLM {', '.join(fallback)} through its Transformers modeling backend, if that "
            f"runs this model"
        )
    return parts


def target_cannot_capture(
    engine: str,
    line,
    architecture: str,
    sglang_version: Optional[str] = None,
    draft: Optional[DraftIds] = None,
) -> Optional["CannotCapture"]:
    """Why the target's class cannot feed an EAGLE-3 draft on ``line`` (from the
    engine facts), and whether that holds for the whole line (False: only some of
    its releases read); None when it can, or when that is not known. The remedy
    names only releases that also load ``draft``."""
    if not architecture:
        return None
    releases = _vllm_releases(line) if engine == "vllm" else _sglang_releases(line, sglang_version)
    facts = {r: engine_facts.target(engine, r, architecture) for r in releases}
    cannot = [r for r, f in facts.items() if _cannot_here(engine, architecture, f)]
    if not cannot:
        return None
    fact = facts[cannot[-1]]
    where = f"{line.engine} {', '.join(cannot)}"
    if fact is None:
        first = next(
            r
            for r in engine_facts.releases("sglang")
            if engine_facts.target("sglang", r, architecture)
        )
        short = f"{architecture} is registered from {first} on"
        why = (
            f"{where}: no model class is registered as {architecture} ({short}), so SGLang "
            f"serves it, if at all, through its Transformers fallback "
            f"(TransformersForCausalLM), which has no set_eagle3_layers_to_capture"
        )
    elif engine == "vllm":
        short = f"{fact['class']} is not SupportsEagle3"
        why = (
            f"{where}: the target's class {short}, so the server refuses EAGLE-3 at "
            f'start-up ("Model does not support EAGLE3 interface")'
        )
    elif fact.get("why"):
        short = f"{fact['class']}: {fact['why'].split(':')[0]}"
        why = f"{where}: the target's class {fact['class']} {fact['why']}"
        held = {r: tensors.measured(engine, r, architecture) for r in cannot}
        held = {r: t for r, t in held.items() if t and t != tensors.RESIDUAL}
        if held:  # read in the code and measured running it: say both
            why += (
                f" (measured in {', '.join(held)}'s own model code against transformers' "
                f"hidden_states: the draft receives the {sorted(set(held.values()))[0]})"
            )
    else:
        short = f"{fact['class']} has no set_eagle3_layers_to_capture"
        why = (
            f"{where}: the target's class {short} (nor its bases), so the server stops at "
            f"start-up where the model runner calls it (AttributeError; SGLang 0.5.23 checks "
            f"first and raises a ValueError naming the method)"
        )
    whole = len(cannot) == len(releases)
    if not whole:
        can = [r for r in releases if r not in cannot and (facts[r] or {}).get("capture")]
        why += f"; {', '.join(can)} capture" if can else ""
        short += f" on {', '.join(cannot)}" + (f"; {', '.join(can)} capture" if can else "")
    remedy = _lines_that_capture(architecture, draft)
    return CannotCapture(
        f"{why}. It cannot feed an EAGLE-3 draft there, whatever the ids; {remedy}",
        whole,
        short,
        remedy,
    )


def _cannot_here(engine: str, architecture: str, fact: Optional[dict]) -> bool:
    """Whether a release whose fact for ``architecture`` is ``fact`` cannot capture for it:
    its class cannot; or (SGLang) it registers no class for a name that other releases
    do register -- its Transformers fallback has no set_eagle3_layers_to_capture. (A name
    no release registers may be a typo: ASSUMED, said in a note.)"""
    if fact is not None:
        return fact["capture"] is False
    return engine == "sglang" and any(
        engine_facts.target("sglang", r, architecture) for r in engine_facts.releases("sglang")
    )


@dataclass(frozen=True)
class CannotCapture:
    """A target class that cannot feed an EAGLE-3 draft on a line (or part of it)."""

    text: str
    whole: bool  # every release of the line read (False: some only)
    short: str  # the cause in a few words
    remedy: str  # where it can


def _vllm_notes(draft: Optional[DraftIds], ids, provenance: Provenance) -> list[str]:
    """What vLLM's reading of the draft config and its id rule mean for this draft."""
    notes = []
    if (
        draft is not None
        and draft.top_level is not None
        and draft.nested is not None
        and draft.top_level != draft.nested
    ):
        notes.append(
            f"{draft.source} names ids {draft.top_level} at its top level and "
            f"{draft.nested} in eagle_config: vLLM's runners read the top-level ones, "
            f"SGLang's target eagle_config's; remove the other"
        )
    if draft is not None and draft.target_layer_ids and not draft.top_level:
        notes.append("vLLM's V1 runner reads no target_layer_ids: it captures its defaults")
    elif len(vllm_lines(draft)) > 1:
        notes.append(
            "vLLM's model runner V2 (its default wherever Triton runs, and the only "
            "runner of 0.34) never reads eagle_config.eagle_aux_hidden_state_layer_ids: "
            "this draft gets vLLM's defaults there and its ids only under the V1 "
            "runner of 0.32 - 0.33. Write the ids at the config's top level"
        )
    if (
        ids is not None
        and not provenance.ambiguous
        and provenance.readings[0].convention == "output"
    ):
        notes.append(
            "vLLM captures id k as the input of layer k (the output of layer k - 1), without "
            "SGLang's +1: a draft trained by SpecForge (id X = the output of layer X) gets "
            "every capture one layer early (a field report of the same off-by-one on another "
            "model: acceptance ~45% -> ~10%). If the ids were written for vLLM's rule (the "
            "draft trained on vLLM's own captures), pass --id-convention input"
        )
    return notes


def _short_label(reading: Reading) -> str:
    """ "output convention", "input convention", "the recorded capture layers"..."""
    return reading.label.split(" (")[0]
