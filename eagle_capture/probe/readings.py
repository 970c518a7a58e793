"""The probe's readings and their scoring: every reading of a draft's ids worth
measuring (:func:`candidates`: the config's own, one layer off, what each engine
captures, the engines' default, the config's slot order), and how often the draft's
first step, fed the target's states at a reading's layers, proposes the target's own
greedy token (:func:`score_readings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from eagle_capture.layer_ids.diagnosis import model_lines
from eagle_capture.layer_ids.lines import (
    SGLANG_LINES,
    DraftIds,
    default_capture_layers,
    line_of,
    vllm_lines,
)
from eagle_capture.layer_ids.trainers import Provenance

__all__ = [
    "SGLANG_DEFAULT",
    "Candidate",
    "candidates",
    "config_order",
    "first_step_agreement",
    "score_readings",
]

# The SGLang version whose capture the engine lines show (--sglang-version): the newest read.
SGLANG_DEFAULT = SGLANG_LINES[-1].read_versions[-1]


@dataclass
class Candidate:
    """One reading of the draft's ids: the capture layers it feeds the draft."""

    layers: tuple[int, ...]  # capture layers (c = the input of layer c) in the order
    #                                  the draft's fc takes them: ascending (the engines'
    #                                  order) but for a reading in the config's slot order
    labels: list[str]
    config_reading: bool = False  # one of the config's own readings
    hits: int = 0
    tokens: int = 0

    @property
    def config_order(self) -> bool:
        """Slots in the config's order, not ascending: no engine feeds that."""
        return list(self.layers) != sorted(self.layers)

    @property
    def agreement(self) -> float:
        return self.hits / self.tokens if self.tokens else 0.0

    def describe(self, num_layers: int) -> str:
        def one(c):
            return (
                "embedding"
                if c == 0
                else (f"out {c - 1}" if c < num_layers else f"out {c - 1} (final)")
            )

        return f"{list(self.layers)} = {', '.join(one(c) for c in self.layers)}"


def _sglang_line(architecture: str, sglang_version: str):
    """SGLang's line for ``sglang_version`` with the target's own id rule (the
    doctor's: an architecture not read is ASSUMED to add 1, said in the notes)."""
    lines, notes = model_lines([line_of(sglang_version)], architecture, sglang_version)
    return lines[0], notes


def _engine_captures(draft: DraftIds, num_layers: int, architecture: str, sglang_version: str):
    """(short label, full label, capture layers) for what each engine captures for
    this config."""
    line, _ = _sglang_line(architecture, sglang_version)
    out = [
        (
            f"SGLang {sglang_version}",
            f"SGLang {sglang_version}",
            line.capture_layers(draft.read_by_target, num_layers),
        )
    ]
    for v in vllm_lines(draft):
        short = {"V2": "vLLM V2", "V1": "vLLM V1"}.get(v.runner, "vLLM")
        out.append((short, f"vLLM {v.title}", v.capture_layers(v.read_ids(draft), num_layers)))
    return out


def candidates(
    draft: DraftIds,
    provenance: Provenance,
    num_layers: int,
    num_aux: int,
    architecture: str = "",
    sglang_version: str = SGLANG_DEFAULT,
) -> tuple[list[Candidate], list[str]]:
    """Every reading worth measuring (deduplicated by layers, labels merged), and
    notes on readings left out (outside [0, num_layers], a layer twice, or not
    ``num_aux`` layers: the draft's fc takes exactly that many). Readings are in
    ascending order, as the engines feed them, except the config-order ones."""
    found: dict[tuple, Candidate] = {}
    notes: list[str] = []

    def add(layers, label, config_reading=False, ordered=False):
        if layers is None:
            return
        layers = tuple(layers) if ordered else tuple(sorted(layers))
        if (
            len(layers) != num_aux
            or len(set(layers)) != len(layers)
            or not all(0 <= c <= num_layers for c in layers)
        ):
            notes.append(
                f"{label}: {list(layers)} left out (the draft takes {num_aux} distinct "
                f"capture layers in [0, {num_layers}])"
            )
            return
        cand = found.setdefault(layers, Candidate(layers, []))
        if label not in cand.labels:
            cand.labels.append(label)
        cand.config_reading |= config_reading

    readings = [r for r in provenance.readings if r.expected is not None]
    ids = provenance.ids
    for r in readings:
        add(r.expected, f"config: {r.label.split(' (')[0]}", config_reading=True)
        in_order = config_order(ids, r.expected)
        if in_order is not None:
            add(
                in_order,
                f"config: {r.label.split(' (')[0]}, slots in the config's order",
                config_reading=True,
                ordered=True,
            )
    defaults = default_capture_layers(num_layers)
    if not readings:
        # No ids: the config's reading is what the engines feed it, their default.
        add(defaults, "config: no ids, the engines' default", config_reading=True)
    if ids is not None:
        add([i + 1 for i in ids], "ids read as outputs")
        add(list(ids), "ids read as inputs")
        add([i - 1 for i in ids], "ids read as inputs, all one lower")
        add([i + 2 for i in ids], "ids read as outputs, all one higher")
    for label, _, layers in _engine_captures(draft, num_layers, architecture, sglang_version):
        add(layers, label + " captures")
    add(defaults, "the engines' default")
    # One layer off in one slot, around each config reading (two when the config reads
    # two ways: a draft trained next to the second is as likely as next to the first).
    for base in [sorted(r.expected) for r in readings] or [defaults]:
        for k in range(len(base)):
            for d in (-1, 1):
                moved = list(base)
                moved[k] += d
                add(moved, f"config, layer {base[k]} -> {base[k] + d}")
    return list(found.values()), notes


def config_order(ids, expected) -> Optional[tuple[int, ...]]:
    """The capture layers ``expected`` (ascending) in the order the config lists ``ids``,
    when that order is not ascending (None otherwise). Every reading moves all ids by
    one constant, so the k-th smallest id names the k-th capture layer."""
    if (
        not ids
        or expected is None
        or list(ids) == sorted(ids)
        or len(set(ids)) != len(ids)
        or len(ids) != len(expected)
    ):
        return None
    rank = {i: k for k, i in enumerate(sorted(ids))}
    return tuple(expected[rank[i]] for i in ids)


@torch.no_grad()
def score_readings(
    draft,
    states: dict,
    greedy: torch.Tensor,
    embeds: torch.Tensor,
    readings: Sequence[tuple[int, ...]],
) -> dict:
    """For each reading (capture layers), whether the draft's first step at each
    position t (the target's states at t, the token at t + 1) proposes the target's
    greedy token at t + 1: {layers: bool [T - 1]}, from the target's ``states``
    ({c: [1, T, H]}), its ``greedy`` next tokens [1, T] and the draft's ``embeds``
    [1, T, H] of the prompt's tokens."""
    greedy = greedy[0]
    dtype = next(draft.parameters()).dtype
    embeds = embeds[:, 1:].to(dtype)
    positions = torch.arange(greedy.shape[0] - 1, device=greedy.device).unsqueeze(0)
    out = {}
    for r in readings:
        aux = torch.cat([states[c][:, :-1] for c in r], dim=-1).to(dtype)
        proposed = draft.to_target(draft(aux, embeds, positions)[0].argmax(-1))
        out[tuple(r)] = proposed == greedy[1:]
    return out


@torch.no_grad()
def first_step_agreement(
    model, layers, draft, embed, tokens: torch.Tensor, readings: Sequence[tuple[int, ...]]
) -> dict:
    """:func:`score_readings` for a transformers ``model`` (its decoder ``layers``) on
    ``tokens`` [1, T], the draft's embeddings from ``embed``."""
    from eagle_capture.probe.target import target_states

    keep = sorted({c for r in readings for c in r})
    states, greedy = target_states(model, layers, tokens, keep)
    return score_readings(draft, states, greedy, embed(tokens), readings)
