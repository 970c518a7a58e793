"""One adapter per SGLang model family (:class:`base.Family`); a new family is one
file here and its tests. :func:`family_of` picks the adapter by SGLang's class."""

from typing import Optional

import torch

from eagle_capture.integrations.sglang.families import (
    deepseek_v2,
    glm4_moe,
    gpt_oss,
    llama,
    minimax_m2,
    qwen_moe,
)
from eagle_capture.integrations.sglang.families.base import Family, UnknownFamily

__all__ = ["FAMILIES", "FUSED_ARCHITECTURES", "Family", "UnknownFamily", "family_of"]

FAMILIES: tuple = (
    deepseek_v2.FAMILY,
    llama.FAMILY,
    qwen_moe.FAMILY,
    gpt_oss.FAMILY,
    glm4_moe.FAMILY,
    minimax_m2.FAMILY,
)

# Every SGLang class the fused capture installs on.
FUSED_ARCHITECTURES: tuple = tuple(a for f in FAMILIES for a in f.architectures)


def family_of(model: torch.nn.Module, *, required: bool = True) -> Optional[Family]:
    """The adapter for SGLang's ``model`` (by its class name); None, or
    :class:`UnknownFamily` when ``required``, for a class none was read against."""
    name = type(model).__name__
    for family in FAMILIES:
        if name in family.architectures:
            return family
    if required:
        raise UnknownFamily(
            f"eagle_capture: no fused capture for SGLang's {name} (families: "
            f"{', '.join(FUSED_ARCHITECTURES)}); SGLang's own capture stays"
        )
    return None
