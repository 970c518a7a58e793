"""The start-up id check both plugins run on every EAGLE-3 target: the layers the
engine has just set to capture, against the layers the draft was trained on (read
from the draft's exported config in its trainer's convention,
:mod:`eagle_capture.layer_ids.trainers`).

It compares what the engine really set (SGLang's ``layers_to_capture`` after the
model's own ``set_eagle3_layers_to_capture``; the ids vLLM's runner passes to
``set_aux_hidden_state_layers``), so it holds for model classes whose rule the
doctor's table has not read. Outcomes: ``ok``; ``problem`` (the server should not
start: every reading of the ids says the draft gets other layers); ``ambiguous``
(right under one reading, wrong under another: a warning naming
``EAGLE_CAPTURE_ID_CONVENTION``); ``unknown`` (no ids and no trainer default known,
or the draft's config is not visible).
"""

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from eagle_capture.layer_ids.lines import CapturePlanError, load_config, read_draft_ids
from eagle_capture.layer_ids.trainers import CONVENTIONS, recognise
from eagle_capture.layer_ids.validate import CaptureLayerError, check_capture_layers

ID_CONVENTION = "EAGLE_CAPTURE_ID_CONVENTION"  # auto (default) | output | input


@dataclass(frozen=True)
class StartupCheck:
    status: str  # "ok" | "problem" | "ambiguous" | "unknown"
    text: str


def id_convention(env=os.environ) -> str:
    value = env.get(ID_CONVENTION, "auto").strip().lower() or "auto"
    if value not in CONVENTIONS:
        raise ValueError(
            f"{ID_CONVENTION}={env.get(ID_CONVENTION)!r}: expected auto, output or input"
        )
    return value


def find_draft_config(path: Optional[str], revision: Optional[str] = None) -> Optional[dict]:
    """The draft's own ``config.json`` (a local folder, or the Hugging Face cache),
    as its exporter wrote it (the engines' parsed configs drop trainer keys: vLLM
    rebuilds a speculators config); None when it cannot be seen from here."""
    if not path:
        return None
    if not os.path.isdir(path):  # a hub id: the file in the Hugging Face cache, if there
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(path, "config.json", revision=revision)
        except Exception:  # noqa: BLE001 - no hub, or not cached
            path = None
        if not isinstance(path, str):
            return None
    try:
        return load_config(path, "draft config")[0]
    except CapturePlanError as e:
        logging.getLogger("eagle_capture").warning("eagle_capture: %s", e)
        return None


def slot_order_problem(ids) -> Optional[str]:
    """Why ids not in ascending order feed the draft the wrong slot, or None.

    Both engines capture in the layer loop's order, ascending, whatever the
    config's order (SGLang's model loops, vLLM's ``aux_hidden_state_layers``);
    SpecForge's Hugging Face target concatenates ``hidden_states[X + 1]`` in the
    order the config lists the ids. The doctor and both plugins' start-up checks
    ask this one question."""
    if not ids or list(ids) == sorted(ids):
        return None
    moved = [i for i, (a, b) in enumerate(zip(ids, sorted(ids))) if a != b]
    return (
        f"ids {list(ids)} are not in ascending order: the engines capture in layer order "
        f"{sorted(ids)}, so a draft trained with its slots in the config's order (SpecForge's "
        f"Hugging Face target concatenates them so) gets slots {moved} swapped, with no "
        f"error. If the draft was trained on an engine's capture (ascending), write the ids "
        f"sorted, {sorted(ids)}; otherwise no id list fixes it"
    )


def check(
    engine: str,
    captured: Sequence[int],
    num_layers: int,
    draft_config: Optional[dict],
    architecture: str = "",
    fix=None,
    env=os.environ,
) -> StartupCheck:
    """``engine`` ("SGLang" / "vLLM") has set ``captured`` (capture layers: c = the
    input of layer c) on a target of ``num_layers`` layers; is that what the draft
    (``draft_config``, the exported ``config.json``) was trained on? ``fix(expected)``
    says which ids to write for ``expected`` capture layers on this engine."""
    try:  # the shared validation: a layer twice, a negative one, the embedding output
        captured = tuple(check_capture_layers(captured, embedding=False))
    except CaptureLayerError as e:
        return StartupCheck("problem", str(e).replace("eagle_capture: ", "", 1))
    if draft_config is None:
        return StartupCheck(
            "unknown",
            f"{engine} captures layers {list(captured)}; the draft's "
            f"config.json is not visible here: not checked against "
            f"what the draft was trained on",
        )
    convention = id_convention(env)  # a malformed setting is the caller's error
    try:
        draft = read_draft_ids(draft_config)
        provenance = recognise(draft, num_layers, architecture, convention)
    except (CapturePlanError, ValueError) as e:
        return StartupCheck("problem", f"the draft config cannot be read: {e}")
    said = provenance.describe()
    unsorted = slot_order_problem(provenance.ids)
    if unsorted:
        return StartupCheck("problem", f"{said}. {unsorted}")
    known = [r for r in provenance.readings if r.expected is not None]
    if not known:
        return StartupCheck(
            "unknown",
            f"{said}. {engine} captures its defaults "
            f"{list(captured)}: a draft trained on other layers "
            f"serves with collapsed acceptance and no error",
        )
    right = [r for r in known if r.expected == captured]
    if right and len({r.expected for r in known}) == 1:
        return StartupCheck(
            "ok",
            f"{said}. {engine} captures layers {list(captured)}: what the draft was trained on",
        )
    if right:
        wrong = [r for r in known if r.expected != captured]
        return StartupCheck(
            "ambiguous",
            (
                f"{said}. {engine} captures layers {list(captured)}: right if the draft was trained "
                f"in the {right[0].label}, wrong in the "
                + " or ".join(
                    f"{r.label} (it expects {list(r.expected)}"
                    + (f"; write {fix(list(r.expected))}" if fix else "")
                    + ")"
                    for r in wrong
                )
                + f". Set {ID_CONVENTION}=output|input to say which (or check with "
                f"`eagle-capture doctor`)"
            ),
        )
    fixes = (
        "; ".join(f"if trained in the {r.label}: {fix(list(r.expected))}" for r in known)
        if fix
        else ""
    )
    return StartupCheck(
        "problem",
        (
            f"{said}. {engine} captures layers {list(captured)} (inputs of those layers), but the "
            f"draft was trained on "
            + " or ".join(str(list(r.expected)) for r in known)
            + ": expect acceptance to collapse"
            + (f". Fix: {fixes}" if fixes else "")
        ),
    )
