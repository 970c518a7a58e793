"""Capture plans: which layers to capture, in which slot, under which convention.

Two conventions for an EAGLE-3 layer id are in use:

* ``output`` -- id X is the *output of decoder layer X* (SpecForge drafts,
  TensorRT-LLM). That is HF transformers' ``output_hidden_states[X + 1]`` and
  SGLang's capture at the start of layer X + 1.
* ``input`` -- id X is the *input to decoder layer X* (SGLang's capture point
  and its default ids, vLLM). That is ``output_hidden_states[X]``; the input
  to layer 0 is the embedding output.

SGLang turns a draft config's ids into capture layers with a rule that changed
across versions: up to 0.5.12 it always adds 1 ("layer i takes the output of
layer i-1"); from 0.5.13 it adds 1 only when ``ids[0] == 1``. Without
configured ids it captures ``[2, L // 2, L - 3]`` as-is (= SpecForge's default
``[1, L // 2 - 1, L - 4]`` in the output convention).

A plan is always expressed as *capture layers* (SGLang's ``layers_to_capture``:
the capture is taken at the start of that layer), one slot per layer in
ascending order -- the order SGLang's loop appends in -- each slot described in
both conventions and as an HF hidden-states index.

The user's failure this guards against: ids ``[-1, 2, 30]`` (an embedding
capture added "to fix" a draft trained on ``[2, 30, 58]``) dropped acceptance
from ~47% to ~19%, silently.
"""

import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

from eagle_capture.layer_ids.lines import (
    CapturePlanError,
    default_capture_layers,
    line_of,
    read_draft_ids,
    specforge_default_ids,
)

__all__ = [
    "CONVENTIONS",
    "CapturePlan",
    "CapturePlanError",
    "SlotInfo",
    "build_plan",
    "default_capture_layers",
    "ids_from_draft_config",
    "plan_from_draft_config",
    "specforge_default_ids",
]

CONVENTIONS = ("output", "input")


@dataclass(frozen=True)
class SlotInfo:
    slot: int
    capture_layer: int  # SGLang layers_to_capture entry: input to this layer
    configured_id: Optional[int]

    @property
    def output_of_layer(self) -> int:
        """``output`` convention id (-1: the embedding output)."""
        return self.capture_layer - 1

    @property
    def hf_hidden_states_index(self) -> int:
        """Index into HF ``output_hidden_states`` (0 = embedding output)."""
        return self.capture_layer

    def describe(self) -> str:
        src = (
            "embedding output"
            if self.capture_layer == 0
            else f"output of layer {self.output_of_layer}"
        )
        cfg = "default" if self.configured_id is None else f"id {self.configured_id}"
        return (
            f"slot {self.slot}: {cfg} -> capture at start of layer {self.capture_layer} "
            f"= {src} = HF hidden_states[{self.hf_hidden_states_index}]"
        )


@dataclass
class CapturePlan:
    num_layers: int
    rule: str  # how configured ids were read
    configured_ids: Optional[tuple[int, ...]]  # None: defaults
    slots: tuple[SlotInfo, ...]
    warnings: list[str] = field(default_factory=list)

    @property
    def layers_to_capture(self) -> list[int]:
        return [s.capture_layer for s in self.slots]

    @property
    def num_captures(self) -> int:
        return len(self.slots)

    def slot_of(self, capture_layer: int) -> int:
        for s in self.slots:
            if s.capture_layer == capture_layer:
                return s.slot
        raise KeyError(
            f"layer {capture_layer} is not captured by this plan ({self.layers_to_capture})"
        )

    def make_buffer(self, max_tokens: int, hidden_size: int, **kwargs):
        from eagle_capture.buffer import AuxCaptureBuffer

        return AuxCaptureBuffer(max_tokens, hidden_size, self.layers_to_capture, **kwargs)

    def format(self) -> str:
        ids = "defaults" if self.configured_ids is None else list(self.configured_ids)
        lines = [
            f"capture plan: {self.num_layers}-layer target, ids {ids}, rule: {self.rule}",
            f"  layers_to_capture = {self.layers_to_capture}",
        ]
        lines += [f"  {s.describe()}" for s in self.slots]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# ----------------------------------------------------------------------------
# Rules (per SGLang line: eagle_capture.layer_ids.lines)
# ----------------------------------------------------------------------------


def _rule_shift(ids: Sequence[int], convention: Optional[str], sglang_version: Optional[str]):
    if sglang_version is not None:
        line = line_of(sglang_version)
        shift = line.capture_layers(ids, 0)[0] - ids[0]
        return shift, f"SGLang {sglang_version}, line {line.name} (adds {shift})"
    convention = convention or "output"
    if convention not in CONVENTIONS:
        raise CapturePlanError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    shift = 1 if convention == "output" else 0
    return shift, f"ids are layer {'outputs' if shift else 'inputs'} (adds {shift})"


def build_plan(
    layer_ids: Optional[Iterable[int]],
    num_layers: int,
    *,
    convention: Optional[str] = None,
    sglang_version: Optional[str] = None,
    pp_layers: Optional[tuple[int, int]] = None,
    allow_embedding: bool = False,
) -> CapturePlan:
    """Turn configured ids into a plan, or raise :class:`CapturePlanError`.

    ``convention`` says how the ids were meant (``output``: SpecForge, the
    default; ``input``); ``sglang_version`` instead applies that SGLang
    version's rule -- what the server would really do. ``pp_layers`` is the
    ``[start, end)`` range of this pipeline stage (SGLang captures on the last
    stage only; a captured layer it does not own would be silently missing).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 4:
        raise CapturePlanError(f"num_layers must be an int >= 4, got {num_layers!r}")
    warn: list[str] = []
    if layer_ids is None:
        capture = default_capture_layers(num_layers)
        configured = [None] * len(capture)
        rule = "SGLang default [2, L//2, L-3], used as-is"
        ids = None
    else:
        ids = list(layer_ids)
        if not ids:
            raise CapturePlanError(
                "eagle_aux_hidden_state_layer_ids is empty; name the layers "
                "the draft was trained on, or omit the field for defaults"
            )
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CapturePlanError(f"layer ids must be integers, got {ids!r}")
        negative = [i for i in ids if i < 0]
        shift, rule = _rule_shift(ids, convention, sglang_version)
        # -1 read as an output id is the embedding output (capture layer 0); that
        # one is allowed on request, any other negative id names no layer at all.
        if negative and not (allow_embedding and negative == [-1] and shift == 1):
            raise CapturePlanError(
                f"layer id {negative[0]} in {ids} asks for the embedding output, which no "
                f"SpecForge-trained draft uses (SpecForge requires non-negative ids); adding it "
                f"dropped acceptance from ~47% to ~19% in the field (a field report). Use the ids "
                f"the draft was trained on -- for a {num_layers}-layer target SpecForge's default "
                f"is {specforge_default_ids(num_layers)}. Only for a draft really trained on the "
                f"embedding: --allow-embedding (allow_embedding=True), read as an output id. "
                f"`python -m eagle_capture.layer_ids.doctor` shows what each SGLang line does with it"
            )
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise CapturePlanError(
                f"layer id {dupes[0]} appears more than once in {ids}; each "
                f"captured layer fills one slot of the draft's input"
            )
        capture = [i + shift for i in ids]
        configured = list(ids)
        if ids[0] != 1:
            warn.append(
                f"SGLang <= 0.5.12 would capture layers {[i + 1 for i in ids]} and >= 0.5.13 "
                f"layers {list(ids)} for these ids (the +1 applies only when ids[0] == 1 "
                f"from 0.5.13): pin the rule that matches how the draft was trained"
            )
        if ids != sorted(ids):
            warn.append(
                f"ids {ids} are not ascending; SGLang concatenates in ascending layer "
                f"order, so the slots are ordered {sorted(capture)}: check the draft was "
                f"trained on that order"
            )
    for layer, cid in zip(capture, configured):
        if layer == 0 and not allow_embedding:
            raise CapturePlanError(
                f"id {cid} captures the input to layer 0, i.e. the embedding output, which no "
                f"SpecForge-trained draft uses. SGLang 0.5.9 - 0.5.17 fail at the first forward "
                f"on it (residual is None at layer 0); 0.5.18 and later capture the embedding. "
                f"Only for a draft trained on it: --allow-embedding (allow_embedding=True)"
            )
        if not 0 <= layer < num_layers:
            hint = (
                f"the last usable id is {num_layers - 2} in the output convention "
                f"(capture at the start of layer {num_layers - 1})"
            )
            raise CapturePlanError(
                f"id {cid} maps to capture layer {layer}, outside the "
                f"{num_layers}-layer target; {hint}"
            )
    if pp_layers is not None:
        start, end = pp_layers
        missing = [layer for layer in capture if not start <= layer < end]
        if missing:
            raise CapturePlanError(
                f"this pipeline stage owns layers [{start}, {end}) but the plan captures layer(s) "
                f"{missing}: SGLang captures on the last PP stage only, so these would be "
                f"silently missing from the draft's input. Capture on the stages that own them "
                f"or move the ids"
            )
    order = sorted(range(len(capture)), key=lambda k: capture[k])
    slots = tuple(SlotInfo(slot, capture[k], configured[k]) for slot, k in enumerate(order))
    return CapturePlan(num_layers, rule, tuple(ids) if ids is not None else None, slots, warn)


def ids_from_draft_config(config: Union[dict, str, os.PathLike]) -> Optional[list[int]]:
    """The ids SGLang's target reads from a draft config (a dict, a config.json
    path or its folder): ``eagle_config.eagle_aux_hidden_state_layer_ids``, or
    None -- a top-level key is ignored by every SGLang line (the doctor reports it)."""
    return read_draft_ids(config).read_by_target


def plan_from_draft_config(
    config: Union[dict, str, os.PathLike], num_layers: int, **kwargs
) -> CapturePlan:
    """:func:`build_plan` for a draft config (a dict, a config.json path or its folder)."""
    return build_plan(ids_from_draft_config(config), num_layers, **kwargs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m eagle_capture.layer_ids.plan`` is the doctor now (one CLI, one verdict)."""
    import sys

    from eagle_capture.cli import doctor

    print(
        "eagle_capture.layer_ids.plan: the capture plan is part of the doctor's output now; running "
        "`eagle-capture doctor`",
        file=sys.stderr,
    )
    return doctor.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
