"""SGLang's EAGLE-3 id rules as values: the three ways a model class's own
``set_eagle3_layers_to_capture`` turns a draft config's ids into the layers it captures
(capture layer i = the input of layer i; i = num_layers: the final boundary), their words
for the user, and :func:`apply_rule`. Which class applies which rule in which release is
:mod:`.rules` (from the engine facts); the wheels' reader (:mod:`.engine_read`) classifies
a class's method by these rules.
"""

from typing import Optional, Sequence

SHIFT_ALWAYS = "+1"
SHIFT_IF_FIRST_IS_1 = "+1 if ids[0] == 1"
KEEP_FINAL_BOUNDARY = "kept at the final boundary"

RULE_WORDS = {
    SHIFT_ALWAYS: "adds 1 to every id (id X = the output of layer X)",
    SHIFT_IF_FIRST_IS_1: "adds 1 to every id only when ids[0] == 1, else takes the ids as "
    "capture layers (id X = the input of layer X)",
    KEEP_FINAL_BOUNDARY: "takes the ids as capture layers when the largest is num_layers (the "
    "final boundary, captured after the last layer), else adds 1",
}


def apply_rule(rule: str, ids: Optional[Sequence[int]], num_layers: int) -> list[int]:
    """``layers_to_capture`` for the draft config's ``ids`` (None: absent) under ``rule``."""
    if ids is None:
        return [2, num_layers // 2, num_layers - 3]
    ids = list(ids)
    if rule == SHIFT_ALWAYS:
        return [i + 1 for i in ids]
    if rule == SHIFT_IF_FIRST_IS_1:
        return [i + 1 for i in ids] if ids and ids[0] == 1 else ids
    if rule == KEEP_FINAL_BOUNDARY:
        return ids if ids and max(ids) == num_layers else [i + 1 for i in ids]
    raise ValueError(f"unknown id rule {rule!r}")
