"""vLLM's other EAGLE-3 targets with the plugin's start-up id check, and nothing
else: each class here is vLLM's own class (same name, weights, forward) whose
``set_aux_hidden_state_layers`` -- which vLLM's model runner calls in
``load_model`` with the ids it read from the draft config, before the first
forward -- first checks those ids against what the draft was trained on
(:mod:`eagle_capture.layer_ids.startup`: the draft's own ``config.json``, read in
its trainer's convention). A problem stops the server with the ids to write
(``EAGLE_CAPTURE_ON_PROBLEM=install``: logged as an error, served as is).

The plugin registers them under vLLM's own architecture names (``"module:name"``,
so this module is imported only where such a model is built); the class for an
architecture is made on first use from the entry in vLLM's own registry table.
vLLM's DeepseekV2 / V3 and the other fused families get the same check inside the
fused capture's install (:mod:`eagle_capture.integrations.vllm.install`), with
:func:`check_layer_ids` before it: the shared validation of capture layers.
"""

from __future__ import annotations

import importlib
import os

from eagle_capture.integrations import settings
from eagle_capture.integrations.core.errors import PluginError, WrongCaptureLayers
from eagle_capture.integrations.vllm.plugin import CHECKED_ARCHITECTURES, vllm_module
from eagle_capture.integrations.vllm.plugin import log as _log
from eagle_capture.layer_ids.validate import check_capture_layers, layer_list

__all__ = ["check_draft_ids", "check_layer_ids", "vllm_class", "WrongCaptureLayers"]


def _draft_config(vllm_config):
    """The draft's config.json as its exporter wrote it, else vLLM's parsed one."""
    from eagle_capture.layer_ids.startup import find_draft_config

    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None:
        return None
    config = find_draft_config(getattr(draft, "model", None), getattr(draft, "revision", None))
    if config is None and getattr(draft, "hf_config", None) is not None:
        config = draft.hf_config.to_dict()
    return config


def check_draft_ids(model, layers, vllm_config=None, env=os.environ) -> None:
    """Check the ids vLLM is about to capture (``layers``: id k = the input of layer
    k) for ``model`` against the draft's training; raise :class:`WrongCaptureLayers`
    (policy refuse) or log."""
    from eagle_capture.layer_ids import startup

    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    num_layers = int(config.num_hidden_layers)
    ids = layer_list(layers, error=WrongCaptureLayers)
    # The served architecture (the registry's key), not the class (ours may wrap it).
    archs = getattr(
        getattr(getattr(vllm_config, "model_config", None), "hf_config", None),
        "architectures",
        None,
    ) or [type(model).__name__]
    try:
        verdict = startup.check(
            "vLLM",
            ids,
            num_layers,
            _draft_config(vllm_config),
            archs[0],
            lambda expected: (
                f"eagle_aux_hidden_state_layer_ids = {expected} at the config's top level"
            ),
            env,
        )
    except ValueError as e:
        raise PluginError(f"eagle_capture: {e}") from None
    if verdict.status == "problem":
        text = (
            f"eagle_capture refuses to start this server: the draft would not receive what "
            f"it was trained on (vLLM's own capture, with or without the plugin): "
            f"{verdict.text}. Fix the draft config, or set {settings.ON_PROBLEM}=install to "
            f"serve anyway"
        )
        if settings.on_problem(env) == "refuse":
            raise WrongCaptureLayers(text)
        _log().error(
            "eagle_capture: PROBLEM (%s=install: serving anyway): %s",
            settings.ON_PROBLEM,
            verdict.text,
        )
    elif verdict.status == "ok":
        _log().info("eagle_capture: layer ids: %s", verdict.text)
    else:
        _log().warning("eagle_capture: layer ids %s: %s", verdict.status.upper(), verdict.text)


def check_layer_ids(
    layers, num_layers: int, start_layer: int, end_layer: int, embedding_id: bool = False
) -> list[int]:
    """The sorted captured layers for vLLM's ids (id k = the input of layer k,
    ``num_layers`` the last layer's output) on the last pipeline stage, which runs
    layers ``[start_layer, end_layer)``, or :class:`WrongCaptureLayers` (the shared
    validation, :func:`eagle_capture.layer_ids.validate.check_capture_layers`).
    ``embedding_id``: the family's loop captures id 0 as the embedding output (else
    it fails there)."""
    return check_capture_layers(
        layers,
        num_layers=num_layers,
        final_boundary=True,
        embedding=embedding_id,
        stage=(start_layer, end_layer),
        error=WrongCaptureLayers,
    )


class _IdCheck:
    """vLLM's EAGLE-3 interface with the start-up id check in front."""

    def set_aux_hidden_state_layers(self, layers) -> None:
        check_draft_ids(self, layers)
        super().set_aux_hidden_state_layers(layers)


_MADE: dict[str, type] = {}


def _vllm_entry(name: str) -> tuple[str, str]:
    """(module, class) of vLLM's own entry for architecture or class ``name``."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    if name in _VLLM_MODELS:
        return _VLLM_MODELS[name]
    for arch in CHECKED_ARCHITECTURES:
        module, cls = _VLLM_MODELS.get(arch, (None, None))
        if cls == name:
            return module, cls
    raise AttributeError(name)


def vllm_class(name: str) -> type:
    """vLLM's own class for architecture (or class) ``name``, from its registry table
    (imports only that model's module)."""
    module, cls_name = _vllm_entry(name)
    return getattr(importlib.import_module(vllm_module(module)), cls_name)


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in _MADE:
        base = vllm_class(name)
        cls_name = base.__name__
        # Same name as vLLM's class (its logs and any name check see vLLM's), found here
        # by that name (pickling by reference).
        made = type(
            cls_name,
            (_IdCheck, base),
            {"__module__": __name__, "__qualname__": cls_name, "__doc__": base.__doc__},
        )
        _MADE[name] = _MADE[cls_name] = made
    return _MADE[name]
