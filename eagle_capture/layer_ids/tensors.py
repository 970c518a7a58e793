"""Which tensor each engine line's EAGLE-3 capture holds, measured: the engine's own
model code run on CPU on a tiny random config against transformers'
``hidden_states`` for the same weights (``data/capture_tensors.json``; the
measurement and how it tells the tensors apart: docs/engine_facts.md section 16).

A draft is trained on the residual stream entering a layer (transformers'
``hidden_states[k]``). A line that captures another tensor at the right place (the
layer's normed input, the previous layer's output before the residual add) feeds
every draft wrong inputs with the right ids: no id fixes that.
"""

import functools
import json
import os
from typing import Optional

DATA = os.path.join(os.path.dirname(__file__), "data", "capture_tensors.json")
RESIDUAL = "residual stream"
# A layer's branch output before it is added to the stream (the MLP's, or the norm after it).
PRE_RESIDUAL = "pre-residual output"


@functools.lru_cache(maxsize=None)
def load(path: str = DATA) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def measured(engine: str, release: str, architecture: str) -> Optional[str]:
    """What ``release``'s capture holds for ``architecture`` ("residual stream",
    "normed input", "pre-residual output", "other"), or None: not measured."""
    return load().get(engine, {}).get(release, {}).get(architecture)


def wrong(engine: str, releases, architecture: str) -> list[tuple[str, str]]:
    """(release, tensor) for each release measured to capture another tensor."""
    out = []
    for release in releases:
        tensor = measured(engine, release, architecture)
        if tensor is not None and tensor != RESIDUAL:
            out.append((release, tensor))
    return out


def right_releases(engine: str, architecture: str) -> list[str]:
    """The releases measured to capture the residual stream for ``architecture``."""
    return [r for r, per in load().get(engine, {}).items() if per.get(architecture) == RESIDUAL]
