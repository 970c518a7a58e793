"""The one validation of capture layers: what the aux buffer, both engine plugins,
the SGLang drop-in, the start-up id check and the probe accept, with one set of
messages.

Capture layer ``c`` is the input of decoder layer ``c`` (SGLang's
``layers_to_capture``, vLLM's aux ids): ``0`` is the embedding output, ``N`` (the
layer count) the last layer's output, before the final norm. Each caller says
what it knows -- the layer count, whether its loop captures the final boundary or
the embedding output, the layers its pipeline stage runs -- and gets the same
refusal for the same ids; ids are never reordered or deduplicated silently, since
the draft's fc takes exactly one hidden state per id.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["CaptureLayerError", "check_capture_layers", "layer_list"]


class CaptureLayerError(ValueError):
    """Capture layers that name no layer, a layer twice, or one this rank or engine
    does not capture: the draft would not get one hidden state per id."""


def layer_list(layers, *, error: type[Exception] = CaptureLayerError) -> list[int]:
    """``layers`` as a list of ints, or ``error``: a non-empty sequence of integers
    (``bool`` is not one, a string is not a sequence of ids)."""
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise error(
            f"eagle_capture: the capture layers must be a non-empty sequence of "
            f"integers, got {layers!r}"
        )
    ids = list(layers)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise error(
            f"eagle_capture: the capture layers must be a non-empty sequence of "
            f"integers, got {layers!r}"
        )
    return ids


def check_capture_layers(
    layers,
    *,
    num_layers: Optional[int] = None,
    final_boundary: bool = True,
    embedding: bool = True,
    stage: Optional[tuple[int, int]] = None,
    error: type[Exception] = CaptureLayerError,
) -> list[int]:
    """The capture layers ``layers``, sorted (the order every engine fills its
    slots in), or ``error`` saying what is wrong with them.

    ``num_layers``: the target's decoder layers (None: no upper bound known);
    ``final_boundary``: whether ``num_layers`` itself (the last layer's output) is
    captured; ``embedding``: whether capture layer 0 (the embedding output) is
    accepted; ``stage``: ``(start, end)``, the layers ``[start, end)`` this rank's
    pipeline stage runs (the final boundary belongs to the last stage)."""
    ids = layer_list(layers, error=error)
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise error(
            f"eagle_capture: capture layers {ids} name layer(s) {duplicates} more than once: an "
            f"engine captures each layer once, so the draft would get {len(set(ids))} of the "
            f"{len(ids)} hidden states its fc expects. Fix the draft's "
            f"eagle_aux_hidden_state_layer_ids"
        )
    negative = [i for i in ids if i < 0]
    if negative:
        raise error(
            f"eagle_capture: capture layers {ids} hold {negative}: no layer has a negative "
            f"index, so no engine captures it. A draft id of -1 is the embedding output in the "
            f"output convention (capture layer 0), which no SpecForge draft is trained on: fix "
            f"the draft's eagle_aux_hidden_state_layer_ids"
        )
    if num_layers is not None:
        highest = num_layers if final_boundary else num_layers - 1
        outside = [i for i in ids if i > highest]
        if outside:
            last = (
                f", {num_layers} the last layer's output"
                if final_boundary
                else f"; {num_layers}, the last layer's output, is not captured here"
            )
            raise error(
                f"eagle_capture: capture layer(s) {outside} of {ids} are outside 0..{highest} "
                f"(capture layer c is the input of decoder layer c{last}): no engine captures "
                f"them, so the draft would get fewer hidden states than it expects"
            )
    if 0 in ids and not embedding:
        raise error(
            f"eagle_capture: capture layer 0 in {ids} is the embedding output (the input of "
            f"layer 0): no trainer's EAGLE-3 draft is trained on it (a draft id of -1 in the "
            f"output convention, or 0 in the input one), and several engines' loops fail "
            f"there. Fix the draft's eagle_aux_hidden_state_layer_ids"
        )
    if stage is not None:
        start, end = stage
        elsewhere = [
            i
            for i in ids
            if not start <= i < end and not (final_boundary and i == end == num_layers)
        ]
        if elsewhere:
            raise error(
                f"eagle_capture: capture layer(s) {elsewhere} of {ids} are in another pipeline "
                f"stage (this rank runs layers {start}..{end - 1}): the engine drops what "
                f"another stage captures, so the draft would get {len(ids) - len(elsewhere)} "
                f"of {len(ids)} hidden states. Choose capture layers in this stage, or serve "
                f"without pipeline parallelism"
            )
    return sorted(ids)
