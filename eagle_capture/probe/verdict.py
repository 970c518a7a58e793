"""The probe's verdict: the measured table (:class:`ProbeReport`), and from it
(:func:`judge`) whether the config's reading is what the draft was trained on, the
ids to write (or the draft's fc columns to reorder), and what each engine's line
captures and whether it can load the draft."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from eagle_capture.layer_ids.deployment import wrap
from eagle_capture.layer_ids.diagnosis import cannot_load, fix_ids, target_cannot_capture
from eagle_capture.layer_ids.lines import VLLM_LINE, DraftIds
from eagle_capture.layer_ids.startup import slot_order_problem
from eagle_capture.layer_ids.trainers import Provenance
from eagle_capture.probe.readings import SGLANG_DEFAULT, Candidate, _engine_captures, _sglang_line

__all__ = ["ProbeReport", "judge"]


@dataclass
class ProbeReport:
    num_layers: int
    candidates: list[Candidate]
    provenance: Provenance
    threshold: float
    verdict: str = ""
    fixes: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    ok: bool = False
    notes: list[str] = field(default_factory=list)
    measured: dict = field(default_factory=dict)  # where and how the target ran

    def to_json(self) -> dict:
        """The report as data: what a script checks (``--json``)."""
        return {
            "verdict": self.verdict.split(":")[0],
            "verdict_text": self.verdict,
            "ok": self.ok,
            "threshold": self.threshold,
            "num_layers": self.num_layers,
            "trainer": self.provenance.trainer,
            "ids": self.provenance.ids,
            "readings": [
                {
                    "capture_layers": list(c.layers),
                    "agreement": c.agreement,
                    "hits": c.hits,
                    "tokens": c.tokens,
                    "labels": c.labels,
                    "config_reading": c.config_reading,
                }
                for c in self.ranked
            ],
            "engines": self.engines,
            "fixes": self.fixes,
            "notes": self.notes,
            "measured": self.measured,
        }

    @property
    def ranked(self) -> list[Candidate]:
        return sorted(self.candidates, key=lambda c: (-c.agreement, c.layers))

    def format(self) -> str:
        n = self.num_layers
        rows = [("", "capture layers (c = input of layer c)", "agree", "tokens", "reading")]
        for i, c in enumerate(self.ranked):
            mark = "*" if c.config_reading else " "
            rows.append(
                (
                    f"{i + 1}{mark}",
                    c.describe(n),
                    f"{100 * c.agreement:5.1f}%",
                    str(c.tokens),
                    "; ".join(c.labels),
                )
            )
        w = [max(len(r[j]) for r in rows) for j in range(4)]
        lines = ["  ".join(r[j].ljust(w[j]) for j in range(4)) + "  " + r[4] for r in rows]
        lines.append(
            "(* the config's own reading; out X = the output of layer X; agree = the "
            "draft's first token is the target's greedy next token)"
        )
        lines.append("")
        lines += [wrap(self.verdict, "", "  ")]
        lines += [wrap(f, "  ", "    ") for f in self.fixes]
        lines += [wrap(e, "  ", "    ") for e in self.engines]
        lines += [wrap("note: " + t, "", "  ") for t in self.notes]
        return "\n".join(lines)


def _threshold(a: Candidate, b: Candidate, min_margin: float) -> float:
    """The margin that separates two agreements: ``min_margin``, or three standard
    errors of the difference when that is larger (few tokens)."""
    n = max(1, min(a.tokens, b.tokens))
    se = math.sqrt((a.agreement * (1 - a.agreement) + b.agreement * (1 - b.agreement)) / n)
    return max(min_margin, 3 * se)


def _fc_reorder(trained: list[int], spec, ids) -> str:
    """How to make a draft trained with its slots in ``trained`` order (capture layers,
    not ascending) take the engines' ascending feed: its fc is linear in the
    concatenated states, so permuting fc's input column blocks is exact; then the
    config's ``ids`` are written sorted."""
    ascending = sorted(trained)
    perm = [trained.index(c) for c in ascending]
    k = len(trained)
    width = f" of {spec.target_hidden_size} columns" if spec is not None else ""
    extra = ""
    if spec is not None and spec.norm_before_fc:
        extra += (
            f"; permute the {k} blocks of the weight of the norm before fc the same way "
            f"(its RMS over the whole concatenation does not depend on the order)"
        )
    if spec is not None and spec.fc_norm:
        extra += f"; reorder its {k} per-state fc norms the same way"
    return (
        f"fix the draft, not the ids: reorder the input columns of its fc.weight in {k} "
        f"blocks{width}, one per target state, so that the new blocks are the old blocks "
        f"{perm} in that order (new block j = old block {perm}[j]){extra}. fc is linear "
        f"in the concatenated states and nothing else in the draft sees them, so the "
        f"draft then computes from the engines' ascending feed {ascending} exactly what "
        f"it was trained to"
        + (f"; then write the ids sorted, {sorted(ids)}" if ids else "")
        + ". Or retrain the draft on the engines' order"
    )


def judge(
    report: ProbeReport,
    draft: DraftIds,
    architecture: str,
    min_margin: float,
    sglang_version: str = "",
    draft_spec=None,
    engines: Sequence[str] = ("sglang", "vllm"),
) -> None:
    """The verdict, the ids to write and each engine's line, from the measured table.
    The config's reading stands unless another reading beats it by more than the
    noise (:func:`_threshold`); two config readings (ambiguous ids, or unsorted ids
    in ascending and in the config's slot order) must be told apart by that margin
    too. ``draft_spec`` (the draft's :class:`~eagle_capture.probe.draft_spec.DraftSpec`)
    names the weights to reorder for a draft trained in the config's slot order;
    ``engines``: the engines whose lines are reported and decide ``ok``."""
    ranked = report.ranked
    best = ranked[0]
    n = report.num_layers
    config = [c for c in ranked if c.config_reading]
    top = config[0]
    need = _threshold(best, top, min_margin)
    report.threshold = need

    def pct(c):
        return f"{100 * c.agreement:.1f}%"

    want: Optional[list[int]] = None
    if best is not top and best.agreement - top.agreement >= need:
        want = list(best.layers)
        report.verdict = (
            f"MISMATCH: capture layers {want} agree {pct(best)}, "
            f"{100 * (best.agreement - top.agreement):.1f} points more than the config's "
            f"reading {list(top.layers)} ({pct(top)}; {100 * need:.1f} needed): the draft was "
            f"trained on {want}"
        )
    elif len(config) > 1 and top.agreement - config[1].agreement < _threshold(
        top, config[1], min_margin
    ):
        report.verdict = (
            f"INCONCLUSIVE: the config's readings {list(top.layers)} ({pct(top)}) and "
            f"{list(config[1].layers)} ({pct(config[1])}) are within "
            f"{100 * _threshold(top, config[1], min_margin):.1f} points over {top.tokens} "
            f"tokens: more calibration text (--prompts, --max-tokens) narrows it; a draft "
            f"that agrees little everywhere may not belong to this target"
        )
    else:
        want = list(top.layers)
        which = "; ".join(lb for lb in top.labels if lb.startswith("config"))
        runner = next((c for c in ranked if c is not top), None)
        report.verdict = (
            f"CONFIRMED: the draft was trained on capture layers {want}, the "
            f"config's reading ({which}): {pct(top)} agreement"
        )
        if runner is not None:
            gap = top.agreement - runner.agreement
            report.verdict += (
                f", {100 * gap:.1f} points over the next reading {list(runner.layers)}"
                if gap >= 0
                else f"; {list(runner.layers)} agrees {pct(runner)}, within the "
                f"{100 * need:.1f} points that noise allows"
            )
        if report.provenance.ambiguous and report.provenance.ids is None:
            # (no ids: the readings are the runs that write none, not conventions)
            report.fixes.append(
                f"the config names no ids, and the runs that write none trained on different "
                f"layers: this draft was trained on {want}; write them (below) so that the "
                f"doctor and the plugins read it without a guess"
            )
        elif report.provenance.ambiguous:
            conv = "output" if "output" in which else "input"
            report.fixes.append(
                f"the config's ids are ambiguous; this draft's are in the {conv} convention: "
                f"pass --id-convention {conv} to the doctor, EAGLE_CAPTURE_ID_CONVENTION={conv} "
                f"to the plugins"
            )
    if want is None:
        report.ok = False
        return
    report.ok = want == list(top.layers)
    ids = report.provenance.ids
    in_order = want != sorted(want)
    if in_order:
        # Trained with the slots in the config's order: what no engine feeds.
        report.ok = False
        won = next(c for c in ranked if list(c.layers) == want)
        asc = next((c for c in ranked if list(c.layers) == sorted(want)), None)
        report.verdict = (
            f"MISMATCH: the draft was trained with its slots in the config's order, capture "
            f"layers {want} in that order ({pct(won)}"
            + (f"; ascending, {sorted(want)}, {pct(asc)}" if asc is not None else "")
            + "): no engine can feed it so. SGLang and vLLM capture in ascending layer order "
            "whatever the order of the ids, so no id list fixes it on either engine"
        )
        report.fixes.append(_fc_reorder(want, draft_spec, ids))
        want = sorted(want)
    elif ids and slot_order_problem(ids) and want == list(top.layers):
        ordered = next((c for c in ranked if c.config_order), None)
        report.fixes.append(
            slot_order_problem(ids) + ". Measured: this draft takes its slots in ascending "
            f"order, as the engines feed them ({pct(top)}"
            + (f"; in the config's order {pct(ordered)}" if ordered is not None else "")
            + f"): write the ids sorted, {sorted(ids)}"
        )
    sglang_version = sglang_version or SGLANG_DEFAULT
    line, _ = _sglang_line(architecture, sglang_version)
    sglang_ids = fix_ids(line, want, n, allow_embedding=0 in want)
    for _, label, layers in _engine_captures(draft, n, architecture, sglang_version):
        sglang = label.startswith("SGLang")
        if ("sglang" if sglang else "vllm") not in engines:
            continue
        cannot = cannot_load(
            "sglang" if sglang else "vllm",
            draft,
            line if sglang else None,
            sglang_version=sglang_version,
        )
        if cannot:
            # No class for the format: no ids help there (the doctor's words).
            report.ok = False
            report.engines.append(f"{label}: CANNOT LOAD -- {cannot}")
            continue
        # The target's class cannot capture there at all (the doctor's engine facts).
        stuck = target_cannot_capture(
            "sglang" if sglang else "vllm",
            line if sglang else VLLM_LINE,
            architecture,
            sglang_version if sglang else None,
        )
        if stuck is not None and stuck.whole:
            report.ok = False
            report.engines.append(f"{label}: CANNOT CAPTURE -- {stuck.text}")
            continue
        head = (
            f"{label} captures {sorted(layers)} in ascending order: PROBLEM -- no ids "
            f"feed slots in the config's order; with the draft's fc reordered (above), "
            if in_order
            else f"{label} captures {sorted(layers)}: "
        )
        if sorted(layers) == want:
            report.engines.append(head + ("it captures the right layers" if in_order else "OK"))
            continue
        report.ok = False
        if not sglang:
            fix = f"write the top-level eagle_aux_hidden_state_layer_ids = {want}"
        elif sglang_ids is None:
            fix = f"no ids make this line capture {want}"
        else:
            fix = f"write eagle_config.eagle_aux_hidden_state_layer_ids = {sglang_ids}"
        report.engines.append(head + (fix if in_order else f"PROBLEM -- {fix}"))
